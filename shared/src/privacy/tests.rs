//! The accountant against Google's dp-accounting, and the properties ε must have.
//!
//! Every table below is the output of `shared/src/privacy/reference.py`, run with dp-accounting 0.6.0
//! (Python 3, `pip install dp-accounting==0.6.0` in a fresh venv) as
//! `python shared/src/privacy/reference.py`: RDP from `_compute_rdp_poisson_subsampled_gaussian`, ε and
//! the best order from `RdpAccountant(DEFAULT_RDP_ORDERS).get_epsilon_and_optimal_order(1e-5)`, σ from
//! `calibrate_dp_mechanism` (Brent, tol 1e-12). All at δ = 1e-5.
//!
//! Tolerance: a relative 1e-6. The two implementations share the algorithm but not
//! the special functions (libm's `lgamma`/`erfc` against scipy's `gammaln`/`log_ndtr`), which differ in
//! the last bits only; agreement is in fact ~1e-12, so 1e-6 still catches any wrong term.

use super::accountant::*;
use alloc::vec::Vec;
use proptest::prelude::*;

const DELTA: f64 = 1e-5;
const TOL: f64 = 1e-6;

/// (q, σ, order, RDP of one round); ∞ where dp-accounting's fractional series gives up.
const RDP: &[(f64, f64, f64, f64)] = &[
    (0.01, 1.1, 1.5, 9.858756968009191e-05),
    (0.01, 1.1, 2.0, 0.00012851008160516542),
    (0.01, 1.1, 3.7, 0.0002452953902361313),
    (0.01, 1.1, 10.5, 0.00096727134933067),
    (0.01, 1.1, 32.0, 8.469416433675926),
    (0.01, 1.1, 1024.0, 418.53082404914505),
    (0.1, 0.5, 1.5, f64::INFINITY),
    (0.1, 0.5, 2.0, 0.4291695905978999),
    (0.1, 0.5, 3.7, 4.244863853265197),
    (0.1, 0.5, 10.5, 18.455037528796055),
    (0.1, 0.5, 32.0, 61.62313796852228),
    (0.1, 0.5, 1024.0, 2045.6951640906882),
    (0.1, 4.0, 1.5, 0.0008364841890747316),
    (0.1, 4.0, 2.0, 0.0006447367017961714),
    (0.1, 4.0, 3.7, 0.0012053309366519209),
    (0.1, 4.0, 10.5, 0.003566267324047623),
    (0.1, 4.0, 32.0, 0.012720223446929526),
    (0.1, 4.0, 1024.0, 29.695164090688266),
    (1.0, 1.0, 1.5, 0.75),
    (1.0, 1.0, 2.0, 1.0),
    (1.0, 1.0, 3.7, 1.85),
    (1.0, 1.0, 10.5, 5.25),
    (1.0, 1.0, 32.0, 16.0),
    (1.0, 1.0, 1024.0, 512.0),
];

/// (q, σ, rounds, ε, best order).
const EPSILON: &[(f64, f64, u64, f64, f64)] = &[
    (0.01, 1.1, 1, 0.7751031255879707, 12.0),
    (0.01, 1.1, 100, 0.9560911044993916, 10.7),
    (0.01, 1.1, 1000, 1.7117701662429012, 9.6),
    (0.01, 0.5, 1000, 15.4721334181956, 2.0),
    (0.01, 4.0, 1000, 0.3011611585547749, 48.0),
    (0.1, 1.0, 1, 2.1330059954307927, 6.0),
    (0.1, 1.0, 100, 7.903850223578231, 3.2),
    (0.1, 0.5, 100, 36.96666522047155, 1.7),
    (0.1, 1.1, 1000, 22.824272075126245, 2.1),
    (0.1, 4.0, 1000, 3.7362417078948433, 6.3),
    (1.0, 1.0, 1, 4.728507067217623, 5.4),
    (1.0, 4.0, 100, 14.132226163159334, 2.8),
    (1.0, 1.1, 1000, 550.7290286666946, 1.2),
    (1.0, 0.5, 1, 10.725509696418232, 3.3),
];

/// 100 rounds at (0.01, 1.1), then 10 at (0.1, 4.0), then 1 at (1.0, 4.0): (ε, best order).
const HETEROGENEOUS: (f64, f64) = (1.3245896450958499, 10.6);

/// (q, rounds, target ε, σ).
const SIGMA: &[(f64, u64, f64, f64)] =
    &[(0.01, 1000, 1.0, 1.513122162607205), (0.1, 100, 3.0, 1.7961439801345152), (1.0, 10, 8.0, 2.0164901812655818)];

fn close(got: f64, want: f64) -> bool {
    (got - want).abs() <= TOL * want.abs() || (got.is_infinite() && got == want)
}

fn eps(q: f64, sigma: f64, rounds: u64) -> f64 {
    let mut acc = Accountant::with_default_orders(DELTA).unwrap();
    acc.compose(q, sigma, rounds).unwrap();
    acc.epsilon().0
}

#[test]
fn default_orders_are_dp_accountings() {
    let orders = default_orders();
    assert_eq!(orders.len(), DEFAULT_ORDERS_LEN);
    assert_eq!(&orders[..3], &[1.1, 1.2, 1.3]);
    assert_eq!(orders[98], 10.9);
    assert_eq!(&orders[99..101], &[11.0, 12.0]);
    assert_eq!(&orders[151..], &[63.0, 128.0, 256.0, 512.0, 1024.0]);
}

#[test]
fn rdp_matches_dp_accounting() {
    for &(q, sigma, order, want) in RDP {
        let got = rdp_sampled_gaussian(q, sigma, order).unwrap();
        assert!(close(got, want), "q={q} sigma={sigma} order={order}: {got} vs {want}");
    }
}

#[test]
fn epsilon_matches_dp_accounting() {
    for &(q, sigma, rounds, want, order) in EPSILON {
        let mut acc = Accountant::with_default_orders(DELTA).unwrap();
        acc.compose(q, sigma, rounds).unwrap();
        let (got, best) = acc.epsilon();
        assert!(close(got, want), "q={q} sigma={sigma} rounds={rounds}: {got} vs {want}");
        assert_eq!(best, order, "q={q} sigma={sigma} rounds={rounds}");
        assert_eq!(acc.rounds(), rounds);
    }
}

#[test]
fn heterogeneous_rounds_match_dp_accounting() {
    let mut acc = Accountant::with_default_orders(DELTA).unwrap();
    acc.compose(0.01, 1.1, 100).unwrap();
    for _ in 0..10 {
        acc.step(0.1, 4.0).unwrap();
    }
    acc.step(1.0, 4.0).unwrap();
    let (got, order) = acc.epsilon();
    assert!(close(got, HETEROGENEOUS.0), "{got} vs {}", HETEROGENEOUS.0);
    assert_eq!(order, HETEROGENEOUS.1);
    // The last round alone is one plain Gaussian round at σ = 4.
    let last = acc.epsilon_of_last_round().unwrap();
    let mut one = Accountant::with_default_orders(DELTA).unwrap();
    one.step(1.0, 4.0).unwrap();
    assert_eq!(last, one.epsilon());
}

#[test]
fn per_round_epsilon_is_the_one_round_reference() {
    let mut acc = Accountant::with_default_orders(DELTA).unwrap();
    assert_eq!(acc.epsilon_of_last_round(), None);
    assert_eq!(acc.epsilon(), (0.0, 1.1));
    acc.compose(0.01, 1.1, 1000).unwrap();
    let (per_round, order) = acc.epsilon_of_last_round().unwrap();
    assert!(close(per_round, 0.7751031255879707), "{per_round}");
    assert_eq!(order, 12.0);
}

#[test]
fn noise_multiplier_matches_dp_accounting() {
    let orders = default_orders();
    for &(q, rounds, target, want) in SIGMA {
        let got = noise_multiplier_for(target, DELTA, q, rounds, &orders).unwrap();
        assert!(close(got, want), "q={q} rounds={rounds} eps={target}: {got} vs {want}");
        assert!(eps(q, got, rounds) <= target);
    }
}

#[test]
fn epsilon_if_leaves_the_accountant_alone() {
    let mut acc = Accountant::with_default_orders(DELTA).unwrap();
    acc.compose(0.01, 1.1, 100).unwrap();
    let before = acc.clone();
    let (next, _) = acc.epsilon_if(0.01, 1.1, 900).unwrap();
    assert_eq!(acc, before);
    assert!(close(next, 1.7117701662429012), "{next}");
}

#[test]
fn bad_parameters_are_errors() {
    let orders = default_orders();
    for q in [0.0, -0.1, 1.5] {
        assert_eq!(rdp_sampled_gaussian(q, 1.0, 2.0), Err(PrivacyError::SamplingRate(q)));
    }
    for s in [0.0, -1.0, f64::INFINITY] {
        assert_eq!(rdp_sampled_gaussian(0.1, s, 2.0), Err(PrivacyError::NoiseMultiplier(s)));
    }
    assert!(matches!(rdp_sampled_gaussian(0.1, f64::NAN, 2.0), Err(PrivacyError::NoiseMultiplier(_))));
    for a in [1.0, 0.5, MAX_ORDER + 1.0] {
        assert_eq!(rdp_sampled_gaussian(0.1, 1.0, a), Err(PrivacyError::Order(a)));
    }
    for d in [0.0, 1.0, -1e-5] {
        assert_eq!(Accountant::new(d, orders.clone()), Err(PrivacyError::Delta(d)));
    }
    assert!(matches!(Accountant::new(f64::NAN, orders.clone()), Err(PrivacyError::Delta(_))));
    assert_eq!(Accountant::new(DELTA, Vec::new()), Err(PrivacyError::NoOrders));
    assert_eq!(epsilon_from_rdp(&orders, &[0.0], DELTA), Err(PrivacyError::Lengths { orders: 156, rdp: 1 }));
    assert!(matches!(epsilon_from_rdp(&[2.0], &[f64::NAN], DELTA), Err(PrivacyError::Rdp(_))));
    let mut acc = Accountant::with_default_orders(DELTA).unwrap();
    assert!(acc.step(0.1, 0.0).is_err() && acc.step(2.0, 1.0).is_err() && acc.compose(0.1, -1.0, 0).is_err());
    assert_eq!(acc.rounds(), 0);
    assert!(matches!(noise_multiplier_for(0.0, DELTA, 0.1, 10, &orders), Err(PrivacyError::TargetEpsilon(_))));
    assert!(matches!(noise_multiplier_for(f64::NAN, DELTA, 0.1, 10, &orders), Err(PrivacyError::TargetEpsilon(_))));
    assert_eq!(noise_multiplier_for(1.0, DELTA, 0.1, 0, &orders), Err(PrivacyError::NoRounds));
}

/// NaN is never equal to itself, so NaN errors are compared by kind.
#[test]
fn nan_sampling_rate_is_an_error() {
    assert!(matches!(rdp_sampled_gaussian(f64::NAN, 1.0, 2.0), Err(PrivacyError::SamplingRate(_))));
}

#[test]
fn unreachable_target_is_an_error() {
    // Orders at or below 1.01 give no bound at all, so no σ reaches any ε.
    assert_eq!(noise_multiplier_for(1.0, DELTA, 0.1, 10, &[1.005]), Err(PrivacyError::Unreachable(1.0)));
}

#[test]
fn state_round_trips_and_bad_state_is_refused() {
    let mut acc = Accountant::with_default_orders(DELTA).unwrap();
    acc.compose(0.1, 0.5, 3).unwrap();
    let bytes = postcard::to_allocvec(&acc).unwrap();
    let back: Accountant = postcard::from_bytes(&bytes).unwrap();
    assert_eq!(back, acc);
    assert_eq!(back.epsilon(), acc.epsilon());
    assert_eq!(back.epsilon_of_last_round(), acc.epsilon_of_last_round());

    let bad = Accountant::new(DELTA, alloc::vec![2.0, 3.0]).unwrap();
    let mut bytes = postcard::to_allocvec(&bad).unwrap();
    bytes[0..8].copy_from_slice(&2.0f64.to_le_bytes()); // δ = 2
    assert!(postcard::from_bytes::<Accountant>(&bytes).is_err());
}

// Monotone up to the fractional orders' series: where it stops before it converges (small σ, large q; dp-accounting
// does the same) those orders count as ∞ and the best order moves, so ε may go the wrong way by a hair. Seen:
// q = 0.754, σ = 0.735, 886 rounds: ε 1010.314, and 1010.294 at 1.25 q (orders 1.3 to 1.6 ∞ at q only). Hence σ
// from 0.5 and a relative 1e-3.
proptest! {
    // A fixed seed: the same 24 cases on every run, so that CI sees what a developer sees.
    #![proptest_config(ProptestConfig {
        cases: 24,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x5eed_ac0c),
        ..ProptestConfig::default()
    })]

    #[test]
    fn epsilon_falls_with_sigma(q in 0.001f64..1.0, sigma in 0.5f64..8.0, rounds in 1u64..2000) {
        prop_assert!(eps(q, sigma * 1.25, rounds) <= eps(q, sigma, rounds) * (1.0 + 1e-3));
    }

    #[test]
    fn epsilon_grows_with_rounds(q in 0.001f64..1.0, sigma in 0.5f64..8.0, rounds in 1u64..2000) {
        prop_assert!(eps(q, sigma, rounds + 1 + rounds / 2) >= eps(q, sigma, rounds) * (1.0 - 1e-3));
    }

    #[test]
    fn epsilon_grows_with_q(q in 0.001f64..0.8, sigma in 0.5f64..8.0, rounds in 1u64..2000) {
        prop_assert!(eps(q * 1.25, sigma, rounds) >= eps(q, sigma, rounds) * (1.0 - 1e-3));
    }

    #[test]
    fn noise_multiplier_round_trips(q in 0.001f64..1.0, rounds in 1u64..1000, target in 0.2f64..20.0) {
        let sigma = noise_multiplier_for(target, DELTA, q, rounds, &default_orders()).unwrap();
        prop_assert!(eps(q, sigma, rounds) <= target);
        prop_assert!(sigma <= MIN_SIGMA || eps(q, sigma * 0.999, rounds) > target);
    }
}
