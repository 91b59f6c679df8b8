//! A connection's inbound streams (the control stream, broadcasts on uni streams) and the cost
//! records written on the control stream.

use std::sync::Arc;

use anchorage_shared::frame::encode_frame;
use anchorage_shared::io::{FrameIoError, read_frame, write_frame};
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::Message;
use tokio::sync::mpsc;

use crate::metrics::ClientMetrics;

/// What a connection's readers hand the client loop.
pub(crate) enum Inbound {
    Message { msg: Message, wire_bytes: u64 },
    Closed(String),
}

pub(super) async fn read_control(mut recv: quinn::RecvStream, tx: mpsc::UnboundedSender<Inbound>, max_frame: usize) {
    loop {
        match read_frame(&mut recv, max_frame).await {
            Ok(Some((msg, n))) => {
                if tx.send(Inbound::Message { msg, wire_bytes: n as u64 }).is_err() {
                    return;
                }
            }
            Ok(None) => {
                let _ = tx.send(Inbound::Closed("server closed the control stream".into()));
                return;
            }
            Err(FrameIoError::Io(e)) => {
                let _ = tx.send(Inbound::Closed(format!("control stream: {e}")));
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, "bad control frame from the server");
                let _ = tx.send(Inbound::Closed(format!("bad control frame: {e}")));
                return;
            }
        }
    }
}

/// Accepts broadcast streams. The wire bytes of a broadcast are the UDP bytes received since the
/// previous broadcast ended (or the connection began) until this one ended: QUIC headers and
/// retransmissions included, plus the little control traffic in between (acks, heartbeats).
/// `mark` is shared with the broadcasts that come as transfers (`crate::broadcasts`).
pub(super) async fn accept_broadcasts(
    conn: quinn::Connection,
    tx: mpsc::UnboundedSender<Inbound>,
    max_frame: usize,
    mark: crate::broadcasts::WireMark,
    metrics: Arc<ClientMetrics>,
) {
    while let Ok(mut recv) = conn.accept_uni().await {
        match read_frame(&mut recv, max_frame).await {
            Ok(Some((msg, _))) => {
                let wire_bytes = mark.take(&conn);
                if tx.send(Inbound::Message { msg, wire_bytes }).is_err() {
                    return;
                }
            }
            Ok(None) => {}
            Err(e) => {
                if !matches!(e, FrameIoError::Io(_)) {
                    metrics.transfer_refused(crate::metrics::DOWN, crate::metrics::MALFORMED);
                }
                tracing::warn!(error = %e, "bad broadcast from the server");
            }
        }
    }
}

/// Sends a round's measured cost to the server's ledger (best effort: the sim keeps its own copy).
pub(super) async fn report_cost(control: &mut quinn::SendStream, record: CostRecord, max_frame: usize) {
    if let Ok(frame) = encode_frame(&Message::Cost(record), max_frame)
        && let Err(e) = write_frame(control, &frame).await
    {
        tracing::debug!(error = %e, "could not report a round's cost");
    }
}
