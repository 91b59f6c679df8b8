//! The tokio + quinn shell around the [`Session`](crate::session::Session): connects with a pinned server certificate,
//! reconnects with exponential backoff and jitter, runs training off the async threads, uploads
//! on uni streams, and measures what the session's cost records need (wire bytes from QUIC's
//! statistics, times on the host's clock) and what the device reads of itself; the session
//! sends each record it completes to the server's ledger until the server confirms it.
//!
//! - [`options`]: how to reach the server and who this client is ([`ClientOptions`]).
//! - [`backoff`]: the waits between connection attempts ([`Backoff`]).
//! - [`refusal`]: the server's refusals for good ([`Refused`]) and what a retry may clear.
//! - [`endpoint`](mod@endpoint): the device's QUIC endpoint, its own or one a process's devices share.
//! - [`client`]: the client loop: connections, the session's actions, trainings ([`run`]).
//! - [`streams`]: a connection's control stream and broadcasts.
//! - [`upload`]: uploads as resumable transfers ([`send_resumable`]).
//! - [`device_state`]: the method's device state across restarts.

mod backoff;
mod client;
mod device_state;
mod endpoint;
mod options;
mod refusal;
mod streams;
mod upload;

use anchorage_shared::ledger::CostRecord;

pub use anchorage_shared::priority::Priority;
pub use backoff::Backoff;
pub use client::run;
pub use endpoint::{DeviceEndpoint, endpoint, shared_endpoint};
pub use options::{ClientCert, ClientOptions, SocketWrapper, client_crypto};
pub use refusal::{EXIT_REFUSED, RefusalKind, Refused, definite_refusal, tls_failure};
pub(crate) use streams::Inbound;
pub use upload::{prioritise, send_resumable};

/// ALPN protocol id of Anchorage v1 (the server's `tls::ALPN`).
pub const ALPN: &[u8] = b"anchorage/1";

/// What a running client reports to its owner (the simulator, a metrics exporter).
#[derive(Debug, Clone)]
pub enum ClientEvent {
    Connected,
    /// A round's broadcast arrived; training starts.
    RoundStarted {
        round: u64,
    },
    Disconnected {
        reason: String,
    },
    /// The server acknowledged this client's update of `round` (`aggregated: false`: it came
    /// after the round closed). Sent for every ack, before the round's cost record is complete.
    Acked {
        round: u64,
        aggregated: bool,
    },
    /// The device declined `round`'s invitation: its `[eligibility]` says it should not train now.
    Declined {
        round: u64,
        reason: anchorage_shared::ledger::DeclineReason,
    },
    /// A round's update was acknowledged; its cost record is complete.
    RoundDone {
        cost: CostRecord,
        aggregated: bool,
    },
    Finished {
        reason: String,
    },
}

#[cfg(test)]
pub(crate) mod tests;
