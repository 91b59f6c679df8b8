//! Carrying out the session's actions: messages, training off the async threads, uploads, the
//! store.

use std::time::Duration;

use anchorage_shared::frame::encode_frame;
use anchorage_shared::io::write_frame;
use anchorage_shared::priority::Priority;
use anchorage_shared::protocol::{Broadcast, Goodbye, Message, RefusalReason};
use anyhow::Context;

use super::super::device_state::save_device_state;
use super::super::refusal::RefusalKind;
use super::super::streams::report_cost;
use super::super::upload::upload;
use super::{Client, ClientEvent, Ended};
use crate::eligibility::Readings;
use crate::session::SessionAction;

impl Client {
    /// One session action; `Some` when it ends the connection (a failed write) or the client.
    pub(super) async fn act(
        &mut self,
        action: SessionAction,
        conn: &quinn::Connection,
        control: &mut quinn::SendStream,
        tasks: &mut tokio::task::JoinSet<()>,
    ) -> anyhow::Result<Option<Ended>> {
        let max_frame = self.options.max_frame_bytes;
        match action {
            // Best effort: the session sends a record again after each welcome until the
            // server's ledger confirms it.
            SessionAction::Send(Message::Cost(record)) => report_cost(control, record, max_frame).await,
            SessionAction::Send(msg) => {
                let frame = encode_frame(&msg, max_frame)?;
                if let Err(e) = write_frame(control, &frame).await {
                    return Ok(Some(Ended::Lost(format!("control stream: {e}"))));
                }
            }
            SessionAction::Train(b) => self.train(b),
            SessionAction::Upload(update) => {
                let priority = Priority::of_update(&update);
                self.start_upload(update.round, Message::Update(update), priority, conn, tasks)
            }
            // A masked vector is as large as an update and travels the same way.
            SessionAction::UploadMasked { round, msg } => self.start_upload(round, msg, Priority::Blocks, conn, tasks),
            SessionAction::Cost(record) => self.report(record),
            SessionAction::Persist(update) => {
                if let Some(store) = &self.options.store {
                    store.save_pending(update.as_ref()).context("persisting the update")?;
                }
            }
            SessionAction::SetAsidePending { round, reason } => {
                // Not fatal: the session does not resend it either way; a file left in place is
                // resent (and refused again) only after a restart.
                if let Some(store) = &self.options.store
                    && let Err(e) = store.set_aside_pending(&format!("round {round} refused: {reason}"))
                {
                    tracing::warn!(client = %self.options.client_id, round, error = %e, "could not set the refused update aside");
                }
            }
            SessionAction::Finished { reason } => {
                if let Ok(frame) = encode_frame(&Message::Goodbye(Goodbye { reason: "done".into() }), max_frame) {
                    let _ = write_frame(control, &frame).await;
                    let _ = control.finish();
                }
                conn.close(quinn::VarInt::from_u32(0), b"done");
                if let Some(refusal) = self.session.refusal() {
                    let kind = match refusal.reason {
                        RefusalReason::Revoked => RefusalKind::Revoked,
                        RefusalReason::NotEnrolled => RefusalKind::NotEnrolled,
                        _ => RefusalKind::Incompatible,
                    };
                    let refused = self.refusal(kind, format!("{:?}: {}", refusal.reason, refusal.detail));
                    self.endpoint.wait_idle(Duration::from_secs(1)).await;
                    return Ok(Some(Ended::Refused(refused)));
                }
                self.emit(ClientEvent::Finished { reason: reason.clone() });
                self.endpoint.wait_idle(Duration::from_secs(1)).await;
                return Ok(Some(Ended::Exit(reason)));
            }
        }
        Ok(None)
    }

    /// Trains on `b` on a blocking thread (the result comes back on `trained`, with what the
    /// device read of itself right after), unless the device's `[eligibility]` says it should
    /// not train now: then the session declines the round with the reason.
    pub(in crate::transport) fn train(&mut self, b: Broadcast) {
        let round = b.round;
        let eligible = match &self.options.sys_root {
            // `eligibility::check_now`, keeping the count of the values the reading refused.
            Some(root) if self.options.eligibility.is_enabled() => {
                let readings = Readings::read(root);
                self.options.metrics.readings_refused(readings.errors.len());
                let now = crate::eligibility::utc_minutes(std::time::SystemTime::now());
                crate::eligibility::decide(&self.options.eligibility, &readings, now)
            }
            _ => Ok(()),
        };
        if let Err(decline) = eligible {
            self.options.metrics.declined(decline.kind());
            self.session.declined(round, decline.kind(), &decline.to_string());
            self.emit(ClientEvent::Declined { round, reason: decline.kind() });
            return;
        }
        let (method, tx, store) = (self.method.clone(), self.trained.clone(), self.options.store.clone());
        let root = self.options.sys_root.clone();
        tokio::task::spawn_blocking(move || {
            let result = match method.lock() {
                Ok(mut m) => {
                    // The one measurement of the round's compute time on this clock.
                    let result = m
                        .train_measured(&b)
                        .map(|(trained, compute)| (trained, compute, root.as_ref().map(Readings::read)))
                        .map_err(|e| e.to_string());
                    if let (Ok(_), Some(store)) = (&result, &store) {
                        save_device_state(store, &**m, round);
                    }
                    result
                }
                Err(_) => Err("a previous training run panicked".to_string()),
            };
            let _ = tx.send((round, result));
        });
    }

    /// Starts the upload of `update` unless the same round's is still going on this connection.
    fn start_upload(
        &mut self,
        round: u64,
        msg: Message,
        priority: Priority,
        conn: &quinn::Connection,
        tasks: &mut tokio::task::JoinSet<()>,
    ) {
        if self.uploading.get(&round).is_some_and(|task| !task.is_finished()) {
            tracing::debug!(round, "the round's update is already being uploaded");
            return;
        }
        let (max_frame, resume) = (self.options.max_frame_bytes, self.options.resume_uploads);
        let priority = priority.when(self.options.stream_priorities);
        let (done, metrics) = (self.uploaded.clone(), self.options.metrics.clone());
        let task = tasks.spawn(upload(conn.clone(), (round, msg), max_frame, (resume, priority), done, metrics));
        self.uploading.retain(|_, t| !t.is_finished());
        self.uploading.insert(round, task);
    }
}
