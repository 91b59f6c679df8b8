//! Seeded partitions of a dataset over clients: the same seed gives the same assignment.
//!
//! Plain partitions ([`iid`], [`dirichlet`], [`quantity_skew`], [`long_tail()`]) return client →
//! indices; the paper settings ([`gldp()`], [`fedta()`], [`fedprok_sync`], [`fedprok_async`]) and the
//! task builders ([`class_incremental`], [`domain_incremental`]) return a [`FederatedSplit`]
//! (client → task → indices).

use anchorage_shared::rng::Rng;

use crate::DataError;

mod fedprok;
mod fedta;
mod gldp;
mod long_tail;
mod quantity;
mod split;
mod tasks;

pub use fedprok::{FedprokAsyncConfig, FedprokSyncConfig, consensus_rate, fedprok_async, fedprok_sync};
pub use fedta::{FedtaConfig, fedta, private_classes};
pub use gldp::{GldpConfig, gldp};
pub use long_tail::{imbalance_factor, long_tail, long_tail_counts};
pub use quantity::quantity_skew;
pub use split::{ClientSplit, FederatedSplit, TaskSplit, task_at_round};
pub use tasks::{class_incremental, domain_incremental};

/// How many times [`dirichlet`] redraws the client shares before giving up on `min_per_client`.
pub const MAX_REDRAWS: usize = 1000;

/// IID: a seeded shuffle cut into near-equal contiguous parts (sizes differ by at most one).
/// Zero clients get zero parts.
pub fn iid(len: usize, num_clients: usize, seed: u64) -> Vec<Vec<usize>> {
    if num_clients == 0 {
        return Vec::new();
    }
    let mut idx: Vec<usize> = (0..len).collect();
    Rng::new(seed).shuffle(&mut idx);
    let n = num_clients;
    (0..n).map(|c| idx[c * len / n..(c + 1) * len / n].to_vec()).collect()
}

/// Dirichlet(α) label skew (Hsu et al. 2019): for every class, client shares drawn from
/// Dir(α, …, α) deal out that class's (shuffled) samples. Small α gives few classes per client;
/// α → ∞ approaches IID. Redraws (at most [`MAX_REDRAWS`] times) until every client has
/// `min_per_client` samples, then gives up with [`DataError::MinPerClientUnmet`]. Each part is
/// returned sorted ascending.
pub fn dirichlet(
    labels: &[u32],
    num_classes: u32,
    num_clients: usize,
    alpha: f64,
    min_per_client: usize,
    seed: u64,
) -> Result<Vec<Vec<usize>>, DataError> {
    if num_clients == 0 || !(alpha.is_finite() && alpha > 0.0) {
        return Err(DataError::Invalid(format!(
            "need clients > 0 and a finite α > 0 (got {num_clients} clients, α = {alpha})"
        )));
    }
    if labels.len() < num_clients * min_per_client {
        return Err(DataError::TooFewSamples { len: labels.len(), num_clients, min_per_client });
    }
    let mut by_class = vec![Vec::new(); num_classes as usize];
    for (i, &l) in labels.iter().enumerate() {
        let class =
            by_class.get_mut(l as usize).ok_or(DataError::LabelOutOfRange { index: i, label: l, num_classes })?;
        class.push(i);
    }
    let mut rng = Rng::new(seed);
    for _attempt in 0..MAX_REDRAWS {
        let mut parts = vec![Vec::new(); num_clients];
        for class in &by_class {
            let mut idx = class.clone();
            rng.shuffle(&mut idx);
            let shares = rng.dirichlet(alpha, num_clients);
            let mut start = 0usize;
            let mut cum = 0.0;
            for (c, share) in shares.iter().enumerate() {
                cum += share;
                let end = if c + 1 == num_clients {
                    idx.len()
                } else {
                    ((cum * idx.len() as f64).round() as usize).min(idx.len())
                };
                parts[c].extend_from_slice(&idx[start..end.max(start)]);
                start = end.max(start);
            }
        }
        if parts.iter().all(|p| p.len() >= min_per_client) {
            parts.iter_mut().for_each(|p| p.sort_unstable());
            return Ok(parts);
        }
    }
    Err(DataError::MinPerClientUnmet { num_clients, min_per_client, alpha, attempts: MAX_REDRAWS })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels() -> Vec<u32> {
        (0..2000).map(|i| (i % 10) as u32).collect()
    }

    fn assert_cover(parts: &[Vec<usize>], len: usize) {
        let mut all: Vec<usize> = parts.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, (0..len).collect::<Vec<_>>(), "partitions must be a disjoint cover");
    }

    fn mean_max_share(parts: &[Vec<usize>], labels: &[u32]) -> f64 {
        parts
            .iter()
            .map(|p| {
                let mut h = [0usize; 10];
                p.iter().for_each(|&i| h[labels[i] as usize] += 1);
                *h.iter().max().unwrap() as f64 / p.len() as f64
            })
            .sum::<f64>()
            / parts.len() as f64
    }

    #[test]
    fn dirichlet_is_seeded_and_covers() {
        let l = labels();
        let a = dirichlet(&l, 10, 8, 0.5, 20, 1).unwrap();
        assert_eq!(a, dirichlet(&l, 10, 8, 0.5, 20, 1).unwrap());
        assert_ne!(a, dirichlet(&l, 10, 8, 0.5, 20, 2).unwrap());
        assert_cover(&a, l.len());
        assert!(a.iter().all(|p| p.len() >= 20));
    }

    #[test]
    fn alpha_controls_skew() {
        let l = labels();
        let skewed = mean_max_share(&dirichlet(&l, 10, 10, 0.1, 5, 3).unwrap(), &l);
        let uniform = mean_max_share(&dirichlet(&l, 10, 10, 1000.0, 5, 3).unwrap(), &l);
        assert!(skewed > 0.5, "α=0.1 mean max class share {skewed}");
        assert!(uniform < 0.2, "α=1000 mean max class share {uniform}");
    }

    #[test]
    fn bad_requests_are_errors() {
        let l = labels();
        assert!(matches!(dirichlet(&l, 10, 0, 0.5, 1, 1), Err(DataError::Invalid(_))));
        assert!(matches!(dirichlet(&l, 10, 4, f64::NAN, 1, 1), Err(DataError::Invalid(_))));
        assert!(matches!(dirichlet(&l, 10, 100, 0.5, 30, 1), Err(DataError::TooFewSamples { .. })));
        assert!(matches!(dirichlet(&[0, 12], 10, 1, 0.5, 1, 1), Err(DataError::LabelOutOfRange { .. })));
    }

    #[test]
    fn iid_is_balanced_cover() {
        let parts = iid(103, 4, 9);
        assert_cover(&parts, 103);
        assert!(parts.iter().all(|p| p.len() == 25 || p.len() == 26));
        assert_eq!(parts, iid(103, 4, 9));
    }
}
