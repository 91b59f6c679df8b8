//! Whole rounds: the unmasked aggregate is the plain sum of the contributors, with and without
//! dropouts, and a round short of shares fails with nothing output.

use std::collections::{BTreeMap, BTreeSet};

use super::{Harness, ids, pick};
use crate::{Params, Quantizer, Rounding, SecAggError, Stage};

/// n clients with f32 updates; `dropout` of them drop after masking. The u32 sum must equal the
/// plain sum of the survivors' quantised inputs exactly, and its dequantisation the f32 sum to
/// within the quantisation error.
fn quantised_round(n: u32, dropout: f64, seed: u64) {
    let params = Params::recommended(n as usize, dropout);
    let quantizer = Quantizer::new(4.0, n).unwrap();
    let updates: BTreeMap<_, Vec<f32>> = ids(n)
        .into_iter()
        .enumerate()
        .map(|(i, c)| (c, (0..48).map(|j| ((i * 31 + j * 17) % 97) as f32 / 12.0 - 4.0).collect()))
        .collect();
    let inputs = updates
        .iter()
        .map(|(&c, x)| (c, quantizer.quantize(x, Rounding::Stochastic { seed: seed + u64::from(c.0) })))
        .collect();
    let mut h = Harness::with_inputs(inputs, params, seed);
    let dropped = pick(n, (f64::from(n) * dropout).round() as usize, seed);
    let aggregate = h.run(&dropped, &BTreeSet::new()).unwrap_or_else(|e| panic!("n={n} dropout={dropout}: {e}"));
    assert_eq!(aggregate.sum, h.plain_sum(&dropped));
    assert_eq!(aggregate.contributors as usize, n as usize - dropped.len());
    let mean = quantizer.dequantize_sum(&aggregate.sum, aggregate.contributors).unwrap();
    for (j, got) in mean.iter().enumerate() {
        let want: f64 = updates.iter().filter(|(c, _)| !dropped.contains(c)).map(|(_, x)| f64::from(x[j])).sum();
        assert!((f64::from(*got) - want).abs() <= f64::from(n) * quantizer.step() + 1e-3, "{got} vs {want}");
    }
    assert!(h.server.held_vectors().is_empty());
    assert_eq!(h.server.stage(), Stage::Done);
}

#[test]
fn ten_clients_at_0_10_30_percent_dropout() {
    for dropout in [0.0, 0.1, 0.3] {
        quantised_round(10, dropout, 1);
    }
}

#[test]
fn fifty_clients_at_0_10_30_percent_dropout() {
    for dropout in [0.0, 0.1, 0.3] {
        quantised_round(50, dropout, 2);
    }
}

#[test]
fn hundred_clients_at_0_10_30_percent_dropout() {
    for dropout in [0.0, 0.1, 0.3] {
        quantised_round(100, dropout, 3);
    }
}

#[test]
fn a_sparse_graph_recovers_dropped_clients_and_silent_survivors() {
    let params = Params { degree: 16, threshold: 9 };
    let mut h = Harness::new(60, params, 300, 11);
    let dropped = pick(60, 4, 11);
    let silent: BTreeSet<_> = pick(60, 8, 12).difference(&dropped).copied().take(2).collect();
    let aggregate = h.run(&dropped, &silent).unwrap();
    assert_eq!(aggregate.sum, h.plain_sum(&dropped));
    assert_eq!(aggregate.contributors, 56);
}

#[test]
fn too_many_dropped_after_masking_fails_before_asking_for_any_share() {
    let mut h = Harness::new(30, Params::recommended(30, 0.1), 20, 5);
    let dropped = pick(30, 18, 5);
    h.stage(&BTreeSet::new());
    h.server.advance().unwrap();
    h.stage(&BTreeSet::new());
    h.server.advance().unwrap();
    h.stage(&dropped);
    let err = h.server.advance().unwrap_err();
    assert_eq!(err.reason(), "below_threshold", "{err}");
    assert_eq!(h.server.stage(), Stage::Failed);
    assert!(h.server.poll_transmit().is_none(), "no unmask request goes out");
    assert!(h.server.held_vectors().is_empty(), "the masked sum is wiped");
    assert!(matches!(h.server.advance(), Err(SecAggError::WrongStage { .. })));
}

#[test]
fn too_few_unmask_answers_fail_without_output() {
    let mut h = Harness::new(12, Params { degree: 6, threshold: 4 }, 10, 8);
    let silent = pick(12, 9, 8);
    let err = h.run(&BTreeSet::new(), &silent).unwrap_err();
    assert!(matches!(err, SecAggError::BelowThreshold { .. }), "{err}");
    assert_eq!(h.server.stage(), Stage::Failed);
    assert!(h.server.held_vectors().is_empty());
}

#[test]
fn dropouts_before_masking_are_left_out_of_the_graph() {
    let mut h = Harness::new(20, Params::recommended(20, 0.2), 16, 9);
    let early = pick(20, 2, 9);
    let late = pick(20, 4, 10).difference(&early).copied().take(1).collect::<BTreeSet<_>>();
    h.stage(&early);
    h.server.advance().unwrap();
    h.stage(&late);
    h.server.advance().unwrap();
    h.stage(&BTreeSet::new());
    h.server.advance().unwrap();
    h.stage(&BTreeSet::new());
    let crate::Advance::Done(aggregate) = h.server.advance().unwrap() else { panic!("round not done") };
    let absent: BTreeSet<_> = early.union(&late).copied().collect();
    assert_eq!(aggregate.sum, h.plain_sum(&absent));
    assert_eq!(aggregate.contributors, 17);
}

#[test]
fn one_vector_carries_quantised_sums_and_raw_counts() {
    let n = 12;
    let q = Quantizer::new(2.0, n).unwrap();
    let inputs = ids(n)
        .into_iter()
        .map(|c| {
            let mut v = q.quantize(&[0.5, -1.25, 1.0], Rounding::Nearest);
            v.extend([c.0 % 3, 1]);
            (c, v)
        })
        .collect();
    let mut h = Harness::with_inputs(inputs, Params::recommended(n as usize, 0.0), 4);
    let aggregate = h.run(&BTreeSet::new(), &BTreeSet::new()).unwrap();
    let sums = q.dequantize_sum(&aggregate.sum[..3], aggregate.contributors).unwrap();
    assert!((sums[0] - 6.0).abs() < 1e-3 && (sums[1] + 15.0).abs() < 1e-3 && (sums[2] - 12.0).abs() < 1e-3);
    assert_eq!(aggregate.sum[4], 12);
    assert_eq!(aggregate.sum[3], ids(n).iter().map(|c| c.0 % 3).sum::<u32>());
}
