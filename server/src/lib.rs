//! anchorage-server: the coordinator.
//!
//! - [`engine`]: the sans-IO round engine.
//! - [`methods`]: server halves of the methods (aggregation, prototype rules).
//! - [`transport`]: the quinn endpoint driving the engine.
//! - [`store`]: durable server state (atomic checkpoint files).
//! - [`tls`]: certificates for development and pinning.

pub mod config;
pub mod engine;
pub mod methods;
pub mod store;
pub mod tls;
pub mod transport;

pub use engine::{Action, Checkpoint, ClientId, Engine, EngineConfig, RoundReport};
