//! FedAvg (McMahan et al. 2017, Algorithm 1): the sample-weighted mean of the shared blocks,
//! w_{t+1} = Σ_k n_k/n · w_{t+1}^k. FedProx and FedRep aggregate the same way (their difference
//! is on the client: a proximal term, a personal head that never travels).

use anchorage_shared::method::{FedAvgConfig, LocalConfig, MethodParams};
use anchorage_shared::protocol::Update;
use anchorage_shared::tensor::{Encoding, ParamBlock};

use super::{MethodError, RoundInfo, ServerMethod};
use crate::aggregate::{AggregateError, AggregationRule};

/// FedAvg's server half, under the name of the method it serves (`fedavg`, `fedprox`, `fedrep`).
#[derive(Debug, Clone)]
pub struct FedAvg {
    name: &'static str,
    /// Encoding of the next broadcast's blocks.
    pub encoding: Option<Encoding>,
}

impl Default for FedAvg {
    fn default() -> Self {
        Self::named(FedAvgConfig::NAME)
    }
}

impl FedAvg {
    pub fn named(name: &'static str) -> Self {
        Self { name, encoding: None }
    }
}

/// Every block the updates carry (by name, in the first update's order), combined by `rule`
/// (the sample-weighted mean for [`AggregationRule::Mean`], FedAvg's rule; see
/// [`crate::aggregate`] for the robust ones). Updates without blocks leave `global` as it is.
/// The one place every method's shared blocks are averaged.
pub fn average_blocks(
    global: &[ParamBlock],
    updates: &[(&str, &Update)],
    encoding: Encoding,
    rule: &AggregationRule,
) -> Result<Vec<ParamBlock>, MethodError> {
    let (_, first) = updates.first().ok_or(MethodError::Empty)?;
    if first.blocks.is_empty() {
        return Ok(global.to_vec());
    }
    let block_of = |u: &Update, block: &ParamBlock| -> Result<Vec<f32>, MethodError> {
        let b = u
            .blocks
            .iter()
            .find(|b| b.name == block.name)
            .ok_or_else(|| MethodError::Inconsistent(block.name.clone()))?;
        let values = b.decode()?;
        if values.len() != blocks_len(block)? {
            return Err(MethodError::Inconsistent(block.name.clone()));
        }
        Ok(values)
    };
    if matches!(rule, AggregationRule::Mean) {
        // FedAvg's rule one update at a time: one decoded update in memory, not all of them
        // (100 updates of an MLP 784-256-10 held 81 MB at once).
        let mut out = Vec::with_capacity(first.blocks.len());
        for block in &first.blocks {
            let mut mean = anchorage_shared::math::WeightedMean::new(blocks_len(block)?);
            for (_, u) in updates {
                mean.add(&block_of(u, block)?, u.num_samples as f64)
                    .ok_or_else(|| MethodError::Inconsistent(block.name.clone()))?;
            }
            let values = mean.finish().ok_or_else(|| MethodError::Inconsistent(block.name.clone()))?;
            out.push(ParamBlock::encode(block.name.clone(), &block.tensor.shape, &values, encoding));
        }
        return Ok(out);
    }
    // decoded[i][b]: update i's values of the first update's block b (the robust rules compare
    // updates with each other).
    let mut decoded: Vec<Vec<Vec<f32>>> = Vec::with_capacity(updates.len());
    for (_, u) in updates {
        let mut blocks = Vec::with_capacity(first.blocks.len());
        for block in &first.blocks {
            blocks.push(block_of(u, block)?);
        }
        decoded.push(blocks);
    }
    let parts: Vec<(Vec<&[f32]>, f64)> = decoded
        .iter()
        .zip(updates)
        .map(|(blocks, (_, u))| (blocks.iter().map(Vec::as_slice).collect(), u.num_samples as f64))
        .collect();
    let combined = rule.combine(&parts).map_err(|e| match e {
        AggregateError::Inconsistent | AggregateError::BadWeights => {
            MethodError::Inconsistent(first.blocks.iter().map(|b| b.name.as_str()).collect::<Vec<_>>().join(", "))
        }
        e => MethodError::Aggregate(e),
    })?;
    Ok(first
        .blocks
        .iter()
        .zip(combined)
        .map(|(block, values)| ParamBlock::encode(block.name.clone(), &block.tensor.shape, &values, encoding))
        .collect())
}

/// Number of values a block's shape holds.
fn blocks_len(block: &ParamBlock) -> Result<usize, MethodError> {
    Ok(block.tensor.len()?)
}

impl ServerMethod for FedAvg {
    fn name(&self) -> &'static str {
        self.name
    }

    fn aggregate(
        &mut self,
        round: &RoundInfo,
        global: &[ParamBlock],
        updates: &[(&str, &Update)],
    ) -> Result<Vec<ParamBlock>, MethodError> {
        average_blocks(global, updates, self.encoding.unwrap_or(Encoding::F32), &round.rule)
    }
}

/// Local-only training: nothing is shared, the server only keeps the rounds going.
#[derive(Debug, Clone, Default)]
pub struct LocalOnly;

impl ServerMethod for LocalOnly {
    fn name(&self) -> &'static str {
        LocalConfig::NAME
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

    const ROUND: RoundInfo = RoundInfo { round: 1, task: 0, last_of_task: false, rule: AggregationRule::Mean };

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
