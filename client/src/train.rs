//! Local training and evaluation of trainable parts on cached features: the loop every method's
//! client half shares.

use anchorage_shared::rng::Rng;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use serde::{Deserialize, Serialize};

use crate::model::{FeatureCache, Trainable};

/// The local optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    /// SGD with momentum 0.9.
    Sgd,
    #[default]
    Adam,
}

impl OptimizerKind {
    fn build(self) -> ModuleOptimizer {
        match self {
            OptimizerKind::Sgd => SgdConfig::new().with_momentum(Some(MomentumConfig::new())).init(),
            OptimizerKind::Adam => AdamConfig::new().init(),
        }
    }
}

/// What one call of [`fit`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct FitReport {
    /// Mean cross-entropy over the last epoch.
    pub last_epoch_loss: f64,
    pub steps: usize,
}

/// Minibatch training of `model` on cached features with cross-entropy. The batch order comes from
/// `rng`, so a seeded run is reproducible.
pub fn fit(
    mut model: Trainable,
    cache: &FeatureCache,
    epochs: u32,
    batch_size: usize,
    learning_rate: f64,
    optimizer: OptimizerKind,
    rng: &mut Rng,
    device: &Device,
) -> (Trainable, FitReport) {
    let mut optim = optimizer.build();
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let n = cache.len();
    let batch_size = batch_size.max(1);
    let mut order: Vec<i64> = (0..n as i64).collect();
    let mut report = FitReport { last_epoch_loss: f64::NAN, steps: 0 };
    for _ in 0..epochs {
        rng.shuffle(&mut order);
        let mut loss_sum = 0.0;
        for batch in order.chunks(batch_size) {
            let idx = Tensor::<1, Int>::from_data(TensorData::new(batch.to_vec(), [batch.len()]), device);
            let x = cache.features.clone().select(0, idx.clone());
            let y = cache.labels.clone().select(0, idx);
            let loss = loss_fn.forward(model.forward(x), y);
            let value: f32 = loss.clone().into_scalar::<f32>();
            loss_sum += value as f64 * batch.len() as f64;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(learning_rate, model, grads);
            report.steps += 1;
        }
        if n > 0 {
            report.last_epoch_loss = loss_sum / n as f64;
        }
    }
    (model, report)
}

/// Top-1 accuracy of `model` on cached features; `None` for an empty set.
pub fn accuracy(model: &Trainable, cache: &FeatureCache, batch_size: usize) -> Option<f64> {
    let n = cache.len();
    if n == 0 {
        return None;
    }
    let model = burn::module::Module::valid(model);
    let mut correct = 0usize;
    for start in (0..n).step_by(batch_size.max(1)) {
        let end = (start + batch_size.max(1)).min(n);
        let x = cache.features.clone().slice(start..end);
        let pred: Vec<i64> = model.forward(x).argmax(1).into_data().try_into_vec_as::<i64>().unwrap_or_default();
        correct += pred.iter().zip(&cache.labels_host[start..end]).filter(|(p, l)| **p == **l as i64).count();
    }
    Some(correct as f64 / n as f64)
}
