//! How a device reaches its server and who it is: the options, its certificate, the socket hook
//! and the TLS config.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anchorage_shared::frame::DEFAULT_MAX_FRAME;
use rustls::pki_types::CertificateDer;

use super::{ALPN, Backoff};
use crate::metrics::ClientMetrics;
use crate::store::ClientStore;

/// How to reach the server and who this client is.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    pub server: SocketAddr,
    /// Other addresses of the federation (a tier's other relays): after a failed
    /// attempt or a lost connection the device tries the next, round robin ([`ClientOptions::fail_over`]).
    pub fallbacks: Vec<SocketAddr>,
    /// On a fallback, how long the device stays before it goes back to its own address (the
    /// first `server`) at the next moment it holds nothing unacked ([`ClientOptions::due_home`]):
    /// a restarted relay gets its devices back.
    pub home_after: Duration,
    /// The device's own address and since when it has been on a fallback; `None` at home.
    away: Option<(SocketAddr, Instant)>,
    /// Name in the server's certificate.
    pub server_name: String,
    /// The only certificate this client trusts: the project CA's (`ca.der`), or, against a
    /// development server (`insecure_dev`), that server's own certificate.
    pub server_cert: CertificateDer<'static>,
    /// This device's certificate and key from the project CA (mutual TLS); the server takes the
    /// device's id from it. `None` only against a development server.
    pub client_cert: Option<Arc<ClientCert>>,
    pub client_id: String,
    /// Backend actually in use, announced in the hello.
    pub backend: String,
    pub memory_mb: u32,
    pub store: Option<ClientStore>,
    pub backoff: Backoff,
    /// QUIC keep-alive and session heartbeat interval: bounds how long a device takes to see a
    /// restarted server's stateless reset (it only comes in answer to a packet).
    pub keep_alive: Duration,
    /// The connection is dropped after this long without a packet from the server.
    pub idle_timeout: Duration,
    /// A connection attempt that has not completed by then counts as failed (and backs off): a
    /// server that is down does not answer, and the attempt would otherwise wait out the idle
    /// timeout.
    pub connect_timeout: Duration,
    pub max_frame_bytes: usize,
    /// Seed of the backoff jitter.
    pub seed: u64,
    /// Set to `true` to leave gracefully (goodbye, close); e.g. on SIGTERM.
    pub stop: Option<tokio::sync::watch::Receiver<bool>>,
    /// Wraps the client's UDP socket before QUIC uses it (the simulator's link model). `None`:
    /// plain UDP.
    pub socket_wrapper: Option<SocketWrapper>,
    /// An endpoint that this process's devices share ([`shared_endpoint`](crate::transport::shared_endpoint): the simulator's and a
    /// fleet worker's); ignored when `socket_wrapper` asks for a socket of the device's
    /// own. `None`: the device binds its own.
    pub shared_endpoint: Option<quinn::Endpoint>,
    /// Uploads are resumable transfers ([`send_resumable`](crate::transport::send_resumable)); `false`: one frame on a uni stream,
    /// sent again from the start after an interruption (the baseline the simulator measures
    /// against).
    pub resume_uploads: bool,
    /// Large broadcasts come as resumable transfers (`crate::broadcasts`; the device offers
    /// `anchorage/1+resumable-broadcasts` in the handshake): after a lost connection the device
    /// receives only what it does not hold. `false`: whole on a uni stream, received again from
    /// the start (as from a server that does not offer it).
    pub resume_broadcasts: bool,
    /// Secure aggregation (`secure_aggregation` in client.toml): the update is sent
    /// only masked, with keys from the operating system's entropy.
    pub secure_aggregation: bool,
    /// When this device may train (`[eligibility]` of client.toml): an invited device
    /// that may not declines the round with its reason. Empty: always trains.
    pub eligibility: crate::eligibility::Eligibility,
    /// Where the device reads itself (eligibility, and the condition its cost records carry):
    /// `/` on a device, a fake tree in tests. `None` (the default, and the simulator's devices,
    /// whose host is not the device): nothing is read, every device is eligible, and cost
    /// records carry no condition.
    pub sys_root: Option<crate::eligibility::SysRoot>,
    /// Streams get send priorities ([`Priority`](crate::transport::Priority)): the control stream first, then an update
    /// without parameter blocks, then one with blocks. `false`: every stream at quinn's default,
    /// taking turns (the baseline `tests/priorities.rs` measures against).
    pub stream_priorities: bool,
    /// What the shell counts (transfers refused and resumed, readings refused, rounds,
    /// connections): a fresh set per options; `anchorage-client` writes it as a Prometheus
    /// textfile (`[metrics]` of client.toml, [`crate::metrics`]).
    pub metrics: Arc<ClientMetrics>,
}

/// A device's certificate chain and private key.
#[derive(Debug)]
pub struct ClientCert {
    pub chain: Vec<CertificateDer<'static>>,
    pub key: rustls::pki_types::PrivateKeyDer<'static>,
}

/// The link-shaping hook: turns the bound UDP socket into the socket quinn drives.
#[derive(Clone)]
pub struct SocketWrapper(
    pub Arc<dyn Fn(std::net::UdpSocket) -> std::io::Result<Arc<dyn quinn::AsyncUdpSocket>> + Send + Sync>,
);

impl std::fmt::Debug for SocketWrapper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SocketWrapper")
    }
}

impl ClientOptions {
    /// The next address to try after a failed attempt or a lost connection: the first fallback,
    /// with the current server last in line. Without fallbacks, the server again.
    pub fn fail_over(&mut self) {
        if self.fallbacks.is_empty() {
            return;
        }
        let next = self.fallbacks.remove(0);
        let left = std::mem::replace(&mut self.server, next);
        self.fallbacks.push(left);
        match self.away {
            None => self.away = Some((left, Instant::now())),
            Some((home, _)) if home == self.server => self.away = None,
            Some(_) => {}
        }
        tracing::info!(client = %self.client_id, server = %self.server, "failing over to the next address");
    }

    /// Whether the device has been on a fallback for `home_after`: time to go back to its own
    /// address ([`ClientOptions::go_home`]).
    pub fn due_home(&self) -> bool {
        self.away.is_some_and(|(_, since)| since.elapsed() >= self.home_after)
    }

    /// Back to the device's own address, the fallbacks in their round-robin order again. If it
    /// cannot be reached, the next failover starts the wait of `home_after` again.
    pub fn go_home(&mut self) {
        let Some((home, _)) = self.away else { return };
        for _ in 0..=self.fallbacks.len() {
            if self.server == home {
                break;
            }
            self.fail_over();
        }
        tracing::info!(client = %self.client_id, server = %self.server, "back to its own address");
    }

    pub fn new(server: SocketAddr, server_cert: CertificateDer<'static>, client_id: impl Into<String>) -> Self {
        Self {
            server,
            fallbacks: Vec::new(),
            home_after: Duration::from_secs(60),
            away: None,
            server_name: "localhost".into(),
            server_cert,
            client_cert: None,
            client_id: client_id.into(),
            backend: "cpu".into(),
            memory_mb: 1024,
            store: None,
            backoff: Backoff::default(),
            keep_alive: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(15),
            connect_timeout: Duration::from_secs(2),
            max_frame_bytes: DEFAULT_MAX_FRAME,
            seed: 0,
            stop: None,
            socket_wrapper: None,
            shared_endpoint: None,
            resume_uploads: true,
            resume_broadcasts: true,
            secure_aggregation: false,
            eligibility: Default::default(),
            sys_root: Default::default(),
            stream_priorities: true,
            metrics: Arc::default(),
        }
    }
}

/// Pinned-certificate rustls config (ring provider only, TLS 1.3; `anchorage_pki::tls`).
pub fn client_crypto(
    server_cert: &CertificateDer<'static>,
    client_cert: Option<&ClientCert>,
) -> anyhow::Result<rustls::ClientConfig> {
    anchorage_pki::tls::client_config(server_cert, client_cert.map(|c| (c.chain.as_slice(), &c.key)), &[ALPN])
}
