//! Resumable transfers: a large frame (an update, or a broadcast to a device that
//! negotiated [`RESUMABLE_BROADCASTS_ALPN`]) moves in [`Chunk`]s that each carry
//! their offset and the SHA-256 of their bytes, after a [`TransferOffer`] that names the whole
//! frame by its SHA-256. After a lost connection the receiver answers the same offer with how
//! much it holds ([`TransferResume`]), and the sender goes on from there instead of from zero.
//!
//! This module is the part without I/O, shared by both sides: cutting a frame into chunks
//! ([`chunks_from`]) and putting one together ([`Assembly`]), which refuses a chunk whose hash is
//! wrong, that leaves a gap or runs past the end, and a whole whose hash is not the offer's. A
//! refused chunk changes nothing held.

use alloc::string::String;
use alloc::vec::Vec;

use crate::protocol::{Chunk, TransferOffer, TransferResume};

/// Bytes of frame per chunk: at most this much is sent again after an interruption, for 40
/// bytes of offset and hash (0.06 %).
pub const CHUNK_BYTES: usize = 64 << 10;

/// The largest chunk frame a reader must accept: a full chunk and its header.
pub const MAX_CHUNK_FRAME: usize = CHUNK_BYTES + 256;

/// ALPN id of protocol v1 with resumable broadcasts. A device that takes its broadcasts as
/// transfers offers it ahead of `anchorage/1`; a server that sends them so lists it first, and
/// then sends each broadcast larger than a chunk as a transfer on a bi stream it opens (an
/// offer, the device's answer with what it holds, the chunks from there). Either side without
/// it agrees on `anchorage/1`: the broadcast goes whole on a uni stream, as before. Said in the
/// handshake, not in a message, because the server sends the round's broadcast right behind
/// its welcome: a message after the welcome would come too late for it.
pub const RESUMABLE_BROADCASTS_ALPN: &[u8] = b"anchorage/1+resumable-broadcasts";

/// SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    digest.as_ref().try_into().unwrap_or([0; 32])
}

/// The offer of `frame`, for `round`.
pub fn offer(frame: &[u8], round: u64) -> TransferOffer {
    TransferOffer { transfer: sha256(frame), total: frame.len() as u64, round }
}

/// The chunks of `frame` from `offset` on (none when `offset` is at or past the end).
pub fn chunks_from(frame: &[u8], offset: u64) -> impl Iterator<Item = Chunk> + '_ {
    let start = usize::try_from(offset).unwrap_or(usize::MAX).min(frame.len());
    frame[start..].chunks(CHUNK_BYTES).enumerate().map(move |(i, data)| Chunk {
        offset: (start + i * CHUNK_BYTES) as u64,
        hash: sha256(data),
        data: data.to_vec(),
    })
}

/// Why a chunk or a whole transfer was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TransferError {
    /// A chunk whose bytes do not hash to its hash.
    #[error("chunk at offset {offset}: its bytes do not match its hash")]
    ChunkHash {
        /// Where the chunk starts, in bytes.
        offset: u64,
    },
    /// A chunk that does not start where the held bytes end.
    #[error("chunk at offset {offset}: {held} bytes are held, so the next chunk starts there")]
    Gap {
        /// Where the chunk starts, in bytes.
        offset: u64,
        /// Bytes held.
        held: u64,
    },
    /// A chunk (or held bytes, at offset 0) running past the offer's total.
    #[error("chunk at offset {offset} of {len} bytes runs past the end of the {total}-byte transfer")]
    PastEnd {
        /// Where the chunk starts, in bytes.
        offset: u64,
        /// The chunk's length in bytes.
        len: u64,
        /// Bytes of the whole transfer.
        total: u64,
    },
    /// A complete transfer whose bytes do not hash to the offer's SHA-256.
    #[error("the {total} bytes received do not hash to the offered transfer")]
    WholeHash {
        /// Bytes received.
        total: u64,
    },
    /// An offer larger than the receiver takes.
    #[error("an offer of {total} bytes is over the limit of {max}")]
    TooLarge {
        /// Bytes offered.
        total: u64,
        /// The largest transfer taken, in bytes.
        max: u64,
    },
    /// A resume answer past the end of the offered transfer.
    #[error("an answer resumes at offset {offset}, past the end of the {total}-byte transfer")]
    ResumePastEnd {
        /// Where the answer resumes, in bytes.
        offset: u64,
        /// Bytes of the whole transfer.
        total: u64,
    },
    /// A resume answer for another transfer.
    #[error("an answer names another transfer than the one offered")]
    OtherTransfer,
    /// An offer whose transfer is held already with another size or round.
    #[error(
        "an offer of {total} bytes for round {round} names a transfer held as {held_total} bytes for round {held_round}"
    )]
    OfferMismatch {
        /// Bytes offered.
        total: u64,
        /// The round offered.
        round: u64,
        /// Bytes of the held transfer.
        held_total: u64,
        /// The round of the held transfer.
        held_round: u64,
    },
}

impl TransferError {
    /// A short name for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::ChunkHash { .. } | Self::WholeHash { .. } => "bad_hash",
            Self::Gap { .. } | Self::PastEnd { .. } | Self::ResumePastEnd { .. } => "bad_offset",
            Self::TooLarge { .. } => "too_large",
            Self::OtherTransfer | Self::OfferMismatch { .. } => "bad_offer",
        }
    }
}

/// A transfer being put together: the offer and the bytes held so far, from its start.
#[derive(Debug, Clone)]
pub struct Assembly {
    /// What is being sent.
    pub offer: TransferOffer,
    held: Vec<u8>,
}

impl Assembly {
    /// An empty assembly of `offer`, refused when it is larger than `max_total` bytes.
    pub fn new(offer: TransferOffer, max_total: u64) -> Result<Self, TransferError> {
        if offer.total > max_total {
            return Err(TransferError::TooLarge { total: offer.total, max: max_total });
        }
        Ok(Self { offer, held: Vec::new() })
    }

    /// An assembly of `offer` that holds `held` already (read back from where a receiver saved
    /// it; the caller checked those bytes), refused when the offer is larger than `max_total`
    /// bytes or `held` runs past its end.
    pub fn resumed(offer: TransferOffer, held: Vec<u8>, max_total: u64) -> Result<Self, TransferError> {
        let mut assembly = Self::new(offer, max_total)?;
        let (len, total) = (held.len() as u64, assembly.offer.total);
        if len > total {
            return Err(TransferError::PastEnd { offset: 0, len, total });
        }
        assembly.held = held;
        Ok(assembly)
    }

    /// The bytes held, from the start.
    pub fn held_bytes(&self) -> &[u8] {
        &self.held
    }

    /// Bytes held, from the start: where the sender resumes.
    pub fn held(&self) -> u64 {
        self.held.len() as u64
    }

    /// Whether every byte is held.
    pub fn is_complete(&self) -> bool {
        self.held() == self.offer.total
    }

    /// Keeps `chunk` if it is the next one and its bytes match its hash; otherwise refuses it
    /// and holds what it held.
    pub fn accept(&mut self, chunk: &Chunk) -> Result<(), TransferError> {
        let (offset, len, total) = (chunk.offset, chunk.data.len() as u64, self.offer.total);
        if offset.saturating_add(len) > total {
            return Err(TransferError::PastEnd { offset, len, total });
        }
        if offset != self.held() {
            return Err(TransferError::Gap { offset, held: self.held() });
        }
        if sha256(&chunk.data) != chunk.hash {
            return Err(TransferError::ChunkHash { offset });
        }
        if self.held.capacity() == 0 {
            // One allocation of the whole size (the offer was bounded), not a doubling series.
            self.held.reserve_exact(usize::try_from(total).unwrap_or(0));
        }
        self.held.extend_from_slice(&chunk.data);
        Ok(())
    }

    /// The whole frame, once complete and its hash is the offer's.
    pub fn finish(self) -> Result<Vec<u8>, TransferError> {
        if !self.is_complete() || sha256(&self.held) != self.offer.transfer {
            return Err(TransferError::WholeHash { total: self.held() });
        }
        Ok(self.held)
    }
}

/// Where the sender of `offer` goes on after the receiver's `answer`: its offset, unless the
/// answer names another transfer or resumes past the end (refused; the sender sends nothing).
pub fn resume_offset(offer: &TransferOffer, answer: &TransferResume) -> Result<u64, TransferError> {
    if answer.transfer != offer.transfer {
        return Err(TransferError::OtherTransfer);
    }
    if answer.offset > offer.total {
        return Err(TransferError::ResumePastEnd { offset: answer.offset, total: offer.total });
    }
    Ok(answer.offset)
}

/// The transfer id as hex, for logs.
pub fn hex(id: &[u8; 32]) -> String {
    id.iter().take(8).map(|b| alloc::format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 % 251) as u8).collect()
    }

    #[test]
    fn a_frame_cut_and_put_together_resumes_where_it_broke_off() {
        let frame = frame(3 * CHUNK_BYTES + 100);
        let offer = offer(&frame, 4);
        let mut first = Assembly::new(offer.clone(), 1 << 30).unwrap();
        for chunk in chunks_from(&frame, 0).take(2) {
            first.accept(&chunk).unwrap();
        }
        assert_eq!(first.held(), 2 * CHUNK_BYTES as u64);
        assert!(!first.is_complete());
        // The connection broke; the sender asks again and goes on from what is held.
        let resumed: Vec<_> = chunks_from(&frame, first.held()).collect();
        assert_eq!(resumed.len(), 2);
        assert_eq!(resumed[0].offset, 2 * CHUNK_BYTES as u64);
        for chunk in &resumed {
            first.accept(chunk).unwrap();
        }
        assert_eq!(first.finish().unwrap(), frame);
        assert_eq!(chunks_from(&frame, frame.len() as u64 + 5).count(), 0, "nothing past the end");
    }

    #[test]
    fn bad_chunks_are_refused_and_change_nothing_held() {
        let frame = frame(2 * CHUNK_BYTES);
        let mut a = Assembly::new(offer(&frame, 1), 1 << 30).unwrap();
        let chunks: Vec<_> = chunks_from(&frame, 0).collect();
        a.accept(&chunks[0]).unwrap();
        let mut flipped = chunks[1].clone();
        flipped.data[10] ^= 1;
        assert_eq!(a.accept(&flipped).unwrap_err().reason(), "bad_hash");
        assert_eq!(a.accept(&chunks[0]).unwrap_err(), TransferError::Gap { offset: 0, held: CHUNK_BYTES as u64 });
        let mut past = chunks[1].clone();
        past.data.extend_from_slice(&[1, 2, 3]);
        past.hash = sha256(&past.data);
        assert!(matches!(a.accept(&past), Err(TransferError::PastEnd { .. })));
        assert_eq!(a.held(), CHUNK_BYTES as u64, "refusals keep what was held");
        a.accept(&chunks[1]).unwrap();
        assert_eq!(a.finish().unwrap(), frame);
    }

    #[test]
    fn a_whole_that_is_not_the_offered_one_and_oversized_offers_are_refused() {
        let frame = frame(1000);
        let mut other = offer(&frame, 1);
        other.transfer[0] ^= 1;
        let mut a = Assembly::new(other, 1 << 30).unwrap();
        a.accept(&chunks_from(&frame, 0).next().unwrap()).unwrap();
        assert!(matches!(a.finish(), Err(TransferError::WholeHash { total: 1000 })));
        let err = Assembly::new(offer(&frame, 1), 999).unwrap_err();
        assert_eq!(err.reason(), "too_large");
    }

    #[test]
    fn an_answer_past_the_end_or_of_another_transfer_is_refused() {
        use alloc::string::ToString;
        let offer = offer(&frame(1000), 1);
        let answer = |offset| TransferResume { transfer: offer.transfer, offset };
        assert_eq!(resume_offset(&offer, &answer(0)), Ok(0));
        assert_eq!(resume_offset(&offer, &answer(1000)), Ok(1000), "all held: nothing left to send");
        let past = resume_offset(&offer, &answer(1001)).unwrap_err();
        assert_eq!(past, TransferError::ResumePastEnd { offset: 1001, total: 1000 });
        assert!(past.to_string().contains("past the end"), "{past}");
        let other = TransferResume { transfer: [7; 32], offset: 0 };
        assert_eq!(resume_offset(&offer, &other), Err(TransferError::OtherTransfer));
    }
}
