//! `anchorage compare RUN...`: runs side by side. A table of key metrics, one column per run
//! folder (named by the folder), and their accuracy-by-round curves overlaid in one chart
//! (`compare_accuracy.svg` and `.png`).

use std::fmt::Write;
use std::path::{Path, PathBuf};

use anchorage_shared::ledger::CostRecord;
use anyhow::Context;

use crate::record::{RunStatus, RunSummary, human_bytes};
use crate::report::svg::{Series, line_chart_marked, task_marks};
use crate::report::{RunInfo, Source, png};

/// The chart's file name in the output folder (without extension).
pub const CHART: &str = "compare_accuracy";

/// One run folder, read.
struct Run {
    name: String,
    summary: RunSummary,
    ledger: Vec<CostRecord>,
    info: RunInfo,
    /// `(task, first round)` of each task after the first.
    starts: Vec<(usize, u64)>,
}

impl Run {
    /// Reads a run folder written by `anchorage sim` or `anchorage fleet`; anything else is an
    /// error naming the folder.
    fn read(dir: &Path, name: String) -> anyhow::Result<Self> {
        anyhow::ensure!(dir.is_dir(), "{}: no such folder", dir.display());
        anyhow::ensure!(
            dir.join("metrics.json").is_file() || dir.join(crate::record::ROUNDS_FILE).is_file(),
            "{} is not a run folder (no metrics.json and no rounds.csv; `anchorage sim` writes them)",
            dir.display()
        );
        // A run that did not write its final record is read from the tables it appended.
        let source = Source::read(dir, None).with_context(|| format!("reading the run folder {}", dir.display()))?;
        let last = source.summary.rounds.last().map_or(0, |r| r.round);
        let starts = source.info.task_starts(source.accuracy.as_deref(), last);
        Ok(Self { name, summary: source.summary, ledger: source.ledger, info: source.info, starts })
    }

    /// The table's values for this run, in [`ROWS`] order.
    fn column(&self) -> Vec<String> {
        let s = &self.summary;
        let pct = |v: f64| if v.is_finite() { format!("{:.2}%", v * 100.0) } else { "-".into() };
        let opt_pct = |v: Option<f64>| v.map_or_else(|| "-".into(), pct);
        let total = |f: &dyn Fn(&CostRecord) -> u64| human_bytes(self.ledger.iter().map(f).sum());
        let best = s.rounds.iter().filter(|r| r.accuracy.is_finite()).max_by(|a, b| a.accuracy.total_cmp(&b.accuracy));
        let tasks = !self.starts.is_empty();
        vec![
            self.info.method.clone().unwrap_or_else(|| "-".into()),
            self.info.clients.map_or_else(|| "-".into(), |c| c.to_string()),
            match self.info.rounds {
                Some(of) => format!("{} of {of}", s.rounds.len()),
                None => s.rounds.len().to_string(),
            },
            match s.status {
                // metrics.json never said how it ended (killed, or still running).
                RunStatus::Running => "unfinished",
                RunStatus::Finished => "finished",
                RunStatus::Interrupted => "interrupted",
                RunStatus::Failed => "failed",
            }
            .into(),
            pct(s.final_accuracy),
            best.map_or_else(|| "-".into(), |b| format!("{} (round {})", pct(b.accuracy), b.round)),
            pct(s.initial_accuracy),
            if tasks { opt_pct(s.continual.average_accuracy) } else { "-".into() },
            if tasks { opt_pct(s.continual.forgetting) } else { "-".into() },
            s.mean_upload_payload.map_or_else(|| "-".into(), |p| human_bytes(p.round() as u64)),
            total(&|c| c.wire_up),
            total(&|c| c.wire_down),
            format!("{:.1}", s.wall_seconds),
        ]
    }
}

/// The table's rows, in order.
const ROWS: [&str; 13] = [
    "method",
    "clients",
    "rounds completed",
    "status",
    "final accuracy",
    "best accuracy",
    "initial accuracy",
    "average accuracy (tasks)",
    "forgetting",
    "mean upload payload",
    "bytes up (wire)",
    "bytes down (wire)",
    "wall seconds",
];

/// What [`compare`] made: the table as printed, and the chart's files.
pub struct Comparison {
    pub table: String,
    pub svg: PathBuf,
    pub png: PathBuf,
}

/// Column names: each folder's name, or more of its path where two runs share a name.
fn names(runs: &[PathBuf]) -> Vec<String> {
    let name = |p: &Path, parts: usize| -> String {
        let parts: Vec<String> =
            p.components().rev().take(parts).map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
        parts.into_iter().rev().collect::<Vec<_>>().join("/")
    };
    let short: Vec<String> = runs.iter().map(|p| name(p, 1)).collect();
    runs.iter()
        .zip(&short)
        .map(|(p, s)| if short.iter().filter(|o| *o == s).count() > 1 { name(p, 2) } else { s.clone() })
        .collect()
}

/// Reads the run folders, returns the table and writes the overlaid accuracy curves into `out`
/// (default: the first run's parent folder).
pub fn compare(runs: &[PathBuf], out: Option<&Path>) -> anyhow::Result<Comparison> {
    anyhow::ensure!(!runs.is_empty(), "no run folder to compare");
    // `runs/x/` has the file name `x`; `.` and `..` are named by the folder they are.
    let resolved: Vec<PathBuf> = runs.iter().map(|p| std::path::absolute(p).unwrap_or_else(|_| p.clone())).collect();
    let resolved: Vec<PathBuf> = resolved.iter().map(|p| normalise(p)).collect();
    let runs: Vec<Run> =
        resolved.iter().zip(names(&resolved)).map(|(dir, name)| Run::read(dir, name)).collect::<anyhow::Result<_>>()?;

    let columns: Vec<Vec<String>> = runs.iter().map(Run::column).collect();
    let label_width = ROWS.iter().map(|r| r.chars().count()).max().unwrap_or(0);
    let widths: Vec<usize> = runs
        .iter()
        .zip(&columns)
        .map(|(r, col)| col.iter().chain([&r.name]).map(|v| v.chars().count()).max().unwrap_or(0))
        .collect();
    let mut table = String::new();
    let _ = write!(table, "{:label_width$}", "");
    for (run, w) in runs.iter().zip(&widths) {
        let _ = write!(table, "  {:>w$}", run.name);
    }
    table.push('\n');
    for (i, row) in ROWS.iter().enumerate() {
        let _ = write!(table, "{row:label_width$}");
        for (col, w) in columns.iter().zip(&widths) {
            let _ = write!(table, "  {:>w$}", col[i]);
        }
        table.push('\n');
    }

    let series: Vec<Series> = runs
        .iter()
        .map(|r| Series {
            name: r.name.clone(),
            points: std::iter::once((0.0, r.summary.initial_accuracy * 100.0))
                .filter(|p| p.1.is_finite())
                .chain(r.summary.rounds.iter().map(|row| (row.round as f64, row.accuracy * 100.0)))
                .collect(),
        })
        .collect();
    // Task boundaries when every run has the same ones.
    let marks = if runs.iter().all(|r| r.starts == runs[0].starts) {
        task_marks(runs[0].starts.iter().map(|&(k, r)| (k, r as f64 - 1.0)))
    } else {
        Vec::new()
    };
    let svg =
        line_chart_marked("Global accuracy by round", "round", "accuracy (%)", &series, Some((0.0, 100.0)), &marks);

    let out = match out {
        Some(out) => out.to_path_buf(),
        None => resolved[0].parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf),
    };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let svg_path = out.join(format!("{CHART}.svg"));
    std::fs::write(&svg_path, &svg).with_context(|| format!("writing {}", svg_path.display()))?;
    let png_path = out.join(format!("{CHART}.png"));
    png::write_png(&svg, &png_path).with_context(|| format!("rendering {}", png_path.display()))?;
    Ok(Comparison { table, svg: svg_path, png: png_path })
}

/// `anchorage compare`: prints the table and the chart's paths (a reader that closes stdout
/// early, such as `head`, is no error).
pub fn print(runs: &[PathBuf], out: Option<&Path>) -> anyhow::Result<()> {
    use std::io::Write as _;
    let c = compare(runs, out)?;
    let text = format!("{}\n{}\n{}\n", c.table, c.svg.display(), c.png.display());
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e).context("writing to stdout"),
        _ => Ok(()),
    }
}

/// `a/./b/../c` as `a/c`, without touching the file system (a folder's name is its last part).
fn normalise(path: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_are_named_by_folder_and_told_apart() {
        let runs = [PathBuf::from("/r/a/sim-1"), PathBuf::from("/r/b/sim-1"), PathBuf::from("/r/sim-2")];
        assert_eq!(names(&runs), ["a/sim-1", "b/sim-1", "sim-2"]);
        assert_eq!(normalise(Path::new("/r/x/./../sim-3/")), PathBuf::from("/r/sim-3"));
    }

    #[test]
    fn a_folder_that_is_not_a_run_is_refused_by_name() {
        let tmp = tempfile::tempdir().unwrap();
        let err = format!("{:#}", compare(&[tmp.path().to_path_buf()], None).err().unwrap());
        assert!(err.contains(&tmp.path().display().to_string()) && err.contains("not a run folder"), "{err}");
        let missing = tmp.path().join("missing");
        let err = format!("{:#}", compare(std::slice::from_ref(&missing), None).err().unwrap());
        assert!(err.contains(&missing.display().to_string()) && err.contains("no such folder"), "{err}");
        assert!(compare(&[], None).is_err());
    }
}
