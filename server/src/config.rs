//! `server.toml`: what an operator writes to run `anchorage-server`.

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::engine::EngineConfig;
use crate::transport::Limits;

/// The server's configuration file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// UDP address to listen on.
    pub bind: SocketAddr,
    /// Method the federation runs (`fedavg`).
    pub method: String,
    /// Folder of the durable state (checkpoint). Restarting with the same folder resumes.
    pub state_dir: PathBuf,
    /// Folder of `cert.der` / `key.der`; a self-signed pair is created there if absent, and
    /// clients pin `cert.der`.
    pub tls_dir: PathBuf,
    /// Names the development certificate is issued for.
    #[serde(default = "default_names")]
    pub server_names: Vec<String>,
    #[serde(default)]
    pub engine: EngineConfig,
    #[serde(default)]
    pub limits: Limits,
    /// Address of the Prometheus endpoint (`GET /metrics`); none: no endpoint.
    #[serde(default)]
    pub metrics_bind: Option<SocketAddr>,
}

fn default_names() -> Vec<String> {
    vec!["localhost".into()]
}

impl ServerConfig {
    /// Reads and checks a config file.
    pub fn load(path: &std::path::Path) -> anyhow::Result<Self> {
        use anyhow::Context;
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let config: Self = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        anyhow::ensure!(
            crate::methods::by_name(&config.method).is_some(),
            "{}: unknown method `{}` (known: {})",
            path.display(),
            config.method,
            crate::methods::METHODS.join(", ")
        );
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn example_config_parses() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/server.toml");
        let config = super::ServerConfig::load(&path).unwrap();
        assert_eq!(config.method, "fedavg");
        assert!(config.limits.keep_alive < config.limits.idle_timeout);
    }
}
