//! `anchorage report <state_dir>` on a server's state folder: the
//! status says whether the rounds the server was set to run finished, both accuracies are shown
//! and labelled, each round's outcome says who was invited and who is missing, the report goes
//! to `--out` or a new folder outside the state folder (never into it), and a 100-round report
//! labels its x axes. Builds the state folder with the server's own store, then runs the binary.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anchorage_server::engine::{
    Checkpoint, EngineStats, OpenedRound, Persist, RoundOutcome, RoundReport, UpdateReport,
};
use anchorage_server::store::ServerStore;
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use common::anchorage;

const DEVICES: [&str; 3] = ["edge-001", "edge-002", "edge-003"];

fn checkpoint(round: u64) -> Checkpoint {
    Checkpoint {
        round,
        method: "fedavg".into(),
        global: vec![ParamBlock::encode("head.bias", &[2], &[0.5, round as f32], Encoding::F32)],
        stats: EngineStats::default(),
        method_state: vec![],
        prototypes: vec![],
    }
}

/// An update of `client` with its own evaluation `accuracy` over `samples` samples.
fn update(client: &str, samples: u64, accuracy: f64) -> UpdateReport {
    UpdateReport {
        client: client.into(),
        num_samples: samples,
        payload_up: 40_000,
        prototypes: 0,
        compute_seconds: 0.5,
        arrived_after: Duration::from_millis(800),
        metrics: vec![("train_loss".into(), 0.3), ("local_accuracy".into(), accuracy)],
    }
}

/// A state folder `site/state` of `rounds` closed rounds of three invited devices (target 2):
/// edge-001 (100 samples) and edge-002 (300 samples) report, edge-003 never does; round 7 fails
/// at its deadline with one update; every tenth round carries the server's held-out accuracy.
/// Then round `rounds + 1` opens when `open_after` (with one accepted update).
fn state_folder(site: &Path, rounds: u64, open_after: bool) -> PathBuf {
    let state = site.join("state");
    let store = ServerStore::open(&state).unwrap();
    store.save_initial(&checkpoint(0)).unwrap();
    let invited: Vec<String> = DEVICES.iter().map(|d| d.to_string()).collect();
    for round in 1..=rounds {
        let opened = OpenedRound { round, task: 0, target: 2, sampled: invited.clone() };
        store.commit(&Persist::Opened(opened)).unwrap();
        let acc = 0.5 + 0.004 * round as f64;
        let failed = round == 7;
        let updates = if failed {
            vec![update("edge-001", 100, acc)]
        } else {
            vec![update("edge-001", 100, acc), update("edge-002", 300, acc + 0.1)]
        };
        let mut missing = vec!["edge-003".to_string()];
        if failed {
            missing.insert(0, "edge-002".into());
        }
        let report = RoundReport {
            round,
            outcome: if failed {
                RoundOutcome::Failed { reason: "deadline passed with 1 of 2 updates".into() }
            } else {
                RoundOutcome::Aggregated
            },
            sampled: 3,
            target: 2,
            updates,
            missing,
            declined: Vec::new(),
            duplicates: 0,
            refused: 0,
            late_total: 0,
            payload_down: 40_000,
            started: Duration::from_secs(10 * round),
            closed: Duration::from_secs(10 * round + 2),
            influence: Default::default(),
            held_out_accuracy: (round % 10 == 0).then_some(0.45 + 0.004 * round as f64),
            privacy: None,
            secagg: None,
        };
        store.commit(&Persist::Closed { checkpoint: Arc::new(checkpoint(round)), report: Arc::new(report) }).unwrap();
        let costs: Vec<CostRecord> = ["edge-001", "edge-002"]
            .iter()
            .map(|c| CostRecord {
                client: c.to_string(),
                round,
                payload_down: 40_000,
                payload_up: 40_000,
                wire_down: 41_000 + round,
                wire_up: 41_500,
                compute_seconds: 0.5,
                transfer_seconds: 0.2,
                wait_seconds: 1.0,
                wall_seconds: 1.7,
                ..CostRecord::default()
            })
            .collect();
        store.append_ledger(&costs).unwrap();
    }
    if open_after {
        let round = rounds + 1;
        store.commit(&Persist::Opened(OpenedRound { round, task: 0, target: 2, sampled: invited })).unwrap();
    }
    drop(store);
    state
}

/// Every file in `dir` with its size and modification time.
fn listing(dir: &Path) -> BTreeMap<String, (u64, SystemTime)> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let m = e.metadata().unwrap();
            (e.file_name().to_string_lossy().into_owned(), (m.len(), m.modified().unwrap()))
        })
        .collect()
}

/// Asserts that the report wrote nothing into the state folder: every file is as it was. (A
/// read-only SQLite connection to a WAL database whose server stopped makes the empty `-wal` and
/// `-shm` files SQLite itself needs, owned like the database even under sudo: those may appear.)
fn untouched(state: &Path, before: &BTreeMap<String, (u64, SystemTime)>) {
    let mut after = listing(state);
    for sqlite in ["anchorage.db-wal", "anchorage.db-shm"] {
        if !before.contains_key(sqlite) {
            after.remove(sqlite);
        }
    }
    assert_eq!(&after, before, "nothing written into the state folder");
}

/// `anchorage report ARGS` in `dir`: (exit code, stdout, stderr).
fn report(dir: &Path, args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["report"];
    all.extend(args);
    let out = anchorage(dir, &all).output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

#[test]
fn a_finished_server_run_is_reported_outside_its_state_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let site = tmp.path().join("site");
    std::fs::create_dir(&site).unwrap();
    std::fs::write(site.join("server.toml"), "state_dir = \"state\"\n[engine]\nrounds = 100\n").unwrap();
    let state = state_folder(&site, 100, false);
    let before = listing(&state);

    // `sudo anchorage report /var/lib/anchorage-server`, from the operator's home folder.
    let home = tmp.path().join("home");
    std::fs::create_dir(&home).unwrap();
    let (code, stdout, stderr) = report(&home, &[state.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    untouched(&state, &before);
    let folders: Vec<PathBuf> = std::fs::read_dir(&home).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(folders.len(), 1, "{folders:?}");
    let out = &folders[0];
    let name = out.file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("report-state-") && name.contains('T'), "{name}");
    assert!(stdout.lines().all(|l| l.starts_with(out.to_str().unwrap())), "{stdout}");
    assert!(!stderr.contains("WARN"), "no warnings: {stderr}");

    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    println!("{md}");
    let status = md.lines().find(|l| l.starts_with("**Status:**")).unwrap();
    assert!(status.starts_with("**Status:** finished (100 of 100 rounds); last commit at "), "{status}");
    assert!(!md.contains("running, or stopped without a word") && !md.contains("NaN"), "{md}");
    assert!(md.contains("rounds set in") && md.contains("server.toml"), "{md}");
    // Round 100: (100 × 0.9 + 300 × 1.0) / 400 = 97.50%; the server's held-out set 85.00%.
    assert!(
        md.contains("| device accuracy (their own evaluation) | 97.50% (round 100, 2 devices, weighted by samples) |"),
        "{md}"
    );
    assert!(md.contains("| held-out accuracy (server) | 85.00% (round 100) |"), "{md}");
    assert!(md.contains("| rounds failed / invitations unanswered | 1 / 101 |"), "{md}");
    assert!(
        md.contains("| 1 | aggregated | 3: edge-001, edge-002, edge-003 | 2/2 | 1: edge-003 | 57.90% (2 of 2) | – |"),
        "round 1: (100 × 0.504 + 300 × 0.604) / 400: {md}"
    );
    assert!(md.contains("| 7 | failed: deadline passed with 1 of 2 updates | 3: edge-001, edge-002, edge-003 | 1/2 | 2: edge-002, edge-003 |"), "{md}");
    assert!(md.contains("| 10 | aggregated |") && md.contains("| 49.00% |"), "held-out in round 10: {md}");
    assert!(md.contains("### Failed rounds\n\n- round 7: failed: deadline passed with 1 of 2 updates"), "{md}");
    assert!(md.contains("![Accuracy by round](accuracy_by_round.png)"), "{md}");
    let accuracy = std::fs::read_to_string(out.join("accuracy_by_round.svg")).unwrap();
    assert!(
        accuracy.contains(">device accuracy (their own evaluation)<")
            && accuracy.contains(">held-out accuracy (server)<")
    );

    // A 100-round report labels its x axes (rounds 20, 40, … on lines; 10, 20, … under bars).
    for chart in ["bytes_per_round.svg", "round_time_breakdown.svg", "accuracy_by_round.svg"] {
        let svg = std::fs::read_to_string(out.join(chart)).unwrap();
        let ticks = svg.matches(r#"class="x-tick""#).count();
        assert!((4..=12).contains(&ticks), "{chart}: {ticks} x labels");
        assert!(svg.contains(">100</text>") || svg.contains(">40</text>"), "{chart}");
    }

    // Never into the state folder, whatever is asked; and not from inside it by default.
    let inside = state.join("report");
    let (code, _, stderr) = report(&home, &[state.to_str().unwrap(), "--out", inside.to_str().unwrap(), "--force"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("inside a server's state folder") && !inside.exists(), "{stderr}");
    let (code, _, stderr) = report(&state, &["."]);
    assert_ne!(code, 0);
    assert!(stderr.contains("give --out"), "{stderr}");
    untouched(&state, &before);

    // --out: a new folder; again into it (the same state folder's report); not into a run.
    let chosen = tmp.path().join("chosen");
    for _ in 0..2 {
        let (code, _, stderr) = report(&home, &[state.to_str().unwrap(), "--out", chosen.to_str().unwrap()]);
        assert_eq!(code, 0, "{stderr}");
    }
    std::fs::write(home.join("metrics.json"), "{}").unwrap();
    let (code, _, stderr) = report(tmp.path(), &[state.to_str().unwrap(), "--out", "home"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("already holds another run") && stderr.contains("--force"), "{stderr}");
}

#[test]
fn a_server_run_that_stopped_early_or_still_runs_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let site = tmp.path().join("site");
    let state = state_folder(&site, 12, true);
    let config = tmp.path().join("elsewhere.toml");
    std::fs::write(&config, "state_dir = \"/var/lib/anchorage-server\"\n[engine]\nrounds = 20\n").unwrap();
    let out = tmp.path().join("out");
    let args = [state.to_str().unwrap(), "--config", config.to_str().unwrap(), "--out", out.to_str().unwrap()];
    let (code, _, stderr) = report(tmp.path(), &args);
    assert_eq!(code, 0, "{stderr}");
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    let status = md.lines().find(|l| l.starts_with("**Status:**")).unwrap();
    assert!(
        status.starts_with("**Status:** stopped without finishing: last round 12 of 20 (round 13 open, 0 updates accepted); last commit at "),
        "{status}"
    );
    assert!(md.contains("state_dir is /var/lib/anchorage-server, not this folder"), "{md}");
    assert!(md.contains("Round 13 was open at the last commit"), "{md}");

    // A server holds the folder (this process, through the store's lock).
    let store = ServerStore::open(&state).unwrap();
    let (code, _, stderr) = report(tmp.path(), &[state.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert_eq!(code, 0, "{stderr}");
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    let status = md.lines().find(|l| l.starts_with("**Status:**")).unwrap();
    let pid = format!("a server (pid {}) holds the folder", std::process::id());
    assert!(status.contains("last round 12") && status.contains(&pid) && status.contains("give --config"), "{status}");
    drop(store);
}
