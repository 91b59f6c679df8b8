//! The operator's tools on a state folder: `anchorage-server check` (every checksum, SQLite's
//! integrity check, versions against rounds, the generation witness), `backup` (`VACUUM INTO`:
//! one snapshot of the database, taken while the server runs) and `restore` (a backup put back,
//! with the rollback it is accepted in one step, so that the witness does not refuse it by
//! accident).

use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rusqlite::Connection;

use super::rounds::{report_checksum, update_checksum, version_checksum};
use super::witness::{Witness, read_witness};
use super::{DB_FILE, SHM_FILE, ServerStore, StoreError, WAL_FILE};
use crate::engine::Checkpoint;

/// What `check` found.
#[derive(Debug, Default)]
pub struct CheckReport {
    pub versions: usize,
    /// The newest global version's round (the model a server resumes from); `None` in a
    /// database without versions.
    pub newest_version: Option<u64>,
    pub updates: usize,
    pub ledger_rows: usize,
    pub reports: usize,
    /// Ledger rows and reports written before schema 2, which carry no checksum.
    pub unsigned: usize,
    /// The folder's witness file (`None` when there is none, or for a file checked on its own).
    pub witness: Option<Witness>,
    /// The database's own witness: how far it has come.
    pub stored: Witness,
    /// Everything that is wrong, one line each.
    pub problems: Vec<String>,
}

impl CheckReport {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

impl std::fmt::Display for CheckReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "checked {} versions, {} update blobs, {} ledger rows, {} round reports ({} written before checksums)",
            self.versions, self.updates, self.ledger_rows, self.reports, self.unsigned
        )?;
        if let Some(w) = self.witness {
            writeln!(f, "database at {}; witness at {w}", self.stored)?;
        }
        if self.ok() {
            write!(f, "ok")
        } else {
            for p in &self.problems {
                writeln!(f, "problem: {p}")?;
            }
            write!(f, "{} problems", self.problems.len())
        }
    }
}

/// The round a database's newest global version holds and its generation, as the operator's
/// commands print them: "round 2, generation round 3 (open, 1 accepted updates)".
struct Holds(Option<u64>, Witness);

impl std::fmt::Display for Holds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(round) => write!(f, "round {round}, generation {}", self.1),
            None => write!(f, "no global version, generation {}", self.1),
        }
    }
}

/// What `backup` wrote.
#[derive(Debug)]
pub struct BackupReport {
    /// The round of the copy's newest global version: the model a restore resumes from, the
    /// round closed last when the backup was asked for (`None`: the database had no version).
    pub round: Option<u64>,
    /// The copy's generation: its own witness (newest round, whether it closed, its accepted
    /// updates), what the store had committed when the backup was asked for.
    pub generation: Witness,
    /// The copy's size.
    pub bytes: u64,
    /// From the call to the copy synced on disk (the check after it not included).
    pub took: Duration,
    /// The copy's check.
    pub check: CheckReport,
}

impl BackupReport {
    pub fn ok(&self) -> bool {
        self.check.ok()
    }
}

impl std::fmt::Display for BackupReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "backup holds {} ({:.1} MiB, copied in {:.2} s)",
            Holds(self.round, self.generation),
            self.bytes as f64 / (1 << 20) as f64,
            self.took.as_secs_f64()
        )?;
        write!(f, "{}", self.check)
    }
}

/// What `restore` put back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestoreReport {
    /// The round of the backup's newest global version: the model the federation resumes from.
    pub round: Option<u64>,
    /// The backup's generation (its own witness) as it was put back, before the rollback was
    /// accepted.
    pub generation: Witness,
    /// Round numbers at or below this were announced before: the next round is numbered above.
    pub floor: u64,
}

impl std::fmt::Display for RestoreReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "put back {}; the next round is numbered above {}", Holds(self.round, self.generation), self.floor)
    }
}

impl ServerStore {
    /// Checks a state folder without taking its lock (a running server keeps serving): SQLite's
    /// integrity check, every stored checksum, that every closed round still kept has its
    /// version and the newest version is the newest closed round, and the witness.
    pub fn check(dir: &Path) -> Result<CheckReport, StoreError> {
        let mut report = check_file(&dir.join(DB_FILE))?;
        report.witness = read_witness(dir)?;
        if let Some(w) = report.witness
            && w > report.stored
        {
            report
                .problems
                .push(format!("the database ends at {} but the folder had committed {w}: rolled back", report.stored));
        }
        Ok(report)
    }

    /// A copy of the database at `dest`, taken while the server runs, then checked.
    ///
    /// The copy is SQLite's `VACUUM INTO`, which reads the whole database in one read
    /// transaction. In WAL mode a read transaction sees one snapshot, the database as it was when
    /// the transaction began, and it does not block the server's writers (their commits go on
    /// into the WAL meanwhile). So the copy holds the moment of the call, and it takes a time
    /// that grows with the database's size, not with how often the server writes. (SQLite's
    /// backup API, run a few pages per step, starts over whenever another connection writes
    /// between two steps: under running rounds its copy is the database as it was when it
    /// finished, if it finishes at all.)
    ///
    /// The copy is written as a 0600 file into a 0700 folder beside `dest`
    /// (`.<name>.partial-*`), synced, checked as `check` does, and renamed to `dest`, so that
    /// `dest` is never half written and no other user can read it meanwhile. The copy is kept
    /// when its check finds a problem (the report lists it).
    pub fn backup(dir: &Path, dest: &Path) -> Result<BackupReport, StoreError> {
        let started = Instant::now();
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |error| StoreError::Io { path, error }
        };
        let invalid = |why: &str| StoreError::Io { path: dest.into(), error: std::io::Error::other(why.to_string()) };
        let name = dest.file_name().ok_or_else(|| invalid("a backup needs a file name"))?;
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let db = dir.join(DB_FILE);
        let conn = super::open_read_only(&db)?;
        // A backup holds every kept update and the QUIC reset key: private whatever the umask.
        let staging = tempfile::Builder::new()
            .prefix(&format!(".{}.partial-", name.to_string_lossy()))
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir_in(parent)
            .map_err(io(parent))?;
        let copy = staging.path().join(DB_FILE);
        // VACUUM INTO writes into an empty file that exists, keeping its mode.
        std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&copy).map_err(io(&copy))?;
        let target = copy.to_str().ok_or_else(|| invalid("a backup's path must be UTF-8 (SQLite's file names are)"))?;
        conn.execute("VACUUM INTO ?1", [target]).map_err(|error| StoreError::Sqlite { path: dest.into(), error })?;
        drop(conn);
        std::fs::File::open(&copy).and_then(|f| f.sync_all()).map_err(io(&copy))?;
        let bytes = std::fs::metadata(&copy).map_err(io(&copy))?.len();
        let took = started.elapsed();
        let check = check_file(&copy)?;
        std::fs::rename(&copy, dest).map_err(io(dest))?;
        std::fs::File::open(parent).and_then(|d| d.sync_all()).map_err(io(parent))?;
        Ok(BackupReport { round: check.newest_version, generation: check.stored, bytes, took, check })
    }

    /// Puts `backup` back as the folder's database (the server must be stopped: this takes the
    /// folder's lock). The backup is checked first; the old database is kept beside it as
    /// `anchorage.db.before-restore-<unix secs>`; round numbers then continue above every round the
    /// folder announced. Returns the round and generation put back and the new floor.
    pub fn restore(dir: &Path, backup: &Path) -> Result<RestoreReport, StoreError> {
        let staging = tempfile::tempdir_in(dir).map_err(|error| StoreError::Io { path: dir.into(), error })?;
        let staged = staging.path().join(DB_FILE);
        std::fs::copy(backup, &staged).map_err(|error| StoreError::Io { path: backup.into(), error })?;
        let report = check_file(&staged)?;
        if !report.ok() {
            return Err(StoreError::Corrupt { path: backup.into(), detail: report.problems.join("; ") });
        }
        // Hold the folder's lock while the files change hands.
        let lock = super::take_lock(&dir.join(super::LOCK_FILE))?;
        let db = dir.join(DB_FILE);
        let kept: PathBuf = dir.join(format!("{DB_FILE}.before-restore-{}", super::unix_now()));
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |error| StoreError::Io { path, error }
        };
        if db.exists() {
            std::fs::rename(&db, &kept).map_err(io(&db))?;
        }
        for name in [WAL_FILE, SHM_FILE] {
            let p = dir.join(name);
            if p.exists() {
                std::fs::rename(&p, dir.join(format!("{name}.before-restore"))).map_err(io(&p))?;
            }
        }
        std::fs::File::open(&staged).and_then(|f| f.sync_all()).map_err(io(&staged))?;
        std::fs::rename(&staged, &db).map_err(io(&db))?;
        drop(lock);
        let floor = Self::accept_rollback(dir, None)?;
        tracing::warn!(
            dir = %dir.display(), backup = %backup.display(), kept = %kept.display(),
            round = report.newest_version, generation = %report.stored, floor, "database restored"
        );
        Ok(RestoreReport { round: report.newest_version, generation: report.stored, floor })
    }
}

/// `check` of one database file, without a folder's witness: SQLite's integrity check, every
/// checksum, versions against rounds; the database's own witness and newest version.
fn check_file(db: &Path) -> Result<CheckReport, StoreError> {
    if !db.exists() {
        return Err(StoreError::Io { path: db.into(), error: std::io::ErrorKind::NotFound.into() });
    }
    let conn = super::open_read_only(db)?;
    let sql = |error| StoreError::Sqlite { path: db.into(), error };
    let mut report = CheckReport::default();
    let integrity: Vec<String> = conn
        .prepare("PRAGMA integrity_check")
        .and_then(|mut s| s.query_map([], |r| r.get(0))?.collect())
        .map_err(sql)?;
    if integrity != ["ok"] {
        report.problems.extend(integrity.into_iter().map(|l| format!("SQLite integrity: {l}")));
    }
    check_versions(&conn, &mut report).map_err(sql)?;
    check_updates(&conn, &mut report).map_err(sql)?;
    check_reports(&conn, &mut report).map_err(sql)?;
    let ledger = super::ledger::query_ledger_checked(&conn).map_err(sql)?;
    let unsigned: i64 =
        conn.query_row("SELECT COUNT(*) FROM ledger WHERE checksum IS NULL", [], |r| r.get(0)).map_err(sql)?;
    report.unsigned += unsigned.max(0) as usize;
    report.ledger_rows = ledger.len();
    for (r, ok) in &ledger {
        if !ok {
            report.problems.push(format!("ledger row ({}, round {}) does not match its checksum", r.client, r.round));
        }
    }
    report.stored = super::witness::stored_witness(&conn).map_err(sql)?;
    Ok(report)
}

fn check_versions(conn: &Connection, report: &mut CheckReport) -> rusqlite::Result<()> {
    let mut stmt = conn.prepare("SELECT version, method, state, checksum FROM versions ORDER BY version")?;
    let rows = stmt.query_map([], |r| {
        Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?, r.get::<_, Vec<u8>>(2)?, r.get::<_, Vec<u8>>(3)?))
    })?;
    let mut versions = Vec::new();
    for row in rows {
        let (version, method, state, sum) = row?;
        report.versions += 1;
        versions.push(version);
        if sum != version_checksum(version.max(0) as u64, &method, &state) {
            report.problems.push(format!("global version {version} does not match its checksum"));
            continue;
        }
        match postcard::from_bytes::<Checkpoint>(&state) {
            Ok(c) if c.round == version.max(0) as u64 => {}
            Ok(c) => report.problems.push(format!("global version {version} holds round {}", c.round)),
            Err(e) => report.problems.push(format!("global version {version} does not decode: {e}")),
        }
    }
    // Every closed round at or after the oldest version kept made a version.
    report.newest_version = versions.last().map(|&v| v.max(0) as u64);
    let oldest = versions.first().copied().unwrap_or(0);
    let mut stmt = conn.prepare("SELECT round FROM rounds WHERE status != 'open' AND round >= ?1 ORDER BY round")?;
    let closed: Vec<i64> = stmt.query_map([oldest], |r| r.get(0))?.collect::<rusqlite::Result<_>>()?;
    for round in &closed {
        if versions.binary_search(round).is_err() {
            report.problems.push(format!("round {round} closed but its global version is missing"));
        }
    }
    if let (Some(newest_closed), Some(newest_version)) = (closed.last(), versions.last())
        && newest_closed != newest_version
    {
        report.problems.push(format!("rounds closed up to {newest_closed}, newest version {newest_version}"));
    }
    Ok(())
}

fn check_updates(conn: &Connection, report: &mut CheckReport) -> rusqlite::Result<()> {
    let mut stmt = conn.prepare("SELECT round, client, body, checksum FROM updates WHERE body IS NOT NULL")?;
    let rows = stmt.query_map([], |r| {
        Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?, r.get::<_, Vec<u8>>(2)?, r.get::<_, Vec<u8>>(3)?))
    })?;
    for row in rows {
        let (round, client, body, sum) = row?;
        report.updates += 1;
        if sum != update_checksum(round.max(0) as u64, &client, &body) {
            report.problems.push(format!("{client}'s update for round {round} does not match its checksum"));
        }
    }
    Ok(())
}

fn check_reports(conn: &Connection, report: &mut CheckReport) -> rusqlite::Result<()> {
    let mut stmt = conn.prepare("SELECT round, report, report_checksum FROM rounds WHERE report IS NOT NULL")?;
    let rows =
        stmt.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?, r.get::<_, Option<Vec<u8>>>(2)?)))?;
    for row in rows {
        let (round, json, sum) = row?;
        report.reports += 1;
        match sum {
            None => report.unsigned += 1,
            Some(sum) if sum != report_checksum(round.max(0) as u64, &json) => {
                report.problems.push(format!("round {round}'s report does not match its checksum"));
            }
            Some(_) => {}
        }
    }
    Ok(())
}
