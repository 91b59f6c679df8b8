//! An engine's role, part of its configuration (DESIGN.md, "one engine, three roles"): the
//! root opens its own rounds and takes relays' partial aggregates as participants' updates; a
//! relay opens its parent's rounds and folds each into one partial aggregate in place of the
//! method's aggregation. The method's server half is the same object in either role and knows
//! nothing of relays.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anchorage_shared::method::MethodConfig;
use anchorage_shared::protocol::{Broadcast, Member, Metric, Partial, Update};
use anchorage_shared::prototype::Prototype;
use anchorage_shared::prototype_rules::fuse;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use anchorage_shared::transfer::sha256;
use serde::{Deserialize, Serialize};

use super::{Checkpoint, ClientId, EngineConfig, INVITATIONS_KEPT};
use crate::aggregate::AggregationRule;
use crate::methods::{MethodError, average_blocks, decode_state, encode_state, uploaded_prototypes};

/// Where an engine sits in the tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// Opens its own rounds; the method's server half aggregates them.
    #[default]
    Root,
    /// Opens its parent's rounds ([`crate::Engine::handle_parent_round`]) and folds each into
    /// one partial aggregate ([`fold`]) that goes up as one participant's update.
    Relay,
}

/// Why `method` cannot run behind a relay under `config`; `Ok` when it can: the compatibility
/// table's ([`super::compat::check`]) verdict on `config` in the relay role.
pub fn relay_check(config: &EngineConfig, method: &MethodConfig) -> Result<(), super::ConfigError> {
    super::compat::check(&EngineConfig { role: Role::Relay, ..config.clone() }, method)
}

/// What the engine keeps for its role.
#[derive(Debug)]
pub(super) enum RoleState {
    Root(RootState),
    Relay(Box<RelayState>),
}

impl RoleState {
    pub(super) fn new(role: Role) -> Self {
        match role {
            Role::Root => Self::Root(RootState::default()),
            Role::Relay => Self::Relay(Box::default()),
        }
    }

    pub(super) fn role(&self) -> Role {
        match self {
            Self::Root(_) => Role::Root,
            Self::Relay(_) => Role::Relay,
        }
    }

    pub(super) fn relay(&self) -> Option<&RelayState> {
        match self {
            Self::Relay(relay) => Some(relay),
            Self::Root(_) => None,
        }
    }

    pub(super) fn relay_mut(&mut self) -> Option<&mut RelayState> {
        match self {
            Self::Relay(relay) => Some(relay),
            Self::Root(_) => None,
        }
    }

    pub(super) fn root(&self) -> Option<&RootState> {
        match self {
            Self::Root(root) => Some(root),
            Self::Relay(_) => None,
        }
    }

    pub(super) fn root_mut(&mut self) -> Option<&mut RootState> {
        match self {
            Self::Root(root) => Some(root),
            Self::Relay(_) => None,
        }
    }

    /// A relay with no parent broadcast to open: it opens no round of its own.
    pub(super) fn awaits_parent(&self) -> bool {
        self.relay().is_some_and(|r| r.next.is_none())
    }
}

/// A root's knowledge of its relays.
#[derive(Debug, Default)]
pub(super) struct RootState {
    /// Peers whose certificate carries the relay role: only they may send partial aggregates
    /// and cost batches.
    pub(super) relays: BTreeSet<ClientId>,
    /// The devices behind the relays' accepted partial aggregates.
    pub(super) members: Members,
}

/// A relay's state: its parent's next round, its last round's partial aggregate, and the acks it
/// owes its devices until the parent says what became of that partial.
#[derive(Debug, Default)]
pub(super) struct RelayState {
    /// The parent's broadcast of the round to open next.
    next: Option<Broadcast>,
    last: Option<Partial>,
    /// The last round's screened and bounded updates, in memory, to fold again without devices
    /// the parent counted through another relay.
    kept: Vec<(ClientId, Update)>,
    /// Per round, the devices whose update the relay accepted and has not acked: a relay's ack
    /// repeats its parent's ack of the partial that holds the update.
    held: BTreeMap<u64, BTreeSet<ClientId>>,
    /// The parent's verdict on this relay's partial of each recent round (a device resending an
    /// update of such a round gets it at once).
    verdicts: BTreeMap<u64, ParentVerdict>,
}

/// What a relay's parent did with the relay's partial aggregate of `round`: acked it
/// (`aggregated`: in the parent's round, or late) holding `members`, or dropped it (refused,
/// `members` empty). The relay's devices among `members` get the parent's ack; the rest none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParentVerdict {
    pub round: u64,
    pub aggregated: bool,
    pub members: Vec<ClientId>,
}

impl ParentVerdict {
    /// The parent refused the partial and the relay could not fold it again: nobody in it is
    /// counted.
    pub fn dropped(round: u64) -> Self {
        Self { round, aggregated: false, members: Vec::new() }
    }
}

impl RelayState {
    /// Whether the parent's broadcast of `round` or a later one waits to be opened.
    pub(super) fn holds_round(&self, round: u64) -> bool {
        self.next.as_ref().is_some_and(|b| b.round >= round)
    }

    /// A device's update of `round` was accepted (or sent again): the ack it is owed, `None`
    /// while the parent has not said what became of the round's partial (the ack is held) or
    /// when the partial the parent counted does not hold it.
    pub(super) fn ack_owed(&mut self, client: &str, round: u64) -> Option<bool> {
        match self.verdicts.get(&round) {
            Some(v) => v.members.iter().any(|m| m == client).then_some(v.aggregated),
            None => {
                self.held.entry(round).or_default().insert(client.into());
                None
            }
        }
    }

    /// The parent's verdict on the partial of `verdict.round`: the held acks it answers, as
    /// (device, aggregated). Verdicts and held acks older than [`INVITATIONS_KEPT`] rounds go.
    pub(super) fn parent_verdict(&mut self, verdict: ParentVerdict) -> Vec<(ClientId, bool)> {
        let round = verdict.round;
        let held = self.held.remove(&round).unwrap_or_default();
        let acks = held.into_iter().filter(|d| verdict.members.contains(d)).map(|d| (d, verdict.aggregated)).collect();
        self.verdicts.insert(round, verdict);
        let oldest = round.saturating_sub(INVITATIONS_KEPT);
        self.verdicts.retain(|r, _| *r > oldest);
        self.held.retain(|r, _| *r > oldest);
        acks
    }

    pub(super) fn queue(&mut self, broadcast: Broadcast) {
        self.next = Some(broadcast);
    }

    /// The parent's broadcast of `round`, to open it: its training config keeps the earlier of
    /// the two deadlines (the relay must answer before its parent closes).
    pub(super) fn take(&mut self, round: u64, deadline: Duration) -> Option<Broadcast> {
        let mut b = self.next.take_if(|b| b.round == round)?;
        let own = deadline.as_millis() as u64;
        b.config.deadline_ms = if b.config.deadline_ms == 0 { own } else { b.config.deadline_ms.min(own) };
        Some(b)
    }

    /// The relay's aggregation: the round's updates folded into its partial; the global blocks
    /// stay as the parent sent them.
    pub(super) fn fold(&mut self, round: u64, updates: &[(&str, &Update)]) -> Result<(), MethodError> {
        self.last = Some(fold(round, updates)?);
        self.kept = updates.iter().map(|(d, u)| ((*d).to_string(), (*u).clone())).collect();
        Ok(())
    }

    /// The last partial aggregate folded again without `devices` (it becomes the last one);
    /// `None` when nothing is left or the updates are gone.
    pub(super) fn refold_without(&mut self, devices: &[String]) -> Option<Partial> {
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

    /// What the checkpoint stores for a relay in place of a method's state: its last partial.
    pub(super) fn save_state(&self) -> Vec<u8> {
        encode_state(&self.last)
    }

    pub(super) fn load_state(&mut self, state: &[u8]) -> Result<(), MethodError> {
        decode_state(state, &mut self.last)
    }
}

/// What a root knows of the devices behind its relays: per recent round, each device whose
/// update an accepted partial aggregate holds, with the relay and the update's hash, so that a
/// device that failed over to another relay is counted once.
#[derive(Debug, Default)]
pub(super) struct Members {
    by_round: BTreeMap<u64, BTreeMap<ClientId, (ClientId, [u8; 32])>>,
}

impl Members {
    /// The devices of `partial` that an accepted partial of another relay holds already.
    pub(super) fn counted_elsewhere(&self, relay: &str, round: u64, members: &[Member]) -> Vec<ClientId> {
        let Some(counted) = self.by_round.get(&round) else { return Vec::new() };
        members
            .iter()
            .filter(|m| counted.get(&m.device).is_some_and(|(r, _)| r != relay))
            .map(|m| m.device.clone())
            .collect()
    }

    pub(super) fn note(&mut self, relay: &str, round: u64, members: &[Member], last_round: u64) {
        let counted = self.by_round.entry(round).or_default();
        for m in members {
            counted.insert(m.device.clone(), (relay.into(), m.hash));
        }
        let oldest = last_round.saturating_sub(INVITATIONS_KEPT);
        self.by_round.retain(|round, _| *round > oldest);
    }

    /// The relay and hash of `device`'s update in `round`, if a partial holds it.
    pub(super) fn of(&self, round: u64, device: &str) -> Option<&(ClientId, [u8; 32])> {
        self.by_round.get(&round)?.get(device)
    }
}

/// Folds a round's screened and bounded updates into one partial aggregate: the blocks as their
/// sample-weighted mean Σ n_k w_k / N with N = Σ n_k the update's `num_samples`; each class's
/// prototype as the count-weighted mean of its uploads with their total count (GLDP Eq. 6
/// across clients, FedProK Eq. 9's first case); metrics as sample-weighted means; compute
/// seconds summed. A parent that takes the weighted mean over its relays gets
/// Σ_r N_r (Σ_{k∈r} n_k w_k / N_r) / Σ_r N_r = Σ_k n_k w_k / Σ_k n_k, the devices' own mean, to
/// float rounding; the prototype rules fuse the same count-weighted means. `members` names every
/// update by (device, samples, SHA-256 of its body).
pub fn fold(round: u64, updates: &[(&str, &Update)]) -> Result<Partial, MethodError> {
    if updates.is_empty() {
        return Err(MethodError::Empty);
    }
    let blocks: Vec<ParamBlock> = average_blocks(&[], updates, Encoding::F32, &AggregationRule::Mean)?;
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
        prototypes_are: Default::default(),
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

/// The partial aggregate a relay's checkpoint holds for its round, if that round aggregated:
/// what its shell sends up (again after a restart) until the parent acks it.
pub fn partial_of(checkpoint: &Checkpoint) -> Option<Partial> {
    let mut last: Option<Partial> = None;
    decode_state(&checkpoint.method_state, &mut last).ok()?;
    last.filter(|p| p.update.round == checkpoint.round)
}
