//! Shamir's t-out-of-k sharing of b_u and s_u over Z_ℓ, the prime order of Curve25519's subgroup
//! (Bonawitz et al. 2017, §3 and Fig. 4 round 1; Bell et al. 2020 share among the k neighbours
//! only), through vsss-rs; and the fixed layout of one encrypted share pair.
//!
//! A share's x-coordinate is its holder's id + 1 (never 0, where the secret sits), so a share
//! travels as its 32-byte y-value alone and the receiver knows x from who sent it.

use chacha20::ChaCha20Rng;
use curve25519_dalek::scalar::Scalar;
use vsss_rs::{DefaultShare, IdentifierPrimeField, ReadableShareSet, shamir};

use crate::error::SecAggError;
use crate::messages::{ClientId, ShareValue};

type Field = IdentifierPrimeField<Scalar>;
type Share = DefaultShare<Field, Field>;

/// Bytes of a share pair's plaintext: round (8), owner (4), holder (4), b_u share, s_u share.
pub(crate) const PLAINTEXT_LEN: usize = 8 + 4 + 4 + 32 + 32;
/// Bytes of its ciphertext (Poly1305 tag included).
pub(crate) const CIPHERTEXT_LEN: usize = PLAINTEXT_LEN + 16;

/// The x-coordinate of `holder`'s shares.
fn x_of(holder: ClientId) -> Field {
    IdentifierPrimeField(Scalar::from(u64::from(holder.0) + 1))
}

/// Splits `secret` into one share per holder, any `threshold` of which reconstruct it.
pub(crate) fn split(
    secret: &Scalar,
    holders: &[ClientId],
    threshold: usize,
    rng: &mut ChaCha20Rng,
) -> Result<Vec<ShareValue>, SecAggError> {
    let ids = holders.iter().map(|&h| x_of(h));
    let shares =
        shamir::split_secret_with_ids::<Share>(threshold, holders.len(), &IdentifierPrimeField(*secret), rng, ids)
            .map_err(|_| SecAggError::Sharing("split"))?;
    Ok(shares.iter().map(|s| s.value.0.to_bytes()).collect())
}

/// A share value as a field element, refusing non-canonical bytes.
pub(crate) fn parse(value: &ShareValue, from: ClientId) -> Result<Scalar, SecAggError> {
    Option::from(Scalar::from_canonical_bytes(*value)).ok_or(SecAggError::BadShare(from))
}

/// Reconstructs a secret from the first `threshold` of `shares` (holder, y).
pub(crate) fn combine(shares: &[(ClientId, Scalar)], threshold: usize) -> Result<Scalar, SecAggError> {
    if shares.len() < threshold {
        return Err(SecAggError::BelowThreshold { what: "shares of a secret", have: shares.len(), need: threshold });
    }
    let set: Vec<Share> = shares[..threshold]
        .iter()
        .map(|&(holder, y)| DefaultShare { identifier: x_of(holder), value: IdentifierPrimeField(y) })
        .collect();
    set.combine().map(|s| s.0).map_err(|_| SecAggError::Sharing("combine"))
}

/// One holder's share pair of one owner, as sealed in round 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SharePair {
    pub round: u64,
    pub owner: ClientId,
    pub holder: ClientId,
    /// The share of b_u (self-mask seed).
    pub self_mask: ShareValue,
    /// The share of s_u (mask-agreement secret key).
    pub mask_key: ShareValue,
}

impl SharePair {
    /// The fixed-length plaintext.
    pub(crate) fn to_bytes(self) -> [u8; PLAINTEXT_LEN] {
        let mut out = [0u8; PLAINTEXT_LEN];
        out[..8].copy_from_slice(&self.round.to_le_bytes());
        out[8..12].copy_from_slice(&self.owner.0.to_le_bytes());
        out[12..16].copy_from_slice(&self.holder.0.to_le_bytes());
        out[16..48].copy_from_slice(&self.self_mask);
        out[48..].copy_from_slice(&self.mask_key);
        out
    }

    /// Reads a plaintext; `None` if it is not [`PLAINTEXT_LEN`] bytes.
    pub(crate) fn from_bytes(b: &[u8]) -> Option<Self> {
        let b: &[u8; PLAINTEXT_LEN] = b.try_into().ok()?;
        let word = |r: core::ops::Range<usize>| u32::from_le_bytes(b[r].try_into().expect("4 bytes"));
        Some(Self {
            round: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            owner: ClientId(word(8..12)),
            holder: ClientId(word(12..16)),
            self_mask: b[16..48].try_into().expect("32 bytes"),
            mask_key: b[48..].try_into().expect("32 bytes"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chacha20::rand_core::SeedableRng;

    #[test]
    fn any_threshold_shares_reconstruct_and_fewer_do_not() {
        let mut rng = ChaCha20Rng::from_seed([5; 32]);
        let secret = Scalar::from(123_456_789u64);
        let holders: Vec<ClientId> = [3, 8, 9, 20, 41].into_iter().map(ClientId).collect();
        let ys = split(&secret, &holders, 3, &mut rng).unwrap();
        let pts: Vec<(ClientId, Scalar)> = holders.iter().zip(&ys).map(|(&h, y)| (h, parse(y, h).unwrap())).collect();
        assert_eq!(combine(&pts[2..], 3).unwrap(), secret);
        assert_eq!(combine(&[pts[4], pts[0], pts[2]], 3).unwrap(), secret);
        assert_ne!(combine(&pts[..2], 2).unwrap(), secret);
        assert_eq!(combine(&pts[..2], 3).unwrap_err().reason(), "below_threshold");
        assert_eq!(parse(&[0xff; 32], ClientId(1)), Err(SecAggError::BadShare(ClientId(1))));
    }

    #[test]
    fn share_pair_layout_round_trips() {
        let p = SharePair { round: 7, owner: ClientId(1), holder: ClientId(2), self_mask: [3; 32], mask_key: [4; 32] };
        assert_eq!(SharePair::from_bytes(&p.to_bytes()), Some(p));
        assert_eq!(SharePair::from_bytes(&[0; 10]), None);
    }
}
