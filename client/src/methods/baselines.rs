//! The baselines on one [`Net`] (adapter + head on frozen features), trained with cross-entropy
//! on the current task:
//! - **FedAvg** (McMahan et al. 2017, Algorithm 1 ClientUpdate): every block is shared.
//! - **FedProx** (Li et al. 2020, Eq. 2): CE + µ/2·‖w − w^t‖² against the round's global weights.
//! - **FedRep** (Collins et al. 2021, Algorithm 1): the head is personal (never leaves the
//!   device); `personal_epochs` on the head with the body fixed, then `local_epochs` on the body.
//! - **Local-only**: nothing is shared; each client keeps training its own net.

use super::Trained;
use anchorage_shared::method::{MethodConfig, MethodInfo, Prediction, Shared};
use anchorage_shared::protocol::Broadcast;
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::Tensor;

use super::{ClientMethod, MethodContext, Reveal, TrainError, common_metrics};
use anchorage_model::train::{Trainer, accuracy, body_only, head_only, whole};
use anchorage_model::{BlockLayout, FeatureCache, Net, is_head_block};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    FedAvg,
    FedProx { mu: f32 },
    FedRep { personal_epochs: u32 },
    Local,
}

/// FedAvg, FedProx, FedRep or Local-only. What it uploads and keeps follows its registry entry
/// ([`MethodInfo::shared`], `MethodInfo::personal`).
pub struct Baseline {
    kind: Kind,
    info: &'static MethodInfo,
    ctx: MethodContext,
    /// The net kept on the device: FedRep's (head), Local-only's (all of it).
    own: Option<Net>,
    task: u32,
    rng: Rng,
}

/// FedAvg's client half (the baseline every other method is compared with).
pub type FedAvgClient = Baseline;

/// ‖w − w_g‖² over every parameter of the net (FedProx's proximal term).
fn squared_drift(net: &Net, global: &Net) -> Tensor<1> {
    let mut terms = Vec::new();
    let pairs = net.adapter.layers.iter().zip(&global.adapter.layers).chain([(&net.head, &global.head)]);
    for (a, b) in pairs {
        terms.push((a.weight.val() - b.weight.val()).powi_scalar(2).sum());
        if let (Some(x), Some(y)) = (&a.bias, &b.bias) {
            terms.push((x.val() - y.val()).powi_scalar(2).sum());
        }
    }
    Tensor::cat(terms, 0).sum()
}

impl Baseline {
    pub fn new(ctx: MethodContext, config: &MethodConfig) -> Result<Self, TrainError> {
        let kind = match config {
            // FedAvgM's difference is on the server (momentum): its clients train as FedAvg's.
            MethodConfig::FedAvg(_) | MethodConfig::FedAvgM(_) => Kind::FedAvg,
            MethodConfig::FedProx(c) => Kind::FedProx { mu: c.mu },
            MethodConfig::FedRep(c) => Kind::FedRep { personal_epochs: c.personal_epochs },
            MethodConfig::Local(_) => Kind::Local,
            other => return Err(TrainError::UnknownMethod(other.name().into())),
        };
        Ok(Self { kind, info: config.info(), rng: Rng::derive(ctx.seed, 0xBA5E), ctx, own: None, task: 0 })
    }

    /// The blocks of the net's `blocks` the method shares ([`MethodInfo::shared`]).
    fn shared_blocks(&self, mut blocks: Vec<ParamBlock>) -> Vec<ParamBlock> {
        match self.info.shared {
            Shared::Body => blocks.retain(|b| !is_head_block(&b.name)),
            Shared::Nothing => blocks.clear(),
            _ => {}
        }
        blocks
    }

    /// The net a round starts from: the broadcast's blocks over the parts kept on the device.
    fn start(&mut self, broadcast: &Broadcast) -> Result<Net, TrainError> {
        let device = &self.ctx.device;
        let own = self.own.take().unwrap_or_else(|| Net::new(&self.ctx.net, device));
        Ok(match self.kind {
            Kind::Local => own,
            _ => own.load_blocks(&broadcast.blocks, device)?,
        })
    }
}

impl ClientMethod for Baseline {
    fn name(&self) -> &'static str {
        self.info.name
    }

    fn num_samples(&self) -> u64 {
        self.ctx.stream.current_samples(self.task)
    }

    fn train(&mut self, broadcast: &Broadcast) -> Result<Trained, TrainError> {
        self.task = broadcast.task;
        // The current task; under FedEvolve's protocol (every source domain known), all of them
        // pooled into one set, so that every batch mixes domains.
        let train = match self.ctx.stream.reveal {
            Reveal::All => {
                let seen: Vec<FeatureCache> =
                    self.ctx.stream.seen(broadcast.task).iter().map(|t| t.train.clone()).collect();
                FeatureCache::concat(&seen)
            }
            Reveal::ByTask => self.ctx.stream.current(broadcast.task).map(|t| t.train.clone()),
        };
        let train = train.filter(|t| !t.is_empty()).ok_or(TrainError::NoData)?;
        let samples = train.len() as u64;
        let c = &broadcast.config;
        let mut trainer = Trainer::new(self.ctx.optimizer, c.learning_rate as f64, c.batch_size as usize);
        let ce = CrossEntropyLossConfig::new().init(&self.ctx.device);
        let mut model = self.start(broadcast)?;
        let global = model.clone().no_grad();
        let mut loss = f64::NAN;
        if let Kind::FedRep { personal_epochs } = self.kind {
            for _ in 0..personal_epochs {
                (model, loss) = trainer.epoch(model, &train, &mut self.rng, head_only, |m, b| {
                    ce.forward(m.forward(b.x.clone()), b.y.clone())
                });
            }
        }
        let part = if matches!(self.kind, Kind::FedRep { .. }) { body_only } else { whole };
        for _ in 0..c.local_epochs {
            (model, loss) = trainer.epoch(model, &train, &mut self.rng, part, |m, b| {
                let l = ce.forward(m.forward(b.x.clone()), b.y.clone());
                match self.kind {
                    Kind::FedProx { mu } => l + squared_drift(m, &global).mul_scalar(mu / 2.0),
                    _ => l,
                }
            });
        }
        let accuracies = self.ctx.stream.accuracy_metrics(broadcast, |t| accuracy(&model, t, 512));
        let blocks = self.shared_blocks(model.to_blocks(self.ctx.encoding)?);
        // What it does not share stays on the device for the next round (FedRep's head, the
        // local-only net).
        if self.info.shared != Shared::Net {
            self.own = Some(model);
        }
        Ok(Trained {
            prototypes_are: Default::default(),
            num_samples: samples,
            blocks,
            prototypes: Vec::new(),
            metrics: common_metrics(loss, accuracies),
        })
    }

    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
        Ok(self.shared_blocks(Net::new(&self.ctx.net, &self.ctx.device).to_blocks(Encoding::F32)?))
    }

    fn global_accuracy(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Option<f64>, TrainError> {
        if self.info.predicts_with == Prediction::None || broadcast.blocks.is_empty() {
            return Ok(None);
        }
        let model = self.ctx.global_net(broadcast)?;
        Ok(accuracy(&model, test, 1024))
    }

    /// The global head's accuracy (the global accuracy) and the global body's separability.
    fn global_probes(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<super::Probes, TrainError> {
        if self.info.predicts_with == Prediction::None || broadcast.blocks.is_empty() {
            return Ok(super::Probes::default());
        }
        self.ctx.global_net_probes(broadcast, test)
    }
}
