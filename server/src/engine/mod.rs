//! The sans-IO round engine: events in (a message from a client, a disconnect, the clock),
//! actions out (send, broadcast, refuse, persist, report). No sockets, no threads, no clock of
//! its own: the caller passes `now` (time since the engine started) into every call, in the
//! manner of `quinn-proto`. The tokio shell in [`crate::transport`] and the simulator's virtual
//! clock drive the same engine.
//!
//! Synchronous rounds, as Flower and FedScale run them: wait for `min_available` clients, sample
//! `max(min_fit, ⌈fraction·available⌉)` of them, over-select by `over_selection` (FedScale's
//! over-commitment), close the round when the target number of updates arrived or when the
//! deadline fires. Updates for a closed round are acknowledged and counted as late, never
//! aggregated and never silently dropped; a second update from the same client for the same round
//! is counted once.

mod buffered;
pub mod config;
mod persist;
mod report;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::{Ack, Broadcast, Goodbye, Hello, Message, Refusal, RefusalReason, Update, Welcome};
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{ParamBlock, payload_bytes};
use serde::{Deserialize, Serialize};

pub use buffered::{AggregationMode, staleness_weight};
pub use config::EngineConfig;
pub use persist::{AcceptedUpdate, OpenedRound, Persist, Recovered};
pub use report::{EngineStats, RoundOutcome, RoundReport, UpdateReport, preview};

use crate::aggregate::{InfluenceReport, RoundScreen, Screened};
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

#[derive(Debug, Clone)]
struct ClientInfo {
    connected: bool,
    /// Buffered mode: the last version this client was dispatched to train on.
    last_version: Option<u64>,
}

#[derive(Debug)]
struct OpenRound {
    round: u64,
    broadcast: Arc<Message>,
    sampled: BTreeSet<ClientId>,
    target: usize,
    started: Duration,
    deadline: Duration,
    updates: BTreeMap<ClientId, (Arc<AcceptedUpdate>, Duration)>,
    duplicates: u64,
    refused: u64,
}

/// The round engine. See the module docs.
pub struct Engine {
    config: EngineConfig,
    method: Box<dyn ServerMethod>,
    rng: Rng,
    clients: BTreeMap<ClientId, ClientInfo>,
    global: Vec<ParamBlock>,
    last_round: u64,
    /// Clients whose update the last closed round aggregated: a copy arriving later is a
    /// duplicate, not a late update.
    last_accepted: BTreeSet<ClientId>,
    /// Who was invited to each of the last [`INVITATIONS_KEPT`] rounds, and whether their cost
    /// record for it arrived.
    invited: BTreeMap<u64, BTreeMap<ClientId, bool>>,
    open: Option<OpenRound>,
    /// State of the semi-asynchronous mode (unused in synchronous rounds).
    buffered: buffered::Buffered,
    stats: EngineStats,
    /// The last aggregated round's lower median delta norm: the reference of `min_norm_ratio`
    /// (none after a restart until a round aggregates).
    last_median_norm: Option<f64>,
    /// Devices whose hello named a round beyond any this engine announced, with that round: the
    /// devices' witness of a rolled-back store (module `crate::store::witness`).
    ahead: BTreeMap<ClientId, u64>,
    finished: bool,
    actions: VecDeque<Action>,
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
            },
        )
    }

    /// An engine that continues from what its store recovered: the last global version, the
    /// round that was open at the crash with the updates it had accepted (acked updates are never
    /// lost), and the buffered updates no version has aggregated yet. A recovered round gets a
    /// fresh deadline; if it already holds its target, it closes on the first poll.
    pub fn recover(config: EngineConfig, mut method: Box<dyn ServerMethod>, recovered: Recovered) -> Self {
        let Recovered { checkpoint, open, pending, last_accepted, round_floor, invitations } = recovered;
        if let Err(e) = method.load_state(&checkpoint.method_state) {
            tracing::error!(error = %e, round = checkpoint.round, "the checkpoint's method state is unreadable; the method starts fresh");
        }
        let rng = Rng::derive(config.seed, checkpoint.round);
        let mut engine = Self {
            finished: config.rounds > 0 && checkpoint.round >= config.rounds,
            config,
            method,
            rng,
            clients: BTreeMap::new(),
            global: checkpoint.global,
            // After an accepted rollback, numbering continues above every round ever announced.
            last_round: checkpoint.round.max(round_floor),
            last_accepted: last_accepted.into_iter().collect(),
            invited: BTreeMap::new(),
            open: None,
            buffered: buffered::Buffered::default(),
            stats: checkpoint.stats,
            last_median_norm: None,
            ahead: BTreeMap::new(),
            actions: VecDeque::new(),
        };
        // The invitations of the last rounds, so that a device's resent cost record is judged
        // (and confirmed) as it would have been before the restart.
        for (round, invited, costed) in invitations {
            engine.note_invited(round, invited);
            if let Some(flags) = engine.invited.get_mut(&round) {
                for c in costed {
                    if let Some(f) = flags.get_mut(&c) {
                        *f = true;
                    }
                }
            }
        }
        if engine.finished {
            tracing::info!(
                round = engine.last_round,
                rounds = engine.config.rounds,
                "resumed a finished federation: every configured round has closed"
            );
            engine.actions.push_back(Action::Finished);
        }
        if engine.is_buffered() {
            engine.buffered_restore(pending);
        } else if let Some(opened) = open.filter(|o| o.round == engine.last_round + 1 && !engine.finished) {
            let pending: Vec<AcceptedUpdate> = pending.into_iter().filter(|p| p.update.round == opened.round).collect();
            tracing::info!(
                round = opened.round,
                accepted = pending.len(),
                target = opened.target,
                "resuming the open round"
            );
            let mut round = engine.open_round_record(
                Duration::ZERO,
                opened.round,
                opened.target,
                opened.sampled.into_iter().collect(),
            );
            for p in pending {
                let at = p.arrived_after;
                round.updates.insert(p.client.clone(), (Arc::new(p), at));
            }
            engine.note_invited(round.round, round.sampled.iter().cloned());
            let full = round.updates.len() >= round.target;
            engine.open = Some(round);
            if full {
                engine.close_round(Duration::ZERO);
            }
        }
        engine
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Counters since the federation began (persisted with the checkpoint).
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// The last round that closed.
    pub fn last_round(&self) -> u64 {
        self.last_round
    }

    /// The round now open, if any.
    pub fn open_round(&self) -> Option<u64> {
        self.open.as_ref().map(|o| o.round)
    }

    /// The current global parameter blocks.
    pub fn global(&self) -> &[ParamBlock] {
        &self.global
    }

    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Number of connected clients.
    pub fn connected(&self) -> usize {
        self.clients.values().filter(|c| c.connected).count()
    }

    /// The global state as of the last closed round: what a store keeps per version.
    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            round: self.last_round,
            method: self.method.name().into(),
            global: self.global.clone(),
            stats: self.stats.clone(),
            method_state: self.method.save_state(),
            prototypes: self.method.prototypes(),
        }
    }

    /// Next action for the shell, if any.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When the engine next needs [`Engine::handle_timeout`].
    pub fn poll_timeout(&self) -> Option<Duration> {
        if self.is_buffered() {
            return self.buffered_timeout();
        }
        self.open.as_ref().map(|o| o.deadline)
    }

    /// The clock reached `now`: close the open round if its deadline passed.
    pub fn handle_timeout(&mut self, now: Duration) {
        if self.is_buffered() {
            self.buffered_timeout_fired(now);
            return;
        }
        if self.open.as_ref().is_some_and(|o| now >= o.deadline) {
            self.close_round(now);
        }
        self.maybe_start_round(now);
    }

    /// A client's connection is gone. Its sampled slot stays open until the deadline: it may
    /// reconnect and upload.
    pub fn handle_disconnect(&mut self, _now: Duration, client: &str) {
        if let Some(c) = self.clients.get_mut(client) {
            c.connected = false;
        }
    }

    /// A decoded message from a client. `client` is the identity the transport established.
    pub fn handle_message(&mut self, now: Duration, client: &str, msg: Message) {
        match msg {
            Message::Hello(hello) => self.on_hello(now, client, *hello),
            Message::Update(update) => self.on_update(now, client, update),
            Message::Heartbeat(_) => {}
            Message::Goodbye(_) => self.handle_disconnect(now, client),
            Message::Cost(record) => self.on_cost(client, record),
            other => {
                tracing::warn!(client, kind = other.kind_name(), "unexpected message from a client");
                self.refuse(client, RefusalReason::Malformed, format!("a client may not send {}", other.kind_name()));
            }
        }
    }

    fn on_hello(&mut self, now: Duration, client: &str, hello: Hello) {
        if hello.client_id != client {
            self.stats.refused += 1;
            self.actions.push_back(Action::Close {
                client: client.into(),
                refusal: Refusal {
                    reason: RefusalReason::NotEnrolled,
                    detail: format!("hello names `{}` but the connection is `{client}`", hello.client_id),
                },
            });
            return;
        }
        let method_ok = hello.capabilities.methods.iter().any(|m| m.as_str() == self.method.name());
        if !method_ok {
            self.stats.refused += 1;
            self.actions.push_back(Action::Close {
                client: client.into(),
                refusal: Refusal {
                    reason: RefusalReason::UnknownMethod,
                    detail: format!("this federation runs `{}`", self.method.name()),
                },
            });
            return;
        }
        self.compare_witness(client, hello.last_round);
        let last_version = self.clients.get(client).and_then(|c| c.last_version);
        self.clients.insert(client.into(), ClientInfo { connected: true, last_version });
        self.actions.push_back(Action::Persist(Persist::Seen { client: client.into(), fingerprint: None }));
        self.actions.push_back(Action::Send {
            to: client.into(),
            msg: Message::Welcome(Welcome {
                server_id: self.config.server_id.clone(),
                method: self.method.name().into(),
                max_frame_bytes: self.config.max_frame_bytes,
                heartbeat_ms: self.config.heartbeat.as_millis() as u32,
                current_round: self.open.as_ref().map(|o| o.round),
            }),
        });
        if self.finished {
            self.actions.push_back(Action::Send { to: client.into(), msg: goodbye("federation finished") });
            return;
        }
        // A sampled client that reconnects mid-round gets the round's broadcast again.
        if let Some(open) = &self.open
            && open.sampled.contains(client)
            && !open.updates.contains_key(client)
        {
            self.actions.push_back(Action::Broadcast { to: vec![client.into()], msg: open.broadcast.clone() });
        }
        self.maybe_start_round(now);
    }

    fn on_update(&mut self, now: Duration, client: &str, mut update: Update) {
        if !self.clients.contains_key(client) {
            self.refuse(client, RefusalReason::NotEnrolled, "send a hello first".into());
            return;
        }
        if self.is_buffered() {
            self.buffered_update(now, client, update);
            return;
        }
        let round = update.round;
        let Some(open) = self.open.as_mut().filter(|o| o.round == round) else {
            if round == self.last_round && self.last_accepted.contains(client) {
                self.stats.duplicate_updates += 1;
                self.actions
                    .push_back(Action::Send { to: client.into(), msg: Message::Ack(Ack { round, aggregated: true }) });
            } else if round <= self.last_round {
                // Late: its round already closed. Acknowledge so the client stops resending, but
                // only values that would have passed the screen: an ack never covers garbage.
                if let Err(reason) = self.config.robust.screen_values(&update) {
                    self.refuse(client, RefusalReason::BadTensor, format!("update screened out: {reason}"));
                    return;
                }
                self.stats.late_updates += 1;
                tracing::info!(client, round, "late update counted, not aggregated");
                self.actions
                    .push_back(Action::Send { to: client.into(), msg: Message::Ack(Ack { round, aggregated: false }) });
            } else {
                self.refuse(client, RefusalReason::NotSampled, format!("round {round} is not open"));
            }
            return;
        };
        if !open.sampled.contains(client) {
            open.refused += 1;
            self.refuse(client, RefusalReason::NotSampled, format!("not sampled for round {round}"));
            return;
        }
        if open.updates.contains_key(client) {
            open.duplicates += 1;
            self.stats.duplicate_updates += 1;
            self.actions
                .push_back(Action::Send { to: client.into(), msg: Message::Ack(Ack { round, aggregated: true }) });
            return;
        }
        // The model's layout is the operator's (the initial model), never an update's: a server
        // without one aggregates only methods that share no blocks.
        let layout = if self.global.is_empty() && !update.blocks.is_empty() {
            Err("this server holds no model: its layout comes from the operator (initial_model in server.toml), \
                 never from an update"
                .to_string())
        } else {
            same_layout(&self.global, &update.blocks)
        };
        if let Err(detail) = layout {
            open.refused += 1;
            self.refuse(client, RefusalReason::ShapeMismatch, detail);
            return;
        }
        if update.num_samples == 0 {
            open.refused += 1;
            self.refuse(client, RefusalReason::Malformed, "an update must be trained on at least one sample".into());
            return;
        }
        // Screening (`[engine.robust]`): finite values, a bounded delta and a change of an honest
        // shape, all before the ack.
        let robust = &self.config.robust;
        let screened = robust
            .screen_update(&update, &self.global)
            .and_then(|norm| robust.screen_change(&update, &self.global, norm, self.last_median_norm));
        if let Err(reason) = screened {
            open.refused += 1;
            self.refuse(client, RefusalReason::BadTensor, format!("update screened out: {reason}"));
            return;
        }
        self.config.robust.cap_samples(client, &mut update);
        let accepted = Arc::new(AcceptedUpdate {
            client: client.into(),
            update,
            staleness: 0,
            arrived_after: now.saturating_sub(open.started),
        });
        open.updates.insert(client.into(), (accepted.clone(), now));
        // Ack after commit: the shell commits the accepted update before it sends the ack.
        self.actions.push_back(Action::Persist(Persist::Accepted(accepted)));
        self.actions.push_back(Action::Send { to: client.into(), msg: Message::Ack(Ack { round, aggregated: true }) });
        if open.updates.len() >= open.target {
            self.close_round(now);
            self.maybe_start_round(now);
        }
    }

    /// A client's measured cost of a round it took part in: into the ledger under its identity.
    /// The record is checked against what the server saw: the client must have been invited to
    /// that round, and each invitation takes one record (so one peer writes at most one row per
    /// round it was invited to, whatever it sends); its byte counts must fit the frames the
    /// federation allows. A record that fails is dropped and counted, not answered with a
    /// refusal (a refusal would make the device set its unsent update aside); the log says so
    /// for the 1st, 2nd, 4th, 8th, … dropped record, so a flood cannot flood the log either.
    fn on_cost(&mut self, client: &str, mut record: CostRecord) {
        if !self.clients.contains_key(client) {
            self.refuse(client, RefusalReason::NotEnrolled, "send a hello first".into());
            return;
        }
        let invitation = self.invited.get_mut(&record.round).and_then(|c| c.get_mut(client));
        let already_costed = invitation.as_ref().is_some_and(|costed| **costed);
        let max_payload = u64::from(self.config.max_frame_bytes);
        let max_wire = max_payload.saturating_mul(8).saturating_add(1 << 20);
        let why = if invitation.is_none() {
            Some(format!("round {} is not one this client was invited to lately", record.round))
        } else if invitation.as_ref().is_some_and(|costed| **costed) {
            Some(format!("round {} already has this client's cost record", record.round))
        } else if record.payload_up.max(record.payload_down) > max_payload {
            Some(format!("payload bytes above the {max_payload}-byte frame limit"))
        } else if record.wire_up.max(record.wire_down) > max_wire {
            Some(format!("wire bytes above {max_wire}"))
        } else {
            record.check_physical().err()
        };
        if let Some(why) = why {
            self.stats.refused += 1;
            self.stats.dropped_cost_records += 1;
            let dropped = self.stats.dropped_cost_records;
            if dropped.is_power_of_two() {
                tracing::warn!(client, round = record.round, %why, dropped, "cost record dropped");
            }
            if already_costed {
                // A resend of a record the ledger holds (the confirmation was lost): confirm again.
                self.actions.push_back(cost_ack(client, record.round));
            }
            return;
        }
        if let Some(costed) = invitation {
            *costed = true;
        }
        record.client = client.into();
        let round = record.round;
        // The shell appends the record to the ledger before it sends the confirmation.
        self.actions.push_back(Action::Ledger(record));
        self.actions.push_back(cost_ack(client, round));
    }

    /// Remembers who was invited to `round` (for checking cost records), for the last few rounds.
    fn note_invited(&mut self, round: u64, clients: impl IntoIterator<Item = ClientId>) {
        self.invited.entry(round).or_default().extend(clients.into_iter().map(|c| (c, false)));
        self.invited.retain(|r, _| r + INVITATIONS_KEPT > round);
    }

    /// A device's last round is a witness of what this server announced: one beyond the newest
    /// round it knows (`last_round`, plus the open one) means the store lost rounds. One device
    /// raises the alarm; [`ROLLBACK_QUORUM`] devices (or every known one, if fewer) stop new
    /// rounds until the operator decides (`anchorage-server accept-rollback`), so that a single
    /// hostile device cannot halt the federation with a made-up number.
    fn compare_witness(&mut self, client: &str, last_round: Option<u64>) {
        let Some(seen) = last_round.filter(|r| *r > self.last_round + 1) else { return };
        if self.ahead.insert(client.into(), seen).is_none() {
            tracing::error!(
                client,
                device_round = seen,
                server_round = self.last_round,
                devices = self.ahead.len(),
                "a device has trained a round this server never announced: the state folder may have been rolled back"
            );
        }
        if self.rollback_suspected().is_some() && self.open.is_none() {
            tracing::error!(
                devices = self.ahead.len(),
                highest = self.ahead.values().max().copied().unwrap_or(0),
                "no new round opens: restore the newest backup, or resume from this store with \
                 `anchorage-server accept-rollback --config server.toml --seen ROUND` (the highest round the devices report)"
            );
        }
    }

    /// Rollback evidence from the devices that stops new rounds: how many devices reported a
    /// round beyond this server's, and the highest they reported.
    pub fn rollback_suspected(&self) -> Option<(usize, u64)> {
        let quorum = ROLLBACK_QUORUM.min(self.clients.len().max(1));
        (self.ahead.len() >= quorum).then(|| (self.ahead.len(), self.ahead.values().max().copied().unwrap_or(0)))
    }

    /// Devices that reported a round beyond this server's (an alarm even below the quorum).
    pub fn devices_ahead(&self) -> usize {
        self.ahead.len()
    }

    fn refuse(&mut self, client: &str, reason: RefusalReason, detail: String) {
        self.stats.refused += 1;
        tracing::warn!(client, ?reason, %detail, "refused");
        self.actions.push_back(Action::Send { to: client.into(), msg: Message::Refusal(Refusal { reason, detail }) });
    }

    fn maybe_start_round(&mut self, now: Duration) {
        if self.finished || self.open.is_some() || self.rollback_suspected().is_some() {
            return;
        }
        if self.is_buffered() {
            if self.last_round > 0 || self.connected() >= self.config.min_available.max(1) {
                self.dispatch(now);
            }
            return;
        }
        // Count before collecting: every hello lands here, and fleets have thousands of clients.
        if self.connected() < self.config.min_available.max(1) {
            return;
        }
        let available: Vec<ClientId> =
            self.clients.iter().filter(|(_, c)| c.connected).map(|(id, _)| id.clone()).collect();
        let target = self.config.sample_size(available.len());
        let invited = self.config.invited(target, available.len());
        let sampled: BTreeSet<ClientId> =
            self.rng.sample_indices(available.len(), invited).into_iter().map(|i| available[i].clone()).collect();
        let round = self.last_round + 1;
        tracing::info!(
            round,
            available = available.len(),
            target,
            invited = sampled.len(),
            invited_ids = %report::preview(sampled.iter(), 5),
            "round opened"
        );
        let open = self.open_round_record(now, round, target, sampled);
        self.note_invited(round, open.sampled.iter().cloned());
        // The invitations are durable before anyone trains on them.
        self.actions.push_back(Action::Persist(Persist::Opened(OpenedRound {
            round,
            task: self.config.task_of(round),
            target,
            sampled: open.sampled.iter().cloned().collect(),
        })));
        self.actions
            .push_back(Action::Broadcast { to: open.sampled.iter().cloned().collect(), msg: open.broadcast.clone() });
        self.open = Some(open);
    }

    /// Round `round`'s record, its broadcast made from the current global version.
    fn open_round_record(&self, now: Duration, round: u64, target: usize, sampled: BTreeSet<ClientId>) -> OpenRound {
        let mut config = self.config.round.clone();
        config.deadline_ms = self.config.round_deadline.as_millis() as u64;
        let broadcast = Arc::new(Message::Broadcast(Broadcast {
            round,
            task: self.config.task_of(round),
            config,
            blocks: self.global.clone(),
            prototypes: self.method.prototypes(),
        }));
        OpenRound {
            round,
            broadcast,
            sampled,
            target,
            started: now,
            deadline: now + self.config.round_deadline,
            updates: BTreeMap::new(),
            duplicates: 0,
            refused: 0,
        }
    }

    fn close_round(&mut self, now: Duration) {
        let Some(open) = self.open.take() else { return };
        let payload_down = match open.broadcast.as_ref() {
            Message::Broadcast(b) => payload_bytes(&b.blocks) as u64,
            _ => 0,
        };
        let mut updates: Vec<UpdateReport> = open
            .updates
            .iter()
            .map(|(id, (a, at))| (id, &a.update, at))
            .map(|(id, u, at)| UpdateReport {
                client: id.clone(),
                num_samples: u.num_samples,
                payload_up: payload_bytes(&u.blocks) as u64,
                prototypes: u.prototypes.len(),
                compute_seconds: u.compute_seconds,
                arrived_after: at.saturating_sub(open.started),
                metrics: u.metrics.iter().map(|m| (m.name.clone(), m.value)).collect(),
            })
            .collect();
        let missing: Vec<ClientId> = open.sampled.iter().filter(|c| !open.updates.contains_key(*c)).cloned().collect();
        let enough = open.updates.len() >= self.config.min_updates.max(1);
        let (outcome, screened, influence) = if !enough {
            let reason =
                format!("{} of at least {} updates arrived", open.updates.len(), self.config.min_updates.max(1));
            (RoundOutcome::Failed { reason }, Vec::new(), InfluenceReport::default())
        } else {
            let inputs: Vec<(&str, &Update)> =
                open.updates.iter().map(|(id, (a, _))| (id.as_str(), &a.update)).collect();
            self.aggregate(&inputs)
        };
        // The report lists the updates aggregated: the screened-out ones count as refused.
        updates.retain(|u| !screened.iter().any(|s| s.client == u.client));
        self.stats.dropped += missing.len() as u64;
        for client in &missing {
            self.actions.push_back(Action::Ledger(CostRecord {
                client: client.clone(),
                round: open.round,
                payload_down,
                dropped: true,
                wall_seconds: now.saturating_sub(open.started).as_secs_f64(),
                ..CostRecord::default()
            }));
        }
        self.last_accepted = open.updates.keys().cloned().collect();
        let report = RoundReport {
            round: open.round,
            outcome,
            sampled: open.sampled.len(),
            target: open.target,
            updates,
            missing,
            duplicates: open.duplicates,
            refused: open.refused + screened.len() as u64,
            late_total: self.stats.late_updates,
            payload_down,
            started: open.started,
            closed: now,
            influence,
            held_out_accuracy: None,
        };
        self.close_version(report);
    }

    /// Prepares the round's updates (`[engine.robust]`: capped sample counts, then the influence
    /// bounds, which drop nothing that was acked), then runs the method's aggregation with the
    /// configured rule; on success the result becomes the global model. A result that is not
    /// finite is refused and the model stays as it was. Returns the outcome, the updates screened
    /// out (only one that decodes no more, which the ack-time screen makes impossible) and what
    /// the bounds did.
    fn aggregate(&mut self, inputs: &[(&str, &Update)]) -> (RoundOutcome, Vec<Screened>, InfluenceReport) {
        let round = self.last_round + 1;
        let RoundScreen { kept, screened, mut influence } = self.config.robust.screen_round(inputs, &self.global);
        if self.config.robust.min_norm_ratio.is_some() && self.last_median_norm.is_none() {
            influence.skipped.push("min_norm_ratio: no earlier round's median norm to compare with yet".into());
        }
        if influence.median_norm.is_some() {
            self.last_median_norm = influence.median_norm;
        }
        if !influence.weight_clipped.is_empty() || !influence.norm_clipped.is_empty() {
            tracing::info!(
                round,
                weight_clipped = ?influence.weight_clipped,
                norm_clipped = ?influence.norm_clipped,
                norm_bound = ?influence.norm_bound,
                "influence bounded"
            );
        }
        if !screened.is_empty() {
            self.stats.refused += screened.len() as u64;
            let clients: Vec<&str> = screened.iter().map(|s| s.client.as_str()).collect();
            let reasons: Vec<String> = screened.iter().map(|s| format!("{}: {}", s.client, s.reason)).collect();
            tracing::error!(
                round,
                screened = screened.len(),
                ?clients,
                ?reasons,
                "acked updates failed the round's screen"
            );
        }
        if kept.is_empty() {
            let reason = format!("all {} updates were screened out", inputs.len());
            return (RoundOutcome::Failed { reason }, screened, influence);
        }
        let kept: Vec<(&str, &Update)> = kept.iter().map(|(c, u)| (*c, u.as_ref())).collect();
        let info = self.config.round_info(round);
        let outcome = match self.method.aggregate(&info, &self.global, &kept) {
            Ok(global) => match global.iter().find_map(|b| b.decode().err()) {
                Some(e) => {
                    tracing::error!(round, error = %e, "the aggregate is not a usable model; the global model stays");
                    RoundOutcome::Failed { reason: format!("the aggregate is not a usable model: {e}") }
                }
                None => {
                    self.global = global;
                    RoundOutcome::Aggregated
                }
            },
            Err(e) => RoundOutcome::Failed { reason: format!("aggregation failed: {e}") },
        };
        (outcome, screened, influence)
    }

    /// A new global version exists (a round closed, or a buffer aggregated): persist it before
    /// anything is announced, report it, and finish after the last configured round.
    fn close_version(&mut self, report: RoundReport) {
        if matches!(report.outcome, RoundOutcome::Failed { .. }) {
            self.stats.failed_rounds += 1;
        }
        self.last_round = report.round;
        self.rng = Rng::derive(self.config.seed, self.last_round);
        let report = Arc::new(report);
        // The owner logs the round's line (with its quality); this one is for debugging the engine.
        tracing::debug!(round = report.round, aggregated = report.updates.len(), missing = report.missing.len(), outcome = ?report.outcome, "round closed");
        let checkpoint = Arc::new(self.checkpoint());
        self.actions
            .push_back(Action::Persist(Persist::Closed { checkpoint: checkpoint.clone(), report: report.clone() }));
        self.actions.push_back(Action::RoundClosed(report, checkpoint));
        if self.config.rounds > 0 && self.last_round >= self.config.rounds {
            self.finished = true;
            let to: Vec<ClientId> =
                self.clients.iter().filter(|(_, c)| c.connected).map(|(id, _)| id.clone()).collect();
            for client in to {
                self.actions.push_back(Action::Send { to: client, msg: goodbye("federation finished") });
            }
            self.actions.push_back(Action::Finished);
        }
    }
}

fn cost_ack(client: &str, round: u64) -> Action {
    Action::Send { to: client.into(), msg: Message::CostAck(anchorage_shared::protocol::CostAck { round }) }
}

fn goodbye(reason: &str) -> Message {
    Message::Goodbye(Goodbye { reason: reason.into() })
}

/// Checks that `update` has exactly the block names and shapes of `reference`.
fn same_layout(reference: &[ParamBlock], update: &[ParamBlock]) -> Result<(), String> {
    if reference.len() != update.len() {
        return Err(format!("expected {} blocks, got {}", reference.len(), update.len()));
    }
    for r in reference {
        match update.iter().find(|u| u.name == r.name) {
            None => return Err(format!("block `{}` is missing", r.name)),
            Some(u) if u.tensor.shape != r.tensor.shape => {
                return Err(format!(
                    "block `{}` has shape {:?}, expected {:?}",
                    r.name, u.tensor.shape, r.tensor.shape
                ));
            }
            Some(_) => {}
        }
    }
    Ok(())
}
