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
use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::protocol::{Ack, Broadcast, Message, RefusalReason, Update};
use anchorage_shared::tensor::{ParamBlock, TensorError, payload_bytes};
use serde::{Deserialize, Serialize};

use super::{AcceptedUpdate, Action, ClientId, Engine, Persist, RoundOutcome, RoundReport, UpdateReport, same_layout};

/// How the engine turns updates into new global models.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum AggregationMode {
    /// Rounds: sample, wait for the target or the deadline, aggregate (Flower, FedScale).
    Synchronous,
    /// FedBuff: `concurrency` clients always training, a new version every `buffer` updates.
    Buffered { buffer: usize, concurrency: usize, max_staleness: u64 },
}

impl Default for AggregationMode {
    fn default() -> Self {
        Self::Synchronous
    }
}

/// A client training for the buffered engine.
#[derive(Debug, Clone)]
pub(super) struct InFlight {
    /// The version it trains on.
    version: u64,
    since: Duration,
}

/// State of the buffered mode.
#[derive(Debug, Default)]
pub(super) struct Buffered {
    in_flight: BTreeMap<ClientId, InFlight>,
    /// Accepted updates: client, update rebased onto the version it trained on, staleness, arrival.
    buffer: Vec<(ClientId, Update, u64, Duration)>,
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

impl Engine {
    fn buffered_params(&self) -> Option<(usize, usize, u64)> {
        match self.config.mode {
            AggregationMode::Buffered { buffer, concurrency, max_staleness } => {
                Some((buffer.max(1), concurrency.max(1), max_staleness))
            }
            AggregationMode::Synchronous => None,
        }
    }

    pub(super) fn is_buffered(&self) -> bool {
        self.buffered_params().is_some()
    }

    /// Earliest time a training client is given up on.
    pub(super) fn buffered_timeout(&self) -> Option<Duration> {
        self.buffered.in_flight.values().map(|f| f.since + self.config.round_deadline).min()
    }

    /// Drops clients that trained past the deadline (their slot goes to another), then dispatches.
    pub(super) fn buffered_timeout_fired(&mut self, now: Duration) {
        let deadline = self.config.round_deadline;
        let expired: Vec<ClientId> =
            self.buffered.in_flight.iter().filter(|(_, f)| now >= f.since + deadline).map(|(c, _)| c.clone()).collect();
        for client in expired {
            self.buffered.in_flight.remove(&client);
            self.stats.dropped += 1;
            tracing::info!(%client, "buffered: client gave no update within the deadline; its slot is reused");
        }
        self.dispatch(now);
    }

    /// Keeps `concurrency` clients training on the current version.
    pub(super) fn dispatch(&mut self, now: Duration) {
        let Some((_, concurrency, _)) = self.buffered_params() else { return };
        if self.finished {
            return;
        }
        let version = self.last_round;
        if !self.buffered.history.contains_key(&version) {
            self.buffered.history.insert(version, Arc::new(self.global.clone()));
            self.buffered.version_started = now;
        }
        let idle: Vec<ClientId> = self
            .clients
            .iter()
            .filter(|(id, c)| {
                c.connected && !self.buffered.in_flight.contains_key(*id) && c.last_version.is_none_or(|v| v < version)
            })
            .map(|(id, _)| id.clone())
            .collect();
        let free = concurrency.saturating_sub(self.buffered.in_flight.len()).min(idle.len());
        if free == 0 {
            return;
        }
        let picked: Vec<ClientId> =
            self.rng.sample_indices(idle.len(), free).into_iter().map(|i| idle[i].clone()).collect();
        let mut config = self.config.round.clone();
        config.deadline_ms = self.config.round_deadline.as_millis() as u64;
        let broadcast = Arc::new(Message::Broadcast(Broadcast {
            round: version + 1,
            task: self.config.task_of(version + 1),
            config,
            blocks: self.global.clone(),
            prototypes: self.method.prototypes(),
        }));
        self.note_invited(version + 1, picked.iter().cloned());
        for client in &picked {
            self.buffered.in_flight.insert(client.clone(), InFlight { version, since: now });
            if let Some(c) = self.clients.get_mut(client) {
                c.last_version = Some(version);
            }
        }
        tracing::debug!(
            version,
            dispatched = picked.len(),
            in_flight = self.buffered.in_flight.len(),
            "buffered: clients dispatched"
        );
        self.actions.push_back(Action::Broadcast { to: picked, msg: broadcast });
    }

    /// An update in buffered mode: `update.round − 1` is the version it trained on.
    pub(super) fn buffered_update(&mut self, now: Duration, client: &str, mut update: Update) {
        let Some((buffer, _, max_staleness)) = self.buffered_params() else { return };
        // After the last version, updates still in flight are acknowledged and not aggregated:
        // a buffer filling up now would make one version more than the federation asked for.
        if self.finished {
            self.buffered.in_flight.remove(client);
            if let Err(reason) = self.config.robust.screen_values(&update) {
                self.refuse(client, RefusalReason::BadTensor, format!("update screened out: {reason}"));
                return;
            }
            tracing::info!(client, round = update.round, "buffered: update after the last version, not aggregated");
            self.actions.push_back(Action::Send {
                to: client.into(),
                msg: Message::Ack(Ack { round: update.round, aggregated: false }),
            });
            return;
        }
        let trained_on = update.round.saturating_sub(1);
        match self.buffered.in_flight.get(client) {
            Some(f) if f.version == trained_on => {}
            _ => {
                if update.round <= self.last_round + 1
                    && self.buffered.buffer.iter().any(|(c, u, _, _)| c == client && u.round == update.round)
                {
                    self.stats.duplicate_updates += 1;
                    self.actions.push_back(Action::Send {
                        to: client.into(),
                        msg: Message::Ack(Ack { round: update.round, aggregated: true }),
                    });
                } else {
                    self.refuse(
                        client,
                        RefusalReason::NotSampled,
                        format!("no training of version {trained_on} was dispatched to this client"),
                    );
                }
                return;
            }
        }
        if let Err(detail) = same_layout(&self.global, &update.blocks) {
            self.buffered.in_flight.remove(client);
            self.refuse(client, RefusalReason::ShapeMismatch, detail);
            self.dispatch(now);
            return;
        }
        // Screening (`[engine.robust]`): finite values and a bounded delta from the version the
        // client trained on, before the ack.
        let base = self.buffered.history.get(&trained_on).cloned();
        let reference = base.as_deref().map_or(self.global.as_slice(), Vec::as_slice);
        let robust = &self.config.robust;
        let screened = robust
            .screen_update(&update, reference)
            .and_then(|norm| robust.screen_change(&update, reference, norm, self.last_median_norm));
        if let Err(reason) = screened {
            self.buffered.in_flight.remove(client);
            self.refuse(client, RefusalReason::BadTensor, format!("update screened out: {reason}"));
            self.dispatch(now);
            return;
        }
        self.config.robust.cap_samples(client, &mut update);
        self.buffered.in_flight.remove(client);
        let staleness = self.last_round - trained_on;
        if staleness > max_staleness || update.num_samples == 0 {
            self.stats.late_updates += 1;
            tracing::info!(client, staleness, "buffered: stale update counted, not aggregated");
            self.actions.push_back(Action::Send {
                to: client.into(),
                msg: Message::Ack(Ack { round: update.round, aggregated: false }),
            });
            self.dispatch(now);
            return;
        }
        let arrived_after = now.saturating_sub(self.buffered.version_started);
        let round = update.round;
        let accepted = Arc::new(AcceptedUpdate { client: client.into(), update, staleness, arrived_after });
        self.buffered.buffer.push((client.into(), accepted.update.clone(), staleness, now));
        // Ack after commit.
        self.actions.push_back(Action::Persist(Persist::Accepted(accepted)));
        self.actions.push_back(Action::Send { to: client.into(), msg: Message::Ack(Ack { round, aggregated: true }) });
        if self.buffered.buffer.len() >= buffer {
            self.buffered_aggregate(now);
        }
        self.dispatch(now);
    }

    /// After a restart: the accepted updates no version aggregated yet go back into the buffer.
    /// Their base versions are gone from memory, so they are aggregated as they are (no rebase),
    /// which is exact for staleness 0 and an approximation for older ones.
    pub(super) fn buffered_restore(&mut self, pending: Vec<AcceptedUpdate>) {
        if !pending.is_empty() {
            tracing::info!(updates = pending.len(), version = self.last_round, "buffered: restoring accepted updates");
        }
        for p in pending {
            self.buffered.buffer.push((p.client, p.update, p.staleness, p.arrived_after));
        }
    }

    /// Makes a new version from the buffer.
    fn buffered_aggregate(&mut self, now: Duration) {
        let entries = std::mem::take(&mut self.buffered.buffer);
        let mut rebased = Vec::with_capacity(entries.len());
        let mut failure = None;
        for (client, u, staleness, _) in &entries {
            let base = self.buffered.history.get(&(u.round - 1)).cloned();
            let blocks = match base {
                Some(base) => rebase(&self.global, &base, &u.blocks),
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
        let (outcome, screened, influence) = match failure {
            Some(reason) => (RoundOutcome::Failed { reason }, Vec::new(), Default::default()),
            None => {
                let inputs: Vec<(&str, &Update)> = rebased.iter().map(|(c, u)| (c.as_str(), u)).collect();
                self.aggregate(&inputs)
            }
        };
        let started = self.buffered.version_started;
        let updates = entries
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
            .collect();
        let report = RoundReport {
            round: self.last_round + 1,
            outcome,
            sampled: entries.len(),
            target: entries.len(),
            updates,
            missing: Vec::new(),
            duplicates: 0,
            refused: screened.len() as u64,
            late_total: self.stats.late_updates,
            payload_down: payload_bytes(&self.global) as u64,
            started,
            closed: now,
            influence,
            held_out_accuracy: None,
        };
        self.close_version(report);
        // Keep only the versions a non-stale update can still have trained on.
        let (_, _, max_staleness) = self.buffered_params().unwrap_or((1, 1, 0));
        let oldest = self.last_round.saturating_sub(max_staleness);
        self.buffered.history.retain(|v, _| *v >= oldest);
        self.buffered.history.insert(self.last_round, Arc::new(self.global.clone()));
        self.buffered.version_started = now;
    }
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
