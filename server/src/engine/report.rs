//! What the engine reports about rounds: per round, and counters over the whole federation.

use anchorage_shared::MetricKey;
use anchorage_shared::ledger::DeclineReason;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ClientId;
use crate::aggregate::InfluenceReport;

/// Counters since the federation began; persisted with the checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    /// Updates that arrived after their round closed (acknowledged, not aggregated).
    pub late_updates: u64,
    /// Second and later copies of an update already accepted (counted once).
    pub duplicate_updates: u64,
    /// Messages refused (wrong shape, not sampled, not enrolled, malformed).
    pub refused: u64,
    /// Sampled clients that sent nothing before their round closed.
    pub dropped: u64,
    /// Rounds that closed without aggregating.
    pub failed_rounds: u64,
    /// Cost records dropped (not invited to that round, a second record for it, or bytes beyond
    /// the frame limits); also counted in `refused`.
    pub dropped_cost_records: u64,
}

/// How a round ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RoundOutcome {
    Aggregated,
    Failed { reason: String },
}

/// One accepted update, as the round report lists it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateReport {
    pub client: ClientId,
    pub num_samples: u64,
    pub payload_up: u64,
    /// Class prototypes the update carried.
    #[serde(default)]
    pub prototypes: usize,
    pub compute_seconds: f64,
    /// Time from the round's start to the update's arrival.
    pub arrived_after: Duration,
    pub metrics: Vec<(String, f64)>,
}

/// The record of one closed round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundReport {
    pub round: u64,
    pub outcome: RoundOutcome,
    /// Clients invited (target plus over-selection).
    pub sampled: usize,
    /// Updates the round waited for.
    pub target: usize,
    /// Updates aggregated, in client order.
    pub updates: Vec<UpdateReport>,
    /// Sampled clients whose update had not arrived when the round closed.
    pub missing: Vec<ClientId>,
    /// Invited devices that declined, with why; not counted in `missing`. Each was
    /// replaced by another invitation where a connected device was free.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub declined: Vec<(ClientId, DeclineReason)>,
    pub duplicates: u64,
    pub refused: u64,
    /// Late updates counted since the federation began.
    pub late_total: u64,
    /// Payload bytes of the broadcast, per receiving client.
    pub payload_down: u64,
    pub started: Duration,
    pub closed: Duration,
    /// What the influence bounds of `[engine.robust]` did, and which rules did not run.
    #[serde(default)]
    pub influence: InfluenceReport,
    /// The new global model's accuracy on the operator's held-out set (`[evaluation]` in
    /// server.toml), when the server evaluates it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_out_accuracy: Option<f64>,
    /// The privacy spent so far (`[engine.privacy]`): ε at δ after this round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub privacy: Option<super::privacy::PrivacyAccount>,
    /// What the round's secure aggregation did (`[engine.secagg]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secagg: Option<super::secagg::SecAggReport>,
}

impl RoundReport {
    /// Sample-weighted mean of a metric the clients reported, if any reported it.
    pub fn weighted_metric(&self, key: &MetricKey) -> Option<f64> {
        let name = key.name();
        let (sum, weight) = self
            .updates
            .iter()
            .filter_map(|u| {
                u.metrics
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| (v * u.num_samples as f64, u.num_samples as f64))
            })
            .fold((0.0, 0.0), |(s, w), (v, n)| (s + v, w + n));
        (weight > 0.0).then(|| sum / weight)
    }

    /// The devices' own evaluation of the round: the sample-weighted mean of the `local_accuracy`
    /// their updates carry, and how many reported one.
    pub fn device_accuracy(&self) -> Option<(f64, usize)> {
        let name = MetricKey::LocalAccuracy.name();
        let reported = self.updates.iter().filter(|u| u.metrics.iter().any(|(n, _)| *n == name)).count();
        self.weighted_metric(&MetricKey::LocalAccuracy).map(|a| (a, reported))
    }

    /// Total payload bytes uploaded in the round.
    pub fn payload_up(&self) -> u64 {
        self.updates.iter().map(|u| u.payload_up).sum()
    }

    /// Seconds from open to close.
    pub fn seconds(&self) -> f64 {
        self.closed.saturating_sub(self.started).as_secs_f64()
    }
}

/// The first `n` ids and how many more: `edge-002, edge-007 (+3 more)`; `-` for none. What the
/// log lines of a round name.
pub fn preview<'a>(ids: impl ExactSizeIterator<Item = &'a ClientId>, n: usize) -> String {
    let total = ids.len();
    if total == 0 {
        return "-".into();
    }
    let shown: Vec<&str> = ids.take(n).map(String::as_str).collect();
    let shown = shown.join(", ");
    if total > n { format!("{shown} (+{} more)", total - n) } else { shown }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_preview_names_the_first_ids_and_counts_the_rest() {
        let ids: Vec<ClientId> = (0..7).map(|i| format!("edge-{i}")).collect();
        assert_eq!(preview(ids.iter(), 5), "edge-0, edge-1, edge-2, edge-3, edge-4 (+2 more)");
        assert_eq!(preview(ids[..2].iter(), 5), "edge-0, edge-1");
        assert_eq!(preview([].iter(), 5), "-");
    }
}
