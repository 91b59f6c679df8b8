//! Properties of prototype fusion and weighted means: permutation invariance and weight
//! consistency (FedProK Eq. 9, GLDP Eq. 11, FedAvg).

use anchorage_shared::math::weighted_mean;
use anchorage_shared::prototype_rules::{ClassMean, fuse};
use proptest::prelude::*;

fn uploads() -> impl Strategy<Value = Vec<ClassMean>> {
    proptest::collection::vec((0u32..4, 1u64..50, proptest::collection::vec(-10f32..10f32, 3)), 1..12)
        .prop_map(|v| v.into_iter().map(|(class, count, vector)| ClassMean { class, count, vector }).collect())
}

fn close(a: &[ClassMean], b: &[ClassMean]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.class == y.class
                && x.count == y.count
                && x.vector.iter().zip(&y.vector).all(|(p, q)| (p - q).abs() <= 1e-4 * (1.0 + p.abs()))
        })
}

proptest! {
    #[test]
    fn fusion_is_permutation_invariant(ups in uploads(), seed in any::<u64>(), beta in 0f32..1f32) {
        let mut shuffled = ups.clone();
        let n = shuffled.len();
        for i in (1..n).rev() {
            shuffled.swap(i, (seed.wrapping_mul(6364136223846793005).wrapping_add(i as u64) % (i as u64 + 1)) as usize);
        }
        let previous = vec![ClassMean { class: 0, count: 5, vector: vec![1.0, 2.0, 3.0] }];
        prop_assert!(close(&fuse(&previous, &ups, beta), &fuse(&previous, &shuffled, beta)));
    }

    #[test]
    fn splitting_an_upload_changes_nothing(ups in uploads(), beta in 0f32..1f32) {
        // One client with count 2n weighs the same as two clients with the same prototype and count n.
        let doubled: Vec<ClassMean> = ups.iter().map(|u| ClassMean { count: u.count * 2, ..u.clone() }).collect();
        let split: Vec<ClassMean> = ups.iter().flat_map(|u| [u.clone(), u.clone()]).collect();
        prop_assert!(close(&fuse(&[], &doubled, beta), &fuse(&[], &split, beta)));
    }

    #[test]
    fn weighted_mean_scales_with_weights(parts in proptest::collection::vec((proptest::collection::vec(-5f32..5f32, 4), 0.1f64..10.0), 1..8), k in 0.5f64..20.0) {
        let a: Vec<(&[f32], f64)> = parts.iter().map(|(v, w)| (v.as_slice(), *w)).collect();
        let b: Vec<(&[f32], f64)> = parts.iter().map(|(v, w)| (v.as_slice(), *w * k)).collect();
        let (x, y) = (weighted_mean(&a).unwrap(), weighted_mean(&b).unwrap());
        prop_assert!(x.iter().zip(&y).all(|(p, q)| (p - q).abs() <= 1e-4 * (1.0 + p.abs())));
    }
}
