//! CIFAR ResNet-20/56 (He et al. 2016, "Deep Residual Learning", §4.2) with option-A shortcuts:
//! identity, subsampled by 2 and zero-padded in channels where the shape changes. Parameter
//! names follow `akamaster/pytorch_resnet_cifar10` (`conv1`, `bn1`, `layer{1,2,3}.{i}.conv{1,2}`,
//! `layer*.bn*`, `linear`), so its checkpoints load without renaming.

use std::path::Path;

use burn::module::Module;
use burn::nn::conv::Conv2d;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::ops::PadMode;
use burn::tensor::{Device, Slice, Tensor};
use burn_store::PyTorchToBurnAdapter;

use super::input::InputTransform;
use super::resnet_parts::{basic_layers, conv, global_average_pool, residual_path};
use super::weights::{Import, WeightError, load_safetensors};

/// Depth and classes of a CIFAR ResNet (depth = 6n + 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResNetCifarConfig {
    pub depth: usize,
    pub num_classes: usize,
}

impl ResNetCifarConfig {
    pub fn resnet20() -> Self {
        Self { depth: 20, num_classes: 10 }
    }

    pub fn resnet56() -> Self {
        Self { depth: 56, num_classes: 10 }
    }

    /// Blocks per stage, `None` when `depth` is not 6n + 2.
    pub fn blocks_per_stage(&self) -> Option<usize> {
        (self.depth >= 8 && (self.depth - 2).is_multiple_of(6)).then(|| (self.depth - 2) / 6)
    }

    /// A randomly initialised network (panics only on a depth that is not 6n + 2).
    pub fn init(&self, device: &Device) -> ResNetCifar {
        let n = self.blocks_per_stage().expect("ResNet-CIFAR depth must be 6n + 2");
        let stage = |c_in: usize, c_out: usize, stride: usize| -> Vec<BasicBlock> {
            (0..n)
                .map(|i| {
                    BasicBlock::new(if i == 0 { c_in } else { c_out }, c_out, if i == 0 { stride } else { 1 }, device)
                })
                .collect()
        };
        ResNetCifar {
            conv1: conv(3, 16, 3, 1, device),
            bn1: BatchNormConfig::new(16).init(device),
            layer1: stage(16, 16, 1),
            layer2: stage(16, 32, 2),
            layer3: stage(32, 64, 2),
            linear: LinearConfig::new(64, self.num_classes).init(device),
        }
    }
}

/// Two 3×3 convolutions with BatchNorm and an option-A shortcut.
#[derive(Module, Debug)]
pub struct BasicBlock {
    pub conv1: Conv2d,
    pub bn1: BatchNorm,
    pub conv2: Conv2d,
    pub bn2: BatchNorm,
    /// Zero channels added on each side of the shortcut (0: plain identity).
    pub pad_channels: usize,
    pub stride: usize,
}

impl BasicBlock {
    fn new(c_in: usize, c_out: usize, stride: usize, device: &Device) -> Self {
        let (conv1, bn1, conv2, bn2) = basic_layers(c_in, c_out, stride, device);
        Self { conv1, bn1, conv2, bn2, pad_channels: (c_out - c_in) / 2, stride }
    }

    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let out = residual_path(&self.conv1, &self.bn1, &self.conv2, &self.bn2, x.clone());
        let shortcut = if self.stride == 1 && self.pad_channels == 0 {
            x
        } else {
            // Option A: x[:, :, ::s, ::s] padded with zero channels (planes/4 on each side).
            let s = self.stride as isize;
            let x = x.slice([Slice::full(), Slice::full(), Slice::new(0, None, s), Slice::new(0, None, s)]);
            let p = self.pad_channels;
            x.pad([(0, 0), (p, p), (0, 0), (0, 0)], PadMode::Constant(0.0))
        };
        relu(out + shortcut)
    }
}

/// ResNet-(6n+2) for 32×32 inputs: 16-32-64 channels, global average pooling, a linear classifier.
#[derive(Module, Debug)]
pub struct ResNetCifar {
    pub conv1: Conv2d,
    pub bn1: BatchNorm,
    pub layer1: Vec<BasicBlock>,
    pub layer2: Vec<BasicBlock>,
    pub layer3: Vec<BasicBlock>,
    pub linear: Linear,
}

impl ResNetCifar {
    /// Width of the pooled features.
    pub const FEATURE_DIM: usize = 64;

    /// The input transform the akamaster checkpoints were trained with (ImageNet mean/std).
    pub fn input_transform() -> InputTransform {
        InputTransform::imagenet()
    }

    /// Loads a PyTorch-named safetensors checkpoint (`resnet20-12fca82f.safetensors`, ...).
    pub fn load(config: ResNetCifarConfig, path: &Path, device: &Device) -> Result<Self, WeightError> {
        if config.blocks_per_stage().is_none() {
            return Err(WeightError::Read {
                path: path.to_path_buf(),
                message: format!("depth {} is not 6n + 2", config.depth),
            });
        }
        let import = Import { remap: Vec::new(), adapter: Box::new(PyTorchToBurnAdapter) };
        load_safetensors(config.init(device), path, import)
    }

    /// Pooled features `[n, 64]` of normalised images `[n, 3, 32, 32]`.
    pub fn forward_features(&self, x: Tensor<4>) -> Tensor<2> {
        let mut x = relu(self.bn1.forward(self.conv1.forward(x)));
        for block in self.layer1.iter().chain(&self.layer2).chain(&self.layer3) {
            x = block.forward(x);
        }
        global_average_pool(x)
    }

    /// Logits `[n, classes]` of normalised images.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        self.linear.forward(self.forward_features(x))
    }
}
