//! `anchorage fleet`, `export` and `data describe`: flags to the simulator's and the data crate's
//! functions.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::builder::RangedU64ValueParser;
use clap::{Args, Subcommand};

use crate::sim::{SharedArgs, scenario_or_default, set_shared_flags};
use anchorage_sim::scenario;

#[derive(Args)]
pub(crate) struct FleetArgs {
    #[command(flatten)]
    shared: SharedArgs,
    /// The scenario (as for `anchorage sim`); default: the embedded default.
    #[arg(long)]
    scenario: Option<PathBuf>,
    /// This worker's shard, from 0 (a Kubernetes Indexed Job passes $JOB_COMPLETION_INDEX).
    #[arg(long, env = "JOB_COMPLETION_INDEX", requires = "of")]
    index: Option<usize>,
    /// The number of shards (workers).
    #[arg(long)]
    of: Option<usize>,
    /// The server, host:port.
    #[arg(long)]
    server: Option<String>,
    /// Another address the devices fail over to when --server cannot be reached or drops them
    /// (a tier's other relays), host:port; repeat for more, tried in turn.
    #[arg(long = "fallback", requires = "server")]
    fallbacks: Vec<String>,
    /// The name in the server's certificate (default: the host of --server).
    #[arg(long)]
    server_name: Option<String>,
    /// The project CA's folder (ca.der, ca.key): each device gets its own certificate from it.
    #[arg(long, default_value = "ca")]
    ca: PathBuf,
    /// Start a server here and this many worker processes; write one run folder.
    #[arg(long, conflicts_with_all = ["index", "server"], value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    local: Option<usize>,
    /// Run folder of a local fleet (default: runs/fleet-<seed>-<UTC date>T<time>).
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Args)]
pub(crate) struct ExportArgs {
    /// A scenario file (as for `anchorage sim`) with a `[data]` table, one task, FedAvg.
    scenario: PathBuf,
    /// Folder of the real datasets and weights (`../shared/data`).
    #[arg(long, env = "ANCHORAGE_DATA")]
    data_dir: Option<PathBuf>,
    /// Where the .npy files and meta.json go.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Subcommand)]
pub(crate) enum DataCommand {
    /// Per client and task: class histogram, sample counts, imbalance factor and label skew of a
    /// scenario's `[data]` table. Prints a table and writes the same as CSV. With a data folder,
    /// also reads and decodes every image file as `anchorage sim` would load it.
    Describe(DescribeArgs),
}

#[derive(Args)]
pub(crate) struct DescribeArgs {
    /// A scenario TOML file with a `[data]` table (see `scenarios/`).
    scenario: PathBuf,
    /// Folder of the real datasets (MNIST, CIFAR, Tiny-ImageNet). Without it, stand-in labels
    /// with the official per-class counts are used, and the output says so.
    #[arg(long, env = "ANCHORAGE_DATA")]
    data_dir: Option<PathBuf>,
    /// CSV output (default: `runs/<scenario file stem>.describe.csv` under the current folder).
    #[arg(long)]
    csv: Option<PathBuf>,
}

pub(crate) fn fleet(args: FleetArgs) -> anyhow::Result<()> {
    let (file, mut config) = scenario_or_default(args.scenario.as_deref())?;
    let file = file.as_ref();
    set_shared_flags(&mut config, file, &args.shared);
    scenario::check(&config, file)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    if let Some(workers) = args.local {
        let out = match args.out {
            Some(out) => out,
            None => {
                let name =
                    anchorage_sim::run_folder_name("fleet", config.federation.seed, std::time::SystemTime::now());
                anchorage_sim::claim_run_folder(Path::new("runs"), &name)
                    .context("creating the run folder under runs/")?
            }
        };
        let result = runtime.block_on(anchorage_sim::fleet::run_local(config, workers, &out, true))?;
        println!(
            "final accuracy {:.2}% (initial {}); {} rounds in {:.1} s",
            result.summary.final_accuracy * 100.0,
            anchorage_sim::percent(result.summary.initial_accuracy),
            result.summary.rounds.len(),
            result.summary.wall_seconds
        );
        anchorage_sim::report::write_report(&out)?;
        println!("run folder: {} (the server's state folder is {}/state)", out.display(), out.display());
        return Ok(());
    }
    let (Some(index), Some(of)) = (args.index, args.of) else {
        anyhow::bail!("give --local N, or --index I --of N --server host:port for one worker");
    };
    let server = args.server.context("a worker needs --server host:port")?;
    let resolve = |server: &str| -> anyhow::Result<std::net::SocketAddr> {
        std::net::ToSocketAddrs::to_socket_addrs(server)
            .with_context(|| format!("resolving {server}"))?
            .next()
            .with_context(|| format!("{server} resolves to no address"))
    };
    let address = resolve(&server)?;
    let fallbacks = args.fallbacks.iter().map(|f| resolve(f)).collect::<anyhow::Result<Vec<_>>>()?;
    let server_name = args
        .server_name
        .unwrap_or_else(|| server.rsplit_once(':').map_or(server.as_str(), |(host, _)| host).to_string());
    let server_name = if server_name.parse::<std::net::IpAddr>().is_ok() { "localhost".into() } else { server_name };
    let target = anchorage_sim::fleet::Target { server: address, fallbacks, server_name, ca_dir: args.ca };
    let summary = runtime.block_on(anchorage_sim::fleet::run_worker(&config, index, of, &target))?;
    println!(
        "worker {index} of {of}: {} devices, {} finished, {} updates acknowledged",
        summary.devices, summary.finished, summary.rounds
    );
    anyhow::ensure!(
        summary.finished == summary.devices,
        "{} devices did not finish",
        summary.devices - summary.finished
    );
    Ok(())
}

pub(crate) fn export(args: ExportArgs) -> anyhow::Result<()> {
    let mut config = anchorage_sim::scenario::sim_config(&args.scenario)?;
    if let Some(v) = args.data_dir {
        config.data.data_dir = Some(v);
    }
    let done = anchorage_sim::export::export(&config, &args.out)?;
    println!(
        "exported {} clients ({} training rows, {} test rows, {} features) into {}: {} files",
        done.clients,
        done.train_rows,
        done.test_rows,
        done.feature_dim,
        done.dir.display(),
        done.files.len()
    );
    Ok(())
}

pub(crate) fn describe(args: DescribeArgs) -> anyhow::Result<()> {
    let spec = anchorage_sim::scenario::data_spec(&args.scenario)?;
    let description = anchorage_data::describe(&spec, args.data_dir.as_deref())
        .with_context(|| format!("describing the data of {}", args.scenario.display()))?;
    println!("{description}");
    let csv = match args.csv {
        Some(csv) => csv,
        None => {
            let stem = args.scenario.file_stem().map_or_else(|| "scenario".into(), |s| s.to_string_lossy());
            std::fs::create_dir_all("runs").context("creating runs/ for the CSV")?;
            Path::new("runs").join(format!("{stem}.describe.csv"))
        }
    };
    let file = std::fs::File::create(&csv).with_context(|| format!("writing {}", csv.display()))?;
    description.write_csv(file).with_context(|| format!("writing {}", csv.display()))?;
    println!("csv: {}", csv.display());
    Ok(())
}
