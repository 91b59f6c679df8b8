//! Secure aggregation (SecAgg+) over real QUIC on loopback and on the virtual clock:
//! the simulator's real server and real clients run FedAvg and FedProK with `[secagg]`; every
//! round's report says how many devices the sum holds, and the accuracy matches the run without
//! it (the sum is the plain sum to quantisation). A device killed in the middle of a round (after
//! it shared its keys, or before) is left out of the sum and the others' round still aggregates.

use anchorage_server::engine::secagg::SecAggConfig;
use anchorage_shared::method::MethodConfig;
use anchorage_sim::virtual_clock::run_virtual;
use anchorage_sim::{DataConfig, FederationConfig, SimConfig, SimResult, run};

fn federation(method: MethodConfig, secure: bool) -> SimConfig {
    SimConfig {
        federation: FederationConfig {
            clients: 5,
            rounds: 3,
            seed: 17,
            local_epochs: 2,
            learning_rate: 0.02,
            ..Default::default()
        },
        data: DataConfig { train_per_class: 40, test_per_class: 20, ..Default::default() },
        method,
        secagg: SecAggConfig { enabled: secure, clip: 100.0, ..SecAggConfig::default() },
        ..SimConfig::default()
    }
}

fn final_accuracy(result: &SimResult) -> f64 {
    result.summary.final_accuracy
}

fn contributors(result: &SimResult) -> Vec<usize> {
    result.reports.iter().map(|r| r.secagg.as_ref().expect("a SecAgg round reports it").contributors).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fedavg_and_fedprok_aggregate_securely_on_both_clocks() {
    for method in [MethodConfig::FedAvg(Default::default()), MethodConfig::FedProK(Default::default())] {
        let name = method.name();
        let secure = federation(method.clone(), true);
        let real = run(secure.clone()).await.expect("runs over QUIC");
        let simulated = run_virtual(&secure).expect("runs on the virtual clock");
        let plain = run_virtual(&federation(method, false)).expect("runs without SecAgg");
        let (a_real, a_virtual, a_plain) = (final_accuracy(&real), final_accuracy(&simulated), final_accuracy(&plain));
        println!(
            "{name}: final accuracy with SecAgg {a_real:.4} over QUIC, {a_virtual:.4} on the virtual clock; \
             {a_plain:.4} without; devices in each sum {:?}",
            contributors(&real)
        );
        for result in [&real, &simulated] {
            assert!(result.summary.rounds.iter().all(|r| r.outcome == "aggregated"), "{name}: every round aggregated");
            assert_eq!(contributors(result), vec![5, 5, 5], "{name}: every device in every sum");
        }
        assert!(
            (a_virtual - a_plain).abs() < 0.02,
            "{name}: the secure sum is the plain sum: {a_virtual} vs {a_plain}"
        );
        assert!((a_real - a_plain).abs() < 0.05, "{name}: over QUIC too: {a_real} vs {a_plain}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_killed_mid_federation_leaves_the_others_sum_intact_over_quic() {
    let mut config = federation(MethodConfig::FedAvg(Default::default()), true);
    config.secagg.stage_timeout = std::time::Duration::from_secs(2);
    // The masked stage waits for a device that shared keys until the deadline, then unmasks
    // without it.
    config.federation.round_deadline_secs = 10.0;
    config.federation.min_available = Some(4);
    config.systems.kill = vec![anchorage_sim::KillAt { client: 4, round: 2 }];
    let result = run(config).await.expect("runs over QUIC");
    let sums = contributors(&result);
    let seconds: Vec<f64> = result.reports.iter().map(|r| r.closed.saturating_sub(r.started).as_secs_f64()).collect();
    let dropped: Vec<usize> = result.reports.iter().map(|r| r.secagg.as_ref().unwrap().dropped_after_masking).collect();
    println!(
        "devices in each sum with device 4 killed at round 2's broadcast: {sums:?}; dropped after sharing keys \
         {dropped:?}; round seconds {seconds:?}"
    );
    assert!(result.summary.rounds.iter().all(|r| r.outcome == "aggregated"), "every round aggregated");
    let killed = "client-004";
    for report in &result.reports[1..] {
        let secagg = report.secagg.as_ref().unwrap();
        assert!(!report.updates.iter().any(|u| u.client == killed), "round {}: the killed device", report.round);
        assert_eq!(secagg.contributors, 4, "round {}: everyone else in the sum", report.round);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn masked_vectors_also_travel_whole_on_a_uni_stream() {
    // Devices that do not resume uploads send each frame whole on a uni stream: a masked vector
    // (1 MB here) is as large as an update and the server reads it under the update's limit.
    let mut config = federation(MethodConfig::FedAvg(Default::default()), true);
    config.federation.rounds = 2;
    config.systems.resume_uploads = false;
    let result = run(config).await.expect("runs over QUIC");
    let vector_len = result.reports[0].secagg.as_ref().unwrap().vector_len;
    println!("whole uploads: devices in each sum {:?}, {} B masked vectors", contributors(&result), 4 * vector_len);
    assert!(4 * vector_len > 64 << 10, "larger than a control frame");
    assert!(result.summary.rounds.iter().all(|r| r.outcome == "aggregated"));
    assert!(contributors(&result).iter().all(|&n| n >= 4));
}
