//! anchorage-client: the edge runtime. The models it trains (backbones, nets, the feature
//! cache, the training loop, the device choice) are `anchorage-model`'s.
//!
//! - [`session`]: the sans-IO state machine of a client's life.
//! - [`methods`]: client halves of the methods.
//! - [`config`]: the `client.toml` file.
//! - [`doctor`]: `anchorage-client doctor`, the checks before a device's service starts.
//! - [`eligibility`]: whether the device should train now (power, heat, network, time, load).
//! - [`check_config`]: `anchorage-client check-config`, the same checks of the files, off the network.
//! - [`runner`]: from a `client.toml` to a running device (what `anchorage-client` runs).
//! - [`transport`]: the quinn shell with reconnect and resend.
//! - [`broadcasts`]: broadcasts that resume after a lost connection.
//! - [`store`]: the durable local state (the unacknowledged update).
//! - [`memory`]: the process's peak memory, reported with every update.
//! - [`metrics`]: the device's own metrics, written as a Prometheus textfile for node_exporter.
//! - [`compress`]: smaller updates for any method (top-k with error feedback, zstd).
//! - [`privacy`]: the device's half of differential privacy (`[privacy]`: clipped prototype
//!   sums, local noise, the prototypes' form).

pub mod broadcasts;
pub mod check_config;
pub mod compress;
pub mod config;
pub mod doctor;
pub mod eligibility;
pub mod encoding;
pub mod memory;
pub mod methods;
pub mod metrics;
pub mod privacy;
pub mod runner;
pub mod session;
pub mod share;
pub mod store;
pub mod transport;
