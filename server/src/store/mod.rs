//! The server's durable state: one SQLite database, `state_dir/anchorage.db` (rusqlite, WAL,
//! `synchronous = FULL`), inspectable with the `sqlite3` shell. It holds the rounds and their
//! status, every accepted update (the encoded update as a blob), the global model and prototypes
//! per version, the client registry and the cost ledger (schema in [`schema`]).
//!
//! The promise is SQLite's own: the engine's [`Persist`](crate::engine::Persist) actions are committed here before the
//! shell carries out the action that follows (an ack, a broadcast), so an update that was acked
//! survives `kill -9`, and a restarted server resumes the open round with it
//! ([`ServerStore::recover`]). Blobs carry a SHA-256 over their key and content, so a flipped bit
//! or an edited round number is refused at start instead of silently rolling the model back.
//! One process owns a state folder at a time (`anchorage.lock`).

mod check;
mod ledger;
mod rounds;
mod schema;
mod status;
mod witness;

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use rusqlite::Connection;
use serde::{Deserialize, Serialize};

pub use check::{BackupReport, CheckReport, RestoreReport};
pub use ledger::read_ledger;
pub use rounds::{read_round_reports, record_held_out_accuracy};
pub use schema::SCHEMA_VERSION;
pub use witness::{WITNESS_FILE, Witness, read_witness};

/// The database's file name inside the state folder.
pub const DB_FILE: &str = "anchorage.db";
/// The lock file that keeps a second server off the same state folder.
pub const LOCK_FILE: &str = "anchorage.lock";
/// SQLite's write-ahead log and its index, beside the database.
pub const WAL_FILE: &str = "anchorage.db-wal";
pub const SHM_FILE: &str = "anchorage.db-shm";

/// Why the store could not open, read or commit.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    // The cause is in the message and not also a `source()`, so that a `{:#}` chain prints it once.
    #[error("cannot use {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("database {path}: {error}")]
    Sqlite { path: PathBuf, error: rusqlite::Error },
    #[error("{path} is held by another anchorage-server ({holder}); one server per state folder")]
    Locked { path: PathBuf, holder: String },
    #[error(
        "database {path} has schema version {found}, newer than this anchorage-server understands ({supported}); \
         run a newer server or restore a backup"
    )]
    NewerSchema { path: PathBuf, found: i64, supported: i64 },
    #[error("database {path} is corrupt: {detail}; it was left untouched")]
    Corrupt { path: PathBuf, detail: String },
    #[error(
        "database {path} ends at {stored}, but this state folder had committed {witness} \
         (anchorage.generation): the database was replaced by an older copy or lost committed transactions. \
         No round runs until you decide: restore the newest backup, or resume from this one with \
         `anchorage-server accept-rollback --config server.toml` (round numbers then continue above {})",
        witness.round
    )]
    RolledBack { path: PathBuf, stored: Witness, witness: Witness },
}

/// How much history the database keeps on a months-long run (`[store]` in server.toml). 0 keeps
/// everything.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Retention {
    /// Newest global versions kept (the newest is always kept).
    pub keep_versions: u64,
    /// Closed rounds whose accepted updates keep their blocks; older updates keep their row
    /// (client, round, samples, checksum) and lose the blob.
    pub keep_update_blocks: u64,
    /// Rounds of cost-ledger rows kept.
    pub keep_ledger_rounds: u64,
}

impl Default for Retention {
    fn default() -> Self {
        Self { keep_versions: 16, keep_update_blocks: 16, keep_ledger_rounds: 0 }
    }
}

/// The state folder's database. Cheap to clone; one connection behind a mutex (the engine is
/// one task, and every commit must be in order anyway).
#[derive(Clone)]
pub struct ServerStore {
    inner: Arc<Inner>,
}

struct Inner {
    dir: PathBuf,
    db_path: PathBuf,
    conn: Mutex<Connection>,
    retention: Retention,
    /// Held (with an OS lock) for the life of the store.
    _lock: std::fs::File,
}

impl std::fmt::Debug for ServerStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerStore").field("db", &self.inner.db_path).finish()
    }
}

impl ServerStore {
    /// Opens (creating if needed) the database in `dir`, with the default retention.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self, StoreError> {
        Self::open_with(dir, Retention::default())
    }

    /// Opens the database in `dir`: takes the folder's lock, checks that it is writable, runs
    /// SQLite's integrity check, migrates the schema, and checks that the stored rounds and
    /// versions agree. Every failure names the file and stops here, before a socket is bound.
    pub fn open_with(dir: impl Into<PathBuf>, retention: Retention) -> Result<Self, StoreError> {
        let store = Self::open_unchecked(dir, retention)?;
        store.check_witness()?;
        Ok(store)
    }

    /// [`Self::open_with`] without the comparison with the folder's generation witness (for the
    /// operator's commands that look at or repair a rolled-back store).
    pub(crate) fn open_unchecked(dir: impl Into<PathBuf>, retention: Retention) -> Result<Self, StoreError> {
        let dir = dir.into();
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| StoreError::Io { path, error: source }
        };
        let existed = dir.exists();
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        restrict(&dir, 0o700, existed)?;
        let lock = take_lock(&dir.join(LOCK_FILE))?;
        let db_path = dir.join(DB_FILE);
        let db_existed = db_path.exists();
        let sql = |source| StoreError::Sqlite { path: db_path.clone(), error: source };
        // A new database is created 0600 (SQLite gives its -wal and -shm the database's mode).
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&db_path)
            .map_err(io(&db_path))?;
        let conn = Connection::open(&db_path).map_err(sql)?;
        let store = Self {
            inner: Arc::new(Inner { dir, db_path: db_path.clone(), conn: Mutex::new(conn), retention, _lock: lock }),
        };
        {
            let mut conn = store.conn();
            configure(&conn).map_err(|e| store.classify(e))?;
            integrity_check(&conn).map_err(|e| store.classify(e))??;
            schema::migrate(&mut conn, &db_path)?;
        }
        // The WAL and its index exist now (WAL mode, a read); older installs' files are tightened.
        for name in [DB_FILE, WAL_FILE, SHM_FILE, LOCK_FILE] {
            let path = store.inner.dir.join(name);
            if path.exists() {
                restrict(&path, 0o600, db_existed)?;
            }
        }
        store.check_consistency()?;
        Ok(store)
    }

    /// The state folder.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The database file.
    pub fn db_path(&self) -> &Path {
        &self.inner.db_path
    }

    pub fn retention(&self) -> &Retention {
        &self.inner.retention
    }

    /// Hands the connection's page cache back to the C library's heap
    /// (`sqlite3_db_release_memory`), for it to be trimmed after a large fleet has left.
    pub fn release_memory(&self) {
        if let Err(e) = self.conn().release_memory() {
            tracing::debug!(error = %e, "SQLite kept its page cache");
        }
    }

    fn conn(&self) -> MutexGuard<'_, Connection> {
        // A panic while holding the connection cannot leave a half-done transaction behind
        // (SQLite rolls it back), so a poisoned lock is safe to take over.
        self.inner.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A SQLite error as a store error: "not a database" and "malformed" mean corruption.
    fn classify(&self, e: rusqlite::Error) -> StoreError {
        use rusqlite::ffi::ErrorCode;
        let path = self.inner.db_path.clone();
        match e.sqlite_error_code() {
            Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase) => {
                StoreError::Corrupt { path, detail: e.to_string() }
            }
            _ => StoreError::Sqlite { path, error: e },
        }
    }

    fn corrupt(&self, detail: impl Into<String>) -> StoreError {
        StoreError::Corrupt { path: self.inner.db_path.clone(), detail: detail.into() }
    }

    /// The key of QUIC stateless resets, made once and kept, so that after a restart the server
    /// tells devices at once that their old connection is gone (instead of leaving them to wait
    /// out the idle timeout).
    pub fn stateless_reset_key(&self) -> Result<[u8; 32], StoreError> {
        let conn = self.conn();
        let stored: Option<Vec<u8>> = rusqlite::OptionalExtension::optional(conn.query_row(
            "SELECT value FROM meta WHERE key = 'stateless_reset_key'",
            [],
            |r| r.get(0),
        ))
        .map_err(|e| self.classify(e))?;
        if let Some(key) = stored {
            return key.try_into().map_err(|_| self.corrupt("meta.stateless_reset_key is not 32 bytes"));
        }
        let mut key = [0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut key)
            .map_err(|_| self.corrupt("the system's random number generator failed"))?;
        conn.execute("INSERT INTO meta (key, value) VALUES ('stateless_reset_key', ?1)", [key.as_slice()])
            .map_err(|e| self.classify(e))?;
        Ok(key)
    }
}

/// A read-only connection for tools that look at a state folder while its server runs; a
/// database from a newer schema is refused.
fn open_read_only(db: &Path) -> Result<Connection, StoreError> {
    let sql = |source| StoreError::Sqlite { path: db.into(), error: source };
    let conn = Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).map_err(sql)?;
    conn.busy_timeout(std::time::Duration::from_secs(10)).map_err(sql)?;
    let found: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0)).map_err(sql)?;
    if found > SCHEMA_VERSION {
        return Err(StoreError::NewerSchema { path: db.into(), found, supported: SCHEMA_VERSION });
    }
    Ok(conn)
}

/// Sets `path`'s mode to `mode` (the state folder 0700, its files 0600) whatever the umask, so
/// that no other local user reads an update or the QUIC reset key. A path another user owns is
/// left as it is, with a warning (chmod would fail; its owner decides). A loose mode found on
/// what existed before this open is logged.
fn restrict(path: &Path, mode: u32, existed: bool) -> Result<(), StoreError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let io = |error| StoreError::Io { path: path.to_path_buf(), error };
    let meta = std::fs::metadata(path).map_err(io)?;
    let was = meta.permissions().mode() & 0o777;
    if was == mode {
        return Ok(());
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if meta.uid() != unsafe { libc::geteuid() } {
        tracing::warn!(path = %path.display(), mode = format!("{was:o}"), "not ours to restrict: chmod {mode:o} it");
        return Ok(());
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(io)?;
    if existed && was & 0o077 != 0 {
        tracing::warn!(path = %path.display(), was = format!("{was:o}"), now = format!("{mode:o}"), "was readable by other users; restricted to this one");
    }
    Ok(())
}

/// Takes the folder's lock file, or says who holds it.
fn take_lock(path: &Path) -> Result<std::fs::File, StoreError> {
    use std::io::{Read, Seek, Write};
    let io = |source| StoreError::Io { path: path.to_path_buf(), error: source };
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(io)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = if holder.trim().is_empty() { "pid unknown".into() } else { holder.trim().to_string() };
            return Err(StoreError::Locked { path: path.to_path_buf(), holder });
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
    }
    file.set_len(0).map_err(io)?;
    file.rewind().map_err(io)?;
    write!(file, "pid {}", std::process::id()).map_err(io)?;
    file.sync_all().map_err(io)?;
    Ok(file)
}

/// WAL, full syncs (a commit that precedes an ack must be on disk), and a busy timeout so that
/// an operator's `sqlite3` session reading the database does not fail a commit.
fn configure(conn: &Connection) -> rusqlite::Result<()> {
    conn.busy_timeout(std::time::Duration::from_secs(10))?;
    // Incremental vacuum can only be chosen before the first table exists; on an existing
    // database this is a no-op.
    conn.execute_batch("PRAGMA auto_vacuum = INCREMENTAL;")?;
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(rusqlite::Error::InvalidParameterName(format!("journal_mode is {mode}, WAL was asked for")));
    }
    conn.execute_batch("PRAGMA synchronous = FULL;")?;
    Ok(())
}

/// SQLite's `integrity_check`: `Ok(Err(..))` lists what it found.
fn integrity_check(conn: &Connection) -> rusqlite::Result<Result<(), StoreError>> {
    let mut stmt = conn.prepare("PRAGMA integrity_check")?;
    let rows: Vec<String> = stmt.query_map([], |r| r.get(0))?.collect::<rusqlite::Result<_>>()?;
    if rows == ["ok"] {
        return Ok(Ok(()));
    }
    let path = conn.path().map(PathBuf::from).unwrap_or_default();
    Ok(Err(StoreError::Corrupt { path, detail: format!("integrity check: {}", rows.join("; ")) }))
}

/// SHA-256 over a blob and the key it is stored under (so moving a blob to another key, or
/// editing the key, is caught like a flipped bit).
fn checksum(parts: &[&[u8]]) -> Vec<u8> {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for p in parts {
        ctx.update(&(p.len() as u64).to_le_bytes());
        ctx.update(p);
    }
    ctx.finish().as_ref().to_vec()
}

/// Seconds since the Unix epoch, for the `*_at` columns.
fn unix_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

#[cfg(test)]
mod tests;
