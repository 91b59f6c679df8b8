//! From f32 to Z_{2^32} and back (Bonawitz et al. 2017, §3: inputs are vectors over Z_R; Flower's
//! SecAgg+ quantises the same way, clip then scale then round).
//!
//! The modulus is 2^32: a `u32` with wrapping arithmetic is exactly Z_{2^32}, so masking and
//! summing are plain machine adds and a masked element is 4 bytes on the wire. A value is clipped
//! to `[-clip, clip]` and mapped to an integer in `[0, levels]`. Overflow is ruled out, not
//! detected: `levels = ⌊(2^32 − 1) / max_clients⌋`, so the true sum of up to `max_clients` inputs is
//! at most `max_clients · levels ≤ 2^32 − 1 < 2^32` and the sum mod 2^32 is the sum itself. More
//! clients buy coarser steps: the step is `2·clip / levels`, about 3.7e-7 for clip 8 and 100 clients.

use chacha20::ChaCha20Rng;
use chacha20::rand_core::{Rng, SeedableRng};

use crate::error::SecAggError;

/// How a scaled value becomes an integer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rounding {
    /// To the nearest level (biased by up to half a step per value).
    Nearest,
    /// Up with probability equal to the fraction, so unbiased; seeded for reproducibility.
    Stochastic {
        /// Seeds the ChaCha20 RNG that draws the rounding.
        seed: u64,
    },
}

/// Clipping range and number of levels, fixed for a round and known to all.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Quantizer {
    clip: f32,
    levels: u32,
    max_clients: u32,
}

impl Quantizer {
    /// A quantiser for values clipped to `[-clip, clip]`, summed over at most `max_clients`.
    pub fn new(clip: f32, max_clients: u32) -> Result<Self, SecAggError> {
        if !(clip.is_finite() && clip > 0.0) {
            return Err(SecAggError::BadParams("clip must be finite and positive"));
        }
        if max_clients == 0 {
            return Err(SecAggError::BadParams("max_clients must be at least 1"));
        }
        Ok(Self { clip, levels: u32::MAX / max_clients, max_clients })
    }

    /// The largest integer one value maps to.
    pub fn levels(&self) -> u32 {
        self.levels
    }

    /// The width of one level in the input's units.
    pub fn step(&self) -> f64 {
        2.0 * f64::from(self.clip) / f64::from(self.levels)
    }

    /// Clips, scales and rounds each value (NaN counts as 0).
    pub fn quantize(&self, values: &[f32], rounding: Rounding) -> Vec<u32> {
        let scale = f64::from(self.levels) / (2.0 * f64::from(self.clip));
        let scaled = values.iter().map(|&x| {
            let x = if x.is_nan() { 0.0 } else { x.clamp(-self.clip, self.clip) };
            (f64::from(x) + f64::from(self.clip)) * scale
        });
        match rounding {
            Rounding::Nearest => scaled.map(|r| self.level(r.round())).collect(),
            Rounding::Stochastic { seed } => {
                let mut rng = ChaCha20Rng::seed_from_u64(seed);
                scaled.map(|r| self.level(r.floor() + f64::from(u8::from(unit(&mut rng) < r.fract())))).collect()
            }
        }
    }

    /// The f32 sum of `count` quantised vectors from their sum mod 2^32: each element is
    /// `sum · step − count · clip` (each input carried an offset of `clip`).
    pub fn dequantize_sum(&self, sum: &[u32], count: u32) -> Result<Vec<f32>, SecAggError> {
        if count > self.max_clients {
            return Err(SecAggError::BadParams("more contributors than the quantiser allows"));
        }
        let offset = f64::from(count) * f64::from(self.clip);
        let step = self.step();
        Ok(sum.iter().map(|&s| (f64::from(s) * step - offset) as f32).collect())
    }

    fn level(&self, r: f64) -> u32 {
        // `r` is in [0, levels] up to float error; the clamp keeps the bound that rules out overflow.
        r.clamp(0.0, f64::from(self.levels)) as u32
    }
}

/// A uniform draw in [0, 1) with 53 random bits.
fn unit(rng: &mut ChaCha20Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sum_of_max_clients_extremes_does_not_wrap() {
        let q = Quantizer::new(1.0, 7).unwrap();
        let one = q.quantize(&[1.0, -1.0, 5.0], Rounding::Nearest);
        assert_eq!(one, vec![q.levels(), 0, q.levels()]);
        let sum: Vec<u32> = (0..3).map(|i| one[i].wrapping_mul(7)).collect();
        assert!(u64::from(q.levels()) * 7 <= u64::from(u32::MAX));
        let back = q.dequantize_sum(&sum, 7).unwrap();
        assert!((back[0] - 7.0).abs() < 1e-4 && (back[1] + 7.0).abs() < 1e-4, "{back:?}");
    }

    #[test]
    fn stochastic_rounding_is_seeded_and_unbiased() {
        // Four levels (0..=3) over [-1, 1]: 0.1 sits at 1.65 levels, nearest rounding says 1/3.
        let q = Quantizer::new(1.0, 1 << 30).unwrap();
        assert_eq!(q.levels(), 3);
        let x = vec![0.1f32; 20_000];
        let a = q.quantize(&x, Rounding::Stochastic { seed: 9 });
        assert_eq!(a, q.quantize(&x, Rounding::Stochastic { seed: 9 }));
        assert_ne!(a, q.quantize(&x, Rounding::Stochastic { seed: 10 }));
        let mean = |v: &[u32]| v.iter().map(|&l| f64::from(l)).sum::<f64>() / 20_000.0 * q.step() - 1.0;
        assert!((mean(&a) - 0.1).abs() < 0.02, "{}", mean(&a));
        assert!((mean(&q.quantize(&x, Rounding::Nearest)) - 1.0 / 3.0).abs() < 1e-6);
    }

    #[test]
    fn more_contributors_than_planned_are_refused() {
        let q = Quantizer::new(1.0, 3).unwrap();
        assert_eq!(q.dequantize_sum(&[0], 4).unwrap_err().reason(), "bad_params");
        assert!(Quantizer::new(f32::NAN, 3).is_err() && Quantizer::new(1.0, 0).is_err());
    }
}
