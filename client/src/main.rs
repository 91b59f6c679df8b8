//! `anchorage-client --config client.toml`: the edge runtime as a long-running service (the
//! work is [`anchorage_client::runner`]).

use std::path::PathBuf;

use anchorage_client::config::ClientConfig;
use anchorage_shared::systemd;
use anyhow::Context;
use clap::Parser;

#[derive(Parser)]
#[command(name = "anchorage-client", version, about = "Anchorage edge client")]
struct Cli {
    /// Path of client.toml.
    #[arg(long, short)]
    config: PathBuf,
    #[arg(long, env = "ANCHORAGE_LOG", default_value = "info")]
    log: String,
    #[arg(long)]
    log_json: bool,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log).context("--log filter")?;
    let fmt = tracing_subscriber::fmt().with_env_filter(filter);
    if cli.log_json {
        fmt.json().init()
    } else {
        fmt.init()
    }
    let config = ClientConfig::load(&cli.config)?;
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run(config))
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
