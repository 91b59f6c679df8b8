//! `anchorage-server check-config --config server.toml`: checks a server's config and every file
//! it names before the service starts (`ExecStartPre=`, or by hand after copying a site folder),
//! one line per check, without starting anything: no socket is bound, no database opened.
//!
//! - **config**: the file is not empty and parses ([`ServerConfig::load`], the loader the server
//!   itself uses);
//! - **bind**: the QUIC address (and the metrics port's) as the server would listen;
//! - **ca**, **certificate**, **key**, **crl**: the project CA's `ca.der` parses; the server's
//!   `cert.der` chains to it (webpki, as the devices check it) under its own id; `key.der` is the
//!   certificate's key (rustls' own check); `revoked.crl` parses ([`Trust::read_crl`]) and is the
//!   CA's. A development server (`insecure_dev`) has only its self-signed pair;
//! - **model**: `initial_model` loads ([`model_file::load`]) and has the layout of the method's
//!   shared blocks, and the method's server half aggregates an update of that layout;
//! - **state**: `state_dir` exists or can be made, and the current user can write there;
//! - **sikf**, **evaluation**: `[sikf]`'s and `[evaluation]`'s data folders hold their labels
//!   (read with the data crate's loaders), and the backbone's weights load.
//!
//! Exit status 0 when nothing failed (warnings included), 1 otherwise.

use std::path::Path;
use std::sync::Arc;

use anchorage_shared::method::{MethodConfig, Shared, fedta_blocks};
use anchorage_shared::protocol::Update;
use anchorage_shared::tensor::ParamBlock;
use anyhow::Context;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

use crate::config::ServerConfig;
use crate::tls::{self, Trust};
use crate::{methods, model_file};
use anchorage_pki::{CertInfo, cert_info};

/// A certificate with fewer days left than this is a warning.
pub const WARN_DAYS: i64 = 30;

pub use anchorage_shared::checks::{Check, Report, Status};

/// check-config's verdict on the server.
fn verdict(report: &Report) -> String {
    if report.failed() {
        format!("check-config: the server would NOT start: {} failed", report.failed_names())
    } else {
        format!("check-config: the server can start ({} warnings)", report.count(Status::Warn))
    }
}

/// An empty config file (nothing but whitespace and comments) is an error that names it: the
/// server has no defaults for its address, method or folders.
pub fn refuse_empty(path: &Path) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    if let Ok(table) = toml::from_str::<toml::Table>(&text) {
        anyhow::ensure!(
            !table.is_empty(),
            "{} is empty (no settings, only whitespace or comments): a server.toml needs at least bind, method, \
             state_dir and tls_dir (see deploy/server.toml, or `anchorage provision`)",
            path.display()
        );
    }
    Ok(())
}

/// `anchorage-server check-config`: prints the report; returns whether nothing failed.
pub fn main(path: &Path) -> bool {
    let report = run(path);
    print!("{}", report.render());
    !report.failed()
}

/// Every check of the server whose config is at `path`.
pub fn run(path: &Path) -> Report {
    let mut report = Report::new(verdict);
    let config = match refuse_empty(path).and_then(|()| ServerConfig::load(path)) {
        Ok(config) => config,
        Err(e) => {
            report.checks.push(Check::new("config", Status::Fail, format!("{e:#}")));
            return report;
        }
    };
    let method = match config.method.config() {
        Ok(method) => method,
        Err(e) => {
            report.checks.push(Check::new("config", Status::Fail, format!("{}: {e:#}", path.display())));
            return report;
        }
    };
    report.checks.push(Check::new("config", Status::Ok, format!("{} (method {})", path.display(), method.name())));
    report.checks.push(check_bind(&config));
    if config.insecure_dev {
        report.checks.push(check_dev_identity(&config));
    } else {
        report.checks.extend(check_tls(&config.tls_dir, unix_now()));
    }
    report.checks.push(check_model(&config, &method));
    report.checks.push(check_state(&config.state_dir));
    if let (Some(section), MethodConfig::FedTa(_)) = (&config.sikf, &method) {
        report.checks.push(check_sikf(section));
    }
    if let Some(section) = &config.evaluation {
        report.checks.push(check_evaluation(section));
    }
    report
}

fn unix_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

fn check_bind(config: &ServerConfig) -> Check {
    let mut status = Status::Ok;
    let mut detail = format!("QUIC (UDP) on {}", config.bind);
    if config.bind.port() == 0 {
        status = Status::Warn;
        detail.push_str(": port 0 picks a random port at every start, which devices cannot know");
    } else if config.bind.ip().is_unspecified() {
        detail.push_str(" (every interface)");
    }
    match config.metrics_address() {
        None => detail.push_str("; no metrics port"),
        Some(m) if m.ip().is_unspecified() => {
            status = Status::Warn;
            detail.push_str(&format!(
                "; metrics port {m} listens on every interface: bind it to 127.0.0.1 or one address and firewall it"
            ));
        }
        Some(m) => detail.push_str(&format!("; metrics port http://{m}/metrics")),
    }
    Check::new("bind", status, format!("{detail} (not bound here)"))
}

/// `insecure_dev`: the self-signed pair, or that the first start makes one.
fn check_dev_identity(config: &ServerConfig) -> Check {
    match anchorage_pki::load_identity(&config.tls_dir) {
        Ok(Some(identity)) => match tls::server_crypto(&identity, None) {
            Ok(_) => Check::new(
                "certificate",
                Status::Warn,
                format!(
                    "insecure_dev: the self-signed development pair in {}; no client certificates are asked for \
                     (never in the field)",
                    config.tls_dir.display()
                ),
            ),
            Err(e) => Check::new("certificate", Status::Fail, format!("{}: {e:#}", config.tls_dir.display())),
        },
        Ok(None) => Check::new(
            "certificate",
            Status::Warn,
            format!(
                "insecure_dev: {} holds no cert.der / key.der yet; the first start makes a self-signed pair \
                 (never in the field)",
                config.tls_dir.display()
            ),
        ),
        Err(e) => Check::new("certificate", Status::Fail, format!("{e:#}")),
    }
}

/// A certificate's validity at `now`, in words.
fn validity(what: &str, facts: &CertInfo, now: i64) -> (Status, String) {
    if now < facts.not_before {
        return (
            Status::Fail,
            format!(
                "{what} is not valid yet (for another {} s): is this machine's clock behind?",
                facts.not_before - now
            ),
        );
    }
    if now > facts.not_after {
        return (Status::Fail, format!("{what} EXPIRED on {}: renew it (`anchorage ca renew`)", facts.not_after_text));
    }
    let days = (facts.not_after - now).div_euclid(86_400);
    let status = if days < WARN_DAYS { Status::Warn } else { Status::Ok };
    (status, format!("{what} valid until {} ({days} days left)", facts.not_after_text))
}

/// The project CA's files in `dir`: ca.der, cert.der chained to it, key.der, revoked.crl.
fn check_tls(dir: &Path, now: i64) -> Vec<Check> {
    // `tls_dir = "."` beside server.toml: `site/./cert.der` shown as `site/cert.der`.
    let dir = &dir.components().collect::<std::path::PathBuf>();
    let mut checks = Vec::new();
    let hint = "`anchorage provision project.toml` (or `anchorage ca issue server <id>`) writes it";
    let ca_path = dir.join(anchorage_pki::CA_CERT);
    let ca_der = match std::fs::read(&ca_path)
        .with_context(|| format!("reading the project CA {}: {hint}", ca_path.display()))
    {
        Ok(der) => CertificateDer::from(der),
        Err(e) => {
            checks.push(Check::new("ca", Status::Fail, format!("{e:#}")));
            return checks;
        }
    };
    match cert_info(ca_der.as_ref()) {
        Ok(facts) => {
            let (status, detail) = validity("the project CA", &facts, now);
            checks.push(Check::new("ca", status, format!("{detail}; {}", ca_path.display())));
        }
        Err(e) => {
            checks.push(Check::new("ca", Status::Fail, format!("{}: {e:#}", ca_path.display())));
            return checks;
        }
    }
    let identity = match anchorage_pki::load_identity(dir) {
        Ok(Some(identity)) => identity,
        Ok(None) => {
            checks.push(Check::new(
                "certificate",
                Status::Fail,
                format!("{} holds no cert.der / key.der: {hint}", dir.display()),
            ));
            return checks;
        }
        Err(e) => {
            checks.push(Check::new("certificate", Status::Fail, format!("{e:#}")));
            return checks;
        }
    };
    let cert_path = dir.join(anchorage_pki::CERT_FILE);
    let facts = match cert_info(identity.cert.as_ref()) {
        Ok(facts) => facts,
        Err(e) => {
            checks.push(Check::new("certificate", Status::Fail, format!("{}: {e:#}", cert_path.display())));
            return checks;
        }
    };
    let (status, detail) = validity("the server's certificate", &facts, now);
    let chained = match &facts.id {
        Some(id) => chains_to(&identity.cert, &ca_der, id),
        None => Err(anyhow::anyhow!("it names no id (no DNS subject alternative name)")),
    };
    checks.push(match chained {
        Ok(()) => Check::new(
            "certificate",
            status,
            format!(
                "{} ({}) chains to the project CA: {detail}",
                facts.id.as_deref().unwrap_or("?"),
                cert_path.display()
            ),
        ),
        Err(e) => Check::new(
            "certificate",
            Status::Fail,
            format!(
                "{} does not chain to {} ({e:#}): issue the server's certificate from this project's CA",
                cert_path.display(),
                ca_path.display()
            ),
        ),
    });
    checks.push(check_key(dir, &identity));
    checks.push(check_crl(dir, &ca_der, &facts.serial));
    checks
}

/// webpki's verdict on `cert` as a server certificate for `name`, under the root `ca`.
fn chains_to(cert: &CertificateDer<'static>, ca: &CertificateDer<'static>, name: &str) -> anyhow::Result<()> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).context("the project CA certificate")?;
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), tls::provider())
        .build()
        .context("building the verifier")?;
    let name = ServerName::try_from(name.to_string()).with_context(|| format!("`{name}` is not a DNS name"))?;
    rustls::client::danger::ServerCertVerifier::verify_server_cert(
        verifier.as_ref(),
        cert,
        &[],
        &name,
        &[],
        UnixTime::now(),
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(())
}

/// The key is the certificate's (rustls refuses a mismatched pair) and private to its owner.
fn check_key(dir: &Path, identity: &anchorage_pki::Identity) -> Check {
    let key_path = dir.join(anchorage_pki::KEY_FILE);
    if let Err(e) = tls::server_crypto(identity, None) {
        return Check::new(
            "key",
            Status::Fail,
            format!(
                "{} is not the key of {} ({e:#}): copy the pair from the same `anchorage ca issue` / provision run",
                key_path.display(),
                dir.join(anchorage_pki::CERT_FILE).display()
            ),
        );
    }
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&key_path).map(|m| m.permissions().mode() & 0o777).unwrap_or(0);
    if mode & 0o077 != 0 {
        return Check::new(
            "key",
            Status::Warn,
            format!(
                "{} matches the certificate but others can read it (mode {mode:04o}): chmod 0600 it",
                key_path.display()
            ),
        );
    }
    Check::new("key", Status::Ok, format!("{} matches the certificate (mode {mode:04o})", key_path.display()))
}

/// `revoked.crl` parses, was issued by the project CA, and does not list the server itself.
fn check_crl(dir: &Path, ca_der: &CertificateDer<'static>, own_serial: &str) -> Check {
    let path = dir.join(anchorage_pki::CRL);
    let trust = Trust::ProjectCa { ca: ca_der.clone(), crl: Some(path.clone()) };
    let crl = match trust.read_crl() {
        Ok(Some(crl)) => crl,
        Ok(None) => return Check::new("crl", Status::Fail, format!("{}: no revocation list", path.display())),
        Err(e) => return Check::new("crl", Status::Fail, format!("{e:#}")),
    };
    let issuer_matches = (|| -> anyhow::Result<bool> {
        let (_, list) = x509_parser::parse_x509_crl(crl.as_ref()).context("the revocation list does not parse")?;
        let (_, root) = x509_parser::parse_x509_certificate(ca_der.as_ref()).context("the CA does not parse")?;
        Ok(list.issuer().as_raw() == root.subject().as_raw())
    })();
    match issuer_matches {
        Ok(true) => {}
        Ok(false) => {
            return Check::new(
                "crl",
                Status::Fail,
                format!(
                    "{} was issued by another CA than ca.der: copy this project CA's revoked.crl here. {}",
                    path.display(),
                    tls::CRL_HINT
                ),
            );
        }
        Err(e) => return Check::new("crl", Status::Fail, format!("{}: {e:#}", path.display())),
    }
    let revoked = match anchorage_pki::revoked_serials(crl.as_ref()) {
        Ok(revoked) => revoked,
        Err(e) => return Check::new("crl", Status::Fail, format!("{}: {e:#}", path.display())),
    };
    if revoked.contains(own_serial) {
        return Check::new(
            "crl",
            Status::Warn,
            format!(
                "{} revokes the server's own certificate (serial {own_serial}): renew it (`anchorage ca renew`)",
                path.display()
            ),
        );
    }
    Check::new("crl", Status::Ok, format!("{}: {} revoked certificates", path.display(), revoked.len()))
}

/// The initial model loads and fits the method.
fn check_model(config: &ServerConfig, method: &MethodConfig) -> Check {
    let Some(path) = &config.initial_model else {
        return match method.info().shared {
            Shared::Nothing => {
                Check::new("model", Status::Ok, format!("no initial_model: `{}` shares no blocks", method.name()))
            }
            _ => Check::new(
                "model",
                Status::Fail,
                format!(
                    "no initial_model: `{}` shares model blocks, and a server without a model refuses every update \
                     (its layout comes from the operator, never from an update); `anchorage provision` writes \
                     initial-model.bin",
                    method.name()
                ),
            ),
        };
    };
    let blocks = match model_file::load(path) {
        Ok(blocks) => blocks,
        Err(e) => return Check::new("model", Status::Fail, format!("{e:#}")),
    };
    let fits = layout_fits(&blocks, method).and_then(|()| aggregates(&blocks, method, config));
    let values: usize = blocks.iter().map(|b| b.tensor.shape.iter().map(|d| *d as usize).product::<usize>()).sum();
    match fits {
        Ok(()) => Check::new(
            "model",
            Status::Ok,
            format!("{}: {} blocks, {values} values, the layout of `{}`", path.display(), blocks.len(), method.name()),
        ),
        Err(why) => Check::new(
            "model",
            Status::Fail,
            format!(
                "{} does not fit the method `{}`: {why} (was it made for another method? provision again with \
                 this method, after moving the old file away)",
                path.display(),
                method.name()
            ),
        ),
    }
}

/// The block names a method's clients share: FedTA its input-enhancement pool (`ie.*`, and the
/// tail `tail.*` with `share_tail`), body-only methods no head (`head.*`), `local` nothing.
fn layout_fits(blocks: &[ParamBlock], method: &MethodConfig) -> Result<(), String> {
    let named = |prefix: &str| {
        blocks.iter().filter(|b| b.name.starts_with(prefix)).map(|b| b.name.as_str()).collect::<Vec<_>>()
    };
    let (ie, tail, head) = (named(fedta_blocks::IE_PREFIX), named(fedta_blocks::TAIL_PREFIX), named("head."));
    let first = |names: &[&str]| names.first().map_or(String::new(), |n| format!("`{n}`"));
    match method.info().shared {
        Shared::Nothing if !blocks.is_empty() => {
            Err(format!("it shares no blocks, but the model has {}", blocks.len()))
        }
        Shared::Nothing => Ok(()),
        _ if blocks.is_empty() => Err("the model has no blocks".into()),
        Shared::PromptsAndPrototypes => {
            if ie.is_empty() {
                return Err(format!("no input-enhancement blocks (`{}*`)", fedta_blocks::IE_PREFIX));
            }
            if let Some(other) = blocks.iter().find(|b| {
                !b.name.starts_with(fedta_blocks::IE_PREFIX) && !b.name.starts_with(fedta_blocks::TAIL_PREFIX)
            }) {
                return Err(format!("block `{}` is not FedTA's", other.name));
            }
            let share_tail = matches!(method, MethodConfig::FedTa(c) if c.share_tail);
            match (share_tail, tail.is_empty()) {
                (true, true) => Err("share_tail is on but the model has no tail blocks".into()),
                (false, false) => Err(format!("share_tail is off but the model has tail blocks ({})", first(&tail))),
                _ => Ok(()),
            }
        }
        shared => {
            if let Some(b) = ie.first().or(tail.first()) {
                return Err(format!("block `{b}` is FedTA's"));
            }
            if matches!(shared, Shared::Body | Shared::BodyAndPrototypes) && !head.is_empty() {
                return Err(format!("it shares the body only, but the model has head blocks ({})", first(&head)));
            }
            Ok(())
        }
    }
}

/// The method's server half aggregates one update of the model's own layout (the plain mean: the
/// robust rules need more than one update).
fn aggregates(blocks: &[ParamBlock], method: &MethodConfig, config: &ServerConfig) -> Result<(), String> {
    let mut server = methods::build(method);
    let round = methods::RoundInfo { rule: methods::AggregationRule::Mean, ..config.engine.round_info(1) };
    let update = Update {
        prototypes_are: Default::default(),
        round: 1,
        num_samples: 1,
        blocks: blocks.to_vec(),
        prototypes: Vec::new(),
        metrics: Vec::new(),
        compute_seconds: 0.0,
    };
    server
        .aggregate(&round, blocks, &[("check-config", &update)])
        .map(|_| ())
        .map_err(|e| format!("the server half does not aggregate it: {e}"))
}

/// The state folder exists or can be made, and the current user can write there (a probe file,
/// removed again). Nothing is made and no database is opened.
pub fn check_state(dir: &Path) -> Check {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let who = if uid == 0 {
        "checked as root, who writes anywhere: run check-config as the service's user to check what it can do"
            .to_string()
    } else {
        format!("checked as uid {uid}")
    };
    if !dir.exists() {
        let parent = dir.ancestors().skip(1).find(|p| p.exists()).unwrap_or(Path::new("/"));
        return match probe(parent) {
            Ok(()) => {
                Check::new("state", Status::Ok, format!("{} does not exist yet; it can be made ({who})", dir.display()))
            }
            Err(e) => Check::new(
                "state",
                Status::Fail,
                format!(
                    "{} does not exist and cannot be made: {} is not writable ({e}; {who}): create it for the \
                     service's user (systemd's StateDirectory= does)",
                    dir.display(),
                    parent.display()
                ),
            ),
        };
    }
    if !dir.is_dir() {
        return Check::new("state", Status::Fail, format!("{} is not a folder", dir.display()));
    }
    let db = dir.join(crate::store::DB_FILE);
    let holds = if db.exists() {
        format!("; holds {} (`anchorage-server check` verifies it)", crate::store::DB_FILE)
    } else {
        "; no database yet (a new federation)".into()
    };
    match probe(dir) {
        Ok(()) => Check::new("state", Status::Ok, format!("{} is writable ({who}){holds}", dir.display())),
        Err(e) => Check::new(
            "state",
            Status::Fail,
            format!("{} is not writable ({e}; {who}): chown it to the service's user", dir.display()),
        ),
    }
}

/// Makes and removes a file in `dir`.
fn probe(dir: &Path) -> std::io::Result<()> {
    tempfile::Builder::new().prefix(".anchorage-check-config").tempfile_in(dir).map(drop)
}

/// `[sikf]`: its data folder and the surrogate set's labels (read with the data crate's loaders),
/// and the backbone's weights (the surrogate set's features are computed at start).
#[cfg(feature = "sikf")]
fn check_sikf(section: &crate::config::SikfSection) -> Check {
    Check::outcome(
        "sikf",
        (|| {
            anyhow::ensure!(
                section.data_dir.is_dir(),
                "[sikf] data_dir {} is not a folder",
                section.data_dir.display()
            );
            let spec: anchorage_data::DataSpec =
                toml::Value::Table(section.data.clone()).try_into().context("[sikf.data]")?;
            let pools = anchorage_data::label_pools(&spec, Some(&section.data_dir))
                .with_context(|| format!("[sikf.data]: reading the labels in {}", section.data_dir.display()))?;
            let split = anchorage_data::build_split(&spec, &pools).context("[sikf.data]: partitioning")?;
            anyhow::ensure!(
                !split.surrogate.is_empty(),
                "[sikf.data]: the split has no surrogate set (a `fedta` partition with surrogate_per_class > 0 has one)"
            );
            anchorage_model::zoo::load(&section.backbone, 1, Some(&section.data_dir), &burn::tensor::Device::flex())
                .with_context(|| format!("[sikf]: the backbone `{}`", section.backbone))?;
            Ok(format!(
                "backbone {} (loads) on {} surrogate samples from {}",
                section.backbone,
                split.surrogate.len(),
                section.data_dir.display()
            ))
        })(),
    )
}

#[cfg(not(feature = "sikf"))]
fn check_sikf(_: &crate::config::SikfSection) -> Check {
    Check::outcome(
        "sikf",
        Err(anyhow::anyhow!(
            "server.toml has a [sikf] section, but this anchorage-server was built without SIKF: build it with \
             `cargo build --release -p anchorage-server --features sikf`"
        )),
    )
}

/// `[evaluation]`: the held-out set's labels and the backbone's weights (read with the loaders
/// the server evaluates with; the features are computed at start).
#[cfg(feature = "sikf")]
fn check_evaluation(section: &crate::config::EvaluationSection) -> Check {
    use crate::config::EvaluationData;
    let every = match section.every {
        1 => "after every round".to_string(),
        n => format!("after every {n}th round"),
    };
    match &section.data {
        EvaluationData::Synthetic { seed } => Check::new(
            "evaluation",
            Status::Ok,
            format!("the embedded set's test half (seed {seed}, no files), {every}"),
        ),
        EvaluationData::Scenario { data_dir, backbone, spec, .. } => Check::outcome::<anyhow::Error>(
            "evaluation",
            (|| {
                let spec: anchorage_data::DataSpec =
                    toml::Value::Table(spec.clone()).try_into().context("[evaluation] spec")?;
                let pools = anchorage_data::label_pools(&spec, Some(data_dir)).with_context(|| {
                    let missing = if data_dir.is_dir() { "" } else { ", which is not a folder" };
                    format!("[evaluation]: reading the labels in data_dir {}{missing}", data_dir.display())
                })?;
                anchorage_model::zoo::load(backbone, 1, Some(data_dir), &burn::tensor::Device::flex())
                    .with_context(|| format!("[evaluation]: the backbone `{backbone}`"))?;
                Ok(format!(
                    "{} held-out labels in {}, backbone {backbone} loads; {every}",
                    pools.test.len(),
                    data_dir.display()
                ))
            })(),
        ),
    }
}

#[cfg(not(feature = "sikf"))]
fn check_evaluation(_: &crate::config::EvaluationSection) -> Check {
    Check::outcome(
        "evaluation",
        Err(anyhow::anyhow!(
            "server.toml has an [evaluation] section, but this anchorage-server was built without the model and \
             data crates: build it with `cargo build --release -p anchorage-server --features sikf`"
        )),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use anchorage_pki::{Kind, ProjectCa};
    use anchorage_shared::tensor::Encoding;

    fn block(name: &str) -> ParamBlock {
        ParamBlock::encode(name, &[2], &[1.0, -1.0], Encoding::F32)
    }

    /// A provisioned-like server folder: CA, the server's pair, revoked.crl, a FedAvg model.
    fn site(dir: &Path) -> (std::path::PathBuf, ProjectCa) {
        // Well past WARN_DAYS: a CA of exactly 30 days has 29 left once a second passes, a warning.
        let mut ca = ProjectCa::init(&dir.join("ca"), "check", 365).unwrap();
        let site = dir.join("server");
        let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 300).unwrap();
        anchorage_pki::save_identity(&site, &identity).unwrap();
        std::fs::write(site.join(anchorage_pki::CA_CERT), ca.cert().as_ref()).unwrap();
        std::fs::write(site.join(anchorage_pki::CRL), ca.crl().unwrap().as_ref()).unwrap();
        model_file::save(&site.join("initial-model.bin"), &[block("body.weight"), block("head.weight")]).unwrap();
        let config = site.join("server.toml");
        std::fs::write(
            &config,
            "bind = \"127.0.0.1:4433\"\nmethod = \"fedavg\"\nstate_dir = \"state\"\ntls_dir = \".\"\n\
             initial_model = \"initial-model.bin\"\n",
        )
        .unwrap();
        (config, ca)
    }

    fn statuses(report: &Report) -> Vec<(&'static str, Status)> {
        report.checks.iter().map(|c| (c.name, c.status)).collect()
    }

    #[test]
    fn a_sound_folder_passes_every_check_without_making_anything() {
        let dir = tempfile::tempdir().unwrap();
        let (config, _) = site(dir.path());
        let report = run(&config);
        assert!(!report.failed(), "{}", report.render());
        let names: Vec<&str> = report.checks.iter().map(|c| c.name).collect();
        assert_eq!(names, ["config", "bind", "ca", "certificate", "key", "crl", "model", "state"]);
        assert!(report.get("certificate").unwrap().detail.contains("chains to the project CA"));
        assert!(report.get("state").unwrap().detail.contains("does not exist yet"), "{}", report.render());
        assert!(!dir.path().join("server/state").exists(), "nothing is made");
        assert!(report.render().ends_with("check-config: the server can start (0 warnings)\n"), "{}", report.render());
    }

    #[test]
    fn each_broken_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let (config, mut ca) = site(dir.path());
        let folder = config.parent().unwrap().to_path_buf();
        let failing = |name: &str| {
            let report = run(&config);
            let c = report.get(name).unwrap_or_else(|| panic!("no {name} check: {}", report.render()));
            assert_eq!(c.status, Status::Fail, "{}", report.render());
            assert!(report.failed());
            c.detail.clone()
        };

        // A certificate from another CA.
        let good_cert = std::fs::read(folder.join("cert.der")).unwrap();
        let good_key = std::fs::read(folder.join("key.der")).unwrap();
        let mut other = ProjectCa::in_memory("other", 30).unwrap();
        let stranger = other.issue(Kind::Server, "server", &[], 30).unwrap();
        std::fs::write(folder.join("cert.der"), stranger.cert.as_ref()).unwrap();
        let detail = failing("certificate");
        assert!(detail.contains("does not chain to") && detail.contains("ca.der"), "{detail}");
        // The key of another certificate.
        std::fs::write(folder.join("cert.der"), &good_cert).unwrap();
        std::fs::write(folder.join("key.der"), stranger.key.secret_der()).unwrap();
        let detail = failing("key");
        assert!(detail.contains("is not the key of") && detail.contains("cert.der"), "{detail}");
        std::fs::write(folder.join("key.der"), &good_key).unwrap();
        // A client certificate in the server's place.
        let client = ca.issue(Kind::Client, "server", &[], 30).unwrap();
        anchorage_pki::save_identity(&folder, &client).unwrap();
        assert!(failing("certificate").contains("does not chain to"));
        std::fs::write(folder.join("cert.der"), &good_cert).unwrap();
        std::fs::write(folder.join("key.der"), &good_key).unwrap();
        // A damaged or foreign revocation list.
        std::fs::write(folder.join(anchorage_pki::CRL), b"not a crl").unwrap();
        assert!(failing("crl").contains("revoked.crl"));
        std::fs::write(folder.join(anchorage_pki::CRL), other.crl().unwrap().as_ref()).unwrap();
        assert!(failing("crl").contains("another CA"));
        std::fs::write(folder.join(anchorage_pki::CRL), ca.crl().unwrap().as_ref()).unwrap();
        // A model for another method, or a damaged one.
        std::fs::write(&config, std::fs::read_to_string(&config).unwrap().replace("fedavg", "fedrep")).unwrap();
        let detail = failing("model");
        assert!(detail.contains("`fedrep`") && detail.contains("head blocks"), "{detail}");
        std::fs::write(&config, std::fs::read_to_string(&config).unwrap().replace("fedrep", "fedta")).unwrap();
        assert!(failing("model").contains("input-enhancement"));
        std::fs::write(&config, std::fs::read_to_string(&config).unwrap().replace("fedta", "fedavg")).unwrap();
        std::fs::write(folder.join("initial-model.bin"), b"ANCHMDL1 short").unwrap();
        assert!(failing("model").contains("initial-model.bin"));
        model_file::save(&folder.join("initial-model.bin"), &[block("body.weight")]).unwrap();
        assert!(!run(&config).failed());
        // The state folder is a file.
        std::fs::write(folder.join("state"), b"").unwrap();
        assert!(failing("state").contains("not a folder"));
        std::fs::remove_file(folder.join("state")).unwrap();
        // A missing CA stops the TLS checks at the first one.
        std::fs::remove_file(folder.join(anchorage_pki::CA_CERT)).unwrap();
        let report = run(&config);
        assert_eq!(report.get("ca").unwrap().status, Status::Fail);
        assert!(report.get("certificate").is_none(), "{}", report.render());
        assert!(report.render().contains("the server would NOT start: ca failed"), "{}", report.render());
    }

    #[test]
    fn an_empty_config_is_an_error_that_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.toml");
        for text in ["", "  \n\n", "# only a comment\n\n# and another\n"] {
            std::fs::write(&path, text).unwrap();
            let err = format!("{:#}", refuse_empty(&path).unwrap_err());
            assert!(err.contains("server.toml is empty"), "{err}");
            let report = run(&path);
            assert_eq!(statuses(&report), [("config", Status::Fail)]);
            assert!(report.checks[0].detail.contains("server.toml is empty"));
        }
        // Bad TOML is the parser's to report.
        std::fs::write(&path, "bind = ").unwrap();
        refuse_empty(&path).unwrap();
        assert!(run(&path).checks[0].detail.contains("parsing"), "{}", run(&path).render());
    }

    #[test]
    fn a_development_server_has_only_its_own_pair() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.toml");
        std::fs::write(
            &path,
            "bind = \"127.0.0.1:0\"\nmethod = \"local\"\nstate_dir = \"s\"\ntls_dir = \"t\"\ninsecure_dev = true\n",
        )
        .unwrap();
        let report = run(&path);
        assert!(!report.failed(), "{}", report.render());
        assert_eq!(
            statuses(&report),
            [
                ("config", Status::Ok),
                ("bind", Status::Warn),
                ("certificate", Status::Warn),
                ("model", Status::Ok),
                ("state", Status::Ok)
            ]
        );
        assert!(!dir.path().join("t").exists(), "no development pair is made");
    }

    #[test]
    fn held_out_evaluation_data_is_checked_too() {
        let dir = tempfile::tempdir().unwrap();
        let (config, _) = site(dir.path());
        let text = std::fs::read_to_string(&config).unwrap();
        std::fs::write(&config, format!("{text}[evaluation]\ndata = {{ source = \"synthetic\", seed = 7 }}\n"))
            .unwrap();
        let report = run(&config);
        let evaluation = report.get("evaluation").unwrap_or_else(|| panic!("{}", report.render()));
        if cfg!(feature = "sikf") {
            assert_eq!(evaluation.status, Status::Ok, "{}", report.render());
            assert!(evaluation.detail.contains("seed 7"), "{}", evaluation.detail);
            std::fs::write(
                &config,
                format!(
                    "{text}[evaluation]\ndata = {{ source = \"scenario\", data_dir = \"nowhere\", backbone = \"resnet20\", \
                     spec = {{ dataset = \"cifar100\", seed = 1, partition = {{ kind = \"iid\", clients = 2 }} }} }}\n"
                ),
            )
            .unwrap();
            let report = run(&config);
            let evaluation = report.get("evaluation").unwrap();
            assert_eq!(evaluation.status, Status::Fail, "{}", report.render());
            assert!(evaluation.detail.contains("nowhere"), "{}", evaluation.detail);
        } else {
            assert_eq!(evaluation.status, Status::Fail);
            assert!(evaluation.detail.contains("built without"), "{}", evaluation.detail);
        }
    }

    #[test]
    fn layouts_by_method() {
        let fedta = MethodConfig::named("fedta").unwrap();
        let fedavg = MethodConfig::named("fedavg").unwrap();
        let local = MethodConfig::named("local").unwrap();
        assert!(layout_fits(&[block("ie.keys"), block("ie.sets")], &fedta).is_ok());
        assert!(layout_fits(&[block("ie.keys"), block("head.weight")], &fedta).unwrap_err().contains("head.weight"));
        assert!(layout_fits(&[block("ie.keys")], &fedavg).unwrap_err().contains("FedTA's"));
        assert!(layout_fits(&[], &fedavg).is_err());
        assert!(layout_fits(&[], &local).is_ok());
        assert!(layout_fits(&[block("x")], &local).is_err());
    }
}
