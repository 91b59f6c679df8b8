//! The virtual clock drives the real engine and sessions with no sockets.

use anchorage_sim::SimConfig;
use anchorage_sim::network::DuplexProfile;
use anchorage_sim::virtual_clock::{run_virtual, wire_bytes};

#[test]
fn a_virtual_federation_learns_and_charges_its_links() {
    let link = DuplexProfile::preset("lte").unwrap();
    let config = SimConfig {
        clients: 4,
        rounds: 3,
        seed: 5,
        local_epochs: 1,
        train_per_class: 40,
        test_per_class: 20,
        link: Some("lte".into()),
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
        assert!(r.seconds > upload, "round {} took {} simulated s, less than one upload ({upload} s)", r.round, r.seconds);
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
        clients: 3,
        rounds: 2,
        seed: 9,
        local_epochs: 1,
        train_per_class: 30,
        test_per_class: 10,
        link: Some("3g".into()),
        compute_scale: 0.0,
        ..SimConfig::default()
    };
    let a = run_virtual(&config).unwrap();
    let b = run_virtual(&config).unwrap();
    let times = |r: &anchorage_sim::SimResult| r.summary.rounds.iter().map(|r| r.seconds).collect::<Vec<_>>();
    assert_eq!(times(&a), times(&b), "with compute charged as zero, simulated time is deterministic");
    assert_eq!(a.summary.final_accuracy, b.summary.final_accuracy);
}
