//! anchorage-model: the models both sides share (the client trains them, the server's FedTA
//! fusion and the simulator run them). No device runtime, no transport.
//!
//! Models: a frozen backbone and trainable named blocks.
//!
//! The edge default: the backbone never trains, so its features are computed once per sample
//! ([`FeatureCache`]) and every epoch of the small trainable parts runs on cached features.
//! Trainable parts travel as named parameter blocks (`adapter.0.weight`, `head.bias`, ...).
//! Pretrained backbones ([`ResNetCifar`], [`ResNet18`], [`MobileNetV2`]) load from safetensors through burn-store ([`weights`]).

pub mod autodiff;
pub mod backbone;
pub mod blocks;
pub mod cache;
pub mod input;
mod linear;
pub(crate) mod mlp;
pub mod mobilenet_v2;
pub mod net;
pub mod ops;
pub mod prompts;
pub mod resnet18;
pub mod resnet_cifar;
mod resnet_parts;
pub mod separability;
pub mod vit;
pub mod weights;
pub mod zoo;

pub mod device;
pub mod train;

pub use backbone::{Backbone, FeatureNet, Frozen, Identity, InputBackbone};
pub use blocks::{BlockLayout, ModelError, is_head_block};
pub use cache::{CacheError, CacheStats, FeatureCache, FeatureStore, Inputs};
pub use input::InputTransform;
pub use mlp::{FrozenBackbone, ModelSpec};
pub use net::{Body, Net, NetSpec};

/// The trainable parts every method on frozen features trains (see [`Net`]).
pub type Trainable = Net;
pub use mobilenet_v2::{MobileNetV2, MobileNetV2Config};
pub use resnet_cifar::{ResNetCifar, ResNetCifarConfig};
pub use resnet18::{ResNet18, ResNet18Config};
pub use vit::{Vit, VitConfig};
pub use weights::WeightError;
