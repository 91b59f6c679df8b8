//! Every way a message or a round is refused. Handling never panics on what a peer sent: each
//! malformed message maps to one variant here, and the state that refused it is left as it was.

use crate::messages::{ClientId, Stage};

/// A refused message, a refused configuration, or a round that cannot finish.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SecAggError {
    /// A message of another stage than the one the state machine is in.
    #[error("a {got:?} message while in stage {expected:?}")]
    WrongStage {
        /// The stage the state machine is in.
        expected: Stage,
        /// The stage of the message.
        got: Stage,
    },
    /// A message for another round.
    #[error("a message for round {got}, this is round {expected}")]
    WrongRound {
        /// The round the state machine is in.
        expected: u64,
        /// The round the message names.
        got: u64,
    },
    /// A vector, a ciphertext or a list of the wrong length.
    #[error("{what}: length {got}, expected {expected}")]
    WrongLength {
        /// What had the wrong length.
        what: &'static str,
        /// The length it must have.
        expected: usize,
        /// The length it has.
        got: usize,
    },
    /// A sender that is not in the round's sample.
    #[error("client {0} is not in this round")]
    UnknownSender(ClientId),
    /// A client of the sample that was left out of the stage (it did not answer an earlier one).
    #[error("client {0} is no longer part of this round")]
    Excluded(ClientId),
    /// The same client twice: a second message in one stage, or an entry listed twice.
    #[error("client {0} appears twice")]
    Duplicate(ClientId),
    /// A key, share or list entry naming a client that is not a neighbour (or is the client itself).
    #[error("client {0} is not a neighbour here")]
    NotNeighbour(ClientId),
    /// An encrypted share that does not open (bad AEAD tag: tampered, or not for this client).
    #[error("the share from client {0} does not decrypt")]
    BadTag(ClientId),
    /// A share that decrypts but names another owner, holder or round than the one it came as.
    #[error("the share from client {from} is for another peer or round")]
    WrongPeer {
        /// The client the share came from.
        from: ClientId,
    },
    /// Survivor / dropped lists that do not partition the neighbours this client holds shares of.
    #[error("inconsistent survivor and dropped sets: {0}")]
    Inconsistent(&'static str),
    /// A request for the self-mask share and the key share of one client (SecAgg's invariant).
    #[error("refused to reveal both kinds of share of client {0}")]
    BothShares(ClientId),
    /// Fewer than the threshold: neighbours, shares, or clients.
    #[error("{what}: {have} of the {need} needed")]
    BelowThreshold {
        /// What fell short: neighbours, shares, or clients.
        what: &'static str,
        /// How many there are.
        have: usize,
        /// How many are needed.
        need: usize,
    },
    /// A public key that is a low-order point (its agreement would not be secret).
    #[error("client {0} sent an unusable public key")]
    BadKey(ClientId),
    /// A share value that is not a canonical field element.
    #[error("client {0} sent a share that is not a field element")]
    BadShare(ClientId),
    /// A reconstructed mask key whose public key is not the one the client advertised.
    #[error("the key reconstructed for client {0} does not match its public key")]
    ReconstructionMismatch(ClientId),
    /// Degree, threshold, sample or quantiser settings that cannot work.
    #[error("invalid parameters: {0}")]
    BadParams(&'static str),
    /// Bytes that do not decode as a message.
    #[error("undecodable message: {0}")]
    Decode(postcard::Error),
    /// The secret-sharing library refused (a bug or an impossible input; never a peer's doing).
    #[error("secret sharing failed: {0}")]
    Sharing(&'static str),
    /// Round 2 reached a client whose input was not provided yet; retry after providing it.
    #[error("the input is not there yet")]
    NoInput,
    /// An update or global model that does not fit the round's layout (a block's name or shape, a
    /// prototype's class, an undecodable tensor).
    #[error("the update does not fit the layout: {0}")]
    BadUpdate(String),
}

impl SecAggError {
    /// A short, stable name for a metric label (`secagg_refused_total{reason="bad_tag"}`).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::WrongStage { .. } => "wrong_stage",
            Self::WrongRound { .. } => "wrong_round",
            Self::WrongLength { .. } => "wrong_length",
            Self::UnknownSender(_) => "unknown_sender",
            Self::Excluded(_) => "excluded",
            Self::Duplicate(_) => "duplicate",
            Self::NotNeighbour(_) => "not_neighbour",
            Self::BadTag(_) => "bad_tag",
            Self::WrongPeer { .. } => "wrong_peer",
            Self::Inconsistent(_) => "inconsistent",
            Self::BothShares(_) => "both_shares",
            Self::BelowThreshold { .. } => "below_threshold",
            Self::BadKey(_) => "bad_key",
            Self::BadShare(_) => "bad_share",
            Self::ReconstructionMismatch(_) => "reconstruction_mismatch",
            Self::BadParams(_) => "bad_params",
            Self::Decode(_) => "decode",
            Self::Sharing(_) => "sharing",
            Self::NoInput => "no_input",
            Self::BadUpdate(_) => "bad_update",
        }
    }
}

impl From<postcard::Error> for SecAggError {
    fn from(e: postcard::Error) -> Self {
        Self::Decode(e)
    }
}
