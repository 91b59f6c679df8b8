//! A simulated device's battery and temperature on the virtual clock, and the
//! `[eligibility]` it applies to them: the same decision a real device takes on its sysfs
//! readings ([`anchorage_client::eligibility::decide`]), on readings this model makes.
//!
//! - **Battery**: drains `compute_watts` (the profile's) while training and `idle_watts`
//!   otherwise; charges at `charge_watts` inside its daily `charging` window (minutes of the
//!   simulated day, which starts at 00:00 UTC). Charge is kept between 0 and the capacity.
//! - **Temperature**: first-order (Newton's law of cooling): it moves toward `load_c` while
//!   training and toward `ambient_c` otherwise, T(t + dt) = T∞ + (T(t) − T∞)·e^(−dt/τ). A training
//!   that starts at or above `throttle_c` runs `throttle_slowdown` times longer (DVFS), and its
//!   round is recorded as throttled.
//!
//! State changes only when the clock reaches the device ([`Power::advance`]), in steps of at most
//! a minute, so a week costs about 10,000 steps per device whatever the number of events.

use std::collections::BTreeMap;
use std::time::Duration;

use anchorage_client::eligibility::{
    Decline, DefaultRoute, Eligibility, PowerSupply, Readings, ThermalZone, Window, decide,
};
use anchorage_shared::ledger::CostRecord;
use anyhow::Context;
use serde::{Deserialize, Serialize};

/// A device's battery (`[[systems.devices]] battery = { ... }`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BatteryModel {
    /// Capacity in watt-hours.
    pub capacity_wh: f64,
    /// Charge at the start of the run, percent.
    pub start_percent: f64,
    /// Drawn while not training, in watts (screen, radio idle, the OS).
    pub idle_watts: f64,
    /// Charging power while on the charger, in watts.
    pub charge_watts: f64,
    /// Daily window of the simulated day when the device is on its charger (`"22:00-06:00"`);
    /// none: never charged during the run.
    pub charging: Option<Window>,
}

impl Default for BatteryModel {
    /// A phone: 15 Wh, full at the start, 0.5 W idle, charged at 10 W overnight.
    fn default() -> Self {
        Self {
            capacity_wh: 15.0,
            start_percent: 100.0,
            idle_watts: 0.5,
            charge_watts: 10.0,
            charging: "22:00-06:00".parse().ok(),
        }
    }
}

/// A device's heating under load (`[[systems.devices]] thermal = { ... }`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ThermalModel {
    /// Temperature when idle, °C.
    pub ambient_c: f64,
    /// Temperature the device settles at under sustained training, °C.
    pub load_c: f64,
    /// Time constant of heating and cooling, seconds.
    pub tau_seconds: f64,
    /// Trainings that start at or above this run throttled, °C.
    pub throttle_c: f64,
    /// How much longer a throttled training takes (2.0: twice as long).
    pub throttle_slowdown: f64,
}

impl Default for ThermalModel {
    /// A passively cooled board: 40 °C idle, 90 °C under load, τ = 5 min, throttled from 80 °C
    /// at half speed.
    fn default() -> Self {
        Self { ambient_c: 40.0, load_c: 90.0, tau_seconds: 300.0, throttle_c: 80.0, throttle_slowdown: 2.0 }
    }
}

impl BatteryModel {
    /// What parsing cannot check.
    pub fn validate(&self) -> anyhow::Result<()> {
        let finite = [self.capacity_wh, self.start_percent, self.idle_watts, self.charge_watts];
        anyhow::ensure!(finite.iter().all(|v| v.is_finite() && *v >= 0.0), "battery: every figure is finite and >= 0");
        anyhow::ensure!(self.capacity_wh > 0.0, "battery.capacity_wh must be above 0");
        anyhow::ensure!(self.start_percent <= 100.0, "battery.start_percent is a percentage");
        Ok(())
    }
}

impl ThermalModel {
    /// What parsing cannot check.
    pub fn validate(&self) -> anyhow::Result<()> {
        let all = [self.ambient_c, self.load_c, self.tau_seconds, self.throttle_c, self.throttle_slowdown];
        anyhow::ensure!(all.iter().all(|v| v.is_finite()), "thermal: every figure is finite");
        anyhow::ensure!(self.tau_seconds > 0.0, "thermal.tau_seconds must be above 0");
        anyhow::ensure!(self.throttle_slowdown >= 1.0, "thermal.throttle_slowdown is at least 1");
        Ok(())
    }
}

/// Longest step of the integration.
const STEP: Duration = Duration::from_secs(60);

/// One device's battery and temperature, and its eligibility. A device with neither model and
/// an empty `[eligibility]` is always eligible and never throttled, and costs nothing.
#[derive(Debug, Clone)]
pub struct Power {
    eligibility: Eligibility,
    compute_watts: f64,
    battery: Option<(BatteryModel, f64)>,
    thermal: Option<(ThermalModel, f64)>,
    /// The clock this state is at.
    at: Duration,
    /// Training until then.
    busy_until: Duration,
    /// The device's link is cellular (its default route is metered).
    metered: bool,
    /// Rounds whose training ran throttled.
    throttled: BTreeMap<u64, bool>,
}

impl Power {
    pub fn new(
        eligibility: Eligibility,
        compute_watts: f64,
        battery: Option<BatteryModel>,
        thermal: Option<ThermalModel>,
    ) -> Self {
        let battery = battery.map(|b| {
            let joules = b.capacity_wh * 3600.0 * b.start_percent.clamp(0.0, 100.0) / 100.0;
            (b, joules)
        });
        let thermal = thermal.map(|t| {
            let ambient = t.ambient_c;
            (t, ambient)
        });
        Self {
            eligibility,
            compute_watts,
            battery,
            thermal,
            at: Duration::ZERO,
            busy_until: Duration::ZERO,
            metered: false,
            throttled: BTreeMap::new(),
        }
    }

    /// The device reaches the server over a metered (cellular) link.
    pub fn on_metered_link(mut self, metered: bool) -> Self {
        self.metered = metered;
        self
    }

    /// The model of a device profile, its figures checked.
    pub fn of(profile: &crate::device::DeviceProfile) -> anyhow::Result<Self> {
        let what = || format!("device profile `{}`", profile.name);
        if let Some(b) = &profile.battery {
            b.validate().with_context(what)?;
        }
        if let Some(t) = &profile.thermal {
            t.validate().with_context(what)?;
        }
        profile.eligibility.validate().with_context(what)?;
        Ok(Self::new(
            profile.eligibility.clone(),
            profile.compute_watts,
            profile.battery.clone(),
            profile.thermal.clone(),
        ))
    }

    /// Whether there is anything to model (else every call is a no-op).
    fn modelled(&self) -> bool {
        self.battery.is_some() || self.thermal.is_some() || self.eligibility.is_enabled()
    }

    /// Brings charge and temperature to `now`.
    pub fn advance(&mut self, now: Duration) {
        if self.battery.is_none() && self.thermal.is_none() {
            self.at = self.at.max(now);
            return;
        }
        while self.at < now {
            let busy = self.at < self.busy_until;
            let mut next = (self.at + STEP).min(now);
            if busy {
                next = next.min(self.busy_until);
            }
            let dt = (next - self.at).as_secs_f64();
            let charging = self.charging_at(self.at);
            if let Some((b, joules)) = &mut self.battery {
                let draw = if busy { self.compute_watts } else { b.idle_watts };
                let gain = if charging { b.charge_watts } else { 0.0 };
                *joules = (*joules + (gain - draw) * dt).clamp(0.0, b.capacity_wh * 3600.0);
            }
            if let Some((t, celsius)) = &mut self.thermal {
                let target = if busy { t.load_c } else { t.ambient_c };
                *celsius = target + (*celsius - target) * (-dt / t.tau_seconds).exp();
            }
            self.at = next;
        }
    }

    /// Whether the device is on its charger at `t` (minutes of the simulated day).
    fn charging_at(&self, t: Duration) -> bool {
        let Some((b, _)) = &self.battery else { return false };
        b.charging.is_some_and(|w| w.contains(minute_of_day(t)))
    }

    /// What the device would read of itself now: its battery as a system battery (charging or
    /// not), its temperature as one thermal zone, its link as the default route (`wwan0` when
    /// metered, `wlan0` else).
    fn readings(&self) -> Readings {
        let mut r = Readings::default();
        let interface = if self.metered { "wwan0" } else { "wlan0" };
        r.default_route = Some(DefaultRoute { interface: interface.into(), metered: self.metered });
        if let Some((b, joules)) = &self.battery {
            let percent = (100.0 * joules / (b.capacity_wh * 3600.0)).round().clamp(0.0, 100.0) as u8;
            let status = if self.charging_at(self.at) { "Charging" } else { "Discharging" };
            r.power_supplies.push(PowerSupply {
                name: "BAT0".into(),
                kind: Some("Battery".into()),
                online: None,
                capacity: Some(percent),
                status: Some(status.into()),
                scope: None,
                present: Some(true),
            });
        }
        if let Some((_, celsius)) = &self.thermal {
            r.thermal_zones.push(ThermalZone {
                zone: "thermal_zone0".into(),
                kind: Some("soc-thermal".into()),
                celsius: Some(*celsius as f32),
            });
        }
        r
    }

    /// Whether the device may train at `now` by its `[eligibility]`.
    pub fn decide(&mut self, now: Duration) -> Result<(), Decline> {
        if !self.modelled() {
            return Ok(());
        }
        self.advance(now);
        decide(&self.eligibility, &self.readings(), minute_of_day(now))
    }

    /// A training for `round` starts at `started` and takes `compute` at full speed: it takes
    /// longer if the device is throttled now (recorded for the round); the device draws compute
    /// power and heats until it ends. Returns the time it takes.
    pub fn train(&mut self, started: Duration, round: u64, compute: Duration) -> Duration {
        if !self.modelled() {
            return compute;
        }
        self.advance(started);
        let throttled = self.thermal.as_ref().is_some_and(|(t, c)| *c >= t.throttle_c);
        let slowdown = match (&self.thermal, throttled) {
            (Some((t, _)), true) => t.throttle_slowdown,
            _ => 1.0,
        };
        let compute = compute.mul_f64(slowdown);
        self.busy_until = started + compute;
        self.throttled.insert(round, throttled);
        while self.throttled.len() > 64 {
            self.throttled.pop_first();
        }
        compute
    }

    /// Writes the device's condition at `now` into `record` (its round's throttling, the
    /// temperature, the battery and whether it charges), as a real device's would carry it.
    pub fn fill(&mut self, now: Duration, record: &mut CostRecord) {
        if self.battery.is_none() && self.thermal.is_none() {
            return;
        }
        self.advance(now);
        let readings = self.readings();
        record.temperature_c = readings.hottest().map(|(_, c)| c);
        record.battery_percent = readings.battery_percent();
        record.external_power = readings.external_power();
        record.throttled = self.throttled.get(&record.round).copied().or(self.thermal.as_ref().map(|_| false));
    }
}

/// Minutes after midnight of the simulated day (the run starts at 00:00 UTC).
pub fn minute_of_day(t: Duration) -> u32 {
    ((t.as_secs() / 60) % 1440) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hours(h: f64) -> Duration {
        Duration::from_secs_f64(h * 3600.0)
    }

    #[test]
    fn a_battery_drains_while_training_and_charges_in_its_window() {
        let battery = BatteryModel { capacity_wh: 10.0, start_percent: 50.0, idle_watts: 0.0, ..Default::default() };
        let eligibility: Eligibility = toml::from_str("min_battery_percent = 30").unwrap();
        let mut p = Power::new(eligibility, 5.0, Some(battery), None);
        assert!(p.decide(hours(13.0)).is_ok(), "50 % at 13:00");
        // Two hours of training at 5 W: 10 Wh, the whole battery (clamped at 0).
        assert_eq!(p.train(hours(13.0), 1, hours(2.0)), hours(2.0));
        let declined = p.decide(hours(15.0)).unwrap_err();
        assert_eq!(declined.kind(), anchorage_shared::ledger::DeclineReason::Battery);
        let mut record = CostRecord { round: 1, ..CostRecord::default() };
        p.fill(hours(15.0), &mut record);
        assert_eq!((record.battery_percent, record.external_power), (Some(0), Some(false)));
        assert!(p.decide(hours(21.9)).is_err(), "still empty before its charging window");
        // On the charger from 22:00: external power, so it trains whatever the charge.
        assert!(p.decide(hours(22.1)).is_ok());
        p.fill(hours(23.0), &mut record);
        assert_eq!(record.external_power, Some(true), "charging counts as external power");
        assert_eq!(record.battery_percent, Some(100), "10 W for an hour refills 10 Wh");
    }

    #[test]
    fn sustained_training_heats_the_device_until_it_throttles_and_declines() {
        let eligibility: Eligibility = toml::from_str("max_temperature_c = 85").unwrap();
        let mut p = Power::new(eligibility, 10.0, None, Some(ThermalModel::default()));
        let minute = Duration::from_secs(60);
        // Back-to-back trainings of 5 minutes: the first runs at full speed.
        let mut now = Duration::ZERO;
        let mut rounds = Vec::new();
        for round in 1..=8 {
            if p.decide(now).is_err() {
                rounds.push((round, "declined"));
                now += 5 * minute;
                continue;
            }
            let took = p.train(now, round, 5 * minute);
            rounds.push((round, if took > 5 * minute { "throttled" } else { "full" }));
            now += took;
        }
        assert_eq!(rounds[0], (1, "full"));
        assert!(rounds.iter().any(|r| r.1 == "throttled"), "{rounds:?}");
        assert!(rounds.iter().any(|r| r.1 == "declined"), "{rounds:?}");
        let mut record =
            CostRecord { round: rounds.iter().find(|r| r.1 == "throttled").unwrap().0, ..Default::default() };
        p.fill(now, &mut record);
        assert_eq!(record.throttled, Some(true));
        // An idle hour cools it back to about ambient: eligible again.
        assert!(p.decide(now + 60 * minute).is_ok());
    }

    #[test]
    fn a_device_on_a_cellular_link_declines_when_unmetered_only() {
        let eligibility: Eligibility = toml::from_str("unmetered_only = true").unwrap();
        let mut cellular = Power::new(eligibility.clone(), 5.0, None, None).on_metered_link(true);
        let declined = cellular.decide(hours(1.0)).unwrap_err();
        assert_eq!(declined.kind(), anchorage_shared::ledger::DeclineReason::Metered);
        assert!(Power::new(eligibility, 5.0, None, None).decide(hours(1.0)).is_ok(), "Wi-Fi passes");
        let config: crate::config::SimConfig = toml::from_str(
            "clients = 10\n[[link_mix]]\npreset = \"wifi\"\nshare = 0.5\n[[link_mix]]\npreset = \"lte\"\nshare = 0.5\n",
        )
        .unwrap();
        let metered = config.metered_links();
        let links = config.links().unwrap();
        let lte = crate::network::LinkPreset::Lte.profile();
        for (m, l) in metered.iter().zip(&links) {
            assert_eq!(*m, l.as_ref() == Some(&lte), "metered exactly where the LTE preset was dealt");
        }
        assert_eq!(metered.iter().filter(|m| **m).count(), 5);
    }

    #[test]
    fn a_device_with_no_model_is_always_eligible_and_never_slowed() {
        let mut p = Power::new(Eligibility::default(), 10.0, None, None);
        assert!(p.decide(hours(100.0)).is_ok());
        assert_eq!(p.train(hours(100.0), 1, hours(1.0)), hours(1.0));
        let mut record = CostRecord::default();
        p.fill(hours(200.0), &mut record);
        assert_eq!(record, CostRecord::default(), "no condition invented");
    }

    /// The virtual clock end to end: hot boards decline while hot and run throttled otherwise;
    /// the declines are in the ledger, never as drops, and every round still aggregates.
    #[test]
    fn on_the_virtual_clock_hot_boards_decline_and_throttle() {
        use crate::config::{DataConfig, FederationConfig, SimConfig, SystemsConfig};
        use crate::device::DeviceProfile;
        use anchorage_shared::ledger::DeclineReason;
        // Trainings of 100 s (not the host's time: the run is the same on any machine) heat a
        // board from 40 toward 95 °C with a τ of 100 s: about 75 °C at the end, above the
        // eligibility limit of 70; after a round's rest it is near 53 °C, above the 45 °C from
        // which it throttles.
        let thermal = ThermalModel { load_c: 95.0, tau_seconds: 100.0, throttle_c: 45.0, ..Default::default() };
        let hot = DeviceProfile {
            name: "hot".into(),
            compute_seconds: Some(100.0),
            share: 1.0,
            thermal: Some(thermal),
            eligibility: toml::from_str("max_temperature_c = 70").unwrap(),
            ..Default::default()
        };
        let config = SimConfig {
            federation: FederationConfig {
                clients: 6,
                rounds: 8,
                seed: 5,
                local_epochs: 1,
                fraction: 0.5,
                // Long enough for a throttled board: a drop here would be the deadline's.
                round_deadline_secs: 3600.0,
                ..Default::default()
            },
            data: DataConfig { train_per_class: 20, test_per_class: 5, ..Default::default() },
            systems: SystemsConfig { devices: vec![hot], ..Default::default() },
            ..SimConfig::default()
        };
        let result = crate::virtual_clock::run_virtual(&config).unwrap();
        assert!(result.summary.rounds.iter().all(|r| r.outcome == "aggregated"), "{:?}", result.summary.rounds);
        let declined: Vec<_> = result.ledger.iter().filter(|r| r.declined.is_some()).collect();
        assert!(!declined.is_empty(), "a hot board declined at least once");
        assert!(declined.iter().all(|r| r.declined == Some(DeclineReason::Thermal) && !r.dropped));
        let dropped: Vec<_> = result.ledger.iter().filter(|r| r.dropped).collect();
        assert!(dropped.is_empty(), "a decline is not a drop: {dropped:?}");
        assert!(result.ledger.iter().any(|r| r.throttled == Some(true)), "a hot board ran throttled");
        for r in &result.reports {
            assert!(r.missing.is_empty(), "round {}: {:?}", r.round, r.missing);
        }
    }
}
