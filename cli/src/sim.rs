//! `anchorage sim`: its flags over a scenario file or the embedded default, then one run (or a
//! sweep of seeds) into a run folder.

use std::path::{Path, PathBuf};

use anchorage_data::PartitionSpec;
use anchorage_sim::device::DeviceProfile;
use anchorage_sim::network::LinkPreset;
use anchorage_sim::recorder::{Console, Recorder, StopFlag};
use anchorage_sim::scenario::{self, ConfigFile};
use anchorage_sim::{Clock, SimConfig};
use anyhow::Context;
use clap::Args;
use clap::builder::{PossibleValuesParser, RangedU64ValueParser};

#[derive(Args)]
pub(crate) struct SimArgs {
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
    #[arg(long, value_enum)]
    encoding: Option<anchorage_client::encoding::UploadEncoding>,
    /// Top-k sparsification with error feedback: the fraction of each block's delta a client
    /// uploads, in (0, 1] (off by default; the values go in --encoding).
    #[arg(long, value_parser = fraction)]
    top_k: Option<f64>,
    /// A compressor over the encoded blocks (off by default).
    #[arg(long, value_parser = PossibleValuesParser::new(anchorage_shared::method::encodings::names_of("compress")))]
    compress: Option<String>,
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
    /// Evaluate on the scenario's validation split instead of its test split (its `[data]
    /// evaluate_on`): held-out training samples, or under evolving shifts the last source
    /// domain's held-out rows. Choices are made there, never on the test or target data.
    #[arg(long, value_parser = ["test", "validation"])]
    evaluate_on: Option<String>,
    /// Fraction of every class's training samples held out as the validation split (a
    /// scenario's `[data] validation`; no client trains on them).
    #[arg(long)]
    validation: Option<f64>,
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
pub(crate) fn scenario_or_default(path: Option<&Path>) -> anyhow::Result<(Option<ConfigFile>, SimConfig)> {
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
pub(crate) struct SharedArgs {
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
    #[arg(long, value_enum)]
    link: Option<LinkPreset>,
    /// Folder of the real datasets and weights (`../shared/data`).
    #[arg(long, env = "ANCHORAGE_DATA")]
    data_dir: Option<PathBuf>,
}

/// The shared flags over the file's values: `--clients` (the federation's and the split's),
/// `--rounds`, `--fraction`, `--link` (which replaces any link mix or per-client links) and
/// `--data-dir`.
pub(crate) fn set_shared_flags(config: &mut SimConfig, file: Option<&ConfigFile>, flags: &SharedArgs) {
    let SharedArgs { clients, rounds, fraction, link, data_dir } = flags;
    let (clients, rounds, fraction) = (*clients, *rounds, *fraction);
    set(file, "--fraction", fraction, &["fraction"], &mut config.federation.fraction);
    if let Some(v) = clients {
        overrides(file, "--clients", v, &["clients"]);
        config.federation.clients = v;
        if let Some(data) = config.data.spec.as_mut() {
            overrides(file, "--clients", v, &["data", "partition", "clients"]);
            *scenario::partition_clients(&mut data.partition) = v;
        }
    }
    set(file, "--rounds", rounds, &["rounds"], &mut config.federation.rounds);
    if let Some(v) = link {
        for key in ["link", "link_mix", "client_links"] {
            overrides(file, "--link", v, &[key]);
        }
        config.systems.link = Some(*v);
        config.systems.link_mix.clear();
        config.systems.client_links.clear();
    }
    if let Some(v) = data_dir {
        overrides(file, "--data-dir", v.display(), &["data_dir"]);
        config.data.data_dir = Some(v.clone());
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
        let data = config.data.spec.as_mut().with_context(|| {
            format!(
                "--data-scale scales a scenario's [data] table and {} has none (the embedded data's size: \
                 train_per_class, test_per_class)",
                from()
            )
        })?;
        overrides(file, "--data-scale", v, &["data", "scale"]);
        data.scale = v;
    }
    set(file, "--rounds-per-task", args.rounds_per_task, &["rounds_per_task"], &mut config.data.rounds_per_task);
    set_shared_flags(config, file, &args.shared);
    set(file, "--seed", args.seed, &["seed"], &mut config.federation.seed);
    set(file, "--epochs", args.epochs, &["local_epochs"], &mut config.federation.local_epochs);
    if let Some(v) = args.alpha {
        apply_alpha(v, config, file)?;
    }
    set(file, "--encoding", args.encoding, &["encoding"], &mut config.systems.encoding);
    set_update_encodings(args, config, file)?;
    set(file, "--clock", args.clock, &["clock"], &mut config.systems.clock);
    if let Some(name) = &args.device {
        overrides(file, "--device", name, &["devices"]);
        config.systems.devices =
            vec![DeviceProfile::preset(name).with_context(|| format!("unknown device preset `{name}`"))?];
    }
    set(file, "--stragglers", args.stragglers, &["straggler_ratio"], &mut config.systems.straggler_ratio);
    if let Some(v) = args.optimizer {
        overrides(file, "--optimizer", format!("{v:?}").to_lowercase(), &["optimizer"]);
        config.federation.optimizer = v;
    }
    set(file, "--lr", args.lr.map(|v| v as f32), &["learning_rate"], &mut config.federation.learning_rate);
    set(file, "--batch-size", args.batch_size, &["batch_size"], &mut config.federation.batch_size);
    set(file, "--eval-every", args.eval_every, &["eval_every"], &mut config.output.eval_every);
    set(file, "--eval-fraction", args.eval_fraction, &["eval_fraction"], &mut config.output.eval_fraction);
    if let Some(v) = args.test_scale {
        let data = config.data.spec.as_mut().with_context(|| {
            format!(
                "--test-scale scales a scenario's [data] test set and {} has none (the embedded data: test_per_class)",
                from()
            )
        })?;
        overrides(file, "--test-scale", v, &["data", "test_scale"]);
        data.test_scale = Some(v);
    }
    if let Some(v) = args.validation {
        let data = config.data.spec.as_mut().with_context(|| {
            format!("--validation holds out part of a scenario's [data] and {} has none (the embedded data)", from())
        })?;
        overrides(file, "--validation", v, &["data", "validation"]);
        data.validation = v;
    }
    if let Some(v) = &args.evaluate_on {
        let data = config.data.spec.as_mut().with_context(|| {
            format!("--evaluate-on picks a scenario's [data] split and {} has none (the embedded data)", from())
        })?;
        overrides(file, "--evaluate-on", v, &["data", "evaluate_on"]);
        data.evaluate_on = match v.as_str() {
            "validation" => anchorage_data::EvaluateOn::Validation,
            _ => anchorage_data::EvaluateOn::Test,
        };
    }
    Ok(())
}

/// `--alpha`: the embedded data's `alpha`, or the Dirichlet α of the scenario's partition; a
/// partition without one is refused, naming the key to change.
/// `--top-k` and `--compress` (both off unless given here or in the file).
fn set_update_encodings(args: &SimArgs, config: &mut SimConfig, file: Option<&ConfigFile>) -> anyhow::Result<()> {
    if let Some(v) = args.top_k {
        overrides(file, "--top-k", v, &["top_k"]);
        config.systems.top_k = Some(v);
    }
    if let Some(name) = &args.compress {
        overrides(file, "--compress", name, &["compress"]);
        let compressor = <anchorage_client::compress::Compressor as clap::ValueEnum>::from_str(name, false);
        config.systems.compress = Some(compressor.map_err(anyhow::Error::msg)?);
    }
    Ok(())
}

fn apply_alpha(v: f64, config: &mut SimConfig, file: Option<&ConfigFile>) -> anyhow::Result<()> {
    let from = || file.map_or("the embedded default".to_string(), |f| f.path.display().to_string());
    let key = ["data", "partition", "alpha"];
    match config.data.spec.as_mut().map(|d| &mut d.partition) {
        None => {
            overrides(file, "--alpha", v, &["alpha"]);
            config.data.alpha = v;
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
    Ok(())
}

/// A data folder that is not there: an error when the run reads files from it, else a warning.
fn check_data_dir(config: &SimConfig, from_flag: bool, file: Option<&ConfigFile>) -> anyhow::Result<()> {
    let needs = scenario::files_needed(config);
    let Some(dir) = &config.data.data_dir else {
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

pub(crate) fn sim(args: SimArgs) -> anyhow::Result<()> {
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
            let name = anchorage_sim::run_folder_name(kind, config.federation.seed, std::time::SystemTime::now());
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
