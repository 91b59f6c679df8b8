//! The device's half of differential privacy, for any method: [`Privatized`] wraps a
//! method's client half when `[privacy]` is on (off: no wrapper, the update is the method's own,
//! byte for byte).
//!
//! - Prototypes: the method itself uploads per-class sums of per-sample features clipped to
//!   `prototype_clip`, with their counts, instead of means
//!   ([`crate::methods::protos::PrototypeRelease`], set in its
//!   [`crate::methods::MethodContext`] from the same table: [`DevicePrivacy::prototype_release`]).
//! - The form: every update says its prototypes are sums (`prototypes_are` =
//!   [`PrototypeForm::Sums`]), so that a server whose own `[privacy]` disagrees refuses it
//!   rather than reading sums as means (or means as sums).
//! - `noise = "local"` (an untrusted server; McMahan et al. 2018's Gaussian mechanism applied on
//!   the device, as Flower's `LocalDpMod` does): the delta of the uploaded blocks from the
//!   broadcast ones, all shared blocks together as one vector, is clipped to L2 norm `clip`
//!   ([`clip_in_place`]) and N(0, (σ·clip)²) is added to each of its values; N(0,
//!   (σ·prototype_clip)²) goes on each coordinate of every prototype sum and N(0, σ²) on its
//!   count ([`noisy_count`]); FedTA's `tail.trained` block, a count per anchor, is noised as
//!   counts are. σ is [`DevicePrivacy::noise_multiplier`].
//! - `noise = "central"` (a trusted server): the device clips the prototype features and sends
//!   sums; the server clips the update deltas and adds all the noise.
//!
//! Noise randomness: the simulator seeds each device's generator from the scenario seed and the
//! device's index (a run is reproducible; [`Rng::derive`]); a device in the field
//! (`anchorage-client`) seeds it from the operating system ([`system_rng`]), since noise the
//! server could predict protects nothing.
//!
//! Order with compression ([`crate::compress`]): privatize first, then compress. A top-k of a
//! noised delta, or a zstd frame of it, is post-processing and costs no privacy.

use crate::methods::Trained;
use anchorage_model::FeatureCache;

use anchorage_shared::method::fedta_blocks::TAIL_TRAINED;
use anchorage_shared::privacy::mechanism::{add_gaussian, clip_in_place, noisy_count};
use anchorage_shared::privacy::{NoiseSite, PrivacyConfig};
use anchorage_shared::protocol::{Broadcast, PrototypeForm};
use anchorage_shared::prototype::Prototype;
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{EncodedTensor, Encoding, ParamBlock, TensorError};

use crate::methods::protos::PrototypeRelease;
use crate::methods::{ClientMethod, TrainError};

/// What a device does under `[privacy]` (only built when it is on).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DevicePrivacy {
    /// Who noises: [`NoiseSite::Central`] (the server) or [`NoiseSite::Local`] (this device).
    pub noise: NoiseSite,
    /// C: the L2 bound of the update's delta, all shared blocks together (local noise).
    pub clip: f64,
    /// The L2 bound of one sample's feature before it enters a prototype sum.
    pub prototype_clip: f64,
    /// σ of the device's own noise: set under local noise, `None` under central noise.
    pub noise_multiplier: Option<f64>,
}

impl DevicePrivacy {
    /// A device in the field (`[privacy]` of client.toml): `None` when off. A device does not
    /// know how many rounds the run has, so it cannot turn `target_epsilon` into σ: local noise
    /// needs `noise_multiplier` (the simulator computes it: [`DevicePrivacy::for_simulation`]).
    pub fn for_device(config: &PrivacyConfig) -> anyhow::Result<Option<Self>> {
        config.check()?;
        if config.noise == NoiseSite::Local {
            anyhow::ensure!(
                config.noise_multiplier.is_some(),
                "[privacy] noise = \"local\" on a device needs noise_multiplier (σ): a device does not know the \
                 run's rounds, so it cannot derive σ from target_epsilon; take σ from the server's operator (the \
                 simulator computes it from its rounds)"
            );
        }
        Ok(Self::new(config, config.noise_multiplier))
    }

    /// A simulated device of a method that sends `prototypes` or not: σ is `noise_multiplier`,
    /// or, with only `target_epsilon`, the smallest that keeps it after `rounds` releases of the
    /// device's own at sampling rate 1 (each participation releases the device's whole data):
    /// [`PrivacyConfig::noise_multiplier`], the σ the server's accountant counts.
    pub fn for_simulation(config: &PrivacyConfig, rounds: u64, prototypes: bool) -> anyhow::Result<Option<Self>> {
        config.check()?;
        let sigma = match config.noise {
            NoiseSite::Local => Some(config.noise_multiplier(rounds.max(1), 1.0, prototypes)?),
            _ => None,
        };
        Ok(Self::new(config, sigma))
    }

    fn new(config: &PrivacyConfig, sigma: Option<f64>) -> Option<Self> {
        config.is_on().then(|| Self {
            noise: config.noise,
            clip: config.clip,
            prototype_clip: config.prototype_clip,
            noise_multiplier: if config.noise == NoiseSite::Local { sigma } else { None },
        })
    }

    /// What the wrapped method uploads as prototypes: sums of features clipped to
    /// `prototype_clip`.
    pub fn prototype_release(&self) -> PrototypeRelease {
        PrototypeRelease::ClippedSums { clip: self.prototype_clip }
    }

    /// σ of the device's noise, when it adds any.
    fn local_sigma(&self) -> Option<f64> {
        if self.noise == NoiseSite::Local { self.noise_multiplier } else { None }
    }
}

/// The noise generator of a device in the field, seeded from the operating system
/// (`ring::rand::SystemRandom`: getrandom), so that the server cannot predict the noise it
/// receives. 64 bits seed the xoshiro256** stream; the simulator seeds its devices'
/// generators from the scenario seed instead.
pub fn system_rng() -> anyhow::Result<Rng> {
    use ring::rand::SecureRandom;
    let mut seed = [0u8; 8];
    ring::rand::SystemRandom::new()
        .fill(&mut seed)
        .map_err(|_| anyhow::anyhow!("the operating system gave no random seed for the privacy noise"))?;
    Ok(Rng::new(u64::from_le_bytes(seed)))
}

/// `method` under `privacy`: itself when off (`None`), else wrapped in [`Privatized`] with the
/// noise generator `rng`. Wrap before [`crate::compress::wrap`].
pub fn wrap(method: Box<dyn ClientMethod>, privacy: Option<DevicePrivacy>, rng: Rng) -> Box<dyn ClientMethod> {
    match privacy {
        Some(p) => Box::new(Privatized::new(method, p, rng)),
        None => method,
    }
}

/// A method whose updates say their prototypes are sums and, under local noise, a clipped and
/// noised delta and noised prototype sums and counts. See the module docs.
pub struct Privatized<M> {
    inner: M,
    config: DevicePrivacy,
    rng: Rng,
}

impl<M: ClientMethod> Privatized<M> {
    pub fn new(inner: M, config: DevicePrivacy, rng: Rng) -> Self {
        Self { inner, config, rng }
    }

    /// The update as it leaves the device: noised (local noise) and marked.
    fn privatize(&mut self, broadcast: &Broadcast, mut update: Trained) -> Result<Trained, TensorError> {
        if let Some(sigma) = self.config.local_sigma() {
            self.noise_blocks(broadcast, &mut update.blocks, sigma)?;
            self.noise_prototypes(&mut update.prototypes, sigma)?;
        }
        update.prototypes_are = PrototypeForm::Sums;
        Ok(update)
    }

    /// Δ = trained − broadcast over every uploaded block (one vector; a block the broadcast
    /// lacks counts whole), clipped to `clip`, plus N(0, (σ·clip)²) on each value; the blocks
    /// become broadcast + noised Δ in their own dense layout. Count blocks (`tail.trained`) get
    /// count noise instead.
    fn noise_blocks(
        &mut self,
        broadcast: &Broadcast,
        blocks: &mut [ParamBlock],
        sigma: f64,
    ) -> Result<(), TensorError> {
        let (counts, params): (Vec<&mut ParamBlock>, Vec<&mut ParamBlock>) =
            blocks.iter_mut().partition(|b| b.name == TAIL_TRAINED);
        let mut bases = Vec::with_capacity(params.len());
        let mut deltas = Vec::with_capacity(params.len());
        for block in &params {
            let trained = block.decode()?;
            let base =
                match broadcast.blocks.iter().find(|b| b.name == block.name && b.tensor.shape == block.tensor.shape) {
                    Some(b) => b.decode()?,
                    None => vec![0.0; trained.len()],
                };
            deltas.push(trained.iter().zip(&base).map(|(t, b)| t - b).collect::<Vec<f32>>());
            bases.push(base);
        }
        clip_in_place(&mut deltas, self.config.clip);
        for ((block, base), mut delta) in params.into_iter().zip(bases).zip(deltas) {
            add_gaussian(&mut delta, sigma * self.config.clip, &mut self.rng);
            let values: Vec<f32> = base.iter().zip(&delta).map(|(b, d)| b + d).collect();
            block.tensor = EncodedTensor::encode(&block.tensor.shape, &values, dense(block.tensor.encoding));
        }
        for block in counts {
            let values: Vec<f32> = block
                .decode()?
                .iter()
                .map(|c| noisy_count(c.max(0.0).round() as u64, sigma, &mut self.rng) as f32)
                .collect();
            block.tensor = EncodedTensor::encode(&block.tensor.shape, &values, dense(block.tensor.encoding));
        }
        Ok(())
    }

    /// N(0, (σ·prototype_clip)²) on each coordinate of every sum, N(0, σ²) on its count.
    fn noise_prototypes(&mut self, prototypes: &mut [Prototype], sigma: f64) -> Result<(), TensorError> {
        for p in prototypes {
            let mut sum = p.values()?;
            add_gaussian(&mut sum, sigma * self.config.prototype_clip, &mut self.rng);
            let count = noisy_count(p.count, sigma, &mut self.rng);
            *p = Prototype::encode(p.class, count, &sum, dense(p.vector.encoding));
        }
        Ok(())
    }
}

/// The dense layout of `encoding` (f32 for one that is not dense).
fn dense(encoding: Encoding) -> Encoding {
    encoding.as_dense().map_or(Encoding::F32, Encoding::from)
}

impl<M: ClientMethod> ClientMethod for Privatized<M> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn num_samples(&self) -> u64 {
        self.inner.num_samples()
    }
    /// The inner method's update, privatized (the default `train_measured` times both).
    fn train(&mut self, broadcast: &Broadcast) -> Result<Trained, TrainError> {
        let update = self.inner.train(broadcast)?;
        self.privatize(broadcast, update).map_err(TrainError::Privacy)
    }
    fn global_accuracy(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Option<f64>, TrainError> {
        self.inner.global_accuracy(broadcast, test)
    }
    fn global_probes(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<crate::methods::Probes, TrainError> {
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

#[cfg(test)]
mod tests;
