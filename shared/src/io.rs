//! Async frame I/O over any tokio stream (quinn's streams included) and atomic files.
//! The one frame reader: it delegates to [`FrameReader`], so limits and errors are the same as
//! for the sans-IO decoder.

use alloc::vec::Vec;
use std::io;
use std::path::Path;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::frame::{FrameReader, LEN_BYTES};
use crate::protocol::{DecodeError, Message};

/// A frame could not be read: the stream failed or its bytes were bad.
#[derive(Debug, thiserror::Error)]
pub enum FrameIoError {
    #[error("stream error: {0}")]
    /// The stream failed; a stall or a frame that breaks its pace is [`io::ErrorKind::TimedOut`].
    Io(#[from] io::Error),
    #[error(transparent)]
    /// The bytes do not decode.
    Decode(#[from] DecodeError),
}

/// Reads one frame. `Ok(None)` on a clean end of stream before any byte of a new frame; a stream
/// that ends inside a frame is [`DecodeError::Truncated`]. Returns the message and its size on
/// the stream. A declared length above `max_frame` is refused before its body is read.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max_frame: usize,
) -> Result<Option<(Message, usize)>, FrameIoError> {
    let limits = ReadLimits { max_frame, max_small: max_frame, large_kinds: &[], stall: None, pace: None };
    read_frame_limited(r, &limits).await
}

/// What one peer may make a reader hold, and for how long.
#[derive(Debug, Clone, Copy)]
pub struct ReadLimits<'a> {
    /// Largest frame of the kinds in `large_kinds` (updates, broadcasts).
    pub max_frame: usize,
    /// Largest frame of every other kind (hello, heartbeat, cost, …).
    pub max_small: usize,
    /// Kind bytes whose frames may be up to `max_frame` bytes.
    pub large_kinds: &'a [u8],
    /// A peer that sends no byte of a started frame for this long is cut off (a stalled upload
    /// must not hold its buffer forever). `None`: wait as long as the stream lives.
    pub stall: Option<std::time::Duration>,
    /// The pace a started frame must keep: a peer that feeds a large frame a byte at a time stays
    /// within `stall` forever, so this bounds its rate and its total time. `None`: no bound.
    pub pace: Option<Pace>,
}

/// The least rate and the most time a started frame may take.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// Bytes per second on average, judged once `grace` has passed since the frame's first byte.
    pub min_bytes_per_sec: u64,
    /// How long after the frame's first byte the average rate is first judged.
    pub grace: std::time::Duration,
    /// The whole frame arrives within this.
    pub deadline: std::time::Duration,
}

impl Pace {
    /// Checks the frame's progress: `got` bytes since `started`.
    fn check(&self, started: std::time::Instant, got: usize) -> io::Result<()> {
        let elapsed = started.elapsed();
        if elapsed > self.deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                alloc::format!("a frame still arriving after {:?} (the upload deadline)", self.deadline),
            ));
        }
        if elapsed > self.grace && (got as f64) < self.min_bytes_per_sec as f64 * elapsed.as_secs_f64() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                alloc::format!(
                    "{got} bytes in {:.0} s: slower than the minimum {} B/s",
                    elapsed.as_secs_f64(),
                    self.min_bytes_per_sec
                ),
            ));
        }
        Ok(())
    }
}

/// [`read_frame`] with a size limit per message kind and a stall timeout. The kind is read before
/// the body, and the body's buffer grows with the bytes that actually arrive (never to the
/// declared length up front), so a peer that declares 64 MiB and sends nothing holds 64 KiB.
pub async fn read_frame_limited<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &ReadLimits<'_>,
) -> Result<Option<(Message, usize)>, FrameIoError> {
    const CHUNK: usize = 64 * 1024;
    let max = limits.max_frame.max(limits.max_small);
    let mut head = [0u8; LEN_BYTES + crate::frame::HEADER_BYTES];
    let mut got = 0;
    // When the frame's first byte arrived (its pace is judged from there).
    let mut started = std::time::Instant::now();
    while got < head.len() {
        // The first byte may take as long as the peer likes; after it, the frame has started.
        let read = r.read(&mut head[got..]);
        let n = match (got, limits.stall) {
            (0, _) | (_, None) => read.await?,
            (_, Some(stall)) => tokio::time::timeout(stall, read).await.map_err(|_| stalled(stall))??,
        };
        if got == 0 {
            started = std::time::Instant::now();
        }
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(DecodeError::Truncated { needed: head.len(), have: got }.into());
        }
        got += n;
        if got >= LEN_BYTES {
            // Refuse an oversized declaration before waiting for anything more.
            FrameReader::new(max).push_and_check(&head[..LEN_BYTES])?;
        }
    }
    let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let kind = head[LEN_BYTES + 1];
    let cap = if limits.large_kinds.contains(&kind) { limits.max_frame } else { limits.max_small };
    if len > cap {
        return Err(DecodeError::Oversized { len, max: cap }.into());
    }
    let mut frame = Vec::with_capacity((LEN_BYTES + len).min(LEN_BYTES + CHUNK));
    frame.extend_from_slice(&head);
    while frame.len() < LEN_BYTES + len {
        if let Some(pace) = &limits.pace {
            pace.check(started, frame.len())?;
        }
        let want = (LEN_BYTES + len - frame.len()).min(CHUNK);
        let start = frame.len();
        frame.resize(start + want, 0);
        let read = r.read(&mut frame[start..]);
        let n = match limits.stall {
            None => read.await?,
            Some(stall) => tokio::time::timeout(stall, read).await.map_err(|_| stalled(stall))??,
        };
        frame.truncate(start + n);
        if n == 0 {
            return Err(DecodeError::Truncated { needed: LEN_BYTES + len, have: frame.len() }.into());
        }
    }
    let mut reader = FrameReader::new(max);
    reader.push(&frame);
    match reader.next_frame()? {
        Some(msg) => Ok(Some((msg, LEN_BYTES + len))),
        None => Err(reader.truncation().into()),
    }
}

fn stalled(stall: std::time::Duration) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, alloc::format!("no byte of a started frame for {stall:?}"))
}

/// Writes an already encoded frame.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, frame: &[u8]) -> io::Result<()> {
    w.write_all(frame).await
}

/// Writes `bytes` to `path` atomically: a uniquely named temporary file in the same folder
/// (tempfile), fsync, rename over `path`, and fsync of the folder. A crash leaves either the old
/// file or the new one, never a torn one. The file is mode 0600 whatever the umask (tempfile
/// creates it so, and the rename keeps it), also when it replaces a looser one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Reads a whole file, `Ok(None)` if it does not exist.
pub fn read_if_exists(path: &Path) -> io::Result<Option<Vec<u8>>> {
    match std::fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// A UDP socket bound to `bind` with kernel send and receive buffers of `buffer_bytes` (capped by
/// the kernel's `rmem_max`/`wmem_max`). QUIC over a default 208 KiB buffer drops packets when
/// several clients upload megabytes at once, and every drop is a retransmission on the wire.
pub fn udp_socket(bind: std::net::SocketAddr, buffer_bytes: usize) -> io::Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(bind), Type::DGRAM, Some(Protocol::UDP))?;
    if bind.is_ipv6() {
        let _ = socket.set_only_v6(false);
    }
    // Best effort: a smaller buffer still works, only with more loss under load.
    let _ = socket.set_recv_buffer_size(buffer_bytes);
    let _ = socket.set_send_buffer_size(buffer_bytes);
    socket.bind(&bind.into())?;
    Ok(socket.into())
}
