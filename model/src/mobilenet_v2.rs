//! MobileNetV2 (Sandler et al. 2018, "MobileNetV2: Inverted Residuals and Linear Bottlenecks",
//! Table 2) as in Keras applications (`keras/applications/mobilenet_v2.py`): any width multiplier,
//! BatchNorm eps 1e-3, ReLU6, and Keras' asymmetric stride-2 padding (`correct_pad`: (0, 1) per
//! side on even inputs), done as an explicit zero pad then a convolution without padding.
//! Output: 1280 features (for width ≤ 1) after global average pooling of `out_relu`.

use std::path::Path;

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, PaddingConfig2d};
use burn::tensor::activation::relu6;
use burn::tensor::ops::PadMode;
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_store::{ModuleAdapter, ModuleContext, bridge};

use super::input::InputTransform;
use super::weights::{Import, WeightError, load_safetensors};

/// Keras' BatchNorm epsilon in MobileNetV2.
const BN_EPS: f64 = 1e-3;

/// (expansion t, filters c, stride s) of the 17 inverted-residual blocks (Table 2, one row per block).
const BLOCKS: [(usize, usize, usize); 17] = [
    (1, 16, 1),
    (6, 24, 2),
    (6, 24, 1),
    (6, 32, 2),
    (6, 32, 1),
    (6, 32, 1),
    (6, 64, 2),
    (6, 64, 1),
    (6, 64, 1),
    (6, 64, 1),
    (6, 96, 1),
    (6, 96, 1),
    (6, 96, 1),
    (6, 160, 2),
    (6, 160, 1),
    (6, 160, 1),
    (6, 320, 1),
];

/// Keras `_make_divisible`: round to a multiple of `divisor`, never below 90% of `v`.
fn make_divisible(v: f64, divisor: usize) -> usize {
    let d = divisor as f64;
    let mut new_v = (((v + d / 2.0) as usize) / divisor * divisor).max(divisor);
    if (new_v as f64) < 0.9 * v {
        new_v += divisor;
    }
    new_v
}

/// Width of a MobileNetV2.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MobileNetV2Config {
    /// Width multiplier α (Keras `alpha`): 0.35, 0.5, 0.75, 1.0, 1.3, 1.4.
    pub alpha: f64,
}

impl MobileNetV2Config {
    /// Channels of the last 1×1 convolution (the feature width).
    pub fn feature_dim(&self) -> usize {
        if self.alpha > 1.0 { make_divisible(1280.0 * self.alpha, 8) } else { 1280 }
    }

    /// A randomly initialised network.
    pub fn init(&self, device: &Device) -> MobileNetV2 {
        let stem = make_divisible(32.0 * self.alpha, 8);
        let mut c_in = stem;
        let mut blocks = Vec::with_capacity(BLOCKS.len());
        for &(t, c, s) in &BLOCKS {
            let c_out = make_divisible(c as f64 * self.alpha, 8);
            blocks.push(InvertedResidual::new(c_in, c_out, t, s, device));
            c_in = c_out;
        }
        MobileNetV2 {
            conv1: conv(3, stem, 3, 2, 1, device),
            bn1: bn(stem, device),
            blocks,
            conv_last: conv(c_in, self.feature_dim(), 1, 1, 1, device),
            bn_last: bn(self.feature_dim(), device),
        }
    }
}

/// A bias-free convolution; stride-1 3×3 pads symmetrically by 1, everything else pads nothing
/// (stride-2 3×3 is padded explicitly in `forward`).
fn conv(c_in: usize, c_out: usize, k: usize, stride: usize, groups: usize, device: &Device) -> Conv2d {
    let padding = if k == 3 && stride == 1 { PaddingConfig2d::Explicit(1, 1, 1, 1) } else { PaddingConfig2d::Valid };
    Conv2dConfig::new([c_in, c_out], [k, k])
        .with_stride([stride, stride])
        .with_groups(groups)
        .with_padding(padding)
        .with_bias(false)
        .init(device)
}

fn bn(c: usize, device: &Device) -> BatchNorm {
    BatchNormConfig::new(c).with_epsilon(BN_EPS).init(device)
}

/// Keras `correct_pad` + `ZeroPadding2D` before a stride-2 3×3: `(h % 2, 1)` rows, `(w % 2, 1)` columns.
fn pad_stride2(x: Tensor<4>) -> Tensor<4> {
    let [_, _, h, w] = x.dims();
    x.pad([(0, 0), (0, 0), (h % 2, 1), (w % 2, 1)], PadMode::Constant(0.0))
}

/// Expand (1×1) → depthwise (3×3) → project (1×1, linear), residual when shapes allow.
#[derive(Module, Debug)]
pub struct InvertedResidual {
    /// `None` for the first block (expansion 1).
    pub expand: Option<Conv2d>,
    pub expand_bn: Option<BatchNorm>,
    pub depthwise: Conv2d,
    pub depthwise_bn: BatchNorm,
    pub project: Conv2d,
    pub project_bn: BatchNorm,
    pub stride: usize,
    pub residual: bool,
}

impl InvertedResidual {
    fn new(c_in: usize, c_out: usize, expansion: usize, stride: usize, device: &Device) -> Self {
        let hidden = c_in * expansion;
        let (expand, expand_bn) = if expansion == 1 {
            (None, None)
        } else {
            (Some(conv(c_in, hidden, 1, 1, 1, device)), Some(bn(hidden, device)))
        };
        Self {
            expand,
            expand_bn,
            depthwise: conv(hidden, hidden, 3, stride, hidden, device),
            depthwise_bn: bn(hidden, device),
            project: conv(hidden, c_out, 1, 1, 1, device),
            project_bn: bn(c_out, device),
            stride,
            residual: stride == 1 && c_in == c_out,
        }
    }

    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let mut h = x.clone();
        if let (Some(conv), Some(bn)) = (&self.expand, &self.expand_bn) {
            h = relu6(bn.forward(conv.forward(h)));
        }
        if self.stride == 2 {
            h = pad_stride2(h);
        }
        h = relu6(self.depthwise_bn.forward(self.depthwise.forward(h)));
        h = self.project_bn.forward(self.project.forward(h));
        if self.residual { x + h } else { h }
    }
}

/// The MobileNetV2 feature extractor (no classifier).
#[derive(Module, Debug)]
pub struct MobileNetV2 {
    pub conv1: Conv2d,
    pub bn1: BatchNorm,
    /// Keras `expanded_conv` is block 0, then `block_1` … `block_16`.
    pub blocks: Vec<InvertedResidual>,
    pub conv_last: Conv2d,
    pub bn_last: BatchNorm,
}

impl MobileNetV2 {
    /// Keras `mobilenet_v2.preprocess_input`: x / 127.5 − 1.
    pub fn input_transform() -> InputTransform {
        InputTransform::SymmetricUnit
    }

    /// Loads Keras-named weights (`Conv1/kernel`, `block_1_expand/kernel`,
    /// `block_1_depthwise/depthwise_kernel`, `..._BN/gamma|beta|moving_mean|moving_variance`,
    /// `Conv_1/kernel`, `Conv_1_bn/...`; HWIO kernels, depthwise `[kh, kw, C, 1]`).
    pub fn load(config: MobileNetV2Config, path: &Path, device: &Device) -> Result<Self, WeightError> {
        load_safetensors(config.init(device), path, keras_import())
    }

    /// Features `[n, feature_dim]` of transformed images `[n, 3, h, w]`.
    pub fn forward_features(&self, x: Tensor<4>) -> Tensor<2> {
        let mut x = relu6(self.bn1.forward(self.conv1.forward(pad_stride2(x))));
        for block in &self.blocks {
            x = block.forward(x);
        }
        let x = relu6(self.bn_last.forward(self.conv_last.forward(x)));
        let [n, c, _, _] = x.dims();
        x.mean_dims(&[2, 3]).reshape([n, c])
    }
}

/// Keras names → module paths, and HWIO → OIHW kernels.
fn keras_import() -> Import {
    Import {
        remap: vec![
            (r"^Conv1/kernel$", "conv1.weight"),
            (r"^bn_Conv1/", "bn1."),
            (r"^Conv_1/kernel$", "conv_last.weight"),
            (r"^Conv_1_bn/", "bn_last."),
            (r"^expanded_conv_", "block_0_"),
            (r"^block_(\d+)_(expand|depthwise|project)/(depthwise_)?kernel$", "blocks.$1.$2.weight"),
            (r"^block_(\d+)_(expand|depthwise|project)_BN/", "blocks.$1.${2}_bn."),
            (r"\.moving_mean$", ".running_mean"),
            (r"\.moving_variance$", ".running_var"),
        ],
        adapter: Box::new(KerasConvAdapter),
    }
}

/// Permutes Keras kernels to burn's layout: HWIO `[kh, kw, in, out]` → `[out, in, kh, kw]`;
/// depthwise `[kh, kw, C, 1]` → `[C, 1, kh, kw]` (burn's grouped layout with groups = C).
#[derive(Debug, Clone, Copy)]
pub struct KerasConvAdapter;

impl ModuleAdapter for KerasConvAdapter {
    fn adapt(&self, tensor: burn_store::burn_pack::Tensor, ctx: ModuleContext<'_>) -> burn_store::burn_pack::Tensor {
        let is_conv_weight = ctx.module_type() == Some("Struct:Conv2d") && tensor.name.ends_with("weight");
        if !is_conv_weight || tensor.shape.len() != 4 || tensor.dtype != DType::F32 {
            return tensor;
        }
        let s = [tensor.shape[0], tensor.shape[1], tensor.shape[2], tensor.shape[3]];
        let axes = if tensor.name.ends_with("depthwise.weight") { [2, 3, 0, 1] } else { [3, 2, 0, 1] };
        let shape: Vec<usize> = axes.iter().map(|&a| s[a]).collect();
        let (name, dtype) = (tensor.name.clone(), tensor.dtype);
        bridge::map_data(tensor, name, dtype, shape.clone().into(), move |data| permute4(data, s, axes))
    }

    fn clone_box(&self) -> Box<dyn ModuleAdapter> {
        Box::new(*self)
    }
}

/// `out[i_a0, i_a1, i_a2, i_a3] = in[i_0, i_1, i_2, i_3]` for 4-byte elements of shape `s`.
fn permute4(data: TensorData, s: [usize; 4], axes: [usize; 4]) -> TensorData {
    let bytes = data.as_bytes();
    let out_shape = axes.map(|a| s[a]);
    let in_strides = [s[1] * s[2] * s[3], s[2] * s[3], s[3], 1];
    let mut out = vec![0u8; bytes.len()];
    if bytes.len() != s.iter().product::<usize>() * 4 {
        // Let the applier report the length mismatch.
        return data;
    }
    let mut o = 0;
    for i0 in 0..out_shape[0] {
        for i1 in 0..out_shape[1] {
            for i2 in 0..out_shape[2] {
                for i3 in 0..out_shape[3] {
                    let idx = [i0, i1, i2, i3];
                    let src: usize = (0..4).map(|d| idx[d] * in_strides[axes[d]]).sum();
                    out[o * 4..o * 4 + 4].copy_from_slice(&bytes[src * 4..src * 4 + 4]);
                    o += 1;
                }
            }
        }
    }
    TensorData::from_bytes_vec(out, out_shape.to_vec(), DType::F32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keras_widths() {
        // Keras: alpha 0.35 → stem 16, blocks 8 16 24 32 56 112; alpha 1.0 → 32, 16 24 32 64 96 160 320.
        assert_eq!(make_divisible(32.0 * 0.35, 8), 16);
        let widths: Vec<usize> = BLOCKS.iter().map(|&(_, c, _)| make_divisible(c as f64 * 0.35, 8)).collect();
        assert_eq!(widths, [8, 8, 8, 16, 16, 16, 24, 24, 24, 24, 32, 32, 32, 56, 56, 56, 112]);
        assert_eq!(MobileNetV2Config { alpha: 1.4 }.feature_dim(), 1792);
        let device = Device::flex();
        let model = MobileNetV2Config { alpha: 0.35 }.init(&device);
        // Keras counts BatchNorm moving statistics too: 410,208 (the README of the weights).
        assert_eq!(model.num_params(), 410_208);
        let x = Tensor::<4>::zeros([1, 3, 33, 32], &device);
        assert_eq!(model.forward_features(x).dims(), [1, 1280]);
    }
}
