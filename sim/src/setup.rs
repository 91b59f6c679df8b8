//! What both clocks build from a [`SimConfig`]: the data and its split, each client's method, the
//! engine's configuration, the initial global model and the evaluator.

use std::time::Duration;

use anchorage_client::methods::FedAvgClient;
use anchorage_client::model::{BlockLayout, FeatureCache, FrozenBackbone, ModelSpec, Trainable};
use anchorage_client::train::{OptimizerKind, accuracy};
use anchorage_data::{SyntheticConfig, partition, synthetic};
use anchorage_server::engine::EngineConfig;
use anchorage_shared::protocol::RoundConfig;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use anyhow::Context;
use burn::tensor::Device;

use crate::device::{self, Charge, DeviceProfile, SimulatedDevice};
use crate::run::SimConfig;

/// The federation a run simulates.
pub struct Setup {
    pub spec: ModelSpec,
    pub engine: EngineConfig,
    pub initial: Vec<ParamBlock>,
    /// One client half per client, in client order, on its simulated device.
    pub clients: Vec<SimulatedDevice<FedAvgClient>>,
    /// Each client's device profile.
    pub devices: Vec<DeviceProfile>,
    pub train_len: usize,
    pub test_len: usize,
    pub evaluator: Evaluator,
}

/// The global model on the held-out test set, through the same frozen backbone.
pub struct Evaluator {
    spec: ModelSpec,
    device: Device,
    test: FeatureCache,
}

impl Evaluator {
    pub fn accuracy(&self, blocks: &[ParamBlock]) -> anyhow::Result<f64> {
        let model = Trainable::new(&self.spec, &self.device).load_blocks(blocks, &self.device)?;
        Ok(accuracy(&model, &self.test, 1024).unwrap_or(0.0))
    }
}

/// Client ids as both clocks name them.
pub fn client_id(i: usize) -> String {
    format!("client-{i:03}")
}

impl Setup {
    pub fn new(config: &SimConfig, charge: Charge) -> anyhow::Result<Self> {
        anyhow::ensure!(config.clients >= 1, "need at least one client");
        let encoding = anchorage_client::encoding::parse(&config.encoding)?;
        let device = Device::flex();
        let spec = ModelSpec::embedded_default();
        // Data: procedural images, Dirichlet label skew, a local 80/20 split per client.
        let data = SyntheticConfig {
            num_classes: spec.num_classes as u32,
            side: 16,
            train_per_class: config.train_per_class,
            test_per_class: config.test_per_class,
            noise: config.noise,
            max_shift: 3,
            seed: config.seed,
        };
        let (train, test) = synthetic::generate(&data);
        let min_per_client = (train.len() / config.clients / 4).clamp(1, 20);
        // α = inf (TOML `inf`) is the IID limit of the Dirichlet split.
        let parts = if config.alpha.is_infinite() {
            partition::iid(train.len(), config.clients, config.seed)
        } else {
            partition::dirichlet(
                &train.labels,
                train.num_classes,
                config.clients,
                config.alpha,
                min_per_client,
                config.seed,
            )
            .context("partitioning the synthetic data")?
        };
        let initial = Trainable::new(&spec, &device).to_blocks(Encoding::F32)?;
        let engine = EngineConfig {
            rounds: config.rounds,
            min_available: config.min_available.unwrap_or(config.clients),
            fraction: config.fraction,
            min_fit: 1,
            over_selection: config.over_selection,
            min_updates: 1,
            round_deadline: Duration::from_secs_f64(config.round_deadline_secs),
            round: RoundConfig {
                local_epochs: config.local_epochs,
                batch_size: config.batch_size,
                learning_rate: config.learning_rate,
                deadline_ms: 0,
            },
            seed: config.seed,
            mode: config.aggregation.clone(),
            ..EngineConfig::default()
        };
        let devices = device::assign(&config.devices, config.clients, config.seed);
        let clients = parts
            .iter()
            .enumerate()
            .map(|(i, indices)| {
                let local = train.subset(indices);
                let (local_train, local_test) = local.split_per_class(0.8, config.seed ^ i as u64);
                let seed = config.seed.wrapping_add(i as u64);
                let method = FedAvgClient::new(
                    spec.clone(),
                    &local_train,
                    Some(&local_test),
                    Device::flex().autodiff(),
                    OptimizerKind::Adam,
                    encoding,
                    seed,
                );
                SimulatedDevice::new(method, devices[i].clone(), config.straggler_ratio, charge, seed)
            })
            .collect();
        let backbone = FrozenBackbone::new(&spec, &device);
        let evaluator = Evaluator {
            spec: spec.clone(),
            device: device.clone(),
            test: FeatureCache::build(&backbone, &test, 512, &device),
        };
        Ok(Self { spec, engine, initial, clients, devices, train_len: train.len(), test_len: test.len(), evaluator })
    }
}
