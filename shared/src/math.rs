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
    /// An empty mean of vectors of `dim` elements.
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

    /// [`WeightedMean::add`] of the little-endian f32 values in `bytes` (an F32 tensor's data,
    /// read in place: no decoded copy), the same sums. `None` (and nothing added) for a length
    /// other than 4 bytes a value, a bad weight, or a value that is not finite (decoding refuses
    /// it too). Every value is checked before any is added (a second read of `bytes`, from cache
    /// for a block that fits in it), so a refused part leaves the mean as it was.
    pub fn add_f32_le(&mut self, bytes: &[u8], w: f64) -> Option<()> {
        if bytes.len() != self.acc.len().checked_mul(4)? || !w.is_finite() || w < 0.0 {
            return None;
        }
        let values = bytes.as_chunks::<4>().0;
        if values.iter().any(|x| !f32::from_bits(x.bits()).is_finite()) {
            return None;
        }
        self.total += w;
        add_one(&mut self.acc, values, w);
        Some(())
    }

    /// Adds every part, in order: the same sums as [`WeightedMean::add`] of one part after the
    /// other, but tile by tile ([`add_parts`]), so that each tile of sums stays in cache while
    /// every part is added to it. `None` (and nothing added) for a part of another length or a
    /// bad weight; `None` for a value that is not finite, the sums then holding part of the
    /// parts: drop the mean.
    pub fn add_all(&mut self, parts: &[(Values<'_>, f64)]) -> Option<()> {
        self.add_all_with(parts, |sums, parts| add_parts(sums, 0, parts))
    }

    /// [`WeightedMean::add_all`] through `add`, which must add every part's w·x to every sum, as
    /// [`add_parts`] does over all of them, or over disjoint pieces on several threads (the sum
    /// of a value does not depend on the others', so the split does not change a bit).
    pub fn add_all_with(
        &mut self,
        parts: &[(Values<'_>, f64)],
        add: impl FnOnce(&mut [f64], &[(Values<'_>, f64)]) -> Result<(), NonFinite>,
    ) -> Option<()> {
        if parts.iter().any(|(v, w)| v.len() != self.acc.len() || v.is_ragged() || !w.is_finite() || *w < 0.0) {
            return None;
        }
        if parts.is_empty() {
            return Some(());
        }
        add(&mut self.acc, parts).ok()?;
        parts.iter().for_each(|(_, w)| self.total += w);
        Some(())
    }

    /// The mean; `None` when the weights add up to nothing.
    pub fn finish(self) -> Option<Vec<f32>> {
        let total = self.total;
        (total > 0.0).then(|| self.acc.into_iter().map(|a| (a / total) as f32).collect())
    }
}

/// One part's values as [`add_parts`] reads them.
#[derive(Debug, Clone, Copy)]
pub enum Values<'a> {
    /// Decoded values.
    F32(&'a [f32]),
    /// The little-endian bytes of f32 values (an F32 tensor's data), read in place.
    F32Le(&'a [u8]),
}

impl Values<'_> {
    /// Number of values (whole ones: see [`Values::is_ragged`]).
    pub fn len(&self) -> usize {
        match self {
            Values::F32(v) => v.len(),
            Values::F32Le(b) => b.len() / 4,
        }
    }

    /// True when there is no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True for bytes that end in part of a value.
    pub fn is_ragged(&self) -> bool {
        matches!(self, Values::F32Le(b) if b.len() % 4 != 0)
    }
}

/// A part held a value that is not finite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NonFinite;

/// Values in one tile of [`add_parts`]: 8,192 sums, 64 KB, that stay in the L2 cache while
/// every part is added to them.
pub const TILE: usize = 8192;

/// Parts added in one sweep over a tile: each sum is loaded and stored once for four parts.
const GROUP: usize = 4;

/// Adds w·x of every part to `sums`, the running sums of a [`WeightedMean`]'s values
/// `start..start + sums.len()`: tile by tile ([`TILE`]), every part in order within a tile
/// (runs of four F32Le parts in one sweep), so each value's sum takes the same additions in the
/// same order as adding the parts one after the other (the same bits), while the parts are read
/// once and the sums stay in cache. `Err(NonFinite)` for a value that is not finite; the sums
/// then hold part of the parts. Panics when a part has fewer than `start + sums.len()` values.
pub fn add_parts(sums: &mut [f64], start: usize, parts: &[(Values<'_>, f64)]) -> Result<(), NonFinite> {
    for (t, tile) in sums.chunks_mut(TILE).enumerate() {
        let (from, to) = (start + t * TILE, start + t * TILE + tile.len());
        // The sign bit of `bad` is set when a value was not finite ([`widen`]).
        let mut bad = 0u32;
        let mut rest = parts;
        while let Some((values, w)) = rest.first() {
            if let Some(group) = f32_le_group(rest) {
                bad |= add_four(tile, group.map(|(b, w)| (&b.as_chunks::<4>().0[from..to], w)));
                rest = &rest[GROUP..];
                continue;
            }
            bad |= match values {
                Values::F32(v) => add_one(tile, &v[from..to], *w),
                Values::F32Le(b) => add_one(tile, &b.as_chunks::<4>().0[from..to], *w),
            };
            rest = &rest[1..];
        }
        if bad & 0x8000_0000 != 0 {
            return Err(NonFinite);
        }
    }
    Ok(())
}

/// The first [`GROUP`] parts' bytes and weights when they are all F32Le.
fn f32_le_group<'a>(parts: &[(Values<'a>, f64)]) -> Option<[(&'a [u8], f64); GROUP]> {
    let mut group = [(&[][..], 0.0); GROUP];
    for (g, (values, w)) in group.iter_mut().zip(parts.get(..GROUP)?) {
        let Values::F32Le(bytes) = values else { return None };
        *g = (bytes, *w);
    }
    Some(group)
}

/// A value's bits as an f32's.
trait F32Bits: Copy {
    fn bits(self) -> u32;
}

impl F32Bits for f32 {
    fn bits(self) -> u32 {
        self.to_bits()
    }
}

impl F32Bits for [u8; 4] {
    fn bits(self) -> u32 {
        u32::from_le_bytes(self)
    }
}

/// The f32 of `bits` in f64, and into `bad` the sign bit set when it is not finite (an exponent
/// of all ones plus one carries into the sign bit): a check the compiler vectorises.
#[inline(always)]
fn widen(bits: u32, bad: &mut u32) -> f64 {
    *bad |= (bits & 0x7f80_0000) + 0x0080_0000;
    f32::from_bits(bits) as f64
}

/// `sums[i] += w · values[i]`; returns `bad` ([`widen`]).
fn add_one<T: F32Bits>(sums: &mut [f64], values: &[T], w: f64) -> u32 {
    let mut bad = 0;
    for (a, x) in sums.iter_mut().zip(values) {
        *a += w * widen(x.bits(), &mut bad);
    }
    bad
}

/// [`add_one`] of four parts in one sweep: the four additions to a sum one after the other, in
/// the parts' order, as four calls of [`add_one`] would make them.
fn add_four(sums: &mut [f64], parts: [(&[[u8; 4]], f64); GROUP]) -> u32 {
    let [(x0, w0), (x1, w1), (x2, w2), (x3, w3)] = parts;
    let mut bad = 0;
    for (a, ((x0, x1), (x2, x3))) in sums.iter_mut().zip(x0.iter().zip(x1).zip(x2.iter().zip(x3))) {
        let mut sum = *a;
        sum += w0 * widen(x0.bits(), &mut bad);
        sum += w1 * widen(x1.bits(), &mut bad);
        sum += w2 * widen(x2.bits(), &mut bad);
        sum += w3 * widen(x3.bits(), &mut bad);
        *a = sum;
    }
    bad
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

    fn random(n: usize, rng: &mut crate::rng::Rng) -> Vec<f32> {
        (0..n).map(|_| (rng.normal() * 3.0) as f32).collect()
    }

    fn le(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn bits(m: &WeightedMean) -> (Vec<u64>, u64) {
        (m.acc.iter().map(|a| a.to_bits()).collect(), m.total.to_bits())
    }

    #[test]
    fn reading_bytes_in_place_adds_the_same_bits() {
        let mut rng = crate::rng::Rng::new(1);
        for n in [0, 1, 3, TILE - 1, TILE, TILE + 1, 4 * TILE + 3] {
            let values: Vec<Vec<f32>> = (0..11).map(|_| random(n, &mut rng)).collect();
            let bytes: Vec<Vec<u8>> = values.iter().map(|v| le(v)).collect();
            let weights: Vec<f64> = (0..11).map(|_| rng.f64() * 1000.0).collect();
            let mut decoded = WeightedMean::new(n);
            let mut in_place = WeightedMean::new(n);
            for ((v, b), w) in values.iter().zip(&bytes).zip(&weights) {
                decoded.add(v, *w).unwrap();
                in_place.add_f32_le(b, *w).unwrap();
            }
            assert_eq!(bits(&in_place), bits(&decoded), "{n} values");
            // All at once, tile by tile: bytes in runs of 5 and 4 (a group of four and one
            // alone, a group of four) around decoded values.
            let parts: Vec<(Values<'_>, f64)> = (0..11)
                .map(|i| {
                    (if i == 5 || i == 10 { Values::F32(&values[i]) } else { Values::F32Le(&bytes[i]) }, weights[i])
                })
                .collect();
            let mut tiled = WeightedMean::new(n);
            tiled.add_all(&parts).unwrap();
            assert_eq!(bits(&tiled), bits(&decoded), "{n} values");
            // In two pieces at any split.
            let mut pieces = WeightedMean::new(n);
            pieces
                .add_all_with(&parts, |sums, parts| {
                    let (a, b) = sums.split_at_mut(n / 3);
                    add_parts(b, n / 3, parts)?;
                    add_parts(a, 0, parts)
                })
                .unwrap();
            assert_eq!(bits(&pieces), bits(&decoded), "{n} values");
            assert_eq!(tiled.finish(), decoded.finish());
        }
    }

    #[test]
    fn reading_bytes_in_place_refuses_what_decoding_refuses() {
        let mut rng = crate::rng::Rng::new(2);
        let n = 3 * TILE + 1;
        let good = le(&random(n, &mut rng));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut bytes = le(&random(n, &mut rng));
            bytes[4 * (2 * TILE + 5)..4 * (2 * TILE + 6)].copy_from_slice(&bad.to_le_bytes());
            let mut mean = WeightedMean::new(n);
            mean.add_f32_le(&good, 2.0).unwrap();
            let before = bits(&mean);
            assert!(mean.add_f32_le(&bytes, 1.0).is_none());
            assert_eq!(bits(&mean), before, "a refused part leaves the mean as it was");
            assert!(mean.add_all(&[(Values::F32Le(&good), 1.0), (Values::F32Le(&bytes), 1.0)]).is_none());
            let four = [&good, &good, &bytes, &good, &good].map(|b| (Values::F32Le(b), 1.0));
            assert!(WeightedMean::new(n).add_all(&four).is_none(), "in a group of four");
            let mut decoded = random(n, &mut rng);
            decoded[n - 1] = bad;
            assert!(WeightedMean::new(n).add_all(&[(Values::F32(&decoded), 1.0)]).is_none(), "decoded");
        }
        let mut mean = WeightedMean::new(n);
        assert!(mean.add_f32_le(&good[..4 * n - 4], 1.0).is_none());
        assert!(mean.add_f32_le(&good, -1.0).is_none());
        assert!(mean.add_f32_le(&good, f64::NAN).is_none());
        assert!(mean.add_all(&[(Values::F32Le(&good[..4 * n - 1]), 1.0)]).is_none(), "a ragged part");
        assert!(mean.add_all(&[(Values::F32Le(&good), 1.0), (Values::F32Le(&good[4..]), 1.0)]).is_none());
        assert!(mean.add_all(&[(Values::F32Le(&good), -1.0)]).is_none());
        assert_eq!(bits(&mean), bits(&WeightedMean::new(n)), "nothing added");
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
