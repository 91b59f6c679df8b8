//! `anchorage`: the simulator's command line.

use std::io::Write;
use std::path::{Path, PathBuf};

use anchorage_data::PartitionSpec;
use anchorage_sim::device::DeviceProfile;
use anchorage_sim::network::DuplexProfile;
use anchorage_sim::recorder::{Console, Recorder, StopFlag};
use anchorage_sim::scenario::{self, ConfigFile};
use anchorage_sim::{Clock, SimConfig};
use anyhow::Context;
use clap::builder::{PossibleValuesParser, RangedU64ValueParser};
use clap::{Args, CommandFactory, Parser, Subcommand};

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
    Sim(SimArgs),
    /// Simulated devices as worker processes over real QUIC: `--index I --of N` runs shard I of
    /// N of the scenario's clients against `--server`; `--local N` starts a server here and N
    /// workers, and writes one run folder.
    Fleet(FleetArgs),
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
    Export(ExportArgs),
    /// The peer benchmark's kernels, as JSON: a training step (MLP 784-256-10, Adam, batch 32)
    /// against the measured matmul rate, and FedAvg of 100 updates of 1 MB against a STREAM-like
    /// copy. Threads follow RAYON_NUM_THREADS.
    Microbench,
    /// Data settings: inspect what a scenario's partition gives each client.
    #[command(subcommand)]
    Data(DataCommand),
    /// The project CA: the root every site trusts, and the certificates it signs.
    #[command(subcommand)]
    Ca(CaCommand),
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

#[derive(Args)]
struct FleetArgs {
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
struct ExportArgs {
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
enum CaCommand {
    /// Makes the project's root: ca.der (given to every site) and ca.key (0600, stays here).
    Init {
        #[arg(long, default_value = "ca")]
        dir: PathBuf,
        /// The project's name, in the root's common name.
        #[arg(long, default_value = "anchorage")]
        name: String,
        #[arg(long, default_value_t = anchorage_sim::provision::DEFAULT_CA_DAYS)]
        days: u32,
    },
    /// Signs a certificate for a server or a device: writes cert.der, key.der (0600) and ca.der
    /// into --out (a server's also the CA's revoked.crl, which it needs to start).
    Issue {
        kind: KindArg,
        /// The site's id (a device's id is the client id the server knows it by).
        id: String,
        /// A DNS name (or IP address) the server is reached by; repeat for more.
        #[arg(long = "name")]
        names: Vec<String>,
        #[command(flatten)]
        site: SiteArgs,
    },
    /// Revokes every certificate of an id and rewrites the CA's revoked.crl.
    Revoke {
        id: String,
        /// Only the certificate with this serial (from `anchorage ca list`), e.g. the old one after
        /// a renewal; without it every certificate of the id is revoked.
        #[arg(long)]
        serial: Option<String>,
        #[arg(long, default_value = "ca")]
        dir: PathBuf,
    },
    /// What the CA issued: id, kind, serial, expiry, revocation.
    List {
        #[arg(long, default_value = "ca")]
        dir: PathBuf,
    },
    /// A new certificate and key for an id, same kind, fresh expiry, written into --out over
    /// the old pair; restart the site to use it. A revoked id is refused unless --force.
    Renew {
        id: String,
        /// A server's DNS names (default: those of the certificate now in --out).
        #[arg(long = "name")]
        names: Vec<String>,
        /// Renew an id whose every certificate is revoked: the new certificate lets the site back
        /// in (its old certificates stay revoked).
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        site: SiteArgs,
    },
}

/// Where a certificate goes and for how long (`anchorage ca issue` and `renew`).
#[derive(Args)]
struct SiteArgs {
    #[arg(long, default_value_t = anchorage_sim::provision::DEFAULT_DAYS)]
    days: u32,
    /// The site folder (default: ./<id>).
    #[arg(long)]
    out: Option<PathBuf>,
    #[arg(long, default_value = "ca")]
    dir: PathBuf,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum KindArg {
    Server,
    Client,
}

#[derive(Subcommand)]
enum DataCommand {
    /// Per client and task: class histogram, sample counts, imbalance factor and label skew of a
    /// scenario's `[data]` table. Prints a table and writes the same as CSV. With a data folder,
    /// also reads and decodes every image file as `anchorage sim` would load it.
    Describe(DescribeArgs),
}

#[derive(Args)]
struct DescribeArgs {
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

#[derive(Args)]
struct SimArgs {
    /// A scenario file (`scenarios/*.toml`) or a TOML file of `SimConfig` fields; flags override it.
    config: Option<PathBuf>,
    #[command(flatten)]
    shared: SharedArgs,
    /// The method.
    #[arg(long, value_parser = PossibleValuesParser::new(anchorage_shared::method::names()))]
    method: Option<String>,
    /// Fraction of the scenario's data to use (its `[data] scale`), for a quick CPU run.
    #[arg(long, value_parser = fraction)]
    data_scale: Option<f64>,
    /// Rounds per task of the stream (0: a single task).
    #[arg(long)]
    rounds_per_task: Option<u64>,
    /// The federation's seed (a scenario's `[data] seed` stays).
    #[arg(long)]
    seed: Option<u64>,
    /// Local epochs per round.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    epochs: Option<u32>,
    /// Dirichlet α of the label skew (smaller: more non-IID; inf: IID).
    #[arg(long, value_parser = positive)]
    alpha: Option<f64>,
    /// Upload encoding.
    #[arg(long, value_parser = ["f32", "f16", "bf16", "int8"])]
    encoding: Option<String>,
    /// `real`: QUIC on loopback in real time; `virtual`: the discrete-event clock (no sockets,
    /// simulated time charged by the link and device models). Default: real.
    #[arg(long, value_enum)]
    clock: Option<Clock>,
    /// Every client's device preset.
    #[arg(long, value_parser = PossibleValuesParser::new(DeviceProfile::PRESETS.iter().copied()))]
    device: Option<String>,
    /// FedEvolve's straggler ratio: the chance a client runs fewer local epochs (1..τ) in a round.
    #[arg(long, value_parser = probability)]
    stragglers: Option<f64>,
    /// The clients' local optimizer.
    #[arg(long, value_enum)]
    optimizer: Option<anchorage_model::train::OptimizerKind>,
    /// The local learning rate.
    #[arg(long, value_parser = positive)]
    lr: Option<f64>,
    /// The local batch size.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    batch_size: Option<u32>,
    /// Clients evaluate their local model every this many rounds (the global model: every round).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    eval_every: Option<u64>,
    /// Fraction of each task's test rows the clients evaluate their local model on (seeded).
    #[arg(long, value_parser = fraction)]
    eval_fraction: Option<f64>,
    /// Fraction of a scenario's test set to use (its `[data] test_scale`; default: all of it,
    /// whatever --data-scale is).
    #[arg(long, value_parser = fraction)]
    test_scale: Option<f64>,
    /// Run folder (default: runs/sim-<seed>-<UTC date>T<time>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replace a run of another configuration that --out already holds (a run of the same
    /// configuration is replaced without it).
    #[arg(long, requires = "out")]
    force: bool,
    /// Print only the run folder and the summary line (no progress, no round table).
    #[arg(long, conflicts_with = "json")]
    quiet: bool,
    /// Progress as JSON lines on stdout (`start`, each `round`, `finished`), for scripts.
    #[arg(long)]
    json: bool,
    /// Run the configuration N times, with seeds seed, seed+1, …, seed+N−1 (a scenario's [data]
    /// seed moves with it), each into <out>/seed-<s>/, then sweep.json and sweep.md: mean ± std.
    #[arg(long, value_parser = seed_count)]
    seeds: Option<u64>,
    /// With --seeds: keep the scenario's [data] seed (the same data split in every run).
    #[arg(long, requires = "seeds")]
    keep_data_seed: bool,
}

/// A number parsed from a flag, or why not.
fn number(s: &str, ok: fn(f64) -> bool, rule: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if ok(v) { Ok(v) } else { Err(format!("must be {rule}")) }
}

fn fraction(s: &str) -> Result<f64, String> {
    number(s, |v| v > 0.0 && v <= 1.0, "in (0, 1]")
}

fn probability(s: &str) -> Result<f64, String> {
    number(s, |v| (0.0..=1.0).contains(&v), "within [0, 1]")
}

fn positive(s: &str) -> Result<f64, String> {
    number(s, |v| v > 0.0, "above 0")
}

fn seed_count(s: &str) -> Result<u64, String> {
    let n: u64 = s.parse().map_err(|e| format!("{e}"))?;
    if n >= 2 { Ok(n) } else { Err("must be at least 2 (one run is `anchorage sim` without --seeds)".into()) }
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
        Command::Sim(args) => sim(args),
        Command::Fleet(args) => fleet(args),
        Command::Data(DataCommand::Describe(args)) => describe(args),
        Command::Export(args) => export(args),
        Command::Microbench => {
            println!("{}", serde_json::to_string(&anchorage_sim::microbench::run()?)?);
            Ok(())
        }
        Command::Ca(command) => ca(command),
        Command::Provision { project, out } => provision(&project, out.as_deref()),
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

/// The project CA in `dir`; a folder without one says where the CA is expected, not to make one.
fn open_ca(dir: &Path) -> anyhow::Result<anchorage_server::ca::ProjectCa> {
    use anchorage_server::ca::{CA_CERT, CA_KEY};
    if !dir.join(CA_CERT).exists() && !dir.join(CA_KEY).exists() {
        let shown = if dir.is_absolute() { dir.display().to_string() } else { format!("./{}", dir.display()) };
        anyhow::bail!(
            "the project CA is not here: {shown} holds no {CA_CERT} / {CA_KEY}. Run this from the folder that holds \
             the CA folder, or give it with --dir <project>/ca (`anchorage provision` makes it beside project.toml, \
             as its `ca` key says). Only for a new project: `anchorage ca init --dir <dir>`"
        );
    }
    anchorage_server::ca::ProjectCa::open(dir)
}

/// `ca renew` of an id whose every certificate is revoked: refused unless `force`, saying when
/// it was revoked and what `--force` does. Returns whether the id was revoked (and forced).
fn renew_revoked(issued: &[anchorage_server::ca::Issued], id: &str, force: bool) -> anyhow::Result<bool> {
    let of_id: Vec<_> = issued.iter().filter(|i| i.id == id).collect();
    let Some(last) = of_id.iter().filter_map(|i| i.revoked_at).max() else { return Ok(false) };
    if of_id.iter().any(|i| i.revoked_at.is_none()) {
        return Ok(false);
    }
    let when = anchorage_sim::provision::date(last);
    if force {
        eprintln!(
            "warning: `{id}` was revoked on {when}; --force issues it a valid certificate (its old ones stay revoked)"
        );
        return Ok(true);
    }
    anyhow::bail!(
        "`{id}` was revoked on {when} (every certificate of it; see `anchorage ca list`): a renewed certificate would \
         let it back in. There is no un-revoke: if the site is to be trusted again, run `anchorage ca renew {id} \
         --force` (its old certificates stay revoked); a lost or stolen device should get a new id instead"
    )
}

fn ca(command: CaCommand) -> anyhow::Result<()> {
    use anchorage_server::ca::{Kind, ProjectCa};
    use anchorage_sim::provision;
    let site = |out: Option<PathBuf>, id: &str| out.unwrap_or_else(|| PathBuf::from(id));
    match command {
        CaCommand::Init { dir, name, days } => {
            ProjectCa::init(&dir, &name, days)?;
            println!(
                "project CA `{name}` in {}: give every site {}/ca.der; ca.key stays here",
                dir.display(),
                dir.display()
            );
        }
        CaCommand::Issue { kind, id, names, site: SiteArgs { days, out, dir } } => {
            let mut ca = open_ca(&dir)?;
            let kind = match kind {
                KindArg::Server => Kind::Server,
                KindArg::Client => Kind::Client,
            };
            let out = site(out, &id);
            let issued = provision::issue(&mut ca, kind, &id, &names, days, &out)?;
            println!(
                "issued `{id}` (serial {}, expires {}): {}/cert.der, key.der (0600), ca.der{}",
                issued.serial,
                provision::date(issued.not_after),
                out.display(),
                if kind == Kind::Server { ", revoked.crl" } else { "" }
            );
        }
        CaCommand::Revoke { id, serial, dir } => {
            let mut ca = open_ca(&dir)?;
            for r in ca.revoke_where(&id, serial.as_deref())? {
                println!("revoked `{id}` (serial {})", r.serial);
            }
            println!(
                "revocation list: {}\ncopy it over the server's tls_dir/revoked.crl (a provisioned server: its folder's \
                 revoked.crl); the running server re-reads it within seconds, refuses the certificate and closes its \
                 connections, no restart needed",
                dir.join(anchorage_server::ca::CRL).display()
            );
        }
        CaCommand::List { dir } => print!("{}", provision::list_table(open_ca(&dir)?.issued())),
        CaCommand::Renew { id, names, force, site: SiteArgs { days, out, dir } } => {
            let mut ca = open_ca(&dir)?;
            let was_revoked = renew_revoked(ca.issued(), &id, force)?;
            let out = site(out, &id);
            let issued = provision::renew(&mut ca, &id, &names, days, &out)?;
            let old = if was_revoked {
                "its old certificates stay revoked"
            } else {
                "the old certificate stays valid until it expires (`anchorage ca revoke` ends it and this one too)"
            };
            println!(
                "renewed `{id}` (serial {}, expires {}) in {}: restart the site to use it; {old}",
                issued.serial,
                provision::date(issued.not_after),
                out.display()
            );
        }
    }
    Ok(())
}

fn provision(project: &Path, out: Option<&Path>) -> anyhow::Result<()> {
    let done = anchorage_sim::provision::provision(project, out)?;
    let verb = if done.ca_created { "made" } else { "used" };
    println!("{verb} the project CA in {} (ca.key stays there)", done.ca_dir.display());
    for site in &done.sites {
        let key = match site.key {
            anchorage_sim::provision::SiteKey::Issued => "new certificate and key",
            anchorage_sim::provision::SiteKey::Kept => "certificate and key kept",
        };
        println!("  {:<24} {} ({key})", site.id, site.config.display());
    }
    let server = &done.sites[0];
    println!(
        "copy each folder to its machine, then start\n  anchorage-server --config {}/server.toml\n  anchorage-client --config <device>/client.toml",
        server.dir.file_name().map_or("server".into(), |n| n.to_string_lossy())
    );
    Ok(())
}

fn fleet(args: FleetArgs) -> anyhow::Result<()> {
    let (file, mut config) = scenario_or_default(args.scenario.as_deref())?;
    let file = file.as_ref();
    set_shared_flags(&mut config, file, &args.shared);
    scenario::check(&config, file)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    if let Some(workers) = args.local {
        let out = match args.out {
            Some(out) => out,
            None => {
                let name = anchorage_sim::run_folder_name("fleet", config.seed, std::time::SystemTime::now());
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
    let address = std::net::ToSocketAddrs::to_socket_addrs(&server)
        .with_context(|| format!("resolving {server}"))?
        .next()
        .with_context(|| format!("{server} resolves to no address"))?;
    let server_name = args
        .server_name
        .unwrap_or_else(|| server.rsplit_once(':').map_or(server.as_str(), |(host, _)| host).to_string());
    let server_name = if server_name.parse::<std::net::IpAddr>().is_ok() { "localhost".into() } else { server_name };
    let target = anchorage_sim::fleet::Target { server: address, server_name, ca_dir: args.ca };
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

fn export(args: ExportArgs) -> anyhow::Result<()> {
    let mut config = anchorage_sim::scenario::sim_config(&args.scenario)?;
    if let Some(v) = args.data_dir {
        config.data_dir = Some(v);
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

fn describe(args: DescribeArgs) -> anyhow::Result<()> {
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

/// Prints `--flag value overrides KEY = old from FILE` when the file sets the key a flag replaces.
/// A flag's value over its key (`key`) when it was given, printing the override.
fn set<T: std::fmt::Display>(file: Option<&ConfigFile>, flag: &str, value: Option<T>, key: &[&str], target: &mut T) {
    if let Some(v) = value {
        overrides(file, flag, &v, key);
        *target = v;
    }
}

fn overrides(file: Option<&ConfigFile>, flag: &str, value: impl std::fmt::Display, key: &[&str]) {
    if let Some(f) = file
        && let Some(old) = f.get(key)
    {
        println!("{flag} {value} overrides {} = {old} from {}", f.key(key), f.path.display());
    }
}

/// An empty config file (nothing but whitespace and comments) is an error that names it, not
/// the embedded default.
fn refuse_empty(path: &Path) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    if let Ok(table) = toml::from_str::<toml::Table>(&text) {
        anyhow::ensure!(
            !table.is_empty(),
            "{} is empty (no settings, only whitespace or comments): give a scenario (scenarios/*.toml) or a file \
             of SimConfig keys, or no file at all for the embedded default",
            path.display()
        );
    }
    Ok(())
}

/// The scenario file at `path` and its configuration, or none and the embedded default.
fn scenario_or_default(path: Option<&Path>) -> anyhow::Result<(Option<ConfigFile>, SimConfig)> {
    if let Some(path) = path {
        refuse_empty(path)?;
    }
    let file = path.map(ConfigFile::read).transpose()?;
    let config = match &file {
        Some(f) => f.config()?,
        None => SimConfig::default(),
    };
    Ok((file, config))
}

/// The flags `anchorage sim` and `anchorage fleet` share.
#[derive(Args)]
struct SharedArgs {
    /// Clients in the federation (a scenario's `[data.partition] clients` too).
    #[arg(long, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    clients: Option<usize>,
    /// Rounds in all.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: Option<u64>,
    /// Fraction of the connected clients sampled each round.
    #[arg(long, value_parser = fraction)]
    fraction: Option<f64>,
    /// Every client's link: a preset shaping real QUIC (or the virtual clock's link model).
    #[arg(long, value_parser = PossibleValuesParser::new(DuplexProfile::PRESETS.iter().copied()))]
    link: Option<String>,
    /// Folder of the real datasets and weights (`../shared/data`).
    #[arg(long, env = "ANCHORAGE_DATA")]
    data_dir: Option<PathBuf>,
}

/// The shared flags over the file's values: `--clients` (the federation's and the split's),
/// `--rounds`, `--fraction`, `--link` (which replaces any link mix or per-client links) and
/// `--data-dir`.
fn set_shared_flags(config: &mut SimConfig, file: Option<&ConfigFile>, flags: &SharedArgs) {
    let SharedArgs { clients, rounds, fraction, link, data_dir } = flags;
    let (clients, rounds, fraction) = (*clients, *rounds, *fraction);
    set(file, "--fraction", fraction, &["fraction"], &mut config.fraction);
    if let Some(v) = clients {
        overrides(file, "--clients", v, &["clients"]);
        config.clients = v;
        if let Some(data) = config.data.as_mut() {
            overrides(file, "--clients", v, &["data", "partition", "clients"]);
            *scenario::partition_clients(&mut data.partition) = v;
        }
    }
    set(file, "--rounds", rounds, &["rounds"], &mut config.rounds);
    if let Some(v) = link {
        for key in ["link", "link_mix", "client_links"] {
            overrides(file, "--link", v, &[key]);
        }
        config.link = Some(v.clone());
        config.link_mix.clear();
        config.client_links.clear();
    }
    if let Some(v) = data_dir {
        overrides(file, "--data-dir", v.display(), &["data_dir"]);
        config.data_dir = Some(v.clone());
    }
}

/// Applies the flags over the file's values (a flag wins, for every flag), printing each override,
/// or refuses a flag that cannot apply, naming the key to change instead.
fn apply_flags(args: &SimArgs, config: &mut SimConfig, file: Option<&ConfigFile>) -> anyhow::Result<()> {
    let from = || file.map_or("the embedded default".to_string(), |f| f.path.display().to_string());
    if let Some(v) = &args.method {
        overrides(file, "--method", v, &["method", "name"]);
        let (method, dropped) = scenario::switch_method(&config.method, v)?;
        for key in dropped {
            println!("--method {v}: {key} (a key of {}) does not apply to {v}", config.method.name());
        }
        config.method = method;
    }
    if let Some(v) = args.data_scale {
        let data = config.data.as_mut().with_context(|| {
            format!(
                "--data-scale scales a scenario's [data] table and {} has none (the embedded data's size: \
                 train_per_class, test_per_class)",
                from()
            )
        })?;
        overrides(file, "--data-scale", v, &["data", "scale"]);
        data.scale = v;
    }
    set(file, "--rounds-per-task", args.rounds_per_task, &["rounds_per_task"], &mut config.rounds_per_task);
    set_shared_flags(config, file, &args.shared);
    set(file, "--seed", args.seed, &["seed"], &mut config.seed);
    set(file, "--epochs", args.epochs, &["local_epochs"], &mut config.local_epochs);
    if let Some(v) = args.alpha {
        let key = ["data", "partition", "alpha"];
        match config.data.as_mut().map(|d| &mut d.partition) {
            None => {
                overrides(file, "--alpha", v, &["alpha"]);
                config.alpha = v;
            }
            Some(PartitionSpec::Dirichlet { alpha, .. }) => {
                overrides(file, "--alpha", v, &key);
                *alpha = v;
            }
            Some(PartitionSpec::LongTail { alpha, .. }) => {
                overrides(file, "--alpha", v, &key);
                *alpha = Some(v);
            }
            Some(PartitionSpec::FedprokSync(c)) => {
                overrides(file, "--alpha", v, &key);
                c.alpha = v;
            }
            Some(PartitionSpec::FedprokAsync(c)) => {
                overrides(file, "--alpha", v, &key);
                c.alpha = v;
            }
            Some(_) => {
                let kind = file.and_then(|f| f.get(&["data", "partition", "kind"])).map(|k| k.to_string());
                anyhow::bail!(
                    "--alpha: [data.partition] kind = {} in {} has no Dirichlet α to set; set kind = \"dirichlet\" \
                     and alpha in its [data.partition] instead",
                    kind.as_deref().unwrap_or("?"),
                    from()
                );
            }
        }
    }
    set(file, "--encoding", args.encoding.clone(), &["encoding"], &mut config.encoding);
    set(file, "--clock", args.clock, &["clock"], &mut config.clock);
    if let Some(name) = &args.device {
        overrides(file, "--device", name, &["devices"]);
        config.devices = vec![DeviceProfile::preset(name).with_context(|| format!("unknown device preset `{name}`"))?];
    }
    set(file, "--stragglers", args.stragglers, &["straggler_ratio"], &mut config.straggler_ratio);
    if let Some(v) = args.optimizer {
        overrides(file, "--optimizer", format!("{v:?}").to_lowercase(), &["optimizer"]);
        config.optimizer = v;
    }
    set(file, "--lr", args.lr.map(|v| v as f32), &["learning_rate"], &mut config.learning_rate);
    set(file, "--batch-size", args.batch_size, &["batch_size"], &mut config.batch_size);
    set(file, "--eval-every", args.eval_every, &["eval_every"], &mut config.eval_every);
    set(file, "--eval-fraction", args.eval_fraction, &["eval_fraction"], &mut config.eval_fraction);
    if let Some(v) = args.test_scale {
        let data = config.data.as_mut().with_context(|| {
            format!(
                "--test-scale scales a scenario's [data] test set and {} has none (the embedded data: test_per_class)",
                from()
            )
        })?;
        overrides(file, "--test-scale", v, &["data", "test_scale"]);
        data.test_scale = Some(v);
    }
    Ok(())
}

/// A data folder that is not there: an error when the run reads files from it, else a warning.
fn check_data_dir(config: &SimConfig, from_flag: bool, file: Option<&ConfigFile>) -> anyhow::Result<()> {
    let needs = scenario::files_needed(config);
    let Some(dir) = &config.data_dir else {
        if let Some(needs) = needs {
            anyhow::bail!("{needs} are read from a data folder: give --data-dir or set ANCHORAGE_DATA");
        }
        return Ok(());
    };
    if dir.is_dir() {
        return Ok(());
    }
    let named = match file {
        Some(f) if !from_flag => format!("{} = {:?} in {}", f.key(&["data_dir"]), dir, f.path.display()),
        _ => format!("--data-dir (or ANCHORAGE_DATA) {}", dir.display()),
    };
    match needs {
        Some(needs) => anyhow::bail!("{named} is not a folder, and {needs} are read from it"),
        None => eprintln!("warning: {named} is not a folder; this run reads nothing from it"),
    }
    Ok(())
}

fn sim(args: SimArgs) -> anyhow::Result<()> {
    let (file, mut config) = scenario_or_default(args.config.as_deref())?;
    apply_flags(&args, &mut config, file.as_ref())?;
    scenario::check(&config, file.as_ref())?;
    check_data_dir(&config, args.shared.data_dir.is_some(), file.as_ref())?;
    let sweep = args.seeds.map(|runs| anchorage_sim::sweep::Plan { runs, vary_data_seed: !args.keep_data_seed });
    if let Some(plan) = sweep {
        plan.check(&config)?;
    }
    let out = match args.out {
        Some(out) => out,
        None => {
            let kind = if sweep.is_some() { "sweep" } else { "sim" };
            let name = anchorage_sim::run_folder_name(kind, config.seed, std::time::SystemTime::now());
            anchorage_sim::claim_run_folder(Path::new("runs"), &name).context("creating the run folder under runs/")?
        }
    };
    let console = match (args.quiet, args.json) {
        (true, _) => Console::Quiet,
        (_, true) => Console::Json,
        _ => Console::Human,
    };
    anchorage_sim::progress::enable(console == Console::Human);
    if let Some(plan) = sweep {
        let done = anchorage_sim::sweep::run(&config, plan, &out, console, StopFlag::on_signals()?)?;
        if let Some(reason) = done.stopped {
            eprintln!("sweep stopped: {}; sweep folder {} (status interrupted)", done.sweep.coverage(), out.display());
            std::process::exit(reason.exit_code());
        }
        return Ok(());
    }
    let mut recorder = if args.force {
        Recorder::new_replacing(console, Some(&out), &config, StopFlag::on_signals()?)?
    } else {
        Recorder::new(console, Some(&out), &config, StopFlag::on_signals()?)?
    };
    let result = match anchorage_sim::run_on_clock(config, &mut recorder) {
        Ok(result) => result,
        Err(e) => {
            recorder.fail(&e);
            return Err(e.context(format!("the run failed; its folder {} says so in metrics.json", out.display())));
        }
    };
    anchorage_sim::report::write_report(&out)?;
    recorder.say(&format!("report: {}", out.join("report.md").display()));
    if let Some(reason) = recorder.stop_requested() {
        eprintln!(
            "stopped after round {}; run folder {} (status interrupted)",
            result.summary.rounds.len(),
            out.display()
        );
        std::process::exit(reason.exit_code());
    }
    Ok(())
}
