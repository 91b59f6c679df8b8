//! Rounds, accepted updates and global versions: what the engine commits ([`Persist`]) and
//! what a restarted engine resumes from ([`Recovered`]).

use rusqlite::{OptionalExtension, Transaction, params};

use super::{ServerStore, StoreError, checksum, unix_now};
use crate::engine::{AcceptedUpdate, Checkpoint, OpenedRound, Persist, Recovered, RoundOutcome, RoundReport};
use anchorage_shared::protocol::Update;
use anchorage_shared::tensor::payload_bytes;

/// SQLite integers are signed; counters and rounds stay far below 2^63.
fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

impl ServerStore {
    /// Commits one state change of the engine; returns once it is durable.
    pub fn commit(&self, persist: &Persist) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(|e| self.classify(e))?;
        let result = match persist {
            Persist::Seen { client, fingerprint } => tx
                .execute(
                    "INSERT INTO clients (id, fingerprint, first_seen, last_seen) VALUES (?1, ?2, ?3, ?3)
                     ON CONFLICT (id) DO UPDATE SET last_seen = excluded.last_seen,
                       fingerprint = COALESCE(excluded.fingerprint, clients.fingerprint)",
                    params![client, fingerprint, unix_now()],
                )
                .map(|_| ()),
            Persist::Opened(opened) => open_round(&tx, opened),
            Persist::Invited { round, sampled } => reinvite(&tx, *round, sampled),
            Persist::Accepted(accepted) => self.accept(&tx, accepted),
            Persist::Closed { checkpoint, report } => self.close(&tx, checkpoint, report),
            Persist::PassedOver { through } => super::witness::raise_round_floor(&tx, *through),
        };
        result.and_then(|()| tx.commit()).map_err(|e| self.classify(e))?;
        if !matches!(persist, Persist::Seen { .. }) {
            drop(conn);
            self.witness()?;
            conn = self.conn();
        }
        if matches!(persist, Persist::Closed { .. }) {
            // Give the pages retention freed back to the file system; best effort.
            let _ = conn.execute_batch("PRAGMA incremental_vacuum;");
        }
        Ok(())
    }

    /// Stores the first global version (round 0) of a new federation.
    pub fn save_initial(&self, checkpoint: &Checkpoint) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(|e| self.classify(e))?;
        insert_version(&tx, checkpoint).and_then(|()| tx.commit()).map_err(|e| self.classify(e))
    }

    fn accept(&self, tx: &Transaction, a: &AcceptedUpdate) -> rusqlite::Result<()> {
        let body = postcard::to_allocvec(&a.update).map_err(|e| rusqlite::Error::ToSqlConversionFailure(e.into()))?;
        let round = a.update.round;
        // A resend of an update already stored is the same update: keep the first.
        tx.execute(
            "INSERT OR IGNORE INTO updates
               (round, client, num_samples, staleness, arrived_after_ms, payload_bytes, accepted_at, body, checksum)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
            params![
                int(round),
                a.client,
                int(a.update.num_samples),
                int(a.staleness),
                int(a.arrived_after.as_millis() as u64),
                int(payload_bytes(&a.update.blocks) as u64),
                unix_now(),
                body,
                update_checksum(round, &a.client, &body),
            ],
        )?;
        Ok(())
    }

    fn close(&self, tx: &Transaction, checkpoint: &Checkpoint, report: &RoundReport) -> rusqlite::Result<()> {
        let version = checkpoint.round;
        insert_version(tx, checkpoint)?;
        let (status, outcome) = match &report.outcome {
            RoundOutcome::Aggregated => ("aggregated", None),
            RoundOutcome::Failed { reason } => ("failed", Some(reason.as_str())),
        };
        let report_json = serde_json::to_string(report).ok();
        // Buffered versions have no opening row; a synchronous round has one.
        tx.execute(
            "INSERT INTO rounds (round, task, status, target, sampled, opened_at, closed_at, outcome, report, report_checksum)
             VALUES (?1, 0, ?2, ?3, '[]', ?4, ?4, ?5, ?6, ?7)
             ON CONFLICT (round) DO UPDATE SET status = excluded.status, closed_at = excluded.closed_at,
               outcome = excluded.outcome, report = excluded.report, report_checksum = excluded.report_checksum",
            params![
                int(version),
                status,
                int(report.target as u64),
                unix_now(),
                outcome,
                report_json,
                report_json.as_deref().map(|j| report_checksum(version, j))
            ],
        )?;
        tx.execute("UPDATE updates SET closed_in = ?1 WHERE closed_in IS NULL", [int(version)])?;
        self.prune(tx, version)
    }

    /// Retention: drops old versions, old updates' blocks and old ledger rows.
    fn prune(&self, tx: &Transaction, version: u64) -> rusqlite::Result<()> {
        let r = self.retention();
        if r.keep_versions > 0 && version >= r.keep_versions {
            tx.execute("DELETE FROM versions WHERE version <= ?1", [int(version - r.keep_versions)])?;
        }
        if r.keep_update_blocks > 0 && version >= r.keep_update_blocks {
            tx.execute(
                "UPDATE updates SET body = NULL WHERE body IS NOT NULL AND closed_in <= ?1",
                [int(version - r.keep_update_blocks)],
            )?;
        }
        if r.keep_ledger_rounds > 0 && version >= r.keep_ledger_rounds {
            tx.execute("DELETE FROM ledger WHERE round <= ?1", [int(version - r.keep_ledger_rounds)])?;
        }
        Ok(())
    }

    /// The round of the newest global version kept: the round closed last (0 for the initial
    /// model), the model a restarted engine resumes from; `None` before the initial model.
    pub fn newest_version(&self) -> Result<Option<u64>, StoreError> {
        let conn = self.conn();
        let newest: Option<i64> =
            conn.query_row("SELECT MAX(version) FROM versions", [], |r| r.get(0)).map_err(|e| self.classify(e))?;
        Ok(newest.map(|v| v.max(0) as u64))
    }

    /// What a restarted engine resumes from; `None` for a new federation. Every blob read is
    /// checked against its checksum (that the rounds and versions agree was checked when the
    /// store opened, and the folder's lock keeps anyone else from changing them since).
    pub fn recover(&self, method: &str) -> Result<Option<Recovered>, StoreError> {
        let round_floor = self.round_floor()?;
        let Some((version, checkpoint)) = self.recover_checkpoint(method)? else { return Ok(None) };
        let open = self.recover_open_round()?;
        let pending = self.recover_pending()?;
        let last_accepted =
            self.strings("SELECT client FROM updates WHERE closed_in = ?1 AND round = ?1 ORDER BY client", version)?;
        let invitations = self.recover_invitations()?;
        let privacy = self.recover_privacy()?;
        Ok(Some(Recovered { checkpoint, open, pending, last_accepted, round_floor, invitations, privacy }))
    }

    /// The privacy account of the newest round report (`[engine.privacy]`): what ε a restarted
    /// server continues from. A report that fails its checksum stops the start, since the ε
    /// spent would be unknown.
    fn recover_privacy(&self) -> Result<Option<crate::engine::privacy::PrivacyAccount>, StoreError> {
        let row: Option<(i64, String, Option<Vec<u8>>)> = self
            .conn()
            .query_row(
                "SELECT round, report, report_checksum FROM rounds WHERE report IS NOT NULL ORDER BY round DESC LIMIT 1",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()
            .map_err(|e| self.classify(e))?;
        let Some((round, json, sum)) = row else { return Ok(None) };
        if sum.is_some_and(|sum| sum != report_checksum(round.max(0) as u64, &json)) {
            return Err(self.corrupt(format!("round {round}'s report does not match its checksum")));
        }
        let report: RoundReport =
            serde_json::from_str(&json).map_err(|e| self.corrupt(format!("round {round}'s report: {e}")))?;
        Ok(report.privacy)
    }

    /// The newest global version, checked against its checksum, the method and its round.
    fn recover_checkpoint(&self, method: &str) -> Result<Option<(i64, Checkpoint)>, StoreError> {
        let row: Option<(i64, String, Vec<u8>, Vec<u8>)> = self
            .conn()
            .query_row("SELECT version, method, state, checksum FROM versions ORDER BY version DESC LIMIT 1", [], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
            })
            .optional()
            .map_err(|e| self.classify(e))?;
        let Some((version, stored_method, state, sum)) = row else { return Ok(None) };
        if sum != version_checksum(version as u64, &stored_method, &state) {
            return Err(self.corrupt(format!("global version {version} does not match its checksum")));
        }
        if stored_method != method {
            return Err(StoreError::Corrupt {
                path: self.db_path().into(),
                detail: format!("the federation runs `{stored_method}`, this server was started with `{method}`"),
            });
        }
        let checkpoint: Checkpoint = postcard::from_bytes(&state)
            .map_err(|e| self.corrupt(format!("global version {version} does not decode: {e}")))?;
        if checkpoint.round != version as u64 {
            return Err(self.corrupt(format!("global version {version} holds round {}", checkpoint.round)));
        }
        for block in &checkpoint.global {
            block.validate().map_err(|e| self.corrupt(format!("global version {version}: {e}")))?;
        }
        Ok(Some((version, checkpoint)))
    }

    /// The round left open, with its invitations.
    fn recover_open_round(&self) -> Result<Option<OpenedRound>, StoreError> {
        self.conn()
            .query_row("SELECT round, task, target, sampled FROM rounds WHERE status = 'open'", [], |r| {
                Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?, r.get::<_, String>(3)?))
            })
            .optional()
            .map_err(|e| self.classify(e))?
            .map(|(round, task, target, sampled)| {
                let sampled: Vec<String> = serde_json::from_str(&sampled)
                    .map_err(|e| self.corrupt(format!("round {round}'s invitations: {e}")))?;
                Ok(OpenedRound { round: round as u64, task: task as u32, target: target as usize, sampled })
            })
            .transpose()
    }

    /// The accepted updates no version holds yet, each checked against its checksum and round.
    fn recover_pending(&self) -> Result<Vec<AcceptedUpdate>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT round, client, staleness, arrived_after_ms, body, checksum FROM updates
                 WHERE closed_in IS NULL ORDER BY round, client",
            )
            .map_err(|e| self.classify(e))?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, i64>(3)?,
                    r.get::<_, Option<Vec<u8>>>(4)?,
                    r.get::<_, Vec<u8>>(5)?,
                ))
            })
            .and_then(|rows| rows.collect::<rusqlite::Result<Vec<_>>>())
            .map_err(|e| self.classify(e))?;
        let mut pending = Vec::with_capacity(rows.len());
        for (round, client, staleness, arrived_ms, body, sum) in rows {
            let what = format!("{client}'s update for round {round}");
            let body = body.ok_or_else(|| self.corrupt(format!("{what} is pending but has no blocks")))?;
            if sum != update_checksum(round as u64, &client, &body) {
                return Err(self.corrupt(format!("{what} does not match its checksum")));
            }
            let update: Update =
                postcard::from_bytes(&body).map_err(|e| self.corrupt(format!("{what} does not decode: {e}")))?;
            if update.round != round as u64 {
                return Err(self.corrupt(format!("{what} holds round {}", update.round)));
            }
            pending.push(AcceptedUpdate {
                client,
                update,
                staleness: staleness as u64,
                arrived_after: std::time::Duration::from_millis(arrived_ms as u64),
            });
        }
        Ok(pending)
    }

    /// The recent rounds' invitations, oldest first, each with the clients that reported its cost.
    fn recover_invitations(&self) -> Result<crate::engine::Invitations, StoreError> {
        // The connection is let go before `strings` takes it again.
        let recent = {
            let conn = self.conn();
            let mut stmt = conn
                .prepare("SELECT round, sampled FROM rounds WHERE sampled != '[]' ORDER BY round DESC LIMIT ?1")
                .map_err(|e| self.classify(e))?;
            stmt.query_map([crate::engine::INVITATIONS_KEPT as i64], |r| {
                Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?))
            })
            .and_then(|rows| rows.collect::<rusqlite::Result<Vec<_>>>())
            .map_err(|e| self.classify(e))?
        };
        let mut invitations = Vec::with_capacity(recent.len());
        for (round, sampled) in recent.into_iter().rev() {
            let invited: Vec<String> = serde_json::from_str(&sampled)
                .map_err(|e| self.corrupt(format!("round {round}'s invitations: {e}")))?;
            let reported = self.strings("SELECT client FROM ledger WHERE round = ?1 AND kind = 'reported'", round)?;
            invitations.push((round.max(0) as u64, invited, reported));
        }
        Ok(invitations)
    }

    /// The first column of `sql`'s rows, with `?1` bound to `param`.
    fn strings(&self, sql: &str, param: i64) -> Result<Vec<String>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached(sql).map_err(|e| self.classify(e))?;
        stmt.query_map([param], |r| r.get::<_, String>(0))
            .and_then(|rows| rows.collect::<rusqlite::Result<Vec<_>>>())
            .map_err(|e| self.classify(e))
    }

    /// Rounds and versions must tell one story: the newest version is the newest closed round,
    /// at most one round is open and it is the next one. A database edited by hand (a round
    /// number changed, versions deleted) fails here, at start.
    pub(super) fn check_consistency(&self) -> Result<(), StoreError> {
        let conn = self.conn();
        let q = |sql: &str| conn.query_row(sql, [], |r| r.get::<_, Option<i64>>(0)).map_err(|e| self.classify(e));
        let newest_version = q("SELECT MAX(version) FROM versions")?;
        let newest_closed = q("SELECT MAX(round) FROM rounds WHERE status != 'open'")?;
        let open_rounds = q("SELECT COUNT(*) FROM rounds WHERE status = 'open'")?.unwrap_or(0);
        let open_round = q("SELECT MAX(round) FROM rounds WHERE status = 'open'")?;
        let newest_version_or_initial = newest_version.unwrap_or(0);
        if newest_closed.unwrap_or(0) != newest_version_or_initial {
            return Err(self.corrupt(format!(
                "rounds are closed up to {} but the newest global version is {}",
                newest_closed.unwrap_or(0),
                newest_version.map_or("none".to_string(), |v| v.to_string())
            )));
        }
        if open_rounds > 1 {
            return Err(self.corrupt(format!("{open_rounds} rounds are open at once")));
        }
        drop(conn);
        let next = newest_version_or_initial.max(self.round_floor()? as i64) + 1;
        if let Some(open) = open_round
            && open != next
        {
            return Err(self.corrupt(format!(
                "round {open} is open but the newest global version is {newest_version_or_initial}"
            )));
        }
        Ok(())
    }
}

fn open_round(tx: &Transaction, o: &OpenedRound) -> rusqlite::Result<()> {
    let sampled = serde_json::to_string(&o.sampled).map_err(|e| rusqlite::Error::ToSqlConversionFailure(e.into()))?;
    tx.execute(
        "INSERT INTO rounds (round, task, status, target, sampled, opened_at) VALUES (?1, ?2, 'open', ?3, ?4, ?5)",
        params![int(o.round), o.task, int(o.target as u64), sampled, unix_now()],
    )?;
    Ok(())
}

/// The open round's invitations after a decline was replaced.
fn reinvite(tx: &Transaction, round: u64, sampled: &[String]) -> rusqlite::Result<()> {
    let sampled = serde_json::to_string(sampled).map_err(|e| rusqlite::Error::ToSqlConversionFailure(e.into()))?;
    tx.execute("UPDATE rounds SET sampled = ?2 WHERE round = ?1 AND status = 'open'", params![int(round), sampled])?;
    Ok(())
}

fn insert_version(tx: &Transaction, checkpoint: &Checkpoint) -> rusqlite::Result<()> {
    let state = postcard::to_allocvec(checkpoint).map_err(|e| rusqlite::Error::ToSqlConversionFailure(e.into()))?;
    let version = checkpoint.round;
    tx.execute(
        "INSERT INTO versions (version, method, state, checksum, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![
            int(version),
            checkpoint.method,
            state,
            version_checksum(version, &checkpoint.method, &state),
            unix_now()
        ],
    )?;
    Ok(())
}

pub(super) fn update_checksum(round: u64, client: &str, body: &[u8]) -> Vec<u8> {
    checksum(&[b"update", &round.to_le_bytes(), client.as_bytes(), body])
}

pub(super) fn version_checksum(version: u64, method: &str, state: &[u8]) -> Vec<u8> {
    checksum(&[b"version", &version.to_le_bytes(), method.as_bytes(), state])
}

pub(super) fn report_checksum(round: u64, json: &str) -> Vec<u8> {
    checksum(&[b"report", &round.to_le_bytes(), json.as_bytes()])
}

/// Adds the held-out accuracy of round `round`'s new model (`[evaluation]`, computed after the
/// round's close was committed) to its stored report, with a new checksum. A second connection
/// beside the server's (WAL lets them take turns); a report that fails its checksum is left as
/// it is.
pub fn record_held_out_accuracy(db: &std::path::Path, round: u64, accuracy: f64) -> Result<(), StoreError> {
    let sql = |source| StoreError::Sqlite { path: db.into(), error: source };
    let mut conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE).map_err(sql)?;
    conn.busy_timeout(std::time::Duration::from_secs(10)).map_err(sql)?;
    conn.execute_batch("PRAGMA synchronous = FULL;").map_err(sql)?;
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate).map_err(sql)?;
    let row: Option<(String, Option<Vec<u8>>)> = tx
        .query_row(
            "SELECT report, report_checksum FROM rounds WHERE round = ?1 AND report IS NOT NULL",
            [int(round)],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()
        .map_err(sql)?;
    let Some((json, sum)) = row else {
        return Err(StoreError::Corrupt {
            path: db.into(),
            detail: format!("round {round} has no report to annotate"),
        });
    };
    if sum.is_some_and(|sum| sum != report_checksum(round, &json)) {
        return Err(StoreError::Corrupt {
            path: db.into(),
            detail: format!("round {round}'s report fails its checksum"),
        });
    }
    let mut report: RoundReport = serde_json::from_str(&json)
        .map_err(|e| StoreError::Corrupt { path: db.into(), detail: format!("round {round}'s report: {e}") })?;
    report.held_out_accuracy = Some(accuracy);
    let json = serde_json::to_string(&report)
        .map_err(|e| StoreError::Corrupt { path: db.into(), detail: format!("round {round}'s report: {e}") })?;
    tx.execute(
        "UPDATE rounds SET report = ?2, report_checksum = ?3 WHERE round = ?1",
        params![int(round), json, report_checksum(round, &json)],
    )
    .map_err(sql)?;
    tx.commit().map_err(sql)
}

/// The reports of a state folder's closed rounds, read without taking the folder's lock. A
/// report whose checksum does not match is left out with an error line (`anchorage-server check`
/// lists it); one written before schema 2 has no checksum and is read as it is.
pub fn read_round_reports(db: &std::path::Path) -> Result<Vec<RoundReport>, StoreError> {
    let conn = super::open_read_only(db)?;
    let sql = |source| StoreError::Sqlite { path: db.into(), error: source };
    let mut stmt = conn
        .prepare("SELECT round, report, report_checksum FROM rounds WHERE report IS NOT NULL ORDER BY round")
        .map_err(sql)?;
    let rows = stmt
        .query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?, r.get::<_, Option<Vec<u8>>>(2)?)))
        .and_then(|rows| rows.collect::<rusqlite::Result<Vec<_>>>())
        .map_err(sql)?;
    let mut reports = Vec::with_capacity(rows.len());
    for (round, json, sum) in rows {
        if sum.is_some_and(|sum| sum != report_checksum(round.max(0) as u64, &json)) {
            tracing::error!(db = %db.display(), round, "a round report does not match its checksum; left out");
            continue;
        }
        reports.push(
            serde_json::from_str(&json)
                .map_err(|e| StoreError::Corrupt { path: db.into(), detail: format!("round {round}'s report: {e}") })?,
        );
    }
    Ok(reports)
}
