//! A relay's synchronous rounds ([`super::super::role`]): the round open at a crash waits for
//! its parent's broadcast to open again, a parent that moved on closes the round here, and a
//! device that failed over from another relay of the tier joins the round it trained for.

use std::sync::Arc;
use std::time::Duration;

use super::super::common::Core;
use super::super::{AcceptedUpdate, Action, ClientId, OpenedRound, Persist};
use super::{OpenRound, RoundsState, open_round_record};

impl RoundsState {
    /// After a relay's restart: the round open at the crash and the updates it had acked wait
    /// for the parent's broadcast of that round.
    pub(super) fn stash(&mut self, open: Option<OpenedRound>, pending: Vec<AcceptedUpdate>) {
        self.stashed = open.map(|o| {
            let round = o.round;
            (o, pending.into_iter().filter(|p| p.update.round == round).collect())
        });
    }

    /// A relay's round that was open at a crash opens again on its parent's broadcast, with its
    /// invitations and the updates it had acked (durable already); it closes at once if full.
    pub(super) fn reopen(&mut self, core: &mut Core, now: Duration, opened: OpenedRound, pending: Vec<AcceptedUpdate>) {
        tracing::info!(round = opened.round, accepted = pending.len(), "a relay resumes the round open at its crash");
        let round = resumed(core, now, opened, pending);
        let waiting: Vec<ClientId> =
            round.sampled.iter().filter(|c| !round.updates.contains_key(*c)).cloned().collect();
        round.broadcast_to(core, waiting);
        let full = round.updates.len() >= round.target;
        self.open = Some(round);
        if full {
            self.close_round(core, now);
        }
    }

    /// A relay's parent moved on to round `round`: the round open here closes now with what it
    /// holds, and so does an older round open at a crash that never opened again (its parent's
    /// broadcast of it never came): the store holds one open round at a time.
    pub(super) fn close_as_parent_moved_on(&mut self, core: &mut Core, now: Duration, round: u64) {
        if self.open.is_none()
            && let Some((opened, pending)) = self.stashed.take_if(|(o, _)| o.round < round)
        {
            tracing::info!(
                round = opened.round,
                accepted = pending.len(),
                "the parent moved on from the round open at the crash"
            );
            self.open = Some(resumed(core, now, opened, pending));
        }
        if self.open.is_some() {
            tracing::info!(round = self.open.as_ref().map(|o| o.round), "the parent moved on; closing the round here");
            self.close_round(core, now);
        }
    }
}

/// The round open at a relay's crash, built again with its invitations and the updates it had
/// accepted (durable already).
fn resumed(core: &mut Core, now: Duration, opened: OpenedRound, pending: Vec<AcceptedUpdate>) -> OpenRound {
    let sampled = opened.sampled.into_iter().collect();
    let mut round = open_round_record(core, now, opened.round, opened.target, sampled, None);
    for p in pending {
        let at = p.arrived_after;
        round.updates.insert(p.client.clone(), (Arc::new(p), at));
    }
    core.note_invited(round.round, round.sampled.iter().cloned());
    round
}

/// A relay takes the update of its parent's open round from a device it did not invite: one
/// that failed over from another relay of the tier and resends what it
/// trained for this round. It joins the invitations (durable before its update is) and counts
/// as any other; the parent counts each device once across its relays. The root adopts nobody.
pub(super) fn adopt_failover(core: &mut Core, open: &mut OpenRound, client: &str) -> bool {
    if core.relay().is_none() || open.secagg.is_some() {
        return false;
    }
    tracing::info!(round = open.round, client, "a device that failed over from another relay joins the round");
    open.sampled.insert(client.into());
    core.note_invited(open.round, [client.to_string()]);
    let sampled = open.sampled.iter().cloned().collect();
    core.push(Action::Persist(Persist::Invited { round: open.round, sampled }));
    true
}
