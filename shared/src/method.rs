//! The hyperparameters of every method, in one flat table (`[method]` of a scenario file, the
//! `method` section of the server and client configs). Both halves read the same values; each
//! method uses the fields its paper defines and ignores the rest.

use alloc::string::String;
use serde::{Deserialize, Serialize};

/// Distance used by FedEvolve's alignment (Eq. 4) and prototype prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Distance {
    #[default]
    Euclidean,
    Cosine,
}

/// Which prototypes GLDP predicts with (Eq. 13): the client's own (GLDP-LP) or the global ones (GLDP-GP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrototypeSource {
    Local,
    #[default]
    Global,
}

/// One method's name and hyperparameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MethodConfig {
    /// `fedavg`, `fedprox`, `fedrep`, `local`, `gldp`, `fedprok`, `fedevolve`, `fedevp`, `fedta`.
    pub name: String,
    /// Prototype moving-average / fusion blend β (GLDP Eq. 9 and 11, FedProK Eq. 9).
    pub beta: f32,
    /// GLDP's weight λ of L_LP against (1−λ) of L_GP (Eq. 12).
    pub lambda: f32,
    /// Weight of the prototype loss beside cross-entropy (GLDP Eq. 12's second term, FedEvp Eq. 7).
    pub proto_weight: f32,
    /// FedProx proximal coefficient µ.
    pub mu: f32,
    /// GLDP: local epochs of the shared representation µ (t); the personal layer ν gets
    /// `local_epochs − t` (s). FedRep: epochs of the body after the head's.
    pub shared_epochs: u32,
    /// FedRep: epochs of the personal head before the body; FedEvp: personalization epochs.
    pub personal_epochs: u32,
    /// Temperature of softmax-over-distance losses (FedEvolve Eq. 4, GLDP Eq. 7, FedTA Eq. 5).
    pub temperature: f32,
    /// FedEvolve's distance.
    pub distance: Distance,
    /// GLDP's prediction prototypes (Eq. 13).
    pub prediction: PrototypeSource,
    /// FedProK: pseudo-features replayed per old class and batch, as a multiple of the batch's real ones.
    pub replay_ratio: f32,
    /// FedTA: weight of the key pull of the input-enhancement pool in stage 1 (Eq. 3).
    pub lambda1: f32,
    /// FedTA: weight of the InfoNCE loss against the global prototypes in stage 2 (Eq. 5).
    pub lambda2: f32,
    /// FedTA: weight of the tail-anchor key pull in stage 2 (Eq. 6).
    pub lambda3: f32,
    /// FedTA: M, enhancement sets in the input-enhancement pool.
    pub ie_pool: u32,
    /// FedTA: length of one enhancement set (prompt tokens for a ViT; border width in pixels for
    /// pixel prompts on a convolutional backbone).
    pub ie_length: u32,
    /// FedTA: N, enhancement sets applied per input (the top N by key similarity).
    pub ie_top_n: u32,
    /// FedTA: local epochs of stage 1 (the input enhancement, through the frozen backbone); stage 2
    /// (anchors and head, on cached features) runs the round's `local_epochs`.
    pub ie_epochs: u32,
    /// FedTA: tail anchors in the key/value pool (Eq. 4).
    pub anchors: u32,
    /// FedTA: width of an anchor value (appended to the frozen feature).
    pub anchor_dim: u32,
    /// FedTA: Best Global Prototype Selection locks a class whose chosen score falls below this (Eq. 10).
    pub lock_threshold: f32,
    /// FedTA: epochs E of Selective Input Knowledge Fusion on the server's surrogate set (Eq. 8).
    pub sikf_epochs: u32,
    /// FedTA: Adam learning rate of Selective Input Knowledge Fusion.
    pub sikf_learning_rate: f32,
    /// FedTA: L2 weight decay of the local Adam optimizer.
    pub weight_decay: f32,
    /// FedTA ablation switch: tail anchors (off: the head reads the frozen feature alone).
    pub tail_anchors: bool,
    /// FedTA ablation switch: Selective Input Knowledge Fusion (off: the server averages IE).
    pub sikf: bool,
    /// FedTA ablation switch: Best Global Prototype Selection (off: count-weighted mean of the uploads).
    pub bgps: bool,
    /// FedTA: also upload the tail anchors and the head, averaged by the server, so the global
    /// model predicts with global anchors (off, the paper's default: they stay on the device).
    pub share_tail: bool,
    /// FedTA: the cross-entropy of both stages runs over the current task's classes only (the
    /// "train mask" of the prompt-based learners FedTA builds on, L2P and DualPrompt), so
    /// training a new task does not push down the head's logits of the old classes.
    pub train_mask: bool,
}

impl Default for MethodConfig {
    fn default() -> Self {
        Self {
            name: "fedavg".into(),
            beta: 0.5,
            lambda: 0.5,
            proto_weight: 1.0,
            mu: 0.01,
            shared_epochs: 1,
            personal_epochs: 1,
            temperature: 1.0,
            distance: Distance::Euclidean,
            prediction: PrototypeSource::Global,
            replay_ratio: 1.0,
            lambda1: 0.1,
            lambda2: 0.1,
            lambda3: 0.1,
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
        }
    }
}

impl MethodConfig {
    /// The defaults for `name`.
    pub fn named(name: &str) -> Self {
        Self { name: name.into(), ..Self::default() }
    }
}

/// FedTA's block names on the wire, for both halves.
pub mod fedta_blocks {
    /// The input-enhancement pool: keys `[M, D]` and sets `[M, set_len]`.
    pub const IE_PREFIX: &str = "ie.";
    pub const IE_KEYS: &str = "ie.keys";
    pub const IE_SETS: &str = "ie.sets";
    /// A shared tail (`share_tail`): anchor keys `[A, D]` and values `[A, V]`, and the head.
    pub const TAIL_PREFIX: &str = "tail.";
    pub const TAIL_KEYS: &str = "tail.keys";
    pub const TAIL_VALUES: &str = "tail.values";
    pub const TAIL_HEAD_WEIGHT: &str = "tail.head.weight";
    pub const TAIL_HEAD_BIAS: &str = "tail.head.bias";
    /// Beside a shared tail: how many of the client's samples took each anchor in the round `[A]`
    /// (the server averages each anchor over the clients that trained it, and drops this block).
    pub const TAIL_TRAINED: &str = "tail.trained";
}
