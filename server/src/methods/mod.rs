//! Server halves of the methods. A method consumes the round's updates and produces the next
//! global state; it knows nothing of transport. A new method is a file here, a file in the
//! client's `methods/`, and one line in [`by_name`].

mod fedavg;

use anchorage_shared::protocol::Update;
use anchorage_shared::prototype::Prototype;
use anchorage_shared::tensor::ParamBlock;

pub use fedavg::FedAvg;

/// Why a method could not aggregate a round.
#[derive(Debug, thiserror::Error)]
pub enum MethodError {
    #[error("no updates to aggregate")]
    Empty,
    #[error("block `{0}` could not be averaged: its clients disagree on its length")]
    Inconsistent(String),
    #[error(transparent)]
    Tensor(#[from] anchorage_shared::tensor::TensorError),
}

/// The server half of a federated method (Flower's `Strategy::aggregate_fit`).
pub trait ServerMethod: Send {
    /// Name clients must announce in their capabilities (`fedavg`, ...).
    fn name(&self) -> &'static str;

    /// Next global shared blocks from the current ones and the round's updates (client id, update).
    fn aggregate(&mut self, global: &[ParamBlock], updates: &[(&str, &Update)])
    -> Result<Vec<ParamBlock>, MethodError>;

    /// Global prototypes to broadcast with the next round (none for FedAvg).
    fn prototypes(&self) -> Vec<Prototype> {
        Vec::new()
    }
}

/// The method registry: a server half by name.
pub fn by_name(name: &str) -> Option<Box<dyn ServerMethod>> {
    match name {
        "fedavg" => Some(Box::new(FedAvg::default())),
        _ => None,
    }
}

/// Names of every registered method.
pub const METHODS: &[&str] = &["fedavg"];
