//! `anchorage-server --config server.toml`: the coordinator as a long-running service. The
//! binary is [`main`]; it lives in the library so that tests can run the very same program as a
//! process they can `kill -9`.

use std::path::PathBuf;
use std::sync::Arc;

use crate::config::ServerConfig;
use crate::metrics::http::{self, Exporter};
use crate::store::ServerStore;
use crate::transport::{self, ServerEvent, ServerOptions};
use crate::{methods, tls};
use anchorage_shared::{logging, systemd};
use anyhow::Context;
use clap::Parser;

#[derive(Parser)]
#[command(name = "anchorage-server", version, about = "Anchorage federated continual learning coordinator")]
struct Cli {
    /// Path of server.toml (before or after the task: `anchorage-server check --config server.toml`).
    #[arg(long, short, global = true)]
    config: Option<PathBuf>,
    /// Log filter (tracing EnvFilter syntax); logs go to stderr.
    #[arg(long, env = "ANCHORAGE_LOG", default_value = "info")]
    log: String,
    #[command(flatten)]
    log_format: logging::LogFormatArgs,
    /// Address of the metrics port, over server.toml's (`IP:PORT`; a bare IPv6 address works too,
    /// e.g. `$(POD_IP):9464` from the Kubernetes downward API).
    #[arg(long, env = "ANCHORAGE_METRICS_BIND", value_parser = crate::config::parse_bind)]
    metrics_bind: Option<std::net::SocketAddr>,
    /// An operator's task on the state folder instead of serving.
    #[command(subcommand)]
    task: Option<Task>,
}

/// The operator's tasks on the state folder of `--config`'s server.
#[derive(clap::Subcommand)]
enum Task {
    /// Checks the state folder (SQLite's integrity check, every checksum, versions against
    /// rounds, the generation witness) without stopping the server; exit status 1 on a problem.
    Check,
    /// Writes a consistent copy of the database to FILE while the server runs (SQLite's online
    /// backup API), then checks the copy.
    Backup { file: PathBuf },
    /// Puts a backup back (stop the server first): checks it, keeps the current database beside
    /// it, and accepts the rollback so that round numbers continue above every announced one.
    Restore { file: PathBuf },
    /// Resumes from a database older than what the folder or the devices saw (after the server
    /// refused to start, or stopped opening rounds): round numbers continue above the highest
    /// announced round, or `--seen` (the highest round the devices report) if that is higher.
    AcceptRollback {
        #[arg(long)]
        seen: Option<u64>,
    },
}

/// Runs an operator's task; returns whether it found the folder sound.
fn run_task(task: Task, config: &ServerConfig) -> anyhow::Result<bool> {
    let dir = &config.state_dir;
    match task {
        Task::Check => {
            let report = ServerStore::check(dir).with_context(|| format!("checking {}", dir.display()))?;
            println!("{report}");
            Ok(report.ok())
        }
        Task::Backup { file } => {
            let report = ServerStore::backup(dir, &file).with_context(|| format!("backing up {}", dir.display()))?;
            println!("backup written to {}\n{report}", file.display());
            Ok(report.ok())
        }
        Task::Restore { file } => {
            let floor = ServerStore::restore(dir, &file)
                .with_context(|| format!("restoring {} into {}", file.display(), dir.display()))?;
            println!("restored {} into {}; the next round is numbered above {floor}", file.display(), dir.display());
            Ok(true)
        }
        Task::AcceptRollback { seen } => {
            let floor = ServerStore::accept_rollback(dir, seen)
                .with_context(|| format!("accepting the rollback of {}", dir.display()))?;
            println!("rollback accepted for {}; the next round is numbered above {floor}", dir.display());
            Ok(true)
        }
    }
}

/// Parses the command line, sets up logging, and serves until SIGTERM or the last round.
pub fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    logging::init(&cli.log, cli.log_format.format()).context("--log filter")?;
    let Some(config_path) = cli.config else {
        use clap::CommandFactory;
        Cli::command()
            .error(clap::error::ErrorKind::MissingRequiredArgument, "--config <server.toml> is required")
            .exit()
    };
    if let Some(task) = cli.task {
        let sound = ServerConfig::load(&config_path).and_then(|config| run_task(task, &config));
        let sound = logging::exit_on_error(sound, cli.log_format.format())?;
        if !sound {
            std::process::exit(1);
        }
        return Ok(());
    }
    let result = ServerConfig::load(&config_path).and_then(|mut config| {
        if let Some(bind) = cli.metrics_bind {
            config.metrics_bind = None;
            config.metrics.bind = Some(bind);
        }
        tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(serve(config))
    });
    logging::exit_on_error(result, cli.log_format.format())
}

/// Runs the server of `config` until SIGTERM, Ctrl-C or the last round.
pub async fn serve(config: ServerConfig) -> anyhow::Result<()> {
    // The metrics port first, so that probes see a server that is starting (/healthz 200,
    // /readyz 503) while a large database is checked.
    let exporter = Arc::new(Exporter::new());
    let (_metrics_stop, metrics_stop_rx) = tokio::sync::watch::channel(false);
    if let Some(bind) = config.metrics_address() {
        let addr = http::serve(bind, exporter.clone(), metrics_stop_rx)
            .await
            .with_context(|| format!("binding the metrics port {bind}"))?;
        tracing::info!(%addr, "metrics port: http://{addr}/metrics, /healthz, /readyz");
        if addr.ip().is_unspecified() {
            tracing::warn!(%addr, "the metrics port listens on every interface: anyone who reaches it reads /metrics; \
                bind it to 127.0.0.1 or one address and firewall it (on Kubernetes: the pod IP and a NetworkPolicy)");
        } else if !addr.ip().is_loopback() {
            tracing::info!(%addr, "the metrics port is reachable beyond this host: restrict it to Prometheus and the probes");
        }
    }
    // Then the database: a state folder that cannot be written, is locked by another server, is
    // corrupt or comes from a newer server stops us here, before QUIC listens.
    // The certificates and the revocation list first: a server that would not start anyway
    // leaves no state folder behind.
    let (identity, trust) = identity_and_trust(&config)?;
    let store = ServerStore::open_with(&config.state_dir, config.store.clone())
        .with_context(|| format!("opening the state folder {}", config.state_dir.display()))?;
    let method_config = config.method.config()?;
    let mut parts = methods::Parts::default();
    if let (Some(section), anchorage_shared::method::MethodConfig::FedTa(fedta)) = (&config.sikf, &method_config) {
        parts.distiller = Some(sikf_distiller(section, fedta)?);
    }
    let method = methods::build_with(&method_config, parts);
    let mut server = transport::start(ServerOptions {
        bind: config.bind,
        identity,
        trust,
        engine: config.engine.clone(),
        method,
        initial: match &config.initial_model {
            Some(path) => crate::model_file::load(path)?,
            None => Vec::new(),
        },
        limits: config.limits.clone(),
        store: Some(store),
    })
    .await?;
    tracing::info!(addr = %server.local_addr, method = %method_config.name(), "listening");
    // Device ids on /metrics only when asked for: whoever reads the port would learn the fleet.
    server.metrics.set_device_series(if config.metrics.device_ids { config.metrics.device_series } else { 0 });
    exporter.attach(server.metrics.clone());
    exporter.set_ready();
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // Under a Type=notify unit: ready now that QUIC (and the metrics port) listen; the watchdog
    // is pinged from this runtime until it ends.
    let _watchdog = systemd::ready(&format!("listening on {}", server.local_addr));
    loop {
        tokio::select! {
            event = server.events.recv() => match event {
                Some(ServerEvent::RoundClosed { report, .. }) => {
                    tracing::info!(
                        round = report.round,
                        updates = report.updates.len(),
                        missing = report.missing.len(),
                        late_total = report.late_total,
                        train_loss = report.weighted_metric("train_loss"),
                        "round summary"
                    );
                    systemd::status(&format!(
                        "round {} closed with {} updates; listening on {}",
                        report.round,
                        report.updates.len(),
                        server.local_addr
                    ));
                }
                Some(ServerEvent::Finished) => {
                    tracing::info!("all rounds done");
                    // Let the goodbyes reach the clients before closing.
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                    break;
                }
                None => break,
            },
            _ = tokio::signal::ctrl_c() => { tracing::info!("interrupted"); break; }
            _ = terminate.recv() => { tracing::info!("SIGTERM: shutting down"); break; }
        }
    }
    exporter.set_stopping();
    systemd::stopping("shutting down: closing connections and the store");
    server.shutdown().await
}

/// The server's certificate and who it lets in: the project CA's files in `tls_dir` (mutual
/// TLS), or, with `insecure_dev`, a self-signed development certificate and no client
/// certificates.
fn identity_and_trust(config: &ServerConfig) -> anyhow::Result<(tls::Identity, tls::Trust)> {
    let dir = &config.tls_dir;
    if config.insecure_dev {
        let names: Vec<&str> = config.server_names.iter().map(String::as_str).collect();
        return Ok((tls::load_or_create(dir, &names)?, tls::Trust::InsecureDev));
    }
    let hint = "make the project's certificates with `anchorage ca init` and `anchorage ca issue server <name>` \
                (or `anchorage provision project.toml`), or set `insecure_dev = true` for a development run";
    let identity =
        tls::load_identity(dir)?.with_context(|| format!("{} holds no cert.der / key.der: {hint}", dir.display()))?;
    let ca_path = dir.join(crate::ca::CA_CERT);
    let ca =
        std::fs::read(&ca_path).with_context(|| format!("reading the project CA {}: {hint}", ca_path.display()))?;
    let trust = tls::Trust::ProjectCa { ca: ca.into(), crl: Some(dir.join(crate::ca::CRL)) };
    // Fail closed: no revocation list, no start.
    trust.read_crl()?;
    Ok((identity, trust))
}

/// FedTA's distiller from `[sikf]`.
#[cfg(feature = "sikf")]
fn sikf_distiller(
    section: &crate::config::SikfSection,
    method: &anchorage_shared::method::FedTaConfig,
) -> anyhow::Result<Box<dyn methods::InputDistiller>> {
    Ok(Box::new(crate::sikf::distiller(section, method)?))
}

/// Without the `sikf` feature a `[sikf]` section cannot be honoured: refuse to start rather than
/// silently average.
#[cfg(not(feature = "sikf"))]
fn sikf_distiller(
    _: &crate::config::SikfSection,
    _: &anchorage_shared::method::FedTaConfig,
) -> anyhow::Result<Box<dyn methods::InputDistiller>> {
    anyhow::bail!(
        "server.toml has a [sikf] section, but this anchorage-server was built without SIKF: \
         build it with `cargo build --release -p anchorage-server --features sikf`"
    )
}
