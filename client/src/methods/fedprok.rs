//! FedProK's client half (Gao et al.): a feature extractor f (the adapter on frozen features) and a
//! classifier, both shared (FedAvg), trained on real features of the current task and on
//! pseudo-features of the old classes translated from the new ones.
//!
//! - Prototypes µ_c: class means of f(x) (Eq. 5), uploaded with their counts; the server fuses
//!   them (Eq. 9) and sends the global list back before local training.
//! - For each old class p (a global prototype whose class is not in the current task) the nearest
//!   new class n by cosine between µ_p and the new classes' prototypes (Eq. 6–7).
//! - Pseudo-features f̂(x_p) = f(x_n) + µ_p − µ_n for samples x_n of class n in the batch (Eq. 8),
//!   labelled p and replayed into the classifier beside the real features: loss = CE(real) +
//!   CE(pseudo). At most `replay_ratio` × batch pseudo-features per batch.

use anchorage_shared::MetricKey;

use super::Trained;
use anchorage_shared::method::ReplayInto;
use anchorage_shared::protocol::Broadcast;
use anchorage_shared::prototype_rules::{ClassMean, nearest_by_cosine};
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::ParamBlock;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Int, Tensor, TensorData};

use super::protos::{class_means, from_wire, host, merge_missing, to_wire, upload_prototypes};
use super::{ClientMethod, MethodContext, TrainError, common_metrics};
use anchorage_model::ops::index_tensor;
use anchorage_model::train::{Batch, Part, Trainer, accuracy, head_only, whole};
use anchorage_model::{BlockLayout, FeatureCache, Net};

/// FedProK's client half. See the module docs.
pub struct FedProKClient {
    ctx: MethodContext,
    config: anchorage_shared::method::FedProKConfig,
    task: u32,
    rng: Rng,
}

/// One old class and the translation that makes it from its nearest new class (Eq. 6–8).
#[derive(Debug, Clone)]
struct Translation {
    old: u32,
    new: u32,
    /// µ_p − µ_n.
    offset: Vec<f32>,
}

/// The translations of every old class onto its nearest new class (Eq. 6–7).
fn translations(global: &[ClassMean], new: &[ClassMean], current: &[u32]) -> Vec<Translation> {
    let candidates: Vec<&[f32]> = new.iter().map(|m| m.vector.as_slice()).collect();
    global
        .iter()
        .filter(|g| !current.contains(&g.class))
        .filter_map(|g| {
            let n = &new[nearest_by_cosine(&g.vector, &candidates)?];
            (n.vector.len() == g.vector.len()).then(|| Translation {
                old: g.class,
                new: n.class,
                offset: g.vector.iter().zip(&n.vector).map(|(p, q)| p - q).collect(),
            })
        })
        .collect()
}

impl FedProKClient {
    pub fn new(ctx: MethodContext, config: anchorage_shared::method::FedProKConfig) -> Self {
        static ONCE: std::sync::Once = std::sync::Once::new();
        if config.drift_compensation && ctx.prototype_release.is_sums() {
            ONCE.call_once(|| {
                tracing::warn!(
                    "fedprok: under [privacy] the drift-compensated prototypes of old classes are not uploaded \
                     (they are not sums of clipped features); the new classes' sums are"
                )
            });
        }
        Self { rng: Rng::derive(ctx.seed, 0xF9A0), ctx, config, task: 0 }
    }

    /// A diagnostic, never a training input: how far the old classes' stored prototypes µ_p sit
    /// from the same classes' means under the current f, on this client's own earlier tasks
    /// (the drift Eq. 8's translation cannot see). The mean over old classes of
    /// ‖µ_p − mean f(x_p)‖ / ‖mean f(x_p)‖; `None` in the first task. Computed in the rounds the
    /// stream evaluates in ([`super::stream::TaskStream::evaluates`]).
    fn prototype_drift(&self, net: &Net, global: &[ClassMean], task: u32) -> Option<f64> {
        let seen = self.ctx.stream.seen(task);
        let earlier = &seen[..seen.len().saturating_sub(1)];
        let valid = net.valid();
        let mut ratios = Vec::new();
        for t in earlier.iter().filter(|t| !t.train.is_empty()) {
            for now in class_means(valid.represent(t.train.features().inner()), &t.train.labels_host) {
                let Some(stored) = global.iter().find(|g| g.class == now.class && g.vector.len() == now.vector.len())
                else {
                    continue;
                };
                let gap: f64 = stored.vector.iter().zip(&now.vector).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
                let norm: f64 = now.vector.iter().map(|b| (*b as f64).powi(2)).sum();
                if norm > 0.0 {
                    ratios.push((gap / norm).sqrt());
                }
            }
        }
        (!ratios.is_empty()).then(|| ratios.iter().sum::<f64>() / ratios.len() as f64)
    }
}

/// Semantic drift compensation (Yu et al. 2020, SDC): each old prototype µ_p moves by the
/// weighted mean drift of the current samples, δ_p = Σ_i w_i (e_i − s_i) / Σ_i w_i with
/// w_i = exp(−‖s_i − µ_p‖² / 2σ²), where s_i and e_i are sample i's representation before and
/// after local training (`[n, dim]` row-major each) and σ² the 10% quantile of ‖s_i − µ_p‖²: the
/// nearest tenth of the samples carry the weight, and the kernel has no scale to tune. Returns the
/// moved prototypes, counted by the samples that moved them.
fn compensate_drift(old: &[ClassMean], before: &[f32], after: &[f32], dim: usize) -> Vec<ClassMean> {
    let n = before.len().min(after.len()).checked_div(dim).unwrap_or(0);
    if n == 0 {
        return Vec::new();
    }
    old.iter()
        .filter(|p| p.vector.len() == dim)
        .map(|p| {
            let d2: Vec<f64> = (0..n)
                .map(|i| {
                    before[i * dim..(i + 1) * dim].iter().zip(&p.vector).map(|(s, m)| ((s - m) as f64).powi(2)).sum()
                })
                .collect();
            let mut sorted = d2.clone();
            sorted.sort_by(f64::total_cmp);
            let sigma2 = sorted[n / 10].max(f64::MIN_POSITIVE);
            let nearest = sorted[0];
            // Shifted by the nearest distance so the largest weight is 1 (no underflow far away).
            let w: Vec<f64> = d2.iter().map(|d| (-(d - nearest) / (2.0 * sigma2)).exp()).collect();
            let total: f64 = w.iter().sum();
            let vector = (0..dim)
                .map(|j| {
                    let shift: f64 = (0..n).map(|i| w[i] * (after[i * dim + j] - before[i * dim + j]) as f64).sum();
                    p.vector[j] + (shift / total) as f32
                })
                .collect();
            ClassMean { class: p.class, count: n as u64, vector }
        })
        .collect()
}

/// Pseudo-features of a batch (Eq. 8): `(sample rows, offsets [m, d], labels [m])`, at most `limit`.
fn pseudo_batch(
    batch: &Batch,
    table: &[Translation],
    limit: usize,
    rng: &mut Rng,
) -> Option<(Vec<usize>, Vec<f32>, Vec<i64>)> {
    let mut pairs: Vec<(usize, &Translation)> = Vec::new();
    for (i, label) in batch.labels.iter().enumerate() {
        pairs.extend(table.iter().filter(|t| t.new == *label).map(|t| (i, t)));
    }
    if pairs.is_empty() || limit == 0 {
        return None;
    }
    rng.shuffle(&mut pairs);
    pairs.truncate(limit);
    let rows = pairs.iter().map(|(i, _)| *i).collect();
    let offsets = pairs.iter().flat_map(|(_, t)| t.offset.iter().copied()).collect();
    let labels = pairs.iter().map(|(_, t)| t.old as i64).collect();
    Some((rows, offsets, labels))
}

impl ClientMethod for FedProKClient {
    fn name(&self) -> &'static str {
        <anchorage_shared::method::FedProKConfig as anchorage_shared::method::MethodParams>::NAME
    }

    fn num_samples(&self) -> u64 {
        self.ctx.stream.current_samples(self.task)
    }

    fn train(&mut self, broadcast: &Broadcast) -> Result<Trained, TrainError> {
        self.task = broadcast.task;
        let data = self.ctx.stream.training(broadcast.task)?;
        let (train, current) = (data.train.clone(), data.classes.clone());
        let device = self.ctx.device.clone();
        let global = from_wire(&broadcast.prototypes)?;
        let mut net = Net::new(&self.ctx.net, &device).load_blocks(&broadcast.blocks, &device)?;
        // The new classes' prototypes under the round's starting f; global ones where the server has them.
        let start_rep = net.valid().represent(train.features().inner());
        let before = self.config.drift_compensation.then(|| host(start_rep.clone()));
        let start = class_means(start_rep, &train.labels_host);
        let new: Vec<ClassMean> =
            merge_missing(&global, &start).into_iter().filter(|m| current.contains(&m.class)).collect();
        let table = translations(&global, &new, &current);
        let c = &broadcast.config;
        let limit = (self.config.replay_ratio.max(0.0) * c.batch_size as f32).ceil() as usize;
        let dim = self.ctx.net.representation_dim();
        let ce = CrossEntropyLossConfig::new().init(&device);
        let classifier_only = self.config.replay_into == ReplayInto::Classifier;
        let mut trainer = Trainer::new(self.ctx.optimizer, c.learning_rate as f64, c.batch_size as usize);
        let mut rng = self.rng.clone();
        let mut replay_rng = Rng::derive(self.ctx.seed ^ broadcast.round, 0x9EED);
        let mut loss = f64::NAN;
        let part: Part<Net> = if self.config.freeze_after_first_task && broadcast.task > 0 { head_only } else { whole };
        for _ in 0..c.local_epochs {
            (net, loss) = trainer.epoch(net, &train, &mut rng, part, |m, b| {
                let z = m.represent(b.x.clone());
                let real = ce.forward(m.head.forward(z.clone()), b.y.clone());
                match pseudo_batch(b, &table, limit, &mut replay_rng) {
                    Some((rows, offsets, labels)) => {
                        let k = rows.len();
                        let offsets = Tensor::<2>::from_data(TensorData::new(offsets, [k, dim]), &b.x.device());
                        let source = if classifier_only { z.detach() } else { z };
                        let pseudo = source.select(0, index_tensor(&rows, &b.x.device())) + offsets;
                        let y = Tensor::<1, Int>::from_data(TensorData::new(labels, [k]), &b.x.device());
                        real + ce.forward(m.head.forward(pseudo), y)
                    }
                    None => real,
                }
            });
        }
        self.rng = rng;
        let end_rep = net.valid().represent(train.features().inner());
        let after = before.is_some().then(|| host(end_rep.clone()));
        let release = self.ctx.prototype_release;
        let mut prototypes = upload_prototypes(end_rep, &train.labels_host, release, self.ctx.encoding);
        // The old classes' drift-compensated prototypes are means moved by a data-weighted
        // shift, not sums of clipped features: under [privacy] they stay on the device.
        if let (Some(before), Some(after), false) = (before, after, release.is_sums()) {
            let old: Vec<ClassMean> = global.iter().filter(|g| !current.contains(&g.class)).cloned().collect();
            prototypes.extend(to_wire(&compensate_drift(&old, &before, &after, dim), self.ctx.encoding));
        }
        let drift = self
            .ctx
            .stream
            .evaluates(broadcast.round)
            .then(|| self.prototype_drift(&net, &global, broadcast.task))
            .flatten();
        if let Some(d) = drift {
            tracing::info!(round = broadcast.round, task = broadcast.task, drift = d, "fedprok prototype drift");
        }
        let accuracies = self.ctx.stream.accuracy_metrics(broadcast, |t| accuracy(&net, t, 512));
        let mut metrics = common_metrics(loss, accuracies);
        metrics.push(anchorage_shared::protocol::Metric::new(MetricKey::PseudoClasses, table.len() as f64));
        if let Some(d) = drift {
            metrics.push(anchorage_shared::protocol::Metric::new(MetricKey::PrototypeDrift, d));
        }
        Ok(Trained {
            prototypes_are: Default::default(),
            num_samples: train.len() as u64,
            blocks: net.to_blocks(self.ctx.encoding)?,
            prototypes,
            metrics,
        })
    }

    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
        self.ctx.initial_net_blocks()
    }

    fn global_accuracy(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Option<f64>, TrainError> {
        self.ctx.global_net_accuracy(broadcast, test)
    }

    fn global_probes(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<super::Probes, TrainError> {
        self.ctx.global_net_probes(broadcast, test)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mean(class: u32, v: &[f32]) -> ClassMean {
        ClassMean { class, count: 1, vector: v.to_vec() }
    }

    #[test]
    fn old_classes_translate_from_their_nearest_new_class() {
        // Old 0 points along x, old 1 along y; new 2 along x (+ a little y), new 3 along y.
        let global = [mean(0, &[1.0, 0.0]), mean(1, &[0.0, 2.0]), mean(2, &[9.0, 9.0])];
        let new = [mean(2, &[3.0, 0.5]), mean(3, &[0.1, 5.0])];
        let t = translations(&global, &new, &[2, 3]);
        assert_eq!(t.len(), 2, "class 2 is current, not old");
        assert_eq!((t[0].old, t[0].new), (0, 2));
        assert_eq!(t[0].offset, vec![-2.0, -0.5]);
        assert_eq!((t[1].old, t[1].new), (1, 3));
        // Eq. 8: f(x_n) + µ_p − µ_n lands on µ_p when f(x_n) = µ_n.
        let landed: Vec<f32> = new[1].vector.iter().zip(&t[1].offset).map(|(a, b)| a + b).collect();
        assert!((landed[0] - 0.0).abs() < 1e-6 && (landed[1] - 2.0).abs() < 1e-6);
    }

    #[test]
    fn drift_compensation_moves_old_prototypes_with_the_samples_near_them() {
        // Four samples in 2-D: two near (0, 0), two near (10, 0). Training moved the first pair
        // by (+1, 0) and the second by (0, −2).
        let before = [0.0, 0.0, 0.2, 0.0, 10.0, 0.0, 10.2, 0.0];
        let after = [1.0, 0.0, 1.2, 0.0, 10.0, -2.0, 10.2, -2.0];
        let old = [mean(0, &[0.1, 0.5]), mean(1, &[9.9, 0.5])];
        let moved = compensate_drift(&old, &before, &after, 2);
        assert_eq!((moved[0].class, moved[1].class, moved[0].count), (0, 1, 4));
        // Near the first pair: mostly (+1, 0); near the second: mostly (0, −2).
        assert!(moved[0].vector[0] > 0.9 && moved[0].vector[1] > 0.3, "{:?}", moved[0].vector);
        assert!(moved[1].vector[0] < 9.95 && moved[1].vector[1] < -1.3, "{:?}", moved[1].vector);
        // A uniform shift moves every prototype by exactly that shift.
        let shifted: Vec<f32> =
            before.iter().enumerate().map(|(i, v)| v + if i % 2 == 0 { 3.0 } else { -1.0 }).collect();
        let moved = compensate_drift(&old, &before, &shifted, 2);
        assert!((moved[0].vector[0] - 3.1).abs() < 1e-5 && (moved[0].vector[1] + 0.5).abs() < 1e-5);
        assert!(compensate_drift(&old, &[], &[], 2).is_empty(), "no samples, nothing moves");
    }
}
