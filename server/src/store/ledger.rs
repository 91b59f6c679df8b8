//! The cost ledger (ARCHITECTURE.md §7): one row per client, round and kind (`reported` by the
//! client, or `dropped` by the engine when a sampled client sent nothing). A second record for the
//! same key is ignored, so a client that resends its cost report after a reconnect is counted once.

use std::path::Path;

use anchorage_shared::ledger::CostRecord;
use rusqlite::params;

use super::{ServerStore, StoreError, unix_now};

const COLUMNS: &str = "client, round, kind, payload_down, payload_up, wire_down, wire_up, compute_seconds, \
                       transfer_seconds, wait_seconds, wall_seconds, rtt_seconds, joules, straggler, declined, \
                       temperature_c, throttled, battery_percent, external_power, power_mode, readings_refused";

/// The ledger's `kind` of a record: `declined` (the device said no), `dropped` (it sent nothing)
/// or `reported` (its own cost record).
fn kind(r: &CostRecord) -> &'static str {
    if r.declined.is_some() {
        "declined"
    } else if r.dropped {
        "dropped"
    } else {
        "reported"
    }
}

impl ServerStore {
    /// Appends records in one transaction; returns those that were new (the others were
    /// already in the ledger).
    pub fn append_ledger(&self, records: &[CostRecord]) -> Result<Vec<CostRecord>, StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(|e| self.classify(e))?;
        let mut new = Vec::new();
        {
            let mut stmt = tx
                .prepare_cached(&format!(
                    "INSERT OR IGNORE INTO ledger ({COLUMNS}, recorded_at, checksum)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23)"
                ))
                .map_err(|e| self.classify(e))?;
            for r in records {
                let to_i = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
                let inserted = stmt
                    .execute(params![
                        r.client,
                        to_i(r.round),
                        kind(r),
                        to_i(r.payload_down),
                        to_i(r.payload_up),
                        to_i(r.wire_down),
                        to_i(r.wire_up),
                        r.compute_seconds,
                        r.transfer_seconds,
                        r.wait_seconds,
                        r.wall_seconds,
                        r.rtt_seconds,
                        r.joules,
                        r.straggler,
                        r.declined.map(|d| d.name()),
                        r.temperature_c,
                        r.throttled,
                        r.battery_percent,
                        r.external_power,
                        r.power_mode,
                        r.readings_refused,
                        unix_now(),
                        ledger_checksum(&stored(r)),
                    ])
                    .map_err(|e| self.classify(e))?;
                if inserted > 0 {
                    new.push(r.clone());
                }
            }
        }
        tx.commit().map_err(|e| self.classify(e))?;
        Ok(new)
    }

    /// Every record in the ledger, by round, client and kind.
    pub fn load_ledger(&self) -> Result<Vec<CostRecord>, StoreError> {
        query_ledger(&self.conn()).map_err(|e| self.classify(e))
    }

    /// Writes the ledger as CSV (the simulator's `ledger.csv` format), atomically; returns the
    /// number of rows.
    pub fn export_ledger_csv(&self, path: &Path) -> Result<usize, StoreError> {
        let records = self.load_ledger()?;
        let io = |error: std::io::Error| StoreError::Io { path: path.into(), error };
        let mut w = csv::WriterBuilder::new().has_headers(false).from_writer(Vec::new());
        // The header even for an empty ledger; the rows are the records' serde fields in order.
        w.write_record(anchorage_shared::ledger::CSV_HEADER.split(',')).map_err(|e| io(e.into()))?;
        for r in &records {
            w.serialize(r).map_err(|e| io(e.into()))?;
        }
        let bytes = w.into_inner().map_err(|e| io(e.into_error()))?;
        anchorage_shared::io::write_atomic(path, &bytes).map_err(io)?;
        Ok(records.len())
    }
}

/// The ledger of a state folder's database, read without taking the folder's lock: a running
/// server keeps writing, and WAL lets a reader see its last commit (`anchorage report`).
pub fn read_ledger(db: &Path) -> Result<Vec<CostRecord>, StoreError> {
    let conn = super::open_read_only(db)?;
    query_ledger(&conn).map_err(|source| StoreError::Sqlite { path: db.into(), error: source })
}

/// A record as the ledger stores it: under the key (client, round, kind), the client's id
/// bounded, seconds and bytes as SQLite keeps them.
fn stored(r: &CostRecord) -> CostRecord {
    let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX) as u64;
    CostRecord {
        round: clamp(r.round),
        payload_down: clamp(r.payload_down),
        payload_up: clamp(r.payload_up),
        wire_down: clamp(r.wire_down),
        wire_up: clamp(r.wire_up),
        ..r.clone()
    }
}

/// SHA-256 of a ledger row (its record, postcard-encoded).
pub(super) fn ledger_checksum(r: &CostRecord) -> Vec<u8> {
    super::checksum(&[b"ledger", &r.stable_encoding()])
}

/// Every row, checked: a row whose checksum does not match is left out with an error line
/// (`anchorage-server check` lists it); a row from before schema 2 has none and is kept.
fn query_ledger(conn: &rusqlite::Connection) -> rusqlite::Result<Vec<CostRecord>> {
    Ok(query_ledger_checked(conn)?.into_iter().filter_map(|(r, ok)| ok.then_some(r)).collect())
}

/// A stored decline reason (an unknown name reads as none, and the row's checksum then tells).
fn decline_reason(name: &str) -> Option<anchorage_shared::ledger::DeclineReason> {
    anchorage_shared::ledger::DeclineReason::ALL.into_iter().find(|d| d.name() == name)
}

/// Every row with whether it matches its checksum (true for a row without one).
pub(super) fn query_ledger_checked(conn: &rusqlite::Connection) -> rusqlite::Result<Vec<(CostRecord, bool)>> {
    let mut stmt = conn.prepare(&format!("SELECT {COLUMNS}, checksum FROM ledger ORDER BY round, client, kind"))?;
    let rows = stmt.query_map([], |r| {
        let record = CostRecord {
            client: r.get(0)?,
            round: r.get::<_, i64>(1)?.max(0) as u64,
            dropped: r.get::<_, String>(2)? == "dropped",
            payload_down: r.get::<_, i64>(3)?.max(0) as u64,
            payload_up: r.get::<_, i64>(4)?.max(0) as u64,
            wire_down: r.get::<_, i64>(5)?.max(0) as u64,
            wire_up: r.get::<_, i64>(6)?.max(0) as u64,
            compute_seconds: r.get(7)?,
            transfer_seconds: r.get(8)?,
            wait_seconds: r.get(9)?,
            wall_seconds: r.get(10)?,
            rtt_seconds: r.get(11)?,
            joules: r.get(12)?,
            straggler: r.get(13)?,
            declined: r.get::<_, Option<String>>(14)?.and_then(|d| decline_reason(&d)),
            temperature_c: r.get(15)?,
            throttled: r.get(16)?,
            battery_percent: r.get(17)?,
            external_power: r.get(18)?,
            power_mode: r.get(19)?,
            readings_refused: r.get(20)?,
        };
        let sum: Option<Vec<u8>> = r.get(21)?;
        let ok = sum.is_none_or(|s| s == ledger_checksum(&record));
        if !ok {
            tracing::error!(client = %record.client, round = record.round, "a ledger row does not match its checksum; left out");
        }
        Ok((record, ok))
    })?;
    rows.collect()
}
