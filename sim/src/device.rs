//! Device profiles: how fast a simulated client computes, what it draws, and whether it straggles.
//!
//! Both clocks use [`SimulatedDevice`], a wrapper around a client's method: it applies FedEvolve's
//! straggler definition (with probability `straggler_ratio` a client runs a uniform random number
//! of local epochs in 1..τ instead of τ) and charges `compute_scale` × the host's measured compute
//! time — on the real clock by sleeping the difference, on the virtual clock by advancing
//! simulated time (the wrapper only reports the charged seconds).

use std::time::Instant;

use anchorage_client::methods::{ClientMethod, TrainError};
use anchorage_shared::protocol::{Broadcast, Metric, Update};
use anchorage_shared::rng::Rng;
use serde::{Deserialize, Serialize};

/// A kind of device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeviceProfile {
    pub name: String,
    /// Compute seconds on this device per second on the simulating host (2.0: twice as slow).
    pub compute_scale: f64,
    /// Power drawn while computing, in watts (energy estimate).
    pub compute_watts: f64,
    /// Power drawn by the radio while transferring, in watts.
    pub radio_watts: f64,
    /// Share of the fleet with this profile (weights need not sum to 1).
    pub share: f64,
    /// Virtual clock: chance that the device crashes when a round's broadcast reaches it (the
    /// round's work is lost; the process restarts from its store).
    pub crash_probability: f64,
    /// Seconds a crashed device stays away before it rejoins.
    pub rejoin_seconds: f64,
    /// Virtual clock: the device is reachable `on_seconds`, then away `off_seconds`, repeatedly,
    /// from a random phase (e.g. a board that sleeps or loses power on a schedule).
    pub on_off: Option<OnOff>,
}

/// An availability cycle.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OnOff {
    pub on_seconds: f64,
    pub off_seconds: f64,
}

impl Default for DeviceProfile {
    fn default() -> Self {
        Self {
            name: "host".into(),
            compute_scale: 1.0,
            compute_watts: 15.0,
            radio_watts: 1.0,
            share: 1.0,
            crash_probability: 0.0,
            rejoin_seconds: 30.0,
            on_off: None,
        }
    }
}

impl DeviceProfile {
    /// Named presets (rough figures relative to a desktop CPU core): `host`, `desktop`,
    /// `jetson-orin`, `jetson-nano`, `raspberry-pi-4`, `phone`.
    pub fn preset(name: &str) -> Option<Self> {
        let p = |compute_scale: f64, compute_watts: f64, radio_watts: f64| DeviceProfile {
            name: name.into(),
            compute_scale,
            compute_watts,
            radio_watts,
            ..DeviceProfile::default()
        };
        Some(match name {
            "host" => Self::default(),
            "desktop" => p(0.5, 65.0, 2.0),
            "jetson-orin" => p(1.0, 15.0, 1.5),
            "jetson-nano" => p(4.0, 10.0, 1.5),
            "raspberry-pi-4" => p(8.0, 6.0, 1.2),
            "phone" => p(3.0, 4.0, 1.0),
            _ => return None,
        })
    }

    /// Estimated joules of a round: compute at compute power, transfer at radio power.
    pub fn joules(&self, compute_seconds: f64, transfer_seconds: f64) -> f64 {
        compute_seconds * self.compute_watts + transfer_seconds * self.radio_watts
    }
}

/// Deals profiles to `clients` clients in proportion to their shares (largest remainder, then a
/// seeded shuffle so the kinds are spread over client ids).
pub fn assign(profiles: &[DeviceProfile], clients: usize, seed: u64) -> Vec<DeviceProfile> {
    if profiles.is_empty() {
        return vec![DeviceProfile::default(); clients];
    }
    let weighted: Vec<(DeviceProfile, f64)> = profiles.iter().map(|p| (p.clone(), p.share)).collect();
    deal_by_share(&weighted, clients, seed)
}

/// Deals `n` items in proportion to their shares (largest remainder), then shuffles them with
/// `seed` so the kinds are spread over client ids. Empty `items` give an empty list.
pub fn deal_by_share<T: Clone>(items: &[(T, f64)], n: usize, seed: u64) -> Vec<T> {
    if items.is_empty() {
        return Vec::new();
    }
    let total: f64 = items.iter().map(|(_, s)| s.max(0.0)).sum::<f64>().max(f64::MIN_POSITIVE);
    let exact: Vec<f64> = items.iter().map(|(_, s)| s.max(0.0) / total * n as f64).collect();
    let mut counts: Vec<usize> = exact.iter().map(|e| e.floor() as usize).collect();
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
    for &i in order.iter().cycle().take(n.saturating_sub(counts.iter().sum::<usize>())) {
        counts[i] += 1;
    }
    let mut out: Vec<T> =
        counts.iter().enumerate().flat_map(|(i, &k)| std::iter::repeat_n(items[i].0.clone(), k)).collect();
    Rng::new(seed).shuffle(&mut out);
    out
}

/// Whether the real clock sleeps to charge the device's slowness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Charge {
    /// Sleep for the extra time (real clock).
    Sleep,
    /// Only report it (virtual clock).
    Report,
}

/// A client's method on a simulated device. See the module docs.
pub struct SimulatedDevice<M> {
    inner: M,
    profile: DeviceProfile,
    straggler_ratio: f64,
    charge: Charge,
    rng: Rng,
    /// Local epochs the last round ran (τ, or fewer for a straggler).
    pub last_epochs: u32,
}

impl<M: ClientMethod> SimulatedDevice<M> {
    pub fn new(inner: M, profile: DeviceProfile, straggler_ratio: f64, charge: Charge, seed: u64) -> Self {
        Self { inner, profile, straggler_ratio, charge, rng: Rng::derive(seed, 0x57A6), last_epochs: 0 }
    }

    pub fn profile(&self) -> &DeviceProfile {
        &self.profile
    }
}

impl<M: ClientMethod> ClientMethod for SimulatedDevice<M> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn num_samples(&self) -> u64 {
        self.inner.num_samples()
    }

    fn train(&mut self, broadcast: &Broadcast) -> Result<Update, TrainError> {
        let tau = broadcast.config.local_epochs.max(1);
        let straggles = self.straggler_ratio > 0.0 && self.rng.f64() < self.straggler_ratio;
        let epochs = if straggles { 1 + self.rng.below(tau as u64) as u32 } else { tau };
        self.last_epochs = epochs;
        let started = Instant::now();
        let mut update = if epochs == tau {
            self.inner.train(broadcast)?
        } else {
            let mut b = broadcast.clone();
            b.config.local_epochs = epochs;
            self.inner.train(&b)?
        };
        let measured = started.elapsed();
        let charged = measured.mul_f64(self.profile.compute_scale.max(0.0));
        if self.charge == Charge::Sleep && charged > measured {
            std::thread::sleep(charged - measured);
        }
        update.compute_seconds = charged.as_secs_f64();
        update.metrics.push(Metric { name: "local_epochs".into(), value: epochs as f64 });
        update.metrics.push(Metric { name: "straggler".into(), value: if straggles { 1.0 } else { 0.0 } });
        Ok(update)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_are_dealt_exactly_and_seeded() {
        let profiles = vec![
            DeviceProfile { share: 0.5, ..DeviceProfile::preset("jetson-nano").unwrap() },
            DeviceProfile { share: 0.3, ..DeviceProfile::preset("raspberry-pi-4").unwrap() },
            DeviceProfile { share: 0.2, ..DeviceProfile::preset("desktop").unwrap() },
        ];
        let fleet = assign(&profiles, 10, 1);
        let count = |n: &str| fleet.iter().filter(|p| p.name == n).count();
        assert_eq!((count("jetson-nano"), count("raspberry-pi-4"), count("desktop")), (5, 3, 2));
        assert_eq!(fleet, assign(&profiles, 10, 1));
        assert_eq!(assign(&profiles, 7, 1).len(), 7);
        assert_eq!(assign(&[], 3, 1), vec![DeviceProfile::default(); 3]);
    }

    #[test]
    fn energy_is_power_times_time() {
        let p = DeviceProfile { compute_watts: 10.0, radio_watts: 2.0, ..DeviceProfile::default() };
        assert_eq!(p.joules(3.0, 5.0), 40.0);
    }
}

#[cfg(test)]
mod deal_tests {
    use super::*;

    #[test]
    fn a_link_mix_is_dealt_by_share() {
        let config = crate::SimConfig {
            clients: 10,
            link_mix: vec![
                crate::LinkShare { preset: "wifi".into(), share: 0.7 },
                crate::LinkShare { preset: "3g".into(), share: 0.3 },
            ],
            client_links: vec![crate::ClientLink { client: 0, profile: Default::default() }],
            ..Default::default()
        };
        let links = config.links().unwrap();
        assert_eq!(links.len(), 10);
        assert_eq!(links[0], Some(Default::default()), "an explicit client link wins");
        let slow = links.iter().filter(|l| l.as_ref().is_some_and(|p| p.up.bandwidth_bps == 0.5e6)).count();
        assert!((2..=3).contains(&slow), "30% of the fleet on 3g (one slot taken by the explicit link): {slow}");
        let bad = crate::SimConfig { link: Some("carrier-pigeon".into()), ..Default::default() };
        assert!(format!("{:#}", bad.links().unwrap_err()).contains("unknown link preset"));
        assert!(deal_by_share::<u8>(&[], 3, 1).is_empty());
    }
}
