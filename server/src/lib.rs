//! anchorage-server: the coordinator.
//!
//! - [`engine`]: the sans-IO round engine.
//! - [`aggregate`]: robust aggregation rules and update screening, shared by every method.
//! - [`methods`]: server halves of the methods (aggregation, prototype rules).
//! - [`transport`]: the quinn endpoint driving the engine.
//! - [`relay`]: the relay role, the engine with a parent: partial aggregates.
//! - [`store`]: durable server state in SQLite (rounds, accepted updates, versions, clients, ledger).
//! - [`service`]: the `anchorage-server` program (config, logging, signals, systemd notifications).
//! - [`metrics`]: counters and their Prometheus exposition over HTTP.
//! - [`check_config`]: `anchorage-server check-config`, every file of a server.toml checked before a start.
//! - [`tls`]: rustls configs and client-certificate verification (the CA, ids from certificates
//!   and identities on disk are `anchorage_pki`'s).
//! - `sikf` (feature `sikf`): FedTA's distillation on burn, for the standalone server.

pub mod aggregate;
pub mod check_config;
pub mod config;
pub mod engine;
pub mod methods;
pub mod metrics;
pub mod model_file;
pub mod relay;
pub mod service;
#[cfg(feature = "sikf")]
pub mod sikf;
pub mod store;
pub mod tls;
pub mod transport;

pub use engine::{Action, Checkpoint, ClientId, Engine, EngineConfig, RoundReport};
