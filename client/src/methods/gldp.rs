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
//! λ = 1 and λ = 0 are the paper's ablations (local relation only, global alignment only).

use anchorage_shared::math::moving_average;
use anchorage_shared::method::{Distance, PrototypeSource};
use anchorage_shared::protocol::{Broadcast, Update};
use anchorage_shared::prototype_rules::ClassMean;
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::activation::{log_softmax, softmax};
use burn::tensor::{Device, Tensor};

use super::protos::{PrototypeTable, batch_class_means, from_wire, means_and_upload};
use super::{ClientMethod, MethodContext, TrainError, common_metrics};
use anchorage_model::ops::{index_tensor, squared_distances};
use anchorage_model::train::{Batch, Trainer, accuracy_of, body_only, head_only};
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

    fn train(&mut self, broadcast: &Broadcast) -> Result<Update, TrainError> {
        self.task = broadcast.task;
        let data = self.ctx.stream.training(broadcast.task)?;
        let train = data.train.clone();
        let device = self.ctx.device.clone();
        let global_means = from_wire(&broadcast.prototypes)?;
        let global = table(&global_means, &device);
        let local = table(&self.local, &device);
        let c = &broadcast.config;
        let own = self.own.take().unwrap_or_else(|| Net::new(&self.ctx.net, &device));
        let mut net = own.load_blocks(&broadcast.blocks, &device)?;
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
            PrototypeSource::Local => table(&self.local, &device),
            PrototypeSource::Global => {
                table(&crate::methods::protos::merge_missing(&global_means, &self.local), &device)
            }
        };
        let accuracies =
            self.ctx.stream.accuracy_metrics(broadcast, |t| prototype_accuracy(&net, predict_with.as_ref(), t));
        let mut blocks = net.to_blocks(self.ctx.encoding)?;
        blocks.retain(|b| !is_head_block(&b.name));
        self.own = Some(net);
        Ok(Update {
            round: broadcast.round,
            num_samples: train.len() as u64,
            blocks,
            prototypes,
            metrics: common_metrics(loss, accuracies),
            // The caller times `train` (`ClientMethod::train_timed`); the session stamps it.
            compute_seconds: 0.0,
        })
    }

    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
        let mut blocks = Net::new(&self.ctx.net, &self.ctx.device).to_blocks(Encoding::F32)?;
        blocks.retain(|b| !is_head_block(&b.name));
        Ok(blocks)
    }

    /// GLDP-GP on the server's side: the global µ and the global prototypes (Eq. 13).
    fn global_accuracy(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Option<f64>, TrainError> {
        let device = &self.ctx.device;
        let net = self.ctx.global_net(broadcast)?;
        let global = table(&from_wire(&broadcast.prototypes)?, device);
        Ok(prototype_accuracy(&net, global.as_ref(), test))
    }
}
