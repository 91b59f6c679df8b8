//! The operator's tools on a state folder: `anchorage-server check` (every checksum, SQLite's
//! integrity check, versions against rounds, the generation witness), `backup` (SQLite's online
//! backup API: a consistent copy while the server runs) and `restore` (a backup put back, with
//! the rollback it is accepted in one step, so that the witness does not refuse it by accident).

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rusqlite::Connection;

use super::rounds::{report_checksum, update_checksum, version_checksum};
use super::witness::{Witness, read_witness};
use super::{DB_FILE, SHM_FILE, ServerStore, StoreError, WAL_FILE};
use crate::engine::Checkpoint;

/// What `check` found.
#[derive(Debug, Default)]
pub struct CheckReport {
    pub versions: usize,
    pub updates: usize,
    pub ledger_rows: usize,
    pub reports: usize,
    /// Ledger rows and reports written before schema 2, which carry no checksum.
    pub unsigned: usize,
    pub witness: Option<Witness>,
    pub stored: Option<Witness>,
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
        if let (Some(s), Some(w)) = (self.stored, self.witness) {
            writeln!(f, "database at {s}; witness at {w}")?;
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

impl ServerStore {
    /// Checks a state folder without taking its lock (a running server keeps serving): SQLite's
    /// integrity check, every stored checksum, that every closed round still kept has its
    /// version and the newest version is the newest closed round, and the witness.
    pub fn check(dir: &Path) -> Result<CheckReport, StoreError> {
        let db = dir.join(DB_FILE);
        if !db.exists() {
            return Err(StoreError::Io { path: db, error: std::io::ErrorKind::NotFound.into() });
        }
        let conn = super::open_read_only(&db)?;
        let sql = |error| StoreError::Sqlite { path: db.clone(), error };
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
                report
                    .problems
                    .push(format!("ledger row ({}, round {}) does not match its checksum", r.client, r.round));
            }
        }
        report.stored = Some(super::witness::stored_witness(&conn).map_err(sql)?);
        drop(conn);
        report.witness = read_witness(dir)?;
        if let (Some(w), Some(s)) = (report.witness, report.stored)
            && w > s
        {
            report.problems.push(format!("the database ends at {s} but the folder had committed {w}: rolled back"));
        }
        Ok(report)
    }

    /// A consistent copy of the database at `dest` while the server runs (SQLite's online backup
    /// API), written beside `dest` and renamed into place, then checked. Returns the copy's report.
    pub fn backup(dir: &Path, dest: &Path) -> Result<CheckReport, StoreError> {
        let db = dir.join(DB_FILE);
        let conn = super::open_read_only(&db)?;
        let tmp = dest.with_extension("partial");
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |error| StoreError::Io { path, error }
        };
        let _ = std::fs::remove_file(&tmp);
        // A backup holds every kept update and the QUIC reset key: 0600 whatever the umask.
        std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&tmp).map_err(io(&tmp))?;
        {
            let mut out = Connection::open(&tmp).map_err(|error| StoreError::Sqlite { path: tmp.clone(), error })?;
            let backup = rusqlite::backup::Backup::new(&conn, &mut out)
                .map_err(|error| StoreError::Sqlite { path: tmp.clone(), error })?;
            backup
                .run_to_completion(256, std::time::Duration::from_millis(5), None)
                .map_err(|error| StoreError::Sqlite { path: tmp.clone(), error })?;
        }
        std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(io(&tmp))?;
        std::fs::rename(&tmp, dest).map_err(io(dest))?;
        let staging = tempfile::tempdir().map_err(io(dest))?;
        std::fs::copy(dest, staging.path().join(DB_FILE)).map_err(io(dest))?;
        let mut report = Self::check(staging.path())?;
        report.witness = None;
        Ok(report)
    }

    /// Puts `backup` back as the folder's database (the server must be stopped: this takes the
    /// folder's lock). The backup is checked first; the old database is kept beside it as
    /// `anchorage.db.before-restore-<unix secs>`; round numbers then continue above every round the
    /// folder announced. Returns the new floor.
    pub fn restore(dir: &Path, backup: &Path) -> Result<u64, StoreError> {
        let staging = tempfile::tempdir_in(dir).map_err(|error| StoreError::Io { path: dir.into(), error })?;
        let staged = staging.path().join(DB_FILE);
        std::fs::copy(backup, &staged).map_err(|error| StoreError::Io { path: backup.into(), error })?;
        let report = Self::check(staging.path())?;
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
        tracing::warn!(dir = %dir.display(), backup = %backup.display(), kept = %kept.display(), floor, "database restored");
        Ok(floor)
    }
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
