//! Revocation fails closed, over real QUIC on loopback with a project CA and its `revoked.crl`:
//! - a CA-mode server whose revocation list is missing or not a CRL does not start, and says
//!   which file and how to make one (the library's `start` and the server program alike);
//! - a list deleted or damaged while the server runs keeps the last good one: a revoked device
//!   is still refused, `anchorage_crl_stale` reads 1 and the failures are counted, until a good
//!   file is back;
//! - every handshake refused for a revoked certificate counts in
//!   `anchorage_refusals_total{reason="revoked"}`, and the device learns it from the TLS alert
//!   certificate_revoked (the client stops on it; tests/refusals.rs runs the client program).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anchorage_client::methods::ClientMethod;
use anchorage_client::transport::{self as client, ClientCert};
use anchorage_pki::{CRL, Identity, Kind, ProjectCa};
use anchorage_server::engine::EngineConfig;
use anchorage_server::methods::FedAvg;
use anchorage_server::tls::Trust;
use anchorage_server::transport::{self as server, Limits, ServerHandle, ServerOptions};
use anchorage_shared::protocol::{Message, RoundConfig};
use anchorage_tests::process::ServerProcess;
use anchorage_tests::{fedavg_client, hello, metric_value, raw_connect_as, send_raw_and_read_reply};
use rustls::pki_types::CertificateDer;

fn cert_of(identity: Identity) -> ClientCert {
    ClientCert { chain: vec![identity.cert], key: identity.key }
}

/// Starts a server that trusts `ca` and reads its revocation list from `crl`.
async fn start(ca: &mut ProjectCa, crl: PathBuf) -> anyhow::Result<ServerHandle> {
    let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 30)?;
    server::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity,
        trust: Trust::ProjectCa { ca: ca.cert().clone(), crl: Some(crl) },
        engine: EngineConfig {
            rounds: 0,
            min_available: 1,
            min_fit: 1,
            round_deadline: Duration::from_secs(30),
            round: RoundConfig { local_epochs: 1, batch_size: 32, learning_rate: 1e-3, deadline_ms: 0 },
            ..EngineConfig::default()
        },
        method: Box::new(FedAvg::default()),
        initial: fedavg_client(0).initial_blocks().unwrap(),
        limits: Limits::default(),
        store: None,
    })
    .await
}

/// Whether a connection showing `cert` gets a welcome (`false` when TLS refuses it).
async fn handshake_accepted(addr: SocketAddr, root: &CertificateDer<'static>, cert: &ClientCert, id: &str) -> bool {
    let Ok((_endpoint, conn)) = raw_connect_as(addr, root, Some(cert)).await else { return false };
    let reply = tokio::time::timeout(Duration::from_secs(10), async {
        send_raw_and_read_reply(&conn, &anchorage_tests::frame(&hello(id))).await
    })
    .await;
    match reply {
        Ok(Ok(Some(Message::Welcome(_)))) => true,
        Ok(Ok(other)) => panic!("neither a welcome nor a TLS failure: {other:?}"),
        Ok(Err(_)) => {
            let reason = conn.close_reason();
            assert!(reason.as_ref().is_some_and(client::tls_failure), "a TLS refusal, not another failure: {reason:?}");
            let refusal = reason.as_ref().and_then(client::definite_refusal).map(|(kind, _)| kind);
            assert_eq!(refusal, Some(client::RefusalKind::Revoked), "the alert says revoked: {reason:?}");
            false
        }
        Err(_) => panic!("no answer within 10 s"),
    }
}

/// The value of one series of an exposition.
/// Waits (bounded) until the server's `series` satisfies `done`; returns its value.
async fn metric_until(server: &ServerHandle, series: &str, done: impl Fn(f64) -> bool) -> f64 {
    let cap = Instant::now() + Duration::from_secs(15);
    loop {
        let text = server.metrics.render();
        let v = metric_value(&text, series).unwrap_or_else(|| panic!("{series} is exported:\n{text}"));
        if done(v) {
            return v;
        }
        assert!(Instant::now() < cap, "{series} = {v} after 15 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_server_without_its_revocation_list_does_not_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut ca = ProjectCa::init(&dir.path().join("ca"), "revocation-test", 30).unwrap();
    // Missing.
    let missing = dir.path().join("tls").join(CRL);
    let err = format!("{:#}", start(&mut ca, missing.clone()).await.err().expect("no start without revoked.crl"));
    println!("missing: {err}");
    assert!(err.contains(&missing.display().to_string()) && err.contains("missing"), "names the file: {err}");
    assert!(err.contains("anchorage ca") && err.contains("anchorage provision"), "says how to make one: {err}");
    // Not a CRL.
    let garbage = dir.path().join("garbage.crl");
    std::fs::write(&garbage, b"-----BEGIN NOTHING-----").unwrap();
    let err = format!("{:#}", start(&mut ca, garbage.clone()).await.err().expect("no start with a damaged CRL"));
    println!("damaged: {err}");
    assert!(err.contains(&garbage.display().to_string()) && err.contains("not a CRL"), "{err}");
    // The CA's own list, empty, is enough.
    let server = start(&mut ca, dir.path().join("ca").join(CRL)).await.expect("an empty CRL is a CRL");
    server.shutdown().await.unwrap();
    // The server program (anchorage-server --config): refuses with the same message, exit 1.
    let mut process =
        ServerProcess::new(&dir.path().join("program"), Path::new(env!("CARGO_BIN_EXE_server-process")), 1);
    std::fs::remove_file(process.crl()).unwrap();
    process.spawn();
    let mut child = process.child.take().unwrap();
    let cap = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < cap, "the server program exits within 30 s: {}", process.log_tail());
        std::thread::sleep(Duration::from_millis(50));
    };
    // The whole log (a backtrace may follow the error when RUST_BACKTRACE is set).
    let log = std::fs::read_to_string(&process.log).unwrap();
    println!("the program: {status}\n{}", log.lines().take(5).collect::<Vec<_>>().join("\n"));
    assert!(!status.success(), "{log}");
    assert!(log.contains("revoked.crl is missing") && log.contains("anchorage ca"), "{log}");
    assert!(!log.contains("listening"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crl_deleted_or_damaged_at_run_time_keeps_the_last_good_list() {
    let dir = tempfile::tempdir().unwrap();
    let crl = dir.path().join("ca").join(CRL);
    let mut ca = ProjectCa::init(&dir.path().join("ca"), "revocation-test", 30).unwrap();
    let server = start(&mut ca, crl.clone()).await.unwrap();
    let (addr, root) = (server.local_addr, ca.cert().clone());
    let good = cert_of(ca.issue(Kind::Client, "edge-1", &[], 30).unwrap());
    let also_good = cert_of(ca.issue(Kind::Client, "edge-3", &[], 30).unwrap());
    let revoked = cert_of(ca.issue(Kind::Client, "edge-2", &[], 30).unwrap());
    assert_eq!(metric_value(&server.metrics.render(), "anchorage_crl_stale"), Some(0.0));
    ca.revoke("edge-2").unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!handshake_accepted(addr, &root, &revoked, "edge-2").await, "the control: revoked is refused");

    // Deleted: the last good list stays in force.
    std::fs::remove_file(&crl).unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!handshake_accepted(addr, &root, &revoked, "edge-2").await, "still refused with revoked.crl deleted");
    assert!(handshake_accepted(addr, &root, &good, "edge-1").await, "the valid one still gets in");
    metric_until(&server, "anchorage_crl_stale", |v| v == 1.0).await;
    let failures = metric_until(&server, "anchorage_crl_reload_failures_total", |v| v >= 1.0).await;
    // Staying deleted is one failure, not one every 2 s.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(metric_value(&server.metrics.render(), "anchorage_crl_reload_failures_total"), Some(failures));

    // Damaged: the same.
    std::fs::write(&crl, b"not a certificate revocation list").unwrap();
    metric_until(&server, "anchorage_crl_reload_failures_total", |v| v > failures).await;
    assert!(!handshake_accepted(addr, &root, &revoked, "edge-2").await, "still refused with revoked.crl damaged");
    assert_eq!(metric_value(&server.metrics.render(), "anchorage_crl_stale"), Some(1.0));

    // A good file again: not stale, and the list it holds applies.
    std::fs::write(&crl, ca.crl().unwrap().as_ref()).unwrap();
    metric_until(&server, "anchorage_crl_stale", |v| v == 0.0).await;
    assert!(!handshake_accepted(addr, &root, &revoked, "edge-2").await, "refused by the restored list");
    assert!(handshake_accepted(addr, &root, &also_good, "edge-3").await, "a valid one still gets in");
    // Four refused handshakes of the revoked device, four counts (not one per id).
    let counted = metric_until(&server, "anchorage_refusals_total{reason=\"revoked\"}", |v| v >= 4.0).await;
    assert_eq!(counted, 4.0);
    server.shutdown().await.unwrap();
}
