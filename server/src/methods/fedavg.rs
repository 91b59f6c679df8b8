//! FedAvg (McMahan et al. 2017, Algorithm 1): the sample-weighted mean of the shared blocks,
//! w_{t+1} = Σ_k n_k/n · w_{t+1}^k.

use anchorage_shared::math::weighted_mean;
use anchorage_shared::protocol::Update;
use anchorage_shared::tensor::{Encoding, ParamBlock};

use super::{MethodError, ServerMethod};

/// FedAvg's server half.
#[derive(Debug, Clone, Default)]
pub struct FedAvg {
    /// Encoding of the next broadcast's blocks.
    pub encoding: Option<Encoding>,
}

impl ServerMethod for FedAvg {
    fn name(&self) -> &'static str {
        "fedavg"
    }

    fn aggregate(
        &mut self,
        _global: &[ParamBlock],
        updates: &[(&str, &Update)],
    ) -> Result<Vec<ParamBlock>, MethodError> {
        let (_, first) = updates.first().ok_or(MethodError::Empty)?;
        let encoding = self.encoding.unwrap_or(Encoding::F32);
        let mut out = Vec::with_capacity(first.blocks.len());
        for block in &first.blocks {
            let mut decoded = Vec::with_capacity(updates.len());
            for (_, u) in updates {
                let b = u
                    .blocks
                    .iter()
                    .find(|b| b.name == block.name)
                    .ok_or_else(|| MethodError::Inconsistent(block.name.clone()))?;
                decoded.push((b.decode()?, u.num_samples as f64));
            }
            let parts: Vec<(&[f32], f64)> = decoded.iter().map(|(v, w)| (v.as_slice(), *w)).collect();
            let mean = weighted_mean(&parts).ok_or_else(|| MethodError::Inconsistent(block.name.clone()))?;
            out.push(ParamBlock::encode(block.name.clone(), &block.tensor.shape, &mean, encoding));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(w: &[f32], n: u64) -> Update {
        Update {
            round: 1,
            num_samples: n,
            blocks: vec![ParamBlock::encode("head.weight", &[w.len() as u32], w, Encoding::F32)],
            prototypes: vec![],
            metrics: vec![],
            compute_seconds: 0.0,
        }
    }

    #[test]
    fn weights_by_sample_count() {
        let (a, b) = (update(&[0.0, 10.0], 1), update(&[4.0, 2.0], 3));
        let out = FedAvg::default().aggregate(&[], &[("a", &a), ("b", &b)]).unwrap();
        assert_eq!(out[0].decode().unwrap(), vec![3.0, 4.0]);
        assert_eq!(out[0].name, "head.weight");
    }

    #[test]
    fn empty_round_is_an_error() {
        assert!(matches!(FedAvg::default().aggregate(&[], &[]), Err(MethodError::Empty)));
    }
}
