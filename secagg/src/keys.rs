//! A client's secrets and what is derived from them (Bonawitz et al. 2017, §4 and Fig. 4, rounds
//! 0–2; Bell et al. 2020 keep them unchanged on the sparse graph).
//!
//! Two x25519 key pairs per client and round: mask agreement (s_u) and share encryption (c_u). The
//! mask-agreement secret is drawn as a field element s of Z_ℓ (ℓ the order of Curve25519's prime
//! subgroup) and used as the x25519 scalar bytes (x25519 clamps them), so that the Shamir sharing
//! of s, a field element, reconstructs the secret key itself. Every shared secret goes through
//! HKDF-SHA256 (ring) with the round and both ids in the info, so no seed or AEAD key is used twice.

use chacha20::ChaCha20Rng;
use chacha20::rand_core::Rng;
use curve25519_dalek::scalar::Scalar;
use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};
use ring::hkdf::{HKDF_SHA256, KeyType, Salt};
use x25519_dalek::{PublicKey, StaticSecret};

use crate::error::SecAggError;
use crate::messages::{ClientId, PublicKeys};

/// The HKDF salt of every derivation in this crate.
const SALT: &[u8] = b"anchorage-secagg/v1";

/// One client's secrets for one round.
pub(crate) struct Secrets {
    /// s_u as a field element: what is Shamir-shared for the dropped-client recovery.
    pub mask_scalar: Scalar,
    /// s_u^SK, from `mask_scalar`.
    pub mask_key: StaticSecret,
    /// c_u^SK: the share-encryption key (never shared).
    pub encrypt_key: StaticSecret,
    /// b_u: the self-mask seed, a field element so it can be Shamir-shared.
    pub self_seed: Scalar,
}

impl Secrets {
    /// Draws fresh secrets.
    pub(crate) fn generate(rng: &mut ChaCha20Rng) -> Self {
        let mask_scalar = random_scalar(rng);
        let mut enc = [0u8; 32];
        rng.fill_bytes(&mut enc);
        Self {
            mask_key: mask_secret(&mask_scalar),
            mask_scalar,
            encrypt_key: StaticSecret::from(enc),
            self_seed: random_scalar(rng),
        }
    }

    /// The two public keys advertised in round 0.
    pub(crate) fn public(&self) -> PublicKeys {
        PublicKeys {
            mask: PublicKey::from(&self.mask_key).to_bytes(),
            encrypt: PublicKey::from(&self.encrypt_key).to_bytes(),
        }
    }
}

/// A uniform field element.
fn random_scalar(rng: &mut ChaCha20Rng) -> Scalar {
    let mut wide = [0u8; 64];
    rng.fill_bytes(&mut wide);
    Scalar::from_bytes_mod_order_wide(&wide)
}

/// The x25519 secret key of a mask-agreement field element (also used on reconstruction).
pub(crate) fn mask_secret(s: &Scalar) -> StaticSecret {
    StaticSecret::from(s.to_bytes())
}

/// x25519 agreement, refusing a peer key that is a low-order point (a non-secret result).
pub(crate) fn agree(secret: &StaticSecret, public: &[u8; 32], peer: ClientId) -> Result<[u8; 32], SecAggError> {
    let shared = secret.diffie_hellman(&PublicKey::from(*public));
    if !shared.was_contributory() {
        return Err(SecAggError::BadKey(peer));
    }
    Ok(shared.to_bytes())
}

/// Whether a public key is usable (checked by the server on arrival, by clients before use).
pub(crate) fn usable(public: &[u8; 32]) -> bool {
    let probe = StaticSecret::from([0x5a; 32]);
    probe.diffie_hellman(&PublicKey::from(*public)).was_contributory()
}

/// The pairwise mask seed of u and v (symmetric: the lower id first).
pub(crate) fn pairwise_seed(shared: &[u8; 32], round: u64, u: ClientId, v: ClientId) -> [u8; 32] {
    let (lo, hi) = if u < v { (u, v) } else { (v, u) };
    derive(shared, &[b"pairwise-mask", &round.to_le_bytes(), &lo.0.to_le_bytes(), &hi.0.to_le_bytes()])
}

/// The self-mask PRG seed from b_u.
pub(crate) fn self_mask_seed(b: &Scalar, round: u64) -> [u8; 32] {
    derive(&b.to_bytes(), &[b"self-mask", &round.to_le_bytes()])
}

/// The AEAD key for shares from `from` to `to` (directional: the two directions never share a key).
pub(crate) fn share_key(shared: &[u8; 32], round: u64, from: ClientId, to: ClientId) -> [u8; 32] {
    derive(shared, &[b"share-encryption", &round.to_le_bytes(), &from.0.to_le_bytes(), &to.0.to_le_bytes()])
}

/// The associated data binding a share ciphertext to its round, sender and recipient.
pub(crate) fn share_aad(round: u64, from: ClientId, to: ClientId) -> [u8; 16] {
    let mut aad = [0u8; 16];
    aad[..8].copy_from_slice(&round.to_le_bytes());
    aad[8..12].copy_from_slice(&from.0.to_le_bytes());
    aad[12..].copy_from_slice(&to.0.to_le_bytes());
    aad
}

/// ChaCha20-Poly1305 with an all-zero nonce: each key seals exactly one message.
pub(crate) fn seal(key: &[u8; 32], aad: &[u8; 16], plaintext: &[u8]) -> Vec<u8> {
    let key = LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, key).expect("32-byte key"));
    let mut buf = plaintext.to_vec();
    key.seal_in_place_append_tag(Nonce::assume_unique_for_key([0; 12]), Aad::from(aad), &mut buf)
        .expect("a short plaintext seals");
    buf
}

/// Opens what [`seal`] sealed; `None` on a bad tag.
pub(crate) fn open(key: &[u8; 32], aad: &[u8; 16], ciphertext: &[u8]) -> Option<Vec<u8>> {
    let key = LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, key).expect("32-byte key"));
    let mut buf = ciphertext.to_vec();
    let len = key.open_in_place(Nonce::assume_unique_for_key([0; 12]), Aad::from(aad), &mut buf).ok()?.len();
    buf.truncate(len);
    Some(buf)
}

/// HKDF-SHA256 to 32 bytes.
fn derive(ikm: &[u8], info: &[&[u8]]) -> [u8; 32] {
    struct Len32;
    impl KeyType for Len32 {
        fn len(&self) -> usize {
            32
        }
    }
    let mut out = [0u8; 32];
    Salt::new(HKDF_SHA256, SALT)
        .extract(ikm)
        .expand(info, Len32)
        .and_then(|okm| okm.fill(&mut out))
        .expect("32 bytes is within HKDF-SHA256's limit");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use chacha20::rand_core::SeedableRng;

    #[test]
    fn agreement_is_symmetric_and_low_order_keys_are_refused() {
        let mut rng = ChaCha20Rng::from_seed([1; 32]);
        let (a, b) = (Secrets::generate(&mut rng), Secrets::generate(&mut rng));
        let ab = agree(&a.mask_key, &b.public().mask, ClientId(2)).unwrap();
        let ba = agree(&b.mask_key, &a.public().mask, ClientId(1)).unwrap();
        assert_eq!(ab, ba);
        assert_eq!(pairwise_seed(&ab, 3, ClientId(1), ClientId(2)), pairwise_seed(&ba, 3, ClientId(2), ClientId(1)));
        assert_eq!(agree(&a.mask_key, &[0; 32], ClientId(9)), Err(SecAggError::BadKey(ClientId(9))));
        assert!(!usable(&[0; 32]) && usable(&b.public().encrypt));
    }

    #[test]
    fn mask_key_is_a_function_of_its_scalar() {
        let mut rng = ChaCha20Rng::from_seed([2; 32]);
        let a = Secrets::generate(&mut rng);
        assert_eq!(PublicKey::from(&mask_secret(&a.mask_scalar)).to_bytes(), a.public().mask);
    }

    #[test]
    fn a_sealed_share_opens_only_with_its_key_and_aad() {
        let (key, aad) = ([3; 32], share_aad(1, ClientId(1), ClientId(2)));
        let ct = seal(&key, &aad, b"share");
        assert_eq!(open(&key, &aad, &ct).as_deref(), Some(&b"share"[..]));
        assert!(open(&key, &share_aad(1, ClientId(2), ClientId(1)), &ct).is_none());
        assert!(open(&[4; 32], &aad, &ct).is_none());
    }
}
