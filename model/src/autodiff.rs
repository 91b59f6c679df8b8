//! Tensors with and without autodiff in one operation. Binary operations treat a plain tensor as
//! a constant beside a tracked one; a concatenation is lifted here so that its parts agree
//! (the plain parts become untracked autodiff tensors: constants of the graph).

use burn::tensor::Tensor;

/// `Tensor::cat` of parts that may mix autodiff and plain tensors.
pub fn cat_lifted<const D: usize>(parts: Vec<Tensor<D>>, dim: usize) -> Tensor<D> {
    if parts.iter().any(|t| t.is_autodiff()) && parts.iter().any(|t| !t.is_autodiff()) {
        Tensor::cat(parts.into_iter().map(Tensor::autodiff).collect(), dim)
    } else {
        Tensor::cat(parts, dim)
    }
}
