//! Running one simulated federation over real QUIC on loopback.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anchorage_client::transport::{self as client_transport, ClientCert, ClientEvent, ClientOptions, SocketWrapper};
use anchorage_pki::{Kind, ProjectCa};
use anchorage_server::engine::EngineConfig;
use anchorage_server::methods::ServerMethod;
use anchorage_server::tls;
use anchorage_server::transport::{self as server_transport, Limits, ServerEvent, ServerHandle, ServerOptions};
use anchorage_shared::ParamBlock;
use anchorage_shared::ledger::CostRecord;
use quinn::rustls::pki_types::CertificateDer;
use tokio::sync::mpsc;

use crate::config::{Clock, SimConfig};
use crate::device::{Charge, DeviceProfile};
use crate::network::{DuplexProfile, LinkHandle, ShapedSocket};
use crate::record::{RoundRow, RunSummary, SimResult, SummaryInputs, initial_of};
use crate::recorder::Recorder;
use crate::setup::{Setup, client_id};

/// Runs the federation silently, with no run folder (tests, benches).
pub async fn run(config: SimConfig) -> anyhow::Result<SimResult> {
    run_recorded(config, &mut Recorder::silent()).await
}

/// Runs the federation, reporting each round to `recorder` (console and run folder) as it
/// closes; a stop request ends the run after the round in flight.
pub async fn run_recorded(config: SimConfig, recorder: &mut Recorder) -> anyhow::Result<SimResult> {
    config.relays_on_virtual_clock_only()?;
    let started = Instant::now();
    let Setup { engine, initial, clients, evaluator, devices, num_classes, headline, server_method, .. } =
        Setup::new(&config, Charge::Sleep)?;
    let schedule = engine.clone();

    let (mut server, cert, mut ca) = start_server(engine, server_method, initial.clone()).await?;
    let initial_global = evaluator.evaluate(&initial, &[], 0)?;
    let initial_accuracy = initial_of(&initial_global);
    let chance = 1.0 / num_classes as f64;
    let fleet = Fleet::spawn(&config, clients, server.local_addr, &cert, &mut ca)?;
    let Fleet { mut handles, link_handles, mut events } = fleet;
    recorder.start(
        &headline,
        (!initial_global.is_empty()).then_some(initial_accuracy),
        chance,
        config.federation.rounds,
    )?;

    let mut record = RealRecord { killed: vec![false; handles.len()], ..RealRecord::default() };
    // A stop request is polled between events; the round in flight still closes.
    let mut poll_stop = tokio::time::interval(Duration::from_millis(100));
    let mut stopping = false;
    loop {
        tokio::select! {
            event = server.events.recv() => match event {
                Some(ServerEvent::RoundClosed { report, checkpoint }) => {
                    let task = schedule.task_of(report.round);
                    let costs = record.collect_costs(&report, &mut events, &config, &devices, &mut handles).await;
                    let (acc, new_rows) = evaluator.evaluate_round(&report, &checkpoint, task)?;
                    record.round_closed(&report, acc, new_rows, costs, recorder)?;
                    if recorder.stop_requested().is_some() {
                        stopping = true;
                        break;
                    }
                }
                Some(ServerEvent::Finished) | None => break,
            },
            Some((i, e)) = events.recv() => record.client_event(i, e, &config, &devices, &mut handles),
            _ = poll_stop.tick() => {
                // Announces the stop once; the loop ends when the round in flight closes.
                let _ = recorder.stop_requested();
            }
        }
    }
    wait_for_clients(handles, stopping).await;
    let metrics = server.metrics.clone();
    server.shutdown().await?;

    let inputs = SummaryInputs {
        initial_accuracy,
        chance,
        late_updates: record.reports.last().map(|r| r.late_total).unwrap_or(0),
        refused: metrics.refusals_total(),
        decode_errors: metrics.decode_errors_total(),
        wall_seconds: started.elapsed().as_secs_f64(),
        local_eval: crate::record::LocalEval::of(&config),
        privacy: crate::record::PrivacySpent::of(record.reports.iter()),
    };
    let RealRecord { ledger, rows, reports, accuracy_rows, .. } = record;
    let mut summary = RunSummary::new(inputs, rows, &ledger, &accuracy_rows);
    summary.probes = evaluator.last_probes()?;
    recorder.finish(&mut summary, &ledger, &accuracy_rows, None)?;
    let link_stats = link_handles
        .iter()
        .map(|h| h.as_ref().and_then(|slot| slot.lock().ok().and_then(|s| s.as_ref().map(LinkHandle::stats))))
        .collect();
    let run_dir = recorder.dir().map(|d| d.to_path_buf());
    Ok(SimResult { summary, ledger, reports, run_dir, link_stats, accuracy: accuracy_rows, tier: None })
}

/// The server on loopback with a certificate from a project CA that lives only in this process:
/// mutual TLS, as in the field, with no set-up. Returns the CA too, which issues the devices'.
async fn start_server(
    engine: EngineConfig,
    method: Box<dyn ServerMethod>,
    initial: Vec<ParamBlock>,
) -> anyhow::Result<(ServerHandle, CertificateDer<'static>, ProjectCa)> {
    let mut ca = ProjectCa::in_memory("anchorage-sim", 7)?;
    let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 7)?;
    let cert = ca.cert().clone();
    let server = server_transport::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity,
        trust: tls::Trust::ProjectCa { ca: cert.clone(), crl: None },
        engine,
        method,
        initial,
        limits: Limits::default(),
        store: None,
    })
    .await?;
    Ok((server, cert, ca))
}

/// The simulated devices on the real clock: each one's transport task, its link counters, and
/// the events they all send (tagged with the device's index).
struct Fleet {
    handles: Vec<tokio::task::JoinHandle<anyhow::Result<String>>>,
    link_handles: Vec<Option<LinkSlot>>,
    events: mpsc::UnboundedReceiver<(usize, ClientEvent)>,
}

impl Fleet {
    /// Starts every client of `clients` against the server at `server`, one training at a time
    /// (see ComputePool: compute seconds in the ledger measure work, not contention).
    fn spawn(
        config: &SimConfig,
        clients: Vec<crate::device::SimulatedDevice<Box<dyn anchorage_client::methods::ClientMethod>>>,
        server: SocketAddr,
        cert: &CertificateDer<'static>,
        ca: &mut ProjectCa,
    ) -> anyhow::Result<Self> {
        let (event_tx, events) = mpsc::unbounded_channel::<(usize, ClientEvent)>();
        let mut handles = Vec::new();
        let mut link_handles = Vec::new();
        let links = config.links()?;
        let pool = Arc::new(crate::device::ComputePool::new(config.systems.training_threads())?);
        // One endpoint for every device without a link model of its own (a per-device endpoint
        // costs a 3 MB receive buffer and a driver task: `client_transport::DeviceEndpoint`).
        let shared = client_transport::shared_endpoint(server)?;
        for (i, mut method) in clients.into_iter().enumerate() {
            method.in_pool(pool.clone());
            if let Some(k) = config.systems.kill.iter().filter(|k| k.client == i).map(|k| k.round).min() {
                method.crash_in(k);
            }
            let (mut options, link) = device_options(config, i, server, cert, ca, links[i].clone())?;
            options.shared_endpoint = Some(shared.clone());
            link_handles.push(link);
            let (tx, (ctx, mut crx)) = (event_tx.clone(), mpsc::unbounded_channel::<ClientEvent>());
            tokio::spawn(async move {
                while let Some(e) = crx.recv().await {
                    let _ = tx.send((i, e));
                }
            });
            handles.push(tokio::spawn(client_transport::run(options, Box::new(method), Some(ctx))));
        }
        Ok(Self { handles, link_handles, events })
    }
}

/// What the real clock's run has recorded so far.
#[derive(Default)]
struct RealRecord {
    ledger: Vec<CostRecord>,
    costs_by_round: HashMap<u64, Vec<CostRecord>>,
    rows: Vec<RoundRow>,
    reports: Vec<anchorage_server::RoundReport>,
    accuracy_rows: Vec<crate::accuracy::AccuracyRow>,
    killed: Vec<bool>,
}

impl RealRecord {
    /// A client's event: a round start that a `kill` entry names aborts the client (a
    /// simulated crash); a finished round's cost record is filed under its round.
    fn client_event(
        &mut self,
        i: usize,
        event: ClientEvent,
        config: &SimConfig,
        devices: &[Arc<DeviceProfile>],
        handles: &mut [tokio::task::JoinHandle<anyhow::Result<String>>],
    ) {
        match event {
            ClientEvent::RoundStarted { round }
                if !self.killed[i] && config.systems.kill.iter().any(|k| k.client == i && k.round == round) =>
            {
                tracing::info!(client = i, round, "killing client (simulated crash)");
                handles[i].abort();
                self.killed[i] = true;
            }
            ClientEvent::RoundDone { mut cost, .. } => {
                cost.joules = devices[i].joules(cost.compute_seconds, cost.transfer_seconds);
                self.costs_by_round.entry(cost.round).or_default().push(cost)
            }
            _ => {}
        }
    }

    /// The cost records of a closed round. Its acks are on their way: the clients get a moment
    /// (3 s at most) to file their costs, and every event meanwhile is handled.
    async fn collect_costs(
        &mut self,
        report: &anchorage_server::RoundReport,
        events: &mut mpsc::UnboundedReceiver<(usize, ClientEvent)>,
        config: &SimConfig,
        devices: &[Arc<DeviceProfile>],
        handles: &mut [tokio::task::JoinHandle<anyhow::Result<String>>],
    ) -> Vec<CostRecord> {
        let waiting = report.updates.len();
        let deadline = Instant::now() + Duration::from_secs(3);
        while self.costs_by_round.get(&report.round).map_or(0, |v| v.len()) < waiting && Instant::now() < deadline {
            match tokio::time::timeout(Duration::from_millis(50), events.recv()).await {
                Ok(Some((i, e))) => self.client_event(i, e, config, devices, handles),
                Ok(None) => break,
                Err(_) => {}
            }
        }
        self.costs_by_round.remove(&report.round).unwrap_or_default()
    }

    /// A closed round: its row, costs and accuracy records, told to `recorder`.
    fn round_closed(
        &mut self,
        report: &anchorage_server::RoundReport,
        accuracy: f64,
        new_rows: Vec<crate::accuracy::AccuracyRow>,
        costs: Vec<CostRecord>,
        recorder: &mut Recorder,
    ) -> anyhow::Result<()> {
        let row = RoundRow::from_report(report, accuracy, &costs);
        recorder.round(&row, &costs, &new_rows, None)?;
        self.accuracy_rows.extend(new_rows);
        self.ledger.extend(costs);
        self.rows.push(row);
        self.reports.push(report.clone());
        Ok(())
    }
}

/// Clients received their goodbye: waits for them to leave (5 s each at most). A stopped run's
/// clients get no goodbye: they are aborted.
async fn wait_for_clients(handles: Vec<tokio::task::JoinHandle<anyhow::Result<String>>>, stopping: bool) {
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
}

/// Runs the federation on the clock its configuration names (what `anchorage sim` does).
pub fn run_on_clock(config: SimConfig, recorder: &mut Recorder) -> anyhow::Result<SimResult> {
    match config.systems.clock {
        Clock::Real => {
            let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
            runtime.block_on(run_recorded(config, recorder))
        }
        Clock::Virtual => crate::virtual_clock::run_virtual_recorded(&config, recorder),
    }
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
    options.seed = config.federation.seed.wrapping_add(1000 + i as u64);
    // The simulated server never restarts, so the devices' fast restart detection buys nothing
    // here; keep the timers the simulator's wire figures were measured with, and let a handshake
    // over a slow modelled link (or a busy host) take as long as it needs.
    options.keep_alive = crate::virtual_clock::quic::DEVICE_KEEP_ALIVE;
    options.idle_timeout = crate::virtual_clock::quic::DEVICE_IDLE_TIMEOUT;
    options.connect_timeout = options.idle_timeout;
    options.resume_uploads = config.systems.resume_uploads;
    options.resume_broadcasts = config.systems.resume_broadcasts;
    options.secure_aggregation = config.secagg.enabled;
    let Some(profile) = link else { return Ok((options, None)) };
    let (slot, seed): (LinkSlot, u64) =
        (Arc::new(Mutex::new(None)), config.federation.seed.wrapping_add(5000 + i as u64));
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
