//! `anchorage report <run-folder|state_dir>`: plots and a Markdown summary of a run folder (its
//! `metrics.json` and `ledger.json`, written by both clocks, or the tables it appended round by
//! round when the run did not write its final record) or of a server's state folder (read only:
//! the report goes elsewhere), and the task accuracy matrix from `accuracy.csv` when a continual
//! run wrote one. Charts are SVG and PNG.

pub(crate) mod png;
mod run_info;
mod server;
mod source;
pub(crate) mod svg;

pub use crate::accuracy::{
    AccuracyRow, CLIENTS_MEAN, FILE as ACCURACY_FILE, HEADER as ACCURACY_HEADER, SELECTED_MEAN, SELECTED_PREFIX,
    accuracy_matrix, final_average, load_accuracy, task_starts,
};
pub use run_info::RunInfo;
pub use server::{Holder, ServerRun};
pub use source::{Kind, Source};

use std::fmt::Write;
use std::path::{Path, PathBuf};

use anchorage_shared::ledger::CostRecord;
use anyhow::Context;

use crate::accuracy;
use crate::record::{RunSummary, human_bytes};
use svg::{Series, grouped_bars, heat_map, line_chart, line_chart_marked, stacked_bars, task_marks};

/// Reads a run folder's summary and ledger. A server's state folder (`anchorage.db`) works too:
/// the ledger is read from its database (without taking the running server's lock), and the
/// summary is made from the rounds the database closed. A run folder whose run did not write its
/// final record is read from its tables (see [`Source::read`]).
pub fn load(dir: &Path) -> anyhow::Result<(RunSummary, Vec<CostRecord>)> {
    let source = Source::read(dir, None)?;
    Ok((source.summary, source.ledger))
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 { 0.0 } else { sum / n as f64 }
}

/// A chart the report wrote (as `<stem>.svg` and `<stem>.png`), with its title.
struct Plot {
    title: String,
    stem: String,
}

/// Every chart a report may draw (`<stem>.svg` and `.png`): a report removes those it does not
/// draw again, so no picture of an earlier report stays behind.
pub const PLOTS: [&str; 7] = [
    "accuracy_by_round",
    "accuracy_by_time",
    "bytes_per_round",
    "round_time_breakdown",
    "round_time_cdf",
    "accuracy_matrix",
    "accuracy_matrix_clients",
];

/// The files a report writes: `report.md` and every chart of [`PLOTS`].
pub fn report_files() -> Vec<String> {
    let mut files = vec!["report.md".to_string()];
    files.extend(PLOTS.iter().flat_map(|stem| [format!("{stem}.svg"), format!("{stem}.png")]));
    files
}

/// Bar charts up to this many rounds; beyond, lines.
const MAX_BAR_ROUNDS: usize = 30;

/// What `anchorage report` was asked for.
#[derive(Debug, Clone, Default)]
pub struct ReportOptions {
    /// Where the report goes. Default: the run folder itself; for a server's state folder, a new
    /// folder `report-<name>-<UTC date>T<time>` in the current folder (never the state folder).
    pub out: Option<PathBuf>,
    /// Write into an `out` that holds another run or another folder's report (its report files
    /// are replaced; nothing else in it is touched).
    pub force: bool,
    /// A state folder's server.toml, for the rounds its server was set to run.
    pub server_config: Option<PathBuf>,
}

/// What [`write_report_with`] wrote.
#[derive(Debug, Clone)]
pub struct Written {
    /// The folder the report is in.
    pub out: PathBuf,
    pub files: Vec<PathBuf>,
}

/// Writes the plots and `report.md` into the run folder `dir` itself; returns the files written.
/// A server's state folder is refused: [`write_report_with`] (`anchorage report`) puts its
/// report elsewhere.
pub fn write_report(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let source = Source::read(dir, None)?;
    if matches!(source.kind, Kind::StateFolder) {
        anyhow::bail!(
            "{} is a server's state folder: its report goes elsewhere (write_report_with and --out)",
            dir.display()
        );
    }
    render(&source, dir)
}

/// `anchorage report`: reads `dir` (a run folder or a server's state folder) and writes the
/// report where `options` say. A state folder is never written into: its report goes to
/// `--out` or a new folder in the current one. An `--out` that holds something else (another
/// run, another folder's report) is refused unless `force`.
pub fn write_report_with(dir: &Path, options: &ReportOptions) -> anyhow::Result<Written> {
    let source = Source::read(dir, options.server_config.as_deref())?;
    let here = std::fs::canonicalize(dir).with_context(|| format!("reading {}", dir.display()))?;
    let out = match (&options.out, source.kind) {
        (Some(out), _) => out.clone(),
        (None, Kind::RunFolder) => dir.to_path_buf(),
        (None, Kind::StateFolder) => {
            let name = here.file_name().map_or_else(|| "state".into(), |n| n.to_string_lossy().into_owned());
            let name = crate::record::run_folder_name("report", 0, std::time::SystemTime::now()).replacen(
                "report-0",
                &format!("report-{name}"),
                1,
            );
            let cwd = std::env::current_dir().context("the current folder")?;
            refuse_state_folder(&here, &cwd, "the current folder")?;
            crate::record::claim_run_folder(&cwd, &name)
                .with_context(|| format!("creating a report folder in {}: give --out", cwd.display()))?
        }
    };
    check_out(&source, &here, &out, options.force)?;
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let files = render(&source, &out)?;
    Ok(Written { out, files })
}

/// Refuses a place inside a state folder (or any state folder) for the report.
fn refuse_state_folder(state: &Path, place: &Path, what: &str) -> anyhow::Result<()> {
    let place = nearest_existing(place);
    let inside = place.starts_with(state)
        || place.ancestors().any(|a| a.join(anchorage_server::store::DB_FILE).exists() && a != Path::new("/"));
    anyhow::ensure!(
        !inside,
        "{what} ({}) is inside a server's state folder ({}): the report is never written there; give --out DIR \
         elsewhere",
        place.display(),
        state.display()
    );
    Ok(())
}

/// `path` made absolute through its nearest existing ancestor (symbolic links resolved).
fn nearest_existing(path: &Path) -> PathBuf {
    let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut rest = Vec::new();
    let mut at = path.as_path();
    loop {
        if let Ok(real) = std::fs::canonicalize(at) {
            return rest.iter().rev().fold(real, |p: PathBuf, part| p.join(part));
        }
        match (at.parent(), at.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                at = parent;
            }
            _ => return path,
        }
    }
}

/// Where the report may go: never into a state folder; into a folder that is empty, is the run
/// folder itself, or holds an earlier report of the same folder; elsewhere only with `force`.
fn check_out(source: &Source, here: &Path, out: &Path, force: bool) -> anyhow::Result<()> {
    match source.kind {
        Kind::StateFolder => refuse_state_folder(here, out, "--out")?,
        Kind::RunFolder => {
            // A run folder's report goes into the run folder, but never into a state folder
            // inside or around it (`anchorage fleet --local` keeps one in `state/`).
            let real = nearest_existing(out);
            anyhow::ensure!(
                !real.join(anchorage_server::store::DB_FILE).exists(),
                "--out {} is a server's state folder: the report is never written there",
                out.display()
            );
        }
    }
    let real = nearest_existing(out);
    if real == here {
        return Ok(());
    }
    let entries: Vec<String> = match std::fs::read_dir(out) {
        Ok(entries) => entries.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect(),
        Err(_) => return Ok(()), // not there yet (or not readable: creating it will say)
    };
    if entries.is_empty() || previous_source(out).is_some_and(|s| s == here) {
        return Ok(());
    }
    if force {
        return Ok(());
    }
    let what = if out.join("metrics.json").exists() || out.join("rounds.csv").exists() {
        "another run".to_string()
    } else if let Some(other) = previous_source(out) {
        format!("the report of {}", other.display())
    } else {
        format!("{} other files", entries.len())
    };
    anyhow::bail!(
        "--out {} already holds {what}: give an empty or new folder, or --force to replace its report files \
         (report.md and the charts; nothing else is touched)",
        out.display()
    )
}

/// The folder an earlier `report.md` in `out` was made from (its `**Source:**` line).
fn previous_source(out: &Path) -> Option<PathBuf> {
    let md = std::fs::read_to_string(out.join("report.md")).ok()?;
    let line = md.lines().find_map(|l| l.strip_prefix("**Source:** `"))?;
    Some(PathBuf::from(line.split('`').next()?))
}

/// Draws the charts and writes `report.md` into `out`; returns the files written. Charts of an
/// earlier report that this one does not draw are removed.
fn render(source: &Source, out: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let (summary, ledger, info) = (&source.summary, &source.ledger, &source.info);
    let rows = source.accuracy.as_deref();
    let rounds: Vec<u64> = summary.rounds.iter().map(|r| r.round).collect();
    let mut charts = Charts { out, files: Vec::new(), plots: Vec::new() };

    // Where each task after the first begins: at the end of the round before its first.
    let last_round = rounds.last().copied().unwrap_or(0);
    let starts = info.task_starts(rows, last_round);
    let tasks = task_count(rows, summary, &starts);

    if let Some(server) = &source.server {
        server_accuracy_charts(server, summary, &mut |stem, title, svg| charts.put(stem, title, svg))?;
    } else {
        run_accuracy_charts(source, &starts, &mut charts)?;
    }
    bytes_chart(&rounds, ledger, &mut charts)?;
    round_time_breakdown_chart(&rounds, ledger, &mut charts)?;
    round_time_cdf_chart(ledger, &mut charts)?;
    let (global, local) = matrix_charts(rows.filter(|_| tasks > 1), &mut charts)?;
    remove_stale_charts(out, &charts.plots)?;

    let clients = rows.map_or(!summary.continual.local_matrix.is_empty(), accuracy::has_clients);
    let doc = Doc {
        source,
        summary,
        ledger,
        info,
        tasks,
        clients,
        global: global.as_deref(),
        local: local.as_deref(),
        plots: &charts.plots,
    };
    let path = out.join("report.md");
    std::fs::write(&path, markdown(&doc)).with_context(|| format!("writing {}", path.display()))?;
    let mut files = charts.files;
    files.push(path);
    Ok(files)
}

/// The charts a report has written into its folder so far, each as SVG and PNG.
struct Charts<'a> {
    out: &'a Path,
    /// The files written, each chart's PNG before its SVG.
    files: Vec<PathBuf>,
    plots: Vec<Plot>,
}

impl Charts<'_> {
    /// Writes one chart as `<stem>.svg` and `<stem>.png` and records it under `title`.
    fn put(&mut self, stem: &str, title: &str, svg: String) -> anyhow::Result<()> {
        let path = self.out.join(format!("{stem}.svg"));
        std::fs::write(&path, &svg).with_context(|| format!("writing {}", path.display()))?;
        let png = path.with_extension("png");
        png::write_png(&svg, &png).with_context(|| format!("rendering {}", png.display()))?;
        self.files.extend([png, path]);
        self.plots.push(Plot { title: title.into(), stem: stem.into() });
        Ok(())
    }
}

/// The ledger's records of one round.
fn by_round(ledger: &[CostRecord], round: u64) -> impl Iterator<Item = &CostRecord> {
    ledger.iter().filter(move |c| c.round == round)
}

/// A run folder's accuracy by round and over time (the global model's, or the mean of the
/// clients' local models for a method with none), with the task boundaries marked.
fn run_accuracy_charts(source: &Source, starts: &[(usize, u64)], charts: &mut Charts) -> anyhow::Result<()> {
    let summary = &source.summary;
    let rows = source.accuracy.as_deref();
    // A method with no global model has no initial accuracy, and its rounds' accuracy is
    // the mean of the clients' local models.
    let evaluated = summary.rounds.iter().any(|r| r.accuracy.is_finite());
    // Without metrics.json (no initial accuracy recorded), accuracy.csv says whose it is.
    let global = summary.initial_accuracy.is_finite()
        || (!source.has_metrics && rows.is_some_and(|rows| rows.iter().any(|r| r.model == "global")));
    let initial = summary.initial_accuracy.is_finite().then_some((0.0, summary.initial_accuracy * 100.0));
    let (whose, series) =
        if global { ("Global accuracy", "global") } else { ("Accuracy of the clients' local models", "clients' mean") };
    if evaluated {
        accuracy_by_round_chart(summary, initial, starts, (whose, series), charts)?;
        accuracy_by_time_chart(summary, initial, starts, (whose, series), charts)?;
    }
    Ok(())
}

/// `accuracy_by_round`: the accuracy after each round (from the initial one), `(whose, series)`
/// naming the model.
fn accuracy_by_round_chart(
    summary: &RunSummary,
    initial: Option<(f64, f64)>,
    starts: &[(usize, u64)],
    (whose, series): (&str, &str),
    charts: &mut Charts,
) -> anyhow::Result<()> {
    let accuracy: Vec<(f64, f64)> =
        initial.into_iter().chain(summary.rounds.iter().map(|r| (r.round as f64, r.accuracy * 100.0))).collect();
    let title = format!("{whose} by round");
    let marks = task_marks(starts.iter().map(|&(k, r)| (k, r as f64 - 1.0)));
    charts.put(
        "accuracy_by_round",
        &title,
        line_chart_marked(
            &title,
            "round",
            "accuracy (%)",
            &[Series { name: series.into(), points: accuracy }],
            Some((0.0, 100.0)),
            &marks,
        ),
    )
}

/// `accuracy_by_time`: the accuracy over the sum of the round durations, `(whose, series)`
/// naming the model.
fn accuracy_by_time_chart(
    summary: &RunSummary,
    initial: Option<(f64, f64)>,
    starts: &[(usize, u64)],
    (whose, series): (&str, &str),
    charts: &mut Charts,
) -> anyhow::Result<()> {
    let mut clock = 0.0;
    let mut by_time: Vec<(f64, f64)> = initial.into_iter().collect();
    // The clock when each round began, for the task boundaries.
    let mut began = std::collections::BTreeMap::new();
    for r in &summary.rounds {
        began.insert(r.round, clock);
        clock += r.seconds;
        by_time.push((clock, r.accuracy * 100.0));
    }
    let marks = task_marks(starts.iter().filter_map(|&(k, r)| Some((k, *began.get(&r)?))));
    let title = format!("{whose} over time");
    charts.put(
        "accuracy_by_time",
        &title,
        line_chart_marked(
            &title,
            "seconds (sum of round durations)",
            "accuracy (%)",
            &[Series { name: series.into(), points: by_time }],
            Some((0.0, 100.0)),
            &marks,
        ),
    )
}

/// The bytes per client of each round (payload and wire, up and down), in the binary unit of
/// the largest value: the unit's name and the four series.
fn bytes_series(rounds: &[u64], ledger: &[CostRecord]) -> (&'static str, [(&'static str, Vec<f64>); 4]) {
    let per_client = |f: &dyn Fn(&CostRecord) -> u64| -> Vec<f64> {
        rounds.iter().map(|&r| mean(by_round(ledger, r).map(|c| f(c) as f64))).collect()
    };
    let max_up: Vec<f64> =
        rounds.iter().map(|&r| by_round(ledger, r).map(|c| c.wire_up).max().unwrap_or(0) as f64).collect();
    let mut bytes = [
        ("up payload (mean)", per_client(&|c| c.payload_up)),
        ("up wire (mean)", per_client(&|c| c.wire_up)),
        ("up wire (max)", max_up),
        ("down wire (mean)", per_client(&|c| c.wire_down)),
    ];
    // In the binary unit of the largest value (as the console's columns are).
    let top = bytes.iter().flat_map(|(_, v)| v.iter().copied()).fold(0.0, f64::max);
    let (unit, scale) = [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)]
        .into_iter()
        .find(|(_, s)| top >= *s as f64)
        .unwrap_or(("bytes", 1));
    for (_, values) in &mut bytes {
        values.iter_mut().for_each(|v| *v /= scale as f64);
    }
    (unit, bytes)
}

/// `bytes_per_round`: the bytes per client of each round, as grouped bars up to
/// [`MAX_BAR_ROUNDS`] rounds and as lines beyond.
fn bytes_chart(rounds: &[u64], ledger: &[CostRecord], charts: &mut Charts) -> anyhow::Result<()> {
    let (unit, bytes) = bytes_series(rounds, ledger);
    // Per client: the console's columns are the round's totals over its clients.
    let title = "Bytes per client per round";
    let y_label = format!("{unit} per client (the console prints round totals)");
    let y_label = y_label.as_str();
    let chart = if rounds.len() <= MAX_BAR_ROUNDS {
        let categories: Vec<String> = rounds.iter().map(|r| r.to_string()).collect();
        let series: Vec<(&str, Vec<f64>)> = bytes.iter().map(|(n, v)| (*n, v.clone())).collect();
        grouped_bars(title, "round", y_label, &categories, &series)
    } else {
        let series: Vec<Series> = bytes
            .iter()
            .map(|(name, values)| Series {
                name: name.to_string(),
                points: rounds.iter().zip(values).map(|(&r, &v)| (r as f64, v)).collect(),
            })
            .collect();
        line_chart(title, "round", y_label, &series, None)
    };
    charts.put("bytes_per_round", title, chart)
}

/// `round_time_breakdown`: a client's mean compute, transfer and wait seconds of each round.
fn round_time_breakdown_chart(rounds: &[u64], ledger: &[CostRecord], charts: &mut Charts) -> anyhow::Result<()> {
    let layer = |f: &dyn Fn(&CostRecord) -> f64| -> Vec<f64> {
        rounds.iter().map(|&r| mean(by_round(ledger, r).map(f))).collect()
    };
    let title = "Where a client's round goes (mean over clients)";
    charts.put(
        "round_time_breakdown",
        title,
        stacked_bars(
            title,
            "round",
            "seconds",
            &rounds.iter().map(|r| r.to_string()).collect::<Vec<_>>(),
            &[
                ("compute", layer(&|c| c.compute_seconds)),
                ("transfer", layer(&|c| c.transfer_seconds)),
                ("wait", layer(&|c| c.wait_seconds)),
            ],
        ),
    )
}

/// `round_time_cdf`: the distribution of the client rounds' wall seconds.
fn round_time_cdf_chart(ledger: &[CostRecord], charts: &mut Charts) -> anyhow::Result<()> {
    let mut walls: Vec<f64> = ledger.iter().map(|c| c.wall_seconds).collect();
    walls.sort_by(f64::total_cmp);
    let n = walls.len().max(1) as f64;
    let cdf: Vec<(f64, f64)> = walls.iter().enumerate().map(|(i, w)| (*w, (i + 1) as f64 / n)).collect();
    let title = "CDF of client round times";
    charts.put(
        "round_time_cdf",
        title,
        line_chart(
            title,
            "seconds from broadcast to ack",
            "fraction of client-rounds",
            &[Series { name: "clients".into(), points: cdf }],
            Some((0.0, 1.0)),
        ),
    )
}

/// A task accuracy matrix: per task trained, the accuracy on each test task.
type Matrix = Vec<Vec<Option<f64>>>;

/// The task accuracy heat maps of `rows` (given for more than one task only): the global
/// model's and the mean of the clients' local models, where the records have them; returns
/// the two matrices.
fn matrix_charts(
    rows: Option<&[AccuracyRow]>,
    charts: &mut Charts,
) -> anyhow::Result<(Option<Matrix>, Option<Matrix>)> {
    let (mut global, mut local) = (None, None);
    if let Some(rows) = rows {
        let (row_label, col_label) = ("after task t", "test task k");
        if rows.iter().any(|r| r.model == "global") {
            let matrix = accuracy_matrix(rows, "global");
            let title = "Task accuracy (%): global model";
            charts.put("accuracy_matrix", title, heat_map(title, &matrix, row_label, col_label))?;
            global = Some(matrix);
        }
        if accuracy::has_clients(rows) {
            let matrix = accuracy_matrix(rows, CLIENTS_MEAN);
            let title = "Task accuracy (%): mean of the clients' local models";
            charts.put("accuracy_matrix_clients", title, heat_map(title, &matrix, row_label, col_label))?;
            local = Some(matrix);
        }
    }
    Ok((global, local))
}

/// Removes from `out` the charts of an earlier report that this one (`plots`) did not draw.
fn remove_stale_charts(out: &Path, plots: &[Plot]) -> anyhow::Result<()> {
    for stem in PLOTS.iter().filter(|stem| !plots.iter().any(|p| p.stem == **stem)) {
        for ext in ["svg", "png"] {
            let stale = out.join(format!("{stem}.{ext}"));
            match std::fs::remove_file(&stale) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(e).with_context(|| format!("removing {} (an earlier report's)", stale.display()));
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// A state folder's accuracy charts: the devices' own evaluation and the server's held-out
/// accuracy, when the rounds carry them (by round, and over the sum of round durations).
fn server_accuracy_charts(
    server: &ServerRun,
    summary: &RunSummary,
    put: &mut dyn FnMut(&str, &str, String) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    // Per kind of accuracy: its points by round and by time.
    type Points = Vec<(f64, f64)>;
    let mut clock = 0.0;
    let (mut device, mut held_out): ([Points; 2], [Points; 2]) = Default::default();
    for (r, row) in server.reports.iter().zip(&summary.rounds) {
        clock += row.seconds;
        if let Some((a, _)) = r.device_accuracy() {
            device[0].push((r.round as f64, a * 100.0));
            device[1].push((clock, a * 100.0));
        }
        if let Some(a) = r.held_out_accuracy {
            held_out[0].push((r.round as f64, a * 100.0));
            held_out[1].push((clock, a * 100.0));
        }
    }
    let series = |by_time: bool| -> Vec<Series> {
        let at = usize::from(by_time);
        [("device accuracy (their own evaluation)", &device[at]), ("held-out accuracy (server)", &held_out[at])]
            .into_iter()
            .filter(|(_, points)| !points.is_empty())
            .map(|(name, points)| Series { name: name.into(), points: points.clone() })
            .collect()
    };
    if series(false).is_empty() {
        return Ok(());
    }
    let title = "Accuracy by round";
    put("accuracy_by_round", title, line_chart(title, "round", "accuracy (%)", &series(false), Some((0.0, 100.0))))?;
    let title = "Accuracy over time";
    put(
        "accuracy_by_time",
        title,
        line_chart(title, "seconds (sum of round durations)", "accuracy (%)", &series(true), Some((0.0, 100.0))),
    )
}

/// How many tasks the run trained: from the accuracy records, else the continual metrics'
/// matrices, else the task starts (1 at least).
fn task_count(rows: Option<&[AccuracyRow]>, summary: &RunSummary, starts: &[(usize, u64)]) -> usize {
    let from_rows = rows.and_then(|rows| rows.iter().map(|r| r.task + 1).max());
    let c = &summary.continual;
    from_rows
        .or_else(|| Some(c.global_matrix.len().max(c.local_matrix.len())).filter(|n| *n > 0))
        .unwrap_or(0)
        .max(starts.iter().map(|(k, _)| k + 1).max().unwrap_or(1))
}

/// What `report.md` is made of.
struct Doc<'a> {
    source: &'a Source,
    summary: &'a RunSummary,
    ledger: &'a [CostRecord],
    info: &'a RunInfo,
    /// Tasks the run trained (1: not a continual run).
    tasks: usize,
    /// Whether the clients reported their local models' accuracy.
    clients: bool,
    /// The task accuracy matrices of the global model and of the clients' mean.
    global: Option<&'a [Vec<Option<f64>>]>,
    local: Option<&'a [Vec<Option<f64>>]>,
    plots: &'a [Plot],
}

fn percent(v: Option<f64>) -> Option<String> {
    v.filter(|v| v.is_finite()).map(|v| format!("{:.2}%", v * 100.0))
}

/// `report.md`: the status, where it was read from, a summary table, the continual-learning
/// metrics (more than one task), the task accuracy matrices, every plot, and the rounds.
fn markdown(doc: &Doc) -> String {
    let mut md = String::new();
    heading(&mut md, doc.source);
    let _ = writeln!(md, "| | |\n|---|---|");
    accuracy_rows(&mut md, doc);
    cost_rows(&mut md, doc);
    if doc.tasks > 1 {
        continual_section(&mut md, doc);
    }
    matrix_sections(&mut md, doc);
    plots_section(&mut md, doc.plots);
    match doc.source.server.as_ref() {
        Some(server) => server.rounds_section(&mut md, doc.summary),
        None => rounds_section(&mut md, doc.summary, doc.ledger),
    }
    md
}

/// The title, the status, the folder the report was read from, and the notes on what it read.
fn heading(md: &mut String, source: &Source) {
    let server = source.server.as_ref();
    md.push_str(if server.is_some() { "# Server report\n\n" } else { "# Run report\n\n" });
    let _ = writeln!(md, "**Status:** {}.\n", source.status);
    let dir = std::fs::canonicalize(&source.dir).unwrap_or_else(|_| source.dir.clone());
    let what = match (source.kind, server.and_then(|s| s.configured.as_ref())) {
        (Kind::RunFolder, _) => "a run folder".to_string(),
        (Kind::StateFolder, Some((_, config))) => {
            format!("a server's state folder, read only; rounds set in {}", config.display())
        }
        (Kind::StateFolder, None) => "a server's state folder, read only".to_string(),
    };
    let _ = writeln!(md, "**Source:** `{}` ({what}).\n", dir.display());
    for note in &source.notes {
        let _ = writeln!(md, "> {note}\n");
    }
}

/// The summary table's first rows: the method, the clients and the accuracies (final, best,
/// the clients' local models over one task).
fn accuracy_rows(md: &mut String, doc: &Doc) {
    let Doc { source, summary, info, .. } = doc;
    let server = source.server.as_ref();
    if let Some(method) = &info.method {
        match info.method_info() {
            Some(m) => {
                let _ = writeln!(md, "| method | {method} ({}) |", m.paper);
            }
            None => {
                let _ = writeln!(md, "| method | {method} |");
            }
        }
    }
    if let Some(clients) = info.clients {
        let _ = writeln!(md, "| clients | {clients} |");
    }
    if let Some(server) = server {
        server.accuracy_lines(md);
    } else if summary.final_accuracy.is_finite() {
        let initial = if source.has_metrics {
            percent(Some(summary.initial_accuracy)).unwrap_or_else(|| "– (no global model yet)".into())
        } else {
            "– (not recorded: no metrics.json)".into()
        };
        let chance =
            if summary.chance.is_finite() { format!(", chance {:.0}%", summary.chance * 100.0) } else { String::new() };
        let _ = writeln!(md, "| final accuracy | {:.2}% (initial {initial}{chance}) |", summary.final_accuracy * 100.0);
    } else {
        let _ = writeln!(md, "| final accuracy | not measured |");
    }
    if server.is_none()
        && let Some(best) =
            summary.rounds.iter().filter(|r| r.accuracy.is_finite()).max_by(|a, b| a.accuracy.total_cmp(&b.accuracy))
    {
        let _ = writeln!(md, "| best accuracy | {:.2}% (round {}) |", best.accuracy * 100.0, best.round);
    }
    if doc.tasks <= 1
        && doc.clients
        && let Some(local) = percent(summary.continual.local_final_accuracy)
    {
        let _ = writeln!(md, "| clients' local models (mean, last evaluation) | {local} |");
    }
}

/// The summary table's other rows: rounds and tasks, bytes, energy, FedProK's efficiency, late
/// and refused updates, time, and how often the clients' local models were evaluated.
fn cost_rows(md: &mut String, doc: &Doc) {
    let Doc { source, summary, ledger, info, .. } = doc;
    let total = |f: &dyn Fn(&CostRecord) -> u64| ledger.iter().map(f).sum::<u64>();
    let _ = writeln!(md, "| rounds | {} |", summary.rounds.len());
    if doc.tasks > 1 {
        let per_task =
            if info.rounds_per_task > 0 { format!(", {} rounds each", info.rounds_per_task) } else { String::new() };
        let _ = writeln!(md, "| tasks | {}{per_task} |", doc.tasks);
    }
    let _ = writeln!(
        md,
        "| bytes up (payload / wire) | {} / {} |",
        human_bytes(total(&|c| c.payload_up)),
        human_bytes(total(&|c| c.wire_up))
    );
    let _ = writeln!(
        md,
        "| bytes down (payload / wire) | {} / {} |",
        human_bytes(total(&|c| c.payload_down)),
        human_bytes(total(&|c| c.wire_down))
    );
    if let Some(payload) = summary.mean_upload_payload {
        let _ = writeln!(md, "| mean payload per upload | {} |", human_bytes(payload.round() as u64));
    }
    let _ = writeln!(
        md,
        "| mean wire / payload per upload | {} |",
        summary.upload_wire_ratio.map(|r| format!("{r:.4}")).unwrap_or_else(|| "-".into())
    );
    let _ = writeln!(md, "| energy (estimate) | {:.1} J |", ledger.iter().map(|c| c.joules).sum::<f64>());
    if info.method_info().is_some_and(|m| m.reports_efficiency) {
        let e = &summary.efficiency;
        let _ = writeln!(
            md,
            "| FedProK efficiency E = (τ1 + τ2) / R | {:.3} s per round (τ1 compute {:.1} s, τ2 transfer {:.1} s, R = {}) |",
            e.seconds_per_round, e.compute_seconds, e.transfer_seconds, e.rounds
        );
    }
    let _ = writeln!(md, "| late updates / refused | {} / {} |", summary.late_updates, summary.refused);
    if let Some(p) = &summary.privacy {
        let _ = writeln!(
            md,
            "| differential privacy | ε = {:.3} at δ = {:e} after {} rounds ({} noise, σ = {:.3}, clip {:.4}) |",
            p.epsilon,
            p.delta,
            p.rounds,
            p.noise.name(),
            p.noise_multiplier,
            p.clip
        );
    }
    let wall = if source.server.is_some() { "time in rounds (sum of round durations)" } else { "wall time of the run" };
    let _ = writeln!(md, "| {wall} | {:.1} s |", summary.wall_seconds);
    local_eval_row(md, summary);
}

/// The summary table's row on the clients' local evaluation, when it was not every round on
/// every test row.
fn local_eval_row(md: &mut String, summary: &RunSummary) {
    let local = &summary.local_eval;
    if local.every > 1 || local.sampled {
        let _ = writeln!(
            md,
            "| clients' local accuracies | every {} round(s), on {:.0}% of each task's test rows{} |",
            local.every,
            local.fraction * 100.0,
            if local.sampled {
                " (a seeded sample: the local side of the continual metrics is an estimate)"
            } else {
                ""
            }
        );
    }
}

/// The task accuracy matrices as tables: the global model's (with the average after the last
/// task) and the clients' mean, where the report drew them.
fn matrix_sections(md: &mut String, doc: &Doc) {
    if let Some(matrix) = doc.global {
        let _ = writeln!(
            md,
            "\n## Task accuracy matrix (global model)\n\nAccuracy on each test task at the last round of each task (from `accuracy.csv`).\n"
        );
        md.push_str(&accuracy::markdown_table(matrix));
        if let Some(avg) = accuracy::final_average(matrix) {
            let _ = writeln!(md, "\nAverage accuracy after the last task: {:.2}%.", avg * 100.0);
        }
    }
    if let Some(matrix) = doc.local {
        let _ = writeln!(md, "\n## Task accuracy matrix (mean of the clients' local models)\n");
        md.push_str(&accuracy::markdown_table(matrix));
    }
}

/// Every chart the report drew, embedded as its PNG.
fn plots_section(md: &mut String, plots: &[Plot]) {
    if !plots.is_empty() {
        md.push_str("\n## Plots\n\nEach plot is also an SVG of the same name.\n");
        for plot in plots {
            let _ = writeln!(md, "\n### {}\n\n![{}]({}.png)", plot.title, plot.title, plot.stem);
        }
    }
}

/// A run folder's table of rounds: accuracy, updates, bytes, seconds, and the clients' mean
/// compute, transfer and wait seconds.
fn rounds_section(md: &mut String, summary: &RunSummary, ledger: &[CostRecord]) {
    let _ = writeln!(
        md,
        "\n## Rounds\n\n| round | accuracy | updates | dropped | up wire | down wire | seconds | mean compute s | mean transfer s | mean wait s |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in &summary.rounds {
        let costs: Vec<&CostRecord> = ledger.iter().filter(|c| c.round == r.round).collect();
        let m = |f: &dyn Fn(&CostRecord) -> f64| mean(costs.iter().map(|c| f(c)));
        let accuracy = percent(Some(r.accuracy)).unwrap_or_else(|| "–".into());
        let _ = writeln!(
            md,
            "| {} | {accuracy} | {}/{} | {} | {} | {} | {:.2} | {:.3} | {:.3} | {:.3} |",
            r.round,
            r.aggregated,
            r.sampled,
            r.dropped,
            human_bytes(r.wire_up),
            human_bytes(r.wire_down),
            r.seconds,
            m(&|c| c.compute_seconds),
            m(&|c| c.transfer_seconds),
            m(&|c| c.wait_seconds)
        );
    }
}

/// The continual-learning metrics (ARCHITECTURE.md §8) that the run has: the global model's,
/// and the clients' local models' when they reported any.
fn continual_section(md: &mut String, doc: &Doc) {
    let c = &doc.summary.continual;
    let ratio = |v: Option<f64>| v.filter(|v| v.is_finite()).map(|v| format!("{v:.3}"));
    let mut rows: Vec<(&str, Option<String>)> = vec![
        ("final average accuracy (seen tasks, after the last)", percent(c.final_accuracy)),
        ("average incremental accuracy (mean over tasks)", percent(c.average_accuracy)),
        ("forgetting (best earlier − final, old tasks)", percent(c.forgetting)),
        ("stability (old tasks after the last; FedProK)", percent(c.stability)),
        ("plasticity (each task right after it; FedProK)", percent(c.plasticity)),
        ("U(λ = 0.5) (FedProK Eq. 1)", percent(c.utility)),
        ("KR_t temporal retention (FedTA Eq. 11)", ratio(c.kr_temporal)),
    ];
    if doc.clients {
        rows.extend([
            ("A^loc clients' local models after the last task", percent(c.local_final_accuracy)),
            ("KR_s spatial retention (FedTA Eq. 12)", ratio(c.kr_spatial)),
        ]);
    }
    rows.push(("A^sel clients on their own classes (GLDP)", percent(c.selected_final_accuracy)));
    let rows: Vec<(&str, String)> = rows.into_iter().filter_map(|(name, v)| Some((name, v?))).collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "\n## Continual learning\n\nOver {} tasks, from the task accuracy matrix.\n\n| metric | value |\n|---|---:|",
        doc.tasks
    );
    for (name, value) in rows {
        let _ = writeln!(md, "| {name} | {value} |");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{RoundRow, SummaryInputs};

    /// A run folder of `rounds` rounds with no ledger, `config.toml` as given and `accuracy.csv`
    /// from `csv` when given; the summary's continual metrics come from the same rows.
    fn folder(dir: &Path, config: &str, rounds: u64, csv: Option<&str>) {
        let rows = csv.map(|csv| accuracy::parse(csv, "test").unwrap()).unwrap_or_default();
        let round_rows = (1..=rounds).map(|round| RoundRow::example(round, 0.3 + 0.05 * round as f64, 1.5)).collect();
        let mut summary = RunSummary::new(SummaryInputs::example(), round_rows, &[], &rows);
        summary.status = crate::RunStatus::Interrupted;
        summary.stop_reason = Some("SIGINT".into());
        std::fs::write(dir.join("metrics.json"), serde_json::to_string(&summary).unwrap()).unwrap();
        std::fs::write(dir.join("ledger.json"), "[]").unwrap();
        std::fs::write(dir.join("config.toml"), config).unwrap();
        match csv {
            Some(csv) => std::fs::write(dir.join(accuracy::FILE), csv).unwrap(),
            None => {
                let _ = std::fs::remove_file(dir.join(accuracy::FILE));
            }
        }
    }

    /// Four tasks of three rounds; every model is tested on the tasks seen so far, and forgets.
    fn four_tasks() -> String {
        let mut csv = String::from(accuracy::HEADER);
        for t in 0..4usize {
            for k in 0..=t {
                let global = 0.92 - 0.15 * (t - k) as f64 - 0.02 * k as f64;
                csv.push_str(&format!("\n{},{t},global,{k},{global:.4}", 3 * t + 3));
                for c in 0..3 {
                    let local = global - 0.05 * c as f64 - 0.1;
                    csv.push_str(&format!("\n{},{t},client-{c:03},{k},{local:.4}", 3 * t + 3));
                }
            }
            csv.push_str(&format!("\n{},{t},global,{t},0.3", 3 * t + 1));
        }
        csv + "\n"
    }

    #[test]
    fn a_run_with_accuracy_csv_gets_heat_maps_and_a_table() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        folder(dir, "rounds = 12\nrounds_per_task = 3\n[method]\nname = \"fedavg\"\n", 12, None);
        let without = write_report(dir).unwrap();
        assert!(!without.iter().any(|f| f.to_string_lossy().contains("accuracy_matrix")), "no csv, no matrix");
        let svg = std::fs::read_to_string(dir.join("accuracy_by_round.svg")).unwrap();
        assert_eq!(svg.matches("task-boundary").count(), 3, "no csv: the boundaries from rounds_per_task");
        folder(dir, "rounds = 12\nrounds_per_task = 3\n[method]\nname = \"fedavg\"\n", 12, Some(&four_tasks()));
        let files = write_report(dir).unwrap();
        for name in
            ["accuracy_matrix.svg", "accuracy_matrix.png", "accuracy_matrix_clients.svg", "accuracy_matrix_clients.png"]
        {
            assert!(files.contains(&dir.join(name)), "{name} missing from {files:?}");
        }
        let png = std::fs::read(dir.join("accuracy_matrix.png")).unwrap();
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 3_000, "{} bytes", png.len());
        let svg = std::fs::read_to_string(dir.join("accuracy_matrix.svg")).unwrap();
        assert_eq!(svg.matches(r#"class="cell""#).count(), 16);
        assert!(svg.contains(">92.0<") && svg.contains(">47.0<"), "first and forgotten entries");
        let clients = std::fs::read_to_string(dir.join("accuracy_matrix_clients.svg")).unwrap();
        assert!(clients.contains(">77.0<"), "mean of 0.82, 0.77 and 0.72");
        for chart in ["accuracy_by_round.svg", "accuracy_by_time.svg"] {
            let svg = std::fs::read_to_string(dir.join(chart)).unwrap();
            assert_eq!(svg.matches(r#"class="task-boundary""#).count(), 3, "{chart}");
            assert!(svg.contains(">task 1<") && svg.contains(">task 3<"), "{chart}");
        }
        let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
        assert!(md.contains("## Task accuracy matrix (global model)"), "{md}");
        assert!(md.contains("| 0 | 92.0% | – | – | – |") && md.contains("| 3 | 47.0% |"), "{md}");
        assert!(md.contains("## Task accuracy matrix (mean of the clients' local models)"), "{md}");
        std::fs::write(dir.join(accuracy::FILE), format!("{}\n1,0,global,0,2.5\n", accuracy::HEADER)).unwrap();
        let err = format!("{:#}", write_report(dir).unwrap_err());
        assert!(err.contains("accuracy.csv:2: accuracy 2.5 is outside [0, 1]"), "{err}");
    }

    #[test]
    fn report_md_shows_what_applies_to_the_run() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        // FedProK over four tasks, clients reporting: every section.
        folder(
            dir,
            "clients = 3\nrounds = 12\nrounds_per_task = 3\n[method]\nname = \"fedprok\"\n",
            12,
            Some(&four_tasks()),
        );
        let files = write_report(dir).unwrap();
        let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
        assert!(md.starts_with("# Run report\n\n**Status:** interrupted after round 12 (SIGINT)."), "{md}");
        assert!(md.contains("| method | fedprok (FedProK (Gao et al.)) |") && md.contains("| clients | 3 |"), "{md}");
        assert!(md.contains("| FedProK efficiency E = (τ1 + τ2) / R |"), "{md}");
        assert!(md.contains("## Continual learning") && md.contains("| forgetting"), "{md}");
        assert!(md.contains("| A^loc clients' local models after the last task |"), "{md}");
        assert!(md.contains("| stability") && md.contains("| plasticity"), "{md}");
        // Every plot written is embedded under its title.
        let pngs: Vec<&PathBuf> = files.iter().filter(|f| f.extension().is_some_and(|e| e == "png")).collect();
        assert_eq!(pngs.len(), 7, "{files:?}");
        for png in pngs {
            let name = png.file_name().unwrap().to_string_lossy();
            assert!(md.contains(&format!("]({name})")), "{name} not embedded: {md}");
        }
        assert!(md.contains("### Global accuracy by round\n\n![Global accuracy by round](accuracy_by_round.png)"));

        // FedAvg over one task, the global model only: no FedProK row, no continual metrics.
        let one = format!("{}\n1,0,global,0,0.4\n2,0,global,0,0.5\n", accuracy::HEADER);
        folder(dir, "rounds = 2\n[method]\nname = \"fedavg\"\n", 2, Some(&one));
        let files = write_report(dir).unwrap();
        let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
        assert!(!md.contains("FedProK") && !md.contains("## Continual learning") && !md.contains("forgetting"), "{md}");
        assert!(!md.contains("Task accuracy matrix") && !md.contains("A^loc"), "{md}");
        assert!(!files.iter().any(|f| f.to_string_lossy().contains("accuracy_matrix")), "one task: no heat map");
        assert_eq!(md.matches("![").count(), 5, "{md}");
        let svg = std::fs::read_to_string(dir.join("accuracy_by_round.svg")).unwrap();
        assert!(!svg.contains("task-boundary"));

        // A method with no global model: no initial accuracy, the clients' mean still charted.
        let mut metrics: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("metrics.json")).unwrap()).unwrap();
        metrics["initial_accuracy"] = serde_json::Value::Null;
        std::fs::write(dir.join("metrics.json"), metrics.to_string()).unwrap();
        let files = write_report(dir).unwrap();
        assert!(files.contains(&dir.join("accuracy_by_round.png")), "{files:?}");
        let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
        assert!(md.contains("(initial – (no global model yet), chance 10%)"), "{md}");
        assert!(md.contains("![Accuracy of the clients' local models by round](accuracy_by_round.png)"), "{md}");

        // Two tasks, the global model only: the global metrics, not the local ones.
        let two = format!("{}\n1,0,global,0,0.8\n2,1,global,0,0.5\n2,1,global,1,0.7\n", accuracy::HEADER);
        folder(dir, "rounds = 2\nrounds_per_task = 1\n", 2, Some(&two));
        write_report(dir).unwrap();
        let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
        assert!(md.contains("| method | fedavg (McMahan et al. 2017) |"), "no [method]: the default: {md}");
        assert!(md.contains("| forgetting (best earlier − final, old tasks) | 30.00% |"), "{md}");
        assert!(!md.contains("A^loc") && !md.contains("KR_s"), "{md}");
    }

    /// Writes `rows` under `header` as the run appends them (header first, a newline each).
    fn table<T: serde::Serialize>(path: &Path, header: &[&str], rows: &[T]) {
        let mut w = csv::WriterBuilder::new().has_headers(false).from_writer(Vec::new());
        w.write_record(header).unwrap();
        for r in rows {
            w.serialize(r).unwrap();
        }
        std::fs::write(path, w.into_inner().unwrap()).unwrap();
    }

    /// `bytes_per_round`: each round's four series are bars side by side (none drawn over
    /// another), and the y label says they are per client.
    #[test]
    fn bytes_per_round_puts_its_series_side_by_side_per_client() {
        let dir = tempfile::tempdir().unwrap();
        let ledger: Vec<CostRecord> = (1..=3u64)
            .flat_map(|round| {
                (0..2u64).map(move |c| CostRecord {
                    client: format!("client-{c}"),
                    round,
                    payload_up: 1 << 20,
                    wire_up: (1 << 20) + 1000 * (c + 1),
                    wire_down: 2 << 20,
                    ..CostRecord::default()
                })
            })
            .collect();
        let mut charts = Charts { out: dir.path(), files: Vec::new(), plots: Vec::new() };
        bytes_chart(&[1, 2, 3], &ledger, &mut charts).unwrap();
        let svg = std::fs::read_to_string(dir.path().join("bytes_per_round.svg")).unwrap();
        assert!(svg.contains("MiB per client (the console prints round totals)"), "{svg}");
        assert!(!svg.contains("as the console prints"));
        // A bar is a `<rect class="bar">` with its own x: 4 series × 3 rounds, no two at one x.
        let xs: Vec<&str> = svg.split("<rect class=\"bar\" x=\"").skip(1).filter_map(|r| r.split('"').next()).collect();
        let mut distinct = xs.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!((xs.len(), distinct.len()), (12, 12), "bars: {xs:?}");
    }

    /// A folder after a second Ctrl-C: config.toml, the tables appended round by round,
    /// metrics.json from an earlier round saying `running`, and no ledger.json.
    fn stopped_folder(dir: &Path) {
        std::fs::write(dir.join("config.toml"), "clients = 2\nrounds = 10\n").unwrap();
        let rows: Vec<RoundRow> = (1..=3).map(|r| RoundRow::example(r, 0.4 + 0.1 * r as f64, 0.5)).collect();
        table(&dir.join(crate::record::ROUNDS_FILE), &crate::record::ROUNDS_HEADER, &rows);
        let costs: Vec<CostRecord> = (1..=3u64)
            .flat_map(|round| {
                (0..2).map(move |c| CostRecord {
                    client: format!("client-{c}"),
                    round,
                    wire_up: 1000,
                    payload_up: 900,
                    compute_seconds: 0.25,
                    wall_seconds: 0.4,
                    ..CostRecord::default()
                })
            })
            .collect();
        let header: Vec<&str> = anchorage_shared::ledger::CSV_HEADER.split(',').collect();
        table(&dir.join(crate::record::LEDGER_CSV_FILE), &header, &costs);
        std::fs::write(
            dir.join(accuracy::FILE),
            format!("{}\n1,0,global,0,0.5\n2,0,global,0,0.6\n3,0,global,0,0.7\n", accuracy::HEADER),
        )
        .unwrap();
        let mut running = RunSummary::new(SummaryInputs::example(), rows[..1].to_vec(), &[], &[]);
        running.status = crate::RunStatus::Running;
        std::fs::write(dir.join("metrics.json"), serde_json::to_string(&running).unwrap()).unwrap();
        let _ = std::fs::remove_file(dir.join("ledger.json"));
    }

    /// A folder whose run never wrote its final record is reported from its
    /// tables, with an honest status.
    #[test]
    fn a_run_that_did_not_finish_is_reported_from_its_tables() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        stopped_folder(dir);
        let files = write_report(dir).unwrap();
        assert!(files.contains(&dir.join("report.md")) && files.contains(&dir.join("accuracy_by_round.png")));
        let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
        let status = "**Status:** stopped without finishing (or still running): last round 3 of 10 at ";
        assert!(md.contains(status) && md.contains(" UTC."), "{md}");
        assert!(md.contains("metrics.json still says `running`") && md.contains("read from rounds.csv"), "{md}");
        assert!(md.contains("| 3 | 70.00% | 3/3 |"), "all three rounds, from rounds.csv: {md}");
        assert!(md.contains("| final accuracy | 70.00% (initial 10.00%, chance 10%) |"), "{md}");
        assert!(
            md.contains("| rounds | 3 |") && md.contains("| bytes up (payload / wire) | 5.27 KiB / 5.86 KiB |"),
            "{md}"
        );
        // A last line cut short by the kill is left out, and said so.
        let rounds = dir.join(crate::record::ROUNDS_FILE);
        let mut text = std::fs::read_to_string(&rounds).unwrap();
        text.push_str("4,0.8");
        std::fs::write(&rounds, text).unwrap();
        write_report(dir).unwrap();
        let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
        assert!(md.contains("last round 3 of 10") && md.contains("rounds.csv was cut short (`4,0.8`)"), "{md}");

        // No metrics.json at all.
        std::fs::remove_file(dir.join("metrics.json")).unwrap();
        write_report(dir).unwrap();
        let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
        assert!(md.contains("last round 3 of 10") && md.contains("there is no metrics.json"), "{md}");
        assert!(md.contains("| final accuracy | 70.00% (initial – (not recorded: no metrics.json)) |"), "{md}");
        assert!(md.contains("![Global accuracy by round](accuracy_by_round.png)"), "accuracy.csv says global: {md}");

        // A second Ctrl-C's mark: interrupted, still no ledger.json.
        let mut marked = RunSummary::new(SummaryInputs::example(), vec![RoundRow::example(1, 0.5, 0.5)], &[], &[]);
        marked.status = crate::RunStatus::Interrupted;
        marked.stop_reason = Some("SIGINT twice: quit at once".into());
        std::fs::write(dir.join("metrics.json"), serde_json::to_string(&marked).unwrap()).unwrap();
        write_report(dir).unwrap();
        let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
        assert!(md.contains("**Status:** interrupted after round 3 (SIGINT twice: quit at once)."), "{md}");
        let (summary, ledger) = load(dir).unwrap();
        assert_eq!((summary.rounds.len(), ledger.len()), (3, 6));
    }

    /// `--out` into a folder that holds another run is refused unless
    /// forced, and no chart of an earlier report stays behind.
    #[test]
    fn out_holding_another_run_is_refused_and_no_old_chart_stays() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        for dir in [&a, &b] {
            std::fs::create_dir(dir).unwrap();
        }
        folder(&a, "rounds = 12\nrounds_per_task = 3\n", 12, Some(&four_tasks()));
        folder(&b, "rounds = 2\n", 2, None);
        write_report(&a).unwrap();
        assert!(a.join("accuracy_matrix.png").exists());
        let to = |out: &Path, force: bool| {
            write_report_with(&b, &ReportOptions { out: Some(out.to_path_buf()), force, server_config: None })
        };
        let err = format!("{:#}", to(&a, false).unwrap_err());
        assert!(err.contains("already holds another run") && err.contains("--force"), "{err}");
        let written = to(&a, true).unwrap();
        assert_eq!(written.out, a);
        assert!(!a.join("accuracy_matrix.png").exists() && !a.join("accuracy_matrix.svg").exists(), "a stale chart");
        let md = std::fs::read_to_string(a.join("report.md")).unwrap();
        let b_real = std::fs::canonicalize(&b).unwrap();
        assert!(md.contains(&format!("**Source:** `{}` (a run folder).", b_real.display())), "{md}");
        assert!(a.join("metrics.json").exists() && a.join("accuracy.csv").exists(), "the run's own files stay");
        // A new folder, then the same again (its earlier report of the same run): no --force.
        let fresh = tmp.path().join("reports/b");
        to(&fresh, false).unwrap();
        to(&fresh, false).unwrap();
        std::fs::write(tmp.path().join("reports/notes.txt"), "mine").unwrap();
        let err = format!("{:#}", to(&tmp.path().join("reports"), false).unwrap_err());
        assert!(err.contains("already holds 2 other files"), "{err}");
        // In place, a report that draws fewer charts removes the others.
        folder(&a, "rounds = 2\n", 2, None);
        write_report(&a).unwrap();
        assert!(!a.join("accuracy_matrix.png").exists());
    }
}
