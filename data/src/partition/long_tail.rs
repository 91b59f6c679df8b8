//! Long-tailed class sizes with imbalance factor IF: `n_c = ⌊n_max · IF^(−c/(C−1))⌋` (Cao et al.
//! 2019, as used by GLDP): class 0 keeps `n_max`, the last class `⌊n_max / IF⌋`.

use anchorage_shared::rng::Rng;

use super::split::by_class;
use crate::DataError;

/// The class sizes `n_c = ⌊n_max · IF^(−c/(C−1))⌋` (at least 1), c = 0 … C−1.
pub fn long_tail_counts(n_max: usize, num_classes: usize, imbalance: f64) -> Vec<usize> {
    (0..num_classes)
        .map(|c| {
            let e = if num_classes > 1 { c as f64 / (num_classes - 1) as f64 } else { 0.0 };
            // A tiny epsilon keeps exact products (e.g. 500 · 0.1) from flooring one below.
            ((n_max as f64 * imbalance.powf(-e) + 1e-9).floor() as usize).max(1).min(n_max)
        })
        .collect()
}

/// A long-tailed subset of a labelled pool: `n_max` is the smallest class size, class c keeps a
/// seeded random `n_c` of its samples. Returns sorted indices into `labels`.
pub fn long_tail(labels: &[u32], num_classes: u32, imbalance: f64, seed: u64) -> Result<Vec<usize>, DataError> {
    if !(imbalance.is_finite() && imbalance >= 1.0) {
        return Err(DataError::Invalid(format!("imbalance factor must be ≥ 1, got {imbalance}")));
    }
    let by = by_class(labels, num_classes)?;
    let n_max = by.iter().map(Vec::len).min().unwrap_or(0);
    if n_max == 0 {
        return Err(DataError::Invalid("long tail needs at least one sample of every class".into()));
    }
    let counts = long_tail_counts(n_max, by.len(), imbalance);
    let mut rng = Rng::derive(seed, 0x1A11);
    let mut out = Vec::with_capacity(counts.iter().sum());
    for (mut idx, n) in by.into_iter().zip(counts) {
        rng.shuffle(&mut idx);
        out.extend_from_slice(&idx[..n]);
    }
    out.sort_unstable();
    Ok(out)
}

/// Measured imbalance factor of class counts: largest over smallest non-zero count (1 if none).
pub fn imbalance_factor(counts: &[u64]) -> f64 {
    let nz = counts.iter().copied().filter(|&c| c > 0);
    match (nz.clone().max(), nz.min()) {
        (Some(max), Some(min)) => max as f64 / min as f64,
        _ => 1.0,
    }
}
