//! How far apart a representation puts the classes: Fisher's criterion tr(S_B) / tr(S_W), the
//! between-class scatter over the within-class scatter (Fisher 1936; the trace form of
//! Fukunaga's J). A representation probe: the prototype methods claim their losses
//! shape µ(x) itself, not only the prediction rule, and this measures it on test data apart
//! from any classifier. The ratio is scale-free, so a loss that merely shrinks distances (L_GP
//! pulling class means together) does not count as separation.
//!
//! The sums run on the host in f64 (a test set of 10,000 × 64 values is small); the
//! representation is computed batch by batch on the cache's device.

use burn::tensor::Tensor;

use crate::FeatureCache;

/// tr(S_B) / tr(S_W) of `represent`'s output on `test`: S_B = Σ_c n_c ‖m_c − m‖², S_W = Σ_i ‖z_i −
/// m_{y_i}‖² (m_c the class means, m the overall mean). `None` with fewer than two classes or no
/// spread within the classes.
pub fn fisher_ratio(test: &FeatureCache, batch_size: usize, represent: impl Fn(Tensor<2>) -> Tensor<2>) -> Option<f64> {
    let n = test.len();
    let batch = batch_size.max(1);
    let mut rows: Vec<Vec<f64>> = Vec::with_capacity(n);
    for start in (0..n).step_by(batch) {
        let z = represent(test.slice(start..(start + batch).min(n)));
        let [b, d] = z.dims();
        let values = z.into_data().convert::<f32>().try_to_vec::<f32>().ok()?;
        rows.extend((0..b).map(|i| values[i * d..(i + 1) * d].iter().map(|v| *v as f64).collect()));
    }
    fisher_ratio_of(&rows, &test.labels_host)
}

/// [`fisher_ratio`] on host rows and their labels.
pub fn fisher_ratio_of(rows: &[Vec<f64>], labels: &[u32]) -> Option<f64> {
    let d = rows.first()?.len();
    let classes = labels.iter().max().map_or(0, |m| *m as usize + 1);
    let mut sums = vec![vec![0.0; d]; classes];
    let mut counts = vec![0usize; classes];
    for (row, &y) in rows.iter().zip(labels) {
        counts[y as usize] += 1;
        sums[y as usize].iter_mut().zip(row).for_each(|(s, v)| *s += v);
    }
    let present: Vec<usize> = (0..classes).filter(|c| counts[*c] > 0).collect();
    if present.len() < 2 {
        return None;
    }
    let means: Vec<Vec<f64>> =
        (0..classes).map(|c| sums[c].iter().map(|s| s / counts[c].max(1) as f64).collect()).collect();
    let total = rows.len() as f64;
    let overall: Vec<f64> = (0..d).map(|j| present.iter().map(|c| sums[*c][j]).sum::<f64>() / total).collect();
    let squared = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>();
    let between: f64 = present.iter().map(|c| counts[*c] as f64 * squared(&means[*c], &overall)).sum();
    let within: f64 = rows.iter().zip(labels).map(|(row, &y)| squared(row, &means[y as usize])).sum();
    (within > 0.0 && between.is_finite()).then(|| between / within)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ratio_grows_as_classes_move_apart_and_ignores_scale() {
        // Two classes, each a ±1 spread around its centre, centres 2a apart.
        let data = |a: f64, scale: f64| -> (Vec<Vec<f64>>, Vec<u32>) {
            let rows = [[-a - 1.0], [-a + 1.0], [a - 1.0], [a + 1.0]];
            (rows.iter().map(|r| vec![r[0] * scale]).collect(), vec![0, 0, 1, 1])
        };
        let (rows, labels) = data(3.0, 1.0);
        // Between: 4 · 3² = 36; within: 4 · 1 = 4.
        assert!((fisher_ratio_of(&rows, &labels).unwrap() - 9.0).abs() < 1e-12);
        let (far, _) = data(6.0, 1.0);
        assert!(fisher_ratio_of(&far, &labels).unwrap() > 30.0);
        let (scaled, _) = data(3.0, 0.01);
        assert!((fisher_ratio_of(&scaled, &labels).unwrap() - 9.0).abs() < 1e-9, "scale-free");
        assert_eq!(fisher_ratio_of(&rows, &[0, 0, 0, 0]), None, "one class");
        assert_eq!(fisher_ratio_of(&[vec![1.0], vec![1.0], vec![2.0]], &[0, 0, 1]), None, "no spread within");
    }

    #[test]
    fn the_tensor_path_agrees_with_the_host_sums() {
        let device = burn::tensor::Device::flex();
        let values = [0.0f32, 1.0, 0.5, 1.5, 4.0, -1.0, 5.0, -2.0, 4.5, -1.5];
        let features = Tensor::<2>::from_data(burn::tensor::TensorData::new(values.to_vec(), [5, 2]), &device);
        let labels = [0u32, 0, 1, 1, 1];
        let cache = FeatureCache::from_parts(features, &labels, &device);
        let rows: Vec<Vec<f64>> = values.chunks(2).map(|r| r.iter().map(|v| *v as f64).collect()).collect();
        let host = fisher_ratio_of(&rows, &labels).unwrap();
        for batch in [1, 2, 5] {
            let through = fisher_ratio(&cache, batch, |z| z).unwrap();
            assert!((through - host).abs() < 1e-6, "batch {batch}: {through} vs {host}");
        }
    }
}
