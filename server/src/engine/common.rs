//! What both modes of the engine share ([`Core`]): the configuration, the method, the clients,
//! the global model and its counters, the invitations cost records are checked against, the
//! devices' rollback witness, and the queue of actions. Also the steps both modes take: refusing,
//! judging cost records, aggregating a set of updates and closing a version.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::{
    Broadcast, Decline, Goodbye, Hello, Message, Refusal, RefusalReason, RoundConfig, Update,
};
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::ParamBlock;

use super::configure::{RoundContext, RoundPlan};
use super::privacy::{PrivacyAccount, PrivacyState};
use super::role::{RelayState, Role, RoleState, RootState};
use super::{
    Action, Checkpoint, ClientId, EngineConfig, EngineStats, INVITATIONS_KEPT, Persist, ROLLBACK_QUORUM, RoundOutcome,
    RoundReport,
};
use crate::aggregate::{InfluenceReport, RoundScreen, ScreenReason, Screened};
use crate::methods::ServerMethod;

#[derive(Debug, Clone)]
struct ClientInfo {
    connected: bool,
    /// Buffered mode: the last version this client was dispatched to train on.
    last_version: Option<u64>,
    /// The sample count its hello claimed (secure aggregation's weights).
    num_samples: u64,
}

/// What a round closes with: the devices' updates (synchronous rounds, buffered versions, a
/// relay's devices) with how many were invited, or the one sum a secure aggregation output.
pub(super) enum Collected<'a> {
    Updates { updates: &'a [(&'a str, &'a Update)], invited: usize },
    SecureSum(&'a Update),
}

/// The engine's state that does not depend on its mode. See the module docs.
pub(super) struct Core {
    config: EngineConfig,
    method: Box<dyn ServerMethod>,
    rng: Rng,
    /// Every client that said hello; change `connected` only through [`Core::connect`] and
    /// [`Core::disconnect`], which keep [`Core::connected`]'s count.
    clients: BTreeMap<ClientId, ClientInfo>,
    /// How many of `clients` are connected: every hello asks, so it is kept rather than counted.
    connected_count: usize,
    global: Vec<ParamBlock>,
    last_round: u64,
    /// Who was invited to each of the last [`INVITATIONS_KEPT`] rounds, and whether their cost
    /// record for it arrived.
    invited: BTreeMap<u64, BTreeMap<ClientId, bool>>,
    /// The last round each device was invited to (for [`super::Selection::LeastRecent`]).
    last_invited: BTreeMap<ClientId, u64>,
    stats: EngineStats,
    /// The last aggregated round's lower median delta norm: the reference of `min_norm_ratio`
    /// (none after a restart until a round aggregates).
    last_median_norm: Option<f64>,
    /// Devices whose hello named a round beyond any this engine announced, with that round: the
    /// devices' witness of a rolled-back store (module `crate::store::witness`).
    ahead: BTreeMap<ClientId, u64>,
    finished: bool,
    actions: VecDeque<Action>,
    /// Differential privacy (`[engine.privacy]`); `None` when off.
    privacy: Option<PrivacyState>,
    /// The engine's role and what it keeps for it ([`super::role`]).
    role: RoleState,
}

impl Core {
    /// The shared state of an engine that continues from `checkpoint`; round numbers continue
    /// above `round_floor` (an accepted rollback).
    pub(super) fn resume(
        config: EngineConfig,
        mut method: Box<dyn ServerMethod>,
        checkpoint: Checkpoint,
        round_floor: u64,
    ) -> Self {
        let rng = Rng::derive(config.seed, checkpoint.round);
        let privacy = privacy_state(&config, method.name(), None);
        let mut role = RoleState::new(config.role);
        let state = match role.relay_mut() {
            Some(relay) => relay.load_state(&checkpoint.method_state),
            None => method.load_state(&checkpoint.method_state),
        };
        if let Err(e) = state {
            tracing::error!(error = %e, round = checkpoint.round, "the checkpoint's method state is unreadable; the method starts fresh");
        }
        super::secagg::log_screening(&config);
        Self {
            // A `[engine.privacy]` that cannot be met runs no round (`EngineConfig::check` refuses it first).
            finished: privacy.is_err() || (config.rounds > 0 && checkpoint.round >= config.rounds),
            privacy: privacy.unwrap_or(None),
            config,
            method,
            rng,
            clients: BTreeMap::new(),
            connected_count: 0,
            global: checkpoint.global,
            // After an accepted rollback, numbering continues above every round ever announced.
            last_round: checkpoint.round.max(round_floor),
            invited: BTreeMap::new(),
            last_invited: BTreeMap::new(),
            stats: checkpoint.stats,
            last_median_norm: None,
            ahead: BTreeMap::new(),
            actions: VecDeque::new(),
            role,
        }
    }

    /// The engine's configuration.
    pub(super) fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The method's server half.
    pub(super) fn method(&self) -> &dyn ServerMethod {
        self.method.as_ref()
    }

    /// The global model as of the last closed round (or buffered version).
    pub(super) fn global(&self) -> &[ParamBlock] {
        &self.global
    }

    /// The last round (version) that closed; 0 before the first.
    pub(super) fn last_round(&self) -> u64 {
        self.last_round
    }

    /// Whether the federation is over here.
    pub(super) fn is_finished(&self) -> bool {
        self.finished
    }

    /// Counters since the federation began.
    pub(super) fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Counts an update received twice (acked again, aggregated once).
    pub(super) fn count_duplicate(&mut self) {
        self.stats.duplicate_updates += 1;
    }

    /// Counts an update for a round (version) that closed: acked, not aggregated.
    pub(super) fn count_late(&mut self) {
        self.stats.late_updates += 1;
    }

    /// Counts `n` invited devices that sent nothing in time.
    pub(super) fn count_dropped(&mut self, n: usize) {
        self.stats.dropped += n as u64;
    }

    /// Queues an action for the shell.
    pub(super) fn push(&mut self, action: Action) {
        self.actions.push_back(action);
    }

    /// The next action for the shell.
    pub(super) fn pop_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Queues `msg` to one client.
    pub(super) fn send(&mut self, to: &str, msg: Message) {
        self.actions.push_back(Action::Send { to: to.into(), msg });
    }

    /// `k` distinct indices below `n`, drawn from the round's seeded generator.
    pub(super) fn sample_indices(&mut self, n: usize, k: usize) -> Vec<usize> {
        self.rng.sample_indices(n, k)
    }

    /// Whether `client` said hello (now or before).
    pub(super) fn is_known(&self, client: &str) -> bool {
        self.clients.contains_key(client)
    }

    /// The sample count `client`'s hello claimed.
    pub(super) fn num_samples_of(&self, client: &str) -> Option<u64> {
        self.clients.get(client).map(|c| c.num_samples)
    }

    /// Buffered mode: the connected clients not yet dispatched to train on `version` or later,
    /// in id order.
    pub(super) fn idle_before(&self, version: u64) -> impl Iterator<Item = &ClientId> {
        self.clients
            .iter()
            .filter(move |(_, c)| c.connected && c.last_version.is_none_or(|v| v < version))
            .map(|(id, _)| id)
    }

    /// Buffered mode: `clients` train on `version` now (invited to round `version + 1`).
    pub(super) fn note_dispatched(&mut self, version: u64, clients: &[ClientId]) {
        self.note_invited(version + 1, clients.iter().cloned());
        for client in clients {
            if let Some(c) = self.clients.get_mut(client) {
                c.last_version = Some(version);
            }
        }
    }

    /// Buffered mode: `client`'s training was given up on (no update within the deadline): it
    /// is idle again, and may train on the current version once more. Without this, a version
    /// that every connected device was dispatched on and some gave up on never fills.
    pub(super) fn dispatch_abandoned(&mut self, client: &str) {
        if let Some(c) = self.clients.get_mut(client) {
            c.last_version = None;
        }
    }

    /// Devices that reported a round beyond this server's.
    pub(super) fn devices_ahead(&self) -> usize {
        self.ahead.len()
    }

    /// Round `round`'s broadcast of the current global model and prototypes, with `config`.
    pub(super) fn broadcast_message(&self, round: u64, config: RoundConfig) -> Arc<Message> {
        Arc::new(Message::Broadcast(Broadcast {
            round,
            task: self.config.task_of(round),
            config,
            blocks: self.global.clone(),
            prototypes: self.method.prototypes(),
        }))
    }

    /// An engine resumed from a finished federation says so first thing, so that its owner does
    /// not wait for rounds that will never open.
    pub(super) fn announce_if_finished(&mut self) {
        if self.finished {
            tracing::info!(
                round = self.last_round,
                rounds = self.config.rounds,
                "resumed a finished federation: every configured round has closed"
            );
            self.actions.push_back(Action::Finished);
        }
    }

    #[cfg(test)]
    pub(super) fn privacy_mut(&mut self) -> Option<&mut PrivacyState> {
        self.privacy.as_mut()
    }

    /// The engine's role.
    pub(super) fn role(&self) -> Role {
        self.role.role()
    }

    /// A relay's state; `None` at the root.
    pub(super) fn relay(&self) -> Option<&RelayState> {
        self.role.relay()
    }

    pub(super) fn relay_mut(&mut self) -> Option<&mut RelayState> {
        self.role.relay_mut()
    }

    /// A root's state; `None` at a relay.
    pub(super) fn root(&self) -> Option<&RootState> {
        self.role.root()
    }

    pub(super) fn root_mut(&mut self) -> Option<&mut RootState> {
        self.role.root_mut()
    }

    /// A relay opens no round before its parent's broadcast of it.
    pub(super) fn awaits_parent(&self) -> bool {
        self.role.awaits_parent()
    }

    /// Whether `client` is a relay this root takes partial aggregates and cost batches from.
    pub(super) fn is_relay_peer(&self, client: &str) -> bool {
        self.root().is_some_and(|r| r.relays.contains(client))
    }

    /// Marks `client` as a relay peer (its certificate carries the relay role), or not.
    pub(super) fn set_relay_peer(&mut self, client: &str, relay: bool) {
        if let Some(root) = self.root_mut() {
            if relay {
                root.relays.insert(client.into());
            } else {
                root.relays.remove(client);
            }
        }
    }

    /// A relay takes its parent's model as its own: `round` is the last closed there.
    pub(super) fn take_parent_model(&mut self, last_round: u64, blocks: Vec<ParamBlock>) {
        self.last_round = last_round;
        self.global = blocks;
    }

    /// The invitations of the last rounds, so that a device's resent cost record is judged
    /// (and confirmed) as it would have been before the restart.
    pub(super) fn restore_invitations(&mut self, invitations: Vec<(u64, Vec<ClientId>, Vec<ClientId>)>) {
        for (round, invited, costed) in invitations {
            self.note_invited(round, invited);
            if let Some(flags) = self.invited.get_mut(&round) {
                for c in costed {
                    if let Some(f) = flags.get_mut(&c) {
                        *f = true;
                    }
                }
            }
        }
    }

    /// Round `round`'s target and plan: the operator's `[engine.policy]` picks among the
    /// connected devices, then the method changes what it will; the invitations stay among the
    /// connected devices. Also returns how many were connected.
    pub(super) fn plan_round(&mut self, round: u64) -> (usize, RoundPlan, usize) {
        // Borrowed, not cloned: a fleet of a million devices would copy every id each round.
        let available: Vec<&ClientId> = self.clients.iter().filter(|(_, c)| c.connected).map(|(id, _)| id).collect();
        let target = self.config.sample_size(available.len());
        let invite = self.config.invited(target, available.len());
        let ctx = RoundContext {
            round,
            task: self.config.task_of(round),
            rounds: self.config.rounds,
            available: &available,
            invite,
            last_invited: &self.last_invited,
        };
        let mut plan = self.config.policy.configure_round(&ctx, &self.config.round, &mut self.rng);
        self.method.configure_round(&ctx, &mut plan);
        // `available` is in id order (the map's).
        plan.invited.retain(|c| available.binary_search(&c).is_ok());
        (target, plan, available.len())
    }

    /// Number of connected clients.
    pub(super) fn connected(&self) -> usize {
        self.connected_count
    }

    /// A client said hello: it is connected, with the sample count its hello claimed (the
    /// buffered version it was last dispatched to train on stays).
    pub(super) fn connect(&mut self, client: &str, num_samples: u64) {
        let last_version = self.clients.get(client).and_then(|c| c.last_version);
        let info = ClientInfo { connected: true, last_version, num_samples };
        if !self.clients.insert(client.into(), info).is_some_and(|old| old.connected) {
            self.connected_count += 1;
        }
        self.debug_check_connected();
    }

    /// A client's connection is gone (it stays known).
    pub(super) fn disconnect(&mut self, client: &str) {
        if let Some(c) = self.clients.get_mut(client)
            && std::mem::replace(&mut c.connected, false)
        {
            self.connected_count -= 1;
        }
        self.debug_check_connected();
    }

    /// Invariant: the kept count is the number of connected clients (a pass over every client:
    /// debug builds only).
    fn debug_check_connected(&self) {
        debug_assert_eq!(
            self.connected_count,
            self.clients.values().filter(|c| c.connected).count(),
            "the connected count drifted from the connected clients"
        );
    }

    /// The connected clients, in id order.
    pub(super) fn connected_ids(&self) -> Vec<ClientId> {
        self.clients.iter().filter(|(_, c)| c.connected).map(|(id, _)| id.clone()).collect()
    }

    /// The global state as of the last closed round: what a store keeps per version.
    pub(super) fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            round: self.last_round,
            method: self.method.name().into(),
            global: self.global.clone(),
            stats: self.stats.clone(),
            method_state: match self.relay() {
                Some(relay) => relay.save_state(),
                None => self.method.save_state(),
            },
            prototypes: self.method.prototypes(),
        }
    }

    /// Closes (and counts) a hello that names another client or runs another method; true when
    /// the hello may go on.
    pub(super) fn admit_hello(&mut self, client: &str, hello: &Hello) -> bool {
        let refusal = if hello.client_id != client {
            Refusal::new(
                RefusalReason::NotEnrolled,
                format!("hello names `{}` but the connection is `{client}`", hello.client_id),
            )
        } else if !hello.capabilities.methods.iter().any(|m| m.as_str() == self.method.name()) {
            Refusal::new(RefusalReason::UnknownMethod, format!("this federation runs `{}`", self.method.name()))
        } else {
            return true;
        };
        self.stats.refused += 1;
        self.actions.push_back(Action::Close { client: client.into(), refusal });
        false
    }

    /// A client's measured cost of a round it took part in: into the ledger under its identity.
    /// The record is checked against what the server saw: the client must have been invited to
    /// that round, and each invitation takes one record (so one peer writes at most one row per
    /// round it was invited to, whatever it sends); its byte counts must fit the frames the
    /// federation allows. A record that fails is dropped and counted, not answered with a
    /// refusal (a refusal would make the device set its unsent update aside); the log says so
    /// for the 1st, 2nd, 4th, 8th, … dropped record, so a flood cannot flood the log either.
    pub(super) fn on_cost(&mut self, client: &str, mut record: CostRecord) {
        if !self.clients.contains_key(client) {
            self.refuse(client, RefusalReason::NotEnrolled, "send a hello first".into());
            return;
        }
        let invitation = self.invited.get(&record.round).and_then(|c| c.get(client)).copied();
        let already_costed = invitation == Some(true);
        let why = match invitation {
            None => Some(format!("round {} is not one this client was invited to lately", record.round)),
            Some(true) => Some(format!("round {} already has this client's cost record", record.round)),
            Some(false) => self.implausible(&record),
        };
        if let Some(why) = why {
            self.drop_cost_record(client, record.round, &why);
            if already_costed {
                // A resend of a record the ledger holds (the confirmation was lost): confirm again.
                self.actions.push_back(cost_ack(client, record.round));
            }
            return;
        }
        if let Some(costed) = self.invited.get_mut(&record.round).and_then(|c| c.get_mut(client)) {
            *costed = true;
        }
        record.client = client.into();
        let round = record.round;
        // The shell appends the record to the ledger before it sends the confirmation.
        self.actions.push_back(Action::Ledger(record));
        self.actions.push_back(cost_ack(client, round));
    }

    /// What is impossible about a cost record on its own: bytes beyond the frame limits, or
    /// figures no device measures.
    pub(super) fn implausible(&self, record: &CostRecord) -> Option<String> {
        let max_payload = u64::from(self.config.max_frame_bytes);
        let max_wire = max_payload.saturating_mul(8).saturating_add(1 << 20);
        if record.payload_up.max(record.payload_down) > max_payload {
            Some(format!("payload bytes above the {max_payload}-byte frame limit"))
        } else if record.wire_up.max(record.wire_down) > max_wire {
            Some(format!("wire bytes above {max_wire}"))
        } else {
            record.check_physical().err()
        }
    }

    /// Counts a dropped cost record (and logs the 1st, 2nd, 4th, 8th, … of them).
    pub(super) fn drop_cost_record(&mut self, client: &str, round: u64, why: &str) {
        self.stats.refused += 1;
        self.stats.dropped_cost_records += 1;
        let dropped = self.stats.dropped_cost_records;
        if dropped.is_power_of_two() {
            tracing::warn!(client, round, %why, dropped, "cost record dropped");
        }
    }

    /// An invited device declined `round`: logged, counted, and a ledger row of kind
    /// `declined`, never a drop. Whether it was invited is for the mode to check first.
    pub(super) fn record_decline(&mut self, client: &str, decline: &Decline) {
        tracing::info!(
            client,
            round = decline.round,
            reason = decline.reason.name(),
            detail = %decline.detail,
            "an invited device declined the round"
        );
        self.actions.push_back(Action::Ledger(CostRecord {
            client: client.into(),
            round: decline.round,
            declined: Some(decline.reason),
            ..CostRecord::default()
        }));
    }

    /// Copies what is kept per device (known clients, recent invitations, devices ahead of the
    /// store) into fresh allocations; the contents do not change.
    pub(super) fn compact(&mut self) {
        self.clients = self.clients.iter().map(|(id, c)| (id.clone(), c.clone())).collect();
        let invited = self.invited.iter().map(|(r, ids)| (*r, ids.iter().map(|(id, f)| (id.clone(), *f)).collect()));
        self.invited = invited.collect();
        self.ahead = self.ahead.iter().map(|(id, r)| (id.clone(), *r)).collect();
        self.last_invited = self.last_invited.iter().map(|(id, r)| (id.clone(), *r)).collect();
    }

    /// Remembers who was invited to `round` (for checking cost records), for the last few rounds.
    pub(super) fn note_invited(&mut self, round: u64, clients: impl IntoIterator<Item = ClientId>) {
        let invited = self.invited.entry(round).or_default();
        for client in clients {
            let last = self.last_invited.entry(client.clone()).or_insert(round);
            *last = (*last).max(round);
            invited.insert(client, false);
        }
        self.invited.retain(|r, _| r + INVITATIONS_KEPT > round);
    }

    /// A device's last round is a witness of what this server announced: one beyond the newest
    /// round it knows (`last_round`, plus the open one) means the store lost rounds. One device
    /// raises the alarm; [`ROLLBACK_QUORUM`] devices (or every known one, if fewer) stop new
    /// rounds until the operator decides (`anchorage-server accept-rollback`), so that a single
    /// hostile device cannot halt the federation with a made-up number. `round_open` says
    /// whether a round is open now (then no new one would open anyway).
    ///
    /// A relay takes no witness: its rounds are its parent's, and a device that failed over
    /// trained rounds under a sibling relay that this relay never saw. The root takes the
    /// relay's own last round as its witness instead.
    pub(super) fn compare_witness(&mut self, client: &str, last_round: Option<u64>, round_open: bool) {
        if self.role() == Role::Relay {
            return;
        }
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
        if self.rollback_suspected().is_some() && !round_open {
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
    pub(super) fn rollback_suspected(&self) -> Option<(usize, u64)> {
        let quorum = ROLLBACK_QUORUM.min(self.clients.len().max(1));
        (self.ahead.len() >= quorum).then(|| (self.ahead.len(), self.ahead.values().max().copied().unwrap_or(0)))
    }

    pub(super) fn refuse(&mut self, client: &str, reason: RefusalReason, detail: String) {
        self.refuse_with(client, Refusal::new(reason, detail));
    }

    /// Sends `refusal` to `client` (counted and logged).
    pub(super) fn refuse_with(&mut self, client: &str, refusal: Refusal) {
        self.stats.refused += 1;
        tracing::warn!(client, reason = ?refusal.reason, detail = %refusal.detail, devices = ?refusal.devices, "refused");
        self.actions.push_back(Action::Send { to: client.into(), msg: Message::Refusal(refusal) });
    }

    /// Acknowledges `round`'s update from `client`. A relay's ack `aggregated: true` waits for
    /// its parent's ack of the partial that holds the update, and repeats it
    /// ([`RelayState::ack_owed`]): a relay's ack means what the root's means.
    pub(super) fn ack(&mut self, client: &str, round: u64, aggregated: bool) {
        let aggregated = match self.role.relay_mut() {
            Some(relay) if aggregated => match relay.ack_owed(client, round) {
                Some(parent) => parent,
                None => return,
            },
            _ => aggregated,
        };
        self.actions.push_back(ack(client, round, aggregated));
    }

    /// The screens of `[engine.robust]` that run before an update's ack, against `reference`
    /// (the model the client trained on): finite values, a bounded delta and a change of an
    /// honest shape.
    pub(super) fn screen(&self, update: &Update, reference: &[ParamBlock]) -> Result<(), ScreenReason> {
        let robust = &self.config.robust;
        robust
            .screen_update(update, reference)
            .and_then(|norm| robust.screen_change(update, reference, norm, self.last_median_norm))
    }

    /// The one close pipeline of every round and version: screen and bound what was collected,
    /// the privacy stage (central noise on plain updates), the method's fold, then the
    /// accountant's step; a usable result becomes the global model (a result that is not finite
    /// fails the round and the model stays). Returns the outcome, the updates screened out
    /// (only one that decodes no more, which the ack-time screen makes impossible) and what the
    /// bounds did.
    pub(super) fn aggregate(&mut self, collected: Collected<'_>) -> (RoundOutcome, Vec<Screened>, InfluenceReport) {
        let round = self.last_round + 1;
        match collected {
            Collected::Updates { updates, invited } => {
                let RoundScreen { kept, screened, influence } = self.screen_stage(round, updates);
                if kept.is_empty() {
                    let reason = format!("all {} updates were screened out", updates.len());
                    return (RoundOutcome::Failed { reason }, screened, influence);
                }
                let kept: Vec<(&str, &Update)> = kept.iter().map(|(c, u)| (*c, u.as_ref())).collect();
                // What the round released, as the devices sent it (the privacy stage merges prototypes).
                let with_prototypes = kept.iter().any(|(_, u)| !u.prototypes.is_empty());
                let private = self.privacy_stage(&kept, invited);
                let kept: Vec<(&str, &Update)> = match &private {
                    Some(private) => kept.iter().zip(private).map(|((c, _), u)| (*c, u)).collect(),
                    None => kept,
                };
                (self.fold_and_book(round, &kept, with_prototypes), screened, influence)
            }
            Collected::SecureSum(sum) => {
                // The per-update screens cannot run on a sum: its values are screened.
                if let Err(reason) = self.config.robust.screen_values(sum) {
                    tracing::error!(round, %reason, "the securely aggregated sum failed the value screen");
                    let reason = format!("the sum failed the value screen: {reason}");
                    return (RoundOutcome::Failed { reason }, Vec::new(), InfluenceReport::default());
                }
                let outcome = self.fold_and_book(round, &[("secure-aggregate", sum)], !sum.prototypes.is_empty());
                (outcome, Vec::new(), InfluenceReport::default())
            }
        }
    }

    /// The screen-and-bound stage (`[engine.robust]`): capped sample counts, then the influence
    /// bounds, which drop nothing that was acked; logs and counts what it did.
    fn screen_stage<'a>(&mut self, round: u64, updates: &'a [(&'a str, &'a Update)]) -> RoundScreen<'a> {
        let mut screen = self.config.robust.screen_round(updates, &self.global);
        let influence = &mut screen.influence;
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
        self.count_screened(round, &screen.screened);
        screen
    }

    /// The privacy stage (`[engine.privacy]`): each update clipped and noised at the server
    /// (central noise), prototypes merged; `None` when privacy is off. A secure sum skips it:
    /// its noise was added on the devices.
    fn privacy_stage(&mut self, kept: &[(&str, &Update)], invited: usize) -> Option<Vec<Update>> {
        let connected = self.connected();
        let privacy = self.privacy.as_mut()?;
        Some(privacy.privatize(kept, &self.global, invited, connected))
    }

    /// The method's fold of `kept`, then the accountant's step for what it released
    /// (`with_prototypes`: prototypes too).
    fn fold_and_book(&mut self, round: u64, kept: &[(&str, &Update)], with_prototypes: bool) -> RoundOutcome {
        let outcome = self.run_method(round, kept);
        self.book_privacy(round, &outcome, with_prototypes);
        outcome
    }

    /// The one place the privacy accountant steps: a round that aggregated under
    /// `[engine.privacy]` released its noised sums (and its prototypes' when it sent any).
    fn book_privacy(&mut self, round: u64, outcome: &RoundOutcome, with_prototypes: bool) {
        if matches!(outcome, RoundOutcome::Aggregated)
            && let Some(Err(e)) = self.privacy.as_mut().map(|p| p.account(with_prototypes))
        {
            tracing::error!(round, error = %e, "the privacy accountant could not take the round");
        }
    }

    /// Continues the privacy account from the last round report's (a restart).
    pub(super) fn resume_privacy(&mut self, account: Option<&PrivacyAccount>) {
        if account.is_none() {
            return;
        }
        match privacy_state(&self.config, self.method.name(), account) {
            Ok(privacy) => self.privacy = privacy,
            Err(_) => self.finished = true,
        }
    }

    /// Whether the privacy budget allows another round; when it does not, the federation
    /// finishes (logged, and every device told why).
    pub(super) fn privacy_allows_a_round(&mut self) -> bool {
        let Some(privacy) = &self.privacy else { return true };
        if privacy.may_open() {
            return true;
        }
        let account = privacy.snapshot();
        tracing::warn!(
            epsilon = account.epsilon,
            delta = account.delta,
            limit = ?self.config.privacy.epsilon_limit(),
            rounds = account.rounds,
            "the privacy budget is spent: another round would take ε past its limit; the federation finishes"
        );
        self.finish("privacy budget spent");
        false
    }

    /// The federation is over: every connected device is told `reason`.
    pub(super) fn finish(&mut self, reason: &str) {
        self.finished = true;
        for client in self.connected_ids() {
            self.actions.push_back(Action::Send { to: client, msg: goodbye(reason) });
        }
        self.actions.push_back(Action::Finished);
    }

    /// Counts and logs acked updates that the round's screen took out.
    fn count_screened(&mut self, round: u64, screened: &[Screened]) {
        if screened.is_empty() {
            return;
        }
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

    /// The method's aggregation of the kept updates (a relay's: its fold into the partial); a
    /// usable result becomes the global model.
    fn run_method(&mut self, round: u64, kept: &[(&str, &Update)]) -> RoundOutcome {
        let info = self.config.round_info(round);
        let global = match self.role.relay_mut() {
            Some(relay) => relay.fold(round, kept).map(|()| self.global.clone()),
            None => self.method.aggregate(&info, &self.global, kept),
        };
        match global {
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
        }
    }

    /// A new global version exists (a round closed, or a buffer aggregated): persist it before
    /// anything is announced, report it, and finish after the last configured round.
    pub(super) fn close_version(&mut self, report: RoundReport) {
        self.close_version_then(report, Vec::new());
    }

    /// [`Core::close_version`], with `after_commit` queued right after the version's commit and
    /// before anything else (a secure round's acks: durable first, and ahead of the goodbyes that
    /// end the federation after its last round).
    pub(super) fn close_version_then(&mut self, mut report: RoundReport, after_commit: Vec<Action>) {
        report.privacy = self.privacy.as_ref().map(PrivacyState::snapshot);
        if matches!(report.outcome, RoundOutcome::Failed { .. }) {
            self.stats.failed_rounds += 1;
        }
        // Round numbers only grow and are never reused (a relay closes its parent's numbers).
        assert!(
            self.role.root().is_none() || report.round > self.last_round,
            "round {} closed after round {}: a round number was reused",
            report.round,
            self.last_round
        );
        self.last_round = report.round;
        self.rng = Rng::derive(self.config.seed, self.last_round);
        let report = Arc::new(report);
        // The owner logs the round's line (with its quality); this one is for debugging the engine.
        tracing::debug!(round = report.round, aggregated = report.updates.len(), missing = report.missing.len(), outcome = ?report.outcome, "round closed");
        let checkpoint = Arc::new(self.checkpoint());
        self.actions
            .push_back(Action::Persist(Persist::Closed { checkpoint: checkpoint.clone(), report: report.clone() }));
        self.actions.push_back(Action::RoundClosed(report, checkpoint));
        self.actions.extend(after_commit);
        if self.config.rounds > 0 && self.last_round >= self.config.rounds {
            self.finish("federation finished");
        } else {
            self.privacy_allows_a_round();
        }
    }
}

/// The ack of `round`'s update from `client`.
pub(super) fn ack(client: &str, round: u64, aggregated: bool) -> Action {
    let ack = anchorage_shared::protocol::Ack { round, aggregated };
    Action::Send { to: client.into(), msg: Message::Ack(ack) }
}

pub(super) fn cost_ack(client: &str, round: u64) -> Action {
    Action::Send { to: client.into(), msg: Message::CostAck(anchorage_shared::protocol::CostAck { round }) }
}

pub(super) fn goodbye(reason: &str) -> Message {
    Message::Goodbye(Goodbye { reason: reason.into() })
}

/// Checks that `update` has exactly the block names and shapes of `reference`.
pub(super) fn same_layout(reference: &[ParamBlock], update: &[ParamBlock]) -> Result<(), String> {
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

/// The privacy state `config` asks for, continuing `account` (logged when it cannot be met).
fn privacy_state(
    config: &EngineConfig,
    method: &str,
    account: Option<&PrivacyAccount>,
) -> Result<Option<PrivacyState>, super::PrivacyStateError> {
    let seed = config.noise_seed.unwrap_or_else(os_seed);
    let prototypes = super::privacy::sends_prototypes(method);
    PrivacyState::new(&config.privacy, (config.rounds, config.fraction), prototypes, seed, account).inspect_err(|e| {
        tracing::error!(error = %e, "[engine.privacy] cannot be met: no round runs without it");
    })
}

/// A seed nobody can predict, from the operating system.
fn os_seed() -> u64 {
    let mut bytes = [0u8; 8];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes);
    u64::from_le_bytes(bytes)
}
