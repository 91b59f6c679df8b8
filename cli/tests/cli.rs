//! `anchorage sim` as a user runs it: flags are range-checked and named values are refused before
//! any run folder exists, a flag overrides its scenario key and says so, an empty environment
//! variable counts as unset.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// What a finished `anchorage` printed.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

/// Runs `anchorage` in `dir` (killed after two minutes: a run that should have been refused).
fn anchorage(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Run {
    let logs = tempfile::tempdir().unwrap();
    let (out, err) = (logs.path().join("stdout"), logs.path().join("stderr"));
    let mut command = Command::new(env!("CARGO_BIN_EXE_anchorage"));
    command.args(args).current_dir(dir).env_remove("ANCHORAGE_DATA").env_remove("ANCHORAGE_LOG");
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("`anchorage {}` still running after 120 s", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let read = |p: &Path| std::fs::read_to_string(p).unwrap();
    Run { code: status.code().unwrap_or(-1), stdout: read(&out), stderr: read(&err) }
}

/// Asserts a refusal: exit code ≠ 0, the error mentions `needle`, and nothing was written in `dir`.
fn refused(dir: &Path, run: &Run, needle: &str) {
    assert_ne!(run.code, 0, "stdout: {}\nstderr: {}", run.stdout, run.stderr);
    assert!(run.stderr.contains(needle), "expected `{needle}` in: {}", run.stderr);
    let left: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(left.is_empty(), "a refused run left {left:?}");
}

/// A small scenario: synthetic data, 2 clients, a Dirichlet split with α = 0.5, 3 rounds.
const SCENARIO: &str = r#"
[scenario]
name = "tiny"

[method]
name = "fedavg"

[federation]
clients = 2
rounds = 3
local_epochs = 1

[data]
dataset = "synthetic"
seed = 1

[data.synthetic]
classes = 4
side = 8
train_per_class = 40
test_per_class = 10

[data.partition]
kind = "dirichlet"
clients = 2
alpha = 0.5
"#;

#[test]
fn zero_rounds_is_refused_before_a_run_folder_exists() {
    let dir = tempfile::tempdir().unwrap();
    let run = anchorage(dir.path(), &["sim", "--rounds", "0"], &[]);
    refused(dir.path(), &run, "--rounds");
}

#[test]
fn stragglers_outside_zero_to_one_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let run = anchorage(dir.path(), &["sim", "--stragglers", "1.5"], &[]);
    refused(dir.path(), &run, "--stragglers");
    let run = anchorage(dir.path(), &["sim", "--epochs", "0"], &[]);
    refused(dir.path(), &run, "--epochs");
}

#[test]
fn a_typo_in_method_lists_the_methods_and_makes_no_folder() {
    let dir = tempfile::tempdir().unwrap();
    let run = anchorage(dir.path(), &["sim", "--method", "fedavgg"], &[]);
    refused(dir.path(), &run, "fedavgg");
    let known: Vec<&str> = anchorage_shared::method::names().collect();
    assert!(run.stderr.contains(&known.join(", ")), "every registered method listed: {}", run.stderr);
    let run = anchorage(dir.path(), &["sim", "--device", "jetson"], &[]);
    refused(dir.path(), &run, "jetson-orin");
}

#[test]
fn a_flag_overrides_its_scenario_key_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("scenario.toml");
    std::fs::write(&scenario, SCENARIO).unwrap();
    let run = anchorage(
        dir.path(),
        &["sim", "scenario.toml", "--alpha", "0.01", "--rounds", "1", "--clock", "virtual", "--out", "run"],
        &[],
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stdout.contains("--alpha 0.01 overrides [data.partition] alpha = 0.5 from scenario.toml"),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains("--rounds 1 overrides [federation] rounds = 3"), "{}", run.stdout);
    let config: toml::Table =
        toml::from_str(&std::fs::read_to_string(dir.path().join("run/config.toml")).unwrap()).unwrap();
    assert_eq!(config["data"]["partition"]["alpha"].as_float(), Some(0.01));
    assert_eq!(config["rounds"].as_integer(), Some(1));
    assert_eq!(config["clock"].as_str(), Some("virtual"));
}

#[test]
fn clients_set_the_scenario_split_too() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("scenario.toml"), SCENARIO).unwrap();
    let args = ["sim", "scenario.toml", "--clients", "1", "--rounds", "1", "--clock", "virtual", "--out", "run"];
    let run = anchorage(dir.path(), &args, &[]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.contains("--clients 1 overrides [data.partition] clients = 2"), "{}", run.stdout);
}

#[test]
fn a_scenario_key_out_of_range_names_the_key_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let files = tempfile::tempdir().unwrap();
    let scenario = files.path().join("zero.toml");
    std::fs::write(&scenario, SCENARIO.replace("rounds = 3", "rounds = 0")).unwrap();
    let run = anchorage(dir.path(), &["sim", scenario.to_str().unwrap()], &[]);
    refused(dir.path(), &run, "[federation] rounds = 0 in");
    assert!(run.stderr.contains("zero.toml"), "{}", run.stderr);
}

#[test]
fn an_empty_anchorage_data_runs_like_unset() {
    let dir = tempfile::tempdir().unwrap();
    let run = anchorage(
        dir.path(),
        &["sim", "--rounds", "1", "--clock", "virtual", "--out", "run"],
        &[("ANCHORAGE_DATA", ""), ("ANCHORAGE_LOG", "")],
    );
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(dir.path().join("run/metrics.json").is_file());
}

#[test]
fn a_missing_data_dir_is_an_error_only_when_files_are_needed() {
    let dir = tempfile::tempdir().unwrap();
    let scenario = dir.path().join("cifar.toml");
    std::fs::write(
        &scenario,
        "[scenario]\n[data]\ndataset = \"cifar10\"\n[data.partition]\nkind = \"iid\"\nclients = 4\n",
    )
    .unwrap();
    let run = anchorage(dir.path(), &["sim", "cifar.toml", "--data-dir", "/nonexistent", "--out", "run"], &[]);
    assert_ne!(run.code, 0);
    assert!(run.stderr.contains("--data-dir") && run.stderr.contains("ANCHORAGE_DATA"), "{}", run.stderr);
    assert!(!dir.path().join("run").exists());
    let args = ["sim", "--data-dir", "/nonexistent", "--rounds", "1", "--clock", "virtual", "--out", "run"];
    let run = anchorage(dir.path(), &args, &[]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stderr.contains("warning: --data-dir"), "{}", run.stderr);
}

/// Issue 31: a 1-round run printed four `usvg` warnings (a chart of one point) even with
/// `--quiet`. A quiet run that succeeds prints nothing on stderr, and its report's plots exist.
#[test]
fn a_quiet_one_round_run_says_nothing_on_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let run = anchorage(dir.path(), &["sim", "--quiet", "--rounds", "1", "--clients", "2", "--out", "one"], &[]);
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    assert!(run.stderr.trim().is_empty(), "stderr of a quiet run: {}", run.stderr);
    let report = anchorage(dir.path(), &["report", "one", "--out", "one-report"], &[]);
    assert_eq!(report.code, 0, "{}{}", report.stdout, report.stderr);
    assert!(!report.stderr.contains("usvg") && !report.stderr.to_lowercase().contains("warn"), "{}", report.stderr);
    assert!(dir.path().join("one-report/accuracy_by_round.png").exists());
}
