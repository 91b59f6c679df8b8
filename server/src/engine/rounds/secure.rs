//! A synchronous round under secure aggregation (`[engine.secagg]`, [`super::super::secagg`]):
//! the devices' masked vectors are summed by the protocol, the method's fold takes the one
//! dequantised sum, and the contributors are acked only after the version is durable.

use std::collections::BTreeSet;
use std::time::Duration;

use anchorage_shared::protocol::{Message, RefusalReason, SecAggFrame, Update};

use super::super::common::{Collected, Core};
use super::super::secagg::{SecAggReport, SecAggRound, Step};
use super::super::{Action, ClientId, ModeState, RoundOutcome, UpdateReport};
use super::{Closing, RoundsState, finish_close};
use crate::aggregate::InfluenceReport;

impl RoundsState {
    /// The open round's secure aggregation starts, weighted by the invited devices' sample
    /// counts; a protocol that cannot start fails the round.
    pub(super) fn open_secure(&mut self, core: &mut Core, now: Duration) {
        let Some(open) = self.open.as_mut() else { return };
        let counts = open.sampled.iter().filter_map(|c| core.num_samples_of(c)).collect();
        let config = core.config();
        let scale = super::super::secagg::weight_scale(counts, &config.robust, config.privacy.is_on());
        let round = open.round;
        match SecAggRound::open(&config.secagg, (round, config.seed, scale), &open.sampled, core.global(), now) {
            Ok(secagg) => {
                open.secagg = Some(Box::new(secagg));
                self.step_secagg(core, now);
            }
            Err(why) => {
                tracing::error!(round, reason = %why, "secure aggregation could not start; the round fails");
                self.close_secure(core, now, Err(format!("secure aggregation could not start: {why}")));
            }
        }
    }

    /// A device's message of the open round's secure aggregation; a refused one is counted,
    /// logged and answered with a refusal. Then the protocol moves on if it may.
    pub(super) fn on_secagg_frame(&mut self, core: &mut Core, now: Duration, client: &str, frame: &SecAggFrame) {
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
    pub(super) fn held_vectors(&self) -> Option<usize> {
        self.open.as_ref()?.secagg.as_ref().map(|s| s.held_vectors())
    }

    /// What a device that reconnected during the open round's secure aggregation has not
    /// answered yet: the current stage's message, again.
    pub(super) fn resend_secagg(&self, client: &str) -> Option<Message> {
        self.open.as_ref()?.secagg.as_ref()?.resend(client)
    }

    /// Moves the open round's secure aggregation on as far as `now` allows, sends what it
    /// queued, and closes the round when it output the sum or failed.
    pub(super) fn step_secagg(&mut self, core: &mut Core, now: Duration) {
        let Some(open) = self.open.as_mut() else { return };
        let Some(secagg) = open.secagg.as_mut() else { return };
        let step = secagg.step(now, open.deadline, core.global());
        for (to, msg) in secagg.transmit(open.round) {
            core.push(Action::Send { to, msg });
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
    pub(super) fn close_secure(
        &mut self,
        core: &mut Core,
        now: Duration,
        result: Result<(Box<Update>, Vec<ClientId>), String>,
    ) {
        let Some(open) = self.open.take() else { return };
        let mut report = open
            .secagg
            .as_ref()
            .map(|s| s.report())
            .unwrap_or_else(|| SecAggReport { failed: result.as_ref().err().cloned(), ..SecAggReport::default() });
        let min = core.config().min_updates.max(1);
        let (outcome, contributors) = match result {
            Ok((_, contributors)) if contributors.len() < min => {
                let reason = format!("{} of at least {min} devices in the secure sum", contributors.len());
                report.failed = Some(reason.clone());
                (RoundOutcome::Failed { reason }, Vec::new())
            }
            Ok((sum, contributors)) => (core.aggregate(Collected::SecureSum(&sum)).0, contributors),
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
        let acks =
            contributors.iter().filter(|_| aggregated).map(|client| super::super::common::ack(client, round, true));
        finish_close(core, now, open, closing, acks.collect());
    }
}
