//! `anchorage report <run-folder>`: plots and a Markdown summary from a run folder's
//! `metrics.json` and `ledger.json` (written by both clocks), and the task accuracy matrix from
//! `accuracy.csv` when a continual run wrote one. Charts are SVG and PNG.

mod accuracy;
mod png;
mod svg;

pub use accuracy::{
    AccuracyRow, CLIENTS_MEAN, FILE as ACCURACY_FILE, HEADER as ACCURACY_HEADER, SELECTED_MEAN, SELECTED_PREFIX,
    accuracy_matrix, final_average, load_accuracy,
};

use std::fmt::Write;
use std::path::{Path, PathBuf};

use anchorage_shared::ledger::CostRecord;
use anyhow::Context;

use crate::record::{RoundRow, RunSummary, SummaryInputs, human_bytes};
use svg::{Series, heat_map, line_chart, stacked_bars};

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
    Ok((RunSummary::new(inputs, rows, &ledger, &[]), ledger))
}

fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 { 0.0 } else { sum / n as f64 }
}

/// Writes the plots and `report.md` into `dir`; returns the files written.
pub fn write_report(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let (summary, ledger) = load(dir)?;
    let rounds: Vec<u64> = summary.rounds.iter().map(|r| r.round).collect();
    let by_round = |round: u64| ledger.iter().filter(move |c| c.round == round);
    let mut files = Vec::new();
    // Every chart is written as SVG and as PNG.
    let mut put = |name: &str, text: String| -> anyhow::Result<()> {
        let path = dir.join(name);
        std::fs::write(&path, &text).with_context(|| format!("writing {}", path.display()))?;
        if path.extension().is_some_and(|e| e == "svg") {
            let png = path.with_extension("png");
            png::write_png(&text, &png)?;
            files.push(png);
        }
        files.push(path);
        Ok(())
    };

    // A server's state folder has no accuracy (the server does not evaluate): no accuracy charts.
    let evaluated = summary.initial_accuracy.is_finite();
    let initial = (0.0, summary.initial_accuracy * 100.0);
    if evaluated {
        let accuracy: Vec<(f64, f64)> = std::iter::once(initial)
            .chain(summary.rounds.iter().map(|r| (r.round as f64, r.accuracy * 100.0)))
            .collect();
        put(
            "accuracy_by_round.svg",
            line_chart(
                "Global accuracy by round",
                "round",
                "accuracy (%)",
                &[Series { name: "global".into(), points: accuracy }],
                Some((0.0, 100.0)),
            ),
        )?;

        let mut clock = 0.0;
        let mut by_time = vec![initial];
        for r in &summary.rounds {
            clock += r.seconds;
            by_time.push((clock, r.accuracy * 100.0));
        }
        put(
            "accuracy_by_time.svg",
            line_chart(
                "Global accuracy over time",
                "seconds (sum of round durations)",
                "accuracy (%)",
                &[Series { name: "global".into(), points: by_time }],
                Some((0.0, 100.0)),
            ),
        )?;
    }

    const MIB: f64 = 1024.0 * 1024.0;
    let per_client = |f: &dyn Fn(&CostRecord) -> u64| -> Vec<(f64, f64)> {
        rounds.iter().map(|&r| (r as f64, mean(by_round(r).map(|c| f(c) as f64)) / MIB)).collect()
    };
    let max_up: Vec<(f64, f64)> =
        rounds.iter().map(|&r| (r as f64, by_round(r).map(|c| c.wire_up).max().unwrap_or(0) as f64 / MIB)).collect();
    put(
        "bytes_per_round.svg",
        line_chart(
            "Bytes per client per round",
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
    put(
        "round_time_breakdown.svg",
        stacked_bars(
            "Where a client's round goes (mean over clients)",
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
    put(
        "round_time_cdf.svg",
        line_chart(
            "CDF of client round times",
            "seconds from broadcast to ack",
            "fraction of client-rounds",
            &[Series { name: "clients".into(), points: cdf }],
            Some((0.0, 1.0)),
        ),
    )?;

    // The task accuracy matrix: the global model, and the mean of the clients' local models.
    let (mut global, mut matrices) = (None, Vec::new());
    if let Some(rows) = load_accuracy(dir)? {
        let (row_label, col_label) = ("after task t", "test task k");
        if rows.iter().any(|r| r.model == "global") {
            let matrix = accuracy_matrix(&rows, "global");
            put("accuracy_matrix.svg", heat_map("Task accuracy (%): global model", &matrix, row_label, col_label))?;
            global = Some(matrix);
            matrices.push("accuracy_matrix");
        }
        if accuracy::has_clients(&rows) {
            let matrix = accuracy_matrix(&rows, CLIENTS_MEAN);
            let title = "Task accuracy (%): mean of the clients' local models";
            put("accuracy_matrix_clients.svg", heat_map(title, &matrix, row_label, col_label))?;
            matrices.push("accuracy_matrix_clients");
        }
    }

    put("report.md", markdown(&summary, &ledger, global.as_deref(), &matrices))?;
    Ok(files)
}

/// `tasks`: the global task accuracy matrix; `more_plots`: plots besides the usual five.
fn markdown(
    summary: &RunSummary,
    ledger: &[CostRecord],
    tasks: Option<&[Vec<Option<f64>>]>,
    more_plots: &[&str],
) -> String {
    let mut md = String::from("# Run report\n\n");
    let total = |f: &dyn Fn(&CostRecord) -> u64| ledger.iter().map(f).sum::<u64>();
    let _ = writeln!(md, "| | |\n|---|---|");
    if summary.initial_accuracy.is_finite() {
        let _ = writeln!(
            md,
            "| final accuracy | {:.2}% (initial {:.2}%, chance {:.0}%) |",
            summary.final_accuracy * 100.0,
            summary.initial_accuracy * 100.0,
            summary.chance * 100.0
        );
    } else {
        let _ = writeln!(md, "| final accuracy | not measured (a server's state folder) |");
    }
    let _ = writeln!(md, "| rounds | {} |", summary.rounds.len());
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
    let _ = writeln!(
        md,
        "| mean wire / payload per upload | {} |",
        summary.upload_wire_ratio.map(|r| format!("{r:.4}")).unwrap_or_else(|| "-".into())
    );
    let _ = writeln!(md, "| energy (estimate) | {:.1} J |", ledger.iter().map(|c| c.joules).sum::<f64>());
    let e = &summary.efficiency;
    let _ = writeln!(
        md,
        "| efficiency E = (τ1 + τ2) / R (FedProK) | {:.3} s per round (τ1 compute {:.1} s, τ2 transfer {:.1} s, R = {}) |",
        e.seconds_per_round, e.compute_seconds, e.transfer_seconds, e.rounds
    );
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
    if let Some(matrix) = tasks {
        let _ = writeln!(
            md,
            "\n## Task accuracy matrix (global model)\n\nAccuracy on each test task at the last round of each task (from `accuracy.csv`).\n"
        );
        md.push_str(&accuracy::markdown_table(matrix));
        if let Some(avg) = accuracy::final_average(matrix) {
            let _ = writeln!(md, "\nAverage accuracy after the last task: {:.2}%.", avg * 100.0);
        }
    }
    md.push_str("\nPlots (SVG and PNG): `accuracy_by_round`, `accuracy_by_time`, `bytes_per_round`, `round_time_breakdown`, `round_time_cdf`");
    for name in more_plots {
        let _ = write!(md, ", `{name}`");
    }
    md.push_str(".\n");
    md
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::SummaryInputs;

    #[test]
    fn a_run_with_accuracy_csv_gets_heat_maps_and_a_table() {
        let dir = std::env::temp_dir().join(format!("anchorage-report-matrix-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let inputs = SummaryInputs {
            initial_accuracy: 0.1,
            chance: 0.1,
            late_updates: 0,
            refused: 0,
            decode_errors: 0,
            wall_seconds: 1.0,
            local_eval: Default::default(),
        };
        let summary = RunSummary::new(inputs, Vec::new(), &[], &[]);
        std::fs::write(dir.join("metrics.json"), serde_json::to_string(&summary).unwrap()).unwrap();
        std::fs::write(dir.join("ledger.json"), "[]").unwrap();
        let without = write_report(&dir).unwrap();
        assert!(!without.iter().any(|f| f.to_string_lossy().contains("accuracy_matrix")), "no csv, no matrix");
        // Four tasks of three rounds; every model is tested on the tasks seen so far, and forgets.
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
        std::fs::write(dir.join(accuracy::FILE), csv + "\n").unwrap();
        let files = write_report(&dir).unwrap();
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
        let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
        assert!(md.contains("## Task accuracy matrix (global model)"), "{md}");
        assert!(md.contains("| 0 | 92.0% | – | – | – |") && md.contains("| 3 | 47.0% |"), "{md}");
        assert!(md.contains("`accuracy_matrix`, `accuracy_matrix_clients`."), "{md}");
        std::fs::write(dir.join(accuracy::FILE), format!("{}\n1,0,global,0,2.5\n", accuracy::HEADER)).unwrap();
        let err = format!("{:#}", write_report(&dir).unwrap_err());
        assert!(err.contains("accuracy.csv:2: accuracy 2.5 is outside [0, 1]"), "{err}");
    }
}
