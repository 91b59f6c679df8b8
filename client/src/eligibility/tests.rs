use super::readings::cpu_count;
use super::*;
use anchorage_shared::ledger::{CostRecord, DeclineReason};
use std::path::Path;

fn tree(build: fn(&Path)) -> (tempfile::TempDir, Readings) {
    let dir = tempfile::tempdir().unwrap();
    build(dir.path());
    let readings = Readings::read(&SysRoot::new(dir.path()));
    (dir, readings)
}

fn config(toml_text: &str) -> Eligibility {
    let config: Eligibility = toml::from_str(toml_text).unwrap();
    config.validate().unwrap();
    config
}

const NOON: u32 = 12 * 60;

#[test]
fn a_jetson_orin_reads_its_zones_clock_and_route() {
    let (_dir, r) = tree(fake::jetson_orin);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    let labels: Vec<&str> = r.thermal_zones.iter().map(|z| z.label()).collect();
    assert_eq!(labels[..3], ["CPU-therm", "GPU-therm", "CV0-therm"], "zones in order, cooling devices left out");
    assert_eq!(r.thermal_zones.len(), 8);
    assert_eq!(r.thermal_zones[2].celsius, None, "a sensor that cannot be read is not available");
    let (zone, celsius) = r.hottest().unwrap();
    assert_eq!((zone.label(), celsius), ("tj-therm", 47.656));
    assert_eq!(r.cpus, Some(6));
    assert_eq!(r.load_per_cpu(), Some(0.2));
    let ratio = r.freq_ratio.unwrap();
    assert!((ratio - 729_600.0 / 1_510_400.0).abs() < 1e-6, "{ratio}");
    assert_eq!(r.default_route, Some(DefaultRoute { interface: "eth0".into(), metered: false }));
    // A USB-C port with nothing plugged in, and no battery: the battery criterion passes.
    assert_eq!(r.power_supplies[0].online, Some(false));
    assert_eq!((r.external_power(), r.battery_percent()), (Some(false), None));
    let strict = config("min_battery_percent = 90\nunmetered_only = true\nmax_load = 0.5\nmax_temperature_c = 80");
    assert_eq!(decide(&strict, &r, NOON), Ok(()));
    let hot = config("max_temperature_c = 47.5");
    let declined = decide(&hot, &r, NOON).unwrap_err();
    assert_eq!(declined, Decline::Thermal { celsius: 47.656, zone: "tj-therm".into(), max: 47.5 });
    assert_eq!(declined.reason(), "thermal");
    assert_eq!(declined.to_string(), "thermal zone tj-therm at 47.7 °C (max_temperature_c = 47.5)");
}

#[test]
fn a_jetson_pmic_zone_at_a_fixed_100_c_is_listed_but_not_counted() {
    let dir = tempfile::tempdir().unwrap();
    fake::jetson_orin(dir.path());
    fake::write(
        dir.path(),
        &[
            ("sys/class/thermal/thermal_zone10/type", "PMIC-Die\n"),
            ("sys/class/thermal/thermal_zone10/temp", "100000\n"),
        ],
    );
    let r = Readings::read(&SysRoot::new(dir.path()));
    let last = r.thermal_zones.last().unwrap();
    assert_eq!((last.zone.as_str(), last.celsius), ("thermal_zone10", Some(100.0)), "sorted by number");
    assert!(!last.counted());
    assert_eq!(r.hottest().unwrap().0.label(), "tj-therm");
    assert_eq!(decide(&config("max_temperature_c = 80"), &r, NOON), Ok(()));
}

#[test]
fn a_raspberry_pi_has_one_zone_and_no_battery() {
    let (_dir, r) = tree(fake::raspberry_pi);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(r.power_supplies.is_empty());
    assert_eq!((r.external_power(), r.battery_percent()), (None, None));
    assert_eq!(r.hottest().map(|(z, c)| (z.label(), c)), Some(("cpu-thermal", 52.634)));
    assert_eq!((r.cpus, r.freq_ratio), (Some(4), Some(1.0)));
    assert_eq!(r.default_route.as_ref().map(|d| (d.interface.as_str(), d.metered)), Some(("wlan0", false)));
    let all = config("min_battery_percent = 50\nunmetered_only = true\nmax_load = 0.1\nmax_temperature_c = 60");
    assert_eq!(decide(&all, &r, NOON), Ok(()), "no battery: the battery criterion passes");
    assert_eq!(decide(&config("max_load = 0.02"), &r, NOON), Err(Decline::Busy { load: 0.02, max: 0.02 }));
    assert!(matches!(decide(&config("max_temperature_c = 50"), &r, NOON), Err(Decline::Thermal { .. })));
}

#[test]
fn a_laptop_at_15_percent_on_battery_declines_until_plugged_in() {
    let dir = tempfile::tempdir().unwrap();
    fake::laptop(dir.path());
    let root = SysRoot::new(dir.path());
    let r = Readings::read(&root);
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(r.battery_percent(), Some(15), "the mouse's battery (scope Device) does not count");
    assert_eq!(r.external_power(), Some(false));
    assert_eq!(r.hottest().unwrap().0.label(), "x86_pkg_temp");
    let twenty = config("min_battery_percent = 20");
    let declined = decide(&twenty, &r, NOON).unwrap_err();
    assert_eq!(declined, Decline::Battery { percent: 15, min: 20 });
    assert_eq!(declined.to_string(), "battery at 15% and not on external power (min_battery_percent = 20)");
    assert_eq!(decide(&config("min_battery_percent = 15"), &r, NOON), Ok(()), "at the minimum passes");
    // Plugged in: AC online.
    fake::write(dir.path(), &[("sys/class/power_supply/AC/online", "1\n")]);
    let plugged = Readings::read(&root);
    assert_eq!(plugged.external_power(), Some(true));
    assert_eq!(decide(&twenty, &plugged, NOON), Ok(()));
    // No AC entry, but the battery charges (a USB-C charger the kernel shows nowhere else).
    std::fs::remove_dir_all(dir.path().join("sys/class/power_supply/AC")).unwrap();
    fake::write(dir.path(), &[("sys/class/power_supply/BAT0/status", "Charging\n")]);
    assert_eq!(decide(&twenty, &Readings::read(&root), NOON), Ok(()));
    // An empty battery bay is no battery.
    fake::write(
        dir.path(),
        &[("sys/class/power_supply/BAT0/status", "Discharging\n"), ("sys/class/power_supply/BAT0/present", "0\n")],
    );
    assert_eq!(Readings::read(&root).battery_percent(), None);
}

#[test]
fn cellular_default_routes_are_metered() {
    let route = |lines: &str| {
        let dir = tempfile::tempdir().unwrap();
        let header = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n";
        fake::write(dir.path(), &[("proc/net/route", &format!("{header}{lines}"))]);
        fake::write(dir.path(), &[("sys/class/net/mhi_hwip0/uevent", "DEVTYPE=wwan\nINTERFACE=mhi_hwip0\n")]);
        Readings::read(&SysRoot::new(dir.path()))
    };
    let metered = config("unmetered_only = true");
    for iface in ["wwan0", "wwp0s20f0u6i12", "rmnet_data0", "usb0", "ppp0", "mhi_hwip0"] {
        let r = route(&format!("{iface}\t00000000\t0100000A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"));
        let declined = decide(&metered, &r, NOON).unwrap_err();
        assert_eq!(declined, Decline::Metered { interface: iface.into() });
        assert_eq!(declined.reason(), "metered");
    }
    // Two default routes: the lower metric wins (Ethernet at 100 over the modem's 700).
    let both = route(
        "wwan0\t00000000\t0100000A\t0003\t0\t0\t700\t00000000\t0\t0\t0\n\
         eth0\t00000000\t0100A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0\n",
    );
    assert_eq!(both.default_route.as_ref().unwrap().interface, "eth0");
    assert_eq!(decide(&metered, &both, NOON), Ok(()));
    // A default route that is down (no RTF_UP) is not the default route.
    let down = route("wwan0\t00000000\t0100000A\t0002\t0\t0\t0\t00000000\t0\t0\t0\n");
    assert_eq!(down.default_route, None);
    assert_eq!(decide(&metered, &down, NOON), Ok(()), "no route known: passes");
    assert_eq!(decide(&config(""), &route("wwan0\t00000000\t0\t0003\t0\t0\t0\t00000000\n"), NOON), Ok(()));
}

#[test]
fn windows_wrap_past_midnight() {
    let night: Window = "22:00-06:00".parse().unwrap();
    assert_eq!((night.start, night.end), (22 * 60, 6 * 60));
    let at = |h: u32, m: u32| h * 60 + m;
    for (minute, inside) in
        [(at(22, 0), true), (at(23, 59), true), (0, true), (at(5, 59), true), (at(6, 0), false), (at(21, 59), false)]
    {
        assert_eq!(night.contains(minute), inside, "{minute}");
    }
    assert!(night.contains(1440 + at(1, 0)), "minutes wrap modulo a day");
    let day: Window = "9:00-17:30".parse().unwrap();
    assert!(day.contains(at(9, 0)) && day.contains(at(17, 29)) && !day.contains(at(17, 30)) && !day.contains(0));
    let evening: Window = "18:00-24:00".parse().unwrap();
    assert!(evening.contains(at(23, 59)) && !evening.contains(0));
    assert_eq!(evening.to_string(), "18:00-24:00");
    for bad in ["25:00-01:00", "22:00", "10:00-10:00", "aa:bb-cc:dd", "22:60-01:00", "24:00-01:00", "22:0-06:00", ""] {
        assert!(bad.parse::<Window>().is_err(), "{bad}");
    }
    let err = "22:00-06".parse::<Window>().unwrap_err();
    assert!(err.contains("\"22:00-06\"") && err.contains("HH:MM-HH:MM"), "{err}");
    let c = config("window = \"22:00-06:00\"");
    let r = Readings::default();
    assert_eq!(decide(&c, &r, at(23, 0)), Ok(()));
    let declined = decide(&c, &r, NOON).unwrap_err();
    assert_eq!(
        (declined.reason(), declined.to_string().as_str()),
        ("window", "outside the training window 22:00-06:00 UTC")
    );
    assert!(toml::from_str::<Eligibility>("window = \"22-06\"").is_err(), "refused when client.toml is read");
    assert_eq!(toml::to_string(&c).unwrap().trim(), "unmetered_only = false\nwindow = \"22:00-06:00\"");
    let minutes = utc_minutes(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(86_400 * 3 + 3600 + 59));
    assert_eq!(minutes, 60);
}

#[test]
fn load_is_per_online_cpu() {
    let dir = tempfile::tempdir().unwrap();
    fake::write(
        dir.path(),
        &[("proc/loadavg", "3.20 2.00 1.00 5/300 100\n"), ("sys/devices/system/cpu/online", "0,2-5\n")],
    );
    let r = Readings::read(&SysRoot::new(dir.path()));
    assert_eq!((r.load_1m, r.cpus), (Some(3.2), Some(5)));
    let declined = decide(&config("max_load = 0.5"), &r, NOON).unwrap_err();
    assert_eq!(declined, Decline::Busy { load: 0.64, max: 0.5 });
    assert_eq!(declined.to_string(), "1-minute load 0.64 per CPU (max_load = 0.5)");
    assert_eq!(decide(&config("max_load = 0.65"), &r, NOON), Ok(()));
    assert_eq!(cpu_count("0"), Some(1));
    assert_eq!(cpu_count("0-3,8-11"), Some(8));
    assert_eq!(cpu_count("3-1"), None);
    assert_eq!(cpu_count(""), None);
}

#[test]
fn the_first_failing_criterion_declines_and_reasons_are_stable() {
    let (_dir, r) = tree(fake::laptop);
    let every = config(
        "min_battery_percent = 20\nmax_temperature_c = 50\nunmetered_only = true\nwindow = \"01:00-02:00\"\nmax_load = 0.01",
    );
    assert_eq!(decide(&every, &r, NOON).unwrap_err().reason(), "battery");
    let no_battery = Eligibility { min_battery_percent: None, ..every.clone() };
    assert_eq!(decide(&no_battery, &r, NOON).unwrap_err().reason(), "thermal");
    let cool = Eligibility { max_temperature_c: None, ..no_battery };
    assert_eq!(decide(&cool, &r, NOON).unwrap_err().reason(), "window", "a laptop without a route is not metered");
    let any_time = Eligibility { window: None, ..cool };
    assert_eq!(decide(&any_time, &r, NOON).unwrap_err().reason(), "busy");
    let reasons: Vec<DeclineReason> = [
        Decline::Battery { percent: 1, min: 2 },
        Decline::Thermal { celsius: 1.0, zone: "z".into(), max: 1.0 },
        Decline::Metered { interface: "wwan0".into() },
        Decline::OutsideWindow { window: "01:00-02:00".parse().unwrap() },
        Decline::Busy { load: 1.0, max: 1.0 },
    ]
    .iter()
    .map(Decline::kind)
    .collect();
    assert_eq!(reasons, DeclineReason::ALL, "one protocol reason each, in the order they are checked");
}

/// A round's cost record gets what the device reads of itself; nothing it cannot read, and an
/// nvpmodel status that does not parse is refused (not carried).
#[test]
fn the_condition_goes_into_the_cost_record_where_it_is_read() {
    let dir = tempfile::tempdir().unwrap();
    fake::jetson_orin(dir.path());
    fake::write(dir.path(), &[("var/lib/nvpmodel/status", "pmode:0002 fmode:quiet\n")]);
    let r = Readings::read(&SysRoot::new(dir.path()));
    let mut record = CostRecord::default();
    fill_condition(&mut record, &r);
    assert_eq!(record.temperature_c, Some(47.656));
    assert_eq!(record.power_mode.as_deref(), Some("nvpmodel 2"));
    assert_eq!(record.readings_refused, Some(0));
    assert_eq!((record.battery_percent, record.external_power), (None, Some(false)));
    // Every core of the fake Orin sits at 729.6 of 1510.4 MHz: throttled.
    assert_eq!(record.throttled, Some(true));
    fake::write(dir.path(), &[("var/lib/nvpmodel/status", "garbage\n")]);
    let r = Readings::read(&SysRoot::new(dir.path()));
    assert_eq!(r.power_mode, None);
    assert!(r.errors.iter().any(|e| e.contains("nvpmodel")), "{:?}", r.errors);
    fill_condition(&mut record, &r);
    assert_eq!((record.power_mode, record.readings_refused), (None, Some(1)), "refused, and counted for the server");
    let (_pi, pi) = tree(fake::raspberry_pi);
    let mut record = CostRecord::default();
    fill_condition(&mut record, &pi);
    assert_eq!((record.throttled, record.battery_percent, record.power_mode), (Some(false), None, None));
}

#[test]
fn an_empty_table_is_always_eligible_and_reads_nothing() {
    let off = config("");
    assert_eq!(off, Eligibility::default());
    assert!(!off.is_enabled());
    assert_eq!(off.describe(), "");
    let (_dir, worst) = tree(fake::laptop);
    assert_eq!(decide(&off, &worst, NOON), Ok(()));
    assert_eq!(check_now(&off, &SysRoot::new("/nonexistent/anchorage")), Ok(()));
    assert!(config("unmetered_only = true").is_enabled());
    assert!(toml::from_str::<Eligibility>("min_battery = 20").is_err(), "unknown keys are refused");
    let bad = |text: &str| toml::from_str::<Eligibility>(text).unwrap().validate().unwrap_err().to_string();
    assert!(bad("min_battery_percent = 120").contains("0-100"));
    assert!(bad("max_load = 0.0").contains("max_load"));
    assert!(bad("max_temperature_c = nan").contains("max_temperature_c"));
}

#[test]
fn a_missing_tree_means_nothing_is_available_and_everything_passes() {
    let dir = tempfile::tempdir().unwrap();
    let r = Readings::read(&SysRoot::new(dir.path()));
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert!(r.power_supplies.is_empty() && r.thermal_zones.is_empty());
    assert_eq!((r.load_1m, r.freq_ratio, r.default_route.as_ref()), (None, None, None));
    assert!(r.cpus.is_some_and(|n| n > 0), "falls back on available_parallelism");
    let all = config("min_battery_percent = 100\nmax_temperature_c = -50\nunmetered_only = true\nmax_load = 0.001");
    assert_eq!(decide(&all, &r, NOON), Ok(()));
}

#[test]
fn bad_values_are_refused_named_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    fake::laptop(dir.path());
    fake::write(
        dir.path(),
        &[
            ("sys/class/power_supply/BAT0/capacity", "250\n"),
            ("sys/class/power_supply/AC/online", "-1\n"),
            ("sys/class/thermal/thermal_zone0/temp", "hot\n"),
            ("sys/class/thermal/thermal_zone1/temp", "-273150\n"),
            ("proc/loadavg", "load: high\n"),
            ("sys/devices/system/cpu/online", "3-1\n"),
            ("proc/net/route", "Iface Destination\nwlan0 zzzzzzzz 0 0003 0 0 0 00000000\n"),
        ],
    );
    let r = Readings::read(&SysRoot::new(dir.path()));
    let battery = r.power_supplies.iter().find(|p| p.name == "BAT0").unwrap();
    assert_eq!(battery.capacity, None);
    assert_eq!(r.power_supplies[0].online, None);
    assert!(r.thermal_zones.iter().all(|z| z.celsius.is_none()));
    assert_eq!((r.load_1m, r.default_route.as_ref()), (None, None));
    assert!(r.cpus.is_some_and(|n| n > 0), "a bad CPU list falls back on available_parallelism");
    assert_eq!(r.errors.len(), 7, "{:#?}", r.errors);
    let find = |file: &str| r.errors.iter().find(|e| e.contains(file)).unwrap_or_else(|| panic!("{file}"));
    let capacity = find("BAT0/capacity");
    assert!(capacity.contains("\"250\"") && capacity.contains("0-100"), "{capacity}");
    assert!(find("AC/online").contains("\"-1\""));
    assert!(find("thermal_zone0/temp").contains("\"hot\""));
    assert!(find("thermal_zone1/temp").contains("-273150"));
    assert!(find("proc/loadavg").contains("load: high"));
    assert!(find("cpu/online").contains("\"3-1\""));
    assert!(find("proc/net/route").contains("zzzzzzzz"));
    // Decisions go on with what is left: nothing known, so every criterion passes.
    let all = config("min_battery_percent = 90\nmax_temperature_c = 10\nunmetered_only = true");
    assert_eq!(decide(&all, &r, NOON), Ok(()));
}

#[test]
fn garbage_in_any_file_never_panics() {
    let files = [
        "sys/class/power_supply/BAT0/type",
        "sys/class/power_supply/BAT0/online",
        "sys/class/power_supply/BAT0/capacity",
        "sys/class/power_supply/BAT0/status",
        "sys/class/power_supply/BAT0/scope",
        "sys/class/power_supply/BAT0/present",
        "sys/class/thermal/thermal_zone0/type",
        "sys/class/thermal/thermal_zone0/temp",
        "proc/loadavg",
        "sys/devices/system/cpu/online",
        "sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq",
        "sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq",
        "proc/net/route",
        "sys/class/net/eth0/uevent",
    ];
    let mut inputs: Vec<Vec<u8>> = [
        "",
        "\0\0\0",
        "-",
        "-0",
        "1e309",
        "NaN",
        "inf",
        "-inf",
        "0x10",
        "99999999999999999999999",
        "0-",
        "-3",
        "4294967295-4294967295",
        "0-4294967295",
        ",",
        "1,,2",
        "\u{202e}Battery",
        "eth0 00000000",
        "eth0\t00000000\t0\t0003\t0\t0\t99999999999\t00000000",
        "../../etc\t00000000\t0\t0003\t0\t0\t0\t00000000",
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    inputs.push(vec![0xff, 0xfe, 0x80, b'1']);
    inputs.push("9".repeat(100_000).into_bytes());
    let mut rng = anchorage_shared::rng::Rng::new(33);
    for _ in 0..30 {
        let len = rng.below(64) as usize;
        inputs.push((0..len).map(|_| rng.below(256) as u8).collect());
    }
    let dir = tempfile::tempdir().unwrap();
    let root = SysRoot::new(dir.path());
    let every = config("min_battery_percent = 50\nmax_temperature_c = 60\nunmetered_only = true\nmax_load = 1");
    for input in &inputs {
        for file in files {
            let path = dir.path().join(file);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, input).unwrap();
        }
        let r = Readings::read(&root);
        let _ = decide(&every, &r, NOON);
        let text = String::from_utf8_lossy(input);
        if text.trim().parse::<u8>().is_err() && !text.trim().is_empty() {
            assert!(!r.errors.is_empty(), "{text:?} in every file was taken as fine: {r:?}");
        }
        assert!(r.errors.iter().all(|e| e.chars().count() < 400), "errors stay short: {:?}", r.errors);
    }
}
