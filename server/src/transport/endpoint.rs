//! The QUIC endpoint: its TLS server config (built again whenever the revocation list changes),
//! with a store the keys that outlive a restart so that devices hear at once that their old
//! connection is gone, and its renewal once a large fleet has left ([`Listener`]).

use std::sync::{Arc, Mutex};

use anchorage_shared::io::udp_socket;
use anyhow::Context;
use quinn::crypto::rustls::QuicServerConfig;
use tokio::sync::watch;

use super::ServerOptions;
use crate::tls::{RefusalLog, Trust};
use anchorage_pki::Identity;

/// The server's QUIC endpoint, renewable. quinn keeps an endpoint's routing tables (connection
/// ids, reset tokens, the connection slab) at the largest size they ever reached: after 10,000
/// devices have come and gone they hold megabytes for no one. Once an endpoint has held
/// `Limits::renew_endpoint_after` connections and holds none, [`renew_if_emptied`](Self::renew_if_emptied)
/// moves the UDP socket to a fresh endpoint with the same keys and TLS config (same address, no
/// packet lost: the old endpoint gives the socket up first, and what arrives meanwhile waits in
/// the kernel's buffer). The accept loop follows [`current`](Self::current).
#[derive(Clone)]
pub(super) struct Listener {
    current: Arc<watch::Sender<quinn::Endpoint>>,
    state: Arc<Mutex<ListenerState>>,
}

struct ListenerState {
    /// The bound socket; each endpoint runs on a clone of it.
    socket: std::net::UdpSocket,
    endpoint_config: quinn::EndpointConfig,
    /// The TLS config new handshakes get (the revocation list's latest).
    server_config: quinn::ServerConfig,
    /// The most connections the current endpoint has held at once.
    most_open: usize,
    closed: bool,
    renew_after: usize,
}

impl Listener {
    /// Binds the UDP socket of `options.bind` and starts an endpoint on it: the TLS config of
    /// `options.trust` with `crl`, and stateless-reset keys from the store if there is one.
    pub(super) fn bind(
        options: &ServerOptions,
        crl: Crl,
        transport: &Arc<quinn::TransportConfig>,
        refusals: &Arc<RefusalLog>,
    ) -> anyhow::Result<Self> {
        let server_config = quic_server_config(&options.trust, &options.identity, crl, transport, refusals)?;
        let socket = udp_socket(options.bind, options.limits.socket_buffer)
            .with_context(|| format!("binding {}", options.bind))?;
        let endpoint_config = match &options.store {
            Some(store) => restart_aware_endpoint(&store.stateless_reset_key()?),
            None => quinn::EndpointConfig::default(),
        };
        let clone = socket.try_clone().context("cloning the UDP socket")?;
        let endpoint = new_endpoint(clone, &endpoint_config, &server_config)
            .with_context(|| format!("starting the QUIC endpoint on {}", options.bind))?;
        let state = ListenerState {
            socket,
            endpoint_config,
            server_config,
            most_open: 0,
            closed: false,
            renew_after: options.limits.renew_endpoint_after,
        };
        Ok(Self { current: Arc::new(watch::channel(endpoint).0), state: Arc::new(Mutex::new(state)) })
    }

    /// The endpoint connections are accepted on now.
    pub(super) fn current(&self) -> quinn::Endpoint {
        self.current.borrow().clone()
    }

    /// Wakes when the endpoint is renewed.
    pub(super) fn subscribe(&self) -> watch::Receiver<quinn::Endpoint> {
        self.current.subscribe()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, ListenerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The TLS config for new handshakes, on this endpoint and on any it is renewed into.
    pub(super) fn set_server_config(&self, config: quinn::ServerConfig) {
        let mut state = self.state();
        state.server_config = config.clone();
        self.current().set_server_config(Some(config));
    }

    /// Notes how many connections the endpoint holds (the accept loop, at each admission).
    pub(super) fn note_open(&self, open: usize) {
        let mut state = self.state();
        state.most_open = state.most_open.max(open);
    }

    /// Closes the endpoint for good: every connection, and no renewal after.
    pub(super) fn close(&self, reason: &[u8]) {
        let mut state = self.state();
        state.closed = true;
        self.current().close(quinn::VarInt::from_u32(0), reason);
    }

    /// Moves the socket to a fresh endpoint when the current one has held at least
    /// `Limits::renew_endpoint_after` connections and holds none. True when it did.
    pub(super) fn renew_if_emptied(&self) -> bool {
        let mut state = self.state();
        let old = self.current();
        let due = state.renew_after > 0 && state.most_open >= state.renew_after;
        if state.closed || !due || old.open_connections() > 0 {
            return false;
        }
        match self.renew(&state, &old) {
            Ok(fresh) => {
                tracing::info!(held = state.most_open, "a fleet has left; the QUIC endpoint was renewed");
                state.most_open = 0;
                self.current.send_replace(fresh);
                old.close(quinn::VarInt::from_u32(0), b"endpoint renewed");
                true
            }
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "could not renew the QUIC endpoint; keeping the old one");
                state.most_open = 0;
                false
            }
        }
    }

    fn renew(&self, state: &ListenerState, old: &quinn::Endpoint) -> anyhow::Result<quinn::Endpoint> {
        let for_fresh = state.socket.try_clone().context("cloning the UDP socket")?;
        // The old endpoint gives the shared socket up for a loopback one it never reads from.
        let loopback: std::net::IpAddr = match state.socket.local_addr()? {
            std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        };
        let stand_in = std::net::UdpSocket::bind((loopback, 0)).context("binding a stand-in socket")?;
        old.rebind(stand_in).context("moving the old endpoint off the socket")?;
        new_endpoint(for_fresh, &state.endpoint_config, &state.server_config).map_err(|e| {
            // Back onto the socket: a server that cannot renew keeps listening.
            let back = state.socket.try_clone().and_then(|socket| old.rebind(socket));
            e.context(format!("starting the fresh endpoint (back on the old one: {back:?})"))
        })
    }

    /// True once [`close`](Self::close) has run.
    pub(super) fn is_closed(&self) -> bool {
        self.state().closed
    }
}

/// An endpoint on `socket`, a clone of the listener's.
fn new_endpoint(
    socket: std::net::UdpSocket,
    endpoint_config: &quinn::EndpointConfig,
    server_config: &quinn::ServerConfig,
) -> anyhow::Result<quinn::Endpoint> {
    let runtime = Arc::new(quinn::TokioRuntime);
    Ok(quinn::Endpoint::new(endpoint_config.clone(), Some(server_config.clone()), socket, runtime)?)
}

/// An endpoint whose keys outlive the process, so that after a restart a device's next packet
/// on its old connection is answered with a stateless reset it recognises, and it reconnects at
/// once instead of waiting out its idle timeout. Both keys matter: the connection-ID generator's
/// key (quinn drops packets whose connection ID it did not sign, before any reset) and the reset
/// key (the token the device checks).
fn restart_aware_endpoint(secret: &[u8; 32]) -> quinn::EndpointConfig {
    let derive = |label: &[u8]| {
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        ctx.update(label);
        ctx.update(secret);
        ctx.finish()
    };
    let reset = derive(b"anchorage stateless reset");
    let cid = derive(b"anchorage connection ids");
    let cid_key = u64::from_le_bytes(cid.as_ref()[..8].try_into().expect("a SHA-256 digest has 32 bytes"));
    let mut config =
        quinn::EndpointConfig::new(Arc::new(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, reset.as_ref())));
    config.cid_generator(move || Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cid_key)));
    config
}

pub(super) type Crl = Option<rustls::pki_types::CertificateRevocationListDer<'static>>;

pub(super) fn quic_server_config(
    trust: &Trust,
    identity: &Identity,
    crl: Crl,
    transport: &Arc<quinn::TransportConfig>,
    refusals: &Arc<RefusalLog>,
) -> anyhow::Result<quinn::ServerConfig> {
    let crypto = trust.server_crypto_logged(identity, crl, refusals.clone())?;
    let mut config =
        quinn::ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(crypto).context("QUIC TLS config")?));
    config.transport_config(transport.clone());
    Ok(config)
}
