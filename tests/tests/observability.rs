//! The server's metrics port, the way Prometheus and a probe see it: the server program as a
//! process with mutual TLS and `metrics_bind`, a device training two rounds over real QUIC on
//! loopback, then `GET /healthz`, `/readyz` and `/metrics` over HTTP. Every metric that
//! deploy/observability's Grafana dashboard and alert rules query is exported, with the values
//! the rounds gave; after a restart the totals the store keeps are exported again.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anchorage_client::transport::{self as client, Backoff, ClientCert, ClientEvent, ClientOptions};
use anchorage_pki::Kind;
use anchorage_tests::process::{Ending, ServerProcess, http_get};

/// The sample names of an exposition, and the names its `# TYPE` lines declare.
fn exported_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            names.extend(rest.split(' ').next().map(str::to_string));
        } else if !line.starts_with('#') && !line.is_empty() {
            names.extend(line.split(['{', ' ']).next().map(str::to_string));
        }
    }
    names
}

/// The value of one series (its full name and labels as the exposition writes them).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Metric names in PromQL expressions: `anchorage_…` and `process_…` words.
fn queried_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let bytes = expr.as_bytes();
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b':';
    let mut i = 0;
    while i < bytes.len() {
        if word(bytes[i]) && (i == 0 || !word(bytes[i - 1])) {
            let end = (i..bytes.len()).find(|&j| !word(bytes[j])).unwrap_or(bytes.len());
            let w = &expr[i..end];
            if w.starts_with("anchorage_") || w.starts_with("process_") {
                names.push(w.to_string());
            }
            i = end;
        } else {
            i += 1;
        }
    }
    names
}

/// Every PromQL expression of the dashboard (`expr` of its targets, `query` of its variables)
/// and of the alert rules (their one-line `expr:`).
fn expressions(observability: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(observability.join("grafana-dashboard.json")).unwrap()).unwrap();
    fn walk(v: &serde_json::Value, out: &mut Vec<(String, String)>) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    match (k.as_str(), v) {
                        ("expr" | "query" | "definition", serde_json::Value::String(s)) => {
                            out.push(("grafana-dashboard.json".into(), s.clone()))
                        }
                        _ => walk(v, out),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    walk(&dashboard, &mut out);
    let rules = std::fs::read_to_string(observability.join("anchorage-alerts.yml")).unwrap();
    for line in rules.lines() {
        if let Some(expr) = line.trim().strip_prefix("expr:") {
            assert!(!expr.trim().starts_with(['|', '>']), "one-line expressions only: {line}");
            out.push(("anchorage-alerts.yml".into(), expr.trim().to_string()));
        }
    }
    out
}

fn wait_ready(addr: SocketAddr, server: &ServerProcess, within: Duration) {
    let cap = Instant::now() + within;
    loop {
        if let Ok((200, body)) = http_get(addr, "/readyz") {
            assert_eq!(body, "ready\n");
            return;
        }
        assert!(Instant::now() < cap, "/readyz answers 200 within {within:?}: {}", server.log_tail());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Scrapes until `done` holds for the exposition (the device's cost report follows its ack).
fn scrape_until(addr: SocketAddr, what: &str, done: impl Fn(&str) -> bool) -> String {
    let cap = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, text) = http_get(addr, "/metrics").unwrap();
        assert_eq!(status, 200);
        if done(&text) {
            return text;
        }
        assert!(Instant::now() < cap, "{what} within 20 s:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_server_exports_what_the_dashboard_and_the_alerts_query() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = ServerProcess::new(dir.path(), Path::new(env!("CARGO_BIN_EXE_server-process")), 1);
    let metrics = server.with_metrics();
    // Device ids on /metrics are an option (off by default); the dashboard's per-device panel needs them.
    server.append_config("[metrics]\ndevice_ids = true");
    server.spawn();
    wait_ready(metrics, &server, Duration::from_secs(30));
    assert_eq!(http_get(metrics, "/healthz").unwrap(), (200, "ok\n".to_string()));
    assert_eq!(http_get(metrics, "/nothing").unwrap().0, 404);

    // One device, two rounds.
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let mut options = ClientOptions::new(server.addr, server.cert.clone(), "edge-001");
        let device = server.ca.issue(Kind::Client, "edge-001", &[], 30).unwrap();
        options.client_cert = Some(Arc::new(ClientCert { chain: vec![device.cert], key: device.key }));
        options.backoff =
            Backoff { initial: Duration::from_millis(100), max: Duration::from_secs(1), max_attempts: None };
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        options.stop = Some(stop_rx);
        let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let device = tokio::spawn(client::run(options, Box::new(anchorage_tests::fedavg_client(0)), Some(events)));
        let mut done = 0;
        while done < 2 {
            match tokio::time::timeout(Duration::from_secs(120), rx.recv()).await {
                Ok(Some(ClientEvent::RoundDone { .. })) => done += 1,
                Ok(Some(_)) => {}
                other => panic!("two rounds within 120 s ({other:?}): {}", server.log_tail()),
            }
        }
        // Scraped while the device is still connected.
        let text = scrape_until(metrics, "the device's second cost report", |t| {
            value(t, "anchorage_client_rounds_total{result=\"completed\"}").is_some_and(|v| v >= 2.0)
        });
        assert_eq!(value(&text, "anchorage_clients_connected"), Some(1.0), "{text}");
        let _ = stop.send(true);
        let _ = tokio::time::timeout(Duration::from_secs(10), device).await;
    });

    let text = scrape_until(metrics, "the device's goodbye", |t| value(t, "anchorage_clients_connected") == Some(0.0));
    let v = |series: &str| value(&text, series).unwrap_or_else(|| panic!("{series} in\n{text}"));
    assert!(v("anchorage_rounds_closed_total{outcome=\"aggregated\"}") >= 2.0);
    assert!(v("anchorage_last_round") >= 2.0);
    assert!(v("anchorage_round_duration_seconds_count") >= 2.0);
    assert!(v("anchorage_updates_total{outcome=\"accepted\"}") >= 2.0);
    assert_eq!(v("anchorage_refusals_total{reason=\"not_enrolled\"}"), 0.0);
    assert!(v("anchorage_client_round_duration_seconds_count") >= 2.0);
    assert!(v("anchorage_client_traffic_bytes_total{direction=\"up\",kind=\"payload\"}") > 0.0);
    assert!(v("anchorage_client_traffic_bytes_total{direction=\"down\",kind=\"wire\"}") > 0.0);
    assert!(v("anchorage_frame_bytes_total{direction=\"up\"}") > 0.0);
    assert_eq!(v("anchorage_clients_sampled"), 1.0);
    assert!(v("anchorage_connections_total") >= 1.0);
    assert_eq!(v("anchorage_ready"), 1.0);
    assert_eq!((v("anchorage_devices_known"), v("anchorage_devices_silent{since=\"1h\"}")), (1.0, 0.0));
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    let seen = v("anchorage_device_last_seen_timestamp_seconds{device=\"edge-001\"}");
    assert!((now - seen).abs() < 120.0, "last seen {seen}, now {now}");
    let closed = v("anchorage_last_round_closed_timestamp_seconds");
    assert!((now - closed).abs() < 120.0, "last round closed {closed}, now {now}");
    assert!(text.contains("anchorage_build_info{version=\"0.1.0\",git_commit=\""), "{text}");
    if cfg!(target_os = "linux") {
        assert!(v("process_resident_memory_bytes") > 1e6 && v("process_open_fds") > 0.0);
    }
    assert!(!text.contains("ledger"), "no internal words in the names: {text}");

    // Everything the dashboard and the alerts ask for is there.
    let exported = exported_names(&text);
    let observability = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/observability");
    let exprs = expressions(&observability);
    assert!(exprs.len() >= 20, "{exprs:?}");
    let mut missing = Vec::new();
    let mut queried = BTreeSet::new();
    for (file, expr) in &exprs {
        for name in queried_names(expr) {
            if !exported.contains(&name) {
                missing.push(format!("{file}: {name} in `{expr}`"));
            }
            queried.insert(name);
        }
    }
    assert!(missing.is_empty(), "queried but not exported:\n{}\nexported: {exported:?}", missing.join("\n"));
    println!("{} expressions query {} metrics, all exported: {queried:?}", exprs.len(), queried.len());

    // A restart: what the store keeps is exported again (cost totals, last round, last seen).
    let status = server.stop(Ending::Term);
    assert!(status.success(), "{status}: {}", server.log_tail());
    server.spawn();
    wait_ready(metrics, &server, Duration::from_secs(30));
    let (_, again) = http_get(metrics, "/metrics").unwrap();
    for series in [
        "anchorage_client_rounds_total{result=\"completed\"}",
        "anchorage_client_traffic_bytes_total{direction=\"up\",kind=\"wire\"}",
        "anchorage_device_last_seen_timestamp_seconds{device=\"edge-001\"}",
    ] {
        assert_eq!(value(&again, series), value(&text, series), "{series} after a restart:\n{again}");
    }
    // The store's clock reading of the close and the metric's may straddle a second.
    let closed_again = value(&again, "anchorage_last_round_closed_timestamp_seconds").unwrap();
    assert!((closed_again - closed).abs() <= 1.0, "last round closed {closed_again} after a restart, {closed} before");
    assert_eq!(value(&again, "anchorage_rounds_closed_total{outcome=\"aggregated\"}"), Some(0.0), "since this start");
    server.stop(Ending::Term);
}

#[test]
fn names_in_expressions_are_found() {
    assert_eq!(
        queried_names("histogram_quantile(0.9, sum by (le) (rate(anchorage_round_duration_seconds_bucket[5m])))"),
        ["anchorage_round_duration_seconds_bucket"]
    );
    assert_eq!(
        queried_names("time() - anchorage_x_seconds > 86400 and process_open_fds / my_anchorage_y"),
        ["anchorage_x_seconds", "process_open_fds"]
    );
    let names = exported_names("# TYPE anchorage_a counter\nanchorage_a_total{x=\"1\"} 0\nprocess_b 1.0\n# EOF\n");
    assert_eq!(names.into_iter().collect::<Vec<_>>(), ["anchorage_a", "anchorage_a_total", "process_b"]);
}

/// The model's quality has its own panel in the dashboard, over both accuracies the
/// server exports (the devices' own and the held-out set's), and the stall has its own.
#[test]
fn the_dashboard_shows_both_accuracies_and_the_stall() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/observability/grafana-dashboard.json");
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let panels = dashboard["panels"].as_array().unwrap();
    let queries = |title: &str| -> Vec<String> {
        let panel = panels.iter().find(|p| p["title"] == title).unwrap_or_else(|| panic!("no panel `{title}`"));
        panel["targets"].as_array().unwrap().iter().map(|t| t["expr"].as_str().unwrap().to_string()).collect()
    };
    let title = "Accuracy: the devices' own and held-out";
    assert!(panels.iter().any(|p| p["title"] == title && p["type"] == "timeseries"), "a time series over rounds");
    let accuracy = queries(title);
    assert_eq!(
        accuracy,
        [
            "max(anchorage_round_device_accuracy{instance=~\"$instance\"})",
            "max(anchorage_round_held_out_accuracy{instance=~\"$instance\"})"
        ]
    );
    assert!(queries("Waiting for devices").iter().any(|q| q.contains("anchorage_waiting_for_devices")));
}

/// The alert rules' unit tests (`deploy/observability/alerts-test.yml`: a stalled federation, a
/// refusal spike, a stale revocation list) pass under promtool, where it is installed.
#[test]
fn the_alert_rules_fire_when_they_should() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/observability");
    for args in [["check", "rules", "anchorage-alerts.yml"], ["test", "rules", "alerts-test.yml"]] {
        let out = match std::process::Command::new("promtool").args(args).current_dir(&dir).output() {
            Ok(out) => out,
            Err(e) => {
                anchorage_shared::skip::skipped(&format!(
                    "`promtool {}`: promtool is not installed ({e}); apt-get install prometheus",
                    args.join(" ")
                ));
                return;
            }
        };
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        println!("promtool {}: {said}", args.join(" "));
        assert!(out.status.success() && said.contains("SUCCESS"), "promtool {}: {said}", args.join(" "));
    }
}
