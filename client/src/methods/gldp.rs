//! GLDP's client half (STHFL, Guo et al.): a shared representation µ (the adapter) and a personal
//! layer ν (the head, never uploaded).
//!
//! - µ trains for t = `shared_epochs` local epochs with ν fixed, then ν for s = `local_epochs`
//!   with µ fixed (t < s in the paper); only µ is aggregated (Eq. 5).
//! - Local prototypes C_i^n: the class means of µ(x) (Eq. 6), kept across stages by a moving
//!   average with β (Eq. 9); a class seen for the first time is added as it is.
//! - Loss (Eq. 12): CE(ν(µ(x)), y) + λ·L_LP + (1−λ)·L_GP.
//! - **L_LP, our reading of Eq. 7–8.** The paper writes a KL divergence between a prototype and a
//!   probability vector, which is not defined as printed. We compare two distributions over the
//!   local prototypes: the relation of the sample, p(z) = softmax_k(−‖z − C_k‖²/T), and the
//!   relation of its class prototype, q_y = softmax_k(−‖C_y − C_k‖²/T); L_LP = KL(q_y ‖ p(z)).
//!   A sample then sits among the prototypes the way its class prototype does. Samples of a class
//!   without a local prototype yet (the first round of a stage) are left out of L_LP.
//! - **L_GP (Eq. 10)**: the count-weighted squared distance between the batch's class means and
//!   the global prototypes, Σ_n (N_n/N)·‖C_n^batch − G_n‖², over the classes with a global prototype.
//! - Prediction by the nearest prototype (Eq. 13), local (GLDP-LP) or global (GLDP-GP).
//!
//! λ = 1 and λ = 0 are the paper's ablations (local relation only, global alignment only);
//! `prototype_losses = false` drops both, and `prediction = "head"` predicts with ν instead of
//! prototypes (the global model with ν averaged over the devices, `global_head`), our
//! ablations. The global model's probes ([`super::Probes`]) read µ apart from the prediction rule.

use super::Trained;
use anchorage_shared::math::moving_average;
use anchorage_shared::method::{Distance, GldpPrediction};
use anchorage_shared::protocol::Broadcast;
use anchorage_shared::prototype_rules::ClassMean;
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::{Device, Tensor};

use super::protos::{PrototypeTable, batch_class_means, from_wire, means_and_upload};
use super::{ClientMethod, MethodContext, Probes, TrainError, common_metrics};
use anchorage_model::ops::{index_tensor, squared_distances};
use anchorage_model::train::{Batch, Trainer, accuracy, accuracy_of, body_only, head_only};
use anchorage_model::{BlockLayout, FeatureCache, Net, is_head_block};

/// GLDP's client half. See the module docs.
pub struct GldpClient {
    ctx: MethodContext,
    config: anchorage_shared::method::GldpConfig,
    /// The personal layer ν, kept on the device (the head of this net; its body is refreshed from µ).
    own: Option<Net>,
    /// Local prototypes C_i^n (Eq. 6, Eq. 9).
    local: Vec<ClassMean>,
    task: u32,
    rng: Rng,
}

/// KL(q_y ‖ p(z)) up to the constant entropy of q (Eq. 7–8, our reading; see the module docs).
fn local_relation_loss(z: Tensor<2>, labels: &[u32], local: &PrototypeTable, temperature: f32) -> Option<Tensor<1>> {
    let rows: Vec<(usize, usize)> =
        local.rows_of(labels).into_iter().enumerate().filter_map(|(i, r)| r.map(|r| (i, r))).collect();
    if rows.is_empty() || local.classes.len() < 2 {
        return None;
    }
    let device = z.device();
    let samples = index_tensor(&rows.iter().map(|(i, _)| *i).collect::<Vec<_>>(), &device);
    let classes = index_tensor(&rows.iter().map(|(_, r)| *r).collect::<Vec<_>>(), &device);
    let t = temperature.max(1e-6);
    let relation = softmax(-squared_distances(local.matrix.clone(), local.matrix.clone()) / t, 1);
    let q = relation.select(0, classes);
    let log_p = log_softmax(-squared_distances(z.select(0, samples), local.matrix.clone()) / t, 1);
    Some((q.clone() * (q.clamp_min(1e-12).log() - log_p)).sum_dim(1).mean())
}

/// Σ_n (N_n/N)·‖C_n^batch − G_n‖² over the batch's classes that have a global prototype (Eq. 10).
fn global_prototype_loss(z: Tensor<2>, labels: &[u32], global: &PrototypeTable) -> Option<Tensor<1>> {
    let (classes, means) = batch_class_means(z, labels);
    let keep: Vec<(usize, usize, f32)> = classes
        .iter()
        .enumerate()
        .filter_map(|(k, c)| {
            let n = labels.iter().filter(|l| *l == c).count() as f32;
            global.row(*c).map(|r| (k, r, n / labels.len() as f32))
        })
        .collect();
    if keep.is_empty() {
        return None;
    }
    let device = means.device();
    let mine = means.select(0, index_tensor(&keep.iter().map(|k| k.0).collect::<Vec<_>>(), &device));
    let theirs = global.matrix.clone().select(0, index_tensor(&keep.iter().map(|k| k.1).collect::<Vec<_>>(), &device));
    let weights = Tensor::<1>::from_floats(keep.iter().map(|k| k.2).collect::<Vec<_>>().as_slice(), &device);
    Some(((mine - theirs).powi_scalar(2).sum_dim(1).reshape([keep.len()]) * weights).sum())
}

impl GldpClient {
    pub fn new(ctx: MethodContext, config: anchorage_shared::method::GldpConfig) -> Self {
        Self { rng: Rng::derive(ctx.seed, 0x61D9), ctx, config, own: None, local: Vec::new(), task: 0 }
    }

    /// Eq. 12 for one batch.
    fn loss(
        &self,
        net: &Net,
        batch: &Batch,
        local: Option<&PrototypeTable>,
        global: Option<&PrototypeTable>,
    ) -> Tensor<1> {
        let ce = CrossEntropyLossConfig::new().init(&batch.x.device());
        let z = net.represent(batch.x.clone());
        let mut loss = ce.forward(net.head.forward(z.clone()), batch.y.clone());
        if !self.config.prototype_losses {
            return loss;
        }
        let lambda = self.config.lambda;
        if lambda > 0.0
            && let Some(l) =
                local.and_then(|p| local_relation_loss(z.clone(), &batch.labels, p, self.config.temperature))
        {
            loss = loss + l.mul_scalar(lambda);
        }
        if lambda < 1.0
            && let Some(g) = global.and_then(|p| global_prototype_loss(z, &batch.labels, p))
        {
            loss = loss + g.mul_scalar(1.0 - lambda);
        }
        loss
    }

    /// Eq. 9: blends this round's class means into the local prototypes.
    fn remember(&mut self, fresh: &[ClassMean]) {
        let beta = self.config.beta;
        for f in fresh {
            match self.local.iter_mut().find(|l| l.class == f.class) {
                Some(l) => {
                    if let Some(v) = moving_average(&l.vector, &f.vector, beta) {
                        l.vector = v;
                        l.count = f.count;
                    }
                }
                None => self.local.push(f.clone()),
            }
        }
        self.local.sort_by_key(|l| l.class);
    }
}

/// Nearest-prototype accuracy of a representation on `test` (Eq. 13).
fn prototype_accuracy(net: &Net, table: Option<&PrototypeTable>, test: &FeatureCache) -> Option<f64> {
    let table = table?;
    let net = net.valid();
    let table = PrototypeTable { matrix: table.matrix.clone().inner(), ..table.clone() };
    accuracy_of(test, 1024, |x| table.predict(net.represent(x.inner()), Distance::Euclidean))
}

/// Top-1 accuracy of the global µ through the global ν; none when the broadcast has no head.
fn global_head_accuracy(net: &Net, broadcast: &Broadcast, test: &FeatureCache) -> Option<f64> {
    broadcast.blocks.iter().any(|b| is_head_block(&b.name)).then(|| accuracy(net, test, 1024)).flatten()
}

fn table(means: &[ClassMean], device: &Device) -> Option<PrototypeTable> {
    PrototypeTable::new(means, device)
}

impl ClientMethod for GldpClient {
    fn name(&self) -> &'static str {
        <anchorage_shared::method::GldpConfig as anchorage_shared::method::MethodParams>::NAME
    }

    fn num_samples(&self) -> u64 {
        self.ctx.stream.current_samples(self.task)
    }

    fn train(&mut self, broadcast: &Broadcast) -> Result<Trained, TrainError> {
        self.task = broadcast.task;
        let data = self.ctx.stream.training(broadcast.task)?;
        let train = data.train.clone();
        let device = self.ctx.device.clone();
        let global_means = from_wire(&broadcast.prototypes)?;
        let global = table(&global_means, &device);
        let local = table(&self.local, &device);
        let c = &broadcast.config;
        let own = self.own.take().unwrap_or_else(|| Net::new(&self.ctx.net, &device));
        // ν is personal: a global head (`global_head`) is for the global model, never loaded here.
        let shared: Vec<ParamBlock> = broadcast.blocks.iter().filter(|b| !is_head_block(&b.name)).cloned().collect();
        let mut net = own.load_blocks(&shared, &device)?;
        let mut trainer = Trainer::new(self.ctx.optimizer, c.learning_rate as f64, c.batch_size as usize);
        let mut rng = self.rng.clone();
        let mut loss = f64::NAN;
        // µ for t epochs, then ν for s epochs (Eq. 12 throughout).
        for _ in 0..self.config.shared_epochs {
            (net, loss) = trainer
                .epoch(net, &train, &mut rng, body_only, |m, b| self.loss(m, b, local.as_ref(), global.as_ref()));
        }
        for _ in 0..c.local_epochs {
            (net, loss) = trainer
                .epoch(net, &train, &mut rng, head_only, |m, b| self.loss(m, b, local.as_ref(), global.as_ref()));
        }
        self.rng = rng;
        let (fresh, prototypes) = means_and_upload(
            net.valid().represent(train.features().inner()),
            &train.labels_host,
            self.ctx.prototype_release,
            self.ctx.encoding,
        );
        self.remember(&fresh);
        let predict_with = match self.config.prediction {
            GldpPrediction::Local => table(&self.local, &device),
            GldpPrediction::Global => {
                table(&crate::methods::protos::merge_missing(&global_means, &self.local), &device)
            }
            GldpPrediction::Head => None,
        };
        let accuracies = self.ctx.stream.accuracy_metrics(broadcast, |t| match self.config.prediction {
            GldpPrediction::Head => accuracy(&net, t, 1024),
            _ => prototype_accuracy(&net, predict_with.as_ref(), t),
        });
        let mut blocks = net.to_blocks(self.ctx.encoding)?;
        blocks.retain(|b| self.config.shares_head() || !is_head_block(&b.name));
        self.own = Some(net);
        Ok(Trained {
            prototypes_are: Default::default(),
            num_samples: train.len() as u64,
            blocks,
            prototypes,
            metrics: common_metrics(loss, accuracies),
        })
    }

    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
        let mut blocks = Net::new(&self.ctx.net, &self.ctx.device).to_blocks(Encoding::F32)?;
        blocks.retain(|b| self.config.shares_head() || !is_head_block(&b.name));
        Ok(blocks)
    }

    /// GLDP-GP on the server's side: the global µ and the global prototypes (Eq. 13); under
    /// `prediction = "head"` the global µ and the averaged ν.
    fn global_accuracy(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Option<f64>, TrainError> {
        let device = &self.ctx.device;
        let net = self.ctx.global_net(broadcast)?;
        if self.config.prediction == GldpPrediction::Head {
            return Ok(global_head_accuracy(&net, broadcast, test));
        }
        let global = table(&from_wire(&broadcast.prototypes)?, device);
        Ok(prototype_accuracy(&net, global.as_ref(), test))
    }

    /// The global head's accuracy on the global µ (with a global head) and µ's separability.
    fn global_probes(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Probes, TrainError> {
        self.ctx.global_net_probes(broadcast, test)
    }
}

#[cfg(test)]
mod tests {
    use anchorage_data::Dataset;
    use anchorage_model::{Identity, NetSpec};
    use anchorage_shared::method::GldpConfig;
    use anchorage_shared::protocol::RoundConfig;
    use anchorage_shared::prototype::Prototype;

    use super::*;
    use crate::methods::TaskStream;

    /// Three classes of 4 features around class-dependent centres.
    fn data(n: usize, seed: u64) -> Dataset {
        let mut rng = Rng::new(seed);
        let labels: Vec<u32> = (0..n as u32).map(|i| i % 3).collect();
        let features = labels
            .iter()
            .flat_map(|&l| {
                (0..4).map(|j| if j == l as usize { 1.0 } else { 0.0 } + 0.3 * rng.f32()).collect::<Vec<_>>()
            })
            .collect();
        Dataset::new(vec![4], 3, features, labels).unwrap()
    }

    fn client(config: GldpConfig) -> GldpClient {
        let plain = Device::flex();
        let stream = TaskStream::build(&Identity { dim: 4 }, &[(vec![0, 1, 2], data(30, 1), data(12, 2))], &plain);
        let net = NetSpec { input_dim: 4, hidden: vec![8], num_classes: 3, seed: 5, residual: false };
        GldpClient::new(MethodContext::for_tests(net, stream), config)
    }

    fn broadcast(round: u64, blocks: Vec<ParamBlock>, prototypes: Vec<Prototype>) -> Broadcast {
        let config = RoundConfig { local_epochs: 2, batch_size: 8, learning_rate: 0.05, deadline_ms: 0 };
        Broadcast { round, task: 0, config, blocks, prototypes }
    }

    fn far_prototypes() -> Vec<Prototype> {
        (0..3).map(|c| Prototype::encode(c, 10, &[5.0 * c as f32 - 7.0; 8], Encoding::F32)).collect()
    }

    fn bytes(blocks: &[ParamBlock]) -> Vec<u8> {
        postcard::to_allocvec(blocks).unwrap()
    }

    #[test]
    fn with_the_prototype_losses_off_the_global_prototypes_do_not_move_mu() {
        let trained = |config: GldpConfig, prototypes: Vec<Prototype>| {
            let mut c = client(config);
            let b = broadcast(1, c.initial_blocks().unwrap(), prototypes);
            c.train(&b).unwrap().blocks
        };
        let off = GldpConfig { prototype_losses: false, ..GldpConfig::default() };
        assert_eq!(bytes(&trained(off.clone(), vec![])), bytes(&trained(off, far_prototypes())));
        // On, L_GP pulls the batch means toward the far prototypes: µ learns something else.
        let on = GldpConfig::default();
        assert_ne!(bytes(&trained(on.clone(), vec![])), bytes(&trained(on, far_prototypes())));
    }

    #[test]
    fn a_global_head_travels_up_but_never_replaces_the_devices_own() {
        let plain = client(GldpConfig::default());
        assert!(plain.initial_blocks().unwrap().iter().all(|b| !is_head_block(&b.name)), "ν is personal by default");
        let config = GldpConfig { global_head: true, ..GldpConfig::default() };
        let round_two = |head_value: f32| {
            let mut c = client(config.clone());
            let initial = c.initial_blocks().unwrap();
            assert!(initial.iter().any(|b| is_head_block(&b.name)), "the global model has a head");
            let first = c.train(&broadcast(1, initial, vec![])).unwrap();
            assert!(first.blocks.iter().any(|b| is_head_block(&b.name)), "ν travels up");
            // The next broadcast carries some other global head: the device trains on from its own ν.
            let blocks: Vec<ParamBlock> = first
                .blocks
                .iter()
                .map(|b| match is_head_block(&b.name) {
                    true => {
                        let n = b.tensor.len().unwrap();
                        ParamBlock::encode(b.name.clone(), &b.tensor.shape, &vec![head_value; n], Encoding::F32)
                    }
                    false => b.clone(),
                })
                .collect();
            c.train(&broadcast(2, blocks, first.prototypes)).unwrap().blocks
        };
        assert_eq!(bytes(&round_two(0.0)), bytes(&round_two(3.0)));
    }

    #[test]
    fn the_global_model_predicts_with_its_head_under_head_prediction_and_probes_both() {
        let mut c = client(GldpConfig { prediction: GldpPrediction::Head, ..GldpConfig::default() });
        let mut blocks = c.initial_blocks().unwrap();
        let mut prototypes = vec![];
        for round in 1..=4 {
            let update = c.train(&broadcast(round, blocks, prototypes)).unwrap();
            (blocks, prototypes) = (update.blocks, update.prototypes);
        }
        let test = c.ctx.stream.current(0).unwrap().test.clone();
        let b = broadcast(5, blocks.clone(), prototypes);
        let by_head = c.global_accuracy(&b, &test).unwrap().unwrap();
        let probes = c.global_probes(&b, &test).unwrap();
        assert_eq!(probes.head_accuracy, Some(by_head), "the probe reads the same head");
        assert!(by_head > 0.6, "three separable classes: {by_head}");
        assert!(probes.separability.unwrap() > 0.0);
        // Without a head in the broadcast the global model has nothing to predict with.
        let headless: Vec<ParamBlock> = blocks.into_iter().filter(|b| !is_head_block(&b.name)).collect();
        let b = broadcast(5, headless, vec![]);
        assert_eq!(c.global_accuracy(&b, &test).unwrap(), None);
        assert_eq!(c.global_probes(&b, &test).unwrap().head_accuracy, None);
    }
}
