//! FedTA's Selective Input Knowledge Fusion (Eq. 8) for the server half (feature `sikf`).
//!
//! The distillation itself is [`Sikf`] in the client crate (it runs the frozen backbone on
//! burn); this module hands it to [`FedTaServer`](crate::methods::FedTaServer) as its
//! [`InputDistiller`], and builds it for the standalone server from the `[sikf]` section of
//! `server.toml`: the clients' backbone, and the surrogate set of a data spec's FedTA split
//! (k test images per class). The simulator builds the same distiller on the features it already
//! holds.

use std::sync::Arc;

use anchorage_data::DataSpec;
use anchorage_model::prompts::fusion::Sikf;
use anchorage_model::{FeatureCache, InputBackbone, Inputs, zoo};
use anchorage_shared::method::FedTaConfig;
use anchorage_shared::tensor::ParamBlock;
use anyhow::Context;
use burn::tensor::Device;

use crate::config::SikfSection;
use crate::methods::{Distilled, InputDistiller};

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

/// The distiller `section` describes, for the FedTA of `method`: loads the backbone's weights and
/// the data from `section.data_dir`, takes the split's surrogate set and computes its plain
/// features once.
pub fn distiller(section: &SikfSection, method: &FedTaConfig) -> anyhow::Result<Sikf> {
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
    let sikf = Sikf::for_method(method, &input, features, section.batch_size, plain.autodiff(), section.seed)
        .context("[sikf]: building the distiller")?;
    tracing::info!(
        backbone = %section.backbone,
        surrogate = sikf.len(),
        source = %loaded.source,
        "FedTA: SIKF distils on the server's surrogate set"
    );
    Ok(sikf)
}
