//! FedEvp's client half (the lighter variant beside FedEvolve): one map φ (the adapter) and a
//! classifier w (the head), both shared.
//!
//! - Evolving prototypes over the source domains (Eq. 5): C_m = (m−1)/m·C_{m−1} + 1/m·mean_m,
//!   where mean_m is the class mean of φ(x) over domain m, computed at the start of the round.
//! - Loss (Eq. 6–7): CE(w(φ(x)), y) + `proto_weight`·‖φ(x) − C_y‖²/d (the alignment to the global
//!   evolving prototype of the sample's class; the client's own ones before the server has any).
//!   `alignment` puts a target nearer the unseen domain in Eq. 5's place: the last
//!   source domain's class mean, or that mean moved one step further along the drift.
//!   The squared distance is divided by the width d (a mean squared error, as the reference
//!   MSE loss computes it): summed over 256 ReLU units it outweighs the CE term by orders of
//!   magnitude and pulls every feature onto nearly equal class means, collapsing φ to chance.
//! - After training, a personalized copy fine-tunes w and the last layer of φ for
//!   `personal_epochs` on the last source domain; the upload is the shared model, the client's
//!   reported accuracy is the personalized one, the server's is the global model's.
//! - Under `[privacy]` the upload is each class's sum of clipped φ-features over every
//!   seen domain pooled, with its count ([`uploaded_prototypes`]); the server's mean of those
//!   sums is Eq. 5's equal-weight average of the domains' means when the domains hold a class
//!   equally often (the sample-weighted average otherwise). The device still trains on its
//!   evolving prototypes.

use super::Trained;
use anchorage_shared::method::{FedEvpAlignment, FedEvpConfig};
use anchorage_shared::protocol::Broadcast;
use anchorage_shared::prototype_rules::{ClassMean, evolving_prototype};
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::ParamBlock;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::GradientsParams;
use burn::tensor::{Gradients, Tensor};

use super::protos::{
    PrototypeRelease, PrototypeTable, add_sums, class_clipped_sums, class_means, from_wire, merge_missing, to_wire,
};
use super::{ClientMethod, MethodContext, TaskData, TrainError, common_metrics};
use anchorage_model::ops::index_tensor;
use anchorage_model::train::{Trainer, accuracy, whole};
use anchorage_model::{BlockLayout, FeatureCache, Net};

/// FedEvp's client half. See the module docs.
pub struct FedEvpClient {
    ctx: MethodContext,
    config: FedEvpConfig,
    task: u32,
    rng: Rng,
}

/// The head and the last layer of φ (the personalized parts).
fn personal_parts(grads: &mut Gradients, net: &Net) -> GradientsParams {
    let mut params = GradientsParams::from_module(grads, &net.head);
    if let Some(last) = net.adapter.layers.last() {
        let more = GradientsParams::from_module(grads, last);
        params = merge(params, more, last);
    }
    params
}

fn merge(mut a: GradientsParams, mut b: GradientsParams, module: &burn::nn::Linear) -> GradientsParams {
    let id = module.weight.id;
    if let Some(g) = b.remove::<2>(id) {
        a.register(id, g);
    }
    if let Some(bias) = &module.bias
        && let Some(g) = b.remove::<1>(bias.id)
    {
        a.register(bias.id, g);
    }
    a
}

/// The alignment targets on the representation of `net`: Eq. 5 over the domains in order, or
/// what `alignment` puts in its place.
fn evolving_prototypes(net: &Net, domains: &[TaskData], alignment: FedEvpAlignment) -> Vec<ClassMean> {
    let net = net.valid();
    let mut evolving: Vec<ClassMean> = Vec::new();
    // Per class, the previous domain's mean (for the extrapolated target).
    let mut previous: Vec<ClassMean> = Vec::new();
    for (m, d) in domains.iter().enumerate() {
        for mean in class_means(net.represent(d.train.features().inner()), &d.train.labels_host) {
            let prev = evolving.iter().position(|e| e.class == mean.class);
            let before = previous.iter().position(|e| e.class == mean.class);
            let vector = match alignment {
                FedEvpAlignment::Evolving => {
                    evolving_prototype(prev.map(|i| evolving[i].vector.as_slice()), &mean.vector, m as u32 + 1)
                }
                FedEvpAlignment::Latest => Some(mean.vector.clone()),
                FedEvpAlignment::Extrapolated => match before.map(|i| &previous[i].vector) {
                    Some(p) if p.len() == mean.vector.len() => {
                        Some(mean.vector.iter().zip(p).map(|(now, then)| 2.0 * now - then).collect())
                    }
                    _ => Some(mean.vector.clone()),
                },
            };
            match before {
                Some(i) => previous[i] = mean.clone(),
                None => previous.push(mean.clone()),
            }
            match (prev, vector) {
                (Some(i), Some(v)) => evolving[i] = ClassMean { vector: v, count: mean.count, class: mean.class },
                (None, Some(v)) => evolving.push(ClassMean { vector: v, ..mean }),
                _ => {}
            }
        }
    }
    evolving.sort_by_key(|e| e.class);
    evolving
}

/// What the device uploads: the evolving prototypes (privacy off) or, under
/// `[privacy]`, the per-class sums of φ-features clipped to the release's clip over every seen
/// domain, with their counts (a sum over domains of Eq. 5's weights would let one sample move
/// the upload by more than the clip).
fn uploaded_prototypes(
    net: &Net,
    domains: &[TaskData],
    release: PrototypeRelease,
    config: &FedEvpConfig,
    encoding: anchorage_shared::tensor::Encoding,
) -> Vec<anchorage_shared::prototype::Prototype> {
    let PrototypeRelease::ClippedSums { clip } = release else {
        return to_wire(&evolving_prototypes(net, domains, config.alignment), encoding);
    };
    let net = net.valid();
    let mut sums = Vec::new();
    for d in domains {
        add_sums(&mut sums, class_clipped_sums(net.represent(d.train.features().inner()), &d.train.labels_host, clip));
    }
    to_wire(&sums, encoding)
}

impl FedEvpClient {
    pub fn new(ctx: MethodContext, config: FedEvpConfig) -> Self {
        Self { rng: Rng::derive(ctx.seed, 0xE7B), ctx, config, task: 0 }
    }
}

impl ClientMethod for FedEvpClient {
    fn name(&self) -> &'static str {
        <anchorage_shared::method::FedEvpConfig as anchorage_shared::method::MethodParams>::NAME
    }

    fn num_samples(&self) -> u64 {
        self.ctx.stream.seen_samples(self.task)
    }

    fn train(&mut self, broadcast: &Broadcast) -> Result<Trained, TrainError> {
        self.task = broadcast.task;
        let domains = self.ctx.stream.seen_training(broadcast.task)?;
        let last = domains[domains.len() - 1].clone();
        let device = self.ctx.device.clone();
        let mut net = Net::new(&self.ctx.net, &device).load_blocks(&broadcast.blocks, &device)?;
        let own = evolving_prototypes(&net, &domains, self.config.alignment);
        let anchors = PrototypeTable::new(&merge_missing(&from_wire(&broadcast.prototypes)?, &own), &device);
        let c = &broadcast.config;
        let weight = self.config.proto_weight;
        let ce = CrossEntropyLossConfig::new().init(&device);
        let mut trainer = Trainer::new(self.ctx.optimizer, c.learning_rate as f64, c.batch_size as usize);
        let mut rng = self.rng.clone();
        let mut loss = f64::NAN;
        let objective = |m: &Net, b: &anchorage_model::train::Batch| {
            let z = m.represent(b.x.clone());
            let l = ce.forward(m.head.forward(z.clone()), b.y.clone());
            let Some(table) = anchors.as_ref().filter(|_| weight > 0.0) else { return l };
            let rows: Vec<(usize, usize)> =
                table.rows_of(&b.labels).into_iter().enumerate().filter_map(|(i, r)| r.map(|r| (i, r))).collect();
            if rows.is_empty() {
                return l;
            }
            let dev = b.x.device();
            let zi = z.select(0, index_tensor(&rows.iter().map(|r| r.0).collect::<Vec<_>>(), &dev));
            let ci = table.matrix.clone().select(0, index_tensor(&rows.iter().map(|r| r.1).collect::<Vec<_>>(), &dev));
            let align: Tensor<1> = (zi - ci).powi_scalar(2).mean();
            l + align.mul_scalar(weight)
        };
        // Every source domain in one shuffled set (the alignment target of a class is the same
        // evolving prototype whatever the domain).
        let pooled = FeatureCache::concat(&domains.iter().map(|d| d.train.clone()).collect::<Vec<_>>())
            .ok_or(TrainError::NoData)?;
        for _ in 0..c.local_epochs {
            (net, loss) = trainer.epoch(net, &pooled, &mut rng, whole, objective);
        }
        let prototypes =
            uploaded_prototypes(&net, &domains, self.ctx.prototype_release, &self.config, self.ctx.encoding);
        let blocks = net.to_blocks(self.ctx.encoding)?;
        // Personalization: w and the last layer of φ, on a copy that stays on the device.
        let mut personal = net;
        let mut tuner = Trainer::new(self.ctx.optimizer, c.learning_rate as f64, c.batch_size as usize);
        for _ in 0..self.config.personal_epochs {
            (personal, _) = tuner.epoch(personal, &last.train, &mut rng, personal_parts, |m, b| {
                ce.forward(m.forward(b.x.clone()), b.y.clone())
            });
        }
        self.rng = rng;
        let accuracies = self.ctx.stream.accuracy_metrics(broadcast, |t| accuracy(&personal, t, 512));
        Ok(Trained {
            prototypes_are: Default::default(),
            num_samples: domains.iter().map(|d| d.train.len() as u64).sum(),
            blocks,
            prototypes,
            metrics: common_metrics(loss, accuracies),
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
    use anchorage_model::NetSpec;
    use burn::tensor::{Device, TensorData};

    use super::*;

    /// A domain whose class c samples all sit at `at` on axis c (two classes, two features).
    fn domain(at: f32) -> TaskData {
        let device = Device::flex();
        let values = vec![at, 0.0, at, 0.0, 0.0, at, 0.0, at];
        let features = Tensor::<2>::from_data(TensorData::new(values, [4, 2]), &device);
        let cache = FeatureCache::from_parts(features, &[0, 0, 1, 1], &device);
        TaskData { classes: vec![0, 1], train: cache.clone(), test: cache, selected: None }
    }

    #[test]
    fn each_alignment_target_from_the_domains_class_means() {
        // No hidden layer: the representation is the features themselves.
        let spec = NetSpec { input_dim: 2, hidden: vec![], num_classes: 2, seed: 1, residual: false };
        let net = Net::new(&spec, &Device::flex());
        let domains = [domain(1.0), domain(3.0), domain(5.0)];
        let target = |alignment| {
            let means = evolving_prototypes(&net, &domains, alignment);
            assert_eq!(means.iter().map(|m| m.class).collect::<Vec<_>>(), [0, 1]);
            (means[0].vector.clone(), means[1].vector.clone())
        };
        let close = |a: (Vec<f32>, Vec<f32>), b: [f32; 2]| {
            assert!((a.0[0] - b[0]).abs() < 1e-5 && (a.1[1] - b[1]).abs() < 1e-5, "{a:?} vs {b:?}");
            assert!(a.0[1].abs() < 1e-6 && a.1[0].abs() < 1e-6, "{a:?}");
        };
        close(target(FedEvpAlignment::Evolving), [3.0, 3.0]); // (1 + 3 + 5) / 3, Eq. 5
        close(target(FedEvpAlignment::Latest), [5.0, 5.0]);
        close(target(FedEvpAlignment::Extrapolated), [7.0, 7.0]); // 5 + (5 − 3)
        // One domain: every target is its mean.
        let one = evolving_prototypes(&net, &domains[..1], FedEvpAlignment::Extrapolated);
        assert!((one[0].vector[0] - 1.0).abs() < 1e-6);
    }
}
