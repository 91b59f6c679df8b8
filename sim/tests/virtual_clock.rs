//! The virtual clock drives the real engine and sessions with no sockets.

use anchorage_sim::SimConfig;
use anchorage_sim::network::LinkPreset;
use anchorage_sim::virtual_clock::{run_virtual, wire_bytes};
use anchorage_sim::{DataConfig, FederationConfig, OutputConfig, SystemsConfig};

#[test]
fn a_virtual_federation_learns_and_charges_its_links() {
    let link = LinkPreset::Lte.profile();
    let config = SimConfig {
        federation: FederationConfig { clients: 4, rounds: 3, seed: 5, local_epochs: 1, ..Default::default() },
        data: DataConfig { train_per_class: 40, test_per_class: 20, ..Default::default() },
        systems: SystemsConfig { link: Some(LinkPreset::Lte), ..Default::default() },
        ..SimConfig::default()
    };
    let result = run_virtual(&config).expect("virtual run");
    let s = &result.summary;
    assert_eq!(s.rounds.len(), 3);
    assert!(s.rounds.iter().all(|r| r.outcome == "aggregated" && r.aggregated == 4));
    assert!(s.final_accuracy > s.chance + 0.15, "learns: {} vs chance {}", s.final_accuracy, s.chance);
    // Uploads of ~1 MB at LTE's 5 Mbit/s uplink take about 1.7 s each: the simulated rounds show it.
    let upload = result.ledger[0].payload_up as f64 * 8.0 / link.up.bandwidth_bps;
    for r in &s.rounds {
        assert!(
            r.seconds > upload,
            "round {} took {} simulated s, less than one upload ({upload} s)",
            r.round,
            r.seconds
        );
    }
    assert_eq!(result.ledger.len(), 12, "one cost record per client per round");
    for c in &result.ledger {
        assert!(c.transfer_seconds >= upload * 0.99, "{c:?}");
        assert!(c.wire_up > c.payload_up && c.wire_up < c.payload_up + c.payload_up / 20);
    }
}

#[test]
fn the_packet_model_adds_a_few_percent() {
    assert_eq!(wire_bytes(0), 0);
    assert_eq!(wire_bytes(1200), 1240);
    let mb = wire_bytes(1_000_000) as f64 / 1e6;
    assert!((1.03..1.04).contains(&mb), "{mb}");
}

#[test]
fn the_same_seed_gives_the_same_simulated_times() {
    let config = SimConfig {
        federation: FederationConfig { clients: 3, rounds: 2, seed: 9, local_epochs: 1, ..Default::default() },
        data: DataConfig { train_per_class: 30, test_per_class: 10, ..Default::default() },
        systems: SystemsConfig {
            link: Some(LinkPreset::ThreeG),
            devices: vec![anchorage_sim::device::DeviceProfile { compute_scale: 0.0, ..Default::default() }],
            ..Default::default()
        },
        ..SimConfig::default()
    };
    let a = run_virtual(&config).unwrap();
    let b = run_virtual(&config).unwrap();
    let times = |r: &anchorage_sim::SimResult| r.summary.rounds.iter().map(|r| r.seconds).collect::<Vec<_>>();
    assert_eq!(times(&a), times(&b), "with compute charged as zero, simulated time is deterministic");
    assert_eq!(a.summary.final_accuracy, b.summary.final_accuracy);
}

fn epochs_run(result: &anchorage_sim::SimResult) -> Vec<f64> {
    result
        .reports
        .iter()
        .flat_map(|r| r.updates.iter())
        .flat_map(|u| u.metrics.iter().filter(|(n, _)| n == "local_epochs").map(|(_, v)| *v))
        .collect()
}

#[test]
fn stragglers_run_fewer_local_epochs() {
    let base = SimConfig {
        federation: FederationConfig { clients: 4, rounds: 3, seed: 12, local_epochs: 4, ..Default::default() },
        data: DataConfig { train_per_class: 20, test_per_class: 5, ..Default::default() },
        ..SimConfig::default()
    };
    let steady = run_virtual(&base).unwrap();
    assert!(epochs_run(&steady).iter().all(|&e| e == 4.0), "no stragglers: every client runs τ = 4 epochs");
    let straggling =
        run_virtual(&SimConfig { systems: SystemsConfig { straggler_ratio: 1.0, ..base.systems }, ..base }).unwrap();
    let epochs = epochs_run(&straggling);
    assert_eq!(epochs.len(), 12);
    assert!(epochs.iter().all(|&e| (1.0..=4.0).contains(&e)));
    let mean = epochs.iter().sum::<f64>() / epochs.len() as f64;
    assert!(mean < 3.5, "uniform in 1..=4 has mean 2.5; got {mean}");
}

#[test]
fn a_slow_device_misses_the_deadline_and_its_update_is_late() {
    use anchorage_sim::device::DeviceProfile;
    // Half the fleet is 10,000× slower than the host: their training outlasts a 5 s deadline.
    let fast = DeviceProfile { name: "fast".into(), compute_scale: 0.0, share: 1.0, ..DeviceProfile::default() };
    let slow = DeviceProfile { name: "slow".into(), compute_scale: 10_000.0, share: 1.0, ..DeviceProfile::default() };
    let config = SimConfig {
        federation: FederationConfig {
            clients: 4,
            rounds: 2,
            seed: 13,
            local_epochs: 1,
            round_deadline_secs: 5.0,
            ..Default::default()
        },
        data: DataConfig { train_per_class: 20, test_per_class: 5, ..Default::default() },
        systems: SystemsConfig { devices: vec![fast, slow], ..Default::default() },
        ..SimConfig::default()
    };
    let result = run_virtual(&config).unwrap();
    let first = &result.reports[0];
    assert_eq!(first.updates.len(), 2, "the fast half is aggregated");
    assert_eq!(first.missing.len(), 2, "the slow half misses the deadline");
    assert!((first.seconds() - 5.0).abs() < 1e-6, "the round closed at its deadline: {}", first.seconds());
    assert!(result.ledger.iter().all(|c| c.joules >= 0.0));
}

#[test]
fn buffered_aggregation_runs_on_the_virtual_clock() {
    use anchorage_server::engine::AggregationMode;
    use anchorage_sim::device::DeviceProfile;
    // Compute is charged as nothing, so the order of arrivals comes from the seeded links alone
    // and the run is the same on a busy and an idle machine (with the host's measured compute
    // time, an idle machine reordered the arrivals and the result moved).
    let instant = DeviceProfile { compute_scale: 0.0, ..DeviceProfile::default() };
    let config = SimConfig {
        federation: FederationConfig {
            clients: 6,
            rounds: 6,
            seed: 14,
            local_epochs: 1,
            aggregation: AggregationMode::Buffered { buffer: 2, concurrency: 4, max_staleness: 3 },
            ..Default::default()
        },
        data: DataConfig { train_per_class: 60, test_per_class: 10, alpha: 100.0, ..Default::default() },
        systems: SystemsConfig { devices: vec![instant], link: Some(LinkPreset::Lte), ..Default::default() },
        ..SimConfig::default()
    };
    let result = run_virtual(&config).expect("buffered run");
    let s = &result.summary;
    assert_eq!(s.rounds.len(), 6, "six versions");
    assert!(
        s.rounds.iter().all(|r| r.outcome == "aggregated" && r.aggregated == 2),
        "each version from a buffer of two"
    );
    let stale: Vec<f64> = result
        .reports
        .iter()
        .flat_map(|r| r.updates.iter())
        .flat_map(|u| u.metrics.iter().filter(|(n, _)| n == "staleness").map(|(_, v)| *v))
        .collect();
    assert!(
        stale.iter().any(|s| *s > 0.0),
        "with 4 clients in flight and buffers of 2, some updates are stale: {stale:?}"
    );
    eprintln!("buffered: accuracy {} → {}, staleness {stale:?}", s.initial_accuracy, s.final_accuracy);
    assert!(s.final_accuracy > s.initial_accuracy + 0.1, "learns: {} → {}", s.initial_accuracy, s.final_accuracy);
}

#[test]
fn crashing_devices_miss_rounds_and_rejoin() {
    use anchorage_sim::device::DeviceProfile;
    let flaky =
        DeviceProfile { crash_probability: 0.4, rejoin_seconds: 3.0, compute_scale: 0.0, ..DeviceProfile::default() };
    let config = SimConfig {
        federation: FederationConfig {
            clients: 5,
            rounds: 6,
            seed: 15,
            local_epochs: 1,
            min_available: Some(2),
            round_deadline_secs: 2.0,
            ..Default::default()
        },
        data: DataConfig { train_per_class: 30, test_per_class: 5, alpha: f64::INFINITY, ..Default::default() },
        systems: SystemsConfig { devices: vec![flaky], ..Default::default() },
        ..SimConfig::default()
    };
    let result = run_virtual(&config).expect("a flaky fleet still runs");
    assert_eq!(result.summary.rounds.len(), 6);
    let missed: usize = result.reports.iter().map(|r| r.missing.len()).sum();
    assert!(missed > 0, "crashes leave sampled clients silent at the deadline");
    assert!(result.ledger.iter().any(|c| c.dropped), "dropped clients are in the ledger");
    let crashed_then_aggregated = result.reports.iter().enumerate().any(|(i, r)| {
        r.missing
            .iter()
            .any(|m| result.reports[i + 1..].iter().any(|later| later.updates.iter().any(|u| &u.client == m)))
    });
    assert!(crashed_then_aggregated, "a client that missed a round is aggregated again after rejoining");
}

#[test]
fn devices_on_an_availability_cycle_come_and_go() {
    use anchorage_sim::device::{DeviceProfile, OnOff};
    let sleepy = DeviceProfile {
        on_off: Some(OnOff { on_seconds: 1.0, off_seconds: 1.0 }),
        compute_scale: 0.0,
        ..DeviceProfile::default()
    };
    let always = DeviceProfile { compute_scale: 0.0, ..DeviceProfile::default() };
    let config = SimConfig {
        federation: FederationConfig {
            clients: 4,
            rounds: 8,
            seed: 16,
            local_epochs: 1,
            min_available: Some(1),
            round_deadline_secs: 6.0,
            ..Default::default()
        },
        data: DataConfig { train_per_class: 20, test_per_class: 5, alpha: f64::INFINITY, ..Default::default() },
        systems: SystemsConfig {
            link: Some(LinkPreset::Wifi),
            devices: vec![DeviceProfile { share: 1.0, ..sleepy }, DeviceProfile { share: 1.0, ..always }],
            ..Default::default()
        },
        ..SimConfig::default()
    };
    let result = run_virtual(&config).expect("runs");
    assert_eq!(result.summary.rounds.len(), 8);
    let sampled: Vec<usize> = result.reports.iter().map(|r| r.sampled).collect();
    assert!(sampled.iter().any(|&s| s < 4), "some rounds open while sleepy devices are away: {sampled:?}");
    assert!(result.reports.iter().all(|r| !r.updates.is_empty()), "the always-on half keeps every round going");
}

/// The virtual clock trains the sampled clients on a pool of threads; the run is the same for one
/// thread and for four: accuracy per round, who was aggregated, the bytes and the loss.
#[test]
fn one_thread_and_four_give_the_same_run() {
    let config = |threads| SimConfig {
        federation: FederationConfig { clients: 8, rounds: 3, seed: 13, local_epochs: 1, ..Default::default() },
        data: DataConfig { train_per_class: 40, test_per_class: 20, ..Default::default() },
        systems: SystemsConfig { link: Some(LinkPreset::Wifi), threads, ..Default::default() },
        ..SimConfig::default()
    };
    let (one, four) = (run_virtual(&config(1)).unwrap(), run_virtual(&config(4)).unwrap());
    let rounds = |r: &anchorage_sim::SimResult| -> Vec<(u64, String, usize, String, u64, u64)> {
        r.summary
            .rounds
            .iter()
            .map(|x| {
                let loss = x.train_loss.map(|l| format!("{l:.6}")).unwrap_or_default();
                (x.round, format!("{:.6}", x.accuracy), x.aggregated, loss, x.payload_up, x.payload_down)
            })
            .collect()
    };
    println!("1 thread: {:?}", rounds(&one));
    assert_eq!(rounds(&one), rounds(&four));
    let who = |r: &anchorage_sim::SimResult| -> Vec<Vec<String>> {
        r.reports.iter().map(|x| x.updates.iter().map(|u| u.client.to_string()).collect()).collect()
    };
    assert_eq!(who(&one), who(&four));
    assert_eq!(one.accuracy.len(), four.accuracy.len());
    assert!(one.accuracy.iter().zip(&four.accuracy).all(|(a, b)| a == b), "the accuracy records match");
}

/// The clients' local evaluation policy: every 2nd round, on a 20% sample of the test rows. The
/// global model is still evaluated every round, training is untouched (the same global
/// accuracies), and the summary says the local side is a sample.
#[test]
fn clients_evaluate_on_the_policy_and_the_global_model_every_round() {
    let base = SimConfig {
        federation: FederationConfig { clients: 4, rounds: 4, seed: 3, local_epochs: 1, ..Default::default() },
        data: DataConfig { train_per_class: 40, ..Default::default() },
        ..SimConfig::default()
    };
    let full = run_virtual(&base).unwrap();
    let sparse =
        run_virtual(&SimConfig { output: OutputConfig { eval_every: 2, eval_fraction: 0.2, ..base.output }, ..base })
            .unwrap();
    let global = |r: &anchorage_sim::SimResult| -> Vec<f64> { r.summary.rounds.iter().map(|x| x.accuracy).collect() };
    assert_eq!(global(&full), global(&sparse), "evaluation does not change training");
    let client_rounds = |r: &anchorage_sim::SimResult| -> std::collections::BTreeSet<u64> {
        r.accuracy.iter().filter(|a| a.is_client()).map(|a| a.round).collect()
    };
    assert_eq!(client_rounds(&full), [1, 2, 3, 4].into());
    assert_eq!(client_rounds(&sparse), [2, 4].into(), "local accuracies only in even rounds");
    let global_rounds: std::collections::BTreeSet<u64> =
        sparse.accuracy.iter().filter(|a| !a.is_client()).map(|a| a.round).collect();
    assert_eq!(global_rounds, [1, 2, 3, 4].into(), "the global model every round");
    assert!(sparse.summary.local_eval.sampled && sparse.summary.local_eval.every == 2);
    assert!(!full.summary.local_eval.sampled);
}

/// A relay tier on the virtual clock. With every client in every round, the
/// tier gives the global model of the clients straight to the server (the same accuracy every
/// round); the root's traffic is the relays' partial aggregates; a relay's link outage holds
/// the round back, and a slower relay link makes rounds longer.
#[test]
fn a_relay_tier_on_the_virtual_clock_gives_the_same_model_and_charges_its_links() {
    use anchorage_sim::config::{RelayOutage, RelayTier};
    let base = six_clients_three_rounds(vec![anchorage_sim::device::DeviceProfile {
        compute_scale: 0.0,
        ..Default::default()
    }]);
    let with = |tier: RelayTier| {
        let mut c = base.clone();
        c.systems.relays = Some(tier);
        assert!(c.relays_on_virtual_clock_only().unwrap_err().to_string().contains("--clock virtual"));
        run_virtual(&c).expect("a tiered run")
    };
    let tier = |link, outages| RelayTier { count: 2, link, outages, failovers: vec![], restarts: vec![] };
    let straight = run_virtual(&base).unwrap();
    let tiered = with(tier(LinkPreset::Ethernet, vec![]));
    assert_eq!(tiered.summary.rounds.len(), 3);
    for (a, b) in straight.summary.rounds.iter().zip(&tiered.summary.rounds) {
        assert!(
            (a.accuracy - b.accuracy).abs() < 1e-6,
            "round {}: {} straight, {} through relays",
            a.round,
            a.accuracy,
            b.accuracy
        );
        assert_eq!(b.aggregated, 2, "the root aggregates the two relays' partials");
    }
    assert_eq!(tiered.ledger.iter().filter(|c| !c.dropped).count(), 18, "every client's record, every round");
    let slow = with(tier(LinkPreset::Satellite, vec![]));
    let seconds = |r: &anchorage_sim::SimResult| r.summary.rounds.iter().map(|r| r.seconds).sum::<f64>();
    assert!(seconds(&slow) > seconds(&tiered) + 1.0, "satellite {} s, ethernet {} s", seconds(&slow), seconds(&tiered));
    // Relay 1's link is down for the first 30 s: round 1 waits for its partial (the root's
    // deadline is 60 s) and ends with the same model.
    let outage = |ms| vec![RelayOutage { relay: 1, start_ms: 0, duration_ms: ms }];
    let held = with(tier(LinkPreset::Ethernet, outage(30_000)));
    let first = &held.summary.rounds[0];
    assert!(first.seconds >= 30.0 && first.aggregated == 2, "round 1 waits for relay 1: {first:?}");
    assert!((first.accuracy - tiered.summary.rounds[0].accuracy).abs() < 1e-6);
    // Down for two minutes: the root closes round 1 at its deadline with relay 0's partial alone.
    let lost = with(tier(LinkPreset::Ethernet, outage(120_000)));
    let first = &lost.summary.rounds[0];
    assert!((59.0..70.0).contains(&first.seconds) && first.aggregated == 1, "{first:?}");
}

/// The tier's relays run the uplink session of anchorage-relay: each relay's devices' cost
/// records reach the root's ledger in batches the root confirms (once each, nothing owed at the
/// end), and a device whose connection breaks before its ack fails over and is held by two relays' partials:
/// the root refuses the later one as a duplicate naming it, that relay folds its round again
/// without it, and every device is counted once.
#[test]
fn a_relay_tiers_uplinks_confirm_costs_and_fold_again_after_a_duplicate() {
    use anchorage_sim::config::{RelayFailover, RelayTier};
    let base = six_clients_three_rounds(vec![
        anchorage_sim::device::DeviceProfile { compute_seconds: Some(1.0), ..Default::default() },
        anchorage_sim::device::DeviceProfile { name: "slow".into(), compute_seconds: Some(15.0), ..Default::default() },
    ]);
    let with = |failovers: Vec<RelayFailover>| {
        let mut c = base.clone();
        let link = LinkPreset::Ethernet;
        c.systems.relays = Some(RelayTier { count: 2, link, outages: vec![], failovers, restarts: vec![] });
        run_virtual(&c).expect("a tiered run")
    };
    let plain = with(vec![]);
    let tier = plain.tier.as_ref().expect("the tier's outcome");
    println!("uplinks: {:?}", tier.counts);
    assert_eq!((tier.counts.sent, tier.counts.acked, tier.counts.refused), (6, 6, 0), "one partial a relay a round");
    assert!(tier.counts.cost_batches >= 6, "a batch a relay a round at least: {:?}", tier.counts);
    let mut rows: Vec<(String, u64)> =
        tier.root_ledger.iter().filter(|c| !c.dropped).map(|c| (c.client.clone(), c.round)).collect();
    rows.sort();
    let expected: Vec<(String, u64)> = (1..=3)
        .flat_map(|r| (0..6).map(move |c| (format!("client-{c:03}"), r)))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(rows, expected, "every device's record of every round in the root's ledger, once");
    assert!(
        tier.owed.iter().all(|(p, costs)| p.is_none() && costs.is_empty()),
        "nothing owed at the end: {:?}",
        tier.owed
    );

    // A fast device of relay 0 (even ids) loses its connection before its round-2 ack and resends to relay 1, whose
    // slow device holds its round open.
    let compute =
        |c: usize| plain.ledger.iter().find(|r| r.client == format!("client-{c:03}")).unwrap().compute_seconds;
    let client = (0..6).step_by(2).find(|c| compute(*c) < 5.0).expect("a fast device on relay 0");
    assert!((1..6).step_by(2).any(|c| compute(c) > 5.0), "a slow device on relay 1");
    let failed_over = with(vec![RelayFailover { client, round: 2 }]);
    let tier = failed_over.tier.as_ref().unwrap();
    println!("uplinks after a failover: {:?}", tier.counts);
    assert_eq!(tier.counts.refused, 1, "the root refused one partial as a duplicate: {:?}", tier.counts);
    assert_eq!(tier.counts.refolded, 1, "and its relay folded its round again without the device");
    assert_eq!(tier.counts.acked, 6, "every round's partials were acked in the end");
    // Counted once: no round's partials weigh more samples than without the failover (twice
    // would add the device's samples again). In round 2 the adopted device fills relay 1's
    // target, so relay 1's own slow device arrives late there (acked as not aggregated) and the
    // round holds one device fewer; rounds 1 and 3 hold every device.
    let samples = |r: &anchorage_sim::SimResult| -> Vec<u64> {
        r.reports.iter().map(|report| report.updates.iter().map(|u| u.num_samples).sum()).collect()
    };
    let (with_failover, without) = (samples(&failed_over), samples(&plain));
    println!("samples a round: {with_failover:?} with the failover, {without:?} without");
    assert!(with_failover.iter().zip(&without).all(|(a, b)| a <= b), "nobody counted twice");
    assert_eq!((with_failover[0], with_failover[2]), (without[0], without[2]));
    assert!(failed_over.reports.iter().all(|r| r.updates.len() == 2), "both relays' partials every round");
    assert!(tier.owed.iter().all(|(p, costs)| p.is_none() && costs.is_empty()), "{:?}", tier.owed);
}

/// A relay's process restarts mid-federation (`[relays] restarts`): in round 2, once its store
/// holds its first update of the round and before that update's ack goes out. It resumes from
/// its store (its last partial, the round it had open with that update, its ledger), its devices
/// reconnect and resend what was not acked, and the federation ends as without the restart: the
/// same model and samples every round, every device's cost record once in the root's ledger,
/// nothing owed.
#[test]
fn a_relay_restarted_mid_federation_resumes_from_its_store_and_its_devices_come_back() {
    use anchorage_sim::config::{RelayRestart, RelayTier};
    let base = six_clients_three_rounds(vec![
        anchorage_sim::device::DeviceProfile { compute_seconds: Some(1.0), ..Default::default() },
        anchorage_sim::device::DeviceProfile { name: "slow".into(), compute_seconds: Some(15.0), ..Default::default() },
    ]);
    let with = |restarts: Vec<RelayRestart>| {
        let mut c = base.clone();
        let link = LinkPreset::Ethernet;
        c.systems.relays = Some(RelayTier { count: 2, link, outages: vec![], failovers: vec![], restarts });
        run_virtual(&c).expect("a tiered run")
    };
    let plain = with(vec![]);
    let restarted = with(vec![RelayRestart { relay: 1, round: 2, down_ms: 0 }]);
    let tier = restarted.tier.as_ref().expect("the tier's outcome");
    println!("uplinks with a restart: {:?}", tier.counts);
    assert_eq!(tier.counts.restarts, 1, "relay 1 restarted in round 2: {:?}", tier.counts);
    assert!(tier.counts.repeated_costs > 0, "the restarted relay sent its ledger up again: {:?}", tier.counts);
    assert_eq!(tier.counts.refused, 0, "no partial refused: {:?}", tier.counts);

    // Every round aggregated both relays' partials, with the samples and the model of the run
    // without the restart: the update committed before the crash was folded, once.
    assert_eq!(restarted.summary.rounds.len(), 3);
    let samples = |r: &anchorage_sim::SimResult| -> Vec<u64> {
        r.reports.iter().map(|report| report.updates.iter().map(|u| u.num_samples).sum()).collect()
    };
    assert_eq!(samples(&restarted), samples(&plain), "each round's devices, once each");
    for (a, b) in plain.summary.rounds.iter().zip(&restarted.summary.rounds) {
        assert_eq!((b.outcome.as_str(), b.aggregated), ("aggregated", 2), "round {}: {b:?}", b.round);
        assert!((a.accuracy - b.accuracy).abs() < 1e-6, "round {}: {} and {}", a.round, a.accuracy, b.accuracy);
    }

    // Relay 1's devices (odd ids) came back: their records of rounds 2 and 3 reached the root.
    let mut rows: Vec<(String, u64)> =
        tier.root_ledger.iter().filter(|c| !c.dropped).map(|c| (c.client.clone(), c.round)).collect();
    rows.sort();
    let expected: Vec<(String, u64)> =
        (0..6).flat_map(|c| (1..=3).map(move |r| (format!("client-{c:03}"), r))).collect();
    assert_eq!(rows, expected, "every device's record of every round in the root's ledger, once");
    let mut devices: Vec<(String, u64)> =
        restarted.ledger.iter().filter(|c| !c.dropped).map(|c| (c.client.clone(), c.round)).collect();
    devices.sort();
    assert_eq!(devices, expected, "every device completed each round's record once");
    assert!(
        tier.owed.iter().all(|(p, costs)| p.is_none() && costs.is_empty()),
        "nothing owed at the end: {:?}",
        tier.owed
    );
}

/// A relay's process dies in round 2 and stays down for 100 s (`down_ms`): its devices fail over
/// to the other relay and are counted there while it is down; once it is up they go back, and
/// the last rounds hold both relays' partials again, each device once a round.
#[test]
fn a_relay_down_for_a_while_gets_its_devices_back_once_it_is_up() {
    use anchorage_sim::config::{RelayRestart, RelayTier};
    let mut config = six_clients_three_rounds(vec![
        anchorage_sim::device::DeviceProfile { compute_seconds: Some(1.0), ..Default::default() },
        anchorage_sim::device::DeviceProfile { name: "slow".into(), compute_seconds: Some(15.0), ..Default::default() },
    ]);
    config.federation.rounds = 6;
    let restarts = vec![RelayRestart { relay: 1, round: 2, down_ms: 100_000 }];
    let link = LinkPreset::Ethernet;
    config.systems.relays = Some(RelayTier { count: 2, link, outages: vec![], failovers: vec![], restarts });
    let run = run_virtual(&config).expect("a tiered run");
    let tier = run.tier.as_ref().expect("the tier's outcome");
    println!("uplinks with a relay down 100 s: {:?}", tier.counts);
    for report in &run.reports {
        let clients: Vec<&str> = report.updates.iter().map(|u| u.client.as_str()).collect();
        let samples: u64 = report.updates.iter().map(|u| u.num_samples).sum();
        println!(
            "round {} ({:.0} s to {:.0} s): {clients:?}, {samples} samples",
            report.round,
            report.started.as_secs_f64(),
            report.closed.as_secs_f64()
        );
    }
    assert_eq!(tier.counts.restarts, 1, "relay 1 started again once: {:?}", tier.counts);
    let samples = |r: &anchorage_server::engine::RoundReport| r.updates.iter().map(|u| u.num_samples).sum::<u64>();
    let relays =
        |r: &anchorage_server::engine::RoundReport| r.updates.iter().map(|u| u.client.clone()).collect::<Vec<_>>();
    let last = run.reports.last().expect("rounds");
    assert_eq!(relays(last), ["relay-0", "relay-1"], "relay 1 is counted again, with its own devices");
    // Rounds 3 to 5 ran while relay 1 was down: relay 0 carried every device.
    for round in &run.reports[2..5] {
        assert_eq!(relays(round), ["relay-0"], "round {}", round.round);
        assert_eq!(samples(round), samples(last), "round {}: each of the six devices, through relay 0", round.round);
    }
    assert!(tier.owed.iter().all(|(p, costs)| p.is_none() && costs.is_empty()), "nothing owed: {:?}", tier.owed);
}

/// Six clients, three rounds, every client in every round, on these devices: the relay tests'
/// federation.
fn six_clients_three_rounds(devices: Vec<anchorage_sim::device::DeviceProfile>) -> SimConfig {
    SimConfig {
        federation: FederationConfig {
            clients: 6,
            rounds: 3,
            seed: 11,
            local_epochs: 1,
            min_available: Some(6),
            ..Default::default()
        },
        data: DataConfig { train_per_class: 30, test_per_class: 10, ..Default::default() },
        systems: SystemsConfig { devices, ..Default::default() },
        ..SimConfig::default()
    }
}
