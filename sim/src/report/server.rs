//! A server's state folder as a report reads it: the closed rounds' reports and the ledger from
//! `anchorage.db` (read-only, without the running server's lock), where the rounds stand from
//! the store's generation witness (`anchorage.generation`: the newest round, whether it closed),
//! whether a server holds the folder (its `anchorage.lock`), and how many rounds the server was
//! set to run (`[engine] rounds` of its server.toml). Nothing is ever written into the folder.

use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anchorage_server::RoundReport;
use anchorage_server::engine::RoundOutcome;
use anchorage_server::store::{self, Witness};
use anchorage_shared::ledger::CostRecord;
use anyhow::Context;

use super::run_info::RunInfo;
use super::source::{Kind, Source, modified, utc};
use crate::record::{RoundRow, RunStatus, RunSummary, SummaryInputs};

/// Where the server's own config file usually is (the systemd unit's `--config`).
const SYSTEM_CONFIG: &str = "/etc/anchorage/server.toml";

/// Whether a server process holds a state folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    /// A process holds the folder's lock (a server runs on it).
    Running { pid: Option<u32> },
    /// No process holds it: the server is stopped.
    Stopped,
    /// This system does not tell (no `/proc/locks`).
    Unknown,
}

/// A state folder's rounds and where the federation stands.
#[derive(Debug, Clone)]
pub struct ServerRun {
    /// The closed rounds' reports, in order.
    pub reports: Vec<RoundReport>,
    /// `[engine] rounds` of the server's config (0: until stopped), and that file.
    pub configured: Option<(u64, PathBuf)>,
    /// The store's newest round and whether it closed.
    pub witness: Option<Witness>,
    /// When the store last committed (its witness, else the database, was last written).
    pub last_commit: Option<SystemTime>,
    pub holder: Holder,
}

/// Reads a server's state folder; `config`: its server.toml (default: one beside the folder, or
/// /etc/anchorage/server.toml, whose `state_dir` is this folder).
pub(super) fn read(dir: &Path, config: Option<&Path>) -> anyhow::Result<Source> {
    let db = dir.join(store::DB_FILE);
    let ledger = store::read_ledger(&db)?;
    let reports = store::read_round_reports(&db)?;
    let mut notes = Vec::new();
    let configured = configured_rounds(dir, config, &mut notes)?;
    let witness = store::read_witness(dir).unwrap_or_else(|e| {
        notes.push(format!("The store's generation witness could not be read ({e})."));
        None
    });
    let last_commit = [store::WITNESS_FILE, store::WAL_FILE, store::DB_FILE]
        .iter()
        .filter_map(|name| modified(&dir.join(name)))
        .max();
    let run = ServerRun { reports, configured, witness, last_commit, holder: holder(dir) };

    let rows: Vec<RoundRow> = run
        .reports
        .iter()
        .map(|r| {
            let costs: Vec<CostRecord> = ledger.iter().filter(|c| c.round == r.round).cloned().collect();
            RoundRow::from_report(r, r.held_out_accuracy.unwrap_or(f64::NAN), &costs)
        })
        .collect();
    let inputs = SummaryInputs {
        initial_accuracy: f64::NAN,
        chance: f64::NAN,
        late_updates: run.reports.last().map_or(0, |r| r.late_total),
        refused: run.reports.iter().map(|r| r.refused).sum(),
        decode_errors: 0,
        wall_seconds: rows.iter().map(|r| r.seconds).sum(),
        local_eval: Default::default(),
        privacy: crate::record::PrivacySpent::of(run.reports.iter()),
    };
    let mut summary = RunSummary::new(inputs, rows, &ledger, &[]);
    summary.status = if run.finished() { RunStatus::Finished } else { RunStatus::Running };
    let info = RunInfo { rounds: run.configured.as_ref().map(|(r, _)| *r), ..RunInfo::default() };
    Ok(Source {
        dir: dir.to_path_buf(),
        kind: Kind::StateFolder,
        summary,
        ledger,
        accuracy: None,
        info,
        status: run.status_text(),
        has_metrics: false,
        notes,
        server: Some(run),
    })
}

/// `[engine] rounds` of the server's config: the file given, or the first of server.toml beside
/// the folder and /etc/anchorage/server.toml whose `state_dir` is this folder.
fn configured_rounds(
    dir: &Path,
    given: Option<&Path>,
    notes: &mut Vec<String>,
) -> anyhow::Result<Option<(u64, PathBuf)>> {
    let here = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    if let Some(path) = given {
        let (rounds, state_dir) = read_config(path)?;
        if state_dir.as_deref().and_then(|s| std::fs::canonicalize(s).ok()).is_none_or(|s| s != here) {
            notes.push(format!(
                "{}'s state_dir is {}, not this folder; its [engine] rounds is taken all the same.",
                path.display(),
                state_dir.map_or_else(|| "not set".into(), |s| s.display().to_string())
            ));
        }
        return Ok(Some((rounds, path.to_path_buf())));
    }
    let beside = here.parent().map(|p| p.join("server.toml"));
    for path in beside.into_iter().chain([PathBuf::from(SYSTEM_CONFIG)]) {
        let Ok((rounds, Some(state_dir))) = read_config(&path) else { continue };
        if std::fs::canonicalize(&state_dir).is_ok_and(|s| s == here) {
            return Ok(Some((rounds, path)));
        }
    }
    Ok(None)
}

/// A server.toml's `[engine] rounds` (the server's default when left out) and its `state_dir`
/// (relative to the file's folder), read loosely: the rest of the file is the server's business.
fn read_config(path: &Path) -> anyhow::Result<(u64, Option<PathBuf>)> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let table: toml::Table = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let rounds = match table.get("engine").and_then(|e| e.get("rounds")) {
        None => anchorage_server::EngineConfig::default().rounds,
        Some(v) => v
            .as_integer()
            .and_then(|r| u64::try_from(r).ok())
            .with_context(|| format!("{}: [engine] rounds = {v} is not a number of rounds", path.display()))?,
    };
    let base = path.parent().unwrap_or(Path::new(""));
    let state_dir = table.get("state_dir").and_then(toml::Value::as_str).map(|s| base.join(s));
    Ok((rounds, state_dir))
}

/// Whether a process holds the folder's lock, from the kernel's table of file locks (the lock
/// file is only looked at: taking it, even for a moment, could stop a server that starts then).
fn holder(dir: &Path) -> Holder {
    use std::os::unix::fs::MetadataExt;
    let Ok(lock) = std::fs::metadata(dir.join(store::LOCK_FILE)) else { return Holder::Stopped };
    let Ok(locks) = std::fs::read_to_string("/proc/locks") else { return Holder::Unknown };
    held_in(&locks, lock.ino()).map_or(Holder::Stopped, |pid| Holder::Running { pid })
}

/// The holder's pid (`None`: not given) when `/proc/locks` lists a lock on inode `ino`:
/// `1: FLOCK  ADVISORY  WRITE 1234 00:2f:5678 0 EOF` (waiters, `1: -> FLOCK ...`, are not holders).
fn held_in(locks: &str, ino: u64) -> Option<Option<u32>> {
    locks.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.get(1) == Some(&"->") || fields.len() < 6 {
            return None;
        }
        let file_ino = fields[5].rsplit(':').next()?.parse::<u64>().ok()?;
        (file_ino == ino).then(|| fields[4].parse::<u32>().ok().filter(|p| *p > 0))
    })
}

impl ServerRun {
    /// The last closed round's number.
    fn last_round(&self) -> Option<u64> {
        self.reports.last().map(|r| r.round)
    }

    /// Whether the rounds the server was set to run have all closed.
    pub fn finished(&self) -> bool {
        matches!((self.configured.as_ref(), self.last_round()), (Some((r, _)), Some(last)) if *r > 0 && last >= *r)
    }

    /// The round the store opened after the last closed one, and its accepted updates.
    fn open_round(&self) -> Option<Witness> {
        self.witness.filter(|w| !w.closed && self.last_round().is_none_or(|last| w.round > last))
    }

    /// Where the federation stands, in words.
    pub fn status_text(&self) -> String {
        let at = self.last_commit.map(|t| format!("; last commit at {}", utc(t))).unwrap_or_default();
        let last = match self.last_round() {
            Some(last) => format!("last round {last}"),
            None => "no round closed".into(),
        };
        let open = self
            .open_round()
            .map(|w| format!(" (round {} open, {} updates accepted)", w.round, w.updates))
            .unwrap_or_default();
        let holder = match self.holder {
            Holder::Running { pid: Some(pid) } => format!("a server (pid {pid}) holds the folder"),
            Holder::Running { pid: None } => "a server holds the folder".into(),
            Holder::Stopped => "no server holds the folder".into(),
            Holder::Unknown => "whether a server holds the folder is unknown".into(),
        };
        let running = matches!(self.holder, Holder::Running { .. });
        match &self.configured {
            Some((rounds, _)) if self.finished() => {
                let still = if running { format!("; {holder}, idle") } else { String::new() };
                format!("finished ({rounds} of {rounds} rounds){at}{still}")
            }
            Some((0, from)) => format!(
                "{} ({} runs until stopped: rounds = 0): {last}{open}{at}",
                if running { "running" } else { "stopped" },
                from.display()
            ),
            Some((rounds, _)) if running => format!("running: {last} of {rounds}{open}{at}"),
            Some((rounds, _)) if self.holder == Holder::Stopped => {
                format!("stopped without finishing: {last} of {rounds}{open}{at}")
            }
            Some((rounds, _)) => format!("not finished: {last} of {rounds}{open}{at} ({holder})"),
            None => format!(
                "{last}{open}{at}; {holder}. Whether that is every round the server was set to run is in its \
                 server.toml ([engine] rounds): give --config"
            ),
        }
    }

    /// The summary table's lines about the model's quality: the devices' own evaluation and the
    /// server's on its held-out set, at the last round that has each.
    pub fn accuracy_lines(&self, md: &mut String) {
        let device = self.reports.iter().rev().find_map(|r| Some((r.round, r.device_accuracy()?)));
        match device {
            Some((round, (acc, n))) => {
                let _ = writeln!(
                    md,
                    "| device accuracy (their own evaluation) | {:.2}% (round {round}, {n} devices, weighted by samples) |",
                    acc * 100.0
                );
            }
            None => {
                let _ = writeln!(md, "| device accuracy (their own evaluation) | not reported by any update |");
            }
        }
        match self.reports.iter().rev().find_map(|r| Some((r.round, r.held_out_accuracy?))) {
            Some((round, acc)) => {
                let _ = writeln!(md, "| held-out accuracy (server) | {:.2}% (round {round}) |", acc * 100.0);
            }
            None => {
                let _ = writeln!(md, "| held-out accuracy (server) | not evaluated (no [evaluation] in server.toml) |");
            }
        }
        let failed = self.reports.iter().filter(|r| matches!(r.outcome, RoundOutcome::Failed { .. })).count();
        let missing: usize = self.reports.iter().map(|r| r.missing.len()).sum();
        let _ = writeln!(md, "| rounds failed / invitations unanswered | {failed} / {missing} |");
    }

    /// `## Rounds`: per round its outcome, who was invited, who is missing, both accuracies,
    /// bytes and seconds; then why rounds failed.
    pub fn rounds_section(&self, md: &mut String, summary: &RunSummary) {
        let _ = writeln!(
            md,
            "\n## Rounds\n\nDevice accuracy is the devices' own evaluation of the model they trained (the sample-weighted \
             mean of their updates' `local_accuracy`); held-out accuracy is the server's evaluation of the new global \
             model on the operator's held-out set.\n\n\
             | round | outcome | invited | updates / target | missing | device accuracy (their own evaluation) | \
             held-out accuracy (server) | up wire | down wire | seconds |\n\
             |---:|---|---|---:|---|---:|---:|---:|---:|---:|"
        );
        for (r, row) in self.reports.iter().zip(&summary.rounds) {
            let device = r
                .device_accuracy()
                .map_or_else(|| "–".into(), |(a, n)| format!("{:.2}% ({n} of {})", a * 100.0, r.updates.len()));
            let held_out = r.held_out_accuracy.map_or_else(|| "–".into(), |a| format!("{:.2}%", a * 100.0));
            let missing =
                if r.missing.is_empty() { "0".into() } else { format!("{}: {}", r.missing.len(), names(&r.missing)) };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {}/{} | {missing} | {device} | {held_out} | {} | {} | {:.2} |",
                r.round,
                outcome(r),
                invited(r),
                r.updates.len(),
                r.target,
                crate::record::human_bytes(row.wire_up),
                crate::record::human_bytes(row.wire_down),
                row.seconds
            );
        }
        let failed: Vec<&RoundReport> =
            self.reports.iter().filter(|r| matches!(r.outcome, RoundOutcome::Failed { .. })).collect();
        if !failed.is_empty() {
            let _ = writeln!(md, "\n### Failed rounds\n");
            for r in failed {
                let _ = writeln!(
                    md,
                    "- round {}: {}; {} of {} updates arrived, {} invited devices sent nothing",
                    r.round,
                    outcome(r),
                    r.updates.len(),
                    r.target,
                    r.missing.len()
                );
            }
        }
        if let Some(w) = self.open_round() {
            let _ = writeln!(
                md,
                "\nRound {} was open at the last commit, with {} updates accepted (it closes when its target arrives or \
                 at its deadline).",
                w.round, w.updates
            );
        }
    }
}

/// A round's outcome in words.
fn outcome(r: &RoundReport) -> String {
    match &r.outcome {
        RoundOutcome::Aggregated => "aggregated".into(),
        RoundOutcome::Failed { reason } => format!("failed: {reason}"),
    }
}

/// Who a round invited: the devices that sent an update and those that did not, by name (the
/// first few), and how many in all.
fn invited(r: &RoundReport) -> String {
    let mut who: Vec<String> = r.updates.iter().map(|u| u.client.clone()).chain(r.missing.iter().cloned()).collect();
    who.sort();
    who.dedup();
    let n = r.sampled.max(who.len());
    if who.is_empty() { n.to_string() } else { format!("{n}: {}", names(&who)) }
}

/// Up to six names, then how many more.
fn names(ids: &[String]) -> String {
    const SHOWN: usize = 6;
    let mut text = ids.iter().take(SHOWN).map(|s| s.replace('|', "\\|")).collect::<Vec<_>>().join(", ");
    if ids.len() > SHOWN {
        let _ = write!(text, " and {} more", ids.len() - SHOWN);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_holder_is_found_in_proc_locks() {
        let locks = "1: FLOCK  ADVISORY  WRITE 4242 00:2f:1234567 0 EOF\n\
                     1: -> FLOCK  ADVISORY  WRITE 4343 00:2f:7654321 0 EOF\n\
                     2: POSIX  ADVISORY  WRITE 17 fd:01:99 0 EOF\n";
        assert_eq!(held_in(locks, 1234567), Some(Some(4242)));
        assert_eq!(held_in(locks, 7654321), None, "a waiter does not hold the lock");
        assert_eq!(held_in(locks, 99), Some(Some(17)));
        assert_eq!(held_in(locks, 5), None);
        assert_eq!(held_in("", 5), None);
    }

    fn run(rounds: &[u64], configured: Option<u64>, holder: Holder, witness: Option<Witness>) -> ServerRun {
        let reports = rounds
            .iter()
            .map(|&round| RoundReport {
                round,
                outcome: RoundOutcome::Aggregated,
                sampled: 2,
                target: 2,
                updates: vec![],
                missing: vec![],
                declined: vec![],
                duplicates: 0,
                refused: 0,
                late_total: 0,
                payload_down: 0,
                started: Default::default(),
                closed: Default::default(),
                influence: Default::default(),
                held_out_accuracy: None,
                privacy: None,
                secagg: None,
            })
            .collect();
        let configured = configured.map(|r| (r, PathBuf::from("server.toml")));
        let last_commit = Some(std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_795_600_321));
        ServerRun { reports, configured, witness, last_commit, holder }
    }

    #[test]
    fn the_status_says_whether_the_configured_rounds_finished() {
        let at = "last commit at 2026-11-25 09:52:01 UTC";
        let stopped = Holder::Stopped;
        assert_eq!(run(&[1, 2, 3], Some(3), stopped, None).status_text(), format!("finished (3 of 3 rounds); {at}"));
        let idle = run(&[1, 2, 3], Some(3), Holder::Running { pid: Some(7) }, None).status_text();
        assert!(idle.ends_with("a server (pid 7) holds the folder, idle"), "{idle}");
        let open = Some(Witness { round: 3, closed: false, updates: 1 });
        assert_eq!(
            run(&[1, 2], Some(5), stopped, open).status_text(),
            format!("stopped without finishing: last round 2 of 5 (round 3 open, 1 updates accepted); {at}")
        );
        let running = run(&[1, 2], Some(5), Holder::Running { pid: None }, None).status_text();
        assert!(running.starts_with("running: last round 2 of 5"), "{running}");
        let unknown = run(&[1, 2], None, stopped, None).status_text();
        assert!(unknown.contains("give --config") && unknown.starts_with("last round 2;"), "{unknown}");
        assert!(!run(&[1, 2], Some(0), stopped, None).finished(), "rounds = 0 runs until stopped");
        assert!(!unknown.contains("running, or stopped without a word"));
    }

    #[test]
    fn invitations_name_who_was_asked_and_who_is_missing() {
        let mut r = run(&[1], None, Holder::Stopped, None).reports.remove(0);
        r.missing = (0..8).map(|i| format!("edge-{i:03}")).collect();
        r.sampled = 9;
        assert_eq!(invited(&r), "9: edge-000, edge-001, edge-002, edge-003, edge-004, edge-005 and 2 more");
        assert_eq!(names(&["a|b".into()]), "a\\|b");
    }
}
