//! The same scenario on both clocks: real QUIC through the shaped socket, and the discrete-event
//! virtual clock through the same link model. Where the shaped link dominates a round, per-round
//! durations agree within 15%; on a lossy link the bytes on the wire agree (wall time there is a
//! measurement, `--ignored`); compute seconds agree (thread CPU time).

use anchorage_shared::ledger::CostRecord;
use anchorage_sim::network::{DuplexProfile, LinkPreset, LinkProfile};
use anchorage_sim::virtual_clock::run_virtual;
use anchorage_sim::{ClientLink, SimConfig, run};
use anchorage_sim::{DataConfig, FederationConfig, SystemsConfig};

/// One comparison at a time: the real clock measures wall time, and a second federation training
/// beside it on 2 cores slows it (measured: 0.114 s against 0.084 s per client-round with the
/// other tests of this file running, 0.086 against 0.090 alone).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The same scenario on the virtual clock (on a blocking thread) and then on the real clock.
async fn both_clocks(config: SimConfig) -> (anchorage_sim::SimResult, anchorage_sim::SimResult) {
    let _alone = ONE_AT_A_TIME.lock().await;
    // A comparison that just ended may still be closing its connections on the other core.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let virtual_run = tokio::task::spawn_blocking({
        let config = config.clone();
        move || run_virtual(&config)
    })
    .await
    .unwrap()
    .expect("virtual run");
    (virtual_run, run(config).await.expect("real run"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_and_virtual_round_durations_agree() {
    let side = |mbps: f64| LinkProfile {
        bandwidth_bps: mbps * 1e6,
        latency_ms: 20.0,
        buffer_bytes: 128 * 1024,
        ..LinkProfile::default()
    };
    let profile = DuplexProfile::new(side(2.0), side(10.0));
    let config = SimConfig {
        federation: FederationConfig { clients: 2, rounds: 2, seed: 31, local_epochs: 1, ..Default::default() },
        data: DataConfig { train_per_class: 40, test_per_class: 10, ..Default::default() },
        systems: SystemsConfig {
            client_links: (0..2).map(|client| ClientLink { client, profile: profile.clone() }).collect(),
            ..Default::default()
        },
        ..SimConfig::default()
    };
    let (virtual_run, real_run) = both_clocks(config).await;
    let real: Vec<f64> = real_run.summary.rounds.iter().map(|r| r.seconds).collect();
    let simulated: Vec<f64> = virtual_run.summary.rounds.iter().map(|r| r.seconds).collect();
    println!("per-round seconds: real clock {real:?}, virtual clock {simulated:?}");
    assert_eq!(real.len(), 2);
    assert_eq!(simulated.len(), 2);
    for (r, v) in real.iter().zip(&simulated) {
        assert!(*r > 4.0, "the shaped link dominates the round: {r}");
        assert!((r - v).abs() <= 0.15 * r, "real {r:.2} s vs virtual {v:.2} s differ by more than 15%");
    }
    for run in [&real_run, &virtual_run] {
        assert!(run.summary.rounds.iter().all(|r| r.outcome == "aggregated" && r.aggregated == 2));
    }
}

/// On a lossy preset (LTE: 0.2% loss, 25 ms latency, 20 Mbit/s down) what the link model
/// determines must agree across clocks, whatever else runs on the machine: the bytes each device
/// put on the wire per round, up and down (QUIC's overhead and retransmissions on the real clock,
/// the window model's on the virtual one), within 15%, and the accuracy curve exactly. Round
/// durations in wall time are a measurement, not a test: `round_seconds_on_a_lossy_link` below
/// (`--ignored`) prints them side by side (benches/README.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_and_virtual_agree_on_a_lossy_link() {
    let (virtual_run, real_run) = both_clocks(lossy_link_job()).await;
    let per_client_round = |run: &anchorage_sim::SimResult, bytes: fn(&CostRecord) -> u64| -> f64 {
        let rows: Vec<&CostRecord> = run.ledger.iter().filter(|c| !c.dropped).collect();
        assert!(!rows.is_empty());
        rows.iter().map(|c| bytes(c) as f64).sum::<f64>() / rows.len() as f64
    };
    for (direction, bytes) in [("up", (|c| c.wire_up) as fn(&CostRecord) -> u64), ("down", |c| c.wire_down)] {
        let (real, simulated) = (per_client_round(&real_run, bytes), per_client_round(&virtual_run, bytes));
        println!("wire bytes {direction} per client-round on LTE: real clock {real:.0}, virtual clock {simulated:.0}");
        assert!(real > 0.0, "the real clock counted its {direction}link bytes");
        assert!((real - simulated).abs() <= 0.15 * real, "{direction}: real {real:.0} B vs virtual {simulated:.0} B");
    }
    let accuracy =
        |run: &anchorage_sim::SimResult| -> Vec<f64> { run.summary.rounds.iter().map(|r| r.accuracy).collect() };
    assert_eq!(accuracy(&real_run), accuracy(&virtual_run), "the same seed gives the same accuracy curve");
}

fn lossy_link_job() -> SimConfig {
    SimConfig {
        federation: FederationConfig { clients: 4, rounds: 3, seed: 11, ..Default::default() },
        systems: SystemsConfig { link: Some(LinkPreset::Lte), ..Default::default() },
        ..SimConfig::default()
    }
}

/// A measurement, not a check (wall time grows with whatever else the machine runs): mean round
/// seconds on LTE, real clock against virtual. On an idle 2-core machine on 2026-11-27: real
/// 3.52 s, virtual 3.18 s (the window model's gap on lossy links is a fidelity item of its own).
/// `cargo test -p anchorage-tests --test clocks -- --ignored --nocapture round_seconds_on_a_lossy_link`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a wall-time measurement; run it on an idle machine with --ignored --nocapture"]
async fn round_seconds_on_a_lossy_link() {
    let (virtual_run, real_run) = both_clocks(lossy_link_job()).await;
    let mean = |run: &anchorage_sim::SimResult| -> f64 {
        run.summary.rounds.iter().map(|r| r.seconds).sum::<f64>() / run.summary.rounds.len() as f64
    };
    let (real, simulated) = (mean(&real_run), mean(&virtual_run));
    println!(
        "mean round seconds on LTE: real clock {real:.2}, virtual clock {simulated:.2} (ratio {:.3})",
        real / simulated
    );
}

/// Compute seconds measure work on both clocks: a device's training is charged its thread's CPU
/// time, and the real clock trains one device at a time, so a busy host (QUIC, the server, ten
/// clients on two cores) does not stretch them. After the first round (warm-up: first
/// allocations, handshakes beside it), the real clock's compute seconds per client-round are
/// within a factor of 2 of the virtual clock's for the same job. Charging wall time, or the wait
/// for the compute pool, would be several times off (ten clients queue for one pool), which is
/// what this test is for. The two are measured at different moments, and thread CPU time grows
/// when the other core is busy (shared caches): alone they agree within 7% (0.0745 against
/// 0.0694 s on 2026-11-26), under the full suite they measured 0.0844 against 0.1087 s
/// (2026-11-26) and 0.0957 against 0.0684 s (2026-11-27), so a tighter bound fails on load alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compute_seconds_per_client_round_agree_across_clocks() {
    let config = SimConfig {
        federation: FederationConfig { clients: 10, rounds: 3, seed: 5, local_epochs: 1, ..Default::default() },
        data: DataConfig { alpha: f64::INFINITY, train_per_class: 600, ..Default::default() },
        ..SimConfig::default()
    };
    let (virtual_run, real_run) = both_clocks(config).await;
    let per_client_round = |run: &anchorage_sim::SimResult| -> f64 {
        let after_warm_up: Vec<f64> =
            run.ledger.iter().filter(|c| c.round >= 2 && !c.dropped).map(|c| c.compute_seconds).collect();
        assert_eq!(after_warm_up.len(), 20);
        after_warm_up.iter().sum::<f64>() / after_warm_up.len() as f64
    };
    let (real, simulated) = (per_client_round(&real_run), per_client_round(&virtual_run));
    println!("compute seconds per client-round (rounds 2–3): real clock {real:.4}, virtual clock {simulated:.4}");
    assert!(real > 0.0 && simulated > 0.0);
    let ratio = real / simulated;
    assert!((0.5..=2.0).contains(&ratio), "real {real:.4} s vs virtual {simulated:.4} s (ratio {ratio:.2})");
}
