//! The sans-IO state machine of one client's life: join → wait → train → upload → wait.
//!
//! Like `quinn-proto`, it owns no socket and no thread: the shell feeds it what happened
//! (connected, a message arrived, training finished, the connection dropped) and carries out the
//! actions it emits. Training itself runs outside (it is slow and belongs to the method); the
//! session only decides *when* to train and *what* to send.
//!
//! The update is persisted before it is uploaded and kept until the server acknowledges it, so a
//! dropped connection or a restarted process resends it after the next hello; the server
//! de-duplicates by (client, round). Only the ack for its round clears it; an update the server
//! refuses for good is not resent but set aside, never deleted.
//!
//! The session also keeps each round's cost record ([`cost`]) and emits it once complete, for
//! both shells: the shell passes in the times and wire bytes it measured and what the device read
//! of itself (the session reads no clock and no device), the session does the accounting. Where
//! the records go to the server's ledger ([`Session::reporting_costs`]) it also sends each and
//! sends it again until the server confirms it ([`reports`]).

mod cost;
mod reports;
mod secagg;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::ledger::CostRecord;
use anchorage_shared::ledger::DeclineReason;
use anchorage_shared::protocol::{
    Broadcast, Capabilities, Decline, Downward, Hello, MAX_DECLINE_DETAIL, Message, Refusal, RefusalReason, Update,
};

pub use cost::UploadMeasure;

use crate::eligibility::Readings;
use crate::methods::Trained;

/// What the session asks its shell to do.
#[derive(Debug, Clone, PartialEq)]
pub enum SessionAction {
    /// Send a control message.
    Send(Message),
    /// Train on this broadcast and call [`Session::trained`] with the result.
    Train(Broadcast),
    /// Upload this update on its own stream and report what it took with [`Session::uploaded`].
    Upload(Update),
    /// Under secure aggregation: send this masked vector of `round`'s update as a
    /// resumable transfer on its own stream, like an update, and report it with
    /// [`Session::uploaded`].
    UploadMasked { round: u64, msg: Message },
    /// Persist the unacknowledged update (`None`: clear it, only ever after the ack for its round)
    /// before anything else happens.
    Persist(Option<Update>),
    /// The server refused the unacknowledged update of `round` for good: it is not resent, and its
    /// file is set aside (kept for an operator), never deleted.
    SetAsidePending { round: u64, reason: String },
    /// The federation is over (goodbye) or refused us for good; stop.
    Finished { reason: String },
    /// A round's cost record is complete (its update uploaded and acknowledged; `straggler`: the
    /// ack said it came after its round closed). The real shell logs it (and, reporting costs,
    /// the session sends it next as a `Cost` message); the simulator files it in its own ledger.
    Cost(CostRecord),
}

/// Where the session stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionState {
    /// No connection.
    Disconnected,
    /// Hello sent, waiting for the welcome.
    Joining,
    /// Waiting for a broadcast.
    Idle,
    /// Training for a round.
    Training {
        round: u64,
    },
    /// Update sent, waiting for its acknowledgement.
    Uploading {
        round: u64,
    },
    Finished,
}

/// Why the session rejected a message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SessionError {
    #[error("unexpected {kind} while {state:?}")]
    Unexpected { kind: &'static str, state: SessionState },
    /// A secure aggregation message refused (its `reason` names the kind, for metrics).
    #[error("secure aggregation message refused ({reason}): {detail}")]
    SecAgg { reason: &'static str, detail: String },
}

/// One client's session. See the module docs.
#[derive(Debug)]
pub struct Session {
    client_id: String,
    /// Shared: a simulator holds a million sessions with the same capabilities.
    capabilities: Arc<Capabilities>,
    num_samples: u64,
    state: SessionState,
    /// A connection is up (training may outlive a connection).
    connected: bool,
    /// The last update produced and not yet acknowledged.
    pending: Option<Update>,
    /// The newest round this client trained for.
    last_trained: Option<u64>,
    /// The server's refusal that ended the session, if one did.
    refused: Option<Refusal>,
    /// The cost records of the rounds in flight.
    costs: cost::Costs,
    /// The records sent to the server's ledger and not confirmed yet; `None`: the records are not
    /// sent (the simulator files them itself).
    reports: Option<reports::Unconfirmed>,
    /// Secure aggregation (`secure_aggregation` in client.toml): the update never travels in the clear.
    /// Boxed: most sessions have none, and it is larger than the rest of the session.
    secagg: Option<Box<secagg::DeviceSecAgg>>,
    actions: VecDeque<SessionAction>,
}

impl Session {
    /// A session; `pending` is an unacknowledged update restored from the store.
    pub fn new(
        client_id: impl Into<String>,
        capabilities: impl Into<Arc<Capabilities>>,
        num_samples: u64,
        pending: Option<Update>,
    ) -> Self {
        let last_trained = pending.as_ref().map(|u| u.round);
        Self {
            client_id: client_id.into(),
            capabilities: capabilities.into(),
            num_samples,
            state: SessionState::Disconnected,
            connected: false,
            pending,
            last_trained,
            refused: None,
            costs: cost::Costs::default(),
            reports: None,
            secagg: None,
            actions: VecDeque::new(),
        }
    }

    /// Secure aggregation on: the update is only ever sent masked, and `entropy` (32
    /// random bytes; the operating system's in the field, a seed's in a simulation) roots each
    /// round's keys.
    pub fn with_secure_aggregation(mut self, entropy: [u8; 32]) -> Self {
        self.secagg = Some(Box::new(secagg::DeviceSecAgg::new(entropy)));
        self
    }

    /// Cost records go to the server's ledger: each complete record (`Cost`) is followed by its
    /// `Cost` message, kept until the server's `CostAck` and sent again after every welcome.
    pub fn reporting_costs(mut self) -> Self {
        self.reports = Some(reports::Unconfirmed::default());
        self
    }

    /// Counts only a broadcast's parameter blocks in its rounds' `payload_down`, not its
    /// prototypes. The virtual clock's ledger has always counted so, unlike the real clock's and
    /// ARCHITECTURE.md §7; this keeps its ledger as it was.
    pub fn payload_down_without_prototypes(mut self) -> Self {
        self.costs.without_prototypes_down();
        self
    }

    /// The process restarted (the simulator's crash): a new session from what the store kept,
    /// the unacknowledged update, with `num_samples` now held. The cost records of the rounds in
    /// flight go on: the simulator measures its devices from outside (a real restart loses them).
    pub fn restart(&mut self, num_samples: u64) {
        let costs = std::mem::take(&mut self.costs);
        let reports = self.reports.take();
        let pending = self.pending.take();
        // A restart loses the round's keys and shares; the entropy root stays.
        let secagg = self.secagg.take().map(|s| Box::new(s.restarted()));
        *self = Self::new(self.client_id.clone(), self.capabilities.clone(), num_samples, pending);
        self.costs = costs;
        self.reports = reports;
        self.secagg = secagg;
    }

    pub fn state(&self) -> SessionState {
        self.state
    }

    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    /// The server's refusal that ended the session (`NotEnrolled`, `VersionMismatch`,
    /// `UnknownMethod`): the shell stops the client with it as an error, not as a finished run.
    pub fn refusal(&self) -> Option<&Refusal> {
        self.refused.as_ref()
    }

    /// Whether the device holds nothing in flight: idle, no update waiting for its ack, no cost
    /// record waiting for its confirmation, nothing queued to send (it may change servers
    /// without losing a round's work or sending out of turn).
    pub fn at_rest(&self) -> bool {
        self.state == SessionState::Idle
            && self.pending.is_none()
            && self.actions.is_empty()
            && self.reports.as_ref().is_none_or(|r| r.records().next().is_none())
    }

    /// The update waiting for an acknowledgement, if any.
    pub fn pending(&self) -> Option<&Update> {
        self.pending.as_ref()
    }

    pub fn poll_action(&mut self) -> Option<SessionAction> {
        let action = self.actions.pop_front();
        if action.is_none() && self.actions.capacity() > 0 {
            // An idle session holds no buffer: a simulator keeps a million of them between rounds.
            self.actions = VecDeque::new();
        }
        action
    }

    /// A connection is up: say hello.
    pub fn connected(&mut self) {
        if self.state == SessionState::Finished {
            return;
        }
        self.connected = true;
        if !matches!(self.state, SessionState::Training { .. }) {
            self.state = SessionState::Joining;
        }
        self.actions.push_back(SessionAction::Send(Message::Hello(Box::new(Hello {
            client_id: self.client_id.clone(),
            capabilities: (*self.capabilities).clone(),
            num_samples: self.num_samples,
            last_round: self.last_trained,
        }))));
    }

    /// The connection is gone. The pending update is kept for the next connection; training in
    /// progress goes on and its result is uploaded after reconnecting.
    pub fn disconnected(&mut self) {
        self.connected = false;
        if !matches!(self.state, SessionState::Finished | SessionState::Training { .. }) {
            self.state = SessionState::Disconnected;
        }
    }

    /// A message from the server, arrived at `now` (the shell's clock), `wire_bytes` on the wire
    /// (what the shell measured; a broadcast's go into its round's cost record).
    pub fn handle_message(&mut self, now: Duration, msg: Message, wire_bytes: u64) -> Result<(), SessionError> {
        let msg = match Downward::try_from(msg) {
            Ok(msg) => msg,
            Err(up) => return Err(self.unexpected(up.kind_name())),
        };
        match msg {
            Downward::Welcome(_) => {
                self.resend_costs();
                match self.state {
                    SessionState::Joining => self.state = SessionState::Idle,
                    // Reconnected while training: the result is uploaded when it is ready.
                    SessionState::Training { .. } => return Ok(()),
                    _ => return Err(self.unexpected("welcome")),
                }
                if let Some(update) = self.pending.clone().filter(|_| self.secagg.is_none()) {
                    tracing::info!(round = update.round, "resending the unacknowledged update");
                    self.upload(update);
                }
            }
            Downward::Broadcast(b) => {
                self.costs.broadcast(now, &b, wire_bytes);
                self.on_broadcast(b);
            }
            Downward::Ack(ack) => {
                if let Some(record) = self.costs.acked(now, ack.round, ack.aggregated, &self.client_id) {
                    self.completed(record);
                }
                if self.pending.as_ref().is_some_and(|u| u.round == ack.round) {
                    self.pending = None;
                    self.actions.push_back(SessionAction::Persist(None));
                    if self.state == (SessionState::Uploading { round: ack.round }) {
                        self.state = SessionState::Idle;
                    }
                    if !ack.aggregated {
                        tracing::info!(round = ack.round, "update arrived after its round closed (counted as late)");
                    }
                }
            }
            Downward::Refusal(r) => self.on_refusal(r),
            Downward::Goodbye(g) => self.finish(g.reason),
            Downward::SecAgg(frame) => self.on_secagg(&frame)?,
            Downward::CostAck(a) => {
                if let Some(reports) = self.reports.as_mut() {
                    reports.confirmed(a.round);
                }
            }
            Downward::Heartbeat(_) => {}
            // Transfer messages ride their own streams (the shell's), never the control stream.
            Downward::TransferOffer(_) | Downward::TransferResume(_) | Downward::Chunk(_) => {
                return Err(self.unexpected(msg.kind_name()));
            }
        }
        Ok(())
    }

    /// The server refused: a refusal of the device itself ends the session; one of its pending
    /// update stops the resending (the file is set aside, never deleted); the rest are logged.
    fn on_refusal(&mut self, r: Refusal) {
        tracing::warn!(reason = ?r.reason, detail = %r.detail, "server refused");
        match r.reason {
            RefusalReason::VersionMismatch
            | RefusalReason::UnknownMethod
            | RefusalReason::NotEnrolled
            | RefusalReason::Revoked => {
                if self.state != SessionState::Finished {
                    self.finish(format!("refused: {:?}: {}", r.reason, r.detail));
                    self.refused = Some(r);
                }
            }
            RefusalReason::ShapeMismatch
            | RefusalReason::BadTensor
            | RefusalReason::NotSampled
            | RefusalReason::Malformed => {
                // The pending update can never be accepted: stop resending it, but keep its
                // file aside (only an ack deletes an update).
                if let Some(update) = self.pending.take() {
                    self.actions.push_back(SessionAction::SetAsidePending {
                        round: update.round,
                        reason: format!("{:?}: {}", r.reason, r.detail),
                    });
                }
                if matches!(self.state, SessionState::Uploading { .. }) {
                    self.state = SessionState::Idle;
                }
            }
            RefusalReason::Duplicate | RefusalReason::TooLarge | RefusalReason::ServerBusy => {}
        }
    }

    fn on_broadcast(&mut self, b: Broadcast) {
        if self.state == SessionState::Finished {
            return;
        }
        if let Some(secagg) = self.secagg.as_mut() {
            secagg.broadcast(b.round, &b.blocks);
        }
        // Already trained for this round: the server lost or never got the update; resend it
        // (never in the clear under secure aggregation: the server asks for it masked).
        if let Some(update) = self.pending.as_ref().filter(|u| u.round == b.round && self.secagg.is_none()).cloned() {
            self.upload(update);
            return;
        }
        if self.last_trained.is_some_and(|r| b.round <= r) || matches!(self.state, SessionState::Training { .. }) {
            tracing::debug!(round = b.round, "ignoring a broadcast for a round already handled");
            return;
        }
        self.state = SessionState::Training { round: b.round };
        self.actions.push_back(SessionAction::Train(b));
    }

    /// Training for `round` finished after the device computed for `compute` (the caller timed it:
    /// see `ClientMethod::train_measured`): the session turns the method's result into the round's
    /// wire update, which carries the compute time, as does the round's cost record. Persist the
    /// update, then upload it.
    pub fn trained(&mut self, round: u64, trained: Trained, compute: Duration) {
        let update = trained.into_update(round, compute);
        self.costs.trained(update.round, compute);
        self.last_trained = Some(update.round);
        self.pending = Some(update.clone());
        self.actions.push_back(SessionAction::Persist(Some(update.clone())));
        if self.state == SessionState::Finished {
            return;
        }
        if let Some(secagg) = self.secagg.as_mut() {
            self.costs.upload(&update);
            self.state = if self.connected {
                SessionState::Uploading { round: update.round }
            } else {
                SessionState::Disconnected
            };
            let reply = secagg.trained(&update);
            // A refusal here is the device's own (its update does not fit the layout): logged.
            let _ = self.secagg_reply(update.round, reply);
            return;
        }
        if !self.connected {
            // The welcome after reconnecting uploads it.
            self.state = SessionState::Disconnected;
        } else if matches!(self.state, SessionState::Training { .. }) {
            self.upload(update);
        }
    }

    /// A message of the round's secure aggregation: answered at once, or (the ask for the
    /// masked vector) once the update is trained.
    fn on_secagg(&mut self, frame: &anchorage_shared::protocol::SecAggFrame) -> Result<(), SessionError> {
        let Some(secagg) = self.secagg.as_mut() else {
            let detail = "secure aggregation is off on this device (secure_aggregation in client.toml)".to_string();
            return Err(SessionError::SecAgg { reason: "off", detail });
        };
        let reply = secagg.on_frame(frame, self.pending.as_ref());
        self.secagg_reply(frame.round, reply)
    }

    /// Queues what the device's secure aggregation answered, or reports its refusal.
    fn secagg_reply(
        &mut self,
        round: u64,
        reply: Result<secagg::Reply, anchorage_secagg::SecAggError>,
    ) -> Result<(), SessionError> {
        match reply {
            Ok(secagg::Reply::Control(msg)) => self.actions.push_back(SessionAction::Send(msg)),
            Ok(secagg::Reply::Masked(msg)) => self.actions.push_back(SessionAction::UploadMasked { round, msg }),
            Ok(secagg::Reply::Nothing) => {}
            Err(e) => {
                tracing::warn!(round, reason = e.reason(), error = %e, "secure aggregation message refused");
                return Err(SessionError::SecAgg { reason: e.reason(), detail: e.to_string() });
            }
        }
        Ok(())
    }

    /// An upload of `round`'s update ended at `now` (the shell's clock) having taken what `m`
    /// says; with the round's ack in, its cost record is complete.
    pub fn uploaded(&mut self, now: Duration, round: u64, m: UploadMeasure) {
        if let Some(record) = self.costs.uploaded(now, round, m, &self.client_id) {
            self.completed(record);
        }
    }

    /// What the device read of itself right after training `round` (only where the shell reads
    /// the device): the round's cost record carries its condition.
    pub fn condition(&mut self, round: u64, readings: &Readings) {
        self.costs.condition(round, readings);
    }

    /// A round's cost record is complete: emitted, and, reporting costs, sent and kept until the
    /// server confirms it.
    fn completed(&mut self, record: CostRecord) {
        let Some(reports) = self.reports.as_mut() else {
            self.actions.push_back(SessionAction::Cost(record));
            return;
        };
        self.actions.push_back(SessionAction::Cost(record.clone()));
        self.actions.push_back(SessionAction::Send(Message::Cost(record.clone())));
        reports.sent(record);
    }

    /// After a welcome: the records the server has not confirmed are sent again.
    fn resend_costs(&mut self) {
        let Some(reports) = &self.reports else { return };
        for record in reports.records() {
            tracing::debug!(client = %self.client_id, round = record.round, "resending an unconfirmed cost record");
            self.actions.push_back(SessionAction::Send(Message::Cost(record.clone())));
        }
    }

    /// Asks the shell to upload `update` and waits for its ack.
    fn upload(&mut self, update: Update) {
        self.costs.upload(&update);
        self.state = SessionState::Uploading { round: update.round };
        self.actions.push_back(SessionAction::Upload(update));
    }

    /// The device should not train now (its `[eligibility]`): instead of training for
    /// `round` it tells the server why and waits for the next broadcast. A broadcast of the same
    /// round sent again later is trained on if the device is eligible by then.
    pub fn declined(&mut self, round: u64, reason: DeclineReason, detail: &str) {
        if self.state != (SessionState::Training { round }) {
            return;
        }
        tracing::info!(round, reason = reason.name(), detail, "declining the round: not eligible to train now");
        self.costs.forget(round);
        self.state = if self.connected { SessionState::Idle } else { SessionState::Disconnected };
        if self.connected {
            let mut detail = detail.to_string();
            if detail.len() > MAX_DECLINE_DETAIL {
                let cut = (0..=MAX_DECLINE_DETAIL).rev().find(|i| detail.is_char_boundary(*i)).unwrap_or(0);
                detail.truncate(cut);
            }
            self.actions.push_back(SessionAction::Send(Message::Decline(Decline { round, reason, detail })));
        }
    }

    /// Training failed: go back to waiting.
    pub fn training_failed(&mut self, round: u64, error: &str) {
        tracing::error!(round, error, "local training failed");
        if self.state == (SessionState::Training { round }) {
            self.state = SessionState::Idle;
        }
    }

    fn finish(&mut self, reason: String) {
        self.state = SessionState::Finished;
        self.actions.push_back(SessionAction::Finished { reason });
    }

    fn unexpected(&self, kind: &'static str) -> SessionError {
        SessionError::Unexpected { kind, state: self.state }
    }
}

#[cfg(test)]
mod tests;
