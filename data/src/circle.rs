//! FedEvolve's **Circle** set (after Wang et al., CIDA 2020): 30 evolving domains of 1,000 2-D
//! points each (30,000 in all). Domain k's points are a Gaussian with std 0.6 around a mean on the
//! upper half circle of radius 10: `μ_k = 10·(cos θ_k, sin θ_k)`, `θ_k = π·k/(D−1)` (k = 0 … D−1,
//! so the first mean is (10, 0) and the last (−10, 0)). The label is 1 outside the circle of
//! radius `r` around (0, 0) and 0 inside.
//!
//! **r = 10** (the radius of the means, [`CircleConfig::default`]): every domain is then split
//! about half and half, and the local decision boundary (the tangent at μ_k) turns with k — the
//! evolving concept shift the set is meant to show.

use anchorage_shared::rng::Rng;
use serde::{Deserialize, Serialize};

use crate::Dataset;

/// Knobs of the Circle set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CircleConfig {
    pub domains: usize,
    pub per_domain: usize,
    /// Radius of the half circle of domain means.
    pub mean_radius: f64,
    /// Standard deviation of each domain's Gaussian (both axes).
    pub std: f64,
    /// Radius `r` of the label boundary around (0, 0).
    pub boundary_radius: f64,
    pub seed: u64,
}

impl Default for CircleConfig {
    fn default() -> Self {
        Self { domains: 30, per_domain: 1000, mean_radius: 10.0, std: 0.6, boundary_radius: 10.0, seed: 0 }
    }
}

impl CircleConfig {
    /// The mean of domain `k`.
    pub fn mean(&self, k: usize) -> (f64, f64) {
        let theta = if self.domains > 1 { std::f64::consts::PI * k as f64 / (self.domains - 1) as f64 } else { 0.0 };
        (self.mean_radius * theta.cos(), self.mean_radius * theta.sin())
    }
}

/// One [`Dataset`] per domain: samples of shape `[2]` (x, y), 2 classes. Domain k draws from its
/// own stream of the seed, so domains are independent of each other's size.
pub fn generate(cfg: &CircleConfig) -> Vec<Dataset> {
    (0..cfg.domains)
        .map(|k| {
            let mut rng = Rng::derive(cfg.seed, 0xC1C1E + k as u64);
            let (mx, my) = cfg.mean(k);
            let mut features = Vec::with_capacity(2 * cfg.per_domain);
            let mut labels = Vec::with_capacity(cfg.per_domain);
            for _ in 0..cfg.per_domain {
                let x = mx + cfg.std * rng.normal();
                let y = my + cfg.std * rng.normal();
                features.extend_from_slice(&[x as f32, y as f32]);
                labels.push(u32::from((x * x + y * y).sqrt() > cfg.boundary_radius));
            }
            Dataset { sample_shape: vec![2], num_classes: 2, features, labels }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_specification() {
        let cfg = CircleConfig::default();
        let domains = generate(&cfg);
        assert_eq!(domains.len(), 30);
        assert_eq!(domains.iter().map(Dataset::len).sum::<usize>(), 30_000);
        for (k, d) in domains.iter().enumerate() {
            assert_eq!(d.sample_shape, vec![2]);
            let (mx, my) = cfg.mean(k);
            assert!(my >= -1e-9 && ((mx * mx + my * my).sqrt() - 10.0).abs() < 1e-9);
            let n = d.len() as f64;
            let (sx, sy) =
                (0..d.len()).fold((0.0, 0.0), |(a, b), i| (a + d.sample(i)[0] as f64, b + d.sample(i)[1] as f64));
            assert!((sx / n - mx).abs() < 0.1 && (sy / n - my).abs() < 0.1, "domain {k} mean");
            let var = (0..d.len()).map(|i| (d.sample(i)[0] as f64 - mx).powi(2)).sum::<f64>() / n;
            assert!((var.sqrt() - 0.6).abs() < 0.05, "domain {k} std {}", var.sqrt());
            let ones = d.labels.iter().filter(|&&l| l == 1).count() as f64 / n;
            assert!((0.4..0.6).contains(&ones), "domain {k}: class-1 share {ones}");
            for i in 0..d.len() {
                let s = d.sample(i);
                let r = ((s[0] as f64).powi(2) + (s[1] as f64).powi(2)).sqrt();
                assert_eq!(d.labels[i], u32::from(r > 10.0));
            }
        }
        assert_eq!(cfg.mean(0), (10.0, 0.0));
        assert!((cfg.mean(29).0 + 10.0).abs() < 1e-9);
        assert_eq!(generate(&cfg), domains);
        assert_ne!(generate(&CircleConfig { seed: 1, ..cfg }), domains);
    }
}
