//! Procedural image classes made in code (no file, no network): the embedded default's data.
//!
//! Each class has a template drawn from a class-seeded stream: a few Gaussian blobs, oriented bars
//! and sinusoid gratings, normalised to zero mean and unit deviation. A sample is its class
//! template shifted by a few pixels, scaled by a random contrast, plus Gaussian pixel noise.

use anchorage_shared::rng::Rng;

use crate::Dataset;

/// Knobs of the synthetic set.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticConfig {
    pub num_classes: u32,
    /// Images are 1×side×side.
    pub side: usize,
    pub train_per_class: usize,
    pub test_per_class: usize,
    /// Standard deviation of the pixel noise (the template has unit deviation).
    pub noise: f32,
    /// Largest shift in pixels, in x and in y.
    pub max_shift: usize,
    pub seed: u64,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        Self {
            num_classes: 10,
            side: 16,
            train_per_class: 300,
            test_per_class: 100,
            noise: 0.35,
            max_shift: 2,
            seed: 7,
        }
    }
}

fn template(side: usize, rng: &mut Rng) -> Vec<f32> {
    let mut img = vec![0f32; side * side];
    let s = side as f32;
    let parts = 3 + rng.below(3) as usize;
    for _ in 0..parts {
        let (cx, cy) = (rng.f32() * s, rng.f32() * s);
        let sign = if rng.f32() < 0.5 { -1.0 } else { 1.0 };
        match rng.below(3) {
            0 => {
                let sigma = 1.0 + rng.f32() * s / 6.0;
                for y in 0..side {
                    for x in 0..side {
                        let d2 = (x as f32 - cx).powi(2) + (y as f32 - cy).powi(2);
                        img[y * side + x] += sign * (-d2 / (2.0 * sigma * sigma)).exp();
                    }
                }
            }
            1 => {
                let angle = rng.f32() * std::f32::consts::PI;
                let (dx, dy) = (angle.cos(), angle.sin());
                let (half_len, width) = (s / 4.0 + rng.f32() * s / 4.0, 0.8 + rng.f32());
                for y in 0..side {
                    for x in 0..side {
                        let (px, py) = (x as f32 - cx, y as f32 - cy);
                        let along = px * dx + py * dy;
                        let across = -px * dy + py * dx;
                        if along.abs() <= half_len {
                            img[y * side + x] += sign * (-(across * across) / (2.0 * width * width)).exp();
                        }
                    }
                }
            }
            _ => {
                let angle = rng.f32() * std::f32::consts::PI;
                let freq = 2.0 * std::f32::consts::PI / (3.0 + rng.f32() * s / 2.0);
                let phase = rng.f32() * std::f32::consts::TAU;
                for y in 0..side {
                    for x in 0..side {
                        let t = x as f32 * angle.cos() + y as f32 * angle.sin();
                        img[y * side + x] += 0.5 * sign * (freq * t + phase).sin();
                    }
                }
            }
        }
    }
    let n = img.len() as f32;
    let mean = img.iter().sum::<f32>() / n;
    let std = (img.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / n).sqrt().max(1e-6);
    img.iter_mut().for_each(|v| *v = (*v - mean) / std);
    img
}

fn draw(templates: &[Vec<f32>], cfg: &SyntheticConfig, per_class: usize, rng: &mut Rng) -> Dataset {
    let side = cfg.side;
    let mut features = Vec::with_capacity(templates.len() * per_class * side * side);
    let mut labels = Vec::with_capacity(templates.len() * per_class);
    let span = 2 * cfg.max_shift as u64 + 1;
    for _ in 0..per_class {
        for (class, t) in templates.iter().enumerate() {
            let sx = rng.below(span) as isize - cfg.max_shift as isize;
            let sy = rng.below(span) as isize - cfg.max_shift as isize;
            let contrast = 0.8 + 0.4 * rng.f32();
            for y in 0..side as isize {
                for x in 0..side as isize {
                    let (ox, oy) = (x - sx, y - sy);
                    let v = if ox >= 0 && oy >= 0 && (ox as usize) < side && (oy as usize) < side {
                        t[oy as usize * side + ox as usize]
                    } else {
                        0.0
                    };
                    features.push(contrast * v + cfg.noise * rng.normal() as f32);
                }
            }
            labels.push(class as u32);
        }
    }
    Dataset { sample_shape: vec![1, side, side], num_classes: templates.len() as u32, features, labels }
}

/// Generates `(train, test)` from independent streams of the seed.
pub fn generate(cfg: &SyntheticConfig) -> (Dataset, Dataset) {
    let templates: Vec<Vec<f32>> =
        (0..cfg.num_classes).map(|c| template(cfg.side, &mut Rng::derive(cfg.seed, 1 + c as u64))).collect();
    let train = draw(&templates, cfg, cfg.train_per_class, &mut Rng::derive(cfg.seed, 0x7EA1));
    let test = draw(&templates, cfg, cfg.test_per_class, &mut Rng::derive(cfg.seed, 0x7E57));
    (train, test)
}

/// Rotation by an angle: the domain-shift hook (one implementation, in [`crate::transform`]).
pub use crate::transform::rotate;

#[cfg(test)]
mod tests {
    use super::*;

    /// Nearest-class-mean accuracy on raw pixels: the difficulty gauge of the set.
    fn ncm_accuracy(train: &Dataset, test: &Dataset) -> f64 {
        let n = train.sample_len();
        let mut means = vec![vec![0f64; n]; train.num_classes as usize];
        let counts = train.class_counts();
        for i in 0..train.len() {
            let m = &mut means[train.labels[i] as usize];
            m.iter_mut().zip(train.sample(i)).for_each(|(a, v)| *a += *v as f64);
        }
        for (m, c) in means.iter_mut().zip(&counts) {
            m.iter_mut().for_each(|a| *a /= *c as f64);
        }
        let correct = (0..test.len())
            .filter(|&i| {
                let s = test.sample(i);
                let best = (0..means.len())
                    .min_by(|&a, &b| {
                        let da: f64 = means[a].iter().zip(s).map(|(m, v)| (m - *v as f64).powi(2)).sum();
                        let db: f64 = means[b].iter().zip(s).map(|(m, v)| (m - *v as f64).powi(2)).sum();
                        da.total_cmp(&db)
                    })
                    .unwrap();
                best as u32 == test.labels[i]
            })
            .count();
        correct as f64 / test.len() as f64
    }

    #[test]
    fn default_set_is_learnable_but_not_trivial() {
        let t0 = std::time::Instant::now();
        let (train, test) = generate(&SyntheticConfig::default());
        println!("default synthetic set generated in {:?}", t0.elapsed());
        assert_eq!(train.len(), 3000);
        assert_eq!(test.len(), 1000);
        assert_eq!(train.class_counts(), vec![300; 10]);
        let acc = ncm_accuracy(&train, &test);
        println!("nearest-class-mean accuracy on raw pixels (default synthetic set): {:.1}%", acc * 100.0);
        assert!((0.4..=0.995).contains(&acc), "NCM accuracy {acc}");
    }

    #[test]
    fn learnable_across_seeds() {
        for seed in [1, 2, 3] {
            let (train, test) = generate(&SyntheticConfig { seed, ..Default::default() });
            let acc = ncm_accuracy(&train, &test);
            println!("nearest-class-mean accuracy, seed {seed}: {:.1}%", acc * 100.0);
            assert!((0.4..=0.995).contains(&acc), "seed {seed}: NCM accuracy {acc}");
        }
    }

    #[test]
    fn seeded_and_finite() {
        let cfg = SyntheticConfig { train_per_class: 5, test_per_class: 2, ..Default::default() };
        let a = generate(&cfg);
        assert_eq!(a, generate(&cfg));
        assert_ne!(a.0.features, generate(&SyntheticConfig { seed: 8, ..cfg.clone() }).0.features);
        assert!(Dataset::new(a.0.sample_shape.clone(), 10, a.0.features.clone(), a.0.labels.clone()).is_ok());
    }

    #[test]
    fn rotation_identity_and_full_turn() {
        let (ds, _) =
            generate(&SyntheticConfig { train_per_class: 1, test_per_class: 1, noise: 0.0, ..Default::default() });
        let same = rotate(&ds, 0.0);
        for (a, b) in same.features.iter().zip(&ds.features) {
            assert!((a - b).abs() < 1e-5);
        }
        let back = rotate(&rotate(&rotate(&rotate(&ds, 90.0), 90.0), 90.0), 90.0);
        // Away from the corners (which rotate out of the frame), four quarter turns are the identity.
        let side = 16;
        for i in 0..ds.len() {
            for y in 3..side - 3 {
                for x in 3..side - 3 {
                    let k = i * side * side + y * side + x;
                    assert!((back.features[k] - ds.features[k]).abs() < 1e-3, "pixel {x},{y}");
                }
            }
        }
        assert!(rotate(&ds, 45.0).features != ds.features);
    }
}
