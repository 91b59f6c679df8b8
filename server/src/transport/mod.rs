//! The tokio + quinn shell around the [`Engine`]: accepts connections,
//! turns frames into engine events, carries out the engine's actions. Control messages ride one
//! bi stream per client (opened by the client, hello first); broadcasts go out and updates come
//! in on uni streams, so a large block never holds up a control message.
//!
//! Bad input never stops the server: a frame that does not decode is refused with a reason
//! (logged here, counted in [`ServerMetrics`]) and only that client's connection is closed.
//!
//! - [`limits`]: the bounds a connection lives within ([`Limits`]).
//! - [`endpoint`]: the QUIC endpoint, its TLS config, its restart-proof keys and its renewal.
//! - [`revocation`]: the revocation list, followed while the server runs.
//! - [`accept`]: the accept loop and its bounds on connections and handshakes.
//! - [`connection`]: one connection: handshake, identity, hello, refusals.
//! - [`streams`]: a connection's stream I/O (control, uploads, broadcasts).
//! - [`engine_loop`]: the task that drives the engine and carries out its actions.
//! - [`flaps`]: two devices sharing one certificate.
//! - [`transfers`]: resumable uploads, and what interrupted ones leave.
//! - [`saved_uploads`]: what interrupted uploads leave, across a graceful restart.
//! - [`broadcasts`]: resumable broadcasts, to the devices that take them.

mod accept;
mod broadcasts;
mod connection;
mod endpoint;
mod engine_loop;
mod flaps;
mod limits;
mod revocation;
mod saved_uploads;
mod streams;
mod transfers;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::priority::Priority;
use anchorage_shared::protocol::{Message, Refusal};
use anchorage_shared::tensor::ParamBlock;
use anyhow::Context;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::engine::{Checkpoint, ClientId, Engine, EngineConfig, RoundReport};
use crate::methods::ServerMethod;
use crate::store::ServerStore;
use crate::tls::{RefusalLog, Trust};
use anchorage_pki::Identity;

pub use limits::Limits;
pub use revocation::Revoked;

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
    listener: endpoint::Listener,
    task: JoinHandle<anyhow::Result<()>>,
    uploads: Arc<transfers::KeptUploads>,
    /// The store's folder, where interrupted uploads are saved at shutdown.
    state: Option<std::path::PathBuf>,
    inputs: mpsc::UnboundedSender<Input>,
    /// A relay's: what its uplink starts from (`None` at the root).
    pub relay: Option<RelayStart>,
}

/// What a relay's uplink takes from the server it runs beside, at start.
pub struct RelayStart {
    /// Its devices' cost records once its own ledger holds them, for its parent's.
    pub costs: mpsc::UnboundedReceiver<anchorage_shared::ledger::CostRecord>,
    /// The last round it closed, as its store resumed it (0: none).
    pub last_round: u64,
    /// That round's partial aggregate, sent up again until the parent acks it.
    pub partial: Option<anchorage_shared::protocol::Partial>,
}

impl ServerHandle {
    /// A relay's parent broadcast a round: the relay's engine opens it.
    pub fn parent_round(&self, broadcast: anchorage_shared::protocol::Broadcast) {
        let _ = self.inputs.send(Input::Parent(broadcast));
    }

    /// The handle a relay's uplink keeps to its engine.
    pub fn relay_control(&self) -> RelayControl {
        RelayControl { inputs: self.inputs.clone() }
    }

    /// A relay's parent said goodbye: the relay's devices are told, then `Finished`.
    pub fn parent_goodbye(&self, reason: String) {
        let _ = self.inputs.send(Input::ParentGoodbye(reason));
    }

    /// Stops accepting, closes every connection, waits for the engine task, and saves what
    /// interrupted uploads left for the next start ([`saved_uploads`]).
    pub async fn shutdown(self) -> anyhow::Result<()> {
        let _ = self.shutdown.send(true);
        self.listener.close(b"server shutting down");
        let result = self.task.await.context("engine task panicked")?;
        tokio::time::timeout(Duration::from_secs(2), self.listener.current().wait_idle()).await.ok();
        if let Some(state) = &self.state {
            saved_uploads::save(&self.uploads, state, &self.metrics).await;
        }
        result
    }
}

/// A connection's hello, as its task reports it to the engine loop.
struct Arrival {
    conn: u64,
    client: ClientId,
    /// SHA-256 of the certificate the peer showed (mutual TLS).
    fingerprint: Option<String>,
    /// The peer's certificate carries the relay role.
    relay: bool,
    msg: Message,
    out: mpsc::UnboundedSender<Outbound>,
}

/// What a connection task reports to the engine loop.
enum Input {
    Hello(Arrival),
    Message {
        conn: u64,
        client: ClientId,
        msg: Message,
    },
    Closed {
        conn: u64,
        client: ClientId,
    },
    /// A relay's parent broadcast a round.
    Parent(anchorage_shared::protocol::Broadcast),
    /// A relay's parent said goodbye.
    ParentGoodbye(String),
    /// A relay's parent counted some of its last partial's devices through another relay: fold
    /// the round again without them.
    Refold {
        devices: Vec<String>,
        reply: tokio::sync::oneshot::Sender<Option<anchorage_shared::protocol::Partial>>,
    },
    /// A relay's parent acked or dropped one of its partials: its devices' acks follow.
    ParentVerdict(crate::engine::ParentVerdict),
}

/// What a relay's uplink may ask of its engine while the server runs.
#[derive(Clone)]
pub struct RelayControl {
    inputs: mpsc::UnboundedSender<Input>,
}

impl RelayControl {
    /// The last partial aggregate folded again without `devices` (`Engine::refold_without`).
    pub async fn refold_without(&self, devices: Vec<String>) -> Option<anchorage_shared::protocol::Partial> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.inputs.send(Input::Refold { devices, reply }).ok()?;
        answer.await.ok().flatten()
    }

    /// What the parent did with a partial (`Engine::handle_parent_verdict`).
    pub fn verdict(&self, verdict: crate::engine::ParentVerdict) {
        let _ = self.inputs.send(Input::ParentVerdict(verdict));
    }
}

/// What the engine loop sends a connection task to write.
#[derive(Debug)]
enum Outbound {
    Control(Arc<Vec<u8>>),
    /// A broadcast, and the priority of its stream: on a uni stream, or as a transfer to a
    /// device that takes them (`broadcasts`).
    Uni(Arc<broadcasts::SharedBroadcast>, Priority),
    Close(Refusal),
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
    let listener = endpoint::Listener::bind(&options, crl.clone(), &transport_config, &refusals)?;
    let local_addr = listener.current().local_addr()?;

    let (engine, metrics) = match &options.store {
        Some(store) => engine_loop::recover(store, &options.engine, options.method, options.initial)?,
        None => (Engine::new(options.engine.clone(), options.method, options.initial), Arc::new(ServerMetrics::new())),
    };
    let (input_tx, input_rx) = mpsc::unbounded_channel();
    let (event_tx, events) = mpsc::unbounded_channel();
    let (shutdown, shutdown_rx) = watch::channel(false);
    let max_frame = options.engine.max_frame_bytes as usize;
    let uploads = Arc::new(transfers::KeptUploads::default());
    let state = options.store.as_ref().map(|s| s.dir().to_path_buf());
    if let Some(state) = &state {
        let bound = options.limits.max_kept_upload_bytes;
        saved_uploads::restore(&uploads, state, max_frame as u64, bound, &metrics);
    }

    let revoked = revocation::watch_revocations(
        &listener,
        &options.trust,
        &options.identity,
        &crl,
        transport_config,
        metrics.clone(),
        refusals.clone(),
    )?;
    let conn_inputs = input_tx.clone();
    let conn = connection::ConnCtx {
        id: 0,
        inputs: input_tx,
        metrics: metrics.clone(),
        max_frame,
        limits: options.limits.clone(),
        revoked,
        refusals,
        uploads: uploads.clone(),
    };
    let acceptor = accept::Acceptor { listener: listener.clone(), conn };
    tokio::spawn(acceptor.run());

    let (costs_tx, relay) = match engine.is_relay() {
        true => {
            let (tx, costs) = mpsc::unbounded_channel();
            owe_recent_costs(options.store.as_ref(), engine.last_round(), &tx);
            (Some(tx), Some(RelayStart { costs, last_round: engine.last_round(), partial: engine.last_partial() }))
        }
        false => (None, None),
    };
    let shell = engine_loop::EngineShell::new(
        engine,
        event_tx,
        options.store,
        metrics.clone(),
        max_frame,
        uploads.clone(),
        costs_tx,
    );
    let run = engine_loop::run_engine(shell, input_rx, shutdown_rx);
    let task = tokio::spawn(run);
    let inputs = conn_inputs;
    Ok(ServerHandle { local_addr, metrics, events, shutdown, listener, task, uploads, state, inputs, relay })
}

/// A relay that starts from its store owes its parent its recent rounds' cost records again
/// ([`crate::relay::session::owed_after_restart`]): whether the parent confirmed them ended with the
/// process. An unreadable ledger is logged and sends none (the rounds still run).
fn owe_recent_costs(
    store: Option<&ServerStore>,
    last_round: u64,
    costs: &mpsc::UnboundedSender<anchorage_shared::ledger::CostRecord>,
) {
    let Some(store) = store else { return };
    match store.load_ledger() {
        Ok(ledger) => {
            for record in crate::relay::session::owed_after_restart(last_round, ledger) {
                let _ = costs.send(record);
            }
        }
        Err(e) => tracing::error!(error = %e, "the relay's ledger is unreadable: no cost record is sent up again"),
    }
}
