//! FedProK's federated class-incremental settings (Gao et al.).
//!
//! * **Synchronous**: all clients share one (seeded) class order cut into tasks of equal class
//!   count; within each task, every class's samples are dealt over the clients by Dirichlet(α)
//!   amounts.
//! * **Asynchronous**, consensus rate γ: `G = round(γ·C)` classes are common to all clients (their
//!   samples dealt by Dirichlet(α)); each of the other `C − G` classes belongs to exactly one
//!   client (round robin over the permuted classes), with all its samples. Every client meets its
//!   common + own classes in its own seeded order, cut into `tasks` tasks. The fraction of classes
//!   held by every client is exactly `G / C` (= γ when γ·C is whole).
//!
//! The task advances every R rounds: see [`task_at_round`](super::task_at_round).

use std::collections::HashSet;

use anchorage_shared::rng::Rng;
use serde::{Deserialize, Serialize};

use super::split::{
    ClientSplit, FederatedSplit, TaskSplit, by_class, chunks, class_incremental_tasks, class_permutation, deal, test_of,
};
use crate::DataError;

/// Synchronous FCIL.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FedprokSyncConfig {
    pub clients: usize,
    pub tasks: usize,
    /// Dirichlet concentration of the per-class client amounts.
    pub alpha: f64,
}

/// Asynchronous FCIL with consensus rate γ.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FedprokAsyncConfig {
    pub clients: usize,
    pub tasks: usize,
    pub alpha: f64,
    /// γ ∈ [0, 1]: the fraction of classes common to all clients.
    pub consensus: f64,
}

fn check(clients: usize, tasks: usize, alpha: f64, num_classes: u32) -> Result<(), DataError> {
    if clients == 0 || tasks == 0 || tasks > num_classes as usize || !(alpha.is_finite() && alpha > 0.0) {
        return Err(DataError::Invalid(format!(
            "FedProK: need clients > 0, 0 < tasks ≤ {num_classes} classes and α > 0 (got {clients}, {tasks}, {alpha})"
        )));
    }
    Ok(())
}

/// Synchronous FCIL.
pub fn fedprok_sync(
    train_labels: &[u32],
    test_labels: &[u32],
    num_classes: u32,
    cfg: &FedprokSyncConfig,
    seed: u64,
) -> Result<FederatedSplit, DataError> {
    check(cfg.clients, cfg.tasks, cfg.alpha, num_classes)?;
    let by = by_class(train_labels, num_classes)?;
    let test_by = by_class(test_labels, num_classes)?;
    let mut rng = Rng::derive(seed, 0x5C);
    let order = class_permutation(num_classes, &mut rng);
    let mut clients = vec![ClientSplit::default(); cfg.clients];
    for classes in chunks(&order, cfg.tasks) {
        let mut parts: Vec<Vec<usize>> = vec![Vec::new(); cfg.clients];
        for &k in &classes {
            let mut idx = by[k as usize].clone();
            rng.shuffle(&mut idx);
            let shares = rng.dirichlet(cfg.alpha, cfg.clients);
            for (i, p) in deal(&idx, &shares).into_iter().enumerate() {
                parts[i].extend(p);
            }
        }
        let test = test_of(&test_by, &classes, &HashSet::new());
        for (c, mut train) in clients.iter_mut().zip(parts) {
            train.sort_unstable();
            c.tasks.push(TaskSplit { classes: classes.clone(), train, local_test: Vec::new(), test: test.clone() });
        }
    }
    Ok(FederatedSplit { clients, surrogate: Vec::new() })
}

/// Asynchronous FCIL with consensus rate γ.
pub fn fedprok_async(
    train_labels: &[u32],
    test_labels: &[u32],
    num_classes: u32,
    cfg: &FedprokAsyncConfig,
    seed: u64,
) -> Result<FederatedSplit, DataError> {
    check(cfg.clients, cfg.tasks, cfg.alpha, num_classes)?;
    if !(0.0..=1.0).contains(&cfg.consensus) {
        return Err(DataError::Invalid(format!("FedProK: consensus rate γ must be in [0, 1], got {}", cfg.consensus)));
    }
    let (n, c) = (cfg.clients, num_classes as usize);
    let g = (cfg.consensus * c as f64).round() as usize;
    let by = by_class(train_labels, num_classes)?;
    let test_by = by_class(test_labels, num_classes)?;
    let mut rng = Rng::derive(seed, 0xA5);
    let perm = class_permutation(num_classes, &mut rng);
    let mut owned: Vec<Vec<(u32, Vec<usize>)>> = vec![Vec::new(); n];
    for &k in &perm[..g] {
        let mut idx = by[k as usize].clone();
        rng.shuffle(&mut idx);
        let shares = rng.dirichlet(cfg.alpha, n);
        for (i, p) in deal(&idx, &shares).into_iter().enumerate() {
            owned[i].push((k, p));
        }
    }
    for (j, &k) in perm[g..].iter().enumerate() {
        owned[j % n].push((k, by[k as usize].clone()));
    }
    let mut clients = Vec::with_capacity(n);
    for (i, own) in owned.iter().enumerate() {
        let mut order: Vec<u32> = own.iter().map(|(k, _)| *k).collect();
        Rng::derive(seed, 0xA5_0000 + i as u64).shuffle(&mut order);
        clients.push(class_incremental_tasks(own, &order, cfg.tasks.min(order.len().max(1)), &test_by));
    }
    Ok(FederatedSplit { clients, surrogate: Vec::new() })
}

/// The measured consensus rate: classes held by every client over classes held by any client.
pub fn consensus_rate(split: &FederatedSplit) -> f64 {
    let held: Vec<HashSet<u32>> =
        split.clients.iter().map(|c| c.tasks.iter().flat_map(|t| t.classes.iter().copied()).collect()).collect();
    let any: HashSet<u32> = held.iter().flatten().copied().collect();
    if any.is_empty() {
        return 0.0;
    }
    let all = any.iter().filter(|k| held.iter().all(|h| h.contains(k))).count();
    all as f64 / any.len() as f64
}
