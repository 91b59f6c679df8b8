//! `anchorage compare`: two run folders side by side, as a function and as the binary.

use std::path::{Path, PathBuf};
use std::process::Command;

use anchorage_sim::compare::compare;
use anchorage_sim::virtual_clock::run_virtual;
use anchorage_sim::{DataConfig, FederationConfig};
use anchorage_sim::{RunSummary, SimConfig, write_run_folder};

/// A small run with `seed`, written into `dir`.
fn run_into(dir: &Path, seed: u64) -> RunSummary {
    let config = SimConfig {
        federation: FederationConfig { clients: 3, rounds: 2, seed, local_epochs: 1, ..Default::default() },
        data: DataConfig { train_per_class: 20, test_per_class: 5, ..Default::default() },
        ..SimConfig::default()
    };
    let result = run_virtual(&config).unwrap();
    write_run_folder(dir, &toml::to_string_pretty(&config).unwrap(), &result.summary, &result.ledger, &result.accuracy)
        .unwrap();
    result.summary
}

fn two_runs(tmp: &Path) -> (Vec<PathBuf>, Vec<RunSummary>) {
    let dirs = vec![tmp.join("runs").join("seed-1"), tmp.join("runs").join("seed-2")];
    let summaries = dirs.iter().zip([1, 2]).map(|(d, seed)| run_into(d, seed)).collect();
    (dirs, summaries)
}

fn check_table(table: &str, summaries: &[RunSummary]) {
    let header = table.lines().next().unwrap();
    assert!(header.contains("seed-1") && header.contains("seed-2"), "{table}");
    let finals = table.lines().find(|l| l.starts_with("final accuracy")).unwrap();
    for s in summaries {
        assert!(finals.contains(&format!("{:.2}%", s.final_accuracy * 100.0)), "{finals}");
    }
    for row in ["method", "clients", "rounds completed", "status", "best accuracy", "initial accuracy", "wall seconds"]
    {
        assert!(table.lines().any(|l| l.starts_with(row)), "{row} missing from\n{table}");
    }
    assert!(table.lines().any(|l| l.starts_with("status") && l.matches("finished").count() == 2), "{table}");
    assert!(table.lines().any(|l| l.starts_with("rounds completed") && l.matches("2 of 2").count() == 2), "{table}");
}

#[test]
fn two_runs_side_by_side() {
    let tmp = tempfile::tempdir().unwrap();
    let (dirs, summaries) = two_runs(tmp.path());
    let out = tmp.path().join("out");
    let c = compare(&dirs, Some(&out)).unwrap();
    check_table(&c.table, &summaries);
    assert_eq!((c.svg.clone(), c.png.clone()), (out.join("compare_accuracy.svg"), out.join("compare_accuracy.png")));
    let svg = std::fs::read_to_string(&c.svg).unwrap();
    assert_eq!(svg.matches("<polyline").count(), 2, "one line per run");
    assert!(svg.contains(">seed-1<") && svg.contains(">seed-2<"), "a legend by folder name");
    assert!(std::fs::read(&c.png).unwrap().starts_with(b"\x89PNG\r\n\x1a\n"));
    // Without --out: the first run's parent folder.
    let c = compare(&dirs, None).unwrap();
    assert_eq!(c.svg, tmp.path().join("runs").join("compare_accuracy.svg"));
    // A folder that is not a run is refused by name, whatever comes with it.
    let stray = tmp.path().join("not-a-run");
    std::fs::create_dir_all(&stray).unwrap();
    let err = format!("{:#}", compare(&[dirs[0].clone(), stray.clone()], None).err().unwrap());
    assert!(err.contains("not-a-run") && err.contains("not a run folder"), "{err}");
}

#[test]
fn the_binary_prints_the_table_and_the_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let (dirs, summaries) = two_runs(tmp.path());
    let out = tmp.path().join("charts");
    let output = Command::new(env!("CARGO_BIN_EXE_anchorage"))
        .arg("compare")
        .args(&dirs)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    check_table(&stdout, &summaries);
    for file in ["compare_accuracy.svg", "compare_accuracy.png"] {
        let path = out.join(file);
        assert!(stdout.contains(&path.display().to_string()) && path.is_file(), "{file}: {stdout}");
    }
    let output = Command::new(env!("CARGO_BIN_EXE_anchorage")).arg("compare").arg(tmp.path()).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("not a run folder"), "{stderr}");
    let output = Command::new(env!("CARGO_BIN_EXE_anchorage")).arg("compare").output().unwrap();
    assert!(!output.status.success(), "no run folder: a usage error");
}
