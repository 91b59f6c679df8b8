//! The prototype rules of the four papers, on plain decoded vectors (no transport, no tensors):
//! used by the server halves, the client halves and the tests alike.

use alloc::collections::{BTreeMap, BTreeSet};
use alloc::vec::Vec;

use crate::math::{cosine, cosine_matrix, moving_average, weighted_mean};

/// One class's prototype, decoded: the mean feature and the samples behind it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassMean {
    /// The class id.
    pub class: u32,
    /// Samples behind the mean.
    pub count: u64,
    /// The mean feature.
    pub vector: Vec<f32>,
}

/// Server-side fusion of uploaded prototypes with the previous global ones (FedProK Eq. 9; GLDP
/// Eq. 11, whose moving average runs over the clients that own class n):
/// a class seen for the first time gets the count-weighted mean of its uploads,
/// C_n = Σ_i N_i,n c_i,n / Σ_i N_i,n; a known class blends it into the previous value,
/// C_n ← β·C_n + (1−β)·(Σ_i N_i,n c_i,n / Σ_i N_i,n). Classes nobody uploaded keep their value.
/// Uploads whose dimension differs from the class's first upload are ignored.
/// The result is sorted by class and does not depend on the order of the uploads.
pub fn fuse(previous: &[ClassMean], uploads: &[ClassMean], beta: f32) -> Vec<ClassMean> {
    let mut by_class: BTreeMap<u32, Vec<&ClassMean>> = BTreeMap::new();
    for u in uploads.iter().filter(|u| u.count > 0) {
        by_class.entry(u.class).or_default().push(u);
    }
    let mut out: BTreeMap<u32, ClassMean> = previous.iter().map(|p| (p.class, p.clone())).collect();
    for (class, parts) in by_class {
        let dim = parts[0].vector.len();
        let parts: Vec<(&[f32], f64)> =
            parts.iter().filter(|p| p.vector.len() == dim).map(|p| (p.vector.as_slice(), p.count as f64)).collect();
        let count: u64 = parts.iter().map(|(_, n)| *n as u64).sum();
        let Some(fresh) = weighted_mean(&parts) else { continue };
        let fused = match out.get(&class) {
            Some(old) => match moving_average(&old.vector, &fresh, beta) {
                Some(v) => ClassMean { class, count: old.count.max(count), vector: v },
                None => continue,
            },
            None => ClassMean { class, count, vector: fresh },
        };
        out.insert(class, fused);
    }
    out.into_values().collect()
}

/// FedEvp Eq. 5, the evolving prototype of domain m (1-based):
/// C_m = (m−1)/m · C_{m−1} + 1/m · mean_m. Domain 1 is the mean itself.
pub fn evolving_prototype(previous: Option<&[f32]>, mean: &[f32], m: u32) -> Option<Vec<f32>> {
    match previous {
        None => Some(mean.to_vec()),
        Some(prev) if m <= 1 => (prev.len() == mean.len()).then(|| mean.to_vec()),
        Some(prev) => moving_average(prev, mean, (m - 1) as f32 / m as f32),
    }
}

/// FedProK Eq. 6–7: the index of the candidate (new-class prototype) most similar by cosine to
/// `query` (an old-class prototype); the first on ties; `None` without candidates.
pub fn nearest_by_cosine(query: &[f32], candidates: &[&[f32]]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, c) in candidates.iter().enumerate() {
        let s = cosine(query, c);
        if best.is_none_or(|(_, b)| s > b) {
            best = Some((i, s));
        }
    }
    best.map(|(i, _)| i)
}

/// FedProK Eq. 8, prototype translation: a pseudo-feature of old class p made from a real
/// feature of new class n, f̂ = f(x_n) + µ_p − µ_n.
pub fn translate(feature: &[f32], old_mean: &[f32], new_mean: &[f32]) -> Option<Vec<f32>> {
    (feature.len() == old_mean.len() && feature.len() == new_mean.len())
        .then(|| feature.iter().zip(old_mean).zip(new_mean).map(|((f, p), n)| f + p - n).collect())
}

/// What Best Global Prototype Selection chose.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// Per class, the index into the candidates of the prototype kept.
    pub chosen: BTreeMap<u32, usize>,
    /// Classes whose best mean similarity fell below the threshold in this call (now locked).
    pub newly_locked: BTreeSet<u32>,
}

/// FedTA Eq. 9–10, Best Global Prototype Selection. `candidates` stacks every uploaded prototype
/// and the previous global ones, each tagged with its class. On their cosine-similarity matrix
/// the same-class blocks are set to 1; a candidate's score is the mean of its row; per class
/// the candidate with the lowest score (the most distinct from other classes) is chosen. A class
/// whose chosen score is below `threshold` is locked; classes in `locked` are skipped (their
/// prototype never changes again).
pub fn best_global_prototypes(candidates: &[(u32, &[f32])], threshold: f32, locked: &BTreeSet<u32>) -> Selection {
    let n = candidates.len();
    let rows: Vec<&[f32]> = candidates.iter().map(|(_, v)| *v).collect();
    let mut m = cosine_matrix(&rows);
    for i in 0..n {
        for j in 0..n {
            if candidates[i].0 == candidates[j].0 {
                m[i * n + j] = 1.0;
            }
        }
    }
    let score = |i: usize| m[i * n..(i + 1) * n].iter().map(|&s| s as f64).sum::<f64>() / n.max(1) as f64;
    let mut chosen: BTreeMap<u32, (usize, f64)> = BTreeMap::new();
    for (i, (class, _)) in candidates.iter().enumerate() {
        if locked.contains(class) {
            continue;
        }
        let s = score(i);
        if chosen.get(class).is_none_or(|(_, best)| s < *best) {
            chosen.insert(*class, (i, s));
        }
    }
    let newly_locked = chosen.iter().filter(|(_, (_, s))| *s < threshold as f64).map(|(c, _)| *c).collect();
    Selection { chosen: chosen.into_iter().map(|(c, (i, _))| (c, i)).collect(), newly_locked }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    fn cm(class: u32, count: u64, vector: &[f32]) -> ClassMean {
        ClassMean { class, count, vector: vector.to_vec() }
    }

    #[test]
    fn fusion_new_classes_are_count_weighted_and_old_ones_blended() {
        let previous = vec![cm(0, 10, &[1.0, 1.0]), cm(5, 3, &[9.0, 9.0])];
        let uploads = vec![cm(0, 1, &[3.0, 3.0]), cm(0, 3, &[3.0, 3.0]), cm(1, 1, &[0.0, 4.0]), cm(1, 3, &[4.0, 0.0])];
        let out = fuse(&previous, &uploads, 0.75);
        // class 0 (old): 0.75·1 + 0.25·3 = 1.5; class 1 (new): (1·[0,4] + 3·[4,0]) / 4 = [3, 1]; class 5 kept.
        assert_eq!(out, vec![cm(0, 10, &[1.5, 1.5]), cm(1, 4, &[3.0, 1.0]), cm(5, 3, &[9.0, 9.0])]);
    }

    #[test]
    fn fusion_ignores_empty_and_mismatched_uploads() {
        let out = fuse(&[], &[cm(2, 0, &[5.0]), cm(3, 2, &[1.0, 1.0]), cm(3, 2, &[7.0])], 0.5);
        assert_eq!(out, vec![cm(3, 2, &[1.0, 1.0])]);
    }

    #[test]
    fn fusion_does_not_depend_on_upload_order() {
        let uploads = vec![cm(0, 2, &[1.0, 0.0]), cm(1, 5, &[0.0, 2.0]), cm(0, 7, &[3.0, 1.0]), cm(1, 1, &[2.0, 2.0])];
        let mut reversed = uploads.clone();
        reversed.reverse();
        let previous = vec![cm(1, 1, &[1.0, 1.0])];
        assert_eq!(fuse(&previous, &uploads, 0.3), fuse(&previous, &reversed, 0.3));
    }

    #[test]
    fn the_evolving_prototype_is_the_running_mean_of_domain_means() {
        let c1 = evolving_prototype(None, &[2.0], 1).unwrap();
        let c2 = evolving_prototype(Some(&c1), &[4.0], 2).unwrap();
        let c3 = evolving_prototype(Some(&c2), &[9.0], 3).unwrap();
        assert_eq!((c1[0], c2[0], c3[0]), (2.0, 3.0, 5.0), "C_m is the mean of the first m domain means");
        assert_eq!(evolving_prototype(Some(&[1.0]), &[1.0, 2.0], 2), None);
    }

    #[test]
    fn translation_and_nearest_new_class() {
        assert_eq!(translate(&[1.0, 1.0], &[5.0, 0.0], &[2.0, 2.0]), Some(vec![4.0, -1.0]));
        assert_eq!(translate(&[1.0], &[1.0, 2.0], &[0.0]), None);
        let news: [&[f32]; 3] = [&[0.0, 1.0], &[1.0, 0.1], &[-1.0, 0.0]];
        assert_eq!(nearest_by_cosine(&[2.0, 0.0], &news), Some(1));
        assert_eq!(nearest_by_cosine(&[2.0, 0.0], &[]), None);
    }

    #[test]
    fn bgps_picks_the_most_distinct_prototype_and_locks_below_the_threshold() {
        // Class 0 has two candidates: one close to class 1's, one orthogonal to it.
        let candidates: [(u32, &[f32]); 4] =
            [(0, &[1.0, 0.9]), (0, &[1.0, -1.0]), (1, &[0.9, 1.0]), (2, &[-1.0, -1.0])];
        let sel = best_global_prototypes(&candidates, 0.25, &BTreeSet::new());
        assert_eq!(sel.chosen[&0], 1, "the candidate least similar to the other classes");
        assert_eq!(sel.chosen[&1], 2);
        assert_eq!(sel.chosen[&2], 3);
        // Row means: candidate 1 = (1 + 1 − 0.053 + 0) / 4 ≈ 0.487 (kept open); candidate 2 =
        // (0.995 − 0.053 + 1 − 0.998) / 4 ≈ 0.236 and candidate 3 = (−0.998 + 0 − 0.998 + 1) / 4 ≈ −0.249,
        // both below 0.25: classes 1 and 2 are locked.
        assert_eq!(sel.newly_locked, [1, 2].into_iter().collect());
        // A locked class is never chosen again.
        let locked: BTreeSet<u32> = [2].into_iter().collect();
        let again = best_global_prototypes(&candidates, 0.25, &locked);
        assert!(!again.chosen.contains_key(&2));
    }
}
