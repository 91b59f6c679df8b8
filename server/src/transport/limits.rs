//! The bounds a connection lives within ([`Limits`], `[limits]` in server.toml): QUIC's idle
//! timeout, windows and stream counts, the hello's deadline, read stalls and upload pace, and how
//! many connections and handshakes the accept loop lets in.

use std::time::Duration;

use anyhow::Context;
use quinn::VarInt;

use crate::engine::config::duration_ms;

/// QUIC limits per connection.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// A connection silent this long is closed.
    #[serde(with = "duration_ms")]
    pub idle_timeout: Duration,
    /// Keep-alive interval; must be below the idle timeout (quinn's default is off).
    #[serde(with = "duration_ms")]
    pub keep_alive: Duration,
    /// Concurrent uni streams a client may open (one-frame uploads); as many resumable uploads
    /// (bi streams) besides the control stream.
    pub max_uni_streams: u32,
    /// Time a new connection has to send its hello.
    #[serde(with = "duration_ms")]
    pub hello_timeout: Duration,
    /// Per-stream and per-connection receive windows, in bytes.
    pub stream_window: u32,
    pub connection_window: u32,
    /// Kernel UDP buffer size requested for the endpoint's socket.
    pub socket_buffer: usize,
    /// A peer that sends no byte of a started frame for this long is closed (its half-read
    /// frame is not held), and so is one that takes no byte of what the server sends it.
    #[serde(with = "duration_ms")]
    pub read_stall: Duration,
    /// Largest frame of a control message (hello, heartbeat, cost, goodbye); updates get
    /// `max_frame_bytes` of the engine config.
    pub max_control_frame: u32,
    /// Connections open at once; more are refused before the handshake.
    pub max_connections: usize,
    /// Handshakes in progress from one IP address; more are refused (a host cannot tie up the
    /// server with half-open connections).
    pub max_handshakes_per_ip: usize,
    /// The least average rate of an update being uploaded, in bytes per second, judged once
    /// `read_stall` has passed since its first byte (0: none). A device that feeds a 64 MiB
    /// upload a byte at a time is closed instead of holding its buffer for hours.
    pub min_upload_rate: u64,
    /// The most time one update may take to arrive, from its first byte.
    #[serde(with = "duration_ms")]
    pub upload_deadline: Duration,
    /// An endpoint that has held this many connections at once is replaced by a fresh one when
    /// the last of them goes (0: never): quinn's routing tables keep their largest size.
    pub renew_endpoint_after: usize,
    /// Bytes of interrupted uploads kept for devices to resume, over all devices; an upload
    /// interrupted beyond this is let go (the device sends it from the start).
    pub max_kept_upload_bytes: u64,
    /// Streams get send priorities (`anchorage_shared::priority`): control messages first, then
    /// broadcasts without parameter blocks, then those with blocks. `false`: every stream at
    /// quinn's default, taking turns (the baseline).
    pub stream_priorities: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            idle_timeout: Duration::from_secs(30),
            keep_alive: Duration::from_secs(5),
            max_uni_streams: 8,
            hello_timeout: Duration::from_secs(10),
            stream_window: 8 << 20,
            connection_window: 16 << 20,
            socket_buffer: 4 << 20,
            read_stall: Duration::from_secs(30),
            max_control_frame: 64 << 10,
            max_connections: 10_000,
            max_handshakes_per_ip: 16,
            // 1 KiB/s and 30 minutes: a 20 MB update over a 3G uplink takes about 7 minutes.
            min_upload_rate: 1024,
            upload_deadline: Duration::from_secs(30 * 60),
            // Measured with 10,000 devices come and gone (tests/tests/silent_fleet.rs).
            renew_endpoint_after: 1000,
            // 25 interrupted 20 MB updates.
            max_kept_upload_bytes: 512 << 20,
            stream_priorities: true,
        }
    }
}

impl Limits {
    pub(super) fn transport_config(&self) -> anyhow::Result<quinn::TransportConfig> {
        anyhow::ensure!(self.keep_alive < self.idle_timeout, "keep-alive must be shorter than the idle timeout");
        let mut t = quinn::TransportConfig::default();
        t.max_idle_timeout(Some(self.idle_timeout.try_into().context("idle timeout")?))
            .keep_alive_interval(Some(self.keep_alive))
            .max_concurrent_uni_streams(VarInt::from_u32(self.max_uni_streams))
            // The control stream, and as many resumable uploads as one-frame ones.
            .max_concurrent_bidi_streams(VarInt::from_u32(1 + self.max_uni_streams))
            .stream_receive_window(VarInt::from_u32(self.stream_window))
            .receive_window(VarInt::from_u32(self.connection_window))
            .send_window(self.connection_window as u64);
        Ok(t)
    }
}
