//! FedTA's tail anchors and stage 2 (§4.2).
//!
//! - A key/value pool of anchors, one per class (class c owns anchor c mod A; the design's
//!   "key/value per class"). The anchored feature is F_TA = [f, v] (Eq. 4), f the frozen output
//!   feature of an (enhanced) input.
//! - **Which anchor.** In stage 2 a sample takes its own class's anchor, and the key pull draws
//!   that key towards the sample's feature (Eq. 6). At inference, where the label is unknown, f
//!   takes the anchor whose key is most similar by cosine (Eq. 4). This is the train-by-label,
//!   infer-by-key rule of DualPrompt's task prompts. Keys pulled towards their class's features
//!   make the key match a class match, so the anchor value tells the head the class.
//!   A class's key starts at its class mean the first time the device trains the class
//!   ([`TailAnchors::seat_keys`]); from a random key in 1280 dimensions the pull would need
//!   hundreds of steps, and until then the key match is a random hash (measured: 110 samples of
//!   8 classes took 50 different anchors).
//! - Stage 2 loss: CE(head(F_TA), y) + λ2 · InfoNCE(F_TA, global prototypes, τ) (Eq. 5) plus
//!   λ3 · Σ (1 − cos(f, k_y)) (Eq. 6). The IE is frozen in stage 2, so f comes from a
//!   feature cache and nothing before it can change.
//! - InfoNCE (Eq. 5): −log exp(cos(F_TA, P_y)/τ) / Σ_c exp(cos(F_TA, P_c)/τ) over the global
//!   prototypes P, for the samples whose class has one.
//! - Old classes keep their anchors: a task without class c moves neither k_c nor v_c, so the
//!   head keeps a class signal for c that new classes do not overwrite.
//!
//! With the `tail_anchors` switch off (the "w/o TA" ablation) F_TA is f and there is no key pull.
//! Anchors and head stay on the device, unless the scenario sets `share_tail` (then they travel as
//! the `tail.*` blocks and the server averages them).

use anchorage_shared::method::Distance;
use anchorage_shared::prototype_rules::ClassMean;
use anchorage_shared::rng::Rng;
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};

use anchorage_shared::tensor::{Encoding, ParamBlock};

use crate::methods::protos::PrototypeTable;
use anchorage_model::ModelError;
use anchorage_model::autodiff::cat_lifted;
use anchorage_model::blocks::{load_tensor, tensor_block};
use anchorage_model::ops::index_tensor;
use anchorage_model::prompts::keys::{Selection, key_pull};
use anchorage_model::prompts::pool::seeded_linear;

/// The anchor pool: keys `[A, D]` (matched against f) and values `[A, V]` (appended to f).
#[derive(Module, Debug)]
pub struct TailAnchors {
    pub keys: Param<Tensor<2>>,
    pub values: Param<Tensor<2>>,
}

impl TailAnchors {
    /// `count` anchors with keys uniform in [−1, 1] and values standard normal, from `seed`.
    pub fn new(count: usize, dim: usize, value_dim: usize, seed: u64, device: &Device) -> Self {
        let mut rng = Rng::derive(seed, 0x7A11);
        let count = count.max(1);
        let keys: Vec<f32> = (0..count * dim).map(|_| (rng.f64() * 2.0 - 1.0) as f32).collect();
        let values: Vec<f32> = (0..count * value_dim).map(|_| rng.normal() as f32).collect();
        Self {
            keys: Param::from_tensor(Tensor::from_data(TensorData::new(keys, [count, dim]), device)),
            values: Param::from_tensor(Tensor::from_data(TensorData::new(values, [count, value_dim]), device)),
        }
    }

    /// Anchors in the pool.
    pub fn count(&self) -> usize {
        self.keys.dims()[0]
    }

    /// The anchor of each label (class c owns anchor c mod A).
    pub fn of_classes(&self, labels: &[u32]) -> Selection {
        let pool = self.count();
        Selection { chosen: labels.iter().map(|&c| vec![c as usize % pool]).collect(), pool }
    }

    /// Eq. 4 at inference: the anchored features `[n, D + V]` of f `[n, D]`, each with the anchor
    /// of the most similar key, and which anchor each took.
    pub fn anchor(&self, f: Tensor<2>) -> (Tensor<2>, Selection) {
        let selection = Selection::by_cosine(f.clone(), self.keys.val(), 1);
        (self.with(f, &selection), selection)
    }

    /// F_TA = [f, v_chosen] for a given choice.
    pub fn with(&self, f: Tensor<2>, selection: &Selection) -> Tensor<2> {
        let values = self.values.val();
        let device = values.device();
        let chosen = values.select(0, index_tensor(&selection.flat(), &device));
        cat_lifted(vec![f, chosen], 1)
    }

    /// Sets the key of each class in `means` (plain-feature class means) to its mean: a class's
    /// key starts where Eq. 6 would pull it. Classes whose anchor is taken by an earlier class of
    /// `means` (more classes than anchors) keep the first.
    pub fn seat_keys(mut self, means: &[ClassMean]) -> Self {
        let [count, dim] = self.keys.dims();
        let device = self.keys.device();
        let mut keys: Vec<f32> = self.keys.val().into_data().convert::<f32>().try_to_vec::<f32>().unwrap_or_default();
        if keys.len() != count * dim {
            return self;
        }
        let mut seated = vec![false; count];
        for m in means.iter().filter(|m| m.vector.len() == dim) {
            let row = m.class as usize % count;
            if !std::mem::replace(&mut seated[row], true) {
                keys[row * dim..(row + 1) * dim].copy_from_slice(&m.vector);
            }
        }
        self.keys = Param::from_tensor(Tensor::from_data(TensorData::new(keys, [count, dim]), &device));
        self
    }
}

/// Stage 2's model: the anchors (none in the "w/o TA" ablation) and the head on F_TA.
#[derive(Module, Debug)]
pub struct TailModel {
    pub anchors: Option<TailAnchors>,
    pub head: Linear,
}

pub use anchorage_shared::method::fedta_blocks::{
    TAIL_HEAD_BIAS, TAIL_HEAD_WEIGHT, TAIL_KEYS, TAIL_TRAINED, TAIL_VALUES,
};

/// Whether a block belongs to a shared tail.
pub fn is_tail_block(name: &str) -> bool {
    name.starts_with(anchorage_shared::method::fedta_blocks::TAIL_PREFIX)
}

/// The weights of stage 2's loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StageTwo {
    pub lambda2: f32,
    pub lambda3: f32,
    /// τ of Eq. 5.
    pub temperature: f32,
}

impl TailModel {
    /// `anchors`: `(count, value width)`, or `None` for the head on f alone.
    pub fn new(
        feature_dim: usize,
        num_classes: usize,
        anchors: Option<(usize, usize)>,
        seed: u64,
        device: &Device,
    ) -> Self {
        let anchors = anchors.map(|(count, v)| TailAnchors::new(count, feature_dim, v, seed, device));
        let width = feature_dim + anchors.as_ref().map_or(0, |a| a.values.dims()[1]);
        Self { anchors, head: seeded_linear(width, num_classes, seed, 0x7A1D, device) }
    }

    /// The `tail.*` blocks: anchor keys and values (when there are anchors) and the head.
    pub fn to_blocks(&self, encoding: Encoding) -> Result<Vec<ParamBlock>, ModelError> {
        let mut out = Vec::new();
        if let Some(a) = &self.anchors {
            out.push(tensor_block(TAIL_KEYS, &a.keys.val(), encoding)?);
            out.push(tensor_block(TAIL_VALUES, &a.values.val(), encoding)?);
        }
        out.push(tensor_block(TAIL_HEAD_WEIGHT, &self.head.weight.val(), encoding)?);
        if let Some(b) = &self.head.bias {
            out.push(tensor_block(TAIL_HEAD_BIAS, &b.val(), encoding)?);
        }
        Ok(out)
    }

    /// This tail with the `tail.*` blocks among `blocks` loaded (other blocks, and the
    /// `tail.trained` counts, are skipped); a tail block this tail has no place for, or of another
    /// shape, is an error.
    pub fn load_blocks(mut self, blocks: &[ParamBlock], device: &Device) -> Result<Self, ModelError> {
        for block in blocks.iter().filter(|b| is_tail_block(&b.name) && b.name != TAIL_TRAINED) {
            match (block.name.as_str(), &mut self.anchors) {
                (TAIL_KEYS, Some(a)) => load_tensor(&mut a.keys, block, device)?,
                (TAIL_VALUES, Some(a)) => load_tensor(&mut a.values, block, device)?,
                (TAIL_HEAD_WEIGHT, _) => load_tensor(&mut self.head.weight, block, device)?,
                (TAIL_HEAD_BIAS, _) if self.head.bias.is_some() => {
                    if let Some(b) = self.head.bias.as_mut() {
                        load_tensor(b, block, device)?
                    }
                }
                _ => return Err(ModelError::UnknownBlock(block.name.clone())),
            }
        }
        Ok(self)
    }

    /// The `tail.trained` block beside a shared tail: how many of `labels` took each anchor
    /// (none without anchors).
    pub fn trained_block(&self, labels: &[u32]) -> Option<ParamBlock> {
        let a = self.anchors.as_ref()?;
        let mut counts = vec![0f32; a.count()];
        a.of_classes(labels).flat().into_iter().for_each(|i| counts[i] += 1.0);
        Some(ParamBlock::encode(TAIL_TRAINED, &[counts.len() as u32], &counts, Encoding::F32))
    }

    /// F_TA of f (f itself without anchors), and the anchor choice.
    pub fn anchored(&self, f: Tensor<2>) -> (Tensor<2>, Option<Selection>) {
        match &self.anchors {
            Some(a) => {
                let (z, s) = a.anchor(f);
                (z, Some(s))
            }
            None => (f, None),
        }
    }

    /// F_TA of f with each sample's own class anchor (stage 2 and the local prototypes of Eq. 7);
    /// f itself without anchors.
    pub fn anchored_by_class(&self, f: Tensor<2>, labels: &[u32]) -> (Tensor<2>, Option<Selection>) {
        match &self.anchors {
            Some(a) => {
                let s = a.of_classes(labels);
                (a.with(f, &s), Some(s))
            }
            None => (f, None),
        }
    }

    /// Logits `[n, classes]` of f.
    pub fn forward(&self, f: Tensor<2>) -> Tensor<2> {
        self.head.forward(self.anchored(f).0)
    }

    /// Eq. 4–6 on one batch of frozen features `f` with labels `y` (host `labels`); each sample
    /// takes its class's anchor, and the train `mask` (see [`super::task_mask`]) is added to the
    /// logits.
    pub fn loss(
        &self,
        f: Tensor<2>,
        y: Tensor<1, Int>,
        labels: &[u32],
        global: Option<&PrototypeTable>,
        w: StageTwo,
        mask: Option<&Tensor<2>>,
    ) -> Tensor<1> {
        let (z, selection) = self.anchored_by_class(f.clone(), labels);
        let ce = CrossEntropyLossConfig::new().init(&z.device());
        let mut loss = ce.forward(anchorage_model::ops::masked(self.head.forward(z.clone()), mask), y);
        if w.lambda2 > 0.0
            && let Some(nce) = global.and_then(|g| info_nce(z, labels, g, w.temperature))
        {
            loss = loss + nce.mul_scalar(w.lambda2);
        }
        if let (Some(a), Some(s), true) = (&self.anchors, selection, w.lambda3 > 0.0) {
            loss = loss + key_pull(f, a.keys.val(), &s).mul_scalar(w.lambda3);
        }
        loss
    }
}

/// Eq. 5 over the rows of `z` whose label has a global prototype of z's width; `None` if none.
pub fn info_nce(z: Tensor<2>, labels: &[u32], global: &PrototypeTable, temperature: f32) -> Option<Tensor<1>> {
    if global.dim() != z.dims()[1] {
        return None;
    }
    let rows: Vec<(usize, usize)> =
        global.rows_of(labels).into_iter().enumerate().filter_map(|(i, r)| r.map(|r| (i, r))).collect();
    if rows.is_empty() {
        return None;
    }
    let device = z.device();
    let samples = index_tensor(&rows.iter().map(|(i, _)| *i).collect::<Vec<_>>(), &device);
    let targets: Vec<i64> = rows.iter().map(|(_, r)| *r as i64).collect();
    let targets = Tensor::<1, Int>::from_data(TensorData::new(targets, [rows.len()]), &device);
    let logits = global.logits(z.select(0, samples), Distance::Cosine, temperature);
    Some(CrossEntropyLossConfig::new().init(&device).forward(logits, targets))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_feature_takes_the_anchor_of_its_nearest_key() {
        let device = Device::flex();
        let mut a = TailAnchors::new(2, 2, 1, 3, &device);
        a.keys = Param::from_tensor(Tensor::from_data(TensorData::new(vec![1.0f32, 0.0, 0.0, 1.0], [2, 2]), &device));
        a.values = Param::from_tensor(Tensor::from_data(TensorData::new(vec![10.0f32, 20.0], [2, 1]), &device));
        let f = Tensor::<2>::from_data(TensorData::new(vec![0.1f32, 3.0, 2.0, 0.5], [2, 2]), &device);
        let (z, s) = a.anchor(f);
        assert_eq!(s.chosen, vec![vec![1], vec![0]]);
        let z: Vec<f32> = z.into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        assert_eq!(z, vec![0.1, 3.0, 20.0, 2.0, 0.5, 10.0]);
    }

    #[test]
    fn training_takes_the_class_anchor_and_inference_the_nearest_key() {
        let device = Device::flex();
        let tail = TailModel::new(2, 3, Some((2, 1)), 3, &device);
        let a = tail.anchors.as_ref().unwrap();
        // Class c owns anchor c mod 2, whatever its feature.
        assert_eq!(a.of_classes(&[1, 0, 2]).chosen, vec![vec![1], vec![0], vec![0]]);
        // Seated keys: class 0 along x, class 1 along y; class 2 shares class 0's anchor and
        // keeps the first mean.
        let means = [
            ClassMean { class: 0, count: 1, vector: vec![1.0, 0.0] },
            ClassMean { class: 1, count: 1, vector: vec![0.0, 1.0] },
            ClassMean { class: 2, count: 1, vector: vec![-1.0, -1.0] },
            ClassMean { class: 3, count: 1, vector: vec![1.0] },
        ];
        let a = TailModel { anchors: tail.anchors.map(|a| a.seat_keys(&means)), head: tail.head };
        let keys: Vec<f32> = a.anchors.as_ref().unwrap().keys.val().into_data().try_to_vec::<f32>().unwrap();
        assert_eq!(
            keys,
            vec![1.0, 0.0, 0.0, 1.0],
            "a class's key starts at its mean; a mean of another width is skipped"
        );
        // A class-1 sample near x trains with anchor 1 but is inferred with anchor 0.
        let f = Tensor::<2>::from_data(TensorData::new(vec![3.0f32, 0.2], [1, 2]), &device);
        let (_, train) = a.anchored_by_class(f.clone(), &[1]);
        let (_, infer) = a.anchored(f.clone());
        assert_eq!((train.unwrap().chosen, infer.unwrap().chosen), (vec![vec![1]], vec![vec![0]]));
        // The key pull of Eq. 6 moves the label's key, not the nearest one.
        let w = StageTwo { lambda2: 0.0, lambda3: 1.0, temperature: 0.2 };
        let y = Tensor::<1, Int>::from_data(TensorData::new(vec![1i64], [1]), &device);
        let a = a.valid();
        let grads = {
            let ad = Device::flex().autodiff();
            let m = TailModel::new(2, 3, Some((2, 1)), 3, &ad)
                .load_blocks(&a.to_blocks(Encoding::F32).unwrap(), &ad)
                .unwrap();
            let f = Tensor::<2>::from_data(TensorData::new(vec![3.0f32, 0.2], [1, 2]), &ad);
            let y = Tensor::<1, Int>::from_data(y.into_data(), &ad);
            let loss = m.loss(f, y, &[1], None, w, None);
            let g = loss.backward();
            m.anchors.unwrap().keys.grad(&g).unwrap().into_data().try_to_vec::<f32>().unwrap()
        };
        assert_eq!(&grads[..2], &[0.0, 0.0], "anchor 0 is not the label's");
        assert!(grads[2..].iter().any(|g| *g != 0.0), "anchor 1 is pulled towards the class-1 feature");
    }

    #[test]
    fn the_train_mask_leaves_the_old_classes_logits_alone() {
        let ad = Device::flex().autodiff();
        let w = StageTwo { lambda2: 0.0, lambda3: 0.0, temperature: 0.2 };
        let head_grad = |masked: bool| {
            let m = TailModel::new(2, 3, Some((3, 1)), 3, &ad);
            let f = Tensor::<2>::from_data(TensorData::new(vec![1.0f32, 0.5, 0.2, 2.0], [2, 2]), &ad);
            let y = Tensor::<1, Int>::from_data(TensorData::new(vec![1i64, 2], [2]), &ad);
            // The task holds classes 1 and 2; class 0 is an old one.
            let mask = crate::methods::fedta::task_mask(masked, &[1, 2], &[1, 2], 3, &ad);
            let g = m.loss(f, y, &[1, 2], None, w, mask.as_ref()).backward();
            // Linear weight [in, out]: one column per class.
            let grad: Vec<f32> = m.head.weight.grad(&g).unwrap().into_data().try_to_vec::<f32>().unwrap();
            let column = |c: usize| grad.iter().skip(c).step_by(3).map(|v| v.abs()).sum::<f32>();
            (column(0), column(1), column(2))
        };
        let (old, one, two) = head_grad(true);
        assert_eq!(old, 0.0, "masked: the old class's weights get no gradient");
        assert!(one > 0.0 && two > 0.0, "the task's classes learn");
        let (old, _, _) = head_grad(false);
        assert!(old > 0.0, "unmasked: the task pushes the old class down");
        assert!(crate::methods::fedta::task_mask(false, &[1], &[], 3, &ad).is_none());
    }

    /// The global prototypes are the anchors' training targets (Eq. 5): the InfoNCE term moves
    /// the value of the label's anchor, and only that one.
    #[test]
    fn info_nce_moves_the_label_anchor_value() {
        let plain = Device::flex();
        let ad = plain.clone().autodiff();
        let protos = [
            ClassMean { class: 0, count: 1, vector: vec![1.0, 0.0, 1.0, 0.0] },
            ClassMean { class: 1, count: 1, vector: vec![0.0, 1.0, 0.0, 1.0] },
        ];
        let table = PrototypeTable::new(&protos, &plain).unwrap();
        let grad_of = |lambda2: f32| {
            let m = TailModel::new(2, 2, Some((2, 2)), 3, &ad);
            let f = Tensor::<2>::from_data(TensorData::new(vec![1.0f32, 0.2], [1, 2]), &plain);
            let y = Tensor::<1, Int>::from_data(TensorData::new(vec![1i64], [1]), &ad);
            let w = StageTwo { lambda2, lambda3: 0.0, temperature: 0.2 };
            let g = m.loss(f, y, &[1], Some(&table), w, None).backward();
            m.anchors.unwrap().values.grad(&g).unwrap().into_data().try_to_vec::<f32>().unwrap()
        };
        let (ce, both) = (grad_of(0.0), grad_of(1.0));
        assert_eq!(&both[..2], &[0.0, 0.0], "anchor 0 is not the label's");
        assert!(both[2..].iter().zip(&ce[2..]).any(|(a, b)| (a - b).abs() > 1e-6), "{both:?} vs {ce:?}");
    }

    #[test]
    fn info_nce_prefers_the_own_class_prototype() {
        let device = Device::flex();
        let protos = [
            ClassMean { class: 4, count: 1, vector: vec![1.0, 0.0] },
            ClassMean { class: 9, count: 1, vector: vec![0.0, 1.0] },
        ];
        let table = PrototypeTable::new(&protos, &device).unwrap();
        let z = Tensor::<2>::from_data(TensorData::new(vec![1.0f32, 0.1, 0.2, 1.0, 5.0, 5.0], [3, 2]), &device);
        let right = info_nce(z.clone(), &[4, 9, 7], &table, 0.2).unwrap().into_scalar::<f32>();
        let wrong = info_nce(z.clone(), &[9, 4, 7], &table, 0.2).unwrap().into_scalar::<f32>();
        assert!(right < wrong, "{right} vs {wrong}");
        assert!(info_nce(z.clone(), &[7, 7, 7], &table, 0.2).is_none(), "no sample of a known class");
        let wide = Tensor::<2>::zeros([1, 3], &device);
        assert!(info_nce(wide, &[4], &table, 0.2).is_none(), "prototypes of another width are skipped");
    }
}
