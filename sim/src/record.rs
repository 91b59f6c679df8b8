//! The run record: one row per round, the cost ledger, a summary, and the run folder on disk.

use std::io::Write;
use std::path::{Path, PathBuf};

use anchorage_shared::ledger::CostRecord;
use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::continual::ContinualMetrics;
use crate::report::{AccuracyRow, SELECTED_PREFIX};

/// One round as the results table shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RoundRow {
    pub round: u64,
    /// Global model accuracy on the held-out synthetic test set after the round.
    pub accuracy: f64,
    /// Sample-weighted mean train loss the clients reported.
    pub train_loss: Option<f64>,
    pub aggregated: usize,
    pub sampled: usize,
    /// Late updates counted since the start.
    pub late_total: u64,
    pub dropped: usize,
    pub payload_up: u64,
    pub wire_up: u64,
    pub payload_down: u64,
    pub wire_down: u64,
    pub seconds: f64,
    pub outcome: String,
}

/// What the run achieved and what it cost.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunSummary {
    pub initial_accuracy: f64,
    pub final_accuracy: f64,
    pub chance: f64,
    pub rounds: Vec<RoundRow>,
    /// Mean wire bytes / payload bytes over all uploads (QUIC overhead included).
    pub upload_wire_ratio: Option<f64>,
    /// Mean payload bytes per upload.
    pub mean_upload_payload: Option<f64>,
    pub late_updates: u64,
    pub refused: u64,
    pub decode_errors: u64,
    pub wall_seconds: f64,
    /// Metrics of the task accuracy matrix (ARCHITECTURE.md §8).
    #[serde(default)]
    pub continual: ContinualMetrics,
    /// FedProK's efficiency E = (τ1 + τ2) / R (see [`Efficiency`]).
    #[serde(default)]
    pub efficiency: Efficiency,
    /// How the clients' local accuracies (the client rows of the accuracy records, and the
    /// continual metrics' local side) were computed.
    #[serde(default)]
    pub local_eval: LocalEval,
}

/// The clients' local evaluation policy of a run: every `every`-th round, on `fraction` of each
/// task's test rows (a seeded sample when below 1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LocalEval {
    pub every: u64,
    pub fraction: f64,
    /// Whether the local accuracies come from a sample of the test rows.
    pub sampled: bool,
}

impl Default for LocalEval {
    fn default() -> Self {
        Self { every: 1, fraction: 1.0, sampled: false }
    }
}

impl LocalEval {
    pub fn of(config: &crate::run::SimConfig) -> Self {
        let fraction = config.eval_fraction.clamp(0.0, 1.0);
        Self { every: config.eval_every.max(1), fraction, sampled: fraction < 1.0 }
    }
}

/// FedProK's efficiency metric E = (τ1 + τ2) / R: the time a round costs. Our reading: τ1 is the
/// fleet's local training time (Σ compute seconds in the ledger), τ2 its communication time
/// (Σ transfer seconds), R the number of rounds. Lower is better.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Efficiency {
    pub compute_seconds: f64,
    pub transfer_seconds: f64,
    pub rounds: usize,
    /// E, in seconds per round (0 when no round ran).
    pub seconds_per_round: f64,
}

impl Efficiency {
    pub fn from_ledger(ledger: &[CostRecord], rounds: usize) -> Self {
        let compute_seconds: f64 = ledger.iter().map(|c| c.compute_seconds).sum();
        let transfer_seconds: f64 = ledger.iter().map(|c| c.transfer_seconds).sum();
        let seconds_per_round = if rounds == 0 { 0.0 } else { (compute_seconds + transfer_seconds) / rounds as f64 };
        Self { compute_seconds, transfer_seconds, rounds, seconds_per_round }
    }
}

/// What a run's summary is made of, besides the rows and the ledger.
pub struct SummaryInputs {
    pub initial_accuracy: f64,
    pub chance: f64,
    pub late_updates: u64,
    pub refused: u64,
    pub decode_errors: u64,
    pub wall_seconds: f64,
    pub local_eval: LocalEval,
}

/// The accuracy records of a closed round: the global model per test task, and each client's
/// local model per test task from its update's `acc.task.K` / `acc.target` metrics.
pub fn accuracy_records(report: &anchorage_server::RoundReport, task: u32, global: &[(u32, f64)]) -> Vec<AccuracyRow> {
    let target = global.iter().map(|(k, _)| *k).max().unwrap_or(task);
    let mut out: Vec<AccuracyRow> = global
        .iter()
        .map(|(k, a)| AccuracyRow {
            round: report.round,
            task: task as usize,
            model: "global".into(),
            test_task: *k as usize,
            accuracy: *a,
        })
        .collect();
    for u in &report.updates {
        for (name, value) in &u.metrics {
            let (test_task, model) = if let Some(k) = name.strip_prefix("acc.task.") {
                (k.parse::<usize>().ok(), u.client.clone())
            } else if let Some(k) = name.strip_prefix("acc.sel.") {
                (k.parse::<usize>().ok(), format!("{SELECTED_PREFIX}{}", u.client))
            } else {
                ((name == "acc.target").then_some(target as usize), u.client.clone())
            };
            if let Some(k) = test_task.filter(|_| value.is_finite() && (0.0..=1.0).contains(value)) {
                out.push(AccuracyRow {
                    round: report.round,
                    task: task as usize,
                    model,
                    test_task: k,
                    accuracy: *value,
                });
            }
        }
    }
    out
}

/// Evaluates the global model a round closed with (on the test data of the tasks seen by `task`)
/// and returns the round's headline accuracy and its accuracy records.
pub fn evaluate_round(
    evaluator: &crate::setup::Evaluator,
    report: &anchorage_server::RoundReport,
    checkpoint: &anchorage_server::engine::Checkpoint,
    task: u32,
) -> anyhow::Result<(f64, Vec<AccuracyRow>)> {
    let global = evaluator.evaluate(&checkpoint.global, &checkpoint.prototypes, task)?;
    let rows = accuracy_records(report, task, &global);
    Ok((round_accuracy(&global, &rows), rows))
}

/// The round's headline accuracy: the global model's mean over the seen tasks, or the clients'
/// local models' mean where the method has no global predictor (Local-only, FedRep).
pub fn round_accuracy(global: &[(u32, f64)], rows: &[AccuracyRow]) -> f64 {
    if !global.is_empty() {
        return crate::setup::mean_accuracy(global);
    }
    let local: Vec<f64> = rows.iter().filter(|r| r.is_client()).map(|r| r.accuracy).collect();
    if local.is_empty() { 0.0 } else { local.iter().sum::<f64>() / local.len() as f64 }
}

impl RunSummary {
    /// The summary of a run from its rows, its ledger (uploads with measured wire bytes) and its
    /// accuracy records (the continual-learning metrics).
    pub fn new(inputs: SummaryInputs, rows: Vec<RoundRow>, ledger: &[CostRecord], accuracy: &[AccuracyRow]) -> Self {
        let uploads: Vec<&CostRecord> = ledger.iter().filter(|c| c.payload_up > 0 && c.wire_up > 0).collect();
        let mean = |f: &dyn Fn(&CostRecord) -> f64| {
            (!uploads.is_empty()).then(|| uploads.iter().map(|c| f(c)).sum::<f64>() / uploads.len() as f64)
        };
        Self {
            initial_accuracy: inputs.initial_accuracy,
            final_accuracy: rows.last().map(|r| r.accuracy).unwrap_or(inputs.initial_accuracy),
            chance: inputs.chance,
            upload_wire_ratio: mean(&|c| c.wire_up as f64 / c.payload_up as f64),
            mean_upload_payload: mean(&|c| c.payload_up as f64),
            late_updates: inputs.late_updates,
            refused: inputs.refused,
            decode_errors: inputs.decode_errors,
            efficiency: Efficiency::from_ledger(ledger, rows.len()),
            rounds: rows,
            wall_seconds: inputs.wall_seconds,
            continual: ContinualMetrics::from_records(accuracy),
            local_eval: inputs.local_eval,
        }
    }
}

impl RoundRow {
    /// The row of a closed round: the engine's report, the global accuracy after it, and the
    /// wire bytes of the clients' cost records.
    pub fn from_report(report: &anchorage_server::RoundReport, accuracy: f64, costs: &[CostRecord]) -> Self {
        Self {
            round: report.round,
            accuracy,
            train_loss: report.weighted_metric("train_loss"),
            aggregated: report.updates.len(),
            sampled: report.sampled,
            late_total: report.late_total,
            dropped: report.missing.len(),
            payload_up: report.payload_up(),
            wire_up: costs.iter().map(|c| c.wire_up).sum(),
            payload_down: report.payload_down * report.sampled as u64,
            wire_down: costs.iter().map(|c| c.wire_down).sum(),
            seconds: report.seconds(),
            outcome: match &report.outcome {
                anchorage_server::engine::RoundOutcome::Aggregated => "aggregated".into(),
                anchorage_server::engine::RoundOutcome::Failed { reason } => format!("failed: {reason}"),
            },
        }
    }

    pub const HEADER: &'static str =
        "round  accuracy  loss    clients  late  dropped  up payload  up wire     down payload  down wire   seconds";

    /// The row as the results table prints it.
    pub fn table_line(&self) -> String {
        format!(
            "{:>5}  {:>7.2}%  {:<6}  {:>3}/{:<3}  {:>4}  {:>7}  {:>10}  {:>10}  {:>12}  {:>10}  {:>7.2}",
            self.round,
            self.accuracy * 100.0,
            self.train_loss.map(|l| format!("{l:.3}")).unwrap_or_else(|| "-".into()),
            self.aggregated,
            self.sampled,
            self.late_total,
            self.dropped,
            human_bytes(self.payload_up),
            human_bytes(self.wire_up),
            human_bytes(self.payload_down),
            human_bytes(self.wire_down),
            self.seconds,
        )
    }
}

/// Bytes with a binary unit.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{b} B") } else { format!("{v:.2} {}", UNITS[u]) }
}

/// Writes `config.toml`, `rounds.csv`, `ledger.csv`, `ledger.json` and `metrics.json` into `dir`.
/// Creates and returns a new folder `parent/name`, or `parent/name-2`, `-3`, … when that exists:
/// two runs started in the same second with the same seed must not write into one folder.
pub fn claim_run_folder(parent: &Path, name: &str) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(parent)?;
    for n in 1..10_000u32 {
        let dir = if n == 1 { parent.join(name) } else { parent.join(format!("{name}-{n}")) };
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::new(std::io::ErrorKind::AlreadyExists, format!("{name}: 10,000 folders of that name")))
}

pub fn write_run_folder(
    dir: &Path,
    config_toml: &str,
    summary: &RunSummary,
    ledger: &[CostRecord],
    accuracy: &[AccuracyRow],
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(dir.join("config.toml"), config_toml)?;
    let mut acc = std::fs::File::create(dir.join(crate::report::ACCURACY_FILE))?;
    writeln!(acc, "{}", crate::report::ACCURACY_HEADER)?;
    for r in accuracy {
        writeln!(acc, "{},{},{},{},{}", r.round, r.task, csv_field(&r.model), r.test_task, r.accuracy)?;
    }

    let mut rounds = std::fs::File::create(dir.join("rounds.csv"))?;
    writeln!(
        rounds,
        "round,accuracy,train_loss,aggregated,sampled,late_total,dropped,payload_up,wire_up,payload_down,wire_down,seconds,outcome"
    )?;
    for r in &summary.rounds {
        writeln!(
            rounds,
            "{},{:.6},{},{},{},{},{},{},{},{},{},{:.3},{}",
            r.round,
            r.accuracy,
            r.train_loss.map(|l| format!("{l:.6}")).unwrap_or_default(),
            r.aggregated,
            r.sampled,
            r.late_total,
            r.dropped,
            r.payload_up,
            r.wire_up,
            r.payload_down,
            r.wire_down,
            r.seconds,
            csv_field(&r.outcome)
        )?;
    }

    let mut l = std::fs::File::create(dir.join("ledger.csv"))?;
    writeln!(l, "{}", anchorage_shared::ledger::CSV_HEADER)?;
    for c in ledger {
        writeln!(l, "{}", c.csv_row())?;
    }
    std::fs::write(dir.join("metrics.json"), serde_json::to_string_pretty(summary)?)?;
    std::fs::write(dir.join("ledger.json"), serde_json::to_string(ledger)?)?;
    Ok(())
}

use anchorage_shared::ledger::csv_field;

#[cfg(test)]
mod efficiency_tests {
    use super::*;

    #[test]
    fn efficiency_is_compute_plus_transfer_per_round() {
        let cost = |compute: f64, transfer: f64| CostRecord {
            compute_seconds: compute,
            transfer_seconds: transfer,
            ..CostRecord::default()
        };
        let ledger = [cost(2.0, 1.0), cost(4.0, 0.5), cost(0.0, 0.5)];
        let e = Efficiency::from_ledger(&ledger, 2);
        assert_eq!((e.compute_seconds, e.transfer_seconds, e.rounds), (6.0, 2.0, 2));
        assert_eq!(e.seconds_per_round, 4.0);
        assert_eq!(Efficiency::from_ledger(&ledger, 0).seconds_per_round, 0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_started_together_get_folders_of_their_own() {
        let parent = std::env::temp_dir().join(format!("anchorage-claim-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&parent);
        let a = claim_run_folder(&parent, "sim-7-100").unwrap();
        let b = claim_run_folder(&parent, "sim-7-100").unwrap();
        let c = claim_run_folder(&parent, "sim-7-100").unwrap();
        assert_eq!(a, parent.join("sim-7-100"));
        assert_eq!(b, parent.join("sim-7-100-2"));
        assert_eq!(c, parent.join("sim-7-100-3"));
        assert!(a.is_dir() && b.is_dir() && c.is_dir());
        std::fs::remove_dir_all(&parent).unwrap();
    }
}
