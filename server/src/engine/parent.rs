//! The engine's events that come with the tier ([`super::role`]): a relay's parent's rounds and
//! goodbye, and at the root the relays' partial aggregates and cost batches. A relay's round
//! opens when the parent's broadcast of it arrives, with the parent's round number, task,
//! training config, blocks and prototypes, and closes (at its target or its own deadline) into
//! the partial aggregate its role keeps.

use std::time::Duration;

use anchorage_shared::method::MethodConfig;
use anchorage_shared::protocol::{Broadcast, CostBatch, Partial, Refusal, RefusalReason};

use super::common::{ack, cost_ack};
use super::role::{ParentVerdict, Role, partial_of, relay_check};
use super::{Action, Engine, EngineConfig, Recovered};

impl Engine {
    /// A relay's engine running `method`'s server half: fresh, or continuing from what its store
    /// recovered. Its rounds are its parent's ([`Engine::handle_parent_round`]); `config.rounds`
    /// is ignored (the parent says when the federation ends). Refused where a partial aggregate
    /// cannot stand in for the devices' updates ([`relay_check`]).
    pub fn relay(
        mut config: EngineConfig,
        method: &MethodConfig,
        recovered: Option<Recovered>,
    ) -> Result<Self, super::ConfigError> {
        relay_check(&config, method)?;
        config.role = Role::Relay;
        let half = crate::methods::build(method);
        Ok(match recovered {
            Some(recovered) => Self::recover(config, half, recovered),
            None => Self::new(config, half, Vec::new()),
        })
    }

    /// Whether `client`'s certificate carries the relay role (the shell says so before its
    /// hello): only a relay may send partial aggregates and cost batches, and it must have
    /// said hello.
    pub fn set_relay(&mut self, client: &str, relay: bool) {
        self.core.set_relay_peer(client, relay);
    }

    /// A relay's parent said goodbye: the federation is over here too (goodbyes to the devices,
    /// then `Finished`).
    pub fn handle_parent_goodbye(&mut self, reason: &str) {
        if self.is_relay() && !self.core.is_finished() {
            self.core.finish(reason);
        }
    }

    /// A relay's last partial aggregate folded again without `devices` (its parent counted them
    /// through another relay): what goes up in its place; `None` where nothing is left or the
    /// round's updates are gone (a restart).
    pub fn refold_without(&mut self, devices: &[String]) -> Option<Partial> {
        self.core.relay_mut()?.refold_without(devices)
    }

    /// What a relay's parent did with its partial of a round ([`ParentVerdict`]): the devices
    /// in the partial the parent acked get the parent's ack; the acks held for the others go.
    pub fn handle_parent_verdict(&mut self, verdict: ParentVerdict) {
        let round = verdict.round;
        let Some(relay) = self.core.relay_mut() else { return };
        let acks = relay.parent_verdict(verdict);
        tracing::debug!(round, devices = acks.len(), "the parent's verdict on the partial reached its devices");
        for (device, aggregated) in acks {
            self.core.push(ack(&device, round, aggregated));
        }
    }

    /// The engine's role.
    pub fn role(&self) -> Role {
        self.core.role()
    }

    /// Whether this engine is a relay's.
    pub fn is_relay(&self) -> bool {
        self.role() == Role::Relay
    }

    /// The parent's broadcast of a round reached a relay: the round opens here (at once, if
    /// enough devices are connected). A broadcast of a round taken already is ignored (the parent
    /// sends it again after a reconnect); one of a newer round closes the round still open here
    /// first, with what it holds (its partial goes up, and the parent counts it late).
    pub fn handle_parent_round(&mut self, now: Duration, broadcast: Broadcast) {
        let round = broadcast.round;
        let Some(relay) = self.core.relay() else {
            tracing::warn!(round, "a parent's broadcast reached the root's engine; ignored");
            return;
        };
        let queued = relay.holds_round(round);
        if round <= self.core.last_round() || self.open_round().is_some_and(|r| r >= round) || queued || round == 0 {
            tracing::debug!(round, "the parent's broadcast of a round taken already; ignored");
            return;
        }
        let (core, mode) = self.mode_mut();
        mode.close_for_parent(core, now, round);
        if round - 1 > core.last_round() {
            // Rounds the parent ran without this relay: its numbers continue above them.
            core.push(Action::Persist(super::Persist::PassedOver { through: round - 1 }));
        }
        core.take_parent_model(round - 1, broadcast.blocks.clone());
        if let Some(relay) = core.relay_mut() {
            relay.queue(broadcast);
        }
        mode.start(core, now);
    }

    /// The partial aggregate of the last closed round, if it aggregated (what a relay's shell
    /// sends up until its parent acks it).
    pub fn last_partial(&self) -> Option<Partial> {
        self.is_relay().then(|| partial_of(&self.core.checkpoint())).flatten()
    }

    /// A partial aggregate from a relay (the shell passes them only from peers whose certificate
    /// has the relay role): the relay's update, weighted by its devices' total, checked and acked
    /// like any update; refused as a duplicate, naming the devices, when another relay's accepted
    /// partial of the round holds one of them already.
    pub(super) fn on_partial(&mut self, now: Duration, relay: &str, partial: Partial) {
        let Some(root) = self.core.root() else {
            let detail = "a relay takes updates from devices, not partial aggregates (one tier)".to_string();
            self.core.refuse(relay, RefusalReason::Malformed, detail);
            return;
        };
        let Partial { update, members } = partial;
        let round = update.round;
        let twice = root.members.counted_elsewhere(relay, round, &members);
        if !twice.is_empty() {
            self.core.count_duplicate();
            let detail = format!(
                "round {round}: another relay's partial aggregate holds {} of these devices already",
                twice.len()
            );
            self.core.refuse_with(relay, Refusal::duplicates(detail, twice));
            return;
        }
        self.on_update(now, relay, update);
        if self.open().is_some_and(|o| o.round == round && o.updates.contains_key(relay)) {
            let last = self.core.last_round();
            if let Some(root) = self.core.root_mut() {
                root.members.note(relay, round, &members, last);
            }
        }
    }

    /// A relay's batch of its devices' cost records of one round: each plausible one goes to
    /// the ledger under its device's name (the ledger ignores a row it holds already, so a resent
    /// batch adds nothing), then one confirmation of the round to the relay.
    pub(super) fn on_cost_batch(&mut self, relay: &str, batch: CostBatch) {
        if !self.core.is_known(relay) {
            self.core.refuse(relay, RefusalReason::NotEnrolled, "send a hello first".into());
            return;
        }
        let Some(round) = batch.records.first().map(|r| r.round) else { return };
        let next = self.core.last_round() + 1;
        if batch.records.iter().any(|r| r.round != round) || round > next {
            let detail = format!("a cost batch holds one round's records, of a round not ahead of {next}");
            self.core.refuse(relay, RefusalReason::Malformed, detail);
            return;
        }
        for record in batch.records {
            match self.core.implausible(&record) {
                Some(why) => self.core.drop_cost_record(&record.client, round, &why),
                None => self.core.push(Action::Ledger(record)),
            }
        }
        self.core.push(cost_ack(relay, round));
    }

    /// The relay and hash of `device`'s update in `round`, where an accepted partial holds it.
    pub fn counted_through(&self, round: u64, device: &str) -> Option<(&str, [u8; 32])> {
        self.core.root()?.members.of(round, device).map(|(relay, hash)| (relay.as_str(), *hash))
    }
}
