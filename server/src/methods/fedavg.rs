//! FedAvg (McMahan et al. 2017, Algorithm 1): the sample-weighted mean of the shared blocks,
//! w_{t+1} = Σ_k n_k/n · w_{t+1}^k. FedProx and FedRep aggregate the same way (their difference
//! is on the client: a proximal term, a personal head that never travels).

use anchorage_shared::math::weighted_mean;
use anchorage_shared::protocol::Update;
use anchorage_shared::tensor::{Encoding, ParamBlock};

use super::{MethodError, RoundInfo, ServerMethod};

/// FedAvg's server half, under the name of the method it serves (`fedavg`, `fedprox`, `fedrep`).
#[derive(Debug, Clone)]
pub struct FedAvg {
    name: &'static str,
    /// Encoding of the next broadcast's blocks.
    pub encoding: Option<Encoding>,
}

impl Default for FedAvg {
    fn default() -> Self {
        Self::named("fedavg")
    }
}

impl FedAvg {
    pub fn named(name: &'static str) -> Self {
        Self { name, encoding: None }
    }
}

/// The sample-weighted mean of every block the updates carry (by name, in the first update's
/// order). Updates without blocks leave `global` as it is.
pub fn average_blocks(
    global: &[ParamBlock],
    updates: &[(&str, &Update)],
    encoding: Encoding,
) -> Result<Vec<ParamBlock>, MethodError> {
    let (_, first) = updates.first().ok_or(MethodError::Empty)?;
    if first.blocks.is_empty() {
        return Ok(global.to_vec());
    }
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

impl ServerMethod for FedAvg {
    fn name(&self) -> &'static str {
        self.name
    }

    fn aggregate(
        &mut self,
        _round: &RoundInfo,
        global: &[ParamBlock],
        updates: &[(&str, &Update)],
    ) -> Result<Vec<ParamBlock>, MethodError> {
        average_blocks(global, updates, self.encoding.unwrap_or(Encoding::F32))
    }
}

/// Local-only training: nothing is shared, the server only keeps the rounds going.
#[derive(Debug, Clone, Default)]
pub struct LocalOnly;

impl ServerMethod for LocalOnly {
    fn name(&self) -> &'static str {
        "local"
    }

    fn aggregate(
        &mut self,
        _round: &RoundInfo,
        global: &[ParamBlock],
        updates: &[(&str, &Update)],
    ) -> Result<Vec<ParamBlock>, MethodError> {
        if updates.is_empty() {
            return Err(MethodError::Empty);
        }
        Ok(global.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROUND: RoundInfo = RoundInfo { round: 1, task: 0, last_of_task: false };

    pub(crate) fn update(w: &[f32], n: u64) -> Update {
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
        let out = FedAvg::default().aggregate(&ROUND, &[], &[("a", &a), ("b", &b)]).unwrap();
        assert_eq!(out[0].decode().unwrap(), vec![3.0, 4.0]);
        assert_eq!(out[0].name, "head.weight");
    }

    #[test]
    fn empty_round_is_an_error() {
        assert!(matches!(FedAvg::default().aggregate(&ROUND, &[], &[]), Err(MethodError::Empty)));
    }

    #[test]
    fn local_only_keeps_the_global_model() {
        let global = update(&[1.0, 2.0], 1).blocks;
        let mut empty = update(&[], 5);
        empty.blocks.clear();
        let out = LocalOnly.aggregate(&ROUND, &global, &[("a", &empty)]).unwrap();
        assert_eq!(out, global);
    }

    #[test]
    fn a_block_missing_from_one_update_is_inconsistent() {
        let a = update(&[1.0], 1);
        let mut b = update(&[1.0], 1);
        b.blocks[0].name = "other".into();
        assert!(matches!(
            FedAvg::default().aggregate(&ROUND, &[], &[("a", &a), ("b", &b)]),
            Err(MethodError::Inconsistent(_))
        ));
    }
}
