//! ResNet-18 with the CIFAR stem (3×3 convolution, stride 1, no max-pool): four stages of two
//! basic blocks (64-128-256-512 channels), 1×1 convolution + BatchNorm projection shortcuts where
//! the shape changes, global average pooling to 512 features.
//!
//! Parameter names follow `kuangliu/pytorch-cifar` (`conv1`, `bn1`,
//! `layer{1..4}.{0,1}.{conv1,bn1,conv2,bn2}`, `layer{2,3,4}.0.shortcut.{0,1}`, `linear`), so
//! its checkpoints load as they are; torchvision's `downsample.{0,1}` and `fc` are accepted too.

use std::path::Path;

use burn::module::Module;
use burn::nn::conv::Conv2d;
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use burn_store::PyTorchToBurnAdapter;

use super::input::InputTransform;
use super::resnet_parts::{basic_layers, conv, global_average_pool, residual_path};
use super::weights::{Import, WeightError, load_safetensors};

/// Classes and width of a ResNet-18.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResNet18Config {
    pub num_classes: usize,
    /// Channels of the first stage (64; stages double it, so features are 8 × width).
    pub width: usize,
}

impl Default for ResNet18Config {
    fn default() -> Self {
        Self { num_classes: 10, width: 64 }
    }
}

impl ResNet18Config {
    /// Width of the pooled features.
    pub fn feature_dim(&self) -> usize {
        8 * self.width.max(1)
    }

    /// A randomly initialised network.
    pub fn init(&self, device: &Device) -> ResNet18 {
        let w = self.width.max(1);
        let widths = [w, 2 * w, 4 * w, 8 * w];
        let stage = |c_in: usize, c_out: usize, stride: usize| {
            vec![BasicBlock::new(c_in, c_out, stride, device), BasicBlock::new(c_out, c_out, 1, device)]
        };
        ResNet18 {
            conv1: conv(3, widths[0], 3, 1, device),
            bn1: BatchNormConfig::new(widths[0]).init(device),
            layer1: stage(widths[0], widths[0], 1),
            layer2: stage(widths[0], widths[1], 2),
            layer3: stage(widths[1], widths[2], 2),
            layer4: stage(widths[2], widths[3], 2),
            linear: LinearConfig::new(widths[3], self.num_classes).init(device),
        }
    }
}

/// The projection shortcut: 1×1 convolution (file `shortcut.0`) and BatchNorm (`shortcut.1`).
#[derive(Module, Debug)]
pub struct Projection {
    pub conv: Conv2d,
    pub bn: BatchNorm,
}

/// Two 3×3 convolutions with BatchNorm; identity or projection shortcut.
#[derive(Module, Debug)]
pub struct BasicBlock {
    pub conv1: Conv2d,
    pub bn1: BatchNorm,
    pub conv2: Conv2d,
    pub bn2: BatchNorm,
    /// `None`: identity (same shape).
    pub shortcut: Option<Projection>,
}

impl BasicBlock {
    fn new(c_in: usize, c_out: usize, stride: usize, device: &Device) -> Self {
        let shortcut = (stride != 1 || c_in != c_out).then(|| Projection {
            conv: conv(c_in, c_out, 1, stride, device),
            bn: BatchNormConfig::new(c_out).init(device),
        });
        let (conv1, bn1, conv2, bn2) = basic_layers(c_in, c_out, stride, device);
        Self { conv1, bn1, conv2, bn2, shortcut }
    }

    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let out = residual_path(&self.conv1, &self.bn1, &self.conv2, &self.bn2, x.clone());
        let shortcut = match &self.shortcut {
            Some(p) => p.bn.forward(p.conv.forward(x)),
            None => x,
        };
        relu(out + shortcut)
    }
}

/// ResNet-18 for small images (CIFAR stem).
#[derive(Module, Debug)]
pub struct ResNet18 {
    pub conv1: Conv2d,
    pub bn1: BatchNorm,
    pub layer1: Vec<BasicBlock>,
    pub layer2: Vec<BasicBlock>,
    pub layer3: Vec<BasicBlock>,
    pub layer4: Vec<BasicBlock>,
    pub linear: Linear,
}

impl ResNet18 {
    /// Width of the pooled features of the standard (width 64) network.
    pub const FEATURE_DIM: usize = 512;

    /// Width of the pooled features of this network.
    pub fn feature_dim(&self) -> usize {
        self.linear.weight.dims()[0]
    }

    /// CIFAR-10 mean/std, as `kuangliu/pytorch-cifar` trains.
    pub fn input_transform() -> InputTransform {
        InputTransform::MeanStd { mean: [0.4914, 0.4822, 0.4465], std: [0.2023, 0.1994, 0.2010] }
    }

    /// Loads a PyTorch-named safetensors checkpoint (names in the module docs). Every tensor must
    /// fit; mismatches are listed in the error.
    pub fn load(config: ResNet18Config, path: &Path, device: &Device) -> Result<Self, WeightError> {
        load_safetensors(config.init(device), path, pytorch_import())
    }

    /// Pooled features `[n, 8 × width]` of normalised images `[n, 3, h, w]`.
    pub fn forward_features(&self, x: Tensor<4>) -> Tensor<2> {
        let mut x = relu(self.bn1.forward(self.conv1.forward(x)));
        for block in self.layer1.iter().chain(&self.layer2).chain(&self.layer3).chain(&self.layer4) {
            x = block.forward(x);
        }
        global_average_pool(x)
    }

    /// Logits `[n, classes]` of normalised images.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<2> {
        self.linear.forward(self.forward_features(x))
    }
}

/// `shortcut.{0,1}` / `downsample.{0,1}` → `shortcut.{conv,bn}`, `fc` → `linear`; PyTorch layouts.
fn pytorch_import() -> Import {
    Import {
        remap: vec![
            (r"^(layer\d+\.\d+)\.(?:shortcut|downsample)\.0\.", "$1.shortcut.conv."),
            (r"^(layer\d+\.\d+)\.(?:shortcut|downsample)\.1\.", "$1.shortcut.bn."),
            (r"^fc\.", "linear."),
        ],
        adapter: Box::new(PyTorchToBurnAdapter),
    }
}
