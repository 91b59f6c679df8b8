//! `server.toml`: what an operator writes to run `anchorage-server`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anchorage_shared::method::MethodConfig;
use serde::{Deserialize, Serialize};

use crate::engine::EngineConfig;
use crate::transport::Limits;

/// The server's configuration file.
///
/// Relative paths in a file read with [`ServerConfig::load`] (`state_dir`, `tls_dir`, `[sikf]`'s
/// `data_dir`) are taken from the folder that holds the file, not from the current directory,
/// so a folder written by `anchorage provision` (`tls_dir = "."`, `state_dir = "state"`) works
/// wherever it is copied; absolute paths are used as they are.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// UDP address to listen on.
    pub bind: SocketAddr,
    /// Method the federation runs: a name with the paper's defaults (`method = "fedavg"`), or a
    /// `[method]` table with its hyperparameters, the same table the clients' `client.toml` and
    /// the scenario files hold (FedTA's `lock_threshold` and ablation switches, the prototype
    /// blend `beta`, …).
    pub method: MethodSection,
    /// Folder of the durable state (`anchorage.db`, SQLite). Restarting with the same folder
    /// resumes, the round that was open included.
    pub state_dir: PathBuf,
    /// Folder of the server's TLS files: `cert.der` and `key.der` (mode 0600), issued by the
    /// project CA, and the CA's `ca.der` and `revoked.crl` (re-read while running); `anchorage
    /// provision` writes them all. With `insecure_dev` only `cert.der` / `key.der`, a self-signed
    /// pair created on first start that clients pin.
    pub tls_dir: PathBuf,
    /// Development only: no client certificates, the hello names the client, and a warning at
    /// every start. Never in the field: anyone who reaches the port can join under any name.
    #[serde(default)]
    pub insecure_dev: bool,
    /// Names the development certificate is issued for (`insecure_dev` only).
    #[serde(default = "default_names")]
    pub server_names: Vec<String>,
    #[serde(default)]
    pub engine: EngineConfig,
    #[serde(default)]
    pub limits: Limits,
    /// `[store]`: how much history the database keeps.
    #[serde(default)]
    pub store: crate::store::Retention,
    /// Address of the metrics port (`GET /metrics`, `/healthz`, `/readyz`); none: no port. The
    /// same as `[metrics] bind` (give one of the two).
    #[serde(default)]
    pub metrics_bind: Option<SocketAddr>,
    /// `[metrics]`: the metrics port and how many series it may hold.
    #[serde(default)]
    pub metrics: MetricsSection,
    /// FedTA's SIKF (Eq. 8): the backbone and surrogate set the server distils on. Without it
    /// FedTA averages the clients' input enhancement, and says so in the log. Needs a server
    /// built with the `sikf` feature.
    #[serde(default)]
    pub sikf: Option<SikfSection>,
    /// The global model of round 1 (`anchorage provision` writes `initial-model.bin` from the
    /// method's own model): the model's layout comes from here, never from the first update. A
    /// server resuming from its database ignores it.
    #[serde(default)]
    pub initial_model: Option<PathBuf>,
    /// `[evaluation]`: the server's own evaluation of each new global model on the operator's
    /// held-out set (logged with the round, exported as `anchorage_round_held_out_accuracy`).
    /// Needs a server built with the `sikf` feature (the model and data crates).
    #[serde(default)]
    pub evaluation: Option<EvaluationSection>,
    /// `[parent]`: this server is a relay (`anchorage-relay`): its rounds are its
    /// parent's, and it sends each round's partial aggregate up instead of changing the model.
    /// Its certificate must carry the relay role (`anchorage ca issue relay <id>`).
    #[serde(default)]
    pub parent: Option<ParentSection>,
}

/// `[parent]`: where a relay's parent listens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParentSection {
    /// The parent's QUIC address (`host:port` resolved at start, or `IP:PORT`).
    pub address: String,
    /// The name the parent's certificate is issued for (`server` by default: the id
    /// `anchorage provision` gives the root).
    #[serde(default = "parent_name")]
    pub server_name: String,
}

fn parent_name() -> String {
    "server".into()
}

/// `[evaluation]`: which held-out data the server evaluates the global model on, and how often.
/// The prediction is the method's own (the global net's head: FedAvg, FedAvgM, FedProx, FedProK,
/// FedEvp); the data come through the same loaders and frozen backbone as the devices'.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvaluationSection {
    /// The held-out data: `{ source = "synthetic", seed = 7 }` (the embedded set's test half,
    /// which no device trains on; `seed` as in the devices' `[data]`), or `{ source = "scenario",
    /// data_dir = …, backbone = …, spec = { … } }` (a scenario's test set, as client.toml's
    /// scenario `[data]` names it).
    pub data: EvaluationData,
    /// Evaluate after every `every`-th round (and after the last one of the run).
    #[serde(default = "one")]
    pub every: u64,
    /// At most this many held-out samples, a seeded draw (0: all of them).
    #[serde(default)]
    pub max_samples: usize,
}

/// Where `[evaluation]`'s held-out samples come from: the same sources as a device's `[data]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "source", rename_all = "snake_case", deny_unknown_fields)]
pub enum EvaluationData {
    /// The embedded procedural set's test half (the devices train on shares of its training
    /// half): `seed` must be the devices' `[data] seed`.
    Synthetic {
        #[serde(default = "synthetic_seed")]
        seed: u64,
    },
    /// A scenario's test set through the devices' frozen backbone and net (every field as in the
    /// devices' `[data]` with `source = "scenario"`).
    Scenario {
        /// Folder with the dataset files and the backbone's `weights/`.
        data_dir: PathBuf,
        /// The devices' frozen backbone (`mobilenet_v2`, `resnet20`, `identity`, …).
        backbone: String,
        #[serde(default)]
        hidden: Vec<usize>,
        #[serde(default)]
        residual: bool,
        #[serde(default)]
        model_seed: u64,
        /// The scenario's `[data]` table.
        spec: toml::Table,
    },
}

fn one() -> u64 {
    1
}

/// The embedded set's default seed (`anchorage_data::SyntheticConfig`'s).
fn synthetic_seed() -> u64 {
    7
}

/// `[metrics]`: Prometheus metrics and the health probes on one HTTP port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSection {
    /// Address of `GET /metrics`, `/healthz` and `/readyz`; none: no port. Keep it on loopback
    /// unless something restricts who reaches it (`--metrics-bind` overrides it).
    pub bind: Option<SocketAddr>,
    /// Whether `/metrics` names devices (`anchorage_device_last_seen_timestamp_seconds{device}`);
    /// off by default, since whoever reads the port would learn every device id.
    pub device_ids: bool,
    /// With `device_ids`: devices with their own last-seen series, the longest silent first (a
    /// fleet beyond it is still counted in `anchorage_devices_silent`).
    pub device_series: usize,
}

impl Default for MetricsSection {
    fn default() -> Self {
        Self { bind: None, device_ids: false, device_series: crate::metrics::DEFAULT_DEVICE_SERIES }
    }
}

/// An `IP:PORT` address; a bare IPv6 address before the last `:` works too (`fd00::5:9464`, what
/// `$(POD_IP):9464` gives on an IPv6 pod).
pub fn parse_bind(text: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = text.parse() {
        return Ok(addr);
    }
    let bad = || format!("`{text}` is not IP:PORT (e.g. 127.0.0.1:9464)");
    let (ip, port) = text.rsplit_once(':').ok_or_else(bad)?;
    Ok(SocketAddr::new(ip.parse().map_err(|_| bad())?, port.parse().map_err(|_| bad())?))
}

/// `[sikf]`: what FedTA's server half distils the clients' input enhancement on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SikfSection {
    /// The clients' frozen backbone, by name (`mobilenet_v2`, `resnet20`, …).
    pub backbone: String,
    /// Folder with the backbone's `weights/` and the dataset files.
    pub data_dir: PathBuf,
    /// A scenario's `[data]` table with a `fedta` partition: the server takes its split's
    /// surrogate set (`surrogate_per_class` test images per class).
    pub data: toml::Table,
    /// Batch size of the distillation.
    #[serde(default = "default_sikf_batch")]
    pub batch_size: usize,
    /// Seed of the distillation's batch order.
    #[serde(default)]
    pub seed: u64,
}

fn default_sikf_batch() -> usize {
    16
}

/// `method`: a name or a whole table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MethodSection {
    Name(String),
    Table(MethodConfig),
}

impl MethodSection {
    /// The method's hyperparameters (a bare name: that method's defaults).
    pub fn config(&self) -> anyhow::Result<MethodConfig> {
        match self {
            Self::Name(name) => MethodConfig::named(name)
                .ok_or_else(|| anyhow::anyhow!("unknown method `{name}` (known: {})", anchorage_shared::method::Names)),
            Self::Table(config) => Ok(config.clone()),
        }
    }
}

fn default_names() -> Vec<String> {
    vec!["localhost".into()]
}

impl ServerConfig {
    /// The metrics port's address: `metrics_bind` or `[metrics] bind`.
    pub fn metrics_address(&self) -> Option<SocketAddr> {
        self.metrics.bind.or(self.metrics_bind)
    }

    /// Reads and checks a config file; relative paths in it are resolved against the file's own
    /// folder (see [`ServerConfig::resolve_paths`]).
    pub fn load(path: &std::path::Path) -> anyhow::Result<Self> {
        use anyhow::Context;
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut config = Self::parse(&text).with_context(|| format!("parsing {}", path.display()))?;
        config.resolve_paths(path.parent().unwrap_or(std::path::Path::new("")));
        Ok(config)
    }

    /// Makes every relative path (`state_dir`, `tls_dir`, `[sikf]`'s `data_dir`) relative to
    /// `base` (the config file's folder); absolute paths stay as they are.
    pub fn resolve_paths(&mut self, base: &std::path::Path) {
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        fix(&mut self.state_dir);
        fix(&mut self.tls_dir);
        if let Some(model) = &mut self.initial_model {
            fix(model);
        }
        if let Some(sikf) = &mut self.sikf {
            fix(&mut sikf.data_dir);
        }
        if let Some(EvaluationSection { data: EvaluationData::Scenario { data_dir, .. }, .. }) = &mut self.evaluation {
            fix(data_dir);
        }
    }

    /// Parses and checks the text of a config file.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        use anyhow::Context;
        // A `[method]` table is read on its own first: an untagged section would only say that
        // neither form matched, where the table's own error names the field.
        let table: toml::Table = toml::from_str(text)?;
        if let Some(toml::Value::Table(method)) = table.get("method") {
            toml::Value::Table(method.clone()).try_into::<MethodConfig>().context("[method]")?;
        }
        let config: Self = toml::from_str(text)?;
        anyhow::ensure!(
            config.metrics_bind.is_none() || config.metrics.bind.is_none(),
            "server.toml gives both metrics_bind and [metrics] bind: keep one"
        );
        let method = config.method.config()?;
        let mut engine = config.engine.clone();
        if config.parent.is_some() {
            engine.role = crate::engine::Role::Relay;
        }
        crate::engine::compat::check(&engine, &method).map_err(anyhow::Error::msg)?;
        anyhow::ensure!(
            config.sikf.is_none() || matches!(method, MethodConfig::FedTa(_)),
            "[sikf] is FedTA's distillation; this server runs `{}`",
            method.name()
        );
        if let Some(evaluation) = &config.evaluation {
            anyhow::ensure!(evaluation.every >= 1, "[evaluation] every must be 1 or more (1: after every round)");
            use anchorage_shared::method::Prediction;
            let predicts = method.info().predicts_with;
            anyhow::ensure!(
                predicts == Prediction::Head,
                "[evaluation]: `{}` {}; the server evaluates methods that predict with the global net's head \
                 (fedavg, fedavgm, fedprox, fedprok, fedevp): remove [evaluation], and read the devices' own \
                 accuracy (anchorage_round_device_accuracy)",
                method.name(),
                match predicts {
                    Prediction::None => "has no global model to evaluate (each device predicts with its own)",
                    _ => "predicts with the nearest global prototype, which only the devices' code computes",
                }
            );
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn example_config_parses() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/server.toml");
        let config = ServerConfig::load(&path).unwrap();
        assert_eq!(config.method, MethodSection::Name("fedavg".into()));
        assert!(config.limits.keep_alive < config.limits.idle_timeout);
    }

    /// A misspelt key in `[engine.round]` is refused at load, naming the key (it was silently
    /// ignored, and the devices trained with the default).
    #[test]
    fn a_typo_in_engine_round_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/server.toml");
        let text = std::fs::read_to_string(example).unwrap().replace("learning_rate = 0.001", "learnig_rate = 0.01");
        let path = dir.path().join("server.toml");
        std::fs::write(&path, text).unwrap();
        let error = format!("{:#}", ServerConfig::load(&path).unwrap_err());
        assert!(error.contains("learnig_rate"), "{error}");
    }

    const BASE: &str = "bind = \"127.0.0.1:4433\"\nstate_dir = \"s\"\ntls_dir = \"t\"\n";

    /// deploy/server.toml's commented `[engine.secagg]` example parses once uncommented, and a
    /// rule that needs each update is refused at load with why.
    #[test]
    fn the_example_secagg_table_parses_and_a_median_is_refused() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/server.toml");
        let text = std::fs::read_to_string(path).unwrap();
        let table: String = text
            .lines()
            .skip_while(|l| *l != "# [engine.secagg]")
            .skip(1)
            .map_while(|l| l.strip_prefix("# "))
            .map(|l| format!("{l}\n"))
            .collect();
        let parsed = ServerConfig::parse(&format!("method = \"fedprok\"\n{BASE}[engine.secagg]\n{table}")).unwrap();
        let secagg = &parsed.engine.secagg;
        assert!(secagg.enabled && secagg.classes == 10 && secagg.prototype_dim == 64, "{table}");
        let median = format!(
            "method = \"fedprok\"\n{BASE}[engine.robust]\naggregation = {{ rule = \"median\" }}\n[engine.secagg]\n{table}"
        );
        let err = format!("{:#}", ServerConfig::parse(&median).unwrap_err());
        assert!(err.contains("[engine.secagg]") && err.contains("sees only their sum"), "{err}");
    }

    #[test]
    fn the_method_is_a_name_or_a_table_of_hyperparameters() {
        let named = ServerConfig::parse(&format!("method = \"fedta\"\n{BASE}")).unwrap();
        assert_eq!(named.method.config().unwrap(), MethodConfig::named("fedta").unwrap());
        let table =
            ServerConfig::parse(&format!("{BASE}[method]\nname = \"fedta\"\nbgps = false\nlock_threshold = 0.3\n"))
                .unwrap();
        let MethodConfig::FedTa(m) = table.method.config().unwrap() else { panic!("not fedta") };
        assert_eq!((m.bgps, m.lock_threshold, m.sikf), (false, 0.3, true));
        let err = format!(
            "{:#}",
            ServerConfig::parse(&format!("{BASE}[method]\nname = \"gldp\"\nie_pool = 4\n")).unwrap_err()
        );
        assert!(err.contains("method `gldp`") && err.contains("ie_pool"), "{err}");
        let err = format!("{:#}", ServerConfig::parse(&format!("method = \"fedavgx\"\n{BASE}")).unwrap_err());
        assert!(err.contains("unknown method `fedavgx`"), "{err}");
    }

    #[test]
    fn a_sikf_section_names_the_backbone_and_the_data() {
        let text = format!(
            "method = \"fedta\"\n{BASE}[sikf]\nbackbone = \"mobilenet_v2\"\ndata_dir = \"/srv/data\"\n\
             [sikf.data]\ndataset = \"tiny-imagenet-100\"\n"
        );
        let s = ServerConfig::parse(&text).unwrap().sikf.unwrap();
        assert_eq!((s.backbone.as_str(), s.batch_size), ("mobilenet_v2", 16));
        assert_eq!(s.data.get("dataset").and_then(|v| v.as_str()), Some("tiny-imagenet-100"));
        let err = format!("{:#}", ServerConfig::parse(&text.replace("\"fedta\"", "\"fedavg\"")).unwrap_err());
        assert!(err.contains("[sikf] is FedTA's"), "{err}");
    }

    #[test]
    fn relative_paths_are_taken_from_the_config_files_folder() {
        let dir = tempfile::tempdir().unwrap();
        let site = dir.path().join("server");
        std::fs::create_dir_all(&site).unwrap();
        let text = "method = \"fedavg\"\nbind = \"127.0.0.1:4433\"\nstate_dir = \"state\"\ntls_dir = \".\"\n";
        std::fs::write(site.join("server.toml"), text).unwrap();
        let config = ServerConfig::load(&site.join("server.toml")).unwrap();
        assert_eq!((config.state_dir, config.tls_dir), (site.join("state"), site.join(".")));
        std::fs::write(site.join("abs.toml"), text.replace("\"state\"", "\"/var/lib/x\"")).unwrap();
        assert_eq!(ServerConfig::load(&site.join("abs.toml")).unwrap().state_dir, PathBuf::from("/var/lib/x"));
    }

    #[test]
    fn the_metrics_port_is_metrics_bind_or_a_metrics_table() {
        let flat =
            ServerConfig::parse(&format!("method = \"fedavg\"\nmetrics_bind = \"127.0.0.1:9464\"\n{BASE}")).unwrap();
        assert_eq!(flat.metrics_address(), Some("127.0.0.1:9464".parse().unwrap()));
        assert_eq!(flat.metrics.device_series, crate::metrics::DEFAULT_DEVICE_SERIES);
        let table = ServerConfig::parse(&format!(
            "method = \"fedavg\"\n{BASE}[metrics]\nbind = \"0.0.0.0:9464\"\ndevice_series = 50\n"
        ))
        .unwrap();
        assert_eq!((table.metrics_address(), table.metrics.device_series), (Some("0.0.0.0:9464".parse().unwrap()), 50));
        let both =
            format!("method = \"fedavg\"\nmetrics_bind = \"127.0.0.1:1\"\n{BASE}[metrics]\nbind = \"127.0.0.1:2\"\n");
        assert!(format!("{:#}", ServerConfig::parse(&both).unwrap_err()).contains("keep one"));
        assert!(ServerConfig::parse(&format!("method = \"fedavg\"\n{BASE}")).unwrap().metrics_address().is_none());
        // The Kubernetes manifests' server.toml uses the table.
        let k8s = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/k8s/server/server.toml");
        let k8s = ServerConfig::load(&k8s).unwrap();
        assert_eq!(
            k8s.metrics_address(),
            Some("127.0.0.1:9464".parse().unwrap()),
            "the pod IP comes from --metrics-bind"
        );
        // Device ids are off unless asked for.
        assert!(!flat.metrics.device_ids && !k8s.metrics.device_ids);
        let ids = ServerConfig::parse(&format!("method = \"fedavg\"\n{BASE}[metrics]\ndevice_ids = true\n")).unwrap();
        assert!(ids.metrics.device_ids);
    }

    /// The relay tier's manifests hold configs the program reads: the relay's
    /// [parent] names the root's Service, and the root weighs relays without a cap.
    #[test]
    fn the_relay_tiers_configs_load() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/k8s/relays");
        let relay = ServerConfig::load(&dir.join("relay.toml")).unwrap();
        let parent = relay.parent.expect("a relay has a parent");
        assert_eq!(
            (parent.address.as_str(), parent.server_name.as_str()),
            ("anchorage-server:4433", "anchorage-server")
        );
        let root = ServerConfig::load(&dir.join("root-server.toml")).unwrap();
        assert!(root.parent.is_none() && root.engine.robust.weight_cap.is_none());
        let method = relay.method.config().unwrap();
        crate::relay::check(&relay.engine, &method).expect("the relays can carry the root's method");
        assert_eq!(method, root.method.config().unwrap());
    }

    #[test]
    fn a_metrics_address_may_be_a_bare_ipv6_address_and_a_port() {
        assert_eq!(parse_bind("10.1.2.3:9464"), Ok("10.1.2.3:9464".parse().unwrap()));
        assert_eq!(parse_bind("[fd00::5]:9464"), Ok("[fd00::5]:9464".parse().unwrap()));
        assert_eq!(parse_bind("fd00::5:9464"), Ok("[fd00::5]:9464".parse().unwrap()));
        for bad in ["", "9464", ":9464", "10.1.2.3", "10.1.2.3:x", "host:9464"] {
            assert!(parse_bind(bad).unwrap_err().contains("IP:PORT"), "{bad}");
        }
    }

    #[test]
    fn an_evaluation_section_names_held_out_data_like_a_devices_data_table() {
        let synthetic = ServerConfig::parse(&format!(
            "method = \"fedavg\"\n{BASE}[evaluation]\ndata = {{ source = \"synthetic\", seed = 3 }}\n"
        ))
        .unwrap()
        .evaluation
        .unwrap();
        assert_eq!(
            (synthetic.data, synthetic.every, synthetic.max_samples),
            (EvaluationData::Synthetic { seed: 3 }, 1, 0)
        );
        let dir = tempfile::tempdir().unwrap();
        let text = format!(
            "method = \"fedprox\"\n{BASE}[evaluation]\nevery = 5\nmax_samples = 2000\n[evaluation.data]\nsource = \"scenario\"\n\
             data_dir = \"data\"\nbackbone = \"resnet20\"\nhidden = [64]\n[evaluation.data.spec]\ndataset = \"cifar10\"\n"
        );
        std::fs::write(dir.path().join("server.toml"), &text).unwrap();
        let scenario = ServerConfig::load(&dir.path().join("server.toml")).unwrap().evaluation.unwrap();
        let EvaluationData::Scenario { data_dir, backbone, hidden, spec, .. } = scenario.data else {
            panic!("a scenario")
        };
        assert_eq!((data_dir, backbone.as_str(), hidden), (dir.path().join("data"), "resnet20", vec![64]));
        assert_eq!((scenario.every, scenario.max_samples), (5, 2000));
        assert_eq!(spec.get("dataset").and_then(|v| v.as_str()), Some("cifar10"));
        let err = |text: String| format!("{:#}", ServerConfig::parse(&text).unwrap_err());
        let section = "[evaluation]\ndata = { source = \"synthetic\" }\n";
        let gldp = err(format!("method = \"gldp\"\n{BASE}{section}"));
        assert!(
            gldp.contains("nearest global prototype") && gldp.contains("anchorage_round_device_accuracy"),
            "{gldp}"
        );
        assert!(err(format!("method = \"local\"\n{BASE}{section}")).contains("no global model"));
        assert!(err(format!("method = \"fedavg\"\n{BASE}{section}every = 0\n")).contains("every must be 1"));
        assert!(
            err(format!("method = \"fedavg\"\n{BASE}[evaluation]\ndata = {{ source = \"synthetic\", index = 0 }}\n"))
                .contains("index")
        );
    }

    #[test]
    fn a_bad_method_says_what_is_wrong() {
        let err = |text: String| format!("{:#}", ServerConfig::parse(&text).unwrap_err());
        let typo = err(format!("{BASE}[method]\nname = \"fedta\"\nbgsp = false\n"));
        assert!(typo.contains("[method]") && typo.contains("bgsp"), "{typo}");
        let unknown = err(format!("method = \"fedfoo\"\n{BASE}"));
        assert!(unknown.contains("unknown method `fedfoo`"), "{unknown}");
        // A table's name is checked by serde against the registry's names.
        let unknown = err(format!("{BASE}[method]\nname = \"fedfoo\"\n"));
        assert!(unknown.contains("unknown variant `fedfoo`") && unknown.contains("`fedavgm`"), "{unknown}");
    }
}
