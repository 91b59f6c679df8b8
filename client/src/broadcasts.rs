//! Resumable broadcasts on the device (the server's side is
//! `server/src/transport/broadcasts.rs`, the chunking `anchorage_shared::transfer`). A device
//! that offers [`RESUMABLE_BROADCASTS_ALPN`] (`ClientOptions::resume_broadcasts`) gets each large
//! broadcast as a transfer on a bi stream the server opens: an offer (the broadcast frame's
//! SHA-256, size and round), the device's answer with the bytes of it it holds, and the chunks
//! from there, each checked against its hash before a byte of it is kept.
//!
//! What arrived is kept across reconnects in memory ([`HeldBroadcast`]): one broadcast, the
//! newest the server offered (an offer of another broadcast replaces it; a completed one is
//! handed over and let go). A chunk whose hash is wrong, that leaves a gap or runs past the end,
//! and an offer that names a held transfer with another size or round are refused with a log
//! line and a count in `anchorage_device_transfers_refused_total{direction="down"}` (the device
//! stops the stream) and change nothing held. The completed frame is delivered
//! as a uni-stream broadcast is, with the wire bytes every connection spent on it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anchorage_shared::frame::{decode_frame, encode_frame};
use anchorage_shared::io::{FrameIoError, read_frame, write_frame};
use anchorage_shared::protocol::{Chunk, Message, TransferOffer, TransferResume};
pub use anchorage_shared::transfer::RESUMABLE_BROADCASTS_ALPN;
use anchorage_shared::transfer::{Assembly, MAX_CHUNK_FRAME, TransferError, hex};
use tokio::sync::mpsc;

use crate::metrics::{ClientMetrics, DOWN, MALFORMED};
use crate::transport::{Inbound, Priority, prioritise};

/// The broadcast a device holds part of, kept across its connections.
#[derive(Debug, Default)]
pub struct HeldBroadcast {
    held: Option<Partial>,
}

#[derive(Debug)]
struct Partial {
    assembly: Assembly,
    /// Wire bytes that connections before the current one received while it was on its way.
    earlier_wire: u64,
}

/// What a chunk came to.
#[derive(Debug, PartialEq)]
pub enum Accepted {
    /// Kept; more is to come.
    More,
    /// The last chunk: the whole frame, verified against the offer's hash, and the wire bytes
    /// earlier connections spent on it.
    Whole { frame: Vec<u8>, earlier_wire: u64 },
    /// The device now holds another broadcast (a newer offer came on another stream): this
    /// stream's chunks are not wanted.
    Superseded,
}

impl HeldBroadcast {
    /// Bytes held of `transfer` (0 when another broadcast or none is held).
    pub fn held(&self, transfer: &[u8; 32]) -> u64 {
        self.held.as_ref().filter(|p| &p.assembly.offer.transfer == transfer).map_or(0, |p| p.assembly.held())
    }

    /// Begins or resumes `offer`: the offset to answer with. An offer of another broadcast
    /// replaces what is held (only the newest is kept); one over `max_frame` bytes, or one that
    /// names the held transfer with another size or round, is refused and changes nothing.
    pub fn begin(&mut self, offer: &TransferOffer, max_frame: u64) -> Result<u64, TransferError> {
        if let Some(p) = &self.held
            && p.assembly.offer.transfer == offer.transfer
        {
            let held = &p.assembly.offer;
            if held != offer {
                return Err(TransferError::OfferMismatch {
                    total: offer.total,
                    round: offer.round,
                    held_total: held.total,
                    held_round: held.round,
                });
            }
            return Ok(p.assembly.held());
        }
        let fresh = Assembly::new(offer.clone(), max_frame)?;
        if let Some(dropped) = self.held.replace(Partial { assembly: fresh, earlier_wire: 0 }) {
            tracing::debug!(
                round = dropped.assembly.offer.round,
                held = dropped.assembly.held(),
                "a newer broadcast replaces the part of an older one held"
            );
        }
        Ok(0)
    }

    /// Keeps `chunk` of `transfer` if it is the next one and its bytes match its hash (a refusal
    /// changes nothing held); the last one completes the broadcast, which is then let go.
    pub fn accept(&mut self, transfer: &[u8; 32], chunk: &Chunk) -> Result<Accepted, TransferError> {
        let Some(p) = self.held.as_mut().filter(|p| &p.assembly.offer.transfer == transfer) else {
            return Ok(Accepted::Superseded);
        };
        p.assembly.accept(chunk)?;
        if !p.assembly.is_complete() {
            return Ok(Accepted::More);
        }
        let Some(Partial { assembly, earlier_wire }) = self.held.take() else { return Ok(Accepted::Superseded) };
        // Every chunk matched its hash; a whole that does not match the offer cannot be kept.
        Ok(Accepted::Whole { frame: assembly.finish()?, earlier_wire })
    }

    /// A connection ended: the wire bytes it received since its last broadcast count toward
    /// the one held, if any (it was on its way).
    pub fn connection_lost(&mut self, wire_bytes: u64) {
        if let Some(p) = &mut self.held {
            p.earlier_wire += wire_bytes;
        }
    }
}

/// The UDP bytes a connection had received when its last broadcast was delivered: a
/// broadcast's wire bytes are those received since (QUIC headers, retransmissions and the
/// little control traffic in between included), whichever stream it came on.
#[derive(Debug, Clone)]
pub(crate) struct WireMark(Arc<AtomicU64>);

impl WireMark {
    /// From the start of `conn`.
    pub(crate) fn new(conn: &quinn::Connection) -> Self {
        Self(Arc::new(AtomicU64::new(conn.stats().udp_rx.bytes)))
    }

    /// Bytes received since the mark; the mark moves to now.
    pub(crate) fn take(&self, conn: &quinn::Connection) -> u64 {
        let now = conn.stats().udp_rx.bytes;
        now.saturating_sub(self.0.swap(now, Ordering::Relaxed))
    }

    /// Bytes received since the mark.
    pub(crate) fn since(&self, conn: &quinn::Connection) -> u64 {
        conn.stats().udp_rx.bytes.saturating_sub(self.0.load(Ordering::Relaxed))
    }
}

/// What a device needs to take broadcast transfers on one connection.
pub(crate) struct Receiver {
    pub(crate) conn: quinn::Connection,
    pub(crate) held: Arc<Mutex<HeldBroadcast>>,
    pub(crate) mark: WireMark,
    pub(crate) max_frame: usize,
    /// Whether the answer's stream goes first (`ClientOptions::stream_priorities`).
    pub(crate) priorities: bool,
    /// Where refused and resumed broadcasts are counted.
    pub(crate) metrics: Arc<ClientMetrics>,
}

impl Receiver {
    fn held(&self) -> std::sync::MutexGuard<'_, HeldBroadcast> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Accepts the server's broadcast transfers, one at a time (a newer broadcast resets the
    /// stream of an older one), until the connection ends; each completed broadcast goes to `tx`.
    pub(crate) async fn accept(self, tx: mpsc::UnboundedSender<Inbound>) {
        while let Ok((send, recv)) = self.conn.accept_bi().await {
            if let Some(msg) = self.receive(send, recv).await
                && tx.send(msg).is_err()
            {
                return;
            }
        }
    }

    /// One transfer stream: the offer, the answer, the chunks; the broadcast once whole.
    async fn receive(&self, mut send: quinn::SendStream, mut recv: quinn::RecvStream) -> Option<Inbound> {
        let offer = match read_frame(&mut recv, MAX_CHUNK_FRAME).await {
            Ok(Some((Message::TransferOffer(offer), _))) => offer,
            Ok(Some((other, _))) => {
                return self.refuse(&mut recv, MALFORMED, &format!("a transfer began with {}", other.kind_name()));
            }
            Ok(None) | Err(FrameIoError::Io(_)) => return None,
            Err(e) => return self.refuse(&mut recv, MALFORMED, &e.to_string()),
        };
        let offset = match self.held().begin(&offer, self.max_frame as u64) {
            Ok(offset) => offset,
            Err(e) => return self.refuse(&mut recv, e.reason(), &e.to_string()),
        };
        if offset > 0 {
            self.metrics.transfer_resumed(DOWN);
            tracing::info!(round = offer.round, offset, total = offer.total, "resuming a broadcast");
        }
        // The answer is what the server waits for before it sends a chunk: a control message.
        prioritise(&send, Priority::Control.when(self.priorities));
        let answer = Message::TransferResume(TransferResume { transfer: offer.transfer, offset });
        let frame = encode_frame(&answer, usize::MAX).ok()?;
        write_frame(&mut send, &frame).await.ok()?;
        let _ = send.finish();
        loop {
            let chunk = match read_frame(&mut recv, MAX_CHUNK_FRAME).await {
                Ok(Some((Message::Chunk(chunk), _))) => chunk,
                Ok(Some((other, _))) => {
                    return self.refuse(&mut recv, MALFORMED, &format!("{} inside a transfer", other.kind_name()));
                }
                Ok(None) | Err(FrameIoError::Io(_)) => {
                    let held = self.held().held(&offer.transfer);
                    tracing::info!(
                        round = offer.round,
                        held,
                        total = offer.total,
                        "a broadcast broke off; what arrived is kept"
                    );
                    return None;
                }
                Err(e) => return self.refuse(&mut recv, MALFORMED, &e.to_string()),
            };
            let accepted = self.held().accept(&offer.transfer, &chunk);
            match accepted {
                Ok(Accepted::More) => {}
                Ok(Accepted::Superseded) => return None,
                Ok(Accepted::Whole { frame, earlier_wire }) => return self.deliver(&offer, &frame, earlier_wire),
                Err(e) => {
                    let held = self.held().held(&offer.transfer);
                    let detail = format!("{e} (the {held} bytes held are kept)");
                    return self.refuse(&mut recv, e.reason(), &detail);
                }
            }
        }
    }

    /// A whole broadcast, decoded, with its wire bytes (this connection's since the last
    /// broadcast and what earlier ones spent on it).
    fn deliver(&self, offer: &TransferOffer, frame: &[u8], earlier_wire: u64) -> Option<Inbound> {
        match decode_frame(frame, self.max_frame) {
            Ok(msg) => Some(Inbound::Message { msg, wire_bytes: self.mark.take(&self.conn) + earlier_wire }),
            Err(e) => {
                self.metrics.transfer_refused(DOWN, MALFORMED);
                tracing::warn!(transfer = %hex(&offer.transfer), round = offer.round, error = %e, "bad broadcast from the server");
                None
            }
        }
    }

    /// Refuses a broadcast transfer: a log line saying why, a count under `reason` (one of
    /// `crate::metrics::REFUSAL_REASONS`), and the stream stopped (the server's write fails;
    /// what is held stays held).
    fn refuse(&self, recv: &mut quinn::RecvStream, reason: &'static str, detail: &str) -> Option<Inbound> {
        self.metrics.transfer_refused(DOWN, reason);
        tracing::warn!(reason, %detail, "refused a broadcast transfer from the server");
        let _ = recv.stop(quinn::VarInt::from_u32(1));
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anchorage_shared::transfer::{CHUNK_BYTES, chunks_from, offer, sha256};

    fn frame(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 13 % 251) as u8).collect()
    }

    #[test]
    fn a_broadcast_held_across_connections_resumes_and_counts_every_connections_bytes() {
        let whole = frame(3 * CHUNK_BYTES + 10);
        let offer = offer(&whole, 5);
        let chunks: Vec<Chunk> = chunks_from(&whole, 0).collect();
        let mut held = HeldBroadcast::default();
        assert_eq!(held.begin(&offer, 1 << 30), Ok(0));
        for chunk in &chunks[..2] {
            assert_eq!(held.accept(&offer.transfer, chunk), Ok(Accepted::More));
        }
        held.connection_lost(1000);
        // The next connection: the same offer resumes where the last one broke off.
        assert_eq!(held.begin(&offer, 1 << 30), Ok(2 * CHUNK_BYTES as u64));
        assert_eq!(held.accept(&offer.transfer, &chunks[2]), Ok(Accepted::More));
        let done = held.accept(&offer.transfer, &chunks[3]).unwrap();
        assert_eq!(done, Accepted::Whole { frame: whole, earlier_wire: 1000 });
        assert_eq!(held.held(&offer.transfer), 0, "a completed broadcast is let go");
        held.connection_lost(50);
        assert!(held.held.is_none());
    }

    #[test]
    fn bad_chunks_and_offers_are_refused_and_lose_nothing_held() {
        let whole = frame(2 * CHUNK_BYTES + 10);
        let offer = offer(&whole, 5);
        let chunks: Vec<Chunk> = chunks_from(&whole, 0).collect();
        let mut held = HeldBroadcast::default();
        held.begin(&offer, 1 << 30).unwrap();
        held.accept(&offer.transfer, &chunks[0]).unwrap();
        let kept = CHUNK_BYTES as u64;

        let mut flipped = chunks[1].clone();
        flipped.data[3] ^= 1;
        let e = held.accept(&offer.transfer, &flipped).unwrap_err();
        assert!(e.to_string().contains("do not match its hash"), "{e}");
        let data = vec![1; 100];
        let past = Chunk { offset: whole.len() as u64 - 10, hash: sha256(&data), data };
        let e = held.accept(&offer.transfer, &past).unwrap_err();
        assert!(e.to_string().contains("runs past the end"), "{e}");
        assert_eq!(held.accept(&offer.transfer, &chunks[0]).unwrap_err().reason(), "bad_offset", "a gap");
        assert_eq!(held.held(&offer.transfer), kept, "refused chunks changed nothing held");

        // An offer of the held transfer with another size, and one over the frame limit.
        let mut lying = offer.clone();
        lying.total -= 1;
        let e = held.begin(&lying, 1 << 30).unwrap_err();
        assert_eq!(e.reason(), "bad_offer", "{e}");
        let other = anchorage_shared::transfer::offer(&frame(10), 6);
        assert_eq!(held.begin(&other, 5).unwrap_err().reason(), "too_large");
        assert_eq!(held.held(&offer.transfer), kept, "refused offers changed nothing held");

        // The honest offer resumes and completes.
        assert_eq!(held.begin(&offer, 1 << 30), Ok(kept));
        for chunk in &chunks[1..] {
            held.accept(&offer.transfer, chunk).unwrap();
        }
        assert!(held.held.is_none());
    }

    /// Waits until `count` reaches `want` (the receiver runs on its own task).
    async fn until(count: impl Fn() -> u64, want: u64) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while count() != want {
            assert!(std::time::Instant::now() < deadline, "count {} never reached {want}", count());
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    /// Over QUIC, through the receiver the client runs: a chunk with a wrong hash, an offer the
    /// device holds with another size, and a transfer that begins with something else than an
    /// offer are refused, each counted under its reason, and what is held stays held; an offer
    /// the device holds part of resumes and is counted as resumed.
    #[tokio::test]
    async fn refused_broadcast_transfers_are_counted_by_reason() {
        use anchorage_shared::protocol::Heartbeat;
        let (server, client, _endpoints) = crate::transport::tests::loopback().await;
        let metrics = Arc::new(ClientMetrics::new());
        let held = Arc::new(Mutex::new(HeldBroadcast::default()));
        let receiver = Receiver {
            conn: client.clone(),
            held: held.clone(),
            mark: WireMark::new(&client),
            max_frame: 1 << 30,
            priorities: true,
            metrics: metrics.clone(),
        };
        let (tx, _rx) = mpsc::unbounded_channel();
        let _receiving = tokio::spawn(receiver.accept(tx));
        let whole = frame(2 * CHUNK_BYTES + 10);
        let offer = offer(&whole, 5);
        let chunks: Vec<Chunk> = chunks_from(&whole, 0).collect();
        let write = |msg: Message| encode_frame(&msg, usize::MAX).unwrap();
        let held_now = || held.lock().unwrap().held(&offer.transfer);

        // The offer, the device's answer (offset 0), a good chunk, then one whose hash is wrong.
        let (mut send, mut recv) = server.open_bi().await.unwrap();
        write_frame(&mut send, &write(Message::TransferOffer(offer.clone()))).await.unwrap();
        let answer = read_frame(&mut recv, MAX_CHUNK_FRAME).await.unwrap();
        assert!(matches!(answer, Some((Message::TransferResume(TransferResume { offset: 0, .. }), _))), "{answer:?}");
        write_frame(&mut send, &write(Message::Chunk(chunks[0].clone()))).await.unwrap();
        let mut flipped = chunks[1].clone();
        flipped.data[3] ^= 1;
        write_frame(&mut send, &write(Message::Chunk(flipped))).await.unwrap();
        until(|| metrics.transfers_refused(DOWN, "bad_hash"), 1).await;
        assert_eq!(held_now(), CHUNK_BYTES as u64, "the refused chunk changed nothing held");

        // An offer of the held transfer with another size.
        let mut lying = offer.clone();
        lying.total -= 1;
        let (mut send, _recv) = server.open_bi().await.unwrap();
        write_frame(&mut send, &write(Message::TransferOffer(lying))).await.unwrap();
        until(|| metrics.transfers_refused(DOWN, "bad_offer"), 1).await;

        // A transfer stream that begins with a heartbeat.
        let (mut send, _recv) = server.open_bi().await.unwrap();
        write_frame(&mut send, &write(Message::Heartbeat(Heartbeat { seq: 1 }))).await.unwrap();
        until(|| metrics.transfers_refused(DOWN, MALFORMED), 1).await;

        // The honest offer resumes where the device holds it.
        let (mut send, mut recv) = server.open_bi().await.unwrap();
        write_frame(&mut send, &write(Message::TransferOffer(offer.clone()))).await.unwrap();
        let answer = read_frame(&mut recv, MAX_CHUNK_FRAME).await.unwrap();
        let resumed = TransferResume { transfer: offer.transfer, offset: CHUNK_BYTES as u64 };
        assert!(matches!(&answer, Some((Message::TransferResume(r), _)) if *r == resumed), "{answer:?}");
        let text = metrics.encode_text();
        assert!(text.contains("anchorage_device_transfers_resumed_total{direction=\"down\"} 1"), "{text}");
        assert!(text.contains("anchorage_device_transfers_refused_total{direction=\"down\",reason=\"bad_hash\"} 1"));
        let refused: u64 = crate::metrics::REFUSAL_REASONS.iter().map(|r| metrics.transfers_refused(DOWN, r)).sum();
        assert_eq!(refused, 3, "{text}");
    }

    #[test]
    fn a_newer_broadcast_replaces_the_part_held_of_an_older_one() {
        let (older, newer) = (frame(2 * CHUNK_BYTES), frame(CHUNK_BYTES + 1));
        let (old_offer, new_offer) = (offer(&older, 1), offer(&newer, 2));
        let mut held = HeldBroadcast::default();
        held.begin(&old_offer, 1 << 30).unwrap();
        held.accept(&old_offer.transfer, &chunks_from(&older, 0).next().unwrap()).unwrap();
        assert_eq!(held.begin(&new_offer, 1 << 30), Ok(0));
        let late = chunks_from(&older, CHUNK_BYTES as u64).next().unwrap();
        assert_eq!(held.accept(&old_offer.transfer, &late), Ok(Accepted::Superseded));
        assert_eq!(held.held(&old_offer.transfer), 0, "one broadcast at most is held");
    }
}
