//! What a pretrained backbone expects at its input: pixels in [0, 1] (`ImageSet::to_dataset`)
//! mapped by a per-model transform, and batches of images as `[n, c, h, w]` tensors.

use anchorage_data::ImageSet;
use burn::tensor::{Device, Tensor, TensorData};

/// The input transform of a pretrained backbone, applied to pixels in [0, 1].
#[derive(Debug, Clone, PartialEq)]
pub enum InputTransform {
    /// `(x - mean[c]) / std[c]` (torchvision; e.g. ImageNet mean/std for the CIFAR ResNets).
    MeanStd { mean: [f32; 3], std: [f32; 3] },
    /// `x * 255 / 127.5 - 1` (Keras `mobilenet_v2.preprocess_input`).
    SymmetricUnit,
    /// Pixels as they are.
    Identity,
}

impl InputTransform {
    /// ImageNet mean and std (torchvision).
    pub fn imagenet() -> Self {
        InputTransform::MeanStd { mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225] }
    }

    /// Applies the transform to `[n, 3, h, w]` pixels in [0, 1].
    pub fn apply(&self, x: Tensor<4>) -> Tensor<4> {
        match self {
            InputTransform::MeanStd { mean, std } => {
                let device = x.device();
                let m = Tensor::<1>::from_data(TensorData::new(mean.to_vec(), [3]), &device).reshape([1, 3, 1, 1]);
                let s = Tensor::<1>::from_data(TensorData::new(std.to_vec(), [3]), &device).reshape([1, 3, 1, 1]);
                (x - m) / s
            }
            InputTransform::SymmetricUnit => x * 2.0 - 1.0,
            InputTransform::Identity => x,
        }
    }

    /// A stable identity of the transform (part of a feature-cache key).
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv::new();
        match self {
            InputTransform::MeanStd { mean, std } => {
                h.write(b"meanstd");
                for v in mean.iter().chain(std) {
                    h.write(&v.to_le_bytes());
                }
            }
            InputTransform::SymmetricUnit => h.write(b"symmetric-unit"),
            InputTransform::Identity => h.write(b"identity"),
        }
        h.finish()
    }
}

/// Images `start..end` of `set` as a `[n, c, h, w]` tensor of pixels in [0, 1].
pub fn image_batch(set: &ImageSet, start: usize, end: usize, device: &Device) -> Tensor<4> {
    let end = end.min(set.len());
    let start = start.min(end);
    let lut: [f32; 256] = std::array::from_fn(|v| v as f32 / 255.0);
    let values: Vec<f32> =
        set.pixels[start * set.image_len()..end * set.image_len()].iter().map(|&v| lut[v as usize]).collect();
    Tensor::from_data(TensorData::new(values, [end - start, set.channels, set.height, set.width]), device)
}

/// 64-bit FNV-1a, for fingerprints that must not change between builds or platforms.
#[derive(Debug, Clone)]
pub(crate) struct Fnv(u64);

impl Fnv {
    pub(crate) fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    pub(crate) fn finish(&self) -> u64 {
        self.0
    }
}

impl Default for Fnv {
    fn default() -> Self {
        Self::new()
    }
}
