//! What the device reads of itself under a [`SysRoot`] (see the module docs of `eligibility`).

use std::io::Read;
use std::path::{Path, PathBuf};

/// The directory the readings' paths are taken under: `/` on a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SysRoot(PathBuf);

impl Default for SysRoot {
    fn default() -> Self {
        Self(PathBuf::from("/"))
    }
}

impl SysRoot {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self(root.into())
    }

    /// `rel` (such as `proc/loadavg`) under the root.
    pub fn path(&self, rel: impl AsRef<Path>) -> PathBuf {
        self.0.join(rel)
    }
}

/// One `/sys/class/power_supply/*` entry.
#[derive(Debug, Clone, PartialEq)]
pub struct PowerSupply {
    /// Its folder's name (`AC`, `BAT0`, `ucsi-source-psy-USBC000:001`).
    pub name: String,
    /// `type`: `Mains`, `USB`, `Battery`, `UPS`, `Wireless`, …
    pub kind: Option<String>,
    /// `online` (external supplies): above 0 is online (USB-C says 2 for a programmable supply).
    pub online: Option<bool>,
    /// `capacity` (batteries), percent.
    pub capacity: Option<u8>,
    /// `status` (batteries): `Charging`, `Discharging`, `Not charging`, `Full`, `Unknown`.
    pub status: Option<String>,
    /// `scope`: `Device` for a peripheral's battery (a wireless mouse), not the system's.
    pub scope: Option<String>,
    /// `present` (batteries): 0 for an empty battery bay.
    pub present: Option<bool>,
}

impl PowerSupply {
    /// A battery of this system (not a peripheral's, and not an empty bay).
    pub fn is_system_battery(&self) -> bool {
        self.kind.as_deref() == Some("Battery")
            && !self.scope.as_deref().is_some_and(|s| s.eq_ignore_ascii_case("device"))
            && self.present != Some(false)
    }

    /// An external supply (anything but a battery: `Mains`, `USB`, …).
    pub fn is_external(&self) -> bool {
        self.kind.as_deref().is_some_and(|k| k != "Battery")
    }
}

/// One `/sys/class/thermal/thermal_zone*`.
#[derive(Debug, Clone, PartialEq)]
pub struct ThermalZone {
    /// Its folder's name (`thermal_zone0`).
    pub zone: String,
    /// `type`: `CPU-therm`, `cpu-thermal`, `x86_pkg_temp`, …
    pub kind: Option<String>,
    /// `temp`, in °C; `None` when it could not be read (a sensor that is off).
    pub celsius: Option<f32>,
}

impl ThermalZone {
    /// Its type, else its folder's name.
    pub fn label(&self) -> &str {
        self.kind.as_deref().unwrap_or(&self.zone)
    }

    /// Whether it counts for the hottest zone: a `PMIC*` zone does not (on Jetson TX1/TX2/Xavier
    /// `PMIC-Die` is a trip point that reads a fixed 100 °C).
    pub fn counted(&self) -> bool {
        !self.kind.as_deref().is_some_and(|k| k.to_ascii_uppercase().starts_with("PMIC"))
    }
}

/// The IPv4 default route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DefaultRoute {
    pub interface: String,
    /// See [`is_metered_interface`], or `DEVTYPE=wwan` in the interface's `uevent`.
    pub metered: bool,
}

/// Whether an interface's name marks a cellular (metered) link: it starts with `wwan`, `wwp`
/// (systemd's predictable name for a WWAN modem), `rmnet` (Qualcomm modems), `usb` (USB
/// tethering, RNDIS/CDC) or `ppp` (dial-up and older modems). Everything else (`eth0`, `wlan0`,
/// `enp3s0`, `mlan0`) counts as unmetered: a Wi-Fi hotspot on a phone is not recognised.
pub fn is_metered_interface(name: &str) -> bool {
    ["wwan", "wwp", "rmnet", "usb", "ppp"].iter().any(|p| name.starts_with(p))
}

/// What this device reads of itself; see the module's documentation for the files.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Readings {
    /// Sorted by name.
    pub power_supplies: Vec<PowerSupply>,
    /// Sorted by zone number.
    pub thermal_zones: Vec<ThermalZone>,
    /// The 1-minute load average.
    pub load_1m: Option<f32>,
    /// Online CPUs (or the parallelism this process may use).
    pub cpus: Option<u32>,
    /// The CPUs' current clock over their maximum, summed over the CPUs that report both
    /// (below 1 when idle under an on-demand governor, or throttled).
    pub freq_ratio: Option<f32>,
    /// The fastest CPU's current clock over its maximum: below [`THROTTLED_BELOW`] even the
    /// busiest core is held back (thermal or power capping).
    pub top_freq_ratio: Option<f32>,
    /// A Jetson's power mode, from `var/lib/nvpmodel/status` (`pmode:0002` reads `nvpmodel 2`).
    pub power_mode: Option<String>,
    pub default_route: Option<DefaultRoute>,
    /// The values refused, one line each: the file, the value, why.
    pub errors: Vec<String>,
}

impl Readings {
    /// Reads everything under `root`; never fails (see the module's documentation).
    pub fn read(root: &SysRoot) -> Self {
        let mut r = Reader { errors: Vec::new() };
        let power_supplies = r.power_supplies(root);
        let thermal_zones = r.thermal_zones(root);
        let load_1m = r.loadavg(root);
        let cpus = r.cpus(root);
        let (freq_ratio, top_freq_ratio) = r.freq_ratios(root).unzip();
        let power_mode = r.power_mode(root);
        let default_route = r.default_route(root);
        Self {
            power_supplies,
            thermal_zones,
            load_1m,
            cpus,
            freq_ratio,
            top_freq_ratio,
            power_mode,
            default_route,
            errors: r.errors,
        }
    }

    /// Whether the device runs on external power: `Some(true)` when an external supply is online
    /// or a system battery is `Charging`/`Not charging`; `Some(false)` when the external supplies
    /// are offline or a battery is `Discharging`, and nothing says online; `None` when nothing
    /// tells (no supplies, or only `Full`/`Unknown` batteries).
    pub fn external_power(&self) -> Option<bool> {
        let external = self.power_supplies.iter().filter(|p| p.is_external()).filter_map(|p| p.online);
        let charging =
            self.power_supplies.iter().filter(|p| p.is_system_battery()).filter_map(|p| match p.status.as_deref()? {
                "Charging" | "Not charging" => Some(true),
                "Discharging" => Some(false),
                _ => None, // `Full` and `Unknown` say nothing about the supply
            });
        external.chain(charging).reduce(|a, b| a || b)
    }

    /// The system batteries' mean `capacity` (a peripheral's battery excluded); `None` without one.
    pub fn battery_percent(&self) -> Option<u8> {
        let capacities: Vec<u32> = self
            .power_supplies
            .iter()
            .filter(|p| p.is_system_battery())
            .filter_map(|p| p.capacity.map(u32::from))
            .collect();
        let n = u32::try_from(capacities.len()).ok().filter(|&n| n > 0)?;
        u8::try_from(capacities.iter().sum::<u32>() / n).ok()
    }

    /// The hottest counted zone ([`ThermalZone::counted`]) and its temperature.
    pub fn hottest(&self) -> Option<(&ThermalZone, f32)> {
        self.thermal_zones
            .iter()
            .filter(|z| z.counted())
            .filter_map(|z| z.celsius.map(|c| (z, c)))
            .reduce(|a, b| if b.1 > a.1 { b } else { a })
    }

    /// Whether the CPU is held below its clock: the fastest core under [`THROTTLED_BELOW`] of its
    /// maximum. Read right after training, when at least one core was busy.
    pub fn throttled(&self) -> Option<bool> {
        self.top_freq_ratio.map(|r| r < THROTTLED_BELOW)
    }

    /// The 1-minute load average over the CPU count.
    pub fn load_per_cpu(&self) -> Option<f32> {
        let cpus = self.cpus.filter(|&c| c > 0)?;
        Some(self.load_1m? / cpus as f32)
    }
}

/// The fastest core's clock ratio under which the CPU counts as throttled.
pub(super) const THROTTLED_BELOW: f32 = 0.9;

/// Most a sysfs attribute is read of; more is garbage anyway.
const ATTRIBUTE_BYTES: u64 = 4096;
/// Most of `/proc/net/route` that is read (a router's table can be long).
const ROUTE_BYTES: u64 = 1 << 20;
/// Most folders of one kind read (thermal zones, supplies, CPUs).
const MAX_ENTRIES: usize = 4096;

/// Reads files, keeping what it refused.
struct Reader {
    errors: Vec<String>,
}

impl Reader {
    /// A file's text, trimmed; `None` if it is missing or cannot be read.
    fn text(&self, path: &Path, limit: u64) -> Option<String> {
        let mut bytes = Vec::new();
        let read = std::fs::File::open(path).and_then(|f| f.take(limit).read_to_end(&mut bytes));
        match read {
            Ok(_) => Some(String::from_utf8_lossy(&bytes).trim().to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                tracing::debug!(file = %path.display(), error = %e, "not available");
                None
            }
        }
    }

    /// Keeps and logs a refused value.
    fn refuse(&mut self, path: &Path, value: &str, why: &str) {
        let shown: String = value.chars().take(40).collect();
        let shown = if shown.len() < value.len() { format!("{shown}…") } else { shown };
        tracing::warn!(file = %path.display(), value = ?shown, why, "refused a device reading");
        self.errors.push(format!("{}: {shown:?} refused: {why}", path.display()));
    }

    /// A file's value through `parse`, refused (with `why`) when `parse` says `None`.
    fn value<T>(&mut self, path: &Path, why: &str, parse: impl FnOnce(&str) -> Option<T>) -> Option<T> {
        let text = self.text(path, ATTRIBUTE_BYTES)?;
        let value = parse(&text);
        if value.is_none() {
            self.refuse(path, &text, why);
        }
        value
    }

    /// A short word (`type`, `status`, `scope`): printable, at most 64 characters.
    fn word(&mut self, path: &Path) -> Option<String> {
        self.value(path, "not a short printable name", |t| {
            (!t.is_empty() && t.len() <= 64 && t.chars().all(|c| !c.is_control())).then(|| t.to_string())
        })
    }

    /// The sorted names of `dir`'s entries that start with `prefix`.
    fn entries(&self, dir: &Path, prefix: &str) -> Vec<String> {
        let Ok(listing) = std::fs::read_dir(dir) else { return Vec::new() };
        let mut names: Vec<String> = listing
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with(prefix))
            .take(MAX_ENTRIES)
            .collect();
        names.sort_by(|a, b| natural_key(a).cmp(&natural_key(b)));
        names
    }

    fn power_supplies(&mut self, root: &SysRoot) -> Vec<PowerSupply> {
        let dir = root.path("sys/class/power_supply");
        let names = self.entries(&dir, "");
        names
            .into_iter()
            .map(|name| {
                let at = dir.join(&name);
                PowerSupply {
                    kind: self.word(&at.join("type")),
                    online: self.value(&at.join("online"), "not 0 or a positive number", |t| {
                        t.parse::<u32>().ok().map(|n| n > 0)
                    }),
                    capacity: self.value(&at.join("capacity"), "not a percentage (0-100)", |t| {
                        t.parse::<u8>().ok().filter(|&p| p <= 100)
                    }),
                    status: self.word(&at.join("status")),
                    scope: self.word(&at.join("scope")),
                    present: self
                        .value(&at.join("present"), "not 0 or 1", |t| matches!(t, "0" | "1").then_some(t == "1")),
                    name,
                }
            })
            .collect()
    }

    fn thermal_zones(&mut self, root: &SysRoot) -> Vec<ThermalZone> {
        let dir = root.path("sys/class/thermal");
        let names = self.entries(&dir, "thermal_zone");
        names
            .into_iter()
            .map(|zone| {
                let at = dir.join(&zone);
                ThermalZone {
                    kind: self.word(&at.join("type")),
                    celsius: self.value(&at.join("temp"), "not a temperature in millidegrees (-60 to 200 °C)", |t| {
                        t.parse::<i64>().ok().filter(|m| (-60_000..=200_000).contains(m)).map(|m| m as f32 / 1000.0)
                    }),
                    zone,
                }
            })
            .collect()
    }

    fn loadavg(&mut self, root: &SysRoot) -> Option<f32> {
        self.value(&root.path("proc/loadavg"), "the first field is not a load average", |t| {
            t.split_whitespace().next()?.parse::<f32>().ok().filter(|l| l.is_finite() && *l >= 0.0)
        })
    }

    fn cpus(&mut self, root: &SysRoot) -> Option<u32> {
        let online =
            self.value(&root.path("sys/devices/system/cpu/online"), "not a CPU list such as 0-3 or 0,2-5", cpu_count);
        online.or_else(|| std::thread::available_parallelism().ok().and_then(|n| u32::try_from(n.get()).ok()))
    }

    /// The CPUs' summed clock ratio, and the fastest one's.
    fn freq_ratios(&mut self, root: &SysRoot) -> Option<(f32, f32)> {
        let dir = root.path("sys/devices/system/cpu");
        let (mut cur_sum, mut max_sum, mut top) = (0u64, 0u64, 0f64);
        for cpu in self.entries(&dir, "cpu") {
            if !cpu[3..].bytes().all(|c| c.is_ascii_digit()) || cpu.len() == 3 {
                continue; // cpufreq, cpuidle, …
            }
            let at = dir.join(&cpu).join("cpufreq");
            let khz = |t: &str| t.parse::<u64>().ok().filter(|&k| k > 0 && k < 1 << 40);
            let why = "not a frequency in kHz";
            let Some(cur) = self.value(&at.join("scaling_cur_freq"), why, khz) else { continue };
            let Some(max) = self.value(&at.join("cpuinfo_max_freq"), why, khz) else { continue };
            cur_sum += cur;
            max_sum += max;
            top = top.max(cur as f64 / max as f64);
        }
        (max_sum > 0).then(|| ((cur_sum as f64 / max_sum as f64) as f32, top as f32))
    }

    /// `pmode:NNNN` in nvpmodel's status file, as `nvpmodel N`; anything else is refused.
    fn power_mode(&mut self, root: &SysRoot) -> Option<String> {
        let path = root.path("var/lib/nvpmodel/status");
        let mode = |t: &str| {
            let digits = t.split_whitespace().find_map(|f| f.strip_prefix("pmode:"))?;
            digits.parse::<u16>().ok().map(|n| format!("nvpmodel {n}"))
        };
        self.value(&path, "not an nvpmodel status (pmode:NNNN)", mode)
    }

    fn default_route(&mut self, root: &SysRoot) -> Option<DefaultRoute> {
        let path = root.path("proc/net/route");
        let text = self.text(&path, ROUTE_BYTES)?;
        let mut best: Option<(u32, String)> = None;
        let mut refused = None;
        for line in text.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.is_empty() || fields[0] == "Iface" {
                continue;
            }
            match route_line(&fields) {
                Some(Some((metric, iface))) => {
                    if best.as_ref().is_none_or(|(m, _)| metric < *m) {
                        best = Some((metric, iface.to_string()));
                    }
                }
                Some(None) => {}
                None => {
                    refused.get_or_insert(line);
                }
            }
        }
        if let Some(line) = refused {
            let line = line.to_string();
            self.refuse(&path, &line, "not a route line (Iface, hex Destination, Gateway, Flags, …, Metric, Mask)");
        }
        let (_, interface) = best?;
        let wwan = self
            .text(&root.path("sys/class/net").join(&interface).join("uevent"), ATTRIBUTE_BYTES)
            .is_some_and(|u| u.lines().any(|l| l.trim() == "DEVTYPE=wwan"));
        Some(DefaultRoute { metered: wwan || is_metered_interface(&interface), interface })
    }
}

/// One line of `/proc/net/route`: `None` if it is not one, `Some(None)` if it is not an up default
/// route, else its metric and interface.
fn route_line<'a>(fields: &[&'a str]) -> Option<Option<(u32, &'a str)>> {
    let [iface, destination, _gateway, flags, _refcnt, _use, metric, mask, ..] = fields else { return None };
    let hex = |s: &str| u32::from_str_radix(s, 16).ok();
    let (destination, flags, mask) = (hex(destination)?, hex(flags)?, hex(mask)?);
    let metric: u32 = metric.parse().ok()?;
    let name_ok = iface.len() <= 15 && !iface.contains('/') && *iface != "." && *iface != "..";
    if !name_ok {
        return None;
    }
    const RTF_UP: u32 = 1;
    Some((destination == 0 && mask == 0 && flags & RTF_UP != 0).then_some((metric, *iface)))
}

/// The count of a CPU list (`0-3` → 4, `0,2-5` → 5); `None` if it is not one.
pub(super) fn cpu_count(list: &str) -> Option<u32> {
    let mut count = 0u32;
    for part in list.split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (u32, u32) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
        if a > b || b >= 1 << 20 {
            return None;
        }
        count = count.checked_add(b - a + 1)?;
    }
    (count > 0 && count <= 1 << 20).then_some(count)
}

/// Sorts `thermal_zone10` after `thermal_zone9`: the name without its trailing digits, then them.
fn natural_key(name: &str) -> (&str, u64, &str) {
    let stem = name.trim_end_matches(|c: char| c.is_ascii_digit());
    (stem, name[stem.len()..].parse().unwrap_or(0), name)
}

#[cfg(test)]
pub(crate) mod fake {
    //! Fake `/sys` and `/proc` trees for tests.

    use std::path::Path;

    /// Writes each `(path, content)` under `root`, making folders as needed.
    pub(crate) fn write(root: &Path, files: &[(&str, &str)]) {
        for (path, content) in files {
            let path = root.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, content).unwrap();
        }
    }

    /// A Jetson Orin Nano on JetPack 5 (L4T r35): its thermal zones (CV0-therm's block is off,
    /// its `temp` cannot be read), a USB-C port (UCSI) with nothing plugged in, six cores at
    /// about half clock, Ethernet.
    pub(crate) fn jetson_orin(root: &Path) {
        let zones = [
            ("CPU-therm", "47500"),
            ("GPU-therm", "45218"),
            ("CV0-therm", ""),
            ("CV1-therm", ""),
            ("SOC0-therm", "44937"),
            ("SOC1-therm", "45093"),
            ("SOC2-therm", "44468"),
            ("tj-therm", "47656"),
        ];
        for (i, (kind, temp)) in zones.iter().enumerate() {
            let zone = format!("sys/class/thermal/thermal_zone{i}");
            write(root, &[(&format!("{zone}/type"), &format!("{kind}\n"))]);
            if temp.is_empty() {
                // A folder where the file is: reading it fails, as an unpowered sensor's does.
                std::fs::create_dir_all(root.join(&zone).join("temp")).unwrap();
            } else {
                write(root, &[(&format!("{zone}/temp"), &format!("{temp}\n"))]);
            }
        }
        write(root, &[("sys/class/thermal/cooling_device0/type", "pwm-fan\n")]);
        let psy = "sys/class/power_supply/ucsi-source-psy-USBC000:001";
        write(root, &[(&format!("{psy}/type"), "USB\n"), (&format!("{psy}/online"), "0\n")]);
        write(root, &[("sys/devices/system/cpu/online", "0-5\n"), ("proc/loadavg", "1.20 0.95 0.80 2/731 4242\n")]);
        for cpu in 0..6 {
            let at = format!("sys/devices/system/cpu/cpu{cpu}/cpufreq");
            write(
                root,
                &[(&format!("{at}/scaling_cur_freq"), "729600\n"), (&format!("{at}/cpuinfo_max_freq"), "1510400\n")],
            );
        }
        write(
            root,
            &[(
                "proc/net/route",
                "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT \n\
             eth0\t00000000\t0100A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0 \n\
             eth0\t0000A8C0\t00000000\t0001\t0\t0\t100\t00FFFFFF\t0\t0\t0 \n\
             docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0 \n",
            )],
        );
    }

    /// A Raspberry Pi 4: one `cpu-thermal` zone, no power supply class at all, four cores, Wi-Fi.
    pub(crate) fn raspberry_pi(root: &Path) {
        write(
            root,
            &[
                ("sys/class/thermal/thermal_zone0/type", "cpu-thermal\n"),
                ("sys/class/thermal/thermal_zone0/temp", "52634\n"),
                ("sys/devices/system/cpu/online", "0-3\n"),
                ("sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq", "1500000\n"),
                ("sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq", "1500000\n"),
                ("proc/loadavg", "0.08 0.12 0.10 1/180 999\n"),
                (
                    "proc/net/route",
                    "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                 wlan0\t00000000\t0101A8C0\t0003\t0\t0\t303\t00000000\t0\t0\t0\n",
                ),
            ],
        );
    }

    /// A laptop on battery: AC offline, BAT0 at 15 % discharging, a wireless mouse's battery at 5 %.
    pub(crate) fn laptop(root: &Path) {
        write(
            root,
            &[
                ("sys/class/power_supply/AC/type", "Mains\n"),
                ("sys/class/power_supply/AC/online", "0\n"),
                ("sys/class/power_supply/BAT0/type", "Battery\n"),
                ("sys/class/power_supply/BAT0/present", "1\n"),
                ("sys/class/power_supply/BAT0/capacity", "15\n"),
                ("sys/class/power_supply/BAT0/status", "Discharging\n"),
                ("sys/class/power_supply/hidpp_battery_0/type", "Battery\n"),
                ("sys/class/power_supply/hidpp_battery_0/scope", "Device\n"),
                ("sys/class/power_supply/hidpp_battery_0/capacity", "5\n"),
                ("sys/class/power_supply/hidpp_battery_0/status", "Discharging\n"),
                ("sys/class/thermal/thermal_zone0/type", "acpitz\n"),
                ("sys/class/thermal/thermal_zone0/temp", "41000\n"),
                ("sys/class/thermal/thermal_zone1/type", "x86_pkg_temp\n"),
                ("sys/class/thermal/thermal_zone1/temp", "58000\n"),
                ("sys/devices/system/cpu/online", "0-7\n"),
                ("proc/loadavg", "0.40 0.30 0.20 1/900 12345\n"),
            ],
        );
    }
}
