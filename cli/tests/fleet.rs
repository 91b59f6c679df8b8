//! A local fleet over real QUIC: `anchorage fleet --local 2` starts a server and two worker
//! processes of 10 devices each; the run folder is the server's record, and the accuracy curve is
//! the virtual clock's for the same seed (the same split, initial model, sampling and training:
//! only the transport differs, and FedAvg's synchronous rounds do not depend on arrival order).

use std::process::Command;

use anchorage_sim::FederationConfig;
use anchorage_sim::SimConfig;
use anchorage_sim::virtual_clock::run_virtual;

#[test]
fn two_workers_of_ten_devices_run_two_rounds_over_quic() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let status = Command::new(env!("CARGO_BIN_EXE_anchorage"))
        .args(["fleet", "--local", "2", "--clients", "20", "--rounds", "2", "--out"])
        .arg(&out)
        .status()
        .expect("starting anchorage fleet");
    for i in 0..2 {
        let log = std::fs::read_to_string(out.join(format!("worker-{i}.log"))).unwrap_or_default();
        println!("worker {i}: {}", log.lines().last().unwrap_or("(no log)"));
        assert!(log.contains("10 devices, 10 finished"), "worker {i}: {log}");
    }
    assert!(status.success(), "anchorage fleet failed: {status}");

    // The server's record: every device's cost in its ledger, both rounds aggregated by all 20.
    let ledger = anchorage_server::store::read_ledger(&out.join("state").join("anchorage.db")).unwrap();
    let clients: std::collections::BTreeSet<&str> = ledger.iter().map(|r| r.client.as_str()).collect();
    assert_eq!((ledger.len(), clients.len()), (40, 20), "one record per device per round");
    assert!(ledger.iter().all(|r| r.payload_up > 0 && r.wire_up >= r.payload_up && r.compute_seconds > 0.0));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("metrics.json")).unwrap()).unwrap();
    let rounds = summary["rounds"].as_array().expect("rounds in metrics.json");
    assert_eq!(rounds.len(), 2);
    assert!(rounds.iter().all(|r| r["aggregated"] == 20 && r["outcome"] == "aggregated"), "{rounds:?}");

    // Fidelity: the same accuracy curve as the virtual clock.
    let virtual_run = run_virtual(&SimConfig {
        federation: FederationConfig { clients: 20, rounds: 2, ..Default::default() },
        ..SimConfig::default()
    })
    .unwrap();
    let curve = |rounds: &[serde_json::Value]| -> Vec<f64> {
        rounds.iter().map(|r| (r["accuracy"].as_f64().unwrap() * 1e4).round()).collect()
    };
    let virtual_curve: Vec<f64> = virtual_run.summary.rounds.iter().map(|r| (r.accuracy * 1e4).round()).collect();
    println!("accuracy ×10⁴ per round: fleet {:?}, virtual clock {virtual_curve:?}", curve(rounds));
    assert_eq!(curve(rounds), virtual_curve);
}
