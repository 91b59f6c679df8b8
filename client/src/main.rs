//! `anchorage-client --config client.toml`: the edge runtime as a long-running service (the
//! work is [`anchorage_client::runner`]); `anchorage-client doctor --config client.toml` checks
//! the device before the service starts ([`anchorage_client::doctor`]).

use std::path::PathBuf;
use std::process::ExitCode;

use anchorage_client::config::ClientConfig;
use anchorage_client::doctor::{self, DoctorArgs};
use anchorage_shared::{logging, systemd};
use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "anchorage-client", version, about = "Anchorage edge client")]
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
}

fn main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    let Some(path) = cli.config else {
        Cli::command().error(clap::error::ErrorKind::MissingRequiredArgument, "--config client.toml is required").exit()
    };
    let default_filter = if cli.command.is_some() { "warn" } else { "info" };
    logging::init(cli.log.as_deref().unwrap_or(default_filter), cli.log_format.format()).context("--log filter")?;
    if let Some(Command::Doctor(args)) = cli.command {
        return Ok(doctor::main(&path, &args));
    }
    let result = ClientConfig::load(&path)
        .and_then(|config| tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run(config)));
    logging::exit_on_error(result, cli.log_format.format())?;
    Ok(ExitCode::SUCCESS)
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
