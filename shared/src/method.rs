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
        }
    }
}

impl MethodConfig {
    /// The defaults for `name`.
    pub fn named(name: &str) -> Self {
        Self { name: name.into(), ..Self::default() }
    }
}
