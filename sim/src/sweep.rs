//! `anchorage sim ... --seeds N`: the same configuration run N times, with the federation's seed
//! `seed, seed + 1, …, seed + N − 1`, and the metrics over the runs as mean ± sample standard
//! deviation, the way the papers report them.
//!
//! Run i is an ordinary run (its own [`Recorder`], run folder `<sweep>/seed-<seed + i>/` with
//! `report.md`, readable by `anchorage report` and `anchorage compare`). A scenario's `[data]
//! seed` moves with the run seed by default (`[data] seed + i`: the papers' runs differ in their
//! data split too); `--keep-data-seed` keeps it, so only the federation's randomness (the model's
//! initialisation, the client sampling, the batch order, ...) varies. The embedded data has no
//! `[data] seed`: its split follows the federation's seed. Run 0 is exactly the run `anchorage sim`
//! makes without `--seeds`.
//!
//! After the runs the sweep folder gets `sweep.json` (per metric: the finished seeds, their
//! values, mean, sample std, n) and `sweep.md` (a table `metric | mean ± std | per seed`). A stop
//! request (Ctrl-C, SIGTERM, a closed stdout; one [`StopFlag`] for all runs) ends the current run
//! after its round in flight (its folder says `interrupted`) and starts no further seed; the
//! summary then covers the seeds that finished, and says so.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Serialize;

use crate::config::{Clock, SimConfig};
use crate::record::{RunStatus, RunSummary, human_bytes, write_atomic};
use crate::recorder::{Console, Recorder, StopFlag, StopReason};

/// The sweep's JSON summary in the sweep folder.
pub const SWEEP_JSON: &str = "sweep.json";
/// The sweep's Markdown table in the sweep folder.
pub const SWEEP_MD: &str = "sweep.md";

/// What `--seeds` asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Runs, at least 2.
    pub runs: u64,
    /// Whether a scenario's `[data] seed` moves with the run seed (the default) or stays.
    pub vary_data_seed: bool,
}

impl Plan {
    /// Refuses a plan that cannot apply to `base`, before anything is written.
    pub fn check(&self, base: &SimConfig) -> anyhow::Result<()> {
        anyhow::ensure!(self.runs >= 2, "--seeds runs a configuration at least twice (got {})", self.runs);
        anyhow::ensure!(
            self.vary_data_seed || base.data.spec.is_some(),
            "--keep-data-seed keeps a scenario's [data] seed, and this configuration has no [data] table (the \
             embedded data is split by the federation's seed, which --seeds varies)"
        );
        Ok(())
    }
}

/// The configuration of run `i` of a sweep over `base`: the federation's seed `base.seed + i`,
/// and a scenario's `[data] seed` + i when `vary_data_seed`.
pub fn seed_config(base: &SimConfig, i: u64, vary_data_seed: bool) -> SimConfig {
    let mut config = base.clone();
    config.federation.seed = base.federation.seed.wrapping_add(i);
    if vary_data_seed && let Some(data) = config.data.spec.as_mut() {
        data.seed = data.seed.wrapping_add(i);
    }
    config
}

/// Mean, sample standard deviation (n − 1) and count of some values.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Stats {
    pub mean: f64,
    /// None for a single value (one run shows no spread).
    pub std: Option<f64>,
    pub n: usize,
}

/// The mean and sample standard deviation of `values` (none when empty; no std for one value).
pub fn mean_std(values: &[f64]) -> Option<Stats> {
    let n = values.len();
    if n == 0 {
        return None;
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    // Two passes: the squared deviations from the mean, not E[x²] − E[x]² (no cancellation).
    let std = (n > 1).then(|| (values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt());
    Some(Stats { mean, std, n })
}

/// How a metric's values read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Unit {
    /// An accuracy in [0, 1], shown as a percentage.
    Fraction,
    /// A ratio, shown with 4 decimals.
    Ratio,
    Bytes,
    Seconds,
}

impl Unit {
    fn show(self, v: f64) -> String {
        match self {
            Unit::Fraction => format!("{:.2}%", v * 100.0),
            Unit::Ratio => format!("{v:.4}"),
            Unit::Bytes => human_bytes(v.max(0.0).round() as u64),
            Unit::Seconds => format!("{v:.2} s"),
        }
    }
}

/// One metric over the finished seeds.
#[derive(Debug, Clone, Serialize)]
pub struct MetricStats {
    pub label: &'static str,
    pub unit: Unit,
    /// The finished seeds that have the metric, and its value in each (same order).
    pub seeds: Vec<u64>,
    pub values: Vec<f64>,
    pub mean: f64,
    /// Sample standard deviation (n − 1); null for one seed.
    pub std: Option<f64>,
    pub n: usize,
}

impl MetricStats {
    /// `mean ± std` in the metric's unit ("–" for the std of one seed).
    pub fn mean_std_text(&self) -> String {
        let std = self.std.map_or_else(|| "–".to_string(), |s| self.unit.show(s));
        format!("{} ± {std}", self.unit.show(self.mean))
    }
}

/// The metrics a sweep summarises, in table order: the metrics.json key (`continual.*` for the
/// continual-learning metrics), the label, the unit.
pub const METRICS: [(&str, &str, Unit); 18] = [
    ("final_accuracy", "final accuracy", Unit::Fraction),
    ("best_accuracy", "best accuracy (any round)", Unit::Fraction),
    ("continual.final_accuracy", "final average accuracy (seen tasks)", Unit::Fraction),
    ("continual.average_accuracy", "average incremental accuracy", Unit::Fraction),
    ("continual.forgetting", "forgetting", Unit::Fraction),
    ("continual.stability", "stability (FedProK)", Unit::Fraction),
    ("continual.plasticity", "plasticity (FedProK)", Unit::Fraction),
    ("continual.utility", "U(λ = 0.5) (FedProK Eq. 1)", Unit::Fraction),
    ("continual.kr_temporal", "KR_t (FedTA Eq. 11)", Unit::Ratio),
    ("continual.kr_spatial", "KR_s (FedTA Eq. 12)", Unit::Ratio),
    ("continual.local_final_accuracy", "A^loc clients' local models", Unit::Fraction),
    ("continual.selected_final_accuracy", "A^sel clients on their own classes (GLDP)", Unit::Fraction),
    ("probes.head_accuracy", "global head on the global representation (probe)", Unit::Fraction),
    ("probes.separability", "class separability tr(S_B)/tr(S_W) (probe)", Unit::Ratio),
    ("mean_upload_payload", "mean upload payload", Unit::Bytes),
    ("upload_wire_ratio", "upload wire / payload", Unit::Ratio),
    ("wall_seconds", "wall seconds", Unit::Seconds),
    ("simulated_seconds", "simulated seconds (virtual clock)", Unit::Seconds),
];

/// A finished run's value of each of [`METRICS`] (none where the run has no finite value). The
/// continual-learning metrics count for a run of more than one task only, as in `report.md` (over
/// one task they repeat the final accuracy), except A^loc and A^sel; the simulated seconds (the
/// rounds' durations on the virtual clock) for the virtual clock only.
pub fn figures(summary: &RunSummary, clock: Clock) -> Vec<Option<f64>> {
    let c = &summary.continual;
    let tasks = c.global_matrix.len().max(c.local_matrix.len());
    let continual = |v: Option<f64>| v.filter(|_| tasks > 1);
    let best = summary.rounds.iter().map(|r| r.accuracy).filter(|a| a.is_finite()).reduce(f64::max);
    let simulated = (clock == Clock::Virtual).then(|| summary.rounds.iter().map(|r| r.seconds.max(0.0)).sum());
    let values = [
        Some(summary.final_accuracy),
        best,
        continual(c.final_accuracy),
        continual(c.average_accuracy),
        continual(c.forgetting),
        continual(c.stability),
        continual(c.plasticity),
        continual(c.utility),
        continual(c.kr_temporal),
        continual(c.kr_spatial),
        c.local_final_accuracy,
        c.selected_final_accuracy,
        summary.probes.head_accuracy,
        summary.probes.separability,
        summary.mean_upload_payload,
        summary.upload_wire_ratio,
        Some(summary.wall_seconds),
        simulated,
    ];
    values.into_iter().map(|v| v.filter(|v| v.is_finite())).collect()
}

/// One run of the sweep, as `sweep.json` lists it.
#[derive(Debug, Clone, Serialize)]
pub struct SeedRun {
    /// The federation's seed.
    pub seed: u64,
    /// The scenario's `[data] seed` of the run (none: the embedded data).
    pub data_seed: Option<u64>,
    /// The run folder, relative to the sweep folder.
    pub folder: String,
    pub status: RunStatus,
    pub rounds: usize,
}

/// `sweep.json`.
#[derive(Debug, Clone, Serialize)]
pub struct Sweep {
    /// Runs asked for (`--seeds`).
    pub requested: u64,
    /// The seeds asked for, in order.
    pub seeds: Vec<u64>,
    /// The seeds whose run finished: the statistics cover these only.
    pub finished_seeds: Vec<u64>,
    /// Every seed asked for finished.
    pub complete: bool,
    /// What stopped the sweep early (a signal, a closed stdout, a failed run).
    pub stop_reason: Option<String>,
    /// `varied` (`[data] seed` + i), `fixed` (`--keep-data-seed`) or `embedded` (no `[data]`:
    /// the split follows the federation's seed).
    pub data_seed: &'static str,
    pub method: String,
    pub clock: Clock,
    pub clients: usize,
    pub rounds: u64,
    /// Every run started, in order.
    pub runs: Vec<SeedRun>,
    /// Per metric (keys as in [`METRICS`], in that order), over the finished seeds; a metric no
    /// finished run has is left out.
    #[serde(serialize_with = "ordered_map")]
    pub metrics: Vec<(&'static str, MetricStats)>,
}

fn ordered_map<S: serde::Serializer>(v: &[(&'static str, MetricStats)], s: S) -> Result<S::Ok, S::Error> {
    s.collect_map(v.iter().map(|(k, m)| (k, m)))
}

impl Sweep {
    /// The statistics of the finished runs' `figures` (seed, one value per [`METRICS`] entry).
    pub fn metrics_of(finished: &[(u64, Vec<Option<f64>>)]) -> Vec<(&'static str, MetricStats)> {
        let mut out = Vec::new();
        for (i, (key, label, unit)) in METRICS.iter().enumerate() {
            let (seeds, values): (Vec<u64>, Vec<f64>) =
                finished.iter().filter_map(|(seed, f)| Some((*seed, f.get(i).copied().flatten()?))).unzip();
            if let Some(Stats { mean, std, n }) = mean_std(&values) {
                out.push((*key, MetricStats { label, unit: *unit, seeds, values, mean, std, n }));
            }
        }
        out
    }

    /// The table's rows: metric, mean ± std, the value per finished seed ("–" where a seed has none).
    fn rows(&self) -> Vec<[String; 3]> {
        self.metrics
            .iter()
            .map(|(_, m)| {
                let per_seed: Vec<String> = self
                    .finished_seeds
                    .iter()
                    .map(|s| {
                        m.seeds.iter().position(|x| x == s).map_or_else(|| "–".into(), |j| m.unit.show(m.values[j]))
                    })
                    .collect();
                [m.label.to_string(), m.mean_std_text(), per_seed.join(", ")]
            })
            .collect()
    }

    fn seeds_text(seeds: &[u64]) -> String {
        seeds.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
    }

    /// One sentence on what the statistics cover.
    pub fn coverage(&self) -> String {
        let finished = self.finished_seeds.len();
        let n = self.requested;
        match &self.stop_reason {
            None => format!("{finished} of {n} seeds finished"),
            Some(reason) => format!(
                "{reason}: {finished} of {n} seeds finished; the statistics cover the finished seeds only ({})",
                if finished == 0 { "none".to_string() } else { Self::seeds_text(&self.finished_seeds) }
            ),
        }
    }

    /// `sweep.md`.
    pub fn markdown(&self) -> String {
        let mut md = String::from("# Sweep over seeds\n\n");
        let data = match self.data_seed {
            "varied" => "the scenario's `[data] seed` moved with it (`[data] seed` + i)",
            "fixed" => "the scenario's `[data] seed` kept (`--keep-data-seed`)",
            _ => "the embedded data's split follows it",
        };
        let _ = writeln!(
            md,
            "{}, {} clients, {} rounds, {} clock; run seeds {} ({data}), each run in `seed-<seed>/`.\n",
            self.method,
            self.clients,
            self.rounds,
            self.clock,
            Self::seeds_text(&self.seeds)
        );
        let _ = writeln!(md, "**{}.**\n", capitalise(&self.coverage()));
        if self.finished_seeds.is_empty() {
            md.push_str("No seed finished: no statistics.\n");
        } else {
            let _ = writeln!(
                md,
                "| metric | mean ± std | per seed ({}) |\n|---|---:|---|",
                Self::seeds_text(&self.finished_seeds)
            );
            for [metric, stats, per_seed] in self.rows() {
                let _ = writeln!(md, "| {metric} | {stats} | {per_seed} |");
            }
            md.push_str(
                "\nstd is the sample standard deviation (n − 1), in the metric's unit (percentage points for \
                 accuracies); `–` where one seed gives no spread. The continual-learning rows appear for runs of \
                 more than one task.\n",
            );
        }
        let folders: Vec<&str> = self.runs.iter().map(|r| r.folder.as_str()).collect();
        let _ = writeln!(md, "\nSide by side: `anchorage compare {}` (in this folder).", folders.join(" "));
        md
    }

    /// The table for the console, columns aligned.
    pub fn table(&self) -> String {
        let header = [
            "metric".to_string(),
            "mean ± std".into(),
            format!("per seed ({})", Self::seeds_text(&self.finished_seeds)),
        ];
        let rows = self.rows();
        let width = |c: usize| rows.iter().chain([&header]).map(|r| r[c].chars().count()).max().unwrap_or(0);
        let (w0, w1) = (width(0), width(1));
        let mut out = String::new();
        for r in std::iter::once(&header).chain(&rows) {
            let pad = |s: &str, w: usize| format!("{s}{}", " ".repeat(w.saturating_sub(s.chars().count())));
            let _ = writeln!(out, "{}  {}  {}", pad(&r[0], w0), pad(&r[1], w1), r[2]);
        }
        out
    }
}

fn capitalise(s: &str) -> String {
    let mut c = s.chars();
    c.next().map_or_else(String::new, |f| f.to_uppercase().chain(c).collect())
}

/// What a sweep did: its summary, and why it stopped early (the exit status a stopped run has).
pub struct Outcome {
    pub sweep: Sweep,
    pub dir: PathBuf,
    pub stopped: Option<StopReason>,
}

/// Runs the sweep into `dir` (`seed-<s>/` per run, then `sweep.json` and `sweep.md`), printing as
/// `console` says: `Human` keeps each run's table, `Quiet` prints a line per finished seed, `Json`
/// each run's lines, a `seed` object per run and a `sweep` object at the end. Stops early on a
/// request to `stop`; a run that fails ends the sweep with its error, after the summary of the
/// seeds before it is written.
pub fn run(base: &SimConfig, plan: Plan, dir: &Path, console: Console, stop: StopFlag) -> anyhow::Result<Outcome> {
    plan.check(base)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating the sweep folder {}", dir.display()))?;
    let seeds: Vec<u64> = (0..plan.runs).map(|i| base.federation.seed.wrapping_add(i)).collect();
    let data_seed = match (&base.data.spec, plan.vary_data_seed) {
        (None, _) => "embedded",
        (Some(_), true) => "varied",
        (Some(_), false) => "fixed",
    };
    if matches!(console, Console::Human | Console::Quiet) {
        announce(&stop, dir, plan.runs, &seeds, data_seed);
    }
    let mut runs = Runs { base, plan, dir, console, stop, runs: Vec::new(), finished: Vec::new(), failure: None };
    // A stop request starts no further seed; a run that fails ends the sweep.
    for i in 0..plan.runs {
        if runs.stop.requested().is_some() || !runs.run_seed(i)? {
            break;
        }
    }
    let Runs { runs, finished, failure, stop, .. } = runs;

    let stopped = stop.requested();
    let stop_reason = match (&failure, stopped) {
        (Some(e), _) => Some(format!("the run of seed {} failed: {e:#}", runs.last().map_or(0, |r| r.seed))),
        (None, Some(reason)) => Some(reason.describe().to_string()),
        (None, None) => None,
    };
    let sweep = Sweep {
        requested: plan.runs,
        seeds,
        finished_seeds: finished.iter().map(|(s, _)| *s).collect(),
        complete: finished.len() as u64 == plan.runs,
        stop_reason,
        data_seed,
        method: base.method.name().to_string(),
        clock: base.systems.clock,
        clients: base.federation.clients,
        rounds: base.federation.rounds,
        runs,
        metrics: Sweep::metrics_of(&finished),
    };
    write_atomic(&dir.join(SWEEP_JSON), serde_json::to_string_pretty(&sweep)?.as_bytes())?;
    write_atomic(&dir.join(SWEEP_MD), sweep.markdown().as_bytes())?;
    print_summary(&stop, console, &sweep, dir)?;
    if let Some(e) = failure {
        return Err(e.context(format!("the sweep summary in {} covers the seeds before it", dir.display())));
    }
    Ok(Outcome { sweep, dir: dir.to_path_buf(), stopped })
}

/// The sweep's first line on the console: its folder, its runs and their seeds.
fn announce(stop: &StopFlag, dir: &Path, runs: u64, seeds: &[u64], data_seed: &str) {
    let data = match data_seed {
        "varied" => ", the data split's seed with it",
        "fixed" => ", the data split's seed kept",
        _ => "",
    };
    stop.println(&format!("sweep folder: {} ({runs} runs, seeds {}{data})", dir.display(), Sweep::seeds_text(seeds)));
}

/// The sweep's runs so far: what each did, the figures of those that finished, and the error
/// of one that failed.
struct Runs<'a> {
    base: &'a SimConfig,
    plan: Plan,
    dir: &'a Path,
    console: Console,
    stop: StopFlag,
    runs: Vec<SeedRun>,
    /// The finished runs' seeds and [`figures`].
    finished: Vec<(u64, Vec<Option<f64>>)>,
    failure: Option<anyhow::Error>,
}

impl Runs<'_> {
    /// Runs seed `i` into its folder and writes its report; false when the run failed (its error
    /// kept in `failure`), which ends the sweep.
    fn run_seed(&mut self, i: u64) -> anyhow::Result<bool> {
        let config = seed_config(self.base, i, self.plan.vary_data_seed);
        let folder = format!("seed-{}", config.federation.seed);
        let run_dir = self.dir.join(&folder);
        let inner = match self.console {
            Console::Human => Console::Human,
            Console::Json => Console::Json,
            Console::Quiet | Console::Silent => Console::Silent,
        };
        let mut recorder = Recorder::new(inner, Some(&run_dir), &config, self.stop.clone())?;
        let mut entry = SeedRun {
            seed: config.federation.seed,
            data_seed: config.data.spec.as_ref().map(|d| d.seed),
            folder,
            status: RunStatus::Failed,
            rounds: 0,
        };
        let result = match crate::run::run_on_clock(config.clone(), &mut recorder) {
            Ok(result) => result,
            Err(e) => {
                recorder.fail(&e);
                self.runs.push(entry);
                self.failure = Some(e.context(format!(
                    "the run of seed {} failed; its folder {} says so in metrics.json",
                    config.federation.seed,
                    run_dir.display()
                )));
                return Ok(false);
            }
        };
        crate::report::write_report(&run_dir)?;
        recorder.say(&format!("report: {}", run_dir.join("report.md").display()));
        let summary = &result.summary;
        entry.status = summary.status;
        entry.rounds = summary.rounds.len();
        if summary.status == RunStatus::Finished {
            self.finished.push((config.federation.seed, figures(summary, config.systems.clock)));
        }
        self.print_seed(config.federation.seed, i, summary, &run_dir)?;
        self.runs.push(entry);
        Ok(true)
    }

    /// The console's line on seed `seed` (run `i`), as `console` says.
    fn print_seed(&self, seed: u64, i: u64, summary: &RunSummary, run_dir: &Path) -> anyhow::Result<()> {
        let status = match summary.status {
            RunStatus::Finished => "finished",
            RunStatus::Interrupted => "interrupted",
            RunStatus::Running => "running",
            RunStatus::Failed => "failed",
        };
        match self.console {
            Console::Silent => {}
            Console::Human | Console::Quiet => self.stop.println(&format!(
                "seed {seed} ({} of {}): {status} after {} rounds, final accuracy {}, {:.1} s; {}",
                i + 1,
                self.plan.runs,
                summary.rounds.len(),
                crate::record::percent(summary.final_accuracy),
                summary.wall_seconds,
                run_dir.display()
            )),
            Console::Json => {
                #[derive(Serialize)]
                struct SeedLine<'a> {
                    event: &'a str,
                    seed: u64,
                    index: u64,
                    of: u64,
                    status: RunStatus,
                    rounds: usize,
                    final_accuracy: Option<f64>,
                    wall_seconds: f64,
                    run_folder: String,
                }
                let line = SeedLine {
                    event: "seed",
                    seed,
                    index: i + 1,
                    of: self.plan.runs,
                    status: summary.status,
                    rounds: summary.rounds.len(),
                    final_accuracy: Some(summary.final_accuracy).filter(|a| a.is_finite()),
                    wall_seconds: summary.wall_seconds,
                    run_folder: run_dir.display().to_string(),
                };
                self.stop.println(&serde_json::to_string(&line)?);
            }
        }
        Ok(())
    }
}

/// The sweep's last lines on the console, as `console` says: what it covers, its table and
/// where its summary is, or one `sweep` object.
fn print_summary(stop: &StopFlag, console: Console, sweep: &Sweep, dir: &Path) -> anyhow::Result<()> {
    match console {
        Console::Silent => {}
        Console::Human | Console::Quiet => {
            stop.println(&format!("\nsweep: {}", sweep.coverage()));
            if !sweep.finished_seeds.is_empty() {
                stop.println(sweep.table().trim_end());
            }
            stop.println(&format!(
                "sweep summary: {} and {}",
                dir.join(SWEEP_MD).display(),
                dir.join(SWEEP_JSON).display()
            ));
        }
        Console::Json => {
            #[derive(Serialize)]
            struct SweepLine<'a> {
                event: &'a str,
                sweep_folder: String,
                #[serde(flatten)]
                sweep: &'a Sweep,
            }
            let line = SweepLine { event: "sweep", sweep_folder: dir.display().to_string(), sweep };
            stop.println(&serde_json::to_string(&line)?);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FederationConfig;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    }

    #[test]
    fn mean_and_sample_std_of_hand_values() {
        // 2, 4, 4, 4, 5, 5, 7, 9: mean 5, squared deviations sum to 32, sample variance 32 / 7.
        let s = mean_std(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]).unwrap();
        close(s.mean, 5.0);
        close(s.std.unwrap(), (32.0f64 / 7.0).sqrt());
        assert_eq!(s.n, 8);
        // Two values: std = |a − b| / √2.
        let s = mean_std(&[0.7, 0.9]).unwrap();
        close(s.mean, 0.8);
        close(s.std.unwrap(), 0.2 / 2f64.sqrt());
        // Equal values: no spread.
        assert_eq!(mean_std(&[0.5, 0.5, 0.5]).unwrap().std, Some(0.0));
    }

    #[test]
    fn one_value_has_no_std_and_none_has_no_mean() {
        assert_eq!(mean_std(&[0.42]), Some(Stats { mean: 0.42, std: None, n: 1 }));
        assert_eq!(mean_std(&[]), None);
    }

    #[test]
    fn the_std_of_one_seed_shows_as_a_dash() {
        let m = Sweep::metrics_of(&[(7, vec![Some(0.5)])]);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].1.mean_std_text(), "50.00% ± –");
        let m = Sweep::metrics_of(&[(7, vec![Some(0.5)]), (8, vec![Some(0.7)])]);
        assert_eq!(m[0].1.mean_std_text(), format!("60.00% ± {:.2}%", 0.2 / 2f64.sqrt() * 100.0));
    }

    #[test]
    fn a_metric_counts_the_seeds_that_have_it() {
        // Seed 8 has no best accuracy and no metric has the third entry: it is left out.
        let finished = [(7, vec![Some(0.5), Some(0.6)]), (8, vec![Some(0.7), None])];
        let m = Sweep::metrics_of(&finished);
        assert_eq!(m.iter().map(|(k, _)| *k).collect::<Vec<_>>(), ["final_accuracy", "best_accuracy"]);
        assert_eq!((m[1].1.seeds.as_slice(), m[1].1.n, m[1].1.std), (&[7][..], 1, None));
    }

    #[test]
    fn run_i_moves_the_federation_seed_and_the_data_seed_unless_kept() {
        let mut base =
            SimConfig { federation: FederationConfig { seed: 7, ..Default::default() }, ..SimConfig::default() };
        assert_eq!(seed_config(&base, 2, true).federation.seed, 9);
        assert_eq!(seed_config(&base, 0, true), base, "run 0 is the run without --seeds");
        let spec = "dataset = \"synthetic\"\nseed = 1\n[partition]\nkind = \"iid\"\nclients = 4\n";
        base.data.spec = Some(toml::from_str(spec).unwrap());
        let data_seed = |c: SimConfig| c.data.spec.unwrap().seed;
        assert_eq!(data_seed(seed_config(&base, 2, true)), 3);
        assert_eq!(data_seed(seed_config(&base, 2, false)), 1);
    }
}
