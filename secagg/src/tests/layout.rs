//! Updates as one vector: encode, sum, decode gives the mean delta and the pooled prototypes to
//! within the quantisers' steps, counts exactly; clipping and capping hold; misfits are refused.

use std::collections::{BTreeMap, BTreeSet};

use anchorage_shared::protocol::Update;
use anchorage_shared::prototype::Prototype;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use chacha20::ChaCha20Rng;
use chacha20::rand_core::{Rng, SeedableRng};

use super::{Harness, ids};
use crate::{ClientId, Layout, Params, Quantizer, RoundConfig, SecAggError as E, ServerFrame, ServerMessage};

const DEVICES: usize = 5;

fn layout() -> Layout {
    Layout {
        blocks: vec![("adapter.weight".into(), vec![2, 3]), ("head.bias".into(), vec![4])],
        classes: 4,
        dim: 5,
        clip: 1.0,
        prototype_clip: 2.0,
        max_count: 1000,
        max_clients: 1 << 12,
        weight_scale: 0.0,
    }
}

fn global() -> Vec<ParamBlock> {
    vec![
        ParamBlock::encode("adapter.weight", &[2, 3], &[0.5, -1.0, 2.0, 0.0, 0.25, -0.75], Encoding::F32),
        ParamBlock::encode("head.bias", &[4], &[1.0, 2.0, -3.0, 0.125], Encoding::F32),
    ]
}

fn values(blocks: &[ParamBlock]) -> Vec<f64> {
    blocks.iter().flat_map(|b| b.decode().unwrap()).map(f64::from).collect()
}

/// Device `i`'s delta (norm below the clip) and its prototypes: classes 0..3 but not `i % 3`
/// (class 3 never), count `3 + i + class`, a mean of norm below `prototype_clip`.
fn device(i: usize) -> (Vec<f64>, Update) {
    let delta: Vec<f64> = (0..10).map(|j| ((i * 7 + j * 3) % 13) as f64 / 60.0 - 0.1).collect();
    let global = values(&global());
    let new: Vec<f32> = global.iter().zip(&delta).map(|(g, d)| (g + d) as f32).collect();
    let blocks = vec![
        ParamBlock::encode("adapter.weight", &[2, 3], &new[..6], Encoding::F32),
        ParamBlock::encode("head.bias", &[4], &new[6..], Encoding::F32),
    ];
    let prototypes = (0..3u32)
        .filter(|&c| c as usize != i % 3)
        .map(|c| Prototype::encode(c, (3 + i) as u64 + u64::from(c), &mean(i, c), Encoding::F32))
        .collect();
    let delta = global.iter().zip(&new).map(|(g, n)| f64::from(*n) - g).collect();
    (
        delta,
        Update {
            prototypes_are: Default::default(),
            round: 3,
            num_samples: 10,
            blocks,
            prototypes,
            metrics: vec![],
            compute_seconds: 1.5,
        },
    )
}

fn mean(i: usize, class: u32) -> Vec<f32> {
    (0..5).map(|j| ((i * 7 + class as usize * 3 + j) % 11) as f32 / 20.0 - 0.25).collect()
}

fn wrapping_sum(vectors: &[Vec<u32>]) -> Vec<u32> {
    let mut sum = vec![0u32; vectors[0].len()];
    vectors.iter().for_each(|v| crate::mask::add_into(&mut sum, v));
    sum
}

fn steps(l: &Layout) -> (f64, f64) {
    let delta = Quantizer::new(l.clip, l.max_clients).unwrap().step();
    let sums = Quantizer::new(l.max_count as f32 * l.prototype_clip, l.max_clients).unwrap().step();
    (delta, sums)
}

/// Checks `got` against the mean of the devices' deltas and their pooled prototypes.
fn assert_mean(got: &Update, devices: &[(Vec<f64>, Update)]) {
    let l = layout();
    let (delta_step, sums_step) = steps(&l);
    let n = devices.len() as f64;
    // Each device's value is off by at most half a step: so is the mean; f32 rounding on top.
    let tol = delta_step / 2.0 + 1e-6;
    for (j, (g, x)) in values(&global()).iter().zip(values(&got.blocks)).enumerate() {
        let want = g + devices.iter().map(|(d, _)| d[j]).sum::<f64>() / n;
        assert!((x - want).abs() <= tol, "element {j}: {x} vs {want} (tolerance {tol})");
    }
    assert_eq!(got.blocks.iter().map(|b| (b.name.clone(), b.tensor.shape.clone())).collect::<Vec<_>>(), l.blocks);
    assert_eq!(got.prototypes.iter().map(|p| p.class).collect::<Vec<_>>(), vec![0, 1, 2], "class 3 had no samples");
    for p in &got.prototypes {
        let parts: Vec<&Prototype> =
            devices.iter().flat_map(|(_, u)| &u.prototypes).filter(|q| q.class == p.class).collect();
        let count: u64 = parts.iter().map(|q| q.count).sum();
        assert_eq!(p.count, count);
        // A class sum is off by at most n half-steps; its mean by that over the count.
        let tol = n * sums_step / 2.0 / count as f64 + 1e-5;
        for (j, x) in p.values().unwrap().iter().enumerate() {
            let want =
                parts.iter().map(|q| f64::from(q.values().unwrap()[j]) * q.count as f64).sum::<f64>() / count as f64;
            assert!((f64::from(*x) - want).abs() <= tol, "class {} [{j}]: {x} vs {want} (tolerance {tol})", p.class);
        }
    }
}

#[test]
fn five_devices_sum_to_the_mean_delta_and_the_pooled_prototypes() {
    let l = layout();
    l.check().unwrap();
    assert_eq!(l.vector_len(), 10 + 4 * 5 + 4 + 1, "delta, sums, counts, weight");
    let devices: Vec<_> = (0..DEVICES).map(device).collect();
    let vectors: Vec<Vec<u32>> = devices.iter().map(|(_, u)| l.encode(u, &global(), false).unwrap()).collect();
    assert!(vectors.iter().all(|v| v.len() == l.vector_len()));
    let got = l.decode(&wrapping_sum(&vectors), DEVICES as u32, &global(), 9).unwrap();
    assert_eq!((got.round, got.num_samples, got.metrics.len(), got.compute_seconds), (9, 5, 0, 0.0));
    assert_mean(&got, &devices);
}

#[test]
fn prototypes_sent_as_sums_decode_as_the_same_means() {
    let l = layout();
    let devices: Vec<_> = (0..DEVICES).map(device).collect();
    let as_sums: Vec<Vec<u32>> = devices
        .iter()
        .map(|(_, u)| {
            let mut u = u.clone();
            for p in &mut u.prototypes {
                let sum: Vec<f32> = p.values().unwrap().iter().map(|v| v * p.count as f32).collect();
                *p = Prototype::encode(p.class, p.count, &sum, Encoding::F32);
            }
            l.encode(&u, &global(), true).unwrap()
        })
        .collect();
    assert_mean(&l.decode(&wrapping_sum(&as_sums), DEVICES as u32, &global(), 9).unwrap(), &devices);
}

#[test]
fn a_secagg_round_over_layout_vectors_outputs_their_sum() {
    let l = layout();
    let devices: Vec<_> = (0..DEVICES).map(device).collect();
    let inputs: BTreeMap<ClientId, Vec<u32>> = ids(DEVICES as u32)
        .into_iter()
        .zip(&devices)
        .map(|(c, (_, u))| (c, l.encode(u, &global(), false).unwrap()))
        .collect();
    let mut h = Harness::with_inputs(inputs, Params::recommended(DEVICES, 0.0), 41);
    let aggregate = h.run(&BTreeSet::new(), &BTreeSet::new()).unwrap();
    assert_eq!(aggregate.sum, h.plain_sum(&BTreeSet::new()));
    assert_mean(&l.decode(&aggregate.sum, aggregate.contributors, &global(), 9).unwrap(), &devices);
}

/// One device's update decoded alone: its clipped delta and prototypes.
fn alone(l: &Layout, update: &Update) -> Update {
    l.decode(&l.encode(update, &global(), false).unwrap(), 1, &global(), 0).unwrap()
}

#[test]
fn a_huge_delta_is_clipped_to_the_norm_bound() {
    let l = layout();
    let (mut update, delta_step) = (device(0).1, steps(&l).0);
    update.blocks = global()
        .iter()
        .map(|b| {
            let v: Vec<f32> = b.decode().unwrap().iter().map(|x| x + 1000.0).collect();
            ParamBlock::encode(b.name.clone(), &b.tensor.shape, &v, Encoding::F32)
        })
        .collect();
    let got = alone(&l, &update);
    let delta: Vec<f64> = values(&got.blocks).iter().zip(values(&global())).map(|(x, g)| x - g).collect();
    let norm = delta.iter().map(|d| d * d).sum::<f64>().sqrt();
    assert!((norm - f64::from(l.clip)).abs() <= 10f64.sqrt() * (delta_step + 1e-6), "norm {norm}");
    let each = f64::from(l.clip) / 10f64.sqrt();
    assert!(delta.iter().all(|d| (d - each).abs() <= delta_step + 1e-6), "the direction is kept: {delta:?}");
}

#[test]
fn prototype_sums_are_clipped_and_counts_capped() {
    let l = layout();
    let sums_step = steps(&l).1;
    let mut update = device(0).1;
    update.prototypes = vec![
        Prototype::encode(0, 3, &[10.0; 5], Encoding::F32),
        Prototype::encode(1, 5000, &[0.1, 0.2, 0.3, 0.4, 0.5], Encoding::F32),
        Prototype::encode(2, 0, &[1.0; 5], Encoding::F32),
    ];
    let got = alone(&l, &update);
    assert_eq!(got.prototypes.iter().map(|p| (p.class, p.count)).collect::<Vec<_>>(), vec![(0, 3), (1, 1000)]);
    let clipped = got.prototypes[0].values().unwrap();
    let norm = clipped.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    assert!((norm - f64::from(l.prototype_clip)).abs() <= sums_step, "mean norm {norm} (sum clipped to 3 · 2)");
    let capped = got.prototypes[1].values().unwrap();
    let want = [0.1, 0.2, 0.3, 0.4, 0.5];
    assert!(capped.iter().zip(want).all(|(x, w)| f64::from(x - w).abs() <= sums_step / 1000.0 + 1e-6), "{capped:?}");
}

#[test]
fn non_finite_values_count_as_no_change() {
    let l = layout();
    let mut update = device(1).1;
    let mut v = update.blocks[1].decode().unwrap();
    v[2] = f32::NAN;
    update.blocks[1] = ParamBlock::encode("head.bias", &[4], &v, Encoding::F32);
    update.prototypes = vec![Prototype::encode(0, 2, &[f32::NAN, 0.5, 0.0, 0.0, 0.0], Encoding::F32)];
    let got = alone(&l, &update);
    let head = got.blocks[1].decode().unwrap();
    assert!((head[2] + 3.0).abs() < 1e-5, "the NaN element keeps the global value: {head:?}");
    let p = got.prototypes[0].values().unwrap();
    assert!(p[0].abs() < 1e-2 && (p[1] - 0.5).abs() < 1e-2, "{p:?}");
}

#[test]
fn updates_that_do_not_fit_the_layout_are_refused() {
    let l = layout();
    let base = device(2).1;
    let refused = |f: &dyn Fn(&mut Update)| {
        let mut u = base.clone();
        f(&mut u);
        l.encode(&u, &global(), false).unwrap_err()
    };
    let missing = refused(&|u| {
        u.blocks.pop();
    });
    assert!(matches!(missing, E::WrongLength { what: "update blocks", expected: 2, got: 1 }), "{missing}");
    assert_eq!(refused(&|u| u.blocks[0].name = "other".into()).reason(), "bad_update");
    assert_eq!(refused(&|u| u.blocks[1] = u.blocks[0].clone()).reason(), "bad_update", "a block twice");
    let reshaped = |u: &mut Update| {
        let v = u.blocks[0].decode().unwrap();
        u.blocks[0] = ParamBlock::encode("adapter.weight", &[3, 2], &v, Encoding::F32);
    };
    assert_eq!(refused(&reshaped).reason(), "bad_update");
    let class = |c| move |u: &mut Update| u.prototypes.push(Prototype::encode(c, 1, &[0.0; 5], Encoding::F32));
    assert_eq!(refused(&class(4)).reason(), "bad_update", "class out of range");
    assert_eq!(refused(&class(base.prototypes[0].class)).reason(), "bad_update", "a class twice");
    let short = refused(&|u| u.prototypes[0] = Prototype::encode(1, 1, &[0.0; 4], Encoding::F32));
    assert!(matches!(short, E::WrongLength { what: "prototype vector", expected: 5, got: 4 }), "{short}");
    let mut global = global();
    global[1].tensor.shape = vec![2, 2];
    assert_eq!(l.encode(&base, &global, false).unwrap_err().reason(), "bad_update", "the global model misfits too");
}

#[test]
fn bad_sums_and_layouts_are_refused() {
    let l = layout();
    let good = vec![0u32; l.vector_len()];
    assert!(matches!(l.decode(&good[1..], 1, &global(), 0), Err(E::WrongLength { .. })));
    assert!(matches!(l.decode(&good, 0, &global(), 0), Err(E::BadParams(_))));
    assert!(matches!(l.decode(&good, l.max_clients + 1, &global(), 0), Err(E::BadParams(_))));
    let bad = |f: &dyn Fn(&mut Layout)| {
        let mut l = layout();
        f(&mut l);
        matches!(l.check(), Err(E::BadParams(_)))
    };
    assert!(bad(&|l| l.max_count = u32::MAX / l.max_clients + 1), "counts could wrap");
    assert!(bad(&|l| l.clip = 0.0) && bad(&|l| l.clip = f32::NAN) && bad(&|l| l.clip = f32::INFINITY));
    assert!(bad(&|l| l.prototype_clip = -1.0) && bad(&|l| l.prototype_clip = f32::NAN));
    assert!(bad(&|l| l.max_clients = 0) && bad(&|l| l.max_count = 0));
    assert!(bad(&|l| l.blocks.push(("huge".into(), vec![u32::MAX, 2]))), "a vector past 2^32 - 1");
    assert!(bad(&|l| l.blocks.push(("head.bias".into(), vec![1]))), "a block name twice");
    let no_prototypes = Layout { classes: 0, dim: 0, prototype_clip: 0.0, max_count: 0, ..layout() };
    assert_eq!((no_prototypes.check(), no_prototypes.vector_len()), (Ok(()), 11));
    assert!(bad(&|l| l.weight_scale = -1.0) && bad(&|l| l.weight_scale = f32::NAN));
}

#[test]
fn server_frames_round_trip_and_garbage_is_refused() {
    let config = RoundConfig {
        round: 4,
        clients: ids(3),
        params: Params { degree: 2, threshold: 2 },
        graph_seed: [7; 32],
        vector_len: layout().vector_len() as u32,
    };
    let setup = ServerFrame { layout: Some(layout()), you: Some(ClientId(3)), message: ServerMessage::Setup(config) };
    let unmask = ServerFrame {
        layout: None,
        you: None,
        message: ServerMessage::Unmask { round: 4, survivors: vec![ClientId(1)], dropped: vec![] },
    };
    for frame in [setup, unmask] {
        let bytes = frame.encode();
        assert_eq!(ServerFrame::decode(&bytes).unwrap(), frame);
        for cut in 0..bytes.len() {
            assert!(matches!(ServerFrame::decode(&bytes[..cut]), Err(E::Decode(_))), "a frame cut at {cut}");
        }
    }
    assert!(matches!(ServerFrame::decode(&[0xff; 9]), Err(E::Decode(_))));
    let mut rng = ChaCha20Rng::seed_from_u64(5);
    for len in 0..300 {
        let mut garbage = vec![0u8; len];
        rng.fill_bytes(&mut garbage);
        let _ = ServerFrame::decode(&garbage);
    }
}

#[test]
fn a_weight_scale_gives_the_sample_weighted_mean_with_each_voice_capped() {
    let l = Layout { classes: 0, dim: 0, weight_scale: 100.0, ..layout() };
    let g = global();
    // Three devices of 10, 50 and 400 samples (the last capped at 100), each moving one value.
    let moved = |by: f32, n: u64| {
        let mut blocks = g.clone();
        let mut v = blocks[1].decode().unwrap();
        v[0] += by;
        blocks[1] = ParamBlock::encode("head.bias", &[4], &v, Encoding::F32);
        Update {
            prototypes_are: Default::default(),
            round: 1,
            num_samples: n,
            blocks,
            prototypes: vec![],
            metrics: vec![],
            compute_seconds: 0.0,
        }
    };
    let updates = [moved(0.3, 10), moved(-0.1, 50), moved(0.2, 400)];
    let mut sum = vec![0u32; l.vector_len()];
    for u in &updates {
        for (s, x) in sum.iter_mut().zip(l.encode(u, &g, false).unwrap()) {
            *s = s.wrapping_add(x);
        }
    }
    let out = l.decode(&sum, 3, &g, 1).unwrap();
    let want = (0.3 * 0.1 - 0.1 * 0.5 + 0.2 * 1.0) / (0.1 + 0.5 + 1.0);
    let got = out.blocks[1].decode().unwrap()[0] - 1.0;
    assert!((f64::from(got) - want).abs() < 1e-5, "{got} vs {want}");
    assert_eq!(out.num_samples, 160, "Σ w · weight_scale");
}
