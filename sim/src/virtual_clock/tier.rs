//! A relay tier on the virtual clock (`[relays]`): what a tier does to round time and bytes
//! before one is built. Each relay is the server's own sans-IO engine in its relay role
//! ([`Engine::relay`]) with the same uplink session as `anchorage-relay` ([`UplinkSession`]):
//! hello, partials owed until acked, refolds after a duplicate refusal, cost batches until
//! confirmed. Client i joins relay i mod R. The root takes the relays as its participants;
//! what passes between a relay and the root is charged to the relay's own link, whose outages
//! hold it back. A relay that restarts keeps its state in a store ([`super::restart`]).

use std::time::Duration;

use anchorage_server::engine::{Engine, EngineConfig, Persist};
use anchorage_server::relay::session::{UplinkAction, UplinkSession};
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::method::MethodConfig;
use anchorage_shared::protocol::Message;

use super::quic::Path;
use super::restart::RelayDisk;
use crate::config::RelayTier;
use crate::network::Outage;

/// What a tier's uplinks did over a run, for the reports and tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UplinkCounts {
    /// Partial aggregates sent (again after a reconnect or a refold), acked, refused.
    pub sent: u64,
    pub acked: u64,
    pub refused: u64,
    /// Rounds folded again without devices the root counted through another relay.
    pub refolded: u64,
    /// Cost batches sent, and rounds of cost records the root confirmed.
    pub cost_batches: u64,
    /// Relay processes restarted (`[relays] restarts`).
    pub restarts: u64,
    /// Cost records the root's ledger held already (a restarted relay sends its recent ones again).
    pub repeated_costs: u64,
}

/// One relay: its engine, its uplink session and its link to the root.
pub(super) struct VirtualRelay {
    pub(super) id: String,
    pub(super) engine: Engine,
    /// What the engine is built with (again at a restart).
    pub(super) config: EngineConfig,
    pub(super) uplink: UplinkSession,
    pub(super) counts: UplinkCounts,
    /// Towards the root, and from it.
    pub(super) up: Path,
    pub(super) down: Path,
    /// Incremented at every restart: messages in flight on the relay's link are lost with it.
    pub(super) conn: u64,
    /// The relay's store, for a relay that restarts.
    pub(super) disk: Option<RelayDisk>,
    /// While its process is down: when it starts again.
    pub(super) down_until: Option<Duration>,
}

/// The key the server's store keeps one ledger row per: (client, round, declined, dropped).
pub(super) fn ledger_key(r: &CostRecord) -> (&str, u64, bool, bool) {
    (&r.client, r.round, r.declined.is_some(), r.dropped)
}

/// The tier: the relays, in order.
pub(super) struct Tier {
    pub(super) relays: Vec<VirtualRelay>,
    /// The relay each client is on (i mod R until it fails over).
    assigned: Vec<usize>,
    /// Failovers still to happen: (client, round).
    failovers: Vec<(usize, u64)>,
    /// Clients away on another relay for a round: (client, round, their own relay).
    away: Vec<(usize, u64, usize)>,
    /// Clients on another relay because their own is down: (client, their own relay).
    displaced: Vec<(usize, usize)>,
    /// Restarts still to happen: (relay, round, how long it stays down).
    restarts: Vec<(usize, u64, Duration)>,
    /// The federation's method, to build a restarted relay's engine.
    pub(super) method: MethodConfig,
    /// The root's ledger: what the relays' cost batches carried up.
    pub(super) root_ledger: Vec<CostRecord>,
    /// Records the root's ledger held already when they came.
    repeated_costs: u64,
}

impl Tier {
    /// The relays of `tier` over `clients` clients ([`VirtualRelay::new`]), and the root's engine
    /// config: the relays are its participants (every one each round, weighted by what it holds,
    /// no weight cap).
    pub(super) fn new(
        tier: &RelayTier,
        clients: usize,
        engine: &EngineConfig,
        method: &MethodConfig,
        seed: u64,
    ) -> anyhow::Result<(Self, EngineConfig)> {
        anyhow::ensure!(
            tier.count >= 1 && tier.count <= clients,
            "[relays] count must be 1 to the clients ({clients})"
        );
        if let Some(o) = tier.outages.iter().find(|o| o.relay >= tier.count) {
            anyhow::bail!(
                "[relays] outage of relay {}: there are {} relays (0 to {})",
                o.relay,
                tier.count,
                tier.count - 1
            );
        }
        if let Some(r) = tier.restarts.iter().find(|r| r.relay >= tier.count) {
            anyhow::bail!("[relays] restart of relay {}: there are {} relays", r.relay, tier.count);
        }
        let relays = (0..tier.count)
            .map(|r| VirtualRelay::new(tier, r, clients, engine, method, seed))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut robust = engine.robust.clone();
        robust.weight_cap = None;
        // The root waits for every relay, but one that goes down for a while (it goes on without
        // those).
        let going_down: std::collections::BTreeSet<usize> =
            tier.restarts.iter().filter(|r| r.down_ms > 0).map(|r| r.relay).collect();
        let wanted = (tier.count - going_down.len()).max(1);
        let root = EngineConfig {
            min_available: wanted,
            min_fit: wanted,
            fraction: 1.0,
            over_selection: 0.0,
            robust,
            ..engine.clone()
        };
        if let Some(f) = tier.failovers.iter().find(|f| f.client >= clients) {
            anyhow::bail!("[relays] failover of client {}: there are {clients} clients", f.client);
        }
        let tier = Self {
            relays,
            assigned: (0..clients).map(|c| c % tier.count).collect(),
            failovers: tier.failovers.iter().map(|f| (f.client, f.round)).collect(),
            away: Vec::new(),
            displaced: Vec::new(),
            restarts: tier.restarts.iter().map(|r| (r.relay, r.round, Duration::from_millis(r.down_ms))).collect(),
            method: method.clone(),
            root_ledger: Vec::new(),
            repeated_costs: 0,
        };
        Ok((tier, root))
    }

    /// The relay client `client` is on.
    pub(super) fn relay_of(&self, client: usize) -> usize {
        self.assigned[client]
    }

    /// Whether `client`'s connection breaks once its relay accepted its update of `round` (a
    /// failover, before the ack): then the client moves to the next relay for that round (once).
    pub(super) fn fails_over(&mut self, client: usize, round: u64) -> bool {
        let Some(i) = self.failovers.iter().position(|f| *f == (client, round)) else { return false };
        self.failovers.remove(i);
        let home = self.assigned[client];
        let next = (home + 1) % self.relays.len();
        tracing::info!(
            client,
            round,
            relay = next,
            "the connection is lost before the ack: the device fails over to the next relay"
        );
        self.assigned[client] = next;
        self.away.push((client, round, home));
        true
    }

    /// Whether `client`, away for `round`, is acked that round where it failed over to: then it
    /// goes back to its own relay when it next disconnects ([`Tier::back_home`]).
    pub(super) fn acked_away(&mut self, client: usize, round: u64) -> bool {
        match self.away.iter_mut().find(|(c, r, _)| (*c, *r) == (client, round)) {
            Some(away) => {
                away.1 = u64::MAX;
                true
            }
            None => false,
        }
    }

    /// A client that was acked away, or is on another relay while its own is down, goes back to
    /// its own relay (it has disconnected; if its own is still down, it fails over again as it
    /// connects: [`Tier::displace`]).
    pub(super) fn back_home(&mut self, client: usize) {
        if let Some(i) = self.away.iter().position(|(c, r, _)| *c == client && *r == u64::MAX) {
            let (_, _, home) = self.away.remove(i);
            self.assigned[client] = home;
        }
        if let Some(i) = self.displaced.iter().position(|(c, _)| *c == client) {
            let (_, home) = self.displaced.remove(i);
            self.assigned[client] = home;
        }
    }

    /// When relay `relay` restarts as it commits its first update of `round` (once): how long it
    /// stays down.
    pub(super) fn restarts_at(&mut self, relay: usize, round: u64) -> Option<Duration> {
        let i = self.restarts.iter().position(|(r, at, _)| (*r, *at) == (relay, round))?;
        Some(self.restarts.remove(i).2)
    }

    /// Whether relay `r`'s process is up.
    pub(super) fn is_up(&self, r: usize) -> bool {
        self.relays[r].down_until.is_none()
    }

    /// `client` connects while its relay is down: it fails over to the next relay that is up
    /// (its own is remembered, to go back to). `Err`: none is up, and when its own starts again.
    pub(super) fn displace(&mut self, client: usize) -> Result<(), Duration> {
        let at = self.assigned[client];
        let Some(up_at) = self.relays[at].down_until else { return Ok(()) };
        let count = self.relays.len();
        let Some(next) = (1..count).map(|k| (at + k) % count).find(|&r| self.is_up(r)) else { return Err(up_at) };
        if !self.displaced.iter().any(|(c, _)| *c == client) {
            self.displaced.push((client, at));
        }
        tracing::info!(client, relay = next, "its relay is down: the device fails over to the next relay");
        self.assigned[client] = next;
        Ok(())
    }

    /// The clients on another relay while relay `home` was down.
    pub(super) fn displaced_from(&self, home: usize) -> Vec<usize> {
        self.displaced.iter().filter(|(_, h)| *h == home).map(|(c, _)| *c).collect()
    }

    /// Whether `client`, on another relay while its own was down, goes back now (its own is up).
    pub(super) fn goes_home(&mut self, client: usize) -> bool {
        let Some(i) = self.displaced.iter().position(|(c, _)| *c == client) else { return false };
        let home = self.displaced[i].1;
        if !self.is_up(home) {
            return false;
        }
        self.displaced.remove(i);
        self.assigned[client] = home;
        true
    }

    /// A record for the root's ledger, which keeps one row per (client, round, kind) as the root's
    /// store does: a record it holds already is counted and ignored (`true`: it was).
    pub(super) fn file_at_root(&mut self, record: CostRecord) -> bool {
        let repeated = self.root_ledger.iter().any(|held| ledger_key(held) == ledger_key(&record));
        if repeated {
            self.repeated_costs += 1;
        } else {
            self.root_ledger.push(record);
        }
        repeated
    }

    /// The relay named `id`, if one is.
    pub(super) fn index_of(&self, id: &str) -> Option<usize> {
        self.relays.iter().position(|r| r.id == id)
    }

    /// Every relay's uplink connects and says hello to the root at the start (as a relay
    /// certificate would let it), on no link: the tier starts joined.
    pub(super) fn join(&mut self, root: &mut Engine) {
        for relay in &mut self.relays {
            root.set_relay(&relay.id, true);
            relay.uplink.connected(Duration::ZERO);
            for msg in relay.carry_out(Duration::ZERO) {
                root.handle_message(Duration::ZERO, &relay.id, msg);
            }
        }
    }

    /// When the earliest relay engine or uplink that is up needs its timeout.
    pub(super) fn poll_timeout(&self) -> Option<Duration> {
        let up = || self.relays.iter().filter(|r| r.down_until.is_none());
        let engines = up().filter_map(|r| r.engine.poll_timeout());
        engines.chain(up().filter_map(|r| r.uplink.poll_timeout())).min()
    }

    /// Whether no uplink is still closing (sending its last cost records after the root's
    /// goodbye, or waiting for their confirmation).
    pub(super) fn settled(&self) -> bool {
        self.relays
            .iter()
            .all(|r| !matches!(r.uplink.state(), anchorage_server::relay::session::UplinkState::Closing { .. }))
    }

    /// What every uplink did, summed over the relays.
    pub(super) fn counts(&self) -> UplinkCounts {
        let total = UplinkCounts { repeated_costs: self.repeated_costs, ..UplinkCounts::default() };
        self.relays.iter().fold(total, |t, r| UplinkCounts {
            sent: t.sent + r.counts.sent,
            acked: t.acked + r.counts.acked,
            refused: t.refused + r.counts.refused,
            refolded: t.refolded + r.counts.refolded,
            cost_batches: t.cost_batches + r.counts.cost_batches,
            restarts: t.restarts + r.counts.restarts,
            repeated_costs: t.repeated_costs,
        })
    }
}

impl VirtualRelay {
    /// Relay `r` of `tier` over `clients` clients: its engine samples from its own clients as
    /// `engine` says the server would from all of them (`min_available` and `min_fit` in
    /// proportion) and closes a little before the root's deadline, so that its partial can make
    /// it; a relay that restarts keeps a store.
    fn new(
        tier: &RelayTier,
        r: usize,
        clients: usize,
        engine: &EngineConfig,
        method: &MethodConfig,
        seed: u64,
    ) -> anyhow::Result<Self> {
        let held = (r..clients).step_by(tier.count).count();
        let share = |n: usize| (n * held).div_ceil(clients).max(1);
        let config = EngineConfig {
            min_available: share(engine.min_available),
            min_fit: share(engine.min_fit),
            round_deadline: engine.round_deadline.mul_f64(0.9),
            ..engine.clone()
        };
        let relay = Engine::relay(config.clone(), method, None)
            .map_err(|why| anyhow::anyhow!("[relays]: a relay cannot carry `{}`: {why}", method.name()))?;
        let mut profile = tier.link.profile();
        for o in tier.outages.iter().filter(|o| o.relay == r) {
            let outage = Outage { start_ms: o.start_ms, duration_ms: o.duration_ms, every_ms: None };
            profile.up.outages.push(outage);
            profile.down.outages.push(outage);
        }
        let link_seed = seed.wrapping_add(0x7E1A_0000 + r as u64);
        let id = format!("relay-{r}");
        let uplink = UplinkSession::new(anchorage_server::relay::hello(&id, method.name(), None), None);
        let disk = tier.restarts.iter().any(|x| x.relay == r).then(|| RelayDisk::new(&id, &relay)).transpose()?;
        Ok(Self {
            id,
            engine: relay,
            config,
            uplink,
            counts: UplinkCounts::default(),
            up: Path::new(profile.up, link_seed),
            down: Path::new(profile.down, link_seed ^ 0x5EED),
            conn: 0,
            disk,
            down_until: None,
        })
    }

    /// Carries out what the uplink asks at `now`: the engine opens the parent's rounds, folds
    /// again and ends with the parent; returns the messages that go up the link, in order.
    pub(super) fn carry_out(&mut self, now: Duration) -> Vec<Message> {
        let mut up = Vec::new();
        while let Some(action) = self.uplink.poll_action() {
            match action {
                UplinkAction::Send(msg) => {
                    if matches!(msg, Message::CostBatch(_)) {
                        self.counts.cost_batches += 1;
                    }
                    up.push(msg);
                }
                UplinkAction::SendPartial(p) => up.push(Message::Partial(p)),
                UplinkAction::OpenRound(b) => self.engine.handle_parent_round(now, b),
                UplinkAction::Refold(devices) => {
                    let again = self.engine.refold_without(&devices);
                    self.counts.refolded += u64::from(again.is_some());
                    self.uplink.refolded(again);
                }
                UplinkAction::Verdict(verdict) => self.engine.handle_parent_verdict(verdict),
                UplinkAction::Counted(outcome) => match outcome {
                    "sent" => self.counts.sent += 1,
                    "acked" => self.counts.acked += 1,
                    _ => self.counts.refused += 1,
                },
                UplinkAction::Finished(reason) => self.engine.handle_parent_goodbye(&reason),
                UplinkAction::Refused(why) => tracing::error!(relay = %self.id, %why, "the root refused the relay"),
                UplinkAction::Joined => {}
            }
        }
        up
    }

    /// A record the relay's ledger took: its store keeps it, and its uplink owes it to the root.
    pub(super) fn cost(&mut self, now: Duration, record: CostRecord) -> anyhow::Result<()> {
        if let Some(disk) = &self.disk {
            disk.append(&record)?;
        }
        self.uplink.cost(now, record);
        Ok(())
    }

    /// One of the engine's state changes: a relay that keeps a store commits it there first.
    pub(super) fn persist(&self, persist: &Persist) -> anyhow::Result<()> {
        match &self.disk {
            Some(disk) => disk.commit(persist),
            None => Ok(()),
        }
    }
}
