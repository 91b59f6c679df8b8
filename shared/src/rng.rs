//! A small seeded random generator (xoshiro256** seeded by SplitMix64).
//!
//! Our own, rather than a crate's, so that the same seed gives the same sampling, partitions and
//! synthetic data byte for byte across dependency upgrades.

use alloc::vec::Vec;

/// Seeded xoshiro256** generator.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        let mut st = seed;
        Self { s: [splitmix(&mut st), splitmix(&mut st), splitmix(&mut st), splitmix(&mut st)] }
    }

    /// An independent generator for a named sub-stream (e.g. one per client).
    pub fn derive(seed: u64, stream: u64) -> Self {
        let mut st = seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03);
        Self::new(splitmix(&mut st))
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [0, 1) as f32.
    pub fn f32(&mut self) -> f32 {
        self.f64() as f32
    }

    /// Uniform integer in 0..n (n > 0), without modulo bias.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "Rng::below needs n > 0");
        let zone = u64::MAX - (u64::MAX % n);
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }

    /// Standard normal by the Box–Muller transform.
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.f64(); // (0, 1]
        let u2 = self.f64();
        libm_sqrt(-2.0 * libm_ln(u1)) * libm_cos(core::f64::consts::TAU * u2)
    }

    /// In-place Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }

    /// `k` distinct indices out of `0..n`, in random order (k is capped at n).
    pub fn sample_indices(&mut self, n: usize, k: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (0..n).collect();
        let k = k.min(n);
        for i in 0..k {
            let j = i + self.below((n - i) as u64) as usize;
            all.swap(i, j);
        }
        all.truncate(k);
        all
    }

    /// Gamma(shape, 1) by Marsaglia–Tsang (with the boost for shape < 1).
    pub fn gamma(&mut self, shape: f64) -> f64 {
        if shape < 1.0 {
            let u = self.f64().max(f64::MIN_POSITIVE);
            return self.gamma(shape + 1.0) * libm_exp(libm_ln(u) / shape);
        }
        let d = shape - 1.0 / 3.0;
        let c = 1.0 / libm_sqrt(9.0 * d);
        loop {
            let x = self.normal();
            let v = 1.0 + c * x;
            if v <= 0.0 {
                continue;
            }
            let v = v * v * v;
            let u = self.f64();
            if u < 1.0 - 0.0331 * x * x * x * x
                || libm_ln(u.max(f64::MIN_POSITIVE)) < 0.5 * x * x + d * (1.0 - v + libm_ln(v))
            {
                return d * v;
            }
        }
    }

    /// A draw from Dirichlet(α, …, α) of dimension `k`.
    pub fn dirichlet(&mut self, alpha: f64, k: usize) -> Vec<f64> {
        let mut g: Vec<f64> = (0..k).map(|_| self.gamma(alpha)).collect();
        let total: f64 = g.iter().sum();
        if total > 0.0 {
            g.iter_mut().for_each(|x| *x /= total);
        } else {
            g.iter_mut().for_each(|x| *x = 1.0 / k as f64);
        }
        g
    }
}

// Minimal f64 elementary functions for no_std. Accuracy ~1e-12, ample for sampling.

fn libm_sqrt(x: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    let mut y = if x > 1.0 { x / 2.0 } else { 1.0 };
    for _ in 0..100 {
        let next = 0.5 * (y + x / y);
        if (next - y).abs() <= 1e-15 * next {
            return next;
        }
        y = next;
    }
    y
}

fn libm_ln(x: f64) -> f64 {
    if x <= 0.0 {
        return f64::NEG_INFINITY;
    }
    // x = m · 2^e with m in [1, 2); ln x = e·ln2 + ln m, ln m by the atanh series.
    let bits = x.to_bits();
    let e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let m = f64::from_bits((bits & 0x000f_ffff_ffff_ffff) | 0x3ff0_0000_0000_0000);
    let t = (m - 1.0) / (m + 1.0);
    let t2 = t * t;
    let mut term = t;
    let mut sum = 0.0;
    let mut k = 1.0;
    while term.abs() > 1e-17 {
        sum += term / k;
        term *= t2;
        k += 2.0;
    }
    2.0 * sum + e as f64 * core::f64::consts::LN_2
}

fn libm_exp(x: f64) -> f64 {
    if x < -745.0 {
        return 0.0;
    }
    // exp x = 2^k · exp r with |r| ≤ ln2/2.
    let k = (x / core::f64::consts::LN_2 + if x >= 0.0 { 0.5 } else { -0.5 }) as i64;
    let r = x - k as f64 * core::f64::consts::LN_2;
    let mut term = 1.0;
    let mut sum = 1.0;
    for i in 1..30 {
        term *= r / i as f64;
        sum += term;
    }
    sum * f64::from_bits(((k + 1023).clamp(0, 2046) as u64) << 52)
}

fn libm_cos(x: f64) -> f64 {
    // Reduce to [-π, π], then Taylor series.
    let tau = core::f64::consts::TAU;
    let mut r = x - tau * ((x / tau) as i64 as f64);
    if r > core::f64::consts::PI {
        r -= tau;
    }
    let r2 = r * r;
    let mut term = 1.0;
    let mut sum = 1.0;
    for i in 1..20 {
        term *= -r2 / ((2 * i - 1) as f64 * (2 * i) as f64);
        sum += term;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let a: Vec<u64> = (0..5)
            .map({
                let mut r = Rng::new(7);
                move |_| r.next_u64()
            })
            .collect();
        let b: Vec<u64> = (0..5)
            .map({
                let mut r = Rng::new(7);
                move |_| r.next_u64()
            })
            .collect();
        assert_eq!(a, b);
        assert_ne!(Rng::new(7).next_u64(), Rng::new(8).next_u64());
    }

    #[test]
    fn elementary_functions_are_accurate() {
        for x in [0.001f64, 0.5, 1.0, 2.0, 10.0, 1e6] {
            assert!((libm_ln(x) - std::primitive::f64::ln(x)).abs() < 1e-10, "ln {x}");
            assert!((libm_sqrt(x) - x.sqrt()).abs() < 1e-9 * x.sqrt().max(1.0), "sqrt {x}");
        }
        for x in [-3.0f64, -0.2, 0.0, 1.5, 7.0] {
            assert!((libm_exp(x) - x.exp()).abs() < 1e-10 * x.exp().max(1.0), "exp {x}");
            assert!((libm_cos(x) - x.cos()).abs() < 1e-10, "cos {x}");
        }
    }

    #[test]
    fn normal_and_gamma_moments() {
        let mut r = Rng::new(1);
        let n = 20000;
        let xs: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "mean {mean} var {var}");
        for shape in [0.3, 1.0, 4.0] {
            let g: f64 = (0..n).map(|_| r.gamma(shape)).sum::<f64>() / n as f64;
            assert!((g - shape).abs() < 0.08 * shape.max(1.0), "gamma({shape}) mean {g}");
        }
        let d = r.dirichlet(0.5, 6);
        assert!((d.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    }

    #[test]
    fn sampling_is_distinct_and_bounded() {
        let mut r = Rng::new(3);
        let mut s = r.sample_indices(10, 4);
        assert_eq!(s.len(), 4);
        s.sort();
        s.dedup();
        assert_eq!(s.len(), 4);
        assert!(s.iter().all(|&i| i < 10));
        assert_eq!(r.sample_indices(3, 9).len(), 3);
    }
}
