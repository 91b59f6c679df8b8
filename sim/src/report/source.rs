//! What a report is drawn from: a run folder (its `metrics.json` and `ledger.json`, or the tables
//! the run appends round by round when those do not tell the whole run) or a server's state
//! folder (see [`super::server`]).

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anchorage_shared::ledger::CostRecord;
use anyhow::Context;
use serde::de::DeserializeOwned;

use super::run_info::RunInfo;
use super::server::ServerRun;
use crate::accuracy::AccuracyRow;
use crate::record::{LEDGER_CSV_FILE, LocalEval, ROUNDS_FILE, RoundRow, RunStatus, RunSummary, SummaryInputs};

/// What kind of folder a report reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Written by `anchorage sim` or `anchorage fleet --local`.
    RunFolder,
    /// A server's `state_dir` (`anchorage.db`): read only, never written.
    StateFolder,
}

/// A run, read for its report.
#[derive(Debug, Clone)]
pub struct Source {
    pub dir: PathBuf,
    pub kind: Kind,
    pub summary: RunSummary,
    pub ledger: Vec<CostRecord>,
    /// `accuracy.csv`'s records, when the folder has one.
    pub accuracy: Option<Vec<AccuracyRow>>,
    pub info: RunInfo,
    /// How the run ended (or where it is), in words.
    pub status: String,
    /// Whether `metrics.json` gave the run's initial accuracy and chance.
    pub has_metrics: bool,
    /// What the report read instead of the usual files, and why; one sentence each.
    pub notes: Vec<String>,
    /// A state folder's rounds as the server recorded them.
    pub server: Option<ServerRun>,
}

impl Source {
    /// Reads a run folder or a server's state folder (`server_config`: the server's config file,
    /// for the rounds a state folder's server was set to run).
    pub fn read(dir: &Path, server_config: Option<&Path>) -> anyhow::Result<Self> {
        if dir.join(anchorage_server::store::DB_FILE).exists() && !dir.join("metrics.json").exists() {
            return super::server::read(dir, server_config);
        }
        read_run_folder(dir)
    }
}

/// A time as the report prints it: `2026-11-25 10:12:29 UTC`.
pub(super) fn utc(at: SystemTime) -> String {
    let secs = at.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let t = time::OffsetDateTime::from_unix_timestamp(secs as i64).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    format!(
        "{:04}-{:02}-{:02} {:02}:{:02}:{:02} UTC",
        t.year(),
        t.month() as u8,
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

/// When `path` was last written, if it exists.
pub(super) fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// A file's text, or `None` when it does not exist.
fn read_optional(path: &Path) -> anyhow::Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// The rows of a CSV table the run appended to (header first). A last line cut short (the
/// process was killed while appending) is left out, with a note; a bad line before it is an
/// error naming the file and line.
pub(super) fn read_csv<T: DeserializeOwned>(path: &Path, notes: &mut Vec<String>) -> anyhow::Result<Option<Vec<T>>> {
    let Some(text) = read_optional(path)? else { return Ok(None) };
    let parse = |text: &str| -> anyhow::Result<Vec<T>> {
        let mut reader = csv::ReaderBuilder::new().from_reader(text.as_bytes());
        reader
            .deserialize()
            .map(|record| {
                record.map_err(|e| {
                    let line = e.position().map_or(0, |p| p.line());
                    anyhow::anyhow!("{}:{line}: {e}", path.display())
                })
            })
            .collect()
    };
    lenient(&text, path, parse, notes).map(Some)
}

/// `parse(text)`, or where that fails and the last line has no newline (cut short while it was
/// appended), `parse` of the lines before it, with a note.
fn lenient<T>(
    text: &str,
    path: &Path,
    parse: impl Fn(&str) -> anyhow::Result<T>,
    notes: &mut Vec<String>,
) -> anyhow::Result<T> {
    let error = match parse(text) {
        Ok(rows) => return Ok(rows),
        Err(e) => e,
    };
    match text.rfind('\n') {
        Some(end) if end + 1 < text.len() => {
            let rows = parse(&text[..=end]).map_err(|_| error)?;
            let cut: String = text[end + 1..].chars().take(40).collect();
            notes.push(format!("The last line of {} was cut short (`{cut}`), and was left out.", file_name(path)));
            Ok(rows)
        }
        _ => Err(error),
    }
}

fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// `accuracy.csv`, with a last line cut short left out (as [`read_csv`]).
fn read_accuracy(dir: &Path, notes: &mut Vec<String>) -> anyhow::Result<Option<Vec<AccuracyRow>>> {
    let path = dir.join(crate::accuracy::FILE);
    let Some(text) = read_optional(&path)? else { return Ok(None) };
    let source = path.display().to_string();
    lenient(&text, &path, |t| crate::accuracy::parse(t, &source), notes).map(Some)
}

/// A run folder. A finished, interrupted or failed run's `metrics.json` and `ledger.json` hold
/// the whole run. Where they do not (`metrics.json` still says `running`, or is missing, or
/// there is no `ledger.json`: the process was killed, or quit at a second Ctrl-C), the rounds,
/// costs and accuracy records come from `rounds.csv`, `ledger.csv` and `accuracy.csv`, which the
/// run appended as each round closed.
fn read_run_folder(dir: &Path) -> anyhow::Result<Source> {
    let folder = RunFiles::read(dir)?;
    if let (Some(summary), Some(ledger)) = (&folder.metrics, &folder.ledger)
        && summary.status != RunStatus::Running
    {
        let (summary, ledger) = (summary.clone(), ledger.clone());
        return folder.whole(summary, ledger);
    }
    folder.read_tables()
}

/// A run folder's final record as read: `metrics.json` and `ledger.json` where they exist.
struct RunFiles<'a> {
    dir: &'a Path,
    metrics: Option<RunSummary>,
    ledger: Option<Vec<CostRecord>>,
    info: RunInfo,
    /// What the report read instead of the usual files.
    notes: Vec<String>,
}

impl<'a> RunFiles<'a> {
    /// Reads `metrics.json`, `ledger.json` and the run's configuration; refuses a folder with
    /// neither `metrics.json` nor `rounds.csv`.
    fn read(dir: &'a Path) -> anyhow::Result<Self> {
        let metrics_path = dir.join("metrics.json");
        let metrics: Option<RunSummary> = read_optional(&metrics_path)?
            .map(|text| serde_json::from_str(&text).context("parsing metrics.json"))
            .transpose()?;
        if metrics.is_none() && !dir.join(ROUNDS_FILE).exists() {
            anyhow::bail!(
                "reading {}: no such file, and no {ROUNDS_FILE} either (is {} a run folder? `anchorage sim` writes them)",
                metrics_path.display(),
                dir.display()
            );
        }
        let ledger: Option<Vec<CostRecord>> = read_optional(&dir.join("ledger.json"))?
            .map(|text| serde_json::from_str(&text).context("parsing ledger.json"))
            .transpose()?;
        let info = RunInfo::read(dir)?;
        Ok(RunFiles { dir, metrics, ledger, info, notes: Vec::new() })
    }

    /// The run as its final record (`summary` and `ledger`, the run no longer running) tells it.
    fn whole(mut self, summary: RunSummary, ledger: Vec<CostRecord>) -> anyhow::Result<Source> {
        let accuracy = read_accuracy(self.dir, &mut self.notes)?;
        let status = self.info.status_text(&summary);
        Ok(self.source(summary, ledger, accuracy, status))
    }

    /// The run as its tables tell it: it did not write its final record, and its tables hold
    /// every round that closed.
    fn read_tables(mut self) -> anyhow::Result<Source> {
        let rounds_path = self.dir.join(ROUNDS_FILE);
        let why = self.why_tables();
        let rows: Vec<RoundRow> = match read_csv(&rounds_path, &mut self.notes)? {
            Some(rows) => rows,
            None => self.metrics.as_ref().map(|m| m.rounds.clone()).unwrap_or_default(),
        };
        let ledger = match self.ledger.take() {
            Some(ledger) => ledger,
            None => read_csv(&self.dir.join(LEDGER_CSV_FILE), &mut self.notes)?.unwrap_or_else(|| {
                self.notes.push(format!("There is no {LEDGER_CSV_FILE}: no costs are shown."));
                Vec::new()
            }),
        };
        let accuracy = read_accuracy(self.dir, &mut self.notes)?;
        self.notes.insert(
            0,
            format!(
                "The run did not write its final record ({why}): its rounds, costs and accuracy records are read \
                 from {ROUNDS_FILE}, {LEDGER_CSV_FILE} and {}, which it appended as each round closed.",
                crate::accuracy::FILE
            ),
        );
        let summary = self.summary_of(rows, &ledger, accuracy.as_deref().unwrap_or(&[]));
        let status = match summary.status {
            RunStatus::Running => stopped_without_finishing(&summary, &self.info, modified(&rounds_path)),
            _ => self.info.status_text(&summary),
        };
        Ok(self.source(summary, ledger, accuracy, status))
    }

    /// Why the report reads the tables, in words.
    fn why_tables(&self) -> String {
        match &self.metrics {
            None => "there is no metrics.json".to_string(),
            Some(m) if m.status == RunStatus::Running => "metrics.json still says `running`".to_string(),
            Some(m) => format!("metrics.json says `{}` but there is no ledger.json", status_word(m.status)),
        }
    }

    /// The summary of the tables' rounds, costs and accuracy records, with what `metrics.json`
    /// adds where there is one (the initial accuracy, chance, refusals, status, ...).
    fn summary_of(&self, rows: Vec<RoundRow>, ledger: &[CostRecord], accuracy: &[AccuracyRow]) -> RunSummary {
        let metrics = self.metrics.as_ref();
        let inputs = SummaryInputs {
            initial_accuracy: metrics.map_or(f64::NAN, |m| m.initial_accuracy),
            chance: metrics.map_or(f64::NAN, |m| m.chance),
            late_updates: rows.last().map_or(0, |r| r.late_total),
            refused: metrics.map_or(0, |m| m.refused),
            decode_errors: metrics.map_or(0, |m| m.decode_errors),
            wall_seconds: metrics.map_or_else(|| rows.iter().map(|r| r.seconds).sum(), |m| m.wall_seconds),
            local_eval: metrics.map_or_else(LocalEval::default, |m| m.local_eval),
            privacy: metrics.and_then(|m| m.privacy.clone()),
        };
        let mut summary = RunSummary::new(inputs, rows, ledger, accuracy);
        summary.status = metrics.map_or(RunStatus::Running, |m| m.status);
        summary.stop_reason = metrics.and_then(|m| m.stop_reason.clone());
        summary
    }

    /// The report's source: this folder with the summary, costs, accuracy records and status read.
    fn source(
        self,
        summary: RunSummary,
        ledger: Vec<CostRecord>,
        accuracy: Option<Vec<AccuracyRow>>,
        status: String,
    ) -> Source {
        Source {
            dir: self.dir.to_path_buf(),
            kind: Kind::RunFolder,
            summary,
            ledger,
            accuracy,
            info: self.info,
            status,
            has_metrics: self.metrics.is_some(),
            notes: self.notes,
            server: None,
        }
    }
}

/// `metrics.json`'s word for a status.
pub(super) fn status_word(status: RunStatus) -> &'static str {
    match status {
        RunStatus::Running => "running",
        RunStatus::Finished => "finished",
        RunStatus::Interrupted => "interrupted",
        RunStatus::Failed => "failed",
    }
}

/// The status of a run whose folder still says `running`: it stopped without a word (killed,
/// crashed, or quit at a second Ctrl-C of an older `anchorage`), or it is still going. `at`:
/// when its last round was appended.
fn stopped_without_finishing(summary: &RunSummary, info: &RunInfo, at: Option<SystemTime>) -> String {
    let at = at.map(|t| format!(" at {}", utc(t))).unwrap_or_default();
    format!("{}{at}", info.status_text(summary))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_last_line_cut_short_is_left_out_with_a_note() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rounds.csv");
        let mut notes = Vec::new();
        let header = crate::record::ROUNDS_HEADER.join(",");
        let row = "1,0.5,,3,3,0,0,10,12,10,12,0.25,aggregated";
        std::fs::write(&path, format!("{header}\n{row}\n2,0.6")).unwrap();
        let rows: Vec<RoundRow> = read_csv(&path, &mut notes).unwrap().unwrap();
        assert_eq!(rows.len(), 1);
        assert!(notes[0].contains("rounds.csv was cut short (`2,0.6`)"), "{notes:?}");
        // A whole last line without its newline is kept; a bad line before the last is an error.
        notes.clear();
        std::fs::write(&path, format!("{header}\n{row}")).unwrap();
        assert_eq!(read_csv::<RoundRow>(&path, &mut notes).unwrap().unwrap().len(), 1);
        assert!(notes.is_empty());
        std::fs::write(&path, format!("{header}\nbad\n{row}\n")).unwrap();
        let err = format!("{:#}", read_csv::<RoundRow>(&path, &mut notes).unwrap_err());
        assert!(err.contains("rounds.csv:2"), "{err}");
        assert!(read_csv::<RoundRow>(&dir.path().join("none.csv"), &mut notes).unwrap().is_none());
    }
}
