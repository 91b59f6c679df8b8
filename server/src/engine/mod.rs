//! The sans-IO round engine: events in (a message from a client, a disconnect, the clock),
//! actions out (send, broadcast, refuse, persist, report). No sockets, no threads, no clock of
//! its own: the caller passes `now` (time since the engine started) into every call, in the
//! manner of `quinn-proto`. The tokio shell in [`crate::transport`] and the simulator's virtual
//! clock drive the same engine.
//!
//! The engine is the state both modes share ([`common`]: clients, global model, counters, the
//! action queue) and its [`Mode`]: synchronous rounds ([`rounds`]) or FedBuff-style buffered
//! versions ([`buffered`]). Which mode runs is decided once, in [`Engine::mode`] and
//! [`Engine::mode_mut`]; every event goes to the mode through [`ModeState`].

mod buffered;
mod common;
pub mod compat;
pub mod config;
pub mod configure;
mod decode;
mod error;
mod parent;
mod persist;
pub mod privacy;
#[cfg(test)]
mod privacy_tests;
mod report;
mod role;
mod rounds;
pub mod secagg;
#[cfg(test)]
mod secagg_tests;
#[cfg(test)]
pub(crate) mod tests;

use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::{
    Decline, Hello, Message, Refusal, RefusalReason, SecAggFrame, Update, Upward, Welcome,
};
use anchorage_shared::tensor::ParamBlock;
use serde::{Deserialize, Serialize};

pub use buffered::{AggregationMode, staleness_weight};
pub use config::EngineConfig;
pub use configure::{RoundContext, RoundPlan, RoundPolicy, Schedule, Selection};
pub use error::{ConfigError, PrivacyStateError, PrototypeFormError};
pub use persist::{AcceptedUpdate, Invitations, OpenedRound, Persist, Recovered};
pub use report::{EngineStats, RoundOutcome, RoundReport, UpdateReport, preview};
pub use role::{ParentVerdict, Role, fold, partial_of, relay_check};

use buffered::BufferedState;
use common::{Core, goodbye};
use rounds::{OpenRound, RoundsState};

use crate::methods::ServerMethod;

/// Rounds whose invitations the engine remembers to check cost records against.
pub(crate) const INVITATIONS_KEPT: u64 = 8;

/// Devices that must report rounds beyond the server's before it stops opening rounds.
pub const ROLLBACK_QUORUM: usize = 2;

/// A client's identity: from its certificate under mutual TLS (from its hello in the
/// development mode).
pub type ClientId = String;

/// What the engine asks its shell to do.
#[derive(Debug, Clone)]
pub enum Action {
    /// Send a control message to one client.
    Send { to: ClientId, msg: Message },
    /// Send one message to many clients on uni streams; encode it once.
    Broadcast { to: Vec<ClientId>, msg: Arc<Message> },
    /// Refuse a client and close its connection.
    Close { client: ClientId, refusal: Refusal },
    /// Commit this to the store before carrying out any action queued after it: acks, broadcasts
    /// and announcements never run ahead of durable state.
    Persist(Persist),
    /// A round closed (aggregated or failed).
    RoundClosed(Arc<RoundReport>, Arc<Checkpoint>),
    /// Append one record to the cost ledger (a client's measured round, or a dropped client).
    Ledger(CostRecord),
    /// All configured rounds are done; goodbyes have been queued. An engine recovered from a
    /// finished federation queues it first thing, so that its owner can say the run is over
    /// instead of waiting for rounds that will never open.
    Finished,
}

/// The durable global state: what a restarted server resumes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Last round that closed (0 before the first).
    pub round: u64,
    pub method: String,
    pub global: Vec<ParamBlock>,
    pub stats: EngineStats,
    /// The method's own state (global prototypes, locks): [`ServerMethod::save_state`].
    #[serde(default)]
    pub method_state: Vec<u8>,
    /// The global prototypes the next broadcast carries (what evaluators predict with).
    #[serde(default)]
    pub prototypes: Vec<anchorage_shared::prototype::Prototype>,
}

/// The engine's mode and the state it keeps: the one thing that differs between synchronous
/// rounds and buffered versions. [`Engine::mode`] and [`Engine::mode_mut`] are where the engine
/// looks at it; everything else goes through [`ModeState`].
#[derive(Debug)]
enum Mode {
    /// Synchronous rounds: the open round, and who the last one aggregated.
    Rounds(RoundsState),
    /// FedBuff-style versions: the clients training, the buffer, recent versions.
    Buffered(BufferedState),
}

impl Mode {
    fn new(mode: &AggregationMode) -> Self {
        match *mode {
            AggregationMode::Synchronous => Self::Rounds(RoundsState::default()),
            AggregationMode::Buffered { buffer, concurrency, max_staleness } => {
                Self::Buffered(BufferedState::new(buffer, concurrency, max_staleness))
            }
        }
    }
}

/// What a mode does with the engine's events; the [`Core`] is the state both modes share.
trait ModeState {
    /// The round now open (buffered mode opens none).
    fn open(&self) -> Option<&OpenRound>;
    /// When the mode next needs [`ModeState::on_timeout`].
    fn timeout(&self, core: &Core) -> Option<Duration>;
    /// The clock reached `now`.
    fn on_timeout(&mut self, core: &mut Core, now: Duration);
    /// Puts clients to work if the mode may (called after every hello).
    fn start(&mut self, core: &mut Core, now: Duration);
    /// An update from a client that said hello.
    fn on_update(&mut self, core: &mut Core, now: Duration, client: &str, update: Update);
    /// The model `round` was broadcast from (its top-k deltas decode against it): by default
    /// the current one (a late update's round is gone: only its values are screened).
    fn base_of<'a>(&'a self, core: &'a Core, _round: u64) -> &'a [ParamBlock] {
        core.global()
    }
    /// A client that said hello declines the round it was invited to: counted apart
    /// from a drop, and another device is put to work in its place where one is free.
    fn on_decline(&mut self, core: &mut Core, now: Duration, client: &str, decline: Decline);
    /// A device's message of the open round's secure aggregation (only synchronous rounds run
    /// one).
    fn on_secagg(&mut self, core: &mut Core, _now: Duration, client: &str, _frame: &SecAggFrame) {
        core.refuse(client, RefusalReason::Malformed, "no secure aggregation here".into());
    }
    /// What a device that reconnected has not answered of the open round's secure aggregation.
    fn secagg_resend(&self, _client: &str) -> Option<Message> {
        None
    }
    /// How many vectors the open round's secure aggregation holds; `None` outside one.
    fn secagg_held_vectors(&self) -> Option<usize> {
        None
    }
    /// A relay's parent moved on to round `round`: the round open here closes with what it
    /// holds.
    fn close_for_parent(&mut self, _core: &mut Core, _now: Duration, _round: u64) {}
    /// Takes back what a store recovered: the round that was open and the accepted updates no
    /// version aggregated yet, and who the last closed round aggregated.
    fn restore(
        &mut self,
        core: &mut Core,
        open: Option<OpenedRound>,
        pending: Vec<AcceptedUpdate>,
        last_accepted: Vec<ClientId>,
    );
}

/// The round engine. See the module docs.
pub struct Engine {
    core: Core,
    mode: Mode,
}

impl Engine {
    /// A fresh engine whose first round broadcasts `initial` (empty: clients start from their
    /// own seeded initialisation, and the first round's updates fix the shapes).
    pub fn new(config: EngineConfig, method: Box<dyn ServerMethod>, initial: Vec<ParamBlock>) -> Self {
        let checkpoint = Checkpoint {
            round: 0,
            method: method.name().into(),
            global: initial,
            stats: EngineStats::default(),
            method_state: Vec::new(),
            prototypes: Vec::new(),
        };
        Self::resume(config, method, checkpoint)
    }

    /// An engine that continues from a persisted checkpoint, with no round open.
    pub fn resume(config: EngineConfig, method: Box<dyn ServerMethod>, checkpoint: Checkpoint) -> Self {
        Self::recover(
            config,
            method,
            Recovered {
                checkpoint,
                open: None,
                pending: Vec::new(),
                last_accepted: Vec::new(),
                round_floor: 0,
                invitations: Vec::new(),
                privacy: None,
            },
        )
    }

    /// An engine that continues from what its store recovered: the last global version, the
    /// round that was open at the crash with the updates it had accepted (acked updates are never
    /// lost), and the buffered updates no version has aggregated yet. A recovered round gets a
    /// fresh deadline; if it already holds its target, it closes on the first poll.
    ///
    /// In the relay role (`config.role`) its rounds are its parent's, and `config.rounds` does
    /// not apply (see [`Engine::relay`]).
    pub fn recover(mut config: EngineConfig, method: Box<dyn ServerMethod>, recovered: Recovered) -> Self {
        if config.role == Role::Relay {
            config.rounds = 0;
        }
        let Recovered { checkpoint, open, pending, last_accepted, round_floor, invitations, privacy } = recovered;
        let mode = Mode::new(&config.mode);
        let mut engine = Self { core: Core::resume(config, method, checkpoint, round_floor), mode };
        engine.core.restore_invitations(invitations);
        engine.core.resume_privacy(privacy.as_ref());
        engine.core.announce_if_finished();
        let (core, mode) = engine.mode_mut();
        mode.restore(core, open, pending, last_accepted);
        engine
    }

    /// The mode's state, to read.
    fn mode(&self) -> &dyn ModeState {
        match &self.mode {
            Mode::Rounds(rounds) => rounds,
            Mode::Buffered(buffered) => buffered,
        }
    }

    /// The shared state and the mode's, to change both.
    fn mode_mut(&mut self) -> (&mut Core, &mut dyn ModeState) {
        match &mut self.mode {
            Mode::Rounds(rounds) => (&mut self.core, rounds),
            Mode::Buffered(buffered) => (&mut self.core, buffered),
        }
    }

    /// The round now open, if any.
    fn open(&self) -> Option<&OpenRound> {
        self.mode().open()
    }

    pub fn config(&self) -> &EngineConfig {
        self.core.config()
    }

    /// Counters since the federation began (persisted with the checkpoint).
    pub fn stats(&self) -> &EngineStats {
        self.core.stats()
    }

    /// The last round that closed.
    pub fn last_round(&self) -> u64 {
        self.core.last_round()
    }

    /// The round now open, if any.
    pub fn open_round(&self) -> Option<u64> {
        self.open().map(|o| o.round)
    }

    /// The current global parameter blocks.
    pub fn global(&self) -> &[ParamBlock] {
        self.core.global()
    }

    pub fn is_finished(&self) -> bool {
        self.core.is_finished()
    }

    /// Number of connected clients.
    pub fn connected(&self) -> usize {
        self.core.connected()
    }

    /// The global state as of the last closed round: what a store keeps per version.
    pub fn checkpoint(&self) -> Checkpoint {
        self.core.checkpoint()
    }

    /// Next action for the shell, if any.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.core.pop_action()
    }

    /// When the engine next needs [`Engine::handle_timeout`]: the open round's deadline, or
    /// when the buffered mode next gives up on a training client.
    pub fn poll_timeout(&self) -> Option<Duration> {
        self.mode().timeout(&self.core)
    }

    /// The clock reached `now`: close the open round if its deadline passed (buffered mode:
    /// free the slots of clients that trained past it).
    pub fn handle_timeout(&mut self, now: Duration) {
        let (core, mode) = self.mode_mut();
        mode.on_timeout(core, now);
    }

    /// Copies the state kept per device into fresh allocations, so that the allocator can give
    /// back the pages a departed fleet's connections used (the shell calls it after most of a
    /// large fleet left); what the engine knows does not change.
    pub fn compact(&mut self) {
        self.core.compact();
    }

    /// A client's connection is gone. Its sampled slot stays open until the deadline: it may
    /// reconnect and upload.
    pub fn handle_disconnect(&mut self, _now: Duration, client: &str) {
        self.core.disconnect(client);
    }

    /// A decoded message from a client. `client` is the identity the transport established.
    pub fn handle_message(&mut self, now: Duration, client: &str, msg: Message) {
        let msg = match Upward::try_from(msg) {
            Ok(msg) => msg,
            Err(down) => return self.unexpected(client, down.kind_name()),
        };
        match msg {
            Upward::Hello(hello) => self.on_hello(now, client, *hello),
            Upward::Update(update) => self.on_update(now, client, update),
            Upward::Heartbeat(_) => {}
            Upward::Goodbye(_) => self.handle_disconnect(now, client),
            Upward::Cost(record) => self.core.on_cost(client, record),
            Upward::Partial(partial) if self.core.is_relay_peer(client) => self.on_partial(now, client, partial),
            Upward::CostBatch(batch) if self.core.is_relay_peer(client) => self.on_cost_batch(client, batch),
            Upward::SecAgg(frame) if self.core.is_known(client) => {
                let (core, mode) = self.mode_mut();
                mode.on_secagg(core, now, client, &frame);
            }
            Upward::Decline(decline) if self.core.is_known(client) => {
                let (core, mode) = self.mode_mut();
                mode.on_decline(core, now, client, decline);
            }
            // What only a relay sends (from a peer without the relay role), what needs a hello
            // first, a refusal (a device does not refuse its server), and transfer frames (the
            // shell's, on their own streams): listed, not caught all, so that a new upward
            // message kind must be placed here.
            Upward::Refusal(_)
            | Upward::TransferOffer(_)
            | Upward::TransferResume(_)
            | Upward::Chunk(_)
            | Upward::Partial(_)
            | Upward::CostBatch(_)
            | Upward::SecAgg(_)
            | Upward::Decline(_) => self.unexpected(client, msg.kind_name()),
        }
    }

    /// A message a client may not send (here, or yet): refused, logged and counted.
    fn unexpected(&mut self, client: &str, kind: &str) {
        tracing::warn!(client, kind, "unexpected message from a client");
        self.core.refuse(client, RefusalReason::Malformed, format!("a client may not send {kind}"));
    }

    /// A hello: refused if it names another client or method; otherwise the client is
    /// connected, welcomed, sent the open round's broadcast again if it was invited and has not
    /// answered, and may start a round.
    fn on_hello(&mut self, now: Duration, client: &str, hello: Hello) {
        if !self.core.admit_hello(client, &hello) {
            return;
        }
        let current_round = self.open_round();
        self.core.compare_witness(client, hello.last_round, current_round.is_some());
        let core = &mut self.core;
        core.connect(client, hello.num_samples);
        core.push(Action::Persist(Persist::Seen { client: client.into(), fingerprint: None }));
        let welcome = Welcome {
            server_id: core.config().server_id.clone(),
            method: core.method().name().into(),
            max_frame_bytes: core.config().max_frame_bytes,
            heartbeat_ms: core.config().heartbeat.as_millis() as u32,
            current_round,
        };
        core.send(client, Message::Welcome(welcome));
        if core.is_finished() {
            core.send(client, goodbye("federation finished"));
            return;
        }
        // A sampled client that reconnects mid-round gets the round's broadcast again.
        let again = self
            .open()
            .filter(|open| open.sampled.contains(client) && !open.updates.contains_key(client))
            .map(|open| open.broadcast_of(client));
        if let Some(msg) = again {
            self.core.push(Action::Broadcast { to: vec![client.into()], msg });
        }
        // And the secure aggregation's message it has not answered.
        if let Some(msg) = self.mode().secagg_resend(client) {
            self.core.send(client, msg);
        }
        let (core, mode) = self.mode_mut();
        mode.start(core, now);
    }

    fn on_update(&mut self, now: Duration, client: &str, update: Update) {
        if !self.core.is_known(client) {
            self.core.refuse(client, RefusalReason::NotEnrolled, "send a hello first".into());
            return;
        }
        if self.core.config().secagg.enabled {
            let detail = "this server aggregates securely ([engine.secagg]): updates travel masked, never in the clear \
                          (set secure_aggregation = true in the device's client.toml)";
            self.core.refuse(client, RefusalReason::Malformed, detail.into());
            return;
        }
        if let Err(form) = privacy::PrivacyState::check_update(&update, &self.core.config().privacy) {
            self.core.refuse(client, RefusalReason::Malformed, form.to_string());
            return;
        }
        let (core, mode) = self.mode_mut();
        // Dense from here on, in one place: checks, screens and aggregation see values.
        let round = update.round;
        match decode::densify(update, mode.base_of(core, round)) {
            Ok(update) => mode.on_update(core, now, client, update),
            Err(e) => core.refuse(client, RefusalReason::BadTensor, format!("update not decodable: {e}")),
        }
    }

    /// How many vectors the open round's secure aggregation holds: 1 (the running sum of
    /// masked vectors) or 0, never one per device; `None` outside a SecAgg round. For audits
    /// and the tests that check it.
    pub fn secagg_held_vectors(&self) -> Option<usize> {
        self.mode().secagg_held_vectors()
    }

    /// Rollback evidence from the devices that stops new rounds: how many devices reported a
    /// round beyond this server's, and the highest they reported.
    pub fn rollback_suspected(&self) -> Option<(usize, u64)> {
        self.core.rollback_suspected()
    }

    /// Devices that reported a round beyond this server's (an alarm even below the quorum).
    pub fn devices_ahead(&self) -> usize {
        self.core.devices_ahead()
    }
}
