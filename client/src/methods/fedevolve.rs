//! FedEvolve's client half (evolving distribution shifts): two representation maps φ and ψ, both
//! shared (averaged by the server), no classifier.
//!
//! - φ-prototypes of domain m: class means of φ(x), x in domain m (Eq. 3).
//! - ψ learns the shift: ψ(x) for x in domain m+1 is classified by the softmax over negative
//!   distances to the φ-prototypes of domain m (Eq. 4; Euclidean by default, cosine as an option):
//!   L = −log softmax_y(−d(ψ(x), C_m^φ)/T). Both maps get gradients (the prototypes are batch
//!   means of φ over a batch of domain m drawn beside each batch of domain m+1).
//! - The target (next, unseen) domain is predicted by the nearest φ-prototype of the last source
//!   domain to ψ(x). The uploaded prototypes are those of the last source domain, so the server's
//!   model predicts the same way.

use std::time::Instant;

use anchorage_shared::protocol::{Broadcast, Update};
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};

use super::protos::{PrototypeTable, batch_class_means, class_means, from_wire, index_tensor, to_wire};
use super::{ClientMethod, MethodContext, TaskData, TrainError, common_metrics};
use crate::model::blocks::{body_blocks, load_body_block};
use crate::model::{Body, FeatureCache, ModelError};
use crate::train::{Trainer, accuracy_of, whole};

/// φ and ψ.
#[derive(Module, Debug)]
pub struct Maps {
    pub phi: Body,
    pub psi: Body,
}

impl Maps {
    fn new(ctx: &MethodContext, device: &Device) -> Self {
        let mut rng = Rng::derive(ctx.net.seed, 0xE70);
        let phi = Body::new(ctx.net.input_dim, &ctx.net.hidden, &mut rng, device);
        let psi = Body::new(ctx.net.input_dim, &ctx.net.hidden, &mut rng, device);
        Self { phi, psi }
    }

    fn to_blocks(&self, encoding: Encoding) -> Result<Vec<ParamBlock>, ModelError> {
        let mut out = Vec::new();
        body_blocks("phi", &self.phi, encoding, &mut out)?;
        body_blocks("psi", &self.psi, encoding, &mut out)?;
        Ok(out)
    }

    fn load_blocks(mut self, blocks: &[ParamBlock], device: &Device) -> Result<Self, ModelError> {
        for b in blocks {
            if !(load_body_block("phi", &mut self.phi, b, device)? || load_body_block("psi", &mut self.psi, b, device)?)
            {
                return Err(ModelError::UnknownBlock(b.name.clone()));
            }
        }
        Ok(self)
    }
}

/// FedEvolve's client half. See the module docs.
pub struct FedEvolveClient {
    ctx: MethodContext,
    task: u32,
    rng: Rng,
}

impl FedEvolveClient {
    pub fn new(ctx: MethodContext) -> Self {
        Self { rng: Rng::derive(ctx.seed, 0xE701), ctx, task: 0 }
    }
}

/// Nearest-φ-prototype accuracy of ψ(x) on `test`.
fn target_accuracy(
    maps: &Maps,
    prototypes: Option<&PrototypeTable>,
    test: &FeatureCache,
    ctx: &MethodContext,
) -> Option<f64> {
    let table = prototypes?;
    let maps = maps.valid();
    accuracy_of(test, 1024, |x| table.predict(maps.psi.forward(x.inner()), ctx.method.distance))
}

/// A random batch of `size` rows of `data`: features and host labels.
fn draw(data: &TaskData, size: usize, rng: &mut Rng) -> (Tensor<2>, Vec<u32>) {
    let n = data.train.len();
    let rows: Vec<usize> = (0..size).map(|_| rng.below(n as u64) as usize).collect();
    let x = data.train.features.clone().select(0, index_tensor(&rows, &data.train.features.device()));
    (x, rows.iter().map(|&r| data.train.labels_host[r]).collect())
}

impl ClientMethod for FedEvolveClient {
    fn name(&self) -> &'static str {
        "fedevolve"
    }

    fn num_samples(&self) -> u64 {
        self.ctx.stream.seen(self.task).iter().map(|t| t.train.len() as u64).sum()
    }

    fn train(&mut self, broadcast: &Broadcast) -> Result<Update, TrainError> {
        self.task = broadcast.task;
        let domains: Vec<TaskData> =
            self.ctx.stream.seen(broadcast.task).iter().filter(|t| !t.train.is_empty()).cloned().collect();
        let last = domains.last().ok_or(TrainError::NoData)?.clone();
        let started = Instant::now();
        let device = self.ctx.device.clone();
        let mut maps = Maps::new(&self.ctx, &device).load_blocks(&broadcast.blocks, &device)?;
        let c = &broadcast.config;
        let (t, distance) = (self.ctx.method.temperature, self.ctx.method.distance);
        let mut trainer = Trainer::new(self.ctx.optimizer, c.learning_rate as f64, c.batch_size as usize);
        let mut rng = self.rng.clone();
        let mut draw_rng = Rng::derive(self.ctx.seed ^ broadcast.round, 0xD4A);
        let ce = CrossEntropyLossConfig::new().init(&device);
        let mut loss = f64::NAN;
        // Consecutive pairs (m, m+1); a single domain is paired with itself.
        let pairs: Vec<(usize, usize)> =
            if domains.len() == 1 { vec![(0, 0)] } else { (0..domains.len() - 1).map(|m| (m, m + 1)).collect() };
        for _ in 0..c.local_epochs {
            for &(m, next) in &pairs {
                let source = &domains[m];
                (maps, loss) = trainer.epoch(maps, &domains[next].train, &mut rng, whole, |maps, b| {
                    let (xs, ys) = draw(source, b.labels.len().max(8), &mut draw_rng);
                    let (classes, means) = batch_class_means(maps.phi.forward(xs), &ys);
                    let rows: Vec<(usize, usize)> = b
                        .labels
                        .iter()
                        .enumerate()
                        .filter_map(|(i, l)| classes.iter().position(|c| c == l).map(|r| (i, r)))
                        .collect();
                    let dev = b.x.device();
                    let z = maps
                        .psi
                        .forward(b.x.clone())
                        .select(0, index_tensor(&rows.iter().map(|r| r.0).collect::<Vec<_>>(), &dev));
                    let table =
                        PrototypeTable { classes: classes.clone(), counts: vec![1; classes.len()], matrix: means };
                    let y = Tensor::<1, Int>::from_data(
                        TensorData::new(rows.iter().map(|r| r.1 as i64).collect::<Vec<_>>(), [rows.len()]),
                        &dev,
                    );
                    ce.forward(table.logits(z, distance, t), y)
                });
            }
        }
        self.rng = rng;
        let prototypes =
            class_means(maps.valid().phi.forward(last.train.features.clone().inner()), &last.train.labels_host);
        let table = PrototypeTable::new(&prototypes, &device);
        let accuracies = self
            .ctx
            .stream
            .accuracy_metrics(broadcast.task, |test| target_accuracy(&maps, table.as_ref(), test, &self.ctx));
        Ok(Update {
            round: broadcast.round,
            num_samples: domains.iter().map(|d| d.train.len() as u64).sum(),
            blocks: maps.to_blocks(self.ctx.encoding)?,
            prototypes: to_wire(&prototypes, self.ctx.encoding),
            metrics: common_metrics(loss, accuracies),
            compute_seconds: started.elapsed().as_secs_f64(),
        })
    }

    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
        Ok(Maps::new(&self.ctx, &self.ctx.device).to_blocks(Encoding::F32)?)
    }

    fn global_accuracy(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Option<f64>, TrainError> {
        let device = &self.ctx.device;
        let maps = Maps::new(&self.ctx, device).load_blocks(&broadcast.blocks, device)?;
        let table = PrototypeTable::new(&from_wire(&broadcast.prototypes)?, device);
        Ok(target_accuracy(&maps, table.as_ref(), test, &self.ctx))
    }
}
