//! Client halves of the methods: consume a broadcast and local data, produce an update. They know
//! nothing of transport. A new method is a file here, a file in the server's `methods/`, and one
//! registry line on each side.

mod fedavg;

use anchorage_shared::protocol::{Broadcast, Update};

pub use fedavg::FedAvgClient;

/// Local training failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error("no local training data")]
    NoData,
}

/// The client half of a federated method (Flower's `Client::fit`).
pub trait ClientMethod: Send {
    /// Name announced in the hello; must match the server's method.
    fn name(&self) -> &'static str;
    /// Training samples held now.
    fn num_samples(&self) -> u64;
    /// Trains from the broadcast's global state and returns the update for its round.
    fn train(&mut self, broadcast: &Broadcast) -> Result<Update, TrainError>;
}

/// Names of the methods whose client half this build carries.
pub const METHODS: &[&str] = &["fedavg"];
