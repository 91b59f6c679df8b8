//! A relay tier on the virtual clock (issue 37, item 5; `[relays]`): what a tier does to round
//! time and bytes before one is built. Each relay is the server's own sans-IO engine in its relay
//! role ([`Engine::relay`]), the same code as `anchorage-relay`; client i joins relay i mod R. The
//! root takes the relays as its participants; what passes between a relay and the root (the
//! broadcast down, the partial aggregate up) is charged to the relay's own link, whose outages
//! hold it back.

use std::time::Duration;

use anchorage_server::engine::{Engine, EngineConfig};
use anchorage_shared::method::MethodConfig;

use super::Path;
use crate::config::RelayTier;
use crate::network::Outage;

/// One relay: its engine and its link to the root.
pub(super) struct VirtualRelay {
    pub(super) id: String,
    pub(super) engine: Engine,
    /// Towards the root, and from it.
    pub(super) up: Path,
    pub(super) down: Path,
}

/// The tier: the relays, in order.
pub(super) struct Tier {
    pub(super) relays: Vec<VirtualRelay>,
}

impl Tier {
    /// The relays of `tier` over `clients` clients, and the root's engine config: the relays are
    /// its participants (every one each round, weighted by what it holds, no weight cap); each
    /// relay samples from its own clients as `engine` says the server would from all of them
    /// (`min_available` and `min_fit` in proportion), and closes a little before the root's
    /// deadline so that its partial can make it.
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
        let mut relays = Vec::with_capacity(tier.count);
        for r in 0..tier.count {
            let held = (r..clients).step_by(tier.count).count();
            let share = |n: usize| (n * held).div_ceil(clients).max(1);
            let config = EngineConfig {
                min_available: share(engine.min_available),
                min_fit: share(engine.min_fit),
                round_deadline: engine.round_deadline.mul_f64(0.9),
                ..engine.clone()
            };
            let relay = Engine::relay(config, method, None)
                .map_err(|why| anyhow::anyhow!("[relays]: a relay cannot carry `{}`: {why}", method.name()))?;
            let mut profile = tier.link.profile();
            for o in tier.outages.iter().filter(|o| o.relay == r) {
                let outage = Outage { start_ms: o.start_ms, duration_ms: o.duration_ms, every_ms: None };
                profile.up.outages.push(outage);
                profile.down.outages.push(outage);
            }
            let link_seed = seed.wrapping_add(0x7E1A_0000 + r as u64);
            relays.push(VirtualRelay {
                id: format!("relay-{r}"),
                engine: relay,
                up: Path::new(profile.up, link_seed),
                down: Path::new(profile.down, link_seed ^ 0x5EED),
            });
        }
        let mut robust = engine.robust.clone();
        robust.weight_cap = None;
        let root = EngineConfig {
            min_available: tier.count,
            min_fit: tier.count,
            fraction: 1.0,
            over_selection: 0.0,
            robust,
            ..engine.clone()
        };
        Ok((Self { relays }, root))
    }

    /// The relay client `client` joins.
    pub(super) fn relay_of(&self, client: usize) -> usize {
        client % self.relays.len()
    }

    /// The relay named `id`, if one is.
    pub(super) fn index_of(&self, id: &str) -> Option<usize> {
        self.relays.iter().position(|r| r.id == id)
    }

    /// Every relay says hello to the root, as a relay certificate would let it.
    pub(super) fn join(&self, root: &mut Engine, method: &str) {
        for relay in &self.relays {
            root.set_relay(&relay.id, true);
            root.handle_message(Duration::ZERO, &relay.id, anchorage_server::relay::hello(&relay.id, method, None));
        }
    }

    /// When the earliest relay engine needs its timeout.
    pub(super) fn poll_timeout(&self) -> Option<Duration> {
        self.relays.iter().filter_map(|r| r.engine.poll_timeout()).min()
    }
}
