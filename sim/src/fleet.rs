//! Fleets beyond one process: simulated devices as worker processes over real QUIC.
//!
//! - [`run_worker`]: shard `index` of `of` of a scenario's clients, each a full client session
//!   with its own data share (the split is computed in full on every shard, so client i gets the
//!   same rows wherever it runs), its own link model around its socket and its own device
//!   profile, against a real server given by address. Training takes turns on one
//!   [`ComputePool`] per worker (one at a time; workers train in parallel).
//! - [`run_local`]: `anchorage fleet --local N` — a server in this process with its state folder
//!   in the run folder, N worker processes of this binary, and one run folder at the end with
//!   the same files as `anchorage sim` writes. The run's record is the server's: the ledger is
//!   read from the server's database (what the devices reported over QUIC), not collected from
//!   the workers.
//!
//! Certificates: one per device, issued by the worker from the project CA's folder, because the
//! server knows a client by the id in its certificate (one shared certificate would make every
//! device of a shard the same client). They are issued in memory for 7 days and not recorded in
//! the CA's index; give workers a CA made for the fleet, not the field project's.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anchorage_client::transport as client_transport;
use anchorage_pki::{Kind, ProjectCa};
use anchorage_server::RoundReport;
use anchorage_server::engine::EngineConfig;
use anchorage_server::methods::ServerMethod;
use anchorage_server::store::{ServerStore, read_ledger};
use anchorage_server::tls;
use anchorage_server::transport::{self as server_transport, Limits, ServerEvent, ServerHandle, ServerOptions};
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::tensor::ParamBlock;
use anyhow::Context;

use crate::accuracy::AccuracyRow;
use crate::config::SimConfig;
use crate::device::{Charge, ComputePool};
use crate::record::{RoundRow, RunSummary, SimResult, SummaryInputs, initial_of, write_run_folder};
use crate::run::device_options;
use crate::setup::{Evaluator, Setup};

/// The clients of shard `index` of `of`: contiguous, sizes differing by at most one.
pub fn shard(clients: usize, index: usize, of: usize) -> anyhow::Result<std::ops::Range<usize>> {
    anyhow::ensure!(of >= 1 && index < of, "shard {index} of {of}: the index must be below the count");
    Ok(clients * index / of..clients * (index + 1) / of)
}

/// Where a worker's devices connect.
#[derive(Debug, Clone)]
pub struct Target {
    pub server: SocketAddr,
    /// Other addresses the devices fail over to, in turn (a tier's other relays).
    pub fallbacks: Vec<SocketAddr>,
    /// The name in the server's certificate.
    pub server_name: String,
    /// The project CA's folder (ca.der and ca.key).
    pub ca_dir: PathBuf,
}

/// What a worker's devices did.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSummary {
    pub devices: usize,
    /// Devices that ended because the server finished the run.
    pub finished: usize,
    /// Rounds each device took part in, summed.
    pub rounds: u64,
}

/// Runs shard `index` of `of` of `config`'s clients against `target` until the server ends the
/// run; returns when every device has left.
pub async fn run_worker(config: &SimConfig, index: usize, of: usize, target: &Target) -> anyhow::Result<WorkerSummary> {
    config.relays_on_virtual_clock_only()?;
    let range = shard(config.federation.clients, index, of)?;
    let setup = Setup::for_clients(config, Charge::Sleep, range.clone())?;
    let mut ca = ProjectCa::open(&target.ca_dir)?.detached();
    let root = ca.cert().clone();
    let links = config.links()?;
    let pool = Arc::new(ComputePool::new(config.systems.training_threads())?);
    let mut handles = Vec::with_capacity(range.len());
    let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    // The worker's devices share one endpoint unless a link model gives one its own socket
    // (`client_transport::DeviceEndpoint`).
    let shared = client_transport::shared_endpoint(target.server)?;
    for (i, mut device) in range.clone().zip(setup.clients) {
        device.in_pool(pool.clone());
        let (mut options, _link) = device_options(config, i, target.server, &root, &mut ca, links[i].clone())?;
        options.server_name = target.server_name.clone();
        options.fallbacks = target.fallbacks.clone();
        options.shared_endpoint = Some(shared.clone());
        handles.push(tokio::spawn(client_transport::run(options, Box::new(device), Some(events_tx.clone()))));
    }
    drop(events_tx);
    tracing::info!(index, of, devices = range.len(), server = %target.server, "fleet worker started");
    let mut summary = WorkerSummary { devices: range.len(), finished: 0, rounds: 0 };
    let counting = async {
        let mut rounds = 0;
        while let Some(e) = events.recv().await {
            rounds += matches!(e, client_transport::ClientEvent::Acked { .. }) as u64;
        }
        rounds
    };
    let joined = async {
        let mut finished = 0;
        for h in handles {
            match h.await {
                Ok(Ok(reason)) => finished += reason.contains("finished") as usize,
                Ok(Err(e)) => tracing::warn!(error = %format!("{e:#}"), "a device ended with an error"),
                Err(e) => tracing::warn!(error = %e, "a device's task failed"),
            }
        }
        finished
    };
    let (rounds, finished) = tokio::join!(counting, joined);
    // The last devices' close frames leave before the worker does (the server then need not
    // wait out their idle timeouts).
    tokio::time::timeout(std::time::Duration::from_secs(2), shared.wait_idle()).await.ok();
    summary.rounds = rounds;
    summary.finished = finished;
    Ok(summary)
}

/// `anchorage fleet --local N`: a server here, `workers` worker processes of this binary, one
/// run folder in `out` (with the server's state folder in `out/state` and its CA in `out/ca`).
pub async fn run_local(config: SimConfig, workers: usize, out: &Path, progress: bool) -> anyhow::Result<SimResult> {
    anyhow::ensure!(workers >= 1, "a fleet needs at least one worker");
    config.relays_on_virtual_clock_only()?;
    let started = Instant::now();
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let Setup { engine, initial, evaluator, num_classes, headline, server_method, .. } =
        Setup::for_clients(&config, Charge::Sleep, 0..0)?;
    let schedule = engine.clone();
    let ca_dir = out.join("ca");
    let (mut server, db) = start_server(&config, out, &ca_dir, engine, server_method, initial.clone()).await?;
    let initial_accuracy = initial_of(&evaluator.evaluate(&initial, &[], 0)?);
    let scenario = out.join("fleet.toml");
    std::fs::write(&scenario, toml::to_string_pretty(&config)?)
        .with_context(|| format!("writing {}", scenario.display()))?;
    let mut children = start_workers(&scenario, &ca_dir, server.local_addr, workers, out)?;
    if progress {
        println!("anchorage fleet: {headline}, {workers} worker processes");
        println!("initial global accuracy {}", crate::record::percent(initial_accuracy));
    }

    let closed = follow_rounds(&mut server, &mut children, &schedule, &evaluator, out, progress).await?;
    wait_for_workers(&mut children).await;
    let metrics = server.metrics.clone();
    server.shutdown().await?;
    if progress {
        print_usage(workers);
    }

    // The run's record is the server's: every device's costs as they reached its ledger.
    let ledger: Vec<CostRecord> = read_ledger(&db)?;
    let inputs = SummaryInputs {
        initial_accuracy,
        chance: 1.0 / num_classes as f64,
        late_updates: closed.rounds.last().map(|(r, _)| r.late_total).unwrap_or(0),
        refused: metrics.refusals_total(),
        decode_errors: metrics.decode_errors_total(),
        wall_seconds: started.elapsed().as_secs_f64(),
        local_eval: crate::record::LocalEval::of(&config),
        privacy: crate::record::PrivacySpent::of(closed.rounds.iter().map(|(r, _)| r.as_ref())),
    };
    record_run(&config, out, ledger, closed, inputs)
}

/// Starts the fleet's server on a free port of 127.0.0.1, with a new CA in `ca_dir` and its state
/// folder in `out/state`; returns it and the path of its database.
async fn start_server(
    config: &SimConfig,
    out: &Path,
    ca_dir: &Path,
    engine: EngineConfig,
    method: Box<dyn ServerMethod>,
    initial: Vec<ParamBlock>,
) -> anyhow::Result<(ServerHandle, PathBuf)> {
    let mut ca = ProjectCa::init(ca_dir, "anchorage-fleet", 7)?;
    let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 7)?;
    let store = ServerStore::open(out.join("state"))?;
    let db = store.db_path().to_path_buf();
    let server = server_transport::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity,
        trust: tls::Trust::ProjectCa { ca: ca.cert().clone(), crl: None },
        engine,
        method,
        initial,
        // Every device of a local fleet comes from 127.0.0.1: the per-address handshake cap that
        // guards a field server would make them queue.
        limits: Limits {
            max_connections: config.federation.clients + 64,
            max_handshakes_per_ip: config.federation.clients.max(16),
            ..Limits::default()
        },
        store: Some(store),
    })
    .await?;
    Ok((server, db))
}

/// Starts `workers` processes of this binary, worker i running shard i of `workers` of the
/// scenario's clients against `server`, its output in `out/worker-<i>.log`.
fn start_workers(
    scenario: &Path,
    ca_dir: &Path,
    server: SocketAddr,
    workers: usize,
    out: &Path,
) -> anyhow::Result<Vec<tokio::process::Child>> {
    let exe = std::env::current_exe().context("finding this program to start the workers")?;
    let mut children = Vec::with_capacity(workers);
    for index in 0..workers {
        let log = std::fs::File::create(out.join(format!("worker-{index}.log")))?;
        let child = tokio::process::Command::new(&exe)
            .arg("fleet")
            .arg("--scenario")
            .arg(scenario)
            .args(["--index", &index.to_string(), "--of", &workers.to_string()])
            .args(["--server", &server.to_string(), "--ca"])
            .arg(ca_dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting worker {index} ({})", exe.display()))?;
        children.push(child);
    }
    Ok(children)
}

/// The rounds the server closed, each with its global accuracy, and their accuracy records.
struct Closed {
    rounds: Vec<(Arc<RoundReport>, f64)>,
    accuracy: Vec<AccuracyRow>,
}

/// Follows the server's rounds until the run ends, evaluating (and with `progress`, printing)
/// each; a worker that fails first ends the run with an error.
async fn follow_rounds(
    server: &mut ServerHandle,
    children: &mut [tokio::process::Child],
    schedule: &EngineConfig,
    evaluator: &Evaluator,
    out: &Path,
    progress: bool,
) -> anyhow::Result<Closed> {
    let mut closed = Closed { rounds: Vec::new(), accuracy: Vec::new() };
    loop {
        let event = tokio::select! {
            e = server.events.recv() => e,
            status = first_failure(children) => {
                anyhow::bail!("a worker stopped before the run ended ({status}); see {}/worker-*.log", out.display())
            }
        };
        match event {
            Some(ServerEvent::RoundClosed { report, checkpoint }) => {
                let task = schedule.task_of(report.round);
                let (acc, rows) = evaluator.evaluate_round(&report, &checkpoint, task)?;
                closed.accuracy.extend(rows);
                if progress {
                    println!(
                        "round {:>4}  accuracy {:>6.2}%  clients {}/{}  {:.2} s",
                        report.round,
                        acc * 100.0,
                        report.updates.len(),
                        report.sampled,
                        report.seconds()
                    );
                }
                closed.rounds.push((report, acc));
            }
            Some(ServerEvent::Finished) | None => break,
        }
    }
    Ok(closed)
}

/// Waits up to 30 s for each worker to leave, stopping one that does not.
async fn wait_for_workers(children: &mut [tokio::process::Child]) {
    for (index, child) in children.iter_mut().enumerate() {
        match tokio::time::timeout(Duration::from_secs(30), child.wait()).await {
            Ok(Ok(status)) if status.success() => {}
            Ok(Ok(status)) => tracing::warn!(index, %status, "a worker ended with an error"),
            Ok(Err(e)) => tracing::warn!(index, error = %e, "could not wait for a worker"),
            Err(_) => {
                tracing::warn!(index, "a worker did not leave in time; stopping it");
                let _ = child.kill().await;
            }
        }
    }
}

/// Prints the peak memory and CPU time of this process and of the `workers` worker processes.
fn print_usage(workers: usize) {
    if let Some((peak, cpu)) = own_usage() {
        println!("server process (server and evaluator): peak RSS {:.1} MiB, CPU {cpu:.1} s", peak as f64 / 1048576.0);
    }
    if let Some((peak, cpu)) = workers_usage() {
        println!(
            "worker processes: largest peak RSS {:.1} MiB, CPU {cpu:.1} s in all ({workers} workers)",
            peak as f64 / 1048576.0
        );
    }
}

/// The run's summary from the server's `ledger` and the `closed` rounds, written as the run
/// folder `out`.
fn record_run(
    config: &SimConfig,
    out: &Path,
    ledger: Vec<CostRecord>,
    closed: Closed,
    inputs: SummaryInputs,
) -> anyhow::Result<SimResult> {
    let rows: Vec<RoundRow> = closed
        .rounds
        .iter()
        .map(|(report, acc)| {
            let costs: Vec<CostRecord> = ledger.iter().filter(|c| c.round == report.round).cloned().collect();
            RoundRow::from_report(report, *acc, &costs)
        })
        .collect();
    let summary = RunSummary::new(inputs, rows, &ledger, &closed.accuracy);
    write_run_folder(out, &crate::scenario::effective_toml(config)?, &summary, &ledger, &closed.accuracy)?;
    let reports = closed.rounds.iter().map(|(r, _)| (**r).clone()).collect();
    Ok(SimResult {
        summary,
        ledger,
        reports,
        run_dir: Some(out.to_path_buf()),
        link_stats: Vec::new(),
        accuracy: closed.accuracy,
        tier: None,
    })
}

/// This process's peak resident memory (bytes) and CPU seconds (user + system).
fn own_usage() -> Option<(u64, f64)> {
    usage(libc::RUSAGE_SELF)
}

/// The finished worker processes' largest peak resident memory (bytes) and their CPU seconds
/// (user + system, all of them together).
fn workers_usage() -> Option<(u64, f64)> {
    usage(libc::RUSAGE_CHILDREN)
}

/// getrusage(`who`): the peak resident memory and the CPU seconds it reports.
fn usage(who: libc::c_int) -> Option<(u64, f64)> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a whole rusage into the pointer it is given, which is valid.
    if unsafe { libc::getrusage(who, usage.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: zeroed, then filled in by a successful getrusage.
    let usage = unsafe { usage.assume_init() };
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    // ru_maxrss is in KiB on Linux.
    Some((usage.ru_maxrss as u64 * 1024, seconds(usage.ru_utime) + seconds(usage.ru_stime)))
}

/// Waits until one of `children` exits with a failure (a worker that ends well, because the
/// server told its devices the run is over, is not one); says which and how.
async fn first_failure(children: &mut [tokio::process::Child]) -> String {
    loop {
        for (i, c) in children.iter_mut().enumerate() {
            if let Ok(Some(status)) = c.try_wait()
                && !status.success()
            {
                return format!("worker {i}: {status}");
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
