//! The cost record of one client in one round (ARCHITECTURE.md §7).

use alloc::string::String;
use serde::{Deserialize, Serialize};

/// What one round cost one client, in bytes and seconds, per direction.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CostRecord {
    pub client: String,
    pub round: u64,
    /// Bytes of parameter and prototype values sent down (the broadcast's payload).
    pub payload_down: u64,
    /// Bytes of parameter and prototype values sent up (the update's payload).
    pub payload_up: u64,
    /// UDP bytes received by the client while the broadcast came in (QUIC overhead included).
    pub wire_down: u64,
    /// UDP bytes sent by the client while uploading (QUIC overhead and retransmissions included).
    pub wire_up: u64,
    pub compute_seconds: f64,
    pub transfer_seconds: f64,
    pub wait_seconds: f64,
    pub wall_seconds: f64,
    /// QUIC's smoothed round-trip time at the end of the upload.
    pub rtt_seconds: f64,
    /// Estimated energy of the round on the client's device (compute and radio), in joules.
    pub joules: f64,
    /// The update arrived after its round closed.
    pub straggler: bool,
    /// The client was sampled but sent nothing before the deadline.
    pub dropped: bool,
}

impl CostRecord {
    /// Checks what arrives from a peer: finite non-negative seconds and joules, a bounded name.
    pub fn validate(&self) -> Result<(), String> {
        if self.client.len() > 128 {
            return Err("client id longer than 128 bytes".into());
        }
        let fields = [
            ("compute_seconds", self.compute_seconds),
            ("transfer_seconds", self.transfer_seconds),
            ("wait_seconds", self.wait_seconds),
            ("wall_seconds", self.wall_seconds),
            ("rtt_seconds", self.rtt_seconds),
            ("joules", self.joules),
        ];
        match fields.iter().find(|(_, v)| !(v.is_finite() && *v >= 0.0)) {
            Some((name, v)) => Err(alloc::format!("{name} = {v} is not a finite non-negative number")),
            None => Ok(()),
        }
    }

    /// Checks that the record describes a round a real device could have had: every seconds
    /// field within [`MAX_RECORD_SECONDS`], the RTT within [`MAX_RTT_SECONDS`], the energy within
    /// [`MAX_RECORD_JOULES`]. A record beyond them is made up (one that claimed 10³⁰⁰ J would own
    /// every energy total of the federation).
    pub fn check_physical(&self) -> Result<(), String> {
        let seconds = [
            ("compute_seconds", self.compute_seconds),
            ("transfer_seconds", self.transfer_seconds),
            ("wait_seconds", self.wait_seconds),
            ("wall_seconds", self.wall_seconds),
        ];
        if let Some((name, v)) = seconds.iter().find(|(_, v)| *v > MAX_RECORD_SECONDS) {
            return Err(alloc::format!("{name} = {v} is beyond {MAX_RECORD_SECONDS} s (a week)"));
        }
        if self.rtt_seconds > MAX_RTT_SECONDS {
            return Err(alloc::format!("rtt_seconds = {} is beyond {MAX_RTT_SECONDS} s", self.rtt_seconds));
        }
        if self.joules > MAX_RECORD_JOULES {
            return Err(alloc::format!("joules = {} is beyond {MAX_RECORD_JOULES} J", self.joules));
        }
        Ok(())
    }
}

/// The longest a round's compute, transfer, wait or wall time can be: a week.
pub const MAX_RECORD_SECONDS: f64 = 7.0 * 24.0 * 3600.0;
/// The longest smoothed RTT a record may report: ten minutes (beyond any satellite link).
pub const MAX_RTT_SECONDS: f64 = 600.0;
/// The most energy one round can cost a device: 10⁸ J, a 1 kW machine busy for a day.
pub const MAX_RECORD_JOULES: f64 = 1e8;

/// The header of the ledger as CSV: the one format the simulator's run folder (`ledger.csv`) and
/// the server's export share (both write the rows with the `csv` crate from the serde fields, in
/// this order).
pub const CSV_HEADER: &str = "client,round,payload_down,payload_up,wire_down,wire_up,compute_seconds,transfer_seconds,wait_seconds,wall_seconds,rtt_seconds,joules,straggler,dropped";
