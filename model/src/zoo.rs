//! Backbones by name, as scenario files and client configs write them.

use std::path::Path;

use burn::tensor::Device;

use super::backbone::Identity;
use super::{
    Backbone, Frozen, FrozenBackbone, MobileNetV2, MobileNetV2Config, ModelSpec, ResNet18, ResNet18Config, ResNetCifar,
    ResNetCifarConfig, WeightError,
};

/// The pretrained weight files in `../shared/data/weights`.
pub const RESNET20_WEIGHTS: &str = "weights/resnet20-12fca82f.safetensors";
pub const RESNET56_WEIGHTS: &str = "weights/resnet56-4bfd9763.safetensors";
pub const MOBILENET_V2_WEIGHTS: &str = "weights/mobilenetv2_035_224_imagenet_backbone.safetensors";
/// CIFAR-stem ResNet-18 (`kuangliu/pytorch-cifar` names); not shipped in `../shared/data`: put your own there.
pub const RESNET18_WEIGHTS: &str = "weights/resnet18_cifar.safetensors";

/// Backbone names [`load`] knows.
pub const BACKBONES: &[&str] = &["identity", "embedded", "resnet20", "resnet56", "resnet18", "mobilenet_v2"];

/// A backbone could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ZooError {
    #[error("unknown backbone `{0}` (known: {known})", known = BACKBONES.join(", "))]
    Unknown(String),
    #[error("backbone `{0}` needs pretrained weights: give a data directory holding {1}")]
    NoDataDir(String, &'static str),
    #[error(transparent)]
    Weights(#[from] WeightError),
}

/// The frozen backbone `name`: `identity` (raw inputs of `input_dim` values), `embedded` (the
/// random-feature MLP of the embedded default), or a pretrained network loaded from `data_dir`.
pub fn load(
    name: &str,
    input_dim: usize,
    data_dir: Option<&Path>,
    device: &Device,
) -> Result<Box<dyn Backbone + Send + Sync>, ZooError> {
    let weights = |file: &'static str| data_dir.map(|d| d.join(file)).ok_or(ZooError::NoDataDir(name.into(), file));
    Ok(match name {
        "identity" => Box::new(Identity { dim: input_dim }),
        "embedded" => Box::new(FrozenBackbone::new(&ModelSpec { input_dim, ..ModelSpec::embedded_default() }, device)),
        "resnet20" => Box::new(Frozen::new(
            ResNetCifar::load(ResNetCifarConfig::resnet20(), &weights(RESNET20_WEIGHTS)?, device)?,
            ResNetCifar::input_transform(),
        )),
        "resnet56" => Box::new(Frozen::new(
            ResNetCifar::load(ResNetCifarConfig::resnet56(), &weights(RESNET56_WEIGHTS)?, device)?,
            ResNetCifar::input_transform(),
        )),
        "resnet18" => Box::new(Frozen::new(
            ResNet18::load(ResNet18Config::default(), &weights(RESNET18_WEIGHTS)?, device)?,
            ResNet18::input_transform(),
        )),
        "mobilenet_v2" => Box::new(Frozen::new(
            MobileNetV2::load(MobileNetV2Config { alpha: 0.35 }, &weights(MOBILENET_V2_WEIGHTS)?, device)?,
            MobileNetV2::input_transform(),
        )),
        other => return Err(ZooError::Unknown(other.into())),
    })
}
