//! Running one simulated federation over real QUIC on loopback.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anchorage_client::transport::{self as client_transport, ClientCert, ClientEvent, ClientOptions, SocketWrapper};
use anchorage_data::DataSpec;
use anchorage_server::aggregate::RobustConfig;
use anchorage_server::ca::{Kind, ProjectCa};
use anchorage_server::engine::AggregationMode;
use anchorage_server::tls;
use anchorage_server::transport::{self as server_transport, Limits, ServerEvent, ServerOptions};
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::method::MethodConfig;
use anyhow::Context;
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::device::{Charge, DeviceProfile, deal_by_share};
use crate::network::{DuplexProfile, DuplexStats, LinkHandle, ShapedSocket};
use crate::record::{RoundRow, RunSummary, SummaryInputs, evaluate_round};
use crate::recorder::Recorder;
use crate::setup::{Setup, client_id, mean_accuracy};

/// A client to kill (abort, no goodbye) when the broadcast of `round` reaches it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KillAt {
    pub client: usize,
    pub round: u64,
}

/// Everything a simulated run needs; written to the run folder as `config.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimConfig {
    pub clients: usize,
    pub rounds: u64,
    pub seed: u64,
    pub local_epochs: u32,
    pub batch_size: u32,
    pub learning_rate: f32,
    /// The clients' local optimizer (`sgd`: momentum 0.9; `adam`).
    pub optimizer: anchorage_model::train::OptimizerKind,
    /// Fraction of connected clients each round waits for.
    pub fraction: f64,
    pub over_selection: f64,
    /// Clients required before a round opens (default: all of them).
    pub min_available: Option<usize>,
    /// Dirichlet α of the label skew over clients (smaller is more non-IID; `inf`: IID).
    pub alpha: f64,
    pub round_deadline_secs: f64,
    pub train_per_class: usize,
    pub test_per_class: usize,
    /// Pixel noise of the synthetic images (their templates have unit deviation). The default,
    /// 1.0, is harder than the data crate's, so the table shows the model learning over rounds.
    pub noise: f32,
    /// Upload encoding: f32, f16, bf16 or int8.
    pub encoding: String,
    pub kill: Vec<KillAt>,
    /// Link of every client, by preset name (`ethernet`, `wifi`, `lte`, `3g`, `satellite`, `iot`);
    /// none: plain loopback.
    pub link: Option<String>,
    /// A fleet of mixed links: presets dealt to clients by share (overrides `link`).
    pub link_mix: Vec<LinkShare>,
    /// Explicit links for single clients (override `link` and `link_mix`).
    pub client_links: Vec<ClientLink>,
    /// The fleet's device kinds, dealt by share (empty: every client computes at host speed).
    pub devices: Vec<DeviceProfile>,
    /// FedEvolve's straggler ratio p: with probability p a client runs a uniform random number of
    /// local epochs in 1..τ instead of τ.
    pub straggler_ratio: f64,
    /// Clients evaluate their local model in rounds that are multiples of this (1: every round;
    /// the global model is evaluated every round whatever this says).
    pub eval_every: u64,
    /// Fraction of each task's test rows clients evaluate their local model on (a seeded
    /// sample; 1: all). `metrics.json` records both under `local_eval`.
    pub eval_fraction: f64,
    /// Threads the virtual clock trains sampled clients on; 0: one per core. Results are the
    /// same for any count (a training sees only its own client's state and the broadcast). The
    /// default is 1: on the CPU backend trainings serialise on burn-autodiff's process-wide lock
    /// (see `device::ComputePool`), and the slowdown of each would enter the simulated time.
    pub threads: usize,
    /// Synchronous rounds (default) or FedBuff-style buffered aggregation:
    /// `aggregation = { kind = "buffered", buffer = 4, concurrency = 8, max_staleness = 4 }`.
    pub aggregation: AggregationMode,
    /// The server's screening and aggregation rule (`[robust]`, the server's `[engine.robust]`):
    /// `robust = { aggregation = { rule = "median" }, max_norm_z = 3.5 }`.
    pub robust: RobustConfig,
    /// Byzantine devices (`[attack]`): these clients send a scaled update instead of their own.
    pub attack: Option<Attack>,
    /// The method and its hyperparameters (`[method]` of a scenario file).
    pub method: MethodConfig,
    /// The frozen backbone and the trainable net on it (`[model]`).
    pub model: ModelConfig,
    /// The scenario's data (`[data]`); none: the embedded synthetic set (`alpha`, `noise`, ...).
    pub data: Option<DataSpec>,
    /// Where real datasets and weights are (`../shared/data`, `ANCHORAGE_DATA`).
    pub data_dir: Option<PathBuf>,
    /// Which clock `anchorage sim` runs on.
    pub clock: Clock,
    /// Rounds per task of the stream (FedProK's R); 0: a single task.
    pub rounds_per_task: u64,
    /// FedEvolve's protocol: the clients hold every source domain from the start and the last
    /// domain of the split is the unseen target the accuracy is measured on.
    pub evolving: bool,
    /// Also evaluate each client's local model on the global test data of its own classes (GLDP's
    /// A^sel). Off by default: under label skew every distinct class set holds its own copy of
    /// those test features.
    pub selected_accuracy: bool,
    /// Evolving shifts: how many of the last domains form the target (default 1: the next domain
    /// only; more holds out a stretch of far domains, as evolving-domain benchmarks often do).
    pub target_domains: usize,
}

/// `real`: QUIC on loopback in real time; `virtual`: the discrete-event clock (no sockets,
/// simulated time charged by the link and device models).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Clock {
    Real,
    Virtual,
}

impl std::fmt::Display for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if *self == Clock::Real { "real" } else { "virtual" })
    }
}

/// The frozen backbone and the trainable net on its features.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// `embedded` (random features, the default), `identity` (raw inputs), `resnet20`, `resnet56`,
    /// `mobilenet_v2` (pretrained, from the data directory).
    pub backbone: String,
    /// Widths of the trainable adapter's layers (the representation); the head follows.
    pub hidden: Vec<usize>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self { backbone: "embedded".into(), hidden: vec![512] }
    }
}

/// Byzantine devices: each listed client trains as usual, then uploads
/// global + `scale`·(trained − global) — `scale` = −10 is the scaled sign-flip attack.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Attack {
    /// 0-based client indices.
    pub clients: Vec<usize>,
    pub scale: f32,
}

/// A preset and its share of the fleet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkShare {
    pub preset: String,
    pub share: f64,
}

/// One client's link, written out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientLink {
    pub client: usize,
    pub profile: DuplexProfile,
}

impl SimConfig {
    /// The link client `i` runs on, if shaped.
    /// Every client's link, in client order: an entry of `client_links` first, else a preset
    /// dealt from `link_mix` by share, else `link`, else none (plain loopback).
    pub fn links(&self) -> anyhow::Result<Vec<Option<DuplexProfile>>> {
        let preset = |name: &str| {
            DuplexProfile::preset(name)
                .with_context(|| format!("unknown link preset `{name}` (known: {})", DuplexProfile::PRESETS.join(", ")))
        };
        let mix: Vec<(DuplexProfile, f64)> =
            self.link_mix.iter().map(|m| Ok((preset(&m.preset)?, m.share))).collect::<anyhow::Result<_>>()?;
        let dealt = deal_by_share(&mix, self.clients, self.seed ^ 0x11AC);
        let default = self.link.as_deref().map(preset).transpose()?;
        Ok((0..self.clients)
            .map(|i| match self.client_links.iter().find(|l| l.client == i) {
                Some(l) => Some(l.profile.clone()),
                None => dealt.get(i).cloned().or_else(|| default.clone()),
            })
            .collect())
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            clients: 4,
            rounds: 5,
            seed: 7,
            local_epochs: 2,
            batch_size: 32,
            learning_rate: 1e-3,
            optimizer: anchorage_model::train::OptimizerKind::Adam,
            fraction: 1.0,
            over_selection: 0.0,
            min_available: None,
            alpha: 0.5,
            round_deadline_secs: 60.0,
            train_per_class: 300,
            test_per_class: 100,
            noise: 1.0,
            encoding: "f32".into(),
            kill: Vec::new(),
            link: None,
            link_mix: Vec::new(),
            client_links: Vec::new(),
            devices: Vec::new(),
            straggler_ratio: 0.0,
            eval_every: 1,
            eval_fraction: 1.0,
            threads: 1,
            aggregation: AggregationMode::Synchronous,
            robust: RobustConfig::default(),
            attack: None,
            method: MethodConfig::default(),
            model: ModelConfig::default(),
            data: None,
            data_dir: None,
            clock: Clock::Real,
            rounds_per_task: 0,
            evolving: false,
            selected_accuracy: false,
            target_domains: 1,
        }
    }
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct SimResult {
    pub summary: RunSummary,
    pub ledger: Vec<CostRecord>,
    /// Round reports from the server, in order.
    pub reports: Vec<anchorage_server::RoundReport>,
    pub run_dir: Option<PathBuf>,
    /// Per client, the counters of its modelled link (`None`: unshaped).
    pub link_stats: Vec<Option<DuplexStats>>,
    /// The accuracy records (global and local models per test task, per round).
    pub accuracy: Vec<crate::report::AccuracyRow>,
}

/// Runs the federation silently, with no run folder (tests, benches).
pub async fn run(config: SimConfig) -> anyhow::Result<SimResult> {
    run_recorded(config, &mut Recorder::silent()).await
}

/// Runs the federation, reporting each round to `recorder` (console and run folder) as it
/// closes; a stop request ends the run after the round in flight.
pub async fn run_recorded(config: SimConfig, recorder: &mut Recorder) -> anyhow::Result<SimResult> {
    let started = Instant::now();
    let Setup { engine, initial, clients, evaluator, devices, num_classes, headline, server_method, .. } =
        Setup::new(&config, Charge::Sleep)?;
    let schedule = engine.clone();
    let task_of = |round: u64| schedule.task_of(round);

    // Server and clients on loopback with certificates from a project CA that lives only in this
    // process: mutual TLS, as in the field, with no set-up.
    let mut ca = ProjectCa::in_memory("anchorage-sim", 7)?;
    let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 7)?;
    let cert = ca.cert().clone();
    let mut server = server_transport::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity,
        trust: tls::Trust::ProjectCa { ca: cert.clone(), crl: None },
        engine: engine.clone(),
        method: server_method,
        initial: initial.clone(),
        limits: Limits::default(),
        store: None,
    })
    .await?;
    let initial_global = evaluator.evaluate(&initial, &[], 0)?;
    let initial_accuracy = initial_of(&initial_global);
    let chance = 1.0 / num_classes as f64;
    let mut accuracy_rows = Vec::new();

    // Clients.
    let (event_tx, mut client_events) = mpsc::unbounded_channel::<(usize, ClientEvent)>();
    let mut handles = Vec::new();
    let mut link_handles: Vec<Option<LinkSlot>> = Vec::new();
    let links = config.links()?;
    // One training at a time (see ComputePool): compute seconds in the ledger measure work, not contention.
    let pool = Arc::new(crate::device::ComputePool::new(1));
    for (i, mut method) in clients.into_iter().enumerate() {
        method.in_pool(pool.clone());
        if let Some(k) = config.kill.iter().filter(|k| k.client == i).map(|k| k.round).min() {
            method.crash_in(k);
        }
        let (options, link) = device_options(&config, i, server.local_addr, &cert, &mut ca, links[i].clone())?;
        link_handles.push(link);
        let (tx, forward) = (event_tx.clone(), mpsc::unbounded_channel::<ClientEvent>());
        let (ctx, mut crx) = forward;
        tokio::spawn(async move {
            while let Some(e) = crx.recv().await {
                let _ = tx.send((i, e));
            }
        });
        handles.push(tokio::spawn(client_transport::run(options, Box::new(method), Some(ctx))));
    }
    drop(event_tx);

    recorder.start(&headline, (!initial_global.is_empty()).then_some(initial_accuracy), chance, config.rounds)?;

    let mut ledger: Vec<CostRecord> = Vec::new();
    let mut costs_by_round: HashMap<u64, Vec<CostRecord>> = HashMap::new();
    let mut rows = Vec::new();
    let mut reports = Vec::new();
    let mut killed = vec![false; handles.len()];
    // A stop request is polled between events; the round in flight still closes.
    let mut poll_stop = tokio::time::interval(Duration::from_millis(100));
    let mut stopping = false;
    loop {
        tokio::select! {
            event = server.events.recv() => match event {
                Some(ServerEvent::RoundClosed { report, checkpoint }) => {
                    // The acks of this round are on their way; give the clients a moment to file their costs.
                    let waiting: Vec<&str> = report.updates.iter().map(|u| u.client.as_str()).collect();
                    let deadline = Instant::now() + Duration::from_secs(3);
                    while costs_by_round.get(&report.round).map_or(0, |v| v.len()) < waiting.len() && Instant::now() < deadline {
                        match tokio::time::timeout(Duration::from_millis(50), client_events.recv()).await {
                            Ok(Some((i, e))) => handle_client_event(i, e, &config, &devices, &mut handles, &mut killed, &mut costs_by_round),
                            Ok(None) => break,
                            Err(_) => {}
                        }
                    }
                    let costs = costs_by_round.remove(&report.round).unwrap_or_default();
                    let task = task_of(report.round);
                    let (acc, new_rows) = evaluate_round(&evaluator, &report, &checkpoint, task)?;
                    let row = RoundRow::from_report(&report, acc, &costs);
                    recorder.round(&row, &costs, &new_rows, None)?;
                    accuracy_rows.extend(new_rows);
                    ledger.extend(costs);
                    rows.push(row);
                    reports.push((*report).clone());
                    if recorder.stop_requested().is_some() {
                        stopping = true;
                        break;
                    }
                }
                Some(ServerEvent::Finished) | None => break,
            },
            Some((i, e)) = client_events.recv() => handle_client_event(i, e, &config, &devices, &mut handles, &mut killed, &mut costs_by_round),
            _ = poll_stop.tick() => {
                // Announces the stop once; the loop ends when the round in flight closes.
                let _ = recorder.stop_requested();
            }
        }
    }

    // Clients received their goodbye; wait for them to leave, then stop the server. A stopped
    // run's clients get no goodbye: they are aborted.
    for h in handles {
        if stopping {
            h.abort();
            continue;
        }
        match tokio::time::timeout(Duration::from_secs(5), h).await {
            Ok(Ok(Ok(_))) | Ok(Err(_)) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %format!("{e:#}"), "a client ended with an error"),
            Err(_) => tracing::warn!("a client did not leave in time"),
        }
    }
    let metrics = server.metrics.clone();
    server.shutdown().await?;

    let inputs = SummaryInputs {
        initial_accuracy,
        chance,
        late_updates: reports.last().map(|r| r.late_total).unwrap_or(0),
        refused: metrics.refusals_total(),
        decode_errors: metrics.decode_errors_total(),
        wall_seconds: started.elapsed().as_secs_f64(),
        local_eval: crate::record::LocalEval::of(&config),
    };
    let mut summary = RunSummary::new(inputs, rows, &ledger, &accuracy_rows);
    recorder.finish(&mut summary, &ledger, &accuracy_rows, None)?;
    let link_stats = link_handles
        .iter()
        .map(|h| h.as_ref().and_then(|slot| slot.lock().ok().and_then(|s| s.as_ref().map(LinkHandle::stats))))
        .collect();
    let run_dir = recorder.dir().map(|d| d.to_path_buf());
    Ok(SimResult { summary, ledger, reports, run_dir, link_stats, accuracy: accuracy_rows })
}

/// Runs the federation on the clock its configuration names (what `anchorage sim` does).
pub fn run_on_clock(config: SimConfig, recorder: &mut Recorder) -> anyhow::Result<SimResult> {
    match config.clock {
        Clock::Real => {
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            runtime.block_on(run_recorded(config, recorder))
        }
        Clock::Virtual => crate::virtual_clock::run_virtual_recorded(&config, recorder),
    }
}

/// The initial accuracy of the global model: the mean over the tasks evaluated, NaN when the
/// method has no global model before its first round.
pub(crate) fn initial_of(global: &[(u32, f64)]) -> f64 {
    if global.is_empty() { f64::NAN } else { mean_accuracy(global) }
}

/// The link counters of one shaped device, filled in once its socket exists.
pub(crate) type LinkSlot = Arc<Mutex<Option<LinkHandle>>>;

/// How simulated device `i` reaches the server at `server`: a certificate from `ca` under its
/// client id, the simulator's timers, and its modelled link (if any) around its socket, whose
/// counters land in the returned slot. Used by the real clock and by fleet workers alike.
pub(crate) fn device_options(
    config: &SimConfig,
    i: usize,
    server: SocketAddr,
    root: &quinn::rustls::pki_types::CertificateDer<'static>,
    ca: &mut ProjectCa,
    link: Option<DuplexProfile>,
) -> anyhow::Result<(ClientOptions, Option<LinkSlot>)> {
    let mut options = ClientOptions::new(server, root.clone(), client_id(i));
    let device = ca.issue(Kind::Client, &client_id(i), &[], 7)?;
    options.client_cert = Some(Arc::new(ClientCert { chain: vec![device.cert], key: device.key }));
    options.seed = config.seed.wrapping_add(1000 + i as u64);
    // The simulated server never restarts, so the devices' fast restart detection buys nothing
    // here; keep the timers the simulator's wire figures were measured with, and let a handshake
    // over a slow modelled link (or a busy host) take as long as it needs.
    options.keep_alive = std::time::Duration::from_secs(5);
    options.idle_timeout = std::time::Duration::from_secs(30);
    options.connect_timeout = options.idle_timeout;
    let Some(profile) = link else { return Ok((options, None)) };
    let (slot, seed): (LinkSlot, u64) = (Arc::new(Mutex::new(None)), config.seed.wrapping_add(5000 + i as u64));
    let filled = slot.clone();
    options.socket_wrapper = Some(SocketWrapper(Arc::new(move |socket| {
        let (shaped, handle) = ShapedSocket::new(socket, profile.clone(), seed)?;
        if let Ok(mut s) = filled.lock() {
            *s = Some(handle);
        }
        Ok(shaped as Arc<dyn quinn::AsyncUdpSocket>)
    })));
    Ok((options, Some(slot)))
}

fn handle_client_event(
    i: usize,
    event: ClientEvent,
    config: &SimConfig,
    devices: &[DeviceProfile],
    handles: &mut [tokio::task::JoinHandle<anyhow::Result<String>>],
    killed: &mut [bool],
    costs: &mut HashMap<u64, Vec<CostRecord>>,
) {
    match event {
        ClientEvent::RoundStarted { round } => {
            if !killed[i] && config.kill.iter().any(|k| k.client == i && k.round == round) {
                tracing::info!(client = i, round, "killing client (simulated crash)");
                handles[i].abort();
                killed[i] = true;
            }
        }
        ClientEvent::RoundDone { mut cost, .. } => {
            cost.joules = devices[i].joules(cost.compute_seconds, cost.transfer_seconds);
            costs.entry(cost.round).or_default().push(cost)
        }
        _ => {}
    }
}
