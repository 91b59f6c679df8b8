//! Local training and evaluation of trainable parts on cached features: the loop every method's
//! client half shares.

use anchorage_shared::rng::Rng;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Gradients, Int, Tensor};
use serde::{Deserialize, Serialize};

use crate::{FeatureCache, Trainable};

/// The local optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    /// SGD with momentum 0.9.
    Sgd,
    /// Adam (β = 0.9, 0.999).
    #[default]
    Adam,
}

impl OptimizerKind {
    fn build(self) -> ModuleOptimizer {
        self.build_with_decay(0.0)
    }

    /// The optimizer with L2 weight decay `decay` (none when 0).
    fn build_with_decay(self, decay: f32) -> ModuleOptimizer {
        let decay = (decay > 0.0 && decay.is_finite()).then(|| WeightDecayConfig::new(decay));
        match self {
            OptimizerKind::Sgd => {
                SgdConfig::new().with_momentum(Some(MomentumConfig::new())).with_weight_decay(decay).init()
            }
            OptimizerKind::Adam => AdamConfig::new().with_weight_decay(decay).init(),
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

/// One minibatch of cached features.
pub struct Batch {
    pub x: Tensor<2>,
    pub y: Tensor<1, Int>,
    /// The labels, on the host.
    pub labels: Vec<u32>,
    /// The cache rows of the batch (e.g. to fetch their raw inputs).
    pub rows: Vec<usize>,
}

/// Which parameters a step updates: the gradients of the chosen part of the model.
pub type Part<M> = fn(&mut Gradients, &M) -> GradientsParams;

/// Every parameter of the model.
pub fn whole<M: Module>(grads: &mut Gradients, model: &M) -> GradientsParams {
    GradientsParams::from_module(grads, model)
}

/// The head of a [`Trainable`] (the body stays fixed).
pub fn head_only(grads: &mut Gradients, net: &Trainable) -> GradientsParams {
    GradientsParams::from_module(grads, &net.head)
}

/// The body (adapter) of a [`Trainable`] (the head stays fixed).
pub fn body_only(grads: &mut Gradients, net: &Trainable) -> GradientsParams {
    GradientsParams::from_module(grads, &net.adapter)
}

/// Minibatch training on cached features: the one loop every method's client half runs. The batch
/// order comes from `rng`, so a seeded run is reproducible; the optimizer state lives as long as
/// the trainer (one local round).
pub struct Trainer {
    optim: ModuleOptimizer,
    learning_rate: f64,
    batch_size: usize,
    /// Optimizer steps taken.
    pub steps: usize,
}

impl Trainer {
    pub fn new(optimizer: OptimizerKind, learning_rate: f64, batch_size: usize) -> Self {
        Self { optim: optimizer.build(), learning_rate, batch_size: batch_size.max(1), steps: 0 }
    }

    /// A trainer whose optimizer applies L2 weight decay `decay`.
    pub fn with_weight_decay(optimizer: OptimizerKind, learning_rate: f64, batch_size: usize, decay: f32) -> Self {
        Self { optim: optimizer.build_with_decay(decay), ..Self::new(optimizer, learning_rate, batch_size) }
    }

    /// One optimizer step minimising `loss` over the parameters `part` selects; returns the model
    /// and the loss value.
    pub fn step<M: Module>(&mut self, model: M, loss: Tensor<1>, part: Part<M>) -> (M, f64) {
        let value = loss.clone().into_scalar::<f32>() as f64;
        let mut grads = loss.backward();
        let grads = part(&mut grads, &model);
        self.steps += 1;
        (self.optim.step(self.learning_rate, model, grads), value)
    }

    /// One epoch over `cache`: for each batch, `loss(model, batch)` is minimised over the
    /// parameters `part` selects. Returns the model and the epoch's mean loss (NaN when empty).
    pub fn epoch<M: Module>(
        &mut self,
        mut model: M,
        cache: &FeatureCache,
        rng: &mut Rng,
        part: Part<M>,
        mut loss: impl FnMut(&M, &Batch) -> Tensor<1>,
    ) -> (M, f64) {
        let n = cache.len();
        let mut order: Vec<i64> = (0..n as i64).collect();
        rng.shuffle(&mut order);
        let mut loss_sum = 0.0;
        for chunk in order.chunks(self.batch_size) {
            let rows: Vec<usize> = chunk.iter().map(|&i| i as usize).collect();
            let batch = Batch {
                x: cache.select(&rows),
                y: cache.labels_of(&rows),
                labels: rows.iter().map(|&i| cache.labels_host[i]).collect(),
                rows,
            };
            let l = loss(&model, &batch);
            let value;
            (model, value) = self.step(model, l, part);
            loss_sum += value * chunk.len() as f64;
        }
        (model, if n == 0 { f64::NAN } else { loss_sum / n as f64 })
    }
}

/// Minibatch training of `model` on cached features with cross-entropy.
#[expect(clippy::too_many_arguments, reason = "the loop's settings, passed as the callers hold them")]
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
    let mut trainer = Trainer::new(optimizer, learning_rate, batch_size);
    let ce = CrossEntropyLossConfig::new().init(device);
    let mut report = FitReport { last_epoch_loss: f64::NAN, steps: 0 };
    for _ in 0..epochs {
        let (m, loss) = trainer.epoch(model, cache, rng, whole, |m, b| ce.forward(m.forward(b.x.clone()), b.y.clone()));
        model = m;
        report.last_epoch_loss = loss;
    }
    report.steps = trainer.steps;
    (model, report)
}

/// Top-1 accuracy of `model` on cached features; `None` for an empty set.
pub fn accuracy(model: &Trainable, cache: &FeatureCache, batch_size: usize) -> Option<f64> {
    let model = model.valid();
    accuracy_of(cache, batch_size, |x| model.forward(x).argmax(1))
}

std::thread_local! {
    /// Set by [`on_every_core`] for the calls of [`accuracy_of`] it makes.
    static EVERY_CORE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with [`accuracy_of`] spreading its batches over the current rayon pool on the CPU:
/// the simulator's evaluation of the global model. A device's own evaluation is not
/// spread: it runs on its training thread, whose CPU time is the device's compute time, and the
/// devices already evaluate side by side.
pub fn on_every_core<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            EVERY_CORE.set(self.0);
        }
    }
    let _restore = Restore(EVERY_CORE.replace(true));
    f()
}

/// Top-1 accuracy of any predictor (features `[n, d]` → class indices `[n, 1]`) on cached
/// features, in batches; `None` for an empty set. Under [`on_every_core`] the batches run on the
/// threads of the current rayon pool; each batch is the same rows as on one thread, so the count
/// of correct answers is the same.
pub fn accuracy_of(
    cache: &FeatureCache,
    batch_size: usize,
    predict: impl Fn(Tensor<2>) -> Tensor<2, Int> + Sync,
) -> Option<f64> {
    use rayon::prelude::*;
    let n = cache.len();
    if n == 0 {
        return None;
    }
    let batch = batch_size.max(1);
    let correct_in = |start: usize| {
        let end = (start + batch).min(n);
        let pred: Vec<i64> =
            predict(cache.slice(start..end)).into_data().convert::<i64>().try_to_vec::<i64>().unwrap_or_default();
        pred.iter().zip(&cache.labels_host[start..end]).filter(|(p, l)| **p == **l as i64).count()
    };
    let starts: Vec<usize> = (0..n).step_by(batch).collect();
    // A GPU takes one stream of work: its batches stay in order on this thread.
    let correct: usize = if EVERY_CORE.get() && cache.device().inner() == Device::flex() {
        starts.into_par_iter().map(correct_in).sum()
    } else {
        starts.into_iter().map(correct_in).sum()
    };
    Some(correct as f64 / n as f64)
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;

    use super::*;

    #[test]
    fn accuracy_counts_the_same_on_one_thread_or_several() {
        let device = Device::flex();
        let (n, d) = (1000, 3);
        // Distinct values in every row (7919 is prime to 1009), so the arg max has no tie.
        let values: Vec<f32> = (0..n * d).map(|i| ((i * 7919) % 1009) as f32).collect();
        let labels: Vec<u32> = (0..n).map(|i| (i % 3) as u32).collect();
        let expected = (0..n)
            .filter(|&r| {
                let row = &values[r * d..(r + 1) * d];
                let best = (0..d).max_by(|&a, &b| row[a].total_cmp(&row[b])).unwrap();
                best as u32 == labels[r]
            })
            .count() as f64
            / n as f64;
        let cache = FeatureCache::from_parts(
            Tensor::<2>::from_data(TensorData::new(values, [n, d]), &device),
            &labels,
            &device,
        );
        let predict = |x: Tensor<2>| x.argmax(1);
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| on_every_core(|| accuracy_of(&cache, 64, predict)))
        };
        assert_eq!(accuracy_of(&cache, n, predict), Some(expected), "one batch");
        assert_eq!(on(1), Some(expected), "16 batches on one thread");
        assert_eq!(on(4), Some(expected), "16 batches on four threads");
        assert!(expected > 0.2 && expected < 0.5, "a count that could come out wrong: {expected}");
    }
}
