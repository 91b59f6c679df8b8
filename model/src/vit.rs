//! A Vision Transformer (Dosovitskiy et al. 2021) with timm's parameter names
//! (`patch_embed.proj`, `cls_token`, `pos_embed`, `blocks.{i}.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}`,
//! `norm`, `head`), pre-norm blocks, exact GELU and LayerNorm eps 1e-6 as in timm.
//!
//! Optional prompt tokens `[P, width]` (L2P, FedTA) are prepended after the patch embedding,
//! once the cls token and position embeddings are in: the sequence is `[prompts, cls, patches]`,
//! and prompts carry no position embedding. Every other layer works per token, so prompts reach
//! the cls and patch tokens only through attention.

use std::path::Path;

use burn::module::{Module, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::{gelu, softmax};
use burn::tensor::{Device, Distribution, Tensor};
use burn_store::PyTorchToBurnAdapter;

use super::weights::{Import, WeightError, load_safetensors};

/// timm's LayerNorm epsilon in ViTs.
const LN_EPS: f64 = 1e-6;

/// Shape of a ViT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VitConfig {
    pub image_size: usize,
    pub patch_size: usize,
    pub in_channels: usize,
    /// Token width (timm `embed_dim`).
    pub width: usize,
    pub depth: usize,
    pub heads: usize,
    /// MLP hidden width = `mlp_ratio · width`.
    pub mlp_ratio: usize,
    /// Classes of the linear head; 0 for a headless backbone (no `head.*` in the file).
    pub num_classes: usize,
}

impl VitConfig {
    /// timm `vit_tiny_patch16_224`: width 192, depth 12, 3 heads.
    pub fn tiny_patch16_224(num_classes: usize) -> Self {
        Self {
            image_size: 224,
            patch_size: 16,
            in_channels: 3,
            width: 192,
            depth: 12,
            heads: 3,
            mlp_ratio: 4,
            num_classes,
        }
    }

    /// timm `vit_base_patch16_224`: width 768, depth 12, 12 heads.
    pub fn base_patch16_224(num_classes: usize) -> Self {
        Self {
            image_size: 224,
            patch_size: 16,
            in_channels: 3,
            width: 768,
            depth: 12,
            heads: 12,
            mlp_ratio: 4,
            num_classes,
        }
    }

    /// Patches per image.
    pub fn num_patches(&self) -> usize {
        (self.image_size / self.patch_size).pow(2)
    }

    /// Why the shape is invalid, if it is.
    pub fn check(&self) -> Result<(), String> {
        if self.patch_size == 0 || !self.image_size.is_multiple_of(self.patch_size) {
            return Err(format!("image size {} is not a multiple of patch size {}", self.image_size, self.patch_size));
        }
        if self.heads == 0 || !self.width.is_multiple_of(self.heads) {
            return Err(format!("width {} is not a multiple of {} heads", self.width, self.heads));
        }
        Ok(())
    }

    /// A randomly initialised network (panics only on a shape [`check`](Self::check) rejects).
    pub fn init(&self, device: &Device) -> Vit {
        if let Err(e) = self.check() {
            panic!("invalid ViT config: {e}");
        }
        let (d, p) = (self.width, self.patch_size);
        let trunc = Distribution::Normal(0.0, 0.02);
        Vit {
            patch_embed: PatchEmbed {
                proj: Conv2dConfig::new([self.in_channels, d], [p, p]).with_stride([p, p]).init(device),
            },
            cls_token: Param::from_tensor(Tensor::random([1, 1, d], trunc, device)),
            pos_embed: Param::from_tensor(Tensor::random([1, self.num_patches() + 1, d], trunc, device)),
            blocks: (0..self.depth).map(|_| Block::new(d, self.heads, self.mlp_ratio * d, device)).collect(),
            norm: layer_norm(d, device),
            head: (self.num_classes > 0).then(|| LinearConfig::new(d, self.num_classes).init(device)),
        }
    }
}

fn layer_norm(d: usize, device: &Device) -> LayerNorm {
    LayerNormConfig::new(d).with_epsilon(LN_EPS).init(device)
}

/// Non-overlapping patches to tokens: a `p×p` convolution with stride `p`.
#[derive(Module, Debug)]
pub struct PatchEmbed {
    pub proj: Conv2d,
}

impl PatchEmbed {
    /// Images `[n, c, h, w]` → tokens `[n, patches, width]` (row-major patch order, as timm).
    pub fn forward(&self, x: Tensor<4>) -> Tensor<3> {
        let x: Tensor<3> = self.proj.forward(x).flatten(2, 3);
        x.swap_dims(1, 2)
    }
}

/// Multi-head self-attention with a fused `qkv` projection (timm `Attention`).
#[derive(Module, Debug)]
pub struct Attention {
    pub qkv: Linear,
    pub proj: Linear,
    pub heads: usize,
}

impl Attention {
    /// Tokens `[n, t, width]` → `[n, t, width]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [n, t, d] = x.dims();
        let hd = d / self.heads;
        // [n, t, 3·d] → [n, t, 3, heads, hd]; q, k, v each [n, heads, t, hd].
        let qkv: Tensor<5> = self.qkv.forward(x).reshape([n, t, 3, self.heads, hd]);
        let part =
            |i: usize| -> Tensor<4> { qkv.clone().narrow(2, i, 1).reshape([n, t, self.heads, hd]).swap_dims(1, 2) };
        let (q, k, v) = (part(0), part(1), part(2));
        let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar((hd as f64).powf(-0.5));
        let out = softmax(scores, 3).matmul(v).swap_dims(1, 2).reshape([n, t, d]);
        self.proj.forward(out)
    }
}

/// fc1, GELU, fc2 (timm `Mlp`).
#[derive(Module, Debug)]
pub struct Mlp {
    pub fc1: Linear,
    pub fc2: Linear,
}

impl Mlp {
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.fc2.forward(gelu(self.fc1.forward(x)))
    }
}

/// A pre-norm transformer block: `x + attn(norm1(x))`, then `x + mlp(norm2(x))`.
#[derive(Module, Debug)]
pub struct Block {
    pub norm1: LayerNorm,
    pub attn: Attention,
    pub norm2: LayerNorm,
    pub mlp: Mlp,
}

impl Block {
    fn new(d: usize, heads: usize, hidden: usize, device: &Device) -> Self {
        Self {
            norm1: layer_norm(d, device),
            attn: Attention {
                qkv: LinearConfig::new(d, 3 * d).init(device),
                proj: LinearConfig::new(d, d).init(device),
                heads,
            },
            norm2: layer_norm(d, device),
            mlp: Mlp { fc1: LinearConfig::new(d, hidden).init(device), fc2: LinearConfig::new(hidden, d).init(device) },
        }
    }

    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = x.clone() + self.attn.forward(self.norm1.forward(x));
        x.clone() + self.mlp.forward(self.norm2.forward(x))
    }
}

/// The Vision Transformer.
#[derive(Module, Debug)]
pub struct Vit {
    pub patch_embed: PatchEmbed,
    /// `[1, 1, width]`.
    pub cls_token: Param<Tensor<3>>,
    /// `[1, 1 + patches, width]` (cls first).
    pub pos_embed: Param<Tensor<3>>,
    pub blocks: Vec<Block>,
    pub norm: LayerNorm,
    pub head: Option<Linear>,
}

impl Vit {
    /// Loads a timm-named safetensors file (`[out, in]` Linear weights, `weight`/`bias` norms).
    /// Every model parameter must be in the file and every file tensor used.
    pub fn load(config: VitConfig, path: &Path, device: &Device) -> Result<Self, WeightError> {
        if let Err(message) = config.check() {
            return Err(WeightError::Read { path: path.to_path_buf(), message });
        }
        let import = Import { remap: Vec::new(), adapter: Box::new(PyTorchToBurnAdapter) };
        load_safetensors(config.init(device), path, import)
    }

    /// Token width.
    pub fn width(&self) -> usize {
        self.cls_token.dims()[2]
    }

    /// All tokens after the final norm, `[n, P + 1 + patches, width]`: prompts first, then cls,
    /// then patches. `prompt` is `[P, width]`; `None` or `P = 0` is the plain model.
    pub fn forward_tokens(&self, x: Tensor<4>, prompt: Option<Tensor<2>>) -> Tensor<3> {
        let n = x.dims()[0];
        let prompts = prompt.filter(|p| p.dims()[0] > 0).map(|p| {
            let [len, d] = p.dims();
            p.unsqueeze::<3>().expand([n, len, d])
        });
        self.forward_tokens_each(x, prompts)
    }

    /// As [`forward_tokens`](Self::forward_tokens) with a prompt per sample: `prompts` is
    /// `[n, P, width]` (FedTA's input enhancement picks the sets of each input by its own query).
    pub fn forward_tokens_each(&self, x: Tensor<4>, prompts: Option<Tensor<3>>) -> Tensor<3> {
        let patches = self.patch_embed.forward(x);
        let [n, _, d] = patches.dims();
        let cls = self.cls_token.val().expand([n, 1, d]);
        let mut x = Tensor::cat(vec![cls, patches], 1) + self.pos_embed.val();
        if let Some(prompts) = prompts.filter(|p| p.dims()[1] > 0) {
            x = super::autodiff::cat_lifted(vec![prompts, x], 1);
        }
        for block in &self.blocks {
            x = block.forward(x);
        }
        self.norm.forward(x)
    }

    /// The cls token's features `[n, width]` with per-sample prompts `[n, P, width]`.
    pub fn forward_features_each(&self, x: Tensor<4>, prompts: Option<Tensor<3>>) -> Tensor<2> {
        let p = prompts.as_ref().map_or(0, |p| p.dims()[1]);
        let tokens = self.forward_tokens_each(x, prompts);
        let [n, _, d] = tokens.dims();
        tokens.narrow(1, p, 1).reshape([n, d])
    }

    /// The cls token's features `[n, width]` (after the final norm).
    pub fn forward_features(&self, x: Tensor<4>, prompt: Option<Tensor<2>>) -> Tensor<2> {
        let p = prompt.as_ref().map_or(0, |p| p.dims()[0]);
        let tokens = self.forward_tokens(x, prompt);
        let [n, _, d] = tokens.dims();
        tokens.narrow(1, p, 1).reshape([n, d])
    }

    /// Logits `[n, classes]` from the cls token; the features themselves when there is no head.
    pub fn forward(&self, x: Tensor<4>, prompt: Option<Tensor<2>>) -> Tensor<2> {
        let features = self.forward_features(x, prompt);
        match &self.head {
            Some(head) => head.forward(features),
            None => features,
        }
    }
}
