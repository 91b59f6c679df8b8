//! Run folders of runs that did not write their final record: a second Ctrl-C
//! quits at once but marks the folder `interrupted` first, and `anchorage report` and `anchorage
//! compare` read such a folder (and one left by `kill -9`, still saying `running`) from the
//! tables the run appended round by round. Runs the `anchorage` binary.

mod common;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use common::{anchorage, metrics, wait};

/// Data rows of a CSV file (the header excluded).
fn csv_rows(path: &Path) -> usize {
    std::fs::read_to_string(path).map_or(0, |t| t.lines().count().saturating_sub(1))
}

/// Starts a long run into `dir/run` and waits until `rounds` rounds are in its rounds.csv.
fn start(dir: &Path, clock: &str, link: &str, rounds: usize) -> Child {
    let args = ["sim", "--clock", clock, "--link", link, "--rounds", "300", "--clients", "2", "--out", "run"];
    let mut child = anchorage(dir, &args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let table = dir.join("run/rounds.csv");
    let deadline = Instant::now() + Duration::from_secs(120);
    while csv_rows(&table) < rounds {
        assert!(Instant::now() < deadline, "no {rounds} rounds in rounds.csv after 120 s");
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

fn stderr_of(child: &mut Child) -> String {
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    stderr
}

/// `anchorage report run` in `dir`, which must succeed; report.md's status line.
fn report_status(dir: &Path) -> (String, String) {
    let out = anchorage(dir, &["report", "run"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "anchorage report: {stderr}");
    assert!(!stderr.contains("WARN"), "{stderr}");
    let md = std::fs::read_to_string(dir.join("run/report.md")).unwrap();
    let status = md.lines().find(|l| l.starts_with("**Status:**")).unwrap().to_string();
    (status, md)
}

#[test]
fn a_second_ctrl_c_quits_at_once_and_leaves_a_truthful_reportable_folder() {
    let dir = tempfile::tempdir().unwrap();
    // LTE: a round's upload takes about two seconds, so the second Ctrl-C lands in the round
    // the first asked to finish.
    let mut child = start(dir.path(), "real", "lte", 1);
    let pid = child.id() as i32;
    unsafe { libc::kill(pid, libc::SIGINT) };
    std::thread::sleep(Duration::from_millis(300));
    unsafe { libc::kill(pid, libc::SIGINT) };
    let code = wait(&mut child);
    let stderr = stderr_of(&mut child);
    assert_eq!(code, 130, "{stderr}");
    assert!(stderr.contains("SIGINT again: quit at once; run folder run says interrupted after"), "{stderr}");
    let run = dir.path().join("run");
    assert!(!run.join("ledger.json").exists(), "it quit before writing its final record");
    let m = metrics(&run);
    assert_eq!(m["status"], "interrupted", "not `running` forever: {m}");
    assert!(m["stop_reason"].as_str().unwrap().starts_with("SIGINT twice: quit at once"), "{m}");
    let rounds = csv_rows(&run.join("rounds.csv"));
    assert_eq!(m["rounds"].as_array().unwrap().len(), rounds, "every round rounds.csv holds: {m}");

    let (status, md) = report_status(dir.path());
    assert_eq!(
        status,
        format!(
            "**Status:** interrupted after round {rounds} (SIGINT twice: quit at once; the round in flight was lost, and the tables end at the last round that closed)."
        )
    );
    assert!(md.contains("read from rounds.csv, ledger.csv and accuracy.csv"), "{md}");
    assert!(md.contains(&format!("| rounds | {rounds} |")), "{md}");
    assert!(dir.path().join("run/accuracy_by_round.png").is_file());
}

#[test]
fn a_killed_run_is_reported_as_stopped_without_finishing() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = start(dir.path(), "virtual", "wifi", 2);
    child.kill().unwrap(); // SIGKILL: nothing runs after it
    wait(&mut child);
    let run = dir.path().join("run");
    assert_eq!(metrics(&run)["status"], "running");
    let rounds = csv_rows(&run.join("rounds.csv"));
    let (status, md) = report_status(dir.path());
    let expected = format!("**Status:** stopped without finishing (or still running): last round {rounds} of 300 at ");
    assert!(status.starts_with(&expected) && status.ends_with(" UTC."), "{status}");
    assert!(md.contains("metrics.json still says `running`"), "{md}");

    // `anchorage compare` reads it too.
    let out = anchorage(dir.path(), &["compare", "run", "--out", "cmp"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find(|l| l.starts_with("status")).unwrap();
    assert!(line.ends_with("unfinished"), "{stdout}");
    let line = stdout.lines().find(|l| l.starts_with("rounds completed")).unwrap();
    assert!(line.ends_with(&format!("{rounds} of 300")), "{stdout}");
}
