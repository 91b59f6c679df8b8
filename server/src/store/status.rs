//! What the metrics replay at start, so that they survive a restart: when each client was last
//! seen and when the last round closed. A hello records "seen" through the engine
//! ([`crate::engine::Persist::Seen`]); the transport records a client's last message when its
//! connection ends (and at shutdown), so that a device that went silent is not taken for one
//! silent since its hello.

use rusqlite::OptionalExtension;

use super::{ServerStore, StoreError};

impl ServerStore {
    /// Every client of the registry and when it last said a hello (Unix seconds).
    pub fn clients_last_seen(&self) -> Result<Vec<(String, i64)>, StoreError> {
        let conn = self.conn();
        let rows = conn
            .prepare("SELECT id, last_seen FROM clients ORDER BY id")
            .and_then(|mut q| q.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect::<Result<Vec<_>, _>>())
            .map_err(|e| self.classify(e))?;
        Ok(rows)
    }

    /// When the last round closed (Unix seconds); `None` before the first.
    pub fn last_round_closed_at(&self) -> Result<Option<i64>, StoreError> {
        let conn = self.conn();
        let at: Option<Option<i64>> = conn
            .query_row("SELECT MAX(closed_at) FROM rounds WHERE closed_at IS NOT NULL", [], |r| r.get(0))
            .optional()
            .map_err(|e| self.classify(e))?;
        Ok(at.flatten())
    }

    /// Moves clients' last-seen times forward (never back) to when they were last heard from;
    /// clients not in the registry are left out.
    pub fn touch_clients(&self, seen: &[(String, i64)]) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(|e| self.classify(e))?;
        for (id, at) in seen {
            tx.execute("UPDATE clients SET last_seen = MAX(last_seen, ?2) WHERE id = ?1", rusqlite::params![id, at])
                .map_err(|e| self.classify(e))?;
        }
        tx.commit().map_err(|e| self.classify(e))
    }
}
