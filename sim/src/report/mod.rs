//! `anchorage report <run-folder>`: plots and a Markdown summary from a run folder's
//! `metrics.json` and `ledger.json` (written by both clocks), and the task accuracy matrix from
//! `accuracy.csv` when a continual run wrote one. Charts are SVG and PNG.

pub(crate) mod png;
mod run_info;
pub(crate) mod svg;

pub use crate::accuracy::{
    AccuracyRow, CLIENTS_MEAN, FILE as ACCURACY_FILE, HEADER as ACCURACY_HEADER, SELECTED_MEAN, SELECTED_PREFIX,
    accuracy_matrix, final_average, load_accuracy, task_starts,
};
pub use run_info::RunInfo;

use std::fmt::Write;
use std::path::{Path, PathBuf};

use anchorage_shared::ledger::CostRecord;
use anyhow::Context;

use crate::accuracy;
use crate::record::{RoundRow, RunSummary, SummaryInputs, human_bytes};
use svg::{Series, heat_map, line_chart, line_chart_marked, stacked_bars, task_marks};

/// Reads a run folder's summary and ledger. A server's state folder (`anchorage.db`) works too:
/// the ledger is read from its database (without taking the running server's lock), and without
/// a `metrics.json` the summary is made from the rounds the database closed (the server does not
/// evaluate, so there is no accuracy).
pub fn load(dir: &Path) -> anyhow::Result<(RunSummary, Vec<CostRecord>)> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path)
            .with_context(|| format!("reading {} (is {} a run folder?)", path.display(), dir.display()))
    };
    let db = dir.join(anchorage_server::store::DB_FILE);
    if !db.exists() {
        let summary: RunSummary = serde_json::from_str(&read("metrics.json")?).context("parsing metrics.json")?;
        let ledger: Vec<CostRecord> = serde_json::from_str(&read("ledger.json")?).context("parsing ledger.json")?;
        return Ok((summary, ledger));
    }
    let ledger = anchorage_server::store::read_ledger(&db)?;
    if dir.join("metrics.json").exists() {
        return Ok((serde_json::from_str(&read("metrics.json")?).context("parsing metrics.json")?, ledger));
    }
    let reports = anchorage_server::store::read_round_reports(&db)?;
    let rows: Vec<RoundRow> = reports
        .iter()
        .map(|r| {
            let costs: Vec<CostRecord> = ledger.iter().filter(|c| c.round == r.round).cloned().collect();
            RoundRow::from_report(r, f64::NAN, &costs)
        })
        .collect();
    let inputs = SummaryInputs {
        initial_accuracy: f64::NAN,
        chance: f64::NAN,
        late_updates: reports.last().map_or(0, |r| r.late_total),
        refused: reports.iter().map(|r| r.refused).sum(),
        decode_errors: 0,
        wall_seconds: rows.iter().map(|r| r.seconds).sum(),
        local_eval: Default::default(),
    };
    let mut summary = RunSummary::new(inputs, rows, &ledger, &[]);
    // A server does not finish: its folder shows the rounds closed so far.
    summary.status = crate::RunStatus::Running;
    Ok((summary, ledger))
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

/// Writes the plots and `report.md` into `dir`; returns the files written.
pub fn write_report(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let (summary, ledger) = load(dir)?;
    let info = RunInfo::read(dir)?;
    let rows = load_accuracy(dir)?;
    let rounds: Vec<u64> = summary.rounds.iter().map(|r| r.round).collect();
    let by_round = |round: u64| ledger.iter().filter(move |c| c.round == round);
    let mut files = Vec::new();
    let mut plots = Vec::new();
    // Every chart is written as SVG and as PNG.
    let mut put = |stem: &str, title: &str, svg: String| -> anyhow::Result<()> {
        let path = dir.join(format!("{stem}.svg"));
        std::fs::write(&path, &svg).with_context(|| format!("writing {}", path.display()))?;
        let png = path.with_extension("png");
        png::write_png(&svg, &png).with_context(|| format!("rendering {}", png.display()))?;
        files.extend([png, path]);
        plots.push(Plot { title: title.into(), stem: stem.into() });
        Ok(())
    };

    // Where each task after the first begins: at the end of the round before its first.
    let last_round = rounds.last().copied().unwrap_or(0);
    let starts = info.task_starts(rows.as_deref(), last_round);
    let tasks = task_count(rows.as_deref(), &summary, &starts);

    // A server's state folder has no accuracy (the server does not evaluate): no accuracy charts.
    // A method with no global model has no initial accuracy, and its rounds' accuracy is the mean
    // of the clients' local models.
    let evaluated = summary.rounds.iter().any(|r| r.accuracy.is_finite());
    let global = summary.initial_accuracy.is_finite();
    let initial = global.then_some((0.0, summary.initial_accuracy * 100.0));
    let (whose, series) =
        if global { ("Global accuracy", "global") } else { ("Accuracy of the clients' local models", "clients' mean") };
    if evaluated {
        let accuracy: Vec<(f64, f64)> =
            initial.into_iter().chain(summary.rounds.iter().map(|r| (r.round as f64, r.accuracy * 100.0))).collect();
        let title = format!("{whose} by round");
        let marks = task_marks(starts.iter().map(|&(k, r)| (k, r as f64 - 1.0)));
        put(
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
        )?;

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
        put(
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
        )?;
    }

    const MIB: f64 = 1024.0 * 1024.0;
    let per_client = |f: &dyn Fn(&CostRecord) -> u64| -> Vec<(f64, f64)> {
        rounds.iter().map(|&r| (r as f64, mean(by_round(r).map(|c| f(c) as f64)) / MIB)).collect()
    };
    let max_up: Vec<(f64, f64)> =
        rounds.iter().map(|&r| (r as f64, by_round(r).map(|c| c.wire_up).max().unwrap_or(0) as f64 / MIB)).collect();
    let title = "Bytes per client per round";
    put(
        "bytes_per_round",
        title,
        line_chart(
            title,
            "round",
            "MiB (as the console prints)",
            &[
                Series { name: "up wire (mean)".into(), points: per_client(&|c| c.wire_up) },
                Series { name: "up payload (mean)".into(), points: per_client(&|c| c.payload_up) },
                Series { name: "down wire (mean)".into(), points: per_client(&|c| c.wire_down) },
                Series { name: "up wire (max)".into(), points: max_up },
            ],
            None,
        ),
    )?;

    let layer =
        |f: &dyn Fn(&CostRecord) -> f64| -> Vec<f64> { rounds.iter().map(|&r| mean(by_round(r).map(f))).collect() };
    let title = "Where a client's round goes (mean over clients)";
    put(
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
    )?;

    let mut walls: Vec<f64> = ledger.iter().map(|c| c.wall_seconds).collect();
    walls.sort_by(f64::total_cmp);
    let n = walls.len().max(1) as f64;
    let cdf: Vec<(f64, f64)> = walls.iter().enumerate().map(|(i, w)| (*w, (i + 1) as f64 / n)).collect();
    let title = "CDF of client round times";
    put(
        "round_time_cdf",
        title,
        line_chart(
            title,
            "seconds from broadcast to ack",
            "fraction of client-rounds",
            &[Series { name: "clients".into(), points: cdf }],
            Some((0.0, 1.0)),
        ),
    )?;

    // The task accuracy matrix (more than one task): the global model, and the mean of the
    // clients' local models.
    let (mut global, mut local) = (None, None);
    if let Some(rows) = rows.as_deref().filter(|_| tasks > 1) {
        let (row_label, col_label) = ("after task t", "test task k");
        if rows.iter().any(|r| r.model == "global") {
            let matrix = accuracy_matrix(rows, "global");
            let title = "Task accuracy (%): global model";
            put("accuracy_matrix", title, heat_map(title, &matrix, row_label, col_label))?;
            global = Some(matrix);
        }
        if accuracy::has_clients(rows) {
            let matrix = accuracy_matrix(rows, CLIENTS_MEAN);
            let title = "Task accuracy (%): mean of the clients' local models";
            put("accuracy_matrix_clients", title, heat_map(title, &matrix, row_label, col_label))?;
            local = Some(matrix);
        }
    }

    let clients = rows.as_deref().map_or(!summary.continual.local_matrix.is_empty(), accuracy::has_clients);
    let doc = Doc {
        summary: &summary,
        ledger: &ledger,
        info: &info,
        tasks,
        clients,
        global: global.as_deref(),
        local: local.as_deref(),
        plots: &plots,
    };
    let path = dir.join("report.md");
    std::fs::write(&path, markdown(&doc)).with_context(|| format!("writing {}", path.display()))?;
    files.push(path);
    Ok(files)
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

/// `report.md`: the status, a summary table, the continual-learning metrics (more than one
/// task), the task accuracy matrices, every plot, and the rounds.
fn markdown(doc: &Doc) -> String {
    let Doc { summary, ledger, info, .. } = doc;
    let mut md = String::from("# Run report\n\n");
    let _ = writeln!(md, "**Status:** {}.\n", info.status_text(summary));
    let total = |f: &dyn Fn(&CostRecord) -> u64| ledger.iter().map(f).sum::<u64>();
    let _ = writeln!(md, "| | |\n|---|---|");
    if let Some(method) = &info.method {
        let _ = writeln!(md, "| method | {method} |");
    }
    if let Some(clients) = info.clients {
        let _ = writeln!(md, "| clients | {clients} |");
    }
    if summary.final_accuracy.is_finite() {
        let _ = writeln!(
            md,
            "| final accuracy | {:.2}% (initial {}, chance {:.0}%) |",
            summary.final_accuracy * 100.0,
            percent(Some(summary.initial_accuracy)).unwrap_or_else(|| "– (no global model yet)".into()),
            summary.chance * 100.0
        );
    } else {
        let _ = writeln!(md, "| final accuracy | not measured (a server's state folder) |");
    }
    if let Some(best) =
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
    if info.method_is("fedprok") {
        let e = &summary.efficiency;
        let _ = writeln!(
            md,
            "| FedProK efficiency E = (τ1 + τ2) / R | {:.3} s per round (τ1 compute {:.1} s, τ2 transfer {:.1} s, R = {}) |",
            e.seconds_per_round, e.compute_seconds, e.transfer_seconds, e.rounds
        );
    }
    let _ = writeln!(md, "| late updates / refused | {} / {} |", summary.late_updates, summary.refused);
    let _ = writeln!(md, "| wall time of the run | {:.1} s |", summary.wall_seconds);
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

    if doc.tasks > 1 {
        continual_section(&mut md, doc);
    }
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

    if !doc.plots.is_empty() {
        md.push_str("\n## Plots\n\nEach plot is also an SVG of the same name.\n");
        for plot in doc.plots {
            let _ = writeln!(md, "\n### {}\n\n![{}]({}.png)", plot.title, plot.title, plot.stem);
        }
    }

    let _ = writeln!(
        md,
        "\n## Rounds\n\n| round | accuracy | updates | dropped | up wire | down wire | seconds | mean compute s | mean transfer s | mean wait s |\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in &summary.rounds {
        let costs: Vec<&CostRecord> = ledger.iter().filter(|c| c.round == r.round).collect();
        let m = |f: &dyn Fn(&CostRecord) -> f64| mean(costs.iter().map(|c| f(c)));
        let _ = writeln!(
            md,
            "| {} | {:.2}% | {}/{} | {} | {} | {} | {:.2} | {:.3} | {:.3} | {:.3} |",
            r.round,
            r.accuracy * 100.0,
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
    md
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
    use crate::record::SummaryInputs;

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
        assert!(md.contains("| method | fedprok |") && md.contains("| clients | 3 |"), "{md}");
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
        assert!(md.contains("| method | fedavg |"), "no [method]: the default: {md}");
        assert!(md.contains("| forgetting (best earlier − final, old tasks) | 30.00% |"), "{md}");
        assert!(!md.contains("A^loc") && !md.contains("KR_s"), "{md}");
    }
}
