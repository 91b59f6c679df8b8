//! FedAvg's client half (McMahan et al. 2017, Algorithm 1, ClientUpdate): start from the global
//! blocks, run E local epochs of minibatch training, send the trained blocks and the sample count.

use std::time::Instant;

use anchorage_data::Dataset;
use anchorage_shared::protocol::{Broadcast, Metric, Update};
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::Encoding;
use burn::tensor::Device;

use super::{ClientMethod, TrainError};
use crate::model::{BlockLayout, FeatureCache, FrozenBackbone, ModelSpec, Trainable};
use crate::train::{OptimizerKind, accuracy, fit};

/// FedAvg on a frozen backbone with a trainable adapter and head.
pub struct FedAvgClient {
    spec: ModelSpec,
    device: Device,
    train: FeatureCache,
    test: Option<FeatureCache>,
    optimizer: OptimizerKind,
    encoding: Encoding,
    rng: Rng,
}

impl FedAvgClient {
    /// Builds the feature caches of the local train (and optional local test) data once.
    pub fn new(
        spec: ModelSpec,
        train: &Dataset,
        test: Option<&Dataset>,
        device: Device,
        optimizer: OptimizerKind,
        encoding: Encoding,
        seed: u64,
    ) -> Self {
        let backbone = FrozenBackbone::new(&spec, &device);
        let train = FeatureCache::build(&backbone, train, 512, &device);
        let test = test.map(|t| FeatureCache::build(&backbone, t, 512, &device));
        Self { spec, device, train, test, optimizer, encoding, rng: Rng::new(seed) }
    }
}

impl ClientMethod for FedAvgClient {
    fn name(&self) -> &'static str {
        "fedavg"
    }

    fn num_samples(&self) -> u64 {
        self.train.len() as u64
    }

    fn train(&mut self, broadcast: &Broadcast) -> Result<Update, TrainError> {
        if self.train.is_empty() {
            return Err(TrainError::NoData);
        }
        let started = Instant::now();
        let model = Trainable::new(&self.spec, &self.device).load_blocks(&broadcast.blocks, &self.device)?;
        let c = &broadcast.config;
        let (model, report) = fit(
            model,
            &self.train,
            c.local_epochs,
            c.batch_size as usize,
            c.learning_rate as f64,
            self.optimizer,
            &mut self.rng,
            &self.device,
        );
        let mut metrics = vec![Metric { name: "train_loss".into(), value: report.last_epoch_loss }];
        if let Some(acc) = self.test.as_ref().and_then(|t| accuracy(&model, t, 512)) {
            metrics.push(Metric { name: "local_accuracy".into(), value: acc });
        }
        if let Some(peak) = crate::memory::peak_rss_bytes() {
            metrics.push(Metric { name: "peak_rss_mb".into(), value: peak as f64 / (1 << 20) as f64 });
        }
        metrics.retain(|m| m.value.is_finite());
        Ok(Update {
            round: broadcast.round,
            num_samples: self.train.len() as u64,
            blocks: model.to_blocks(self.encoding)?,
            prototypes: Vec::new(),
            metrics,
            compute_seconds: started.elapsed().as_secs_f64(),
        })
    }
}
