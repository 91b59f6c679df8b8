//! GLDP's spatio-temporal heterogeneity setting `[N, S, M]` (STHFL, Guo et al.): N clients, each
//! holding S classes met over M stages (tasks), on a long-tailed pool (imbalance factor IF).
//!
//! How the split is built (the paper fixes the triple and IF; the dealing below is ours):
//! 1. the training pool is cut to a long tail ([`long_tail`](super::long_tail())) when IF > 1;
//! 2. clients in turn take the S classes held by the fewest clients so far (ties broken at random,
//!    seeded): S distinct classes each, every class held by ⌊N·S/C⌋ or ⌈N·S/C⌉ clients;
//! 3. the client's S classes, in a per-client seeded order, are cut into M stages (S/M each, the
//!    first stages take a remainder);
//! 4. class c's (long-tailed) samples are divided equally among its holders, then every client is
//!    cut down (proportionally, largest remainder) to the same total T = min over clients (or
//!    `samples_per_client` if smaller): the same number of samples per client, a different class
//!    distribution per client, and no sample in two clients.
//!
//! Test sets: every stage gets the test-pool samples of its classes.

use anchorage_shared::rng::Rng;
use serde::{Deserialize, Serialize};

use super::long_tail::long_tail;
use super::split::{FederatedSplit, apportion, by_class, class_incremental_tasks};
use crate::DataError;

/// `[N, S, M]` and the long tail.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GldpConfig {
    /// N.
    pub clients: usize,
    /// S.
    pub classes_per_client: usize,
    /// M (1 = the spatial setting).
    #[serde(default = "one")]
    pub stages: usize,
    /// IF (1 = balanced).
    #[serde(default = "one_f")]
    pub imbalance: f64,
    /// Cap on the equal per-client sample count.
    #[serde(default)]
    pub samples_per_client: Option<usize>,
}

fn one() -> usize {
    1
}

fn one_f() -> f64 {
    1.0
}

/// Builds the `[N, S, M]` split of a training pool (`train_labels`) and test pool (`test_labels`).
pub fn gldp(
    train_labels: &[u32],
    test_labels: &[u32],
    num_classes: u32,
    cfg: &GldpConfig,
    seed: u64,
) -> Result<FederatedSplit, DataError> {
    let (n, s, m, c) = (cfg.clients, cfg.classes_per_client, cfg.stages, num_classes as usize);
    if n == 0 || s == 0 || m == 0 || s > c || m > s {
        return Err(DataError::Invalid(format!(
            "GLDP [N, S, M] = [{n}, {s}, {m}] needs N, S, M > 0, S ≤ {c} classes and M ≤ S"
        )));
    }
    let pool: Vec<usize> = if cfg.imbalance > 1.0 {
        long_tail(train_labels, num_classes, cfg.imbalance, seed)?
    } else {
        by_class(train_labels, num_classes)?;
        (0..train_labels.len()).collect()
    };
    let mut by = vec![Vec::new(); c];
    pool.iter().for_each(|&i| by[train_labels[i] as usize].push(i));
    let test_by = by_class(test_labels, num_classes)?;
    let mut rng = Rng::derive(seed, 0x61D9);
    // Each client takes the S least-held classes so far, ties broken at random.
    let mut holders: Vec<Vec<usize>> = vec![Vec::new(); c];
    let mut held: Vec<Vec<u32>> = Vec::with_capacity(n);
    for i in 0..n {
        let mut keyed: Vec<(usize, u64, u32)> =
            (0..num_classes).map(|k| (holders[k as usize].len(), rng.next_u64(), k)).collect();
        keyed.sort_unstable();
        let mine: Vec<u32> = keyed[..s].iter().map(|&(_, _, k)| k).collect();
        mine.iter().for_each(|&k| holders[k as usize].push(i));
        held.push(mine);
    }
    // Equal share of each class among its holders, then equalise client totals.
    let share: Vec<usize> = (0..c).map(|k| by[k].len() / holders[k].len().max(1)).collect();
    let base = |_i: usize, k: u32| share[k as usize];
    let totals: Vec<usize> = held.iter().enumerate().map(|(i, cl)| cl.iter().map(|&k| base(i, k)).sum()).collect();
    let mut t = totals.iter().copied().min().unwrap_or(0);
    if let Some(cap) = cfg.samples_per_client {
        t = t.min(cap);
    }
    if t == 0 {
        return Err(DataError::Invalid(format!(
            "GLDP: a client would get no samples ([{n}, {s}, {m}], IF {})",
            cfg.imbalance
        )));
    }
    let amounts: Vec<Vec<usize>> = held
        .iter()
        .enumerate()
        .map(|(i, cl)| apportion(t, &cl.iter().map(|&k| base(i, k) as f64).collect::<Vec<_>>()))
        .collect();
    for idx in by.iter_mut() {
        rng.shuffle(idx);
    }
    let mut clients = Vec::with_capacity(n);
    for (i, cl) in held.iter().enumerate() {
        let mut mine: Vec<(u32, Vec<usize>)> = Vec::with_capacity(s);
        for (j, &k) in cl.iter().enumerate() {
            let slot = holders[k as usize].iter().position(|&h| h == i).unwrap_or(0);
            let start = slot * base(i, k);
            mine.push((k, by[k as usize][start..start + amounts[i][j]].to_vec()));
        }
        let mut order: Vec<u32> = cl.clone();
        Rng::derive(seed, 0x61D9_0000 + i as u64).shuffle(&mut order);
        clients.push(class_incremental_tasks(&mine, &order, m, &test_by));
    }
    Ok(FederatedSplit { clients, surrogate: Vec::new() })
}
