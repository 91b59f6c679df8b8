//! What the two ResNets share (He et al. 2016): the bias-free convolutions, the basic block's
//! residual path and the global average pool. Each ResNet keeps its own block struct, because
//! the field names are the checkpoints' tensor names and the shortcuts differ (projection in
//! ResNet-18, option-A zero padding in the CIFAR ResNets).

use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, PaddingConfig2d};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

/// A bias-free convolution: 3×3 padded by 1, 1×1 unpadded.
pub(crate) fn conv(c_in: usize, c_out: usize, k: usize, stride: usize, device: &Device) -> Conv2d {
    let padding = if k == 3 { PaddingConfig2d::Explicit(1, 1, 1, 1) } else { PaddingConfig2d::Valid };
    Conv2dConfig::new([c_in, c_out], [k, k])
        .with_stride([stride, stride])
        .with_padding(padding)
        .with_bias(false)
        .init(device)
}

/// The residual path's layers (conv1, bn1, conv2, bn2) of a basic block from `c_in` to `c_out`
/// channels; the first convolution carries the stride.
pub(crate) fn basic_layers(
    c_in: usize,
    c_out: usize,
    stride: usize,
    device: &Device,
) -> (Conv2d, BatchNorm, Conv2d, BatchNorm) {
    (
        conv(c_in, c_out, 3, stride, device),
        BatchNormConfig::new(c_out).init(device),
        conv(c_out, c_out, 3, 1, device),
        BatchNormConfig::new(c_out).init(device),
    )
}

/// conv1 → bn1 → ReLU → conv2 → bn2: a basic block's residual path, before its shortcut is added.
pub(crate) fn residual_path(
    conv1: &Conv2d,
    bn1: &BatchNorm,
    conv2: &Conv2d,
    bn2: &BatchNorm,
    x: Tensor<4>,
) -> Tensor<4> {
    bn2.forward(conv2.forward(relu(bn1.forward(conv1.forward(x)))))
}

/// Global average pooling: `[n, c, h, w]` → `[n, c]`.
pub(crate) fn global_average_pool(x: Tensor<4>) -> Tensor<2> {
    let [n, c, _, _] = x.dims();
    x.mean_dims(&[2, 3]).reshape([n, c])
}
