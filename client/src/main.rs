//! `anchorage-client --config client.toml`: the edge runtime as a long-running service.

use std::path::PathBuf;

use anchorage_client::config::{ClientConfig, DataSource};
use anchorage_client::methods::{self, MethodContext};
use anchorage_client::store::ClientStore;
use anchorage_client::transport::{self, Backoff, ClientOptions};
use anchorage_client::{device, encoding};
use anchorage_data::{SyntheticConfig, partition, synthetic};
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
    let (dev, picked) = device::select(&config.device)?;
    tracing::info!(device = picked, "compute device");
    let (train, test) = match &config.data {
        DataSource::Synthetic { seed, clients, index, alpha } => {
            anyhow::ensure!(index < clients, "data.index {index} must be below data.clients {clients}");
            let (all, _) = synthetic::generate(&SyntheticConfig { seed: *seed, ..SyntheticConfig::default() });
            let parts = partition::dirichlet(&all.labels, all.num_classes, *clients, *alpha, 20, *seed)?;
            all.subset(&parts[*index]).split_per_class(0.8, seed ^ *index as u64)
        }
    };
    tracing::info!(train = train.len(), test = test.len(), "local data (embedded synthetic set)");
    let enc = encoding::parse(&config.encoding)?;
    let context =
        MethodContext::embedded(config.method.clone(), &train, &test, dev.autodiff(), config.optimizer, enc, 0);
    let method = methods::build(context)?;
    let cert = std::fs::read(&config.server_cert)
        .with_context(|| format!("reading the pinned server certificate {}", config.server_cert.display()))?;
    let mut options = ClientOptions::new(config.server, cert.into(), config.client_id.clone());
    options.server_name = config.server_name.clone();
    options.backend = picked.into();
    options.memory_mb = config.memory_mb;
    options.store = Some(ClientStore::new(&config.state_dir));
    options.backoff = Backoff {
        initial: std::time::Duration::from_millis(config.reconnect.initial_ms),
        max: std::time::Duration::from_millis(config.reconnect.max_ms),
        max_attempts: None,
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    options.stop = Some(stop_rx);
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
        let _ = stop_tx.send(true);
    });
    let reason = transport::run(options, method, None).await?;
    tracing::info!(%reason, "client finished");
    Ok(())
}
