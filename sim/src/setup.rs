//! What both clocks build from a [`SimConfig`]: the data and its split into task streams, the
//! frozen backbone's features (computed once per sample), each client's method half, the engine's
//! configuration, the initial global model and the evaluator.

use std::sync::Arc;
use std::time::Duration;

use anchorage_client::compress::UpdateCompression;
use anchorage_client::methods::protos::PrototypeRelease;
use anchorage_client::methods::{self, ClientMethod, MethodContext, Probes, Reveal, TaskData, TaskStream};
use anchorage_client::privacy::DevicePrivacy;
use anchorage_data::partition::FederatedSplit;
use anchorage_data::{Dataset, EvaluateOn, SyntheticConfig, partition, synthetic};
use anchorage_model::train::on_every_core;
use anchorage_model::{FeatureCache, InputBackbone, Inputs, NetSpec, zoo};
use anchorage_server::engine::EngineConfig;
use anchorage_server::methods::ServerMethod;
use anchorage_shared::protocol::{Broadcast, RoundConfig};
use anchorage_shared::prototype::Prototype;
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::ParamBlock;
use anyhow::Context;
use burn::tensor::Device;

use crate::accuracy::AccuracyRow;
use crate::config::SimConfig;
use crate::device::{self, Charge, DeviceProfile, SimulatedDevice};
use crate::record::{accuracy_records, round_accuracy};

/// The sub-stream of the scenario seed that the devices' local privacy noise comes from (device
/// i: [`Rng::derive`] of the seed xor this and i), apart from the server's own noise seed.
const PRIVACY_NOISE_STREAM: u64 = 0xDE71_CE00_0000_0034;

/// What every simulated device wraps its method in, in this order: `[privacy]` (σ of
/// local noise from the run's rounds, each device's noise seeded from the scenario seed and its
/// index), then compression (a top-k of a noised delta is post-processing).
struct DeviceWraps {
    privacy: Option<DevicePrivacy>,
    compression: UpdateCompression,
}

impl DeviceWraps {
    fn of(config: &SimConfig) -> anyhow::Result<Self> {
        Ok(Self {
            privacy: DevicePrivacy::for_simulation(
                &config.privacy,
                config.federation.rounds,
                config.method.info().shared.has_prototypes(),
            )?,
            compression: config.systems.update_compression()?,
        })
    }

    /// What the methods upload as prototypes: sums of clipped features under `[privacy]`.
    fn prototype_release(&self) -> PrototypeRelease {
        self.privacy.map_or(PrototypeRelease::Means, |p| p.prototype_release())
    }

    /// Client `i`'s method as its device runs it.
    fn method(&self, config: &SimConfig, context: MethodContext, i: usize) -> anyhow::Result<Box<dyn ClientMethod>> {
        let method = methods::build(&config.method, context)?;
        let noise = Rng::derive(config.federation.seed ^ PRIVACY_NOISE_STREAM, i as u64);
        let method = anchorage_client::privacy::wrap(method, self.privacy, noise);
        Ok(if self.compression.is_off() { method } else { anchorage_client::compress::wrap(method, self.compression) })
    }
}

/// The federation a run simulates.
pub(crate) struct Setup {
    pub engine: EngineConfig,
    pub initial: Vec<ParamBlock>,
    /// One client half per client built (all of them, or a fleet worker's shard), in client
    /// order, on its simulated device.
    pub clients: Vec<SimulatedDevice<Box<dyn ClientMethod>>>,
    /// Each client's device profile.
    pub devices: Vec<std::sync::Arc<DeviceProfile>>,
    pub num_classes: usize,
    pub evaluator: Evaluator,
    /// One line on the run: method, data, sizes.
    pub headline: String,
    /// The method's server half, with what it needs from the simulation (FedTA's distiller on the
    /// split's surrogate set).
    pub server_method: Box<dyn ServerMethod>,
}

/// The global model on the global test data of each task, predicted the way the method predicts.
pub(crate) struct Evaluator {
    method: Box<dyn ClientMethod>,
    /// Test data per task (class-incremental) or the single target domain (evolving).
    tests: Vec<(u32, FeatureCache)>,
    /// Evolving shifts: only the target is evaluated, whatever the task.
    target_only: bool,
    /// The last round's global model, probed once for the run's summary.
    last_round: std::sync::Mutex<Option<Broadcast>>,
}

impl Evaluator {
    /// Evaluates the global model a round closed with (on the test data of the tasks seen by
    /// `task`) and returns the round's headline accuracy and its accuracy records.
    pub(crate) fn evaluate_round(
        &self,
        report: &anchorage_server::RoundReport,
        checkpoint: &anchorage_server::engine::Checkpoint,
        task: u32,
    ) -> anyhow::Result<(f64, Vec<AccuracyRow>)> {
        let global = self.evaluate(&checkpoint.global, &checkpoint.prototypes, task)?;
        if let Ok(mut last) = self.last_round.lock() {
            *last = Some(evaluation_broadcast(&checkpoint.global, &checkpoint.prototypes, task));
        }
        let rows = accuracy_records(report, task, &global);
        Ok((round_accuracy(&global, &rows), rows))
    }

    /// The probes of the last round [`Self::evaluate_round`] evaluated, their mean over the test
    /// data [`Self::evaluate`] reads (none before a round); computed once, for the summary.
    pub(crate) fn last_probes(&self) -> anyhow::Result<Probes> {
        let Some(broadcast) = self.last_round.lock().ok().and_then(|last| last.clone()) else {
            return Ok(Probes::default());
        };
        let mut all = Vec::new();
        for (k, test) in &self.tests {
            if self.target_only || *k <= broadcast.task {
                all.push(on_every_core(|| self.method.global_probes(&broadcast, test))?);
            }
        }
        Ok(Probes::mean(&all))
    }

    /// Global accuracy on the test data of every task seen by a round of `task` (or on the
    /// target), as `(test task, accuracy)`, its batches on every core; methods without a global
    /// predictor give none.
    pub(crate) fn evaluate(
        &self,
        blocks: &[ParamBlock],
        prototypes: &[Prototype],
        task: u32,
    ) -> anyhow::Result<Vec<(u32, f64)>> {
        let broadcast = evaluation_broadcast(blocks, prototypes, task);
        let mut out = Vec::new();
        for (k, test) in &self.tests {
            if (self.target_only || *k <= task)
                && let Some(a) = on_every_core(|| self.method.global_accuracy(&broadcast, test))?
            {
                out.push((*k, a));
            }
        }
        Ok(out)
    }
}

/// The global model as the method's evaluation reads it: a broadcast of round 0 with no training.
fn evaluation_broadcast(blocks: &[ParamBlock], prototypes: &[Prototype], task: u32) -> Broadcast {
    Broadcast {
        round: 0,
        task,
        config: RoundConfig { local_epochs: 0, batch_size: 1, learning_rate: 0.0, deadline_ms: 0 },
        blocks: blocks.to_vec(),
        prototypes: prototypes.to_vec(),
    }
}

/// Client ids as both clocks name them.
pub(crate) fn client_id(i: usize) -> String {
    format!("client-{i:03}")
}

/// The data before features: pools, each client's tasks as index lists, and the global tests.
struct Prepared {
    train: Dataset,
    test: Dataset,
    split: FederatedSplit,
    source: String,
}

/// How the clients' tasks form a stream: FedProK's class-incremental tasks revealed one by one,
/// or FedEvolve's evolving shifts (every source domain from the start, the last
/// `target_domains` held out as the target). The one place that tells the two protocols apart.
#[derive(Clone, Copy)]
enum Protocol {
    ClassIncremental {
        num_tasks: usize,
    },
    /// Domains `first_target..num_tasks` together form the target.
    Evolving {
        num_tasks: usize,
        first_target: usize,
        /// `[data] evaluate_on = "validation"`: the last source domain's held-out rows stand in
        /// for the target (training-domain validation), which no choice may see.
        validate: bool,
    },
}

impl Protocol {
    fn of(config: &SimConfig, split: &FederatedSplit) -> anyhow::Result<Self> {
        let num_tasks = split.clients.iter().map(|c| c.tasks.len()).max().unwrap_or(0);
        anyhow::ensure!(num_tasks > 0, "the split gives the clients no tasks");
        if !config.data.evolving {
            return Ok(Self::ClassIncremental { num_tasks });
        }
        let held_out = config.data.target_domains.max(1);
        anyhow::ensure!(
            num_tasks > held_out,
            "evolving shifts need more domains ({num_tasks}) than target domains ({held_out}): at least one source"
        );
        let validate = config.data.spec.as_ref().is_some_and(|d| d.evaluate_on == EvaluateOn::Validation);
        Ok(Self::Evolving { num_tasks, first_target: num_tasks - held_out, validate })
    }

    fn num_tasks(self) -> usize {
        match self {
            Self::ClassIncremental { num_tasks } | Self::Evolving { num_tasks, .. } => num_tasks,
        }
    }

    fn is_evolving(self) -> bool {
        matches!(self, Self::Evolving { .. })
    }

    /// The global test sets: per task the union of the clients' test data of that task, or (evolving)
    /// one set, the target domains' rows, under the last task's number.
    fn global_rows(self, split: &FederatedSplit) -> Vec<GlobalRows> {
        let num_tasks = self.num_tasks();
        let tasks: Vec<(usize, std::ops::Range<usize>)> = match self {
            Self::ClassIncremental { .. } => (0..num_tasks).map(|k| (k, k..k + 1)).collect(),
            Self::Evolving { first_target, validate: false, .. } => vec![(num_tasks - 1, first_target..num_tasks)],
            Self::Evolving { first_target, validate: true, .. } => {
                vec![(num_tasks - 1, first_target - 1..first_target)]
            }
        };
        tasks.into_iter().map(|(k, targets)| self.global_rows_of(split, k, targets)).collect()
    }

    /// One global test set. Rows of one pool only: the test pool when every client of the task has
    /// test rows, else the clients' local tests (train-pool rows); mixing the two would index one
    /// pool with the other's rows.
    fn global_rows_of(self, split: &FederatedSplit, k: usize, targets: std::ops::Range<usize>) -> GlobalRows {
        let holders: Vec<_> =
            split.clients.iter().flat_map(|c| targets.clone().filter_map(|j| c.tasks.get(j))).collect();
        let in_train = self.is_evolving() || holders.iter().any(|t| t.test.is_empty());
        let mut idx: Vec<usize> = Vec::new();
        // Clients of one class set share one test list (`TaskSplit::test`): add each list
        // once, not once per client (100,000 clients of an IID split: 800 MB of repeats).
        let mut lists_seen = std::collections::HashSet::new();
        for t in holders {
            if let Self::Evolving { validate: true, .. } = self {
                idx.extend(&t.local_test);
            } else if self.is_evolving() {
                idx.extend(t.train.iter().chain(&t.local_test));
            } else if in_train {
                idx.extend(&t.local_test);
            } else if lists_seen.insert(Arc::as_ptr(&t.test) as *const usize) {
                idx.extend(t.test.iter());
            }
        }
        idx.sort_unstable();
        idx.dedup();
        GlobalRows { task: k as u32, in_train, idx }
    }

    /// The engine's rounds per task: the stream's, or none under evolving shifts (the target is
    /// fixed from the start).
    fn rounds_per_task(self, config: &SimConfig) -> u64 {
        if self.is_evolving() { 0 } else { config.data.rounds_per_task }
    }
}

/// A global test set: its task, its pool (train or test) and its rows.
struct GlobalRows {
    task: u32,
    in_train: bool,
    idx: Vec<usize>,
}

/// The frozen backbone's features of both pools (computed once per sample), and the labels.
struct Features {
    backbone: InputBackbone,
    train: FeatureCache,
    test: FeatureCache,
    train_labels: Vec<u32>,
    test_labels: Vec<u32>,
    num_classes: usize,
    train_len: usize,
    test_len: usize,
}

impl Features {
    /// Runs `config.model.backbone` over both pools. The raw samples stay beside the features only
    /// for a method that reads them (FedTA's input enhancement, and its server's SIKF); for the
    /// others they are let go once their features exist, and under the identity backbone the
    /// samples' buffer becomes the features (data held once).
    fn build(config: &SimConfig, train: Dataset, test: Dataset, plain: &Device) -> anyhow::Result<Self> {
        let backbone: anchorage_model::prompts::SharedBackbone =
            zoo::load(&config.model.backbone, train.sample_len(), config.data.data_dir.as_deref(), plain)
                .context("building the frozen backbone")?
                .into();
        let input_backbone = InputBackbone { net: backbone.clone(), sample_shape: train.sample_shape.clone() };
        let (train_len, test_len, num_classes) = (train.len(), test.len(), train.num_classes as usize);
        let (train_labels, test_labels) = (train.labels.clone(), test.labels.clone());
        let keep_inputs = config.method.info().reads_raw_samples;
        let features = |data: Dataset, what: &str| {
            if config.model.backbone == "identity" && !keep_inputs {
                return (FeatureCache::of_samples(data, plain), None);
            }
            let bar = crate::progress::bar(data.len() as u64, &format!("{what} features ({})", config.model.backbone));
            let cache = FeatureCache::build_with_progress(backbone.as_ref(), &data, 256, plain, &|n| bar.inc(n as u64));
            bar.finish_and_clear();
            (cache, keep_inputs.then(|| Arc::new(data)))
        };
        let (mut train_features, train_inputs) = features(train, "train");
        let (mut test_features, test_inputs) = features(test, "test");
        if let (Some(train), Some(test)) = (train_inputs, test_inputs) {
            train_features = train_features.with_inputs(Inputs::all(train));
            test_features = test_features.with_inputs(Inputs::all(test));
        }
        Ok(Self {
            backbone: input_backbone,
            train: train_features,
            test: test_features,
            train_labels,
            test_labels,
            num_classes,
            train_len,
            test_len,
        })
    }
}

/// Row subsets of the feature pools, one copy per distinct row set: clients that share a test set
/// (the embedded default's global test set, a class-incremental task's test-pool samples) share
/// its tensor, so memory per simulated client stays small (burn tensors clone by reference).
struct Rows<'a> {
    features: &'a Features,
    shared: std::cell::RefCell<std::collections::HashMap<(bool, Vec<usize>), FeatureCache>>,
}

impl<'a> Rows<'a> {
    fn new(features: &'a Features) -> Self {
        Self { features, shared: Default::default() }
    }

    /// The features of rows `idx` of the train pool (`in_train`) or the test pool.
    fn get(&self, in_train: bool, idx: &[usize]) -> FeatureCache {
        let key = (in_train, idx.to_vec());
        if let Some(cached) = self.shared.borrow().get(&key) {
            return cached.clone();
        }
        let cache = if in_train { self.features.train.subset(idx) } else { self.features.test.subset(idx) };
        self.shared.borrow_mut().insert(key, cache.clone());
        cache
    }
}

/// `eval_fraction`: clients evaluate their local model on a seeded sample of each task's test
/// rows, the same sample for the same rows (clients sharing a test set share it).
fn eval_rows(config: &SimConfig, k: usize, idx: &[usize]) -> Vec<usize> {
    if config.output.eval_fraction >= 1.0 || idx.is_empty() {
        return idx.to_vec();
    }
    let keep = ((idx.len() as f64 * config.output.eval_fraction.max(0.0)).ceil() as usize).clamp(1, idx.len());
    let mut rng = anchorage_shared::rng::Rng::derive(config.federation.seed ^ k as u64, 0xE7A1);
    let mut picked: Vec<usize> = rng.sample_indices(idx.len(), keep).into_iter().map(|i| idx[i]).collect();
    picked.sort_unstable();
    picked
}

/// Builds each client's task stream from the split, the global tests and the feature rows.
struct Streams<'a> {
    config: &'a SimConfig,
    protocol: Protocol,
    rows: &'a Rows<'a>,
    global: &'a [GlobalRows],
}

impl Streams<'_> {
    /// Client `client`'s stream: its tasks revealed one by one, or (evolving) its source domains
    /// all at once and the target domains' rows as the target.
    fn of(&self, client: &anchorage_data::partition::ClientSplit) -> TaskStream {
        let eval_every = self.config.output.eval_every;
        match self.protocol {
            Protocol::ClassIncremental { .. } => TaskStream {
                tasks: client.tasks.iter().enumerate().map(|(k, t)| self.task_data(k, t)).collect(),
                reveal: Reveal::ByTask,
                target: None,
                eval_every,
            },
            Protocol::Evolving { num_tasks, first_target, validate } => {
                let (sources, target) = client.tasks.split_at(first_target.min(client.tasks.len()));
                let mut all: Vec<usize> = match validate {
                    true => sources.last().map(|t| t.local_test.clone()).unwrap_or_default(),
                    false => target.iter().flat_map(|t| t.train.iter().chain(&t.local_test)).copied().collect(),
                };
                all.sort_unstable();
                TaskStream {
                    tasks: sources.iter().enumerate().map(|(k, t)| self.task_data(k, t)).collect(),
                    reveal: Reveal::All,
                    target: Some(self.rows.get(true, &eval_rows(self.config, num_tasks, &all))),
                    eval_every,
                }
            }
        }
    }

    /// Task `k` of a client: its training rows, its (sampled) local test rows and, for A^sel, the
    /// task's global test rows of the classes this client trains on.
    fn task_data(&self, k: usize, t: &anchorage_data::partition::TaskSplit) -> TaskData {
        let (idx, in_train) = t.local_test_rows();
        let idx = &eval_rows(self.config, k, idx)[..];
        let selected = self.config.output.selected_accuracy.then(|| self.selected_rows(k, t)).flatten();
        TaskData {
            classes: t.classes.clone(),
            train: self.rows.get(true, &t.train),
            test: self.rows.get(in_train, idx),
            selected,
        }
    }

    fn selected_rows(&self, k: usize, t: &anchorage_data::partition::TaskSplit) -> Option<FeatureCache> {
        let features = self.rows.features;
        let own: std::collections::BTreeSet<u32> = t.train.iter().map(|&i| features.train_labels[i]).collect();
        let global = self.global.iter().find(|g| g.task as usize == k)?;
        let pool = if global.in_train { &features.train_labels } else { &features.test_labels };
        let idx: Vec<usize> = global.idx.iter().copied().filter(|&i| own.contains(&pool[i])).collect();
        Some(self.rows.get(global.in_train, &idx))
    }
}

/// The engine's configuration for `config`'s federation.
fn engine_config(config: &SimConfig, protocol: Protocol) -> EngineConfig {
    EngineConfig {
        rounds: config.federation.rounds,
        rounds_per_task: protocol.rounds_per_task(config),
        min_available: config.federation.min_available.unwrap_or(config.federation.clients),
        fraction: config.federation.fraction,
        min_fit: 1,
        over_selection: config.federation.over_selection,
        min_updates: 1,
        round_deadline: Duration::from_secs_f64(config.federation.round_deadline_secs),
        round: RoundConfig {
            local_epochs: config.federation.local_epochs,
            batch_size: config.federation.batch_size,
            learning_rate: config.federation.learning_rate,
            deadline_ms: 0,
        },
        seed: config.federation.seed,
        mode: config.federation.aggregation.clone(),
        robust: config.federation.robust.clone(),
        privacy: config.privacy.clone(),
        noise_seed: Some(config.federation.seed ^ 0xD1FF_E4E7),
        secagg: config.secagg.clone(),
        policy: config.federation.policy,
        ..EngineConfig::default()
    }
}

/// The run's headline: method, data, sizes.
fn headline(config: &SimConfig, source: &str, features: &Features, num_tasks: usize) -> String {
    format!(
        "{} clients, {} rounds, {}, {} ({} train / {} test, {} classes, {} task{}), backbone {}, seed {}",
        config.federation.clients,
        config.federation.rounds,
        config.method.name(),
        source,
        features.train_len,
        features.test_len,
        features.num_classes,
        num_tasks,
        if num_tasks == 1 { "" } else { "s" },
        config.model.backbone,
        config.federation.seed
    )
}

/// The data before features: the embedded synthetic set, or the scenario's `[data]`.
fn prepare_data(config: &SimConfig) -> anyhow::Result<Prepared> {
    let Some(spec) = &config.data.spec else { return embedded_data(config) };
    let dir = config.data.data_dir.as_deref();
    let pools = anchorage_data::label_pools(spec, dir).context("reading the scenario's labels")?;
    let split = anchorage_data::build_split(spec, &pools).context("partitioning the scenario's data")?;
    let loading = crate::progress::spinner(format!("loading {}", spec.dataset.name()));
    let loaded = anchorage_data::load(spec, dir).context("loading the scenario's data")?;
    loading.finish_and_clear();
    Ok(Prepared { train: loaded.train, test: loaded.test, split, source: loaded.source })
}

/// A federation that can run: at least one client, and no more needed for a round than there are.
fn feasible(config: &SimConfig) -> anyhow::Result<()> {
    let clients = config.federation.clients;
    anyhow::ensure!(clients >= 1, "need at least one client");
    let min_available = config.federation.min_available.unwrap_or(clients);
    anyhow::ensure!(
        min_available <= clients,
        "min_available = {min_available} exceeds clients = {clients}: no round could ever open"
    );
    Ok(())
}

impl Setup {
    /// The whole federation, every client built.
    pub(crate) fn new(config: &SimConfig, charge: Charge) -> anyhow::Result<Self> {
        Self::for_clients(config, charge, 0..config.federation.clients)
    }

    /// The federation with only the clients of `client_range` built (a fleet worker's shard; an
    /// empty range for a server that only evaluates). The split is computed in full, the same
    /// way on every shard, so client i gets the same data wherever it runs. Steps, low-level to
    /// high-level: data, features, the stream protocol, the global tests, the clients' streams,
    /// the evaluator and the server half, the devices, the engine.
    pub(crate) fn for_clients(
        config: &SimConfig,
        charge: Charge,
        client_range: std::ops::Range<usize>,
    ) -> anyhow::Result<Self> {
        feasible(config)?;
        anyhow::ensure!(
            client_range.end <= config.federation.clients,
            "clients {client_range:?} are outside the federation's {}",
            config.federation.clients
        );
        let wraps = DeviceWraps::of(config)?;
        let encoding = wraps.compression.method_encoding(config.systems.encoding.encoding());
        let plain = Device::flex();
        let train_device = Device::flex().autodiff();
        let Prepared { train, test, split, source } = prepare_data(config)?;
        anyhow::ensure!(
            split.num_clients() == config.federation.clients,
            "the data split has {} clients, the federation {}",
            split.num_clients(),
            config.federation.clients
        );
        let features = Features::build(config, train, test, &plain)?;
        let net = NetSpec {
            input_dim: features.backbone.net.feature_dim(),
            hidden: config.model.hidden.clone(),
            num_classes: features.num_classes,
            seed: config.federation.seed ^ 0x5EED,
            residual: config.model.residual,
        };
        net.check().map_err(|e| anyhow::anyhow!("[model] residual: {e}"))?;
        let protocol = Protocol::of(config, &split)?;
        let context = |stream: TaskStream, seed: u64| MethodContext {
            net: net.clone(),
            stream,
            device: train_device.clone(),
            optimizer: config.federation.optimizer,
            encoding,
            seed,
            backbone: Some(features.backbone.clone()),
            prototype_release: wraps.prototype_release(),
        };
        let global = protocol.global_rows(&split);
        let rows = Rows::new(&features);
        let builder = Streams { config, protocol, rows: &rows, global: &global };
        let streams: Vec<TaskStream> = split.clients[client_range.clone()].iter().map(|c| builder.of(c)).collect();
        let tests = global.iter().map(|g| (g.task, rows.get(g.in_train, &g.idx))).collect();
        let evaluator = Evaluator {
            method: methods::build(&config.method, context(TaskStream::default(), config.federation.seed))?,
            tests,
            target_only: protocol.is_evolving(),
            last_round: Default::default(),
        };
        let initial = evaluator.method.initial_blocks()?;
        let server_method = server_method(config, &features, &split)?;
        let devices = device::assign(&config.systems.devices, config.federation.clients, config.federation.seed);
        let mut clients = Vec::with_capacity(client_range.len());
        for (i, stream) in client_range.zip(streams) {
            let seed = config.federation.seed.wrapping_add(i as u64);
            let method = wraps.method(config, context(stream, seed), i)?;
            let mut device =
                SimulatedDevice::new(method, devices[i].clone(), config.systems.straggler_ratio, charge, seed);
            if let Some(attack) = config.federation.attack.as_ref().filter(|a| a.clients.contains(&i)) {
                device.attack(attack.scale, attack.claim_samples);
            }
            clients.push(device);
        }
        let probe = || wraps.method(config, context(builder.of(&split.clients[0]), config.federation.seed), 0);
        let engine = checked_engine(config, protocol, (features.num_classes, &initial), probe)?;
        Ok(Self {
            engine,
            initial,
            clients,
            devices,
            num_classes: features.num_classes,
            evaluator,
            headline: headline(config, &source, &features, protocol.num_tasks()),
            server_method,
        })
    }
}

/// The engine's configuration for `config`, with `[secagg]` sized (`probe` builds client 0's
/// method for it), refused where `[privacy]` or `[secagg]` cannot hold.
fn checked_engine(
    config: &SimConfig,
    protocol: Protocol,
    (num_classes, initial): (usize, &[ParamBlock]),
    probe: impl FnOnce() -> anyhow::Result<Box<dyn ClientMethod>>,
) -> anyhow::Result<EngineConfig> {
    let mut engine = engine_config(config, protocol);
    if engine.secagg.enabled {
        size_secagg(&mut engine, &config.method, num_classes, probe, initial)?;
    }
    anchorage_server::engine::compat::check(&engine, &config.method).map_err(anyhow::Error::msg)?;
    Ok(engine)
}

/// `[secagg]`'s vector for this federation: the data's classes, and the dimension of the
/// prototypes the method sends (each method has its own feature space), from one probe round of
/// training on client 0's stream. A method that sends no prototypes needs neither.
fn size_secagg(
    engine: &mut EngineConfig,
    method: &anchorage_shared::method::MethodConfig,
    num_classes: usize,
    probe: impl FnOnce() -> anyhow::Result<Box<dyn ClientMethod>>,
    initial: &[ParamBlock],
) -> anyhow::Result<()> {
    let sends_prototypes = anchorage_shared::method::info(method.name()).is_some_and(|m| m.shared.has_prototypes());
    if !sends_prototypes {
        return Ok(());
    }
    if engine.secagg.classes == 0 {
        engine.secagg.classes = num_classes as u32;
    }
    if engine.secagg.prototype_dim == 0 {
        let broadcast = Broadcast {
            round: 1,
            task: 0,
            config: engine.round.clone(),
            blocks: initial.to_vec(),
            prototypes: Vec::new(),
        };
        let update = probe()?.train(&broadcast).context("the probe round that sizes [secagg]'s prototypes")?;
        let dim = update.prototypes.first().and_then(|p| p.vector.shape.first().copied());
        engine.secagg.prototype_dim =
            dim.context("the probe round sent no prototype: set prototype_dim in [secagg]")?;
    }
    Ok(())
}

/// The server half `config.method` names; FedTA's distiller runs on the split's surrogate set
/// (the frozen backbone the clients have), wired by [`anchorage_server::sikf::server_method`].
fn server_method(
    config: &SimConfig,
    features: &Features,
    split: &FederatedSplit,
) -> anyhow::Result<Box<dyn ServerMethod>> {
    let fedta = matches!(config.method, anchorage_shared::method::MethodConfig::FedTa(_));
    let surrogate = (fedta && !split.surrogate.is_empty()).then(|| anchorage_server::sikf::Surrogate {
        backbone: features.backbone.clone(),
        features: features.test.subset(&split.surrogate),
        batch_size: config.federation.batch_size as usize,
        seed: config.federation.seed ^ 0x51CF,
        source: "the split's surrogate set".into(),
    });
    anchorage_server::sikf::server_method(&config.method, surrogate)
}

/// The embedded default: procedural images, a Dirichlet label skew (α = inf: IID), one task, a
/// local 80/20 split per client; the global test set is held out.
fn embedded_data(config: &SimConfig) -> anyhow::Result<Prepared> {
    let data = SyntheticConfig {
        num_classes: 10,
        side: 16,
        train_per_class: config.data.train_per_class,
        test_per_class: config.data.test_per_class,
        noise: config.data.noise,
        max_shift: 3,
        seed: config.federation.seed,
    };
    let (train, test) = synthetic::generate(&data);
    let min_per_client = (train.len() / config.federation.clients / 4).clamp(1, 20);
    let parts = if config.data.alpha.is_infinite() {
        partition::iid(train.len(), config.federation.clients, config.federation.seed)
    } else {
        partition::dirichlet(
            &train.labels,
            train.num_classes,
            config.federation.clients,
            config.data.alpha,
            min_per_client,
            config.federation.seed,
        )
        .context("partitioning the synthetic data")?
    };
    let classes: Vec<u32> = (0..train.num_classes).collect();
    let all_test: Arc<[usize]> = (0..test.len()).collect();
    let clients = parts
        .iter()
        .enumerate()
        .map(|(i, indices)| {
            let (local_train, local_test) = split_per_class(&train, indices, 0.8, config.federation.seed ^ i as u64);
            anchorage_data::partition::ClientSplit {
                tasks: vec![anchorage_data::partition::TaskSplit {
                    classes: classes.clone(),
                    train: local_train,
                    local_test,
                    test: all_test.clone(),
                }],
            }
        })
        .collect();
    Ok(Prepared {
        train,
        test,
        split: FederatedSplit { clients, surrogate: Vec::new() },
        source: "synthetic data".into(),
    })
}

/// `indices` split per class into a `fraction` share and the rest (seeded), as pool indices.
fn split_per_class(data: &Dataset, indices: &[usize], fraction: f64, seed: u64) -> (Vec<usize>, Vec<usize>) {
    let local = data.subset(indices);
    let (a, b) = local.split_indices_per_class(fraction, seed);
    (a.iter().map(|&i| indices[i]).collect(), b.iter().map(|&i| indices[i]).collect())
}
