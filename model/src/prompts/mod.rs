//! The two forms of FedTA's input enhancement (Eq. 2) behind one trait: how a learnable
//! enhancement set changes what the frozen backbone sees.
//!
//! - [`TokenPrompts`]: a set is `length` prompt tokens prepended to a ViT's patch embeddings
//!   (L2P-style prompting; the N chosen sets of an input are concatenated).
//! - [`PixelPrompts`]: for convolutional (or any image) backbones, a set is a learnable frame of
//!   `length` pixels along the image border, added to the input pixels before the backbone's own
//!   transform (visual prompting as in Bahng et al. 2022, "padding" prompts); the N chosen
//!   frames of an input are averaged. Training it backpropagates through the frozen network to
//!   the input only.
//!
//! Either way the backbone's weights are constants of the graph: nothing but the sets receives
//! a gradient, and BatchNorm layers keep their running statistics (the backbone is frozen, not
//! merely gradient-free).

pub mod fusion;
pub mod keys;
pub mod pool;

use std::sync::Arc;

use anchorage_shared::method::FedTaConfig;
use burn::tensor::Tensor;

use crate::autodiff::cat_lifted;
use crate::backbone::weights_fingerprint;
use crate::input::{Fnv, InputTransform};
use crate::{Backbone, InputBackbone, Vit};

/// A frozen backbone that features can be read from with its input enhanced.
pub trait Enhancer: Send + Sync {
    /// Values of one enhancement set.
    fn set_len(&self) -> usize;
    /// Width of the features.
    fn feature_dim(&self) -> usize;
    /// Standard deviation of a freshly drawn set (0: sets start as the identity).
    fn init_std(&self) -> f64;
    /// Features `[n, feature_dim]` of flat samples `x` `[n, sample_len]`, each enhanced by its
    /// chosen sets `[n, N, set_len]` (`None`: the plain input, the query of Eq. 2).
    fn features(&self, x: Tensor<2>, sets: Option<Tensor<3>>) -> Tensor<2>;
    /// Identity of the frozen weights and the enhancement's shape.
    fn fingerprint(&self) -> u64;
}

/// A shareable frozen backbone (one copy serves every client of a simulation and the server).
pub type SharedBackbone = Arc<dyn Backbone + Send + Sync>;

/// The enhancement FedTA builds on a backbone given as samples → features: pixel prompts of
/// `ie_length` pixels (a ViT built in code takes [`TokenPrompts`] instead).
pub fn enhancer_for(method: &FedTaConfig, backbone: &InputBackbone) -> Arc<dyn Enhancer> {
    Arc::new(PixelPrompts::new(backbone.net.clone(), &backbone.sample_shape, method.ie_length as usize))
}

/// `[c, h, w]` of a sample shape (`[h, w]` is one channel; anything else is one row).
fn image_shape(shape: &[usize]) -> [usize; 3] {
    match shape {
        [c, h, w] => [*c, *h, *w],
        [h, w] => [1, *h, *w],
        other => [1, 1, other.iter().product()],
    }
}

/// Pixel prompts: a learnable border frame added to the input image. See the module docs.
#[derive(Clone)]
pub struct PixelPrompts {
    backbone: SharedBackbone,
    shape: [usize; 3],
    /// Frame width in pixels; 0: the prompt covers the whole input (non-image samples).
    border: usize,
}

impl PixelPrompts {
    /// Frames `length` pixels wide (at most half the image side) on samples of `sample_shape`.
    /// Samples that are not images (one row) get a prompt over the whole input.
    pub fn new(backbone: SharedBackbone, sample_shape: &[usize], length: usize) -> Self {
        let shape = image_shape(sample_shape);
        let [_, h, w] = shape;
        let border = if h < 2 { 0 } else { length.clamp(1, (h / 2).min(w / 2).max(1)) };
        Self { backbone, shape, border }
    }

    /// The frame of each row of `v` `[n, set_len]` as flat images `[n, c·h·w]` (zero inside).
    fn canvas(&self, v: Tensor<2>) -> Tensor<2> {
        let [c, h, w] = self.shape;
        let n = v.dims()[0];
        let b = self.border;
        if b == 0 {
            return v;
        }
        let (band, side_rows) = (c * b * w, h - 2 * b);
        let side = c * side_rows * b;
        let top: Tensor<4> = v.clone().narrow(1, 0, band).reshape([n, c, b, w]);
        let bottom: Tensor<4> = v.clone().narrow(1, band, band).reshape([n, c, b, w]);
        let mut rows = vec![top];
        if side_rows > 0 {
            let left: Tensor<4> = v.clone().narrow(1, 2 * band, side).reshape([n, c, side_rows, b]);
            let right: Tensor<4> = v.narrow(1, 2 * band + side, side).reshape([n, c, side_rows, b]);
            let mut middle = vec![left];
            if w > 2 * b {
                middle.push(Tensor::zeros([n, c, side_rows, w - 2 * b], &right.device()));
            }
            middle.push(right);
            rows.push(cat_lifted(middle, 3));
        }
        rows.push(bottom);
        cat_lifted(rows, 2).reshape([n, c * h * w])
    }
}

impl Enhancer for PixelPrompts {
    fn set_len(&self) -> usize {
        let [c, h, w] = self.shape;
        let b = self.border;
        if b == 0 { c * h * w } else { c * (2 * b * w + 2 * (h - 2 * b) * b) }
    }

    fn feature_dim(&self) -> usize {
        self.backbone.feature_dim()
    }

    fn init_std(&self) -> f64 {
        0.0
    }

    fn features(&self, x: Tensor<2>, sets: Option<Tensor<3>>) -> Tensor<2> {
        let [c, h, w] = self.shape;
        let x = match sets {
            Some(sets) if sets.dims()[1] > 0 => {
                let [n, _, len] = sets.dims();
                x + self.canvas(sets.mean_dim(1).reshape([n, len]))
            }
            _ => x,
        };
        self.backbone.features(x, &[c, h, w])
    }

    fn fingerprint(&self) -> u64 {
        let mut h = Fnv::new();
        h.write(b"pixel-prompts");
        h.write(&self.backbone.fingerprint().to_le_bytes());
        for v in self.shape.iter().chain([&self.border]) {
            h.write(&(*v as u64).to_le_bytes());
        }
        h.finish()
    }
}

/// Token prompts on a frozen ViT (Eq. 2 as written): `length` tokens per set.
pub struct TokenPrompts {
    vit: Vit,
    transform: InputTransform,
    shape: [usize; 3],
    length: usize,
    fingerprint: u64,
}

impl TokenPrompts {
    /// `vit` is frozen here (no gradients, no training behaviour).
    pub fn new(vit: Vit, transform: InputTransform, sample_shape: &[usize], length: usize) -> Self {
        use burn::module::Module;
        let vit = vit.freeze();
        let mut h = Fnv::new();
        h.write(b"token-prompts");
        h.write(&weights_fingerprint(&vit).to_le_bytes());
        h.write(&transform.fingerprint().to_le_bytes());
        h.write(&(length as u64).to_le_bytes());
        Self { vit, transform, shape: image_shape(sample_shape), length: length.max(1), fingerprint: h.finish() }
    }
}

impl Enhancer for TokenPrompts {
    fn set_len(&self) -> usize {
        self.length * self.vit.width()
    }

    fn feature_dim(&self) -> usize {
        self.vit.width()
    }

    fn init_std(&self) -> f64 {
        0.02
    }

    fn features(&self, x: Tensor<2>, sets: Option<Tensor<3>>) -> Tensor<2> {
        let [c, h, w] = self.shape;
        let n = x.dims()[0];
        let images = self.transform.apply(x.reshape([n, c, h, w]));
        let prompts = sets.filter(|s| s.dims()[1] > 0).map(|s| {
            let [n, k, _] = s.dims();
            s.reshape([n, k * self.length, self.vit.width()])
        });
        self.vit.forward_features_each(images, prompts)
    }

    fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Identity, VitConfig};
    use burn::tensor::{Device, TensorData};

    #[test]
    fn the_pixel_frame_covers_the_border_only() {
        let device = Device::flex();
        let p = PixelPrompts::new(Arc::new(Identity { dim: 2 * 5 * 6 }), &[2, 5, 6], 1);
        // Two channels: 2·(2·1·6 + 2·3·1) = 36 values per set.
        assert_eq!(p.set_len(), 36);
        let ones = Tensor::<3>::ones([1, 1, 36], &device);
        let x = Tensor::<2>::zeros([1, 60], &device);
        let out: Vec<f32> = p.features(x, Some(ones)).into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        for ch in 0..2 {
            for r in 0..5 {
                for c in 0..6 {
                    let border = r == 0 || r == 4 || c == 0 || c == 5;
                    assert_eq!(out[ch * 30 + r * 6 + c], if border { 1.0 } else { 0.0 }, "({ch}, {r}, {c})");
                }
            }
        }
        // Without sets the input passes unchanged; a width beyond half the side is capped.
        let plain = p.features(Tensor::<2>::ones([1, 60], &device), None);
        assert_eq!(plain.sum().into_scalar::<f32>(), 60.0);
        let wide = PixelPrompts::new(Arc::new(Identity { dim: 16 }), &[1, 4, 4], 9);
        assert_eq!(wide.set_len(), 16, "a 2-pixel frame of a 4×4 image is all of it");
    }

    #[test]
    fn chosen_frames_are_averaged() {
        let device = Device::flex();
        let p = PixelPrompts::new(Arc::new(Identity { dim: 9 }), &[1, 3, 3], 1);
        assert_eq!(p.set_len(), 8);
        let sets =
            Tensor::<3>::from_data(TensorData::new([vec![2.0f32; 8], vec![4.0f32; 8]].concat(), [1, 2, 8]), &device);
        let out: Vec<f32> = p
            .features(Tensor::zeros([1, 9], &device), Some(sets))
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .unwrap();
        assert_eq!(out, vec![3.0, 3.0, 3.0, 3.0, 0.0, 3.0, 3.0, 3.0, 3.0]);
    }

    #[test]
    fn token_prompts_change_the_cls_feature() {
        let device = Device::flex();
        let cfg = VitConfig {
            image_size: 8,
            patch_size: 4,
            in_channels: 3,
            width: 8,
            depth: 1,
            heads: 2,
            mlp_ratio: 2,
            num_classes: 0,
        };
        let p = TokenPrompts::new(cfg.init(&device), InputTransform::Identity, &[3, 8, 8], 2);
        assert_eq!(p.set_len(), 16);
        let x = Tensor::<2>::ones([2, 192], &device);
        let plain = p.features(x.clone(), None);
        assert_eq!(plain.dims(), [2, 8]);
        let sets = Tensor::<3>::ones([2, 3, 16], &device);
        let prompted = p.features(x, Some(sets));
        let diff = (prompted - plain).abs().sum().into_scalar::<f32>();
        assert!(diff > 1e-4, "prompt tokens reach the cls token through attention");
    }
}
