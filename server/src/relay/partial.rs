//! A relay's partial aggregate: one round's updates folded into the sums and counts its parent
//! aggregates as it would the updates themselves.

use anchorage_shared::protocol::{Member, Metric, Partial, Update};
use anchorage_shared::prototype::Prototype;
use anchorage_shared::prototype_rules::fuse;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use anchorage_shared::transfer::sha256;

use crate::engine::Checkpoint;
use crate::methods::{
    AggregationRule, MethodError, RoundInfo, ServerMethod, average_blocks, decode_state, encode_state,
    uploaded_prototypes,
};

/// Folds a round's screened and bounded updates into one partial aggregate (issue 37): the
/// blocks as their sample-weighted mean Σ n_k w_k / N with N = Σ n_k the update's `num_samples`;
/// each class's prototype as the count-weighted mean of its uploads with their total count (GLDP
/// Eq. 6 across clients, FedProK Eq. 9's first case); metrics as sample-weighted means; compute
/// seconds summed. A parent that takes the weighted mean over its relays gets
/// Σ_r N_r (Σ_{k∈r} n_k w_k / N_r) / Σ_r N_r = Σ_k n_k w_k / Σ_k n_k, the devices' own mean, to
/// float rounding; the prototype rules fuse the same count-weighted means. `members` names every
/// update by (device, samples, SHA-256 of its body).
pub fn fold(round: u64, updates: &[(&str, &Update)]) -> Result<Partial, MethodError> {
    if updates.is_empty() {
        return Err(MethodError::Empty);
    }
    let blocks = average_blocks(&[], updates, Encoding::F32, &AggregationRule::Mean)?;
    let prototypes = fuse(&[], &uploaded_prototypes(updates)?, 0.0)
        .iter()
        .map(|m| Prototype::encode(m.class, m.count, &m.vector, Encoding::F32))
        .collect();
    let num_samples: u64 = updates.iter().map(|(_, u)| u.num_samples).sum();
    let members = updates
        .iter()
        .map(|(device, u)| Member {
            device: (*device).to_string(),
            num_samples: u.num_samples,
            hash: sha256(&postcard::to_allocvec(*u).unwrap_or_default()),
        })
        .collect();
    let update = Update {
        round,
        num_samples,
        blocks,
        prototypes,
        metrics: weighted_metrics(updates),
        compute_seconds: updates.iter().map(|(_, u)| u.compute_seconds).sum(),
    };
    Ok(Partial { update, members })
}

/// Each metric's sample-weighted mean over the updates that report it, in first-seen order.
fn weighted_metrics(updates: &[(&str, &Update)]) -> Vec<Metric> {
    let mut out: Vec<(Metric, f64)> = Vec::new();
    for (_, u) in updates {
        let w = u.num_samples as f64;
        for m in &u.metrics {
            match out.iter_mut().find(|(o, _)| o.name == m.name) {
                Some((o, total)) => {
                    o.value += w * m.value;
                    *total += w;
                }
                None => out.push((Metric { name: m.name.clone(), value: w * m.value }, w)),
            }
        }
    }
    out.into_iter()
        .map(|(mut m, total)| {
            m.value = if total > 0.0 { m.value / total } else { 0.0 };
            m
        })
        .collect()
}

/// A relay's method: the fold in place of the method's own aggregation. It leaves the global
/// blocks as the parent sent them and keeps the round's partial as its state, so that the
/// engine's close (one transaction) makes the partial durable before it goes up.
#[derive(Debug, Clone)]
pub struct RelayMethod {
    /// The method the federation runs (the devices' hello must name it).
    name: &'static str,
    last: Option<Partial>,
    /// The last round's screened and bounded updates, in memory, to fold again without devices
    /// the parent counted through another relay.
    kept: Vec<(String, Update)>,
}

impl RelayMethod {
    pub fn new(name: &'static str) -> Self {
        Self { name, last: None, kept: Vec::new() }
    }

    /// The last partial aggregate folded again without `devices` (it becomes the last one);
    /// `None` when nothing is left or the updates are gone.
    pub fn refold_without(&mut self, devices: &[String]) -> Option<Partial> {
        let last = self.last.as_ref()?;
        let (round, members) = (last.update.round, &last.members);
        let left: Vec<(&str, &Update)> = self
            .kept
            .iter()
            .filter(|(d, _)| members.iter().any(|m| &m.device == d) && !devices.contains(d))
            .map(|(d, u)| (d.as_str(), u))
            .collect();
        if left.is_empty() || left.len() == members.len() {
            return None;
        }
        let partial = fold(round, &left).ok()?;
        self.last = Some(partial.clone());
        Some(partial)
    }
}

impl ServerMethod for RelayMethod {
    fn name(&self) -> &'static str {
        self.name
    }

    fn aggregate(
        &mut self,
        round: &RoundInfo,
        global: &[ParamBlock],
        updates: &[(&str, &Update)],
    ) -> Result<Vec<ParamBlock>, MethodError> {
        self.last = Some(fold(round.round, updates)?);
        self.kept = updates.iter().map(|(d, u)| ((*d).to_string(), (*u).clone())).collect();
        Ok(global.to_vec())
    }

    fn save_state(&self) -> Vec<u8> {
        encode_state(&self.last)
    }

    fn load_state(&mut self, state: &[u8]) -> Result<(), MethodError> {
        decode_state(state, &mut self.last)
    }

    fn is_relay(&self) -> bool {
        true
    }

    fn as_relay_mut(&mut self) -> Option<&mut RelayMethod> {
        Some(self)
    }
}

/// The partial aggregate a relay's checkpoint holds for its round, if that round aggregated:
/// what its shell sends up (again after a restart) until the parent acks it.
pub fn partial_of(checkpoint: &Checkpoint) -> Option<Partial> {
    let mut last: Option<Partial> = None;
    decode_state(&checkpoint.method_state, &mut last).ok()?;
    last.filter(|p| p.update.round == checkpoint.round)
}
