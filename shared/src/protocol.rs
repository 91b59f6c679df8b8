//! Protocol v1: versioned, append-only messages.
//!
//! On the wire every message is a frame (see [`crate::frame`]): a little-endian `u32` length,
//! the protocol version byte, a message-kind byte and a postcard body. The kind byte sits
//! outside postcard so that an unknown kind from a newer peer is recognised as such.
//! New messages get new kind numbers; existing numbers and fields never change meaning.

use alloc::boxed::Box;
use alloc::string::String;
use alloc::vec::Vec;
use serde::{Deserialize, Serialize};

use crate::ledger::{CostRecord, DeclineReason};
use crate::metric::MetricKey;
use crate::prototype::Prototype;
use crate::tensor::{ParamBlock, TensorError};

/// Most methods a client may announce.
pub const MAX_METHODS: usize = 16;

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u8 = 1;

/// Why a frame or message could not be decoded.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    /// A frame that ends before its header or its declared length.
    #[error("frame truncated: need {needed} bytes, have {have}")]
    Truncated {
        /// Bytes the frame needs.
        needed: usize,
        /// Bytes there are.
        have: usize,
    },
    /// A frame longer than the largest accepted.
    #[error("frame of {len} bytes exceeds the maximum of {max}")]
    Oversized {
        /// The frame's length in bytes (after the length prefix).
        len: usize,
        /// The largest accepted, in bytes.
        max: usize,
    },
    /// A frame of another protocol version.
    #[error("protocol version {got} is not supported (this side speaks {expected})")]
    WrongVersion {
        /// The frame's version byte.
        got: u8,
        /// [`PROTOCOL_VERSION`].
        expected: u8,
    },
    /// A kind byte this version does not know.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    /// A body that postcard cannot decode as its kind's message.
    #[error("malformed {kind} body: {detail}")]
    Body {
        /// The kind's name ([`kind_name`]).
        kind: &'static str,
        /// Postcard's error.
        detail: String,
    },
    /// A tensor or block that does not validate.
    #[error("{0}")]
    Tensor(#[from] TensorError),
    /// A message that decodes but breaks a rule of its own (lengths, bounds, finite values).
    #[error("invalid message: {0}")]
    Invalid(String),
}

/// What a client can do, sent in its [`Hello`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Capabilities {
    /// Compute backend actually in use (`flex`, `wgpu`, `cuda:0`, ...).
    pub backend: String,
    /// Memory budget in MiB the client may use for training.
    pub memory_mb: u32,
    /// Methods whose client half this build carries (at most [`MAX_METHODS`], names of at most
    /// 32 bytes: bounded at decode time, so a hostile hello cannot make the server allocate).
    pub methods: heapless::Vec<heapless::String<32>, MAX_METHODS>,
}

/// First message of a client on its control stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// The client's identity. With mutual TLS the certificate's name must match it.
    pub client_id: String,
    /// What the client can do.
    pub capabilities: Capabilities,
    /// Number of training samples the client holds now (for sampling and weighting).
    pub num_samples: u64,
    /// The last round whose broadcast the client has applied, if any.
    pub last_round: Option<u64>,
}

/// The server's answer to an accepted [`Hello`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Welcome {
    /// The server's identity.
    pub server_id: String,
    /// Method the federation runs (`fedavg`, ...).
    pub method: String,
    /// Largest frame the server accepts, in bytes.
    pub max_frame_bytes: u32,
    /// How often the client should send a heartbeat, in milliseconds.
    pub heartbeat_ms: u32,
    /// The round currently open, if any.
    pub current_round: Option<u64>,
}

/// Local training settings for one round (Flower's `configure_fit`). Written by operators as
/// server.toml's `[engine.round]`, where a misspelt key is refused (the wire encoding, postcard,
/// carries no field names, so this changes nothing on the wire).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoundConfig {
    /// Passes over the local data per round.
    pub local_epochs: u32,
    /// Samples per training step.
    pub batch_size: u32,
    /// Step size of local training.
    pub learning_rate: f32,
    /// Time the server waits for updates, in milliseconds from the broadcast.
    pub deadline_ms: u64,
}

/// Round start: the global state every sampled client trains from. Encoded once, sent to all.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Broadcast {
    /// The round's number.
    pub round: u64,
    /// The task (stage of the class/domain stream) this round belongs to.
    pub task: u32,
    /// Local training settings.
    pub config: RoundConfig,
    /// Shared parameter blocks of the global model.
    pub blocks: Vec<ParamBlock>,
    /// Global class prototypes (empty for methods without prototypes).
    pub prototypes: Vec<Prototype>,
}

/// A named scalar reported by a client (train loss, local accuracy, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metric {
    /// The metric's name.
    pub name: String,
    /// Its value (finite).
    pub value: f64,
}

/// A client's result for one round.
///
/// On the wire (protocol v1) the prototypes' form travels as the metric `prototype_sums` = 1
/// ([`MetricKey::PrototypeSums`]) at the end of `metrics`; in memory it is the typed
/// `prototypes_are`, and `metrics` never holds the marker. [`Update`]'s serde impls are the one
/// place that translates, so every encoding (frames, partial aggregates, stored updates) keeps the
/// v1 bytes.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(from = "UpdateV1")]
pub struct Update {
    /// The round the update is for.
    pub round: u64,
    /// Samples the update was trained on (the FedAvg weight).
    pub num_samples: u64,
    /// The shared parameter blocks after local training.
    pub blocks: Vec<ParamBlock>,
    /// The client's class prototypes (empty for methods without prototypes).
    pub prototypes: Vec<Prototype>,
    /// Whether `prototypes` are per-class means or sums.
    pub prototypes_are: PrototypeForm,
    /// Named scalars of local training (finite).
    pub metrics: Vec<Metric>,
    /// Seconds of local computation, as measured by the client.
    pub compute_seconds: f64,
}

/// What an update's prototypes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrototypeForm {
    /// Per-class means with their counts (FedProK Eq. 9 fuses them count-weighted).
    #[default]
    Means,
    /// Per-class sums of clipped features with their counts (a device under `[privacy]`): the
    /// server noises the sums and divides after.
    Sums,
}

/// An update as protocol v1 spells it: the prototypes' form as a marker metric.
#[derive(Deserialize)]
struct UpdateV1 {
    round: u64,
    num_samples: u64,
    blocks: Vec<ParamBlock>,
    prototypes: Vec<Prototype>,
    metrics: Vec<Metric>,
    compute_seconds: f64,
}

/// [`UpdateV1`], borrowed, for encoding without a copy of the blocks.
#[derive(Serialize)]
struct UpdateV1Ref<'a> {
    round: u64,
    num_samples: u64,
    blocks: &'a [ParamBlock],
    prototypes: &'a [Prototype],
    metrics: &'a [Metric],
    compute_seconds: f64,
}

impl From<UpdateV1> for Update {
    fn from(v1: UpdateV1) -> Self {
        let UpdateV1 { round, num_samples, blocks, prototypes, mut metrics, compute_seconds } = v1;
        let marked = metrics.iter().any(|m| m.key() == MetricKey::PrototypeSums);
        metrics.retain(|m| m.key() != MetricKey::PrototypeSums);
        let prototypes_are = if marked { PrototypeForm::Sums } else { PrototypeForm::Means };
        Update { round, num_samples, blocks, prototypes, prototypes_are, metrics, compute_seconds }
    }
}

impl Serialize for Update {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let marked: Vec<Metric>;
        let metrics = match self.prototypes_are {
            PrototypeForm::Means => self.metrics.as_slice(),
            PrototypeForm::Sums => {
                marked = self.metrics.iter().cloned().chain([Metric::new(MetricKey::PrototypeSums, 1.0)]).collect();
                marked.as_slice()
            }
        };
        UpdateV1Ref {
            round: self.round,
            num_samples: self.num_samples,
            blocks: &self.blocks,
            prototypes: &self.prototypes,
            metrics,
            compute_seconds: self.compute_seconds,
        }
        .serialize(serializer)
    }
}

/// The server received an update and will not need it again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ack {
    /// The round of the update.
    pub round: u64,
    /// False when the update arrived after its round closed: counted as late, not aggregated.
    pub aggregated: bool,
}

/// The server's ledger holds the client's cost record of `round` (committed): the client stops
/// resending it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostAck {
    /// The round of the cost record.
    pub round: u64,
}

/// The first frame of a resumable transfer, on a bi stream its sender opens: what is
/// about to be sent. `transfer` is the SHA-256 of the whole frame being moved (an update's), so
/// both sides name the same bytes after a reconnect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransferOffer {
    /// SHA-256 of the whole frame.
    pub transfer: [u8; 32],
    /// Bytes of the whole frame.
    pub total: u64,
    /// The round the update is for (the receiver drops what it holds of it when the round closes).
    pub round: u64,
}

/// The receiver's answer to a [`TransferOffer`]: the bytes of it it already holds, from the
/// start; the sender goes on from there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TransferResume {
    /// The transfer ([`TransferOffer::transfer`]).
    pub transfer: [u8; 32],
    /// Bytes of the frame the receiver holds, from the start.
    pub offset: u64,
}

/// One piece of a transfer: `data` at `offset` of the whole frame; `hash` is the SHA-256 of
/// `data`, checked before a byte of it is kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Chunk {
    /// Where `data` starts in the whole frame, in bytes.
    pub offset: u64,
    /// SHA-256 of `data`.
    pub hash: [u8; 32],
    #[serde(with = "serde_bytes")]
    /// The bytes.
    pub data: Vec<u8>,
}

/// An invited device will not train for `round` now (its `[eligibility]` says no). The
/// server counts it apart from a drop and invites another device in its place.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Decline {
    /// The round declined.
    pub round: u64,
    /// Why the device declines.
    pub reason: DeclineReason,
    /// What the device read (at most [`MAX_DECLINE_DETAIL`] bytes), for the server's log.
    pub detail: String,
}

/// One message of the SecAgg+ sub-protocol of a round (Bell et al. 2020), opaque at
/// this layer: from the server a `anchorage_secagg::ServerFrame`, from a device a
/// `anchorage_secagg::ClientMessage`, each postcard. The secagg crate decodes and checks it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SecAggFrame {
    /// The round.
    pub round: u64,
    #[serde(with = "serde_bytes")]
    /// The postcard bytes of the SecAgg message.
    pub body: Vec<u8>,
}

/// One device's update inside a relay's [`Partial`]: the relay and its parent agree on what
/// each update is by (round, device, hash), so that a device that failed over to another relay
/// is never counted twice.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// The device's id.
    pub device: String,
    /// The samples the relay counted for it (after its caps).
    pub num_samples: u64,
    /// SHA-256 of the update's body as the device sent it (`Message::Update(..).encode_body()`).
    pub hash: [u8; 32],
}

/// Most members one partial aggregate may list.
pub const MAX_MEMBERS: usize = 1 << 20;

/// A relay's partial aggregate of one round (DESIGN.md "one engine, three roles"):
/// `update` is the fold of its devices' screened and bounded updates, blocks as their
/// sample-weighted mean and prototypes as each class's count-weighted mean, with `num_samples`
/// (and each prototype's count) the total behind it, so that the parent's weighted means over
/// relays equal its means over the devices. `members` names every update in it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Partial {
    /// The fold of the relay's devices' updates.
    pub update: Update,
    /// The updates in it, one a device.
    pub members: Vec<Member>,
}

impl Partial {
    fn validate(&self) -> Result<(), DecodeError> {
        Message::Update(self.update.clone()).validate()?;
        if self.members.is_empty() || self.members.len() > MAX_MEMBERS {
            return Err(DecodeError::Invalid(alloc::format!(
                "a partial aggregate lists {} members; 1 to {MAX_MEMBERS}",
                self.members.len()
            )));
        }
        let total: Option<u64> = self.members.iter().try_fold(0u64, |t, m| t.checked_add(m.num_samples));
        if total != Some(self.update.num_samples) {
            return Err(DecodeError::Invalid("a partial aggregate's samples are not its members' sum".into()));
        }
        let mut seen = alloc::collections::BTreeSet::new();
        match self.members.iter().find(|m| m.device.is_empty() || m.device.len() > 128 || !seen.insert(&m.device)) {
            Some(m) => Err(DecodeError::Invalid(alloc::format!("member `{}` is empty, too long or twice", m.device))),
            None => Ok(()),
        }
    }
}

/// Most cost records one batch may carry.
pub const MAX_COST_BATCH: usize = 100_000;

/// A relay's devices' cost records (each naming its device), in one message for its parent's
/// ledger: the root's ledger still holds every device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostBatch {
    /// The cost records.
    pub records: Vec<CostRecord>,
}

/// Most bytes one cost batch's records take encoded: half of a server's default control-frame
/// limit (64 KiB), so that a relay with any number of devices sends its round's records in
/// frames its parent reads ([`CostBatch::chunks`]).
pub const COST_BATCH_BYTES: usize = 32 << 10;

impl CostBatch {
    /// `records`, in order, as batches whose records take at most [`COST_BATCH_BYTES`] encoded
    /// (a record larger than that goes alone).
    pub fn chunks(records: &[CostRecord]) -> Vec<CostBatch> {
        let mut batches = Vec::new();
        let (mut records_now, mut bytes) = (Vec::new(), 0);
        for record in records {
            let size = postcard::experimental::serialized_size(record).unwrap_or(COST_BATCH_BYTES);
            if !records_now.is_empty() && bytes + size > COST_BATCH_BYTES {
                batches.push(CostBatch { records: core::mem::take(&mut records_now) });
                bytes = 0;
            }
            records_now.push(record.clone());
            bytes += size;
        }
        if !records_now.is_empty() {
            batches.push(CostBatch { records: records_now });
        }
        batches
    }

    fn validate(&self) -> Result<(), DecodeError> {
        if self.records.len() > MAX_COST_BATCH {
            return Err(DecodeError::Invalid(alloc::format!(
                "{} cost records; at most {MAX_COST_BATCH}",
                self.records.len()
            )));
        }
        self.records.iter().try_for_each(|c| c.validate().map_err(DecodeError::Invalid))
    }
}

/// Longest [`Decline::detail`] accepted.
pub const MAX_DECLINE_DETAIL: usize = 256;

/// Liveness signal; either side may send it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Sequence number.
    pub seq: u64,
}

/// Why a peer refused a message or a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RefusalReason {
    /// The peer speaks another protocol version.
    VersionMismatch,
    /// A frame or message that does not decode, or does not fit where it arrived.
    Malformed,
    /// A frame or transfer longer than the receiver accepts.
    TooLarge,
    /// An update whose blocks do not match the global model's layout.
    ShapeMismatch,
    /// A client that has not said hello, or whose hello names another identity than its connection.
    NotEnrolled,
    /// An update for a round the client is not sampled for or that is not open.
    NotSampled,
    /// A duplicate: a second connection of one identity, or devices another relay's partial holds already.
    Duplicate,
    /// The server timed out reading the message (a stall or a deadline); the sender keeps it and sends it again.
    ServerBusy,
    /// A client whose methods do not include the federation's.
    UnknownMethod,
    /// A tensor's bytes do not match its shape, or it holds non-finite values.
    BadTensor,
    /// The peer's certificate is on the project's revocation list.
    Revoked,
}

/// A refusal: a reason the peer acts on, the typed facts that go with it, and a detail for logs
/// only (no peer parses it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Refusal {
    /// What the peer acts on.
    pub reason: RefusalReason,
    /// A detail for logs.
    pub detail: String,
    /// A [`RefusalReason::Duplicate`] of a relay's partial aggregate: the devices another
    /// relay's accepted partial holds already, which the relay folds its round again without.
    /// On the wire after protocol v1's fields, and only when not empty (`RefusalTail`).
    #[serde(default)]
    pub devices: Vec<String>,
}

impl Refusal {
    /// A refusal with no devices.
    pub fn new(reason: RefusalReason, detail: impl Into<String>) -> Self {
        Self { reason, detail: detail.into(), devices: Vec::new() }
    }

    /// A partial aggregate refused because another relay counted `devices` already.
    pub fn duplicates(detail: impl Into<String>, devices: Vec<String>) -> Self {
        Self { reason: RefusalReason::Duplicate, detail: detail.into(), devices }
    }
}

/// A refusal's fields of protocol v1, in their wire order.
#[derive(Serialize, Deserialize)]
struct RefusalV1 {
    reason: RefusalReason,
    detail: String,
}

/// What follows a refusal's v1 fields on the wire when there is any: a v1 peer's postcard
/// decoder stops before it, and a body without it (a v1 peer's) decodes with it empty.
#[derive(Serialize, Deserialize, Default)]
struct RefusalTail {
    devices: Vec<String>,
}

impl WireBody for Refusal {
    fn encode(&self) -> postcard::Result<Vec<u8>> {
        let mut body = postcard::to_allocvec(&RefusalV1 { reason: self.reason, detail: self.detail.clone() })?;
        if !self.devices.is_empty() {
            body.extend(postcard::to_allocvec(&RefusalTail { devices: self.devices.clone() })?);
        }
        Ok(body)
    }

    fn decode(body: &[u8]) -> postcard::Result<Self> {
        let (v1, rest) = postcard::take_from_bytes::<RefusalV1>(body)?;
        let tail: RefusalTail = if rest.is_empty() { RefusalTail::default() } else { postcard::from_bytes(rest)? };
        Ok(Self { reason: v1.reason, detail: v1.detail, devices: tail.devices })
    }
}

/// Orderly end of a session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Goodbye {
    /// Why the session ends, for logs.
    pub reason: String,
}

/// How one message's body goes on the wire: postcard, unless its row says otherwise.
trait WireBody: Sized {
    fn encode(&self) -> postcard::Result<Vec<u8>>;
    fn decode(body: &[u8]) -> postcard::Result<Self>;
}

macro_rules! postcard_bodies {
    ($($ty:ty),* $(,)?) => {$(
        impl WireBody for $ty {
            fn encode(&self) -> postcard::Result<Vec<u8>> {
                postcard::to_allocvec(self)
            }
            fn decode(body: &[u8]) -> postcard::Result<Self> {
                postcard::from_bytes(body)
            }
        }
    )*};
}

postcard_bodies!(
    Box<Hello>,
    Welcome,
    Broadcast,
    Update,
    Ack,
    Heartbeat,
    Goodbye,
    CostAck,
    TransferOffer,
    TransferResume,
    Chunk,
    Decline,
    SecAggFrame,
    Partial,
    CostBatch,
);

impl WireBody for CostRecord {
    fn encode(&self) -> postcard::Result<Vec<u8>> {
        postcard::to_allocvec(self)
    }
    fn decode(body: &[u8]) -> postcard::Result<Self> {
        CostRecord::from_stable_encoding(body)
    }
}

/// Who sends a message: a device (or a relay, to its parent) up to a server, a server down to
/// its peers, or either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From a device (or a relay) to its server.
    Up,
    /// From a server to its devices (or relays).
    Down,
    /// Either way.
    Both,
}

/// The table's rows by direction: [`Upward`] holds the rows marked `Up` or `Both` (what a server
/// takes from a device or a relay), [`Downward`] those marked `Down` or `Both` (what a device or a
/// relay takes from its server), each with its conversions from and into [`Message`].
macro_rules! directed {
    (@up [$($acc:tt)*]) => {
        directed!(@build Upward "What a device or a relay sends to its server: the table's `Up` and `Both` rows." [$($acc)*]);
    };
    (@up [$($acc:tt)*] $v:ident($t:ty) $n:literal Down; $($rest:tt)*) => { directed!(@up [$($acc)*] $($rest)*); };
    (@up [$($acc:tt)*] $v:ident($t:ty) $n:literal $dir:ident; $($rest:tt)*) => {
        directed!(@up [$($acc)* $v($t) $n] $($rest)*);
    };
    (@down [$($acc:tt)*]) => {
        directed!(@build Downward "What a server sends to a device or a relay: the table's `Down` and `Both` rows." [$($acc)*]);
    };
    (@down [$($acc:tt)*] $v:ident($t:ty) $n:literal Up; $($rest:tt)*) => { directed!(@down [$($acc)*] $($rest)*); };
    (@down [$($acc:tt)*] $v:ident($t:ty) $n:literal $dir:ident; $($rest:tt)*) => {
        directed!(@down [$($acc)* $v($t) $n] $($rest)*);
    };
    (@build $name:ident $doc:literal [$($v:ident($t:ty) $n:literal)*]) => {
        #[doc = $doc]
        #[derive(Debug, Clone, PartialEq)]
        #[allow(missing_docs)]
        pub enum $name {
            $($v($t),)*
        }

        impl From<$name> for Message {
            fn from(m: $name) -> Message {
                match m {
                    $($name::$v(x) => Message::$v(x),)*
                }
            }
        }

        impl TryFrom<Message> for $name {
            /// A message of the other direction, given back.
            type Error = Message;
            fn try_from(m: Message) -> Result<Self, Message> {
                match m {
                    $(Message::$v(x) => Ok($name::$v(x)),)*
                    other => Err(other),
                }
            }
        }

        impl $name {
            /// A readable name of the kind, for logs and metrics.
            pub fn kind_name(&self) -> &'static str {
                match self {
                    $($name::$v(_) => $n,)*
                }
            }
        }
    };
}

/// The message table (quinn-proto's `frame_types!` is the model): one row a message, with its
/// kind byte, variant, body type, name and direction. Everything that depends on the kind
/// (the enum, [`Message::kind`], [`kind_name`], encoding and decoding, [`KINDS`]) comes from
/// here, so adding a message is one row plus the handlers the compiler asks for.
macro_rules! messages {
    ($($(#[$doc:meta])* $variant:ident($ty:ty) = $kind:tt, $name:literal, $dir:ident;)*) => {
        /// Every message of the protocol. Append-only: new rows get new kind numbers.
        #[derive(Debug, Clone, PartialEq)]
        pub enum Message {
            $($(#[$doc])* $variant($ty),)*
        }

        /// Every kind byte with its name and direction, in kind order.
        pub const KINDS: &[(u8, &str, Direction)] = &[$(($kind, $name, Direction::$dir)),*];

        directed!(@up [] $($variant($ty) $name $dir;)*);
        directed!(@down [] $($variant($ty) $name $dir;)*);

        impl Message {
            /// The kind byte on the wire.
            pub fn kind(&self) -> u8 {
                match self {
                    $(Message::$variant(_) => $kind,)*
                }
            }

            /// Serialises the body (without the frame header).
            pub fn encode_body(&self) -> Vec<u8> {
                let r = match self {
                    $(Message::$variant(m) => WireBody::encode(m),)*
                };
                // Serialising owned in-memory structs into a growable Vec cannot fail.
                r.unwrap_or_default()
            }

            /// Parses a body of the given kind and validates it.
            pub fn decode_body(kind: u8, body: &[u8]) -> Result<Message, DecodeError> {
                let bad = |name: &'static str| {
                    move |e: postcard::Error| DecodeError::Body { kind: name, detail: alloc::format!("{e}") }
                };
                let msg = match kind {
                    $($kind => Message::$variant(<$ty as WireBody>::decode(body).map_err(bad($name))?),)*
                    other => return Err(DecodeError::UnknownKind(other)),
                };
                msg.validate()?;
                Ok(msg)
            }
        }

        /// Name of a kind byte, or `None` if this version does not know it.
        pub fn kind_name(kind: u8) -> Option<&'static str> {
            match kind {
                $($kind => Some($name),)*
                _ => None,
            }
        }
    };
}

/// Kind bytes of the messages that may be large (readers give them their own size limit).
pub const KIND_BROADCAST: u8 = 3;
/// The kind byte of [`Message::Update`].
pub const KIND_UPDATE: u8 = 4;
/// The kind byte of [`Message::Chunk`].
pub const KIND_CHUNK: u8 = 13;
/// A masked vector is as large as an update (it travels as a resumable transfer).
pub const KIND_SECAGG: u8 = 15;
/// A partial aggregate is as large as an update.
pub const KIND_PARTIAL: u8 = 16;

messages! {
    /// Boxed: its inline strings make it ten times the size of the other variants, and every
    /// queued message (a session's outbox, 100,000 simulated clients) would be that large.
    Hello(Box<Hello>) = 1, "hello", Up;
    /// The server accepts a hello.
    Welcome(Welcome) = 2, "welcome", Down;
    /// A round starts: the global state to train from.
    Broadcast(Broadcast) = KIND_BROADCAST, "broadcast", Down;
    /// A client's result for one round.
    Update(Update) = KIND_UPDATE, "update", Up;
    /// The server received an update.
    Ack(Ack) = 5, "ack", Down;
    /// Liveness signal.
    Heartbeat(Heartbeat) = 6, "heartbeat", Both;
    /// A refused message or connection.
    Refusal(Refusal) = 7, "refusal", Both;
    /// Orderly end of a session.
    Goodbye(Goodbye) = 8, "goodbye", Both;
    /// A client's measured cost of one round, sent after the round's ack (the server keeps the
    /// cost ledger). The `client` field is ignored: the server uses the connection's identity.
    Cost(CostRecord) = 9, "cost", Up;
    /// The ledger holds the client's cost record of a round.
    CostAck(CostAck) = 10, "cost_ack", Down;
    /// A resumable transfer begins.
    TransferOffer(TransferOffer) = 11, "transfer_offer", Both;
    /// How much of an offered transfer the receiver holds.
    TransferResume(TransferResume) = 12, "transfer_resume", Both;
    /// A piece of a transfer.
    Chunk(Chunk) = KIND_CHUNK, "chunk", Both;
    /// An invited device declines the round.
    Decline(Decline) = 14, "decline", Up;
    /// A SecAgg+ message of a round under secure aggregation.
    SecAgg(SecAggFrame) = KIND_SECAGG, "secagg", Both;
    /// A relay's partial aggregate of one round, sent to its parent.
    Partial(Partial) = KIND_PARTIAL, "partial", Up;
    /// The cost records of a relay's devices, in one batch for its parent's ledger.
    CostBatch(CostBatch) = 17, "cost_batch", Up;
}

impl Message {
    /// A readable name of the kind, for logs and metrics.
    pub fn kind_name(&self) -> &'static str {
        kind_name(self.kind()).unwrap_or("unknown")
    }

    /// Checks what postcard cannot: tensor lengths against shapes, finite values, sane names.
    pub fn validate(&self) -> Result<(), DecodeError> {
        match self {
            Message::Broadcast(b) => validate_parts(&b.blocks, &b.prototypes),
            Message::Update(u) => {
                validate_parts(&u.blocks, &u.prototypes)?;
                if !u.compute_seconds.is_finite() || u.compute_seconds < 0.0 {
                    return Err(DecodeError::Invalid("compute_seconds is not a finite non-negative number".into()));
                }
                if let Some(m) = u.metrics.iter().find(|m| !m.value.is_finite()) {
                    return Err(DecodeError::Invalid(alloc::format!("metric `{}` is not finite", m.name)));
                }
                Ok(())
            }
            Message::Cost(c) => c.validate().map_err(DecodeError::Invalid),
            Message::Partial(p) => p.validate(),
            Message::CostBatch(b) => b.validate(),
            Message::Decline(d) if d.detail.len() > MAX_DECLINE_DETAIL => {
                Err(DecodeError::Invalid(alloc::format!("a decline's detail has more than {MAX_DECLINE_DETAIL} bytes")))
            }
            Message::Hello(h) if h.client_id.is_empty() || h.client_id.len() > 128 => {
                Err(DecodeError::Invalid("client id must have 1 to 128 bytes".into()))
            }
            _ => Ok(()),
        }
    }
}

/// Most parameter blocks one message may carry (a ViT-B has about 200 tensors): a frame of
/// tens of thousands of tiny blocks is refused before any of them is checked.
pub const MAX_BLOCKS: usize = 4096;

/// Checks every block and prototype, in time proportional to the message (names in a sorted
/// set, not compared pairwise).
fn validate_parts(blocks: &[ParamBlock], prototypes: &[Prototype]) -> Result<(), DecodeError> {
    if blocks.len() > MAX_BLOCKS {
        return Err(DecodeError::Invalid(alloc::format!("{} blocks; at most {MAX_BLOCKS}", blocks.len())));
    }
    let mut names = alloc::collections::BTreeSet::new();
    for b in blocks {
        if !names.insert(b.name.as_str()) {
            return Err(DecodeError::Invalid(alloc::format!("block `{}` appears twice", b.name)));
        }
        b.validate()?;
    }
    for p in prototypes {
        p.validate()?;
    }
    Ok(())
}
