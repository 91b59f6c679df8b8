//! The store's generation witness, and the operator's decision after a rollback.
//!
//! SQLite cannot tell that `anchorage.db` was replaced by an older copy, nor that a damaged WAL
//! tail was dropped at recovery (it stops replaying at the first bad frame, and the committed
//! transactions after it are gone without an error). So beside the database the store keeps
//! `anchorage.generation`, written atomically after every commit of a round's opening, an
//! accepted update or a round's close: the store's [`Witness`] (newest round, whether it closed,
//! its accepted updates), a value that only grows. At open, a database whose own witness is
//! below the file's was rolled back, and the store refuses to open until the operator decides
//! ([`ServerStore::accept_rollback`], `anchorage-server accept-rollback`). The devices' last
//! rounds, in their hellos, are a second witness that the engine compares while it runs.
//!
//! After an accepted rollback the federation resumes from the restored model, and round numbers
//! continue above every round ever announced (`meta.round_floor`): no number is used twice.

use std::path::Path;

use rusqlite::{Connection, OptionalExtension};
use serde::{Deserialize, Serialize};

use super::{ServerStore, StoreError};

/// The witness file's name inside the state folder.
pub const WITNESS_FILE: &str = "anchorage.generation";

/// How far the store has come, ordered: a later commit never gives a smaller witness.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Witness {
    /// The newest round the store opened, closed or accepted an update for (or the floor of an
    /// accepted rollback).
    pub round: u64,
    /// Whether that round closed.
    pub closed: bool,
    /// Updates accepted for that round.
    pub updates: u64,
}

impl Default for Witness {
    /// A database without rounds: what [`stored_witness`] gives a new one.
    fn default() -> Self {
        Self { round: 0, closed: true, updates: 0 }
    }
}

impl std::fmt::Display for Witness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = if self.closed { "closed" } else { "open" };
        write!(f, "round {} ({state}, {} accepted updates)", self.round, self.updates)
    }
}

/// Reads the witness; `None` when there is none (a new folder, or one from an older server).
pub fn read_witness(dir: &Path) -> Result<Option<Witness>, StoreError> {
    let path = dir.join(WITNESS_FILE);
    let bytes =
        anchorage_shared::io::read_if_exists(&path).map_err(|error| StoreError::Io { path: path.clone(), error })?;
    bytes
        .map(|b| {
            serde_json::from_slice(&b).map_err(|e| StoreError::Corrupt {
                path: path.clone(),
                detail: format!(
                    "the generation witness does not parse ({e}); if you removed or edited it, \
                     run `anchorage-server accept-rollback` to write it again from the database"
                ),
            })
        })
        .transpose()
}

fn write_witness(dir: &Path, witness: Witness) -> Result<(), StoreError> {
    let path = dir.join(WITNESS_FILE);
    let bytes = serde_json::to_vec(&witness).unwrap_or_default();
    anchorage_shared::io::write_atomic(&path, &bytes).map_err(|error| StoreError::Io { path, error })
}

/// Round numbers at or below this were used before an accepted rollback (0: none; a value that
/// is not 8 bytes reads as none and `check`'s integrity pass reports the table).
pub(super) fn round_floor(conn: &Connection) -> rusqlite::Result<u64> {
    let stored: Option<Vec<u8>> =
        conn.query_row("SELECT value FROM meta WHERE key = 'round_floor'", [], |r| r.get(0)).optional()?;
    Ok(stored.and_then(|b| <[u8; 8]>::try_from(b.as_slice()).ok()).map_or(0, u64::from_le_bytes))
}

fn set_round_floor(conn: &Connection, floor: u64) -> rusqlite::Result<()> {
    conn.execute(
        "INSERT INTO meta (key, value) VALUES ('round_floor', ?1)
         ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        [floor.to_le_bytes().as_slice()],
    )?;
    Ok(())
}

/// Round numbers continue above `floor` (a relay's parent ran rounds without it); a lower
/// floor than the one held changes nothing.
pub(super) fn raise_round_floor(conn: &Connection, floor: u64) -> rusqlite::Result<()> {
    if floor > round_floor(conn)? { set_round_floor(conn, floor) } else { Ok(()) }
}

/// How far a database has come: its newest round (a round row or an accepted update's, or the
/// floor an accepted rollback set), whether that round closed, and its accepted updates.
pub(super) fn stored_witness(conn: &Connection) -> rusqlite::Result<Witness> {
    let floor = round_floor(conn)?;
    let q = |sql: &str, p: i64| conn.query_row(sql, [p], |r| r.get::<_, Option<i64>>(0));
    let newest = q("SELECT MAX(round) FROM rounds WHERE round >= ?1", 0)?
        .max(q("SELECT MAX(round) FROM updates WHERE round >= ?1", 0)?)
        .unwrap_or(0)
        .max(0) as u64;
    if floor > newest {
        return Ok(Witness { round: floor, closed: true, updates: 0 });
    }
    let round = newest as i64;
    let closed = q("SELECT COUNT(*) FROM rounds WHERE round = ?1 AND status != 'open'", round)?.unwrap_or(0) > 0;
    let updates = q("SELECT COUNT(*) FROM updates WHERE round = ?1", round)?.unwrap_or(0).max(0) as u64;
    Ok(Witness { round: newest, closed: closed || newest == 0, updates })
}

impl ServerStore {
    /// How far the database has come (see [`stored_witness`]).
    pub fn stored_witness(&self) -> Result<Witness, StoreError> {
        stored_witness(&self.conn()).map_err(|e| self.classify(e))
    }

    /// The newest round the database knows of.
    pub fn highest_round(&self) -> Result<u64, StoreError> {
        Ok(self.stored_witness()?.round)
    }

    /// Round numbers at or below this were used before an accepted rollback (0: none).
    pub fn round_floor(&self) -> Result<u64, StoreError> {
        round_floor(&self.conn()).map_err(|e| self.classify(e))
    }

    /// Compares the database with the folder's witness: refuses a database that ends below it,
    /// and writes the witness when there is none yet.
    pub(super) fn check_witness(&self) -> Result<(), StoreError> {
        let stored = self.stored_witness()?;
        match read_witness(self.dir())? {
            Some(w) if w > stored => Err(StoreError::RolledBack { path: self.db_path().into(), stored, witness: w }),
            Some(_) => Ok(()),
            None => {
                if stored.round > 0 {
                    tracing::warn!(
                        dir = %self.dir().display(),
                        round = stored.round,
                        "no generation witness in a state folder that has rounds (first start of this version, \
                         or the file was removed): writing it from the database"
                    );
                }
                write_witness(self.dir(), stored)
            }
        }
    }

    /// Writes the witness of the database as it is now (after a commit is durable).
    pub(super) fn witness(&self) -> Result<(), StoreError> {
        write_witness(self.dir(), self.stored_witness()?)
    }

    /// The operator's decision to resume from this database although it is older than what the
    /// folder or the devices saw: the round that was open is dropped, round numbers
    /// continue above `seen` (the highest round announced: the witness's, or what the devices
    /// reported, whichever the operator gives, and never below the witness), and the witness is
    /// written again. Returns the new floor.
    pub fn accept_rollback(dir: &Path, seen: Option<u64>) -> Result<u64, StoreError> {
        let witness = read_witness(dir).ok().flatten().map_or(0, |w| w.round);
        // `open_unchecked` takes the folder's lock: no server runs on it meanwhile.
        let store = Self::open_unchecked(dir, super::Retention::default())?;
        let floor = store.highest_round()?.max(witness).max(seen.unwrap_or(0));
        {
            let mut conn = store.conn();
            let tx = conn.transaction().map_err(|e| store.classify(e))?;
            // The round that was open made no version: it is forgotten with the updates it held
            // (its devices trained on a model from before the rollback point anyway).
            tx.execute("DELETE FROM updates WHERE closed_in IS NULL", [])
                .and_then(|_| tx.execute("DELETE FROM rounds WHERE status = 'open'", []))
                .and_then(|_| set_round_floor(&tx, floor))
                .and_then(|_| tx.commit())
                .map_err(|e| store.classify(e))?;
        }
        store.witness()?;
        tracing::warn!(dir = %dir.display(), floor, "rollback accepted: rounds continue above {floor}");
        Ok(floor)
    }
}
