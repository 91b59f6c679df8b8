//! Closed rounds' rows on their way to the recorder, once their acks are in.

use std::collections::HashMap;
use std::time::Duration;

use anchorage_shared::ledger::CostRecord;

use crate::record::RoundRow;
use crate::recorder::Recorder;

/// Closed rounds whose rows wait for their acks: a row's wire bytes are the acked updates' and
/// arrive after the round closes. A row goes to the recorder once every aggregated update's cost
/// record is in, or when the next round closes, or at the end.
#[derive(Default)]
pub(super) struct LiveRows {
    waiting: std::collections::VecDeque<Waiting>,
    /// Per round: indices into the ledger of its cost records.
    costs: HashMap<u64, Vec<usize>>,
}

struct Waiting {
    row: RoundRow,
    accuracy: Vec<crate::accuracy::AccuracyRow>,
    acks: usize,
    closed_at: Duration,
}

impl LiveRows {
    pub(super) fn cost(&mut self, index: usize, record: &CostRecord) {
        self.costs.entry(record.round).or_default().push(index);
    }

    pub(super) fn closed(
        &mut self,
        row: RoundRow,
        accuracy: Vec<crate::accuracy::AccuracyRow>,
        acks: usize,
        at: Duration,
    ) {
        self.waiting.push_back(Waiting { row, accuracy, acks, closed_at: at });
    }

    pub(super) fn emit_complete(&mut self, ledger: &[CostRecord], recorder: &mut Recorder) -> anyhow::Result<()> {
        while let Some(w) = self.waiting.front() {
            let acked = self.costs.get(&w.row.round).map_or(0, |c| c.iter().filter(|&&i| !ledger[i].dropped).count());
            if acked < w.acks {
                break;
            }
            self.emit_front(ledger, recorder)?;
        }
        Ok(())
    }

    pub(super) fn flush(&mut self, ledger: &[CostRecord], recorder: &mut Recorder) -> anyhow::Result<()> {
        while !self.waiting.is_empty() {
            self.emit_front(ledger, recorder)?;
        }
        Ok(())
    }

    fn emit_front(&mut self, ledger: &[CostRecord], recorder: &mut Recorder) -> anyhow::Result<()> {
        let Some(mut w) = self.waiting.pop_front() else { return Ok(()) };
        let costs: Vec<CostRecord> =
            self.costs.remove(&w.row.round).unwrap_or_default().into_iter().map(|i| ledger[i].clone()).collect();
        (w.row.wire_up, w.row.wire_down) = costs.iter().fold((0, 0), |(u, d), c| (u + c.wire_up, d + c.wire_down));
        recorder.round(&w.row, &costs, &w.accuracy, Some(w.closed_at))
    }
}
