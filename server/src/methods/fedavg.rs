//! FedAvg (McMahan et al. 2017, Algorithm 1): the sample-weighted mean of the shared blocks,
//! w_{t+1} = Σ_k n_k/n · w_{t+1}^k. FedProx and FedRep aggregate the same way (their difference
//! is on the client: a proximal term, a personal head that never travels).

use std::sync::OnceLock;

use anchorage_shared::math::{NonFinite, TILE, Values, WeightedMean, add_parts};
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
    if matches!(rule, AggregationRule::Mean) {
        let mut out = Vec::with_capacity(first.blocks.len());
        for block in &first.blocks {
            let n = blocks_len(block)?;
            let values = match mean_in_place(block, n, updates) {
                Some(values) => values,
                // Something is wrong with an update: the decoding path finds it and names it.
                None => mean_by_decoding(block, n, updates)?,
            };
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

/// Update `u`'s values of the first update's block `block`, decoded and checked.
fn block_of(u: &Update, block: &ParamBlock) -> Result<Vec<f32>, MethodError> {
    let b =
        u.blocks.iter().find(|b| b.name == block.name).ok_or_else(|| MethodError::Inconsistent(block.name.clone()))?;
    let values = b.decode()?;
    if values.len() != blocks_len(block)? {
        return Err(MethodError::Inconsistent(block.name.clone()));
    }
    Ok(values)
}

/// FedAvg's rule (the sample-weighted mean) of `block`, `n` values, over the updates: each
/// F32 block read in place (no decoded copy) and added tile by tile, in one pass over memory, on
/// several threads for a large block ([`add_in_pieces`]); a block in another encoding decoded,
/// one at a time, and added between the runs of F32 blocks around it. Every value's sum takes
/// the updates in their order, so the result is [`mean_by_decoding`]'s to the bit. `None` for
/// anything that refuses: the caller then takes that path, which names the error.
fn mean_in_place(block: &ParamBlock, n: usize, updates: &[(&str, &Update)]) -> Option<Vec<f32>> {
    let mut mean = WeightedMean::new(n);
    let mut run: Vec<(Values<'_>, f64)> = Vec::with_capacity(updates.len());
    for (_, u) in updates {
        let b = u.blocks.iter().find(|b| b.name == block.name)?;
        let (t, w) = (&b.tensor, u.num_samples as f64);
        if t.encoding == Encoding::F32 && t.len().ok() == Some(n) && n.checked_mul(4) == Some(t.data.len()) {
            run.push((Values::F32Le(&t.data), w));
            continue;
        }
        mean.add_all_with(&run, add_in_pieces)?;
        run.clear();
        let values = b.decode().ok()?;
        mean.add_all_with(&[(Values::F32(&values), w)], add_in_pieces)?;
    }
    mean.add_all_with(&run, add_in_pieces)?;
    mean.finish()
}

/// FedAvg's rule one update at a time, each decoded first: one decoded update in memory, not
/// all of them (100 updates of an MLP 784-256-10 held 81 MB at once). The errors' reference.
fn mean_by_decoding(block: &ParamBlock, n: usize, updates: &[(&str, &Update)]) -> Result<Vec<f32>, MethodError> {
    let mut mean = WeightedMean::new(n);
    for (_, u) in updates {
        mean.add(&block_of(u, block)?, u.num_samples as f64)
            .ok_or_else(|| MethodError::Inconsistent(block.name.clone()))?;
    }
    mean.finish().ok_or_else(|| MethodError::Inconsistent(block.name.clone()))
}

/// Value additions (values × parts) that repay a thread of [`add_in_pieces`]: about a third of
/// a millisecond's work, against some tens of microseconds to start and join one.
const ADDS_PER_THREAD: usize = 1 << 20;

/// Threads for adding `parts` parts of `values` values: one per core (cached
/// `available_parallelism`), fewer where there is too little work or too few tiles to go round.
fn threads_for(values: usize, parts: usize) -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    cores.min(values.saturating_mul(parts) / ADDS_PER_THREAD).min(values / TILE).max(1)
}

/// [`add_parts`] over all of `sums`, split into one contiguous piece (whole tiles) per thread of
/// [`threads_for`], the first piece on this thread. The pieces are disjoint and each value's sum
/// takes the parts in order, so the split changes no bit.
fn add_in_pieces(sums: &mut [f64], parts: &[(Values<'_>, f64)]) -> Result<(), NonFinite> {
    add_on_threads(sums, parts, threads_for(sums.len(), parts.len()))
}

/// [`add_in_pieces`] on `threads` threads.
fn add_on_threads(sums: &mut [f64], parts: &[(Values<'_>, f64)], threads: usize) -> Result<(), NonFinite> {
    if threads < 2 {
        return add_parts(sums, 0, parts);
    }
    let piece = sums.len().div_ceil(threads).next_multiple_of(TILE);
    let (own, rest) = sums.split_at_mut(piece.min(sums.len()));
    std::thread::scope(|scope| {
        let workers: Vec<_> = rest
            .chunks_mut(piece)
            .enumerate()
            .map(|(i, sums)| scope.spawn(move || add_parts(sums, (i + 1) * piece, parts)))
            .collect();
        let mine = add_parts(own, 0, parts);
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
            .fold(mine, Result::and)
    })
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
    use anchorage_shared::rng::Rng;

    use super::*;

    const ROUND: RoundInfo = RoundInfo { round: 1, task: 0, last_of_task: false, rule: AggregationRule::Mean };

    pub(crate) fn update(w: &[f32], n: u64) -> Update {
        Update {
            prototypes_are: Default::default(),
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

    fn random(n: usize, rng: &mut Rng) -> Vec<f32> {
        // Magnitudes from 1e-4 to 1e4, so that the sums round and their order shows.
        (0..n).map(|_| (rng.normal() * 10f64.powi(rng.below(9) as i32 - 4)) as f32).collect()
    }

    /// Updates of one block of `n` random values, `encodings[i]` for update i.
    fn updates(n: usize, encodings: &[Encoding], rng: &mut Rng) -> Vec<Update> {
        encodings
            .iter()
            .map(|&e| {
                let mut u = update(&[], 1 + rng.below(1000));
                u.blocks = vec![ParamBlock::encode("head.weight", &[n as u32], &random(n, rng), e)];
                u
            })
            .collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn named(updates: &[Update]) -> Vec<(&str, &Update)> {
        updates.iter().map(|u| ("c", u)).collect()
    }

    #[test]
    fn the_one_pass_mean_is_the_decoding_mean_to_the_bit() {
        let mut rng = Rng::new(35);
        for n in [1, 7, TILE - 1, TILE, TILE + 1, 3 * TILE + 5, 100_003] {
            let us = updates(n, &[Encoding::F32; 24], &mut rng);
            let block = &us[0].blocks[0];
            let reference = mean_by_decoding(block, n, &named(&us)).unwrap();
            assert_eq!(bits(&mean_in_place(block, n, &named(&us)).unwrap()), bits(&reference), "{n} values");
            let out = FedAvg::default().aggregate(&ROUND, &[], &named(&us)).unwrap();
            assert_eq!(bits(&out[0].decode().unwrap()), bits(&reference), "{n} values");
        }
    }

    #[test]
    fn any_split_among_threads_gives_the_same_sums() {
        let mut rng = Rng::new(4);
        for n in [1, TILE + 3, 5 * TILE + 1, 70_001] {
            let values: Vec<Vec<f32>> = (0..9).map(|_| random(n, &mut rng)).collect();
            let bytes: Vec<Vec<u8>> = values.iter().map(|v| v.iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
            let weights: Vec<f64> = (0..9).map(|_| 1.0 + rng.below(600) as f64).collect();
            // The sums as `WeightedMean::add` makes them, one update after the other.
            let mut reference = vec![0f64; n];
            for (v, w) in values.iter().zip(&weights) {
                reference.iter_mut().zip(v).for_each(|(a, x)| *a += w * (*x as f64));
            }
            let parts: Vec<(Values<'_>, f64)> =
                bytes.iter().zip(&weights).map(|(b, w)| (Values::F32Le(b), *w)).collect();
            for threads in [1, 2, 3, 8] {
                let mut split = vec![0f64; n];
                add_on_threads(&mut split, &parts, threads).unwrap();
                assert!(
                    split.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{n} values, {threads} threads"
                );
            }
        }
        assert_eq!(threads_for(1000, 1000), 1, "a small block stays on one thread");
    }

    #[test]
    fn mixed_encodings_average_as_decoded() {
        let mut rng = Rng::new(9);
        let zstd =
            Encoding::Zstd { inner: anchorage_shared::tensor::Packed::Dense(anchorage_shared::tensor::Dense::F32) };
        // F32 alone, in runs of two and of five (a group of four read in one sweep, and one).
        let (f32, f16, bf16, int8) = (Encoding::F32, Encoding::F16, Encoding::Bf16, Encoding::Int8 { scale: 0.0 });
        let encodings = [f32, f16, f32, f32, bf16, f32, f32, f32, f32, f32, int8, zstd, f32];
        for n in [5, 3 * TILE + 1, 200_001] {
            let us = updates(n, &encodings, &mut rng);
            let reference = mean_by_decoding(&us[0].blocks[0], n, &named(&us)).unwrap();
            let out = FedAvg::default().aggregate(&ROUND, &[], &named(&us)).unwrap();
            assert_eq!(bits(&out[0].decode().unwrap()), bits(&reference), "{n} values");
        }
    }

    #[test]
    fn a_non_finite_value_is_refused_as_before() {
        let mut rng = Rng::new(5);
        for (n, at) in [(3, 1), (3 * TILE + 1, 2 * TILE + 7), (100_003, 99_999)] {
            let mut us = updates(n, &[Encoding::F32; 24], &mut rng);
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                us[17].blocks[0].tensor.edit_data(|d| d[4 * at..4 * at + 4].copy_from_slice(&bad.to_le_bytes()));
                let err = FedAvg::default().aggregate(&ROUND, &[], &named(&us)).unwrap_err();
                let reference = mean_by_decoding(&us[0].blocks[0], n, &named(&us)).unwrap_err();
                assert_eq!(format!("{err:?}"), format!("{reference:?}"));
                assert!(matches!(err, MethodError::Tensor(_)), "{err:?}");
            }
        }
    }

    #[test]
    fn a_block_of_another_length_is_inconsistent() {
        let a = update(&[1.0, 2.0], 1);
        let b = update(&[1.0], 1);
        assert!(matches!(
            FedAvg::default().aggregate(&ROUND, &[], &[("a", &a), ("b", &b)]),
            Err(MethodError::Inconsistent(_))
        ));
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
