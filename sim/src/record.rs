//! The run record: one row per round, the cost ledger, a summary, and the run folder on disk.

use anchorage_shared::MetricKey;
use std::path::{Path, PathBuf};

use anchorage_client::methods::Probes;
use anchorage_shared::ledger::CostRecord;
use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::accuracy::{AccuracyRow, SELECTED_PREFIX};
use crate::continual::ContinualMetrics;

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
    /// Running while the rounds go, then finished, interrupted (a signal or a closed stdout
    /// stopped it after the round in flight) or failed. Files from before the field: finished.
    #[serde(default)]
    pub status: RunStatus,
    /// What stopped an interrupted run, or the error of a failed one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
    /// The global model's accuracy before the first round; NaN (null in JSON) for a method with no
    /// global model then.
    #[serde(with = "nan_as_null")]
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
    /// The privacy spent (`[privacy]`); absent when it was off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub privacy: Option<PrivacySpent>,
    /// The last round's global model probed apart from its prediction rule (the global
    /// head's accuracy, the representation's separability); absent when the method has none.
    #[serde(default, skip_serializing_if = "Probes::is_empty")]
    pub probes: Probes,
}

/// Where a run is: see [`RunSummary::status`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunStatus {
    Running,
    #[default]
    Finished,
    Interrupted,
    Failed,
}

/// An f64 that may be NaN ("not measured") as a JSON number or null.
mod nan_as_null {
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() { s.serialize_f64(*v) } else { s.serialize_none() }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }
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
    pub fn of(config: &crate::config::SimConfig) -> Self {
        let fraction = config.output.eval_fraction.clamp(0.0, 1.0);
        Self { every: config.output.eval_every.max(1), fraction, sampled: fraction < 1.0 }
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
    /// The privacy the run spent (`[privacy]`): from its last round report that has it.
    pub privacy: Option<PrivacySpent>,
}

/// ε spent by a run under `[privacy]`, as metrics.json and the report give it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrivacySpent {
    pub epsilon: f64,
    pub delta: f64,
    /// `central` or `local`.
    pub noise: anchorage_shared::privacy::NoiseSite,
    pub noise_multiplier: f64,
    /// The clip of the last round (it moves under adaptive clipping).
    pub clip: f64,
    /// Rounds aggregated under privacy.
    pub rounds: u64,
}

impl PrivacySpent {
    /// What the last report with an account says, if any does.
    pub fn of<'a>(reports: impl DoubleEndedIterator<Item = &'a anchorage_server::RoundReport>) -> Option<Self> {
        let account = reports.rev().find_map(|r| r.privacy.as_ref())?;
        Some(Self {
            epsilon: account.epsilon,
            delta: account.delta,
            noise: account.noise,
            noise_multiplier: account.noise_multiplier,
            clip: account.clip,
            rounds: account.rounds,
        })
    }
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct SimResult {
    pub summary: RunSummary,
    pub ledger: Vec<CostRecord>,
    /// Round reports from the server, in order.
    pub reports: Vec<anchorage_server::RoundReport>,
    pub run_dir: Option<PathBuf>,
    /// Per client, the counters of its modelled link (`None`: unshaped).
    pub link_stats: Vec<Option<crate::network::DuplexStats>>,
    /// The accuracy records (global and local models per test task, per round).
    pub accuracy: Vec<AccuracyRow>,
    /// `[relays]` on the virtual clock: what the relays' uplinks did.
    pub tier: Option<TierOutcome>,
}

/// What a relay tier's uplinks did over a virtual run.
#[derive(Debug, Clone, Default)]
pub struct TierOutcome {
    pub counts: crate::virtual_clock::UplinkCounts,
    /// The root's ledger: the records the relays' cost batches carried up.
    pub root_ledger: Vec<CostRecord>,
    /// Per relay at the end: the round of a partial aggregate still owed, and the rounds of
    /// cost records the root has not confirmed.
    pub owed: Vec<(Option<u64>, Vec<u64>)>,
}

/// The initial accuracy of the global model: the mean over the tasks evaluated, NaN when the
/// method has no global model before its first round.
pub(crate) fn initial_of(global: &[(u32, f64)]) -> f64 {
    if global.is_empty() { f64::NAN } else { mean_accuracy(global) }
}

/// The mean of per-task accuracies (the average accuracy of the seen tasks); 0 for none.
pub(crate) fn mean_accuracy(accuracies: &[(u32, f64)]) -> f64 {
    if accuracies.is_empty() { 0.0 } else { accuracies.iter().map(|(_, a)| a).sum::<f64>() / accuracies.len() as f64 }
}

#[cfg(test)]
impl SummaryInputs {
    /// Inputs of a test summary: 10% initial accuracy and chance, nothing refused, 1 s.
    pub(crate) fn example() -> Self {
        Self {
            initial_accuracy: 0.1,
            chance: 0.1,
            late_updates: 0,
            refused: 0,
            decode_errors: 0,
            wall_seconds: 1.0,
            local_eval: Default::default(),
            privacy: None,
        }
    }
}

#[cfg(test)]
impl RoundRow {
    /// A test round: 3 updates of 3 aggregated, no bytes.
    pub(crate) fn example(round: u64, accuracy: f64, seconds: f64) -> Self {
        Self {
            round,
            accuracy,
            train_loss: None,
            aggregated: 3,
            sampled: 3,
            late_total: 0,
            dropped: 0,
            payload_up: 0,
            wire_up: 0,
            payload_down: 0,
            wire_down: 0,
            seconds,
            outcome: "aggregated".into(),
        }
    }
}

/// The accuracy records of a closed round: the global model per test task, and each client's
/// local model per test task from its update's `acc.task.K` / `acc.target` metrics.
pub(crate) fn accuracy_records(
    report: &anchorage_server::RoundReport,
    task: u32,
    global: &[(u32, f64)],
) -> Vec<AccuracyRow> {
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
            let (test_task, model) = match MetricKey::parse(name) {
                MetricKey::TaskAccuracy(k) => (Some(k as usize), u.client.clone()),
                MetricKey::SelectedAccuracy(k) => (Some(k as usize), format!("{SELECTED_PREFIX}{}", u.client)),
                MetricKey::TargetAccuracy => (Some(target as usize), u.client.clone()),
                _ => (None, u.client.clone()),
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

/// The round's headline accuracy: the global model's mean over the seen tasks, or the clients'
/// local models' mean where the method has no global predictor (Local-only, FedRep).
pub(crate) fn round_accuracy(global: &[(u32, f64)], rows: &[AccuracyRow]) -> f64 {
    if !global.is_empty() {
        return mean_accuracy(global);
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
            status: RunStatus::Finished,
            stop_reason: None,
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
            privacy: inputs.privacy,
            probes: Probes::default(),
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
            train_loss: report.weighted_metric(&MetricKey::TrainLoss),
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

/// An accuracy as a percentage with two decimals, or "–" when not measured (NaN).
pub fn percent(v: f64) -> String {
    if v.is_finite() { format!("{:.2}%", v * 100.0) } else { "–".into() }
}

/// Bytes with a binary unit.
pub(crate) fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{b} B") } else { format!("{v:.2} {}", UNITS[u]) }
}

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

/// A run folder's name: `<kind>-<seed>-<UTC date>T<time>`, e.g. `sim-7-20261125T095201`.
pub fn run_folder_name(kind: &str, seed: u64, at: std::time::SystemTime) -> String {
    let secs = at.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let t = time::OffsetDateTime::from_unix_timestamp(secs as i64).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    format!(
        "{kind}-{seed}-{:04}{:02}{:02}T{:02}{:02}{:02}",
        t.year(),
        t.month() as u8,
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

/// The per-round table of a run folder (one [`RoundRow`] per line).
pub(crate) const ROUNDS_FILE: &str = "rounds.csv";
pub(crate) const ROUNDS_HEADER: [&str; 13] = [
    "round",
    "accuracy",
    "train_loss",
    "aggregated",
    "sampled",
    "late_total",
    "dropped",
    "payload_up",
    "wire_up",
    "payload_down",
    "wire_down",
    "seconds",
    "outcome",
];
/// The cost ledger as CSV (one [`CostRecord`] per line under
/// [`anchorage_shared::ledger::CSV_HEADER`], the server's export format).
pub(crate) const LEDGER_CSV_FILE: &str = "ledger.csv";
pub(crate) const ACCURACY_HEADER_FIELDS: [&str; 5] = ["round", "task", "model", "test_task", "accuracy"];

/// Writes `path` whole or not at all (see [`anchorage_shared::io::write_atomic`]).
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    anchorage_shared::io::write_atomic(path, bytes).with_context(|| format!("writing {}", path.display()))
}

/// `rows` as CSV under `header` (written even when there are no rows), atomically.
fn write_csv<T: Serialize>(path: &Path, header: &[&str], rows: impl IntoIterator<Item = T>) -> anyhow::Result<()> {
    let mut w = csv::WriterBuilder::new().has_headers(false).from_writer(Vec::new());
    w.write_record(header)?;
    for r in rows {
        w.serialize(r).with_context(|| format!("writing a row of {}", path.display()))?;
    }
    write_atomic(path, &w.into_inner().map_err(|e| anyhow::anyhow!("{e}"))?)
}

/// The run folder's tables and the JSON ledger, from a run's final record.
pub(crate) fn write_tables(
    dir: &Path,
    summary: &RunSummary,
    ledger: &[CostRecord],
    accuracy: &[AccuracyRow],
) -> anyhow::Result<()> {
    write_csv(&dir.join(crate::accuracy::FILE), &ACCURACY_HEADER_FIELDS, accuracy)?;
    write_csv(&dir.join(ROUNDS_FILE), &ROUNDS_HEADER, &summary.rounds)?;
    let header: Vec<&str> = anchorage_shared::ledger::CSV_HEADER.split(',').collect();
    write_csv(&dir.join(LEDGER_CSV_FILE), &header, ledger)?;
    write_atomic(&dir.join("ledger.json"), serde_json::to_string(ledger)?.as_bytes())
}

/// Writes a whole run folder at once: `config.toml`, `rounds.csv`, `ledger.csv`, `ledger.json`,
/// `accuracy.csv` and `metrics.json`, each atomically. (`anchorage sim` writes the same files
/// round by round through its [`crate::recorder::Recorder`].)
pub fn write_run_folder(
    dir: &Path,
    config_toml: &str,
    summary: &RunSummary,
    ledger: &[CostRecord],
    accuracy: &[AccuracyRow],
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    write_atomic(&dir.join("config.toml"), config_toml.as_bytes())?;
    write_tables(dir, summary, ledger, accuracy)?;
    write_atomic(&dir.join("metrics.json"), serde_json::to_string_pretty(summary)?.as_bytes())
}

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
    fn the_csv_headers_are_the_serialised_field_names() {
        let header = |row: &dyn erased::Row| row.header();
        assert_eq!(header(&RoundRow::example(1, 0.5, 0.1)), ROUNDS_HEADER.join(","));
        assert_eq!(header(&CostRecord::default()), anchorage_shared::ledger::CSV_HEADER);
        let acc = AccuracyRow { round: 1, task: 0, model: "a,\"b\"".into(), test_task: 0, accuracy: 0.5 };
        assert_eq!(header(&acc), ACCURACY_HEADER_FIELDS.join(","));
    }

    mod erased {
        /// The header line the csv crate derives from a row's serde fields.
        pub(super) trait Row {
            fn header(&self) -> String;
        }
        impl<T: serde::Serialize> Row for T {
            fn header(&self) -> String {
                let mut w = csv::Writer::from_writer(Vec::new());
                w.serialize(self).unwrap();
                let text = String::from_utf8(w.into_inner().unwrap()).unwrap();
                text.lines().next().unwrap().to_string()
            }
        }
    }

    #[test]
    fn folder_names_read_as_utc_date_and_time() {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_795_600_321);
        assert_eq!(run_folder_name("sim", 7, at), "sim-7-20261125T095201");
    }

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
