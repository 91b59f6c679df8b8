//! `[evaluation]` (feature `sikf`): the server's own evaluation of a global model on the
//! operator's held-out set.
//!
//! The data come through the devices' own loaders (`anchorage-data`) and frozen backbone
//! (`anchorage-model`), and the prediction is the method's: the seeded net with the global
//! blocks loaded, its head's top-1 class, which is what the client halves of the methods that
//! predict with the global head compute (`MethodContext::global_net_accuracy` in the client crate,
//! also what the simulator's evaluator runs for them). The server does not depend on the client
//! crate, so methods that predict with prototypes (GLDP, FedEvolve, FedTA) are refused by
//! [`crate::config::ServerConfig::parse`]: their prediction lives only in the client crate.

use anchorage_data::{DataSpec, SyntheticConfig, synthetic};
use anchorage_model::{BlockLayout, FeatureCache, FrozenBackbone, ModelSpec, Net, NetSpec, zoo};
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::ParamBlock;
use anyhow::Context;
use burn::tensor::Device;

use crate::config::{EvaluationData, EvaluationSection};

/// The held-out features and the net the devices train, ready to score a global model.
pub(super) struct HeldOut {
    net: NetSpec,
    test: FeatureCache,
    /// The device the net is built on (the devices' training device; its `valid()` form runs).
    device: Device,
    /// What the data are, for the log.
    pub source: String,
}

/// Rows to keep of `n` held-out samples: all of them, or a seeded draw of `max` (in order).
fn keep(n: usize, max: usize) -> Vec<usize> {
    if max == 0 || max >= n {
        return (0..n).collect();
    }
    let mut rows = Rng::derive(0xE7A1, n as u64).sample_indices(n, max);
    rows.sort_unstable();
    rows
}

/// Loads `section`'s held-out data and computes their features once.
pub(super) fn build(section: &EvaluationSection) -> anyhow::Result<HeldOut> {
    let plain = Device::flex();
    match &section.data {
        EvaluationData::Synthetic { seed } => {
            // The devices' embedded set: they train on shares of its training half.
            let (_, test) = synthetic::generate(&SyntheticConfig { seed: *seed, ..SyntheticConfig::default() });
            let test = test.subset(&keep(test.len(), section.max_samples));
            let spec = ModelSpec::embedded_default();
            let backbone = FrozenBackbone::new(&spec, &plain);
            Ok(HeldOut {
                net: spec.net(),
                test: FeatureCache::build(&backbone, &test, 256, &plain),
                device: plain.clone().autodiff(),
                source: format!("the embedded synthetic set's test half (seed {seed}, {} samples)", test.len()),
            })
        }
        EvaluationData::Scenario { data_dir, backbone, hidden, residual, model_seed, spec } => {
            let spec: DataSpec = toml::Value::Table(spec.clone()).try_into().context("[evaluation.data.spec]")?;
            let dir = Some(data_dir.as_path());
            let pools = anchorage_data::label_pools(&spec, dir).context("[evaluation]: reading the labels")?;
            let rows = keep(pools.test.len(), section.max_samples);
            let loaded =
                anchorage_data::load_rows(&spec, dir, &[], &rows).context("[evaluation]: loading the test set")?;
            let test = loaded.test;
            anyhow::ensure!(!test.is_empty(), "[evaluation]: the scenario's test set is empty");
            let net: Box<dyn anchorage_model::Backbone + Send + Sync> =
                zoo::load(backbone, test.sample_len(), dir, &plain)
                    .with_context(|| format!("[evaluation]: the backbone `{backbone}`"))?;
            let spec = NetSpec {
                input_dim: net.feature_dim(),
                hidden: hidden.clone(),
                num_classes: test.num_classes as usize,
                seed: *model_seed,
                residual: *residual,
            };
            spec.check().map_err(|e| anyhow::anyhow!("[evaluation.data] residual: {e}"))?;
            Ok(HeldOut {
                net: spec,
                test: FeatureCache::build(net.as_ref(), &test, 256, &plain),
                device: plain.clone().autodiff(),
                source: format!("{} ({} test samples, backbone {backbone})", loaded.source, test.len()),
            })
        }
    }
}

impl HeldOut {
    /// Top-1 accuracy of the global model `blocks` on the held-out set.
    pub(super) fn evaluate(&self, blocks: &[ParamBlock]) -> anyhow::Result<Option<f64>> {
        let net = Net::new(&self.net, &self.device)
            .load_blocks(blocks, &self.device)
            .context("the global model does not fit the net [evaluation] builds")?;
        Ok(anchorage_model::train::accuracy(&net, &self.test, 1024))
    }

    /// Held-out samples.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.test.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anchorage_shared::tensor::Encoding;

    #[test]
    fn the_embedded_sets_test_half_scores_a_model() {
        let section = EvaluationSection { data: EvaluationData::Synthetic { seed: 7 }, every: 1, max_samples: 200 };
        let held_out = build(&section).unwrap();
        assert_eq!(held_out.len(), 200);
        // The seeded initial model (what provision writes) is about chance on 10 classes.
        let initial = Net::new(&ModelSpec::embedded_default().net(), &Device::flex()).to_blocks(Encoding::F32).unwrap();
        let accuracy = held_out.evaluate(&initial).unwrap().unwrap();
        assert!((0.0..=0.4).contains(&accuracy), "{accuracy}");
        // A model of another layout is an error, not a number.
        let wrong = vec![ParamBlock::encode("head.weight", &[2, 2], &[0.0; 4], Encoding::F32)];
        assert!(held_out.evaluate(&wrong).is_err());
    }

    #[test]
    fn a_scenarios_test_set_goes_through_the_devices_backbone() {
        let spec: toml::Table =
            toml::from_str("dataset = \"synthetic\"\nseed = 3\n[partition]\nkind = \"iid\"\nclients = 2\n").unwrap();
        let section = EvaluationSection {
            data: EvaluationData::Scenario {
                data_dir: std::env::temp_dir(),
                backbone: "identity".into(),
                hidden: vec![],
                residual: false,
                model_seed: 1,
                spec,
            },
            every: 1,
            max_samples: 0,
        };
        let held_out = build(&section).unwrap();
        assert!(held_out.len() > 0, "{}", held_out.source);
        let net = NetSpec { input_dim: 256, hidden: vec![], num_classes: 10, seed: 1, residual: false };
        let initial = Net::new(&net, &Device::flex()).to_blocks(Encoding::F32).unwrap();
        assert!(held_out.evaluate(&initial).unwrap().is_some());
    }
}
