//! The typed messages of the four stages (Bonawitz et al. 2017, Fig. 4, rounds 0, 1, 2 and 4;
//! the consistency check of round 3 is not run: see the crate doc's security model), and their
//! postcard encoding. A masked vector travels as raw little-endian bytes (4 per element), not as
//! varints: masked values are uniform in Z_{2^32} and would take 5 bytes each as varints.

use serde::{Deserialize, Serialize};

use crate::error::SecAggError;
use crate::graph::Params;

/// A client's id within one round (the shell maps device identities to these).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ClientId(pub u32);

impl core::fmt::Display for ClientId {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// The stage a message belongs to, and the stage a state machine is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stage {
    /// Round 0: the configuration goes out, each client's two public keys come back.
    AdvertiseKeys,
    /// Round 1: neighbours' public keys go out, encrypted shares come back.
    ShareKeys,
    /// Round 2: the shares addressed to each client go out, masked vectors come back.
    MaskedInput,
    /// Round 4: survivor and dropped lists go out, shares to unmask with come back.
    Unmask,
    /// The sum was output (server) or the last answer given (client).
    Done,
    /// The round failed; nothing was or will be output.
    Failed,
}

impl Stage {
    /// The stage after this one.
    pub(crate) fn next(self) -> Self {
        match self {
            Self::AdvertiseKeys => Self::ShareKeys,
            Self::ShareKeys => Self::MaskedInput,
            Self::MaskedInput => Self::Unmask,
            Self::Unmask | Self::Done => Self::Done,
            Self::Failed => Self::Failed,
        }
    }
}

/// What the server fixes before round 0 and every client checks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoundConfig {
    /// The round number; bound into every key derivation, AEAD and message.
    pub round: u64,
    /// The sampled clients, sorted, without repeats.
    pub clients: Vec<ClientId>,
    /// Graph degree and share threshold.
    pub params: Params,
    /// The seed of the graph's random relabelling (public; Bell et al. 2020, §3).
    pub graph_seed: [u8; 32],
    /// Elements of every client's vector.
    pub vector_len: u32,
}

/// A client's two x25519 public keys (Bonawitz et al. 2017, round 0): mask agreement (s_u^PK) and
/// share encryption (c_u^PK).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublicKeys {
    /// For the pairwise masks (s_u^PK).
    pub mask: [u8; 32],
    /// For the AEAD keys of the shares (c_u^PK).
    pub encrypt: [u8; 32],
}

/// One AEAD ciphertext of a share pair, from its owner to one holder.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EncryptedShare(#[serde(with = "serde_bytes")] pub Vec<u8>);

/// One Shamir share's value (a canonical scalar); its x-coordinate is the holder's id + 1.
pub type ShareValue = [u8; 32];

/// Server to client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ServerMessage {
    /// Round 0: the round's configuration.
    Setup(RoundConfig),
    /// Round 1: the public keys of this client's neighbours that advertised keys.
    ShareKeys {
        /// The round.
        round: u64,
        /// The neighbours' public keys, by neighbour.
        keys: Vec<(ClientId, PublicKeys)>,
    },
    /// Round 2: the encrypted shares neighbours addressed to this client.
    CollectMasked {
        /// The round.
        round: u64,
        /// The encrypted shares, by the neighbour that sent them.
        shares: Vec<(ClientId, EncryptedShare)>,
    },
    /// Round 4: which of this client's neighbours sent a masked vector and which did not.
    Unmask {
        /// The round.
        round: u64,
        /// The neighbours whose masked vector arrived.
        survivors: Vec<ClientId>,
        /// The neighbours whose masked vector did not arrive.
        dropped: Vec<ClientId>,
    },
}

/// Client to server.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientMessage {
    /// Round 0: this client's public keys.
    Keys {
        /// The round.
        round: u64,
        /// The mask-agreement and share-encryption public keys.
        keys: PublicKeys,
    },
    /// Round 1: one encrypted share pair per neighbour, by recipient.
    Shares {
        /// The round.
        round: u64,
        /// The encrypted share pairs, by recipient.
        shares: Vec<(ClientId, EncryptedShare)>,
    },
    /// Round 2: the masked vector.
    Masked {
        /// The round.
        round: u64,
        /// y_u: the input plus the self mask and the pairwise masks, mod 2^32.
        #[serde(with = "le_u32s")]
        vector: Vec<u32>,
    },
    /// Round 4: self-mask shares of survivors, mask-key shares of the dropped, by owner.
    Unmask {
        /// The round.
        round: u64,
        /// This client's shares of the surviving neighbours' self-mask seeds (b), by owner.
        self_mask: Vec<(ClientId, ShareValue)>,
        /// This client's shares of the dropped neighbours' mask-agreement keys (s), by owner.
        mask_key: Vec<(ClientId, ShareValue)>,
    },
}

impl ServerMessage {
    /// The stage this message drives.
    pub fn stage(&self) -> Stage {
        match self {
            Self::Setup(_) => Stage::AdvertiseKeys,
            Self::ShareKeys { .. } => Stage::ShareKeys,
            Self::CollectMasked { .. } => Stage::MaskedInput,
            Self::Unmask { .. } => Stage::Unmask,
        }
    }

    /// postcard bytes.
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).expect("in-memory encoding does not fail")
    }

    /// Decodes bytes from the wire; anything malformed is refused as [`SecAggError::Decode`].
    pub fn decode(bytes: &[u8]) -> Result<Self, SecAggError> {
        Ok(postcard::from_bytes(bytes)?)
    }
}

impl ClientMessage {
    /// The stage this message answers.
    pub fn stage(&self) -> Stage {
        match self {
            Self::Keys { .. } => Stage::AdvertiseKeys,
            Self::Shares { .. } => Stage::ShareKeys,
            Self::Masked { .. } => Stage::MaskedInput,
            Self::Unmask { .. } => Stage::Unmask,
        }
    }

    /// The round it names.
    pub fn round(&self) -> u64 {
        match self {
            Self::Keys { round, .. }
            | Self::Shares { round, .. }
            | Self::Masked { round, .. }
            | Self::Unmask { round, .. } => *round,
        }
    }

    /// postcard bytes.
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).expect("in-memory encoding does not fail")
    }

    /// Decodes bytes from the wire; anything malformed is refused as [`SecAggError::Decode`].
    pub fn decode(bytes: &[u8]) -> Result<Self, SecAggError> {
        Ok(postcard::from_bytes(bytes)?)
    }
}

/// A `Vec<u32>` as one byte string of little-endian words.
mod le_u32s {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub(crate) fn serialize<S: Serializer>(v: &[u32], s: S) -> Result<S::Ok, S::Error> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        s.serialize_bytes(&bytes)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
        let bytes = serde_bytes::ByteBuf::deserialize(d)?;
        if bytes.len() % 4 != 0 {
            return Err(D::Error::custom("vector bytes not a multiple of 4"));
        }
        Ok(bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
}
