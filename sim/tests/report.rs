//! `anchorage report`: a run folder in, SVG plots and a Markdown summary out.

use std::path::Path;

use anchorage_sim::network::LinkPreset;
use anchorage_sim::report::write_report;
use anchorage_sim::virtual_clock::run_virtual;
use anchorage_sim::{DataConfig, FederationConfig, SystemsConfig};
use anchorage_sim::{SimConfig, write_run_folder};

/// Runs `config` on the virtual clock and writes its run folder into `dir`.
fn run_into(dir: &Path, config: &SimConfig) -> anchorage_sim::SimResult {
    let result = run_virtual(config).unwrap();
    write_run_folder(dir, &toml::to_string_pretty(config).unwrap(), &result.summary, &result.ledger, &result.accuracy)
        .unwrap();
    result
}

/// Three class-incremental tasks of two rounds on a small synthetic set, with `method`.
fn three_tasks(method: &str) -> SimConfig {
    toml::from_str(&format!(
        r#"
clients = 3
rounds = 6
rounds_per_task = 2
local_epochs = 1
seed = 4
[method]
name = "{method}"
[model]
backbone = "embedded"
hidden = [16]
[data]
dataset = "synthetic"
seed = 5
[data.synthetic]
classes = 6
side = 16
train_per_class = 20
test_per_class = 5
[data.partition]
kind = "iid"
clients = 3
tasks = 3
"#
    ))
    .expect("a valid SimConfig")
}

#[test]
fn a_run_folder_gets_plots_and_a_summary() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let config = SimConfig {
        federation: FederationConfig { clients: 3, rounds: 2, seed: 4, local_epochs: 1, ..Default::default() },
        data: DataConfig { train_per_class: 20, test_per_class: 5, ..Default::default() },
        systems: SystemsConfig { link: Some(LinkPreset::Wifi), ..Default::default() },
        ..SimConfig::default()
    };
    let result = run_into(dir, &config);
    let files = write_report(dir).unwrap();
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
    assert!(!svg.contains("task-boundary"), "one task: no boundary");
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(md.contains("| 1 |") && md.contains("| 2 |"), "{md}");
    assert!(md.contains(&format!("{:.2}%", result.summary.final_accuracy * 100.0)));
    assert!(md.contains("**Status:** finished (2 of 2 rounds)."), "{md}");
    // Every plot it wrote is embedded.
    for png in names.iter().filter(|n| n.ends_with(".png")) {
        assert!(md.contains(&format!("]({png})")), "{png} not embedded in {md}");
    }
    // FedAvg over one task: no FedProK row, no continual-learning metrics.
    assert!(md.contains("| method | fedavg (McMahan et al. 2017) |"), "{md}");
    assert!(!md.contains("FedProK efficiency"), "{md}");
    assert!(!md.contains("## Continual learning") && !md.contains("forgetting"), "{md}");
}

#[test]
fn a_continual_fedprok_run_gets_its_metrics_and_boundaries() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let result = run_into(dir, &three_tasks("fedprok"));
    assert_eq!(result.summary.rounds.len(), 6);
    let files = write_report(dir).unwrap();
    let md = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        md.contains("| method | fedprok (FedProK (Gao et al.)) |")
            && md.contains("| FedProK efficiency E = (τ1 + τ2) / R |"),
        "{md}"
    );
    assert!(md.contains("## Continual learning\n\nOver 3 tasks"), "{md}");
    let c = &result.summary.continual;
    let forgetting =
        format!("| forgetting (best earlier − final, old tasks) | {:.2}% |", c.forgetting.unwrap() * 100.0);
    assert!(md.contains(&forgetting), "{forgetting} not in {md}");
    assert!(md.contains("| stability") && md.contains("| plasticity") && md.contains("| A^loc"), "{md}");
    assert!(md.contains("## Task accuracy matrix (global model)"), "{md}");
    for png in files.iter().filter(|f| f.extension().is_some_and(|e| e == "png")) {
        let name = png.file_name().unwrap().to_string_lossy();
        assert!(md.contains(&format!("]({name})")), "{name} not embedded in {md}");
    }
    assert!(md.contains("![Task accuracy (%): global model](accuracy_matrix.png)"), "{md}");
    // Tasks 1 and 2 start with rounds 3 and 5.
    for chart in ["accuracy_by_round.svg", "accuracy_by_time.svg"] {
        let svg = std::fs::read_to_string(dir.join(chart)).unwrap();
        assert_eq!(svg.matches(r#"class="task-boundary""#).count(), 2, "{chart}");
        assert!(svg.contains(">task 1<") && svg.contains(">task 2<"), "{chart}");
    }
}

#[test]
fn a_folder_that_is_not_a_run_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let err = format!("{:#}", write_report(dir).unwrap_err());
    assert!(err.contains("metrics.json") && err.contains("run folder"), "{err}");
    std::fs::write(dir.join("metrics.json"), "{not json").unwrap();
    std::fs::write(dir.join("ledger.json"), "[]").unwrap();
    assert!(format!("{:#}", write_report(dir).unwrap_err()).contains("parsing metrics.json"));
}
