//! Async frame I/O over any tokio stream (quinn's streams included) and atomic files.
//! The one frame reader: it delegates to [`FrameReader`], so limits and errors are the same as
//! for the sans-IO decoder.

use alloc::vec;
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
    Io(#[from] io::Error),
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

/// Reads one frame. `Ok(None)` on a clean end of stream before any byte of a new frame; a stream
/// that ends inside a frame is [`DecodeError::Truncated`]. Returns the message and its size on
/// the stream. A declared length above `max_frame` is refused before its body is read.
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
    max_frame: usize,
) -> Result<Option<(Message, usize)>, FrameIoError> {
    let mut reader = FrameReader::new(max_frame);
    let mut prefix = [0u8; LEN_BYTES];
    let mut got = 0;
    while got < LEN_BYTES {
        let n = r.read(&mut prefix[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(DecodeError::Truncated { needed: LEN_BYTES, have: got }.into());
        }
        got += n;
    }
    reader.push(&prefix);
    let len = reader.pending_len()?.unwrap_or(0);
    let mut body = vec![0u8; len];
    let mut filled = 0;
    while filled < len {
        let n = r.read(&mut body[filled..]).await?;
        if n == 0 {
            return Err(DecodeError::Truncated { needed: LEN_BYTES + len, have: LEN_BYTES + filled }.into());
        }
        filled += n;
    }
    reader.push(&body);
    match reader.next_frame()? {
        Some(msg) => Ok(Some((msg, LEN_BYTES + len))),
        None => Err(reader.truncation().into()),
    }
}

/// Writes an already encoded frame.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, frame: &[u8]) -> io::Result<()> {
    w.write_all(frame).await
}

/// Writes `bytes` to `path` atomically: a temporary file in the same folder, fsync, rename, and
/// fsync of the folder. A crash leaves either the old file or the new one, never a torn one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    use std::io::Write;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut tmp_name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
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
