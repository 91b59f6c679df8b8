//! The crate's public API as other crates use it: re-exports, seeding, covers and error cases.

use anchorage_data::partition::{self, MAX_REDRAWS};
use anchorage_data::synthetic::{self, generate, rotate};
use anchorage_data::{DataError, Dataset, SyntheticConfig};

fn small() -> SyntheticConfig {
    SyntheticConfig { train_per_class: 20, test_per_class: 5, ..Default::default() }
}

fn assert_disjoint_cover(parts: &[Vec<usize>], len: usize) {
    let mut all: Vec<usize> = parts.iter().flatten().copied().collect();
    all.sort_unstable();
    assert_eq!(all, (0..len).collect::<Vec<_>>(), "parts must be a disjoint cover of 0..{len}");
}

#[test]
fn default_config_matches_the_spec() {
    let cfg = SyntheticConfig::default();
    assert_eq!(
        cfg,
        SyntheticConfig {
            num_classes: 10,
            side: 16,
            train_per_class: 300,
            test_per_class: 100,
            noise: 0.35,
            max_shift: 2,
            seed: 7
        }
    );
}

#[test]
fn generated_sets_have_the_requested_shape_and_pass_validation() {
    let cfg = SyntheticConfig { num_classes: 3, side: 8, train_per_class: 7, test_per_class: 4, ..Default::default() };
    let (train, test) = generate(&cfg);
    for (ds, per) in [(&train, 7u64), (&test, 4)] {
        assert_eq!(ds.sample_shape, vec![1, 8, 8]);
        assert_eq!(ds.sample_len(), 64);
        assert_eq!(ds.class_counts(), vec![per; 3]);
        assert_eq!(ds.features.len(), ds.len() * 64);
        Dataset::new(ds.sample_shape.clone(), ds.num_classes, ds.features.clone(), ds.labels.clone())
            .expect("generated data is valid");
    }
    // Train and test come from independent streams: no test image equals a train image.
    for i in 0..test.len() {
        assert!((0..train.len()).all(|j| train.sample(j) != test.sample(i)));
    }
}

#[test]
fn same_seed_same_data_other_seed_other_data() {
    let a = generate(&small());
    let b = generate(&small());
    assert_eq!(a, b);
    assert_eq!(
        a.0.features.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        b.0.features.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    let c = generate(&SyntheticConfig { seed: 8, ..small() });
    assert_ne!(a.0.features, c.0.features);
    assert_ne!(a.1.features, c.1.features);
}

#[test]
fn templates_are_normalised() {
    // Without noise or shift, a sample is contrast × template: zero mean, deviation = contrast ∈ [0.8, 1.2].
    let (train, _) = generate(&SyntheticConfig {
        noise: 0.0,
        max_shift: 0,
        train_per_class: 3,
        test_per_class: 1,
        ..Default::default()
    });
    for i in 0..train.len() {
        let s = train.sample(i);
        let n = s.len() as f32;
        let mean = s.iter().sum::<f32>() / n;
        let std = (s.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / n).sqrt();
        assert!(mean.abs() < 1e-4, "sample {i} mean {mean}");
        assert!((0.8 - 1e-4..=1.2 + 1e-4).contains(&std), "sample {i} std {std}");
    }
}

#[test]
fn dataset_accessors() {
    let ds = Dataset::new(vec![2], 3, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5], vec![2, 0, 1, 2]).unwrap();
    assert_eq!(ds.len(), 4);
    assert!(!ds.is_empty());
    assert_eq!(ds.sample(2), &[2.0, 2.5]);
    assert_eq!(ds.class_counts(), vec![1, 1, 2]);
    let sub = ds.subset(&[3, 0, 3]);
    assert_eq!(sub.labels, vec![2, 2, 2]);
    assert_eq!(sub.features, vec![3.0, 3.5, 0.0, 0.5, 3.0, 3.5]);
    let empty = ds.subset(&[]);
    assert!(empty.is_empty());
    assert_eq!(empty.class_counts(), vec![0, 0, 0]);
}

#[test]
fn new_rejects_bad_input_with_readable_errors() {
    let e = Dataset::new(vec![1, 2, 2], 2, vec![0.0; 7], vec![0, 1]).unwrap_err();
    assert!(matches!(e, DataError::LengthMismatch { features: 7, labels: 2, sample_len: 4 }));
    assert!(e.to_string().contains('7'), "{e}");
    let e = Dataset::new(vec![1], 3, vec![0.0; 3], vec![0, 3, 1]).unwrap_err();
    assert!(matches!(e, DataError::LabelOutOfRange { index: 1, label: 3, num_classes: 3 }));
    assert!(matches!(Dataset::new(vec![1], 2, vec![0.0, f32::INFINITY], vec![0, 1]), Err(DataError::NonFinite(1))));
    assert!(matches!(Dataset::new(vec![1], 2, vec![f32::NAN, 0.0], vec![0, 1]), Err(DataError::NonFinite(0))));
}

#[test]
fn split_per_class_is_proportional_seeded_and_disjoint() {
    let (train, _) = generate(&SyntheticConfig { train_per_class: 33, test_per_class: 1, ..Default::default() });
    let (a, b) = train.split_per_class(0.3, 5);
    // round(0.3 × 33) = 10 of each class in the first part.
    assert_eq!(a.class_counts(), vec![10; 10]);
    assert_eq!(b.class_counts(), vec![23; 10]);
    assert_eq!((a.clone(), b.clone()), train.split_per_class(0.3, 5));
    assert_ne!(a.features, train.split_per_class(0.3, 6).0.features);
    // Together they hold exactly the original samples.
    let mut orig: Vec<Vec<u32>> =
        (0..train.len()).map(|i| train.sample(i).iter().map(|v| v.to_bits()).collect()).collect();
    let mut both: Vec<Vec<u32>> = (0..a.len())
        .map(|i| a.sample(i))
        .chain((0..b.len()).map(|i| b.sample(i)))
        .map(|s| s.iter().map(|v| v.to_bits()).collect())
        .collect();
    orig.sort();
    both.sort();
    assert_eq!(orig, both);
    let (all, none) = train.split_per_class(1.0, 1);
    assert_eq!((all.len(), none.len()), (train.len(), 0));
}

#[test]
fn rotation_keeps_labels_and_half_turns_compose() {
    let (ds, _) =
        generate(&SyntheticConfig { noise: 0.0, train_per_class: 2, test_per_class: 1, ..Default::default() });
    let r = rotate(&ds, 180.0);
    assert_eq!(r.labels, ds.labels);
    assert_eq!(r.sample_shape, ds.sample_shape);
    // A half turn of a 16×16 image about its centre is an exact pixel permutation.
    for i in 0..ds.len() {
        for y in 0..16 {
            for x in 0..16 {
                let (a, b) = (r.sample(i)[y * 16 + x], ds.sample(i)[(15 - y) * 16 + (15 - x)]);
                assert!((a - b).abs() < 1e-4, "sample {i} pixel {x},{y}: {a} vs {b}");
            }
        }
    }
    let back = synthetic::rotate(&r, 180.0);
    assert!(back.features.iter().zip(&ds.features).all(|(a, b)| (a - b).abs() < 1e-4));
    // A small rotation moves content but keeps most of its energy.
    let r15 = rotate(&ds, 15.0);
    assert_ne!(r15.features, ds.features);
    assert!(r15.features.iter().all(|v| v.is_finite()));
}

#[test]
fn iid_is_seeded_balanced_cover() {
    let a = partition::iid(1001, 7, 4);
    assert_eq!(a.len(), 7);
    assert_disjoint_cover(&a, 1001);
    assert!(a.iter().all(|p| p.len() == 143));
    assert_eq!(a, partition::iid(1001, 7, 4));
    assert_ne!(a, partition::iid(1001, 7, 5));
    let b = partition::iid(10, 3, 1);
    assert_disjoint_cover(&b, 10);
    let mut sizes: Vec<usize> = b.iter().map(Vec::len).collect();
    sizes.sort();
    assert_eq!(sizes, vec![3, 3, 4]);
    assert!(partition::iid(10, 0, 1).is_empty());
}

#[test]
fn dirichlet_on_generated_labels_is_seeded_cover() {
    let (train, _) = generate(&small());
    let a = partition::dirichlet(&train.labels, 10, 5, 0.3, 3, 11).unwrap();
    assert_eq!(a.len(), 5);
    assert_disjoint_cover(&a, train.len());
    assert_eq!(a, partition::dirichlet(&train.labels, 10, 5, 0.3, 3, 11).unwrap());
    assert_ne!(a, partition::dirichlet(&train.labels, 10, 5, 0.3, 3, 12).unwrap());
    // The parts select usable client datasets.
    let clients: Vec<Dataset> = a.iter().map(|p| train.subset(p)).collect();
    assert_eq!(clients.iter().map(Dataset::len).sum::<usize>(), train.len());
}

#[test]
fn dirichlet_honours_a_demanding_minimum() {
    let labels: Vec<u32> = (0..2000).map(|i| (i % 10) as u32).collect();
    for seed in 0..5 {
        let parts = partition::dirichlet(&labels, 10, 10, 0.1, 120, seed).unwrap();
        assert_disjoint_cover(&parts, labels.len());
        let smallest = parts.iter().map(Vec::len).min().unwrap();
        assert!(smallest >= 120, "seed {seed}: smallest client has {smallest}");
    }
}

#[test]
fn dirichlet_gives_up_after_bounded_redraws() {
    // 100 samples, 10 clients, at least 10 each: only an exactly even deal would do, which α = 0.01 never draws.
    let labels: Vec<u32> = (0..100).map(|i| (i % 10) as u32).collect();
    match partition::dirichlet(&labels, 10, 10, 0.01, 10, 1) {
        Err(e @ DataError::MinPerClientUnmet { attempts, .. }) => {
            assert_eq!(attempts, MAX_REDRAWS);
            assert!(e.to_string().contains("raise α"), "{e}");
        }
        other => panic!("expected MinPerClientUnmet, got {other:?}"),
    }
}
