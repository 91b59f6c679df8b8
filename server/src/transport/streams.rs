//! The stream I/O of one connection: control frames read in order, one update per upload
//! stream (bounded in size, stall and pace), control messages written in order, and each
//! broadcast on its own uni stream, shared by every recipient and dropped by one that stops
//! reading.

use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::frame::encode_frame;
use anchorage_shared::io::{FrameIoError, Pace, ReadLimits, read_frame_limited, write_frame};
use anchorage_shared::priority::Priority;
use anchorage_shared::protocol::{KIND_PARTIAL, KIND_SECAGG, KIND_UPDATE, Message};
use quinn::VarInt;
use tokio::sync::mpsc;

use super::broadcasts::BroadcastTransfers;
use super::connection::{ConnCtx, refusal_for};
use super::{Input, Outbound};
use crate::engine::ClientId;
use crate::metrics::refusal_reason;

impl ConnCtx {
    /// The control stream carries only small messages.
    pub(super) fn control_limits(&self) -> ReadLimits<'static> {
        let small = (self.limits.max_control_frame as usize).min(self.max_frame);
        ReadLimits {
            max_frame: small,
            max_small: small,
            large_kinds: &[],
            stall: Some(self.limits.read_stall),
            pace: None,
        }
    }

    /// An upload stream carries one update (or, under secure aggregation, one masked vector; from
    /// a relay, one partial aggregate), up to the engine's frame limit.
    fn upload_limits(&self) -> ReadLimits<'static> {
        let small = (self.limits.max_control_frame as usize).min(self.max_frame);
        ReadLimits {
            max_frame: self.max_frame,
            max_small: small,
            large_kinds: &[KIND_UPDATE, KIND_SECAGG, KIND_PARTIAL],
            stall: Some(self.limits.read_stall),
            pace: Some(Pace {
                min_bytes_per_sec: self.limits.min_upload_rate,
                grace: self.limits.read_stall,
                deadline: self.limits.upload_deadline,
            }),
        }
    }

    pub(super) fn count_in(&self, bytes: usize) {
        self.metrics.frame_in(bytes);
    }

    /// Reads control frames until the stream ends. A bad frame closes the connection with a
    /// refusal; returns whether that happened.
    pub(super) async fn read_loop(
        &self,
        mut recv: quinn::RecvStream,
        client: ClientId,
        out: mpsc::UnboundedSender<Outbound>,
    ) -> bool {
        loop {
            match read_frame_limited(&mut recv, &self.control_limits()).await {
                Ok(Some((msg, n))) => {
                    self.count_in(n);
                    if self.inputs.send(Input::Message { conn: self.id, client: client.clone(), msg }).is_err() {
                        return false;
                    }
                }
                Ok(None) => return false,
                Err(e) => return self.bad_frame(&client, &e, &out),
            }
        }
    }

    /// Refuses a bad frame (returns true), or ignores a stream that merely broke off (false).
    fn bad_frame(&self, client: &str, e: &FrameIoError, out: &mpsc::UnboundedSender<Outbound>) -> bool {
        if let FrameIoError::Io(io) = e
            && io.kind() != std::io::ErrorKind::TimedOut
        {
            return false; // the connection went away; nothing to refuse
        }
        let refusal = refusal_for(e);
        self.metrics.decode_error();
        self.metrics.refused(refusal_reason(refusal.reason));
        tracing::warn!(client, error = %e, "bad frame from client");
        let _ = out.send(Outbound::Close(refusal));
        true
    }

    /// Accepts upload streams, one frame each; returns whether a bad one was refused.
    pub(super) async fn accept_uploads(
        &self,
        conn: &quinn::Connection,
        client: ClientId,
        out: mpsc::UnboundedSender<Outbound>,
    ) -> bool {
        while let Ok(mut recv) = conn.accept_uni().await {
            match read_frame_limited(&mut recv, &self.upload_limits()).await {
                Ok(Some((msg, n))) => {
                    self.count_in(n);
                    if self.inputs.send(Input::Message { conn: self.id, client: client.clone(), msg }).is_err() {
                        return false;
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    if self.bad_frame(&client, &e, &out) {
                        return true;
                    }
                }
            }
        }
        false
    }
}

/// Writes what the engine sends one client: control frames in order on the control stream, each
/// broadcast on its own uni stream (a large block never holds up a control message). A client
/// that stops reading is dropped, not buffered for: a write that makes no progress for `stall`
/// closes the connection, and a newer broadcast cancels (resets) one the client has not read
/// yet, so the server holds at most one broadcast's flow-control window per client. With
/// `priorities`, each broadcast's stream gets the priority it came with.
/// A device that takes resumable broadcasts (`transfers`) gets each large one as a transfer
/// (`super::broadcasts`).
pub(super) async fn write_loop(
    conn: quinn::Connection,
    mut control: quinn::SendStream,
    mut out: mpsc::UnboundedReceiver<Outbound>,
    (stall, priorities): (Duration, bool),
    transfers: Option<BroadcastTransfers>,
) {
    let mut unread_broadcast: Option<tokio::sync::oneshot::Sender<()>> = None;
    while let Some(item) = out.recv().await {
        match item {
            Outbound::Control(frame) => match tokio::time::timeout(stall, write_frame(&mut control, &frame)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return,
                Err(_) => return drop_slow_reader(&conn, "control"),
            },
            Outbound::Uni(broadcast, priority) => {
                if let Some(cancel) = unread_broadcast.take() {
                    let _ = cancel.send(());
                }
                let (cancel, cancelled) = tokio::sync::oneshot::channel();
                unread_broadcast = Some(cancel);
                let priority = priority.when(priorities);
                match &transfers {
                    Some(t) if broadcast.resumable() => {
                        tokio::spawn(t.clone().send(conn.clone(), broadcast, priority, cancelled, stall));
                    }
                    _ => {
                        let frame = broadcast.frame.clone();
                        tokio::spawn(send_broadcast(conn.clone(), (frame, priority), cancelled, stall));
                    }
                }
            }
            Outbound::Close(refusal) => {
                if let Ok(frame) = encode_frame(&Message::Refusal(refusal), usize::MAX) {
                    let _ = tokio::time::timeout(Duration::from_secs(1), write_frame(&mut control, &frame)).await;
                    let _ = control.finish();
                    let _ = tokio::time::timeout(Duration::from_secs(1), control.stopped()).await;
                }
                conn.close(VarInt::from_u32(1), b"refused");
                return;
            }
        }
    }
}

/// One broadcast on its own stream, in chunks, each of which must be taken within `stall`. The
/// chunks are slices of the one encoded frame that every recipient shares (`Bytes`): quinn keeps
/// them until they are acknowledged without copying, so a thousand connections that do not read
/// hold one broadcast between them, not a thousand copies of it. The stream gets `priority`
/// (`None`: quinn's default).
async fn send_broadcast(
    conn: quinn::Connection,
    (frame, priority): (Arc<Vec<u8>>, Option<Priority>),
    mut cancelled: tokio::sync::oneshot::Receiver<()>,
    stall: Duration,
) {
    let Ok(mut stream) = conn.open_uni().await else { return };
    prioritise(&stream, priority);
    let frame = bytes::Bytes::from_owner(SharedFrame(frame));
    const CHUNK: usize = 64 << 10;
    for start in (0..frame.len()).step_by(CHUNK) {
        let chunk = frame.slice(start..(start + CHUNK).min(frame.len()));
        tokio::select! {
            written = tokio::time::timeout(stall, stream.write_chunk(chunk)) => match written {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return,
                Err(_) => return drop_slow_reader(&conn, "broadcast"),
            },
            _ = &mut cancelled => {
                let _ = stream.reset(VarInt::from_u32(0));
                return;
            }
        }
    }
    let _ = stream.finish();
    let _ = stream.stopped().await;
}

/// An encoded frame shared by every connection, as the owner of `Bytes` slices.
struct SharedFrame(Arc<Vec<u8>>);

impl AsRef<[u8]> for SharedFrame {
    fn as_ref(&self) -> &[u8] {
        self.0.as_slice()
    }
}

/// Gives `stream` its send priority (`anchorage_shared::priority`); `None` (priorities off)
/// leaves quinn's default, 0 for every stream, which take turns a packet each. Fails only on a
/// stream already finished or reset, which sends nothing more to order.
pub(super) fn prioritise(stream: &quinn::SendStream, priority: Option<Priority>) {
    if let Some(p) = priority {
        let _ = stream.set_priority(p.level());
    }
}

pub(super) fn drop_slow_reader(conn: &quinn::Connection, what: &str) {
    tracing::warn!(remote = %conn.remote_address(), stream = what, "a client that does not read is dropped");
    conn.close(VarInt::from_u32(2), b"not reading");
}
