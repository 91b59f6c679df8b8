//! FedTA's input enhancement (IE, §4.1): a pool of M learnable enhancement sets, each with a
//! key. The frozen backbone's feature of the plain input is the query; the N sets whose keys are
//! most similar by cosine enhance the input (Eq. 2). Stage 1 trains the pool and an IE head with
//! L = CE(head(f(x ⊕ IE(q))), y) + λ1 · Σ (1 − cos(q, k_chosen)) (Eq. 3).
//!
//! Keys and sets travel as the blocks `ie.keys` `[M, D]` and `ie.sets` `[M, set_len]`; the IE
//! head stays on the device.

use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};

use super::Enhancer;
use super::keys::{Selection, key_pull};
use crate::blocks::{load_tensor, tensor_block};
use crate::linear::{init_linear, linear_from};
use crate::ops::index_tensor;
use crate::{FeatureCache, ModelError};

/// Block names of the IE pool.
pub use anchorage_shared::method::fedta_blocks::{IE_KEYS as KEYS, IE_SETS as SETS};

/// The IE pool: keys `[M, D]` and sets `[M, set_len]`.
#[derive(Module, Debug)]
pub struct InputEnhancement {
    pub keys: Param<Tensor<2>>,
    pub sets: Param<Tensor<2>>,
}

/// Sizes of an IE pool.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IeShape {
    /// M.
    pub pool: usize,
    /// D, the query (feature) width.
    pub query_dim: usize,
    pub set_len: usize,
    /// N.
    pub top_n: usize,
}

impl IeShape {
    /// The pool a method config asks for on `enhancer` (N is capped at M).
    pub fn for_method(method: &anchorage_shared::method::FedTaConfig, enhancer: &dyn Enhancer) -> Self {
        let pool = (method.ie_pool as usize).max(1);
        Self {
            pool,
            query_dim: enhancer.feature_dim(),
            set_len: enhancer.set_len(),
            top_n: (method.ie_top_n as usize).clamp(1, pool),
        }
    }
}

impl InputEnhancement {
    /// Seeded pool (identical wherever `seed` is): keys uniform in [−1, 1], sets normal with
    /// `init_std` (0: every set starts as the identity).
    pub fn new(shape: &IeShape, init_std: f64, seed: u64, device: &Device) -> Self {
        let mut rng = Rng::derive(seed, 0x1E);
        let keys: Vec<f32> = (0..shape.pool * shape.query_dim).map(|_| (rng.f64() * 2.0 - 1.0) as f32).collect();
        let sets: Vec<f32> = (0..shape.pool * shape.set_len).map(|_| (rng.normal() * init_std) as f32).collect();
        Self {
            keys: Param::from_tensor(Tensor::from_data(TensorData::new(keys, [shape.pool, shape.query_dim]), device)),
            sets: Param::from_tensor(Tensor::from_data(TensorData::new(sets, [shape.pool, shape.set_len]), device)),
        }
    }

    /// The sets each query takes (Eq. 2's top N by key similarity).
    pub fn select(&self, queries: Tensor<2>, top_n: usize) -> Selection {
        Selection::by_cosine(queries, self.keys.val(), top_n)
    }

    /// The chosen sets `[n, N, set_len]`.
    pub fn chosen(&self, selection: &Selection) -> Tensor<3> {
        let sets = self.sets.val();
        let len = sets.dims()[1];
        let device = sets.device();
        let (n, k) = (selection.chosen.len(), selection.per_query());
        sets.select(0, index_tensor(&selection.flat(), &device)).reshape([n, k, len])
    }

    /// Features of raw samples `x` enhanced by the sets their `queries` choose (Eq. 2).
    pub fn enhanced(&self, enhancer: &dyn Enhancer, x: Tensor<2>, queries: Tensor<2>, top_n: usize) -> Tensor<2> {
        let selection = self.select(queries, top_n);
        enhancer.features(x, Some(self.chosen(&selection)))
    }

    /// The blocks `ie.keys`, `ie.sets`.
    pub fn to_blocks(&self, encoding: Encoding) -> Result<Vec<ParamBlock>, ModelError> {
        Ok(vec![tensor_block(KEYS, &self.keys.val(), encoding)?, tensor_block(SETS, &self.sets.val(), encoding)?])
    }

    /// This pool with the given blocks loaded; every block must be `ie.keys` or `ie.sets` and fit.
    pub fn load_blocks(mut self, blocks: &[ParamBlock], device: &Device) -> Result<Self, ModelError> {
        for block in blocks {
            match block.name.as_str() {
                KEYS => load_tensor(&mut self.keys, block, device)?,
                SETS => load_tensor(&mut self.sets, block, device)?,
                _ => return Err(ModelError::UnknownBlock(block.name.clone())),
            }
        }
        Ok(self)
    }
}

/// Stage 1's model: the IE pool and its head.
#[derive(Module, Debug)]
pub struct IeModel {
    pub ie: InputEnhancement,
    pub head: Linear,
}

/// A seeded linear layer `fan_in → fan_out`.
pub fn seeded_linear(fan_in: usize, fan_out: usize, seed: u64, stream: u64, device: &Device) -> Linear {
    let mut rng = Rng::derive(seed, stream);
    let (w, b) = init_linear(&mut rng, fan_in, fan_out);
    linear_from(w, b, fan_in, fan_out, device)
}

impl IeModel {
    /// The IE head: features → classes.
    pub fn new_head(feature_dim: usize, num_classes: usize, seed: u64, device: &Device) -> Linear {
        seeded_linear(feature_dim, num_classes, seed, 0x1EAD, device)
    }

    /// Eq. 3 on one batch: raw samples `x`, their plain features `queries` and labels `y`; the
    /// train `mask` (see the client's `task_mask`) is added to the logits.
    #[expect(clippy::too_many_arguments, reason = "Eq. 3's terms, each a tensor or a coefficient of its own")]
    pub fn loss(
        &self,
        enhancer: &dyn Enhancer,
        x: Tensor<2>,
        queries: Tensor<2>,
        y: Tensor<1, Int>,
        top_n: usize,
        lambda1: f32,
        mask: Option<&Tensor<2>>,
    ) -> Tensor<1> {
        let selection = self.ie.select(queries.clone(), top_n);
        let features = enhancer.features(x, Some(self.ie.chosen(&selection)));
        let ce = CrossEntropyLossConfig::new().init(&features.device());
        let loss = ce.forward(crate::ops::masked(self.head.forward(features), mask), y);
        if lambda1 > 0.0 { loss + key_pull(queries, self.ie.keys.val(), &selection).mul_scalar(lambda1) } else { loss }
    }
}

/// The features of every row of `cache` with its input enhanced by `ie` (no gradient): the
/// cache stage 2 trains on, and what the enhanced model is evaluated on. The queries are the
/// cache's (plain) features; the raw samples must be attached.
pub fn enhanced_cache(
    ie: &InputEnhancement,
    enhancer: &dyn Enhancer,
    cache: &FeatureCache,
    top_n: usize,
    chunk: usize,
) -> Result<FeatureCache, ModelError> {
    let inputs = cache.inputs.as_ref().ok_or(ModelError::NoInputs)?;
    let device = cache.device();
    let ie = ie.valid();
    let n = cache.len();
    if inputs.rows.len() != n {
        return Err(ModelError::NoInputs);
    }
    let mut parts = Vec::new();
    let rows: Vec<usize> = (0..n).collect();
    for chunk in rows.chunks(chunk.max(1)) {
        let x = inputs.batch(chunk, &device);
        let q = cache.slice(chunk[0]..chunk[0] + chunk.len()).inner();
        parts.push(ie.enhanced(enhancer, x, q, top_n).inner());
    }
    let features =
        if parts.is_empty() { Tensor::zeros([0, enhancer.feature_dim()], &device) } else { Tensor::cat(parts, 0) };
    Ok(cache.with_features(features))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_round_trip_and_wrong_shapes_are_refused() {
        let device = Device::flex();
        let shape = IeShape { pool: 3, query_dim: 4, set_len: 5, top_n: 2 };
        let a = InputEnhancement::new(&shape, 0.1, 1, &device);
        let b = InputEnhancement::new(&shape, 0.1, 2, &device);
        let blocks = a.to_blocks(Encoding::F32).unwrap();
        assert_eq!(blocks.iter().map(|b| b.name.as_str()).collect::<Vec<_>>(), vec![KEYS, SETS]);
        let loaded = b.load_blocks(&blocks, &device).unwrap();
        assert_eq!(loaded.to_blocks(Encoding::F32).unwrap(), blocks);
        let other = InputEnhancement::new(&IeShape { pool: 2, ..shape }, 0.1, 1, &device);
        assert!(other.load_blocks(&blocks, &device).is_err());
        let mut named = blocks.clone();
        named[0].name = "head.weight".into();
        assert!(InputEnhancement::new(&shape, 0.1, 1, &device).load_blocks(&named, &device).is_err());
    }
}
