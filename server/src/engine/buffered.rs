//! Semi-asynchronous aggregation (FedBuff, Nguyen et al. 2022): the engine keeps `concurrency`
//! clients training at all times, each on the newest global model; an arriving update trained on
//! version v has staleness s = current − v; updates staler than `max_staleness` are counted, not
//! used; the others wait in a buffer, and every `buffer` of them make a new version:
//! w ← w + Σ_i q_i Δ_i / Σ_i q_i with Δ_i = w_i − w_{v_i} and q_i = n_i / √(1 + s_i)
//! (the polynomial staleness weight of FedBuff / FedAsync).
//!
//! The method's server half still aggregates: each update is rebased onto the current model
//! (w + Δ_i) and weighted by q_i, so a weighted mean of the rebased models is exactly the rule above
//! for FedAvg. A version is a "round" everywhere else (broadcasts, reports, checkpoints).

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;
use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::protocol::{Decline, RefusalReason, Update};
use anchorage_shared::tensor::{ParamBlock, TensorError, payload_bytes};
use serde::{Deserialize, Serialize};

use super::common::{Collected, Core, same_layout};
use super::rounds::OpenRound;
use super::{
    AcceptedUpdate, Action, ClientId, ModeState, OpenedRound, Persist, RoundOutcome, RoundReport, UpdateReport,
};
use crate::aggregate::{InfluenceReport, Screened};

/// How the engine turns updates into new global models.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum AggregationMode {
    /// Rounds: sample, wait for the target or the deadline, aggregate (Flower, FedScale).
    #[default]
    Synchronous,
    /// FedBuff: `concurrency` clients always training, a new version every `buffer` updates.
    Buffered { buffer: usize, concurrency: usize, max_staleness: u64 },
}

/// A client training for the buffered engine.
#[derive(Debug, Clone)]
struct InFlight {
    /// The version it trains on.
    version: u64,
    since: Duration,
}

/// An accepted update waiting in the buffer: client, update (as it trained it), staleness,
/// arrival.
type Buffered = (ClientId, Update, u64, Duration);

/// State of the buffered mode: its parameters, the clients training, the buffer, and the recent
/// versions stale updates are rebased from.
#[derive(Debug)]
pub(super) struct BufferedState {
    /// Updates that make a new version (at least 1).
    buffer_size: usize,
    /// Clients kept training (at least 1).
    concurrency: usize,
    max_staleness: u64,
    in_flight: BTreeMap<ClientId, InFlight>,
    /// Accepted updates no version has aggregated yet.
    buffer: Vec<Buffered>,
    /// Recent global versions, for the deltas of stale updates.
    history: BTreeMap<u64, Arc<Vec<ParamBlock>>>,
    /// When the version now current was made.
    version_started: Duration,
}

/// Staleness weight of FedBuff: 1 / √(1 + s).
pub fn staleness_weight(staleness: u64) -> f64 {
    1.0 / (1.0 + staleness as f64).sqrt()
}

/// `current + (update − base)`, block by block.
fn rebase(current: &[ParamBlock], base: &[ParamBlock], update: &[ParamBlock]) -> Result<Vec<ParamBlock>, TensorError> {
    let mut out = Vec::with_capacity(update.len());
    for u in update {
        let (Some(c), Some(b)) = (current.iter().find(|c| c.name == u.name), base.iter().find(|b| b.name == u.name))
        else {
            out.push(u.clone());
            continue;
        };
        let (cv, bv, uv) = (c.decode()?, b.decode()?, u.decode()?);
        let values: Vec<f32> = cv.iter().zip(&bv).zip(&uv).map(|((c, b), u)| c + (u - b)).collect();
        out.push(ParamBlock::encode(u.name.clone(), &u.tensor.shape, &values, u.tensor.encoding));
    }
    Ok(out)
}

impl ModeState for BufferedState {
    /// Buffered mode opens no rounds.
    fn open(&self) -> Option<&OpenRound> {
        None
    }

    /// Earliest time a training client is given up on.
    fn timeout(&self, core: &Core) -> Option<Duration> {
        self.in_flight.values().map(|f| f.since + core.config().round_deadline).min()
    }

    /// Drops clients that trained past the deadline (their slot goes to another), then dispatches.
    fn on_timeout(&mut self, core: &mut Core, now: Duration) {
        let deadline = core.config().round_deadline;
        let expired: Vec<ClientId> =
            self.in_flight.iter().filter(|(_, f)| now >= f.since + deadline).map(|(c, _)| c.clone()).collect();
        for client in expired {
            self.in_flight.remove(&client);
            core.dispatch_abandoned(&client);
            core.count_dropped(1);
            tracing::info!(%client, "buffered: client gave no update within the deadline; its slot is reused");
        }
        self.dispatch(core, now);
    }

    /// Starts training once the first version may go out (enough clients connected, no
    /// rollback witnessed); after that, whenever a client is idle.
    fn start(&mut self, core: &mut Core, now: Duration) {
        if core.is_finished() || core.rollback_suspected().is_some() {
            return;
        }
        if core.last_round() > 0 || core.connected() >= core.config().min_available.max(1) {
            self.dispatch(core, now);
        }
    }

    /// An update in buffered mode: `update.round − 1` is the version it trained on.
    fn on_update(&mut self, core: &mut Core, now: Duration, client: &str, mut update: Update) {
        // After the last version, updates still in flight are acknowledged and not aggregated:
        // a buffer filling up now would make one version more than the federation asked for.
        if core.is_finished() {
            self.update_after_last_version(core, client, &update);
            return;
        }
        // Version v's training comes back as round v + 1: round 0 names no version (a device that
        // sent it would otherwise pass as version 0's and break the rebase below).
        if update.round == 0 {
            core.refuse(client, RefusalReason::Malformed, "round 0 is no training's round (rounds start at 1)".into());
            return;
        }
        let trained_on = update.round - 1;
        if self.in_flight.get(client).is_none_or(|f| f.version != trained_on) {
            self.update_not_dispatched(core, client, &update, trained_on);
            return;
        }
        if let Err((reason, detail)) = self.check_update(core, &update, trained_on) {
            self.in_flight.remove(client);
            core.refuse(client, reason, detail);
            self.dispatch(core, now);
            return;
        }
        core.config().robust.cap_samples(client, &mut update);
        self.in_flight.remove(client);
        let staleness = core.last_round() - trained_on;
        if staleness > self.max_staleness || update.num_samples == 0 {
            core.count_late();
            tracing::info!(client, staleness, "buffered: stale update counted, not aggregated");
            core.ack(client, update.round, false);
            self.dispatch(core, now);
            return;
        }
        self.accept(core, now, client, update, staleness);
        self.dispatch(core, now);
    }

    /// A decline from a device training on the version before `decline.round`: its slot goes to
    /// another idle device at once. It is not picked again before the next version (its
    /// `last_version` is this one), so a device that keeps declining cannot make a loop.
    fn on_decline(&mut self, core: &mut Core, now: Duration, client: &str, decline: Decline) {
        let trained_on = decline.round.checked_sub(1);
        if trained_on.is_none() || self.in_flight.get(client).map(|f| f.version) != trained_on {
            tracing::debug!(client, round = decline.round, "buffered: a decline from a device not training; ignored");
            return;
        }
        self.in_flight.remove(client);
        core.record_decline(client, &decline);
        self.dispatch(core, now);
    }

    /// The version `round − 1` an update trained on, while it is kept; else the current one.
    fn base_of<'a>(&'a self, core: &'a Core, round: u64) -> &'a [ParamBlock] {
        self.history.get(&round.wrapping_sub(1)).map_or(core.global(), |v| v.as_slice())
    }

    /// After a restart: the accepted updates no version aggregated yet go back into the buffer.
    /// Their base versions are gone from memory, so they are aggregated as they are (no rebase),
    /// which is exact for staleness 0 and an approximation for older ones.
    fn restore(
        &mut self,
        core: &mut Core,
        _open: Option<OpenedRound>,
        pending: Vec<AcceptedUpdate>,
        _last_accepted: Vec<ClientId>,
    ) {
        if !pending.is_empty() {
            tracing::info!(
                updates = pending.len(),
                version = core.last_round(),
                "buffered: restoring accepted updates"
            );
        }
        for p in pending {
            self.buffer.push((p.client, p.update, p.staleness, p.arrived_after));
        }
    }
}

impl BufferedState {
    /// The buffered mode's state, before any client trained.
    pub(super) fn new(buffer: usize, concurrency: usize, max_staleness: u64) -> Self {
        Self {
            buffer_size: buffer.max(1),
            concurrency: concurrency.max(1),
            max_staleness,
            in_flight: BTreeMap::new(),
            buffer: Vec::new(),
            history: BTreeMap::new(),
            version_started: Duration::ZERO,
        }
    }

    /// Keeps `concurrency` clients training on the current version. A client whose update waits
    /// in the buffer is not dispatched again before the buffer becomes a version: a device is
    /// counted at most once in a version (one voice for the robust rules, one contribution per
    /// device for the accountant). When nobody is left to add to the buffer (every connected
    /// client is in it, trained on this version, or gone), the buffer forms a short version.
    fn dispatch(&mut self, core: &mut Core, now: Duration) {
        if core.is_finished() {
            return;
        }
        let version = core.last_round();
        if !self.history.contains_key(&version) && !core.privacy_allows_a_round() {
            return;
        }
        if let Entry::Vacant(entry) = self.history.entry(version) {
            entry.insert(Arc::new(core.global().to_vec()));
            self.version_started = now;
        }
        let buffered: std::collections::BTreeSet<&str> = self.buffer.iter().map(|(c, ..)| c.as_str()).collect();
        let idle: Vec<ClientId> = core
            .idle_before(version)
            .filter(|id| !self.in_flight.contains_key(*id) && !buffered.contains(id.as_str()))
            .cloned()
            .collect();
        if idle.is_empty() && self.in_flight.is_empty() && !self.buffer.is_empty() {
            // Nobody can add to the buffer before a new version: it forms with what it holds.
            tracing::info!(held = self.buffer.len(), buffer = self.buffer_size, "buffered: a short version");
            self.aggregate(core, now);
            return self.dispatch(core, now);
        }
        let free = self.concurrency.saturating_sub(self.in_flight.len()).min(idle.len());
        if free == 0 {
            return;
        }
        let picked: Vec<ClientId> =
            core.sample_indices(idle.len(), free).into_iter().map(|i| idle[i].clone()).collect();
        let mut config = core.config().round.clone();
        config.deadline_ms = core.config().round_deadline.as_millis() as u64;
        let broadcast = core.broadcast_message(version + 1, config);
        core.note_dispatched(version, &picked);
        for client in &picked {
            self.in_flight.insert(client.clone(), InFlight { version, since: now });
        }
        tracing::debug!(
            version,
            dispatched = picked.len(),
            in_flight = self.in_flight.len(),
            "buffered: clients dispatched"
        );
        core.push(Action::Broadcast { to: picked, msg: broadcast });
    }

    /// An update after the last version: acknowledged (if its values pass the screen), not
    /// aggregated.
    fn update_after_last_version(&mut self, core: &mut Core, client: &str, update: &Update) {
        self.in_flight.remove(client);
        if let Err(reason) = core.config().robust.screen_values(update) {
            core.refuse(client, RefusalReason::BadTensor, format!("update screened out: {reason}"));
            return;
        }
        tracing::info!(client, round = update.round, "buffered: update after the last version, not aggregated");
        core.ack(client, update.round, false);
    }

    /// An update from a client not training on the version it names: a copy of one in the
    /// buffer is a duplicate (acked again), anything else is refused.
    fn update_not_dispatched(&mut self, core: &mut Core, client: &str, update: &Update, trained_on: u64) {
        if update.round <= core.last_round() + 1
            && self.buffer.iter().any(|(c, u, _, _)| c == client && u.round == update.round)
        {
            core.count_duplicate();
            core.ack(client, update.round, true);
        } else {
            core.refuse(
                client,
                RefusalReason::NotSampled,
                format!("no training of version {trained_on} was dispatched to this client"),
            );
        }
    }

    /// The model's layout, then the screens of `[engine.robust]`: finite values and a bounded
    /// delta from the version the client trained on, before the ack.
    fn check_update(&self, core: &Core, update: &Update, trained_on: u64) -> Result<(), (RefusalReason, String)> {
        same_layout(core.global(), &update.blocks).map_err(|detail| (RefusalReason::ShapeMismatch, detail))?;
        let base = self.history.get(&trained_on).cloned();
        let reference = base.as_deref().map_or(core.global(), Vec::as_slice);
        core.screen(update, reference)
            .map_err(|reason| (RefusalReason::BadTensor, format!("update screened out: {reason}")))
    }

    /// Puts an accepted update into the buffer (persisted before its ack); a full buffer makes
    /// a new version.
    fn accept(&mut self, core: &mut Core, now: Duration, client: &str, update: Update, staleness: u64) {
        let arrived_after = now.saturating_sub(self.version_started);
        let round = update.round;
        let accepted = Arc::new(AcceptedUpdate { client: client.into(), update, staleness, arrived_after });
        self.buffer.push((client.into(), accepted.update.clone(), staleness, now));
        // Ack after commit.
        core.push(Action::Persist(Persist::Accepted(accepted)));
        core.ack(client, round, true);
        if self.buffer.len() >= self.buffer_size {
            self.aggregate(core, now);
        }
    }

    /// Makes a new version from the buffer.
    fn aggregate(&mut self, core: &mut Core, now: Duration) {
        let entries = std::mem::take(&mut self.buffer);
        // Invariant: a device is counted at most once in a version (`dispatch` keeps it so).
        let devices: std::collections::BTreeSet<&str> = entries.iter().map(|(c, ..)| c.as_str()).collect();
        assert_eq!(devices.len(), entries.len(), "a device twice in version {}'s buffer", core.last_round() + 1);
        let (outcome, screened, influence) = self.aggregate_entries(core, &entries);
        let started = self.version_started;
        let report = RoundReport {
            round: core.last_round() + 1,
            outcome,
            sampled: entries.len(),
            target: entries.len(),
            updates: update_reports(&entries, &screened, started),
            missing: Vec::new(),
            declined: Vec::new(),
            duplicates: 0,
            refused: screened.len() as u64,
            late_total: core.stats().late_updates,
            payload_down: payload_bytes(core.global()) as u64,
            started,
            closed: now,
            influence,
            held_out_accuracy: None,
            privacy: None,
            secagg: None,
        };
        core.close_version(report);
        // Keep only the versions a non-stale update can still have trained on.
        let oldest = core.last_round().saturating_sub(self.max_staleness);
        self.history.retain(|v, _| *v >= oldest);
        self.history.insert(core.last_round(), Arc::new(core.global().to_vec()));
        self.version_started = now;
    }

    /// Rebases each buffered update onto the current model, weighs it by its staleness, and
    /// runs the shared aggregation on them.
    fn aggregate_entries(
        &self,
        core: &mut Core,
        entries: &[Buffered],
    ) -> (RoundOutcome, Vec<Screened>, InfluenceReport) {
        let mut rebased = Vec::with_capacity(entries.len());
        let mut failure = None;
        for (client, u, staleness, _) in entries {
            let base = self.history.get(&u.round.saturating_sub(1)).cloned();
            let blocks = match base {
                Some(base) => rebase(core.global(), &base, &u.blocks),
                None => Ok(u.blocks.clone()),
            };
            match blocks {
                Ok(blocks) => {
                    let weight = (u.num_samples as f64 * staleness_weight(*staleness)).round().max(1.0) as u64;
                    rebased.push((client.clone(), Update { blocks, num_samples: weight, ..u.clone() }));
                }
                Err(e) => failure = Some(format!("rebasing {client}'s update: {e}")),
            }
        }
        match failure {
            Some(reason) => (RoundOutcome::Failed { reason }, Vec::new(), Default::default()),
            None => {
                let inputs: Vec<(&str, &Update)> = rebased.iter().map(|(c, u)| (c.as_str(), u)).collect();
                core.aggregate(Collected::Updates { updates: &inputs, invited: inputs.len() })
            }
        }
    }
}

/// The report's line for each buffered update the version aggregated, with its staleness.
fn update_reports(entries: &[Buffered], screened: &[Screened], started: Duration) -> Vec<UpdateReport> {
    entries
        .iter()
        .filter(|(client, ..)| !screened.iter().any(|s| &s.client == client))
        .map(|(client, u, staleness, at)| {
            let mut metrics: Vec<(String, f64)> = u.metrics.iter().map(|m| (m.name.clone(), m.value)).collect();
            metrics.push(("staleness".into(), *staleness as f64));
            UpdateReport {
                client: client.clone(),
                num_samples: u.num_samples,
                payload_up: payload_bytes(&u.blocks) as u64,
                prototypes: u.prototypes.len(),
                compute_seconds: u.compute_seconds,
                arrived_after: at.saturating_sub(started),
                metrics,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use anchorage_shared::tensor::Encoding;

    #[test]
    fn staleness_weights_fall_with_age() {
        assert_eq!(staleness_weight(0), 1.0);
        assert!((staleness_weight(3) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn rebasing_moves_a_delta_onto_the_current_model() {
        let b = |v: &[f32]| vec![ParamBlock::encode("w", &[v.len() as u32], v, Encoding::F32)];
        let out = rebase(&b(&[10.0, 10.0]), &b(&[1.0, 2.0]), &b(&[2.0, 0.0])).unwrap();
        assert_eq!(out[0].decode().unwrap(), vec![11.0, 8.0]);
    }
}
