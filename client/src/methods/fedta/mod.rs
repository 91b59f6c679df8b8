//! FedTA's client half (Yu et al., §4.1–4.2): input enhancement, then tail anchors, on a frozen
//! backbone.
//!
//! Each round:
//! 1. **Stage 1** (`ie`): the global IE pool (keys and sets, from the broadcast) and the local
//!    IE head train for `ie_epochs` with CE + λ1 · key pull (Eq. 2–3). Every step runs the frozen
//!    backbone on the enhanced inputs (`prompts`: token prompts for a ViT, pixel prompts for a
//!    convolutional backbone), so this is the expensive stage.
//! 2. The IE is frozen; the features of the enhanced training inputs are computed once.
//! 3. **Stage 2** ([`anchors`]): the tail anchors and the head train for the round's
//!    `local_epochs` on those cached features with CE + λ2 · InfoNCE(global prototypes, τ) +
//!    λ3 · key pull (Eq. 4–6). Stage 2 cannot change the IE or the backbone: neither is in its
//!    model, and its inputs are a plain feature tensor.
//!    With `train_mask` (the default) both stages' cross-entropy runs over the current task's
//!    classes only ([`task_mask`]), as in L2P and DualPrompt.
//! 4. Local prototypes: the per-class means of the anchored features F_TA (Eq. 7), each class
//!    with its own anchor.
//! 5. Upload: the IE blocks (`ie.keys`, `ie.sets`) and the prototypes. The IE head, the anchors
//!    and the head stay on the device, unless the scenario sets `share_tail`: then the anchors
//!    and head travel too (`tail.*`), the server averages them, and every client starts stage 2
//!    from the global tail.
//!
//! **The global model** (what the server holds: the frozen backbone, the global IE and the
//! global prototypes) predicts, with `prediction = "prototypes"` (the default), by the nearest
//! global prototype by cosine, compared on the frozen-feature part of F_TA (the anchors are not
//! global). With `share_tail` the anchors are global, and the global model compares the whole
//! F_TA (feature and global anchor) with the global prototypes. With `prediction = "head"` the
//! devices also upload their stage-1 IE head, the server averages it, and the global model is the
//! global IE with that head, as the authors' code evaluates its global model
//! (`evaluate_on_global_testset`); a device never loads the average. BGPS's picks are then only
//! what the paper makes them: the targets of the anchored features (Eq. 5). The paper's tables
//! report the clients' models (the local accuracies).

pub mod anchors;

use anchorage_shared::MetricKey;
use std::sync::Arc;

use crate::methods::Trained;
use anchorage_shared::method::fedta_blocks::{IE_HEAD_BIAS, IE_HEAD_PREFIX, IE_HEAD_WEIGHT, IE_PREFIX};
use anchorage_shared::method::{Distance, FedTaConfig, FedTaPrediction};
use anchorage_shared::protocol::{Broadcast, Metric};
use anchorage_shared::prototype_rules::ClassMean;
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{Device, Tensor, TensorData};

use self::anchors::{StageTwo, TailModel, is_tail_block};
use super::protos::{PrototypeTable, class_means, from_wire, upload_prototypes};
use super::{ClientMethod, MethodContext, TrainError, common_metrics};
use anchorage_model::blocks::{load_tensor, tensor_block};
use anchorage_model::ops::masked;
use anchorage_model::prompts::pool::{IeModel, IeShape, InputEnhancement, enhanced_cache};
use anchorage_model::prompts::{Enhancer, enhancer_for};
use anchorage_model::train::{Trainer, accuracy_of, whole};
use anchorage_model::{FeatureCache, ModelError};

/// Samples per backbone call when features of enhanced inputs are cached.
const CHUNK: usize = 128;

/// FedTA's client half. See the module docs.
pub struct FedTaClient {
    ctx: MethodContext,
    config: FedTaConfig,
    enhancer: Arc<dyn Enhancer>,
    shape: IeShape,
    /// The IE head of stage 1 (kept on the device).
    ie_head: Option<Linear>,
    /// Anchors and head of stage 2 (kept on the device).
    tail: Option<TailModel>,
    /// Classes whose anchor key this device has seated at their class mean.
    seated: std::collections::BTreeSet<u32>,
    task: u32,
    rng: Rng,
}

impl FedTaClient {
    /// Pixel prompts on the context's frozen backbone (which must be given, with the raw
    /// samples attached to the task stream's caches).
    pub fn new(ctx: MethodContext, config: FedTaConfig) -> Result<Self, TrainError> {
        let backbone = ctx.backbone.as_ref().ok_or(TrainError::Model(anchorage_model::ModelError::NoInputs))?;
        let enhancer = enhancer_for(&config, backbone);
        Ok(Self::with_enhancer(ctx, config, enhancer))
    }

    /// FedTA on any form of input enhancement (e.g. `TokenPrompts` on a ViT).
    pub fn with_enhancer(ctx: MethodContext, config: FedTaConfig, enhancer: Arc<dyn Enhancer>) -> Self {
        let shape = IeShape::for_method(&config, enhancer.as_ref());
        Self {
            rng: Rng::derive(ctx.seed, 0xFE07A),
            ctx,
            config,
            enhancer,
            shape,
            ie_head: None,
            tail: None,
            seated: Default::default(),
            task: 0,
        }
    }

    /// The seeded initial IE pool (identical on every client and the server).
    fn initial_ie(&self, device: &Device) -> InputEnhancement {
        InputEnhancement::new(&self.shape, self.enhancer.init_std(), self.ctx.net.seed, device)
    }

    /// The broadcast's IE pool (the seeded one where the broadcast carries none).
    fn global_ie(&self, broadcast: &Broadcast, device: &Device) -> Result<InputEnhancement, TrainError> {
        let ie: Vec<ParamBlock> = broadcast.blocks.iter().filter(|b| b.name.starts_with(IE_PREFIX)).cloned().collect();
        Ok(self.initial_ie(device).load_blocks(&ie, device)?)
    }

    /// The seeded IE head of stage 1 (identical on every client and the server).
    fn new_ie_head(&self, device: &Device) -> Linear {
        IeModel::new_head(self.shape.query_dim, self.ctx.net.num_classes, self.ctx.net.seed, device)
    }

    /// The IE head held by the `ie_head.*` blocks among `blocks` (the broadcast's average under
    /// `prediction = "head"`, or the device state's own), `None` when there are none.
    fn ie_head_of(&self, blocks: &[ParamBlock], device: &Device) -> Result<Option<Linear>, TrainError> {
        let blocks: Vec<&ParamBlock> = blocks.iter().filter(|b| b.name.starts_with(IE_HEAD_PREFIX)).collect();
        if blocks.is_empty() {
            return Ok(None);
        }
        let mut head = self.new_ie_head(device);
        for block in blocks {
            match (block.name.as_str(), head.bias.as_mut()) {
                (IE_HEAD_WEIGHT, _) => load_tensor(&mut head.weight, block, device)?,
                (IE_HEAD_BIAS, Some(bias)) => load_tensor(bias, block, device)?,
                _ => return Err(ModelError::UnknownBlock(block.name.clone()).into()),
            }
        }
        Ok(Some(head))
    }

    /// The global model of `prediction = "head"`: the global IE, then the broadcast's averaged IE
    /// head (which a device never trains from), over the classes the federation has seen (those
    /// with a global prototype: a class no device has trained keeps its seeded row, whose logits
    /// are noise); `None` without a head or a prototype in the broadcast, or without a test set.
    fn global_head_accuracy(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Option<f64>, TrainError> {
        let device = self.ctx.device.clone().inner();
        let Some(head) = self.ie_head_of(&broadcast.blocks, &device)? else { return Ok(None) };
        let seen: Vec<u32> = broadcast.prototypes.iter().map(|p| p.class).collect();
        if test.is_empty() || seen.is_empty() {
            return Ok(None);
        }
        self.check_width(test)?;
        let ie = self.global_ie(broadcast, &device)?;
        let enhanced = enhanced_cache(&ie, self.enhancer.as_ref(), test, self.shape.top_n, CHUNK)?;
        let head = head.valid();
        let mask = task_mask(true, &seen, &[], self.ctx.net.num_classes, &enhanced.device());
        Ok(accuracy_of(&enhanced, 1024, |x| masked(head.forward(x), mask.as_ref()).argmax(1)))
    }

    /// The broadcast's tail (`share_tail`), `None` when it carries none.
    fn global_tail(&self, broadcast: &Broadcast) -> Result<Option<TailModel>, TrainError> {
        if !self.config.share_tail || !broadcast.blocks.iter().any(|b| is_tail_block(&b.name)) {
            return Ok(None);
        }
        Ok(Some(self.new_tail().load_blocks(&broadcast.blocks, &self.ctx.device)?))
    }

    /// The caches' plain features must be this backbone's.
    fn check_width(&self, cache: &FeatureCache) -> Result<(), TrainError> {
        let got = cache.dim();
        if got != self.shape.query_dim {
            return Err(ModelError::Shape {
                name: "features".into(),
                expected: vec![self.shape.query_dim as u32],
                got: vec![got as u32],
            }
            .into());
        }
        Ok(())
    }

    fn stage_two_weights(&self) -> StageTwo {
        let m = &self.config;
        StageTwo { lambda2: m.lambda2, lambda3: m.lambda3, temperature: m.temperature }
    }

    fn new_tail(&self) -> TailModel {
        let m = &self.config;
        let anchors = m.tail_anchors.then_some(((m.anchors as usize).max(1), (m.anchor_dim as usize).max(1)));
        TailModel::new(self.shape.query_dim, self.ctx.net.num_classes, anchors, self.ctx.net.seed, &self.ctx.device)
    }

    /// Stage 1 (Eq. 2–3): the IE pool and the IE head on the task's raw inputs.
    fn stage_one(
        &mut self,
        ie: InputEnhancement,
        train: &FeatureCache,
        classes: &[u32],
        broadcast: &Broadcast,
        rng: &mut Rng,
    ) -> Result<(InputEnhancement, f64), TrainError> {
        let m = self.config.clone();
        if m.ie_epochs == 0 {
            return Ok((ie, f64::NAN));
        }
        let inputs = train.inputs.as_ref().ok_or(TrainError::Model(anchorage_model::ModelError::NoInputs))?;
        let device = self.ctx.device.clone();
        let head = self.ie_head.take().unwrap_or_else(|| self.new_ie_head(&device));
        let c = &broadcast.config;
        let mut trainer = Trainer::with_weight_decay(
            self.ctx.optimizer,
            c.learning_rate as f64,
            c.batch_size as usize,
            m.weight_decay,
        );
        let plain = train.device();
        let (enhancer, top_n) = (self.enhancer.clone(), self.shape.top_n);
        let mask = task_mask(m.train_mask, classes, &train.labels_host, self.ctx.net.num_classes, &device);
        let mut model = IeModel { ie, head };
        let mut loss = f64::NAN;
        for _ in 0..m.ie_epochs {
            (model, loss) = trainer.epoch(model, train, rng, whole, |model, b| {
                let x = inputs.batch(&b.rows, &plain);
                model.loss(enhancer.as_ref(), x, b.x.clone(), b.y.clone(), top_n, m.lambda1, mask.as_ref())
            });
        }
        self.ie_head = Some(model.head);
        Ok((model.ie, loss))
    }

    /// Stage 2 (Eq. 4–6) on the cached features of the enhanced inputs.
    fn stage_two(
        &mut self,
        enhanced: &FeatureCache,
        classes: &[u32],
        global: Option<&PrototypeTable>,
        broadcast: &Broadcast,
        rng: &mut Rng,
    ) -> (TailModel, f64) {
        let c = &broadcast.config;
        let mut trainer = Trainer::with_weight_decay(
            self.ctx.optimizer,
            c.learning_rate as f64,
            c.batch_size as usize,
            self.config.weight_decay,
        );
        let w = self.stage_two_weights();
        let mut tail = self.tail.take().unwrap_or_else(|| self.new_tail());
        if let Some(anchors) = tail.anchors.take() {
            let fresh: Vec<ClassMean> = class_means(enhanced.features().inner(), &enhanced.labels_host)
                .into_iter()
                .filter(|m| self.seated.insert(m.class))
                .collect();
            tail.anchors = Some(anchors.seat_keys(&fresh));
        }
        let mask = task_mask(
            self.config.train_mask,
            classes,
            &enhanced.labels_host,
            self.ctx.net.num_classes,
            &self.ctx.device,
        );
        let mut loss = f64::NAN;
        for _ in 0..c.local_epochs {
            (tail, loss) = trainer.epoch(tail, enhanced, rng, whole, |m, b| {
                m.loss(b.x.clone(), b.y.clone(), &b.labels, global, w, mask.as_ref())
            });
        }
        (tail, loss)
    }

    /// Accuracy of the local model (IE, anchors, head) on `test`.
    fn local_accuracy(&self, ie: &InputEnhancement, tail: &TailModel, test: &FeatureCache) -> Option<f64> {
        let enhanced = enhanced_cache(ie, self.enhancer.as_ref(), test, self.shape.top_n, CHUNK).ok()?;
        accuracy_of(&enhanced, 512, |x| tail.forward(x).argmax(1))
    }
}

/// The train mask (`train_mask`): `[1, classes]`, 0 for the task's classes (and any class among
/// `labels`), a large negative value elsewhere; added to the logits before the cross-entropy.
/// `None` when the mask is off.
pub fn task_mask(on: bool, task: &[u32], labels: &[u32], classes: usize, device: &Device) -> Option<Tensor<2>> {
    if !on {
        return None;
    }
    let mut mask = vec![-1.0e4f32; classes];
    for &c in task.iter().chain(labels) {
        if let Some(m) = mask.get_mut(c as usize) {
            *m = 0.0;
        }
    }
    Some(Tensor::from_data(TensorData::new(mask, [1, classes]), device))
}

/// Device-state block name of the classes whose anchor key is seated (the tail keeps its
/// `tail.*` names, the IE head its `ie_head.*` ones).
const SEATED: &str = "seated.classes";

/// The IE head's blocks (`ie_head.*`): in the device state, and uploaded under
/// `prediction = "head"`.
fn ie_head_blocks(head: &Linear, encoding: Encoding) -> Result<Vec<ParamBlock>, ModelError> {
    let mut out = vec![tensor_block(IE_HEAD_WEIGHT, &head.weight.val(), encoding)?];
    if let Some(b) = &head.bias {
        out.push(tensor_block(IE_HEAD_BIAS, &b.val(), encoding)?);
    }
    Ok(out)
}

/// The frozen-feature part (the first `dim` values) of each prototype of F_TA.
fn feature_part(means: &[ClassMean], dim: usize) -> Vec<ClassMean> {
    means
        .iter()
        .filter(|m| m.vector.len() >= dim)
        .map(|m| ClassMean { vector: m.vector[..dim].to_vec(), ..m.clone() })
        .collect()
}

impl ClientMethod for FedTaClient {
    fn name(&self) -> &'static str {
        <anchorage_shared::method::FedTaConfig as anchorage_shared::method::MethodParams>::NAME
    }

    fn num_samples(&self) -> u64 {
        self.ctx.stream.current_samples(self.task)
    }

    fn train(&mut self, broadcast: &Broadcast) -> Result<Trained, TrainError> {
        self.task = broadcast.task;
        let data = self.ctx.stream.training(broadcast.task)?;
        let train = data.train.clone();
        let classes = data.classes.clone();
        self.check_width(&train)?;
        let device = self.ctx.device.clone();
        let global_means = from_wire(&broadcast.prototypes)?;
        let ie = self.global_ie(broadcast, &device)?;
        let mut rng = self.rng.clone();

        // A shared tail starts from the global one; a private tail from the device's own.
        if let Some(global) = self.global_tail(broadcast)? {
            self.tail = Some(global);
        }
        let (ie, stage1_loss) = self.stage_one(ie, &train, &classes, broadcast, &mut rng)?;
        let ie = ie.valid();
        let enhanced = enhanced_cache(&ie, self.enhancer.as_ref(), &train, self.shape.top_n, CHUNK)?;
        let global = PrototypeTable::new(&global_means, &enhanced.device());
        let (tail, loss) = self.stage_two(&enhanced, &classes, global.as_ref(), broadcast, &mut rng);
        self.rng = rng;

        // Eq. 7: the local prototypes of F_TA.
        let valid_tail = tail.valid();
        let plain_features = enhanced.features().inner();
        let anchored = valid_tail.anchored_by_class(plain_features.clone(), &enhanced.labels_host).0;
        let prototypes =
            upload_prototypes(anchored, &enhanced.labels_host, self.ctx.prototype_release, self.ctx.encoding);
        let accuracies = self.ctx.stream.accuracy_metrics(broadcast, |t| self.local_accuracy(&ie, &valid_tail, t));
        let mut blocks = ie.to_blocks(self.ctx.encoding)?;
        if self.config.prediction == FedTaPrediction::Head {
            let head = self.ie_head.clone().unwrap_or_else(|| self.new_ie_head(&device));
            blocks.extend(ie_head_blocks(&head.valid(), self.ctx.encoding)?);
        }
        if self.config.share_tail {
            blocks.extend(valid_tail.to_blocks(self.ctx.encoding)?);
            blocks.extend(valid_tail.trained_block(&enhanced.labels_host));
        }
        self.tail = Some(tail);
        let mut metrics = common_metrics(loss, accuracies);
        metrics.push(Metric::new(MetricKey::IeLoss, stage1_loss));
        if let Some(anchors) = &valid_tail.anchors {
            // How often the key match (inference) takes the sample's own class anchor (training).
            let by_key = anchors.anchor(plain_features).1;
            let own = anchors.of_classes(&enhanced.labels_host);
            let matched = by_key.chosen.iter().zip(&own.chosen).filter(|(a, b)| a == b).count();
            let rate = matched as f64 / own.chosen.len().max(1) as f64;
            tracing::debug!(
                task = broadcast.task,
                round = broadcast.round,
                used = by_key.distinct(),
                key_match = rate,
                "tail anchors taken by key similarity on the training samples"
            );
            metrics.push(Metric::new(MetricKey::AnchorKeyMatch, rate));
        }
        metrics.retain(|m| m.value.is_finite());
        Ok(Trained { prototypes_are: Default::default(), num_samples: train.len() as u64, blocks, prototypes, metrics })
    }

    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
        let device = self.ctx.device.clone().inner();
        let mut blocks = self.initial_ie(&device).to_blocks(Encoding::F32)?;
        if self.config.prediction == FedTaPrediction::Head {
            blocks.extend(ie_head_blocks(&self.new_ie_head(&device), Encoding::F32)?);
        }
        if self.config.share_tail {
            let tail = self.new_tail().valid();
            blocks.extend(tail.to_blocks(Encoding::F32)?);
            blocks.extend(tail.trained_block(&[]));
        }
        Ok(blocks)
    }

    /// The anchors, the head and the IE head: they never leave the device (unless `share_tail`),
    /// so a restart must not lose them.
    fn device_state(&self) -> Result<Vec<ParamBlock>, TrainError> {
        let mut out = Vec::new();
        if let Some(tail) = &self.tail {
            out.extend(tail.valid().to_blocks(Encoding::F32)?);
        }
        if let Some(head) = &self.ie_head {
            out.extend(ie_head_blocks(&head.valid(), Encoding::F32)?);
        }
        let seated: Vec<f32> = self.seated.iter().map(|&c| c as f32).collect();
        out.push(ParamBlock::encode(SEATED, &[seated.len() as u32], &seated, Encoding::F32));
        Ok(out)
    }

    fn restore_device_state(&mut self, blocks: &[ParamBlock]) -> Result<(), TrainError> {
        let device = self.ctx.device.clone();
        let tail_blocks: Vec<ParamBlock> = blocks.iter().filter(|b| is_tail_block(&b.name)).cloned().collect();
        let tail =
            if tail_blocks.is_empty() { None } else { Some(self.new_tail().load_blocks(&tail_blocks, &device)?) };
        let ie_head = self.ie_head_of(blocks, &device)?;
        let mut seated = std::collections::BTreeSet::new();
        for block in blocks.iter().filter(|b| !is_tail_block(&b.name) && !b.name.starts_with(IE_HEAD_PREFIX)) {
            match block.name.as_str() {
                SEATED => {
                    for v in block.decode()? {
                        if v < 0.0 || v.fract() != 0.0 || v as usize >= self.ctx.net.num_classes {
                            return Err(ModelError::UnknownBlock(format!("{SEATED} holds {v}, not a class")).into());
                        }
                        seated.insert(v as u32);
                    }
                }
                _ => return Err(ModelError::UnknownBlock(block.name.clone()).into()),
            }
        }
        // Nothing is changed until every block has been placed.
        (self.tail, self.ie_head, self.seated) = (tail, ie_head, seated);
        Ok(())
    }

    /// The global IE and then (see the module docs) the averaged IE head (`prediction = "head"`),
    /// or the nearest global prototype by cosine: on the frozen-feature part of F_TA, or, with a
    /// shared tail, on the whole F_TA with the global anchors.
    fn global_accuracy(&self, broadcast: &Broadcast, test: &FeatureCache) -> Result<Option<f64>, TrainError> {
        if self.config.prediction == FedTaPrediction::Head {
            return self.global_head_accuracy(broadcast, test);
        }
        let tail = self.global_tail(broadcast)?.map(|t| t.valid());
        let means = from_wire(&broadcast.prototypes)?;
        let means = if tail.is_some() { means } else { feature_part(&means, self.shape.query_dim) };
        let plain = test.device();
        let Some(table) = PrototypeTable::new(&means, &plain) else { return Ok(None) };
        if test.is_empty() {
            return Ok(None);
        }
        self.check_width(test)?;
        let ie = self.global_ie(broadcast, &self.ctx.device.clone().inner())?;
        let enhanced = enhanced_cache(&ie, self.enhancer.as_ref(), test, self.shape.top_n, CHUNK)?;
        Ok(accuracy_of(&enhanced, 1024, |x| {
            let x = match &tail {
                Some(t) => t.anchored(x).0,
                None => x,
            };
            table.predict(x, Distance::Cosine)
        }))
    }
}

#[cfg(test)]
mod tests;
