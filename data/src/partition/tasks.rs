//! Turning a plain client partition into task streams: class-incremental tasks over a shared class
//! order, and domain-incremental tasks (one domain per task).

use std::collections::HashSet;

use anchorage_shared::rng::Rng;

use super::split::{
    ClientSplit, FederatedSplit, TaskSplit, by_class, chunks, class_permutation, test_of, train_local_split,
};
use crate::DataError;

/// Class-incremental tasks over any client partition (`parts`: client → training-pool indices):
/// the classes, in a seeded order shared by all clients, are cut into `num_tasks` tasks of
/// near-equal class count; a client's task t holds its samples of task t's classes. With
/// `num_tasks = 1` this just wraps the partition.
pub fn class_incremental(
    parts: &[Vec<usize>],
    train_labels: &[u32],
    test_labels: &[u32],
    num_classes: u32,
    num_tasks: usize,
    seed: u64,
) -> Result<FederatedSplit, DataError> {
    if num_tasks == 0 || num_tasks > num_classes as usize {
        return Err(DataError::Invalid(format!("need 0 < tasks ≤ {num_classes} classes, got {num_tasks}")));
    }
    by_class(train_labels, num_classes)?;
    let test_by = by_class(test_labels, num_classes)?;
    let order: Vec<u32> = if num_tasks == 1 {
        (0..num_classes).collect()
    } else {
        class_permutation(num_classes, &mut Rng::derive(seed, 0xC1A55))
    };
    let task_classes = chunks(&order, num_tasks);
    let mut task_of = vec![0usize; num_classes as usize];
    for (t, cl) in task_classes.iter().enumerate() {
        cl.iter().for_each(|&k| task_of[k as usize] = t);
    }
    // One test list per task, shared by every client (`TaskSplit::test`).
    let task_tests: Vec<std::sync::Arc<[usize]>> =
        task_classes.iter().map(|cl| test_of(&test_by, cl, &HashSet::new())).collect();
    let clients = parts
        .iter()
        .map(|p| {
            let mut tasks: Vec<TaskSplit> = task_classes
                .iter()
                .zip(&task_tests)
                .map(|(cl, test)| TaskSplit { classes: cl.clone(), test: test.clone(), ..Default::default() })
                .collect();
            for &i in p {
                if let Some(&l) = train_labels.get(i) {
                    tasks[task_of[l as usize]].train.push(i);
                }
            }
            tasks.iter_mut().for_each(|t| t.train.sort_unstable());
            ClientSplit { tasks }
        })
        .collect();
    Ok(FederatedSplit { clients, surrogate: Vec::new() })
}

/// Domain-incremental tasks: `domain_of[i]` is the domain of training sample i; every domain's
/// samples are dealt IID (seeded) over the clients, and a client's task d is its share of domain
/// d, split per class into train and local test by `train_fraction` (1 = no local test).
pub fn domain_incremental(
    domain_of: &[u32],
    labels: &[u32],
    num_domains: usize,
    num_classes: u32,
    num_clients: usize,
    train_fraction: f64,
    seed: u64,
) -> Result<FederatedSplit, DataError> {
    if num_clients == 0 || domain_of.len() != labels.len() {
        return Err(DataError::Invalid(format!(
            "need clients > 0 and one domain per label ({num_clients} clients, {} domains, {} labels)",
            domain_of.len(),
            labels.len()
        )));
    }
    by_class(labels, num_classes)?;
    let mut by_domain = vec![Vec::new(); num_domains];
    for (i, &d) in domain_of.iter().enumerate() {
        by_domain
            .get_mut(d as usize)
            .ok_or_else(|| DataError::Invalid(format!("sample {i} is in domain {d}, not below {num_domains}")))?
            .push(i);
    }
    let mut rng = Rng::derive(seed, 0xD0AA);
    let mut clients = vec![ClientSplit::default(); num_clients];
    let all: Vec<u32> = (0..num_classes).collect();
    for mut idx in by_domain {
        rng.shuffle(&mut idx);
        let n = idx.len();
        for (c, client) in clients.iter_mut().enumerate() {
            let share = &idx[c * n / num_clients..(c + 1) * n / num_clients];
            let (train, local_test) = train_local_split(share, labels, train_fraction, &mut rng);
            client.tasks.push(TaskSplit { classes: all.clone(), train, local_test, test: Default::default() });
        }
    }
    Ok(FederatedSplit { clients, surrogate: Vec::new() })
}
