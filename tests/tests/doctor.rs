//! `anchorage-client doctor` against a provisioned federation over real QUIC on loopback: the
//! site folders from `anchorage provision`, the server program started from its folder (with its
//! metrics port, whose HTTP Date header gives the server's clock), and the doctor run as a
//! process on a device's folder. It passes for a device whose certificate the server accepts, and
//! exits non-zero, saying why, for an expired certificate and for a server that is down.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anchorage_pki::{Kind, ProjectCa};
use anchorage_tests::process::{free_udp_port, http_get};

/// Kills the server if the test fails before it stops it.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn doctor(site: &Path, health: &str) -> (Output, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_client-doctor"))
        .arg("--config")
        .arg(site.join("client.toml"))
        .args(["--health-url", health, "--timeout-ms", "1500"])
        .stdin(Stdio::null())
        .output()
        .expect("the doctor runs");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    (out, text)
}

/// The line of one check.
fn line<'a>(text: &'a str, check: &str) -> &'a str {
    text.lines().find(|l| l.split_whitespace().nth(1) == Some(check)).unwrap_or_else(|| panic!("{check} in\n{text}"))
}

#[test]
fn doctor_passes_a_good_device_and_fails_an_expired_certificate_or_a_stopped_server() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_udp_port().port();
    let metrics = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let project = dir.path().join("project.toml");
    std::fs::write(
        &project,
        format!(
            r#"
name = "doctor"
days = 365
method = "fedavg"

[server]
address = "127.0.0.1:{port}"
bind = "127.0.0.1:{port}"
names = ["localhost"]
metrics_bind = "{metrics}"

[engine]
rounds = 0
min_available = 2
min_fit = 2

[client]
max_memory_mb = 384

[[devices]]
id = "edge-001"

[[devices]]
id = "edge-002"
"#
        ),
    )
    .unwrap();
    anchorage::provision::provision(&project, None).unwrap();
    let sites = dir.path().join("sites");
    let log_path = dir.path().join("server.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut server = Running(
        Command::new(env!("CARGO_BIN_EXE_server-process"))
            .arg("--config")
            .arg(sites.join("server/server.toml"))
            .env("ANCHORAGE_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let log_text = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let cap = Instant::now() + Duration::from_secs(30);
    while !matches!(http_get(metrics, "/readyz"), Ok((200, _))) {
        assert!(server.0.try_wait().unwrap().is_none(), "the server exited: {}", log_text());
        assert!(Instant::now() < cap, "the server is ready within 30 s: {}", log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let health = format!("http://{metrics}/healthz");

    // A provisioned device: every check passes.
    let (out, text) = doctor(&sites.join("edge-001"), &health);
    assert!(out.status.success(), "{text}");
    assert!(line(&text, "certificate").contains("edge-001: this device's certificate valid until"), "{text}");
    assert!(line(&text, "server").contains("accepts this device's certificate"), "{text}");
    assert!(line(&text, "clock").starts_with("  ok") && line(&text, "clock").contains("Date header"), "{text}");
    assert!(line(&text, "device").contains("cpu"), "{text}");
    assert!(line(&text, "memory").contains("max_memory_mb = 384: "), "{text}");
    assert!(text.ends_with("doctor: ready (9 ok, 0 warnings, 0 skipped)\n"), "{text}");
    // The doctor says no hello: the server never took it for the device.
    assert!(!log_text().contains("client connected"), "{}", log_text());

    // An expired certificate: the doctor says so, and the server refuses the handshake.
    let mut ca = ProjectCa::open(&dir.path().join("ca")).unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let expired = ca.issue_valid(Kind::Client, "edge-002", &[], now - 10 * 86_400, now - 86_400).unwrap();
    anchorage_pki::save_identity(&sites.join("edge-002"), &expired).unwrap();
    let (out, text) = doctor(&sites.join("edge-002"), &health);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let cert = line(&text, "certificate");
    assert!(cert.contains("FAIL") && cert.contains("EXPIRED") && cert.contains("anchorage ca renew"), "{text}");
    let refused = line(&text, "server");
    assert!(refused.contains("FAIL") && refused.contains("refused the TLS handshake"), "{text}");
    assert!(text.contains("doctor: NOT ready: certificate, server failed"), "{text}");

    // The server stopped: no answer over QUIC, none over HTTP.
    Command::new("kill").arg("-TERM").arg(server.0.id().to_string()).status().unwrap();
    let cap = Instant::now() + Duration::from_secs(15);
    while server.0.try_wait().unwrap().is_none() {
        assert!(Instant::now() < cap, "the server stops on SIGTERM: {}", log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let started = Instant::now();
    let (out, text) = doctor(&sites.join("edge-001"), &health);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let down = line(&text, "server");
    assert!(
        down.contains("FAIL") && down.contains("no answer from 127.0.0.1") && down.contains("is the server running"),
        "{text}"
    );
    assert!(line(&text, "clock").contains("FAIL"), "{text}");
    assert!(line(&text, "certificate").starts_with("  ok"), "the certificate itself is fine: {text}");
    println!(
        "the doctor against a stopped server took {:.1} s (--timeout-ms 1500 per network check)",
        started.elapsed().as_secs_f64()
    );
}
