//! `anchorage microbench`: the two kernels the peer benchmark (`benches/peers/`) sets against
//! PyTorch and the machine.
//!
//! - **step**: one local training step as the FedAvg client takes it (`train::Trainer::step`:
//!   forward, cross-entropy, backward, Adam, the loss read back) on the MLP 784-256-10, batch 32,
//!   on the flex CPU backend; and the machine's f32 matmul rate measured with the same backend
//!   (a 1024³ product), so that the step's arithmetic can be put as a fraction of it; the same at
//!   batch 256, and at both batches the step's five matrix products alone
//!   (no autodiff, no optimiser), which is what the step would cost at the products' own rate. Threads
//!   follow `RAYON_NUM_THREADS` (burn's gemm parallelises products of ≥ 192³ only, so a batch-32
//!   step runs on one thread whatever it says).
//! - **parallel**: independent trainings on 1 and on 2 threads of one process (each thread its
//!   own model, optimiser and batches, as two simulated devices): steps per second in all, and
//!   the speed-up. It measures what burn-autodiff's locks leave of a second core (each
//!   graph has its own lock since burn 0.19, and one process-wide lock is taken per recorded op).
//! - **aggregate**: the server's FedAvg (`methods::average_blocks`: each update's f32 block read
//!   in place and added in f64, tile by tile, on every core; encode) of 100 updates of 1 MB,
//!   decoding the blocks alone (which the server skips), and the core weighted mean alone, against a
//!   STREAM-like copy (`dst.copy_from_slice(src)` over 256 MiB, best of 5, counted as STREAM
//!   counts it: bytes read + bytes written per second) measured in the same run. An
//!   aggregation's rate is the update bytes it reads per second.

use std::time::{Duration, Instant};

use anchorage_model::train::{OptimizerKind, Trainer, whole};
use anchorage_model::{Net, NetSpec};
use anchorage_server::aggregate::AggregationRule;
use anchorage_server::methods::average_blocks;
use anchorage_shared::protocol::Update;
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use serde::Serialize;

/// The figures of one `anchorage microbench` run (printed as JSON).
#[derive(Debug, Clone, Serialize)]
pub struct Figures {
    pub threads: usize,
    /// Median milliseconds of one training step (batch 32, MLP 784-256-10, Adam).
    pub step_ms: f64,
    /// Floating-point operations of one step (forward, backward without the input gradient).
    pub step_flop: f64,
    /// The flex backend's f32 matmul rate on a 1024³ product, GFLOP/s.
    pub matmul_gflops: f64,
    /// The step's rate as a fraction of that.
    pub step_fraction_of_matmul: f64,
    /// Milliseconds of the batch-32 step's five matrix products alone, at their shapes.
    pub step_products_ms: f64,
    /// The same three figures at batch 256.
    pub step_ms_b256: f64,
    pub step_fraction_of_matmul_b256: f64,
    pub step_products_ms_b256: f64,
    /// Steps per second, all threads together, of independent trainings on 1 and on 2 threads.
    pub parallel_steps_per_s: [f64; 2],
    /// The second's over the first's.
    pub parallel_speedup: f64,
    /// STREAM-like copy bandwidth, GB/s (read + write).
    pub copy_gbps: f64,
    /// FedAvg of 100 updates of 1 MB through the server's path: milliseconds, GB/s of updates read.
    pub aggregate_ms: f64,
    pub aggregate_gbps: f64,
    /// Decoding the 100 updates' blocks alone (bytes → `Vec<f32>`), a step the server path
    /// skips: it reads the bytes in place.
    pub decode_ms: f64,
    /// The weighted mean alone (blocks already decoded).
    pub mean_ms: f64,
    pub mean_gbps: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn best(reps: usize, mut f: impl FnMut()) -> Duration {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap_or_default()
}

fn random(n: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n).map(|_| rng.f32()).collect()
}

/// Median step time over `steps` steps after `warmup`. The steps cycle through 64 random
/// batches with random labels, and the model and optimiser start afresh every 200 steps (outside
/// the timing): one batch trained on for thousands of steps drives the loss to zero and the
/// gradients into subnormal floats, which the CPU computes many times slower.
pub fn step_ms(steps: usize, warmup: usize, batch: usize) -> f64 {
    median(step_times(steps, warmup, 1, batch))
}

/// Floating-point operations of one step at `batch`: forward 2·b·(784·256 + 256·10); backward
/// both weight gradients and the hidden layer's input gradient (2·b·256·10); the first layer's
/// input gradient is not needed.
fn step_flop(batch: usize) -> f64 {
    let b = batch as f64;
    let forward = 2.0 * b * (784.0 * 256.0 + 256.0 * 10.0);
    2.0 * forward + 2.0 * b * 256.0 * 10.0
}

/// Median milliseconds of the step's five products at `batch`, without autodiff or optimiser:
/// forward X·W1 and H·W2, backward Xᵀ·G1 and Hᵀ·G2 (the weight gradients) and G2·W2ᵀ (the hidden
/// layer's input gradient). What is left of a step beyond this is element-wise work (bias,
/// ReLU, softmax, Adam), the autodiff graph and allocation.
pub fn products_ms(reps: usize, batch: usize) -> f64 {
    let device = Device::flex();
    let mut rng = Rng::new(4);
    let mut t = |rows: usize, cols: usize| {
        Tensor::<2>::from_data(TensorData::new(random(rows * cols, &mut rng), [rows, cols]), &device)
    };
    let (x, w1, h, w2, g1, g2) = (t(batch, 784), t(784, 256), t(batch, 256), t(256, 10), t(batch, 256), t(batch, 10));
    let times = (0..reps)
        .map(|_| {
            let started = Instant::now();
            let outputs = [
                x.clone().matmul(w1.clone()),
                h.clone().matmul(w2.clone()),
                x.clone().transpose().matmul(g1.clone()),
                h.clone().transpose().matmul(g2.clone()),
                g2.clone().matmul(w2.clone().transpose()),
            ];
            std::hint::black_box(outputs.map(|o| o.into_data()));
            started.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    median(times)
}

/// Steps per second of `threads` independent trainings at once, `steps` each after `warmup`
/// (counted from the first thread's start to the last one's end).
pub fn parallel_steps_per_s(threads: usize, steps: usize, warmup: usize) -> f64 {
    let started = Instant::now();
    std::thread::scope(|scope| {
        let workers: Vec<_> =
            (0..threads).map(|t| scope.spawn(move || step_times(steps, warmup, 1 + t as u64, 32))).collect();
        workers.into_iter().for_each(|w| drop(w.join()));
    });
    let wall = started.elapsed().as_secs_f64();
    (threads * (steps + warmup)) as f64 / wall
}

/// Each step's milliseconds (after `warmup`) of one training on its own model and batches of
/// `batch`.
fn step_times(steps: usize, warmup: usize, seed: u64, batch: usize) -> Vec<f64> {
    let device = Device::flex().autodiff();
    let spec = NetSpec { input_dim: 784, hidden: vec![256], num_classes: 10, seed: 7, residual: false };
    let mut rng = Rng::new(seed);
    let batches: Vec<(Tensor<2>, Tensor<1, Int>)> = (0..64)
        .map(|_| {
            let x = Tensor::<2>::from_data(TensorData::new(random(batch * 784, &mut rng), [batch, 784]), &device);
            let labels: Vec<i64> = (0..batch).map(|_| rng.below(10) as i64).collect();
            (x, Tensor::<1, Int>::from_data(TensorData::new(labels, [batch]), &device))
        })
        .collect();
    let ce = CrossEntropyLossConfig::new().init(&device);
    let mut model = Net::new(&spec, &device);
    let mut trainer = Trainer::new(OptimizerKind::Adam, 1e-3, batch);
    let mut times = Vec::with_capacity(steps);
    for i in 0..warmup + steps {
        if i % 200 == 0 {
            model = Net::new(&spec, &device);
            trainer = Trainer::new(OptimizerKind::Adam, 1e-3, batch);
        }
        let (x, y) = &batches[i % batches.len()];
        let t = Instant::now();
        let loss = ce.forward(model.forward(x.clone()), y.clone());
        (model, _) = trainer.step(model, loss, whole);
        if i >= warmup {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    times
}

/// The flex backend's f32 matmul rate on an n³ product, GFLOP/s (best of 5).
pub fn matmul_gflops(n: usize) -> f64 {
    let device = Device::flex();
    let mut rng = Rng::new(2);
    let a = Tensor::<2>::from_data(TensorData::new(random(n * n, &mut rng), [n, n]), &device);
    let b = Tensor::<2>::from_data(TensorData::new(random(n * n, &mut rng), [n, n]), &device);
    let _ = a.clone().matmul(b.clone()).into_data();
    let t = best(5, || {
        let _ = a.clone().matmul(b.clone()).into_data();
    });
    2.0 * (n * n * n) as f64 / t.as_secs_f64() / 1e9
}

/// STREAM-like copy bandwidth over `bytes`-sized buffers, GB/s counting read + write.
pub fn copy_gbps(bytes: usize) -> f64 {
    let n = bytes / 4;
    let src: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut dst = vec![0f32; n];
    dst.copy_from_slice(&src);
    let t = best(5, || {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    });
    2.0 * bytes as f64 / t.as_secs_f64() / 1e9
}

/// FedAvg of `updates` updates of `values` f32 each: (server path ms, decoding alone ms,
/// weighted mean alone ms).
pub fn aggregate_ms(updates: usize, values: usize) -> anyhow::Result<(f64, f64, f64)> {
    let mut rng = Rng::new(3);
    let shape = [values as u32];
    let global = vec![ParamBlock::encode("adapter.0.weight", &shape, &vec![0.0; values], Encoding::F32)];
    let all: Vec<Update> = (0..updates)
        .map(|_| Update {
            prototypes_are: Default::default(),
            round: 1,
            num_samples: 600,
            blocks: vec![ParamBlock::encode("adapter.0.weight", &shape, &random(values, &mut rng), Encoding::F32)],
            prototypes: Vec::new(),
            metrics: Vec::new(),
            compute_seconds: 0.0,
        })
        .collect();
    let named: Vec<(&str, &Update)> = all.iter().map(|u| ("client", u)).collect();
    let rule = AggregationRule::Mean;
    let mut failed = None;
    let full = best(5, || {
        if let Err(e) = average_blocks(&global, &named, Encoding::F32, &rule) {
            failed = Some(e);
        }
    });
    if let Some(e) = failed {
        anyhow::bail!("aggregation failed: {e}");
    }
    let decode = best(5, || {
        std::hint::black_box(all.iter().map(|u| u.blocks[0].decode().ok()).collect::<Vec<_>>());
    });
    let decoded: Vec<Vec<f32>> = all.iter().map(|u| u.blocks[0].decode()).collect::<Result<_, _>>()?;
    let parts: Vec<(Vec<&[f32]>, f64)> = decoded.iter().map(|v| (vec![v.as_slice()], 600.0)).collect();
    let mean = best(5, || {
        std::hint::black_box(rule.combine(&parts).ok());
    });
    Ok((full.as_secs_f64() * 1e3, decode.as_secs_f64() * 1e3, mean.as_secs_f64() * 1e3))
}

/// Every figure, on the current thread count.
pub fn run() -> anyhow::Result<Figures> {
    let threads = rayon::current_num_threads();
    let step = step_ms(2000, 200, 32);
    let step_b256 = step_ms(400, 40, 256);
    let matmul = matmul_gflops(1024);
    let fraction = |flop: f64, ms: f64| flop / (ms / 1e3) / 1e9 / matmul;
    let parallel = [parallel_steps_per_s(1, 1000, 100), parallel_steps_per_s(2, 1000, 100)];
    let copy = copy_gbps(256 << 20);
    let (updates, values) = (100, 262_144);
    let (full, decode, mean) = aggregate_ms(updates, values)?;
    let read = (updates * values * 4) as f64;
    Ok(Figures {
        threads,
        step_ms: step,
        step_flop: step_flop(32),
        matmul_gflops: matmul,
        step_fraction_of_matmul: fraction(step_flop(32), step),
        step_products_ms: products_ms(2000, 32),
        step_ms_b256: step_b256,
        step_fraction_of_matmul_b256: fraction(step_flop(256), step_b256),
        step_products_ms_b256: products_ms(400, 256),
        parallel_steps_per_s: parallel,
        parallel_speedup: parallel[1] / parallel[0],
        copy_gbps: copy,
        aggregate_ms: full,
        aggregate_gbps: read / (full / 1e3) / 1e9,
        decode_ms: decode,
        mean_ms: mean,
        mean_gbps: read / (mean / 1e3) / 1e9,
    })
}
