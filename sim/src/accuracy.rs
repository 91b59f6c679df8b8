//! The task accuracy matrix of a continual run: `accuracy.csv` in the run folder, one row per
//! evaluation (`round,task,model,test_task,accuracy`).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};

/// The file's name in a run folder, and its header.
pub const FILE: &str = "accuracy.csv";
pub const HEADER: &str = "round,task,model,test_task,accuracy";
/// The model name that [`accuracy_matrix`] reads as the mean over client models.
pub const CLIENTS_MEAN: &str = "clients mean";
/// Model name of a client's local model on its selected global test data is
/// `SELECTED_PREFIX` + the client; as a `model` argument, [`SELECTED_MEAN`] averages them.
pub const SELECTED_PREFIX: &str = "selected:";
pub const SELECTED_MEAN: &str = "selected mean";

/// One evaluation: `model` (`global` or a client id such as `client-003`) on `test_task`, at
/// `round`, while `task` was being trained (tasks are 0-based). The fields are the file's
/// columns, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AccuracyRow {
    pub round: u64,
    pub task: usize,
    pub model: String,
    pub test_task: usize,
    /// In [0, 1].
    pub accuracy: f64,
}

impl AccuracyRow {
    /// Whether the row evaluates a client's local model.
    pub fn is_client(&self) -> bool {
        self.model.starts_with("client")
    }
}

/// Reads `dir/accuracy.csv`; `None` when the run wrote none. Errors name the line.
pub fn load_accuracy(dir: &Path) -> anyhow::Result<Option<Vec<AccuracyRow>>> {
    let path = dir.join(FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    parse(&text, &path.display().to_string()).map(Some)
}

/// Parses the text of an `accuracy.csv` (RFC 4180: a quoted model name may hold commas and
/// quotes; blank lines are skipped); `source` names it in errors (`source:line: ...`).
pub fn parse(text: &str, source: &str) -> anyhow::Result<Vec<AccuracyRow>> {
    let mut reader =
        csv::ReaderBuilder::new().has_headers(false).flexible(true).trim(csv::Trim::All).from_reader(text.as_bytes());
    let header = csv::StringRecord::from(HEADER.split(',').collect::<Vec<_>>());
    let mut records = reader.records();
    match records.next() {
        None => anyhow::bail!("{source}: empty file, expected the header `{HEADER}`"),
        Some(first) => {
            let first = first.map_err(|e| anyhow::anyhow!("{source}:{}: {e}", line_of(&e)))?;
            if first != header {
                let line = first.position().map_or(1, csv::Position::line);
                anyhow::bail!("{source}:{line}: expected the header `{HEADER}`, found `{}`", joined(&first));
            }
        }
    }
    records
        .map(|record| {
            let record = record.map_err(|e| anyhow::anyhow!("{source}:{}: {e}", line_of(&e)))?;
            let n = record.position().map_or(0, csv::Position::line);
            anyhow::ensure!(
                record.len() == header.len(),
                "{source}:{n}: expected 5 fields `{HEADER}`, found {} in `{}`",
                record.len(),
                joined(&record)
            );
            let row: AccuracyRow = record.deserialize(Some(&header)).map_err(|e| {
                // Name the field and its value rather than serde's words.
                let field = match e.kind() {
                    csv::ErrorKind::Deserialize { err, .. } => err.field().map(|f| f as usize),
                    _ => None,
                };
                match field.and_then(|f| Some((header.get(f)?, record.get(f)?))) {
                    Some(("accuracy", v)) => anyhow::anyhow!("{source}:{n}: accuracy `{v}` is not a number"),
                    Some((name, v)) => anyhow::anyhow!("{source}:{n}: {name} `{v}` is not a whole number ≥ 0"),
                    None => anyhow::anyhow!("{source}:{n}: {e}"),
                }
            })?;
            anyhow::ensure!(
                (0.0..=1.0).contains(&row.accuracy),
                "{source}:{n}: accuracy {} is outside [0, 1]",
                &record[4]
            );
            anyhow::ensure!(!row.model.is_empty(), "{source}:{n}: empty model name");
            Ok(row)
        })
        .collect()
}

/// The line a reading error is on (0 when the reader does not say).
fn line_of(e: &csv::Error) -> u64 {
    e.position().map_or(0, csv::Position::line)
}

/// A record as the file shows it, for error messages.
fn joined(record: &csv::StringRecord) -> String {
    record.iter().collect::<Vec<_>>().join(",")
}

/// The first round of each task after the first, `(task, round)` in task order, from the rows'
/// `task` column (the rounds where the task changes). Empty for a single task.
pub fn task_starts(rows: &[AccuracyRow]) -> Vec<(usize, u64)> {
    let mut first: BTreeMap<usize, u64> = BTreeMap::new();
    for r in rows {
        let round = first.entry(r.task).or_insert(r.round);
        *round = (*round).min(r.round);
    }
    first.into_iter().filter(|(task, _)| *task > 0).collect()
}

/// Whether any row evaluates a client's local model.
pub fn has_clients(rows: &[AccuracyRow]) -> bool {
    rows.iter().any(AccuracyRow::is_client)
}

/// `a[t][k]`: accuracy of `model` on test task `k`, evaluated at the last round of task `t` (the
/// last round any row of task `t` names); `None` where it was not evaluated then. `model` =
/// [`CLIENTS_MEAN`] averages over every client model evaluated then. The matrix has a row per
/// trained task and a column per test task seen in any row.
pub fn accuracy_matrix(rows: &[AccuracyRow], model: &str) -> Vec<Vec<Option<f64>>> {
    let tasks = rows.iter().map(|r| r.task + 1).max().unwrap_or(0);
    let tests = rows.iter().map(|r| r.test_task + 1).max().unwrap_or(0);
    let mut last_round: BTreeMap<usize, u64> = BTreeMap::new();
    for r in rows {
        let last = last_round.entry(r.task).or_insert(r.round);
        *last = (*last).max(r.round);
    }
    let wanted = |r: &AccuracyRow| match model {
        CLIENTS_MEAN => r.is_client(),
        SELECTED_MEAN => r.model.starts_with(SELECTED_PREFIX),
        _ => r.model == model,
    };
    let mut sums = vec![vec![(0.0, 0usize); tests]; tasks];
    for r in rows.iter().filter(|r| wanted(r) && last_round.get(&r.task) == Some(&r.round)) {
        let cell = &mut sums[r.task][r.test_task];
        *cell = (cell.0 + r.accuracy, cell.1 + 1);
    }
    sums.into_iter().map(|row| row.into_iter().map(|(sum, n)| (n > 0).then(|| sum / n as f64)).collect()).collect()
}

/// The mean of the last row's evaluated entries (average accuracy after the last task).
pub fn final_average(matrix: &[Vec<Option<f64>>]) -> Option<f64> {
    let last: Vec<f64> = matrix.last()?.iter().flatten().copied().collect();
    (!last.is_empty()).then(|| last.iter().sum::<f64>() / last.len() as f64)
}

/// A Markdown table of a matrix, in percent (`–` where not evaluated).
pub fn markdown_table(matrix: &[Vec<Option<f64>>]) -> String {
    let cols = matrix.iter().map(Vec::len).max().unwrap_or(0);
    let mut md = String::from("| after task |");
    for k in 0..cols {
        let _ = write!(md, " test task {k} |");
    }
    md.push_str("\n|---:|");
    md.push_str(&"---:|".repeat(cols));
    md.push('\n');
    for (t, row) in matrix.iter().enumerate() {
        let _ = write!(md, "| {t} |");
        for k in 0..cols {
            match row.get(k).copied().flatten() {
                Some(v) => {
                    let _ = write!(md, " {:.1}% |", v * 100.0);
                }
                None => md.push_str(" – |"),
            }
        }
        md.push('\n');
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(round: u64, task: usize, model: &str, test_task: usize, accuracy: f64) -> AccuracyRow {
        AccuracyRow { round, task, model: model.into(), test_task, accuracy }
    }

    fn rows() -> Vec<AccuracyRow> {
        vec![
            // Task 0 runs rounds 1–2; only round 2 counts.
            row(1, 0, "global", 0, 0.5),
            row(2, 0, "global", 0, 0.9),
            row(2, 0, "client-000", 0, 0.8),
            row(2, 0, "client-001", 0, 0.6),
            // Task 1 runs rounds 3–4.
            row(3, 1, "global", 0, 0.1),
            row(4, 1, "global", 0, 0.7),
            row(4, 1, "global", 1, 0.85),
            row(4, 1, "client-001", 1, 0.5),
            // A client evaluated before the task's last round is not in the matrix.
            row(3, 1, "client-000", 1, 0.3),
        ]
    }

    #[test]
    fn the_matrix_takes_the_last_round_of_each_task() {
        let global = accuracy_matrix(&rows(), "global");
        assert_eq!(global, vec![vec![Some(0.9), None], vec![Some(0.7), Some(0.85)]]);
        let clients = accuracy_matrix(&rows(), CLIENTS_MEAN);
        assert!((clients[0][0].unwrap() - 0.7).abs() < 1e-12, "the mean of 0.8 and 0.6: {clients:?}");
        assert_eq!((clients[0][1], clients[1][0], clients[1][1]), (None, None, Some(0.5)));
        assert_eq!(accuracy_matrix(&rows(), "client-000"), vec![vec![Some(0.8), None], vec![None, None]]);
        assert!(accuracy_matrix(&[], "global").is_empty());
        assert!(has_clients(&rows()) && !has_clients(&rows()[..2]));
        assert!((final_average(&global).unwrap() - 0.775).abs() < 1e-12);
        let md = markdown_table(&global);
        assert!(md.contains("| after task | test task 0 | test task 1 |"), "{md}");
        assert!(md.contains("| 0 | 90.0% | – |") && md.contains("| 1 | 70.0% | 85.0% |"), "{md}");
    }

    #[test]
    fn a_quoted_model_name_reads_back() {
        let rows = vec![row(1, 0, r#"a,"b""#, 0, 0.5), row(2, 1, "global", 1, 0.25)];
        let mut writer = csv::Writer::from_writer(Vec::new());
        for r in &rows {
            writer.serialize(r).unwrap();
        }
        let text = String::from_utf8(writer.into_inner().unwrap()).unwrap();
        assert!(text.starts_with(HEADER) && text.contains(r#""a,""b""""#), "{text}");
        assert_eq!(parse(&text, "a.csv").unwrap(), rows);
        assert_eq!(task_starts(&rows), vec![(1, 2)]);
        assert!(task_starts(&rows[..1]).is_empty(), "one task: no change");
        // A bad row after a quoted name with a line break in it names its own line.
        let text = format!("{text}3,1,\"x\ny\",1,0.5\n4,1,global,z,0.5\n");
        let err = format!("{:#}", parse(&text, "a.csv").unwrap_err());
        assert!(err.contains("a.csv:6: test_task `z` is not a whole number"), "{err}");
    }

    #[test]
    fn the_file_is_optional_and_bad_lines_name_their_number() {
        let dir = std::env::temp_dir().join(format!("anchorage-accuracy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let _ = std::fs::remove_file(dir.join(FILE));
        assert_eq!(load_accuracy(&dir).unwrap(), None, "no accuracy.csv: no matrix");
        std::fs::write(dir.join(FILE), format!("{HEADER}\n1,0,global,0,0.5\n\n2,0,client-003,1,1\n")).unwrap();
        let rows = load_accuracy(&dir).unwrap().unwrap();
        assert_eq!(rows, vec![row(1, 0, "global", 0, 0.5), row(2, 0, "client-003", 1, 1.0)]);
        std::fs::write(dir.join(FILE), format!("{HEADER}\n1,0,global,0,0.5\n2,x,global,0,0.5\n")).unwrap();
        let err = format!("{:#}", load_accuracy(&dir).unwrap_err());
        assert!(err.contains("accuracy.csv:3: task `x`"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
        let err = |text: &str| format!("{:#}", parse(text, "a.csv").unwrap_err());
        assert!(err("round,task\n").contains("a.csv:1: expected the header"));
        assert!(err(&format!("{HEADER}\n1,0,global,0\n")).contains("a.csv:2: expected 5 fields"));
        assert!(err(&format!("{HEADER}\n1,0,global,0,87.5\n")).contains("a.csv:2: accuracy 87.5 is outside [0, 1]"));
        assert!(err(&format!("{HEADER}\n1,0,global,0,NaN\n")).contains("a.csv:2: accuracy NaN is outside"));
        assert!(err(&format!("{HEADER}\n-1,0,global,0,0.5\n")).contains("a.csv:2: round `-1`"));
        assert!(err("").contains("empty file"));
    }
}
