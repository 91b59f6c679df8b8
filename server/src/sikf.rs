//! FedTA's Selective Input Knowledge Fusion (Eq. 8) for the server half (feature `sikf`).
//!
//! The distillation itself is [`Sikf`] in the client crate (it runs the frozen backbone on
//! burn); this module hands it to [`FedTaServer`](crate::methods::FedTaServer) as its
//! [`InputDistiller`], and builds it for the standalone server from the `[sikf]` section of
//! `server.toml`: the clients' backbone, and the surrogate set of a data spec's FedTA split
//! (k test images per class). The simulator passes the features it already holds to the same
//! [`server_method`].

use std::sync::Arc;

use anchorage_data::DataSpec;
use anchorage_model::prompts::fusion::Sikf;
use anchorage_model::{FeatureCache, InputBackbone, Inputs, zoo};
use anchorage_shared::method::{FedTaConfig, MethodConfig};
use anchorage_shared::tensor::ParamBlock;
use anyhow::Context;
use burn::tensor::Device;

use crate::config::SikfSection;
use crate::methods::{Distilled, InputDistiller};
use crate::methods::{Parts, ServerMethod};

impl InputDistiller for Sikf {
    fn distill(
        &mut self,
        student: &[ParamBlock],
        teachers: &[&[ParamBlock]],
        epochs: u32,
        learning_rate: f32,
    ) -> Result<Distilled, String> {
        let (blocks, losses) =
            Sikf::distill(self, student, teachers, epochs, learning_rate as f64).map_err(|e| e.to_string())?;
        Ok(Distilled { blocks, losses })
    }
}

/// Where FedTA's SIKF distils: the clients' frozen backbone and its features of a surrogate set.
pub struct Surrogate {
    pub backbone: InputBackbone,
    /// The surrogate samples' plain features, with the samples (SIKF enhances the inputs).
    pub features: FeatureCache,
    pub batch_size: usize,
    pub seed: u64,
    /// Where the samples came from, for the log line.
    pub source: String,
}

impl Surrogate {
    /// FedTA's distiller on this set, matching the clients' enhancement and pool (Eq. 8).
    pub fn distiller(self, method: &FedTaConfig) -> anyhow::Result<Sikf> {
        let sikf = Sikf::for_method(
            method,
            &self.backbone,
            self.features,
            self.batch_size,
            Device::flex().autodiff(),
            self.seed,
        )
        .context("building FedTA's SIKF distiller")?;
        tracing::info!(surrogate = sikf.len(), source = %self.source, "FedTA: SIKF distils on the server's surrogate set");
        Ok(sikf)
    }
}

/// The server half `config` names, and for FedTA with `sikf` on its distiller on `surrogate`.
/// The one place the distiller is wired: the standalone server passes its `[sikf]` section's
/// set ([`surrogate`]), the simulator the split's surrogate rows it already holds features of.
pub fn server_method(config: &MethodConfig, surrogate: Option<Surrogate>) -> anyhow::Result<Box<dyn ServerMethod>> {
    let mut parts = Parts::default();
    if let (MethodConfig::FedTa(fedta), Some(surrogate)) = (config, surrogate) {
        if fedta.sikf {
            parts.distiller = Some(Box::new(surrogate.distiller(fedta)?));
        } else {
            tracing::warn!("FedTA's `sikf = false`: the surrogate set is not used and IE is averaged");
        }
    }
    Ok(crate::methods::build_with(config, parts))
}

/// The surrogate set `section` describes: loads the backbone's weights and the data from
/// `section.data_dir`, takes the split's surrogate set and computes its plain features once.
pub fn surrogate(section: &SikfSection) -> anyhow::Result<Surrogate> {
    let spec: DataSpec = toml::Value::Table(section.data.clone()).try_into().context("[sikf.data]")?;
    let dir = Some(section.data_dir.as_path());
    let pools = anchorage_data::label_pools(&spec, dir).context("[sikf.data]: reading the labels")?;
    let split = anchorage_data::build_split(&spec, &pools).context("[sikf.data]: partitioning")?;
    anyhow::ensure!(
        !split.surrogate.is_empty(),
        "[sikf.data]: the split has no surrogate set (a `fedta` partition with surrogate_per_class > 0 has one)"
    );
    let loaded = anchorage_data::load(&spec, dir).context("[sikf.data]: loading the data")?;
    let surrogate = Arc::new(loaded.test.subset(&split.surrogate));
    let plain = Device::flex();
    let backbone: Arc<dyn anchorage_model::Backbone + Send + Sync> =
        zoo::load(&section.backbone, surrogate.sample_len(), dir, &plain).context("[sikf]: the backbone")?.into();
    let features =
        FeatureCache::build(backbone.as_ref(), &surrogate, 256, &plain).with_inputs(Inputs::all(surrogate.clone()));
    let input = InputBackbone { net: backbone, sample_shape: surrogate.sample_shape.clone() };
    tracing::info!(backbone = %section.backbone, "[sikf]: surrogate set loaded");
    Ok(Surrogate {
        backbone: input,
        features,
        batch_size: section.batch_size,
        seed: section.seed,
        source: loaded.source,
    })
}

/// The distiller `section` describes, for the FedTA of `method` ([`surrogate`], then
/// [`Surrogate::distiller`]).
pub fn distiller(section: &SikfSection, method: &FedTaConfig) -> anyhow::Result<Sikf> {
    surrogate(section)?.distiller(method)
}
