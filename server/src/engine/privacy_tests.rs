//! The engine under `[engine.privacy]`: clipped, equally weighted, noised rounds,
//! prototype sums, the account in every report, the budget that ends the federation, and the
//! refusals.

use anchorage_shared::method::{FedTaConfig, MethodConfig};
use anchorage_shared::privacy::{NoiseSite, PrivacyConfig};
use anchorage_shared::protocol::{Message, RefusalReason, Update};
use anchorage_shared::prototype::Prototype;
use anchorage_shared::tensor::Encoding;

use super::compat::check as check_config;

use super::tests::{block, config, drain, engine, join, refusals, reports, secs, update};
use super::*;

fn private(noise_multiplier: f64, max_epsilon: Option<f64>) -> EngineConfig {
    let privacy = PrivacyConfig {
        noise: NoiseSite::Central,
        clip: 1.0,
        noise_multiplier: Some(noise_multiplier),
        max_epsilon,
        ..PrivacyConfig::default()
    };
    EngineConfig { rounds: 10, privacy, noise_seed: Some(7), ..config(3, 3) }
}

fn global(e: &Engine) -> Vec<f32> {
    e.global()[0].decode().unwrap()
}

#[test]
fn deltas_are_clipped_weighted_alike_and_the_claimed_counts_buy_nothing() {
    // σ so small that the noise is invisible: what is left is the clipping and the weights.
    let mut e = engine(private(1e-9, None));
    join(&mut e, secs(0), &["a", "b", "c"]);
    e.handle_message(secs(1), "a", update(1, &[30.0, 40.0], 1_000_000)); // norm 50 → (0.6, 0.8)
    e.handle_message(secs(1), "b", update(1, &[0.0, 0.5], 1));
    e.handle_message(secs(1), "c", update(1, &[0.0, -0.5], 1));
    let report = reports(&drain(&mut e)).pop().expect("the round closed");
    let g = global(&e);
    assert!((g[0] - 0.2).abs() < 1e-4 && (g[1] - 0.8 / 3.0).abs() < 1e-4, "equal weights of clipped deltas: {g:?}");
    let account = report.privacy.as_ref().expect("the report carries the account");
    assert_eq!((account.rounds, account.noise), (1, NoiseSite::Central));
    assert!(account.epsilon > 0.0 && account.sampling_rate == 1.0, "{account:?}");
}

#[test]
fn the_noise_on_the_sum_has_the_configured_spread() {
    // One round, σ = 2, C = 1, three updates of zero change: the mean moves by N(0, (2/3)²).
    let mut e = Engine::new(private(2.0, None), Box::new(crate::methods::FedAvg::default()), vec![block(&[0.0; 3000])]);
    join(&mut e, secs(0), &["a", "b", "c"]);
    for id in ["a", "b", "c"] {
        e.handle_message(secs(1), id, update(1, &[0.0; 3000], 1));
    }
    drain(&mut e);
    let g = global(&e);
    let std = (g.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / g.len() as f64).sqrt();
    assert!((std - 2.0 / 3.0).abs() < 0.03, "std of the noise on the mean {std}");
}

#[test]
fn the_federation_ends_when_the_budget_is_spent_and_restarts_where_it_was() {
    let mut e = engine(private(4.0, Some(3.0)));
    let mut actions = join(&mut e, secs(0), &["a", "b", "c"]);
    for round in 1..=10 {
        if e.is_finished() {
            break;
        }
        for id in ["a", "b", "c"] {
            e.handle_message(secs(round), id, update(round, &[0.1, 0.1], 1));
        }
        actions.extend(drain(&mut e));
    }
    let closed = reports(&actions);
    let last = closed.last().unwrap().privacy.clone().unwrap();
    assert!(e.is_finished() && closed.len() < 10, "{} rounds ran", closed.len());
    assert!(last.epsilon <= 3.0, "ε {} within the limit", last.epsilon);
    let goodbye = actions.iter().any(
        |a| matches!(a, Action::Send { msg: Message::Goodbye(g), .. } if g.reason.contains("privacy budget spent")),
    );
    assert!(goodbye, "the devices are told why");
    // ε only grows: each report's account is the one before plus a round.
    let eps: Vec<f64> = closed.iter().map(|r| r.privacy.as_ref().unwrap().epsilon).collect();
    assert!(eps.windows(2).all(|w| w[0] < w[1]), "{eps:?}");

    // A restart continues the account from the last report: still spent, no round opens.
    let recovered = Recovered {
        checkpoint: e.checkpoint(),
        open: None,
        pending: vec![],
        last_accepted: vec![],
        round_floor: 0,
        invitations: vec![],
        privacy: Some(last.clone()),
    };
    let mut again = Engine::recover(private(4.0, Some(3.0)), Box::new(crate::methods::FedAvg::default()), recovered);
    join(&mut again, secs(100), &["a", "b", "c"]);
    for id in ["a", "b", "c"] {
        again.handle_message(secs(101), id, update(e.last_round() + 1, &[0.1, 0.1], 1));
    }
    let after = reports(&drain(&mut again));
    assert!(after.is_empty() && again.is_finished(), "no round past the budget after a restart");
}

fn with_prototypes(round: u64, sums: &[(u32, u64, [f32; 2])], marked: bool) -> Message {
    let Message::Update(mut u) = update(round, &[0.0, 0.0], 1) else { unreachable!() };
    u.prototypes = sums.iter().map(|(c, n, v)| Prototype::encode(*c, *n, v, Encoding::F32)).collect();
    if marked {
        u.prototypes_are = anchorage_shared::protocol::PrototypeForm::Sums;
    }
    Message::Update(u)
}

#[test]
fn prototype_sums_become_one_mean_per_class_and_unmarked_ones_are_refused() {
    let mut e = Engine::new(private(1e-9, None), Box::new(crate::methods::FedAvg::default()), vec![block(&[0.0, 0.0])]);
    join(&mut e, secs(0), &["a", "b", "c"]);
    e.handle_message(secs(1), "c", with_prototypes(1, &[(0, 2, [2.0, 0.0])], false));
    assert_eq!(refusals(&drain(&mut e), "c"), vec![RefusalReason::Malformed], "means where sums are expected");
    let mut private_updates = Vec::new();
    for (id, sums) in [("a", [(0, 2, [2.0, 0.0]), (1, 1, [0.0, 1.0])]), ("b", [(0, 2, [0.0, 2.0]), (1, 3, [0.0, 3.0])])]
    {
        let Message::Update(u) = with_prototypes(1, &sums, true) else { unreachable!() };
        private_updates.push((id, u));
    }
    let inputs: Vec<(&str, &Update)> = private_updates.iter().map(|(c, u)| (*c, u)).collect();
    let state = e.core.privacy_mut().unwrap();
    let out = state.privatize(&inputs, &[block(&[0.0, 0.0])], 3, 3);
    let merged: Vec<_> = out[0].prototypes.iter().map(|p| (p.class, p.count, p.values().unwrap())).collect();
    assert!(out[1].prototypes.is_empty(), "one prototype per class, on the first update");
    assert_eq!(merged[0].1, 4);
    assert!((merged[0].2[0] - 0.5).abs() < 1e-6 && (merged[0].2[1] - 0.5).abs() < 1e-6, "{merged:?}");
    assert_eq!(merged[1].1, 4);
    assert!(merged[1].2[0].abs() < 1e-6 && (merged[1].2[1] - 1.0).abs() < 1e-6, "{merged:?}");
}

#[test]
fn configs_that_cannot_keep_the_promise_are_refused() {
    let on = private(1.0, None);
    let fedta = MethodConfig::FedTa(FedTaConfig::default());
    assert!(check_config(&on, &fedta).unwrap_err().to_string().contains("bgps = false"));
    let fedta_mean = MethodConfig::FedTa(FedTaConfig { bgps: false, ..FedTaConfig::default() });
    assert!(check_config(&on, &fedta_mean).is_ok());
    let fedavg = MethodConfig::FedAvg(Default::default());
    let mut median = on.clone();
    median.robust.aggregation = crate::aggregate::AggregationRule::Median;
    assert!(check_config(&median, &fedavg).unwrap_err().to_string().contains("mean rule"));
    let mut unreachable = on.clone();
    unreachable.privacy.noise_multiplier = None;
    unreachable.privacy.target_epsilon = Some(4.0);
    unreachable.rounds = 0;
    assert!(
        check_config(&unreachable, &fedavg).unwrap_err().to_string().contains("number of rounds"),
        "an ε spread over no end"
    );
    let mut eps = on;
    eps.privacy.noise_multiplier = None;
    eps.privacy.target_epsilon = Some(4.0);
    assert!(check_config(&eps, &fedavg).is_ok());
}

#[test]
fn buffered_versions_are_privatized_and_accounted_at_the_buffer_s_rate() {
    use super::tests::{buffered, dispatched};
    let config = EngineConfig { privacy: private(1e-9, None).privacy, noise_seed: Some(7), ..buffered(2, 3, 5) };
    let mut e = engine(config);
    let first = dispatched(&join(&mut e, secs(0), &["a", "b", "c", "d"]));
    e.handle_message(secs(1), &first[0].0, update(1, &[30.0, 40.0], 1_000_000));
    e.handle_message(secs(2), &first[1].0, update(1, &[0.0, 0.5], 1));
    let report = reports(&drain(&mut e)).pop().expect("two buffered updates make version 1");
    let g = global(&e);
    assert!((g[0] - 0.3).abs() < 1e-3 && (g[1] - 0.65).abs() < 1e-3, "clipped deltas, equal weights: {g:?}");
    let account = report.privacy.clone().expect("the version's report carries the account");
    assert_eq!(account.sampling_rate, 0.5, "a buffer of 2 of 4 connected devices");
    assert_eq!(account.rounds, 1);
}
