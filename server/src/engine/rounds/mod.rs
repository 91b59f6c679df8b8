//! Synchronous rounds, as Flower and FedScale run them ([`RoundsState`]): wait for
//! `min_available` clients, sample `max(min_fit, ⌈fraction·available⌉)` of them, over-select by
//! `over_selection` (FedScale's over-commitment), close the round when the target number of
//! updates arrived or when the deadline fires. Updates for a closed round are acknowledged and
//! counted as late, never aggregated and never silently dropped; a second update from the same
//! client for the same round is counted once. An invited device that declines is
//! neither a drop nor missing: another connected device is invited in its place.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::ledger::CostRecord;
use anchorage_shared::ledger::DeclineReason;
use anchorage_shared::protocol::{Broadcast, Decline, Message, RefusalReason, RoundConfig, SecAggFrame, Update};
use anchorage_shared::tensor::payload_bytes;

use super::common::{Collected, Core, same_layout};
use super::configure::RoundPlan;
use super::secagg::{SecAggReport, SecAggRound};
use super::{
    AcceptedUpdate, Action, ClientId, ModeState, OpenedRound, Persist, RoundOutcome, RoundReport, UpdateReport, report,
};
use crate::aggregate::InfluenceReport;
use relayed::adopt_failover;

mod relayed;
mod secure;

/// The round now open.
#[derive(Debug)]
pub(super) struct OpenRound {
    pub(super) round: u64,
    /// The round's broadcast, encoded once for every invited device without settings of its own.
    pub(super) broadcast: Arc<Message>,
    /// The broadcasts of devices the round's plan gave other settings (one per distinct one).
    pub(super) tailored: BTreeMap<ClientId, Arc<Message>>,
    pub(super) sampled: BTreeSet<ClientId>,
    pub(super) target: usize,
    pub(super) started: Duration,
    pub(super) deadline: Duration,
    pub(super) updates: BTreeMap<ClientId, (Arc<AcceptedUpdate>, Duration)>,
    pub(super) duplicates: u64,
    pub(super) refused: u64,
    /// Invited devices that declined, and why (removed from `sampled`).
    pub(super) declined: BTreeMap<ClientId, DeclineReason>,
    /// The round's secure aggregation (`[engine.secagg]`); `None` when off.
    pub(super) secagg: Option<Box<SecAggRound>>,
}

impl OpenRound {
    /// The broadcast `client` trains from.
    pub(super) fn broadcast_of(&self, client: &str) -> Arc<Message> {
        self.tailored.get(client).unwrap_or(&self.broadcast).clone()
    }

    /// Queues the round's broadcasts to `clients`: one action per distinct broadcast.
    pub(super) fn broadcast_to(&self, core: &mut Core, clients: Vec<ClientId>) {
        let (own, plain): (Vec<ClientId>, Vec<ClientId>) =
            clients.into_iter().partition(|c| self.tailored.contains_key(c));
        if !plain.is_empty() {
            core.push(Action::Broadcast { to: plain, msg: self.broadcast.clone() });
        }
        let mut groups: Vec<(Arc<Message>, Vec<ClientId>)> = Vec::new();
        for client in own {
            let msg = self.broadcast_of(&client);
            match groups.iter_mut().find(|(m, _)| Arc::ptr_eq(m, &msg)) {
                Some((_, to)) => to.push(client),
                None => groups.push((msg, vec![client])),
            }
        }
        for (msg, to) in groups {
            core.push(Action::Broadcast { to, msg });
        }
    }

    /// The round's task, as its broadcast says.
    pub(super) fn task(&self) -> u32 {
        match self.broadcast.as_ref() {
            Message::Broadcast(b) => b.task,
            _ => 0,
        }
    }
}

/// State of the synchronous mode: the open round, and who the last closed round aggregated.
#[derive(Debug, Default)]
pub(super) struct RoundsState {
    open: Option<OpenRound>,
    /// Clients whose update the last closed round aggregated: a copy arriving later is a
    /// duplicate, not a late update.
    last_accepted: BTreeSet<ClientId>,
    /// A relay's round that was open at a crash, with the updates it had acked: it opens again
    /// when the parent's broadcast of that round comes back (the relay holds no copy of it).
    stashed: Option<(OpenedRound, Vec<AcceptedUpdate>)>,
}

impl ModeState for RoundsState {
    fn open(&self) -> Option<&OpenRound> {
        self.open.as_ref()
    }

    fn timeout(&self, _core: &Core) -> Option<Duration> {
        self.open.as_ref().map(|o| o.secagg.as_ref().map_or(o.deadline, |s| s.timeout(o.deadline)))
    }

    /// Closes the open round if its deadline passed (under secure aggregation: moves the
    /// protocol on), then opens the next if it may.
    fn on_timeout(&mut self, core: &mut Core, now: Duration) {
        if self.open.as_ref().is_some_and(|o| o.secagg.is_some()) {
            self.step_secagg(core, now);
        } else if self.open.as_ref().is_some_and(|o| now >= o.deadline) {
            self.close_round(core, now);
        }
        self.start(core, now);
    }

    /// Opens a round when none is open, enough clients are connected and the devices do not
    /// witness a rollback: samples the clients, persists the invitations, then broadcasts.
    fn start(&mut self, core: &mut Core, now: Duration) {
        if core.is_finished() || self.open.is_some() || core.rollback_suspected().is_some() {
            return;
        }
        // A relay opens a round only when its parent's broadcast of it came.
        if core.awaits_parent() {
            return;
        }
        // Count before collecting: every hello lands here, and fleets have thousands of clients.
        if core.connected() < core.config().min_to_open() || !core.privacy_allows_a_round() {
            return;
        }
        let round = core.last_round() + 1;
        if let Some((opened, pending)) = self.stashed.take_if(|(o, _)| o.round == round) {
            self.reopen(core, now, opened, pending);
            return;
        }
        let (target, plan, available) = core.plan_round(round);
        let sampled = plan.invited.clone();
        tracing::info!(
            round,
            available,
            target,
            invited = sampled.len(),
            invited_ids = %report::preview(sampled.iter(), 5),
            "round opened"
        );
        let open = open_round_record(core, now, round, target, sampled, Some(&plan));
        core.note_invited(round, open.sampled.iter().cloned());
        // The invitations are durable before anyone trains on them.
        core.push(Action::Persist(Persist::Opened(OpenedRound {
            round,
            task: open.task(),
            target,
            sampled: open.sampled.iter().cloned().collect(),
        })));
        let invited: Vec<ClientId> = open.sampled.iter().cloned().collect();
        open.broadcast_to(core, invited);
        self.open = Some(open);
        if core.config().secagg.enabled {
            self.open_secure(core, now);
        }
    }

    /// Checks an update for the open round in order (invited, not a second copy, the model's
    /// layout, at least one sample, the screens), then accepts it: persisted before its ack.
    fn on_update(&mut self, core: &mut Core, now: Duration, client: &str, mut update: Update) {
        let round = update.round;
        let Some(open) = self.open.as_mut().filter(|o| o.round == round) else {
            self.update_outside_round(core, client, &update);
            return;
        };
        if !open.sampled.contains(client) && !adopt_failover(core, open, client) {
            open.refused += 1;
            core.refuse(client, RefusalReason::NotSampled, format!("not sampled for round {round}"));
            return;
        }
        if open.updates.contains_key(client) {
            open.duplicates += 1;
            core.count_duplicate();
            core.ack(client, round, true);
            return;
        }
        if let Err((reason, detail)) = check_update(core, &update) {
            open.refused += 1;
            core.refuse(client, reason, detail);
            return;
        }
        core.config().robust.cap_samples(client, &mut update);
        let accepted = Arc::new(AcceptedUpdate {
            client: client.into(),
            update,
            staleness: 0,
            arrived_after: now.saturating_sub(open.started),
        });
        open.updates.insert(client.into(), (accepted.clone(), now));
        // Ack after commit: the shell commits the accepted update before it sends the ack.
        core.push(Action::Persist(Persist::Accepted(accepted)));
        core.ack(client, round, true);
        if open.updates.len() >= open.target {
            self.close_round(core, now);
            self.start(core, now);
        }
    }

    /// A decline from a device invited to the open round that has sent no update: it leaves the
    /// invitations, and a connected device not yet asked this round is invited in its place
    /// (persisted before its broadcast), so the round can still reach its target. A decline
    /// from anyone else changes nothing.
    fn on_decline(&mut self, core: &mut Core, _now: Duration, client: &str, decline: Decline) {
        let Some(open) = self.open.as_mut().filter(|o| o.round == decline.round) else {
            tracing::debug!(client, round = decline.round, "a decline for a round that is not open; ignored");
            return;
        };
        if !open.sampled.contains(client) || open.updates.contains_key(client) {
            tracing::debug!(client, round = decline.round, "a decline from a device not waited for; ignored");
            return;
        }
        open.sampled.remove(client);
        open.declined.insert(client.into(), decline.reason);
        core.record_decline(client, &decline);
        if open.secagg.is_some() {
            tracing::info!(
                round = open.round,
                client,
                "no replacement: a secure aggregation's cohort is fixed at round 0"
            );
            return;
        }
        let free: Vec<ClientId> = core
            .connected_ids()
            .into_iter()
            .filter(|c| !open.sampled.contains(c) && !open.declined.contains_key(c))
            .collect();
        let Some(&pick) = core.sample_indices(free.len(), 1).first() else {
            tracing::info!(round = open.round, "no connected device is free to replace a decline");
            return;
        };
        let replacement = free[pick].clone();
        tracing::info!(round = open.round, client = %replacement, "invited in place of a decline");
        open.sampled.insert(replacement.clone());
        core.note_invited(open.round, [replacement.clone()]);
        let sampled = open.sampled.iter().cloned().collect();
        core.push(Action::Persist(Persist::Invited { round: open.round, sampled }));
        open.broadcast_to(core, vec![replacement]);
    }

    /// Resumes the round that was open at the crash, with the updates it had accepted and a
    /// fresh deadline; if it already holds its target, it closes at once.
    fn on_secagg(&mut self, core: &mut Core, now: Duration, client: &str, frame: &SecAggFrame) {
        self.on_secagg_frame(core, now, client, frame);
    }

    fn secagg_resend(&self, client: &str) -> Option<Message> {
        self.resend_secagg(client)
    }

    fn secagg_held_vectors(&self) -> Option<usize> {
        self.held_vectors()
    }

    fn close_for_parent(&mut self, core: &mut Core, now: Duration, round: u64) {
        self.close_as_parent_moved_on(core, now, round);
    }

    fn restore(
        &mut self,
        core: &mut Core,
        open: Option<OpenedRound>,
        pending: Vec<AcceptedUpdate>,
        last_accepted: Vec<ClientId>,
    ) {
        self.last_accepted = last_accepted.into_iter().collect();
        if core.relay().is_some() {
            self.stash(open, pending);
            return;
        }
        let Some(opened) = open.filter(|o| o.round == core.last_round() + 1 && !core.is_finished()) else { return };
        let pending: Vec<AcceptedUpdate> = pending.into_iter().filter(|p| p.update.round == opened.round).collect();
        tracing::info!(
            round = opened.round,
            accepted = pending.len(),
            target = opened.target,
            "resuming the open round"
        );
        let sampled = opened.sampled.into_iter().collect();
        let mut round = open_round_record(core, Duration::ZERO, opened.round, opened.target, sampled, None);
        for p in pending {
            let at = p.arrived_after;
            round.updates.insert(p.client.clone(), (Arc::new(p), at));
        }
        core.note_invited(round.round, round.sampled.iter().cloned());
        let full = round.updates.len() >= round.target;
        self.open = Some(round);
        if core.config().secagg.enabled {
            self.close_secure(core, Duration::ZERO, Err(super::secagg::failed_after_restart()));
        } else if full {
            self.close_round(core, Duration::ZERO);
        }
    }
}

impl RoundsState {
    /// An update for a round that is not open: a copy of one the last round aggregated is a
    /// duplicate (acked again); one for an older round is late (acked, counted, not aggregated,
    /// if its values pass the screen); one for a round not yet open is refused (as busy, so the
    /// device keeps it, when it is the round a restarted relay waits to reopen).
    fn update_outside_round(&mut self, core: &mut Core, client: &str, update: &Update) {
        let round = update.round;
        if round == core.last_round() && self.last_accepted.contains(client) {
            core.count_duplicate();
            core.ack(client, round, true);
        } else if round <= core.last_round() {
            // Late: its round already closed. Acknowledge so the client stops resending, but
            // only values that would have passed the screen: an ack never covers garbage.
            if let Err(reason) = core.config().robust.screen_values(update) {
                core.refuse(client, RefusalReason::BadTensor, format!("update screened out: {reason}"));
                return;
            }
            core.count_late();
            tracing::info!(client, round, "late update counted, not aggregated");
            core.ack(client, round, false);
        } else if self.stashed.as_ref().is_some_and(|(o, _)| o.round == round) {
            // A restarted relay's round reopens on its parent's broadcast, which goes to the
            // devices it waits for: the device keeps its update and sends it then.
            let detail = format!("round {round} resumes here when the parent sends it again");
            core.refuse(client, RefusalReason::ServerBusy, detail);
        } else {
            core.refuse(client, RefusalReason::NotSampled, format!("round {round} is not open"));
        }
    }

    /// Closes the open round: aggregates its updates (or fails with too few), writes a dropped
    /// cost record for each invited client that sent nothing, and closes the version.
    fn close_round(&mut self, core: &mut Core, now: Duration) {
        let Some(open) = self.open.take() else { return };
        let mut updates = update_reports(&open);
        let enough = open.updates.len() >= core.config().min_updates.max(1);
        let (outcome, screened, influence) = if !enough {
            let reason =
                format!("{} of at least {} updates arrived", open.updates.len(), core.config().min_updates.max(1));
            (RoundOutcome::Failed { reason }, Vec::new(), InfluenceReport::default())
        } else {
            let inputs: Vec<(&str, &Update)> =
                open.updates.iter().map(|(id, (a, _))| (id.as_str(), &a.update)).collect();
            core.aggregate(Collected::Updates { updates: &inputs, invited: open.sampled.len() })
        };
        // The report lists the updates aggregated: the screened-out ones count as refused.
        updates.retain(|u| !screened.iter().any(|s| s.client == u.client));
        self.last_accepted = open.updates.keys().cloned().collect();
        let missing = open.sampled.iter().filter(|c| !open.updates.contains_key(*c)).cloned().collect();
        let closing = Closing { outcome, updates, missing, influence, refused: screened.len() as u64, secagg: None };
        finish_close(core, now, open, closing, Vec::new());
    }
}

/// How a round ended, for its report.
struct Closing {
    outcome: RoundOutcome,
    updates: Vec<UpdateReport>,
    /// Invited devices whose update is not in the round (dropped).
    missing: Vec<ClientId>,
    influence: InfluenceReport,
    /// Updates refused at close (screened out).
    refused: u64,
    secagg: Option<SecAggReport>,
}

/// Writes a dropped cost record for each invited device that is not in the round's updates,
/// and closes the version with the round's report.
fn finish_close(core: &mut Core, now: Duration, open: OpenRound, closing: Closing, after_commit: Vec<Action>) {
    let payload_down = match open.broadcast.as_ref() {
        Message::Broadcast(b) => payload_bytes(&b.blocks) as u64,
        _ => 0,
    };
    core.count_dropped(closing.missing.len());
    for client in &closing.missing {
        core.push(Action::Ledger(CostRecord {
            client: client.clone(),
            round: open.round,
            payload_down,
            dropped: true,
            wall_seconds: now.saturating_sub(open.started).as_secs_f64(),
            ..CostRecord::default()
        }));
    }
    let report = RoundReport {
        round: open.round,
        outcome: closing.outcome,
        sampled: open.sampled.len(),
        target: open.target,
        updates: closing.updates,
        missing: closing.missing,
        declined: open.declined.into_iter().collect(),
        duplicates: open.duplicates,
        refused: open.refused + closing.refused,
        late_total: core.stats().late_updates,
        payload_down,
        started: open.started,
        closed: now,
        influence: closing.influence,
        held_out_accuracy: None,
        privacy: None,
        secagg: closing.secagg,
    };
    core.close_version_then(report, after_commit);
}

/// The checks an update for the open round passes before the screens' verdict is final: the
/// global model's layout (the operator's, never an update's), at least one sample, then the
/// screens of `[engine.robust]`. The refusal's reason and detail when one fails.
fn check_update(core: &Core, update: &Update) -> Result<(), (RefusalReason, String)> {
    // The model's layout is the operator's (the initial model), never an update's: a server
    // without one aggregates only methods that share no blocks.
    let layout = if core.global().is_empty() && !update.blocks.is_empty() {
        Err("this server holds no model: its layout comes from the operator (initial_model in server.toml), \
             never from an update"
            .to_string())
    } else {
        same_layout(core.global(), &update.blocks)
    };
    layout.map_err(|detail| (RefusalReason::ShapeMismatch, detail))?;
    if update.num_samples == 0 {
        return Err((RefusalReason::Malformed, "an update must be trained on at least one sample".into()));
    }
    // Screening (`[engine.robust]`): finite values, a bounded delta and a change of an honest
    // shape, all before the ack.
    core.screen(update, core.global())
        .map_err(|reason| (RefusalReason::BadTensor, format!("update screened out: {reason}")))
}

/// Round `round`'s record, its broadcast made from the current global version with `plan`'s
/// settings (a relay's: its parent's broadcast of the round, settings and all). A round resumed
/// after a restart has no plan: it trains with `[engine.round]`'s settings at the schedule's
/// learning rate.
fn open_round_record(
    core: &mut Core,
    now: Duration,
    round: u64,
    target: usize,
    sampled: BTreeSet<ClientId>,
    plan: Option<&RoundPlan>,
) -> OpenRound {
    let deadline = core.config().round_deadline;
    if let Some(from_parent) = core.relay_mut().and_then(|r| r.take(round, deadline)) {
        return round_record(
            round,
            Arc::new(Message::Broadcast(from_parent)),
            BTreeMap::new(),
            (now, deadline),
            target,
            sampled,
        );
    }
    let broadcast_with = |config: &RoundConfig| {
        let mut config = config.clone();
        config.deadline_ms = deadline.as_millis() as u64;
        Arc::new(Message::Broadcast(Broadcast {
            round,
            task: core.config().task_of(round),
            config,
            blocks: core.global().to_vec(),
            prototypes: core.method().prototypes(),
        }))
    };
    let scheduled =
        core.config().policy.schedule.learning_rate(core.config().round.learning_rate, round, core.config().rounds);
    let config = plan
        .map_or_else(|| RoundConfig { learning_rate: scheduled, ..core.config().round.clone() }, |p| p.config.clone());
    let broadcast = broadcast_with(&config);
    let mut by_config: Vec<(RoundConfig, Arc<Message>)> = Vec::new();
    let mut tailored = BTreeMap::new();
    for (client, own) in
        plan.map(|p| &p.per_device).into_iter().flatten().filter(|(c, own)| sampled.contains(*c) && **own != config)
    {
        let msg = match by_config.iter().find(|(c, _)| c == own) {
            Some((_, msg)) => msg.clone(),
            None => {
                let msg = broadcast_with(own);
                by_config.push((own.clone(), msg.clone()));
                msg
            }
        };
        tailored.insert(client.clone(), msg);
    }
    round_record(round, broadcast, tailored, (now, deadline), target, sampled)
}

fn round_record(
    round: u64,
    broadcast: Arc<Message>,
    tailored: BTreeMap<ClientId, Arc<Message>>,
    (now, deadline): (Duration, Duration),
    target: usize,
    sampled: BTreeSet<ClientId>,
) -> OpenRound {
    OpenRound {
        round,
        broadcast,
        tailored,
        sampled,
        target,
        started: now,
        deadline: now + deadline,
        updates: BTreeMap::new(),
        duplicates: 0,
        refused: 0,
        declined: BTreeMap::new(),
        secagg: None,
    }
}

/// The report's line for each update the round holds.
fn update_reports(open: &OpenRound) -> Vec<UpdateReport> {
    open.updates
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
        .collect()
}
