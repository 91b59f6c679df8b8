//! The plain index structure every federated partition returns: client → task → indices.
//!
//! Two index spaces: `train` and `local_test` index the **training pool** (the dataset the
//! partition was made from); `test` and [`FederatedSplit::surrogate`] index the **test pool**.
//! All index lists are sorted ascending, so equal partitions are equal structures, and
//! [`FederatedSplit::fingerprint`] hashes one to a stable 64-bit value.

use std::collections::HashSet;

use anchorage_shared::rng::Rng;
use serde::{Deserialize, Serialize};

use crate::DataError;

/// One task of one client.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TaskSplit {
    /// The task's classes, in the order the client meets them.
    pub classes: Vec<u32>,
    /// Training samples (training pool).
    pub train: Vec<usize>,
    /// The client's held-out local test samples (training pool), e.g. FedTA's 30 %; often empty.
    pub local_test: Vec<usize>,
    /// Test samples of the task's classes (test pool), shared by every client of the same class
    /// set: under an IID or Dirichlet split each of 1,000 clients would otherwise hold its own
    /// copy of the whole test pool's indices (80 KB each for MNIST).
    pub test: std::sync::Arc<[usize]>,
}

impl TaskSplit {
    /// The client's local test rows of the task: its held-out share where the split has one,
    /// else the task's test-pool samples. `true`: the rows index the training pool.
    pub fn local_test_rows(&self) -> (&[usize], bool) {
        if self.local_test.is_empty() { (&self.test, false) } else { (&self.local_test, true) }
    }
}

/// The task stream of one client.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ClientSplit {
    pub tasks: Vec<TaskSplit>,
}

/// A whole federated, task-incremental partition.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct FederatedSplit {
    pub clients: Vec<ClientSplit>,
    /// Server-side surrogate samples (test pool), e.g. FedTA's k per class; often empty.
    pub surrogate: Vec<usize>,
}

/// FNV-1a, 64 bit.
struct Fnv(u64);

impl Fnv {
    fn write(&mut self, v: u64) {
        for b in v.to_le_bytes() {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn list(&mut self, v: impl ExactSizeIterator<Item = u64>) {
        self.write(v.len() as u64);
        v.for_each(|x| self.write(x));
    }
}

impl FederatedSplit {
    pub fn num_clients(&self) -> usize {
        self.clients.len()
    }

    /// The largest task count of any client.
    pub fn num_tasks(&self) -> usize {
        self.clients.iter().map(|c| c.tasks.len()).max().unwrap_or(0)
    }

    /// A stable 64-bit FNV-1a hash of the whole structure (independent of platform and Rust version).
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv(0xcbf2_9ce4_8422_2325);
        h.write(self.clients.len() as u64);
        for c in &self.clients {
            h.write(c.tasks.len() as u64);
            for t in &c.tasks {
                h.list(t.classes.iter().map(|&x| x as u64));
                h.list(t.train.iter().map(|&x| x as u64));
                h.list(t.local_test.iter().map(|&x| x as u64));
                h.list(t.test.iter().map(|&x| x as u64));
            }
        }
        h.list(self.surrogate.iter().map(|&x| x as u64));
        h.0
    }

    /// Training-pool indices (train and local test) of a client over all its tasks.
    pub fn client_indices(&self, client: usize) -> Vec<usize> {
        let mut v: Vec<usize> =
            self.clients[client].tasks.iter().flat_map(|t| t.train.iter().chain(&t.local_test).copied()).collect();
        v.sort_unstable();
        v
    }

    /// Checks that no training-pool sample is used twice (across clients, tasks, train and local
    /// test), that every index is below the pool sizes, and that the surrogate set is disjoint
    /// from every client's test set.
    pub fn check(&self, train_len: usize, test_len: usize) -> Result<(), DataError> {
        let mut seen = vec![false; train_len];
        for (ci, c) in self.clients.iter().enumerate() {
            for (ti, t) in c.tasks.iter().enumerate() {
                for &i in t.train.iter().chain(&t.local_test) {
                    match seen.get_mut(i) {
                        None => {
                            return Err(DataError::Invalid(format!("client {ci} task {ti}: index {i} ≥ {train_len}")));
                        }
                        Some(true) => {
                            return Err(DataError::Invalid(format!("client {ci} task {ti}: sample {i} used twice")));
                        }
                        Some(s) => *s = true,
                    }
                }
                if t.test.iter().any(|&i| i >= test_len) {
                    return Err(DataError::Invalid(format!("client {ci} task {ti}: test index ≥ {test_len}")));
                }
            }
        }
        let sur: HashSet<usize> = self.surrogate.iter().copied().collect();
        if self.clients.iter().flat_map(|c| &c.tasks).flat_map(|t| t.test.iter()).any(|i| sur.contains(i)) {
            return Err(DataError::Invalid("a surrogate sample is also a client test sample".into()));
        }
        Ok(())
    }
}

/// The task a client is in at a round, when the task advances every `rounds_per_task` rounds
/// (FedProK's incremental state every R rounds); stays on the last task afterwards.
pub fn task_at_round(round: u64, rounds_per_task: u64, num_tasks: usize) -> usize {
    if num_tasks == 0 {
        return 0;
    }
    ((round / rounds_per_task.max(1)) as usize).min(num_tasks - 1)
}

// ---- helpers shared by the partitioners ----

/// Indices of each class (ascending), checking the label range.
pub(crate) fn by_class(labels: &[u32], num_classes: u32) -> Result<Vec<Vec<usize>>, DataError> {
    let mut by = vec![Vec::new(); num_classes as usize];
    for (i, &l) in labels.iter().enumerate() {
        by.get_mut(l as usize).ok_or(DataError::LabelOutOfRange { index: i, label: l, num_classes })?.push(i);
    }
    Ok(by)
}

/// Cuts `idx` into consecutive parts with sizes proportional to `shares` (cumulative rounding; the
/// last part takes the rest).
pub(crate) fn deal(idx: &[usize], shares: &[f64]) -> Vec<Vec<usize>> {
    let total: f64 = shares.iter().sum();
    let mut parts = Vec::with_capacity(shares.len());
    let (mut start, mut cum) = (0usize, 0.0);
    for (k, s) in shares.iter().enumerate() {
        cum += s;
        let end = if k + 1 == shares.len() {
            idx.len()
        } else if total > 0.0 {
            ((cum / total * idx.len() as f64).round() as usize).clamp(start, idx.len())
        } else {
            start
        };
        parts.push(idx[start..end].to_vec());
        start = end;
    }
    parts
}

/// Largest-remainder apportionment of `total` proportional to `weights` (sums exactly to `total`
/// when some weight is positive).
pub(crate) fn apportion(total: usize, weights: &[f64]) -> Vec<usize> {
    let sum: f64 = weights.iter().sum();
    if sum <= 0.0 {
        return vec![0; weights.len()];
    }
    let exact: Vec<f64> = weights.iter().map(|w| w / sum * total as f64).collect();
    let mut out: Vec<usize> = exact.iter().map(|x| x.floor() as usize).collect();
    let mut left = total.saturating_sub(out.iter().sum());
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())).then(a.cmp(&b)));
    for &k in order.iter().cycle().take(weights.len() * 2) {
        if left == 0 {
            break;
        }
        if exact[k] > out[k] as f64 {
            out[k] += 1;
            left -= 1;
        }
    }
    out
}

/// Test-pool indices of `classes`, without the `exclude`d ones (sorted).
pub(crate) fn test_of(
    test_by_class: &[Vec<usize>],
    classes: &[u32],
    exclude: &HashSet<usize>,
) -> std::sync::Arc<[usize]> {
    let mut v: Vec<usize> = classes
        .iter()
        .filter_map(|&c| test_by_class.get(c as usize))
        .flatten()
        .copied()
        .filter(|i| !exclude.contains(i))
        .collect();
    v.sort_unstable();
    v.into()
}

/// Splits `idx` per class into (train, local test) with `train_fraction` of each class (rounded)
/// in train, after a seeded shuffle; both sorted.
pub(crate) fn train_local_split(
    idx: &[usize],
    labels: &[u32],
    train_fraction: f64,
    rng: &mut Rng,
) -> (Vec<usize>, Vec<usize>) {
    let mut classes: Vec<u32> = idx.iter().map(|&i| labels[i]).collect();
    classes.sort_unstable();
    classes.dedup();
    let (mut train, mut test) = (Vec::new(), Vec::new());
    for c in classes {
        let mut of: Vec<usize> = idx.iter().copied().filter(|&i| labels[i] == c).collect();
        rng.shuffle(&mut of);
        let k = ((of.len() as f64) * train_fraction.clamp(0.0, 1.0)).round() as usize;
        train.extend_from_slice(&of[..k]);
        test.extend_from_slice(&of[k..]);
    }
    train.sort_unstable();
    test.sort_unstable();
    (train, test)
}

/// A client's class-incremental tasks (GLDP's stages, FedProK's tasks): its `owned` classes with
/// their training indices, in `order`, cut into `tasks` chunks; each task trains on its classes'
/// indices (sorted) and is tested on their whole test pool.
pub(crate) fn class_incremental_tasks(
    owned: &[(u32, Vec<usize>)],
    order: &[u32],
    tasks: usize,
    test_by_class: &[Vec<usize>],
) -> ClientSplit {
    let tasks = chunks(order, tasks)
        .into_iter()
        .map(|classes| {
            let mut train: Vec<usize> =
                owned.iter().filter(|(k, _)| classes.contains(k)).flat_map(|(_, v)| v.iter().copied()).collect();
            train.sort_unstable();
            let test = test_of(test_by_class, &classes, &HashSet::new());
            TaskSplit { classes, train, local_test: Vec::new(), test }
        })
        .collect();
    ClientSplit { tasks }
}

/// Cuts `classes` into `n` consecutive chunks of near-equal size (earlier chunks get the remainder).
pub(crate) fn chunks(classes: &[u32], n: usize) -> Vec<Vec<u32>> {
    let (q, r) = (classes.len() / n.max(1), classes.len() % n.max(1));
    let mut out = Vec::with_capacity(n);
    let mut start = 0;
    for k in 0..n {
        let len = q + usize::from(k < r);
        out.push(classes[start..start + len].to_vec());
        start += len;
    }
    out
}

/// A seeded permutation of `0..n` as classes.
pub(crate) fn class_permutation(n: u32, rng: &mut Rng) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    rng.shuffle(&mut v);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helpers() {
        assert_eq!(apportion(10, &[1.0, 1.0, 1.0]).iter().sum::<usize>(), 10);
        assert_eq!(apportion(7, &[0.0, 2.0, 5.0]), vec![0, 2, 5]);
        assert_eq!(deal(&[1, 2, 3, 4], &[0.5, 0.0, 0.5]), vec![vec![1, 2], vec![], vec![3, 4]]);
        assert_eq!(chunks(&[1, 2, 3, 4, 5], 2), vec![vec![1, 2, 3], vec![4, 5]]);
        assert_eq!(task_at_round(0, 10, 3), 0);
        assert_eq!(task_at_round(25, 10, 3), 2);
        assert_eq!(task_at_round(99, 10, 3), 2);
    }
}
