//! Whether this device should train now: the `[eligibility]` table of client.toml,
//! what the device reads of itself, and the decision.
//!
//! [`Readings::read`] reads, under a [`SysRoot`] (`/` on a device, a fake tree in tests):
//!
//! - power supplies: `sys/class/power_supply/*/{type,online,capacity,status,scope,present}`
//!   (Jetson boards show USB-C ports as `ucsi-source-psy-*`, laptops `AC`/`ADP1` and `BAT0`; a
//!   Raspberry Pi shows none);
//! - thermal zones: `sys/class/thermal/thermal_zone*/{type,temp}` (millidegrees Celsius);
//! - the 1-minute load average: the first field of `proc/loadavg`;
//! - the CPU count: `sys/devices/system/cpu/online` (`0-3`, `0,2-5`), else
//!   [`std::thread::available_parallelism`];
//! - the CPU clock: `sys/devices/system/cpu/cpu*/cpufreq/{scaling_cur_freq,cpuinfo_max_freq}`;
//! - the IPv4 default route's interface: `proc/net/route` (and `sys/class/net/<if>/uevent` to
//!   tell a WWAN modem by its `DEVTYPE=wwan`). IPv6 routes are not read.
//!
//! Every reading is an `Option`: a file that is missing, or that cannot be read (a Jetson sensor
//! whose block is powered off answers its read with an error), is "not available", never an
//! error. A value that is there but wrong (`capacity` 250, a temperature `hot`, garbage in
//! `loadavg`) is refused: the reading stays `None`, a `tracing::warn!` names the file and the
//! value, and the same text is kept in [`Readings::errors`] (its length is the count of refused
//! values; nothing global is counted). No file content makes the reading panic.
//!
//! [`decide`] applies an [`Eligibility`] to [`Readings`]. A criterion whose reading is not
//! available passes (a desktop or a Raspberry Pi has no battery, a container may see no thermal
//! zone, a device with no IPv4 default route is not known to be metered). An empty table turns
//! every criterion off: the device is always eligible, and [`check_now`] reads nothing.

use std::fmt;

use std::str::FromStr;
use std::time::SystemTime;

use anchorage_shared::ledger::{CostRecord, DeclineReason, MAX_POWER_MODE_LEN};
use serde::{Deserialize, Serialize};

/// The `[eligibility]` table of client.toml: when this device may train. Every key is optional;
/// none set means always eligible.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Eligibility {
    /// Train only on external power (see [`Readings::external_power`]) or with the system
    /// battery at or above this percentage (see [`Readings::battery_percent`]). No battery: passes.
    pub min_battery_percent: Option<u8>,
    /// Train only while the hottest thermal zone is below this, in °C (`PMIC*` zones excluded:
    /// see [`ThermalZone::counted`]). No thermal zone: passes.
    pub max_temperature_c: Option<f32>,
    /// Do not train while the IPv4 default route goes through a metered (cellular) interface:
    /// see [`is_metered_interface`]. No default route known: passes.
    pub unmetered_only: bool,
    /// Train only within this daily window of UTC time, `"HH:MM-HH:MM"` (start included, end
    /// excluded; `"22:00-06:00"` wraps past midnight; `"24:00"` may end a window). Unset: all day.
    pub window: Option<Window>,
    /// Train only while the 1-minute load average per CPU (`/proc/loadavg` over the online CPUs)
    /// is below this (e.g. 0.5: at most half the CPUs busy). Unknown load: passes.
    pub max_load: Option<f32>,
}

impl Eligibility {
    /// Whether any criterion is set (an empty table: always eligible).
    pub fn is_enabled(&self) -> bool {
        let Self { min_battery_percent, max_temperature_c, unmetered_only, window, max_load } = self;
        min_battery_percent.is_some()
            || max_temperature_c.is_some()
            || *unmetered_only
            || window.is_some()
            || max_load.is_some()
    }

    /// What parsing cannot check: a percentage within 0–100, finite limits, a positive load.
    pub fn validate(&self) -> anyhow::Result<()> {
        if let Some(p) = self.min_battery_percent {
            anyhow::ensure!(p <= 100, "eligibility.min_battery_percent = {p} is not a percentage (0-100)");
        }
        if let Some(t) = self.max_temperature_c {
            anyhow::ensure!(t.is_finite(), "eligibility.max_temperature_c = {t} is not a temperature");
        }
        if let Some(l) = self.max_load {
            anyhow::ensure!(
                l.is_finite() && l > 0.0,
                "eligibility.max_load = {l} must be above 0 (the 1-minute load average per CPU)"
            );
        }
        Ok(())
    }

    /// The criteria set, in words (`min_battery_percent = 20, window = 22:00-06:00 UTC`).
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(p) = self.min_battery_percent {
            parts.push(format!("min_battery_percent = {p}"));
        }
        if let Some(t) = self.max_temperature_c {
            parts.push(format!("max_temperature_c = {t}"));
        }
        if self.unmetered_only {
            parts.push("unmetered_only".into());
        }
        if let Some(w) = self.window {
            parts.push(format!("window = {w} UTC"));
        }
        if let Some(l) = self.max_load {
            parts.push(format!("max_load = {l}"));
        }
        parts.join(", ")
    }
}

/// A daily window of UTC time, minutes after midnight: `start` included, `end` excluded. In
/// client.toml a string `"HH:MM-HH:MM"`; `start > end` wraps past midnight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Window {
    /// 0..1440.
    pub start: u16,
    /// 1..=1440 (1440: `24:00`), never equal to `start`.
    pub end: u16,
}

impl Window {
    /// Whether `minute` (after midnight UTC; taken modulo 1440) is inside the window.
    pub fn contains(&self, minute: u32) -> bool {
        let m = minute % 1440;
        let (start, end) = (u32::from(self.start), u32::from(self.end));
        if start < end { start <= m && m < end } else { m >= start || m < end }
    }
}

impl FromStr for Window {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("window {s:?}: {why} (expected \"HH:MM-HH:MM\" in UTC, e.g. \"22:00-06:00\")");
        let (a, b) = s.split_once('-').ok_or_else(|| bad("no `-` between start and end"))?;
        let minutes = |t: &str, is_end: bool| -> Result<u16, String> {
            let (h, m) = t.trim().split_once(':').ok_or_else(|| bad("a time needs `:`"))?;
            let digits = |x: &str, n: std::ops::RangeInclusive<usize>| {
                n.contains(&x.len()) && x.bytes().all(|c| c.is_ascii_digit())
            };
            if !digits(h, 1..=2) || !digits(m, 2..=2) {
                return Err(bad("hours and minutes are digits, HH:MM"));
            }
            let (h, m): (u16, u16) = (h.parse().map_err(|_| bad("hours"))?, m.parse().map_err(|_| bad("minutes"))?);
            match (h, m) {
                (24, 0) if is_end => Ok(1440),
                (0..=23, 0..=59) => Ok(h * 60 + m),
                _ => Err(bad("a time is 00:00 to 23:59 (24:00 only as the end)")),
            }
        };
        let (start, end) = (minutes(a, false)?, minutes(b, true)?);
        if start == end {
            return Err(bad("start and end are the same; leave `window` out to train all day"));
        }
        Ok(Self { start, end })
    }
}

impl TryFrom<String> for Window {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<Window> for String {
    fn from(w: Window) -> String {
        w.to_string()
    }
}

impl fmt::Display for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hm = |m: u16| format!("{:02}:{:02}", m / 60, m % 60);
        write!(f, "{}-{}", hm(self.start), hm(self.end))
    }
}

/// Minutes after midnight UTC at `now` (for [`decide`]).
pub fn utc_minutes(now: SystemTime) -> u32 {
    let secs = now.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    ((secs / 60) % 1440) as u32
}

/// Why a device declines to train now. [`Decline::reason`] is the stable short name.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Decline {
    #[error("battery at {percent}% and not on external power (min_battery_percent = {min})")]
    Battery { percent: u8, min: u8 },
    #[error("thermal zone {zone} at {celsius:.1} °C (max_temperature_c = {max})")]
    Thermal { celsius: f32, zone: String, max: f32 },
    #[error("the default route goes through {interface}, a metered (cellular) link (unmetered_only)")]
    Metered { interface: String },
    #[error("outside the training window {window} UTC")]
    OutsideWindow { window: Window },
    #[error("1-minute load {load:.2} per CPU (max_load = {max})")]
    Busy { load: f32, max: f32 },
}

impl Decline {
    /// The reason as the protocol's `Decline` message and the server's ledger carry it.
    pub fn kind(&self) -> DeclineReason {
        match self {
            Decline::Battery { .. } => DeclineReason::Battery,
            Decline::Thermal { .. } => DeclineReason::Thermal,
            Decline::Metered { .. } => DeclineReason::Metered,
            Decline::OutsideWindow { .. } => DeclineReason::Window,
            Decline::Busy { .. } => DeclineReason::Busy,
        }
    }

    /// A stable short name for metrics and the protocol: `battery`, `thermal`, `metered`,
    /// `window` or `busy` ([`DeclineReason::name`]).
    pub fn reason(&self) -> &'static str {
        self.kind().name()
    }
}

/// Writes the device's condition into a round's cost record: the hottest counted
/// thermal zone, whether the CPU is throttled, the battery, the power source and a Jetson's
/// power mode, each where the device reads it (values a record may not carry are left out).
pub fn fill_condition(record: &mut CostRecord, readings: &Readings) {
    record.temperature_c = readings.hottest().map(|(_, c)| c).filter(|c| (-60.0..=200.0).contains(c));
    record.throttled = readings.throttled();
    record.battery_percent = readings.battery_percent().filter(|p| *p <= 100);
    record.external_power = readings.external_power();
    record.power_mode = readings.power_mode.clone().filter(|m| m.len() <= MAX_POWER_MODE_LEN);
    record.readings_refused = Some(u32::try_from(readings.errors.len()).unwrap_or(u32::MAX));
}

/// Applies `config` to `readings` at `now_utc_minutes` (minutes after midnight UTC, see
/// [`utc_minutes`]): the first criterion that fails, in the order battery, thermal, metered,
/// window, busy. A criterion whose reading is not available passes.
pub fn decide(config: &Eligibility, readings: &Readings, now_utc_minutes: u32) -> Result<(), Decline> {
    if let (Some(min), Some(percent)) = (config.min_battery_percent, readings.battery_percent())
        && percent < min
        && readings.external_power() != Some(true)
    {
        return Err(Decline::Battery { percent, min });
    }
    if let (Some(max), Some((zone, celsius))) = (config.max_temperature_c, readings.hottest())
        && celsius >= max
    {
        return Err(Decline::Thermal { celsius, zone: zone.label().to_string(), max });
    }
    if config.unmetered_only
        && let Some(route) = &readings.default_route
        && route.metered
    {
        return Err(Decline::Metered { interface: route.interface.clone() });
    }
    if let Some(window) = config.window
        && !window.contains(now_utc_minutes)
    {
        return Err(Decline::OutsideWindow { window });
    }
    if let (Some(max), Some(load)) = (config.max_load, readings.load_per_cpu())
        && load >= max
    {
        return Err(Decline::Busy { load, max });
    }
    Ok(())
}

/// [`decide`] on this machine now: reads `root` only when a criterion is set.
pub fn check_now(config: &Eligibility, root: &SysRoot) -> Result<(), Decline> {
    if !config.is_enabled() {
        return Ok(());
    }
    decide(config, &Readings::read(root), utc_minutes(SystemTime::now()))
}

mod readings;
#[cfg(test)]
mod tests;

#[cfg(test)]
pub(crate) use readings::fake;
pub use readings::{DefaultRoute, PowerSupply, Readings, SysRoot, ThermalZone, is_metered_interface};
