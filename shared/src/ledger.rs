//! The cost record of one client in one round (ARCHITECTURE.md §7).

use alloc::string::String;
use serde::{Deserialize, Serialize};

/// What one round cost one client, in bytes and seconds, per direction.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CostRecord {
    /// The client's id (the server files it under the connection's identity).
    pub client: String,
    /// The round.
    pub round: u64,
    /// Bytes of parameter and prototype values sent down (the broadcast's payload).
    pub payload_down: u64,
    /// Bytes of parameter and prototype values sent up (the update's payload).
    pub payload_up: u64,
    /// UDP bytes received by the client while the broadcast came in (QUIC overhead included).
    pub wire_down: u64,
    /// UDP bytes sent by the client while uploading (QUIC overhead and retransmissions included).
    pub wire_up: u64,
    /// Seconds of local computation.
    pub compute_seconds: f64,
    /// Seconds the update's upload took.
    pub transfer_seconds: f64,
    /// Seconds of the round that compute and transfer do not explain (waiting), at least 0.
    pub wait_seconds: f64,
    /// Seconds from the broadcast's arrival to the end of the round (upload done and acknowledged).
    pub wall_seconds: f64,
    /// QUIC's smoothed round-trip time at the end of the upload.
    pub rtt_seconds: f64,
    /// Estimated energy of the round on the client's device (compute and radio), in joules.
    pub joules: f64,
    /// The update arrived after its round closed.
    pub straggler: bool,
    /// The client was sampled but sent nothing before the deadline.
    pub dropped: bool,
    /// The device was invited and declined to train: why. A decline is not a drop.
    pub declined: Option<DeclineReason>,
    /// The device's condition at the end of the round, where it can read it:
    /// the hottest thermal zone, in °C.
    pub temperature_c: Option<f32>,
    /// The CPU ran below its top clock (or the simulated device throttled) during the round.
    pub throttled: Option<bool>,
    /// The system battery's charge, in percent.
    pub battery_percent: Option<u8>,
    /// On external power (mains, USB-C source) rather than battery.
    pub external_power: Option<bool>,
    /// The board's power mode where it names one (a Jetson's `nvpmodel` mode), at most
    /// [`MAX_POWER_MODE_LEN`] bytes.
    pub power_mode: Option<String>,
    /// Values the device refused to read of itself (a sysfs file with garbage in it: logged on
    /// the device, counted here so the server's metrics show boards with broken sensors).
    pub readings_refused: Option<u32>,
}

/// Why an invited device declined to train (`[eligibility]` of client.toml). The
/// names ([`DeclineReason::name`]) are the metrics' labels and the ledger's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeclineReason {
    /// On battery below `min_battery_percent`.
    Battery,
    /// The hottest thermal zone at or above `max_temperature_c`.
    Thermal,
    /// The default route is a metered (cellular) link and `unmetered_only` is set.
    Metered,
    /// Outside the daily training window.
    Window,
    /// The machine is busy (load above `max_load`).
    Busy,
}

impl DeclineReason {
    /// Every reason, in the order devices check them.
    pub const ALL: [DeclineReason; 5] = [Self::Battery, Self::Thermal, Self::Metered, Self::Window, Self::Busy];

    /// The stable short name: `battery`, `thermal`, `metered`, `window` or `busy`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Battery => "battery",
            Self::Thermal => "thermal",
            Self::Metered => "metered",
            Self::Window => "window",
            Self::Busy => "busy",
        }
    }
}

/// Fields of [`CostRecord`] after `dropped`, the last field of the V1 record older clients send. postcard
/// carries no field names, and each of them is one zero byte when `None`.
const FIELDS_AFTER_V1: usize = 7;

/// Most values a device can refuse to read of itself in one round (every file it reads, bounded).
pub const MAX_READINGS_REFUSED: u32 = 100_000;

/// Longest power-mode name a cost record may carry.
pub const MAX_POWER_MODE_LEN: usize = 32;

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
        if let Some((name, v)) = fields.iter().find(|(_, v)| !(v.is_finite() && *v >= 0.0)) {
            return Err(alloc::format!("{name} = {v} is not a finite non-negative number"));
        }
        self.validate_condition()
    }

    /// The condition fields: a temperature a device can have, a percentage, a short mode name.
    fn validate_condition(&self) -> Result<(), String> {
        if let Some(t) = self.temperature_c
            && !(t.is_finite() && (-60.0..=200.0).contains(&t))
        {
            return Err(alloc::format!("temperature_c = {t} is not a device temperature (-60 to 200 °C)"));
        }
        if let Some(p) = self.battery_percent
            && p > 100
        {
            return Err(alloc::format!("battery_percent = {p} is not a percentage"));
        }
        if let Some(n) = self.readings_refused
            && n > MAX_READINGS_REFUSED
        {
            return Err(alloc::format!(
                "readings_refused = {n} is beyond the {MAX_READINGS_REFUSED} values a device reads"
            ));
        }
        if self.power_mode.as_ref().is_some_and(|m| m.len() > MAX_POWER_MODE_LEN) {
            return Err(alloc::format!("power_mode is longer than {MAX_POWER_MODE_LEN} bytes"));
        }
        Ok(())
    }

    /// The record's postcard bytes, in the V1 encoding when it has no decline and no condition:
    /// checksums computed over V1 records stay valid.
    pub fn stable_encoding(&self) -> alloc::vec::Vec<u8> {
        let mut body = postcard::to_allocvec(self).unwrap_or_default();
        if self.declined.is_none() && !self.has_condition() {
            // Each `None` of the fields after `dropped` is one zero byte at the end.
            body.truncate(body.len().saturating_sub(FIELDS_AFTER_V1));
        }
        body
    }

    /// Reads a record in this version's encoding, or in the shorter V1 encoding of an older
    /// client (which ends at `dropped`: its missing fields read as `None`), so that a fleet
    /// keeps reporting while its devices are updated one by one.
    pub fn from_stable_encoding(body: &[u8]) -> Result<Self, postcard::Error> {
        postcard::from_bytes(body).or_else(|e| {
            let mut padded = body.to_vec();
            padded.extend([0; FIELDS_AFTER_V1]);
            postcard::from_bytes(&padded).map_err(|_| e)
        })
    }

    /// Whether any condition field is set (a record without them encodes, and is checksummed,
    /// as a V1 record).
    pub fn has_condition(&self) -> bool {
        self.temperature_c.is_some()
            || self.throttled.is_some()
            || self.battery_percent.is_some()
            || self.external_power.is_some()
            || self.power_mode.is_some()
            || self.readings_refused.is_some()
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
pub const CSV_HEADER: &str = "client,round,payload_down,payload_up,wire_down,wire_up,compute_seconds,transfer_seconds,wait_seconds,wall_seconds,rtt_seconds,joules,straggler,dropped,declined,temperature_c,throttled,battery_percent,external_power,power_mode,readings_refused";

#[cfg(test)]
mod tests {
    use super::*;

    /// A cost record as older clients encode it (V1: no decline, no condition), frozen here
    /// to check the encodings against.
    #[derive(Debug, Clone, Default, Serialize)]
    struct CostRecordV1 {
        client: String,
        round: u64,
        payload_down: u64,
        payload_up: u64,
        wire_down: u64,
        wire_up: u64,
        compute_seconds: f64,
        transfer_seconds: f64,
        wait_seconds: f64,
        wall_seconds: f64,
        rtt_seconds: f64,
        joules: f64,
        straggler: bool,
        dropped: bool,
    }

    /// A record without the fields after `dropped` encodes exactly as V1; with one, it does not.
    #[test]
    fn records_without_conditions_keep_their_old_encoding() {
        let old = CostRecordV1 { client: "d1".into(), round: 3, joules: 1.5, dropped: true, ..Default::default() };
        let new = CostRecord { client: "d1".into(), round: 3, joules: 1.5, dropped: true, ..Default::default() };
        assert_eq!(new.stable_encoding(), postcard::to_allocvec(&old).unwrap());
        let declined = CostRecord { declined: Some(DeclineReason::Thermal), ..new.clone() };
        assert_ne!(declined.stable_encoding(), postcard::to_allocvec(&old).unwrap());
        assert_eq!(postcard::from_bytes::<CostRecord>(&declined.stable_encoding()).unwrap(), declined);
    }
}
