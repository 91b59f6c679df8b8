//! The database schema and its migrations. `PRAGMA user_version` is the schema version; each
//! migration runs in its own transaction, so a crash mid-migration leaves the previous version.
//! A database from a newer server is refused, never downgraded.

use std::path::Path;

use rusqlite::Connection;

use super::StoreError;

/// The schema this server writes.
pub const SCHEMA_VERSION: i64 = 3;

/// Migration `i` takes the schema from version `i` to `i + 1`.
pub(super) const MIGRATIONS: &[&str] = &[
    // 0 → 1: the first schema.
    r#"
    -- Small settings: the stateless-reset key, when the database was made.
    CREATE TABLE meta (
        key   TEXT PRIMARY KEY,
        value BLOB NOT NULL
    );
    -- One row per round (a version in buffered mode): opened before its broadcast went out,
    -- closed in the same transaction as the version it made.
    CREATE TABLE rounds (
        round     INTEGER PRIMARY KEY,
        task      INTEGER NOT NULL,
        status    TEXT NOT NULL CHECK (status IN ('open', 'aggregated', 'failed')),
        target    INTEGER NOT NULL,
        sampled   TEXT NOT NULL,             -- JSON array of the invited client ids
        opened_at INTEGER NOT NULL,          -- unix seconds
        closed_at INTEGER,
        outcome   TEXT,                      -- why a failed round failed
        report    TEXT                       -- the round report, JSON
    );
    -- Every accepted update, committed before its ack.
    CREATE TABLE updates (
        round            INTEGER NOT NULL,   -- the round it answers (buffered: version trained on + 1)
        client           TEXT NOT NULL,
        num_samples      INTEGER NOT NULL,
        staleness        INTEGER NOT NULL,
        arrived_after_ms INTEGER NOT NULL,
        payload_bytes    INTEGER NOT NULL,
        accepted_at      INTEGER NOT NULL,
        closed_in        INTEGER,            -- the version whose close consumed it; NULL while pending
        body             BLOB,               -- the update (postcard); NULL once retention dropped it
        checksum         BLOB NOT NULL,      -- SHA-256 of (round, client, body)
        PRIMARY KEY (round, client)
    );
    CREATE INDEX updates_pending ON updates (closed_in);
    -- The global model, the method's state and the global prototypes, per version.
    CREATE TABLE versions (
        version    INTEGER PRIMARY KEY,      -- the round that made it; 0 is the initial model
        method     TEXT NOT NULL,
        state      BLOB NOT NULL,            -- the checkpoint (postcard)
        checksum   BLOB NOT NULL,            -- SHA-256 of (version, method, state)
        created_at INTEGER NOT NULL
    );
    -- Clients that said a valid hello.
    CREATE TABLE clients (
        id          TEXT PRIMARY KEY,
        fingerprint TEXT,                    -- of the client certificate, under mutual TLS
        first_seen  INTEGER NOT NULL,
        last_seen   INTEGER NOT NULL
    );
    -- The cost ledger: one row per client, round and kind.
    CREATE TABLE ledger (
        client           TEXT NOT NULL,
        round            INTEGER NOT NULL,
        kind             TEXT NOT NULL CHECK (kind IN ('reported', 'dropped')),
        payload_down     INTEGER NOT NULL,
        payload_up       INTEGER NOT NULL,
        wire_down        INTEGER NOT NULL,
        wire_up          INTEGER NOT NULL,
        compute_seconds  REAL NOT NULL,
        transfer_seconds REAL NOT NULL,
        wait_seconds     REAL NOT NULL,
        wall_seconds     REAL NOT NULL,
        rtt_seconds      REAL NOT NULL,
        joules           REAL NOT NULL,
        straggler        INTEGER NOT NULL,
        recorded_at      INTEGER NOT NULL,
        PRIMARY KEY (client, round, kind)
    );
    INSERT INTO meta (key, value) VALUES ('created_at', CAST(strftime('%s', 'now') AS INTEGER));
    "#,
    // 1 → 2: ledger rows and round reports carry their own SHA-256 (NULL: written before).
    r#"
    ALTER TABLE ledger ADD COLUMN checksum BLOB;         -- SHA-256 of the record (postcard)
    ALTER TABLE rounds ADD COLUMN report_checksum BLOB;  -- SHA-256 of (round, report)
    "#,
    // 2 → 3: a ledger row may record a decline, and carries the device's condition.
    // SQLite cannot change a CHECK, so the table is rebuilt and its rows copied as they are.
    r#"
    CREATE TABLE ledger_v3 (
        client           TEXT NOT NULL,
        round            INTEGER NOT NULL,
        kind             TEXT NOT NULL CHECK (kind IN ('reported', 'dropped', 'declined')),
        payload_down     INTEGER NOT NULL,
        payload_up       INTEGER NOT NULL,
        wire_down        INTEGER NOT NULL,
        wire_up          INTEGER NOT NULL,
        compute_seconds  REAL NOT NULL,
        transfer_seconds REAL NOT NULL,
        wait_seconds     REAL NOT NULL,
        wall_seconds     REAL NOT NULL,
        rtt_seconds      REAL NOT NULL,
        joules           REAL NOT NULL,
        straggler        INTEGER NOT NULL,
        recorded_at      INTEGER NOT NULL,
        checksum         BLOB,
        declined         TEXT,                -- why the device declined (kind 'declined')
        temperature_c    REAL,                -- the device's condition, where it reported it
        throttled        INTEGER,
        battery_percent  INTEGER,
        external_power   INTEGER,
        power_mode       TEXT,
        readings_refused INTEGER,             -- values the device refused to read of itself
        PRIMARY KEY (client, round, kind)
    );
    INSERT INTO ledger_v3 (client, round, kind, payload_down, payload_up, wire_down, wire_up, compute_seconds,
        transfer_seconds, wait_seconds, wall_seconds, rtt_seconds, joules, straggler, recorded_at, checksum)
      SELECT client, round, kind, payload_down, payload_up, wire_down, wire_up, compute_seconds,
        transfer_seconds, wait_seconds, wall_seconds, rtt_seconds, joules, straggler, recorded_at, checksum
      FROM ledger;
    DROP TABLE ledger;
    ALTER TABLE ledger_v3 RENAME TO ledger;
    "#,
];

/// Brings the schema up to [`SCHEMA_VERSION`].
pub(super) fn migrate(conn: &mut Connection, path: &Path) -> Result<(), StoreError> {
    let sql = |source| StoreError::Sqlite { path: path.to_path_buf(), error: source };
    let found: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0)).map_err(sql)?;
    if found > SCHEMA_VERSION {
        return Err(StoreError::NewerSchema { path: path.to_path_buf(), found, supported: SCHEMA_VERSION });
    }
    if found < 0 {
        return Err(StoreError::Corrupt { path: path.to_path_buf(), detail: format!("schema version {found}") });
    }
    for (from, migration) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        let tx = conn.transaction().map_err(sql)?;
        tx.execute_batch(migration).map_err(sql)?;
        tx.pragma_update(None, "user_version", from as i64 + 1).map_err(sql)?;
        tx.commit().map_err(sql)?;
        tracing::info!(path = %path.display(), version = from + 1, "database schema migrated");
    }
    Ok(())
}
