//! `client.toml`: what an operator writes to run `anchorage-client` on a device.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::train::OptimizerKind;

/// Where the client's training data comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "source", rename_all = "snake_case", deny_unknown_fields)]
pub enum DataSource {
    /// The embedded procedural set (no files): this client's Dirichlet share of it.
    Synthetic { seed: u64, clients: usize, index: usize, alpha: f64 },
}

/// Reconnect backoff, in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReconnectConfig {
    pub initial_ms: u64,
    pub max_ms: u64,
}

impl Default for ReconnectConfig {
    fn default() -> Self {
        Self { initial_ms: 200, max_ms: 30_000 }
    }
}

/// The client's configuration file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientConfig {
    pub server: SocketAddr,
    #[serde(default = "default_server_name")]
    pub server_name: String,
    /// The server's certificate (DER) this client pins.
    pub server_cert: PathBuf,
    pub client_id: String,
    /// Durable state: the unacknowledged update survives restarts here.
    pub state_dir: PathBuf,
    /// `cpu` (flex), `ndarray`, `wgpu`, `vulkan`, `cuda:N` or `auto` (see [`crate::device`]).
    #[serde(default = "default_device")]
    pub device: String,
    /// Memory announced to the server (capabilities).
    #[serde(default = "default_memory")]
    pub memory_mb: u32,
    /// Memory budget for training: bounds the batch size and the feature cache (see
    /// [`crate::memory::plan`]); unset: no bound.
    #[serde(default)]
    pub max_memory_mb: Option<u32>,
    /// Upload encoding: f32, f16, bf16, int8.
    #[serde(default = "default_encoding")]
    pub encoding: String,
    #[serde(default)]
    pub optimizer: OptimizerKind,
    pub data: DataSource,
    /// The method's name and hyperparameters (default: FedAvg); must match the server's.
    #[serde(default)]
    pub method: anchorage_shared::method::MethodConfig,
    #[serde(default)]
    pub reconnect: ReconnectConfig,
}

fn default_server_name() -> String {
    "localhost".into()
}
fn default_device() -> String {
    "cpu".into()
}
fn default_memory() -> u32 {
    1024
}
fn default_encoding() -> String {
    "f32".into()
}

impl ClientConfig {
    pub fn load(path: &std::path::Path) -> anyhow::Result<Self> {
        use anyhow::Context;
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn example_config_parses() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/client.toml");
        let config = super::ClientConfig::load(&path).unwrap();
        assert_eq!(config.device, "cpu");
        assert!(matches!(config.data, super::DataSource::Synthetic { clients: 4, .. }));
    }
}
