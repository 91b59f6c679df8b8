//! The engine with a parent: a relay (issue 37, module [`crate::relay`]). Its rounds are its
//! parent's: one opens when the parent's broadcast of that round arrives, with the parent's
//! round number, task, training config, blocks and prototypes, and it closes (at its target or
//! its own deadline) into the partial aggregate the relay method keeps.

use std::collections::BTreeMap;
use std::time::Duration;

use anchorage_shared::method::MethodConfig;
use anchorage_shared::protocol::{Broadcast, CostBatch, Member, Partial, RefusalReason};

use super::common::cost_ack;
use super::{Action, ClientId, Engine, EngineConfig, INVITATIONS_KEPT, Mode, Recovered};
use crate::relay::{RelayMethod, check, partial_of};

/// What a relay's engine holds of its parent.
#[derive(Debug, Default)]
pub(crate) struct ParentLink {
    /// The parent's broadcast of the round to open next.
    pub(super) next: Option<Broadcast>,
}

impl ParentLink {
    /// The parent's broadcast of `round`, to open it: its training config keeps the earlier of
    /// the two deadlines (the relay must answer before its parent closes).
    pub(super) fn take(&mut self, round: u64, deadline: Duration) -> Option<Broadcast> {
        let mut b = self.next.take_if(|b| b.round == round)?;
        let own = deadline.as_millis() as u64;
        b.config.deadline_ms = if b.config.deadline_ms == 0 { own } else { b.config.deadline_ms.min(own) };
        Some(b)
    }
}

/// What a root knows of the devices behind its relays: per recent round, each device whose
/// update an accepted partial aggregate holds, with the relay and the update's hash (issue 37,
/// item 3: nothing is counted twice when a device fails over to another relay).
#[derive(Debug, Default)]
pub(crate) struct Members {
    by_round: BTreeMap<u64, BTreeMap<ClientId, (ClientId, [u8; 32])>>,
}

impl Members {
    /// The devices of `partial` that an accepted partial of another relay holds already.
    fn counted_elsewhere(&self, relay: &str, round: u64, members: &[Member]) -> Vec<ClientId> {
        let Some(counted) = self.by_round.get(&round) else { return Vec::new() };
        members
            .iter()
            .filter(|m| counted.get(&m.device).is_some_and(|(r, _)| r != relay))
            .map(|m| m.device.clone())
            .collect()
    }

    fn note(&mut self, relay: &str, round: u64, members: &[Member], last_round: u64) {
        let counted = self.by_round.entry(round).or_default();
        for m in members {
            counted.insert(m.device.clone(), (relay.into(), m.hash));
        }
        let oldest = last_round.saturating_sub(INVITATIONS_KEPT);
        self.by_round.retain(|round, _| *round > oldest);
    }

    /// The relay and hash of `device`'s update in `round`, if a partial holds it.
    pub(crate) fn of(&self, round: u64, device: &str) -> Option<&(ClientId, [u8; 32])> {
        self.by_round.get(&round)?.get(device)
    }
}

impl Engine {
    /// A relay's engine for `method`: fresh, or continuing from what its store recovered. Its
    /// rounds are its parent's ([`Engine::handle_parent_round`]); `config.rounds` is ignored (the
    /// parent says when the federation ends). Refused where a partial aggregate cannot stand in
    /// for the devices' updates ([`crate::relay::check`]).
    pub fn relay(config: EngineConfig, method: &MethodConfig, recovered: Option<Recovered>) -> Result<Self, String> {
        check(&config, method)?;
        let relay = Box::new(RelayMethod::new(method.name()));
        Ok(match recovered {
            Some(recovered) => Self::recover(config, relay, recovered),
            None => Self::new(config, relay, Vec::new()),
        })
    }

    /// Whether `client`'s certificate carries the relay role (the shell says so before its
    /// hello): only a relay may send partial aggregates and cost batches, and it must have
    /// said hello.
    pub fn set_relay(&mut self, client: &str, relay: bool) {
        if relay {
            self.core.relays.insert(client.into());
        } else {
            self.core.relays.remove(client);
        }
    }

    /// A relay's parent said goodbye: the federation is over here too (goodbyes to the devices,
    /// then `Finished`).
    pub fn handle_parent_goodbye(&mut self, reason: &str) {
        if self.is_relay() && !self.core.finished {
            self.core.finish(reason);
        }
    }

    /// A relay's last partial aggregate folded again without `devices` (its parent counted them
    /// through another relay): what goes up in its place; `None` where nothing is left or the
    /// round's updates are gone (a restart).
    pub fn refold_without(&mut self, devices: &[String]) -> Option<Partial> {
        self.core.method.as_relay_mut()?.refold_without(devices)
    }

    /// Whether this engine is a relay's.
    pub fn is_relay(&self) -> bool {
        self.core.parent.is_some()
    }

    /// The parent's broadcast of a round reached a relay: the round opens here (at once, if
    /// enough devices are connected). A broadcast of a round taken already is ignored (the parent
    /// sends it again after a reconnect); one of a newer round closes the round still open here
    /// first, with what it holds (its partial goes up, and the parent counts it late).
    pub fn handle_parent_round(&mut self, now: Duration, broadcast: Broadcast) {
        let round = broadcast.round;
        let Some(parent) = self.core.parent.as_ref() else {
            tracing::warn!(round, "a parent's broadcast reached the root's engine; ignored");
            return;
        };
        let queued = parent.next.as_ref().is_some_and(|b| b.round >= round);
        if round <= self.core.last_round || self.open_round().is_some_and(|r| r >= round) || queued || round == 0 {
            tracing::debug!(round, "the parent's broadcast of a round taken already; ignored");
            return;
        }
        if let Mode::Rounds(rounds) = &mut self.mode {
            rounds.close_for_parent(&mut self.core, now);
        }
        self.core.last_round = round - 1;
        self.core.global = broadcast.blocks.clone();
        if let Some(parent) = self.core.parent.as_mut() {
            parent.next = Some(broadcast);
        }
        let (core, mode) = self.mode_mut();
        mode.start(core, now);
    }

    /// The partial aggregate of the last closed round, if it aggregated (what a relay's shell
    /// sends up until its parent acks it).
    pub fn last_partial(&self) -> Option<Partial> {
        self.is_relay().then(|| partial_of(&self.core.checkpoint())).flatten()
    }

    /// A partial aggregate from a relay (the shell passes them only from peers whose certificate
    /// has the relay role): the relay's update, weighted by its devices' total, checked and acked
    /// like any update; refused as a duplicate when another relay's accepted partial of the round
    /// holds one of its devices already.
    pub(super) fn on_partial(&mut self, now: Duration, relay: &str, partial: Partial) {
        if self.is_relay() {
            let detail = "a relay takes updates from devices, not partial aggregates (one tier)".to_string();
            self.core.refuse(relay, RefusalReason::Malformed, detail);
            return;
        }
        let Partial { update, members } = partial;
        let round = update.round;
        let twice = self.core.members.counted_elsewhere(relay, round, &members);
        if !twice.is_empty() {
            self.core.stats.duplicate_updates += 1;
            let detail = crate::relay::duplicate_detail(round, &twice);
            self.core.refuse(relay, RefusalReason::Duplicate, detail);
            return;
        }
        self.on_update(now, relay, update);
        if self.open().is_some_and(|o| o.round == round && o.updates.contains_key(relay)) {
            let last = self.core.last_round;
            self.core.members.note(relay, round, &members, last);
        }
    }

    /// A relay's batch of its devices' cost records of one round: each plausible one goes to
    /// the ledger under its device's name (the ledger ignores a row it holds already, so a resent
    /// batch adds nothing), then one confirmation of the round to the relay.
    pub(super) fn on_cost_batch(&mut self, relay: &str, batch: CostBatch) {
        if !self.core.clients.contains_key(relay) {
            self.core.refuse(relay, RefusalReason::NotEnrolled, "send a hello first".into());
            return;
        }
        let Some(round) = batch.records.first().map(|r| r.round) else { return };
        if batch.records.iter().any(|r| r.round != round) || round > self.core.last_round + 1 {
            let detail =
                format!("a cost batch holds one round's records, of a round not ahead of {}", self.core.last_round + 1);
            self.core.refuse(relay, RefusalReason::Malformed, detail);
            return;
        }
        for record in batch.records {
            match self.core.implausible(&record) {
                Some(why) => self.core.drop_cost_record(&record.client, round, &why),
                None => self.core.actions.push_back(Action::Ledger(record)),
            }
        }
        self.core.actions.push_back(cost_ack(relay, round));
    }

    /// The relay and hash of `device`'s update in `round`, where an accepted partial holds it.
    pub fn counted_through(&self, round: u64, device: &str) -> Option<(&str, [u8; 32])> {
        self.core.members.of(round, device).map(|(relay, hash)| (relay.as_str(), *hash))
    }
}
