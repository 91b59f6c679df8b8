//! A relay's process restart on the virtual clock (`[relays] restarts`): its store is the
//! server's own ([`ServerStore`], in a temporary folder), written as `anchorage-relay`'s shell
//! writes it (every `Persist` and ledger row as it happens), and at the restart the relay's
//! engine and uplink session are dropped and built again from it, as the relay program starts.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anchorage_server::engine::{Engine, Persist};
use anchorage_server::relay::session::{UplinkSession, owed_after_restart};
use anchorage_server::store::ServerStore;
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::method::MethodConfig;
use anyhow::Context;

use super::events::Event;
use super::quic::{FAILOVER_DELAY, RESTART_RECONNECT};
use super::run::VirtualRun;
use super::tier::VirtualRelay;
use crate::setup::client_id;

/// Tells the runs' stores apart within a process.
static STORES: AtomicU64 = AtomicU64::new(0);

/// A relay's state folder, removed when the run ends.
pub(super) struct RelayDisk {
    dir: PathBuf,
    store: Option<ServerStore>,
}

impl RelayDisk {
    /// A fresh state folder for relay `id`, holding `engine`'s initial checkpoint (as a relay's
    /// first start saves it).
    pub(super) fn new(id: &str, engine: &Engine) -> anyhow::Result<Self> {
        let n = STORES.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("anchorage-sim-{}-{n}-{id}", std::process::id()));
        // A folder left by an earlier process of the same id would be recovered from.
        let _ = std::fs::remove_dir_all(&dir);
        let store = ServerStore::open(&dir).with_context(|| format!("a relay's store in {}", dir.display()))?;
        store.save_initial(&engine.checkpoint())?;
        Ok(Self { dir, store: Some(store) })
    }

    fn store(&self) -> anyhow::Result<&ServerStore> {
        self.store.as_ref().context("a relay's store is closed")
    }

    /// Commits one of the engine's state changes, before anything queued after it happens.
    pub(super) fn commit(&self, persist: &Persist) -> anyhow::Result<()> {
        Ok(self.store()?.commit(persist)?)
    }

    /// Appends a record to the relay's ledger (a record it holds is ignored).
    pub(super) fn append(&self, record: &CostRecord) -> anyhow::Result<()> {
        self.store()?.append_ledger(std::slice::from_ref(record))?;
        Ok(())
    }

    /// The process ends and starts again: the store is closed (its lock let go) and opened anew.
    fn reopen(&mut self) -> anyhow::Result<&ServerStore> {
        self.store = None;
        let store = ServerStore::open(&self.dir).with_context(|| format!("reopening {}", self.dir.display()))?;
        Ok(self.store.insert(store))
    }
}

impl Drop for RelayDisk {
    fn drop(&mut self) {
        self.store = None;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl VirtualRelay {
    /// The relay's process restarts at `now`: its engine continues from what its store recovers
    /// (the last checkpoint and its partial, the round open at the crash with the updates it had
    /// accepted, the recent invitations) and a new uplink session owes the store's last partial
    /// and the ledger's recent records, then connects at once.
    pub(super) fn restart(&mut self, now: Duration, method: &MethodConfig) -> anyhow::Result<()> {
        let disk = self.disk.as_mut().context("a relay restarts without a store")?;
        let store = disk.reopen()?;
        let recovered = store.recover(method.name())?;
        self.engine = Engine::relay(self.config.clone(), method, recovered)
            .map_err(|why| anyhow::anyhow!("a restarted relay cannot carry `{}`: {why}", method.name()))?;
        let last_round = Some(self.engine.last_round()).filter(|r| *r > 0);
        let hello = anchorage_server::relay::hello(&self.id, method.name(), last_round);
        self.uplink = UplinkSession::new(hello, self.engine.last_partial());
        for record in owed_after_restart(self.engine.last_round(), store.load_ledger()?) {
            self.uplink.cost(now, record);
        }
        tracing::info!(relay = %self.id, round = self.engine.last_round(), "the relay's process restarts");
        self.conn += 1;
        self.counts.restarts += 1;
        self.uplink.connected(now);
        Ok(())
    }
}

impl VirtualRun {
    /// Relay `r`'s process restarts ([`VirtualRelay::restart`]): what was in flight on its link
    /// is lost, the root sees its connection end and a new one begin, and its devices, whose
    /// connections ended with the process, reconnect after [`RESTART_RECONNECT`].
    pub(super) fn restart_relay(&mut self, r: usize) -> anyhow::Result<()> {
        let now = self.now;
        let Some(tier) = self.tier.as_mut() else { return Ok(()) };
        let id = tier.relays[r].id.clone();
        if let Some(watch) = self.watch.as_mut() {
            watch.seen.push(super::watch::Seen::RelayRestarted { relay: r });
        }
        self.engine.handle_disconnect(now, &id);
        self.engine.set_relay(&id, true);
        tier.relays[r].restart(now, &tier.method)?;
        let devices: Vec<usize> = (0..self.clients.len()).filter(|&c| tier.relay_of(c) == r).collect();
        for client in devices {
            self.reconnect_after(client, RESTART_RECONNECT);
        }
        self.drive_uplink(r);
        Ok(())
    }

    /// Relay `r`'s process dies and stays down for `down`: what it had queued and what was in
    /// flight on its link are lost, the root sees its connection end, and its devices, whose
    /// connections ended with it, fail over to the next relay that is up as they reconnect
    /// ([`super::tier::Tier::displace`]).
    pub(super) fn kill_relay(&mut self, r: usize, down: Duration) {
        let now = self.now;
        let Some(tier) = self.tier.as_mut() else { return };
        let relay = &mut tier.relays[r];
        tracing::info!(relay = %relay.id, down_s = down.as_secs_f64(), "the relay's process dies");
        relay.down_until = Some(now + down);
        relay.conn += 1;
        while relay.engine.poll_action().is_some() {}
        let id = relay.id.clone();
        let devices: Vec<usize> = (0..self.clients.len()).filter(|&c| tier.relay_of(c) == r).collect();
        if let Some(watch) = self.watch.as_mut() {
            watch.seen.push(super::watch::Seen::RelayDown { relay: r });
        }
        self.engine.handle_disconnect(now, &id);
        for client in devices {
            self.reconnect_after(client, RESTART_RECONNECT);
        }
        self.queue.push(now + down, Event::RelayUp { relay: r });
    }

    /// Relay `r`'s process starts again after being down ([`VirtualRelay::restart`]); the devices
    /// that failed over meanwhile go back to it once they are at rest.
    pub(super) fn relay_up(&mut self, r: usize) -> anyhow::Result<()> {
        let Some(tier) = self.tier.as_mut() else { return Ok(()) };
        tier.relays[r].down_until = None;
        let away = tier.displaced_from(r);
        self.restart_relay(r)?;
        for client in away {
            self.go_home_at_rest(client);
        }
        Ok(())
    }

    /// `client`, on another relay while its own was down, goes back to its own once that is up
    /// and the device holds nothing unacked (as the device's `home_after` does, at 0 s).
    pub(super) fn go_home_at_rest(&mut self, client: usize) {
        let now = self.now;
        let Some(tier) = self.tier.as_mut() else { return };
        let on = tier.relay_of(client);
        let c = &self.clients[client];
        if c.online && c.session.at_rest() && tier.goes_home(client) {
            tier.relays[on].engine.handle_disconnect(now, &client_id(client));
            self.reconnect_after(client, FAILOVER_DELAY);
        }
    }
}
