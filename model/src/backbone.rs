//! A frozen backbone as the feature cache sees it: samples in, features out, and a fingerprint
//! of everything that determines the features (weights and input transform).

use burn::module::Module;
use burn::tensor::{Tensor, TensorData};
use burn_store::ModuleSnapshot;

use super::input::{Fnv, InputTransform};
use super::{FrozenBackbone, MobileNetV2, ResNet18, ResNetCifar};

/// A backbone whose features are a pure function of (weights, transform, sample).
pub trait Backbone {
    /// Features `[n, feature_dim]` of flat samples `[n, sample_len]` of shape `sample_shape`
    /// (pixels in [0, 1] for image backbones; the backbone applies its own input transform).
    fn features(&self, x: Tensor<2>, sample_shape: &[usize]) -> Tensor<2>;
    fn feature_dim(&self) -> usize;
    /// Identity of the weights and the input transform; a cache built under another
    /// fingerprint is stale.
    fn fingerprint(&self) -> u64;
}

/// A network that maps transformed images `[n, c, h, w]` to pooled features.
pub trait FeatureNet: Module {
    fn forward_features(&self, x: Tensor<4>) -> Tensor<2>;
    fn feature_dim(&self) -> usize;
}

impl FeatureNet for ResNetCifar {
    fn forward_features(&self, x: Tensor<4>) -> Tensor<2> {
        ResNetCifar::forward_features(self, x)
    }
    fn feature_dim(&self) -> usize {
        ResNetCifar::FEATURE_DIM
    }
}

impl FeatureNet for ResNet18 {
    fn forward_features(&self, x: Tensor<4>) -> Tensor<2> {
        ResNet18::forward_features(self, x)
    }
    fn feature_dim(&self) -> usize {
        ResNet18::feature_dim(self)
    }
}

impl FeatureNet for MobileNetV2 {
    fn forward_features(&self, x: Tensor<4>) -> Tensor<2> {
        MobileNetV2::forward_features(self, x)
    }
    fn feature_dim(&self) -> usize {
        self.conv_last.weight.dims()[0]
    }
}

/// Fingerprint of every tensor of a module (names, shapes and bytes, in traversal order).
pub fn weights_fingerprint<M: Module>(module: &M) -> u64 {
    let mut h = Fnv::new();
    for t in module.collect(None, None, false) {
        h.write(t.name.as_bytes());
        for d in t.shape.iter() {
            h.write(&(*d as u64).to_le_bytes());
        }
        match t.to_bytes() {
            Ok(bytes) => h.write(&bytes),
            Err(e) => h.write(e.to_string().as_bytes()),
        }
    }
    h.finish()
}

/// A pretrained image network held frozen, with its input transform.
#[derive(Debug, Clone)]
pub struct Frozen<M> {
    pub net: M,
    pub transform: InputTransform,
    fingerprint: u64,
}

impl<M: FeatureNet> Frozen<M> {
    /// Freezes `net` (no gradients, and no training behaviour: BatchNorm keeps its running
    /// statistics even when a tracked input, such as a prompted image, passes through) and
    /// fingerprints its weights with `transform`.
    pub fn new(net: M, transform: InputTransform) -> Self {
        let net = net.freeze();
        let mut h = Fnv::new();
        h.write(&weights_fingerprint(&net).to_le_bytes());
        h.write(&transform.fingerprint().to_le_bytes());
        Self { net, transform, fingerprint: h.finish() }
    }
}

impl<M: FeatureNet> Backbone for Frozen<M> {
    fn features(&self, x: Tensor<2>, sample_shape: &[usize]) -> Tensor<2> {
        let [n, _] = x.dims();
        let [c, h, w] = match sample_shape {
            [c, h, w] => [*c, *h, *w],
            [h, w] => [1, *h, *w],
            other => [1, 1, other.iter().product()],
        };
        let x = x.reshape([n, c, h, w]);
        self.net.forward_features(self.transform.apply(x))
    }
    fn feature_dim(&self) -> usize {
        self.net.feature_dim()
    }
    fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

impl Backbone for FrozenBackbone {
    fn features(&self, x: Tensor<2>, _sample_shape: &[usize]) -> Tensor<2> {
        self.forward(x)
    }
    fn feature_dim(&self) -> usize {
        self.weight().dims()[1]
    }
    fn fingerprint(&self) -> u64 {
        let mut h = Fnv::new();
        h.write(b"random-feature-mlp");
        for data in [self.weight().into_data(), self.bias().into_data()] {
            let data: TensorData = data;
            h.write(data.as_bytes());
        }
        h.finish()
    }
}

/// No backbone: the raw input is the feature (Circle's 2-D points, a net trained end to end).
#[derive(Debug, Clone, Copy)]
pub struct Identity {
    pub dim: usize,
}

impl Backbone for Identity {
    fn features(&self, x: Tensor<2>, _sample_shape: &[usize]) -> Tensor<2> {
        x
    }
    fn feature_dim(&self) -> usize {
        self.dim
    }
    fn fingerprint(&self) -> u64 {
        let mut h = Fnv::new();
        h.write(b"identity");
        h.write(&(self.dim as u64).to_le_bytes());
        h.finish()
    }
}

/// A frozen backbone on raw samples, shared (one copy serves every client of a simulation), for
/// methods that change the backbone's input (FedTA's input enhancement).
#[derive(Clone)]
pub struct InputBackbone {
    pub net: std::sync::Arc<dyn Backbone + Send + Sync>,
    /// Shape of one raw sample (`[c, h, w]` for images).
    pub sample_shape: Vec<usize>,
}

impl std::fmt::Debug for InputBackbone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InputBackbone")
            .field("feature_dim", &self.net.feature_dim())
            .field("fingerprint", &format_args!("{:016x}", self.net.fingerprint()))
            .field("sample_shape", &self.sample_shape)
            .finish()
    }
}
