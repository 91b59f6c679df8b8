//! `anchorage-server --config server.toml`: the coordinator as a long-running service. The
//! binary is [`main`]; it lives in the library so that tests can run the very same program as a
//! process they can `kill -9`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{EvaluationSection, ServerConfig};
use crate::engine::{AggregationMode, Checkpoint, RoundOutcome, RoundReport};
use crate::metrics::ServerMetrics;
use crate::metrics::http::{self, Exporter};
use crate::metrics::rounds::{self, Waiting};
use crate::store::ServerStore;
use crate::transport::{self, ServerEvent, ServerOptions};
use crate::{methods, tls};
use anchorage_shared::tensor::ParamBlock;
use anchorage_shared::{logging, systemd};
use anyhow::Context;
use clap::Parser;
use tokio::sync::mpsc;

#[cfg(feature = "sikf")]
mod evaluation;
mod relay;

use crate::relay::uplink::Ended;
use relay::{ParentEvent, RelayLink};

#[derive(Parser)]
#[command(
    name = "anchorage-server",
    version,
    about = "Anchorage federated continual learning coordinator",
    after_long_help = "Before the first start: `anchorage-server check-config --config server.toml`.\n\
        Shell completions: `anchorage-server completions bash|zsh|fish`; manual pages: `anchorage-server man --out DIR`."
)]
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
    /// The TLS folder, over server.toml's `tls_dir` (each relay pod of a StatefulSet reads its
    /// own: `/etc/anchorage/tls/$(POD_NAME)`).
    #[arg(long, env = "ANCHORAGE_TLS_DIR")]
    tls_dir: Option<PathBuf>,
    /// An operator's task on the state folder instead of serving.
    #[command(subcommand)]
    task: Option<Task>,
}

/// The operator's tasks on the state folder of `--config`'s server.
#[derive(clap::Subcommand)]
enum Task {
    /// Checks server.toml and every file it names without starting (the project CA, the
    /// server's certificate chained to it, its key, the revocation list, the initial model
    /// against the method, the state folder, the bind address): one line per check, exit
    /// status 1 if any fails. Nothing is bound, made or opened.
    CheckConfig,
    /// Checks the state folder (SQLite's integrity check, every checksum, versions against
    /// rounds, the generation witness) without stopping the server; exit status 1 on a problem.
    Check,
    /// Writes a copy of the database to FILE while the server runs, as it was when the task
    /// started (SQLite's VACUUM INTO: one snapshot), checks the copy, and prints the round and
    /// generation it holds.
    Backup { file: PathBuf },
    /// Puts a backup back (stop the server first): checks it, keeps the current database beside
    /// it, and accepts the rollback so that round numbers continue above every announced one;
    /// prints the round and generation it put back.
    Restore { file: PathBuf },
    /// Resumes from a database older than what the folder or the devices saw (after the server
    /// refused to start, or stopped opening rounds): round numbers continue above the highest
    /// announced round, or `--seen` (the highest round the devices report) if that is higher.
    AcceptRollback {
        #[arg(long)]
        seen: Option<u64>,
    },
    /// Prints the shell completion script for SHELL (bash, zsh, fish, elvish, powershell).
    #[command(hide = true)]
    Completions(logging::CompletionsArgs),
    /// Writes the manual pages (anchorage-server.1, one per task) into --out, or the main page
    /// to stdout.
    #[command(hide = true)]
    Man(logging::ManArgs),
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
            let restored = ServerStore::restore(dir, &file)
                .with_context(|| format!("restoring {} into {}", file.display(), dir.display()))?;
            println!("restored {} into {}: {restored}", file.display(), dir.display());
            Ok(true)
        }
        Task::AcceptRollback { seen } => {
            let floor = ServerStore::accept_rollback(dir, seen)
                .with_context(|| format!("accepting the rollback of {}", dir.display()))?;
            println!("rollback accepted for {}; the next round is numbered above {floor}", dir.display());
            Ok(true)
        }
        // Answered before the config is read (see `main`).
        Task::CheckConfig | Task::Completions(_) | Task::Man(_) => Ok(true),
    }
}

/// Reads server.toml; an empty one is an error that names it.
fn load_config(path: &std::path::Path) -> anyhow::Result<ServerConfig> {
    crate::check_config::refuse_empty(path)?;
    ServerConfig::load(path)
}

/// Parses the command line, sets up logging, and serves until SIGTERM or the last round.
/// Which program runs: the server, or the same program as a relay (`anchorage-relay`, whose
/// config must have a `[parent]` table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Program {
    Server,
    Relay,
}

impl Program {
    fn name(self) -> &'static str {
        match self {
            Self::Server => "anchorage-server",
            Self::Relay => "anchorage-relay",
        }
    }
}

pub fn main(program: Program) -> anyhow::Result<()> {
    use clap::{CommandFactory, FromArgMatches};
    let command = || Cli::command().name(program.name()).bin_name(program.name());
    let cli = Cli::from_arg_matches_mut(&mut command().get_matches()).unwrap_or_else(|e| e.exit());
    // Neither needs a config.
    match &cli.task {
        Some(Task::Completions(args)) => {
            logging::print_completions(command(), args);
            return Ok(());
        }
        Some(Task::Man(args)) => {
            for page in logging::write_man(command(), args)? {
                println!("{}", page.display());
            }
            return Ok(());
        }
        _ => {}
    }
    logging::init(&cli.log, cli.log_format.format()).context("--log filter")?;
    let Some(config_path) = cli.config else {
        command().error(clap::error::ErrorKind::MissingRequiredArgument, "--config <server.toml> is required").exit()
    };
    if let Some(Task::CheckConfig) = cli.task {
        if !crate::check_config::main(&config_path) {
            std::process::exit(1);
        }
        return Ok(());
    }
    if let Some(task) = cli.task {
        let sound = load_config(&config_path).and_then(|config| run_task(task, &config));
        let sound = logging::exit_on_error(sound, cli.log_format.format())?;
        if !sound {
            std::process::exit(1);
        }
        return Ok(());
    }
    let result = load_config(&config_path).and_then(|mut config| {
        anyhow::ensure!(
            program == Program::Server || config.parent.is_some(),
            "{}: anchorage-relay needs a [parent] table (the parent's address and certificate name)",
            config_path.display()
        );
        if let Some(bind) = cli.metrics_bind {
            config.metrics_bind = None;
            config.metrics.bind = Some(bind);
        }
        if let Some(dir) = cli.tls_dir {
            config.tls_dir = dir;
        }
        // A worker going idle gives its allocator cache back once a large fleet has left.
        let mut runtime = tokio::runtime::Builder::new_multi_thread();
        runtime.enable_all().on_thread_park(crate::metrics::flush_allocator_if_requested);
        runtime.build()?.block_on(serve(config))
    });
    logging::exit_on_error(result, cli.log_format.format())
}

/// Runs the server of `config` until SIGTERM, Ctrl-C or the last round.
pub async fn serve(config: ServerConfig) -> anyhow::Result<()> {
    // The metrics port first, so that probes see a server that is starting (/healthz 200,
    // /readyz 503) while a large database is checked.
    let exporter = Arc::new(Exporter::new());
    let (_metrics_stop, metrics_stop_rx) = tokio::sync::watch::channel(false);
    start_metrics_port(&config, exporter.clone(), metrics_stop_rx).await?;
    let (mut server, held_out, stored, mut relay) = start_federation(&config).await?;
    // Device ids on /metrics only when asked for: whoever reads the port would learn the fleet.
    server.metrics.set_device_series(if config.metrics.device_ids { config.metrics.device_series } else { 0 });
    exporter.attach(server.metrics.clone());
    let opening = OpeningRule::of(&config.engine);
    let (stored_round, open_at_start) = stored.map_or((0, false), |w| (w.round, !w.closed && w.round > 0));
    server.metrics.expect_devices(opening.at(stored_round, open_at_start));
    exporter.set_ready();
    // Under a Type=notify unit: ready now that QUIC (and the metrics port) listen; the watchdog
    // is pinged from this runtime until it ends.
    let _watchdog = systemd::ready(&format!("listening on {}", server.local_addr));
    serve_rounds(&config, &mut server, held_out, opening, &mut relay).await?;
    exporter.set_stopping();
    systemd::stopping("shutting down: closing connections and the store");
    server.shutdown().await
}

/// Binds `[metrics]`'s port (if any) and says who can reach it.
async fn start_metrics_port(
    config: &ServerConfig,
    exporter: Arc<Exporter>,
    stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let Some(bind) = config.metrics_address() else { return Ok(()) };
    let addr = http::serve(bind, exporter, stop).await.with_context(|| format!("binding the metrics port {bind}"))?;
    tracing::info!(%addr, "metrics port: http://{addr}/metrics, /healthz, /readyz");
    if addr.ip().is_unspecified() {
        tracing::warn!(%addr, "the metrics port listens on every interface: anyone who reaches it reads /metrics; \
            bind it to 127.0.0.1 or one address and firewall it (on Kubernetes: the pod IP and a NetworkPolicy)");
    } else if !addr.ip().is_loopback() {
        tracing::info!(%addr, "the metrics port is reachable beyond this host: restrict it to Prometheus and the probes");
    }
    Ok(())
}

/// The certificates and the revocation list first (a server that would not start anyway leaves
/// no state folder behind), then the database (a state folder that cannot be written, is locked
/// by another server, is corrupt or comes from a newer server stops us here, before QUIC
/// listens), the method, the held-out set, and QUIC. Also returns where the store stood.
async fn start_federation(
    config: &ServerConfig,
) -> anyhow::Result<(transport::ServerHandle, Option<HeldOut>, Option<crate::store::Witness>, Option<RelayLink>)> {
    let (identity, trust) = identity_and_trust(config)?;
    let store = ServerStore::open_with(&config.state_dir, config.store.clone())
        .with_context(|| format!("opening the state folder {}", config.state_dir.display()))?;
    let method_config = config.method.config()?;
    let mut engine = config.engine.clone();
    let method: Box<dyn methods::ServerMethod> = match &config.parent {
        Some(_) => {
            relay::check_relay(config, &method_config)?;
            engine.role = crate::engine::Role::Relay;
            methods::build(&method_config)
        }
        None => server_method(config, &method_config)?,
    };
    let relay_trust = config.parent.as_ref().map(|_| trust.clone());
    let held_out = config.evaluation.as_ref().map(held_out_evaluator).transpose()?;
    // Where the store stands, for the rule of `anchorage_waiting_for_devices`: a round the
    // engine resumes open, and (buffered mode) whether a version exists.
    let stored = store.stored_witness().ok();
    let mut server = transport::start(ServerOptions {
        bind: config.bind,
        identity,
        trust,
        engine,
        method,
        initial: match &config.initial_model {
            Some(path) => crate::model_file::load(path)?,
            None => Vec::new(),
        },
        limits: config.limits.clone(),
        store: Some(store),
    })
    .await?;
    tracing::info!(addr = %server.local_addr, method = %method_config.name(), relay = config.parent.is_some(), "listening");
    let relay = match (&config.parent, relay_trust) {
        (Some(parent), Some(trust)) => Some(RelayLink::start(config, parent, &mut server, &trust)?),
        _ => None,
    };
    Ok((server, held_out, stored, relay))
}

/// When devices count as missing (`anchorage_waiting_for_devices`): synchronous rounds need
/// `min_available` devices for every round, buffered mode only for its first version.
#[derive(Clone, Copy)]
struct OpeningRule {
    min_available: usize,
    stall_after: Duration,
    rounds: u64,
    synchronous: bool,
}

impl OpeningRule {
    fn of(engine: &crate::engine::EngineConfig) -> Self {
        Self {
            min_available: engine.min_available.max(1),
            stall_after: engine.round_deadline,
            rounds: engine.rounds,
            synchronous: !matches!(engine.mode, AggregationMode::Buffered { .. }),
        }
    }

    /// The rule after `versions` closed rounds (versions), with a round open or not.
    fn at(self, versions: u64, round_open: bool) -> rounds::Opening {
        rounds::Opening {
            min_available: if self.synchronous || versions == 0 { self.min_available } else { 1 },
            stall_after: self.stall_after,
            rounds: self.rounds,
            between_rounds: self.synchronous,
            round_open,
        }
    }
}

/// The serving loop: signals, then the engine's events, then a one-second tick for the waiting
/// log. Closed rounds are logged in order by their own task ([`RoundLog`]), after the held-out
/// evaluation of the new model (on a blocking thread), so that this loop keeps answering
/// signals meanwhile.
async fn serve_rounds(
    config: &ServerConfig,
    server: &mut transport::ServerHandle,
    held_out: Option<HeldOut>,
    opening: OpeningRule,
    relay: &mut Option<RelayLink>,
) -> anyhow::Result<()> {
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let metrics = server.metrics.clone();
    let (rounds_tx, rounds_rx) = mpsc::unbounded_channel();
    let db = config.state_dir.join(crate::store::DB_FILE);
    let reporter = RoundLog { metrics: metrics.clone(), held_out, rounds: config.engine.rounds, db: Some(db) };
    let mut reporter = tokio::spawn(reporter.run(rounds_rx));
    let mut waits = WaitLog::default();
    let second = Duration::from_secs(1);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + second, second);
    let mut closed_here = false;
    loop {
        tokio::select! {
            // Signals, then the engine's events, then the tick: a resumed finished run is said
            // before any wait for devices.
            biased;
            _ = tokio::signal::ctrl_c() => { tracing::info!("interrupted"); break; }
            _ = terminate.recv() => { tracing::info!("SIGTERM: shutting down"); break; }
            event = server.events.recv() => match event {
                Some(ServerEvent::RoundClosed { report, checkpoint }) => {
                    if !closed_here && !opening.synchronous {
                        metrics.expect_devices(opening.at(report.round, false));
                    }
                    closed_here = true;
                    systemd::status(&format!(
                        "round {} closed with {} updates; listening on {}",
                        report.round,
                        report.updates.len(),
                        server.local_addr
                    ));
                    if let Some(link) = relay.as_ref() {
                        link.round_closed(&checkpoint);
                    }
                    let _ = rounds_tx.send((report, checkpoint));
                }
                Some(ServerEvent::Finished) if !closed_here => {
                    metrics.set_run_finished();
                    say_run_is_over(config, server.local_addr);
                }
                Some(ServerEvent::Finished) => {
                    metrics.set_run_finished();
                    // The last round's line (and its held-out evaluation) first.
                    drop(rounds_tx);
                    tokio::select! {
                        _ = &mut reporter => {}
                        _ = tokio::signal::ctrl_c() => tracing::info!("interrupted"),
                        _ = terminate.recv() => tracing::info!("SIGTERM: shutting down"),
                    }
                    tracing::info!("all rounds done");
                    // Let the goodbyes reach the clients before closing.
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    break;
                }
                None => break,
            },
            parent = RelayLink::next(relay) => match parent {
                ParentEvent::Round(b) => server.parent_round(b),
                ParentEvent::Ended(ended) => {
                    *relay = None;
                    match ended {
                        Ok(Ended::Finished(reason)) => server.parent_goodbye(reason),
                        Ok(Ended::Stopped) => break,
                        Err(e) => return Err(e.context("the relay's link to its parent")),
                    }
                }
            },
            _ = tick.tick() => waits.check(metrics.waiting()),
        }
    }
    reporter.abort();
    Ok(())
}

/// Restarted on the state of a run whose rounds are all done: say so, and stay up to tell the
/// devices that connect (they stop instead of retrying).
fn say_run_is_over(config: &ServerConfig, addr: std::net::SocketAddr) {
    let rounds = config.engine.rounds;
    tracing::warn!(
        rounds,
        state_dir = %config.state_dir.display(),
        "the run is over: all {rounds} configured rounds closed before this start, so no round will open; \
         devices that connect are told that the federation finished. To train more rounds raise \
         [engine] rounds in server.toml and restart; to begin a new federation give it a new state_dir"
    );
    systemd::status(&format!("run finished ({rounds} rounds); listening on {addr}"));
}

/// The held-out evaluation of `[evaluation]`: the global model's blocks in, its accuracy out.
type Evaluate = Arc<dyn Fn(&[ParamBlock]) -> anyhow::Result<Option<f64>> + Send + Sync>;

/// `[evaluation]`'s evaluator and how often it runs.
struct HeldOut {
    evaluate: Evaluate,
    every: u64,
}

/// Loads `[evaluation]`'s held-out set (and computes its features) before the server listens.
#[cfg(feature = "sikf")]
fn held_out_evaluator(section: &EvaluationSection) -> anyhow::Result<HeldOut> {
    let started = Instant::now();
    let held_out = evaluation::build(section)?;
    tracing::info!(
        source = %held_out.source,
        every = section.every,
        seconds = started.elapsed().as_secs_f64(),
        "held-out evaluation of the global model {}",
        if section.every == 1 { "after every round".to_string() } else { format!("every {} rounds", section.every) },
    );
    Ok(HeldOut { evaluate: Arc::new(move |blocks| held_out.evaluate(blocks)), every: section.every })
}

/// Without the `sikf` feature the server has no model or data crate to evaluate with: refuse to
/// start rather than silently skip what the operator asked for.
#[cfg(not(feature = "sikf"))]
fn held_out_evaluator(_: &EvaluationSection) -> anyhow::Result<HeldOut> {
    anyhow::bail!(
        "server.toml has an [evaluation] section, but this anchorage-server was built without the model and \
         data crates: build it with `cargo build --release -p anchorage-server --features sikf`, or remove \
         [evaluation] (the devices' own accuracy is still logged and exported)"
    )
}

/// More rounds than this waiting behind an evaluation: the older ones are logged unevaluated.
const EVALUATION_BACKLOG: usize = 3;

/// Logs every closed round in order, one line each, after its held-out evaluation; exports
/// the evaluation's result.
struct RoundLog {
    metrics: Arc<ServerMetrics>,
    held_out: Option<HeldOut>,
    /// Rounds of the run (0: until stopped): the last one is always evaluated.
    rounds: u64,
    /// The store's database, where a held-out accuracy joins its round's report.
    db: Option<PathBuf>,
}

impl RoundLog {
    async fn run(self, mut closed: mpsc::UnboundedReceiver<(Arc<RoundReport>, Arc<Checkpoint>)>) {
        while let Some((report, checkpoint)) = closed.recv().await {
            let mut report = (*report).clone();
            let held_out = match &self.held_out {
                None => "off".to_string(),
                Some(h) if !due(&report, h.every, self.rounds) => "not this round".to_string(),
                Some(_) if closed.len() >= EVALUATION_BACKLOG => {
                    tracing::warn!(
                        round = report.round,
                        behind = closed.len(),
                        "held-out evaluation skipped: rounds close faster than the server evaluates (raise [evaluation] every)"
                    );
                    "skipped (behind)".to_string()
                }
                Some(h) => {
                    let evaluate = h.evaluate.clone();
                    let started = Instant::now();
                    let result = tokio::task::spawn_blocking(move || evaluate(&checkpoint.global)).await;
                    match result {
                        Ok(Ok(Some(accuracy))) => {
                            report.held_out_accuracy = Some(accuracy);
                            self.metrics.held_out_evaluated(report.round, accuracy);
                            let (db, round) = (self.db.clone(), report.round);
                            let stored = tokio::task::spawn_blocking(move || match db {
                                Some(db) => crate::store::record_held_out_accuracy(&db, round, accuracy),
                                None => Ok(()),
                            })
                            .await;
                            if let Ok(Err(e)) = stored {
                                tracing::error!(round, error = %e, "the held-out accuracy could not join the round's stored report");
                            }
                            tracing::debug!(
                                round = report.round,
                                seconds = started.elapsed().as_secs_f64(),
                                "held-out evaluation"
                            );
                            percent(accuracy)
                        }
                        Ok(Ok(None)) => "no samples".to_string(),
                        Ok(Err(e)) => {
                            tracing::error!(round = report.round, error = %format!("{e:#}"), "held-out evaluation failed");
                            "failed".to_string()
                        }
                        Err(e) => {
                            tracing::error!(round = report.round, error = %e, "held-out evaluation panicked");
                            "failed".to_string()
                        }
                    }
                }
            };
            log_round(&report, &held_out);
        }
    }
}

/// Whether a round's new model is evaluated: an aggregated round (a failed one kept the model)
/// every `every` rounds, and the run's last.
fn due(report: &RoundReport, every: u64, rounds: u64) -> bool {
    matches!(report.outcome, RoundOutcome::Aggregated)
        && (report.round.is_multiple_of(every.max(1)) || (rounds > 0 && report.round >= rounds))
}

fn percent(ratio: f64) -> String {
    format!("{:.1}%", ratio * 100.0)
}

/// The round's one line: outcome, updates of target and invited, who was missing, the devices'
/// own accuracy, the held-out accuracy, how long it took. A failed round's line is a warning.
fn log_round(report: &RoundReport, held_out: &str) {
    let outcome = match &report.outcome {
        RoundOutcome::Aggregated => "aggregated".to_string(),
        RoundOutcome::Failed { reason } => format!("failed: {reason}"),
    };
    let device = match report.device_accuracy() {
        Some((accuracy, n)) => format!("{} ({n} of {} reporting)", percent(accuracy), report.updates.len()),
        None => "none reported".to_string(),
    };
    macro_rules! line {
        ($level:ident) => {
            tracing::$level!(
                round = report.round,
                outcome = %outcome,
                updates = report.updates.len(),
                target = report.target,
                invited = report.sampled,
                missing = report.missing.len(),
                missing_ids = %crate::engine::preview(report.missing.iter(), 5),
                device_accuracy = %device,
                held_out_accuracy = %held_out,
                seconds = %format!("{:.2}", report.seconds()),
                "round closed"
            )
        };
    }
    if matches!(report.outcome, RoundOutcome::Failed { .. }) {
        line!(warn);
    } else {
        line!(info);
    }
    if let Some(p) = &report.privacy {
        tracing::info!(
            round = report.round,
            epsilon = %format!("{:.3}", p.epsilon),
            delta = p.delta,
            noise = p.noise.name(),
            noise_multiplier = %format!("{:.3}", p.noise_multiplier),
            clip = %format!("{:.4}", p.clip),
            sampling_rate = %format!("{:.3}", p.sampling_rate),
            rounds = p.rounds,
            "privacy spent"
        );
    }
    if let Some(s) = &report.secagg {
        let refused: u64 = s.refused.values().sum();
        tracing::info!(
            round = report.round,
            contributors = s.contributors,
            dropped_after_masking = s.dropped_after_masking,
            threshold = s.threshold,
            vector_len = s.vector_len,
            refused,
            failed = s.failed.as_deref().unwrap_or("no"),
            "secure aggregation: the server holds only the sum"
        );
    }
}

/// Logs the server's shortfall of devices: when it starts (at most once per round: a wait ends
/// only when a round opens), again every minute while it lasts (a warning once it has lasted a
/// round's deadline: a stall), and when it ends after a stall.
#[derive(Default)]
struct WaitLog {
    /// The shortfall being logged (its start, Unix seconds).
    since: Option<i64>,
    /// When its last line was written.
    logged_at: Option<Instant>,
    /// Whether a stall line was written.
    stalled: bool,
}

/// While a wait lasts, a line this often.
const WAIT_LOG_EVERY: Duration = Duration::from_secs(60);

impl WaitLog {
    fn check(&mut self, waiting: Option<Waiting>) {
        let now = crate::metrics::unix_now();
        match (waiting, self.since) {
            (Some(w), since) if since != Some(w.since) => {
                (self.since, self.logged_at, self.stalled) = (Some(w.since), Some(Instant::now()), false);
                let (needed, connected, min_available) = (w.needed, w.connected, w.min_available);
                tracing::info!(
                    needed,
                    connected,
                    min_available,
                    "waiting for {needed} device{} before the next round opens: {connected} of min_available = {min_available} connected",
                    if needed == 1 { "" } else { "s" }
                );
            }
            (Some(w), Some(_))
                if (w.stalled && !self.stalled) || self.logged_at.is_none_or(|t| t.elapsed() >= WAIT_LOG_EVERY) =>
            {
                self.logged_at = Some(Instant::now());
                let text = rounds::describe(&w, now);
                let (needed, connected, min_available, since) =
                    (w.needed, w.connected, w.min_available, rounds::utc(w.since));
                if w.stalled {
                    self.stalled = true;
                    tracing::warn!(needed, connected, min_available, %since, "stalled: {text}");
                    systemd::status(&format!("stalled: {text}"));
                } else {
                    tracing::info!(needed, connected, min_available, %since, "still {text}");
                }
            }
            (None, Some(since)) => {
                self.since = None;
                if std::mem::take(&mut self.stalled) {
                    tracing::info!(waited = %rounds::age(now - since), "enough devices connected again: rounds open");
                } else {
                    tracing::debug!(waited = %rounds::age(now - since), "enough devices connected");
                }
            }
            _ => {}
        }
    }
}

/// The server's certificate and who it lets in: the project CA's files in `tls_dir` (mutual
/// TLS), or, with `insecure_dev`, a self-signed development certificate and no client
/// certificates.
fn identity_and_trust(config: &ServerConfig) -> anyhow::Result<(anchorage_pki::Identity, tls::Trust)> {
    let dir = &config.tls_dir;
    if config.insecure_dev {
        let names: Vec<&str> = config.server_names.iter().map(String::as_str).collect();
        return Ok((anchorage_pki::identity::load_or_create(dir, &names)?, tls::Trust::InsecureDev));
    }
    let hint = "make the project's certificates with `anchorage ca init` and `anchorage ca issue server <name>` \
                (or `anchorage provision project.toml`), or set `insecure_dev = true` for a development run";
    let identity = anchorage_pki::load_identity(dir)?
        .with_context(|| format!("{} holds no cert.der / key.der: {hint}", dir.display()))?;
    let ca_path = dir.join(anchorage_pki::CA_CERT);
    let ca =
        std::fs::read(&ca_path).with_context(|| format!("reading the project CA {}: {hint}", ca_path.display()))?;
    let trust = tls::Trust::ProjectCa { ca: ca.into(), crl: Some(dir.join(anchorage_pki::CRL)) };
    // Fail closed: no revocation list, no start.
    trust.read_crl()?;
    Ok((identity, trust))
}

/// The method's server half; FedTA's distiller on `[sikf]`'s surrogate set
/// ([`crate::sikf::server_method`]).
#[cfg(feature = "sikf")]
fn server_method(
    config: &crate::config::ServerConfig,
    method: &anchorage_shared::method::MethodConfig,
) -> anyhow::Result<Box<dyn methods::ServerMethod>> {
    let surrogate = match (&config.sikf, method) {
        (Some(section), anchorage_shared::method::MethodConfig::FedTa(_)) => Some(crate::sikf::surrogate(section)?),
        _ => None,
    };
    crate::sikf::server_method(method, surrogate)
}

/// Without the `sikf` feature a `[sikf]` section cannot be honoured: refuse to start rather than
/// silently average.
#[cfg(not(feature = "sikf"))]
fn server_method(
    config: &crate::config::ServerConfig,
    method: &anchorage_shared::method::MethodConfig,
) -> anyhow::Result<Box<dyn methods::ServerMethod>> {
    if let (Some(_), anchorage_shared::method::MethodConfig::FedTa(_)) = (&config.sikf, method) {
        anyhow::bail!(
            "server.toml has a [sikf] section, but this anchorage-server was built without SIKF: \
             build it with `cargo build --release -p anchorage-server --features sikf`"
        );
    }
    Ok(methods::build(method))
}

#[cfg(test)]
mod round_log_tests {
    use super::*;

    fn report(round: u64, outcome: RoundOutcome) -> RoundReport {
        RoundReport {
            round,
            outcome,
            sampled: 2,
            target: 2,
            updates: Vec::new(),
            missing: Vec::new(),
            declined: Vec::new(),
            duplicates: 0,
            refused: 0,
            late_total: 0,
            payload_down: 0,
            started: Duration::ZERO,
            closed: Duration::ZERO,
            influence: Default::default(),
            held_out_accuracy: None,
            privacy: None,
            secagg: None,
        }
    }

    #[test]
    fn held_out_evaluations_follow_every_and_always_take_the_last_round() {
        let aggregated = |r| report(r, RoundOutcome::Aggregated);
        let due_rounds = |every, rounds| (1..=7).filter(|r| due(&aggregated(*r), every, rounds)).collect::<Vec<_>>();
        assert_eq!(due_rounds(1, 0), [1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(due_rounds(3, 0), [3, 6]);
        assert_eq!(due_rounds(3, 7), [3, 6, 7], "the run's last round is evaluated");
        // A failed round kept the model: nothing new to evaluate.
        assert!(!due(&report(3, RoundOutcome::Failed { reason: "0 of at least 1 updates arrived".into() }), 1, 0));
    }

    #[tokio::test]
    async fn rounds_are_logged_in_order_with_their_held_out_accuracy() {
        let metrics = Arc::new(ServerMetrics::new());
        let evaluate: Evaluate = Arc::new(|blocks: &[ParamBlock]| Ok(Some(0.25 * blocks.len() as f64)));
        let log =
            RoundLog { metrics: metrics.clone(), held_out: Some(HeldOut { evaluate, every: 2 }), rounds: 0, db: None };
        let (tx, rx) = mpsc::unbounded_channel();
        let checkpoint = |r| {
            let block = ParamBlock::encode("head.weight", &[1], &[0.0], anchorage_shared::tensor::Encoding::F32);
            Arc::new(Checkpoint {
                round: r,
                method: "fedavg".into(),
                global: vec![block; r as usize],
                stats: Default::default(),
                method_state: Vec::new(),
                prototypes: Vec::new(),
            })
        };
        for r in 1..=3 {
            tx.send((Arc::new(report(r, RoundOutcome::Aggregated)), checkpoint(r))).unwrap();
        }
        drop(tx);
        log.run(rx).await;
        // Round 2 was evaluated (every = 2), on a blocking thread, and exported.
        assert_eq!(metrics.held_out_accuracy(), Some((2, 0.5)));
    }
}
