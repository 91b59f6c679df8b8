//! Resumable broadcasts (the chunking is `anchorage_shared::transfer`). A device that
//! negotiated [`RESUMABLE_BROADCASTS_ALPN`] gets each broadcast larger than one chunk as a
//! transfer on a bi stream the server opens: the server offers the broadcast frame by its
//! SHA-256 and size, the device answers with the bytes of it it holds from a connection that
//! broke, and the server sends the chunks from there. Other devices (the clients before it, and
//! a broadcast of one chunk or less, where nothing could be resumed) get it whole on a uni stream.
//!
//! A broadcast is encoded once for every device ([`SharedBroadcast`]), and its transfer form
//! (the offer and every chunk's frame, hashes included) is made once too, by the first
//! connection that needs it; each connection then writes `Bytes` slices of that one buffer, as
//! the uni streams do with the frame.

use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::frame::encode_frame;
use anchorage_shared::io::{FrameIoError, read_frame, write_frame};
use anchorage_shared::priority::Priority;
use anchorage_shared::protocol::{Message, TransferOffer};
use anchorage_shared::transfer::{CHUNK_BYTES, RESUMABLE_BROADCASTS_ALPN, chunks_from, hex, offer, resume_offset};
use bytes::Bytes;
use quinn::VarInt;
use tokio::sync::{OnceCell, oneshot};

use super::ServerMetrics;
use super::streams::{drop_slow_reader, prioritise};

/// One broadcast as every recipient shares it: the encoded frame, and its transfer form once a
/// connection has asked for it.
#[derive(Debug)]
pub(super) struct SharedBroadcast {
    pub(super) frame: Arc<Vec<u8>>,
    round: u64,
    chunked: OnceCell<Arc<Chunked>>,
}

/// A broadcast cut into chunks: the offer and every chunk's frame, back to back.
#[derive(Debug)]
struct Chunked {
    offer: TransferOffer,
    offer_frame: Vec<u8>,
    frames: Bytes,
    /// Where each chunk's frame starts in `frames`.
    starts: Vec<usize>,
}

impl Chunked {
    fn new(frame: &[u8], round: u64) -> Self {
        let offer = offer(frame, round);
        let offer_frame = encode_frame(&Message::TransferOffer(offer.clone()), usize::MAX).unwrap_or_default();
        let mut frames = Vec::with_capacity(frame.len() + frame.len() / CHUNK_BYTES * 64 + 64);
        let mut starts = Vec::new();
        for chunk in chunks_from(frame, 0) {
            starts.push(frames.len());
            frames.extend_from_slice(&encode_frame(&Message::Chunk(chunk), usize::MAX).unwrap_or_default());
        }
        Self { offer, offer_frame, frames: Bytes::from(frames), starts }
    }

    /// The chunk frames from `offset` on: a slice of the shared buffer when `offset` is where a
    /// chunk starts (every resume of a transfer this server cut), else cut again for this one.
    fn from(&self, frame: &[u8], offset: u64) -> Bytes {
        let index = usize::try_from(offset).unwrap_or(usize::MAX) / CHUNK_BYTES;
        if offset.is_multiple_of(CHUNK_BYTES as u64) && index <= self.starts.len() {
            let start = self.starts.get(index).copied().unwrap_or(self.frames.len());
            return self.frames.slice(start..);
        }
        let mut frames = Vec::new();
        for chunk in chunks_from(frame, offset) {
            frames.extend_from_slice(&encode_frame(&Message::Chunk(chunk), usize::MAX).unwrap_or_default());
        }
        Bytes::from(frames)
    }
}

impl SharedBroadcast {
    pub(super) fn new(frame: Arc<Vec<u8>>, round: u64) -> Self {
        Self { frame, round, chunked: OnceCell::new() }
    }

    /// Whether a device that takes transfers gets this one as a transfer: it is larger than a
    /// chunk (a smaller one has nothing to resume, and the offer would cost a round trip).
    pub(super) fn resumable(&self) -> bool {
        self.frame.len() > CHUNK_BYTES
    }

    /// The transfer form, made once (off the async threads) by the first connection to ask.
    async fn chunked(&self) -> Option<Arc<Chunked>> {
        let chunked = self
            .chunked
            .get_or_try_init(|| async {
                let (frame, round) = (self.frame.clone(), self.round);
                tokio::task::spawn_blocking(move || Arc::new(Chunked::new(&frame, round))).await
            })
            .await;
        chunked.ok().cloned()
    }
}

/// Whether `conn`'s device negotiated resumable broadcasts.
pub(super) fn takes_transfers(conn: &quinn::Connection) -> bool {
    conn.handshake_data()
        .and_then(|data| data.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|data| data.protocol)
        .is_some_and(|alpn| alpn == RESUMABLE_BROADCASTS_ALPN)
}

/// How one broadcast transfer ended.
enum Sent {
    /// Every chunk is written and acknowledged (`resumed_at`: the offset the device answered).
    Whole { resumed_at: u64 },
    /// The device refused, or answered what the server refuses (the connection is closed).
    Refused,
    /// The stream or the connection broke off (the device keeps what arrived), or stalled.
    BrokeOff,
}

/// Sends broadcasts as transfers to one connection's device.
#[derive(Clone)]
pub(super) struct BroadcastTransfers {
    pub(super) metrics: Arc<ServerMetrics>,
}

impl BroadcastTransfers {
    /// One broadcast as a transfer on a new bi stream at `priority` (`None`: quinn's default); a
    /// newer broadcast (`cancelled`) resets it. Each write must be taken within `stall`.
    pub(super) async fn send(
        self,
        conn: quinn::Connection,
        broadcast: Arc<SharedBroadcast>,
        priority: Option<Priority>,
        mut cancelled: oneshot::Receiver<()>,
        stall: Duration,
    ) {
        let Ok((mut send, mut recv)) = conn.open_bi().await else { return };
        prioritise(&send, priority);
        let sent = tokio::select! {
            sent = self.transfer(&conn, &mut send, &mut recv, &broadcast, stall) => Some(sent),
            _ = &mut cancelled => None,
        };
        match sent {
            None => {
                let _ = send.reset(VarInt::from_u32(0));
            }
            Some(Sent::Whole { resumed_at }) => {
                self.metrics.transfer("broadcast_completed");
                if resumed_at > 0 {
                    tracing::info!(
                        remote = %conn.remote_address(),
                        round = broadcast.round,
                        resumed_at,
                        total = broadcast.frame.len(),
                        "a device resumed a broadcast where it held it"
                    );
                }
            }
            Some(Sent::Refused | Sent::BrokeOff) => {}
        }
    }

    /// The offer, the device's answer, the chunks from there.
    async fn transfer(
        &self,
        conn: &quinn::Connection,
        send: &mut quinn::SendStream,
        recv: &mut quinn::RecvStream,
        broadcast: &SharedBroadcast,
        stall: Duration,
    ) -> Sent {
        let Some(chunked) = broadcast.chunked().await else { return Sent::BrokeOff };
        match tokio::time::timeout(stall, write_frame(send, &chunked.offer_frame)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Sent::BrokeOff,
            Err(_) => {
                drop_slow_reader(conn, "broadcast");
                return Sent::BrokeOff;
            }
        }
        let offset = match tokio::time::timeout(stall, read_frame(recv, 1024)).await {
            Ok(Ok(Some((Message::TransferResume(answer), _)))) => match resume_offset(&chunked.offer, &answer) {
                Ok(offset) => offset,
                Err(e) => return self.refuse(conn, &chunked.offer, &e.to_string()),
            },
            Ok(Ok(Some((other, _)))) => {
                let detail = format!("answered a broadcast's offer with {}", other.kind_name());
                return self.refuse(conn, &chunked.offer, &detail);
            }
            // The device stopped the stream (it refused the offer: its log says why), the
            // stream or the connection broke off, or the answer did not come.
            Ok(Ok(None) | Err(FrameIoError::Io(_))) | Err(_) => return Sent::BrokeOff,
            Ok(Err(e)) => return self.refuse(conn, &chunked.offer, &e.to_string()),
        };
        if offset > 0 {
            self.metrics.transfer("broadcast_resumed");
        }
        let rest = chunked.from(&broadcast.frame, offset);
        for start in (0..rest.len()).step_by(CHUNK_BYTES) {
            let piece = rest.slice(start..(start + CHUNK_BYTES).min(rest.len()));
            match tokio::time::timeout(stall, send.write_chunk(piece)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return Sent::BrokeOff,
                Err(_) => {
                    drop_slow_reader(conn, "broadcast");
                    return Sent::BrokeOff;
                }
            }
        }
        let _ = send.finish();
        match send.stopped().await {
            Ok(_) => Sent::Whole { resumed_at: offset },
            Err(_) => Sent::BrokeOff,
        }
    }

    /// A device's answer the server refuses (past the end, another transfer, unreadable):
    /// counted, logged, and the connection closed with the reason.
    fn refuse(&self, conn: &quinn::Connection, offer: &TransferOffer, detail: &str) -> Sent {
        self.metrics.transfer("broadcast_refused");
        tracing::warn!(
            remote = %conn.remote_address(),
            transfer = %hex(&offer.transfer),
            total = offer.total,
            %detail,
            "a device's answer to a broadcast's offer is refused; closing its connection"
        );
        let reason = format!("broadcast transfer refused: {detail}");
        conn.close(VarInt::from_u32(1), &reason.as_bytes()[..reason.len().min(200)]);
        Sent::Refused
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anchorage_shared::frame::decode_frame;
    use anchorage_shared::transfer::Assembly;

    #[test]
    fn chunk_frames_cut_once_resume_at_any_offset() {
        let frame: Vec<u8> = (0..3 * CHUNK_BYTES + 77).map(|i| (i % 251) as u8).collect();
        let chunked = Chunked::new(&frame, 4);
        assert_eq!(chunked.starts.len(), 4);
        for offset in [0, CHUNK_BYTES as u64, 3 * CHUNK_BYTES as u64, 100, frame.len() as u64] {
            let mut assembly = Assembly::new(chunked.offer.clone(), u64::MAX).unwrap();
            let mut held: Vec<u8> = frame[..offset as usize].to_vec();
            let rest = chunked.from(&frame, offset);
            let mut at = 0;
            while at < rest.len() {
                let len = u32::from_le_bytes(rest[at..at + 4].try_into().unwrap()) as usize;
                let Message::Chunk(chunk) = decode_frame(&rest[at..at + 4 + len], usize::MAX).unwrap() else {
                    panic!("a chunk frame")
                };
                assert_eq!(chunk.offset, held.len() as u64, "in order, from {offset}");
                held.extend_from_slice(&chunk.data);
                at += 4 + len;
            }
            assert_eq!(held, frame, "from {offset}");
            if offset == 0 {
                for chunk in chunks_from(&frame, 0) {
                    assembly.accept(&chunk).unwrap();
                }
                assert_eq!(assembly.finish().unwrap(), frame);
            }
        }
    }
}
