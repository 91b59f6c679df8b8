//! Four clients federate over real QUIC on loopback; the global model learns; an update's wire
//! bytes stay close to its payload.

use anchorage_sim::{FederationConfig, SimConfig, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_clients_three_rounds_learn_over_quic() {
    let config = SimConfig {
        federation: FederationConfig { clients: 4, rounds: 3, seed: 11, ..Default::default() },
        ..SimConfig::default()
    };
    let result = run(config).await.expect("simulation runs");
    let s = &result.summary;
    println!(
        "data: embedded synthetic set (no files). accuracy initial {:.3} → final {:.3}, chance {:.2}; wire/payload {:?}",
        s.initial_accuracy, s.final_accuracy, s.chance, s.upload_wire_ratio
    );
    assert_eq!(s.rounds.len(), 3);
    for r in &s.rounds {
        assert_eq!(r.outcome, "aggregated", "round {}", r.round);
        assert_eq!(r.aggregated, 4, "round {} aggregated all four clients", r.round);
    }
    assert!(s.initial_accuracy < s.chance + 0.1, "the untrained model is near chance: {}", s.initial_accuracy);
    assert!(
        s.final_accuracy > s.chance + 0.4,
        "global accuracy {} should rise clearly above chance {}",
        s.final_accuracy,
        s.chance
    );
    // Every client filed a cost record per round, with a ~1 MB upload measured at the socket.
    assert_eq!(result.ledger.len(), 12);
    for c in &result.ledger {
        assert!(
            c.wire_up >= c.payload_up && c.wire_down >= c.payload_down,
            "every record holds its measured wire bytes: {c:?}"
        );
    }
    let payload = s.mean_upload_payload.expect("uploads were measured");
    assert!(payload > 1_000_000.0, "the default update is a 1 MB-class upload: {payload}");
    let ratio = s.upload_wire_ratio.expect("wire bytes were measured");
    assert!((1.0..1.10).contains(&ratio), "wire bytes within 10% of payload (QUIC overhead included): {ratio}");
    assert_eq!(s.decode_errors, 0);
    // Clients report their peak memory with every update.
    let peaks: Vec<f64> = result
        .reports
        .iter()
        .flat_map(|r| r.updates.iter())
        .filter_map(|u| u.metrics.iter().find(|(n, _)| n == "peak_rss_mb").map(|(_, v)| *v))
        .collect();
    println!("client peak memory reported: {:.0} MiB (max over updates)", peaks.iter().cloned().fold(0.0, f64::max));
    assert_eq!(peaks.len(), 12);
    assert!(peaks.iter().all(|&p| p > 1.0));
}
