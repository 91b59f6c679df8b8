//! The tokio + quinn shell around the [`Session`]: connects with a pinned server certificate,
//! reconnects with exponential backoff and jitter, runs training off the async threads, uploads
//! on uni streams, and measures what the session's cost records need (wire bytes from QUIC's
//! statistics, times on the host's clock), reporting each record the session completes to the
//! server's ledger until the server confirms it.

use anchorage_shared::MetricKey;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anchorage_shared::frame::{DEFAULT_MAX_FRAME, encode_frame};
use anchorage_shared::io::{FrameIoError, read_frame, write_frame};
use anchorage_shared::ledger::CostRecord;
pub use anchorage_shared::priority::Priority;
use anchorage_shared::protocol::{Broadcast, Capabilities, Goodbye, Heartbeat, Message, RefusalReason, Update};
use anchorage_shared::rng::Rng;
use anchorage_shared::transfer;
use anyhow::Context;
use rustls::pki_types::CertificateDer;
use tokio::sync::mpsc;

use crate::eligibility::Readings;
use crate::methods::ClientMethod;
use crate::metrics::ClientMetrics;
use crate::session::{Session, SessionAction, UploadMeasure};
use crate::store::ClientStore;

mod endpoint;
pub use endpoint::{DeviceEndpoint, endpoint, shared_endpoint};

/// ALPN protocol id of Anchorage v1 (the server's `tls::ALPN`).
pub const ALPN: &[u8] = b"anchorage/1";

/// Exponential backoff with full jitter between reconnect attempts.
#[derive(Debug, Clone)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    /// Give up after this many failed attempts in a row (`None`: never).
    pub max_attempts: Option<u32>,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { initial: Duration::from_millis(200), max: Duration::from_secs(30), max_attempts: None }
    }
}

impl Backoff {
    /// Delay before attempt `attempt` (1-based): uniform in [d/2, d] with d = min(max, initial·2^(attempt−1))
    /// ("equal jitter"). Ours, in three lines, rather than a crate's: `backoff` is unmaintained
    /// (RUSTSEC-2025-0012) and `backon` is a retry executor around futures, where the transport
    /// needs only the next delay, drawn from its seeded generator so that tests can repeat it.
    pub fn delay(&self, attempt: u32, rng: &mut Rng) -> Duration {
        let exp = self.initial.saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
        let d = exp.min(self.max);
        d.mul_f64(0.5 + 0.5 * rng.f64())
    }
}

/// How to reach the server and who this client is.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    pub server: SocketAddr,
    /// Other addresses of the federation (a tier's other relays): after a failed
    /// attempt or a lost connection the device tries the next, round robin ([`ClientOptions::fail_over`]).
    pub fallbacks: Vec<SocketAddr>,
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
    /// An endpoint that this process's devices share ([`shared_endpoint`]: the simulator's and a
    /// fleet worker's); ignored when `socket_wrapper` asks for a socket of the device's
    /// own. `None`: the device binds its own.
    pub shared_endpoint: Option<quinn::Endpoint>,
    /// Uploads are resumable transfers ([`send_resumable`]); `false`: one frame on a uni stream,
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
    /// Streams get send priorities ([`Priority`]): the control stream first, then an update
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

/// Whether a connection failed because TLS did not accept a certificate (ours or the server's):
/// QUIC's crypto error codes, 0x100–0x1ff, carry a TLS alert.
pub fn tls_failure(e: &quinn::ConnectionError) -> bool {
    let crypto = |code: u64| (0x100..=0x1ff).contains(&code);
    match e {
        quinn::ConnectionError::TransportError(t) => crypto(u64::from(t.code)),
        quinn::ConnectionError::ConnectionClosed(c) => crypto(u64::from(c.error_code)),
        _ => false,
    }
}

/// Exit status of `anchorage-client` when the server refused the device for good
/// ([`Refused`]): sysexits' `EX_NOPERM`. The systemd unit does not restart on it
/// (`RestartPreventExitStatus=77`).
pub const EXIT_REFUSED: u8 = 77;

/// Why the server refused this device for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// The device's certificate is on the project's revocation list (TLS alert
    /// certificate_revoked, or the server's refusal "certificate revoked").
    Revoked,
    /// The certificate is not from the server's project CA (unknown_ca).
    UnknownCa,
    /// The certificate has expired, or is not valid yet by the server's clock (certificate_expired).
    Expired,
    /// The server does not accept the certificate: it names no device, does not parse, is not a
    /// device certificate, or its signature is wrong (bad_certificate, unsupported_certificate,
    /// certificate_unknown, access_denied, decrypt_error).
    BadCertificate,
    /// The device showed no certificate to a server that requires one (certificate_required).
    NoCertificate,
    /// The server's refusal `NotEnrolled`: it does not take this device (another id in the hello
    /// than in the certificate, or a certificate revoked moments ago).
    NotEnrolled,
    /// The server speaks another protocol version or runs another method (`VersionMismatch`,
    /// `UnknownMethod`, or no common ALPN).
    Incompatible,
}

impl RefusalKind {
    /// The kind a TLS alert from the server means; `None` for an alert that a retry may clear.
    pub fn of_alert(alert: u8) -> Option<Self> {
        Some(match alert {
            44 => Self::Revoked,
            48 => Self::UnknownCa,
            45 => Self::Expired,
            42 | 43 | 46 | 49 | 51 => Self::BadCertificate,
            116 => Self::NoCertificate,
            120 => Self::Incompatible,
            _ => return None,
        })
    }

    /// What the operator does about it.
    fn advice(self, id: &str) -> String {
        match self {
            Self::Revoked => format!(
                "the certificate of `{id}` is revoked. If this device should rejoin, issue it a new certificate \
                 (`anchorage ca issue client {id} --dir <ca> --out <site>`, or re-provision it) and copy cert.der and \
                 key.der to it; otherwise uninstall it"
            ),
            Self::UnknownCa => format!(
                "the server's project CA did not sign the certificate of `{id}`: the device holds another project's \
                 or an old folder. Re-provision it from the server's CA (`anchorage provision`, or \
                 `anchorage ca issue client {id}`) and copy its folder to the device"
            ),
            Self::Expired => format!(
                "the certificate of `{id}` has expired (or is not valid yet by the server's clock): \
                 `anchorage ca renew {id} --dir <ca> --out <site>`, then copy cert.der and key.der to the device"
            ),
            Self::BadCertificate => format!(
                "the server does not accept the certificate of `{id}` (no device id in it, unreadable, or not a \
                 device certificate): re-provision the device from the server's CA"
            ),
            Self::NoCertificate => "the server requires a device certificate: set `cert` and `key` in client.toml \
                 to this device's files from `anchorage provision`"
                .to_string(),
            Self::NotEnrolled => format!(
                "the server does not take `{id}`: check that client_id is the id in cert.der, and that the \
                 certificate is not revoked (`anchorage ca list`)"
            ),
            Self::Incompatible => "this client and the server do not speak the same protocol version or method: \
                 install the server's release of anchorage-client, or fix `method` in client.toml"
                .to_string(),
        }
    }
}

/// The server refused this device for good: retrying cannot help until an operator acts, so the
/// client stops (`anchorage-client` exits with [`EXIT_REFUSED`]).
#[derive(Debug, Clone, thiserror::Error)]
#[error("the server {server} refused `{client}` for good ({kind:?}: {detail}); {advice}", advice = kind.advice(client))]
pub struct Refused {
    pub client: String,
    pub server: SocketAddr,
    pub kind: RefusalKind,
    /// What the server said (the TLS alert, or its refusal's detail).
    pub detail: String,
}

/// Whether a closed connection means the server refused this device for good: a TLS alert
/// the *server* sent about this device's certificate (revoked, unknown CA, expired, bad, none,
/// no common protocol). Alerts of this client's own TLS (it did not trust the server's
/// certificate) are not: the server's side may be fixed without touching the device, so those
/// are retried with backoff, as are timeouts, resets and a server that is down.
pub fn definite_refusal(e: &quinn::ConnectionError) -> Option<(RefusalKind, String)> {
    let quinn::ConnectionError::ConnectionClosed(c) = e else { return None };
    let code = u64::from(c.error_code);
    if !(0x100..=0x1ff).contains(&code) {
        return None;
    }
    let alert = (code - 0x100) as u8;
    let kind = RefusalKind::of_alert(alert)?;
    Some((kind, format!("TLS alert {alert} ({:?}): {e}", rustls::AlertDescription::from(alert))))
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
        self.fallbacks.push(std::mem::replace(&mut self.server, next));
        tracing::info!(client = %self.client_id, server = %self.server, "failing over to the next address");
    }

    pub fn new(server: SocketAddr, server_cert: CertificateDer<'static>, client_id: impl Into<String>) -> Self {
        Self {
            server,
            fallbacks: Vec::new(),
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

/// What a running client reports to its owner (the simulator, a metrics exporter).
#[derive(Debug, Clone)]
pub enum ClientEvent {
    Connected,
    /// A round's broadcast arrived; training starts.
    RoundStarted {
        round: u64,
    },
    Disconnected {
        reason: String,
    },
    /// The server acknowledged this client's update of `round` (`aggregated: false`: it came
    /// after the round closed). Sent for every ack, before the round's cost record is complete.
    Acked {
        round: u64,
        aggregated: bool,
    },
    /// The device declined `round`'s invitation: its `[eligibility]` says it should not train now.
    Declined {
        round: u64,
        reason: anchorage_shared::ledger::DeclineReason,
    },
    /// A round's update was acknowledged; its cost record is complete.
    RoundDone {
        cost: CostRecord,
        aggregated: bool,
    },
    Finished {
        reason: String,
    },
}

/// Pinned-certificate rustls config (ring provider only, TLS 1.3; `anchorage_pki::tls`).
pub fn client_crypto(
    server_cert: &CertificateDer<'static>,
    client_cert: Option<&ClientCert>,
) -> anyhow::Result<rustls::ClientConfig> {
    anchorage_pki::tls::client_config(server_cert, client_cert.map(|c| (c.chain.as_slice(), &c.key)), &[ALPN])
}

pub(crate) enum Inbound {
    Message { msg: Message, wire_bytes: u64 },
    Closed(String),
}

/// A round's one line in the client's log, once its cost record is complete: e.g. `round 7:
/// trained 1.2 s on 750 samples, local accuracy 84.1%, uploaded 1.02 MiB in 0.3 s, acked`.
/// `trained`: the samples and local accuracy (a fraction) of an update trained in this process
/// (`None`: a saved update was resent).
fn round_line(r: &CostRecord, trained: Option<(u64, Option<f64>)>) -> String {
    let trained = match trained {
        Some((samples, accuracy)) => {
            let accuracy = accuracy.map_or_else(String::new, |a| format!(", local accuracy {:.1}%", a * 100.0));
            format!("trained {:.1} s on {samples} samples{accuracy}", r.compute_seconds)
        }
        None => "resent the saved update".to_string(),
    };
    let mib = r.wire_up as f64 / f64::from(1u32 << 20);
    let acked = if r.straggler { "acked late (after the round closed; not aggregated)" } else { "acked" };
    format!("round {}: {trained}, uploaded {mib:.2} MiB in {:.1} s, {acked}", r.round, r.transfer_seconds)
}

/// Gives the method the device state saved before a restart. A state file that cannot be read
/// back (the store sets it aside) or that the method refuses (another method or model; set aside
/// here) is reported with a warning and the method starts fresh; an unreadable disk is an error.
fn restore_device_state(store: &ClientStore, method: &mut dyn ClientMethod, client: &str) -> anyhow::Result<()> {
    let Some(blocks) = store.load_device_state().context("loading the device state")? else { return Ok(()) };
    match method.restore_device_state(&blocks) {
        Ok(()) => tracing::info!(client, blocks = blocks.len(), "device state restored"),
        Err(e) => {
            store
                .set_aside_device_state(&format!("the method refused it: {e}"))
                .context("setting the refused device state aside")?;
            tracing::warn!(client, "starting from a fresh device state");
        }
    }
    Ok(())
}

/// Failed connection attempts in a row, for the backoff. A connection that came up resets the
/// count, so after losing it the first retry waits only the initial delay.
#[derive(Debug, Default)]
struct Failures(u32);

impl Failures {
    /// A connection came up.
    fn connected(&mut self) {
        self.0 = 0;
    }

    /// An attempt failed or a connection was lost: the new count, the attempt number to pass to
    /// [`Backoff::delay`].
    fn failed(&mut self) -> u32 {
        self.0 = self.0.saturating_add(1);
        self.0
    }
}

/// Saves the method's device state after a trained round; a failure is logged (the round's
/// update still goes out, and the previous state file stays whole).
fn save_device_state(store: &ClientStore, method: &dyn ClientMethod, round: u64) {
    let saved = method.device_state().map_err(|e| e.to_string()).and_then(|blocks| {
        if blocks.is_empty() { Ok(()) } else { store.save_device_state(&blocks).map_err(|e| e.to_string()) }
    });
    if let Err(e) = saved {
        tracing::warn!(round, error = %e, "could not save the device state");
    }
}

/// Runs the client until the server says goodbye (returns the reason) or refuses it for good
/// (the error is a [`Refused`]: `anchorage-client` exits with [`EXIT_REFUSED`]). Failures a retry
/// may clear (no answer, a reset, a connection closed before the welcome) back off and retry.
pub async fn run(
    options: ClientOptions,
    method: Box<dyn ClientMethod>,
    events: Option<mpsc::UnboundedSender<ClientEvent>>,
) -> anyhow::Result<String> {
    let (trained_tx, mut trained) = mpsc::unbounded_channel();
    let (uploaded_tx, mut uploaded) = mpsc::unbounded_channel();
    let mut stop = options.stop.clone();
    let mut client = Client::new(options, method, events, trained_tx, uploaded_tx)?;
    loop {
        let (conn, control, control_recv) = match client.connect(&mut stop).await? {
            Connected::Up(conn, control, control_recv) => (conn, control, control_recv),
            Connected::Stopped => return Ok(client.stopped_unconnected()),
            Connected::Refused(refused) => return Err(client.refused(refused)),
        };
        let ended = client.serve(conn, control, control_recv, &mut stop, &mut trained, &mut uploaded).await?;
        client.options.metrics.disconnected(matches!(ended, Ended::Lost(_)));
        let reason = match ended {
            Ended::Exit(reason) => return Ok(reason),
            Ended::Refused(refused) => return Err(client.refused(refused)),
            Ended::Lost(reason) => reason,
        };
        client.session.disconnected();
        client.options.fail_over();
        client.emit(ClientEvent::Disconnected { reason: reason.clone() });
        // A connection the server welcomed reset the count, so the first retry comes after the
        // initial delay; one that ended before its welcome (the server closed it at once) backs
        // off further, like a failed attempt.
        let attempt = client.failures.failed();
        let delay = client.options.backoff.delay(attempt, &mut client.rng);
        tracing::info!(
            client = %client.options.client_id,
            %reason,
            attempt,
            delay_s = delay.as_secs_f64(),
            "disconnected (transient); reconnecting in {}",
            human(delay)
        );
        if sleep_or_stop(delay, &mut stop).await {
            return Ok(client.stopped_unconnected());
        }
    }
}

/// What [`Client::connect`] came to.
enum Connected {
    /// A connection and its control stream.
    Up(quinn::Connection, quinn::SendStream, quinn::RecvStream),
    /// The stop signal came first.
    Stopped,
    /// The server refused this device for good.
    Refused(Refused),
}

/// A trained round's result, the device's compute time and what it read of itself right after
/// (the condition its cost record carries), from the training thread.
type Trained = (u64, Result<(Update, Duration, Option<Readings>), String>);
/// An upload's round and what it took, from its task.
type Uploaded = (u64, UploadMeasure);

/// How a connection ended: lost (reconnect), the client's exit with its reason, or the server's
/// refusal for good.
enum Ended {
    Lost(String),
    Exit(String),
    Refused(Refused),
}

/// One client's life across its connections: the session, the method, the cost records to
/// confirm, and where trainings and uploads report back.
struct Client {
    options: ClientOptions,
    session: Session,
    /// The session's clock: times passed to it are since this instant.
    epoch: Instant,
    method: Arc<Mutex<Box<dyn ClientMethod>>>,
    endpoint: DeviceEndpoint,
    rng: Rng,
    trained: mpsc::UnboundedSender<Trained>,
    uploaded: mpsc::UnboundedSender<Uploaded>,
    /// Rounds trained in this process, for their log line: the samples and the local accuracy.
    trained_here: HashMap<u64, (u64, Option<f64>)>,
    /// What the device read of itself right after training each round, for the round's record.
    condition: HashMap<u64, Readings>,
    /// Cost records sent and not yet confirmed by the server's ledger (`CostAck`): resent after
    /// every welcome, so a server that died before committing one still gets it. At most
    /// [`UNCONFIRMED_COSTS`], the oldest dropped first (the server keeps invitations that long).
    unconfirmed: BTreeMap<u64, CostRecord>,
    /// The upload task of each round on the current connection: the session asks to resend a
    /// pending update after a reconnect and again when the round's broadcast comes back, and a
    /// second transfer of the same update while the first is still going would send it twice.
    uploading: HashMap<u64, tokio::task::AbortHandle>,
    /// The part of a broadcast that a lost connection left, for the next one to resume.
    held_broadcast: Arc<Mutex<crate::broadcasts::HeldBroadcast>>,
    failures: Failures,
    events: Option<mpsc::UnboundedSender<ClientEvent>>,
}

/// Unconfirmed cost records a client keeps for resending (the server checks a record against
/// its invitations of the last 8 rounds).
const UNCONFIRMED_COSTS: usize = 8;

impl Client {
    /// The session from the store's unacknowledged update and the method's saved device state.
    fn new(
        options: ClientOptions,
        mut method: Box<dyn ClientMethod>,
        events: Option<mpsc::UnboundedSender<ClientEvent>>,
        trained: mpsc::UnboundedSender<Trained>,
        uploaded: mpsc::UnboundedSender<Uploaded>,
    ) -> anyhow::Result<Self> {
        let capabilities = Capabilities {
            backend: options.backend.clone(),
            memory_mb: options.memory_mb,
            methods: [method.name()].iter().filter_map(|m| heapless::String::try_from(*m).ok()).collect(),
        };
        // A corrupt file is set aside by the store and reads as none: not resent, no crash loop.
        let pending = match &options.store {
            Some(store) => store.load_pending().context("loading the unacknowledged update")?,
            None => None,
        };
        if let Some(store) = &options.store {
            restore_device_state(store, method.as_mut(), &options.client_id)?;
        }
        let mut session = Session::new(options.client_id.clone(), capabilities, method.num_samples(), pending);
        if options.secure_aggregation {
            let mut entropy = [0u8; 32];
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut entropy)
                .map_err(|_| anyhow::anyhow!("the operating system gave no entropy for secure aggregation"))?;
            session = session.with_secure_aggregation(entropy);
        }
        Ok(Self {
            endpoint: DeviceEndpoint::new(&options)?,
            rng: Rng::derive(options.seed, 0xBAC0FF),
            options,
            session,
            epoch: Instant::now(),
            method: Arc::new(Mutex::new(method)),
            trained,
            uploaded,
            trained_here: HashMap::new(),
            condition: HashMap::new(),
            unconfirmed: BTreeMap::new(),
            uploading: HashMap::new(),
            held_broadcast: Arc::default(),
            failures: Failures::default(),
            events,
        })
    }

    /// Now on the session's clock.
    fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    fn emit(&self, e: ClientEvent) {
        if let Some(tx) = &self.events {
            let _ = tx.send(e);
        }
    }

    /// The server refused this device for good: the events hear that it finished, the endpoint
    /// closes, and the refusal becomes the client's error.
    fn refused(&self, refused: Refused) -> anyhow::Error {
        self.endpoint.close(b"refused");
        self.emit(ClientEvent::Finished { reason: format!("refused: {:?}: {}", refused.kind, refused.detail) });
        anyhow::Error::new(refused)
    }

    fn refusal(&self, kind: RefusalKind, detail: String) -> Refused {
        Refused { client: self.options.client_id.clone(), server: self.options.server, kind, detail }
    }

    /// Leaving on the stop signal with no connection to say goodbye on.
    fn stopped_unconnected(&self) -> String {
        self.endpoint.close(b"stopping");
        tracing::info!(client = %self.options.client_id, "stopped while not connected");
        self.emit(ClientEvent::Finished { reason: "stopped".into() });
        "stopped".to_string()
    }

    /// A connection and its control stream, after as many attempts (with backoff) as it takes;
    /// or the stop signal, or the server's refusal for good.
    async fn connect(&mut self, stop: &mut Option<tokio::sync::watch::Receiver<bool>>) -> anyhow::Result<Connected> {
        loop {
            // The stop signal is watched while connecting and backing off too: a client whose
            // server is unreachable must still leave at once on SIGTERM. A server that is down
            // does not answer at all: without the connect timeout the attempt would wait out the
            // whole idle timeout.
            let options = &self.options;
            let connecting = self.endpoint.connect(options)?;
            let attempt = async {
                let conn = connecting.await.map_err(|e| match definite_refusal(&e) {
                    Some(refusal) => Err(refusal),
                    None => {
                        if tls_failure(&e) {
                            tls_error(options, &e);
                        }
                        Ok(e.to_string())
                    }
                })?;
                // Fails only if the connection is already gone: a failed attempt, not a fatal error,
                // unless the server's verdict on this device's certificate closed it (it comes
                // right after the handshake's last flight).
                let streams = conn.open_bi().await.map_err(|e| match definite_refusal(&e) {
                    Some(refusal) => Err(refusal),
                    None => Ok(format!("opening the control stream: {e}")),
                })?;
                Ok::<_, Result<String, (RefusalKind, String)>>((conn, streams))
            };
            let connected = tokio::select! {
                c = tokio::time::timeout(options.connect_timeout, attempt) => c
                    .unwrap_or_else(|_| Err(Ok(format!("no answer within {:?}", options.connect_timeout)))),
                _ = stopped(stop) => return Ok(Connected::Stopped),
            };
            self.options.metrics.connect_attempt(connected.is_ok());
            match connected {
                Ok((conn, (control, control_recv))) => {
                    prioritise(&control, Priority::Control.when(self.options.stream_priorities));
                    // The backoff's count starts again at the server's welcome, not here: a
                    // server that closes every connection at once is not reached.
                    self.emit(ClientEvent::Connected);
                    return Ok(Connected::Up(conn, control, control_recv));
                }
                Err(Err((kind, detail))) => return Ok(Connected::Refused(self.refusal(kind, detail))),
                Err(Ok(e)) => {
                    let failures = self.failures.failed();
                    self.options.fail_over();
                    if self.options.backoff.max_attempts.is_some_and(|m| failures >= m) {
                        anyhow::bail!("could not reach {} after {failures} attempts: {e}", self.options.server);
                    }
                    let delay = self.options.backoff.delay(failures, &mut self.rng);
                    tracing::info!(
                        client = %self.options.client_id,
                        server = %self.options.server,
                        error = %e,
                        attempt = failures,
                        delay_s = delay.as_secs_f64(),
                        "connect failed (transient: the server may be down, restarting or unreachable); \
                         retrying in {}, backing off up to {}",
                        human(delay),
                        human(self.options.backoff.max)
                    );
                    if sleep_or_stop(delay, stop).await {
                        return Ok(Connected::Stopped);
                    }
                }
            }
        }
    }

    /// One connection: the session's actions out, the server's messages, trainings and uploads
    /// in, heartbeats, until the connection ends.
    async fn serve(
        &mut self,
        conn: quinn::Connection,
        mut control: quinn::SendStream,
        control_recv: quinn::RecvStream,
        stop: &mut Option<tokio::sync::watch::Receiver<bool>>,
        trained: &mut mpsc::UnboundedReceiver<Trained>,
        uploaded: &mut mpsc::UnboundedReceiver<Uploaded>,
    ) -> anyhow::Result<Ended> {
        let max_frame = self.options.max_frame_bytes;
        let (in_tx, mut inbound) = mpsc::unbounded_channel();
        // Tasks of this connection die with it (and with this future, if it is aborted).
        let mut tasks = tokio::task::JoinSet::new();
        let mark = self.read(&conn, control_recv, in_tx, &mut tasks);
        self.uploading.clear();
        self.session.connected();
        let mut heartbeat = tokio::time::interval(self.options.keep_alive);
        let mut seq = 0u64;
        let ended = 'conn: loop {
            while let Some(action) = self.session.poll_action() {
                if let Some(ended) = self.act(action, &conn, &mut control, &mut tasks).await? {
                    break 'conn ended;
                }
            }
            tokio::select! {
                message = inbound.recv() => match message {
                    Some(Inbound::Message { msg, wire_bytes }) => self.on_message(msg, wire_bytes, &mut control).await,
                    Some(Inbound::Closed(reason)) => break 'conn Ended::Lost(reason),
                    None => break 'conn Ended::Lost("connection readers ended".into()),
                },
                Some((round, result)) = trained.recv() => self.on_trained(round, result),
                Some((round, measure)) = uploaded.recv() => self.session.uploaded(self.now(), round, measure),
                _ = heartbeat.tick() => {
                    seq += 1;
                    let frame = encode_frame(&Message::Heartbeat(Heartbeat { seq }), max_frame)?;
                    if let Err(e) = write_frame(&mut control, &frame).await {
                        break 'conn Ended::Lost(format!("control stream: {e}"));
                    }
                }
                reason = conn.closed() => {
                    if tls_failure(&reason) && definite_refusal(&reason).is_none() {
                        tls_error(&self.options, &reason);
                    }
                    break 'conn Ended::Lost(reason.to_string())
                }
                _ = stopped(stop) => {
                    let frame = encode_frame(&Message::Goodbye(Goodbye { reason: "client stopping".into() }), max_frame)?;
                    let _ = write_frame(&mut control, &frame).await;
                    let _ = control.finish();
                    conn.close(quinn::VarInt::from_u32(0), b"stopping");
                    self.endpoint.wait_idle(Duration::from_secs(2)).await;
                    self.emit(ClientEvent::Finished { reason: "stopped".into() });
                    break 'conn Ended::Exit("stopped".into());
                }
            }
        };
        tasks.abort_all();
        self.held_broadcast.lock().unwrap_or_else(|p| p.into_inner()).connection_lost(mark.since(&conn));
        // However the loss showed first (a failed read or write, or the close itself), a close
        // with the server's TLS alert about this device's certificate is a refusal for good: the
        // server accepts the handshake's last flight only after checking the certificate.
        if let Ended::Lost(_) = &ended
            && let Some((kind, detail)) = conn.close_reason().as_ref().and_then(definite_refusal)
        {
            return Ok(Ended::Refused(self.refusal(kind, detail)));
        }
        Ok(ended)
    }

    /// A training's result, from its thread: kept for the round's log line and cost record
    /// (with what the device read of itself right after), and handed to the session.
    fn on_trained(&mut self, round: u64, result: Result<(Update, Duration, Option<Readings>), String>) {
        match result {
            Ok((update, compute, readings)) => {
                self.options.metrics.trained();
                let accuracy = update.metrics.iter().find(|m| m.key() == MetricKey::LocalAccuracy).map(|m| m.value);
                self.trained_here.insert(round, (update.num_samples, accuracy));
                self.condition.retain(|r, _| *r + UNCONFIRMED_COSTS as u64 > round);
                if let Some(readings) = readings {
                    self.options.metrics.readings_refused(readings.errors.len());
                    self.condition.insert(round, readings);
                }
                self.session.trained(update, compute);
            }
            Err(e) => {
                self.options.metrics.training_failed();
                self.session.training_failed(round, &e);
            }
        }
    }

    /// Starts the readers of a connection, in `tasks`: its control stream, its broadcasts on uni
    /// streams, and its broadcast transfers when the device takes them. Returns the mark the
    /// broadcasts' wire bytes are counted from: when the connection ends, what it received since
    /// counts toward the broadcast it leaves held, if any.
    fn read(
        &self,
        conn: &quinn::Connection,
        control_recv: quinn::RecvStream,
        tx: mpsc::UnboundedSender<Inbound>,
        tasks: &mut tokio::task::JoinSet<()>,
    ) -> crate::broadcasts::WireMark {
        let (max_frame, mark) = (self.options.max_frame_bytes, crate::broadcasts::WireMark::new(conn));
        tasks.spawn(read_control(control_recv, tx.clone(), max_frame));
        let metrics = self.options.metrics.clone();
        if self.options.resume_broadcasts {
            let (held, priorities) = (self.held_broadcast.clone(), self.options.stream_priorities);
            let (conn, mark, metrics) = (conn.clone(), mark.clone(), metrics.clone());
            let receiver = crate::broadcasts::Receiver { conn, held, mark, max_frame, priorities, metrics };
            tasks.spawn(receiver.accept(tx.clone()));
        }
        tasks.spawn(accept_broadcasts(conn.clone(), tx, max_frame, mark.clone(), metrics));
        mark
    }

    /// One session action; `Some` when it ends the connection (a failed write) or the client.
    async fn act(
        &mut self,
        action: SessionAction,
        conn: &quinn::Connection,
        control: &mut quinn::SendStream,
        tasks: &mut tokio::task::JoinSet<()>,
    ) -> anyhow::Result<Option<Ended>> {
        let max_frame = self.options.max_frame_bytes;
        match action {
            SessionAction::Send(msg) => {
                let frame = encode_frame(&msg, max_frame)?;
                if let Err(e) = write_frame(control, &frame).await {
                    return Ok(Some(Ended::Lost(format!("control stream: {e}"))));
                }
            }
            SessionAction::Train(b) => self.train(b),
            SessionAction::Upload(update) => {
                let priority = Priority::of_update(&update);
                self.start_upload(update.round, Message::Update(update), priority, conn, tasks)
            }
            // A masked vector is as large as an update and travels the same way.
            SessionAction::UploadMasked { round, msg } => self.start_upload(round, msg, Priority::Blocks, conn, tasks),
            SessionAction::Cost(record) => self.report(record, control).await,
            SessionAction::Persist(update) => {
                if let Some(store) = &self.options.store {
                    store.save_pending(update.as_ref()).context("persisting the update")?;
                }
            }
            SessionAction::SetAsidePending { round, reason } => {
                // Not fatal: the session does not resend it either way; a file left in place is
                // resent (and refused again) only after a restart.
                if let Some(store) = &self.options.store
                    && let Err(e) = store.set_aside_pending(&format!("round {round} refused: {reason}"))
                {
                    tracing::warn!(client = %self.options.client_id, round, error = %e, "could not set the refused update aside");
                }
            }
            SessionAction::Finished { reason } => {
                if let Ok(frame) = encode_frame(&Message::Goodbye(Goodbye { reason: "done".into() }), max_frame) {
                    let _ = write_frame(control, &frame).await;
                    let _ = control.finish();
                }
                conn.close(quinn::VarInt::from_u32(0), b"done");
                if let Some(refusal) = self.session.refusal() {
                    let kind = match refusal.reason {
                        RefusalReason::Revoked => RefusalKind::Revoked,
                        RefusalReason::NotEnrolled => RefusalKind::NotEnrolled,
                        _ => RefusalKind::Incompatible,
                    };
                    let refused = self.refusal(kind, format!("{:?}: {}", refusal.reason, refusal.detail));
                    self.endpoint.wait_idle(Duration::from_secs(1)).await;
                    return Ok(Some(Ended::Refused(refused)));
                }
                self.emit(ClientEvent::Finished { reason: reason.clone() });
                self.endpoint.wait_idle(Duration::from_secs(1)).await;
                return Ok(Some(Ended::Exit(reason)));
            }
        }
        Ok(None)
    }

    /// Trains on `b` on a blocking thread (the result comes back on `trained`, with what the
    /// device read of itself right after), unless the device's `[eligibility]` says it should
    /// not train now: then the session declines the round with the reason.
    fn train(&mut self, b: Broadcast) {
        let round = b.round;
        let eligible = match &self.options.sys_root {
            // `eligibility::check_now`, keeping the count of the values the reading refused.
            Some(root) if self.options.eligibility.is_enabled() => {
                let readings = Readings::read(root);
                self.options.metrics.readings_refused(readings.errors.len());
                let now = crate::eligibility::utc_minutes(std::time::SystemTime::now());
                crate::eligibility::decide(&self.options.eligibility, &readings, now)
            }
            _ => Ok(()),
        };
        if let Err(decline) = eligible {
            self.options.metrics.declined(decline.kind());
            self.session.declined(round, decline.kind(), &decline.to_string());
            self.emit(ClientEvent::Declined { round, reason: decline.kind() });
            return;
        }
        let (method, tx, store) = (self.method.clone(), self.trained.clone(), self.options.store.clone());
        let root = self.options.sys_root.clone();
        tokio::task::spawn_blocking(move || {
            let result = match method.lock() {
                Ok(mut m) => {
                    // The one measurement of the round's compute time on this clock.
                    let result = m
                        .train_timed(&b)
                        .map(|(update, compute)| (update, compute, root.as_ref().map(Readings::read)))
                        .map_err(|e| e.to_string());
                    if let (Ok(_), Some(store)) = (&result, &store) {
                        save_device_state(store, &**m, round);
                    }
                    result
                }
                Err(_) => Err("a previous training run panicked".to_string()),
            };
            let _ = tx.send((round, result));
        });
    }

    /// Starts the upload of `update` unless the same round's is still going on this connection.
    fn start_upload(
        &mut self,
        round: u64,
        msg: Message,
        priority: Priority,
        conn: &quinn::Connection,
        tasks: &mut tokio::task::JoinSet<()>,
    ) {
        if self.uploading.get(&round).is_some_and(|task| !task.is_finished()) {
            tracing::debug!(round, "the round's update is already being uploaded");
            return;
        }
        let (max_frame, resume) = (self.options.max_frame_bytes, self.options.resume_uploads);
        let priority = priority.when(self.options.stream_priorities);
        let (done, metrics) = (self.uploaded.clone(), self.options.metrics.clone());
        let task = tasks.spawn(upload(conn.clone(), (round, msg), max_frame, (resume, priority), done, metrics));
        self.uploading.retain(|_, t| !t.is_finished());
        self.uploading.insert(round, task);
    }

    /// A message from the server, `wire_bytes` on the wire: told to the events, unconfirmed cost
    /// records resent after a welcome; then the session handles it (a broadcast opens its round's
    /// cost record, an ack may complete it).
    async fn on_message(&mut self, msg: Message, wire_bytes: u64, control: &mut quinn::SendStream) {
        match &msg {
            Message::Broadcast(b) => {
                self.options.metrics.broadcast(b.round);
                self.emit(ClientEvent::RoundStarted { round: b.round });
            }
            Message::Ack(ack) => self.emit(ClientEvent::Acked { round: ack.round, aggregated: ack.aggregated }),
            Message::CostAck(a) => {
                self.unconfirmed.remove(&a.round);
            }
            Message::Welcome(_) => {
                // The server took this device: the backoff starts again from its initial delay.
                self.failures.connected();
                for record in self.unconfirmed.values() {
                    tracing::debug!(client = %self.options.client_id, round = record.round, "resending an unconfirmed cost record");
                    report_cost(control, record.clone(), self.options.max_frame_bytes).await;
                }
            }
            _ => {}
        }
        if let Err(e) = self.session.handle_message(self.now(), msg, wire_bytes) {
            if let crate::session::SessionError::SecAgg { reason, .. } = &e {
                self.options.metrics.secagg_refused(reason);
            }
            tracing::warn!(client = %self.options.client_id, error = %e, "ignored a message");
        }
    }

    /// A round's cost record, complete: logged, told to the events and reported to the server,
    /// and kept until the server confirms it.
    async fn report(&mut self, mut record: CostRecord, control: &mut quinn::SendStream) {
        let (round, aggregated) = (record.round, !record.straggler);
        if let Some(readings) = self.condition.remove(&round) {
            crate::eligibility::fill_condition(&mut record, &readings);
        }
        self.options.metrics.recorded(&record);
        let line = round_line(&record, self.trained_here.remove(&round));
        tracing::info!(client = %self.options.client_id, round, aggregated, "{line}");
        self.emit(ClientEvent::RoundDone { cost: record.clone(), aggregated });
        report_cost(control, record.clone(), self.options.max_frame_bytes).await;
        self.unconfirmed.insert(round, record);
        while self.unconfirmed.len() > UNCONFIRMED_COSTS {
            self.unconfirmed.pop_first();
        }
    }
}

/// A handshake that TLS ended for a reason a retry may clear (this client did not accept the
/// server's certificate, or the server's alert is not about this device's certificate): an error
/// that says what to check; the client keeps retrying with backoff, in case the server's side is
/// fixed, but never quietly. The server's verdicts on this device's certificate stop the client
/// instead ([`definite_refusal`]).
fn tls_error(options: &ClientOptions, e: &quinn::ConnectionError) {
    let ours = matches!(e, quinn::ConnectionError::TransportError(_));
    tracing::error!(
        client = %options.client_id,
        server = %options.server_name,
        mutual_tls = options.client_cert.is_some(),
        error = %e,
        "TLS failed ({}): check that server_cert is the project CA (or the development server's own \
         certificate) and that the server's certificate names `server_name`; retrying with backoff",
        if ours { "this client did not accept the server's certificate" } else { "the server's alert" }
    );
}

/// A delay as a person reads it: `850 ms`, `12.5 s`, `4.2 min`.
fn human(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 1.0 {
        format!("{} ms", d.as_millis())
    } else if s < 120.0 {
        format!("{s:.1} s")
    } else {
        format!("{:.1} min", s / 60.0)
    }
}

/// Sleeps for `delay`; `true` when the stop signal came first.
async fn sleep_or_stop(delay: Duration, stop: &mut Option<tokio::sync::watch::Receiver<bool>>) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(delay) => false,
        _ = stopped(stop) => true,
    }
}

/// Completes when the stop signal turns true; never without one.
async fn stopped(stop: &mut Option<tokio::sync::watch::Receiver<bool>>) {
    match stop {
        Some(rx) => {
            if rx.wait_for(|s| *s).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}

async fn read_control(mut recv: quinn::RecvStream, tx: mpsc::UnboundedSender<Inbound>, max_frame: usize) {
    loop {
        match read_frame(&mut recv, max_frame).await {
            Ok(Some((msg, n))) => {
                if tx.send(Inbound::Message { msg, wire_bytes: n as u64 }).is_err() {
                    return;
                }
            }
            Ok(None) => {
                let _ = tx.send(Inbound::Closed("server closed the control stream".into()));
                return;
            }
            Err(FrameIoError::Io(e)) => {
                let _ = tx.send(Inbound::Closed(format!("control stream: {e}")));
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "bad control frame from the server");
                let _ = tx.send(Inbound::Closed(format!("bad control frame: {e}")));
                return;
            }
        }
    }
}

/// Accepts broadcast streams. The wire bytes of a broadcast are the UDP bytes received since the
/// previous broadcast ended (or the connection began) until this one ended: QUIC headers and
/// retransmissions included, plus the little control traffic in between (acks, heartbeats).
/// `mark` is shared with the broadcasts that come as transfers (`crate::broadcasts`).
async fn accept_broadcasts(
    conn: quinn::Connection,
    tx: mpsc::UnboundedSender<Inbound>,
    max_frame: usize,
    mark: crate::broadcasts::WireMark,
    metrics: Arc<ClientMetrics>,
) {
    while let Ok(mut recv) = conn.accept_uni().await {
        match read_frame(&mut recv, max_frame).await {
            Ok(Some((msg, _))) => {
                let wire_bytes = mark.take(&conn);
                if tx.send(Inbound::Message { msg, wire_bytes }).is_err() {
                    return;
                }
            }
            Ok(None) => {}
            Err(e) => {
                if !matches!(e, FrameIoError::Io(_)) {
                    metrics.transfer_refused(crate::metrics::DOWN, crate::metrics::MALFORMED);
                }
                tracing::warn!(error = %e, "bad broadcast from the server");
            }
        }
    }
}

/// Sends a round's measured cost to the server's ledger (best effort: the sim keeps its own copy).
async fn report_cost(control: &mut quinn::SendStream, record: CostRecord, max_frame: usize) {
    if let Ok(frame) = encode_frame(&Message::Cost(record), max_frame)
        && let Err(e) = write_frame(control, &frame).await
    {
        tracing::debug!(error = %e, "could not report a round's cost");
    }
}

/// Uploads one update as a resumable transfer on its own stream ([`send_resumable`]; with
/// `resume` false, whole on a uni stream), at `priority`, and waits until the server acknowledged
/// every byte at the QUIC level. Reports the round and what the upload took: the UDP bytes sent
/// meanwhile, its seconds and the RTT at its end.
async fn upload(
    conn: quinn::Connection,
    (round, msg): (u64, Message),
    max_frame: usize,
    (resume, priority): (bool, Option<Priority>),
    done: mpsc::UnboundedSender<Uploaded>,
    metrics: Arc<ClientMetrics>,
) {
    let frame = match encode_frame(&msg, max_frame) {
        Ok(f) => f,
        Err(e) => {
            tracing::error!(round, error = %e, "update does not fit in a frame");
            return;
        }
    };
    let started = Instant::now();
    let before = conn.stats().udp_tx.bytes;
    let mut attempt = 0;
    loop {
        let sent = if resume {
            send_resumable(&conn, &frame, round, priority, &metrics).await
        } else {
            send_whole(&conn, &frame, priority).await
        };
        match sent {
            Ok(resumed_at) => {
                metrics.uploaded(resumed_at);
                if resumed_at > 0 {
                    tracing::info!(round, resumed_at, total = frame.len(), "upload resumed where the server held it");
                }
                let st = conn.stats();
                tracing::debug!(
                    round,
                    lost_bytes = st.path.lost_bytes,
                    lost_packets = st.path.lost_packets,
                    "upload done"
                );
                let wire_bytes = conn.stats().udp_tx.bytes.saturating_sub(before);
                let _ = done.send((round, UploadMeasure { wire_bytes, transfer: started.elapsed(), rtt: conn.rtt() }));
                return;
            }
            // The server let the stream go (it stalled through an outage) but the connection
            // lives: offer the update again at once; the server answers with what it holds.
            Err(e) if resume && conn.close_reason().is_none() && attempt < UPLOAD_RETRIES => {
                attempt += 1;
                tracing::info!(round, attempt, error = %format!("{e:#}"), "upload stream broke off; offering it again");
                tokio::time::sleep(Duration::from_millis(500 * u64::from(attempt))).await;
            }
            Err(e) => {
                tracing::info!(round, error = %format!("{e:#}"), "upload interrupted; it resumes after reconnecting");
                return;
            }
        }
    }
}

/// The whole frame on a uni stream (`resume_uploads = false`) at `priority`; returns offset 0.
async fn send_whole(conn: &quinn::Connection, frame: &[u8], priority: Option<Priority>) -> anyhow::Result<u64> {
    let mut s = conn.open_uni().await?;
    prioritise(&s, priority);
    s.write_all(frame).await?;
    s.finish()?;
    s.stopped().await?;
    Ok(0)
}

/// Gives `stream` its send priority ([`Priority`]); `None` (priorities off) leaves quinn's
/// default, 0 for every stream, which take turns a packet each. Fails only on a stream already
/// finished or reset, which sends nothing more to order.
pub fn prioritise(stream: &quinn::SendStream, priority: Option<Priority>) {
    if let Some(p) = priority {
        let _ = stream.set_priority(p.level());
    }
}

/// Offers of one update on one live connection, after the first, before waiting for a new
/// connection (each resumes where the server holds it, so a retry costs little).
const UPLOAD_RETRIES: u32 = 20;

/// Sends `frame` (an encoded update of `round`) as a resumable transfer
/// (`anchorage_shared::transfer`): offers it by hash and size on a new bi stream, and sends its
/// chunks from where the server's answer says it holds them, at `priority` (`None`: quinn's
/// default). Returns that offset; a refused answer of the server is counted in `metrics`.
pub async fn send_resumable(
    conn: &quinn::Connection,
    frame: &[u8],
    round: u64,
    priority: Option<Priority>,
    metrics: &ClientMetrics,
) -> anyhow::Result<u64> {
    let offer = transfer::offer(frame, round);
    let (mut send, mut recv) = conn.open_bi().await?;
    prioritise(&send, priority);
    write_frame(&mut send, &encode_frame(&Message::TransferOffer(offer.clone()), usize::MAX)?).await?;
    let answer = read_frame(&mut recv, transfer::MAX_CHUNK_FRAME).await;
    let offset = resume_answer(&offer, answer, metrics)?;
    for chunk in transfer::chunks_from(frame, offset) {
        send.write_all(&encode_frame(&Message::Chunk(chunk), usize::MAX)?).await?;
    }
    send.finish()?;
    send.stopped().await?;
    Ok(offset)
}

/// Where an upload goes on after the server's `answer` to `offer`: its offset, unless the
/// answer is refused (another transfer, an offset past the end: `TransferError::reason`; not a
/// `TransferResume`, or a frame that does not decode: `malformed`), which is logged and counted
/// in `metrics`. A stream that ended is an error, not a refusal.
fn resume_answer(
    offer: &anchorage_shared::protocol::TransferOffer,
    answer: Result<Option<(Message, usize)>, FrameIoError>,
    metrics: &ClientMetrics,
) -> anyhow::Result<u64> {
    let refused = match answer {
        Ok(Some((Message::TransferResume(r), _))) => match transfer::resume_offset(offer, &r) {
            Ok(offset) => return Ok(offset),
            Err(e) => (e.reason(), e.to_string()),
        },
        Ok(Some((other, _))) => (crate::metrics::MALFORMED, format!("a {} instead of an answer", other.kind_name())),
        Ok(None) => anyhow::bail!("the server ended the upload's stream without an answer"),
        Err(FrameIoError::Io(e)) => anyhow::bail!("reading the answer to the upload's offer: {e}"),
        Err(e) => (crate::metrics::MALFORMED, e.to_string()),
    };
    let (reason, detail) = refused;
    metrics.transfer_refused(crate::metrics::UP, reason);
    tracing::warn!(round = offer.round, reason, %detail, "refused the server's answer to an upload");
    anyhow::bail!("refused the server's answer to the upload's offer ({reason}): {detail}")
}

#[cfg(test)]
pub(crate) mod tests {
    use anchorage_shared::tensor::ParamBlock;

    use super::*;
    use crate::methods::TrainError;
    use anchorage_model::FeatureCache;

    /// After a failed attempt or a lost connection a device tries its next relay,
    /// round robin; without fallbacks it stays with its server.
    #[test]
    fn fail_over_takes_the_next_address_round_robin() {
        let addr = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
        let cert = CertificateDer::from(vec![0u8; 4]);
        let mut options = ClientOptions::new(addr(1), cert.clone(), "edge-1");
        options.fail_over();
        assert_eq!(options.server, addr(1));
        options.fallbacks = vec![addr(2), addr(3)];
        let seen: Vec<u16> = (0..4)
            .map(|_| {
                options.fail_over();
                options.server.port()
            })
            .collect();
        assert_eq!(seen, vec![2, 3, 1, 2]);
        assert_eq!(options.fallbacks.len(), 2);
    }

    /// A method that never trains; it refuses any device state when `refuse_state`.
    struct Idle {
        refuse_state: bool,
    }

    impl ClientMethod for Idle {
        fn name(&self) -> &'static str {
            "fedavg"
        }
        fn num_samples(&self) -> u64 {
            1
        }
        fn train(&mut self, _: &Broadcast) -> Result<Update, TrainError> {
            Err(TrainError::NoData)
        }
        fn global_accuracy(&self, _: &Broadcast, _: &FeatureCache) -> Result<Option<f64>, TrainError> {
            Ok(None)
        }
        fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
            Ok(Vec::new())
        }
        fn restore_device_state(&mut self, _: &[ParamBlock]) -> Result<(), TrainError> {
            if self.refuse_state { Err(TrainError::NoData) } else { Ok(()) }
        }
    }

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("anchorage-client-transport-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn names(dir: &std::path::Path) -> Vec<String> {
        let mut names: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        names
    }

    /// A throwaway self-signed certificate for `localhost` (these tests never complete a handshake).
    fn test_cert() -> CertificateDer<'static> {
        rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap().cert.der().clone()
    }

    /// Options for a "server" that is a bound UDP socket nobody reads: a server that is down
    /// and answers no Initial packet.
    fn silent_server(client: &str) -> (std::net::UdpSocket, ClientOptions) {
        let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let cert = test_cert();
        let mut options = ClientOptions::new(silent.local_addr().unwrap(), cert, client);
        options.connect_timeout = Duration::from_millis(300);
        options.idle_timeout = Duration::from_secs(30);
        options.backoff =
            Backoff { initial: Duration::from_millis(10), max: Duration::from_millis(20), max_attempts: Some(3) };
        (silent, options)
    }

    /// A QUIC server config with a throwaway self-signed certificate for `localhost`, and that
    /// certificate.
    fn self_signed_server() -> (quinn::ServerConfig, CertificateDer<'static>) {
        let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        let cert = certified.cert.der().clone();
        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
        let mut crypto =
            rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_protocol_versions(&[&rustls::version::TLS13])
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(vec![cert.clone()], key)
                .unwrap();
        crypto.alpn_protocols = vec![ALPN.to_vec()];
        let config = quinn::ServerConfig::with_crypto(Arc::new(
            quinn::crypto::rustls::QuicServerConfig::try_from(crypto).unwrap(),
        ));
        (config, cert)
    }

    /// A QUIC connection on loopback: the server's side, the client's side, and both endpoints
    /// (keep them alive for the connection's life).
    pub(crate) async fn loopback() -> (quinn::Connection, quinn::Connection, [quinn::Endpoint; 2]) {
        let (config, cert) = self_signed_server();
        let server = quinn::Endpoint::server(config, "127.0.0.1:0".parse().unwrap()).unwrap();
        let options = ClientOptions::new(server.local_addr().unwrap(), cert, "c");
        let client = endpoint(&options).unwrap();
        let accepted = tokio::spawn({
            let server = server.clone();
            async move { server.accept().await.unwrap().await.unwrap() }
        });
        let client_conn = client.connect(options.server, "localhost").unwrap().await.unwrap();
        (accepted.await.unwrap(), client_conn, [server, client])
    }

    /// The server's answer to an upload's offer: one that names another transfer, resumes past
    /// the end or is not an answer is refused, logged and counted by reason; a stream that
    /// ended is an error but no refusal.
    #[test]
    fn a_bad_answer_to_an_upload_is_refused_and_counted() {
        use crate::metrics::{MALFORMED, UP};
        use anchorage_shared::protocol::TransferResume;
        let frame = vec![7u8; 1000];
        let offer = transfer::offer(&frame, 3);
        let metrics = ClientMetrics::new();
        let answer = |transfer, offset| Ok(Some((Message::TransferResume(TransferResume { transfer, offset }), 40)));
        assert_eq!(resume_answer(&offer, answer(offer.transfer, 500), &metrics).unwrap(), 500);
        assert_eq!(resume_answer(&offer, answer(offer.transfer, 1000), &metrics).unwrap(), 1000);

        let e = resume_answer(&offer, answer(offer.transfer, 1001), &metrics).unwrap_err().to_string();
        assert!(e.contains("bad_offset") && e.contains("past the end"), "{e}");
        assert_eq!(metrics.transfers_refused(UP, "bad_offset"), 1);
        let e = resume_answer(&offer, answer([9; 32], 0), &metrics).unwrap_err().to_string();
        assert!(e.contains("another transfer"), "{e}");
        assert_eq!(metrics.transfers_refused(UP, "bad_offer"), 1);
        let heartbeat = Ok(Some((Message::Heartbeat(Heartbeat { seq: 1 }), 10)));
        assert!(resume_answer(&offer, heartbeat, &metrics).unwrap_err().to_string().contains("instead of an answer"));
        assert_eq!(metrics.transfers_refused(UP, MALFORMED), 1);

        assert!(resume_answer(&offer, Ok(None), &metrics).is_err());
        let reset = Err(FrameIoError::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset)));
        assert!(resume_answer(&offer, reset, &metrics).is_err());
        let total: u64 = crate::metrics::REFUSAL_REASONS.iter().map(|r| metrics.transfers_refused(UP, r)).sum();
        assert_eq!(total, 3, "a stream that ended is not a refusal");
        assert_eq!(metrics.transfers_refused(crate::metrics::DOWN, "bad_offset"), 0);
    }

    /// The same over QUIC: a server that answers an upload's offer past its end.
    #[tokio::test]
    async fn an_upload_resumed_past_its_end_is_refused_and_counted() {
        use anchorage_shared::protocol::TransferResume;
        let (server, client, _endpoints) = loopback().await;
        let answering = tokio::spawn(async move {
            let (mut send, mut recv) = server.accept_bi().await.unwrap();
            let Some((Message::TransferOffer(offer), _)) = read_frame(&mut recv, usize::MAX).await.unwrap() else {
                panic!("not an offer")
            };
            let past = TransferResume { transfer: offer.transfer, offset: offer.total + 1 };
            write_frame(&mut send, &encode_frame(&Message::TransferResume(past), usize::MAX).unwrap()).await.unwrap();
            let _ = send.finish();
            let _ = recv.read_to_end(usize::MAX).await;
            server
        });
        let metrics = ClientMetrics::new();
        let e = send_resumable(&client, &[1u8; 5000], 2, None, &metrics).await.unwrap_err();
        assert!(format!("{e:#}").contains("past the end"), "{e:#}");
        assert_eq!(metrics.transfers_refused(crate::metrics::UP, "bad_offset"), 1);
        client.close(quinn::VarInt::from_u32(0), b"done");
        let _ = answering.await;
    }

    /// An invited device that may not train now: the values its reading refused and its
    /// decline are counted, and nothing is trained.
    #[tokio::test]
    async fn refused_readings_and_declines_are_counted() {
        let dir = tempfile::tempdir().unwrap();
        crate::eligibility::fake::write(
            dir.path(),
            &[
                ("sys/class/thermal/thermal_zone0/type", "cpu-thermal\n"),
                ("sys/class/thermal/thermal_zone0/temp", "90000\n"),
                ("proc/loadavg", "load: high\n"),
            ],
        );
        let (_silent, mut options) = silent_server("c");
        options.sys_root = Some(crate::eligibility::SysRoot::new(dir.path()));
        options.eligibility.max_temperature_c = Some(80.0);
        let metrics = options.metrics.clone();
        let ((trained, _t), (uploaded, _u)) = (mpsc::unbounded_channel(), mpsc::unbounded_channel());
        let mut client = Client::new(options, Box::new(Idle { refuse_state: false }), None, trained, uploaded).unwrap();
        let config = anchorage_shared::protocol::RoundConfig {
            local_epochs: 1,
            batch_size: 8,
            learning_rate: 0.1,
            deadline_ms: 1000,
        };
        client.train(Broadcast { round: 4, task: 0, config, blocks: Vec::new(), prototypes: Vec::new() });
        let text = metrics.encode_text();
        assert!(text.contains("\nanchorage_device_readings_refused_total 1\n"), "{text}");
        assert!(text.contains("\nanchorage_device_rounds_declined_total{reason=\"thermal\"} 1\n"), "{text}");
        assert!(text.contains("\nanchorage_device_rounds_trained_total 0\n"), "{text}");
    }

    #[test]
    fn defaults_notice_a_restarted_server_within_seconds() {
        let cert = test_cert();
        let options = ClientOptions::new("127.0.0.1:4433".parse().unwrap(), cert, "c");
        assert_eq!(
            (options.keep_alive, options.idle_timeout, options.connect_timeout),
            (Duration::from_secs(2), Duration::from_secs(15), Duration::from_secs(2))
        );
        let config = crate::config::ConnectionConfig::default();
        assert_eq!(
            (config.keep_alive(), config.idle_timeout(), config.connect_timeout()),
            (options.keep_alive, options.idle_timeout, options.connect_timeout),
            "client.toml's defaults are the library's"
        );
    }

    #[test]
    fn a_connection_that_was_up_resets_the_backoff() {
        let backoff = Backoff::default();
        let mut rng = Rng::derive(1, 2);
        let mut failures = Failures::default();
        for _ in 0..6 {
            failures.failed();
        }
        assert!(backoff.delay(failures.failed(), &mut rng) > backoff.initial, "six failures in a row back off");
        failures.connected();
        // The connection is lost: the first retry waits no more than the initial delay.
        let attempt = failures.failed();
        assert_eq!(attempt, 1);
        let delay = backoff.delay(attempt, &mut rng);
        assert!(delay >= backoff.initial / 2 && delay <= backoff.initial, "{delay:?}");
        // And a second loss in a row (the server is still down) backs off from there.
        assert_eq!(failures.failed(), 2);
    }

    /// A QUIC server on loopback that completes every handshake and closes the connection at
    /// once (no welcome): a server that keeps turning the device away for a reason a retry may
    /// clear. Returns its address, its certificate and the count of connections it took.
    fn closing_server(
        close: fn(&quinn::Connection),
    ) -> (SocketAddr, CertificateDer<'static>, Arc<std::sync::atomic::AtomicUsize>) {
        let (config, cert) = self_signed_server();
        let endpoint = quinn::Endpoint::server(config, "127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = endpoint.local_addr().unwrap();
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = count.clone();
        tokio::spawn(async move {
            while let Some(incoming) = endpoint.accept().await {
                if let Ok(conn) = incoming.await {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    close(&conn);
                }
            }
        });
        (addr, cert, count)
    }

    /// A connection that ends before the server's welcome is a failed attempt: the backoff
    /// grows. (Were it to restart from the initial delay at every handshake, a device the server
    /// turns away at once would retry about 5 times a second forever.)
    #[tokio::test]
    async fn a_server_that_closes_before_the_welcome_is_retried_with_growing_backoff() {
        let (addr, cert, count) = closing_server(|c| c.close(quinn::VarInt::from_u32(7), b"not now"));
        let mut options = ClientOptions::new(addr, cert, "c");
        options.backoff =
            Backoff { initial: Duration::from_millis(50), max: Duration::from_secs(60), max_attempts: None };
        let ran =
            tokio::time::timeout(Duration::from_secs(3), run(options, Box::new(Idle { refuse_state: false }), None))
                .await;
        assert!(ran.is_err(), "a transient refusal does not stop the client: {ran:?}");
        let connections = count.load(std::sync::atomic::Ordering::SeqCst);
        println!("connections turned away in 3 s: {connections}");
        // Delays of at least 25, 50, 100, 200, 400, 800 and 1600 ms: 8 connections at most in 3 s
        // (a backoff that restarts at every handshake makes about 60).
        assert!((3..=8).contains(&connections), "{connections} connections in 3 s");
    }

    /// The server's TLS alerts about this device's certificate stop the client; other alerts
    /// and closes are retried.
    #[test]
    fn the_servers_certificate_alerts_are_definite_refusals() {
        let closed = |alert: u8| {
            quinn::ConnectionError::ConnectionClosed(quinn::ConnectionClose {
                error_code: quinn::TransportErrorCode::crypto(alert),
                frame_type: None,
                reason: Default::default(),
            })
        };
        let kind = |alert| definite_refusal(&closed(alert)).map(|(k, _)| k);
        assert_eq!(kind(44), Some(RefusalKind::Revoked));
        assert_eq!(kind(48), Some(RefusalKind::UnknownCa));
        assert_eq!(kind(45), Some(RefusalKind::Expired));
        assert_eq!(kind(42), Some(RefusalKind::BadCertificate));
        assert_eq!(kind(49), Some(RefusalKind::BadCertificate));
        assert_eq!(kind(116), Some(RefusalKind::NoCertificate));
        assert_eq!(kind(120), Some(RefusalKind::Incompatible));
        assert_eq!(kind(80), None, "internal_error may clear");
        assert_eq!(kind(40), None, "handshake_failure may clear");
        let (_, detail) = definite_refusal(&closed(44)).unwrap();
        assert!(detail.contains("44") && detail.contains("CertificateRevoked"), "{detail}");
        let app = quinn::ConnectionError::ApplicationClosed(quinn::ApplicationClose {
            error_code: quinn::VarInt::from_u32(1),
            reason: Default::default(),
        });
        assert!(definite_refusal(&app).is_none());
        assert!(definite_refusal(&quinn::ConnectionError::TimedOut).is_none());
        // What the operator reads.
        let refused = Refused {
            client: "edge-9".into(),
            server: "127.0.0.1:4433".parse().unwrap(),
            kind: RefusalKind::Revoked,
            detail: "TLS alert 44".into(),
        };
        let text = refused.to_string();
        assert!(
            text.contains("edge-9") && text.contains("revoked") && text.contains("anchorage ca issue client edge-9"),
            "{text}"
        );
    }

    /// A server that does not answer costs `connect_timeout` an attempt, not the idle timeout,
    /// and each timed-out attempt counts as a failure.
    #[tokio::test]
    async fn a_connect_attempt_to_a_silent_server_times_out() {
        let (_silent, options) = silent_server("c");
        let started = Instant::now();
        let result =
            tokio::time::timeout(Duration::from_secs(10), run(options, Box::new(Idle { refuse_state: false }), None))
                .await
                .expect("gave up long before the 30 s idle timeout");
        let error = result.unwrap_err().to_string();
        assert!(error.contains("after 3 attempts") && error.contains("no answer within 300ms"), "{error}");
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(5), "{took:?}");
    }

    /// Corrupt files, and a device state the method refuses, are set aside at start: the client
    /// goes on to connect (here to a silent server) instead of failing at start.
    #[tokio::test]
    async fn corrupt_or_refused_files_do_not_stop_the_client_at_start() {
        for refuse_state in [false, true] {
            let dir = temp_dir(&format!("start-{refuse_state}"));
            let store = ClientStore::new(&dir);
            std::fs::write(dir.join("pending-update.bin"), b"ANCHUPD2 not what it was").unwrap();
            if refuse_state {
                let blocks = [ParamBlock::encode("tail.values", &[1], &[1.0], anchorage_shared::tensor::Encoding::F32)];
                store.save_device_state(&blocks).unwrap();
            } else {
                std::fs::write(dir.join("device-state.bin"), b"ANCHDEV2\0\0\0\0").unwrap();
            }
            let (_silent, mut options) = silent_server("c");
            options.backoff.max_attempts = Some(1);
            options.store = Some(store);
            let (tx, mut rx) = mpsc::unbounded_channel();
            let error = run(options, Box::new(Idle { refuse_state }), Some(tx)).await.unwrap_err().to_string();
            assert!(error.contains("could not reach"), "it got as far as connecting: {error}");
            assert!(rx.try_recv().is_err(), "no event: it never connected");
            let files = names(&dir);
            assert_eq!(files.len(), 2, "{files:?}");
            assert!(
                files[0].starts_with("device-state.bin.corrupt-") || files[0].starts_with("device-state.bin.refused-")
            );
            assert_eq!(files[0].contains("refused"), refuse_state, "{files:?}");
            assert!(files[1].starts_with("pending-update.bin.corrupt-"), "{files:?}");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}
