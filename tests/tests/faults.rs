//! Faults over real QUIC: a client killed mid-round does not stall the round past its deadline.

use std::time::Duration;

use anchorage_sim::{DataConfig, FederationConfig, SystemsConfig};
use anchorage_sim::{SimConfig, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_client_round_completes_at_deadline() {
    let deadline = 6.0;
    let config = SimConfig {
        federation: FederationConfig {
            clients: 4,
            rounds: 3,
            seed: 5,
            min_available: Some(3),
            round_deadline_secs: deadline,
            ..Default::default()
        },
        data: DataConfig { train_per_class: 150, ..Default::default() },
        systems: SystemsConfig { kill: vec![anchorage_sim::KillAt { client: 0, round: 2 }], ..Default::default() },
        ..SimConfig::default()
    };
    let result = run(config).await.expect("simulation runs");
    let r2 = &result.reports[1];
    println!(
        "round 2: {} updates, missing {:?}, open for {:.2} s (deadline {deadline} s)",
        r2.updates.len(),
        r2.missing,
        r2.seconds()
    );
    assert_eq!(r2.round, 2);
    assert_eq!(r2.updates.len(), 3, "the three live clients' updates are aggregated");
    assert_eq!(r2.missing, vec!["client-000".to_string()]);
    assert!(r2.closed - r2.started >= Duration::from_secs_f64(deadline), "it waited for the deadline, not less");
    assert!(r2.seconds() < deadline + 5.0, "and did not stall past it: {}", r2.seconds());
    assert!(matches!(r2.outcome, anchorage_server::engine::RoundOutcome::Aggregated));
    // The federation goes on without the dead client.
    let r3 = &result.reports[2];
    assert_eq!(r3.updates.len(), 3);
    assert!(r3.missing.is_empty());
    assert!(result.summary.final_accuracy > result.summary.chance + 0.3);
}
