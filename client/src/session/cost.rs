//! What each round costs the client (ARCHITECTURE.md §7), as the session sees it: the round's
//! broadcast opens its record, training and the upload fill it, and it is complete once the
//! update is both uploaded and acknowledged. Sans-IO like the session: every time and every
//! wire byte count comes from the shell that measured it (QUIC's statistics and the host's clock
//! on the real clock; the link and packet model on the virtual one), and so does the device's
//! condition (what it read of itself). Energy is not the session's to know: the simulator
//! estimates it from the device profile.

use std::collections::HashMap;
use std::time::Duration;

use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::{Broadcast, Update};
use anchorage_shared::tensor::payload_bytes;

use crate::eligibility::Readings;

/// What the shell measured of one upload of an update.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct UploadMeasure {
    /// Bytes on the wire while uploading (UDP bytes sent, QUIC overhead and retransmissions
    /// included; or the packet model's).
    pub wire_bytes: u64,
    /// From the start of the upload until the server had every byte.
    pub transfer: Duration,
    /// The path's smoothed round-trip time at the end of the upload (zero where nothing
    /// measures it).
    pub rtt: Duration,
}

/// One round in flight.
#[derive(Debug, Clone, Default)]
struct RoundCost {
    record: CostRecord,
    /// When the round's broadcast first arrived, on the shell's clock.
    broadcast_at: Option<Duration>,
    /// An upload of the round's update was measured.
    uploaded: bool,
    /// The ack arrived (`Some(aggregated)`); on the real clock it may overtake the upload's
    /// own measurement.
    acked: Option<bool>,
}

/// The cost records of the rounds in flight.
#[derive(Debug, Clone)]
pub(super) struct Costs {
    rounds: HashMap<u64, RoundCost>,
    /// `payload_down` counts the broadcast's prototypes as well as its blocks (see
    /// [`super::Session::payload_down_without_prototypes`]).
    prototypes_down: bool,
}

impl Default for Costs {
    fn default() -> Self {
        Self { rounds: HashMap::new(), prototypes_down: true }
    }
}

impl Costs {
    pub(super) fn without_prototypes_down(&mut self) {
        self.prototypes_down = false;
    }

    /// A round's broadcast arrived at `now`, `wire_bytes` on the wire. The first copy opens the
    /// round; a copy sent again after reconnecting does not restart it.
    pub(super) fn broadcast(&mut self, now: Duration, b: &Broadcast, wire_bytes: u64) {
        let cost = self.rounds.entry(b.round).or_default();
        if cost.broadcast_at.is_some() {
            return;
        }
        let prototypes: usize =
            if self.prototypes_down { b.prototypes.iter().map(|p| p.vector.data.len()).sum() } else { 0 };
        cost.broadcast_at = Some(now);
        cost.record.payload_down = (payload_bytes(&b.blocks) + prototypes) as u64;
        cost.record.wire_down = wire_bytes;
    }

    /// The device declined `round`: it has no cost of its own (the server's ledger records the
    /// decline).
    pub(super) fn forget(&mut self, round: u64) {
        self.rounds.remove(&round);
    }

    /// The device computed `compute` for `round`'s update.
    pub(super) fn trained(&mut self, round: u64, compute: Duration) {
        self.rounds.entry(round).or_default().record.compute_seconds = compute.as_secs_f64();
    }

    /// What the device read of itself after training `round`: its condition goes into the record.
    pub(super) fn condition(&mut self, round: u64, readings: &Readings) {
        crate::eligibility::fill_condition(&mut self.rounds.entry(round).or_default().record, readings);
    }

    /// The session asks the shell to upload `update`.
    pub(super) fn upload(&mut self, update: &Update) {
        self.rounds.entry(update.round).or_default().record.payload_up = payload_bytes(&update.blocks) as u64;
    }

    /// An upload of `round`'s update ended at `now`; the round's record if that completed it.
    /// The measure of a second upload that ends after the record was made (a copy resent after
    /// reconnecting) changes nothing: it does not start a record of its own.
    pub(super) fn uploaded(&mut self, now: Duration, round: u64, m: UploadMeasure, client: &str) -> Option<CostRecord> {
        let cost = self.rounds.get_mut(&round)?;
        cost.record.wire_up = m.wire_bytes;
        cost.record.transfer_seconds = m.transfer.as_secs_f64();
        cost.record.rtt_seconds = m.rtt.as_secs_f64();
        cost.uploaded = true;
        self.complete(now, round, client)
    }

    /// The server acknowledged `round`'s update at `now`; the round's record if that completed
    /// it. An ack for a round with no record (a saved update resent, its record already made)
    /// changes nothing.
    pub(super) fn acked(&mut self, now: Duration, round: u64, aggregated: bool, client: &str) -> Option<CostRecord> {
        self.rounds.get_mut(&round)?.acked = Some(aggregated);
        self.complete(now, round, client)
    }

    /// The record of `round`, once its update is both uploaded and acknowledged: its wall time
    /// runs from the broadcast until `now`, and what compute and transfer do not explain is
    /// waiting.
    fn complete(&mut self, now: Duration, round: u64, client: &str) -> Option<CostRecord> {
        let cost = self.rounds.get(&round)?;
        let aggregated = cost.acked?;
        if !cost.uploaded {
            return None;
        }
        let cost = self.rounds.remove(&round)?;
        let mut r = cost.record;
        if let Some(at) = cost.broadcast_at {
            r.wall_seconds = now.saturating_sub(at).as_secs_f64();
        }
        r.client = client.into();
        r.round = round;
        r.straggler = !aggregated;
        r.wait_seconds = (r.wall_seconds - r.compute_seconds - r.transfer_seconds).max(0.0);
        Some(r)
    }
}
