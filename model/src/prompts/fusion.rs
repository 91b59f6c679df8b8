//! Selective Input Knowledge Fusion on burn (FedTA Eq. 8), for whoever holds the frozen backbone
//! and the server's surrogate set (the simulator hands it to the server half as its distiller).
//!
//! IE_i ← argmin over the sets of IE_i of (1/|J|) Σ_{j ≠ i} MSE(f(x ⊕ IE_i(q)), f(x ⊕ IE_j(q)))
//! over the surrogate samples x with plain features q, minimised by Adam for E epochs. Each IE
//! chooses its own sets by its own keys; the student's keys (and so its choices) stay fixed, only
//! its sets learn. The teachers' enhanced features are computed once.

use std::sync::Arc;

use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Gradients, Tensor};

use super::Enhancer;
use super::pool::{IeShape, InputEnhancement, enhanced_cache};
use crate::ops::index_tensor;
use crate::train::{OptimizerKind, Trainer};
use crate::{FeatureCache, ModelError};

/// Only the sets of an IE pool (its keys stay).
fn sets_only(grads: &mut Gradients, ie: &InputEnhancement) -> GradientsParams {
    GradientsParams::from_params(grads, ie, &[ie.sets.id])
}

/// The distiller. See the module docs.
pub struct Sikf {
    enhancer: Arc<dyn Enhancer>,
    /// Plain features of the surrogate samples (the queries), with the samples attached.
    surrogate: FeatureCache,
    shape: IeShape,
    batch_size: usize,
    /// The training device (autodiff).
    device: Device,
    seed: u64,
}

impl Sikf {
    /// A distiller on `surrogate` (its raw samples must be attached).
    pub fn new(
        enhancer: Arc<dyn Enhancer>,
        surrogate: FeatureCache,
        shape: IeShape,
        batch_size: usize,
        device: Device,
        seed: u64,
    ) -> Result<Self, ModelError> {
        if surrogate.inputs.is_none() || surrogate.is_empty() {
            return Err(ModelError::NoInputs);
        }
        Ok(Self { enhancer, surrogate, shape, batch_size: batch_size.max(1), device, seed })
    }

    /// The distiller FedTA's clients match: the same enhancement and pool as
    /// `FedTaClient` builds from `method` on `backbone`.
    pub fn for_method(
        method: &anchorage_shared::method::FedTaConfig,
        backbone: &crate::InputBackbone,
        surrogate: FeatureCache,
        batch_size: usize,
        device: Device,
        seed: u64,
    ) -> Result<Self, ModelError> {
        let enhancer = super::enhancer_for(method, backbone);
        let shape = IeShape::for_method(method, enhancer.as_ref());
        Self::new(enhancer, surrogate, shape, batch_size, device, seed)
    }

    /// Surrogate samples.
    pub fn len(&self) -> usize {
        self.surrogate.len()
    }

    pub fn is_empty(&self) -> bool {
        self.surrogate.is_empty()
    }

    fn pool(&self, blocks: &[ParamBlock], device: &Device) -> Result<InputEnhancement, ModelError> {
        InputEnhancement::new(&self.shape, 0.0, 0, device).load_blocks(blocks, device)
    }

    /// Each teacher's enhanced features of the whole surrogate set.
    fn targets(&self, teachers: &[&[ParamBlock]]) -> Result<Vec<Tensor<2>>, ModelError> {
        let plain = self.surrogate.device();
        teachers
            .iter()
            .map(|t| {
                let ie = self.pool(t, &plain)?;
                Ok(enhanced_cache(&ie, self.enhancer.as_ref(), &self.surrogate, self.shape.top_n, 256)?.features())
            })
            .collect()
    }

    /// Eq. 8's objective for `student` over the whole surrogate set (no gradient).
    pub fn loss(&self, student: &[ParamBlock], teachers: &[&[ParamBlock]]) -> Result<f64, ModelError> {
        let plain = self.surrogate.device();
        let targets = self.targets(teachers)?;
        let ie = self.pool(student, &plain)?;
        let mine = enhanced_cache(&ie, self.enhancer.as_ref(), &self.surrogate, self.shape.top_n, 256)?.features();
        Ok(mean_mse(mine, &targets).into_scalar::<f32>() as f64)
    }

    /// Eq. 8: the student's blocks after `epochs` epochs of Adam, and each epoch's mean loss.
    pub fn distill(
        &self,
        student: &[ParamBlock],
        teachers: &[&[ParamBlock]],
        epochs: u32,
        learning_rate: f64,
    ) -> Result<(Vec<ParamBlock>, Vec<f64>), ModelError> {
        if teachers.is_empty() {
            return Ok((student.to_vec(), Vec::new()));
        }
        let targets = self.targets(teachers)?;
        let inputs = self.surrogate.inputs.as_ref().ok_or(ModelError::NoInputs)?;
        let mut ie = self.pool(student, &self.device)?;
        let mut trainer = Trainer::new(OptimizerKind::Adam, learning_rate, self.batch_size);
        let mut rng = Rng::derive(self.seed, 0x51CF);
        let mut losses = Vec::with_capacity(epochs as usize);
        let plain = self.surrogate.device();
        for _ in 0..epochs {
            let (next, loss) = trainer.epoch(ie, &self.surrogate, &mut rng, sets_only, |m, b| {
                let x = inputs.batch(&b.rows, &plain);
                let mine = m.enhanced(self.enhancer.as_ref(), x, b.x.clone(), self.shape.top_n);
                let rows = index_tensor(&b.rows, &plain);
                let theirs: Vec<Tensor<2>> = targets.iter().map(|t| t.clone().select(0, rows.clone())).collect();
                mean_mse(mine, &theirs)
            });
            ie = next;
            losses.push(loss);
        }
        Ok((ie.valid().to_blocks(Encoding::F32)?, losses))
    }
}

/// (1/|J|) Σ_j MSE(mine, theirs_j).
fn mean_mse(mine: Tensor<2>, theirs: &[Tensor<2>]) -> Tensor<1> {
    let k = theirs.len().max(1) as f32;
    let mut total: Option<Tensor<1>> = None;
    for t in theirs {
        let mse = (mine.clone() - t.clone()).powi_scalar(2).mean();
        total = Some(match total {
            Some(s) => s + mse,
            None => mse,
        });
    }
    total.unwrap_or_else(|| Tensor::zeros([1], &mine.device())).div_scalar(k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompts::PixelPrompts;
    use crate::{FrozenBackbone, Inputs, ModelSpec};
    use anchorage_data::Dataset;

    #[test]
    fn sikf_lowers_its_own_loss_on_a_fixed_surrogate_batch() {
        let plain = Device::flex();
        let spec = ModelSpec { input_dim: 3 * 8 * 8, feature_dim: 32, ..ModelSpec::embedded_default() };
        let backbone = Arc::new(FrozenBackbone::new(&spec, &plain));
        let mut rng = Rng::new(4);
        let n = 24;
        let pixels: Vec<f32> = (0..n * 192).map(|_| rng.f32()).collect();
        let data = Arc::new(Dataset::new(vec![3, 8, 8], 2, pixels, (0..n as u32).map(|i| i % 2).collect()).unwrap());
        let surrogate = FeatureCache::build(backbone.as_ref(), &data, 64, &plain).with_inputs(Inputs::all(data));
        let enhancer: Arc<dyn Enhancer> = Arc::new(PixelPrompts::new(backbone, &[3, 8, 8], 2));
        let shape = IeShape { pool: 4, query_dim: 32, set_len: enhancer.set_len(), top_n: 2 };
        let student = InputEnhancement::new(&shape, 0.0, 7, &plain).to_blocks(Encoding::F32).unwrap();
        let teachers: Vec<Vec<ParamBlock>> = (0..2)
            .map(|s| InputEnhancement::new(&shape, 0.5, 10 + s, &plain).to_blocks(Encoding::F32).unwrap())
            .collect();
        let teachers: Vec<&[ParamBlock]> = teachers.iter().map(Vec::as_slice).collect();
        let sikf = Sikf::new(enhancer, surrogate, shape, 8, plain.clone().autodiff(), 1).unwrap();
        let before = sikf.loss(&student, &teachers).unwrap();
        let (after_blocks, losses) = sikf.distill(&student, &teachers, 5, 0.05).unwrap();
        let after = sikf.loss(&after_blocks, &teachers).unwrap();
        assert_eq!(losses.len(), 5);
        assert!(after < 0.8 * before, "distillation lowers Eq. 8's loss: {before} → {after} ({losses:?})");
        // The keys (the student's choices) did not move; the names and shapes are the student's.
        assert_eq!(after_blocks[0], student[0]);
        assert_eq!(after_blocks[1].tensor.shape, student[1].tensor.shape);
    }
}
