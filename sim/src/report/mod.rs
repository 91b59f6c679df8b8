//! `anchorage report <run-folder>`: plots and a Markdown summary from a run folder's
//! `metrics.json` and `ledger.json` (written by both clocks). Charts are SVG and PNG.

mod png;
mod svg;

use std::fmt::Write;
use std::path::{Path, PathBuf};

use anchorage_shared::ledger::CostRecord;
use anyhow::Context;

use crate::record::{RunSummary, human_bytes};
use svg::{Series, line_chart, stacked_bars};

/// Reads a run folder's summary and ledger.
pub fn load(dir: &Path) -> anyhow::Result<(RunSummary, Vec<CostRecord>)> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path)
            .with_context(|| format!("reading {} (is {} a run folder?)", path.display(), dir.display()))
    };
    let summary: RunSummary = serde_json::from_str(&read("metrics.json")?).context("parsing metrics.json")?;
    let ledger: Vec<CostRecord> = serde_json::from_str(&read("ledger.json")?).context("parsing ledger.json")?;
    Ok((summary, ledger))
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

    let initial = (0.0, summary.initial_accuracy * 100.0);
    let accuracy: Vec<(f64, f64)> =
        std::iter::once(initial).chain(summary.rounds.iter().map(|r| (r.round as f64, r.accuracy * 100.0))).collect();
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

    let per_client = |f: &dyn Fn(&CostRecord) -> u64| -> Vec<(f64, f64)> {
        rounds.iter().map(|&r| (r as f64, mean(by_round(r).map(|c| f(c) as f64)) / 1e6)).collect()
    };
    let max_up: Vec<(f64, f64)> =
        rounds.iter().map(|&r| (r as f64, by_round(r).map(|c| c.wire_up).max().unwrap_or(0) as f64 / 1e6)).collect();
    put(
        "bytes_per_round.svg",
        line_chart(
            "Bytes per client per round",
            "round",
            "MB",
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

    put("report.md", markdown(&summary, &ledger))?;
    Ok(files)
}

fn markdown(summary: &RunSummary, ledger: &[CostRecord]) -> String {
    let mut md = String::from("# Run report\n\n");
    let total = |f: &dyn Fn(&CostRecord) -> u64| ledger.iter().map(f).sum::<u64>();
    let _ = writeln!(md, "| | |\n|---|---|");
    let _ = writeln!(
        md,
        "| final accuracy | {:.2}% (initial {:.2}%, chance {:.0}%) |",
        summary.final_accuracy * 100.0,
        summary.initial_accuracy * 100.0,
        summary.chance * 100.0
    );
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
    let _ = writeln!(md, "| late updates / refused | {} / {} |", summary.late_updates, summary.refused);
    let _ = writeln!(md, "| wall time of the run | {:.1} s |", summary.wall_seconds);
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
    md.push_str("\nPlots (SVG and PNG): `accuracy_by_round`, `accuracy_by_time`, `bytes_per_round`, `round_time_breakdown`, `round_time_cdf`.\n");
    md
}
