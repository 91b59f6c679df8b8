//! An in-memory labelled dataset of f32 samples.

use anchorage_shared::rng::Rng;

use crate::DataError;

/// Samples of `sample_shape` (e.g. `[1, 16, 16]`), row-major, with one label each.
#[derive(Debug, Clone, PartialEq)]
pub struct Dataset {
    pub sample_shape: Vec<usize>,
    pub num_classes: u32,
    pub features: Vec<f32>,
    pub labels: Vec<u32>,
}

impl Dataset {
    /// Checks lengths, label range and finiteness.
    pub fn new(
        sample_shape: Vec<usize>,
        num_classes: u32,
        features: Vec<f32>,
        labels: Vec<u32>,
    ) -> Result<Self, DataError> {
        let sample_len: usize = sample_shape.iter().product();
        if features.len() != labels.len() * sample_len {
            return Err(DataError::LengthMismatch { features: features.len(), labels: labels.len(), sample_len });
        }
        if let Some((index, &label)) = labels.iter().enumerate().find(|(_, l)| **l >= num_classes) {
            return Err(DataError::LabelOutOfRange { index, label, num_classes });
        }
        if let Some(i) = features.iter().position(|v| !v.is_finite()) {
            return Err(DataError::NonFinite(i));
        }
        Ok(Self { sample_shape, num_classes, features, labels })
    }

    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Values per sample.
    pub fn sample_len(&self) -> usize {
        self.sample_shape.iter().product()
    }

    pub fn sample(&self, i: usize) -> &[f32] {
        let n = self.sample_len();
        &self.features[i * n..(i + 1) * n]
    }

    /// A copy of the samples at `indices`, in that order.
    /// [`Dataset::subset`] that consumes `self`: when `indices` are every row in order, the
    /// samples are kept as they are, not copied (a million simulated clients' generated set is
    /// gigabytes, and a copy would hold it twice).
    pub fn into_subset(self, indices: &[usize]) -> Dataset {
        let every_row = indices.len() == self.len() && indices.iter().enumerate().all(|(i, &r)| i == r);
        if every_row { self } else { self.subset(indices) }
    }

    pub fn subset(&self, indices: &[usize]) -> Dataset {
        let mut features = Vec::with_capacity(indices.len() * self.sample_len());
        for &i in indices {
            features.extend_from_slice(self.sample(i));
        }
        Dataset {
            sample_shape: self.sample_shape.clone(),
            num_classes: self.num_classes,
            features,
            labels: indices.iter().map(|&i| self.labels[i]).collect(),
        }
    }

    /// Samples per class.
    pub fn class_counts(&self) -> Vec<u64> {
        let mut counts = vec![0u64; self.num_classes as usize];
        for &l in &self.labels {
            counts[l as usize] += 1;
        }
        counts
    }

    /// Indices of each class, in dataset order.
    pub fn indices_by_class(&self) -> Vec<Vec<usize>> {
        let mut by = vec![Vec::new(); self.num_classes as usize];
        for (i, &l) in self.labels.iter().enumerate() {
            by[l as usize].push(i);
        }
        by
    }

    /// Splits into (first, second) with `fraction` of each class in the first (rounded), after a
    /// seeded shuffle within the class.
    pub fn split_per_class(&self, fraction: f64, seed: u64) -> (Dataset, Dataset) {
        let (first, second) = self.split_indices_per_class(fraction, seed);
        (self.subset(&first), self.subset(&second))
    }

    /// The indices of [`Dataset::split_per_class`]'s two parts, each sorted.
    pub fn split_indices_per_class(&self, fraction: f64, seed: u64) -> (Vec<usize>, Vec<usize>) {
        let mut rng = Rng::new(seed);
        let (mut first, mut second) = (Vec::new(), Vec::new());
        for mut idx in self.indices_by_class() {
            rng.shuffle(&mut idx);
            let k = ((idx.len() as f64) * fraction.clamp(0.0, 1.0)).round() as usize;
            first.extend_from_slice(&idx[..k]);
            second.extend_from_slice(&idx[k..]);
        }
        first.sort_unstable();
        second.sort_unstable();
        (first, second)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_rejects_bad_input() {
        assert!(matches!(Dataset::new(vec![2], 2, vec![0.0; 3], vec![0, 1]), Err(DataError::LengthMismatch { .. })));
        assert!(matches!(
            Dataset::new(vec![1], 2, vec![0.0; 2], vec![0, 2]),
            Err(DataError::LabelOutOfRange { index: 1, .. })
        ));
        assert!(matches!(Dataset::new(vec![1], 2, vec![0.0, f32::NAN], vec![0, 1]), Err(DataError::NonFinite(1))));
    }

    #[test]
    fn into_subset_keeps_every_row_in_place_and_picks_the_others() {
        let ds = Dataset::new(vec![2], 3, (0..8).map(|i| i as f32).collect(), vec![0, 1, 2, 0]).unwrap();
        let buffer = ds.features.as_ptr();
        let same = ds.clone().into_subset(&[0, 1, 2, 3]);
        assert_eq!(same, ds);
        let kept = ds.clone().into_subset(&[0, 1, 2, 3]);
        assert_ne!(kept.features.as_ptr(), buffer, "a clone's buffer");
        let moved_from = kept.features.as_ptr();
        assert_eq!(kept.into_subset(&[0, 1, 2, 3]).features.as_ptr(), moved_from, "every row: not copied");
        assert_eq!(ds.clone().into_subset(&[3, 1]), ds.subset(&[3, 1]));
        assert_eq!(ds.clone().into_subset(&[1, 0, 2, 3]), ds.subset(&[1, 0, 2, 3]), "every row, another order");
    }

    #[test]
    fn split_keeps_class_proportions() {
        let labels: Vec<u32> = (0..100).map(|i| (i % 4) as u32).collect();
        let ds = Dataset::new(vec![1], 4, (0..100).map(|i| i as f32).collect(), labels).unwrap();
        let (a, b) = ds.split_per_class(0.8, 3);
        assert_eq!(a.class_counts(), vec![20; 4]);
        assert_eq!(b.class_counts(), vec![5; 4]);
        let mut all: Vec<f32> = a.features.iter().chain(&b.features).copied().collect();
        all.sort_by(f32::total_cmp);
        assert_eq!(all, ds.features);
    }
}
