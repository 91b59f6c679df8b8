//! FedEvolve's **Circle** set: 30 evolving domains of 2-D points, two classes. Three definitions,
//! chosen by `kind` (`[data.circle] kind = "..."`, or `[data] circle = "..."` for a kind's
//! defaults):
//!
//! - **`fixed`** (the default, this project's first Circle, after Wang et al., CIDA 2020): domain
//!   k's points are a Gaussian with std 0.6 around a mean on the upper half circle of radius 10,
//!   `μ_k = 10·(cos θ_k, sin θ_k)`, `θ_k = π·k/(D−1)`; the label is 1 outside the circle of
//!   radius `r` = 10 around (0, 0) and 0 inside. Every domain is split about half and half, and
//!   the local decision boundary (the tangent at μ_k) turns with k.
//! - **`cida`**: the same rule at CIDA's scale, as FedEvolve's authors' group regenerated it
//!   (AIMedLab/AIRL `circle_large`, 1,000 points a domain): radius 5, std 0.5 (a spread of 0.1
//!   radius where `fixed` has 0.06), `θ_k = π·k/D`, label 1 outside radius 5.
//! - **`concept`** (Pesaranghader & Viktor 2016, the CIRCLES stream FedEvolve's appendix cites):
//!   concept drift. Points are uniform on the unit square in every domain; the label is 1 outside
//!   the domain's circle, whose centre moves from (0.2, 0.5) to (0.8, 0.5) and whose radius grows
//!   from 0.15 to 0.30 in equal steps over the domains (the stream's four concepts, made gradual).
//!   The input does not tell the domains apart: only the label rule moves.

use anchorage_shared::rng::Rng;
use serde::{Deserialize, Serialize};

use crate::Dataset;

/// Which Circle (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CircleKind {
    #[default]
    Fixed,
    Cida,
    Concept,
}

impl CircleKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Fixed => "fixed",
            Self::Cida => "cida",
            Self::Concept => "concept",
        }
    }
}

/// Knobs of the Circle set. `mean_radius`, `std` and `boundary_radius` shape `fixed` and `cida`
/// (a `cida` table's defaults are CIDA's: [`CircleConfig::of_kind`]); `concept` uses none of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CircleConfig {
    pub kind: CircleKind,
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
        Self::of_kind(CircleKind::Fixed)
    }
}

impl CircleConfig {
    /// The defaults of `kind`: 30 domains of 1,000 points, and its geometry.
    pub fn of_kind(kind: CircleKind) -> Self {
        let (mean_radius, std, boundary_radius) = match kind {
            CircleKind::Fixed | CircleKind::Concept => (10.0, 0.6, 10.0),
            CircleKind::Cida => (5.0, 0.5, 5.0),
        };
        Self { kind, domains: 30, per_domain: 1000, mean_radius, std, boundary_radius, seed: 0 }
    }

    /// The mean of domain `k` (`fixed`, `cida`).
    pub fn mean(&self, k: usize) -> (f64, f64) {
        let steps = match self.kind {
            CircleKind::Cida => self.domains,
            _ => self.domains.saturating_sub(1),
        };
        let theta = if steps > 0 { std::f64::consts::PI * k as f64 / steps as f64 } else { 0.0 };
        (self.mean_radius * theta.cos(), self.mean_radius * theta.sin())
    }

    /// The label circle of domain `k` under `concept`: its centre and radius, moved in equal steps
    /// from ((0.2, 0.5), 0.15) to ((0.8, 0.5), 0.30) (Pesaranghader & Viktor's first and last concept).
    pub fn concept_circle(&self, k: usize) -> ((f64, f64), f64) {
        let t = if self.domains > 1 { k as f64 / (self.domains - 1) as f64 } else { 0.0 };
        ((0.2 + 0.6 * t, 0.5), 0.15 + 0.15 * t)
    }

    /// One point of domain `k` and its label.
    fn point(&self, k: usize, rng: &mut Rng) -> ([f32; 2], u32) {
        match self.kind {
            CircleKind::Fixed | CircleKind::Cida => {
                let (mx, my) = self.mean(k);
                let x = mx + self.std * rng.normal();
                let y = my + self.std * rng.normal();
                ([x as f32, y as f32], u32::from((x * x + y * y).sqrt() > self.boundary_radius))
            }
            CircleKind::Concept => {
                let ((cx, cy), r) = self.concept_circle(k);
                let (x, y) = (rng.f64(), rng.f64());
                ([x as f32, y as f32], u32::from((x - cx).powi(2) + (y - cy).powi(2) > r * r))
            }
        }
    }
}

/// A `[data.circle]` table: its `kind` picks the defaults the other keys override.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CircleTable {
    #[serde(default)]
    kind: CircleKind,
    domains: Option<usize>,
    per_domain: Option<usize>,
    mean_radius: Option<f64>,
    std: Option<f64>,
    boundary_radius: Option<f64>,
    #[serde(default)]
    seed: u64,
}

/// `[data] circle = "concept"` (a kind's defaults) or a `[data.circle]` table.
pub(crate) fn deserialize_circle<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<CircleConfig>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Form {
        Kind(CircleKind),
        Table(CircleTable),
    }
    Ok(Option::<Form>::deserialize(d)?.map(|form| match form {
        Form::Kind(kind) => CircleConfig::of_kind(kind),
        Form::Table(t) => {
            let base = CircleConfig::of_kind(t.kind);
            CircleConfig {
                domains: t.domains.unwrap_or(base.domains),
                per_domain: t.per_domain.unwrap_or(base.per_domain),
                mean_radius: t.mean_radius.unwrap_or(base.mean_radius),
                std: t.std.unwrap_or(base.std),
                boundary_radius: t.boundary_radius.unwrap_or(base.boundary_radius),
                seed: t.seed,
                ..base
            }
        }
    }))
}

/// One [`Dataset`] per domain: samples of shape `[2]` (x, y), 2 classes. Domain k draws from its
/// own stream of the seed, so domains are independent of each other's size.
pub fn generate(cfg: &CircleConfig) -> Vec<Dataset> {
    (0..cfg.domains)
        .map(|k| {
            let mut rng = Rng::derive(cfg.seed, 0xC1C1E + k as u64);
            let mut features = Vec::with_capacity(2 * cfg.per_domain);
            let mut labels = Vec::with_capacity(cfg.per_domain);
            for _ in 0..cfg.per_domain {
                let (xy, label) = cfg.point(k, &mut rng);
                features.extend_from_slice(&xy);
                labels.push(label);
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

    #[test]
    fn the_cida_and_concept_kinds_follow_their_definitions() {
        let cida = CircleConfig::of_kind(CircleKind::Cida);
        let domains = generate(&cida);
        assert_eq!((domains.len(), domains[0].len()), (30, 1000));
        assert!((cida.mean(15).0).abs() < 1e-9 && (cida.mean(15).1 - 5.0).abs() < 1e-9, "θ = π·k/30");
        for d in &domains {
            for i in 0..d.len() {
                let s = d.sample(i);
                let r = ((s[0] as f64).powi(2) + (s[1] as f64).powi(2)).sqrt();
                assert_eq!(d.labels[i], u32::from(r > 5.0));
            }
        }
        let concept = CircleConfig::of_kind(CircleKind::Concept);
        let domains = generate(&concept);
        assert_eq!(concept.concept_circle(0), ((0.2, 0.5), 0.15));
        let ((cx, _), r) = concept.concept_circle(29);
        assert!((cx - 0.8).abs() < 1e-12 && (r - 0.30).abs() < 1e-12);
        for (k, d) in domains.iter().enumerate() {
            let ((cx, cy), r) = concept.concept_circle(k);
            for i in 0..d.len() {
                let s = d.sample(i);
                assert!((0.0..1.0).contains(&s[0]) && (0.0..1.0).contains(&s[1]));
                let outside = (s[0] as f64 - cx).powi(2) + (s[1] as f64 - cy).powi(2) > r * r;
                assert_eq!(d.labels[i], u32::from(outside));
            }
        }
        // The same point changes its label between the first and the last concept.
        let (p, first, last) = ((0.25, 0.5), concept.concept_circle(0), concept.concept_circle(29));
        let inside = |((cx, cy), r): ((f64, f64), f64)| (p.0 - cx).powi(2) + (p.1 - cy).powi(2) <= r * r;
        assert!(inside(first) && !inside(last));
    }
}
