//! Frozen-backbone features, computed once per sample and reused by every epoch and round.

use anchorage_data::Dataset;
use burn::tensor::{Device, Int, Tensor, TensorData};

use super::FrozenBackbone;

/// Features and labels of a dataset under a frozen backbone, kept on the training device.
#[derive(Debug, Clone)]
pub struct FeatureCache {
    pub features: Tensor<2>,
    pub labels: Tensor<1, Int>,
    pub labels_host: Vec<u32>,
}

impl FeatureCache {
    /// Runs the backbone over `data` in chunks of `chunk` samples.
    pub fn build(backbone: &FrozenBackbone, data: &Dataset, chunk: usize, device: &Device) -> Self {
        let dim = data.sample_len();
        let mut parts = Vec::new();
        for start in (0..data.len()).step_by(chunk.max(1)) {
            let end = (start + chunk.max(1)).min(data.len());
            let x = Tensor::<2>::from_data(
                TensorData::new(data.features[start * dim..end * dim].to_vec(), [end - start, dim]),
                device,
            );
            parts.push(backbone.forward(x));
        }
        let features = if parts.is_empty() { Tensor::zeros([0, dim], device) } else { Tensor::cat(parts, 0) };
        let labels_i: Vec<i64> = data.labels.iter().map(|&l| l as i64).collect();
        let labels = Tensor::<1, Int>::from_data(TensorData::new(labels_i, [data.len()]), device);
        Self { features, labels, labels_host: data.labels.clone() }
    }

    pub fn len(&self) -> usize {
        self.labels_host.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels_host.is_empty()
    }
}
