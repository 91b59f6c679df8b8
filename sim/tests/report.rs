//! `anchorage report`: a run folder in, SVG plots and a Markdown summary out.

use anchorage_sim::report::write_report;
use anchorage_sim::virtual_clock::run_virtual;
use anchorage_sim::{SimConfig, write_run_folder};

#[test]
fn a_run_folder_gets_plots_and_a_summary() {
    let dir = std::env::temp_dir().join(format!("anchorage-report-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = SimConfig {
        clients: 3,
        rounds: 2,
        seed: 4,
        local_epochs: 1,
        train_per_class: 20,
        test_per_class: 5,
        link: Some("wifi".into()),
        ..SimConfig::default()
    };
    let result = run_virtual(&config).unwrap();
    write_run_folder(
        &dir,
        &toml::to_string_pretty(&config).unwrap(),
        &result.summary,
        &result.ledger,
        &result.accuracy,
    )
    .unwrap();
    let files = write_report(&dir).unwrap();
    let names: Vec<String> = files.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect();
    for expected in [
        "accuracy_by_round.svg",
        "accuracy_by_time.svg",
        "bytes_per_round.svg",
        "round_time_breakdown.svg",
        "round_time_cdf.svg",
        "report.md",
    ] {
        assert!(names.iter().any(|n| n == expected), "{expected} missing from {names:?}");
    }
    for png in ["accuracy_by_round.png", "round_time_cdf.png"] {
        let bytes = std::fs::read(dir.join(png)).unwrap();
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 5_000, "{png}: {} bytes", bytes.len());
    }
    let svg = std::fs::read_to_string(dir.join("accuracy_by_round.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<polyline"));
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(md.contains("| 1 |") && md.contains("| 2 |"), "{md}");
    assert!(md.contains(&format!("{:.2}%", result.summary.final_accuracy * 100.0)));
}

#[test]
fn a_folder_that_is_not_a_run_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("anchorage-not-a-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = format!("{:#}", write_report(&dir).unwrap_err());
    assert!(err.contains("metrics.json") && err.contains("run folder"), "{err}");
    std::fs::write(dir.join("metrics.json"), "{not json").unwrap();
    std::fs::write(dir.join("ledger.json"), "[]").unwrap();
    assert!(format!("{:#}", write_report(&dir).unwrap_err()).contains("parsing metrics.json"));
}
