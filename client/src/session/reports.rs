//! The cost records the device reports to the server's ledger (ARCHITECTURE.md §7): each is kept
//! until the server confirms it (`CostAck`) and sent again after every welcome, so that a server
//! that stopped before committing one still gets it.

use std::collections::BTreeMap;

use anchorage_shared::ledger::CostRecord;

/// Unconfirmed records kept for resending (the server checks a record against its invitations
/// of the last 8 rounds); the oldest are dropped first.
pub(super) const UNCONFIRMED_COSTS: usize = 8;

/// The records sent and not yet confirmed, by round.
#[derive(Debug, Clone, Default)]
pub(super) struct Unconfirmed(BTreeMap<u64, CostRecord>);

impl Unconfirmed {
    /// `record` was sent: kept until the server confirms it, at most [`UNCONFIRMED_COSTS`].
    pub(super) fn sent(&mut self, record: CostRecord) {
        self.0.insert(record.round, record);
        while self.0.len() > UNCONFIRMED_COSTS {
            self.0.pop_first();
        }
    }

    /// The server's ledger holds `round`'s record.
    pub(super) fn confirmed(&mut self, round: u64) {
        self.0.remove(&round);
    }

    /// The records to send again, oldest round first.
    pub(super) fn records(&self) -> impl Iterator<Item = &CostRecord> {
        self.0.values()
    }
}
