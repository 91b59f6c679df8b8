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
}

/// The header of the ledger as CSV: the one format the simulator's run folder (`ledger.csv`) and
/// the server's export share (both write the rows with the `csv` crate from the serde fields, in
/// this order).
pub const CSV_HEADER: &str = "client,round,payload_down,payload_up,wire_down,wire_up,compute_seconds,transfer_seconds,wait_seconds,wall_seconds,rtt_seconds,joules,straggler,dropped";
