//! `anchorage sim --seeds N`: the same configuration over N seeds, each run an ordinary run
//! folder, and mean ± sample std per metric in sweep.json and sweep.md. Runs the `anchorage`
//! binary.

mod common;

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use common::{anchorage, config, deterministic, json};

fn ok(output: Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    stdout
}

fn close(a: f64, b: f64) {
    assert!((a - b).abs() < 1e-12, "{a} vs {b}");
}

#[test]
fn three_seeds_give_three_runs_and_their_mean_and_std() {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let args = ["sim", "--seeds", "3", "--clock", "virtual", "--rounds", "2", "--clients", "2", "--out", "S"];
    let stdout = ok(anchorage(dir.path(), &args).output().unwrap());
    eprintln!("sweep of 3 seeds: {:.1} s wall\n{stdout}", started.elapsed().as_secs_f64());
    let sweep_dir = dir.path().join("S");

    let mut finals = Vec::new();
    for (i, seed) in [7u64, 8, 9].into_iter().enumerate() {
        let run = sweep_dir.join(format!("seed-{seed}"));
        let m = json(&run.join("metrics.json"));
        assert_eq!(m["status"], "finished", "{m}");
        assert_eq!(m["rounds"].as_array().unwrap().len(), 2);
        assert_eq!(config(&run)["seed"].as_integer(), Some(seed as i64), "seed-{seed}/config.toml");
        assert!(run.join("report.md").is_file());
        assert!(
            stdout.contains(&format!("seed {seed} ({} of 3): finished", i + 1)),
            "one line per finished seed:\n{stdout}"
        );
        finals.push(m["final_accuracy"].as_f64().unwrap());
    }

    // The statistics, computed here from the runs' metrics.json.
    let mean = finals.iter().sum::<f64>() / 3.0;
    let std = (finals.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 2.0).sqrt();
    let s = json(&sweep_dir.join("sweep.json"));
    assert_eq!(s["complete"], true, "{s}");
    assert_eq!(s["finished_seeds"], serde_json::json!([7, 8, 9]));
    let f = &s["metrics"]["final_accuracy"];
    assert_eq!(f["n"], 3);
    assert_eq!(f["seeds"], serde_json::json!([7, 8, 9]));
    for (v, expected) in f["values"].as_array().unwrap().iter().zip(&finals) {
        close(v.as_f64().unwrap(), *expected);
    }
    close(f["mean"].as_f64().unwrap(), mean);
    close(f["std"].as_f64().unwrap(), std);
    assert!(std > 0.0, "three seeds, three different accuracies: {finals:?}");
    for key in ["best_accuracy", "mean_upload_payload", "upload_wire_ratio", "wall_seconds", "simulated_seconds"] {
        assert_eq!(s["metrics"][key]["n"], 3, "{key} in {s}");
    }
    // One task: the continual-learning metrics that repeat the final accuracy are not listed.
    assert!(s["metrics"].get("continual.forgetting").is_none() && s["metrics"].get("continual.plasticity").is_none());

    let md = std::fs::read_to_string(sweep_dir.join("sweep.md")).unwrap();
    assert!(md.contains("| metric | mean ± std | per seed (7, 8, 9) |"), "{md}");
    let percent = |v: f64| format!("{:.2}%", v * 100.0);
    let row = format!("| final accuracy | {} ± {} |", percent(mean), percent(std));
    assert!(md.contains(&row), "{row} in\n{md}");
    assert!(stdout.contains("3 of 3 seeds finished") && stdout.contains("±"), "the table at the end:\n{stdout}");

    // Run 0 is the run without --seeds.
    let single = ["sim", "--clock", "virtual", "--rounds", "2", "--clients", "2", "--quiet", "--out", "single"];
    ok(anchorage(dir.path(), &single).output().unwrap());
    assert_eq!(
        deterministic(json(&dir.path().join("single/metrics.json"))),
        deterministic(json(&sweep_dir.join("seed-7/metrics.json")))
    );

    // `anchorage compare S/seed-*` reads the seed folders.
    let compare = ok(anchorage(dir.path(), &["compare", "S/seed-7", "S/seed-8", "S/seed-9"]).output().unwrap());
    let header = compare.lines().next().unwrap_or_default();
    assert!(["seed-7", "seed-8", "seed-9"].iter().all(|s| header.contains(s)), "{compare}");
    assert!(sweep_dir.join("compare_accuracy.png").is_file());
}

#[test]
fn fewer_than_two_seeds_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for n in ["1", "0"] {
        let out = anchorage(dir.path(), &["sim", "--seeds", n, "--clock", "virtual", "--out", "S"]).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "clap refuses --seeds {n}: {stderr}");
        assert!(stderr.contains("--seeds") && stderr.contains("at least 2"), "{stderr}");
        assert!(!dir.path().join("S").exists(), "nothing runs");
    }
    // --keep-data-seed without a [data] table has no seed to keep.
    let out = anchorage(dir.path(), &["sim", "--seeds", "2", "--keep-data-seed", "--out", "S"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no [data] table"));
    assert!(!dir.path().join("S").exists(), "nothing runs");
}

#[test]
fn a_scenarios_data_seed_moves_with_the_run_seed_unless_kept() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("s.toml"),
        "[scenario]\nname = \"t\"\n[federation]\nclients = 2\nrounds = 1\nlocal_epochs = 1\nseed = 3\n\
         [method]\nname = \"fedavg\"\n[data]\ndataset = \"synthetic\"\nseed = 1\n\
         [data.synthetic]\nclasses = 4\nside = 8\ntrain_per_class = 20\ntest_per_class = 5\n\
         [data.partition]\nkind = \"dirichlet\"\nalpha = 0.5\nclients = 2\n",
    )
    .unwrap();
    let seeds = |out: &str| -> Vec<(i64, i64)> {
        [3, 4]
            .iter()
            .map(|s| {
                let c = config(&dir.path().join(out).join(format!("seed-{s}")));
                (c["seed"].as_integer().unwrap(), c["data"]["seed"].as_integer().unwrap())
            })
            .collect()
    };
    let run = |extra: &[&str]| {
        let mut args = vec!["sim", "s.toml", "--seeds", "2", "--clock", "virtual", "--quiet"];
        args.extend(extra);
        ok(anchorage(dir.path(), &args).output().unwrap())
    };
    run(&["--out", "varied"]);
    assert_eq!(seeds("varied"), [(3, 1), (4, 2)]);
    assert_eq!(json(&dir.path().join("varied/sweep.json"))["data_seed"], "varied");
    run(&["--keep-data-seed", "--out", "kept"]);
    assert_eq!(seeds("kept"), [(3, 1), (4, 1)]);
    assert_eq!(json(&dir.path().join("kept/sweep.json"))["data_seed"], "fixed");
}

#[test]
fn sigint_stops_the_sweep_and_the_summary_covers_the_finished_seeds() {
    let dir = tempfile::tempdir().unwrap();
    let args =
        ["sim", "--seeds", "3", "--clock", "virtual", "--rounds", "20", "--clients", "2", "--quiet", "--out", "S"];
    let mut child = anchorage(dir.path(), &args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    // Seed 7 finishes; interrupt seed 8 once two of its rounds closed.
    let rounds = dir.path().join("S/seed-8/rounds.csv");
    let rows = || std::fs::read_to_string(&rounds).map_or(0, |t| t.lines().count().saturating_sub(1));
    let deadline = Instant::now() + Duration::from_secs(180);
    while rows() < 2 {
        assert!(Instant::now() < deadline, "seed 8 did not reach two rounds in 180 s");
        assert!(child.try_wait().unwrap().is_none(), "the sweep ended before it was interrupted");
        std::thread::sleep(Duration::from_millis(100));
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(120);
    let code = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status.code().unwrap_or(-1);
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("still running 120 s after SIGINT");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = child.wait_with_output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert_eq!(code, 130, "exit status of an interrupted sweep; stderr: {stderr}");
    assert!(stderr.contains("status interrupted"), "{stderr}");

    let sweep_dir = dir.path().join("S");
    assert_eq!(json(&sweep_dir.join("seed-7/metrics.json"))["status"], "finished");
    let m8 = json(&sweep_dir.join("seed-8/metrics.json"));
    assert_eq!(m8["status"], "interrupted");
    let stopped_after = m8["rounds"].as_array().unwrap().len();
    assert!((2..20).contains(&stopped_after), "seed 8 stopped after the round in flight: {stopped_after} rounds");
    assert!(!sweep_dir.join("seed-9").exists(), "no seed starts after the interrupt");

    let s = json(&sweep_dir.join("sweep.json"));
    assert_eq!(s["complete"], false);
    assert_eq!(s["finished_seeds"], serde_json::json!([7]));
    assert_eq!(s["runs"][1]["status"], "interrupted");
    assert!(s["stop_reason"].as_str().unwrap().contains("interrupted"), "{s}");
    let f = &s["metrics"]["final_accuracy"];
    assert_eq!((f["n"].as_u64(), f["std"].is_null()), (Some(1), true), "one finished seed, no std: {f}");
    close(
        f["mean"].as_f64().unwrap(),
        json(&sweep_dir.join("seed-7/metrics.json"))["final_accuracy"].as_f64().unwrap(),
    );
    let md = std::fs::read_to_string(sweep_dir.join("sweep.md")).unwrap();
    assert!(md.contains("1 of 3 seeds finished") && md.contains("finished seeds only"), "{md}");
    assert!(md.contains(" ± – |"), "the std of one seed is a dash:\n{md}");
    assert!(stdout.contains("finished seeds only"), "{stdout}");
    eprintln!("SIGINT during seed 8: stopped after {stopped_after} rounds, exit 130\n{stdout}\n{stderr}");
}
