//! Domain evolution: "domain k = transform(k)" over a base set, e.g. rotated MNIST (12 domains at
//! 0°, 15°, …, 165°; the last domain is the target).

use anchorage_shared::rng::Rng;

use crate::{Dataset, transform};

/// Domain k is `f(k, base_k)`, where `base_k` is the k-th disjoint part of `base` given by `parts`
/// (see [`disjoint_parts`]) — or all of `base` when `parts` is `None`.
pub fn domains(
    base: &Dataset,
    parts: Option<&[Vec<usize>]>,
    num_domains: usize,
    f: impl Fn(usize, &Dataset) -> Dataset,
) -> Vec<Dataset> {
    (0..num_domains)
        .map(|k| match parts.and_then(|p| p.get(k)) {
            Some(idx) => f(k, &base.subset(idx)),
            None => f(k, base),
        })
        .collect()
}

/// The angles `0, step, 2·step, …` of `n` rotation domains.
pub fn rotation_angles(n: usize, step_degrees: f32) -> Vec<f32> {
    (0..n).map(|k| k as f32 * step_degrees).collect()
}

/// `n` disjoint near-equal parts of `0..len` after a seeded shuffle (each part sorted).
pub fn disjoint_parts(len: usize, n: usize, seed: u64) -> Vec<Vec<usize>> {
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<usize> = (0..len).collect();
    Rng::derive(seed, 0xD0).shuffle(&mut idx);
    (0..n)
        .map(|k| {
            let mut p = idx[k * len / n..(k + 1) * len / n].to_vec();
            p.sort_unstable();
            p
        })
        .collect()
}

/// Rotated domains: domain k is part k of `base` (disjoint parts when `disjoint`, else all of it)
/// rotated by `k · step_degrees`.
pub fn rotated(base: &Dataset, num_domains: usize, step_degrees: f32, disjoint: bool, seed: u64) -> Vec<Dataset> {
    let parts = disjoint.then(|| disjoint_parts(base.len(), num_domains, seed));
    let angles = rotation_angles(num_domains, step_degrees);
    domains(base, parts.as_deref(), num_domains, |k, d| transform::rotate(d, angles[k]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotated_mnist_style_domains() {
        assert_eq!(rotation_angles(12, 15.0).last(), Some(&165.0));
        let base = Dataset::new(vec![1, 4, 4], 2, (0..64).map(|v| v as f32).collect(), vec![0, 1, 0, 1]).unwrap();
        let d = rotated(&base, 2, 90.0, true, 3);
        assert_eq!(d.iter().map(Dataset::len).sum::<usize>(), 4);
        let all = rotated(&base, 3, 15.0, false, 3);
        assert_eq!(all[0], base);
        assert_ne!(all[1], base);
        let parts = disjoint_parts(10, 3, 1);
        let mut flat: Vec<usize> = parts.concat();
        flat.sort();
        assert_eq!(flat, (0..10).collect::<Vec<_>>());
    }
}
