//! Differential privacy over real QUIC on loopback: the real server and real clients
//! of the simulator's real clock run FedAvg and a prototype method under `[privacy]`, with the
//! noise added by the server and by the devices; each round report carries the accountant's ε,
//! the run's summary gives it, and a run whose budget runs out stops early. The same runs on the
//! virtual clock give the same ε: the accountant does not depend on the clock.

use anchorage_shared::method::MethodConfig;
use anchorage_shared::privacy::{NoiseSite, PrivacyConfig};
use anchorage_sim::virtual_clock::run_virtual;
use anchorage_sim::{DataConfig, FederationConfig, SimConfig, run};

fn private(method: MethodConfig, noise: NoiseSite, rounds: u64) -> SimConfig {
    SimConfig {
        federation: FederationConfig { clients: 4, rounds, seed: 11, local_epochs: 1, ..Default::default() },
        data: DataConfig { train_per_class: 20, test_per_class: 5, ..Default::default() },
        method,
        privacy: PrivacyConfig { noise, clip: 1.0, target_epsilon: Some(8.0), delta: 1e-5, ..PrivacyConfig::default() },
        ..SimConfig::default()
    }
}

/// ε after each round, from the round reports.
fn epsilons(result: &anchorage_sim::SimResult) -> Vec<f64> {
    result.reports.iter().map(|r| r.privacy.as_ref().expect("every round report has the account").epsilon).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fedavg_and_fedprok_run_under_central_and_local_noise_over_quic() {
    let fedprok = MethodConfig::FedProK(Default::default());
    let fedavg = MethodConfig::FedAvg(Default::default());
    for (method, noise) in [(fedavg, NoiseSite::Central), (fedprok, NoiseSite::Local)] {
        let name = method.name();
        let config = private(method, noise, 2);
        let real = run(config.clone()).await.expect("runs over QUIC");
        let simulated = run_virtual(&config).expect("runs on the virtual clock");
        let (eps, virtual_eps) = (epsilons(&real), epsilons(&simulated));
        println!("{name} under {} noise: ε after each round {eps:?} (virtual clock {virtual_eps:?})", noise.name());
        assert!(real.summary.rounds.iter().all(|r| r.outcome == "aggregated"), "{name}: every round aggregated");
        assert_eq!(eps.len(), 2);
        assert!(eps[0] > 0.0 && eps[0] < eps[1], "{name}: ε grows with the rounds: {eps:?}");
        assert!((eps[1] - 8.0).abs() < 1e-6, "{name}: σ was chosen to reach ε = 8 in 2 rounds: {eps:?}");
        assert_eq!(eps, virtual_eps, "{name}: the same account on both clocks");
        let spent = real.summary.privacy.as_ref().expect("the summary gives the privacy spent");
        assert_eq!((spent.epsilon, spent.noise, spent.rounds), (eps[1], noise, 2));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_run_stops_when_the_budget_is_spent() {
    // σ = 4 per round at q = 1, no more than ε = 3: the budget holds a few rounds of the ten.
    let mut config = private(MethodConfig::FedAvg(Default::default()), NoiseSite::Central, 10);
    config.privacy.noise_multiplier = Some(4.0);
    config.privacy.max_epsilon = Some(3.0);
    let result = run(config).await.expect("runs over QUIC");
    let eps = epsilons(&result);
    println!("ε after each round with σ = 4 and a budget of 3: {eps:?}");
    assert!(!eps.is_empty() && eps.len() < 10, "{} rounds of 10 ran", eps.len());
    assert!(eps.iter().all(|e| *e <= 3.0), "no round past the budget: {eps:?}");
}
