//! Each method's hyperparameters, one struct per method, with the papers' defaults. A `[method]`
//! table names its method (`name = "gldp"`) and may set only that method's keys
//! ([`super::MethodConfig`]).

use serde::{Deserialize, Serialize};

/// Distance used by FedEvolve's alignment (Eq. 4) and prototype prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Distance {
    #[default]
    /// Euclidean distance.
    Euclidean,
    /// Cosine distance.
    Cosine,
}

/// What GLDP predicts with: the nearest prototype (Eq. 13), the client's own (GLDP-LP) or the
/// global ones (GLDP-GP); or, as an ablation, the classifier head ν on µ(x): a device's
/// own ν, the global model's ν averaged over the devices ([`GldpConfig::global_head`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GldpPrediction {
    /// The nearest of the client's own prototypes (GLDP-LP).
    Local,
    #[default]
    /// The nearest global prototype (GLDP-GP).
    Global,
    /// The classifier head ν on µ(x) (an ablation).
    Head,
}

/// FedAvg (McMahan et al. 2017): no hyperparameters beyond the round's.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedAvgConfig {}

/// FedAvgM (Hsu et al. 2019): FedAvg's mean applied as a pseudo-gradient with server momentum.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedAvgMConfig {
    /// η, the server's step along the velocity (1 with no momentum is FedAvg).
    pub server_learning_rate: f32,
    /// β, the velocity's momentum.
    pub server_momentum: f32,
}

impl Default for FedAvgMConfig {
    fn default() -> Self {
        Self { server_learning_rate: 1.0, server_momentum: 0.9 }
    }
}

/// Local training only: no hyperparameters beyond the round's.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LocalConfig {}

/// FedProx (Li et al. 2020): FedAvg with the proximal term µ/2 · ‖w − w_global‖².
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedProxConfig {
    /// The proximal coefficient µ.
    pub mu: f32,
}

impl Default for FedProxConfig {
    fn default() -> Self {
        Self { mu: 0.01 }
    }
}

/// FedRep (Collins et al. 2021): a personal head trained first, then the shared body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedRepConfig {
    /// Epochs of the personal head before the body's `local_epochs`.
    pub personal_epochs: u32,
}

impl Default for FedRepConfig {
    fn default() -> Self {
        Self { personal_epochs: 1 }
    }
}

/// GLDP / STHFL (Guo et al.): shared representation µ, personal layer ν, local and global prototypes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GldpConfig {
    /// Moving average of the global prototypes β (Eq. 9 and 11).
    pub beta: f32,
    /// Weight λ of L_LP against (1−λ) of L_GP (Eq. 12).
    pub lambda: f32,
    /// Temperature of the softmax over prototype distances (Eq. 7).
    pub temperature: f32,
    /// t, local epochs of the shared representation µ (before the personal layer ν's
    /// `local_epochs`, s).
    pub shared_epochs: u32,
    /// What the models predict with (Eq. 13, or the head as an ablation).
    pub prediction: GldpPrediction,
    /// L_LP and L_GP in the loss (Eq. 12); false leaves CE alone (the ablation of both).
    pub prototype_losses: bool,
    /// Devices also upload ν and the server averages it into a global head, which the devices
    /// never load (ν stays personal): the head the global model predicts with under
    /// `prediction = "head"`, and the simulator's head probe. Implied by that
    /// prediction.
    pub global_head: bool,
}

impl GldpConfig {
    /// Whether ν travels up to make a global head.
    pub fn shares_head(&self) -> bool {
        self.global_head || self.prediction == GldpPrediction::Head
    }
}

impl Default for GldpConfig {
    fn default() -> Self {
        Self {
            beta: 0.5,
            lambda: 0.5,
            temperature: 1.0,
            shared_epochs: 1,
            prediction: GldpPrediction::Global,
            prototype_losses: true,
            global_head: false,
        }
    }
}

/// FedProK (Gao et al.): prototypes fused on the server, pseudo-features of old classes replayed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedProKConfig {
    /// Prototype fusion blend β for old classes (Eq. 9).
    pub beta: f32,
    /// Pseudo-features replayed per old class and batch, as a multiple of the batch's real ones.
    pub replay_ratio: f32,
    /// What the pseudo-features of Eq. 8 train: the whole net (f and the classifier) or the
    /// classifier alone (f(x_n) detached, as FeTrIL trains its classifier).
    pub replay_into: ReplayInto,
    /// Move the stored old prototypes with the adapter (semantic drift compensation, Yu et al. 2020,
    /// not in FedProK): after local training each old µ_p moves by the drift f_end(x) − f_start(x)
    /// of the current samples near it, and the client uploads the moved µ_p for Eq. 9's blend.
    pub drift_compensation: bool,
    /// Train f (the adapter) in the first task only and the classifier alone after it, as
    /// FeTrIL, whose translation Eq. 8 is, does: the stored µ_p then stay where f puts class p.
    pub freeze_after_first_task: bool,
}

/// What FedProK's pseudo-features train.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplayInto {
    #[default]
    /// The whole net: f and the classifier.
    Network,
    /// The classifier alone, f(x_n) detached.
    Classifier,
}

impl Default for FedProKConfig {
    fn default() -> Self {
        Self {
            beta: 0.5,
            replay_ratio: 1.0,
            replay_into: ReplayInto::Network,
            drift_compensation: false,
            freeze_after_first_task: false,
        }
    }
}

/// FedEvolve (evolving shifts): representation and prototype alignment across domains.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedEvolveConfig {
    /// Temperature of the softmax over distances (Eq. 4).
    pub temperature: f32,
    /// The alignment's and prediction's distance.
    pub distance: Distance,
}

impl Default for FedEvolveConfig {
    fn default() -> Self {
        Self { temperature: 1.0, distance: Distance::Euclidean }
    }
}

/// FedEvp: evolving prototypes with a personalized head.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedEvpConfig {
    /// Weight of the prototype loss beside cross-entropy (Eq. 7).
    pub proto_weight: f32,
    /// Personalization epochs of the head.
    pub personal_epochs: u32,
    /// The class means the features are aligned to (Eq. 6–7): Eq. 5's evolving prototype, or
    /// a target nearer the unseen domain.
    pub alignment: FedEvpAlignment,
}

/// What FedEvp aligns a sample's features to, per class, from the source domains' class means
/// mean_1 … mean_M in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FedEvpAlignment {
    /// Eq. 5: C_M = (M−1)/M · C_{M−1} + 1/M · mean_M, the equal-weight mean over every domain.
    #[default]
    Evolving,
    /// mean_M: the last source domain's, the one next to the target.
    Latest,
    /// mean_M + (mean_M − mean_{M−1}): one step of the drift past the last source domain, the
    /// target's mean were the drift linear (mean_M with one domain).
    Extrapolated,
}

impl Default for FedEvpConfig {
    fn default() -> Self {
        Self { proto_weight: 1.0, personal_epochs: 1, alignment: FedEvpAlignment::Evolving }
    }
}

/// What FedTA's global model predicts with.
/// - `prototypes`: the nearest global prototype by cosine on the frozen-feature part of F_TA
///   (our first reading; the BGPS picks are then the global model's classifier).
/// - `head`: the global IE and the devices' stage-1 IE heads averaged, as the authors' code
///   evaluates its global model on the global test set (`fed_avg_head`,
///   `evaluate_on_global_testset`); the devices upload their IE head and never load the average,
///   so the global prototypes serve only as the tail anchors' training targets (Eq. 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FedTaPrediction {
    #[default]
    /// The nearest global prototype, by cosine on the frozen-feature part of F_TA.
    Prototypes,
    /// The global IE with the devices' stage-1 IE heads averaged.
    Head,
}

/// FedTA (Yu et al.): input enhancement, tail anchors, SIKF and BGPS.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FedTaConfig {
    /// Weight of the key pull of the input-enhancement pool in stage 1 (Eq. 3).
    pub lambda1: f32,
    /// Weight of the InfoNCE loss against the global prototypes in stage 2 (Eq. 5).
    pub lambda2: f32,
    /// Weight of the tail-anchor key pull in stage 2 (Eq. 6).
    pub lambda3: f32,
    /// τ of the InfoNCE (Eq. 5).
    pub temperature: f32,
    /// M, enhancement sets in the input-enhancement pool.
    pub ie_pool: u32,
    /// Length of one enhancement set (prompt tokens for a ViT; border width in pixels for pixel
    /// prompts on a convolutional backbone).
    pub ie_length: u32,
    /// N, enhancement sets applied per input (the top N by key similarity).
    pub ie_top_n: u32,
    /// Local epochs of stage 1 (the input enhancement, through the frozen backbone); stage 2
    /// (anchors and head, on cached features) runs the round's `local_epochs`.
    pub ie_epochs: u32,
    /// Tail anchors in the key/value pool (Eq. 4).
    pub anchors: u32,
    /// Width of an anchor value (appended to the frozen feature).
    pub anchor_dim: u32,
    /// Best Global Prototype Selection locks a class whose chosen score falls below this (Eq. 10).
    pub lock_threshold: f32,
    /// Epochs E of Selective Input Knowledge Fusion on the server's surrogate set (Eq. 8).
    pub sikf_epochs: u32,
    /// Adam learning rate of Selective Input Knowledge Fusion.
    pub sikf_learning_rate: f32,
    /// L2 weight decay of the local Adam optimizer.
    pub weight_decay: f32,
    /// Ablation switch: tail anchors (off: the head reads the frozen feature alone).
    pub tail_anchors: bool,
    /// Ablation switch: Selective Input Knowledge Fusion (off: the server averages IE).
    pub sikf: bool,
    /// Ablation switch: Best Global Prototype Selection (off: count-weighted mean of the uploads).
    pub bgps: bool,
    /// Also upload the tail anchors and the head, averaged by the server, so the global model
    /// predicts with global anchors (off, the paper's default: they stay on the device).
    pub share_tail: bool,
    /// The cross-entropy of both stages runs over the current task's classes only (the "train
    /// mask" of the prompt-based learners FedTA builds on, L2P and DualPrompt), so training a new
    /// task does not push down the head's logits of the old classes.
    pub train_mask: bool,
    /// What the global model predicts with ([`FedTaPrediction`]).
    pub prediction: FedTaPrediction,
}

impl Default for FedTaConfig {
    fn default() -> Self {
        Self {
            lambda1: 0.1,
            lambda2: 0.1,
            lambda3: 0.1,
            temperature: 1.0,
            ie_pool: 10,
            ie_length: 10,
            ie_top_n: 5,
            ie_epochs: 1,
            anchors: 100,
            anchor_dim: 64,
            lock_threshold: 0.25,
            sikf_epochs: 2,
            sikf_learning_rate: 1e-3,
            weight_decay: 0.0,
            tail_anchors: true,
            sikf: true,
            bgps: true,
            share_tail: false,
            train_mask: true,
            prediction: FedTaPrediction::Prototypes,
        }
    }
}
