//! Masks: PRG(seed) expanded over Z_{2^32}^m with ChaCha20 (Bonawitz et al. 2017, §4: the masked
//! input y_u = x_u + PRG(b_u) + Σ_v ±PRG(s_{u,v}); Bell et al. 2020 sum over u's graph neighbours).
//! The pairwise sign is fixed by id order: the lower id adds, the higher subtracts, so the two
//! masks of one pair cancel in the sum.

use chacha20::ChaCha20Rng;
use chacha20::rand_core::{Rng, SeedableRng};

use crate::messages::ClientId;

/// Whether a mask is added or subtracted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    Add,
    Sub,
}

impl Op {
    /// How `u` applies its mask shared with `v`.
    pub(crate) fn pairwise(u: ClientId, v: ClientId) -> Self {
        if u < v { Self::Add } else { Self::Sub }
    }

    /// The inverse operation (what removes the mask).
    pub(crate) fn inverse(self) -> Self {
        match self {
            Self::Add => Self::Sub,
            Self::Sub => Self::Add,
        }
    }
}

/// Adds or subtracts PRG(seed) to `vector`, element by element mod 2^32.
pub(crate) fn apply(vector: &mut [u32], seed: &[u8; 32], op: Op) {
    const CHUNK: usize = 1024;
    let mut rng = ChaCha20Rng::from_seed(*seed);
    let mut buf = [0u8; CHUNK * 4];
    for part in vector.chunks_mut(CHUNK) {
        let bytes = &mut buf[..part.len() * 4];
        rng.fill_bytes(bytes);
        let words = bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        match op {
            Op::Add => part.iter_mut().zip(words).for_each(|(x, m)| *x = x.wrapping_add(m)),
            Op::Sub => part.iter_mut().zip(words).for_each(|(x, m)| *x = x.wrapping_sub(m)),
        }
    }
}

/// `acc += v` mod 2^32.
pub(crate) fn add_into(acc: &mut [u32], v: &[u32]) {
    acc.iter_mut().zip(v).for_each(|(a, &x)| *a = a.wrapping_add(x));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pair_of_opposite_masks_cancels_and_the_mask_looks_uniform() {
        let mut v = vec![5u32; 3000];
        apply(&mut v, &[9; 32], Op::pairwise(ClientId(1), ClientId(2)));
        let high = v.iter().filter(|&&x| x >= 1 << 31).count();
        assert!((1300..1700).contains(&high), "{high}");
        apply(&mut v, &[9; 32], Op::pairwise(ClientId(2), ClientId(1)));
        assert_eq!(v, vec![5u32; 3000]);
        let mut w = vec![0u32; 3000];
        apply(&mut w, &[8; 32], Op::Add);
        apply(&mut w, &[8; 32], Op::Add.inverse());
        assert!(w.iter().all(|&x| x == 0));
    }
}
