//! Framing: `u32` little-endian length, then version byte, kind byte and postcard body.
//!
//! The length counts everything after itself. A reader refuses a frame whose declared length
//! exceeds its maximum before buffering it, so a peer cannot make it allocate unbounded memory.

use alloc::vec::Vec;

use crate::protocol::{DecodeError, Message, PROTOCOL_VERSION};

/// Bytes of the length prefix.
pub const LEN_BYTES: usize = 4;
/// Bytes after the length and before the body: version and kind.
pub const HEADER_BYTES: usize = 2;
/// Default largest frame (64 MiB): room for big parameter blocks, bounded for safety.
pub const DEFAULT_MAX_FRAME: usize = 64 * 1024 * 1024;

/// Errors of the framing layer are decode errors.
pub type FrameError = DecodeError;

/// Encodes one message as a complete frame. Fails only if the frame would exceed `max_frame`.
pub fn encode_frame(msg: &Message, max_frame: usize) -> Result<Vec<u8>, FrameError> {
    let body = msg.encode_body();
    let len = HEADER_BYTES + body.len();
    if len > max_frame || len > u32::MAX as usize {
        return Err(DecodeError::Oversized { len, max: max_frame });
    }
    let mut out = Vec::with_capacity(LEN_BYTES + len);
    out.extend_from_slice(&(len as u32).to_le_bytes());
    out.push(PROTOCOL_VERSION);
    out.push(msg.kind());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes exactly one complete frame from `bytes` (which must hold nothing else).
pub fn decode_frame(bytes: &[u8], max_frame: usize) -> Result<Message, FrameError> {
    let mut reader = FrameReader::new(max_frame);
    reader.push(bytes);
    match reader.next_frame()? {
        Some(msg) if reader.buffered() == 0 => Ok(msg),
        Some(_) => Err(DecodeError::Invalid(alloc::format!("{} trailing bytes after the frame", reader.buffered()))),
        None => Err(reader.truncation()),
    }
}

/// Incremental frame reader: push bytes as they arrive, pull whole messages out (sans-IO).
#[derive(Debug)]
pub struct FrameReader {
    buf: Vec<u8>,
    max_frame: usize,
}

impl FrameReader {
    /// A reader that refuses frames declaring more than `max_frame` bytes.
    pub fn new(max_frame: usize) -> Self {
        Self { buf: Vec::new(), max_frame }
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes received but not yet consumed.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Length the next frame declares, once its prefix has arrived; checked against the maximum.
    pub fn pending_len(&self) -> Result<Option<usize>, FrameError> {
        if self.buf.len() < LEN_BYTES {
            return Ok(None);
        }
        let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        if len > self.max_frame {
            return Err(DecodeError::Oversized { len, max: self.max_frame });
        }
        if len < HEADER_BYTES {
            return Err(DecodeError::Truncated { needed: HEADER_BYTES, have: len });
        }
        Ok(Some(len))
    }

    /// Checks a length prefix against the maximum without keeping it (for readers that buffer
    /// the frame themselves).
    pub fn push_and_check(&mut self, prefix: &[u8]) -> Result<(), FrameError> {
        self.buf.clear();
        self.buf.extend_from_slice(prefix);
        let result = self.pending_len().map(|_| ());
        self.buf.clear();
        result
    }

    /// The error to report when the stream ended with a partial frame buffered.
    pub fn truncation(&self) -> FrameError {
        let needed = match self.pending_len() {
            Ok(Some(len)) => LEN_BYTES + len,
            _ => LEN_BYTES,
        };
        DecodeError::Truncated { needed, have: self.buf.len() }
    }

    /// Returns the next complete message, `Ok(None)` if more bytes are needed. After an error the
    /// stream is out of sync and should be closed.
    pub fn next_frame(&mut self) -> Result<Option<Message>, FrameError> {
        let Some(len) = self.pending_len()? else { return Ok(None) };
        if self.buf.len() < LEN_BYTES + len {
            return Ok(None);
        }
        let version = self.buf[LEN_BYTES];
        let kind = self.buf[LEN_BYTES + 1];
        let result = if version != PROTOCOL_VERSION {
            Err(DecodeError::WrongVersion { got: version, expected: PROTOCOL_VERSION })
        } else {
            Message::decode_body(kind, &self.buf[LEN_BYTES + HEADER_BYTES..LEN_BYTES + len])
        };
        self.buf.drain(..LEN_BYTES + len);
        result.map(Some)
    }
}
