//! Prototypes on the client: class means of a representation (FedProK Eq. 5, GLDP Eq. 6,
//! FedEvolve Eq. 3), the wire form, and nearest-prototype prediction (GLDP Eq. 13).

use anchorage_model::ops::{cosine_similarities, squared_distances};
use anchorage_shared::method::Distance;
use anchorage_shared::prototype::Prototype;
use anchorage_shared::prototype_rules::ClassMean;
use anchorage_shared::tensor::{Encoding, TensorError};
use burn::tensor::{Device, Int, Tensor, TensorData};

/// Host values of a 2-D tensor, row-major.
pub fn host(t: Tensor<2>) -> Vec<f32> {
    t.into_data().convert::<f32>().try_to_vec::<f32>().unwrap_or_default()
}

/// Per-class means of `rep` `[n, d]` (no gradient), sorted by class.
pub fn class_means(rep: Tensor<2>, labels: &[u32]) -> Vec<ClassMean> {
    let [n, d] = rep.dims();
    let values = host(rep);
    let mut sums: std::collections::BTreeMap<u32, (Vec<f64>, u64)> = Default::default();
    for i in 0..n.min(labels.len()) {
        let (sum, count) = sums.entry(labels[i]).or_insert_with(|| (vec![0.0; d], 0));
        for (s, v) in sum.iter_mut().zip(&values[i * d..(i + 1) * d]) {
            *s += *v as f64;
        }
        *count += 1;
    }
    sums.into_iter()
        .map(|(class, (sum, count))| ClassMean {
            class,
            count,
            vector: sum.iter().map(|s| (s / count as f64) as f32).collect(),
        })
        .collect()
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

    #[test]
    fn wire_round_trip_and_nan_rejected() {
        let m = vec![ClassMean { class: 1, count: 2, vector: vec![0.5, -1.0] }];
        assert_eq!(from_wire(&to_wire(&m, Encoding::F32)).unwrap(), m);
        let bad = to_wire(&[ClassMean { class: 1, count: 2, vector: vec![f32::NAN] }], Encoding::F32);
        assert!(from_wire(&bad).is_err());
    }
}
