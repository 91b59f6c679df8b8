//! Client halves of the methods: consume a broadcast and the local task stream, produce what
//! they trained ([`Trained`]; the device session turns it into the wire update with
//! [`Trained::into_update`]). They know nothing of transport. Which half a config gets is
//! [`build`]'s match on [`MethodConfig`] (CONTRIBUTING.md, "Add a method").

mod baselines;
mod fedevolve;
mod fedevp;
mod fedprok;
pub mod fedta;
mod gldp;
pub mod protos;
pub mod stream;

use anchorage_shared::MetricKey;
use anchorage_shared::method::MethodConfig;
use anchorage_shared::protocol::{Broadcast, Metric, PrototypeForm, Update};
use anchorage_shared::prototype::Prototype;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use burn::tensor::Device;
use std::time::{Duration, Instant};

pub use baselines::{Baseline, FedAvgClient};
pub use fedevolve::FedEvolveClient;
pub use fedevp::FedEvpClient;
pub use fedprok::FedProKClient;
pub use fedta::FedTaClient;
pub use gldp::GldpClient;
pub use stream::{Reveal, TaskData, TaskStream};

use anchorage_data::Dataset;

use anchorage_model::train::OptimizerKind;
use anchorage_model::{FeatureCache, FrozenBackbone, InputBackbone, ModelSpec, NetSpec};

/// Local training failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Model(#[from] anchorage_model::ModelError),
    #[error("no local training data")]
    NoData,
    #[error("bad prototypes in the broadcast: {0}")]
    Prototypes(#[from] anchorage_shared::tensor::TensorError),
    #[error("unknown method `{0}` (known: {known})", known = anchorage_shared::method::Names)]
    UnknownMethod(String),
    /// The device went down during training (a simulated crash): nothing is uploaded.
    #[error("the device crashed in round {0}")]
    Crashed(u64),
    /// Shrinking the update (top-k, zstd: [`crate::compress`]) failed.
    #[error("compressing the update: {0}")]
    Compress(anchorage_shared::tensor::TensorError),
    /// Clipping or noising the update (`[privacy]`: [`crate::privacy`]) failed.
    #[error("privatizing the update: {0}")]
    Privacy(anchorage_shared::tensor::TensorError),
}

/// Probes of the global model's representation µ(x) on test data, apart from the method's
/// prediction rule: do a method's losses shape the representation itself?
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Probes {
    /// Top-1 accuracy of the global classifier head on µ(x) (none: the global model has no head).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_accuracy: Option<f64>,
    /// Fisher's tr(S_B) / tr(S_W) of µ(x) ([`anchorage_model::separability`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub separability: Option<f64>,
}

impl Probes {
    /// Nothing was probed.
    pub fn is_empty(&self) -> bool {
        self.head_accuracy.is_none() && self.separability.is_none()
    }

    /// The mean of each probe over the probes that have it (the tasks a round evaluates).
    pub fn mean(all: &[Probes]) -> Probes {
        let mean = |f: fn(&Probes) -> Option<f64>| {
            let values: Vec<f64> = all.iter().filter_map(f).collect();
            (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
        };
        Probes { head_accuracy: mean(|p| p.head_accuracy), separability: mean(|p| p.separability) }
    }
}

/// What a method's training of one round produced: the update's content, before the round and
/// the device's compute time are stamped into the wire [`Update`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trained {
    /// Samples trained on (the FedAvg weight).
    pub num_samples: u64,
    pub blocks: Vec<ParamBlock>,
    pub prototypes: Vec<Prototype>,
    /// Whether `prototypes` are means or sums (a device under `[privacy]` sends sums).
    pub prototypes_are: PrototypeForm,
    pub metrics: Vec<Metric>,
}

impl Trained {
    /// The wire update of `round`, computed for `compute`: the one place a method's result
    /// becomes an [`Update`].
    pub fn into_update(self, round: u64, compute: Duration) -> Update {
        let Trained { num_samples, blocks, prototypes, prototypes_are, metrics } = self;
        Update {
            round,
            num_samples,
            blocks,
            prototypes,
            prototypes_are,
            metrics,
            compute_seconds: compute.as_secs_f64(),
        }
    }
}

/// The client half of a federated method (Flower's `Client::fit`, plus the evaluation of the
/// global model the way the method predicts).
pub trait ClientMethod: Send {
    /// Name announced in the hello; must match the server's method.
    fn name(&self) -> &'static str;
    /// Training samples held now.
    fn num_samples(&self) -> u64;
    /// Trains from the broadcast's global state and returns what it trained for the round. A
    /// method does not time itself.
    fn train(&mut self, broadcast: &Broadcast) -> Result<Trained, TrainError>;
    /// [`ClientMethod::train`] and how long the device computed it. By default the wall time of
    /// `train`; a device model (the simulator's `SimulatedDevice`) charges its own time instead.
    fn train_measured(&mut self, broadcast: &Broadcast) -> Result<(Trained, Duration), TrainError> {
        let started = Instant::now();
        let trained = self.train(broadcast)?;
        Ok((trained, started.elapsed()))
    }
    /// Accuracy of the global model `broadcast` describes on `test` (`None`: the method has no
    /// global predictor, e.g. Local-only or FedRep's personal heads).
    fn global_accuracy(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Option<f64>, TrainError>;
    /// What the global model's representation is worth apart from the method's prediction rule
    /// ([`Probes`]); by default nothing is probed.
    fn global_probes(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Probes, TrainError> {
        let _ = (broadcast, test);
        Ok(Probes::default())
    }
    /// The shared blocks of the seeded initial model: the server's first broadcast.
    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError>;
    /// What the method keeps on the device between rounds and never uploads (FedTA's anchors and
    /// heads), as named blocks: the client's store saves it after every round, so a restarted
    /// device goes on from it. Default: nothing.
    fn device_state(&self) -> Result<Vec<ParamBlock>, TrainError> {
        Ok(Vec::new())
    }
    /// Restores what [`ClientMethod::device_state`] returned before a restart; blocks it cannot
    /// place, or of another shape, are an error and change nothing.
    fn restore_device_state(&mut self, blocks: &[ParamBlock]) -> Result<(), TrainError> {
        let _ = blocks;
        Ok(())
    }
}

impl<M: ClientMethod + ?Sized> ClientMethod for Box<M> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn num_samples(&self) -> u64 {
        (**self).num_samples()
    }
    fn train(&mut self, broadcast: &Broadcast) -> Result<Trained, TrainError> {
        (**self).train(broadcast)
    }
    fn train_measured(&mut self, broadcast: &Broadcast) -> Result<(Trained, Duration), TrainError> {
        (**self).train_measured(broadcast)
    }
    fn global_accuracy(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Option<f64>, TrainError> {
        (**self).global_accuracy(broadcast, test)
    }
    fn global_probes(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Probes, TrainError> {
        (**self).global_probes(broadcast, test)
    }
    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
        (**self).initial_blocks()
    }
    fn device_state(&self) -> Result<Vec<ParamBlock>, TrainError> {
        (**self).device_state()
    }
    fn restore_device_state(&mut self, blocks: &[ParamBlock]) -> Result<(), TrainError> {
        (**self).restore_device_state(blocks)
    }
}

/// What every client half is built from.
#[derive(Debug, Clone)]
pub struct MethodContext {
    /// The trainable net on the frozen features.
    pub net: NetSpec,
    pub stream: TaskStream,
    /// The training device (autodiff).
    pub device: Device,
    pub optimizer: OptimizerKind,
    pub encoding: Encoding,
    pub seed: u64,
    /// The frozen backbone on raw samples, for methods that enhance its input (FedTA); the task
    /// stream's caches then carry their raw samples ([`FeatureCache::inputs`]).
    pub backbone: Option<InputBackbone>,
    /// What the method uploads as prototypes: class means, or under `[privacy]` per-class sums
    /// of clipped features ([`protos::PrototypeRelease::of`]).
    pub prototype_release: protos::PrototypeRelease,
}

impl MethodContext {
    /// The embedded default: the random-feature backbone of [`ModelSpec::embedded_default`] and
    /// one task holding the client's `train` and local `test` data.
    pub fn embedded(
        train: &Dataset,
        test: &Dataset,
        device: Device,
        optimizer: OptimizerKind,
        encoding: Encoding,
        seed: u64,
    ) -> Self {
        let spec = ModelSpec::embedded_default();
        let backbone = std::sync::Arc::new(FrozenBackbone::new(&spec, &device.clone().inner()));
        let stream = TaskStream::single(backbone.as_ref(), train, test, &device);
        let backbone = Some(InputBackbone { net: backbone, sample_shape: train.sample_shape.clone() });
        Self {
            net: spec.net(),
            stream,
            device,
            optimizer,
            encoding,
            seed,
            backbone,
            prototype_release: protos::PrototypeRelease::Means,
        }
    }
}

#[cfg(test)]
impl MethodContext {
    /// A context for the methods' unit tests: `net` on the features of `stream` (the identity
    /// backbone's), Adam, f32 blocks, seed 3, on the CPU with autodiff.
    pub(crate) fn for_tests(net: NetSpec, stream: TaskStream) -> Self {
        Self {
            net,
            stream,
            device: Device::flex().autodiff(),
            optimizer: OptimizerKind::Adam,
            encoding: Encoding::F32,
            seed: 3,
            backbone: None,
            prototype_release: protos::PrototypeRelease::Means,
        }
    }
}

impl MethodContext {
    /// Every block of the seeded net: the initial model of a method that shares the whole net.
    pub fn initial_net_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
        use anchorage_model::BlockLayout;
        Ok(anchorage_model::Net::new(&self.net, &self.device).to_blocks(Encoding::F32)?)
    }

    /// Accuracy of the global net's head on `test` (the methods that predict with it).
    pub fn global_net_accuracy(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Option<f64>, TrainError> {
        Ok(anchorage_model::train::accuracy(&self.global_net(broadcast)?, test, 1024))
    }

    /// The probes of the global net: its head's accuracy (when the broadcast carries a head)
    /// and the separability of its representation.
    pub fn global_net_probes(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Probes, TrainError> {
        use burn::module::Module;
        let net = self.global_net(broadcast)?;
        let valid = net.valid();
        let has_head = broadcast.blocks.iter().any(|b| anchorage_model::is_head_block(&b.name));
        Ok(Probes {
            head_accuracy: has_head.then(|| anchorage_model::train::accuracy(&net, test, 1024)).flatten(),
            separability: anchorage_model::separability::fisher_ratio(test, 1024, |x| valid.represent(x)),
        })
    }

    /// The seeded net with the broadcast's (shared) blocks loaded: the global model.
    pub fn global_net(&self, broadcast: &Broadcast) -> Result<anchorage_model::Net, TrainError> {
        use anchorage_model::BlockLayout;
        Ok(anchorage_model::Net::new(&self.net, &self.device).load_blocks(&broadcast.blocks, &self.device)?)
    }
}

/// A method whose rounds never train on batches larger than `max` (a memory plan's bound); a
/// broadcast asking for more is trained with `max`.
pub struct BatchCap<M> {
    pub inner: M,
    pub max: u32,
}

impl<M: ClientMethod> ClientMethod for BatchCap<M> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn num_samples(&self) -> u64 {
        self.inner.num_samples()
    }
    fn train(&mut self, broadcast: &Broadcast) -> Result<Trained, TrainError> {
        let max = self.max.max(1);
        if broadcast.config.batch_size <= max {
            return self.inner.train(broadcast);
        }
        tracing::debug!(asked = broadcast.config.batch_size, max, "batch size capped by the memory plan");
        let mut capped = broadcast.clone();
        capped.config.batch_size = max;
        self.inner.train(&capped)
    }
    fn global_accuracy(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Option<f64>, TrainError> {
        self.inner.global_accuracy(broadcast, test)
    }
    fn global_probes(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Probes, TrainError> {
        self.inner.global_probes(broadcast, test)
    }
    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
        self.inner.initial_blocks()
    }
    fn device_state(&self) -> Result<Vec<ParamBlock>, TrainError> {
        self.inner.device_state()
    }
    fn restore_device_state(&mut self, blocks: &[ParamBlock]) -> Result<(), TrainError> {
        self.inner.restore_device_state(blocks)
    }
}

/// The client half of `method`, on `context`.
pub fn build(method: &MethodConfig, context: MethodContext) -> Result<Box<dyn ClientMethod>, TrainError> {
    Ok(match method {
        MethodConfig::FedAvg(_)
        | MethodConfig::FedAvgM(_)
        | MethodConfig::FedProx(_)
        | MethodConfig::FedRep(_)
        | MethodConfig::Local(_) => Box::new(Baseline::new(context, method)?),
        MethodConfig::Gldp(c) => Box::new(GldpClient::new(context, c.clone())),
        MethodConfig::FedProK(c) => Box::new(FedProKClient::new(context, c.clone())),
        MethodConfig::FedEvolve(c) => Box::new(FedEvolveClient::new(context, c.clone())),
        MethodConfig::FedEvp(c) => Box::new(FedEvpClient::new(context, c.clone())),
        MethodConfig::FedTa(c) => Box::new(FedTaClient::new(context, c.clone())?),
    })
}

/// Metrics every update carries besides the method's own: the train loss, the local model's
/// accuracies and the process's peak memory. Non-finite values are dropped.
pub(crate) fn common_metrics(train_loss: f64, mut accuracies: Vec<Metric>) -> Vec<Metric> {
    let mut metrics = vec![Metric::new(MetricKey::TrainLoss, train_loss)];
    // `local_accuracy`: the mean over the seen tasks (or the target), for the round table.
    if !accuracies.is_empty() {
        let mean = accuracies.iter().map(|m| m.value).sum::<f64>() / accuracies.len() as f64;
        metrics.push(Metric::new(MetricKey::LocalAccuracy, mean));
    }
    metrics.append(&mut accuracies);
    if let Some(peak) = crate::memory::peak_rss_bytes() {
        metrics.push(Metric::new(MetricKey::PeakRssMb, peak as f64 / (1 << 20) as f64));
    }
    metrics.retain(|m| m.value.is_finite());
    metrics
}

#[cfg(test)]
mod tests {
    use anchorage_shared::protocol::RoundConfig;

    use super::*;

    /// Records the batch size each round trained with.
    struct Probe(Vec<u32>);

    impl ClientMethod for Probe {
        fn name(&self) -> &'static str {
            "probe"
        }
        fn num_samples(&self) -> u64 {
            1
        }
        fn train(&mut self, broadcast: &Broadcast) -> Result<Trained, TrainError> {
            self.0.push(broadcast.config.batch_size);
            Err(TrainError::NoData)
        }
        fn global_accuracy(&self, _: &Broadcast, _: &FeatureCache) -> Result<Option<f64>, TrainError> {
            Ok(None)
        }
        fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
            Ok(Vec::new())
        }
    }

    #[test]
    fn batch_cap_bounds_the_servers_batch() {
        let mut capped = BatchCap { inner: Probe(Vec::new()), max: 16 };
        for asked in [64, 16, 8] {
            let config = RoundConfig { local_epochs: 1, batch_size: asked, learning_rate: 0.1, deadline_ms: 0 };
            let broadcast = Broadcast { round: 1, task: 0, config, blocks: Vec::new(), prototypes: Vec::new() };
            assert!(capped.train(&broadcast).is_err());
        }
        assert_eq!(capped.inner.0, [16, 16, 8]);
    }
}
