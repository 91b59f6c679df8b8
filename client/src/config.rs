//! `client.toml`: what an operator writes to run `anchorage-client` on a device.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use anchorage_model::train::OptimizerKind;

/// Where the client's training data comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "source", rename_all = "snake_case", deny_unknown_fields)]
#[expect(clippy::large_enum_variant, reason = "read once from client.toml; boxing would only obscure the config")]
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
        /// A residual adapter (features + adapter(features)); every device must agree.
        #[serde(default)]
        residual: bool,
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

/// Reconnect backoff, in milliseconds: doubling from `initial_ms`, with jitter, up to `max_ms`.
/// A transient failure (server away, link down) backs off to minutes, so a fleet does not
/// hammer a server that is down; a definite refusal (revoked, unknown CA) ends the client instead.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReconnectConfig {
    pub initial_ms: u64,
    pub max_ms: u64,
}

impl Default for ReconnectConfig {
    fn default() -> Self {
        Self { initial_ms: 200, max_ms: 300_000 }
    }
}

/// The QUIC connection's timers, in milliseconds (`[connection]` in client.toml).
///
/// A server that restarts answers the old connection's next packet with a stateless reset, so
/// the client notices within about one keep-alive; without one, only the idle timeout ends the
/// connection. Lower keep-alives cost bytes on metered links.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConnectionConfig {
    /// A keep-alive (and the session's heartbeat) at least this often.
    pub keep_alive_ms: u64,
    /// The connection is dropped after this long without a packet from the server.
    pub idle_timeout_ms: u64,
    /// A connection attempt gives up after this long (a server that is down does not answer, and
    /// the attempt would otherwise wait out the idle timeout) and counts as a failed attempt.
    pub connect_timeout_ms: u64,
}

impl Default for ConnectionConfig {
    fn default() -> Self {
        Self { keep_alive_ms: 2_000, idle_timeout_ms: 15_000, connect_timeout_ms: 2_000 }
    }
}

impl ConnectionConfig {
    pub fn keep_alive(&self) -> Duration {
        Duration::from_millis(self.keep_alive_ms)
    }

    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// Every timer positive, the keep-alive below the idle timeout (else an idle but healthy
    /// connection times out between two keep-alives), and the idle timeout within QUIC's range.
    pub fn validate(&self) -> anyhow::Result<()> {
        let Self { keep_alive_ms, idle_timeout_ms, connect_timeout_ms } = *self;
        anyhow::ensure!(keep_alive_ms > 0, "connection.keep_alive_ms must be above 0");
        anyhow::ensure!(connect_timeout_ms > 0, "connection.connect_timeout_ms must be above 0");
        anyhow::ensure!(
            keep_alive_ms < idle_timeout_ms,
            "connection.keep_alive_ms ({keep_alive_ms}) must be below connection.idle_timeout_ms \
             ({idle_timeout_ms}): with no keep-alive within the idle timeout a quiet connection is dropped"
        );
        anyhow::ensure!(
            quinn::IdleTimeout::try_from(self.idle_timeout()).is_ok(),
            "connection.idle_timeout_ms ({idle_timeout_ms}) is out of QUIC's range"
        );
        Ok(())
    }
}

/// `[metrics]` in client.toml: the device's metrics as a Prometheus textfile for node_exporter's
/// textfile collector ([`crate::metrics`]); the device opens no port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// The file, in the collector's folder (`--collector.textfile.directory`), ending in `.prom`
    /// (the collector reads nothing else); unset: no file.
    pub textfile: Option<PathBuf>,
    /// Seconds between two writes (and once more at exit).
    pub every_s: u64,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self { textfile: None, every_s: 15 }
    }
}

impl MetricsConfig {
    pub fn every(&self) -> Duration {
        Duration::from_secs(self.every_s)
    }

    /// A positive interval, and a textfile named `*.prom`.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.every_s > 0, "metrics.every_s must be above 0");
        if let Some(path) = &self.textfile {
            anyhow::ensure!(
                path.extension().is_some_and(|e| e == "prom") && path.file_stem().is_some_and(|s| !s.is_empty()),
                "metrics.textfile = \"{}\" must end in `.prom`: node_exporter's textfile collector reads no other file",
                path.display()
            );
        }
        Ok(())
    }
}

/// The client's configuration file.
///
/// Relative paths in a file read with [`ClientConfig::load`] (`server_cert`, `cert`, `key`,
/// `state_dir`, a scenario's `data_dir`) are taken from the folder that holds the file, not from
/// the current directory, so a folder written by `anchorage provision` works wherever it is
/// copied; absolute paths are used as they are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientConfig {
    /// The server's address, `host:port`: an IP address (`10.0.0.5:4433`) or a DNS name
    /// (`server.example.org:4433`), resolved when the client starts ([`ClientConfig::server_addr`]).
    pub server: String,
    /// Other addresses of the federation (`host:port`), tried in turn when `server` cannot be
    /// reached or the connection is lost (the other relays of a tier; every relay's
    /// certificate must carry `server_name`). An update trained for a round and not yet acked
    /// goes to whichever of them the device reaches.
    #[serde(default)]
    pub fallbacks: Vec<String>,
    /// Seconds on a fallback before the device goes back to `server` (its own relay), at the
    /// first moment it holds no unacked update; a device that cannot reach it fails over again
    /// and waits as long once more.
    #[serde(default = "default_home_after_secs")]
    pub home_after_secs: u64,
    /// The name the server's certificate must carry (a DNS name or an IP address).
    #[serde(default = "default_server_name")]
    pub server_name: String,
    /// The only certificate (DER) this client trusts: the project CA's `ca.der`, or a
    /// development server's own `cert.der`.
    pub server_cert: PathBuf,
    /// This device's certificate (DER) from the project CA; the server takes the device's id
    /// from it. With `key`; both absent only against a development server (`insecure_dev`).
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// This device's private key (DER, PKCS#8; keep it mode 0600).
    #[serde(default)]
    pub key: Option<PathBuf>,
    pub client_id: String,
    /// Durable state: the unacknowledged update survives restarts here.
    pub state_dir: PathBuf,
    /// `cpu` (flex), `ndarray`, `wgpu`, `vulkan`, `cuda:N` or `auto` (see [`anchorage_model::device`]).
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
    #[serde(default)]
    pub encoding: crate::encoding::UploadEncoding,
    /// Top-k sparsification with error feedback: the fraction of each block's delta
    /// uploaded, in (0, 1]; unset: every value ([`crate::compress`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<f64>,
    /// A compressor over the encoded blocks: `zstd`; unset: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compress: Option<crate::compress::Compressor>,
    #[serde(default)]
    pub optimizer: OptimizerKind,
    pub data: DataSource,
    /// The method's name and hyperparameters (default: FedAvg); must match the server's.
    #[serde(default)]
    pub method: anchorage_shared::method::MethodConfig,
    #[serde(default)]
    pub reconnect: ReconnectConfig,
    #[serde(default)]
    pub connection: ConnectionConfig,
    /// When this device should train (`[eligibility]`: battery, temperature, metered network,
    /// a UTC window, load); absent or empty: always.
    #[serde(default)]
    pub eligibility: crate::eligibility::Eligibility,
    /// The device's metrics as a Prometheus textfile (`[metrics]`); absent: none written.
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// Differential privacy of what this device sends (`[privacy]`; must match the
    /// server's `[engine.privacy]`); absent: off. Local noise needs `noise_multiplier`
    /// ([`crate::privacy::DevicePrivacy::for_device`]).
    #[serde(default, skip_serializing_if = "anchorage_shared::privacy::PrivacyConfig::is_off")]
    pub privacy: anchorage_shared::privacy::PrivacyConfig,
    /// Secure aggregation (the server's `[engine.secagg]`): the update leaves the
    /// device only masked, and the server learns only the round's sum. Off by default.
    #[serde(default)]
    pub secure_aggregation: bool,
}

fn default_home_after_secs() -> u64 {
    60
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

impl ClientConfig {
    /// Reads and checks a config file; relative paths in it are resolved against the file's own
    /// folder (see [`ClientConfig::resolve_paths`]).
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        use anyhow::Context;
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut config: Self = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        config.validate().with_context(|| format!("checking {}", path.display()))?;
        config.resolve_paths(path.parent().unwrap_or(Path::new("")));
        Ok(config)
    }

    /// Makes every relative path (`server_cert`, `cert`, `key`, `state_dir`, a scenario's
    /// `data_dir`, `[metrics] textfile`) relative to `base` (the config file's folder); absolute
    /// paths stay as they are.
    pub fn resolve_paths(&mut self, base: &Path) {
        let fix = |p: &mut PathBuf| *p = resolve(base, p);
        fix(&mut self.server_cert);
        fix(&mut self.state_dir);
        self.cert.iter_mut().for_each(fix);
        self.key.iter_mut().for_each(fix);
        self.metrics.textfile.iter_mut().for_each(fix);
        if let DataSource::Scenario { data_dir, .. } = &mut self.data {
            fix(data_dir);
        }
    }

    /// What parsing cannot check.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.server.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok()),
            "server = \"{}\" is not `host:port` (e.g. \"server.example.org:4433\" or \"10.0.0.5:4433\")",
            self.server
        );
        self.connection.validate()?;
        self.update_compression()?;
        self.metrics.validate()?;
        self.device_privacy()?;
        self.eligibility.validate()
    }

    /// What this device does under `[privacy]` (`None`: off); refuses a table that makes no
    /// guarantee, and local noise without `noise_multiplier`.
    pub fn device_privacy(&self) -> anyhow::Result<Option<crate::privacy::DevicePrivacy>> {
        crate::privacy::DevicePrivacy::for_device(&self.privacy)
    }

    /// How the device shrinks its updates (`top_k`, `compress`, `encoding`).
    pub fn update_compression(&self) -> anyhow::Result<crate::compress::UpdateCompression> {
        crate::compress::UpdateCompression::new(self.top_k, self.compress, self.encoding.encoding())
    }

    /// The server's socket address: `server` as an IP address and port, or its host name looked
    /// up (the first address the resolver gives).
    pub fn server_addr(&self) -> anyhow::Result<SocketAddr> {
        resolve_addr(&self.server)
    }

    /// The `fallbacks`' socket addresses, each as [`ClientConfig::server_addr`] finds it.
    pub fn fallback_addrs(&self) -> anyhow::Result<Vec<SocketAddr>> {
        self.fallbacks.iter().map(|a| resolve_addr(a)).collect()
    }
}

/// `address` as an IP address and port, or its host name looked up (the first address).
fn resolve_addr(address: &str) -> anyhow::Result<SocketAddr> {
    use anyhow::Context;
    use std::net::ToSocketAddrs;
    if let Ok(addr) = address.parse() {
        return Ok(addr);
    }
    address
        .to_socket_addrs()
        .with_context(|| format!("resolving the server address `{address}`"))?
        .next()
        .with_context(|| format!("`{address}` resolves to no address"))
}

/// `path` under `base` when it is relative; as it is when absolute.
pub fn resolve(base: &Path, path: &Path) -> PathBuf {
    if path.is_absolute() { path.to_path_buf() } else { base.join(path) }
}

#[cfg(test)]
mod tests {
    /// Transient failures back off to minutes. With the default `[reconnect]`, the
    /// 12th attempt in a row waits at least 100 s, and a device that fails for an hour tries
    /// at most 30 times.
    #[test]
    fn the_default_backoff_reaches_minutes() {
        let reconnect = super::ReconnectConfig::default();
        let backoff = crate::transport::Backoff {
            initial: std::time::Duration::from_millis(reconnect.initial_ms),
            max: std::time::Duration::from_millis(reconnect.max_ms),
            max_attempts: None,
        };
        let mut rng = anchorage_shared::rng::Rng::new(1);
        assert!(backoff.delay(12, &mut rng) >= std::time::Duration::from_secs(100));
        let (mut waited, mut attempts) = (std::time::Duration::ZERO, 0);
        while waited < std::time::Duration::from_secs(3600) {
            attempts += 1;
            waited += backoff.delay(attempts, &mut rng);
        }
        assert!(attempts <= 30, "{attempts} attempts in an hour");
    }

    #[test]
    fn example_config_parses() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/client.toml");
        let config = super::ClientConfig::load(&path).unwrap();
        assert_eq!(config.device, "cpu");
        assert!(matches!(config.data, super::DataSource::Synthetic { clients: 4, .. }));
        assert_eq!(config.connection, super::ConnectionConfig::default(), "the example shows the defaults");
    }

    const MINIMAL: &str = r#"
server = "127.0.0.1:4433"
server_cert = "cert.der"
client_id = "edge-1"
state_dir = "state"
[data]
source = "synthetic"
seed = 1
clients = 2
index = 0
alpha = 0.5
"#;

    #[test]
    fn connection_timers_default_and_parse() {
        use std::time::Duration;
        let config: super::ClientConfig = toml::from_str(MINIMAL).unwrap();
        let c = &config.connection;
        assert_eq!((c.keep_alive_ms, c.idle_timeout_ms, c.connect_timeout_ms), (2_000, 15_000, 2_000));
        config.validate().unwrap();
        let text = format!("{MINIMAL}[connection]\nkeep_alive_ms = 500\nidle_timeout_ms = 4000\n");
        let config: super::ClientConfig = toml::from_str(&text).unwrap();
        let c = &config.connection;
        assert_eq!(
            (c.keep_alive(), c.idle_timeout(), c.connect_timeout()),
            (Duration::from_millis(500), Duration::from_secs(4), Duration::from_secs(2)),
            "an unset key keeps its default"
        );
        config.validate().unwrap();
        let typo = format!("{MINIMAL}[connection]\nkeepalive_ms = 500\n");
        assert!(toml::from_str::<super::ClientConfig>(&typo).is_err(), "unknown keys are refused");
    }

    #[test]
    fn connection_timers_are_checked() {
        let check = |table: &str| {
            let config: super::ClientConfig = toml::from_str(&format!("{MINIMAL}[connection]\n{table}\n")).unwrap();
            config.validate().map_err(|e| e.to_string())
        };
        let err = check("keep_alive_ms = 15000").unwrap_err();
        assert!(err.contains("keep_alive_ms (15000) must be below connection.idle_timeout_ms (15000)"), "{err}");
        assert!(check("keep_alive_ms = 3000\nidle_timeout_ms = 2000").is_err());
        assert!(check("keep_alive_ms = 0").unwrap_err().contains("keep_alive_ms must be above 0"));
        assert!(check("connect_timeout_ms = 0").unwrap_err().contains("connect_timeout_ms"));
        assert!(check("idle_timeout_ms = 9223372036854775807").unwrap_err().contains("out of QUIC's range"));
        check("keep_alive_ms = 14999").unwrap();
        // Loading a file runs the same check and names the file.
        let dir = std::env::temp_dir().join(format!("anchorage-client-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("client.toml");
        std::fs::write(&path, format!("{MINIMAL}[connection]\nkeep_alive_ms = 20000\n")).unwrap();
        let err = format!("{:#}", super::ClientConfig::load(&path).unwrap_err());
        assert!(err.contains("client.toml") && err.contains("keep_alive_ms"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn relative_paths_are_taken_from_the_config_files_folder() {
        let dir = tempfile::tempdir().unwrap();
        let site = dir.path().join("edge-1");
        std::fs::create_dir_all(&site).unwrap();
        let text = MINIMAL.to_string().replace(
            "server_cert = \"cert.der\"",
            "server_cert = \"ca.der\"\ncert = \"cert.der\"\nkey = \"/abs/key.der\"",
        );
        std::fs::write(site.join("client.toml"), text).unwrap();
        let config = super::ClientConfig::load(&site.join("client.toml")).unwrap();
        assert_eq!(config.server_cert, site.join("ca.der"));
        assert_eq!(config.cert.as_deref(), Some(site.join("cert.der").as_path()));
        assert_eq!(config.key.as_deref(), Some(std::path::Path::new("/abs/key.der")), "absolute paths stay");
        assert_eq!(config.state_dir, site.join("state"));
        assert_eq!(config.server_addr().unwrap(), "127.0.0.1:4433".parse().unwrap());
    }

    #[test]
    fn the_server_is_host_and_port() {
        let with = |server: &str| {
            let config: super::ClientConfig = toml::from_str(&MINIMAL.replace("127.0.0.1:4433", server)).unwrap();
            config.validate().map(|_| config)
        };
        assert_eq!(with("localhost:4433").unwrap().server_addr().unwrap().port(), 4433);
        assert!(with("server.example.org").is_err(), "a port is needed");
        assert!(with(":4433").is_err());
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

    #[test]
    fn the_eligibility_table_is_off_unless_written() {
        let config: super::ClientConfig = toml::from_str(MINIMAL).unwrap();
        assert_eq!(config.eligibility, crate::eligibility::Eligibility::default());
        assert!(!config.eligibility.is_enabled(), "existing configs always train");
        let text = format!("{MINIMAL}[eligibility]\nmin_battery_percent = 30\nwindow = \"22:00-06:00\"\n");
        let config: super::ClientConfig = toml::from_str(&text).unwrap();
        config.validate().unwrap();
        assert_eq!(config.eligibility.min_battery_percent, Some(30));
        assert_eq!(config.eligibility.window.map(|w| (w.start, w.end)), Some((22 * 60, 6 * 60)));
        let typo = format!("{MINIMAL}[eligibility]\nmin_battery = 30\n");
        assert!(toml::from_str::<super::ClientConfig>(&typo).is_err(), "unknown keys are refused");
        let bad_window = format!("{MINIMAL}[eligibility]\nwindow = \"22:00\"\n");
        let err = toml::from_str::<super::ClientConfig>(&bad_window).unwrap_err().to_string();
        assert!(err.contains("HH:MM-HH:MM"), "{err}");
        let over = format!("{MINIMAL}[eligibility]\nmin_battery_percent = 101\n");
        let config: super::ClientConfig = toml::from_str(&over).unwrap();
        assert!(config.validate().unwrap_err().to_string().contains("min_battery_percent"));
    }

    #[test]
    fn the_metrics_table_is_off_unless_written_and_checked() {
        let config: super::ClientConfig = toml::from_str(MINIMAL).unwrap();
        assert_eq!(config.metrics, super::MetricsConfig::default());
        assert_eq!((config.metrics.textfile.as_ref(), config.metrics.every_s), (None, 15), "no file by default");
        let with = |table: &str| {
            let config: super::ClientConfig = toml::from_str(&format!("{MINIMAL}[metrics]\n{table}\n"))?;
            config.validate().map_err(|e| anyhow::anyhow!("{e:#}"))?;
            Ok::<_, anyhow::Error>(config)
        };
        let config = with("textfile = \"/var/lib/node_exporter/textfile_collector/anchorage-client.prom\"").unwrap();
        assert_eq!(
            config.metrics.textfile.as_deref(),
            Some(std::path::Path::new("/var/lib/node_exporter/textfile_collector/anchorage-client.prom"))
        );
        assert_eq!(config.metrics.every(), std::time::Duration::from_secs(15));
        assert_eq!(with("every_s = 60").unwrap().metrics.every_s, 60);
        assert!(with("every_s = 0").unwrap_err().to_string().contains("metrics.every_s must be above 0"));
        let err = with("textfile = \"/var/lib/node_exporter/textfile_collector/anchorage.txt\"").unwrap_err();
        assert!(err.to_string().contains("must end in `.prom`"), "{err}");
        assert!(with("text_file = \"a.prom\"").is_err(), "unknown keys are refused");
        // A relative textfile is taken from the config file's folder, like the other paths.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("client.toml"), format!("{MINIMAL}[metrics]\ntextfile = \"m/a.prom\"\n"))
            .unwrap();
        let config = super::ClientConfig::load(&dir.path().join("client.toml")).unwrap();
        assert_eq!(config.metrics.textfile, Some(dir.path().join("m/a.prom")));
    }

    /// deploy/client.toml's commented `[metrics]` example parses once uncommented.
    #[test]
    fn the_example_metrics_table_parses() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/client.toml");
        let text = std::fs::read_to_string(path).unwrap();
        let table: String = text
            .lines()
            .skip_while(|l| *l != "# [metrics]")
            .skip(1)
            .map_while(|l| l.strip_prefix("# "))
            .map(|l| format!("{l}\n"))
            .collect();
        let example: super::MetricsConfig = toml::from_str(&table).unwrap();
        example.validate().unwrap();
        assert!(example.textfile.is_some(), "{table}");
    }

    /// deploy/client.toml's commented `[privacy]` example parses once uncommented, and the device
    /// accepts it.
    #[test]
    fn the_example_privacy_table_parses() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/client.toml");
        let text = std::fs::read_to_string(path).unwrap();
        let table: String = text
            .lines()
            .skip_while(|l| *l != "# [privacy]")
            .skip(1)
            .map_while(|l| l.strip_prefix("# "))
            .map(|l| format!("{l}\n"))
            .collect();
        let example: anchorage_shared::privacy::PrivacyConfig = toml::from_str(&table).unwrap();
        let device = crate::privacy::DevicePrivacy::for_device(&example).unwrap().unwrap();
        assert!(example.is_on() && device.noise_multiplier.is_some(), "{table}");
        let parsed: super::ClientConfig = toml::from_str(&format!("{MINIMAL}[privacy]\n{table}")).unwrap();
        parsed.validate().unwrap();
        assert_eq!(parsed.privacy, example);
        let minimal: super::ClientConfig = toml::from_str(MINIMAL).unwrap();
        assert!(minimal.privacy.is_off() && minimal.device_privacy().unwrap().is_none(), "absent: off");
    }

    /// deploy/client.toml's commented `secure_aggregation` line turns it on once uncommented.
    #[test]
    fn the_example_secure_aggregation_line_parses() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/client.toml");
        let text = std::fs::read_to_string(path).unwrap();
        let line = text.lines().find_map(|l| l.strip_prefix("# secure_aggregation")).expect("the example line");
        let parsed: super::ClientConfig = toml::from_str(&format!("secure_aggregation{line}\n{MINIMAL}")).unwrap();
        assert!(parsed.secure_aggregation);
        let minimal: super::ClientConfig = toml::from_str(MINIMAL).unwrap();
        assert!(!minimal.secure_aggregation, "absent: off");
    }

    /// deploy/client.toml's commented `[eligibility]` example parses once uncommented.
    #[test]
    fn the_example_eligibility_table_parses() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/client.toml");
        let text = std::fs::read_to_string(path).unwrap();
        let table: String = text
            .lines()
            .skip_while(|l| *l != "# [eligibility]")
            .skip(1)
            .map_while(|l| l.strip_prefix("# "))
            .map(|l| format!("{l}\n"))
            .collect();
        let example: crate::eligibility::Eligibility = toml::from_str(&table).unwrap();
        example.validate().unwrap();
        assert!(example.unmetered_only && example.min_battery_percent.is_some(), "{table}");
        assert!(example.max_temperature_c.is_some() && example.window.is_some() && example.max_load.is_some());
    }
}
