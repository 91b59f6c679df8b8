//! Secure aggregation keeps no individual contribution: the database and the server's in-memory
//! state under SecAgg are inspected, and neither holds one.
//!
//! 1. In memory, sans-IO: a real [`Engine`] (FedAvg, `[engine.secagg]` on) and six real device
//!    [`Session`]s with secure aggregation, messages moved by hand on a fake clock. After every
//!    engine call the engine holds at most one vector (the running sum) and never asks the store
//!    to keep an update; the new global model is the mean of the devices' known deltas, every
//!    contributor is acked, and a device that drops after sharing its keys and shares is unmasked
//!    from the others' shares (round 2).
//! 2. In the database, over real QUIC: the real server with a state folder and four real clients
//!    with `secure_aggregation = true`, each training a recognisable update. After two rounds no
//!    `updates` row exists, no byte window of any device's blocks (nor its encoded update, nor its
//!    marker metric) is anywhere in the state folder's files or in any BLOB or TEXT value of any
//!    table, and every round report says four devices are in the sum.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anchorage_client::methods::{ClientMethod, TrainError, Trained};
use anchorage_client::session::{Session, SessionAction};
use anchorage_client::store::ClientStore;
use anchorage_client::transport::{self as client, ClientOptions};
use anchorage_model::FeatureCache;
use anchorage_server::aggregate::RobustConfig;
use anchorage_server::engine::compat::check as check_config;
use anchorage_server::engine::secagg::SecAggConfig;
use anchorage_server::engine::{Action, Engine, EngineConfig, Persist, RoundOutcome, RoundReport};
use anchorage_server::methods::FedAvg;
use anchorage_server::store::{DB_FILE, ServerStore, read_round_reports};
use anchorage_server::transport::{self as server, Limits, ServerEvent, ServerOptions};
use anchorage_shared::method::MethodConfig;
use anchorage_shared::protocol::{Broadcast, Capabilities, Message, Metric, Update};
use anchorage_shared::tensor::{Encoding, ParamBlock};

/// Samples every device holds (equal weights: the sum's mean is the plain mean).
const SAMPLES: u64 = 10;

fn block(name: &str, values: &[f32]) -> ParamBlock {
    ParamBlock::encode(name, &[values.len() as u32], values, Encoding::F32)
}

fn values(blocks: &[ParamBlock]) -> Vec<Vec<f32>> {
    blocks.iter().map(|b| b.decode().expect("a dense block")).collect()
}

/// The broadcast's blocks plus `delta`, block by block.
fn plus(blocks: &[ParamBlock], delta: &[Vec<f32>]) -> Vec<ParamBlock> {
    blocks
        .iter()
        .zip(delta)
        .map(|(b, d)| {
            let v: Vec<f32> = b.decode().unwrap().iter().zip(d).map(|(x, d)| x + d).collect();
            ParamBlock::encode(b.name.clone(), &b.tensor.shape, &v, Encoding::F32)
        })
        .collect()
}

/// `base` plus the mean of `deltas`.
fn mean_of(base: &[Vec<f32>], deltas: &[&Vec<Vec<f32>>]) -> Vec<Vec<f32>> {
    let n = deltas.len() as f32;
    base.iter()
        .enumerate()
        .map(|(b, values)| {
            values.iter().enumerate().map(|(j, x)| x + deltas.iter().map(|d| d[b][j]).sum::<f32>() / n).collect()
        })
        .collect()
}

fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], what: &str) {
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.len(), w.len(), "{what}: block length");
        for (j, (g, w)) in g.iter().zip(w).enumerate() {
            assert!((g - w).abs() < 1e-5, "{what}: element {j} is {g}, the mean of the deltas gives {w}");
        }
    }
}

/// The 16-byte windows of each of `update`'s blocks (a shorter last one) that differ from the
/// same bytes of the `base` it was trained from: each holds some of the device's own change, so
/// none of them can be in anything the server keeps.
fn own_windows(update: &[ParamBlock], base: &[ParamBlock]) -> Vec<Vec<u8>> {
    update
        .iter()
        .zip(base)
        .flat_map(|(u, b)| {
            u.tensor.data.chunks(16).zip(b.tensor.data.chunks(16)).filter(|(u, b)| u != b).map(|(u, _)| u.to_vec())
        })
        .collect()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && haystack.windows(needle.len()).any(|w| w == needle)
}

// ---------------------------------------------------------------------------------------------
// 1. In memory, sans-IO.
// ---------------------------------------------------------------------------------------------

/// One device: its real session, the deltas it trains, and what the test saw of it.
struct Device {
    session: Session,
    /// Its delta (the same each round): recognisable, distinct per device.
    delta: Vec<Vec<f32>>,
    /// Messages reach it (a dropped device gets nothing more).
    up: bool,
    /// The round whose masked vector it sends into the void and then drops.
    drops_in: Option<u64>,
    /// Rounds acked `aggregated: true`.
    acked: BTreeSet<u64>,
    /// The server's goodbye (the federation finished) reached it.
    goodbye: bool,
    /// Rounds whose ack came only after that goodbye.
    acked_after_goodbye: BTreeSet<u64>,
    /// SecAgg control messages it sent, by round (keys, shares, unmasking).
    secagg_sent: BTreeMap<u64, usize>,
    /// The round it is training for (answers of the SecAgg frames carry no round otherwise).
    round: u64,
    /// Its trained update of each round.
    trained: BTreeMap<u64, Update>,
    /// The blocks each round's broadcast carried.
    broadcast: BTreeMap<u64, Vec<ParamBlock>>,
}

enum Deliver {
    ToDevice(String, Message),
    ToServer(String, Message),
}

/// What the loop checks and gathers.
#[derive(Default)]
struct Watch {
    engine_calls: usize,
    /// The most vectors the engine held at once while a SecAgg round was open.
    most_held: Option<usize>,
    reports: Vec<Arc<RoundReport>>,
    /// The global model of each closed round's checkpoint.
    globals: BTreeMap<u64, Vec<ParamBlock>>,
    /// Every checkpoint the engine asked to persist (global blocks and method state).
    persisted_blobs: Vec<Vec<u8>>,
    finished: bool,
}

impl Watch {
    /// After every engine call: at most the running sum in memory, and nothing of a device's
    /// queued for the store. Moves the engine's actions into the delivery queue.
    fn after_engine_call(&mut self, engine: &mut Engine, queue: &mut VecDeque<Deliver>) {
        self.engine_calls += 1;
        let held = engine.secagg_held_vectors();
        assert!(held.is_none_or(|h| h <= 1), "the engine holds {held:?} vectors: more than the running sum");
        self.most_held = self.most_held.max(held);
        while let Some(action) = engine.poll_action() {
            match action {
                Action::Persist(Persist::Accepted(a)) => {
                    panic!("device {}'s update of round {} was queued for the store", a.client, a.update.round)
                }
                Action::Persist(Persist::Closed { checkpoint, .. }) => {
                    self.persisted_blobs.extend(checkpoint.global.iter().map(|b| b.tensor.data.to_vec()));
                    self.persisted_blobs.push(checkpoint.method_state.clone());
                }
                Action::Persist(_) | Action::Ledger(_) => {}
                Action::Send { to, msg } => queue.push_back(Deliver::ToDevice(to, msg)),
                Action::Broadcast { to, msg } => {
                    queue.extend(to.into_iter().map(|to| Deliver::ToDevice(to, (*msg).clone())));
                }
                Action::Close { client, refusal } => panic!("the engine refused {client}: {refusal:?}"),
                Action::RoundClosed(report, checkpoint) => {
                    self.globals.insert(report.round, checkpoint.global.clone());
                    self.reports.push(report);
                }
                Action::Finished => self.finished = true,
            }
        }
    }
}

fn capabilities() -> Capabilities {
    let methods = [heapless::String::try_from("fedavg").unwrap()].into_iter().collect();
    Capabilities { backend: "flex".into(), memory_mb: 128, methods }
}

/// The session's actions: messages to the server, training answered at once with the device's
/// known delta, the masked vector delivered (or lost, for a device that drops). True when the
/// device dropped (the engine heard of its disconnect).
fn drain_session(
    now: Duration,
    id: &str,
    device: &mut Device,
    engine: &mut Engine,
    queue: &mut VecDeque<Deliver>,
) -> bool {
    let mut dropped = false;
    while let Some(action) = device.session.poll_action() {
        match action {
            SessionAction::Send(msg) => {
                if matches!(msg, Message::SecAgg(_)) {
                    *device.secagg_sent.entry(device.round).or_default() += 1;
                }
                queue.push_back(Deliver::ToServer(id.into(), msg));
            }
            SessionAction::Train(broadcast) => {
                let trained = trained(device, &broadcast);
                device.trained.insert(broadcast.round, trained.clone().into_update(broadcast.round, Duration::ZERO));
                device.broadcast.insert(broadcast.round, broadcast.blocks.clone());
                device.round = broadcast.round;
                device.session.trained(broadcast.round, trained, Duration::ZERO);
            }
            SessionAction::UploadMasked { round, msg } => {
                assert!(matches!(msg, Message::SecAgg(_)), "a masked vector travels as a SecAgg frame");
                if device.drops_in == Some(round) {
                    // It masked its update, and its connection dropped before the vector left.
                    device.up = false;
                    device.session.disconnected();
                    engine.handle_disconnect(now, id);
                    dropped = true;
                } else {
                    queue.push_back(Deliver::ToServer(id.into(), msg));
                }
            }
            SessionAction::Upload(update) => panic!("{id} uploaded its update of round {} in the clear", update.round),
            SessionAction::Finished { .. }
            | SessionAction::Persist(_)
            | SessionAction::Cost(_)
            | SessionAction::SetAsidePending { .. } => {}
        }
    }
    dropped
}

fn trained(device: &Device, broadcast: &Broadcast) -> Trained {
    Trained {
        prototypes_are: Default::default(),
        num_samples: SAMPLES,
        blocks: plus(&broadcast.blocks, &device.delta),
        prototypes: vec![],
        metrics: vec![Metric { name: "marker".into(), value: 4242.25 }],
    }
}

#[test]
fn the_engine_holds_only_the_running_sum_and_persists_no_update() {
    const N: usize = 6;
    const DROPS: &str = "d5";
    let config = EngineConfig {
        rounds: 2,
        min_available: N,
        min_fit: N,
        round_deadline: Duration::from_secs(10),
        robust: RobustConfig::unbounded(),
        secagg: SecAggConfig { enabled: true, clip: 10.0, ..SecAggConfig::default() },
        ..EngineConfig::default()
    };
    check_config(&config, &MethodConfig::named("fedavg").unwrap()).expect("a configuration SecAgg can run");
    let initial = vec![
        block("head.weight", &[0.5, -0.25, 0.0, 1.0, 0.125, -1.0, 0.75, 0.3]),
        block("head.bias", &[0.1, -0.1, 0.0]),
    ];
    let mut engine = Engine::new(config, Box::new(FedAvg::default()), initial.clone());
    let mut devices: BTreeMap<String, Device> = (0..N)
        .map(|i| {
            // Device i adds 0.1·(i+1) to weight i, and takes 0.05·(i+1) from bias i mod 3.
            let mut delta = vec![vec![0.0f32; 8], vec![0.0f32; 3]];
            delta[0][i] = 0.1 * (i + 1) as f32;
            delta[1][i % 3] = -0.05 * (i + 1) as f32;
            let mut entropy = [0u8; 32];
            entropy.iter_mut().enumerate().for_each(|(k, b)| *b = (k as u8).wrapping_mul(31) ^ (i as u8 + 1));
            let id = format!("d{i}");
            let session = Session::new(id.clone(), capabilities(), SAMPLES, None).with_secure_aggregation(entropy);
            let drops_in = (id == DROPS).then_some(2);
            let device = Device {
                session,
                delta,
                up: true,
                drops_in,
                acked: BTreeSet::new(),
                goodbye: false,
                acked_after_goodbye: BTreeSet::new(),
                secagg_sent: BTreeMap::new(),
                round: 0,
                trained: BTreeMap::new(),
                broadcast: BTreeMap::new(),
            };
            (id, device)
        })
        .collect();

    let mut watch = Watch::default();
    let mut queue = VecDeque::new();
    let mut now = Duration::ZERO;
    for (id, device) in &mut devices {
        device.session.connected();
        drain_session(now, id, device, &mut engine, &mut queue);
    }
    let mut steps = 0;
    // Until the federation finished and every message queued before and after it was delivered.
    while !(watch.finished && queue.is_empty()) {
        steps += 1;
        assert!(steps < 100_000, "the federation does not finish");
        match queue.pop_front() {
            Some(Deliver::ToServer(from, msg)) => {
                engine.handle_message(now, &from, msg);
                watch.after_engine_call(&mut engine, &mut queue);
            }
            Some(Deliver::ToDevice(to, msg)) => {
                let device = devices.get_mut(&to).expect("a known device");
                if !device.up {
                    continue;
                }
                match &msg {
                    Message::Ack(ack) if ack.aggregated => {
                        device.acked.insert(ack.round);
                        if device.goodbye {
                            device.acked_after_goodbye.insert(ack.round);
                        }
                    }
                    Message::Goodbye(_) => device.goodbye = true,
                    _ => {}
                }
                device.session.handle_message(now, msg, 0).unwrap_or_else(|e| panic!("{to} refused a message: {e}"));
                if drain_session(now, &to, device, &mut engine, &mut queue) {
                    // The drop was an engine call too.
                    watch.after_engine_call(&mut engine, &mut queue);
                }
            }
            None => {
                // Nothing in flight: the clock moves to the engine's next timeout.
                let next = engine.poll_timeout().expect("an open round waits for a timeout");
                now = now.max(next);
                engine.handle_timeout(now);
                watch.after_engine_call(&mut engine, &mut queue);
            }
        }
    }

    // Both rounds aggregated, round 2 without the device that dropped after sharing.
    let rounds: Vec<u64> = watch.reports.iter().map(|r| r.round).collect();
    assert_eq!(rounds, vec![1, 2]);
    for report in &watch.reports {
        assert!(matches!(report.outcome, RoundOutcome::Aggregated), "round {}: {:?}", report.round, report.outcome);
        assert!(
            report.updates.iter().all(|u| u.metrics.is_empty() && u.num_samples == 1),
            "round {}'s report carries nothing of one device's update: {:?}",
            report.round,
            report.updates
        );
    }
    let secagg: Vec<_> = watch.reports.iter().map(|r| r.secagg.clone().expect("a SecAgg round reports it")).collect();
    assert_eq!((secagg[0].contributors, secagg[0].dropped_after_masking), (N, 0), "{:?}", secagg[0]);
    assert_eq!((secagg[1].contributors, secagg[1].dropped_after_masking), (N - 1, 1), "{:?}", secagg[1]);
    assert!(secagg.iter().all(|s| s.failed.is_none() && s.refused.is_empty()), "{secagg:?}");
    assert_eq!(watch.reports[1].missing, vec![DROPS.to_string()]);
    assert_eq!(devices[DROPS].secagg_sent.get(&2), Some(&2), "{DROPS} sent its keys and shares in round 2");
    assert_eq!(watch.most_held, Some(1), "the running sum was held while the masked vectors came in");

    // The globals: the broadcast's model plus the mean of the deltas in each sum.
    let all: Vec<&Vec<Vec<f32>>> = devices.values().map(|d| &d.delta).collect();
    let round1_base = values(&devices["d0"].broadcast[&1]);
    assert_close(&round1_base, &values(&initial), "round 1's broadcast");
    assert_close(&values(&watch.globals[&1]), &mean_of(&round1_base, &all), "round 1's global");
    let survivors: Vec<&Vec<Vec<f32>>> = devices.iter().filter(|(id, _)| *id != DROPS).map(|(_, d)| &d.delta).collect();
    let round2_base = values(&devices["d0"].broadcast[&2]);
    assert_close(&round2_base, &values(&watch.globals[&1]), "round 2's broadcast");
    assert_close(&values(&watch.globals[&2]), &mean_of(&round2_base, &survivors), "round 2's global");
    assert_close(&values(engine.global()), &values(&watch.globals[&2]), "the engine's global");

    // Every contributor acked, its update cleared; the device that dropped keeps its own.
    for (id, device) in &devices {
        let want: BTreeSet<u64> = if id == DROPS { [1].into() } else { [1, 2].into() };
        assert_eq!(device.acked, want, "{id}'s aggregated acks");
        let pending = device.session.pending().map(|u| u.round);
        assert_eq!(pending, (id == DROPS).then_some(2), "{id}'s pending update");
    }

    // What the engine asked to persist (the checkpoints) holds no device's block bytes.
    for (id, device) in &devices {
        for (round, update) in &device.trained {
            let own = own_windows(&update.blocks, &device.broadcast[round]);
            assert!(!own.is_empty(), "{id}'s update of round {round} changes something");
            for window in own {
                assert!(
                    !watch.persisted_blobs.iter().any(|blob| contains(blob, &window)),
                    "{id}'s blocks of round {round} are in a persisted checkpoint"
                );
            }
        }
    }
    println!(
        "in memory: {N} sessions, 2 rounds, {} engine calls, at most {:?} vector held, no Persist::Accepted; \
         global = mean of deltas (1e-5) in both rounds; round 2: {} contributors, {} dropped after masking; \
         acks {:?}",
        watch.engine_calls,
        watch.most_held,
        secagg[1].contributors,
        secagg[1].dropped_after_masking,
        devices.iter().map(|(id, d)| (id.as_str(), d.acked.len())).collect::<Vec<_>>()
    );

    // An ack must reach a device before the goodbye: a real client leaves on the goodbye
    // (client/src/transport/client/act.rs, `SessionAction::Finished`) and never reads what follows it.
    let late: Vec<(&str, &BTreeSet<u64>)> = devices
        .iter()
        .filter(|(_, d)| !d.acked_after_goodbye.is_empty())
        .map(|(id, d)| (id.as_str(), &d.acked_after_goodbye))
        .collect();
    assert!(
        late.is_empty(),
        "the engine queued the last round's aggregated acks after the federation's goodbye: {late:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// 2. In the database, over real QUIC.
// ---------------------------------------------------------------------------------------------

const ELEMENTS: usize = 64;
/// A metric value every update carries, distinct per device (the marker's text is searched).
const MARKER: f64 = 31_415.926_5;

/// A FedAvg device that trains nothing: its update is the broadcast plus its own recognisable
/// delta (every element moves), and the test keeps a copy of each update it made with the
/// blocks it was trained from.
struct Marked {
    index: usize,
    trained: Log,
}

/// Each update a device made: (device, update, the blocks it was trained from).
type Log = Arc<Mutex<Vec<(usize, Update, Vec<ParamBlock>)>>>;

impl Marked {
    fn delta(&self, j: usize) -> f32 {
        // Every element differs from the mean of four devices' (that is 2.5× the pattern).
        (self.index + 1) as f32 * 0.003 * ((j % 7) as f32 + 1.0) + 0.000_1 * j as f32 * (self.index as f32 + 1.0)
    }
}

impl ClientMethod for Marked {
    fn name(&self) -> &'static str {
        "fedavg"
    }
    fn num_samples(&self) -> u64 {
        SAMPLES
    }
    fn train(&mut self, broadcast: &Broadcast) -> Result<Trained, TrainError> {
        let delta: Vec<Vec<f32>> =
            broadcast.blocks.iter().map(|b| (0..b.tensor.len().unwrap()).map(|j| self.delta(j)).collect()).collect();
        let trained = Trained {
            prototypes_are: Default::default(),
            num_samples: SAMPLES,
            blocks: plus(&broadcast.blocks, &delta),
            prototypes: vec![],
            metrics: vec![Metric { name: "marker".into(), value: MARKER + self.index as f64 }],
        };
        let update = trained.clone().into_update(broadcast.round, Duration::ZERO);
        self.trained.lock().unwrap().push((self.index, update, broadcast.blocks.clone()));
        Ok(trained)
    }
    fn global_accuracy(&self, _: &Broadcast, _: &FeatureCache) -> Result<Option<f64>, TrainError> {
        Ok(None)
    }
    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
        Ok(Vec::new())
    }
}

/// Every file under `dir`, recursively.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// Every BLOB and TEXT value of every table, as bytes, with where it came from.
fn every_value(conn: &rusqlite::Connection) -> Vec<(String, Vec<u8>)> {
    let tables: Vec<String> = conn
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let mut out = Vec::new();
    for table in tables {
        let mut stmt = conn.prepare(&format!("SELECT * FROM \"{table}\"")).unwrap();
        let columns: Vec<String> = stmt.column_names().map(String::from).collect();
        let mut rows = stmt.query([]).unwrap();
        while let Some(row) = rows.next().unwrap() {
            for (c, column) in columns.iter().enumerate() {
                let bytes = match row.get_ref(c).unwrap() {
                    rusqlite::types::ValueRef::Blob(b) => b.to_vec(),
                    rusqlite::types::ValueRef::Text(t) => t.to_vec(),
                    _ => continue,
                };
                out.push((format!("{table}.{column}"), bytes));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_holds_no_device_update_under_secure_aggregation() {
    const N: usize = 4;
    let tmp = tempfile::tempdir().unwrap();
    let state_dir = tmp.path().join("server-state");
    let store = ServerStore::open(&state_dir).unwrap();
    let identity = anchorage_pki::identity::self_signed(&["localhost"]).unwrap();
    let base: Vec<f32> = (0..ELEMENTS).map(|j| (j as f32 - 20.0) * 0.0625).collect();
    let initial = vec![block("head.weight", &base), block("head.bias", &base[..16])];
    let engine = EngineConfig {
        rounds: 2,
        min_available: N,
        min_fit: N,
        round_deadline: Duration::from_secs(30),
        robust: RobustConfig::unbounded(),
        secagg: SecAggConfig {
            enabled: true,
            clip: 10.0,
            stage_timeout: Duration::from_secs(20),
            ..SecAggConfig::default()
        },
        ..EngineConfig::default()
    };
    check_config(&engine, &MethodConfig::named("fedavg").unwrap()).expect("a configuration SecAgg can run");
    let mut handle = server::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity: identity.clone(),
        trust: anchorage_server::tls::Trust::InsecureDev,
        engine,
        method: Box::new(FedAvg::default()),
        initial: initial.clone(),
        limits: Limits::default(),
        store: Some(store.clone()),
    })
    .await
    .expect("server starts");

    let trained = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..N)
        .map(|i| {
            let mut options = ClientOptions::new(handle.local_addr, identity.cert.clone(), format!("d{i}"));
            options.secure_aggregation = true;
            options.seed = i as u64;
            options.store = Some(ClientStore::new(tmp.path().join(format!("client-d{i}"))));
            let method = Marked { index: i, trained: trained.clone() };
            tokio::spawn(client::run(options, Box::new(method), None))
        })
        .collect();
    let mut reports = Vec::new();
    let mut last_global = None;
    loop {
        let event = tokio::time::timeout(Duration::from_secs(120), handle.events.recv()).await;
        match event.expect("the server makes progress") {
            Some(ServerEvent::RoundClosed { report, checkpoint }) => {
                last_global = Some(checkpoint.global.clone());
                reports.push((*report).clone());
            }
            Some(ServerEvent::Finished) | None => break,
        }
    }
    for c in clients {
        tokio::time::timeout(Duration::from_secs(30), c).await.expect("the client leaves").unwrap().unwrap();
    }
    handle.shutdown().await.unwrap();
    drop(store);

    assert_eq!(reports.iter().map(|r| r.round).collect::<Vec<_>>(), vec![1, 2]);
    for r in &reports {
        assert!(matches!(r.outcome, RoundOutcome::Aggregated), "round {}: {:?}", r.round, r.outcome);
    }
    let trained = trained.lock().unwrap().clone();
    assert_eq!(trained.len(), 2 * N, "every device trained both rounds");
    let last_global = last_global.unwrap();

    // What to look for: every 16-byte window of each device's blocks, its whole encoded update
    // (the `updates.body` blob a plain round stores), and its marker metric (bytes and text).
    let mut needles: Vec<(String, Vec<u8>)> = Vec::new();
    for (i, update, base) in &trained {
        let who = format!("d{i} round {}", update.round);
        let own = own_windows(&update.blocks, base);
        assert_eq!(own.len(), (ELEMENTS + 16) / 4, "{who}: every element of its blocks moved");
        needles.extend(own.into_iter().map(|w| (format!("{who}: a window of its blocks"), w)));
        needles.push((format!("{who}: its encoded update"), Message::Update(update.clone()).encode_body()));
        let marker = update.metrics[0].value;
        needles.push((format!("{who}: its marker's bytes"), marker.to_le_bytes().to_vec()));
        needles.push((format!("{who}: its marker's text"), format!("{marker}").into_bytes()));
    }

    // The state folder's files as the server left them (the WAL too, if it is still there).
    let on_disk = files(&state_dir);
    assert!(on_disk.iter().any(|p| p.ends_with(DB_FILE)), "{on_disk:?}");
    let mut file_bytes = 0;
    for path in &on_disk {
        let bytes = std::fs::read(path).unwrap();
        file_bytes += bytes.len();
        for (what, needle) in &needles {
            assert!(!contains(&bytes, needle), "{what} is in {}", path.display());
        }
    }

    // The database through SQLite (a normal connection reads whatever the WAL holds).
    let conn = rusqlite::Connection::open(state_dir.join(DB_FILE)).unwrap();
    let ledger: Vec<(i64, String, i64)> = conn
        .prepare("SELECT round, kind, COUNT(*) FROM ledger GROUP BY round, kind ORDER BY round, kind")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let updates: i64 = conn.query_row("SELECT COUNT(*) FROM updates", [], |r| r.get(0)).unwrap();
    assert_eq!(updates, 0, "no accepted update is stored under secure aggregation");
    let values = every_value(&conn);
    for (column, bytes) in &values {
        for (what, needle) in &needles {
            assert!(!contains(bytes, needle), "{what} is in {column}");
        }
    }
    // The scan sees what is there: the final global model's bytes are in `versions`.
    let global_window = &last_global[0].tensor.data[..16];
    assert!(
        values.iter().any(|(column, bytes)| column.starts_with("versions.") && contains(bytes, global_window)),
        "the scan finds the global model it should"
    );
    // The round reports, as stored (JSON), say four devices are in each sum.
    let stored: Vec<(i64, String)> = conn
        .prepare("SELECT round, report FROM rounds ORDER BY round")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(stored.iter().map(|(r, _)| *r).collect::<Vec<_>>(), vec![1, 2]);
    for (round, json) in &stored {
        let report: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(report["secagg"]["contributors"], serde_json::json!(N), "round {round}: {json}");
        assert_eq!(report["secagg"]["dropped_after_masking"], serde_json::json!(0), "round {round}");
    }
    // Whatever the WAL held is now in the database file too: scanned once more, raw.
    conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).unwrap();
    drop(conn);
    let db = std::fs::read(state_dir.join(DB_FILE)).unwrap();
    for (what, needle) in &needles {
        assert!(!contains(&db, needle), "{what} is in the checkpointed database file");
    }
    let checked = read_round_reports(&state_dir.join(DB_FILE)).expect("the stored reports pass their checksums");
    assert!(checked.iter().all(|r| r.secagg.as_ref().is_some_and(|s| s.contributors == N)), "{checked:?}");

    println!(
        "in the database: {N} devices over QUIC, 2 SecAgg rounds of {N} contributors; 0 rows in updates; \
         {} needles (block windows, encoded updates, markers) absent from {} files ({file_bytes} bytes) \
         and {} BLOB/TEXT values; the global model found in versions",
        needles.len(),
        on_disk.len(),
        values.len()
    );

    println!("cost ledger rows (round, kind, devices): {ledger:?}");

    // Every device's update is in an aggregate, so every device heard so and cleared it.
    let still_pending: Vec<(String, u64)> = (0..N)
        .filter_map(|i| {
            let pending = ClientStore::new(tmp.path().join(format!("client-d{i}"))).load_pending().unwrap();
            pending.map(|u| (format!("d{i}"), u.round))
        })
        .collect();
    assert!(
        still_pending.is_empty(),
        "devices still hold updates the server aggregated (device, round): {still_pending:?}; \
         their aggregated ack never reached them"
    );
}
