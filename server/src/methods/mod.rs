//! Server halves of the methods. A method consumes the round's updates and produces the next
//! global state; it knows nothing of transport. Which half a config gets is [`build_with`]'s
//! match on [`MethodConfig`] (CONTRIBUTING.md, "Add a method").

mod fedavg;
mod fedavgm;
mod fedta;
mod prototypes;

use anchorage_shared::protocol::Update;
use anchorage_shared::prototype::Prototype;
use anchorage_shared::tensor::ParamBlock;

pub use fedavg::{FedAvg, LocalOnly, average_blocks};
pub use fedavgm::FedAvgM;
pub use fedta::{Distilled, FedTaServer, IeAggregation, InputDistiller};
pub use prototypes::{PrototypeMethod, PrototypeRule, uploaded_prototypes};

use anchorage_shared::method::MethodConfig;

pub use crate::aggregate::AggregationRule;

/// Why a method could not aggregate a round.
#[derive(Debug, thiserror::Error)]
pub enum MethodError {
    #[error("no updates to aggregate")]
    Empty,
    #[error("block `{0}` could not be averaged: its clients disagree on its length")]
    Inconsistent(String),
    #[error(transparent)]
    Aggregate(#[from] crate::aggregate::AggregateError),
    #[error(transparent)]
    Tensor(#[from] anchorage_shared::tensor::TensorError),
    #[error("stored method state is unreadable: {0}")]
    State(String),
}

/// A method's state as the bytes `ServerMethod::save_state` stores.
pub(crate) fn encode_state<S: serde::Serialize>(state: &S) -> Vec<u8> {
    postcard::to_allocvec(state).unwrap_or_default()
}

/// Bytes from [`encode_state`] back into `state`; no bytes (nothing stored yet) leave it as it is.
pub(crate) fn decode_state<S: serde::de::DeserializeOwned>(bytes: &[u8], state: &mut S) -> Result<(), MethodError> {
    if !bytes.is_empty() {
        *state = postcard::from_bytes(bytes).map_err(|e| MethodError::State(e.to_string()))?;
    }
    Ok(())
}

/// The server half of a federated method (Flower's `Strategy::aggregate_fit`).
pub trait ServerMethod: Send {
    /// Name clients must announce in their capabilities (`fedavg`, ...).
    fn name(&self) -> &'static str;

    /// Next global shared blocks from the current ones and the round's updates (client id, update).
    fn aggregate(
        &mut self,
        round: &RoundInfo,
        global: &[ParamBlock],
        updates: &[(&str, &Update)],
    ) -> Result<Vec<ParamBlock>, MethodError>;

    /// Global prototypes to broadcast with the next round (none for FedAvg).
    fn prototypes(&self) -> Vec<Prototype> {
        Vec::new()
    }

    /// The method's own durable state (global prototypes, locks), stored in the checkpoint.
    fn save_state(&self) -> Vec<u8> {
        Vec::new()
    }

    /// Changes the round's plan (Flower's `configure_fit`): whom to invite of `ctx.available`
    /// and the settings each gets. The engine's `[engine.policy]` made `plan` first; by default
    /// it stands.
    fn configure_round(&mut self, _ctx: &crate::engine::RoundContext, _plan: &mut crate::engine::RoundPlan) {}

    /// Restores [`ServerMethod::save_state`]'s bytes after a restart.
    fn load_state(&mut self, _state: &[u8]) -> Result<(), MethodError> {
        Ok(())
    }
}

/// Where in the task stream the round being aggregated is, and how its blocks are combined.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundInfo {
    pub round: u64,
    /// 0-based task of the round.
    pub task: u32,
    /// The last round of its task (FedTA skips SIKF there).
    pub last_of_task: bool,
    /// The configured aggregation rule (`[engine.robust]`), for [`average_blocks`].
    pub rule: AggregationRule,
}

/// The server half of the method `name` with its default hyperparameters (`None`: no such method).
pub fn by_name(name: &str) -> Option<Box<dyn ServerMethod>> {
    MethodConfig::named(name).map(|config| build(&config))
}

/// The server half of `config`. FedTA gets no distiller here (its IE is averaged); see
/// [`build_with`].
pub fn build(config: &MethodConfig) -> Box<dyn ServerMethod> {
    build_with(config, Parts::default())
}

/// What a server half may be handed by whoever builds it, beyond its config: objects that need
/// tensors or data the server crate does not carry.
#[derive(Default)]
pub struct Parts {
    /// FedTA's SIKF (Eq. 8): the frozen backbone on a surrogate set.
    pub distiller: Option<Box<dyn InputDistiller>>,
}

/// The server half of `config`, with the parts the caller built (see [`Parts`]).
pub fn build_with(config: &MethodConfig, parts: Parts) -> Box<dyn ServerMethod> {
    let name = config.name();
    match config {
        MethodConfig::FedAvg(_) | MethodConfig::FedProx(_) | MethodConfig::FedRep(_) => Box::new(FedAvg::named(name)),
        MethodConfig::FedAvgM(c) => Box::new(FedAvgM::new(c.clone())),
        MethodConfig::Local(_) => Box::new(LocalOnly),
        MethodConfig::Gldp(c) => Box::new(PrototypeMethod::new(name, PrototypeRule::Fuse { beta: c.beta })),
        MethodConfig::FedProK(c) => Box::new(PrototypeMethod::new(name, PrototypeRule::Fuse { beta: c.beta })),
        MethodConfig::FedEvolve(_) | MethodConfig::FedEvp(_) => {
            Box::new(PrototypeMethod::new(name, PrototypeRule::Latest))
        }
        MethodConfig::FedTa(c) => Box::new(FedTaServer::new(c.clone(), parts.distiller)),
    }
}
