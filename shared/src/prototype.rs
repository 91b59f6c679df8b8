//! Class prototypes: the mean feature of a class, with the number of samples behind it.
//!
//! The pure math on prototypes lives in [`crate::math`]; this module holds the wire type and the
//! count-weighted merge every prototype method builds on.

use alloc::vec::Vec;
use serde::{Deserialize, Serialize};

use crate::math;
use crate::tensor::{EncodedTensor, Encoding, TensorError};

/// Longest accepted prototype vector.
pub const MAX_PROTOTYPE_DIM: usize = 1 << 20;

/// One class prototype as it travels: class id, sample count and the encoded mean vector.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prototype {
    /// The class id.
    pub class: u32,
    /// Samples behind the mean.
    pub count: u64,
    /// The mean feature, one-dimensional.
    pub vector: EncodedTensor,
}

impl Prototype {
    /// Encodes a prototype vector.
    pub fn encode(class: u32, count: u64, vector: &[f32], encoding: Encoding) -> Self {
        Self { class, count, vector: EncodedTensor::encode(&[vector.len() as u32], vector, encoding) }
    }

    /// Checks that the vector is one-dimensional, bounded, well-formed and finite.
    pub fn validate(&self) -> Result<(), TensorError> {
        if self.vector.shape.len() != 1 || self.vector.shape[0] as usize > MAX_PROTOTYPE_DIM {
            return Err(TensorError::ShapeOverflow { shape: self.vector.shape.clone() });
        }
        if self.vector.encoding.as_dense().is_none() {
            return Err(TensorError::NotDense { encoding: self.vector.encoding.name() });
        }
        self.vector.validate()
    }

    /// Decodes the vector.
    pub fn values(&self) -> Result<Vec<f32>, TensorError> {
        self.vector.decode()
    }
}

/// Count-weighted mean of several prototypes of one class: Σ n_i·c_i / Σ n_i
/// (the fusion rule for new classes, FedProK Eq. 9 first case; GLDP Eq. 6 across clients).
/// Returns `None` when the total count is zero or the dimensions differ.
pub fn count_weighted_mean(parts: &[(&[f32], u64)]) -> Option<(Vec<f32>, u64)> {
    let total: u64 = parts.iter().map(|(_, n)| *n).sum();
    let weighted: Vec<(&[f32], f64)> = parts.iter().map(|(v, n)| (*v, *n as f64)).collect();
    math::weighted_mean(&weighted).map(|mean| (mean, total))
}
