//! Runs on the virtual clock: threads, availability traces and cycles.

use std::time::Duration;

use super::run_virtual;
use crate::config::SimConfig;
use crate::config::{DataConfig, FederationConfig, SystemsConfig};
use crate::device::DeviceProfile;
use crate::device::{self, OnOff};
use crate::network::LinkPreset;
use crate::record::SimResult;
use crate::setup::client_id;

fn config(flaky: DeviceProfile) -> SimConfig {
    let steady = DeviceProfile { name: "steady".into(), compute_scale: 0.0, share: 2.0, ..DeviceProfile::default() };
    SimConfig {
        federation: FederationConfig {
            clients: 3,
            rounds: 4,
            seed: 21,
            local_epochs: 1,
            min_available: Some(2),
            ..Default::default()
        },
        data: DataConfig { train_per_class: 20, test_per_class: 5, ..Default::default() },
        systems: SystemsConfig {
            link: Some(LinkPreset::Lte),
            devices: vec![steady, DeviceProfile { name: "flaky".into(), compute_scale: 0.0, share: 1.0, ..flaky }],
            ..Default::default()
        },
        ..SimConfig::default()
    }
}

fn clients_of(result: &SimResult, round: u64) -> Vec<String> {
    let report = result.reports.iter().find(|r| r.round == round).expect("round report");
    report.updates.iter().map(|u| u.client.to_string()).collect()
}

/// Trainings run on every core by default; the accuracy records are the same to
/// the bit on one thread or several (a training sees only its own client and the broadcast).
#[test]
fn one_thread_or_several_give_the_same_run() {
    let on = |threads| SimConfig {
        federation: FederationConfig { clients: 6, rounds: 3, seed: 5, local_epochs: 1, ..Default::default() },
        data: DataConfig { train_per_class: 20, test_per_class: 5, ..Default::default() },
        systems: SystemsConfig { threads, ..Default::default() },
        ..SimConfig::default()
    };
    let one = run_virtual(&on(1)).unwrap();
    for threads in [2, 3] {
        let several = run_virtual(&on(threads)).unwrap();
        assert_eq!(one.accuracy, several.accuracy, "{threads} threads");
        let weights = |r: &SimResult| -> Vec<Vec<u64>> {
            r.reports.iter().map(|p| p.updates.iter().map(|u| u.num_samples).collect()).collect()
        };
        assert_eq!(weights(&one), weights(&several));
    }
}

#[test]
fn a_device_away_in_round_two_by_its_trace_misses_it_and_returns() {
    // Rounds take about 3.3 simulated s on LTE (round 2 from about 3.3 s); the flaky device is
    // away from 4 s to 10 s, and round 2 closes at its 5 s deadline without it.
    let path = std::env::temp_dir().join(format!("anchorage-vc-trace-{}.csv", std::process::id()));
    std::fs::write(&path, "start_seconds,end_seconds\n10,1000\n0,4\n").unwrap();
    let flaky = DeviceProfile { availability_trace: Some(path.clone()), ..DeviceProfile::default() };
    let mut c = config(flaky);
    c.federation.round_deadline_secs = 5.0;
    c.federation.rounds = 6;
    c.federation.min_available = Some(3);
    let result = run_virtual(&c).unwrap();
    let _ = std::fs::remove_file(&path);
    let fleet = device::assign(&c.systems.devices, c.federation.clients, c.federation.seed);
    let flaky = client_id(fleet.iter().position(|d| d.name == "flaky").unwrap());
    let report = |round: u64| result.reports.iter().find(|r| r.round == round).unwrap();
    assert!(report(2).started < Duration::from_secs(4) && report(2).closed > Duration::from_secs(4));
    assert!(clients_of(&result, 1).contains(&flaky), "in round 1: {:?}", clients_of(&result, 1));
    assert!(!clients_of(&result, 2).contains(&flaky), "away in round 2: {:?}", clients_of(&result, 2));
    assert_eq!(clients_of(&result, 2).len(), 2, "the others carry round 2");
    assert!(report(2).closed < Duration::from_secs(10), "round 2 closed while the device was away");
    let back = (3..=c.federation.rounds).find(|&r| clients_of(&result, r).contains(&flaky));
    assert!(back.is_some(), "aggregated again after it returns: {:?}", result.reports);
    assert!(result.summary.rounds.iter().all(|r| r.outcome == "aggregated"));
}

#[test]
fn an_on_off_cycle_still_runs_and_a_bad_trace_fails_before_the_run() {
    let cycle = DeviceProfile { on_off: Some(OnOff { on_seconds: 4.0, off_seconds: 1.0 }), ..DeviceProfile::default() };
    let result = run_virtual(&config(cycle)).unwrap();
    assert_eq!(result.summary.rounds.len(), 4);
    let bad = DeviceProfile { availability_trace: Some("/nonexistent/trace.csv".into()), ..DeviceProfile::default() };
    let err = format!("{:#}", run_virtual(&config(bad)).unwrap_err());
    assert!(err.contains("reading availability trace /nonexistent/trace.csv"), "{err}");
}

#[test]
fn a_device_away_at_the_start_joins_when_its_trace_begins() {
    let path = std::env::temp_dir().join(format!("anchorage-vc-late-{}.csv", std::process::id()));
    std::fs::write(&path, "start_seconds,end_seconds\n3,1000\n").unwrap();
    let late = DeviceProfile { availability_trace: Some(path.clone()), ..DeviceProfile::default() };
    let c = config(late);
    let result = run_virtual(&c).unwrap();
    let _ = std::fs::remove_file(&path);
    let fleet = device::assign(&c.systems.devices, c.federation.clients, c.federation.seed);
    let late = client_id(fleet.iter().position(|d| d.name == "flaky").unwrap());
    assert!(!clients_of(&result, 1).contains(&late), "away in round 1: {:?}", clients_of(&result, 1));
    assert!((2..=c.federation.rounds).any(|r| clients_of(&result, r).contains(&late)), "joins later");
}
