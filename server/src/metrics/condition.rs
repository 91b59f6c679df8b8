//! What devices report of themselves: the rounds they declined, by reason, and the
//! condition their cost records carry (temperature, throttling, battery, power source), as
//! fleet-wide distributions and counts. No series per device: a fleet of thousands would make
//! thousands of them.

use anchorage_shared::ledger::{CostRecord, DeclineReason};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

/// Bucket bounds of device temperatures, in °C (a Jetson throttles near 97 °C, a Raspberry Pi
/// from 80 °C).
const CELSIUS_BUCKETS: [f64; 9] = [30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 85.0, 90.0, 95.0];
/// Bucket bounds of battery charge, as a fraction of full.
const CHARGE_BUCKETS: [f64; 6] = [0.1, 0.2, 0.4, 0.6, 0.8, 1.0];

/// The conditions a round's record can report, as `anchorage_client_condition_rounds` labels.
const CONDITIONS: [&str; 3] = ["throttled", "on_battery", "external_power"];

type Label = [(&'static str, &'static str); 1];

/// Declines and device conditions. Cheap to clone: every metric is shared.
#[derive(Debug, Clone)]
pub struct ConditionMetrics {
    declines: Family<Label, Counter>,
    temperature: Histogram,
    battery: Histogram,
    rounds: Family<Label, Counter>,
    readings_refused: Counter,
}

impl Default for ConditionMetrics {
    fn default() -> Self {
        Self {
            declines: Family::default(),
            temperature: Histogram::new(CELSIUS_BUCKETS),
            battery: Histogram::new(CHARGE_BUCKETS),
            rounds: Family::default(),
            readings_refused: Counter::default(),
        }
    }
}

impl ConditionMetrics {
    /// Registers every metric under `r`, each label already at zero (a dashboard shows 0, not
    /// "no data", before the first decline).
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "declines",
            "Invited devices that declined to train, by reason (client.toml [eligibility]): battery, thermal, \
             metered, window, busy. A decline is not a drop: another device is invited in its place.",
            self.declines.clone(),
        );
        r.register(
            "client_temperature_celsius",
            "The hottest thermal zone devices reported at the end of their rounds.",
            self.temperature.clone(),
        );
        r.register_with_unit(
            "client_battery_charge",
            "Battery charge devices reported at the end of their rounds, as a fraction of full (devices with a battery).",
            Unit::Other("ratio".into()),
            self.battery.clone(),
        );
        r.register_with_unit(
            "client_condition",
            "Device rounds by reported condition: throttled (CPU below its top clock), on_battery, external_power.",
            Unit::Other("rounds".into()),
            self.rounds.clone(),
        );
        r.register(
            "client_readings_refused",
            "Values devices refused to read of themselves (a sysfs or proc file holding garbage), as their cost records report them.",
            self.readings_refused.clone(),
        );
        for reason in DeclineReason::ALL {
            let _ = self.declines.get_or_create(&[("reason", reason.name())]);
        }
        for condition in CONDITIONS {
            let _ = self.rounds.get_or_create(&[("condition", condition)]);
        }
    }

    /// Adds what one ledger record says: a decline by its reason, or the condition it carries.
    pub fn record(&self, c: &CostRecord) {
        if let Some(reason) = c.declined {
            self.declines.get_or_create(&[("reason", reason.name())]).inc();
        }
        if let Some(t) = c.temperature_c.filter(|t| t.is_finite()) {
            self.temperature.observe(f64::from(t));
        }
        if let Some(n) = c.readings_refused {
            self.readings_refused.inc_by(u64::from(n));
        }
        if let Some(p) = c.battery_percent {
            self.battery.observe(f64::from(p) / 100.0);
        }
        let conditions = [
            ("throttled", c.throttled == Some(true)),
            ("on_battery", c.external_power == Some(false)),
            ("external_power", c.external_power == Some(true)),
        ];
        for (condition, holds) in conditions {
            if holds {
                self.rounds.get_or_create(&[("condition", condition)]).inc();
            }
        }
    }
}
