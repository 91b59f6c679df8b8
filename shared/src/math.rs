//! The pure vector math shared by aggregation and prototype rules. One copy, used everywhere.

use alloc::vec;
use alloc::vec::Vec;

/// Weighted mean Σ w_i·x_i / Σ w_i of equally long vectors, accumulated in f64.
/// This is FedAvg's aggregation (McMahan et al., Eq. in Alg. 1) when w_i are sample counts.
/// Returns `None` for no input, a non-positive total weight, or vectors of different lengths.
pub fn weighted_mean(parts: &[(&[f32], f64)]) -> Option<Vec<f32>> {
    let mut mean = WeightedMean::new(parts.first()?.0.len());
    for (v, w) in parts {
        mean.add(v, *w)?;
    }
    mean.finish()
}

/// [`weighted_mean`] one part at a time (the same sums in the same order, so the same result):
/// an aggregator adds each update as it decodes it instead of holding them all.
#[derive(Debug, Clone)]
pub struct WeightedMean {
    acc: Vec<f64>,
    total: f64,
}

impl WeightedMean {
    pub fn new(dim: usize) -> Self {
        Self { acc: vec![0.0; dim], total: 0.0 }
    }

    /// Adds `v` with weight `w`; `None` (and nothing added) for a length other than the mean's or
    /// a weight that is negative or not finite.
    pub fn add(&mut self, v: &[f32], w: f64) -> Option<()> {
        if v.len() != self.acc.len() || !w.is_finite() || w < 0.0 {
            return None;
        }
        self.total += w;
        for (a, x) in self.acc.iter_mut().zip(v) {
            *a += w * (*x as f64);
        }
        Some(())
    }

    /// The mean; `None` when the weights add up to nothing.
    pub fn finish(self) -> Option<Vec<f32>> {
        let total = self.total;
        (total > 0.0).then(|| self.acc.into_iter().map(|a| (a / total) as f32).collect())
    }
}

/// Moving average `β·old + (1−β)·new` (GLDP Eq. 9 and Eq. 11; FedProK Eq. 9 for old classes).
pub fn moving_average(old: &[f32], new: &[f32], beta: f32) -> Option<Vec<f32>> {
    (old.len() == new.len()).then(|| old.iter().zip(new).map(|(o, n)| beta * o + (1.0 - beta) * n).collect())
}

/// Dot product.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Cosine similarity; 0 when either vector is zero.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let na = dot(a, a);
    let nb = dot(b, b);
    if na <= 0.0 || nb <= 0.0 {
        return 0.0;
    }
    dot(a, b) / (sqrt(na) * sqrt(nb))
}

/// Square root by Newton's method (no `std` here); exact enough for cosine normalisation.
fn sqrt(x: f32) -> f32 {
    if x <= 0.0 {
        return 0.0;
    }
    let mut y = if x > 1.0 { x / 2.0 } else { 1.0 };
    for _ in 0..40 {
        let next = 0.5 * (y + x / y);
        if (next - y).abs() <= f32::EPSILON * next {
            return next;
        }
        y = next;
    }
    y
}

/// Row-major matrix of pairwise cosine similarities.
pub fn cosine_matrix(rows: &[&[f32]]) -> Vec<f32> {
    let n = rows.len();
    let mut m = vec![0f32; n * n];
    for i in 0..n {
        for j in i..n {
            let c = cosine(rows[i], rows[j]);
            m[i * n + j] = c;
            m[j * n + i] = c;
        }
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_mean_weights_by_count() {
        let a = [1.0f32, 0.0];
        let b = [4.0f32, 3.0];
        let m = weighted_mean(&[(&a, 1.0), (&b, 2.0)]).unwrap();
        assert_eq!(m, vec![3.0, 2.0]);
    }

    #[test]
    fn weighted_mean_rejects_bad_input() {
        assert!(weighted_mean(&[]).is_none());
        assert!(weighted_mean(&[(&[1.0f32][..], 0.0)]).is_none());
        assert!(weighted_mean(&[(&[1.0f32][..], 1.0), (&[1.0f32, 2.0][..], 1.0)]).is_none());
        assert!(weighted_mean(&[(&[1.0f32][..], f64::NAN)]).is_none());
    }

    #[test]
    fn cosine_of_parallel_orthogonal_and_zero() {
        assert!((cosine(&[1.0, 2.0], &[2.0, 4.0]) - 1.0).abs() < 1e-6);
        assert!(cosine(&[1.0, 0.0], &[0.0, 3.0]).abs() < 1e-6);
        assert_eq!(cosine(&[0.0, 0.0], &[1.0, 1.0]), 0.0);
        let m = cosine_matrix(&[&[1.0, 0.0], &[0.0, 1.0], &[1.0, 1.0]]);
        assert!((m[2] - core::f32::consts::FRAC_1_SQRT_2).abs() < 1e-5);
        assert_eq!(m[2], m[6]);
    }

    #[test]
    fn moving_average_blends() {
        assert_eq!(moving_average(&[0.0, 2.0], &[2.0, 0.0], 0.75).unwrap(), vec![0.5, 1.5]);
        assert!(moving_average(&[0.0], &[1.0, 2.0], 0.5).is_none());
    }
}
