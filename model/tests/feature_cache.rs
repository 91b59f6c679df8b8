//! The feature cache over any frozen backbone: same features as the backbone, computed once,
//! bounded by a memory budget (with an optional disk spill), invalidated when the weights or the
//! input transform change. No data files needed.

use anchorage_data::Dataset;
use anchorage_model::{
    Backbone, FeatureCache, FeatureStore, Frozen, FrozenBackbone, InputTransform, ModelSpec, ResNetCifarConfig,
};
use burn::tensor::{Device, Tensor};

fn images(n: usize) -> Dataset {
    let mut state = 7u64;
    let features = (0..n * 3 * 32 * 32)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 40) as f32 / (1u64 << 24) as f32
        })
        .collect();
    Dataset::new(vec![3, 32, 32], 10, features, (0..n as u32).map(|i| i % 10).collect()).unwrap()
}

fn max_diff(a: Tensor<2>, b: Tensor<2>) -> f32 {
    (a - b).abs().max().into_scalar::<f32>()
}

#[test]
fn store_serves_the_backbone_features_once() {
    let device = Device::flex();
    let data = images(24);
    let backbone = Frozen::new(ResNetCifarConfig::resnet20().init(&device), InputTransform::imagenet());
    let direct = FeatureCache::build(&backbone, &data, 10, &device);
    assert_eq!(direct.features().dims(), [24, 64]);

    let mut store = FeatureStore::new(1 << 20);
    store.chunk = 7;
    let first = FeatureCache::build_stored(&mut store, &backbone, &data, 1, &device).unwrap();
    assert!(max_diff(first.features(), direct.features()) < 1e-5);
    assert_eq!((store.stats().misses, store.stats().hits), (24, 0));
    let again = FeatureCache::build_stored(&mut store, &backbone, &data, 1, &device).unwrap();
    assert_eq!((store.stats().misses, store.stats().hits), (24, 24));
    assert_eq!(max_diff(again.features(), first.features()), 0.0);
    // A subset in another order comes from the cache too.
    let sub = store.features(&backbone, &data, 1, &[5, 2, 23], &device).unwrap();
    assert_eq!(store.stats().hits, 27);
    let want = direct.select(&[5, 2, 23]);
    assert!(max_diff(sub, want) < 1e-5);
    // Another data id is another dataset.
    store.features(&backbone, &data, 2, &[0], &device).unwrap();
    assert_eq!(store.stats().misses, 25);
}

#[test]
fn memory_budget_bounds_the_store_and_disk_takes_the_rest() {
    let device = Device::flex();
    let spec = ModelSpec { input_dim: 3 * 32 * 32, feature_dim: 100, adapter_dim: 8, num_classes: 10, seed: 3 };
    let backbone = FrozenBackbone::new(&spec, &device);
    let data = images(40);
    let per_sample = 100 * 4 + 48;
    let budget = 10 * per_sample;

    let mut store = FeatureStore::new(budget);
    let a = FeatureCache::build_stored(&mut store, &backbone, &data, 0, &device).unwrap();
    assert!(store.stats().memory_bytes as usize <= budget);
    assert_eq!((store.len(), store.stats().rejected), (10, 30));
    let b = FeatureCache::build_stored(&mut store, &backbone, &data, 0, &device).unwrap();
    assert_eq!((store.stats().hits, store.stats().misses), (10, 70));
    assert_eq!(max_diff(a.features(), b.features()), 0.0);

    let dir = std::env::temp_dir().join(format!("anchorage-spill-{}", std::process::id()));
    let mut store = FeatureStore::new(budget).with_disk(&dir, 20 * 400);
    let a = FeatureCache::build_stored(&mut store, &backbone, &data, 0, &device).unwrap();
    assert_eq!((store.len(), store.stats().rejected, store.stats().disk_bytes), (30, 10, 20 * 400));
    let b = FeatureCache::build_stored(&mut store, &backbone, &data, 0, &device).unwrap();
    assert_eq!(store.stats().hits, 30);
    assert_eq!(max_diff(a.features(), b.features()), 0.0);
    let direct = FeatureCache::build(&backbone, &data, 16, &device);
    assert!(max_diff(a.features(), direct.features()) < 1e-5);
    drop(store);
    assert_eq!(std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0), 0, "spill file removed on drop");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn new_weights_or_transform_invalidate() {
    let device = Device::flex();
    let data = images(6);
    let net = ResNetCifarConfig::resnet20().init(&device);
    let a = Frozen::new(net.clone(), InputTransform::imagenet());
    let same = Frozen::new(net.clone(), InputTransform::imagenet());
    let other_transform = Frozen::new(net, InputTransform::Identity);
    let other_weights = Frozen::new(ResNetCifarConfig::resnet20().init(&device), InputTransform::imagenet());
    assert_eq!(a.fingerprint(), same.fingerprint());
    assert_ne!(a.fingerprint(), other_transform.fingerprint());
    assert_ne!(a.fingerprint(), other_weights.fingerprint());

    let mut store = FeatureStore::new(1 << 20);
    FeatureCache::build_stored(&mut store, &a, &data, 0, &device).unwrap();
    FeatureCache::build_stored(&mut store, &same, &data, 0, &device).unwrap();
    assert_eq!((store.stats().hits, store.stats().invalidations), (6, 0));
    let f = FeatureCache::build_stored(&mut store, &other_transform, &data, 0, &device).unwrap();
    assert_eq!((store.stats().misses, store.stats().invalidations), (12, 1));
    let direct = FeatureCache::build(&other_transform, &data, 6, &device);
    assert!(max_diff(f.features(), direct.features()) < 1e-5);
    FeatureCache::build_stored(&mut store, &other_weights, &data, 0, &device).unwrap();
    assert_eq!((store.stats().misses, store.stats().invalidations, store.len()), (18, 2, 6));
}

#[test]
fn a_subset_is_rows_of_the_same_features_and_reads_like_a_copy() {
    let device = Device::flex();
    let data = images(12);
    let whole = FeatureCache::of_samples(data.clone(), &device);
    assert_eq!((whole.len(), whole.dim()), (12, 3 * 32 * 32));
    let rows = |c: &FeatureCache| -> Vec<f32> { c.features().into_data().try_to_vec::<f32>().unwrap() };
    let sample = |i: usize| data.sample(i).to_vec();
    // A subset of a subset: rows [7, 3, 9] of the whole, then rows [2, 0] of that = [9, 7].
    let a = whole.subset(&[7, 3, 9]);
    let b = a.subset(&[2, 0]);
    assert_eq!(b.labels_host[..], [data.labels[9], data.labels[7]]);
    assert_eq!(rows(&b), [sample(9), sample(7)].concat());
    // Batches and slices of a subset pick the same rows as its materialised features.
    let picked = a.select(&[1, 2]);
    assert_eq!(picked.into_data().try_to_vec::<f32>().unwrap(), [sample(3), sample(9)].concat());
    assert_eq!(a.slice(0..2).into_data().try_to_vec::<f32>().unwrap(), [sample(7), sample(3)].concat());
    // The identity backbone's built cache and the samples' own buffer agree.
    let identity = anchorage_model::zoo::load("identity", data.sample_len(), None, &device).unwrap();
    let built = FeatureCache::build(identity.as_ref(), &data, 5, &device);
    assert_eq!(max_diff(built.features(), whole.features()), 0.0);
}
