//! `anchorage-client check-config --config client.toml`: checks a device's config and every file
//! it names before the service starts, one line per check, without touching the network (no
//! handshake, no name lookup: `anchorage-client doctor` does those) and without making anything.
//!
//! The doctor's own checks ([`crate::doctor`]) for the compute device, the memory plan, the state
//! folder and the certificates' validity, plus:
//!
//! - **config**: the file is not empty and parses ([`ClientConfig::load`]);
//! - **server**: the server's address is `host:port` (a name is looked up at start, not here);
//! - **chain**: this device's certificate chains to the trusted CA (webpki, as the server checks
//!   it) as a client certificate;
//! - **key-pair**: the key is the certificate's (rustls' own check, in the TLS config the client
//!   builds with [`transport::client_crypto`]);
//! - **data**: this device's share of its data: the embedded set's index, or a scenario's files
//!   (labels read and split with the data crate's loaders, the backbone's weights loaded);
//! - **metrics**: `[metrics] textfile`'s folder exists (node_exporter's textfile collector
//!   folder; the device does not create it);
//! - **privacy**: `[privacy]` makes a guarantee ([`PrivacyConfig::check`]) and local noise has
//!   its `noise_multiplier` ([`crate::privacy::DevicePrivacy::for_device`]; a table that fails
//!   is refused when the config loads, so **config** fails with the same message).
//!
//! [`PrivacyConfig::check`]: anchorage_shared::privacy::PrivacyConfig::check
//!
//! Exit status 0 when nothing failed (warnings and skipped checks included), 1 otherwise.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};

use crate::config::{ClientConfig, DataSource};
use crate::doctor;
use crate::transport::{self, ClientCert};
use anchorage_shared::checks::{Check, Status};

/// A certificate with fewer days left than this is a warning (the doctor's default).
pub const WARN_DAYS: i64 = 30;

pub use anchorage_shared::checks::Report;

/// check-config's verdict on the device.
fn verdict(report: &Report) -> String {
    if report.failed() {
        format!("check-config: the device would NOT start: {} failed", report.failed_names())
    } else {
        format!(
            "check-config: the device can start ({} warnings; `anchorage-client doctor` also tries the server)",
            report.count(Status::Warn)
        )
    }
}

/// An empty config file (nothing but whitespace and comments) is an error that names it.
pub fn refuse_empty(path: &Path) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    if let Ok(table) = toml::from_str::<toml::Table>(&text) {
        anyhow::ensure!(
            !table.is_empty(),
            "{} is empty (no settings, only whitespace or comments): a client.toml needs at least server, \
             server_cert, client_id, state_dir and [data] (see deploy/client.toml, or `anchorage provision`)",
            path.display()
        );
    }
    Ok(())
}

/// `anchorage-client check-config`: prints the report, returns the exit status.
pub fn main(path: &Path) -> std::process::ExitCode {
    let report = run(path);
    print!("{}", report.render());
    if report.failed() { std::process::ExitCode::FAILURE } else { std::process::ExitCode::SUCCESS }
}

/// Every check of the device whose config is at `path`.
pub fn run(path: &Path) -> Report {
    let mut report = Report::new(verdict);
    let config = match refuse_empty(path).and_then(|()| ClientConfig::load(path)) {
        Ok(config) => config,
        Err(e) => {
            report.checks.push(Check::new("config", Status::Fail, format!("{e:#}")));
            return report;
        }
    };
    report.checks.push(Check::new(
        "config",
        Status::Ok,
        format!("{} (device {}, method {})", path.display(), config.client_id, config.method.name()),
    ));
    report.checks.push(check_server(&config));
    let device = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime.block_on(doctor::check_device(&config)),
        Err(e) => Check::new("device", Status::Fail, format!("cannot start the async runtime: {e}")),
    };
    report.checks.push(device);
    report.checks.push(doctor::check_memory(&config));
    report.checks.push(doctor::check_state(&config.state_dir));
    report.checks.extend(doctor::check_certificates(&config, WARN_DAYS, doctor::unix_now()));
    report.checks.extend(check_pair(&config));
    report.checks.push(check_data(&config));
    report.checks.push(check_metrics(&config));
    report.checks.push(check_privacy(&config));
    report
}

/// `[privacy]`: who noises, the clips and σ.
fn check_privacy(config: &ClientConfig) -> Check {
    match config.device_privacy() {
        Ok(None) => {
            Check::new("privacy", Status::Skip, "no [privacy]: updates and prototypes as the method makes them")
        }
        Ok(Some(p)) => {
            let noise = match p.noise_multiplier {
                Some(sigma) => format!(
                    "local noise: σ = {sigma} on the delta clipped to {} and on prototype sums of features \
                     clipped to {}",
                    p.clip, p.prototype_clip
                ),
                None => {
                    format!("central noise (the server's): prototype sums of features clipped to {}", p.prototype_clip)
                }
            };
            Check::new("privacy", Status::Ok, format!("{noise}; the server's [engine.privacy] must agree"))
        }
        Err(e) => Check::new("privacy", Status::Fail, format!("{e:#}")),
    }
}

/// `[metrics] textfile`: its folder must be there (the device writes the file, never the folder).
fn check_metrics(config: &ClientConfig) -> Check {
    let Some(path) = &config.metrics.textfile else {
        return Check::new("metrics", Status::Skip, "no [metrics] textfile: the device writes no metrics file");
    };
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if dir.is_dir() {
        Check::new(
            "metrics",
            Status::Ok,
            format!(
                "{} every {} s (node_exporter's --collector.textfile.directory must be {})",
                path.display(),
                config.metrics.every_s,
                dir.display()
            ),
        )
    } else {
        Check::new(
            "metrics",
            Status::Fail,
            format!(
                "metrics.textfile {}: its folder {} does not exist (the device does not create it): point it at \
                 node_exporter's --collector.textfile.directory, or create that folder writable by the service user",
                path.display(),
                dir.display()
            ),
        )
    }
}

/// The server's address as the client will dial it; nothing is looked up.
fn check_server(config: &ClientConfig) -> Check {
    match config.server.parse::<std::net::SocketAddr>() {
        Ok(addr) => Check::new(
            "server",
            Status::Ok,
            format!("{addr}, certificate name {} (not dialled here)", config.server_name),
        ),
        Err(_) => Check::new(
            "server",
            Status::Ok,
            format!(
                "{}, certificate name {}: a host name, looked up at start (not here: check-config stays off the \
                 network)",
                config.server, config.server_name
            ),
        ),
    }
}

/// The device's certificate chains to the trusted CA, and the key is its own.
fn check_pair(config: &ClientConfig) -> Vec<Check> {
    let (Some(cert_path), Some(key_path)) = (&config.cert, &config.key) else {
        // The doctor's certificate check already says why (none, or half a pair).
        return vec![Check::new("chain", Status::Skip, "no device certificate configured")];
    };
    let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let files = read(&config.server_cert).and_then(|ca| Ok((ca, read(cert_path)?, read(key_path)?)));
    let (ca, cert, key) = match files {
        Ok((ca, cert, key)) => (CertificateDer::from(ca), CertificateDer::from(cert), key),
        Err(e) => return vec![Check::new("chain", Status::Fail, format!("{e:#}"))],
    };
    let chain = Check::outcome(
        "chain",
        client_chains_to(&cert, &ca)
            .map(|()| format!("{} chains to {}", cert_path.display(), config.server_cert.display()))
            .with_context(|| {
                format!(
                    "{} does not chain to {} as a device certificate: issue it from this project's CA \
                     (`anchorage ca issue client {}`)",
                    cert_path.display(),
                    config.server_cert.display(),
                    config.client_id
                )
            }),
    );
    let pair = ClientCert { chain: vec![cert], key: PrivateKeyDer::Pkcs8(key.into()) };
    let key_pair = Check::outcome(
        "key-pair",
        transport::client_crypto(&ca, Some(&pair))
            .map(|_| format!("{} is the key of {}", key_path.display(), cert_path.display()))
            .with_context(|| {
                format!(
                    "{} is not the key of {}: copy the pair from the same provisioning",
                    key_path.display(),
                    cert_path.display()
                )
            }),
    );
    vec![chain, key_pair]
}

/// webpki's verdict on `cert` as a client certificate under the root `ca` (what the server's
/// verifier decides, less the revocation list the device does not have).
fn client_chains_to(cert: &CertificateDer<'static>, ca: &CertificateDer<'static>) -> anyhow::Result<()> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).context("the trusted CA certificate")?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .context("building the verifier")?;
    verifier.verify_client_cert(cert, &[], UnixTime::now()).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

/// This device's share of the data: the embedded set needs no files; a scenario's labels are
/// read and split, and the backbone's weights loaded, with the loaders training uses.
fn check_data(config: &ClientConfig) -> Check {
    match &config.data {
        DataSource::Synthetic { clients, index, alpha, .. } => {
            let ok = *index < *clients && *alpha > 0.0;
            Check::new(
                "data",
                if ok { Status::Ok } else { Status::Fail },
                if ok {
                    format!("the embedded synthetic set (no files): share {index} of {clients}")
                } else {
                    format!("[data] index {index} must be below clients {clients}, and alpha ({alpha}) above 0")
                },
            )
        }
        DataSource::Scenario { data_dir, client, backbone, spec, .. } => Check::outcome(
            "data",
            (|| {
                let pools = anchorage_data::label_pools(spec, Some(data_dir)).with_context(|| {
                    let missing = if data_dir.is_dir() { "" } else { ", which is not a folder" };
                    format!("reading the labels in data_dir {}{missing}", data_dir.display())
                })?;
                let split = anchorage_data::build_split(spec, &pools).context("partitioning")?;
                let mine = split.clients.get(*client).with_context(|| {
                    format!("client index {client} is outside the split's {} clients", split.num_clients())
                })?;
                anyhow::ensure!(!mine.tasks.is_empty(), "the split gives client {client} no tasks");
                let rows: usize = mine.tasks.iter().map(|t| t.train.len()).sum();
                anchorage_model::zoo::load(backbone, 1, Some(data_dir), &burn::tensor::Device::flex())
                    .with_context(|| format!("the backbone `{backbone}`"))?;
                Ok(format!(
                    "client {client} of {}: {} tasks, {rows} training rows in {}; backbone {backbone} loads",
                    split.num_clients(),
                    mine.tasks.len(),
                    data_dir.display()
                ))
            })(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device folder like `anchorage provision` writes: ca.der, cert.der, key.der, client.toml.
    fn device(dir: &Path) -> std::path::PathBuf {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, "test root");
        let ca_cert = params.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::new(params, ca_key);
        let key = rcgen::KeyPair::generate().unwrap();
        let mut leaf = rcgen::CertificateParams::new(vec!["edge-1".to_string()]).unwrap();
        leaf.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = leaf.signed_by(&key, &issuer).unwrap();
        std::fs::write(dir.join("ca.der"), ca_cert.der()).unwrap();
        std::fs::write(dir.join("cert.der"), cert.der()).unwrap();
        std::fs::write(dir.join("key.der"), key.serialize_der()).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.join("key.der"), std::fs::Permissions::from_mode(0o600)).unwrap();
        let config = dir.join("client.toml");
        std::fs::write(
            &config,
            "server = \"127.0.0.1:4433\"\nserver_cert = \"ca.der\"\ncert = \"cert.der\"\nkey = \"key.der\"\n\
             client_id = \"edge-1\"\nstate_dir = \"state\"\n\
             [data]\nsource = \"synthetic\"\nseed = 1\nclients = 2\nindex = 0\nalpha = 0.5\n",
        )
        .unwrap();
        config
    }

    #[test]
    fn a_sound_device_folder_passes_without_the_network() {
        let dir = tempfile::tempdir().unwrap();
        let config = device(dir.path());
        let report = run(&config);
        assert!(!report.failed(), "{}", report.render());
        let names: Vec<&str> = report.checks.iter().map(|c| c.name).collect();
        assert_eq!(
            names,
            [
                "config",
                "server",
                "device",
                "memory",
                "state",
                "ca",
                "certificate",
                "key",
                "chain",
                "key-pair",
                "data",
                "metrics",
                "privacy"
            ]
        );
        assert_eq!(report.get("privacy").unwrap().status, Status::Skip, "no [privacy] table");
        assert_eq!(report.get("metrics").unwrap().status, Status::Skip, "no [metrics] table");
        assert!(report.get("server").unwrap().detail.contains("not dialled"));
        assert!(!dir.path().join("state").exists(), "nothing is made");
        assert!(report.render().contains("check-config: the device can start"), "{}", report.render());
    }

    #[test]
    fn a_foreign_certificate_a_wrong_key_and_a_bad_share_fail() {
        let dir = tempfile::tempdir().unwrap();
        let config = device(dir.path());
        let other = tempfile::tempdir().unwrap();
        device(other.path());
        let failing = |name: &str| {
            let report = run(&config);
            let c = report.get(name).unwrap_or_else(|| panic!("no {name}: {}", report.render()));
            assert_eq!(c.status, Status::Fail, "{}", report.render());
            assert!(report.render().contains("would NOT start"));
            c.detail.clone()
        };
        // Another project's certificate (and its key): it does not chain to this ca.der.
        let own: Vec<Vec<u8>> =
            ["cert.der", "key.der"].iter().map(|f| std::fs::read(dir.path().join(f)).unwrap()).collect();
        std::fs::copy(other.path().join("cert.der"), dir.path().join("cert.der")).unwrap();
        std::fs::copy(other.path().join("key.der"), dir.path().join("key.der")).unwrap();
        assert!(failing("chain").contains("does not chain to"));
        // This project's certificate with another key.
        std::fs::write(dir.path().join("cert.der"), &own[0]).unwrap();
        assert!(failing("key-pair").contains("is not the key of"));
        std::fs::write(dir.path().join("key.der"), &own[1]).unwrap();
        assert!(!run(&config).failed());
        // A share beyond the split.
        let text = std::fs::read_to_string(&config).unwrap();
        std::fs::write(&config, text.replace("index = 0", "index = 2")).unwrap();
        assert!(failing("data").contains("index 2 must be below clients 2"));
        // A scenario whose data folder is not there.
        let scenario = text.replace(
            "[data]\nsource = \"synthetic\"\nseed = 1\nclients = 2\nindex = 0\nalpha = 0.5\n",
            "[data]\nsource = \"scenario\"\ndata_dir = \"nowhere\"\nclient = 0\nbackbone = \"resnet20\"\n\
             [data.spec]\ndataset = \"tiny-imagenet-100\"\nseed = 1\n[data.spec.partition]\nkind = \"fedta\"\n\
             clients = 5\ntasks = 5\nclasses_per_task = 8\npublic_classes = 25\n",
        );
        std::fs::write(&config, scenario).unwrap();
        let detail = failing("data");
        assert!(detail.contains("nowhere") && detail.contains("not a folder"), "{detail}");
    }

    /// `[metrics] textfile` in a folder that is not there fails with what to do; in one that is,
    /// passes, and nothing is written.
    #[test]
    fn a_metrics_textfile_needs_its_folder() {
        let dir = tempfile::tempdir().unwrap();
        let config = device(dir.path());
        let text = std::fs::read_to_string(&config).unwrap();
        let with = |textfile: &str| {
            std::fs::write(&config, format!("{text}[metrics]\ntextfile = \"{textfile}\"\n")).unwrap();
            let report = run(&config);
            report.get("metrics").unwrap().clone()
        };
        let missing = with("collector/anchorage-client.prom");
        assert_eq!(missing.status, Status::Fail);
        assert!(
            missing.detail.contains("collector") && missing.detail.contains("does not exist"),
            "{}",
            missing.detail
        );
        assert!(!dir.path().join("collector").exists(), "nothing is made");
        std::fs::create_dir(dir.path().join("collector")).unwrap();
        let present = with("collector/anchorage-client.prom");
        assert_eq!(present.status, Status::Ok, "{}", present.detail);
        assert!(present.detail.contains("every 15 s"), "{}", present.detail);
        assert!(!dir.path().join("collector/anchorage-client.prom").exists(), "nothing is written");
    }

    /// `[privacy]`: local noise without noise_multiplier is refused with a message naming it;
    /// with it, or central noise, the device can start and the check says what it adds.
    #[test]
    fn a_local_noise_privacy_table_needs_its_noise_multiplier() {
        let dir = tempfile::tempdir().unwrap();
        let config = device(dir.path());
        let text = std::fs::read_to_string(&config).unwrap();
        let with = |table: &str| {
            std::fs::write(&config, format!("{text}[privacy]\n{table}")).unwrap();
            run(&config)
        };
        let refused = with("noise = \"local\"\ntarget_epsilon = 4.0\n");
        let c = refused.get("config").unwrap();
        assert_eq!(c.status, Status::Fail, "{}", refused.render());
        assert!(c.detail.contains("noise_multiplier"), "{}", c.detail);
        assert!(format!("{:#}", ClientConfig::load(&config).unwrap_err()).contains("noise_multiplier"));
        let local = with("noise = \"local\"\nnoise_multiplier = 1.1\nclip = 0.5\n");
        assert!(!local.failed(), "{}", local.render());
        let p = local.get("privacy").unwrap();
        assert_eq!(p.status, Status::Ok);
        assert!(p.detail.contains("σ = 1.1") && p.detail.contains("0.5"), "{}", p.detail);
        let central = with("noise = \"central\"\ntarget_epsilon = 8.0\n");
        assert!(central.get("privacy").unwrap().detail.contains("central"), "{}", central.render());
        let bad = with("noise = \"central\"\nnoise_multiplier = 1.0\ndelta = 2.0\n");
        assert!(bad.get("config").unwrap().detail.contains("delta"), "{}", bad.render());
    }

    #[test]
    fn an_empty_config_is_an_error_that_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("client.toml");
        for text in ["", "\n \n", "# comments only\n"] {
            std::fs::write(&path, text).unwrap();
            assert!(format!("{:#}", refuse_empty(&path).unwrap_err()).contains("client.toml is empty"));
            let report = run(&path);
            assert_eq!(report.checks.len(), 1);
            assert!(report.checks[0].detail.contains("client.toml is empty"), "{}", report.render());
        }
    }
}
