//! What the engine asks its shell to make durable, and what a store gives back to a restarted
//! engine. The rule is SQLite's own promise turned into a protocol: the shell commits every
//! [`Persist`] before it carries out the actions queued after it, so an ack, a broadcast or an
//! announcement never runs ahead of the state it refers to (ARCHITECTURE.md §6).

use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::protocol::Update;

use super::{Checkpoint, ClientId, RoundReport};

/// A state change the shell commits before anything queued after it happens.
#[derive(Debug, Clone)]
pub enum Persist {
    /// A client said a valid hello (the client registry's first / last seen). The shell fills
    /// in the SHA-256 fingerprint of the certificate it showed (mutual TLS).
    Seen { client: ClientId, fingerprint: Option<String> },
    /// A round opened; committed before its broadcast goes out, so a restart resumes the same
    /// round with the same invitations.
    Opened(OpenedRound),
    /// The open round's invitations changed (a device declined and another was invited in its
    /// place); committed before the new invitee's broadcast goes out.
    Invited { round: u64, sampled: Vec<ClientId> },
    /// An update was accepted; committed before its ack.
    Accepted(Arc<AcceptedUpdate>),
    /// A new global version and the close of the round that made it, in one transaction.
    Closed { checkpoint: Arc<Checkpoint>, report: Arc<RoundReport> },
    /// A relay's parent ran rounds up to `through` without it (the relay was down or cut off):
    /// its round numbers continue above `through`. Committed before the next round opens.
    PassedOver { through: u64 },
}

/// A round as it opened.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenedRound {
    pub round: u64,
    pub task: u32,
    /// Updates the round waits for.
    pub target: usize,
    /// Clients invited.
    pub sampled: Vec<ClientId>,
}

/// An update the engine accepted (and will aggregate in the round, or buffered version, it
/// belongs to).
#[derive(Debug, Clone, PartialEq)]
pub struct AcceptedUpdate {
    pub client: ClientId,
    pub update: Update,
    /// Buffered mode: versions between the one it trained on and the current one (0 in rounds).
    pub staleness: u64,
    /// Time from the round's (or version's) start to its arrival.
    pub arrived_after: Duration,
}

/// Rounds' invitations: (round, invited clients, those whose cost record the store holds).
pub type Invitations = Vec<(u64, Vec<ClientId>, Vec<ClientId>)>;

/// What a store hands a restarted engine: the last global version and the work accepted since.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovered {
    pub checkpoint: Checkpoint,
    /// The round that was open at the crash (synchronous mode), if any.
    pub open: Option<OpenedRound>,
    /// Accepted updates that no closed version has aggregated yet.
    pub pending: Vec<AcceptedUpdate>,
    /// Clients whose update the last closed round aggregated (a resend of one is a duplicate).
    pub last_accepted: Vec<ClientId>,
    /// Round numbers up to this were announced before an accepted rollback: the next round is
    /// numbered above it (0: none).
    pub round_floor: u64,
    /// The last rounds' invitations: (round, invited clients, those whose cost record the
    /// ledger holds), so that resent cost records are judged as before the restart.
    pub invitations: Invitations,
    /// The privacy account of the last round report that has one (`[engine.privacy]`).
    pub privacy: Option<super::privacy::PrivacyAccount>,
}
