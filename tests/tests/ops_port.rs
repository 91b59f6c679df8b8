//! The server program's metrics port against strangers, over real sockets on loopback: 200 idle
//! TCP connections held open do not starve `/healthz` and `/readyz`, and `/metrics` names no
//! device unless server.toml asks for it (`[metrics] device_ids = true`). A real scrape passes
//! `promtool check metrics` (run when promtool is installed, else a loud SKIPPED line) and the
//! same checks in Rust.

use std::path::Path;
use std::time::{Duration, Instant};

use anchorage_client::transport::ClientCert;
use anchorage_pki::Kind;
use anchorage_shared::protocol::Message;
use anchorage_tests::process::{ServerProcess, http_get};
use anchorage_tests::{hello, raw_connect_as, send_raw_and_read_reply};

fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn probes_answer_under_an_idle_flood_and_metrics_name_no_device() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = ServerProcess::new(dir.path(), Path::new(env!("CARGO_BIN_EXE_server-process")), 2);
    let metrics = server.with_metrics();
    server.spawn();
    let cap = Instant::now() + Duration::from_secs(30);
    while http_get(metrics, "/readyz").map(|(code, _)| code).ok() != Some(200) {
        assert!(Instant::now() < cap, "ready within 30 s: {}", server.log_tail());
        std::thread::sleep(Duration::from_millis(50));
    }

    // A device says hello (the server now knows its id).
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let identity = server.ca.issue(Kind::Client, "edge-secret-001", &[], 30).unwrap();
    let cert = ClientCert { chain: vec![identity.cert], key: identity.key };
    let (addr, root) = (server.addr, server.cert.clone());
    let _device = runtime.block_on(async {
        let (endpoint, conn) = raw_connect_as(addr, &root, Some(&cert)).await.unwrap();
        let reply = send_raw_and_read_reply(&conn, &anchorage_tests::frame(&hello("edge-secret-001"))).await.unwrap();
        assert!(matches!(reply, Some(Message::Welcome(_))), "{reply:?}");
        (endpoint, conn)
    });
    let cap = Instant::now() + Duration::from_secs(20);
    let text = loop {
        let (code, text) = http_get(metrics, "/metrics").unwrap();
        assert_eq!(code, 200);
        if value(&text, "anchorage_devices_known") == Some(1.0) {
            break text;
        }
        assert!(Instant::now() < cap, "the device is known within 20 s:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!text.contains("edge-secret-001"), "no device id on /metrics by default:\n{text}");
    // What `curl /metrics | promtool check metrics` reads: every family has a help text and a
    // type, counters end in `_total` (and nothing else does), units are base units.
    assert_eq!(anchorage_server::metrics::text::lint(&text), Vec::<String>::new(), "{text}");
    promtool_check_metrics(&text);

    // 200 idle connections to the metrics port, held open.
    let idle: Vec<std::net::TcpStream> = (0..200)
        .map(|i| {
            std::net::TcpStream::connect_timeout(&metrics, Duration::from_secs(5))
                .unwrap_or_else(|e| panic!("idle connection {i}: {e}"))
        })
        .collect();
    for path in ["/healthz", "/readyz"] {
        let started = Instant::now();
        let answer = http_get(metrics, path);
        let took = started.elapsed();
        println!("{path} with {} idle connections held: {answer:?} in {took:?}", idle.len());
        assert_eq!(answer.ok().map(|(code, _)| code), Some(200), "{path}: {}", server.log_tail());
        assert!(took < Duration::from_secs(3), "{path} took {took:?}");
    }
    let (_, text) = http_get(metrics, "/metrics").unwrap();
    let evicted = value(&text, "anchorage_http_connections_dropped_total{reason=\"evicted\"}").unwrap_or(0.0);
    println!("idle connections dropped to make room: {evicted}");
    assert!(evicted >= 100.0, "{text}");
    drop(idle);
    runtime.block_on(async { drop(_device) });
}

/// `promtool check metrics` on an exposition, where promtool is installed; a loud SKIPPED line
/// with the install command where it is not.
fn promtool_check_metrics(text: &str) {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) => {
            anchorage_shared::skip::skipped(&format!(
                "`promtool check metrics` on the scrape: promtool is not installed ({e}); \
                 install it with `apt-get install prometheus` (Debian/Ubuntu) or from a Prometheus release \
                 tarball. The Rust lint above ran."
            ));
            return;
        }
    };
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("promtool check metrics: {} {said}", out.status);
    assert!(out.status.success() && said.trim().is_empty(), "promtool check metrics: {}\n{said}", out.status);
}
