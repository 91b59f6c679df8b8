//! The embedded default's model: a frozen random-feature backbone (Linear + ReLU) under a
//! trainable [`Net`](super::Net) (one adapter layer and a linear head).

use anchorage_shared::rng::Rng;

use super::linear::init_linear;
use super::net::NetSpec;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor, TensorData};
use serde::{Deserialize, Serialize};

/// Sizes and seed of the model. Every client and the server derive identical initial weights
/// from the same spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub input_dim: usize,
    /// Width of the frozen backbone's output (the feature size).
    pub feature_dim: usize,
    /// Width of the trainable adapter.
    pub adapter_dim: usize,
    pub num_classes: usize,
    pub seed: u64,
}

impl ModelSpec {
    /// The embedded default for 16×16 synthetic images and 10 classes: the adapter is
    /// 512×512 + 512 values (≈1 MiB in f32), so every update is a 1 MB-class upload.
    pub fn embedded_default() -> Self {
        Self { input_dim: 256, feature_dim: 512, adapter_dim: 512, num_classes: 10, seed: 17 }
    }

    /// The trainable net on this backbone's features: one adapter layer and the head.
    pub fn net(&self) -> NetSpec {
        NetSpec {
            input_dim: self.feature_dim,
            hidden: vec![self.adapter_dim],
            num_classes: self.num_classes,
            seed: self.seed,
            residual: false,
        }
    }
}

/// The frozen backbone: plain tensors outside any autodiff graph.
#[derive(Debug, Clone)]
pub struct FrozenBackbone {
    weight: Tensor<2>,
    bias: Tensor<1>,
}

impl FrozenBackbone {
    pub fn new(spec: &ModelSpec, device: &Device) -> Self {
        let mut rng = Rng::derive(spec.seed, 0xBAC4B0);
        let (w, b) = init_linear(&mut rng, spec.input_dim, spec.feature_dim);
        Self {
            weight: Tensor::from_data(TensorData::new(w, [spec.input_dim, spec.feature_dim]), device),
            bias: Tensor::from_data(TensorData::new(b, [spec.feature_dim]), device),
        }
    }

    /// The weight `[input_dim, feature_dim]`.
    pub fn weight(&self) -> Tensor<2> {
        self.weight.clone()
    }

    pub fn bias(&self) -> Tensor<1> {
        self.bias.clone()
    }

    /// Features of a batch `[n, input_dim]` → `[n, feature_dim]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        relu(x.matmul(self.weight.clone()) + self.bias.clone().unsqueeze())
    }
}
