//! The Gaussian mechanism's pieces, shared by the server (central noise) and the devices (local
//! noise): clipping a delta or a feature to an L2 bound, and Gaussian noise on a sum.
//!
//! The noise comes from [`Rng`]: seeded in the simulator, so that a run is reproducible; a
//! device or server in the field seeds it from the operating system (its caller's job), since
//! noise that the server can predict protects nothing.

use alloc::vec::Vec;

use crate::rng::Rng;

/// The L2 norm of several vectors taken together.
pub fn l2_norm<'a>(parts: impl IntoIterator<Item = &'a [f32]>) -> f64 {
    libm::sqrt(parts.into_iter().flat_map(|p| p.iter()).map(|v| (*v as f64) * (*v as f64)).sum::<f64>())
}

/// Scales `parts` (one delta, all its blocks) to L2 norm at most `clip`: v ← v·min(1, C/‖v‖)
/// (McMahan et al. 2018, Algorithm 1, "ClipFn"). Returns the norm before clipping.
pub fn clip_in_place(parts: &mut [Vec<f32>], clip: f64) -> f64 {
    let norm = l2_norm(parts.iter().map(Vec::as_slice));
    if norm > clip && norm > 0.0 {
        let scale = (clip / norm) as f32;
        parts.iter_mut().flat_map(|p| p.iter_mut()).for_each(|v| *v *= scale);
    }
    norm
}

/// One sample's feature clipped to L2 norm `clip` (what enters a prototype sum).
pub fn clip_feature(feature: &[f32], clip: f64) -> Vec<f32> {
    let mut parts = [feature.to_vec()];
    clip_in_place(&mut parts, clip);
    let [clipped] = parts;
    clipped
}

/// Adds N(0, std²) to every value.
pub fn add_gaussian(values: &mut [f32], std: f64, rng: &mut Rng) {
    if std > 0.0 {
        values.iter_mut().for_each(|v| *v += (rng.normal() * std) as f32);
    }
}

/// A count with N(0, std²) added, rounded, and floored at zero (post-processing of the noised
/// value, which costs no privacy).
pub fn noisy_count(count: u64, std: f64, rng: &mut Rng) -> u64 {
    let noisy = count as f64 + rng.normal() * std;
    if noisy.is_finite() && noisy > 0.0 { libm::round(noisy) as u64 } else { 0 }
}

/// Adaptive clipping's step (Andrew et al. 2021, Algorithm 1, lines 10–11): `unclipped` of `m`
/// deltas were within `clip`; with N(0, σ_b²) on that count, b̄ = (unclipped + noise)/m and
/// C ← C·exp(−η(b̄ − γ)).
pub fn adapt_clip(clip: f64, unclipped: usize, m: usize, adaptive: &super::config::AdaptiveClip, rng: &mut Rng) -> f64 {
    if m == 0 {
        return clip;
    }
    let noisy = unclipped as f64 + rng.normal() * adaptive.count_noise_multiplier;
    let share = noisy / m as f64;
    clip * libm::exp(-adaptive.learning_rate * (share - adaptive.target_quantile))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::privacy::config::AdaptiveClip;

    #[test]
    fn a_delta_is_clipped_as_one_vector_and_a_small_one_is_left_alone() {
        let mut parts = alloc::vec![alloc::vec![3.0f32, 0.0], alloc::vec![4.0f32]];
        assert_eq!(clip_in_place(&mut parts, 1.0), 5.0);
        assert!((l2_norm(parts.iter().map(Vec::as_slice)) - 1.0).abs() < 1e-6);
        assert!((parts[0][0] - 0.6).abs() < 1e-6 && (parts[1][0] - 0.8).abs() < 1e-6);
        let mut small = alloc::vec![alloc::vec![0.1f32, 0.2]];
        clip_in_place(&mut small, 1.0);
        assert_eq!(small[0], alloc::vec![0.1, 0.2]);
        assert_eq!(clip_feature(&[0.0, 0.0], 1.0), alloc::vec![0.0, 0.0], "a zero vector stays");
    }

    #[test]
    fn noise_has_the_asked_spread_and_counts_stay_counts() {
        let mut rng = Rng::new(3);
        let mut values = alloc::vec![0.0f32; 20_000];
        add_gaussian(&mut values, 2.0, &mut rng);
        let var = values.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / values.len() as f64;
        assert!((libm::sqrt(var) - 2.0).abs() < 0.05, "std {}", libm::sqrt(var));
        assert_eq!(noisy_count(0, 0.0, &mut rng), 0);
        assert!((0..100).all(|_| noisy_count(1, 5.0, &mut rng) < 1000));
    }

    #[test]
    fn the_clip_moves_toward_the_target_quantile() {
        let a = AdaptiveClip { count_noise_multiplier: 1e-9, ..AdaptiveClip::default() };
        let mut rng = Rng::new(1);
        // Every delta within the clip: it shrinks by exp(−0.2·0.5); none: it grows by exp(0.1).
        assert!((adapt_clip(1.0, 10, 10, &a, &mut rng) - libm::exp(-0.1)).abs() < 1e-6);
        assert!((adapt_clip(1.0, 0, 10, &a, &mut rng) - libm::exp(0.1)).abs() < 1e-6);
    }
}
