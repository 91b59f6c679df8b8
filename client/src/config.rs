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
    /// This device's share of a scenario's data split (see [`crate::share`]): every device
    /// names the same `spec` and its own `client` index.
    Scenario {
        /// Folder with the dataset files and the backbone's `weights/`.
        data_dir: PathBuf,
        /// This device's index in the split.
        client: usize,
        /// The frozen backbone (`mobilenet_v2`, `resnet20`, …; see `model::zoo`).
        backbone: String,
        /// Hidden widths of the trainable adapter on the features (empty: the head alone).
        #[serde(default)]
        hidden: Vec<usize>,
        /// Seed of the trainable model's initial weights: the same on every device.
        #[serde(default)]
        model_seed: u64,
        /// Evolving shifts (FedEvolve / FedEvp): the last `target_domains` domains are the target.
        #[serde(default)]
        evolving: bool,
        #[serde(default = "one")]
        target_domains: usize,
        /// The scenario's `[data]` table.
        spec: anchorage_data::DataSpec,
    },
}

fn one() -> usize {
    1
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

    #[test]
    fn a_scenario_share_names_the_spec_and_the_device_index() {
        let text = r#"
server = "127.0.0.1:4433"
server_cert = "cert.der"
client_id = "jetson-3"
state_dir = "state"
[method]
name = "fedta"
[data]
source = "scenario"
data_dir = "/data"
client = 3
backbone = "mobilenet_v2"
[data.spec]
dataset = "tiny-imagenet-100"
seed = 1
[data.spec.partition]
kind = "fedta"
clients = 5
tasks = 5
classes_per_task = 8
public_classes = 25
"#;
        let config: super::ClientConfig = toml::from_str(text).unwrap();
        match config.data {
            super::DataSource::Scenario { client, backbone, target_domains, evolving, spec, .. } => {
                assert_eq!((client, backbone.as_str(), target_domains, evolving), (3, "mobilenet_v2", 1, false));
                assert_eq!(spec.seed, 1);
            }
            other => panic!("{other:?}"),
        }
        let typo = text.replace("client = 3", "clinet = 3");
        assert!(toml::from_str::<super::ClientConfig>(&typo).is_err());
    }
}
