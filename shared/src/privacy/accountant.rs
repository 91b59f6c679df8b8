//! A Rényi-DP accountant for the Poisson-sampled Gaussian mechanism.
//!
//! Each round a client's update is clipped, sampled with probability `q` and noised with a Gaussian of
//! standard deviation `σ` times the clipping norm. This module computes what that costs:
//!
//! 1. The RDP of one round at each order α (Mironov, Talwar, Zhang 2019, "Rényi Differential Privacy of
//!    the Sampled Gaussian Mechanism", arXiv:1908.10530): RDP(α) = log A_α / (α − 1), with A_α the
//!    closed-form binomial sum for integer α and the two-sided erfc series of their §3.3 for fractional α,
//!    both in log space as in tensorflow_privacy / dp-accounting (`_compute_log_a_int`,
//!    `_compute_log_a_frac`). For q = 1 it is the plain Gaussian, α / (2σ²) (Mironov 2017, Prop. 7).
//! 2. Composition: RDP at a fixed order adds over rounds (Mironov 2017, Prop. 1), also across rounds with
//!    other `q` or `σ`.
//! 3. Conversion to (ε, δ) with the improved bound of Balle et al. 2020 ("Hypothesis testing
//!    interpretations and Rényi DP", arXiv:2004.00010, Prop. 12) and Canonne, Kamath, Steinke 2020
//!    (arXiv:2001.05990, eq. 20): ε = RDP(α) + log((α − 1)/α) − (log δ + log α)/(α − 1), minimised over
//!    the orders; as dp-accounting's `compute_epsilon`, an order at or below 1.01 gives no bound and a
//!    round whose RDP is so small that δ² > 1 − e^(−RDP) costs ε = 0 (the KL bound).
//! 4. The inverse: the smallest σ that reaches a target ε at δ after T rounds at rate q, by bisection, as
//!    Opacus' `get_noise_multiplier` does (to a relative 1e-12 in σ rather than Opacus' 0.01 in ε).
//!
//! The numbers follow Google's dp-accounting `RdpAccountant` (0.6.0) to the last few bits, including its
//! one quirk: the fractional series sums |binomial(α, i)| and gives up after 1000 terms when it has not
//! converged (small σ with large q), and that order then counts as RDP = ∞ (it is dropped from the
//! minimum, which can only make ε larger, never smaller). The default orders are dp-accounting's
//! `DEFAULT_RDP_ORDERS` (1.1, 1.2, …, 10.9, then 11..=63, 128, 256, 512, 1024), not Opacus'
//! `DEFAULT_ALPHAS` (which stop at 63 and start the integers at 12).
//!
//! Why our own: the Rust crates that do RDP accounting are either parts of large frameworks whose
//! accountants answer other questions (opendp's combinators and zCDP/approximate-DP measures), or
//! approximate it differently (optirs-core 0.3 evaluates a fractional α at ⌈α⌉; entrenar's accountant is
//! one piece of a training framework), and none is checked against dp-accounting. The math here is
//! ~200 lines on `libm`, so it stays `no_std` like the rest of this crate.

use alloc::vec::Vec;
use serde::{Deserialize, Serialize};

/// Terms of the fractional-order series before that order is given up as RDP = ∞ (dp-accounting's
/// `_MAX_STEPS_LOG_A_FRAC`).
const MAX_FRAC_STEPS: u32 = 1000;
/// The largest order accepted: the integer-order sum has α + 1 terms.
pub const MAX_ORDER: f64 = 65_536.0;
/// The largest noise multiplier [`noise_multiplier_for`] tries before it says the target is unreachable.
pub const MAX_SIGMA: f64 = 1.0e6;
/// Below this noise multiplier [`noise_multiplier_for`] stops looking for a smaller one.
pub const MIN_SIGMA: f64 = 1.0e-6;
/// How many orders [`default_orders`] returns.
pub const DEFAULT_ORDERS_LEN: usize = 156;

/// What a bad parameter is; no function here panics on its input.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum PrivacyError {
    /// A sampling rate q outside (0, 1].
    #[error("sampling rate {0} is not in (0, 1]")]
    SamplingRate(f64),
    /// A noise multiplier σ that is not finite and above 0.
    #[error("noise multiplier {0} is not a finite number above 0")]
    NoiseMultiplier(f64),
    /// A δ outside (0, 1).
    #[error("delta {0} is not in (0, 1)")]
    Delta(f64),
    /// An RDP order α outside (1, [`MAX_ORDER`]], or NaN.
    #[error("RDP order {0} is not a number in (1, {MAX_ORDER}]")]
    Order(f64),
    /// An empty list of orders.
    #[error("no RDP orders given")]
    NoOrders,
    /// Orders and RDP values of different lengths.
    #[error("{orders} orders but {rdp} RDP values")]
    Lengths {
        /// Number of orders.
        orders: usize,
        /// Number of RDP values.
        rdp: usize,
    },
    /// An RDP value below 0 or NaN.
    #[error("RDP value {0} is not a number at or above 0")]
    Rdp(f64),
    /// A target ε that is not finite and above 0.
    #[error("target epsilon {0} is not a finite number above 0")]
    TargetEpsilon(f64),
    /// Zero rounds.
    #[error("the number of rounds must be at least 1")]
    NoRounds,
    /// A target ε that no noise multiplier up to [`MAX_SIGMA`] reaches.
    #[error("no noise multiplier up to {MAX_SIGMA} reaches epsilon {0}")]
    Unreachable(f64),
}

/// dp-accounting's `DEFAULT_RDP_ORDERS`: `[1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) +
/// [128, 256, 512, 1024]`.
pub fn default_orders() -> Vec<f64> {
    let mut orders: Vec<f64> = (1..100).map(|x| 1.0 + f64::from(x) / 10.0).collect();
    orders.extend((11..64).map(f64::from));
    orders.extend([128.0, 256.0, 512.0, 1024.0]);
    orders
}

fn check_q(q: f64) -> Result<(), PrivacyError> {
    if q > 0.0 && q <= 1.0 { Ok(()) } else { Err(PrivacyError::SamplingRate(q)) }
}

fn check_sigma(sigma: f64) -> Result<(), PrivacyError> {
    if sigma > 0.0 && sigma.is_finite() { Ok(()) } else { Err(PrivacyError::NoiseMultiplier(sigma)) }
}

fn check_delta(delta: f64) -> Result<(), PrivacyError> {
    if delta > 0.0 && delta < 1.0 { Ok(()) } else { Err(PrivacyError::Delta(delta)) }
}

fn check_orders(orders: &[f64]) -> Result<(), PrivacyError> {
    if orders.is_empty() {
        return Err(PrivacyError::NoOrders);
    }
    match orders.iter().find(|&&a| !(a > 1.0 && a <= MAX_ORDER)) {
        Some(&bad) => Err(PrivacyError::Order(bad)),
        None => Ok(()),
    }
}

/// log(eˣ + eʸ) without overflow.
fn log_add(x: f64, y: f64) -> f64 {
    let (a, b) = if x < y { (x, y) } else { (y, x) };
    if a == f64::NEG_INFINITY || b == f64::INFINITY {
        return b;
    }
    libm::log1p(libm::exp(a - b)) + b
}

/// log |binomial(n, k)| through log |Γ|, so that n may be fractional (scipy's `gammaln` is log |Γ| too).
fn log_comb(n: f64, k: f64) -> f64 {
    libm::lgamma(n + 1.0) - libm::lgamma(k + 1.0) - libm::lgamma(n - k + 1.0)
}

/// log erfc(x): libm's erfc while it is a normal number, beyond that the Laurent series at infinity
/// dp-accounting falls back to, erfc(x) ≈ exp(−x² − ½x⁻² + ⅝x⁻⁴ − 37/24 x⁻⁶ + 353/64 x⁻⁸) / (x√π).
fn log_erfc(x: f64) -> f64 {
    if x < 25.0 {
        return libm::log(libm::erfc(x));
    }
    let inv = 1.0 / (x * x);
    let series = inv * (-0.5 + inv * (0.625 + inv * (-37.0 / 24.0 + inv * 353.0 / 64.0)));
    -0.5 * libm::log(core::f64::consts::PI) - libm::log(x) - x * x + series
}

/// log A_α for integer α and 0 < q < 1 (MTZ 2019 §3.3):
/// A_α = Σ_{i=0..α} binom(α, i) qⁱ (1 − q)^(α−i) exp((i² − i) / (2σ²)).
fn log_a_int(q: f64, sigma: f64, alpha: u32) -> f64 {
    let (log_q, log_1mq, a) = (libm::log(q), libm::log1p(-q), f64::from(alpha));
    (0..=alpha).fold(f64::NEG_INFINITY, |acc, i| {
        let i = f64::from(i);
        let s = log_comb(a, i) + i * log_q + (a - i) * log_1mq + (i * i - i) / (2.0 * sigma * sigma);
        log_add(acc, s)
    })
}

/// The i-th terms of the two halves of A_α for fractional α (MTZ 2019 §3.3): the integrals over
/// (−∞, z₀] and [z₀, ∞), z₀ = σ² log(1/q − 1) + ½, each expanded as a binomial series whose terms carry
/// ½ erfc((i − z₀)/(√2σ)) and ½ erfc((z₀ − j)/(√2σ)), j = α − i.
fn frac_terms(q: f64, sigma: f64, alpha: f64, z0: f64, i: f64) -> (f64, f64) {
    let (log_q, log_1mq, two_s2) = (libm::log(q), libm::log1p(-q), 2.0 * sigma * sigma);
    let (j, c, root) = (alpha - i, log_comb(alpha, i), core::f64::consts::SQRT_2 * sigma);
    let half = -core::f64::consts::LN_2;
    let s0 = c + i * log_q + j * log_1mq + (i * i - i) / two_s2 + half + log_erfc((i - z0) / root);
    let s1 = c + j * log_q + i * log_1mq + (j * j - j) / two_s2 + half + log_erfc((z0 - j) / root);
    (s0, s1)
}

/// log A_α for fractional α and 0 < q < 1: the series of [`frac_terms`], stopped when both halves'
/// terms decrease and lie e³⁰ below the total; ∞ when that has not happened after 1000 terms.
fn log_a_frac(q: f64, sigma: f64, alpha: f64) -> f64 {
    let z0 = sigma * sigma * libm::log(1.0 / q - 1.0) + 0.5;
    let (mut a0, mut a1) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
    let (mut last0, mut last1) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
    for i in 0..MAX_FRAC_STEPS {
        let (s0, s1) = frac_terms(q, sigma, alpha, z0, f64::from(i));
        a0 = log_add(a0, s0);
        a1 = log_add(a1, s1);
        let total = log_add(a0, a1);
        if s0 < last0 && s1 < last1 && s0.max(s1) < total - 30.0 {
            return total;
        }
        (last0, last1) = (s0, s1);
    }
    f64::INFINITY
}

/// RDP of one round at `order`, parameters already checked.
fn rdp_unchecked(q: f64, sigma: f64, order: f64) -> f64 {
    if q == 1.0 {
        return order / (2.0 * sigma * sigma);
    }
    let log_a = if order == libm::floor(order) {
        // check_orders keeps the order at or below MAX_ORDER, so it fits a u32.
        log_a_int(q, sigma, order as u32)
    } else {
        log_a_frac(q, sigma, order)
    };
    log_a / (order - 1.0)
}

fn rdp_orders_unchecked(q: f64, sigma: f64, orders: &[f64]) -> Vec<f64> {
    orders.iter().map(|&a| rdp_unchecked(q, sigma, a)).collect()
}

/// The RDP of one round of the Poisson-sampled Gaussian mechanism with sampling rate `q` and noise
/// multiplier `sigma` at `order` (may be ∞ where the fractional series does not converge).
pub fn rdp_sampled_gaussian(q: f64, sigma: f64, order: f64) -> Result<f64, PrivacyError> {
    check_q(q)?;
    check_sigma(sigma)?;
    check_orders(&[order])?;
    Ok(rdp_unchecked(q, sigma, order))
}

/// [`rdp_sampled_gaussian`] at each of `orders`.
pub fn rdp_sampled_gaussian_orders(q: f64, sigma: f64, orders: &[f64]) -> Result<Vec<f64>, PrivacyError> {
    check_q(q)?;
    check_sigma(sigma)?;
    check_orders(orders)?;
    Ok(rdp_orders_unchecked(q, sigma, orders))
}

/// ε at one order (Balle et al. 2020, Prop. 12), with dp-accounting's two special cases.
fn epsilon_at(order: f64, rdp: f64, delta: f64) -> f64 {
    if rdp < 0.0 || delta * delta + libm::expm1(-rdp) > 0.0 {
        0.0
    } else if order > 1.01 {
        rdp + libm::log1p(-1.0 / order) - libm::log(delta * order) / (order - 1.0)
    } else {
        f64::INFINITY
    }
}

/// The smallest ε over the orders and the order that gives it (the first on a tie; the first order and
/// ε = ∞ when none gives a bound). Checked inputs.
fn best_epsilon(orders: &[f64], rdp: &[f64], delta: f64) -> (f64, f64) {
    let mut best = (f64::INFINITY, orders.first().copied().unwrap_or(f64::NAN));
    for (&order, &r) in orders.iter().zip(rdp) {
        let eps = epsilon_at(order, r, delta);
        if eps < best.0 {
            best = (eps, order);
        }
    }
    (best.0.max(0.0), best.1)
}

/// (ε, best order) at `delta` for the accumulated RDP values `rdp` at `orders`.
pub fn epsilon_from_rdp(orders: &[f64], rdp: &[f64], delta: f64) -> Result<(f64, f64), PrivacyError> {
    check_delta(delta)?;
    check_orders(orders)?;
    if orders.len() != rdp.len() {
        return Err(PrivacyError::Lengths { orders: orders.len(), rdp: rdp.len() });
    }
    match rdp.iter().find(|r| r.is_nan() || **r < 0.0) {
        Some(&bad) => Err(PrivacyError::Rdp(bad)),
        None => Ok(best_epsilon(orders, rdp, delta)),
    }
}

/// ε at `delta` after `rounds` rounds at sampling rate `q`, each round composing one Gaussian
/// mechanism of multiplier `sigma · s` per `s` in `scales`; checked inputs.
fn epsilon_of_rounds(q: f64, sigma: f64, scales: &[f64], rounds: u64, orders: &[f64], delta: f64) -> f64 {
    let mut rdp = alloc::vec![0.0; orders.len()];
    for s in scales {
        for (total, r) in rdp.iter_mut().zip(rdp_orders_unchecked(q, sigma * s, orders)) {
            *total += rounds as f64 * r;
        }
    }
    best_epsilon(orders, &rdp, delta).0
}

/// The smallest noise multiplier σ (to a relative 1e-12) with ε ≤ `target_epsilon` at `delta` after
/// `rounds` rounds at sampling rate `q`, over `orders`; found by doubling from σ = 1 to bracket it and
/// then bisection, as Opacus' `get_noise_multiplier`. Returns [`MIN_SIGMA`] when even that reaches the
/// target, and [`PrivacyError::Unreachable`] when [`MAX_SIGMA`] does not.
pub fn noise_multiplier_for(
    target_epsilon: f64,
    delta: f64,
    q: f64,
    rounds: u64,
    orders: &[f64],
) -> Result<f64, PrivacyError> {
    noise_multiplier_for_mechanisms(target_epsilon, delta, q, rounds, orders, &[1.0])
}

/// [`noise_multiplier_for`] where each round releases several Gaussian mechanisms at once, of
/// multipliers σ·s for each `s` in `scales` (a server under `[privacy]` that noises a method's
/// update deltas, σ, and its prototype sums and counts, σ/√2 for the pair).
pub fn noise_multiplier_for_mechanisms(
    target_epsilon: f64,
    delta: f64,
    q: f64,
    rounds: u64,
    orders: &[f64],
    scales: &[f64],
) -> Result<f64, PrivacyError> {
    if !(target_epsilon > 0.0 && target_epsilon.is_finite()) {
        return Err(PrivacyError::TargetEpsilon(target_epsilon));
    }
    check_delta(delta)?;
    check_q(q)?;
    check_orders(orders)?;
    if rounds == 0 {
        return Err(PrivacyError::NoRounds);
    }
    if scales.is_empty() || scales.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
        return Err(PrivacyError::NoiseMultiplier(scales.first().copied().unwrap_or(0.0)));
    }
    let meets = |sigma: f64| epsilon_of_rounds(q, sigma, scales, rounds, orders, delta) <= target_epsilon;
    let mut hi = 1.0;
    while !meets(hi) {
        hi *= 2.0;
        if hi > MAX_SIGMA {
            return Err(PrivacyError::Unreachable(target_epsilon));
        }
    }
    let mut lo = hi / 2.0;
    while meets(lo) {
        if lo <= MIN_SIGMA {
            return Ok(MIN_SIGMA);
        }
        (hi, lo) = (lo, lo / 2.0);
    }
    while hi - lo > 1.0e-12 * hi {
        let mid = 0.5 * (lo + hi);
        if meets(mid) { hi = mid } else { lo = mid }
    }
    Ok(hi)
}

/// The privacy spent so far by a run: the RDP summed over its rounds at each order, and the last round's
/// own, so that a server can report ε per round and in total and persist the state between restarts.
/// Deserialising checks the state as [`Accountant::new`] checks its arguments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "AccountantState")]
pub struct Accountant {
    delta: f64,
    orders: Vec<f64>,
    rdp: Vec<f64>,
    last_round: Vec<f64>,
    rounds: u64,
}

/// The unchecked form [`Accountant`] deserialises through.
#[derive(Deserialize)]
struct AccountantState {
    delta: f64,
    orders: Vec<f64>,
    rdp: Vec<f64>,
    last_round: Vec<f64>,
    rounds: u64,
}

impl TryFrom<AccountantState> for Accountant {
    type Error = PrivacyError;

    fn try_from(s: AccountantState) -> Result<Self, PrivacyError> {
        epsilon_from_rdp(&s.orders, &s.rdp, s.delta)?;
        if !s.last_round.is_empty() {
            epsilon_from_rdp(&s.orders, &s.last_round, s.delta)?;
        }
        Ok(Self { delta: s.delta, orders: s.orders, rdp: s.rdp, last_round: s.last_round, rounds: s.rounds })
    }
}

impl Accountant {
    /// An accountant that reports ε at `delta`, tracking RDP at `orders` (each in (1, [`MAX_ORDER`])).
    pub fn new(delta: f64, orders: Vec<f64>) -> Result<Self, PrivacyError> {
        check_delta(delta)?;
        check_orders(&orders)?;
        let rdp = alloc::vec![0.0; orders.len()];
        Ok(Self { delta, orders, rdp, last_round: Vec::new(), rounds: 0 })
    }

    /// [`Accountant::new`] at [`default_orders`].
    pub fn with_default_orders(delta: f64) -> Result<Self, PrivacyError> {
        Self::new(delta, default_orders())
    }

    /// One round at sampling rate `q` and noise multiplier `sigma`.
    pub fn step(&mut self, q: f64, sigma: f64) -> Result<(), PrivacyError> {
        self.compose(q, sigma, 1)
    }

    /// `rounds` rounds at (`q`, `sigma`); zero rounds checks the parameters and changes nothing.
    pub fn compose(&mut self, q: f64, sigma: f64, rounds: u64) -> Result<(), PrivacyError> {
        check_q(q)?;
        check_sigma(sigma)?;
        if rounds == 0 {
            return Ok(());
        }
        let one = rdp_orders_unchecked(q, sigma, &self.orders);
        for (total, r) in self.rdp.iter_mut().zip(&one) {
            *total += rounds as f64 * r;
        }
        self.last_round = one;
        self.rounds = self.rounds.saturating_add(rounds);
        Ok(())
    }

    /// (ε, best order) at this accountant's δ over every round so far; (0, first order) before any.
    pub fn epsilon(&self) -> (f64, f64) {
        best_epsilon(&self.orders, &self.rdp, self.delta)
    }

    /// (ε, best order) of the last round alone; `None` before the first.
    pub fn epsilon_of_last_round(&self) -> Option<(f64, f64)> {
        (!self.last_round.is_empty()).then(|| best_epsilon(&self.orders, &self.last_round, self.delta))
    }

    /// What [`Accountant::epsilon`] would say after `rounds` more rounds at (`q`, `sigma`), leaving this
    /// accountant as it is (for a server that refuses a round over its budget).
    pub fn epsilon_if(&self, q: f64, sigma: f64, rounds: u64) -> Result<(f64, f64), PrivacyError> {
        let mut next = self.clone();
        next.compose(q, sigma, rounds)?;
        Ok(next.epsilon())
    }

    /// The δ at which ε is reported.
    pub fn delta(&self) -> f64 {
        self.delta
    }

    /// The RDP orders tracked.
    pub fn orders(&self) -> &[f64] {
        &self.orders
    }

    /// The RDP summed over all rounds, one value per order.
    pub fn rdp(&self) -> &[f64] {
        &self.rdp
    }

    /// How many rounds have been composed.
    pub fn rounds(&self) -> u64 {
        self.rounds
    }
}
