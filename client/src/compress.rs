//! Smaller updates, for any method: [`Compressed`] wraps a method's client half and
//! turns each uploaded block into
//!
//! - a top-k delta with error feedback (`top_k = F`): the ⌈F·n⌉ entries of largest magnitude of
//!   Δ = (trained − broadcast) + e, and the device keeps e' = Δ − C(Δ) for its next round
//!   (Stich, Cordonnier, Jaggi 2018, "Sparsified SGD with Memory", Algorithm 1:
//!   m_{t+1} = m_t + η g_t − comp_k(m_t + η g_t); Lin et al. 2018, "Deep Gradient Compression",
//!   local gradient accumulation). C(Δ) is what the server will decode, so the values' rounding
//!   (f16, int8) is fed back too. The residual e is part of the device state
//!   ([`ClientMethod::device_state`]), which the client's store saves after every round: it
//!   survives a restart.
//! - a zstd frame over the encoded bytes (`compress = "zstd"`; why zstd:
//!   [`anchorage_shared::compress`]), kept only where it is smaller.
//!
//! Both are off by default; the server decodes either to dense values when the update arrives.

use std::collections::BTreeMap;

use anchorage_model::FeatureCache;
use anchorage_shared::protocol::Broadcast;
use anchorage_shared::tensor::{Dense, EncodedTensor, Encoding, MAX_NAME_LEN, ParamBlock, TensorError};
use anchorage_shared::{compress, sparse};
use serde::{Deserialize, Serialize};

use crate::methods::{ClientMethod, TrainError, Trained};

/// A general-purpose compressor over the encoded blocks (`compress` of client.toml and of a
/// simulation, `--compress`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Compressor {
    Zstd,
}

impl Compressor {
    /// The name configs use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Zstd => "zstd",
        }
    }
}

impl std::fmt::Display for Compressor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How a device shrinks its updates: off unless `top_k` or `compress` is set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct UpdateCompression {
    /// Fraction of each block's entries a top-k delta sends, in (0, 1].
    pub top_k: Option<f64>,
    pub compress: Option<Compressor>,
    /// The layout of the values a top-k delta sends (the configured `encoding`).
    pub values: Dense,
}

impl UpdateCompression {
    /// From the config's keys; `encoding` is the upload encoding.
    pub fn new(top_k: Option<f64>, compress: Option<Compressor>, encoding: Encoding) -> anyhow::Result<Self> {
        if let Some(f) = top_k {
            anyhow::ensure!(f > 0.0 && f <= 1.0, "top_k = {f}: the fraction of each block sent must be in (0, 1]");
        }
        Ok(Self { top_k, compress, values: encoding.as_dense().unwrap_or(Dense::F32) })
    }

    /// Whether it changes nothing.
    pub fn is_off(&self) -> bool {
        self.top_k.is_none() && self.compress.is_none()
    }

    /// The encoding the wrapped method should upload with: f32 under top-k (the delta is taken
    /// from exact values and `values` encodes what is sent), the configured one otherwise.
    pub fn method_encoding(&self, configured: Encoding) -> Encoding {
        if self.top_k.is_some() { Encoding::F32 } else { configured }
    }
}

/// Device-state blocks holding the error-feedback residual: this prefix and the block's name.
pub const RESIDUAL_PREFIX: &str = "ef/";

/// A method whose uploads are top-k deltas with error feedback and/or zstd frames.
pub struct Compressed<M> {
    inner: M,
    config: UpdateCompression,
    /// e of each block (shape, values): what earlier rounds selected out and did not send.
    residual: BTreeMap<String, (Vec<u32>, Vec<f32>)>,
}

impl<M: ClientMethod> Compressed<M> {
    pub fn new(inner: M, config: UpdateCompression) -> Self {
        Self { inner, config, residual: BTreeMap::new() }
    }

    /// The residual kept for block `name`, if any.
    pub fn residual(&self, name: &str) -> Option<&[f32]> {
        self.residual.get(name).map(|(_, v)| v.as_slice())
    }

    /// The update as it is uploaded: each block a top-k delta against the broadcast's block of
    /// the same name and shape (others stay dense), then zstd where it is smaller.
    fn shrink(&mut self, broadcast: &Broadcast, mut update: Trained) -> Result<Trained, TrainError> {
        for block in &mut update.blocks {
            if let Some(fraction) = self.config.top_k {
                let base =
                    broadcast.blocks.iter().find(|b| b.name == block.name && b.tensor.shape == block.tensor.shape);
                if let Some(base) = base {
                    block.tensor = self.sparsify(block, base, fraction).map_err(TrainError::Compress)?;
                }
            }
            if self.config.compress.is_some()
                && let Some(packed) = compress::pack(&block.tensor)
            {
                block.tensor = packed;
            }
        }
        Ok(update)
    }

    /// Δ = trained − base + e; sends C(Δ) (top-k, or every entry where a top-k layout would not
    /// be smaller) and keeps e' = Δ − C(Δ).
    fn sparsify(&mut self, block: &ParamBlock, base: &ParamBlock, fraction: f64) -> Result<EncodedTensor, TensorError> {
        let (trained, base_values) = (block.decode()?, base.decode()?);
        let shape = &block.tensor.shape;
        let n = trained.len();
        let kept = self.residual.remove(&block.name).filter(|(s, e)| s == shape && e.len() == n);
        let mut delta: Vec<f32> = trained.iter().zip(&base_values).map(|(t, b)| t - b).collect();
        if let Some((_, e)) = &kept {
            delta.iter_mut().zip(e).for_each(|(d, e)| *d += e);
        }
        let values = self.config.values;
        let k = sparse::k_of(fraction, n);
        let bytes = Encoding::from(values).bytes_per_value();
        let tensor = if k * (4 + bytes) < n * bytes {
            sparse::encode(shape, &delta, &sparse::top_k(&delta, k), values)
        } else {
            let whole: Vec<f32> = base_values.iter().zip(&delta).map(|(b, d)| b + d).collect();
            EncodedTensor::encode(shape, &whole, values.into())
        };
        let sent = tensor.decode_against(&base_values)?;
        for ((d, s), b) in delta.iter_mut().zip(&sent).zip(&base_values) {
            *d -= s - b;
        }
        self.residual.insert(block.name.clone(), (shape.clone(), delta));
        Ok(tensor)
    }
}

impl<M: ClientMethod> ClientMethod for Compressed<M> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn num_samples(&self) -> u64 {
        self.inner.num_samples()
    }
    /// The inner method's update, shrunk (the default `train_measured` times both).
    fn train(&mut self, broadcast: &Broadcast) -> Result<Trained, TrainError> {
        let update = self.inner.train(broadcast)?;
        if self.config.is_off() { Ok(update) } else { self.shrink(broadcast, update) }
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
    /// The inner method's state and one `ef/<block>` block per residual (a block whose name
    /// would grow past the limit keeps its residual in memory only).
    fn device_state(&self) -> Result<Vec<ParamBlock>, TrainError> {
        let mut blocks = self.inner.device_state()?;
        for (name, (shape, e)) in &self.residual {
            if RESIDUAL_PREFIX.len() + name.len() <= MAX_NAME_LEN {
                blocks.push(ParamBlock::encode(format!("{RESIDUAL_PREFIX}{name}"), shape, e, Encoding::F32));
            }
        }
        Ok(blocks)
    }
    /// Takes the `ef/` blocks back as residuals (dropped when top-k is off now) and hands the
    /// rest to the inner method.
    fn restore_device_state(&mut self, blocks: &[ParamBlock]) -> Result<(), TrainError> {
        let (residual, own): (Vec<&ParamBlock>, Vec<&ParamBlock>) =
            blocks.iter().partition(|b| b.name.starts_with(RESIDUAL_PREFIX));
        let mut restored = BTreeMap::new();
        for b in &residual {
            let values = b.decode().map_err(TrainError::Compress)?;
            restored.insert(b.name[RESIDUAL_PREFIX.len()..].to_string(), (b.tensor.shape.clone(), values));
        }
        let own: Vec<ParamBlock> = own.into_iter().cloned().collect();
        self.inner.restore_device_state(&own)?;
        if self.config.top_k.is_none() && !restored.is_empty() {
            tracing::info!(blocks = restored.len(), "top-k is off: the saved error-feedback residual is dropped");
            restored.clear();
        }
        self.residual = restored;
        Ok(())
    }
}

/// `method` under `config` (a wrapper even when off: it still drops a saved residual the
/// inner method would not know).
pub fn wrap(method: Box<dyn ClientMethod>, config: UpdateCompression) -> Box<dyn ClientMethod> {
    Box::new(Compressed::new(method, config))
}

#[cfg(test)]
mod tests;
