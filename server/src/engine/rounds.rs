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

use super::common::{Core, same_layout};
use super::configure::RoundPlan;
use super::secagg::{SecAggReport, SecAggRound, Step};
use super::{
    AcceptedUpdate, Action, ClientId, ModeState, OpenedRound, Persist, RoundOutcome, RoundReport, UpdateReport, report,
};
use crate::aggregate::InfluenceReport;

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
            core.actions.push_back(Action::Broadcast { to: plain, msg: self.broadcast.clone() });
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
            core.actions.push_back(Action::Broadcast { to, msg });
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
        if core.finished || self.open.is_some() || core.rollback_suspected().is_some() {
            return;
        }
        // A relay opens a round only when its parent's broadcast of it came.
        if core.awaits_parent() {
            return;
        }
        // Count before collecting: every hello lands here, and fleets have thousands of clients.
        if core.connected() < core.config.min_available.max(1) || !core.privacy_allows_a_round() {
            return;
        }
        let round = core.last_round + 1;
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
        let mut open = open_round_record(core, now, round, target, sampled, Some(&plan));
        core.note_invited(round, open.sampled.iter().cloned());
        // The invitations are durable before anyone trains on them.
        core.actions.push_back(Action::Persist(Persist::Opened(OpenedRound {
            round,
            task: open.task(),
            target,
            sampled: open.sampled.iter().cloned().collect(),
        })));
        let invited: Vec<ClientId> = open.sampled.iter().cloned().collect();
        open.broadcast_to(core, invited);
        let secagg = core.config.secagg.enabled.then(|| {
            let counts = open.sampled.iter().filter_map(|c| core.clients.get(c)).map(|c| c.num_samples).collect();
            let private = core.config.privacy.is_on();
            let scale = super::secagg::weight_scale(counts, &core.config.robust, private);
            SecAggRound::open(&core.config.secagg, (round, core.config.seed, scale), &open.sampled, &core.global, now)
        });
        match secagg {
            Some(Ok(secagg)) => open.secagg = Some(Box::new(secagg)),
            Some(Err(why)) => {
                tracing::error!(round, reason = %why, "secure aggregation could not start; the round fails");
                self.open = Some(open);
                self.close_secure(core, now, Err(format!("secure aggregation could not start: {why}")));
                return;
            }
            None => {}
        }
        self.open = Some(open);
        self.step_secagg(core, now);
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
            core.stats.duplicate_updates += 1;
            core.ack(client, round, true);
            return;
        }
        if let Err((reason, detail)) = check_update(core, &update) {
            open.refused += 1;
            core.refuse(client, reason, detail);
            return;
        }
        core.config.robust.cap_samples(client, &mut update);
        let accepted = Arc::new(AcceptedUpdate {
            client: client.into(),
            update,
            staleness: 0,
            arrived_after: now.saturating_sub(open.started),
        });
        open.updates.insert(client.into(), (accepted.clone(), now));
        // Ack after commit: the shell commits the accepted update before it sends the ack.
        core.actions.push_back(Action::Persist(Persist::Accepted(accepted)));
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
        let Some(&pick) = core.rng.sample_indices(free.len(), 1).first() else {
            tracing::info!(round = open.round, "no connected device is free to replace a decline");
            return;
        };
        let replacement = free[pick].clone();
        tracing::info!(round = open.round, client = %replacement, "invited in place of a decline");
        open.sampled.insert(replacement.clone());
        core.note_invited(open.round, [replacement.clone()]);
        let sampled = open.sampled.iter().cloned().collect();
        core.actions.push_back(Action::Persist(Persist::Invited { round: open.round, sampled }));
        open.broadcast_to(core, vec![replacement]);
    }

    /// Resumes the round that was open at the crash, with the updates it had accepted and a
    /// fresh deadline; if it already holds its target, it closes at once.
    fn restore(
        &mut self,
        core: &mut Core,
        open: Option<OpenedRound>,
        pending: Vec<AcceptedUpdate>,
        last_accepted: Vec<ClientId>,
    ) {
        self.last_accepted = last_accepted.into_iter().collect();
        if core.relay().is_some() {
            self.stashed = open.map(|o| {
                let round = o.round;
                (o, pending.into_iter().filter(|p| p.update.round == round).collect())
            });
            return;
        }
        let Some(opened) = open.filter(|o| o.round == core.last_round + 1 && !core.finished) else { return };
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
        if core.config.secagg.enabled {
            self.close_secure(core, Duration::ZERO, Err(super::secagg::failed_after_restart()));
        } else if full {
            self.close_round(core, Duration::ZERO);
        }
    }
}

impl RoundsState {
    /// A relay's round that was open at a crash opens again on its parent's broadcast, with its
    /// invitations and the updates it had acked (durable already); it closes at once if full.
    fn reopen(&mut self, core: &mut Core, now: Duration, opened: OpenedRound, pending: Vec<AcceptedUpdate>) {
        tracing::info!(round = opened.round, accepted = pending.len(), "a relay resumes the round open at its crash");
        let sampled = opened.sampled.into_iter().collect();
        let mut round = open_round_record(core, now, opened.round, opened.target, sampled, None);
        for p in pending {
            let at = p.arrived_after;
            round.updates.insert(p.client.clone(), (Arc::new(p), at));
        }
        core.note_invited(round.round, round.sampled.iter().cloned());
        let waiting: Vec<ClientId> =
            round.sampled.iter().filter(|c| !round.updates.contains_key(*c)).cloned().collect();
        round.broadcast_to(core, waiting);
        let full = round.updates.len() >= round.target;
        self.open = Some(round);
        if full {
            self.close_round(core, now);
        }
    }

    /// A relay's parent moved on to a newer round: the round open here closes now with what it
    /// holds.
    pub(super) fn close_for_parent(&mut self, core: &mut Core, now: Duration) {
        if self.open.is_some() {
            tracing::info!(round = self.open.as_ref().map(|o| o.round), "the parent moved on; closing the round here");
            self.close_round(core, now);
        }
    }

    /// An update for a round that is not open: a copy of one the last round aggregated is a
    /// duplicate (acked again); one for an older round is late (acked, counted, not aggregated,
    /// if its values pass the screen); one for a round not yet open is refused.
    fn update_outside_round(&mut self, core: &mut Core, client: &str, update: &Update) {
        let round = update.round;
        if round == core.last_round && self.last_accepted.contains(client) {
            core.stats.duplicate_updates += 1;
            core.ack(client, round, true);
        } else if round <= core.last_round {
            // Late: its round already closed. Acknowledge so the client stops resending, but
            // only values that would have passed the screen: an ack never covers garbage.
            if let Err(reason) = core.config.robust.screen_values(update) {
                core.refuse(client, RefusalReason::BadTensor, format!("update screened out: {reason}"));
                return;
            }
            core.stats.late_updates += 1;
            tracing::info!(client, round, "late update counted, not aggregated");
            core.ack(client, round, false);
        } else {
            core.refuse(client, RefusalReason::NotSampled, format!("round {round} is not open"));
        }
    }

    /// Closes the open round: aggregates its updates (or fails with too few), writes a dropped
    /// cost record for each invited client that sent nothing, and closes the version.
    fn close_round(&mut self, core: &mut Core, now: Duration) {
        let Some(open) = self.open.take() else { return };
        let mut updates = update_reports(&open);
        let enough = open.updates.len() >= core.config.min_updates.max(1);
        let (outcome, screened, influence) = if !enough {
            let reason =
                format!("{} of at least {} updates arrived", open.updates.len(), core.config.min_updates.max(1));
            (RoundOutcome::Failed { reason }, Vec::new(), InfluenceReport::default())
        } else {
            let inputs: Vec<(&str, &Update)> =
                open.updates.iter().map(|(id, (a, _))| (id.as_str(), &a.update)).collect();
            core.aggregate(&inputs, open.sampled.len())
        };
        // The report lists the updates aggregated: the screened-out ones count as refused.
        updates.retain(|u| !screened.iter().any(|s| s.client == u.client));
        self.last_accepted = open.updates.keys().cloned().collect();
        let missing = open.sampled.iter().filter(|c| !open.updates.contains_key(*c)).cloned().collect();
        let closing = Closing { outcome, updates, missing, influence, refused: screened.len() as u64, secagg: None };
        finish_close(core, now, open, closing, Vec::new());
    }

    /// A device's message of the open round's secure aggregation; a refused one is counted,
    /// logged and answered with a refusal. Then the protocol moves on if it may.
    pub(super) fn on_secagg(&mut self, core: &mut Core, now: Duration, client: &str, frame: &SecAggFrame) {
        let Some(open) = self.open.as_mut().filter(|o| o.round == frame.round) else {
            tracing::debug!(
                client,
                round = frame.round,
                "a secure aggregation message for a round that is not open; ignored"
            );
            return;
        };
        let Some(secagg) = open.secagg.as_mut() else {
            core.refuse(client, RefusalReason::Malformed, "this server does not aggregate securely".into());
            return;
        };
        if let Err((reason, detail)) = secagg.on_message(client, frame) {
            open.refused += 1;
            tracing::warn!(client, round = frame.round, reason, %detail, "secure aggregation message refused");
            core.refuse(client, RefusalReason::Malformed, format!("secure aggregation ({reason}): {detail}"));
            return;
        }
        self.step_secagg(core, now);
        self.start(core, now);
    }

    /// How many vectors the open round's secure aggregation holds (see `Engine::secagg_held_vectors`).
    pub(super) fn secagg_held_vectors(&self) -> Option<usize> {
        self.open.as_ref()?.secagg.as_ref().map(|s| s.held_vectors())
    }

    /// What a device that reconnected during the open round's secure aggregation has not
    /// answered yet: the current stage's message, again.
    pub(super) fn secagg_resend(&self, client: &str) -> Option<Message> {
        self.open.as_ref()?.secagg.as_ref()?.resend(client)
    }

    /// Moves the open round's secure aggregation on as far as `now` allows, sends what it
    /// queued, and closes the round when it output the sum or failed.
    fn step_secagg(&mut self, core: &mut Core, now: Duration) {
        let Some(open) = self.open.as_mut() else { return };
        let Some(secagg) = open.secagg.as_mut() else { return };
        let step = secagg.step(now, open.deadline, &core.global);
        for (to, msg) in secagg.transmit(open.round) {
            core.actions.push_back(Action::Send { to, msg });
        }
        match step {
            Step::Waiting => {}
            Step::Done { update, contributors } => self.close_secure(core, now, Ok((update, contributors))),
            Step::Failed(why) => self.close_secure(core, now, Err(why)),
        }
    }

    /// Closes a securely aggregated round: the method aggregates the sum (with at least
    /// `min_updates` contributors), the version closes, and only then are the contributors
    /// acked. A failed protocol fails the round and exposes nothing.
    fn close_secure(&mut self, core: &mut Core, now: Duration, result: Result<(Box<Update>, Vec<ClientId>), String>) {
        let Some(open) = self.open.take() else { return };
        let mut report = open
            .secagg
            .as_ref()
            .map(|s| s.report())
            .unwrap_or_else(|| SecAggReport { failed: result.as_ref().err().cloned(), ..SecAggReport::default() });
        let min = core.config.min_updates.max(1);
        let (outcome, contributors) = match result {
            Ok((_, contributors)) if contributors.len() < min => {
                let reason = format!("{} of at least {min} devices in the secure sum", contributors.len());
                report.failed = Some(reason.clone());
                (RoundOutcome::Failed { reason }, Vec::new())
            }
            Ok((sum, contributors)) => (core.aggregate_secure(&sum), contributors),
            Err(why) => (RoundOutcome::Failed { reason: format!("secure aggregation failed: {why}") }, Vec::new()),
        };
        let vector_bytes = 4 * report.vector_len as u64;
        let updates = contributors
            .iter()
            .map(|c| UpdateReport {
                client: c.clone(),
                num_samples: 1,
                payload_up: vector_bytes,
                ..UpdateReport::default()
            })
            .collect();
        self.last_accepted = BTreeSet::new();
        let aggregated = matches!(outcome, RoundOutcome::Aggregated);
        let round = open.round;
        let missing = open.sampled.iter().filter(|c| !contributors.contains(*c)).cloned().collect();
        let influence = InfluenceReport::default();
        let closing = Closing { outcome, updates, missing, influence, refused: 0, secagg: Some(report) };
        // After the version is durable (an ack still means "in this round's aggregate"), and before
        // the goodbyes that follow the last round.
        let acks = contributors.iter().filter(|_| aggregated).map(|client| super::common::ack(client, round, true));
        finish_close(core, now, open, closing, acks.collect());
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
    core.stats.dropped += closing.missing.len() as u64;
    for client in &closing.missing {
        core.actions.push_back(Action::Ledger(CostRecord {
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
        late_total: core.stats.late_updates,
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
    let layout = if core.global.is_empty() && !update.blocks.is_empty() {
        Err("this server holds no model: its layout comes from the operator (initial_model in server.toml), \
             never from an update"
            .to_string())
    } else {
        same_layout(&core.global, &update.blocks)
    };
    layout.map_err(|detail| (RefusalReason::ShapeMismatch, detail))?;
    if update.num_samples == 0 {
        return Err((RefusalReason::Malformed, "an update must be trained on at least one sample".into()));
    }
    // Screening (`[engine.robust]`): finite values, a bounded delta and a change of an honest
    // shape, all before the ack.
    core.screen(update, &core.global)
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
    let deadline = core.config.round_deadline;
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
            task: core.config.task_of(round),
            config,
            blocks: core.global.clone(),
            prototypes: core.method.prototypes(),
        }))
    };
    let scheduled =
        core.config.policy.schedule.learning_rate(core.config.round.learning_rate, round, core.config.rounds);
    let config = plan
        .map_or_else(|| RoundConfig { learning_rate: scheduled, ..core.config.round.clone() }, |p| p.config.clone());
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

/// A relay takes the update of its parent's open round from a device it did not invite: one
/// that failed over from another relay of the tier and resends what it
/// trained for this round. It joins the invitations (durable before its update is) and counts
/// as any other; the parent counts each device once across its relays. The root adopts nobody.
fn adopt_failover(core: &mut Core, open: &mut OpenRound, client: &str) -> bool {
    if core.relay().is_none() || open.secagg.is_some() {
        return false;
    }
    tracing::info!(round = open.round, client, "a device that failed over from another relay joins the round");
    open.sampled.insert(client.into());
    core.note_invited(open.round, [client.to_string()]);
    let sampled = open.sampled.iter().cloned().collect();
    core.actions.push_back(Action::Persist(Persist::Invited { round: open.round, sampled }));
    true
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
