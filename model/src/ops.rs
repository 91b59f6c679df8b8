//! Tensor helpers the models and the methods share: distances between rows and host indices.

use burn::tensor::{Device, Int, Tensor, TensorData};

/// ‖a_i − b_j‖² `[n, c]` for `a` `[n, d]`, `b` `[c, d]`.
pub fn squared_distances(a: Tensor<2>, b: Tensor<2>) -> Tensor<2> {
    let aa = a.clone().powi_scalar(2).sum_dim(1);
    let bb = b.clone().powi_scalar(2).sum_dim(1).transpose();
    (aa + bb - a.matmul(b.transpose()).mul_scalar(2.0)).clamp_min(0.0)
}

/// cos(a_i, b_j) `[n, c]`.
pub fn cosine_similarities(a: Tensor<2>, b: Tensor<2>) -> Tensor<2> {
    let na = a.clone().powi_scalar(2).sum_dim(1).sqrt().clamp_min(1e-8);
    let nb = b.clone().powi_scalar(2).sum_dim(1).sqrt().clamp_min(1e-8);
    (a / na).matmul((b / nb).transpose())
}

/// Index tensor `[n]` from host indices.
pub fn index_tensor(indices: &[usize], device: &Device) -> Tensor<1, Int> {
    Tensor::from_data(TensorData::new(indices.iter().map(|&i| i as i64).collect::<Vec<_>>(), [indices.len()]), device)
}

/// `logits` with the train mask added, unchanged without one (FedTA's cross-entropy over the
/// current task's classes only).
pub fn masked(logits: Tensor<2>, mask: Option<&Tensor<2>>) -> Tensor<2> {
    match mask {
        Some(m) => logits + m.clone(),
        None => logits,
    }
}
