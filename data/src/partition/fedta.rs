//! FedTA's setting (Yu et al.): every client holds private classes (its own) and public classes
//! (shared by all clients, their samples dealt by Dirichlet(α = 1) with no overlap), met as tasks of
//! equal class count (e.g. 5 clients × 5 tasks × 8 classes); each client-task's data is split
//! 70/30 into train and local test; the server keeps a small surrogate set of k samples per class
//! drawn from the test pool (and removed from the clients' test sets).
//!
//! Classes: a seeded permutation; its first P are public, the next blocks of p = tasks ·
//! classes_per_task − P are the clients' private classes. Each client meets its P + p classes in
//! its own seeded order.

use std::collections::HashSet;

use anchorage_shared::rng::Rng;
use serde::{Deserialize, Serialize};

use super::split::{
    ClientSplit, FederatedSplit, TaskSplit, by_class, chunks, class_permutation, deal, test_of, train_local_split,
};
use crate::DataError;

/// The FedTA setting's knobs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FedtaConfig {
    pub clients: usize,
    pub tasks: usize,
    pub classes_per_task: usize,
    /// P: classes every client holds.
    pub public_classes: usize,
    /// Dirichlet concentration of the public classes' amounts.
    #[serde(default = "one")]
    pub public_alpha: f64,
    /// Fraction of a client-task's samples used for training (the rest is its local test).
    #[serde(default = "seventy")]
    pub train_fraction: f64,
    /// k: server surrogate samples per class (from the test pool).
    #[serde(default)]
    pub surrogate_per_class: usize,
}

fn one() -> f64 {
    1.0
}

fn seventy() -> f64 {
    0.7
}

impl FedtaConfig {
    /// p: private classes per client.
    pub fn private_per_client(&self) -> usize {
        (self.tasks * self.classes_per_task).saturating_sub(self.public_classes)
    }
}

/// Builds the FedTA split.
pub fn fedta(
    train_labels: &[u32],
    test_labels: &[u32],
    num_classes: u32,
    cfg: &FedtaConfig,
    seed: u64,
) -> Result<FederatedSplit, DataError> {
    let (n, per_client) = (cfg.clients, cfg.tasks * cfg.classes_per_task);
    let p = cfg.private_per_client();
    let needed = cfg.public_classes + n * p;
    if n == 0 || cfg.tasks == 0 || cfg.classes_per_task == 0 || cfg.public_classes > per_client {
        return Err(DataError::Invalid(format!(
            "FedTA: need clients, tasks, classes per task > 0 and public classes ≤ tasks × classes per task = {per_client}"
        )));
    }
    if needed > num_classes as usize {
        return Err(DataError::Invalid(format!(
            "FedTA: {} public + {n} clients × {p} private = {needed} classes, but the data has {num_classes}",
            cfg.public_classes
        )));
    }
    let alpha_ok = cfg.public_alpha.is_finite() && cfg.public_alpha > 0.0;
    if !alpha_ok || !(0.0..=1.0).contains(&cfg.train_fraction) {
        return Err(DataError::Invalid("FedTA: public α must be > 0 and train fraction in [0, 1]".into()));
    }
    let by = by_class(train_labels, num_classes)?;
    let test_by = by_class(test_labels, num_classes)?;
    let mut rng = Rng::derive(seed, 0xFE07A);
    let perm = class_permutation(num_classes, &mut rng);
    let public = &perm[..cfg.public_classes];
    // owned[i]: (class, samples) of client i.
    let mut owned: Vec<Vec<(u32, Vec<usize>)>> = vec![Vec::new(); n];
    for &k in public {
        let mut idx = by[k as usize].clone();
        rng.shuffle(&mut idx);
        let shares = rng.dirichlet(cfg.public_alpha, n);
        for (i, part) in deal(&idx, &shares).into_iter().enumerate() {
            owned[i].push((k, part));
        }
    }
    for (i, own) in owned.iter_mut().enumerate() {
        let start = cfg.public_classes + i * p;
        for &k in &perm[start..start + p] {
            own.push((k, by[k as usize].clone()));
        }
    }
    // Surrogate: k per class from the test pool.
    let mut surrogate = Vec::new();
    for idx in &test_by {
        let mut v = idx.clone();
        rng.shuffle(&mut v);
        surrogate.extend_from_slice(&v[..cfg.surrogate_per_class.min(v.len())]);
    }
    surrogate.sort_unstable();
    let exclude: HashSet<usize> = surrogate.iter().copied().collect();
    let mut clients = Vec::with_capacity(n);
    for (i, own) in owned.iter().enumerate() {
        let mut crng = Rng::derive(seed, 0x000F_E07A_0000 + i as u64);
        let mut order: Vec<u32> = own.iter().map(|(k, _)| *k).collect();
        crng.shuffle(&mut order);
        let tasks = chunks(&order, cfg.tasks)
            .into_iter()
            .map(|classes| {
                let idx: Vec<usize> =
                    own.iter().filter(|(k, _)| classes.contains(k)).flat_map(|(_, v)| v.iter().copied()).collect();
                let (train, local_test) = train_local_split(&idx, train_labels, cfg.train_fraction, &mut crng);
                let test = test_of(&test_by, &classes, &exclude);
                TaskSplit { classes, train, local_test, test }
            })
            .collect();
        clients.push(ClientSplit { tasks });
    }
    Ok(FederatedSplit { clients, surrogate })
}

/// The private classes of each client (classes no other client holds).
pub fn private_classes(split: &FederatedSplit) -> Vec<Vec<u32>> {
    let held: Vec<HashSet<u32>> =
        split.clients.iter().map(|c| c.tasks.iter().flat_map(|t| t.classes.iter().copied()).collect()).collect();
    held.iter()
        .enumerate()
        .map(|(i, mine)| {
            let mut v: Vec<u32> = mine
                .iter()
                .copied()
                .filter(|k| held.iter().enumerate().all(|(j, o)| j == i || !o.contains(k)))
                .collect();
            v.sort_unstable();
            v
        })
        .collect()
}
