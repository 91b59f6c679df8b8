//! `anchorage`: the command line, a thin layer over the libraries. Each command parses its flags
//! here and calls the crate that does the work: `sim`, `fleet`, `report`, `compare`, `export`
//! and `microbench` (anchorage-sim), `data` (anchorage-data), `ca` (anchorage-pki) and
//! `provision` (this crate's library, over anchorage-pki and the two programs' configs).

mod ca;
mod sim;
mod swarm;
mod tools;

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "anchorage",
    version,
    about = "Federated continual learning for edge devices: simulate and report",
    after_long_help = "Shell completions: `anchorage completions bash|zsh|fish`; manual pages: `anchorage man --out DIR`."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log filter (e.g. `info`, `anchorage_server=debug`); logs go to stderr.
    #[arg(long, global = true, env = "ANCHORAGE_LOG", default_value = "warn")]
    log: String,
    #[command(flatten)]
    log_format: anchorage_shared::logging::LogFormatArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Run one server and N clients in this process over real QUIC on loopback.
    /// With no arguments: the embedded default (synthetic data made in code, FedAvg).
    Sim(sim::SimArgs),
    /// Simulated devices as worker processes over real QUIC: `--index I --of N` runs shard I of
    /// N of the scenario's clients against `--server`; `--local N` starts a server here and N
    /// workers, and writes one run folder.
    Fleet(tools::FleetArgs),
    /// A whole federation drawn from a seed (topology, method, features, faults) on the virtual
    /// clock, every promise checked after every step; a broken one prints the seed and step.
    Swarm(swarm::SwarmArgs),
    /// Plots (SVG and PNG) and a Markdown summary of a run folder or of a server's state folder.
    Report {
        /// A run folder written by `anchorage sim` (or `anchorage fleet --local`), or a server's
        /// state folder (its `state_dir`, read only).
        run: PathBuf,
        /// Where the report goes (default: the run folder; for a state folder, a new folder
        /// ./report-<name>-<UTC date>T<time>, never the state folder).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Write into an --out folder that holds another run or another folder's report (its
        /// report.md and charts are replaced; nothing else is touched).
        #[arg(long)]
        force: bool,
        /// A state folder's server.toml, for the rounds the server was set to run (default: the
        /// server.toml beside the state folder, or /etc/anchorage/server.toml, that names it).
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Runs side by side: a table of key metrics (one column per run folder) and their accuracy
    /// by round overlaid in compare_accuracy.svg / .png.
    Compare {
        /// Run folders written by `anchorage sim` (or `anchorage fleet --local`).
        #[arg(required = true)]
        runs: Vec<PathBuf>,
        /// Where the chart goes (default: the first run's parent folder).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// A scenario's federation as NumPy files for a peer framework (benches/peers): features,
    /// each client's rows and batch order, the clients of each round, the initial weights.
    Export(tools::ExportArgs),
    /// The peer benchmark's kernels, as JSON: a training step (MLP 784-256-10, Adam, batch 32)
    /// against the measured matmul rate, and FedAvg of 100 updates of 1 MB against a STREAM-like
    /// copy. Threads follow RAYON_NUM_THREADS.
    Microbench,
    /// Data settings: inspect what a scenario's partition gives each client.
    #[command(subcommand)]
    Data(tools::DataCommand),
    /// The project CA: the root every site trusts, and the certificates it signs.
    #[command(subcommand)]
    Ca(ca::CaCommand),
    /// One ready folder per site (server and each device) from a project file: certificate,
    /// key (0600), the CA's certificate and a complete server.toml / client.toml. Makes the CA
    /// when it does not exist; run again to add devices (existing keys are kept).
    Provision {
        /// The project file (see deploy/project.toml).
        project: PathBuf,
        /// Where the site folders go (default: the project file's `out`, `sites` next to it).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Prints the shell completion script for SHELL (bash, zsh, fish, elvish, powershell).
    #[command(hide = true)]
    Completions(anchorage_shared::logging::CompletionsArgs),
    /// Writes the manual pages (anchorage.1, one per subcommand: anchorage-sim.1, anchorage-ca-init.1,
    /// …) into --out, or the main page to stdout.
    #[command(hide = true)]
    Man(anchorage_shared::logging::ManArgs),
}

/// Environment variables the flags read, set but empty, count as unset.
fn unset_empty_env() {
    fn envs(command: &clap::Command, names: &mut Vec<std::ffi::OsString>) {
        names.extend(command.get_arguments().filter_map(|a| a.get_env()).map(|e| e.to_os_string()));
        command.get_subcommands().for_each(|c| envs(c, names));
    }
    let mut names = Vec::new();
    envs(&Cli::command(), &mut names);
    for name in names {
        if std::env::var_os(&name).is_some_and(|v| v.is_empty()) {
            // SAFETY: called first thing in main, before any other thread exists.
            unsafe { std::env::remove_var(&name) };
        }
    }
}

fn main() -> anyhow::Result<()> {
    unset_empty_env();
    let cli = Cli::parse();
    anchorage_shared::logging::init(&cli.log, cli.log_format.format()).context("--log filter")?;
    match cli.command {
        Command::Sim(args) => sim::sim(args),
        Command::Swarm(args) => swarm::swarm(args),
        Command::Fleet(args) => tools::fleet(args),
        Command::Data(tools::DataCommand::Describe(args)) => tools::describe(args),
        Command::Export(args) => tools::export(args),
        Command::Microbench => {
            println!("{}", serde_json::to_string(&anchorage_sim::microbench::run()?)?);
            Ok(())
        }
        Command::Ca(command) => ca::run(command),
        Command::Provision { project, out } => ca::provision(&project, out.as_deref()),
        Command::Completions(args) => {
            anchorage_shared::logging::print_completions(Cli::command(), &args);
            Ok(())
        }
        Command::Man(args) => {
            for page in anchorage_shared::logging::write_man(Cli::command(), &args)? {
                println!("{}", page.display());
            }
            Ok(())
        }
        Command::Report { run, out, force, config } => {
            let options = anchorage_sim::report::ReportOptions { out, force, server_config: config };
            let files = anchorage_sim::report::write_report_with(&run, &options)?.files;
            // A closed stdout (`anchorage report DIR | head -1`) ends the listing, not the program.
            let mut out = std::io::stdout().lock();
            for file in files {
                if writeln!(out, "{}", file.display()).is_err() {
                    break;
                }
            }
            Ok(())
        }
        Command::Compare { runs, out } => anchorage_sim::compare::print(&runs, out.as_deref()),
    }
}
