//! Query–key matching, shared by the input-enhancement pool (FedTA Eq. 2–3) and the tail anchors
//! (Eq. 4, 6): a query is a frozen-backbone feature, each pool entry has a learnable key, an
//! input takes the entries whose keys are most similar by cosine, and a key-pull term draws the
//! chosen keys towards their queries.

use burn::tensor::{Device, Tensor, TensorData};

use crate::ops::cosine_similarities;

/// Per row of a row-major `[rows, cols]` similarity matrix, the `n` columns of largest value,
/// best first (ties: the lower column). `n` is capped at `cols`; non-finite values rank last.
pub fn top_n(similarity: &[f32], cols: usize, n: usize) -> Vec<Vec<usize>> {
    if cols == 0 {
        return Vec::new();
    }
    let n = n.min(cols);
    similarity
        .chunks(cols)
        .map(|row| {
            let mut order: Vec<usize> = (0..row.len()).collect();
            let key = |v: f32| if v.is_finite() { v } else { f32::NEG_INFINITY };
            order.sort_by(|&a, &b| key(row[b]).total_cmp(&key(row[a])).then(a.cmp(&b)));
            order.truncate(n);
            order
        })
        .collect()
}

/// Which entries each query took.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// Per query, the chosen entries, best first.
    pub chosen: Vec<Vec<usize>>,
    /// Entries in the pool.
    pub pool: usize,
}

impl Selection {
    /// The chosen entries of `queries` `[n, d]` among `keys` `[m, d]`: the top `n_chosen` by cosine
    /// (the choice itself carries no gradient).
    pub fn by_cosine(queries: Tensor<2>, keys: Tensor<2>, n_chosen: usize) -> Self {
        let pool = keys.dims()[0];
        let sim = cosine_similarities(queries.inner(), keys.inner());
        let values: Vec<f32> = sim.into_data().convert::<f32>().try_to_vec::<f32>().unwrap_or_default();
        Self { chosen: top_n(&values, pool, n_chosen), pool }
    }

    /// The chosen entries as one flat index list `[n · k]` (row-major).
    pub fn flat(&self) -> Vec<usize> {
        self.chosen.iter().flatten().copied().collect()
    }

    /// How many distinct entries the queries took (a pool whose queries all take the same few
    /// entries has collapsed).
    pub fn distinct(&self) -> usize {
        let mut seen = vec![false; self.pool];
        self.chosen.iter().flatten().for_each(|&j| seen[j] = true);
        seen.iter().filter(|&&s| s).count()
    }

    /// Entries per query.
    pub fn per_query(&self) -> usize {
        self.chosen.first().map_or(0, Vec::len)
    }

    /// A `[n, pool]` mask: 1 where the query took the entry.
    pub fn mask(&self, device: &Device) -> Tensor<2> {
        let mut m = vec![0.0f32; self.chosen.len() * self.pool];
        for (i, row) in self.chosen.iter().enumerate() {
            for &j in row {
                m[i * self.pool + j] = 1.0;
            }
        }
        Tensor::from_data(TensorData::new(m, [self.chosen.len(), self.pool]), device)
    }
}

/// The key pull of Eq. 3 (IE) and Eq. 6 (anchors): the mean over queries of Σ over its chosen
/// keys of 1 − cos(query, key). Differentiable in the keys; the queries are constants.
pub fn key_pull(queries: Tensor<2>, keys: Tensor<2>, selection: &Selection) -> Tensor<1> {
    let n = selection.chosen.len().max(1);
    let device = keys.device();
    let distance = cosine_similarities(queries.inner(), keys).neg().add_scalar(1.0);
    (distance * selection.mask(&device)).sum().div_scalar(n as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(values: &[f32], shape: [usize; 2]) -> Tensor<2> {
        Tensor::from_data(TensorData::new(values.to_vec(), shape), &Device::flex())
    }

    #[test]
    fn top_n_takes_the_largest_best_first() {
        let sim = [0.1, 0.9, 0.5, f32::NAN, /* row 2 */ 0.3, 0.3, -1.0, 0.2];
        assert_eq!(top_n(&sim, 4, 2), vec![vec![1, 2], vec![0, 1]]);
        assert_eq!(top_n(&sim, 4, 9)[0], vec![1, 2, 0, 3], "capped at the pool; NaN last");
        assert!(top_n(&[], 0, 3).is_empty());
    }

    #[test]
    fn queries_take_their_nearest_keys() {
        // Keys along x, y and the diagonal; queries near y and near x.
        let keys = t(&[1.0, 0.0, 0.0, 1.0, 1.0, 1.0], [3, 2]);
        let queries = t(&[0.1, 2.0, 5.0, 0.2], [2, 2]);
        let s = Selection::by_cosine(queries.clone(), keys.clone(), 1);
        assert_eq!(s.chosen, vec![vec![1], vec![0]]);
        let two = Selection::by_cosine(queries.clone(), keys.clone(), 2);
        assert_eq!(two.chosen, vec![vec![1, 2], vec![0, 2]]);
        assert_eq!(two.flat(), vec![1, 2, 0, 2]);
        assert_eq!((s.distinct(), two.distinct()), (2, 3));
        // The pull is 1 − cos over the chosen keys, averaged over queries.
        let pull = key_pull(queries, keys, &s).into_scalar::<f32>();
        let c1 = 2.0 / (0.01f32 + 4.0).sqrt();
        let c2 = 5.0 / (25.0f32 + 0.04).sqrt();
        assert!((pull - ((1.0 - c1) + (1.0 - c2)) / 2.0).abs() < 1e-5, "{pull}");
    }
}
