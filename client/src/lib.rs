//! anchorage-client: the edge runtime.
//!
//! - [`session`]: the sans-IO state machine of a client's life.
//! - [`model`]: frozen backbones, trainable named blocks, the feature cache.
//! - [`methods`]: client halves of the methods.
//! - [`train`]: the local training and evaluation loop.
//! - [`config`]: `client.toml`.
//! - [`device`]: choosing the compute device at run time.
//! - [`doctor`]: `anchorage-client doctor`, the checks before a device's service starts.
//! - [`runner`]: from a `client.toml` to a running device (what `anchorage-client` runs).
//! - [`transport`]: the quinn shell with reconnect and resend.
//! - [`store`]: the durable local state (the unacknowledged update).
//! - [`memory`]: the process's peak memory, reported with every update.

pub mod config;
pub mod device;
pub mod doctor;
pub mod encoding;
pub mod memory;
pub mod methods;
pub mod model;
pub mod runner;
pub mod session;
pub mod share;
pub mod store;
pub mod train;
pub mod transport;
