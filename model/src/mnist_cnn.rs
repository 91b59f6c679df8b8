//! The rotated-MNIST CNN of FedEvolve: four 3×3 convolutions, each followed by GroupNorm (groups
//! of 8 channels) and ReLU, then two linear layers with hidden size 64.
//!
//! Channels: 32 in every convolution (4 groups of 8). Strides 1, 2, 1, 2 shrink the map
//! 28 → 28 → 14 → 14 → 7, so the flattened map is 32·7·7 = 1568 values.
//! Parts: `representation` (convolutions + the first linear layer, 64 features) and
//! `classifier` (64 → classes), so a method can share or personalize each.

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{GroupNorm, GroupNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

/// Channels per GroupNorm group.
const GROUP_CHANNELS: usize = 8;
/// Strides of the four convolutions.
const STRIDES: [usize; 4] = [1, 2, 1, 2];

/// Width, input size and classes of the CNN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MnistCnnConfig {
    /// Channels of every convolution (a multiple of 8).
    pub channels: usize,
    /// Hidden size of the first linear layer (the representation width).
    pub hidden: usize,
    /// Side of the square single-channel input.
    pub image_size: usize,
    pub num_classes: usize,
}

impl MnistCnnConfig {
    /// FedEvolve's rotated MNIST: 32 channels, hidden size 64, 28×28 inputs, 10 classes.
    pub fn rotated_mnist() -> Self {
        Self { channels: 32, hidden: 64, image_size: 28, num_classes: 10 }
    }

    /// Side of the last feature map (each stride-2 convolution halves it, rounding up).
    pub fn map_size(&self) -> usize {
        STRIDES.iter().fold(self.image_size, |s, &stride| s.div_ceil(stride))
    }

    /// A randomly initialised network (panics only when `channels` is not a multiple of 8).
    pub fn init(&self, device: &Device) -> MnistCnn {
        assert!(self.channels % GROUP_CHANNELS == 0, "MNIST CNN channels must be a multiple of 8");
        let convs = STRIDES
            .iter()
            .enumerate()
            .map(|(i, &stride)| ConvGn::new(if i == 0 { 1 } else { self.channels }, self.channels, stride, device))
            .collect();
        let flat = self.channels * self.map_size() * self.map_size();
        MnistCnn {
            representation: CnnRepresentation { convs, fc: LinearConfig::new(flat, self.hidden).init(device) },
            classifier: LinearConfig::new(self.hidden, self.num_classes).init(device),
        }
    }
}

/// A 3×3 convolution (padding 1), GroupNorm of 8-channel groups, ReLU.
#[derive(Module, Debug)]
pub struct ConvGn {
    pub conv: Conv2d,
    pub norm: GroupNorm,
}

impl ConvGn {
    fn new(c_in: usize, c_out: usize, stride: usize, device: &Device) -> Self {
        Self {
            conv: Conv2dConfig::new([c_in, c_out], [3, 3])
                .with_stride([stride, stride])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(device),
            norm: GroupNormConfig::new(c_out / GROUP_CHANNELS, c_out).init(device),
        }
    }

    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        relu(self.norm.forward(self.conv.forward(x)))
    }
}

/// Convolutions, flatten, first linear layer and ReLU: images `[n, 1, h, w]` → `[n, hidden]`.
#[derive(Module, Debug)]
pub struct CnnRepresentation {
    pub convs: Vec<ConvGn>,
    pub fc: Linear,
}

impl CnnRepresentation {
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        let mut x = x;
        for conv in &self.convs {
            x = conv.forward(x);
        }
        let x: Tensor<2> = x.flatten(1, 3);
        relu(self.fc.forward(x))
    }
}

/// The rotated-MNIST CNN: a shared or personal `representation` under a linear `classifier`.
#[derive(Module, Debug)]
pub struct MnistCnn {
    pub representation: CnnRepresentation,
    pub classifier: Linear,
}

impl MnistCnn {
    /// Features `[n, hidden]` of images `[n, 1, h, w]`.
    pub fn forward_features(&self, x: Tensor<4>) -> Tensor<2> {
        self.representation.forward(x)
    }

    /// Logits `[n, classes]` of images `[n, 1, h, w]`.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        self.classifier.forward(self.forward_features(x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::loss::CrossEntropyLossConfig;
    use burn::optim::{AdamConfig, GradientsParams};
    use burn::tensor::{Distribution, Int, TensorData};

    #[test]
    fn shapes() {
        let device = Device::flex();
        let config = MnistCnnConfig::rotated_mnist();
        assert_eq!(config.map_size(), 7);
        let model = config.init(&device);
        let x = Tensor::<4>::random([3, 1, 28, 28], Distribution::Uniform(0.0, 1.0), &device);
        assert_eq!(model.forward_features(x.clone()).dims(), [3, 64]);
        assert_eq!(model.forward(x).dims(), [3, 10]);
        // Four convolutions with bias and GroupNorm affine, then 1568·64 + 64 and 64·10 + 10.
        let convs = (9 * 32 + 32 + 64) + 3 * (9 * 32 * 32 + 32 + 64);
        assert_eq!(model.num_params(), convs + 1568 * 64 + 64 + 64 * 10 + 10);
    }

    #[test]
    fn one_adam_step_lowers_the_loss() {
        let device = Device::flex().autodiff();
        let model = MnistCnnConfig::rotated_mnist().init(&device);
        let x = Tensor::<4>::random([4, 1, 28, 28], Distribution::Uniform(0.0, 1.0), &device);
        let y = Tensor::<1, Int>::from_data(TensorData::new(vec![0i64, 1, 2, 3], [4]), &device);
        let loss_fn = CrossEntropyLossConfig::new().init(&device);
        let loss = loss_fn.forward(model.forward(x.clone()), y.clone());
        let before: f32 = loss.clone().into_scalar::<f32>();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let mut optim = AdamConfig::new().init();
        let model = optim.step(1e-3, model, grads);
        let after: f32 = loss_fn.forward(model.forward(x), y).into_scalar::<f32>();
        assert!(after < before, "loss {before} → {after}");
    }
}
