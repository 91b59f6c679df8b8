//! The run's side of a relay tier: the relay engines' actions, their uplinks onto their links,
//! and the failovers and restarts ([`super::restart`]) that break their devices' connections.

use std::time::Duration;

use anchorage_server::engine::{Action, Engine, Persist};
use anchorage_shared::protocol::Message;

use super::events::Event;
use super::quic::{FAILOVER_DELAY, HOME_AFTER, frame_len};
use super::run::VirtualRun;
use super::watch::Seen;
use crate::setup::client_id;

impl VirtualRun {
    /// Relay `r`'s engine.
    fn engine_of_relay(&mut self, r: usize) -> &mut Engine {
        match self.tier.as_mut() {
            Some(t) => &mut t.relays[r].engine,
            None => &mut self.engine,
        }
    }

    /// One of relay `r`'s actions: messages to its clients, their dropped records, its state
    /// changes into its store, and its closed round's partial aggregate up its link to the root.
    pub(super) fn on_relay_action(&mut self, r: usize, action: Action) -> anyhow::Result<()> {
        let now = self.now;
        if let Action::Persist(persist @ Persist::Accepted(accepted)) = &action {
            return self.accepted_at_relay(r, persist, &accepted.client, accepted.update.round);
        }
        if let Action::Send { to, msg: Message::Ack(ack) } = &action {
            let (client, round, aggregated) = (to.clone(), ack.round, ack.aggregated);
            self.see(|| Seen::AckQueued { relay: Some(r), client, round, aggregated });
        }
        if let Action::Send { to, msg: Message::Ack(ack) } = &action
            && let Some(&client) = self.index.get(to)
            && self.tier.as_ref().is_some_and(|t| t.relay_of(client) == r)
            && self.tier.as_mut().is_some_and(|t| t.acked_away(client, ack.round))
        {
            // Acked where it failed over to: once the ack is in, it goes back to its own relay.
            let back_after = FAILOVER_DELAY;
            self.queue.push(now + HOME_AFTER, Event::Offline { client, back_after, crash: false });
        }
        match action {
            Action::Send { .. } | Action::Close { .. } | Action::Broadcast { .. } => self.send_to_clients(action),
            Action::Ledger(record) => {
                if record.dropped || record.declined.is_some() {
                    self.live.cost(self.ledger.len(), &record);
                    self.ledger.push(record.clone());
                }
                if let Some(tier) = self.tier.as_mut() {
                    tier.relays[r].cost(now, record)?;
                }
                self.drive_uplink(r);
            }
            Action::RoundClosed(_, checkpoint) => {
                let Some(tier) = self.tier.as_mut() else { return Ok(()) };
                if let Some(partial) = anchorage_server::relay::partial_of(&checkpoint) {
                    tier.relays[r].uplink.partial_closed(partial);
                }
                self.drive_uplink(r);
            }
            Action::Persist(persist) => {
                if let Some(tier) = self.tier.as_ref() {
                    tier.relays[r].persist(&persist)?;
                }
            }
            Action::Finished => {}
        }
        Ok(())
    }

    /// Relay `r` accepted `client`'s update of `round`: committed to its store first; then the
    /// process dies there if a restart is due (its first update of the round is in the store), or
    /// the device's connection breaks if it fails over then (before its ack, which waits for the
    /// root's ack of the relay's partial).
    fn accepted_at_relay(&mut self, r: usize, persist: &Persist, client: &str, round: u64) -> anyhow::Result<()> {
        let Some(tier) = self.tier.as_mut() else { return Ok(()) };
        tier.relays[r].persist(persist)?;
        let committed = client.to_string();
        self.see(|| Seen::Committed { relay: Some(r), client: committed, round });
        let Some(tier) = self.tier.as_mut() else { return Ok(()) };
        match tier.restarts_at(r, round) {
            Some(down) if down.is_zero() => return self.restart_relay(r),
            Some(down) => {
                self.kill_relay(r, down);
                return Ok(());
            }
            None => {}
        }
        if let Some(&i) = self.index.get(client)
            && tier.relay_of(i) == r
            && tier.fails_over(i, round)
        {
            // The device comes back on its next relay and sends its update again there.
            self.reconnect_elsewhere(r, i);
        }
        Ok(())
    }

    /// Client `client`'s connection to relay `r` breaks; it connects to the relay the tier has
    /// it on now, after [`FAILOVER_DELAY`].
    fn reconnect_elsewhere(&mut self, r: usize, client: usize) {
        let now = self.now;
        self.engine_of_relay(r).handle_disconnect(now, &client_id(client));
        self.reconnect_after(client, FAILOVER_DELAY);
    }

    /// Client `client`'s connection breaks; it connects again, to the relay the tier has it on,
    /// `after` from now.
    pub(super) fn reconnect_after(&mut self, client: usize, after: Duration) {
        let c = &mut self.clients[client];
        if c.online {
            c.online = false;
            c.conn += 1;
            c.session.disconnected();
            self.queue.push(self.now + after, Event::Online { client });
        }
    }

    /// Whether relay `r` is still on connection `conn` (a restart ends it).
    pub(super) fn relay_conn(&self, r: usize, conn: u64) -> bool {
        self.tier.as_ref().is_none_or(|t| t.relays[r].conn == conn)
    }

    /// Carries out relay `r`'s uplink actions: what goes up travels its link to the root.
    pub(super) fn drive_uplink(&mut self, r: usize) {
        let now = self.now;
        let Some(tier) = self.tier.as_mut() else { return };
        let relay = &mut tier.relays[r];
        if relay.down_until.is_some() {
            return;
        }
        for msg in relay.carry_out(now) {
            let (at, _) = relay.up.carry_transfer(now, frame_len(&msg), true);
            self.queue.push(at, Event::ToRoot { relay: r, msg, conn: relay.conn });
        }
    }

    /// The root's message onto relay `r`'s link.
    pub(super) fn send_to_relay(&mut self, r: usize, msg: Message) {
        let Some(tier) = self.tier.as_mut() else { return };
        let relay = &mut tier.relays[r];
        let (at, _) = relay.down.carry_transfer(self.now, frame_len(&msg), true);
        self.queue.push(at, Event::ToRelay { relay: r, msg, conn: relay.conn });
    }

    /// The root's message reaches relay `r`'s uplink session.
    pub(super) fn relay_received(&mut self, r: usize, msg: Message) {
        let now = self.now;
        let Some(relay) = self.tier.as_mut().map(|t| &mut t.relays[r]) else { return };
        relay.uplink.handle_message(now, msg);
        self.drive_uplink(r);
    }
}
