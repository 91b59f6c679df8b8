//! Whether a deployment learns and whether it moves, the way its operator sees it: the server
//! program as a process (mutual TLS, the metrics port), devices training over real QUIC on
//! loopback, and what the log, `/metrics` and `/readyz` then say.
//!
//! - every closed round has one log line: its outcome, updates of target and invited, the ids
//!   of the missing devices, the devices' own accuracy, the held-out accuracy (`[evaluation]` on
//!   the embedded synthetic set), its duration; `/metrics` carries both accuracies;
//! - a device that goes away leaves the server waiting for it: `anchorage_waiting_for_devices`,
//!   `anchorage_waiting_since_seconds`, a log line, and once the wait outlasts a round's deadline
//!   "stalled: waiting for 1 device since …" in the log and in `/readyz`'s body (still 200);
//! - a server restarted on a finished run says at once that the run is over (log, `/readyz`,
//!   `anchorage_run_finished 1`) and tells a device that connects.
//!
//! `ANCHORAGE_QUALITY_STATE=DIR` keeps the finished state folder and log.
//! `ANCHORAGE_QUALITY_CSV=FILE` (and `ANCHORAGE_QUALITY_ROUNDS=N`, default 4) write the
//! accuracy series scraped from `/metrics` after every round, the dashboard panel's data.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anchorage_client::methods::{ClientMethod, FedAvgClient, MethodContext};
use anchorage_client::transport::{self as client, Backoff, ClientCert, ClientEvent, ClientOptions};
use anchorage_data::{SyntheticConfig, synthetic};
use anchorage_pki::Kind;
use anchorage_tests::process::{Ending, ServerProcess, close_peers, http_get};

/// The seed of the embedded synthetic set the devices share and the server holds out.
const SEED: u64 = 11;

fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

fn server_process(dir: &Path, devices: usize) -> (ServerProcess, SocketAddr) {
    let mut server = ServerProcess::new(dir, Path::new(env!("CARGO_BIN_EXE_server-process")), devices);
    let metrics = server.with_metrics();
    (server, metrics)
}

/// Replaces `from` by `to` in server.toml (which must hold it).
fn edit_config(server: &ServerProcess, from: &str, to: &str) {
    let text = std::fs::read_to_string(&server.config).unwrap();
    assert!(text.contains(from), "{from} in {text}");
    std::fs::write(&server.config, text.replace(from, to)).unwrap();
}

fn wait_ready(server: &ServerProcess, metrics: SocketAddr) {
    let cap = Instant::now() + Duration::from_secs(60);
    while http_get(metrics, "/readyz").map(|(code, _)| code).ok() != Some(200) {
        assert!(Instant::now() < cap, "ready within 60 s: {}", server.log_tail());
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn log(server: &ServerProcess) -> String {
    std::fs::read_to_string(&server.log).unwrap_or_default()
}

/// Waits (60 s at most) until the server's log holds `what`.
fn wait_log(server: &ServerProcess, what: &str) -> String {
    let cap = Instant::now() + Duration::from_secs(60);
    loop {
        let text = log(server);
        if text.contains(what) {
            return text;
        }
        assert!(Instant::now() < cap, "`{what}` in the log within 60 s:\n{}", server.log_tail());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits (60 s at most) for a line of the server's log that `holds`.
fn wait_line(server: &ServerProcess, holds: impl Fn(&str) -> bool) -> String {
    let cap = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(line) = log(server).lines().find(|l| holds(l)) {
            return line.to_string();
        }
        assert!(Instant::now() < cap, "a log line within 60 s:\n{}", server.log_tail());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Scrapes `/metrics` until `done` holds (60 s at most).
fn scrape_until(metrics: SocketAddr, what: &str, done: impl Fn(&str) -> bool) -> String {
    let cap = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, text) = http_get(metrics, "/metrics").unwrap();
        assert_eq!(status, 200);
        if done(&text) {
            return text;
        }
        assert!(Instant::now() < cap, "{what} within 60 s:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Device `index` of `of`: FedAvg on its IID share of the training half of the embedded
/// synthetic set of [`SEED`] (40 images per class in all), its own test split beside it.
fn fedavg_device(index: usize, of: usize) -> Box<dyn ClientMethod> {
    let (all, _) = synthetic::generate(&SyntheticConfig {
        train_per_class: 40,
        test_per_class: 1,
        seed: SEED,
        ..SyntheticConfig::default()
    });
    let parts = anchorage_data::partition::iid(all.len(), of, SEED);
    let (train, test) = all.subset(&parts[index]).split_per_class(0.8, SEED ^ index as u64);
    let context = MethodContext::embedded(
        &train,
        &test,
        burn::tensor::Device::flex().autodiff(),
        anchorage_model::train::OptimizerKind::Adam,
        anchorage_shared::tensor::Encoding::F32,
        index as u64,
    );
    Box::new(FedAvgClient::new(context, &anchorage_shared::method::MethodConfig::default()).unwrap())
}

/// A device with its own certificate, running until `stop` or the server's goodbye.
fn spawn_device(
    server: &mut ServerProcess,
    id: &str,
    method: Box<dyn ClientMethod>,
    stop: tokio::sync::watch::Receiver<bool>,
    events: tokio::sync::mpsc::UnboundedSender<ClientEvent>,
) -> tokio::task::JoinHandle<anyhow::Result<String>> {
    let mut options = ClientOptions::new(server.addr, server.cert.clone(), id);
    let identity = server.ca.issue(Kind::Client, id, &[], 30).unwrap();
    options.client_cert = Some(Arc::new(ClientCert { chain: vec![identity.cert], key: identity.key }));
    options.backoff = Backoff { initial: Duration::from_millis(100), max: Duration::from_secs(1), max_attempts: None };
    options.stop = Some(stop);
    tokio::spawn(client::run(options, method, Some(events)))
}

/// The `round closed` lines of the log.
fn round_lines(log: &str) -> Vec<&str> {
    log.lines().filter(|l| l.contains("round closed")).collect()
}

/// The accuracy series, scraped from `/metrics` after every round: (seconds since the server
/// was ready, round, device accuracy, held-out accuracy).
type Series = Vec<(f64, u64, f64, f64)>;

#[test]
fn every_round_logs_and_exports_the_devices_accuracy_and_the_held_out_accuracy() {
    let rounds: u64 = std::env::var("ANCHORAGE_QUALITY_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    let dir = tempfile::tempdir().unwrap();
    let (mut server, metrics) = server_process(dir.path(), 2);
    // The operator's held-out set: the test half of the devices' embedded set, which no device
    // trains on, evaluated after every round with the method's own prediction.
    server.append_config(&format!("[evaluation]\ndata = {{ source = \"synthetic\", seed = {SEED} }}\nevery = 1"));
    // A small learning rate, so that the series climbs over the rounds instead of jumping.
    edit_config(&server, "learning_rate = 0.001", "learning_rate = 0.0002");
    server.spawn();
    wait_ready(&server, metrics);
    assert!(log(&server).contains("held-out evaluation of the global model"), "{}", server.log_tail());

    // Scrapes every 100 ms, as Prometheus would, and keeps one point per evaluated round.
    let scraping = Arc::new(AtomicBool::new(true));
    let scraper = {
        let scraping = scraping.clone();
        let start = Instant::now();
        std::thread::spawn(move || {
            let mut series: Series = Vec::new();
            while scraping.load(Ordering::SeqCst) {
                if let Ok((200, text)) = http_get(metrics, "/metrics") {
                    let round = value(&text, "anchorage_round_held_out_evaluated_round");
                    let device = value(&text, "anchorage_round_device_accuracy");
                    let held_out = value(&text, "anchorage_round_held_out_accuracy");
                    if let (Some(r), Some(d), Some(h)) = (round, device, held_out)
                        && series.last().is_none_or(|(_, last, _, _)| *last != r as u64)
                    {
                        series.push((start.elapsed().as_secs_f64(), r as u64, d, h));
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            series
        })
    };

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let devices: Vec<_> = (0..2)
            .map(|i| {
                spawn_device(&mut server, &format!("edge-{i:03}"), fedavg_device(i, 2), stop_rx.clone(), events.clone())
            })
            .collect();
        let mut done = 0;
        while done < 2 * rounds {
            match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await {
                Ok(Some(ClientEvent::RoundDone { .. })) => done += 1,
                Ok(Some(_)) => {}
                other => panic!("{rounds} rounds of two devices within 120 s each ({other:?}): {}", server.log_tail()),
            }
        }
        // The last round's evaluation is scraped before the devices leave.
        scrape_until(metrics, "the last round's held-out evaluation", |t| {
            value(t, "anchorage_round_held_out_evaluated_round").is_some_and(|r| r >= rounds as f64)
        });
        let _ = stop.send(true);
        for d in devices {
            let _ = tokio::time::timeout(Duration::from_secs(10), d).await;
        }
    });
    // The scraper may have missed no round: wait for it to see the last one.
    std::thread::sleep(Duration::from_millis(300));
    scraping.store(false, Ordering::SeqCst);
    let series = scraper.join().unwrap();

    let text = http_get(metrics, "/metrics").unwrap().1;
    for line in text.lines().filter(|l| l.contains("anchorage_round_") || l.contains("anchorage_waiting_")) {
        println!("{line}");
    }
    let v = |s: &str| value(&text, s).unwrap_or_else(|| panic!("{s} in\n{text}"));
    let (device, held_out) = (v("anchorage_round_device_accuracy"), v("anchorage_round_held_out_accuracy"));
    println!("after round {}: device accuracy {device:.3}, held-out accuracy {held_out:.3}", v("anchorage_last_round"));
    assert!((0.0..=1.0).contains(&device) && (0.0..=1.0).contains(&held_out), "{text}");
    assert_eq!(v("anchorage_round_device_accuracy_reports"), 2.0);
    assert!(v("anchorage_round_held_out_evaluated_round") >= rounds as f64);
    assert_eq!(v("anchorage_round_missing_devices"), 0.0);
    // Ten classes: chance is 10%; a few rounds of FedAvg on this set learn far beyond it.
    assert!(held_out > 0.3 && device > 0.3, "device {device}, held out {held_out}:\n{}", server.log_tail());

    // One line per closed round, with both accuracies.
    let text = log(&server);
    let lines = round_lines(&text);
    for line in &lines {
        println!("{line}");
    }
    assert!(lines.len() as u64 >= rounds, "{text}");
    for (i, line) in lines.iter().take(rounds as usize).enumerate() {
        assert!(line.contains(" INFO ") && line.contains(&format!("round={}", i + 1)), "{line}");
        for field in
            ["outcome=aggregated", "updates=2", "target=2", "invited=2", "missing=0", "missing_ids=-", "seconds="]
        {
            assert!(line.contains(field), "{field} in {line}");
        }
        assert!(line.contains("device_accuracy=") && line.contains("% (2 of 2 reporting)"), "{line}");
        assert!(line.contains("held_out_accuracy=") && line.contains('%'), "{line}");
    }
    assert_eq!(text.matches("round summary").count(), 0, "one line per round:\n{text}");

    // The series the dashboard's accuracy panel draws.
    println!("seconds,round,device_accuracy,held_out_accuracy");
    for (t, r, d, h) in &series {
        println!("{t:.1},{r},{d:.4},{h:.4}");
    }
    assert!(series.len() as u64 >= rounds.min(2), "a point per round: {series:?}");
    if let Ok(path) = std::env::var("ANCHORAGE_QUALITY_CSV") {
        let mut csv = "seconds,round,device_accuracy,held_out_accuracy\n".to_string();
        for (t, r, d, h) in &series {
            csv.push_str(&format!("{t:.3},{r},{d},{h}\n"));
        }
        std::fs::write(&path, csv).unwrap();
        println!("series written to {path}");
    }
    server.stop(Ending::Term);
    // The held-out accuracy joined each evaluated round's stored report (its checksum rewritten:
    // a report that failed it would be left out here), so `anchorage report <state_dir>` shows it.
    let reports = anchorage_server::store::read_round_reports(&server.db()).unwrap();
    let evaluated: Vec<(u64, f64)> = reports.iter().filter_map(|r| r.held_out_accuracy.map(|a| (r.round, a))).collect();
    println!("stored held-out accuracies: {evaluated:?}");
    assert!(
        reports.len() as u64 >= rounds && evaluated.len() as u64 >= rounds,
        "{evaluated:?} of {} reports",
        reports.len()
    );
    assert!(evaluated.iter().all(|(_, a)| (0.0..=1.0).contains(a)), "{evaluated:?}");
    // `ANCHORAGE_QUALITY_STATE=DIR` keeps the finished server's state folder and log, for
    // `anchorage report DIR/state` (how the note's report was made).
    if let Ok(keep) = std::env::var("ANCHORAGE_QUALITY_STATE") {
        let keep = Path::new(&keep);
        std::fs::create_dir_all(keep.join("state")).unwrap();
        for entry in std::fs::read_dir(dir.path().join("state")).unwrap() {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_file() {
                std::fs::copy(entry.path(), keep.join("state").join(entry.file_name())).unwrap();
            }
        }
        std::fs::copy(&server.log, keep.join("server.log")).unwrap();
        println!("state folder kept in {}", keep.display());
    }
}

#[test]
fn a_device_that_goes_away_leaves_a_visible_stall() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, metrics) = server_process(dir.path(), 2);
    // Rounds of 3 s: the round without the missing device closes at its deadline, and a wait
    // for devices longer than that is a stall.
    edit_config(&server, "round_deadline = 60000", "round_deadline = 3000");
    server.spawn();
    wait_ready(&server, metrics);

    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        // `gone-0000` says hello and never trains; edge-000 trains.
        let silent = server.connect_peers("gone", 1).await;
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let device = spawn_device(&mut server, "edge-000", fedavg_device(0, 2), stop_rx, events);
        loop {
            match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await {
                Ok(Some(ClientEvent::RoundDone { .. })) => break,
                Ok(Some(_)) => {}
                other => panic!("edge-000's first round within 120 s ({other:?}): {}", server.log_tail()),
            }
        }
        // The silent device goes away for good: round 1 closes at its deadline without it, and
        // no round opens with one device of min_available = 2.
        close_peers(silent).await;
        let line = wait_line(&server, |l| l.contains("round closed") && l.contains("round=1 "));
        println!("{line}");
        for field in ["outcome=aggregated", "updates=1", "target=2", "invited=2", "missing=1", "missing_ids=gone-0000"]
        {
            assert!(line.contains(field), "{field} in {line}");
        }
        assert!(line.contains("device_accuracy=") && line.contains("(1 of 1 reporting)"), "{line}");
        assert!(line.contains("held_out_accuracy=off"), "{line}");

        let text = scrape_until(metrics, "the wait for a device", |t| {
            value(t, "anchorage_waiting_for_devices") == Some(1.0)
                && value(t, "anchorage_clients_connected") == Some(1.0)
        });
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        let since = value(&text, "anchorage_waiting_since_seconds").unwrap();
        assert!(since > 0.0 && now - since < 60.0, "waiting since {since}, now {now}");
        assert_eq!(value(&text, "anchorage_round_missing_devices"), Some(1.0), "{text}");
        assert!(value(&text, "anchorage_round_device_accuracy").is_some(), "{text}");
        assert_eq!(value(&text, "anchorage_run_finished"), Some(0.0));
        wait_log(&server, "waiting for 1 device before the next round opens: 1 of min_available = 2 connected");

        // Past a round's deadline the wait is a stall: /readyz stays 200 (the server must keep
        // taking devices) and says why no round opens.
        let cap = Instant::now() + Duration::from_secs(30);
        let body = loop {
            let (code, body) = http_get(metrics, "/readyz").unwrap();
            assert_eq!(code, 200, "{body}");
            if body.contains("stalled") {
                break body;
            }
            assert!(Instant::now() < cap, "a stall in /readyz within 30 s: {body:?}");
            std::thread::sleep(Duration::from_millis(100));
        };
        println!("/readyz: {body}");
        assert!(body.starts_with("ready\nstalled: waiting for 1 device since "), "{body}");
        assert!(body.contains("1 of min_available = 2 connected"), "{body}");
        let log = wait_log(&server, "stalled: waiting for 1 device since");
        println!("{}", log.lines().find(|l| l.contains("stalled:")).unwrap());
        let _ = stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(10), device).await;
    });
    server.stop(Ending::Term);
}

#[test]
fn a_finished_run_restarted_on_its_state_says_the_run_is_over() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, metrics) = server_process(dir.path(), 1);
    edit_config(&server, "rounds = 0", "rounds = 1");
    server.spawn();
    wait_ready(&server, metrics);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let run_device = |server: &mut ServerProcess| {
        runtime.block_on(async {
            let (_stop, stop_rx) = tokio::sync::watch::channel(false);
            let (events, _rx) = tokio::sync::mpsc::unbounded_channel();
            let device = spawn_device(server, "edge-000", fedavg_device(0, 1), stop_rx, events);
            let ended = tokio::time::timeout(Duration::from_secs(120), device).await;
            ended.expect("the device ends within 120 s").unwrap()
        })
    };
    // The one round; the server says goodbye and exits.
    let said = run_device(&mut server).expect("the device finishes");
    println!("device: {said}");
    let cap = Instant::now() + Duration::from_secs(30);
    while server.child.as_mut().unwrap().try_wait().unwrap().is_none() {
        assert!(Instant::now() < cap, "the server exits after its last round: {}", server.log_tail());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(log(&server).contains("all rounds done"));
    server.child = None;

    // Restarted on its state: it says at once that the run is over, and stays up for devices.
    std::fs::write(&server.log, "").unwrap();
    server.spawn();
    wait_ready(&server, metrics);
    let text = wait_log(&server, "the run is over");
    let line = text.lines().find(|l| l.contains("the run is over")).unwrap();
    println!("{line}");
    assert!(line.contains("WARN") && line.contains("all 1 configured rounds closed before this start"), "{line}");
    let (code, body) = http_get(metrics, "/readyz").unwrap();
    println!("/readyz: {body}");
    assert_eq!(code, 200);
    assert!(body.starts_with("ready\nfinished: the run is over: all 1 configured rounds have closed"), "{body}");
    let scraped = http_get(metrics, "/metrics").unwrap().1;
    assert_eq!(value(&scraped, "anchorage_run_finished"), Some(1.0), "{scraped}");
    assert_eq!(value(&scraped, "anchorage_waiting_for_devices"), Some(0.0), "a finished run waits for nobody");
    // A device that connects is told, and stops.
    let said = run_device(&mut server).expect("the device stops on the server's goodbye");
    assert!(said.contains("finished"), "{said}");
    assert!(server.child.as_mut().unwrap().try_wait().unwrap().is_none(), "still serving: {}", server.log_tail());
    server.stop(Ending::Term);
}
