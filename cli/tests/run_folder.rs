//! The run folder as a researcher meets it: written from the first round, readable after Ctrl-C
//! or a closed pipe (`status = "interrupted"`), and its `config.toml` runs the same federation
//! again with the same metrics. Runs the `anchorage` binary.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{anchorage, deterministic, metrics, wait};

/// Data rows of a CSV file (the header excluded).
fn csv_rows(path: &Path) -> usize {
    let mut reader = csv::Reader::from_path(path).unwrap();
    reader.records().inspect(|r| assert!(r.is_ok(), "{r:?}")).count()
}

/// A long run, small enough per round that two rounds pass quickly.
fn long(clock: &str) -> Vec<&str> {
    vec!["sim", "--clock", clock, "--rounds", "300", "--clients", "2", "--out", "run"]
}

/// Asserts a readable folder of a run stopped after `rounds` ≥ 1 rounds.
fn interrupted_folder(run: &Path) -> u64 {
    let m = metrics(run);
    assert_eq!(m["status"], "interrupted", "{m}");
    let rounds = m["rounds"].as_array().unwrap().len();
    assert!((1..300).contains(&rounds), "stopped after {rounds} rounds");
    assert_eq!(csv_rows(&run.join("rounds.csv")), rounds, "rounds.csv holds every round metrics.json has");
    assert!(csv_rows(&run.join("ledger.csv")) >= rounds, "one cost record per client and round at least");
    assert!(run.join("report.md").is_file() && run.join("accuracy_by_round.png").is_file());
    let config: toml::Table = toml::from_str(&std::fs::read_to_string(run.join("config.toml")).unwrap()).unwrap();
    assert_eq!(config["rounds"].as_integer(), Some(300));
    rounds as u64
}

#[test]
fn sigint_finishes_the_round_in_flight_and_leaves_an_interrupted_folder() {
    for clock in ["virtual", "real"] {
        interrupt(clock);
    }
}

fn interrupt(clock: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut child = anchorage(dir.path(), &long(clock)).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    // The folder exists from the start; wait for two rounds in it.
    let rounds = dir.path().join("run/rounds.csv");
    let deadline = Instant::now() + Duration::from_secs(90);
    while !(rounds.exists() && csv_rows(&rounds) >= 2) {
        assert!(Instant::now() < deadline, "no two rounds in rounds.csv after 90 s");
        assert!(child.try_wait().unwrap().is_none(), "the run ended before it was interrupted");
        std::thread::sleep(Duration::from_millis(100));
    }
    let running = metrics(&dir.path().join("run"));
    assert_eq!(running["status"], "running", "{running}");
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let code = wait(&mut child);
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(code, 130, "exit status of an interrupted run; stderr: {stderr}");
    assert!(stderr.contains("status interrupted"), "{stderr}");
    let rounds = interrupted_folder(&dir.path().join("run"));
    eprintln!("SIGINT on the {clock} clock: stopped after {rounds} rounds, exit 130; stderr:\n{stderr}");
}

#[test]
fn a_closed_stdout_stops_the_run_without_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    // `anchorage sim ... | head -1`
    let mut child =
        anchorage(dir.path(), &long("virtual")).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    assert!(first.starts_with("run folder: run"), "the first line says where the run goes: {first}");
    // The reader is dropped here: the pipe is closed.
    let code = wait(&mut child);
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(code, 141, "exit status after a closed stdout; stderr: {stderr}");
    let m = metrics(&dir.path().join("run"));
    assert_eq!(m["stop_reason"], "stdout closed", "{m}");
    interrupted_folder(&dir.path().join("run"));
}

#[test]
fn a_run_folders_config_reproduces_its_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let first = anchorage(
        dir.path(),
        &[
            "sim",
            "--clock",
            "virtual",
            "--rounds",
            "3",
            "--clients",
            "3",
            "--seed",
            "5",
            "--optimizer",
            "sgd",
            "--lr",
            "0.05",
            "--batch-size",
            "16",
            "--eval-every",
            "2",
            "--eval-fraction",
            "0.5",
            "--alpha",
            "0.3",
            "--quiet",
            "--out",
            "a",
        ],
    )
    .output()
    .unwrap();
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let quiet = String::from_utf8_lossy(&first.stdout);
    assert_eq!(quiet.lines().count(), 2, "--quiet prints the folder and the summary only:\n{quiet}");
    let config = std::fs::read_to_string(dir.path().join("a/config.toml")).unwrap();
    for line in ["clock = \"virtual\"", "optimizer = \"sgd\"", "batch_size = 16", "eval_every = 2", "seed = 5"] {
        assert!(config.contains(line), "config.toml lacks `{line}`:\n{config}");
    }
    assert!(!config.contains("data_dir") && !config.contains("kill"), "unused keys in:\n{config}");
    let again = anchorage(dir.path(), &["sim", "a/config.toml", "--quiet", "--out", "b"]).output().unwrap();
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    let (a, b) = (metrics(&dir.path().join("a")), metrics(&dir.path().join("b")));
    assert_eq!(a["status"], "finished");
    assert_eq!(a["local_eval"]["every"], 2);
    assert_eq!(deterministic(a), deterministic(b), "the same configuration, the same metrics");
    let read = |run: &str| std::fs::read_to_string(dir.path().join(run).join("accuracy.csv")).unwrap();
    assert_eq!(read("a"), read("b"));
}

#[test]
fn a_scenario_runs_config_has_no_embedded_data_keys() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("s.toml"),
        "[scenario]\nname = \"t\"\n[federation]\nclients = 2\nrounds = 1\nlocal_epochs = 1\n\
         [method]\nname = \"fedavg\"\n[data]\ndataset = \"synthetic\"\nseed = 1\n\
         [data.synthetic]\nclasses = 4\nside = 8\ntrain_per_class = 20\ntest_per_class = 5\n\
         [data.partition]\nkind = \"iid\"\nclients = 2\n",
    )
    .unwrap();
    let out =
        anchorage(dir.path(), &["sim", "s.toml", "--clock", "virtual", "--quiet", "--out", "r"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let config: toml::Table =
        toml::from_str(&std::fs::read_to_string(dir.path().join("r/config.toml")).unwrap()).unwrap();
    for key in ["alpha", "noise", "train_per_class", "test_per_class", "target_domains", "kill"] {
        assert!(!config.contains_key(key), "config.toml records the unused `{key}`");
    }
    assert!(config.contains_key("data") && config.contains_key("threads"));
}

#[test]
fn json_progress_is_one_object_per_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = anchorage(
        dir.path(),
        &["sim", "--clock", "virtual", "--rounds", "2", "--clients", "2", "--json", "--out", "r"],
    )
    .output()
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let events: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l}: {e}")))
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["start", "round", "round", "finished"]);
    assert_eq!(events[1]["round"], 1);
    assert!(events[2]["simulated_seconds"].as_f64().unwrap() > 0.0);
    assert_eq!(events[3]["status"], "finished");
    assert_eq!(events[0]["run_folder"], "r");
}
