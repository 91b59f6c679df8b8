//! The tokio + quinn shell around the [`Engine`]: accepts connections, turns frames into engine
//! events, carries out the engine's actions. Control messages ride one bi stream per client
//! (opened by the client, hello first); broadcasts go out and updates come in on uni streams, so
//! a large block never holds up a control message.
//!
//! Bad input never stops the server: a frame that does not decode is refused with a reason
//! (logged here, counted in [`ServerMetrics`]) and only that client's connection is closed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::frame::encode_frame;
use anchorage_shared::io::{FrameIoError, Pace, ReadLimits, read_frame_limited, udp_socket, write_frame};
use anchorage_shared::protocol::{DecodeError, KIND_UPDATE, Message, Refusal, RefusalReason};
use anchorage_shared::tensor::ParamBlock;
use anyhow::Context;
use quinn::VarInt;
use quinn::crypto::rustls::QuicServerConfig;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::engine::config::duration_ms;
use crate::engine::{Action, Checkpoint, ClientId, Engine, EngineConfig, Persist, RoundReport};
use crate::methods::ServerMethod;
use crate::metrics::{outcome, reason, refusal_reason, unix_now};
use crate::store::ServerStore;
use crate::tls::{Identity, RefusalLog, Trust};

/// QUIC limits per connection.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// A connection silent this long is closed.
    #[serde(with = "duration_ms")]
    pub idle_timeout: Duration,
    /// Keep-alive interval; must be below the idle timeout (quinn's default is off).
    #[serde(with = "duration_ms")]
    pub keep_alive: Duration,
    /// Concurrent uni streams a client may open (uploads).
    pub max_uni_streams: u32,
    /// Time a new connection has to send its hello.
    #[serde(with = "duration_ms")]
    pub hello_timeout: Duration,
    /// Per-stream and per-connection receive windows, in bytes.
    pub stream_window: u32,
    pub connection_window: u32,
    /// Kernel UDP buffer size requested for the endpoint's socket.
    pub socket_buffer: usize,
    /// A peer that sends no byte of a started frame for this long is closed (its half-read
    /// frame is not held), and so is one that takes no byte of what the server sends it.
    #[serde(with = "duration_ms")]
    pub read_stall: Duration,
    /// Largest frame of a control message (hello, heartbeat, cost, goodbye); updates get
    /// `max_frame_bytes` of the engine config.
    pub max_control_frame: u32,
    /// Connections open at once; more are refused before the handshake.
    pub max_connections: usize,
    /// Handshakes in progress from one IP address; more are refused (a host cannot tie up the
    /// server with half-open connections).
    pub max_handshakes_per_ip: usize,
    /// The least average rate of an update being uploaded, in bytes per second, judged once
    /// `read_stall` has passed since its first byte (0: none). A device that feeds a 64 MiB
    /// upload a byte at a time is closed instead of holding its buffer for hours.
    pub min_upload_rate: u64,
    /// The most time one update may take to arrive, from its first byte.
    #[serde(with = "duration_ms")]
    pub upload_deadline: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            idle_timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(5),
            max_uni_streams: 8,
            hello_timeout: Duration::from_secs(10),
            stream_window: 8 << 20,
            connection_window: 16 << 20,
            socket_buffer: 4 << 20,
            read_stall: Duration::from_secs(30),
            max_control_frame: 64 << 10,
            max_connections: 10_000,
            max_handshakes_per_ip: 16,
            // 1 KiB/s and 30 minutes: a 20 MB update over a 3G uplink takes about 7 minutes.
            min_upload_rate: 1024,
            upload_deadline: Duration::from_secs(30 * 60),
        }
    }
}

impl Limits {
    fn transport_config(&self) -> anyhow::Result<quinn::TransportConfig> {
        anyhow::ensure!(self.keep_alive < self.idle_timeout, "keep-alive must be shorter than the idle timeout");
        let mut t = quinn::TransportConfig::default();
        t.max_idle_timeout(Some(self.idle_timeout.try_into().context("idle timeout")?))
            .keep_alive_interval(Some(self.keep_alive))
            .max_concurrent_uni_streams(VarInt::from_u32(self.max_uni_streams))
            .max_concurrent_bidi_streams(VarInt::from_u32(1))
            .stream_receive_window(VarInt::from_u32(self.stream_window))
            .receive_window(VarInt::from_u32(self.connection_window))
            .send_window(self.connection_window as u64);
        Ok(t)
    }
}

pub use crate::metrics::ServerMetrics;

/// What the running server tells its owner.
#[derive(Debug, Clone)]
pub enum ServerEvent {
    RoundClosed { report: Arc<RoundReport>, checkpoint: Arc<Checkpoint> },
    Finished,
}

/// Everything needed to start a server.
pub struct ServerOptions {
    pub bind: SocketAddr,
    pub identity: Identity,
    /// Who may connect, and where a peer's id comes from.
    pub trust: Trust,
    pub engine: EngineConfig,
    pub method: Box<dyn ServerMethod>,
    /// Global blocks of round 1 when no checkpoint exists (may be empty).
    pub initial: Vec<ParamBlock>,
    pub limits: Limits,
    /// The database the engine commits to before it acknowledges anything, and resumes from;
    /// `None` keeps state in memory only (the simulator).
    pub store: Option<ServerStore>,
}

/// A running server.
pub struct ServerHandle {
    pub local_addr: SocketAddr,
    pub metrics: Arc<ServerMetrics>,
    pub events: mpsc::UnboundedReceiver<ServerEvent>,
    shutdown: watch::Sender<bool>,
    endpoint: quinn::Endpoint,
    task: JoinHandle<anyhow::Result<()>>,
}

impl ServerHandle {
    /// Stops accepting, closes every connection and waits for the engine task.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        let _ = self.shutdown.send(true);
        self.endpoint.close(VarInt::from_u32(0), b"server shutting down");
        let result = self.task.await.context("engine task panicked")?;
        tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await.ok();
        result
    }
}

enum Input {
    Hello {
        conn: u64,
        client: ClientId,
        /// SHA-256 of the certificate the peer showed (mutual TLS).
        fingerprint: Option<String>,
        msg: Message,
        out: mpsc::UnboundedSender<Outbound>,
    },
    Message {
        client: ClientId,
        msg: Message,
    },
    Closed {
        conn: u64,
        client: ClientId,
    },
}

#[derive(Debug)]
enum Outbound {
    Control(Arc<Vec<u8>>),
    Uni(Arc<Vec<u8>>),
    Close(Refusal),
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

type Crl = Option<rustls::pki_types::CertificateRevocationListDer<'static>>;

fn quic_server_config(
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

/// Serial numbers on the project CA's revocation list, as the server last read it.
pub type Revoked = Arc<std::collections::BTreeSet<String>>;

/// Under mutual TLS, re-reads the CRL when its file changes (every 2 s): new handshakes are
/// checked against the new list at once, and live connections whose certificate it revokes are
/// closed. Returns the list as a watch every connection follows.
///
/// A CRL that disappears or does not parse keeps the last good list (fail closed): one error
/// line when that starts, `anchorage_crl_stale` 1 until a good file is back (retried every
/// tick), and `anchorage_crl_reload_failures_total` counts each failed change.
fn watch_revocations(
    endpoint: &quinn::Endpoint,
    trust: &Trust,
    identity: &Identity,
    first: &Crl,
    transport: Arc<quinn::TransportConfig>,
    metrics: Arc<ServerMetrics>,
    refusals: Arc<RefusalLog>,
) -> anyhow::Result<watch::Receiver<Revoked>> {
    let serials = |crl: Option<&[u8]>| -> anyhow::Result<Revoked> {
        Ok(Arc::new(crl.map(crate::ca::revoked_serials).transpose()?.unwrap_or_default()))
    };
    let trust = trust.clone();
    let (tx, rx) = watch::channel(serials(first.as_deref())?);
    metrics.set_crl_stale(false);
    let Trust::ProjectCa { crl: Some(path), .. } = &trust else { return Ok(rx) };
    let (path, identity, endpoint) = (path.clone(), identity.clone(), endpoint.clone());
    let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let mut seen = modified(&path);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(2));
        // The error of the last failed reload while the list is stale.
        let mut stale: Option<String> = None;
        while !tx.is_closed() {
            tick.tick().await;
            let now = modified(&path);
            let changed = now != seen;
            if !changed && stale.is_none() {
                continue;
            }
            seen = now;
            let reloaded = trust.read_crl().and_then(|crl| {
                let list = serials(crl.as_deref())?;
                Ok((quic_server_config(&trust, &identity, crl, &transport, &refusals)?, list))
            });
            match reloaded {
                Ok((config, list)) => {
                    endpoint.set_server_config(Some(config));
                    if stale.take().is_some() {
                        metrics.set_crl_stale(false);
                        tracing::info!(crl = %path.display(), revoked = list.len(), "revocation list readable again; reloaded");
                    } else {
                        tracing::info!(crl = %path.display(), revoked = list.len(), "revocation list reloaded");
                    }
                    let _ = tx.send(list);
                }
                Err(e) => {
                    let error = format!("{e:#}");
                    if changed {
                        metrics.crl_reload_failed();
                    }
                    if stale.as_deref() != Some(error.as_str()) {
                        let kept = tx.borrow().len();
                        tracing::error!(
                            crl = %path.display(),
                            error = %error,
                            revoked = kept,
                            "REVOCATION LIST STALE: keeping the last good list ({kept} revoked); certificates \
                             revoked since are not refused until a good revoked.crl is back"
                        );
                        metrics.set_crl_stale(true);
                        stale = Some(error);
                    }
                }
            }
        }
    });
    Ok(rx)
}

/// Binds the endpoint and starts the engine. Resumes from the store's checkpoint if one exists.
pub async fn start(options: ServerOptions) -> anyhow::Result<ServerHandle> {
    if matches!(options.trust, Trust::InsecureDev) {
        tracing::warn!(
            "insecure development mode: clients present no certificate and name themselves; never use this in the field"
        );
    }
    let transport_config = Arc::new(options.limits.transport_config()?);
    let crl = options.trust.read_crl()?;
    // One rate limit for the refusal log lines, across revocation-list reloads.
    let refusals = Arc::new(RefusalLog::default());
    let server_config =
        quic_server_config(&options.trust, &options.identity, crl.clone(), &transport_config, &refusals)?;
    let socket =
        udp_socket(options.bind, options.limits.socket_buffer).with_context(|| format!("binding {}", options.bind))?;
    let endpoint_config = match &options.store {
        Some(store) => restart_aware_endpoint(&store.stateless_reset_key()?),
        None => quinn::EndpointConfig::default(),
    };
    let endpoint = quinn::Endpoint::new(endpoint_config, Some(server_config), socket, Arc::new(quinn::TokioRuntime))
        .with_context(|| format!("starting the QUIC endpoint on {}", options.bind))?;
    let local_addr = endpoint.local_addr()?;

    let (engine, metrics) = match &options.store {
        Some(store) => recover(store, &options.engine, options.method, options.initial)?,
        None => (Engine::new(options.engine.clone(), options.method, options.initial), Arc::new(ServerMetrics::new())),
    };
    let (input_tx, input_rx) = mpsc::unbounded_channel();
    let (event_tx, events) = mpsc::unbounded_channel();
    let (shutdown, shutdown_rx) = watch::channel(false);
    let max_frame = options.engine.max_frame_bytes as usize;

    let revoked = watch_revocations(
        &endpoint,
        &options.trust,
        &options.identity,
        &crl,
        transport_config,
        metrics.clone(),
        refusals.clone(),
    )?;
    let accept_endpoint = endpoint.clone();
    let accept_metrics = metrics.clone();
    let limits = options.limits.clone();
    tokio::spawn(async move {
        let mut next_conn = 0u64;
        let handshakes = Arc::new(std::sync::Mutex::new(HashMap::new()));
        while let Some(incoming) = accept_endpoint.accept().await {
            // Bounded before any cryptography runs: connections in all, handshakes per host.
            // Each refusal is counted; the log says it at most once a minute per reason and address.
            let remote = incoming.remote_address();
            let logged = |reason| refusals.note(reason, &remote.ip().to_string(), std::time::Instant::now());
            if accept_endpoint.open_connections() >= limits.max_connections {
                accept_metrics.refused(reason::CONNECTION_LIMIT);
                if let Some(since) = logged(reason::CONNECTION_LIMIT) {
                    let more = RefusalLog::since_text(since);
                    tracing::warn!(%remote, max = limits.max_connections, "connection limit reached; refused{more}");
                }
                incoming.refuse();
                continue;
            }
            let Some(slot) = HandshakeSlot::take(&handshakes, remote.ip(), limits.max_handshakes_per_ip) else {
                accept_metrics.refused(reason::HANDSHAKE_LIMIT);
                if let Some(since) = logged(reason::HANDSHAKE_LIMIT) {
                    let more = RefusalLog::since_text(since);
                    let max = limits.max_handshakes_per_ip;
                    tracing::warn!(%remote, max, "too many handshakes from one address; refused{more}");
                }
                incoming.refuse();
                continue;
            };
            next_conn += 1;
            accept_metrics.connection_accepted();
            let ctx = ConnCtx {
                id: next_conn,
                inputs: input_tx.clone(),
                metrics: accept_metrics.clone(),
                max_frame,
                limits: limits.clone(),
                revoked: revoked.clone(),
                refusals: refusals.clone(),
            };
            tokio::spawn(async move {
                let remote = incoming.remote_address();
                if let Err(e) = ctx.run(incoming, slot).await {
                    tracing::debug!(%remote, error = %format!("{e:#}"), "connection ended");
                }
            });
        }
    });

    let task =
        tokio::spawn(run_engine(engine, input_rx, event_tx, shutdown_rx, options.store, metrics.clone(), max_frame));
    Ok(ServerHandle { local_addr, metrics, events, shutdown, endpoint, task })
}

/// The engine a store resumes (the open round and its accepted updates included), and the
/// metrics that outlive a restart: the totals of its cost ledger, when each client was last
/// seen, when the last round closed. A new federation's initial version is stored first.
fn recover(
    store: &ServerStore,
    config: &EngineConfig,
    method: Box<dyn ServerMethod>,
    initial: Vec<ParamBlock>,
) -> anyhow::Result<(Engine, Arc<ServerMetrics>)> {
    let engine = match store.recover(method.name())? {
        Some(recovered) => {
            tracing::info!(
                round = recovered.checkpoint.round,
                open = recovered.open.as_ref().map(|o| o.round),
                accepted = recovered.pending.len(),
                db = %store.db_path().display(),
                "resuming from the database"
            );
            Engine::recover(config.clone(), method, recovered)
        }
        None => {
            let engine = Engine::new(config.clone(), method, initial);
            store.save_initial(&engine.checkpoint())?;
            engine
        }
    };
    let metrics = Arc::new(ServerMetrics::new());
    store.load_ledger()?.iter().for_each(|r| metrics.record_cost(r));
    store.clients_last_seen()?.iter().for_each(|(client, at)| metrics.seen(client, *at));
    if let Some(at) = store.last_round_closed_at()? {
        metrics.set_last_round_closed_at(at);
    }
    Ok((engine, metrics))
}

/// Commits one engine state change on a blocking thread; an error stops the server, because
/// an ack or a broadcast must never run ahead of what the database holds.
async fn commit(store: &ServerStore, persist: Persist, metrics: &ServerMetrics) -> anyhow::Result<()> {
    let store = store.clone();
    let result = tokio::task::spawn_blocking(move || store.commit(&persist)).await.context("store task panicked")?;
    if let Err(e) = result {
        metrics.store_error();
        tracing::error!(error = %e, "could not commit to the database; stopping before anything is acknowledged");
        return Err(anyhow::Error::new(e).context("committing to the database"));
    }
    Ok(())
}

async fn run_engine(
    engine: Engine,
    mut inputs: mpsc::UnboundedReceiver<Input>,
    events: mpsc::UnboundedSender<ServerEvent>,
    mut shutdown: watch::Receiver<bool>,
    store: Option<ServerStore>,
    metrics: Arc<ServerMetrics>,
    max_frame: usize,
) -> anyhow::Result<()> {
    let mut shell = EngineShell {
        engine,
        events,
        store,
        metrics,
        max_frame,
        start: Instant::now(),
        conns: HashMap::new(),
        fingerprints: HashMap::new(),
        departed: Vec::new(),
        unacked: std::collections::HashSet::new(),
        opened_since_close: false,
        flaps: FlapGuard::default(),
    };
    let mut departures_tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        // Carry out what the engine asked for first: recovery may already have closed a round.
        while let Some(action) = shell.engine.poll_action() {
            shell.act(action).await?;
        }
        shell.metrics.set_rollback_evidence(shell.engine.devices_ahead(), shell.engine.rollback_suspected().is_some());
        shell.metrics.set_engine_drops(shell.engine.stats().dropped_cost_records);
        let deadline = shell.engine.poll_timeout().map(|t| shell.start + t);
        tokio::select! {
            input = inputs.recv() => {
                let Some(input) = input else { break };
                shell.on_input(input);
            }
            _ = sleep_until(deadline) => shell.engine.handle_timeout(shell.start.elapsed()),
            _ = departures_tick.tick() => {
                let _ = touch_clients(&shell.store, std::mem::take(&mut shell.departed));
            }
            _ = shutdown.changed() => break,
        }
    }
    // The clients still connected were heard from until now.
    let at = unix_now();
    let mut departed = shell.departed;
    departed.extend(shell.conns.into_keys().map(|c| (c, at)));
    if let Some(done) = touch_clients(&shell.store, departed) {
        let _ = done.await;
    }
    Ok(())
}

/// The engine's task: the sans-IO engine and what its shell keeps around it (connections, the
/// store, the metrics, acks owed).
struct EngineShell {
    engine: Engine,
    events: mpsc::UnboundedSender<ServerEvent>,
    store: Option<ServerStore>,
    metrics: Arc<ServerMetrics>,
    max_frame: usize,
    /// The engine's clock starts here.
    start: Instant,
    conns: HashMap<ClientId, (u64, mpsc::UnboundedSender<Outbound>)>,
    fingerprints: HashMap<ClientId, String>,
    /// Departures' last-seen times, written on the tick in one transaction: a thousand devices
    /// leaving at once would otherwise queue a thousand blocking threads on the store's mutex
    /// (each thread's stack and arena held memory after they left).
    departed: Vec<(ClientId, i64)>,
    /// Accepted updates whose ack has not gone out yet: an ack for anything else re-acknowledges
    /// a duplicate.
    unacked: std::collections::HashSet<(ClientId, u64)>,
    /// Buffered mode opens no rounds: the sampled gauge follows its versions.
    opened_since_close: bool,
    /// When each client's live connection was last replaced by a newer one, and ids refused for
    /// a while because two holders of one certificate kept evicting each other.
    flaps: FlapGuard,
}

/// Two devices holding one certificate evict each other's connection over and over (each
/// reconnect replaces the other's live connection). [`FLAP_LIMIT`] replacements inside
/// [`FLAP_WINDOW`] are a security event: both are refused for [`FLAP_QUARANTINE`], the error log
/// tells the operator to revoke the certificate, and `anchorage_certificate_conflicts_total`
/// counts it. A device that merely reconnects (a restart, a new address) replaces its old
/// connection once.
#[derive(Default)]
struct FlapGuard {
    replaced: HashMap<ClientId, std::collections::VecDeque<Instant>>,
    quarantined: HashMap<ClientId, Instant>,
}

const FLAP_LIMIT: usize = 4;
const FLAP_WINDOW: Duration = Duration::from_secs(60);
const FLAP_QUARANTINE: Duration = Duration::from_secs(600);

impl FlapGuard {
    /// Whether `client` is refused now.
    fn quarantined(&mut self, client: &str, now: Instant) -> bool {
        match self.quarantined.get(client) {
            Some(until) if *until > now => true,
            Some(_) => {
                self.quarantined.remove(client);
                false
            }
            None => false,
        }
    }

    /// A live connection of `client` was replaced; true when that makes it a conflict.
    fn replaced(&mut self, client: &str, now: Instant) -> bool {
        let times = self.replaced.entry(client.into()).or_default();
        times.push_back(now);
        while times.front().is_some_and(|t| now.duration_since(*t) > FLAP_WINDOW) {
            times.pop_front();
        }
        if times.len() < FLAP_LIMIT {
            return false;
        }
        self.replaced.remove(client);
        self.quarantined.insert(client.into(), now + FLAP_QUARANTINE);
        true
    }
}

impl EngineShell {
    /// Carries out one of the engine's actions (a state change is committed before its ack goes out).
    async fn act(&mut self, action: Action) -> anyhow::Result<()> {
        let metrics = &self.metrics;
        match action {
            Action::Send { to, msg } => {
                match &msg {
                    Message::Refusal(r) => metrics.refused(refusal_reason(r.reason)),
                    Message::Ack(ack) if !ack.aggregated => metrics.update(outcome::LATE),
                    Message::Ack(ack) => {
                        if !self.unacked.remove(&(to.clone(), ack.round)) {
                            metrics.update(outcome::DUPLICATE);
                        }
                    }
                    _ => {}
                }
                send(&self.conns, &to, &msg, self.max_frame, Outbound::Control, metrics);
            }
            Action::Broadcast { to, msg } => match encode_frame(&msg, self.max_frame) {
                Ok(frame) => {
                    let frame = Arc::new(frame);
                    let mut sent = 0;
                    for client in to {
                        if let Some((_, out)) = self.conns.get(&client) {
                            sent += 1;
                            let _ = out.send(Outbound::Uni(frame.clone()));
                        }
                    }
                    metrics.frames_out(frame.len(), sent);
                }
                Err(e) => tracing::error!(error = %e, "broadcast does not fit in a frame; raise max_frame_bytes"),
            },
            Action::Close { client, refusal } => {
                metrics.refused(refusal_reason(refusal.reason));
                tracing::warn!(%client, reason = ?refusal.reason, detail = %refusal.detail, "closing client");
                if let Some((_, out)) = self.conns.remove(&client) {
                    let _ = out.send(Outbound::Close(refusal));
                }
            }
            Action::Persist(persist) => self.persist(persist).await?,
            Action::Ledger(record) => append_ledger(self.store.clone(), metrics, record).await,
            Action::RoundClosed(report, checkpoint) => {
                metrics.round_closed(&report);
                if !std::mem::take(&mut self.opened_since_close) {
                    metrics.set_sampled(report.sampled);
                }
                let _ = self.events.send(ServerEvent::RoundClosed { report, checkpoint });
            }
            Action::Finished => {
                let _ = self.events.send(ServerEvent::Finished);
            }
        }
        Ok(())
    }

    /// Commits a state change to the store (the ack that depends on it goes out after).
    async fn persist(&mut self, mut persist: Persist) -> anyhow::Result<()> {
        if let Persist::Seen { client, fingerprint } = &mut persist {
            *fingerprint = self.fingerprints.get(client).cloned();
        }
        let counted = match &persist {
            Persist::Accepted(a) => Some((a.client.clone(), a.update.round)),
            Persist::Opened(opened) => {
                self.metrics.set_sampled(opened.sampled.len());
                self.opened_since_close = true;
                None
            }
            _ => None,
        };
        if let Some(store) = &self.store {
            commit(store, persist, &self.metrics).await?;
        }
        if let Some(key) = counted {
            self.metrics.update(outcome::ACCEPTED);
            self.unacked.insert(key);
        }
        Ok(())
    }

    /// What a connection task reports: a hello (a newer connection replaces an older one), a
    /// message, a closed connection.
    fn on_input(&mut self, input: Input) {
        let now = self.start.elapsed();
        match input {
            Input::Hello { conn, client, fingerprint, msg, out } => {
                let at = Instant::now();
                if self.flaps.quarantined(&client, at) {
                    self.metrics.refused(crate::metrics::reason::CERTIFICATE_CONFLICT);
                    let _ = out.send(Outbound::Close(conflict_refusal(&client)));
                    return;
                }
                if let Some(f) = fingerprint {
                    self.fingerprints.insert(client.clone(), f);
                }
                if let Some((old, old_out)) = self.conns.insert(client.clone(), (conn, out)) {
                    tracing::info!(%client, old, conn, "client reconnected; closing its older connection");
                    let _ = old_out.send(Outbound::Close(Refusal {
                        reason: RefusalReason::Duplicate,
                        detail: "replaced by a newer connection".into(),
                    }));
                    if self.flaps.replaced(&client, at) {
                        tracing::error!(
                            %client,
                            replacements = FLAP_LIMIT,
                            window_s = FLAP_WINDOW.as_secs(),
                            refused_s = FLAP_QUARANTINE.as_secs(),
                            "SECURITY: two live connections keep presenting the certificate of `{client}`: both are refused. \
                             The certificate is in two devices' hands: revoke it (`anchorage ca revoke {client}`) and issue the \
                             real device a new one"
                        );
                        self.metrics.certificate_conflict();
                        if let Some((_, current)) = self.conns.remove(&client) {
                            let _ = current.send(Outbound::Close(conflict_refusal(&client)));
                        }
                        self.metrics.set_connected(self.conns.len());
                        self.engine.handle_disconnect(now, &client);
                        return;
                    }
                }
                self.metrics.set_connected(self.conns.len());
                self.metrics.seen(&client, unix_now());
                self.engine.handle_message(now, &client, msg);
            }
            Input::Message { client, msg } => {
                self.metrics.seen(&client, unix_now());
                self.engine.handle_message(now, &client, msg)
            }
            Input::Closed { conn, client } => {
                if self.conns.get(&client).is_some_and(|(c, _)| *c == conn) {
                    self.conns.remove(&client);
                    self.metrics.set_connected(self.conns.len());
                    let at = unix_now();
                    self.metrics.seen(&client, at);
                    self.departed.push((client.clone(), at));
                    self.engine.handle_disconnect(now, &client);
                }
            }
        }
    }
}

fn conflict_refusal(client: &str) -> Refusal {
    Refusal {
        reason: RefusalReason::Duplicate,
        detail: format!(
            "the certificate of `{client}` is in use by two devices at once; it is refused until the operator revokes it"
        ),
    }
}

/// Appends a cost record to the ledger; only records new to it count in the metrics (a resent
/// report is not counted twice).
async fn append_ledger(
    store: Option<ServerStore>,
    metrics: &ServerMetrics,
    record: anchorage_shared::ledger::CostRecord,
) {
    let Some(store) = store else {
        metrics.record_cost(&record);
        return;
    };
    match tokio::task::spawn_blocking(move || store.append_ledger(&[record])).await {
        Ok(Ok(new)) => new.iter().for_each(|r| metrics.record_cost(r)),
        Ok(Err(e)) => {
            metrics.store_error();
            tracing::error!(error = %e, "could not append to the cost ledger");
        }
        Err(e) => tracing::error!(error = %e, "ledger task failed"),
    }
}

/// Records in the client registry when clients were last heard from (on a blocking thread; a
/// failure is logged and counted, never fatal: it only makes a last-seen time older).
fn touch_clients(store: &Option<ServerStore>, seen: Vec<(ClientId, i64)>) -> Option<JoinHandle<()>> {
    let store = store.clone()?;
    if seen.is_empty() {
        return None;
    }
    Some(tokio::task::spawn_blocking(move || {
        if let Err(e) = store.touch_clients(&seen) {
            tracing::warn!(error = %e, clients = seen.len(), "could not record when clients were last seen");
        }
    }))
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

fn send(
    conns: &HashMap<ClientId, (u64, mpsc::UnboundedSender<Outbound>)>,
    to: &str,
    msg: &Message,
    max_frame: usize,
    wrap: fn(Arc<Vec<u8>>) -> Outbound,
    metrics: &ServerMetrics,
) {
    let Some((_, out)) = conns.get(to) else { return };
    match encode_frame(msg, max_frame) {
        Ok(frame) => {
            metrics.frames_out(frame.len(), 1);
            let _ = out.send(wrap(Arc::new(frame)));
        }
        Err(e) => tracing::error!(error = %e, to, "message does not fit in a frame"),
    }
}

/// What a connection task needs.
struct ConnCtx {
    id: u64,
    inputs: mpsc::UnboundedSender<Input>,
    metrics: Arc<ServerMetrics>,
    max_frame: usize,
    limits: Limits,
    revoked: watch::Receiver<Revoked>,
    /// The rate limit of refused handshakes' log lines.
    refusals: Arc<RefusalLog>,
}

/// One handshake in progress from one IP address; the count goes down when it is dropped.
struct HandshakeSlot {
    counts: Arc<std::sync::Mutex<HashMap<std::net::IpAddr, usize>>>,
    ip: std::net::IpAddr,
}

impl HandshakeSlot {
    fn take(
        counts: &Arc<std::sync::Mutex<HashMap<std::net::IpAddr, usize>>>,
        ip: std::net::IpAddr,
        max: usize,
    ) -> Option<Self> {
        let mut map = counts.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(ip).or_default();
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Self { counts: counts.clone(), ip })
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let mut map = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

/// Who a peer's certificate says it is (mutual TLS).
struct Certified {
    id: String,
    serial: String,
    /// SHA-256 (hex) of the certificate, for the client registry.
    fingerprint: String,
}

/// The certificate a peer showed, read once; `None` when it showed none (development mode).
fn certified(conn: &quinn::Connection) -> anyhow::Result<Option<Certified>> {
    let Some(identity) = conn.peer_identity() else { return Ok(None) };
    let chain = identity
        .downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
        .map_err(|_| anyhow::anyhow!("the peer identity is not a certificate chain"))?;
    let leaf = chain.first().context("an empty certificate chain")?;
    let (id, serial) = crate::ca::peer_id(leaf)?;
    let digest = ring::digest::digest(&ring::digest::SHA256, leaf.as_ref());
    let fingerprint = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    Ok(Some(Certified { id, serial, fingerprint }))
}

/// Completes when `serial` appears on the revocation list; never without a serial.
async fn revoked(list: &mut watch::Receiver<Revoked>, serial: Option<&str>) {
    let Some(serial) = serial else { return std::future::pending().await };
    if list.wait_for(|l| l.contains(serial)).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The refusal that answers a frame that could not be read.
fn refusal_for(e: &FrameIoError) -> Refusal {
    let reason = match e {
        FrameIoError::Decode(DecodeError::WrongVersion { .. }) => RefusalReason::VersionMismatch,
        FrameIoError::Decode(DecodeError::Oversized { .. }) => RefusalReason::TooLarge,
        FrameIoError::Decode(DecodeError::Tensor(_)) => RefusalReason::BadTensor,
        _ => RefusalReason::Malformed,
    };
    Refusal { reason, detail: e.to_string() }
}

impl ConnCtx {
    async fn run(self, incoming: quinn::Incoming, handshake: HandshakeSlot) -> anyhow::Result<()> {
        let remote = incoming.remote_address();
        let conn = match incoming.await {
            Ok(conn) => conn,
            Err(e) => {
                self.handshake_failed(remote, &e);
                return Ok(());
            }
        };
        drop(handshake);
        // Mutual TLS: the handshake proved the certificate; its id is who this peer is.
        let certified = match certified(&conn) {
            Ok(c) => c,
            Err(e) => {
                self.metrics.refused(reason::BAD_CERTIFICATE);
                tracing::warn!(%remote, error = %format!("{e:#}"), "refusing a certificate without a usable id");
                conn.close(VarInt::from_u32(1), b"certificate names no id");
                return Ok(());
            }
        };
        let (mut control_send, mut control_recv) = tokio::time::timeout(self.limits.hello_timeout, conn.accept_bi())
            .await
            .context("no control stream in time")??;
        let Some(hello) = self.read_hello(&conn, &mut control_send, &mut control_recv).await? else {
            return Ok(());
        };
        // Under mutual TLS the id is the certificate's and the engine refuses a hello that names
        // another; in the development mode the hello names the client.
        let Message::Hello(h) = &hello else { unreachable!("matched above") };
        let serial = certified.as_ref().map(|c| c.serial.clone());
        let fingerprint = certified.as_ref().map(|c| c.fingerprint.clone());
        let client = certified.map_or_else(|| h.client_id.clone(), |c| c.id);
        if serial.as_ref().is_some_and(|s| self.revoked.borrow().contains(s)) {
            let refusal = Refusal { reason: RefusalReason::NotEnrolled, detail: "certificate revoked".into() };
            return self.refuse(&conn, &mut control_send, refusal, Some(reason::REVOKED), &client).await;
        }
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        self.inputs.send(Input::Hello {
            conn: self.id,
            client: client.clone(),
            fingerprint,
            msg: hello,
            out: out_tx.clone(),
        })?;
        tracing::info!(%client, %remote, "client connected");

        let mut writer = tokio::spawn(write_loop(conn.clone(), control_send, out_rx, self.limits.read_stall));
        let control = self.read_loop(control_recv, client.clone(), out_tx.clone());
        let uploads = self.accept_uploads(&conn, client.clone(), out_tx.clone());
        let mut revocations = self.revoked.clone();
        let refused = tokio::select! {
            refused = control => refused,
            refused = uploads => refused,
            _ = conn.closed() => false,
            _ = revoked(&mut revocations, serial.as_deref()) => {
                tracing::warn!(%client, "certificate revoked while connected; closing");
                self.metrics.refused(reason::REVOKED);
                let refusal = Refusal { reason: RefusalReason::NotEnrolled, detail: "certificate revoked".into() };
                let _ = out_tx.send(Outbound::Close(refusal));
                true
            }
        };
        if refused {
            // Let the writer deliver the refusal and close the connection itself.
            let _ = tokio::time::timeout(Duration::from_secs(3), &mut writer).await;
        }
        writer.abort();
        let _ = self.inputs.send(Input::Closed { conn: self.id, client: client.clone() });
        let why = conn.close_reason().map_or_else(|| "the connection is still open".to_string(), |e| e.to_string());
        tracing::info!(%client, reason = %why, "client disconnected");
        Ok(())
    }

    /// A handshake that did not complete. One this server's TLS refused (a certificate it does
    /// not accept, none at all) is counted under its reason every time, and logged at most once
    /// a minute per reason and device (the verifier logs a certificate's verdict with the id the
    /// certificate names) or, for the others, per reason and address.
    fn handshake_failed(&self, remote: SocketAddr, e: &quinn::ConnectionError) {
        let crypto = |code: u64| (0x100..=0x1ff).contains(&code).then(|| (code - 0x100) as u8);
        let now = std::time::Instant::now();
        let ip = remote.ip().to_string();
        match e {
            // Our TLS ended it, with this alert.
            quinn::ConnectionError::TransportError(t) => {
                let Some(alert) = crypto(u64::from(t.code)) else {
                    tracing::debug!(%remote, error = %e, "handshake did not complete");
                    return;
                };
                let reason = crate::tls::alert_reason(alert);
                self.metrics.refused(reason);
                if crate::tls::alert_is_certificate_verdict(alert) {
                    // The verifier logged it, with the id the certificate names.
                    tracing::debug!(%remote, reason, alert, error = %e, "handshake refused");
                } else if let Some(since) = self.refusals.note(reason, &ip, now) {
                    let what = if reason == reason::NO_CERTIFICATE {
                        "the device showed no certificate: give its client.toml `cert` and `key` from this \
                         project's CA (`anchorage provision`)"
                    } else {
                        "TLS could not agree with the peer (an old or foreign client?)"
                    };
                    tracing::warn!(
                        %remote,
                        reason,
                        alert,
                        error = %e,
                        more_refused_since_last_line = since,
                        "handshake refused ({reason}) from {ip}: {what}{}",
                        RefusalLog::since_text(since)
                    );
                }
            }
            // The peer's TLS ended it: a device that does not trust this server's certificate.
            quinn::ConnectionError::ConnectionClosed(c) if crypto(u64::from(c.error_code)).is_some() => {
                if let Some(since) = self.refusals.note("peer_refused_server", &ip, now) {
                    tracing::warn!(
                        %remote,
                        error = %e,
                        more_since_last_line = since,
                        "a device at {ip} refused this server's certificate: check that it names the address the \
                         devices dial (their `server_name`) and comes from the CA in their `server_cert`{}",
                        RefusalLog::since_text(since)
                    );
                }
            }
            _ => tracing::debug!(%remote, error = %e, "handshake did not complete"),
        }
    }

    /// The connection's first message, which must be a hello (in time, readable); anything else
    /// is refused and gives `None`, as does a stream that ends first.
    async fn read_hello(
        &self,
        conn: &quinn::Connection,
        control_send: &mut quinn::SendStream,
        control_recv: &mut quinn::RecvStream,
    ) -> anyhow::Result<Option<Message>> {
        let remote = conn.remote_address().ip().to_string();
        let first =
            tokio::time::timeout(self.limits.hello_timeout, read_frame_limited(control_recv, &self.control_limits()))
                .await
                .context("no hello in time")?;
        match first {
            Ok(Some((msg @ Message::Hello(_), n))) => {
                self.count_in(n);
                Ok(Some(msg))
            }
            Ok(Some((other, _))) => {
                let refusal = Refusal {
                    reason: RefusalReason::NotEnrolled,
                    detail: format!("expected hello, got {}", other.kind_name()),
                };
                self.refuse(conn, control_send, refusal, None, &remote).await.map(|()| None)
            }
            Ok(None) => Ok(None),
            Err(e) => {
                self.metrics.decode_error();
                self.refuse(conn, control_send, refusal_for(&e), None, &remote).await.map(|()| None)
            }
        }
    }

    /// The control stream carries only small messages.
    fn control_limits(&self) -> ReadLimits<'static> {
        let small = (self.limits.max_control_frame as usize).min(self.max_frame);
        ReadLimits {
            max_frame: small,
            max_small: small,
            large_kinds: &[],
            stall: Some(self.limits.read_stall),
            pace: None,
        }
    }

    /// An upload stream carries one update, up to the engine's frame limit.
    fn upload_limits(&self) -> ReadLimits<'static> {
        let small = (self.limits.max_control_frame as usize).min(self.max_frame);
        ReadLimits {
            max_frame: self.max_frame,
            max_small: small,
            large_kinds: &[KIND_UPDATE],
            stall: Some(self.limits.read_stall),
            pace: Some(Pace {
                min_bytes_per_sec: self.limits.min_upload_rate,
                grace: self.limits.read_stall,
                deadline: self.limits.upload_deadline,
            }),
        }
    }

    fn count_in(&self, bytes: usize) {
        self.metrics.frame_in(bytes);
    }

    /// Refuses a connection: `label` counts it under another reason than the refusal's own.
    async fn refuse(
        &self,
        conn: &quinn::Connection,
        control: &mut quinn::SendStream,
        refusal: Refusal,
        label: Option<&'static str>,
        who: &str,
    ) -> anyhow::Result<()> {
        let label = label.unwrap_or(refusal_reason(refusal.reason));
        self.metrics.refused(label);
        // Counted every time; logged at most once a minute per reason and peer.
        if let Some(since) = self.refusals.note(label, who, std::time::Instant::now()) {
            tracing::warn!(
                who,
                reason = ?refusal.reason,
                detail = %refusal.detail,
                more_refused_since_last_line = since,
                "refusing connection{}",
                RefusalLog::since_text(since)
            );
        }
        if let Ok(frame) = encode_frame(&Message::Refusal(refusal), self.max_frame) {
            let _ = write_frame(control, &frame).await;
            let _ = control.finish();
            let _ = tokio::time::timeout(Duration::from_secs(1), control.stopped()).await;
        }
        conn.close(VarInt::from_u32(1), b"refused");
        Ok(())
    }

    /// Reads control frames until the stream ends. A bad frame closes the connection with a
    /// refusal; returns whether that happened.
    async fn read_loop(
        &self,
        mut recv: quinn::RecvStream,
        client: ClientId,
        out: mpsc::UnboundedSender<Outbound>,
    ) -> bool {
        loop {
            match read_frame_limited(&mut recv, &self.control_limits()).await {
                Ok(Some((msg, n))) => {
                    self.count_in(n);
                    if self.inputs.send(Input::Message { client: client.clone(), msg }).is_err() {
                        return false;
                    }
                }
                Ok(None) => return false,
                Err(e) => return self.bad_frame(&client, &e, &out),
            }
        }
    }

    /// Refuses a bad frame (returns true), or ignores a stream that merely broke off (false).
    fn bad_frame(&self, client: &str, e: &FrameIoError, out: &mpsc::UnboundedSender<Outbound>) -> bool {
        if let FrameIoError::Io(io) = e
            && io.kind() != std::io::ErrorKind::TimedOut
        {
            return false; // the connection went away; nothing to refuse
        }
        let refusal = refusal_for(e);
        self.metrics.decode_error();
        self.metrics.refused(refusal_reason(refusal.reason));
        tracing::warn!(client, error = %e, "bad frame from client");
        let _ = out.send(Outbound::Close(refusal));
        true
    }

    /// Accepts upload streams, one frame each; returns whether a bad one was refused.
    async fn accept_uploads(
        &self,
        conn: &quinn::Connection,
        client: ClientId,
        out: mpsc::UnboundedSender<Outbound>,
    ) -> bool {
        while let Ok(mut recv) = conn.accept_uni().await {
            match read_frame_limited(&mut recv, &self.upload_limits()).await {
                Ok(Some((msg, n))) => {
                    self.count_in(n);
                    if self.inputs.send(Input::Message { client: client.clone(), msg }).is_err() {
                        return false;
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    if self.bad_frame(&client, &e, &out) {
                        return true;
                    }
                }
            }
        }
        false
    }
}

/// Writes what the engine sends one client: control frames in order on the control stream, each
/// broadcast on its own uni stream (a large block never holds up a control message). A client
/// that stops reading is dropped, not buffered for: a write that makes no progress for `stall`
/// closes the connection, and a newer broadcast cancels (resets) one the client has not read
/// yet, so the server holds at most one broadcast's flow-control window per client.
async fn write_loop(
    conn: quinn::Connection,
    mut control: quinn::SendStream,
    mut out: mpsc::UnboundedReceiver<Outbound>,
    stall: Duration,
) {
    let mut unread_broadcast: Option<tokio::sync::oneshot::Sender<()>> = None;
    while let Some(item) = out.recv().await {
        match item {
            Outbound::Control(frame) => match tokio::time::timeout(stall, write_frame(&mut control, &frame)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return,
                Err(_) => return drop_slow_reader(&conn, "control"),
            },
            Outbound::Uni(frame) => {
                if let Some(cancel) = unread_broadcast.take() {
                    let _ = cancel.send(());
                }
                let (cancel, cancelled) = tokio::sync::oneshot::channel();
                unread_broadcast = Some(cancel);
                tokio::spawn(send_broadcast(conn.clone(), frame, cancelled, stall));
            }
            Outbound::Close(refusal) => {
                if let Ok(frame) = encode_frame(&Message::Refusal(refusal), usize::MAX) {
                    let _ = tokio::time::timeout(Duration::from_secs(1), write_frame(&mut control, &frame)).await;
                    let _ = control.finish();
                    let _ = tokio::time::timeout(Duration::from_secs(1), control.stopped()).await;
                }
                conn.close(VarInt::from_u32(1), b"refused");
                return;
            }
        }
    }
}

/// One broadcast on its own stream, in chunks, each of which must be taken within `stall`. The
/// chunks are slices of the one encoded frame that every recipient shares (`Bytes`): quinn keeps
/// them until they are acknowledged without copying, so a thousand connections that do not read
/// hold one broadcast between them, not a thousand copies of it.
async fn send_broadcast(
    conn: quinn::Connection,
    frame: Arc<Vec<u8>>,
    mut cancelled: tokio::sync::oneshot::Receiver<()>,
    stall: Duration,
) {
    let Ok(mut stream) = conn.open_uni().await else { return };
    let frame = bytes::Bytes::from_owner(SharedFrame(frame));
    const CHUNK: usize = 64 << 10;
    for start in (0..frame.len()).step_by(CHUNK) {
        let chunk = frame.slice(start..(start + CHUNK).min(frame.len()));
        tokio::select! {
            written = tokio::time::timeout(stall, stream.write_chunk(chunk)) => match written {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return,
                Err(_) => return drop_slow_reader(&conn, "broadcast"),
            },
            _ = &mut cancelled => {
                let _ = stream.reset(VarInt::from_u32(0));
                return;
            }
        }
    }
    let _ = stream.finish();
    let _ = stream.stopped().await;
}

/// An encoded frame shared by every connection, as the owner of `Bytes` slices.
struct SharedFrame(Arc<Vec<u8>>);

impl AsRef<[u8]> for SharedFrame {
    fn as_ref(&self) -> &[u8] {
        self.0.as_slice()
    }
}

fn drop_slow_reader(conn: &quinn::Connection, what: &str) {
    tracing::warn!(remote = %conn.remote_address(), stream = what, "a client that does not read is dropped");
    conn.close(VarInt::from_u32(2), b"not reading");
}
