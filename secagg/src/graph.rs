//! Who shares with whom: SecAgg+'s sparse graph (Bell et al. 2020, §3: a Harary graph H(n, k) whose
//! nodes are relabelled by a random permutation), and the Shamir threshold t.
//!
//! In H(n, k) with k even, the node at position p is joined to the positions p ± 1, …, p ± k/2
//! (mod n). Clients are placed on positions by a Fisher–Yates shuffle of the sorted sample drawn
//! from ChaCha20 keyed with the round's public `graph_seed`, so server and clients build the same
//! graph and no client chooses its neighbours. A degree of n − 1 or more is the complete graph,
//! i.e. the original SecAgg of Bonawitz et al. 2017.

use std::collections::BTreeMap;

use chacha20::ChaCha20Rng;
use chacha20::rand_core::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::error::SecAggError;
use crate::messages::ClientId;

/// The wanted failure rate of [`Params::recommended`]: the expected number of clients left with
/// fewer than t surviving neighbours (which fails the round) stays below this.
pub const RECOMMENDED_FAILURE: f64 = 1e-6;

/// Graph degree k and share threshold t, as configured (see [`Params::effective`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Params {
    /// Neighbours per client, k. Odd values below n − 1 are rounded up to even; n − 1 or more
    /// means every other client.
    pub degree: u32,
    /// Shares needed to reconstruct a secret, t. Must satisfy k/2 < t ≤ k.
    pub threshold: u32,
}

impl Params {
    /// SecAgg+'s recommended parameters for `n` clients of which a fraction `dropout` may drop.
    ///
    /// Bell et al. 2020 (§3) show that k = O(log n) neighbours suffice, with t a fraction of k
    /// strictly above one half: t > k/2 means no two disjoint sets of a client's neighbours can
    /// both reach t, so a server that tells some neighbours "u survived" and others "u dropped"
    /// cannot collect both u's self-mask seed and u's mask key. Concretely: t = ⌊k/2⌋ + 1 and k is
    /// the smallest even degree ≥ 2⌈log₂ n⌉ with n · P[Bin(k, 1 − dropout) < t] ≤
    /// [`RECOMMENDED_FAILURE`] (dropout independent of the random relabelling); where no k < n − 1
    /// does, the complete graph.
    pub fn recommended(n: usize, dropout: f64) -> Self {
        let full = n.saturating_sub(1).max(2);
        let mut k = (2 * ceil_log2(n)).max(2);
        while k < full {
            let t = k / 2 + 1;
            if n as f64 * binomial_below(k, 1.0 - dropout.clamp(0.0, 1.0), t) <= RECOMMENDED_FAILURE {
                return Self { degree: k as u32, threshold: t as u32 };
            }
            k += 2;
        }
        Self { degree: full as u32, threshold: (full / 2 + 1) as u32 }
    }

    /// The (k, t) used for `n` clients, or why these parameters cannot work.
    pub fn effective(&self, n: usize) -> Result<(usize, usize), SecAggError> {
        if n < 3 {
            return Err(SecAggError::BadParams("a round needs at least 3 clients"));
        }
        let k = (self.degree as usize).max(2);
        let k = if k >= n - 1 { n - 1 } else { k + k % 2 };
        let t = self.threshold as usize;
        if 2 * t <= k || t > k {
            return Err(SecAggError::BadParams("threshold must satisfy k/2 < t <= k"));
        }
        Ok((k, t))
    }
}

/// ⌈log₂ n⌉ for n ≥ 1.
fn ceil_log2(n: usize) -> usize {
    n.max(1).next_power_of_two().trailing_zeros() as usize
}

/// P\[X < t\] for X ~ Bin(k, p), summed in log space.
fn binomial_below(k: usize, p: f64, t: usize) -> f64 {
    if p >= 1.0 {
        return 0.0;
    }
    let ln_choose = |i: usize| (1..=i).map(|j| ((k - i + j) as f64 / j as f64).ln()).sum::<f64>();
    (0..t.min(k + 1)).map(|i| (ln_choose(i) + i as f64 * p.ln() + (k - i) as f64 * (1.0 - p).ln()).exp()).sum()
}

/// The round's graph: the relabelled positions of H(n, k).
#[derive(Clone, Debug)]
pub struct Graph {
    order: Vec<ClientId>,
    position: BTreeMap<ClientId, usize>,
    degree: usize,
}

impl Graph {
    /// Builds the graph of a sorted, repeat-free sample with (effective) degree `degree`.
    pub fn new(clients: &[ClientId], degree: usize, seed: &[u8; 32]) -> Result<Self, SecAggError> {
        if clients.windows(2).any(|w| w[0] >= w[1]) {
            return Err(SecAggError::BadParams("the sample must be sorted and without repeats"));
        }
        let mut order = clients.to_vec();
        let mut rng = ChaCha20Rng::from_seed(*seed);
        for i in (1..order.len()).rev() {
            order.swap(i, below(&mut rng, i as u64 + 1) as usize);
        }
        let position = order.iter().enumerate().map(|(p, &c)| (c, p)).collect();
        Ok(Self { order, position, degree })
    }

    /// Whether `client` is in the sample.
    pub fn contains(&self, client: ClientId) -> bool {
        self.position.contains_key(&client)
    }

    /// The neighbours of `client`, sorted (empty for a client not in the sample).
    pub fn neighbours(&self, client: ClientId) -> Vec<ClientId> {
        let Some(&p) = self.position.get(&client) else { return Vec::new() };
        let n = self.order.len();
        let mut out: Vec<ClientId> = if self.degree >= n - 1 {
            self.order.iter().copied().filter(|&c| c != client).collect()
        } else {
            (1..=self.degree / 2).flat_map(|j| [self.order[(p + j) % n], self.order[(p + n - j) % n]]).collect()
        };
        out.sort_unstable();
        out
    }
}

/// A uniform integer in [0, bound) by rejection (no modulo bias; the same on every platform).
fn below(rng: &mut ChaCha20Rng, bound: u64) -> u64 {
    let zone = u64::MAX - (u64::MAX % bound);
    loop {
        let x = rng.next_u64();
        if x < zone {
            return x % bound;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u32) -> Vec<ClientId> {
        (0..n).map(ClientId).collect()
    }

    #[test]
    fn harary_graph_is_regular_and_symmetric() {
        let g = Graph::new(&ids(50), 12, &[7; 32]).unwrap();
        for c in ids(50) {
            let nb = g.neighbours(c);
            assert_eq!(nb.len(), 12);
            assert!(!nb.contains(&c));
            assert!(nb.iter().all(|&v| g.neighbours(v).contains(&c)));
        }
        let other = Graph::new(&ids(50), 12, &[8; 32]).unwrap();
        assert_ne!(g.neighbours(ClientId(0)), other.neighbours(ClientId(0)));
    }

    #[test]
    fn effective_parameters() {
        let p = |degree, threshold| Params { degree, threshold };
        assert_eq!(p(7, 5).effective(100).unwrap(), (8, 5));
        assert_eq!(p(500, 6).effective(10).unwrap(), (9, 6));
        assert_eq!(p(8, 4).effective(100).unwrap_err().reason(), "bad_params");
        assert!(p(8, 9).effective(100).is_err() && p(2, 2).effective(2).is_err());
    }

    #[test]
    fn recommended_grows_with_dropout_and_stays_logarithmic() {
        let r = Params::recommended(100, 0.0);
        assert_eq!((r.degree, r.threshold), (14, 8));
        let r10 = Params::recommended(100, 0.1);
        assert!(r10.degree > 14 && r10.degree < 99 && r10.degree.is_multiple_of(2), "{r10:?}");
        assert_eq!(Params::recommended(100, 0.3).degree, 99);
        let big = Params::recommended(100_000, 0.05);
        assert!(big.degree < 120, "{big:?}");
        assert!(r.effective(100).is_ok() && r10.effective(100).is_ok() && big.effective(100_000).is_ok());
    }
}
