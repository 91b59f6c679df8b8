//! A relay's upward protocol as a state machine with no I/O (in the manner of `quinn-proto`):
//! the parent's messages, the relay engine's closed rounds and cost records, connects,
//! disconnects and the clock go in; what to send and what to ask of the engine comes out
//! ([`UplinkAction`]). The QUIC uplink ([`super::uplink`]) and the virtual clock's tier drive
//! the same session, so that acks, refusals, refolds and cost confirmations happen on both.
//!
//! What it promises: a partial aggregate is owed until the parent acks it (sent again after
//! every welcome); a partial the parent refuses as a duplicate is folded again without the
//! devices it names, or dropped when the relay cannot (nobody is counted twice); what the parent
//! did with each partial goes to the engine, whose devices' acks repeat it; a device's cost
//! record is owed until the parent confirms its round, and goes up again after a reconnect;
//! after the parent's goodbye the last round's records go up and the link waits (bounded) for
//! their confirmation before it ends.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::{Broadcast, CostBatch, Downward, Message, Partial, RefusalReason};

use crate::engine::ParentVerdict;

/// How often cost batches with new records go up.
pub const COST_EVERY: Duration = Duration::from_millis(250);
/// After the parent's goodbye, how long the last round's cost records may take to arrive (the
/// root stays a second after its goodbye).
pub const LAST_COSTS: Duration = Duration::from_millis(600);
/// After the parent's goodbye, how long the parent may take to confirm the last batches.
pub const LAST_CONFIRMATIONS: Duration = Duration::from_secs(3);
/// Rounds of its ledger a restarted relay sends up again: which of them the parent confirmed
/// died with the old session (the parent's ledger ignores a row it holds already).
pub const RESENT_COST_ROUNDS: u64 = 8;

/// The records of `ledger` a relay restarted after round `last_round` owes its parent again: those
/// of its last [`RESENT_COST_ROUNDS`] rounds.
pub fn owed_after_restart(last_round: u64, ledger: Vec<CostRecord>) -> impl Iterator<Item = CostRecord> {
    let oldest = last_round.saturating_sub(RESENT_COST_ROUNDS);
    ledger.into_iter().filter(move |r| r.round > oldest)
}

/// What the session asks its shell to do.
#[derive(Debug, Clone, PartialEq)]
pub enum UplinkAction {
    /// The parent welcomed the relay.
    Joined,
    /// Send this on the control stream.
    Send(Message),
    /// Send this partial aggregate on a stream of its own.
    SendPartial(Partial),
    /// The parent opened a round: the relay's engine opens it ([`crate::Engine::handle_parent_round`]).
    OpenRound(Broadcast),
    /// Fold the last round again without these devices ([`crate::Engine::refold_without`]) and
    /// answer with [`UplinkSession::refolded`].
    Refold(Vec<String>),
    /// What the parent did with a partial: the relay's engine acks its devices so
    /// ([`crate::Engine::handle_parent_verdict`]).
    Verdict(ParentVerdict),
    /// What became of a partial aggregate, for the relay's metrics: `sent`, `acked`, `refused`.
    Counted(&'static str),
    /// The link is over: the parent said goodbye (its reason), and what was owed went up.
    Finished(String),
    /// The parent refused the relay itself (before its welcome): retrying will not help.
    Refused(String),
}

/// Where the link stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UplinkState {
    Disconnected,
    /// Connected, hello sent, no welcome yet.
    Joining,
    Joined,
    /// The parent said goodbye: the last cost records go up, then their confirmations.
    Closing {
        costs_until: Duration,
        confirmed_until: Duration,
        sent_last: bool,
    },
    Finished,
}

/// The relay's side of its link to its parent. See the module docs.
#[derive(Debug)]
pub struct UplinkSession {
    hello: Message,
    state: UplinkState,
    /// The partial aggregate the parent has not acked.
    partial: Option<Partial>,
    /// A refold the engine has been asked for and has not answered.
    refolding: bool,
    /// Cost records by round, in arrival order, until the parent confirms them.
    costs: BTreeMap<u64, Vec<CostRecord>>,
    /// Per round, how many records each batch in flight carried (the first that many of the
    /// round's): the parent's confirmation of a round confirms its oldest batch, not records
    /// that arrived after it went up.
    in_flight: BTreeMap<u64, VecDeque<usize>>,
    /// Rounds whose records changed since their batch last went up (all of them after a welcome).
    fresh: BTreeSet<u64>,
    /// The last acked partial's round and devices: whose cost records the last batch waits for.
    last_members: (u64, Vec<String>),
    goodbye: Option<String>,
    next_costs: Option<Duration>,
    actions: VecDeque<UplinkAction>,
}

impl UplinkSession {
    /// A session whose every connection begins with `hello` ([`super::hello`]), owing `partial`
    /// (the last one a restarted relay's store holds) from the start.
    pub fn new(hello: Message, partial: Option<Partial>) -> Self {
        Self {
            hello,
            state: UplinkState::Disconnected,
            partial,
            refolding: false,
            costs: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            fresh: BTreeSet::new(),
            last_members: (0, Vec::new()),
            goodbye: None,
            next_costs: None,
            actions: VecDeque::new(),
        }
    }

    pub fn state(&self) -> UplinkState {
        self.state
    }

    /// The partial aggregate the parent has not acked yet.
    pub fn owed_partial(&self) -> Option<&Partial> {
        self.partial.as_ref()
    }

    /// Rounds whose cost records the parent has not confirmed.
    pub fn owed_cost_rounds(&self) -> Vec<u64> {
        self.costs.keys().copied().collect()
    }

    pub fn poll_action(&mut self) -> Option<UplinkAction> {
        self.actions.pop_front()
    }

    /// When the session next needs [`UplinkSession::handle_timeout`].
    pub fn poll_timeout(&self) -> Option<Duration> {
        match self.state {
            UplinkState::Closing { costs_until, confirmed_until, sent_last } => {
                Some(if sent_last { confirmed_until } else { costs_until })
            }
            // A batch is due only when there is something new to send.
            UplinkState::Joined => self.next_costs.filter(|_| !self.fresh.is_empty()),
            _ => None,
        }
    }

    /// A connection to the parent is up: the hello goes first.
    pub fn connected(&mut self, _now: Duration) {
        if self.state == UplinkState::Finished {
            return;
        }
        self.state = UplinkState::Joining;
        self.actions.push_back(UplinkAction::Send(self.hello.clone()));
    }

    /// The connection is gone: what is owed stays owed. After the parent's goodbye the link
    /// ends here (the parent has gone).
    pub fn disconnected(&mut self, _now: Duration) {
        match self.state {
            UplinkState::Finished => {}
            UplinkState::Closing { .. } => {
                if !self.costs.is_empty() {
                    tracing::warn!(rounds = ?self.owed_cost_rounds(), "the parent left before it confirmed the last cost records");
                }
                self.finish();
            }
            _ => {
                self.state = UplinkState::Disconnected;
                self.next_costs = None;
            }
        }
    }

    /// A round closed at the relay with this partial aggregate: it is owed until acked.
    pub fn partial_closed(&mut self, partial: Partial) {
        // Invariant: a partial's weight is its members' (the parent refuses one that is not).
        let members: u64 = partial.members.iter().map(|m| m.num_samples).sum();
        assert_eq!(partial.update.num_samples, members, "a partial's samples are not its members' sum");
        tracing::info!(
            round = partial.update.round,
            devices = partial.members.len(),
            samples = partial.update.num_samples,
            "partial aggregate up"
        );
        self.partial = Some(partial.clone());
        if self.state == UplinkState::Joined {
            self.send_partial(partial);
        }
    }

    /// A device's cost record, once the relay's ledger holds it. While closing, the last batch
    /// goes up as soon as every device of the last acked partial has its record here.
    pub fn cost(&mut self, now: Duration, record: CostRecord) {
        self.fresh.insert(record.round);
        self.costs.entry(record.round).or_default().push(record);
        if matches!(self.state, UplinkState::Closing { sent_last: false, .. }) && self.last_round_costed() {
            self.send_last_costs(now);
        }
    }

    /// The engine's answer to [`UplinkAction::Refold`]: the partial to send in place of the
    /// refused one, or `None` (nothing left, or a restart lost the round's updates): dropped.
    pub fn refolded(&mut self, partial: Option<Partial>) {
        self.refolding = false;
        match partial {
            Some(p) => {
                tracing::warn!(
                    round = p.update.round,
                    devices = p.members.len(),
                    "the parent counted some devices through another relay; sending the round without them"
                );
                self.partial = Some(p.clone());
                if self.state == UplinkState::Joined {
                    self.send_partial(p);
                }
            }
            None => {
                tracing::warn!(
                    "the parent counted devices of this partial elsewhere, and it cannot be folded again: dropped"
                );
                self.drop_partial();
            }
        }
    }

    /// A message from the parent.
    pub fn handle_message(&mut self, now: Duration, msg: Message) {
        let msg = match Downward::try_from(msg) {
            Ok(msg) => msg,
            Err(up) => {
                tracing::debug!(kind = up.kind_name(), "the parent sent what only devices and relays send; ignored");
                return;
            }
        };
        match msg {
            Downward::Welcome(w) if self.state == UplinkState::Joining => {
                tracing::info!(parent = %w.server_id, "uplink joined");
                self.state = UplinkState::Joined;
                self.actions.push_back(UplinkAction::Joined);
                if let Some(p) = self.partial.clone() {
                    self.send_partial(p);
                }
                // Batches in flight on the old connection may be lost: all go up again.
                self.in_flight.clear();
                self.fresh = self.costs.keys().copied().collect();
                self.next_costs = Some(now + COST_EVERY);
            }
            Downward::Refusal(r) if self.state == UplinkState::Joining => {
                self.state = UplinkState::Finished;
                self.actions.push_back(UplinkAction::Refused(format!("{:?}: {}", r.reason, r.detail)));
            }
            Downward::Broadcast(b) => self.actions.push_back(UplinkAction::OpenRound(b)),
            Downward::Ack(ack) => {
                if let Some(p) = self.partial.take_if(|p| p.update.round == ack.round) {
                    tracing::info!(
                        round = ack.round,
                        aggregated = ack.aggregated,
                        "the parent acked the partial aggregate"
                    );
                    self.actions.push_back(UplinkAction::Counted("acked"));
                    let members: Vec<String> = p.members.into_iter().map(|m| m.device).collect();
                    let verdict = ParentVerdict { round: ack.round, aggregated: ack.aggregated, members };
                    self.actions.push_back(UplinkAction::Verdict(verdict.clone()));
                    self.last_members = (ack.round, verdict.members);
                }
            }
            Downward::CostAck(ack) => {
                self.confirm(ack.round);
                self.check_closed(now);
            }
            Downward::Refusal(r) => {
                tracing::warn!(reason = ?r.reason, detail = %r.detail, devices = ?r.devices, "the parent refused");
                let partial_refused =
                    matches!(r.reason, RefusalReason::NotSampled | RefusalReason::Duplicate | RefusalReason::Malformed);
                if partial_refused && self.partial.is_some() && !self.refolding {
                    self.actions.push_back(UplinkAction::Counted("refused"));
                    if r.reason == RefusalReason::Duplicate && !r.devices.is_empty() {
                        self.refolding = true;
                        self.actions.push_back(UplinkAction::Refold(r.devices));
                    } else {
                        self.drop_partial();
                    }
                }
            }
            Downward::Goodbye(g) => self.close(now, g.reason),
            Downward::Heartbeat(_) => {}
            // A welcome out of turn, secure aggregation (devices and the root only) and transfer
            // frames: listed, so that a new downward message kind must be placed here.
            Downward::Welcome(_)
            | Downward::TransferOffer(_)
            | Downward::TransferResume(_)
            | Downward::Chunk(_)
            | Downward::SecAgg(_) => {
                tracing::debug!(kind = msg.kind_name(), "the parent sent what a relay does not take; ignored")
            }
        }
    }

    /// The clock reached `now`: batches of new cost records go up; after a goodbye, the link ends
    /// once the last records went up and were confirmed, or their time is up.
    pub fn handle_timeout(&mut self, now: Duration) {
        match self.state {
            UplinkState::Joined if self.next_costs.is_some_and(|t| now >= t) => {
                self.send_costs();
                self.next_costs = Some(now + COST_EVERY);
            }
            UplinkState::Closing { costs_until, sent_last: false, .. } if now >= costs_until => {
                self.send_last_costs(now);
            }
            UplinkState::Closing { confirmed_until, sent_last: true, .. } if now >= confirmed_until => {
                tracing::warn!(rounds = ?self.owed_cost_rounds(), "the parent did not confirm the last cost records");
                self.finish();
            }
            _ => {}
        }
    }

    /// The parent said goodbye: the last round's records may still be on their way.
    fn close(&mut self, now: Duration, reason: String) {
        self.goodbye = Some(reason);
        self.state = UplinkState::Closing {
            costs_until: now + LAST_COSTS,
            confirmed_until: now + LAST_COSTS + LAST_CONFIRMATIONS,
            sent_last: false,
        };
        if self.last_round_costed() {
            self.send_last_costs(now);
        }
    }

    fn send_last_costs(&mut self, now: Duration) {
        self.send_costs();
        if let UplinkState::Closing { sent_last, confirmed_until, .. } = &mut self.state {
            *sent_last = true;
            *confirmed_until = (*confirmed_until).min(now + LAST_CONFIRMATIONS);
        }
        self.check_closed(now);
    }

    /// While closing: ends the link once the last batches went up and every round is confirmed.
    fn check_closed(&mut self, _now: Duration) {
        if matches!(self.state, UplinkState::Closing { sent_last: true, .. }) && self.costs.is_empty() {
            self.finish();
        }
    }

    fn finish(&mut self) {
        self.state = UplinkState::Finished;
        let reason = self.goodbye.take().unwrap_or_default();
        self.actions.push_back(UplinkAction::Finished(reason));
    }

    /// Whether every device of the last acked partial has its cost record of that round here.
    fn last_round_costed(&self) -> bool {
        let (round, members) = &self.last_members;
        let records = self.costs.get(round).map_or(&[][..], Vec::as_slice);
        members.iter().all(|m| records.iter().any(|r| &r.client == m))
    }

    /// The owed partial is given up: none of its devices is counted.
    fn drop_partial(&mut self) {
        if let Some(p) = self.partial.take() {
            self.actions.push_back(UplinkAction::Verdict(ParentVerdict::dropped(p.update.round)));
        }
    }

    fn send_partial(&mut self, partial: Partial) {
        self.actions.push_back(UplinkAction::SendPartial(partial));
        self.actions.push_back(UplinkAction::Counted("sent"));
    }

    /// The owed cost records of each round that has new ones, in batches of bounded size
    /// ([`CostBatch::chunks`]; the parent's ledger ignores a row it holds, so a round's records
    /// may go up again whole). Each batch in flight counts the round's records up to its last.
    fn send_costs(&mut self) {
        for round in std::mem::take(&mut self.fresh) {
            let Some(records) = self.costs.get(&round).filter(|r| !r.is_empty()) else { continue };
            let mut carried = 0;
            for batch in CostBatch::chunks(records) {
                carried += batch.records.len();
                self.in_flight.entry(round).or_default().push_back(carried);
                self.actions.push_back(UplinkAction::Send(Message::CostBatch(batch)));
            }
        }
    }

    /// The parent confirmed `round`'s oldest batch in flight: its records are no longer owed.
    fn confirm(&mut self, round: u64) {
        let Some(carried) = self.in_flight.get_mut(&round).and_then(VecDeque::pop_front) else { return };
        let records = self.costs.entry(round).or_default();
        let confirmed = carried.min(records.len());
        records.drain(..confirmed);
        if let Some(later) = self.in_flight.get_mut(&round) {
            later.iter_mut().for_each(|n| *n = n.saturating_sub(confirmed));
            if later.is_empty() {
                self.in_flight.remove(&round);
            }
        }
        if records.is_empty() {
            self.costs.remove(&round);
        }
    }
}

#[cfg(test)]
mod tests {
    use anchorage_shared::ledger::CostRecord;
    use anchorage_shared::protocol::{
        Ack, CostAck, Goodbye, Member, Message, Partial, Refusal, RefusalReason, Update, Welcome,
    };

    use super::{
        COST_EVERY, LAST_CONFIRMATIONS, ParentVerdict, RESENT_COST_ROUNDS, UplinkAction, UplinkSession, UplinkState,
        owed_after_restart,
    };
    use std::time::Duration;

    #[test]
    fn a_restarted_relay_owes_its_last_rounds_cost_records_and_no_older_ones() {
        let record = |round| CostRecord { client: format!("d{round}"), round, ..CostRecord::default() };
        let ledger: Vec<CostRecord> = (1..=12).map(record).collect();
        let owed: Vec<u64> = owed_after_restart(12, ledger).map(|r| r.round).collect();
        assert_eq!(owed, (12 - RESENT_COST_ROUNDS + 1..=12).collect::<Vec<_>>());
        assert_eq!(owed_after_restart(3, (1..=3).map(record).collect()).count(), 3, "a young relay owes every round");
    }

    fn partial(round: u64, devices: &[&str]) -> Partial {
        let members: Vec<Member> =
            devices.iter().map(|d| Member { device: (*d).into(), num_samples: 10, hash: [1; 32] }).collect();
        let update = Update {
            prototypes_are: Default::default(),
            round,
            num_samples: 10 * devices.len() as u64,
            blocks: vec![],
            prototypes: vec![],
            metrics: vec![],
            compute_seconds: 0.0,
        };
        Partial { update, members }
    }

    fn welcome() -> Message {
        Message::Welcome(Welcome {
            server_id: "root".into(),
            method: "fedavg".into(),
            max_frame_bytes: 1 << 20,
            heartbeat_ms: 5000,
            current_round: None,
        })
    }

    fn record(client: &str, round: u64) -> CostRecord {
        CostRecord { client: client.into(), round, ..CostRecord::default() }
    }

    fn drain(s: &mut UplinkSession) -> Vec<UplinkAction> {
        std::iter::from_fn(|| s.poll_action()).collect()
    }

    fn joined(owed: Option<Partial>) -> UplinkSession {
        let mut s = UplinkSession::new(crate::relay::hello("relay-a", "fedavg", None), owed);
        s.connected(Duration::ZERO);
        assert!(matches!(drain(&mut s).as_slice(), [UplinkAction::Send(Message::Hello(_))]), "hello first");
        s.handle_message(Duration::ZERO, welcome());
        s
    }

    #[test]
    fn a_partial_is_owed_until_acked_and_sent_again_after_a_welcome() {
        let mut s = joined(Some(partial(3, &["d1"])));
        let actions = drain(&mut s);
        assert!(actions.contains(&UplinkAction::SendPartial(partial(3, &["d1"]))), "a restart's partial goes first");
        s.partial_closed(partial(4, &["d1", "d2"]));
        assert!(drain(&mut s).contains(&UplinkAction::SendPartial(partial(4, &["d1", "d2"]))));
        s.disconnected(Duration::from_secs(1));
        s.partial_closed(partial(5, &["d1"]));
        assert!(!drain(&mut s).iter().any(|a| matches!(a, UplinkAction::SendPartial(_))), "nothing is sent offline");
        s.connected(Duration::from_secs(2));
        s.handle_message(Duration::from_secs(2), welcome());
        assert!(drain(&mut s).contains(&UplinkAction::SendPartial(partial(5, &["d1"]))), "resent after the welcome");
        s.handle_message(Duration::from_secs(2), Message::Ack(Ack { round: 4, aggregated: true }));
        assert!(s.owed_partial().is_some(), "an ack of another round acks nothing");
        s.handle_message(Duration::from_secs(2), Message::Ack(Ack { round: 5, aggregated: false }));
        let verdict = ParentVerdict { round: 5, aggregated: false, members: vec!["d1".into()] };
        assert_eq!(
            drain(&mut s),
            [UplinkAction::Counted("acked"), UplinkAction::Verdict(verdict)],
            "late: its devices hear so"
        );
        assert!(s.owed_partial().is_none());
    }

    #[test]
    fn a_duplicate_refusal_is_folded_again_without_the_named_devices_or_dropped() {
        let mut s = joined(None);
        s.partial_closed(partial(2, &["d1", "d2"]));
        drain(&mut s);
        let twice = Refusal::duplicates("counted already", vec!["d1".into()]);
        s.handle_message(Duration::ZERO, Message::Refusal(twice.clone()));
        assert_eq!(drain(&mut s), [UplinkAction::Counted("refused"), UplinkAction::Refold(vec!["d1".into()])]);
        s.handle_message(Duration::ZERO, Message::Refusal(twice));
        assert!(drain(&mut s).is_empty(), "one refold at a time");
        s.refolded(Some(partial(2, &["d2"])));
        assert!(drain(&mut s).contains(&UplinkAction::SendPartial(partial(2, &["d2"]))));
        s.handle_message(Duration::ZERO, Message::Refusal(Refusal::duplicates("again", vec!["d2".into()])));
        drain(&mut s);
        s.refolded(None);
        assert_eq!(drain(&mut s), [UplinkAction::Verdict(ParentVerdict::dropped(2))], "nobody in it is acked");
        assert!(s.owed_partial().is_none(), "nothing left to fold: dropped, nobody counted twice");
        s.partial_closed(partial(3, &["d3"]));
        drain(&mut s);
        s.handle_message(Duration::ZERO, Message::Refusal(Refusal::new(RefusalReason::NotSampled, "no")));
        assert_eq!(drain(&mut s), [UplinkAction::Counted("refused"), UplinkAction::Verdict(ParentVerdict::dropped(3))]);
        assert!(s.owed_partial().is_none(), "a partial the parent will never take is not sent again");
    }

    #[test]
    fn cost_records_go_up_in_batches_until_their_round_is_confirmed() {
        let mut s = joined(None);
        drain(&mut s);
        s.cost(Duration::ZERO, record("d1", 1));
        s.cost(Duration::ZERO, record("d2", 1));
        assert_eq!(s.poll_timeout(), Some(COST_EVERY));
        s.handle_timeout(COST_EVERY);
        let batch = |records: Vec<CostRecord>| {
            UplinkAction::Send(Message::CostBatch(anchorage_shared::protocol::CostBatch { records }))
        };
        assert_eq!(drain(&mut s), [batch(vec![record("d1", 1), record("d2", 1)])]);
        s.handle_timeout(COST_EVERY * 2);
        assert!(drain(&mut s).is_empty(), "nothing new: no batch");
        s.disconnected(COST_EVERY * 2);
        s.connected(COST_EVERY * 3);
        s.handle_message(COST_EVERY * 3, welcome());
        drain(&mut s);
        s.handle_timeout(COST_EVERY * 4);
        assert_eq!(
            drain(&mut s),
            [batch(vec![record("d1", 1), record("d2", 1)])],
            "unconfirmed: again after a reconnect"
        );
        s.handle_message(COST_EVERY * 4, Message::CostAck(CostAck { round: 1 }));
        assert!(s.owed_cost_rounds().is_empty());
    }

    /// A relay's round with 2,000 devices (a 64 KiB control frame held about 700 records): its
    /// records go up in batches whose frames a parent with the default limits reads, in order and
    /// each once, and the round is owed until the last batch's confirmation.
    #[test]
    fn a_round_of_any_size_goes_up_in_frames_the_parent_reads() {
        use anchorage_shared::frame::{DEFAULT_MAX_FRAME, encode_frame};
        use anchorage_shared::protocol::CostBatch;
        let mut s = joined(None);
        drain(&mut s);
        let records: Vec<CostRecord> = (0..2000)
            .map(|d| CostRecord {
                payload_down: 3_000_000 + d,
                payload_up: 2_900_000,
                wire_down: 3_100_000,
                wire_up: 3_000_000,
                compute_seconds: 1.25,
                transfer_seconds: 0.5,
                wait_seconds: 0.125,
                wall_seconds: 2.0,
                rtt_seconds: 0.04,
                joules: 3.5,
                temperature_c: Some(61.5),
                battery_percent: Some(80),
                ..record(&format!("jetson-orin-device-{d:05}"), 1)
            })
            .collect();
        records.iter().for_each(|r| s.cost(Duration::ZERO, r.clone()));
        s.handle_timeout(COST_EVERY);
        let batches: Vec<CostBatch> = drain(&mut s)
            .into_iter()
            .map(|a| match a {
                UplinkAction::Send(Message::CostBatch(b)) => b,
                other => panic!("{other:?}"),
            })
            .collect();
        let limit = crate::transport::Limits::default().max_control_frame as usize;
        let frames: Vec<usize> = batches
            .iter()
            .map(|b| encode_frame(&Message::CostBatch(b.clone()), DEFAULT_MAX_FRAME).unwrap().len())
            .collect();
        println!("2000 records in {} batches, frames of {frames:?} bytes (limit {limit})", batches.len());
        assert!(batches.len() > 1 && frames.iter().all(|n| *n <= limit), "{frames:?}");
        assert_eq!(batches.iter().flat_map(|b| b.records.clone()).collect::<Vec<_>>(), records);
        for _ in 1..batches.len() {
            s.handle_message(COST_EVERY, Message::CostAck(CostAck { round: 1 }));
            assert_eq!(s.owed_cost_rounds(), [1], "owed until every batch is confirmed");
        }
        s.handle_message(COST_EVERY, Message::CostAck(CostAck { round: 1 }));
        assert!(s.owed_cost_rounds().is_empty());
    }

    /// A record that arrives after its round's batch went up is not confirmed by that batch's
    /// confirmation: it goes up in the next one.
    #[test]
    fn a_confirmation_confirms_only_what_its_batch_carried() {
        let mut s = joined(None);
        drain(&mut s);
        s.cost(Duration::ZERO, record("d1", 1));
        s.handle_timeout(COST_EVERY);
        assert_eq!(drain(&mut s).len(), 1, "the batch of d1");
        s.cost(COST_EVERY, record("d2", 1));
        s.handle_message(COST_EVERY, Message::CostAck(CostAck { round: 1 }));
        assert_eq!(s.owed_cost_rounds(), [1], "d2 is still owed");
        s.handle_timeout(COST_EVERY * 2);
        let batch = UplinkAction::Send(Message::CostBatch(anchorage_shared::protocol::CostBatch {
            records: vec![record("d2", 1)],
        }));
        assert_eq!(drain(&mut s), [batch]);
        s.handle_message(COST_EVERY * 2, Message::CostAck(CostAck { round: 1 }));
        assert!(s.owed_cost_rounds().is_empty());
    }

    #[test]
    fn after_the_goodbye_the_last_costs_go_up_and_are_confirmed_before_the_end() {
        let mut s = joined(None);
        s.partial_closed(partial(7, &["d1", "d2"]));
        s.handle_message(Duration::ZERO, Message::Ack(Ack { round: 7, aggregated: true }));
        s.cost(Duration::ZERO, record("d1", 7));
        drain(&mut s);
        s.handle_message(Duration::ZERO, Message::Goodbye(Goodbye { reason: "federation finished".into() }));
        assert!(drain(&mut s).is_empty(), "d2's record of round 7 is still on its way");
        s.cost(Duration::from_millis(100), record("d2", 7));
        let actions = drain(&mut s);
        assert!(matches!(actions.as_slice(), [UplinkAction::Send(Message::CostBatch(b))] if b.records.len() == 2));
        assert!(matches!(s.state(), UplinkState::Closing { sent_last: true, .. }));
        s.handle_message(Duration::from_millis(200), Message::CostAck(CostAck { round: 7 }));
        assert_eq!(drain(&mut s), [UplinkAction::Finished("federation finished".into())]);

        let mut unconfirmed = joined(None);
        unconfirmed.cost(Duration::ZERO, record("d1", 1));
        unconfirmed.handle_message(Duration::ZERO, Message::Goodbye(Goodbye { reason: "done".into() }));
        drain(&mut unconfirmed);
        let end = unconfirmed.poll_timeout().expect("a bound on the wait");
        assert!(end <= LAST_CONFIRMATIONS, "{end:?}");
        unconfirmed.handle_timeout(end);
        assert_eq!(drain(&mut unconfirmed), [UplinkAction::Finished("done".into())], "bounded: it ends anyway");
    }

    #[test]
    fn a_refusal_before_the_welcome_ends_the_link_for_good() {
        let mut s = UplinkSession::new(crate::relay::hello("relay-a", "fedavg", None), None);
        s.connected(Duration::ZERO);
        drain(&mut s);
        s.handle_message(Duration::ZERO, Message::Refusal(Refusal::new(RefusalReason::Revoked, "certificate revoked")));
        assert!(matches!(drain(&mut s).as_slice(), [UplinkAction::Refused(why)] if why.contains("Revoked")));
        s.connected(Duration::from_secs(1));
        assert!(drain(&mut s).is_empty(), "no hello after a definite refusal");
    }
}
