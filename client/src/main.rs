//! `anchorage-client --config client.toml`: the edge runtime as a long-running service (the
//! work is [`anchorage_client::runner`]); `anchorage-client doctor --config client.toml` checks
//! the device before the service starts ([`anchorage_client::doctor`]).

use std::path::PathBuf;
use std::process::ExitCode;

use anchorage_client::check_config;
use anchorage_client::config::ClientConfig;
use anchorage_client::doctor::{self, DoctorArgs};
use anchorage_client::transport::{EXIT_REFUSED, Refused};
use anchorage_shared::{logging, systemd};
use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "anchorage-client",
    version,
    about = "Anchorage edge client",
    long_about = EXIT_STATUSES,
    after_long_help = "Before the first start: `anchorage-client check-config --config client.toml` (files only), then \
        `anchorage-client doctor --config client.toml` (also the server).\n\
        Shell completions: `anchorage-client completions bash|zsh|fish`; manual pages: `anchorage-client man --out DIR`."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Path of client.toml.
    #[arg(long, short, global = true)]
    config: Option<PathBuf>,
    /// Log filter (tracing EnvFilter syntax); logs go to stderr. Default: info (doctor: warn).
    #[arg(long, global = true, env = "ANCHORAGE_LOG")]
    log: Option<String>,
    #[command(flatten)]
    log_format: logging::LogFormatArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Checks this device before its service starts: compute device, memory plan, state folder,
    /// certificates, a QUIC handshake with the server, the clock; exits 1 if any check fails.
    Doctor(DoctorArgs),
    /// Checks client.toml and every file it names without starting and without the network: the
    /// certificate chained to the trusted CA, its key, the compute device, the memory plan, the
    /// state folder, the data share; one line per check, exit status 1 if any fails.
    CheckConfig,
    /// Prints the shell completion script for SHELL (bash, zsh, fish, elvish, powershell).
    #[command(hide = true)]
    Completions(logging::CompletionsArgs),
    /// Writes the manual pages (anchorage-client.1, one per subcommand) into --out, or the main
    /// page to stdout.
    #[command(hide = true)]
    Man(logging::ManArgs),
}

fn main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    // Neither needs a config.
    match &cli.command {
        Some(Command::Completions(args)) => {
            logging::print_completions(Cli::command(), args);
            return Ok(ExitCode::SUCCESS);
        }
        Some(Command::Man(args)) => {
            for page in logging::write_man(Cli::command(), args)? {
                println!("{}", page.display());
            }
            return Ok(ExitCode::SUCCESS);
        }
        _ => {}
    }
    let Some(path) = cli.config else {
        Cli::command().error(clap::error::ErrorKind::MissingRequiredArgument, "--config client.toml is required").exit()
    };
    let default_filter = if cli.command.is_some() { "warn" } else { "info" };
    logging::init(cli.log.as_deref().unwrap_or(default_filter), cli.log_format.format()).context("--log filter")?;
    match cli.command {
        Some(Command::Doctor(args)) => return Ok(doctor::main(&path, &args)),
        Some(Command::CheckConfig) => return Ok(check_config::main(&path)),
        _ => {}
    }
    let result = check_config::refuse_empty(&path)
        .and_then(|()| ClientConfig::load(&path))
        .and_then(|config| tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run(config)));
    if let Err(e) = &result
        && let Some(refused) = e.downcast_ref::<Refused>()
    {
        return Ok(refused_exit(refused));
    }
    logging::exit_on_error(result, cli.log_format.format())?;
    Ok(ExitCode::SUCCESS)
}

/// `--help`'s description: what the exit statuses mean.
const EXIT_STATUSES: &str = "Anchorage edge client: trains on this device's data and takes part in the server's \
    rounds until the server ends the run.\n\n\
    Exit status:\n  \
    0   the server ended the run, or the client was stopped (SIGTERM, Ctrl-C)\n  \
    1   an error: client.toml or a file it names, the state folder, the compute device...\n  \
    77  the server refused this device for good: its certificate is revoked, expired, from another CA or \
    names no device, or the server does not take its id, protocol or method. The log's last line says which \
    and what to do (a new certificate: `anchorage ca issue client <id>` or `anchorage ca renew <id>`, or \
    re-provisioning). Restarting does not help, so the systemd unit does not \
    (RestartPreventExitStatus=77); `systemctl restart anchorage-client` once it is fixed.\n\n\
    A server that is down, restarting or unreachable is not an error: the client retries with exponential \
    backoff (client.toml's [reconnect]) and logs each retry.";

/// The server refused this device for good: one error line that says which device, why and what
/// to do, and the exit status that systemd does not restart ([`EXIT_REFUSED`]).
fn refused_exit(refused: &Refused) -> ExitCode {
    tracing::error!(
        client = %refused.client,
        server = %refused.server,
        kind = ?refused.kind,
        exit_status = EXIT_REFUSED,
        "{refused}. Stopping with exit status {EXIT_REFUSED}: restarting will not help until this is fixed"
    );
    systemd::status(&format!("refused by the server ({:?}); see the log", refused.kind));
    ExitCode::from(EXIT_REFUSED)
}

async fn run(config: ClientConfig) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(t) => t,
            Err(_) => return,
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("stopping: goodbye to the server");
        systemd::stopping("stopping: goodbye to the server");
        let _ = stop_tx.send(true);
    });
    let (id, server) = (config.client_id.clone(), config.server.clone());
    // Under a Type=notify unit: ready once configured (a device keeps dialling a server that is
    // down, so readiness cannot wait for the server); the watchdog is pinged from this runtime.
    let reason = anchorage_client::runner::run_configured(config, Some(stop_rx), |device| {
        let _ = systemd::ready(&format!("{id} on {device}: connecting to {server}"));
    })
    .await?;
    tracing::info!(%reason, "client finished");
    Ok(())
}
