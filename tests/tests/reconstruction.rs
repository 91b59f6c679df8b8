//! Measured: what the server can see of each device's true per-class mean
//! (the prototypes every method here uploads): without protection, under differential privacy, and
//! under secure aggregation (SecAgg+).
//!
//! The devices' features are real where the data folder is there: the first 2,000 lossless
//! CIFAR-10 training records (`cifar10/data_batch_1.first4000.bin.gz`) through the frozen
//! pretrained ResNet-20 (`weights/resnet20-12fca82f.safetensors`), 64-d: the features FedProK
//! uploads in `scenarios/privacy/` (GLDP uploads them through its adapter). The folder is
//! `$ANCHORAGE_DATA` when set, else `../shared/data` beside the repository; without the records
//! the test says so loudly and runs on the embedded synthetic images through the embedded
//! random-feature backbone instead.
//!
//! 20 devices hold 100 images each (consecutive records, so every device has about 10 of each
//! class). What leaves a device is made by the client's own code: `upload_prototypes` under
//! `PrototypeRelease::Means` (privacy off) or `ClippedSums` (on), and under local noise the
//! client's `Privatized` wrapper (`anchorage_client::privacy::wrap`) with σ from
//! `DevicePrivacy::for_simulation` for the main table's 40 rounds. Central noise is the server's
//! rule on the round's summed sums and counts (`anchorage_shared::privacy::mechanism`), with σ
//! from `PrivacyConfig::noise_multiplier` at the main table's q = 0.5.
//!
//! The server's estimate of a device's class mean: the uploaded mean (off); sum / count (central,
//! what the trusted server itself holds); the noised sum / the noised count, floored at 1 (local,
//! one upload); the mean of the 40 uploads' sums over the mean of their counts (local, a server
//! that keeps every round of a device whose features do not change: a frozen backbone); the
//! published global prototype (central, what anyone who reads the broadcast learns). Cosine
//! similarity and relative L2 error ‖estimate − true‖ / ‖true‖ are averaged over devices and the
//! classes each holds.
//!
//! Under SecAgg the uploads are the unprotected means, but they go through a real SecAgg+ round
//! (`anchorage_secagg`, driven here as the server's and the client's shells drive it: the layout
//! and the device's id with round 0's Setup, every message through its wire encoding) over a
//! seeded sample of the 20 devices at the same q = 0.5; the layout clips a class sum to count ×
//! `prototype_clip`. The server's only output is the sum, which `Layout::decode` turns into each
//! class's mean pooled over the round's devices: that is its estimate of every contributor's own
//! class mean, compared with the contributors' means. The test checks that the server never holds
//! more than the one running sum while the masked vectors arrive, that the decoded sum is the
//! contributors' pooled (clipped) means, and that the estimate is further from each device's mean
//! than the unprotected upload.
//!
//! `cargo test -p anchorage-tests --test reconstruction -- --nocapture` prints the table.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anchorage_client::methods::protos::{PrototypeRelease, host, upload_prototypes};
use anchorage_client::methods::{ClientMethod, TrainError, Trained};
use anchorage_client::privacy::{DevicePrivacy, wrap};
use anchorage_data::Dataset;
use anchorage_model::{FeatureCache, zoo};
use anchorage_secagg::{
    Advance, Aggregate, ClientId, ClientMessage, ClientState, Layout, Params, ServerFrame, ServerMessage, ServerState,
    Stage,
};
use anchorage_shared::privacy::mechanism::{add_gaussian, l2_norm, noisy_count};
use anchorage_shared::privacy::{NoiseSite, PrivacyConfig};
use anchorage_shared::protocol::{Broadcast, RoundConfig, Update};
use anchorage_shared::prototype::Prototype;
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use burn::tensor::{Device, Tensor, TensorData};

const DEVICES: usize = 20;
const PER_DEVICE: usize = 100;
/// The main table's rounds (scenarios/privacy/*.toml) and sampling rate.
const ROUNDS: u64 = 40;
const SAMPLING_RATE: f64 = 0.5;
const DELTA: f64 = 1e-5;
const EPSILONS: [f64; 3] = [8.0, 4.0, 1.0];
const CIFAR_RECORDS: &str = "cifar10/data_batch_1.first4000.bin.gz";

/// Every device's features `[PER_DEVICE, dim]` (row-major) and labels, and where they came from.
struct Fleet {
    source: String,
    dim: usize,
    devices: Vec<(Vec<f32>, Vec<u32>)>,
}

/// `$ANCHORAGE_DATA` when set (a folder without the records gives the synthetic fallback), else
/// `../shared/data` beside the repository; `None` when the chosen folder lacks the records.
fn data_folder() -> Option<PathBuf> {
    let dir = match std::env::var_os("ANCHORAGE_DATA") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/data")),
    };
    dir.join(CIFAR_RECORDS).is_file().then_some(dir)
}

/// The fleet on real features (CIFAR-10 through ResNet-20), or on the embedded synthetic set.
fn fleet() -> Fleet {
    let device = Device::flex();
    let n = DEVICES * PER_DEVICE;
    let (data, backbone, source) = match data_folder() {
        Some(dir) => {
            let path = dir.join(CIFAR_RECORDS);
            let images =
                anchorage_data::loaders::cifar::read_batch(&path, anchorage_data::loaders::cifar::CifarKind::Cifar10)
                    .expect("the lossless CIFAR-10 records");
            let idx: Vec<usize> = (0..n).collect();
            let data = images.subset(&idx).to_dataset();
            let backbone = zoo::load("resnet20", 3 * 32 * 32, Some(&dir), &device).expect("ResNet-20 weights");
            (data, backbone, format!("CIFAR-10 ({}, first {n} records) through frozen ResNet-20", path.display()))
        }
        None => {
            eprintln!(
                "\n*** NOT REAL DATA: the data folder ($ANCHORAGE_DATA, else ../shared/data) lacks \
                 {CIFAR_RECORDS}; the table below is on the EMBEDDED SYNTHETIC images \
                 through the embedded random-feature backbone ***\n"
            );
            let (train, _) = anchorage_data::synthetic::generate(&anchorage_data::SyntheticConfig::default());
            let data = shuffled(&train, n);
            let backbone = zoo::load("embedded", data.sample_len(), None, &device).expect("embedded backbone");
            (data, backbone, "EMBEDDED SYNTHETIC images through the embedded backbone (no real data found)".into())
        }
    };
    let cache = FeatureCache::build(&*backbone, &data, 256, &device);
    let values = host(cache.features());
    let dim = cache.dim();
    let devices = (0..DEVICES)
        .map(|d| {
            let rows = d * PER_DEVICE..(d + 1) * PER_DEVICE;
            (values[rows.start * dim..rows.end * dim].to_vec(), data.labels[rows].to_vec())
        })
        .collect();
    Fleet { source, dim, devices }
}

/// `n` samples of the synthetic set in a seeded order (it is stored class by class).
fn shuffled(data: &Dataset, n: usize) -> Dataset {
    let mut idx: Vec<usize> = (0..data.len()).collect();
    Rng::new(34).shuffle(&mut idx);
    idx.truncate(n);
    data.subset(&idx)
}

/// A device's true per-class means of its (unclipped) features: (class, mean).
fn true_means(values: &[f32], labels: &[u32], dim: usize) -> Vec<(u32, Vec<f32>)> {
    let mut classes: Vec<u32> = labels.to_vec();
    classes.sort_unstable();
    classes.dedup();
    classes
        .into_iter()
        .map(|c| {
            let rows: Vec<&[f32]> = labels
                .iter()
                .enumerate()
                .filter(|(_, l)| **l == c)
                .map(|(i, _)| &values[i * dim..(i + 1) * dim])
                .collect();
            let mean = (0..dim).map(|j| rows.iter().map(|r| r[j]).sum::<f32>() / rows.len() as f32).collect();
            (c, mean)
        })
        .collect()
}

/// What the device uploads under `release` (the client's own code).
fn upload(values: &[f32], labels: &[u32], dim: usize, release: PrototypeRelease) -> Vec<Prototype> {
    let rep = Tensor::<2>::from_data(TensorData::new(values.to_vec(), [labels.len(), dim]), &Device::flex());
    upload_prototypes(rep, labels, release, Encoding::F32)
}

/// A method that uploads fixed prototypes and no blocks: the part of a prototype method's update
/// the wrapper noises.
struct Uploads(Vec<Prototype>);

impl ClientMethod for Uploads {
    fn name(&self) -> &'static str {
        "fedprok"
    }
    fn num_samples(&self) -> u64 {
        self.0.iter().map(|p| p.count).sum()
    }
    fn train(&mut self, _: &Broadcast) -> Result<Trained, TrainError> {
        Ok(Trained {
            prototypes_are: Default::default(),
            num_samples: self.num_samples(),
            blocks: Vec::new(),
            prototypes: self.0.clone(),
            metrics: Vec::new(),
        })
    }
    fn global_accuracy(&self, _: &Broadcast, _: &FeatureCache) -> Result<Option<f64>, TrainError> {
        Ok(None)
    }
    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
        Ok(Vec::new())
    }
}

fn broadcast(round: u64) -> Broadcast {
    Broadcast {
        round,
        task: 0,
        config: RoundConfig { local_epochs: 1, batch_size: 16, learning_rate: 0.01, deadline_ms: 0 },
        blocks: Vec::new(),
        prototypes: Vec::new(),
    }
}

fn config(noise: NoiseSite, epsilon: f64, prototype_clip: f64) -> PrivacyConfig {
    PrivacyConfig {
        noise,
        clip: 1.0,
        target_epsilon: Some(epsilon),
        delta: DELTA,
        prototype_clip,
        ..PrivacyConfig::default()
    }
}

/// Per class: (sum of sums, sum of counts) over `uploads`.
fn totals(uploads: &[Vec<Prototype>]) -> Vec<(u32, Vec<f64>, f64)> {
    let mut out: Vec<(u32, Vec<f64>, f64)> = Vec::new();
    for p in uploads.iter().flatten() {
        let values = p.values().expect("finite prototype");
        let at = match out.iter().position(|(c, _, _)| *c == p.class) {
            Some(i) => i,
            None => {
                out.push((p.class, vec![0.0; values.len()], 0.0));
                out.len() - 1
            }
        };
        out[at].1.iter_mut().zip(&values).for_each(|(s, v)| *s += f64::from(*v));
        out[at].2 += p.count as f64;
    }
    out
}

/// The server's estimate of each class's mean from `uploads` of one device (one or several
/// rounds of sums): mean sum / mean count, the count floored at 1.
fn estimate_from_sums(uploads: &[Vec<Prototype>]) -> Vec<(u32, Vec<f32>)> {
    let rounds = uploads.len() as f64;
    totals(uploads)
        .into_iter()
        .map(|(c, sum, count)| {
            let count = (count / rounds).max(1.0);
            (c, sum.iter().map(|s| (s / rounds / count) as f32).collect())
        })
        .collect()
}

/// Cosine and relative L2 error of `estimate` against `truth`, over the classes `truth` has
/// (a class the estimate lacks counts as the zero vector: cosine 0, error 1).
fn compare(truth: &[(u32, Vec<f32>)], estimate: &[(u32, Vec<f32>)]) -> Vec<(f64, f64)> {
    truth
        .iter()
        .map(|(c, t)| {
            let zero = vec![0.0; t.len()];
            let e = estimate.iter().find(|(k, _)| k == c).map_or(&zero, |(_, e)| e);
            let dot: f64 = t.iter().zip(e).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
            let (nt, ne) = (l2_norm([t.as_slice()]), l2_norm([e.as_slice()]));
            let diff: Vec<f32> = t.iter().zip(e).map(|(a, b)| a - b).collect();
            let cos = if nt > 0.0 && ne > 0.0 { dot / (nt * ne) } else { 0.0 };
            (cos, l2_norm([diff.as_slice()]) / nt)
        })
        .collect()
}

/// One row of the table: mean cosine, mean and median relative error over (device, class).
#[derive(Debug, Clone)]
struct Row {
    what: String,
    sigma: Option<f64>,
    cosine: f64,
    error: f64,
    median_error: f64,
}

fn row(what: impl Into<String>, sigma: Option<f64>, pairs: &[(f64, f64)]) -> Row {
    let n = pairs.len() as f64;
    let mut errors: Vec<f64> = pairs.iter().map(|p| p.1).collect();
    errors.sort_by(f64::total_cmp);
    Row {
        what: what.into(),
        sigma,
        cosine: pairs.iter().map(|p| p.0).sum::<f64>() / n,
        error: errors.iter().sum::<f64>() / n,
        median_error: errors[errors.len() / 2],
    }
}

/// The prototype clip: the median norm of one sample's feature (the same rule as the scenarios').
fn median_norm(fleet: &Fleet) -> f64 {
    let mut norms: Vec<f64> =
        fleet.devices.iter().flat_map(|(v, _)| v.chunks(fleet.dim).map(|r| l2_norm([r])).collect::<Vec<_>>()).collect();
    norms.sort_by(f64::total_cmp);
    norms[norms.len() / 2]
}

/// Local noise at `epsilon`: each device's uploads through the client's `Privatized` wrapper,
/// one round and all `ROUNDS` rounds. Returns (σ, one upload, every upload).
fn local_rows(fleet: &Fleet, truths: &[Vec<(u32, Vec<f32>)>], epsilon: f64, clip: f64) -> (f64, Row, Row) {
    let privacy = DevicePrivacy::for_simulation(&config(NoiseSite::Local, epsilon, clip), ROUNDS, true)
        .expect("a valid [privacy]")
        .expect("on");
    let sigma = privacy.noise_multiplier.expect("local noise has σ");
    let (mut one, mut all) = (Vec::new(), Vec::new());
    for (d, ((values, labels), truth)) in fleet.devices.iter().zip(truths).enumerate() {
        let sums = upload(values, labels, fleet.dim, privacy.prototype_release());
        let mut method = wrap(Box::new(Uploads(sums)), Some(privacy), Rng::derive(34, d as u64));
        let uploads: Vec<Vec<Prototype>> =
            (1..=ROUNDS).map(|r| method.train(&broadcast(r)).expect("privatized upload").prototypes).collect();
        one.extend(compare(truth, &estimate_from_sums(&uploads[..1])));
        all.extend(compare(truth, &estimate_from_sums(&uploads)));
    }
    let one = row(format!("local DP, ε = {epsilon}: one upload (sum / count)"), Some(sigma), &one);
    let all = row(format!("local DP, ε = {epsilon}: all {ROUNDS} uploads averaged"), Some(sigma), &all);
    (sigma, one, all)
}

/// Central noise at `epsilon`: the round's sums over every device, noised as the server does,
/// published as sum / count; compared with each device's own mean. `None`: the same without
/// noise (the population's class means, what any global prototype is an estimate of).
fn central_row(fleet: &Fleet, truths: &[Vec<(u32, Vec<f32>)>], epsilon: Option<f64>, clip: f64) -> Row {
    let privacy = config(NoiseSite::Central, epsilon.unwrap_or(1.0), clip);
    let sigma = match epsilon {
        Some(_) => privacy.noise_multiplier(ROUNDS, SAMPLING_RATE, true).expect("σ for the target"),
        None => 0.0,
    };
    let release = PrototypeRelease::of(&privacy);
    let uploads: Vec<Vec<Prototype>> = fleet.devices.iter().map(|(v, l)| upload(v, l, fleet.dim, release)).collect();
    let mut rng = Rng::derive(34, 0xD9);
    let published: Vec<(u32, Vec<f32>)> = totals(&uploads)
        .into_iter()
        .map(|(c, sum, count)| {
            let mut sum: Vec<f32> = sum.iter().map(|s| *s as f32).collect();
            add_gaussian(&mut sum, sigma * clip, &mut rng);
            let count = noisy_count(count as u64, sigma, &mut rng).max(1) as f32;
            (c, sum.iter().map(|s| s / count).collect())
        })
        .collect();
    let pairs: Vec<(f64, f64)> = truths.iter().flat_map(|t| compare(t, &published)).collect();
    match epsilon {
        Some(eps) => row(format!("central DP, ε = {eps}: published global prototypes"), Some(sigma), &pairs),
        None => row("global prototypes without noise (the population's class means)", None, &pairs),
    }
}

/// One device in a SecAgg+ round as the client's shell runs it: its trained update, and the
/// round's layout and protocol state once the Setup frame came.
struct SecAggDevice {
    update: Update,
    entropy: [u8; 32],
    layout: Option<Layout>,
    state: Option<ClientState>,
}

impl SecAggDevice {
    /// Answers one server frame (wire bytes) with one client message (wire bytes); the update is
    /// encoded with the frame's layout when the masked input is asked for.
    fn answer(&mut self, frame: &[u8]) -> Vec<u8> {
        let ServerFrame { layout, you, message } = ServerFrame::decode(frame).expect("a server frame");
        if let (Some(layout), Some(you)) = (layout, you) {
            layout.check().expect("a valid layout");
            self.state = Some(ClientState::awaiting_input(you, self.entropy));
            self.layout = Some(layout);
        }
        let state = self.state.as_mut().expect("a Setup came first");
        if message.stage() == Stage::MaskedInput && state.needs_input() {
            let layout = self.layout.as_ref().expect("the round's layout");
            state.provide_input(layout.encode(&self.update, &[], false).expect("the update fits the layout"));
        }
        state.handle_message(message).expect("the device accepts the frame").encode()
    }
}

/// One SecAgg+ round over `updates` (no dropouts), to its aggregate. Checks that the server holds
/// only the one running sum after each masked vector arrives, and nothing once it is output.
fn secagg_round(layout: &Layout, updates: Vec<(ClientId, Update)>) -> Aggregate {
    let n = updates.len();
    let mut rng = Rng::derive(34, 0x5EC);
    let mut seed = || {
        let mut bytes = [0u8; 32];
        bytes.chunks_exact_mut(8).for_each(|c| c.copy_from_slice(&rng.next_u64().to_le_bytes()));
        bytes
    };
    let graph_seed = seed();
    let clients: Vec<ClientId> = updates.iter().map(|(c, _)| *c).collect();
    let vector_len = layout.vector_len() as u32;
    let config = anchorage_secagg::RoundConfig {
        round: 1,
        clients,
        params: Params::recommended(n, 0.1),
        graph_seed,
        vector_len,
    };
    let mut server = ServerState::new(config).expect("a valid SecAgg+ round");
    let mut devices: BTreeMap<ClientId, SecAggDevice> = updates
        .into_iter()
        .map(|(c, update)| (c, SecAggDevice { update, entropy: seed(), layout: None, state: None }))
        .collect();
    loop {
        while let Some((c, message)) = server.poll_transmit() {
            let setup = matches!(message, ServerMessage::Setup(_));
            let frame = ServerFrame { layout: setup.then(|| layout.clone()), you: setup.then_some(c), message };
            let reply = devices.get_mut(&c).expect("a sampled device").answer(&frame.encode());
            let reply = ClientMessage::decode(&reply).expect("a client message");
            let masked = matches!(reply, ClientMessage::Masked { .. });
            server.handle_message(c, reply).expect("the server accepts the message");
            if masked {
                let held = server.held_vectors().len();
                assert!(held <= 1, "the server holds {held} vectors after {c}'s masked vector, not one running sum");
            }
        }
        assert_eq!(server.awaiting(), 0, "every device answered the stage");
        if let Advance::Done(aggregate) = server.advance().expect("the round goes on") {
            assert!(server.held_vectors().is_empty(), "the sum left the server with the aggregate");
            return aggregate;
        }
    }
}

/// Per class, Σ count · mean / Σ count over the updates' prototypes, each mean clipped to norm
/// `clip` as the layout clips a class sum to count · clip: what the aggregate should decode to.
fn pooled_means(updates: &[(ClientId, Update)], clip: f64) -> Vec<(u32, Vec<f32>)> {
    let sum = |p: &Prototype| {
        let mean = p.values().expect("finite prototype");
        let scale = p.count as f64 * (clip / l2_norm([mean.as_slice()])).min(1.0);
        Prototype::encode(
            p.class,
            p.count,
            &mean.iter().map(|v| (f64::from(*v) * scale) as f32).collect::<Vec<_>>(),
            Encoding::F32,
        )
    };
    let sums: Vec<Vec<Prototype>> = updates.iter().map(|(_, u)| u.prototypes.iter().map(sum).collect()).collect();
    totals(&sums).into_iter().map(|(c, sum, count)| (c, sum.iter().map(|s| (s / count) as f32).collect())).collect()
}

/// SecAgg+: a seeded sample of the devices (q = `SAMPLING_RATE`) sends its unprotected means
/// through one real round; the server's estimate of each contributor's class mean is the decoded
/// aggregate's pooled class mean. Compared with the contributors' own means.
fn secagg_row(fleet: &Fleet, truths: &[Vec<(u32, Vec<f32>)>], clip: f64) -> Row {
    let mut picked = Rng::derive(34, 0x5A).sample_indices(DEVICES, (DEVICES as f64 * SAMPLING_RATE).round() as usize);
    picked.sort_unstable();
    let classes = fleet.devices.iter().flat_map(|(_, l)| l).max().map_or(0, |c| c + 1);
    let layout = Layout {
        blocks: Vec::new(),
        classes,
        dim: fleet.dim as u32,
        clip: 1.0,
        prototype_clip: clip as f32,
        max_count: 1000,
        max_clients: picked.len() as u32,
        weight_scale: 0.0,
    };
    let updates: Vec<(ClientId, Update)> = picked
        .iter()
        .map(|&d| {
            let (values, labels) = &fleet.devices[d];
            let mut method = Uploads(upload(values, labels, fleet.dim, PrototypeRelease::Means));
            let trained = method.train(&broadcast(1)).expect("an update");
            (ClientId(d as u32), trained.into_update(1, std::time::Duration::ZERO))
        })
        .collect();
    let exact = pooled_means(&updates, clip);
    let aggregate = secagg_round(&layout, updates);
    assert_eq!(aggregate.contributors as usize, picked.len(), "every sampled device is in the sum");
    let decoded = layout.decode(&aggregate.sum, aggregate.contributors, &[], 1).expect("the aggregate decodes");
    let pooled: Vec<(u32, Vec<f32>)> =
        decoded.prototypes.iter().map(|p| (p.class, p.values().expect("finite pooled mean"))).collect();
    for (cos, err) in compare(&exact, &pooled) {
        assert!(cos > 0.9999 && err < 1e-4, "the aggregate is the round's pooled means: cosine {cos}, error {err}");
    }
    let pairs: Vec<(f64, f64)> = picked.iter().flat_map(|&d| compare(&truths[d], &pooled)).collect();
    let what = format!("SecAgg+, one round of {} devices: the round's pooled class means", picked.len());
    row(what, None, &pairs)
}

fn print_table(fleet: &Fleet, clip: f64, rows: &[Row]) {
    println!("\nReconstruction of each device's per-class mean feature");
    println!("data: {}", fleet.source);
    println!(
        "{DEVICES} devices × {PER_DEVICE} samples, {}-d features; prototype_clip {clip:.3} (median feature norm); \
         δ = {DELTA}; σ for {ROUNDS} rounds (central: q = {SAMPLING_RATE}; local: q = 1), prototype sums + counts",
        fleet.dim
    );
    println!("\n| what the server (or a reader) holds | σ | cosine | rel. L2 error (mean) | rel. L2 error (median) |");
    println!("|---|---:|---:|---:|---:|");
    for r in rows {
        let sigma = r.sigma.map_or("–".to_string(), |s| format!("{s:.2}"));
        println!("| {} | {sigma} | {:.3} | {:.3} | {:.3} |", r.what, r.cosine, r.error, r.median_error);
    }
    println!();
}

#[test]
fn what_the_server_sees_of_each_devices_class_means() {
    let fleet = fleet();
    let clip = median_norm(&fleet);
    let truths: Vec<Vec<(u32, Vec<f32>)>> = fleet.devices.iter().map(|(v, l)| true_means(v, l, fleet.dim)).collect();
    let mut rows = Vec::new();

    // No protection: the uploaded means themselves.
    let plain: Vec<(f64, f64)> = fleet
        .devices
        .iter()
        .zip(&truths)
        .flat_map(|((v, l), t)| {
            let uploaded = upload(v, l, fleet.dim, PrototypeRelease::Means);
            compare(t, &uploaded.iter().map(|p| (p.class, p.values().unwrap())).collect::<Vec<_>>())
        })
        .collect();
    rows.push(row("no protection: uploaded means", None, &plain));
    // Central noise: the trusted server holds every device's clipped sums and counts as sent.
    let clipped: Vec<(f64, f64)> = fleet
        .devices
        .iter()
        .zip(&truths)
        .flat_map(|((v, l), t)| {
            let sums = upload(v, l, fleet.dim, PrototypeRelease::ClippedSums { clip });
            compare(t, &estimate_from_sums(&[sums]))
        })
        .collect();
    rows.push(row("central DP (any ε): the server's own copy of the clipped sums", None, &clipped));

    let mut local = Vec::new();
    for eps in EPSILONS {
        let (sigma, one, all) = local_rows(&fleet, &truths, eps, clip);
        local.push((eps, sigma, one.clone(), all.clone()));
        rows.extend([one, all]);
    }
    rows.push(central_row(&fleet, &truths, None, clip));
    rows.extend(EPSILONS.iter().map(|&eps| central_row(&fleet, &truths, Some(eps), clip)));
    let secagg = secagg_row(&fleet, &truths, clip);
    rows.push(secagg.clone());
    print_table(&fleet, clip, &rows);

    let none = &rows[0];
    assert!(none.cosine > 0.9999 && none.error < 1e-4, "unprotected means are the true means: {none:?}");
    let kept = &rows[1];
    assert!(kept.cosine > 0.99, "the trusted server's clipped sums keep the direction: {kept:?}");
    for pair in local.windows(2) {
        let ((e1, s1, one1, all1), (e2, s2, one2, all2)) = (&pair[0], &pair[1]);
        assert!(s2 > s1, "σ grows as ε falls: ε {e1} → {s1}, ε {e2} → {s2}");
        assert!(one2.error > one1.error, "one upload's error grows as ε falls: {one1:?} → {one2:?}");
        assert!(all2.error > all1.error, "the averaged uploads' error grows as ε falls: {all1:?} → {all2:?}");
    }
    let (_, _, one_at_1, all_at_1) = &local[2];
    assert!(
        one_at_1.cosine < none.cosine - 0.5 && all_at_1.cosine < none.cosine - 0.3,
        "at ε = 1 local noise hides the device's means: {one_at_1:?} / {all_at_1:?} against {none:?}"
    );
    assert!(
        secagg.cosine < none.cosine && secagg.error > none.error,
        "under SecAgg the server's estimate is no closer than the unprotected upload: {secagg:?} against {none:?}"
    );
}
