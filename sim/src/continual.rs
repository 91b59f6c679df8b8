//! The continual-learning metrics of ARCHITECTURE.md §8, all from one task accuracy matrix `a[t][k]`
//! (accuracy on the test data of task k after training task t, at the task's last round).

use serde::{Deserialize, Serialize};

use crate::accuracy::{AccuracyRow, CLIENTS_MEAN, SELECTED_MEAN, accuracy_matrix, final_average};

/// A task accuracy matrix: rows "after task t", columns "test task k".
pub type Matrix = Vec<Vec<Option<f64>>>;

/// Summaries of the global model's matrix and of the clients' local models' (mean) matrix.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ContinualMetrics {
    /// Mean accuracy over the tasks seen, after the last task (A^glo of GLDP for the global model).
    pub final_accuracy: Option<f64>,
    /// Mean over t of the mean accuracy after task t (the "average incremental accuracy").
    pub average_accuracy: Option<f64>,
    /// Mean over old tasks k of max_{t<T} `a[t][k]` − `a[T][k]`.
    pub forgetting: Option<f64>,
    /// FedProK: mean accuracy on the old tasks after the last one.
    pub stability: Option<f64>,
    /// FedProK: mean over t of `a[t][t]`, a task's accuracy right after learning it.
    pub plasticity: Option<f64>,
    /// FedProK Eq. 1, U(λ) = λ·stability + (1−λ)·plasticity at λ = 0.5 (our reading).
    pub utility: Option<f64>,
    /// FedTA Eq. 11, temporal knowledge retention: mean over old k of `a[T][k]` / `a[k][k]`.
    pub kr_temporal: Option<f64>,
    /// FedTA Eq. 12, spatial knowledge retention: the global model's diagonal mean over the
    /// clients' local models' diagonal mean (how much of the clients' fresh knowledge the
    /// aggregate keeps).
    pub kr_spatial: Option<f64>,
    /// The clients' local models after the last task, mean over clients and seen tasks (A^loc).
    pub local_final_accuracy: Option<f64>,
    /// GLDP's A^sel, our reading: the clients' local models after the last task on the global
    /// test data of the classes each client holds, mean over clients and seen tasks (only when
    /// the run asked for it, `selected_accuracy`).
    pub selected_final_accuracy: Option<f64>,
    /// Matrices, for the report.
    pub global_matrix: Matrix,
    pub local_matrix: Matrix,
}

fn mean(v: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (s, n) = v.into_iter().fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    (n > 0).then(|| s / n as f64)
}

fn at(m: &Matrix, t: usize, k: usize) -> Option<f64> {
    m.get(t).and_then(|r| r.get(k)).copied().flatten()
}

/// Mean of row t over its evaluated entries.
fn row_mean(m: &Matrix, t: usize) -> Option<f64> {
    mean(m.get(t)?.iter().flatten().copied())
}

/// Forgetting: mean over old tasks of (best earlier accuracy − final accuracy).
pub fn forgetting(m: &Matrix) -> Option<f64> {
    let last = m.len().checked_sub(1)?;
    mean((0..last).filter_map(|k| {
        let best =
            (k..last).filter_map(|t| at(m, t, k)).fold(None, |b: Option<f64>, a| Some(b.map_or(a, |b| b.max(a))))?;
        Some(best - at(m, last, k)?)
    }))
}

impl ContinualMetrics {
    pub fn from_records(rows: &[AccuracyRow]) -> Self {
        let g = accuracy_matrix(rows, "global");
        let l = accuracy_matrix(rows, CLIENTS_MEAN);
        let mut out = Self::from_matrices(g, l);
        out.selected_final_accuracy = final_average(&accuracy_matrix(rows, SELECTED_MEAN));
        if out.final_accuracy.is_none() {
            out.final_accuracy = out.local_final_accuracy;
        }
        out
    }

    pub fn from_matrices(g: Matrix, l: Matrix) -> Self {
        let t = g.len();
        let last = t.checked_sub(1);
        let diagonal = |m: &Matrix| mean((0..m.len()).filter_map(|k| at(m, k, k)));
        let stability = last.and_then(|last| mean((0..last).filter_map(|k| at(&g, last, k))));
        let plasticity = diagonal(&g);
        Self {
            final_accuracy: last.and_then(|last| row_mean(&g, last)),
            average_accuracy: mean((0..t).filter_map(|i| row_mean(&g, i))),
            forgetting: forgetting(&g),
            utility: match (stability, plasticity) {
                (Some(s), Some(p)) => Some(0.5 * s + 0.5 * p),
                (None, p) => p,
                _ => None,
            },
            stability,
            plasticity,
            kr_temporal: last.and_then(|last| {
                mean((0..last).filter_map(|k| Some(at(&g, last, k)? / at(&g, k, k).filter(|d| *d > 0.0)?)))
            }),
            kr_spatial: match (diagonal(&g), diagonal(&l)) {
                (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                _ => None,
            },
            local_final_accuracy: l.len().checked_sub(1).and_then(|last| row_mean(&l, last)),
            selected_final_accuracy: None,
            global_matrix: g,
            local_matrix: l,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_of_a_hand_made_matrix() {
        // After task 0: 0.9 on task 0. After task 1: 0.5 on task 0, 0.8 on task 1.
        let g = vec![vec![Some(0.9), None], vec![Some(0.5), Some(0.8)]];
        let l = vec![vec![Some(1.0), None], vec![Some(0.6), Some(1.0)]];
        let m = ContinualMetrics::from_matrices(g, l);
        let close = |a: Option<f64>, b: f64| assert!((a.unwrap() - b).abs() < 1e-12, "{a:?} vs {b}");
        close(m.final_accuracy, 0.65);
        close(m.average_accuracy, (0.9 + 0.65) / 2.0);
        close(m.forgetting, 0.4);
        close(m.stability, 0.5);
        close(m.plasticity, 0.85);
        close(m.utility, 0.675);
        close(m.kr_temporal, 0.5 / 0.9);
        close(m.kr_spatial, 0.85);
        close(m.local_final_accuracy, 0.8);
    }

    #[test]
    fn a_single_task_has_no_forgetting() {
        let m = ContinualMetrics::from_matrices(vec![vec![Some(0.7)]], vec![]);
        assert_eq!(m.forgetting, None);
        assert_eq!(m.final_accuracy, Some(0.7));
        assert_eq!(m.kr_temporal, None);
        assert_eq!(m.utility, Some(0.7));
    }
}
