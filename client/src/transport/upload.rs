//! Uploads: an update (or a masked vector) as a resumable transfer on its own stream, or whole
//! on a uni stream, at its send priority.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anchorage_shared::frame::encode_frame;
use anchorage_shared::io::{FrameIoError, read_frame, write_frame};
use anchorage_shared::priority::Priority;
use anchorage_shared::protocol::Message;
use anchorage_shared::transfer;
use tokio::sync::mpsc;

use super::client::Uploaded;
use crate::metrics::ClientMetrics;
use crate::session::UploadMeasure;

/// Uploads one update as a resumable transfer on its own stream ([`send_resumable`]; with
/// `resume` false, whole on a uni stream), at `priority`, and waits until the server acknowledged
/// every byte at the QUIC level. Reports the round and what the upload took: the UDP bytes sent
/// meanwhile, its seconds and the RTT at its end.
pub(super) async fn upload(
    conn: quinn::Connection,
    (round, msg): (u64, Message),
    max_frame: usize,
    (resume, priority): (bool, Option<Priority>),
    done: mpsc::UnboundedSender<Uploaded>,
    metrics: Arc<ClientMetrics>,
) {
    let frame = match encode_frame(&msg, max_frame) {
        Ok(f) => f,
        Err(e) => {
            tracing::error!(round, error = %e, "update does not fit in a frame");
            return;
        }
    };
    let started = Instant::now();
    let before = conn.stats().udp_tx.bytes;
    let mut attempt = 0;
    loop {
        let sent = if resume {
            send_resumable(&conn, &frame, round, priority, &metrics).await
        } else {
            send_whole(&conn, &frame, priority).await
        };
        match sent {
            Ok(resumed_at) => {
                metrics.uploaded(resumed_at);
                if resumed_at > 0 {
                    tracing::info!(round, resumed_at, total = frame.len(), "upload resumed where the server held it");
                }
                let st = conn.stats();
                tracing::debug!(
                    round,
                    lost_bytes = st.path.lost_bytes,
                    lost_packets = st.path.lost_packets,
                    "upload done"
                );
                let wire_bytes = conn.stats().udp_tx.bytes.saturating_sub(before);
                let _ = done.send((round, UploadMeasure { wire_bytes, transfer: started.elapsed(), rtt: conn.rtt() }));
                return;
            }
            // The server let the stream go (it stalled through an outage) but the connection
            // lives: offer the update again at once; the server answers with what it holds.
            Err(e) if resume && conn.close_reason().is_none() && attempt < UPLOAD_RETRIES => {
                attempt += 1;
                tracing::info!(round, attempt, error = %format!("{e:#}"), "upload stream broke off; offering it again");
                tokio::time::sleep(Duration::from_millis(500 * u64::from(attempt))).await;
            }
            Err(e) => {
                tracing::info!(round, error = %format!("{e:#}"), "upload interrupted; it resumes after reconnecting");
                return;
            }
        }
    }
}

/// The whole frame on a uni stream (`resume_uploads = false`) at `priority`; returns offset 0.
async fn send_whole(conn: &quinn::Connection, frame: &[u8], priority: Option<Priority>) -> anyhow::Result<u64> {
    let mut s = conn.open_uni().await?;
    prioritise(&s, priority);
    s.write_all(frame).await?;
    s.finish()?;
    s.stopped().await?;
    Ok(0)
}

/// Gives `stream` its send priority ([`Priority`]); `None` (priorities off) leaves quinn's
/// default, 0 for every stream, which take turns a packet each. Fails only on a stream already
/// finished or reset, which sends nothing more to order.
pub fn prioritise(stream: &quinn::SendStream, priority: Option<Priority>) {
    if let Some(p) = priority {
        let _ = stream.set_priority(p.level());
    }
}

/// Offers of one update on one live connection, after the first, before waiting for a new
/// connection (each resumes where the server holds it, so a retry costs little).
const UPLOAD_RETRIES: u32 = 20;

/// Sends `frame` (an encoded update of `round`) as a resumable transfer
/// (`anchorage_shared::transfer`): offers it by hash and size on a new bi stream, and sends its
/// chunks from where the server's answer says it holds them, at `priority` (`None`: quinn's
/// default). Returns that offset; a refused answer of the server is counted in `metrics`.
pub async fn send_resumable(
    conn: &quinn::Connection,
    frame: &[u8],
    round: u64,
    priority: Option<Priority>,
    metrics: &ClientMetrics,
) -> anyhow::Result<u64> {
    let offer = transfer::offer(frame, round);
    let (mut send, mut recv) = conn.open_bi().await?;
    prioritise(&send, priority);
    write_frame(&mut send, &encode_frame(&Message::TransferOffer(offer.clone()), usize::MAX)?).await?;
    let answer = read_frame(&mut recv, transfer::MAX_CHUNK_FRAME).await;
    let offset = resume_answer(&offer, answer, metrics)?;
    for chunk in transfer::chunks_from(frame, offset) {
        send.write_all(&encode_frame(&Message::Chunk(chunk), usize::MAX)?).await?;
    }
    send.finish()?;
    send.stopped().await?;
    Ok(offset)
}

/// Where an upload goes on after the server's `answer` to `offer`: its offset, unless the
/// answer is refused (another transfer, an offset past the end: `TransferError::reason`; not a
/// `TransferResume`, or a frame that does not decode: `malformed`), which is logged and counted
/// in `metrics`. A stream that ended is an error, not a refusal.
pub(super) fn resume_answer(
    offer: &anchorage_shared::protocol::TransferOffer,
    answer: Result<Option<(Message, usize)>, FrameIoError>,
    metrics: &ClientMetrics,
) -> anyhow::Result<u64> {
    let refused = match answer {
        Ok(Some((Message::TransferResume(r), _))) => match transfer::resume_offset(offer, &r) {
            Ok(offset) => return Ok(offset),
            Err(e) => (e.reason(), e.to_string()),
        },
        Ok(Some((other, _))) => (crate::metrics::MALFORMED, format!("a {} instead of an answer", other.kind_name())),
        Ok(None) => anyhow::bail!("the server ended the upload's stream without an answer"),
        Err(FrameIoError::Io(e)) => anyhow::bail!("reading the answer to the upload's offer: {e}"),
        Err(e) => (crate::metrics::MALFORMED, e.to_string()),
    };
    let (reason, detail) = refused;
    metrics.transfer_refused(crate::metrics::UP, reason);
    tracing::warn!(round = offer.round, reason, %detail, "refused the server's answer to an upload");
    anyhow::bail!("refused the server's answer to the upload's offer ({reason}): {detail}")
}
