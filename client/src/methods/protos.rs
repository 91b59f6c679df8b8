//! Prototypes on the client: class means of a representation (FedProK Eq. 5, GLDP Eq. 6,
//! FedEvolve Eq. 3), what a device uploads of them ([`PrototypeRelease`]: the means, or under
//! `[privacy]` sums of clipped features), the wire form, and nearest-prototype prediction (GLDP
//! Eq. 13).

use std::collections::BTreeMap;

use anchorage_model::ops::{cosine_similarities, squared_distances};
use anchorage_shared::method::Distance;
use anchorage_shared::privacy::PrivacyConfig;
use anchorage_shared::privacy::mechanism::clip_feature;
use anchorage_shared::prototype::Prototype;
use anchorage_shared::prototype_rules::ClassMean;
use anchorage_shared::tensor::{Encoding, TensorError};
use burn::tensor::{Device, Int, Tensor, TensorData};

/// Host values of a 2-D tensor, row-major.
pub fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap_or_default()
}

/// What a device uploads as its prototypes.
///
/// - [`PrototypeRelease::Means`] (`[privacy]` off, the papers' rule): each class's mean feature
///   and its count.
/// - [`PrototypeRelease::ClippedSums`] (`[privacy]` on, central or local noise): each class's
///   **sum** of per-sample features, every one first clipped to L2 norm `clip`
///   ([`clip_feature`]), and its count. One sample then moves a sum by at most `clip`, so
///   Gaussian noise of σ·`clip` on the sum (by the device under local noise, by the server under
///   central noise) makes it private, and sums add up across devices, a buffer and a secure
///   aggregate; the server divides the summed sums by the summed counts. The update says so in its
///   `prototypes_are` field (set by [`crate::privacy::Privatized`]).
///
/// The prototypes a method keeps on the device for its own loss and prediction stay means.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum PrototypeRelease {
    #[default]
    Means,
    ClippedSums {
        clip: f64,
    },
}

impl PrototypeRelease {
    /// The release `[privacy]` asks for: sums of features clipped to `prototype_clip` when it is
    /// on, means when off.
    pub fn of(privacy: &PrivacyConfig) -> Self {
        if privacy.is_on() { Self::ClippedSums { clip: privacy.prototype_clip } } else { Self::Means }
    }

    /// Whether uploads are sums.
    pub fn is_sums(self) -> bool {
        matches!(self, Self::ClippedSums { .. })
    }
}

/// Per-class sums (in f64) and counts of the rows of `values` (`[n, d]` row-major), each row
/// clipped to L2 norm `clip` first when given.
fn accumulate(values: &[f32], [n, d]: [usize; 2], labels: &[u32], clip: Option<f64>) -> BTreeMap<u32, (Vec<f64>, u64)> {
    let mut sums: BTreeMap<u32, (Vec<f64>, u64)> = Default::default();
    for i in 0..n.min(labels.len()) {
        let row = &values[i * d..(i + 1) * d];
        let clipped = clip.map(|c| clip_feature(row, c));
        let (sum, count) = sums.entry(labels[i]).or_insert_with(|| (vec![0.0; d], 0));
        for (s, v) in sum.iter_mut().zip(clipped.as_deref().unwrap_or(row)) {
            *s += *v as f64;
        }
        *count += 1;
    }
    sums
}

fn means_of(sums: &BTreeMap<u32, (Vec<f64>, u64)>) -> Vec<ClassMean> {
    sums.iter()
        .map(|(&class, (sum, count))| ClassMean {
            class,
            count: *count,
            vector: sum.iter().map(|s| (s / *count as f64) as f32).collect(),
        })
        .collect()
}

fn sums_of(sums: &BTreeMap<u32, (Vec<f64>, u64)>) -> Vec<ClassMean> {
    sums.iter()
        .map(|(&class, (sum, count))| ClassMean {
            class,
            count: *count,
            vector: sum.iter().map(|s| *s as f32).collect(),
        })
        .collect()
}

/// Per-class means of `rep` `[n, d]` (no gradient), sorted by class.
pub fn class_means(rep: Tensor<2>, labels: &[u32]) -> Vec<ClassMean> {
    let dims = rep.dims();
    means_of(&accumulate(&host(rep), dims, labels, None))
}

/// Per-class sums of the rows of `rep` `[n, d]`, each clipped to L2 norm `clip` before it is
/// added, sorted by class ([`ClassMean::vector`] holds the sum): a class's sum has norm at most
/// its count · `clip`.
pub fn class_clipped_sums(rep: Tensor<2>, labels: &[u32], clip: f64) -> Vec<ClassMean> {
    let dims = rep.dims();
    sums_of(&accumulate(&host(rep), dims, labels, Some(clip)))
}

/// Adds `more` class sums into `into` (the same class: sums and counts added; rows of another
/// dimension are left out), sorted by class.
pub fn add_sums(into: &mut Vec<ClassMean>, more: Vec<ClassMean>) {
    for m in more {
        match into.iter_mut().find(|s| s.class == m.class) {
            Some(s) if s.vector.len() == m.vector.len() => {
                s.vector.iter_mut().zip(&m.vector).for_each(|(a, b)| *a += b);
                s.count += m.count;
            }
            Some(_) => {}
            None => into.push(m),
        }
    }
    into.sort_by_key(|m| m.class);
}

/// The class means of `rep` `[n, d]` with `labels` (what the method keeps) and the prototypes
/// it uploads under `release`, from one copy of `rep`'s values: with [`PrototypeRelease::Means`]
/// the means' wire form, exactly as [`to_wire`] of [`class_means`] (byte for byte); with
/// [`PrototypeRelease::ClippedSums`] the per-class sums of clipped features.
pub fn means_and_upload(
    rep: Tensor<2>,
    labels: &[u32],
    release: PrototypeRelease,
    encoding: Encoding,
) -> (Vec<ClassMean>, Vec<Prototype>) {
    let dims = rep.dims();
    let values = host(rep);
    let means = means_of(&accumulate(&values, dims, labels, None));
    let wire = match release {
        PrototypeRelease::Means => to_wire(&means, encoding),
        PrototypeRelease::ClippedSums { clip } => {
            to_wire(&sums_of(&accumulate(&values, dims, labels, Some(clip))), encoding)
        }
    };
    (means, wire)
}

/// The prototypes a device uploads of `rep` `[n, d]` with `labels` under `release`: the class
/// means' wire form (privacy off), or the per-class sums of features clipped to the release's
/// clip, with their counts (privacy on).
pub fn upload_prototypes(
    rep: Tensor<2>,
    labels: &[u32],
    release: PrototypeRelease,
    encoding: Encoding,
) -> Vec<Prototype> {
    match release {
        PrototypeRelease::Means => to_wire(&class_means(rep, labels), encoding),
        PrototypeRelease::ClippedSums { clip } => to_wire(&class_clipped_sums(rep, labels, clip), encoding),
    }
}

/// `primary` plus the classes only `fallback` has (e.g. global prototypes, completed by the
/// local ones of classes the server has not seen yet).
pub fn merge_missing(primary: &[ClassMean], fallback: &[ClassMean]) -> Vec<ClassMean> {
    let mut out = primary.to_vec();
    out.extend(fallback.iter().filter(|f| !primary.iter().any(|p| p.class == f.class)).cloned());
    out.sort_by_key(|m| m.class);
    out
}

/// Prototypes as they travel.
pub fn to_wire(means: &[ClassMean], encoding: Encoding) -> Vec<Prototype> {
    means.iter().map(|m| Prototype::encode(m.class, m.count, &m.vector, encoding)).collect()
}

/// Validated, decoded prototypes from the wire.
pub fn from_wire(prototypes: &[Prototype]) -> Result<Vec<ClassMean>, TensorError> {
    prototypes
        .iter()
        .map(|p| {
            p.validate()?;
            Ok(ClassMean { class: p.class, count: p.count, vector: p.values()? })
        })
        .collect()
}

/// Prototypes as a matrix `[c, d]` with the class of each row; rows of another dimension than
/// the first are left out.
#[derive(Debug, Clone)]
pub struct PrototypeTable {
    pub classes: Vec<u32>,
    pub counts: Vec<u64>,
    pub matrix: Tensor<2>,
}

impl PrototypeTable {
    /// `None` without prototypes.
    pub fn new(means: &[ClassMean], device: &Device) -> Option<Self> {
        let d = means.first()?.vector.len();
        let rows: Vec<&ClassMean> = means.iter().filter(|m| m.vector.len() == d && d > 0).collect();
        if rows.is_empty() {
            return None;
        }
        let values: Vec<f32> = rows.iter().flat_map(|m| m.vector.iter().copied()).collect();
        Some(Self {
            classes: rows.iter().map(|m| m.class).collect(),
            counts: rows.iter().map(|m| m.count).collect(),
            matrix: Tensor::from_data(TensorData::new(values, [rows.len(), d]), device),
        })
    }

    pub fn dim(&self) -> usize {
        self.matrix.dims()[1]
    }

    /// Row of `class`, if present.
    pub fn row(&self, class: u32) -> Option<usize> {
        self.classes.iter().position(|&c| c == class)
    }

    /// Similarity logits `[n, c]` of `z` `[n, d]` to every prototype: −‖z − p‖² (Euclidean) or
    /// cos(z, p) (cosine), divided by the temperature.
    pub fn logits(&self, z: Tensor<2>, distance: Distance, temperature: f32) -> Tensor<2> {
        let p = self.matrix.clone();
        let s = match distance {
            Distance::Euclidean => -squared_distances(z, p),
            Distance::Cosine => cosine_similarities(z, p),
        };
        s / temperature.max(1e-6)
    }

    /// Nearest prototype's class of each row of `z` (GLDP Eq. 13): `[n, 1]`.
    pub fn predict(&self, z: Tensor<2>, distance: Distance) -> Tensor<2, Int> {
        let index = self.logits(z, distance, 1.0).argmax(1);
        let device = index.device();
        let [n, _] = index.dims();
        let classes = Tensor::<1, Int>::from_data(
            TensorData::new(self.classes.iter().map(|&c| c as i64).collect::<Vec<_>>(), [self.classes.len()]),
            &device,
        );
        classes.select(0, index.reshape([n])).reshape([n, 1])
    }

    /// Row index of each label (labels without a prototype map to `None`).
    pub fn rows_of(&self, labels: &[u32]) -> Vec<Option<usize>> {
        labels.iter().map(|&l| self.row(l)).collect()
    }
}

/// Differentiable per-class means of a batch `z` `[n, d]`: the classes present (sorted) and
/// their means `[k, d]` (GLDP Eq. 6 on a batch).
pub fn batch_class_means(z: Tensor<2>, labels: &[u32]) -> (Vec<u32>, Tensor<2>) {
    let mut classes: Vec<u32> = labels.to_vec();
    classes.sort_unstable();
    classes.dedup();
    let n = labels.len();
    let mut weights = vec![0.0f32; classes.len() * n];
    for (k, c) in classes.iter().enumerate() {
        let count = labels.iter().filter(|l| *l == c).count() as f32;
        for (i, l) in labels.iter().enumerate() {
            if l == c {
                weights[k * n + i] = 1.0 / count;
            }
        }
    }
    let device = z.device();
    let w = Tensor::<2>::from_data(TensorData::new(weights, [classes.len(), n]), &device);
    (classes, w.matmul(z))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(values: &[f32], shape: [usize; 2]) -> Tensor<2> {
        Tensor::from_data(TensorData::new(values.to_vec(), shape), &Device::flex())
    }

    #[test]
    fn class_means_by_hand() {
        let rep = t(&[1.0, 0.0, 3.0, 2.0, 5.0, 5.0], [3, 2]);
        let means = class_means(rep, &[4, 4, 1]);
        assert_eq!(means.len(), 2);
        assert_eq!((means[0].class, means[0].count, means[0].vector.clone()), (1, 1, vec![5.0, 5.0]));
        assert_eq!((means[1].class, means[1].count, means[1].vector.clone()), (4, 2, vec![2.0, 1.0]));
    }

    #[test]
    fn nearest_prototype_predicts_class_ids() {
        let means = [
            ClassMean { class: 7, count: 1, vector: vec![0.0, 0.0] },
            ClassMean { class: 3, count: 1, vector: vec![10.0, 0.0] },
        ];
        let table = PrototypeTable::new(&means, &Device::flex()).unwrap();
        let z = t(&[1.0, 1.0, 9.0, -1.0], [2, 2]);
        let pred = table.predict(z, Distance::Euclidean).into_data().convert::<i64>().try_to_vec::<i64>().unwrap();
        assert_eq!(pred, vec![7, 3]);
        let d = squared_distances(t(&[1.0, 1.0], [1, 2]), table.matrix.clone());
        assert_eq!(host(d), vec![2.0, 82.0]);
    }

    #[test]
    fn batch_means_are_per_class() {
        let z = t(&[1.0, 2.0, 3.0, 4.0, 10.0, 10.0], [3, 2]);
        let (classes, means) = batch_class_means(z, &[2, 0, 2]);
        assert_eq!(classes, vec![0, 2]);
        assert_eq!(host(means), vec![3.0, 4.0, 5.5, 6.0]);
    }

    /// Per-sample clipping bounds each class sum's norm by count · clip; features within the clip
    /// are summed as they are.
    #[test]
    fn clipped_sums_are_bounded_by_count_times_clip() {
        let mut rng = anchorage_shared::rng::Rng::new(4);
        let (n, d, clip) = (60, 16, 0.5);
        let values: Vec<f32> = (0..n * d).map(|_| (rng.normal() * 3.0) as f32).collect();
        let labels: Vec<u32> = (0..n as u32).map(|i| i % 3).collect();
        let sums = class_clipped_sums(t(&values, [n, d]), &labels, clip);
        assert_eq!(sums.iter().map(|s| (s.class, s.count)).collect::<Vec<_>>(), [(0, 20), (1, 20), (2, 20)]);
        for s in &sums {
            let norm = s.vector.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
            assert!(norm <= s.count as f64 * clip * (1.0 + 1e-6), "class {}: {norm}", s.class);
            assert!(norm > 0.1, "not all clipped away");
        }
        // One sample per class, every feature far beyond the clip: each sum has norm clip.
        let one = class_clipped_sums(t(&[30.0, 40.0, 0.0, -7.0], [2, 2]), &[1, 2], clip);
        assert!((one[0].vector[0] - 0.3).abs() < 1e-6 && (one[0].vector[1] - 0.4).abs() < 1e-6);
        assert!((one[1].vector[1] + 0.5).abs() < 1e-6);
        // Within the clip: the plain sum.
        let plain = class_clipped_sums(t(&[0.1, 0.0, 0.2, 0.1], [2, 2]), &[5, 5], 10.0);
        assert_eq!(plain[0].count, 2);
        assert!((plain[0].vector[0] - 0.3).abs() < 1e-6 && (plain[0].vector[1] - 0.1).abs() < 1e-6);
    }

    /// Off, the upload is the means' wire form byte for byte; on, the sums divided by the counts
    /// give the means when nothing is clipped.
    #[test]
    fn the_upload_is_the_means_when_off_and_the_sums_when_on() {
        let values = [1.0, 0.0, 3.0, 2.0, 5.0, 5.0, 0.25, -1.5];
        let labels = [4, 4, 1, 4];
        let before = to_wire(&class_means(t(&values, [4, 2]), &labels), Encoding::F16);
        let (means, off) = means_and_upload(t(&values, [4, 2]), &labels, PrototypeRelease::Means, Encoding::F16);
        assert_eq!(postcard::to_allocvec(&off).unwrap(), postcard::to_allocvec(&before).unwrap());
        assert_eq!(upload_prototypes(t(&values, [4, 2]), &labels, PrototypeRelease::Means, Encoding::F16), before);
        assert_eq!(means, class_means(t(&values, [4, 2]), &labels), "the kept prototypes stay means");
        let release = PrototypeRelease::ClippedSums { clip: 100.0 };
        let (kept, on) = means_and_upload(t(&values, [4, 2]), &labels, release, Encoding::F32);
        assert_eq!(kept, means, "the kept prototypes stay means under privacy too");
        for (sum, mean) in from_wire(&on).unwrap().iter().zip(&means) {
            assert_eq!((sum.class, sum.count), (mean.class, mean.count));
            for (s, m) in sum.vector.iter().zip(&mean.vector) {
                assert!((s / sum.count as f32 - m).abs() < 1e-6, "{s} / {} against {m}", sum.count);
            }
        }
        let off_config = PrivacyConfig::default();
        assert_eq!(PrototypeRelease::of(&off_config), PrototypeRelease::Means);
        let on = PrivacyConfig {
            noise: anchorage_shared::privacy::NoiseSite::Central,
            prototype_clip: 2.5,
            ..PrivacyConfig::default()
        };
        assert_eq!(PrototypeRelease::of(&on), PrototypeRelease::ClippedSums { clip: 2.5 });
    }

    #[test]
    fn sums_add_up_by_class() {
        let mut into = vec![ClassMean { class: 2, count: 1, vector: vec![1.0, 1.0] }];
        add_sums(
            &mut into,
            vec![
                ClassMean { class: 2, count: 3, vector: vec![0.5, -1.0] },
                ClassMean { class: 0, count: 2, vector: vec![4.0, 0.0] },
                ClassMean { class: 2, count: 9, vector: vec![1.0] },
            ],
        );
        assert_eq!(
            into,
            vec![
                ClassMean { class: 0, count: 2, vector: vec![4.0, 0.0] },
                ClassMean { class: 2, count: 4, vector: vec![1.5, 0.0] }
            ]
        );
    }

    #[test]
    fn wire_round_trip_and_nan_rejected() {
        let m = vec![ClassMean { class: 1, count: 2, vector: vec![0.5, -1.0] }];
        assert_eq!(from_wire(&to_wire(&m, Encoding::F32)).unwrap(), m);
        let bad = to_wire(&[ClassMean { class: 1, count: 2, vector: vec![f32::NAN] }], Encoding::F32);
        assert!(from_wire(&bad).is_err());
    }
}
