//! Trust over real QUIC on loopback, the attacks of a field deployment against a server that runs
//! mutual TLS with a project CA: each must fail, and honest devices must not notice.
//! - no client certificate, a certificate from another CA, an expired one: the handshake fails;
//! - a revoked certificate: refused at the handshake, and a device revoked while connected is
//!   closed within seconds (the server re-reads the CRL file);
//! - a hello that names another id than the certificate, and an impostor of a live device: refused,
//!   and the live device keeps its connection and finishes its rounds.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anchorage_client::methods::ClientMethod;
use anchorage_client::transport::{self as client, Backoff, ClientCert, ClientEvent, ClientOptions};
use anchorage_pki::Identity;
use anchorage_pki::{Kind, ProjectCa};
use anchorage_server::engine::EngineConfig;
use anchorage_server::methods::FedAvg;
use anchorage_server::tls::Trust;
use anchorage_server::transport::{self as server, Limits, ServerEvent, ServerHandle, ServerOptions};
use anchorage_shared::protocol::{Message, RefusalReason, RoundConfig};
use anchorage_tests::{fedavg_client, hello, raw_connect_as, send_raw_and_read_reply};
use rustls::pki_types::CertificateDer;
use tokio::sync::mpsc;

fn cert_of(identity: Identity) -> ClientCert {
    ClientCert { chain: vec![identity.cert], key: identity.key }
}

struct Project {
    ca: ProjectCa,
    server: ServerHandle,
}

impl Project {
    /// A CA in `dir`, and a server that trusts it and re-reads its CRL.
    async fn start(dir: &Path, rounds: u64) -> Self {
        let mut ca = ProjectCa::init(&dir.join("ca"), "trust-test", 30).unwrap();
        let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 30).unwrap();
        let server = server::start(ServerOptions {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            identity,
            trust: Trust::ProjectCa { ca: ca.cert().clone(), crl: Some(dir.join("ca").join(anchorage_pki::CRL)) },
            engine: EngineConfig {
                rounds,
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
        .unwrap();
        Self { ca, server }
    }

    fn root(&self) -> CertificateDer<'static> {
        self.ca.cert().clone()
    }

    fn device(&mut self, id: &str) -> ClientCert {
        cert_of(self.ca.issue(Kind::Client, id, &[], 30).unwrap())
    }
}

/// Whether a connection showing `client_cert` gets past the handshake: a hello is answered
/// with a welcome. `false` when TLS closes it.
async fn handshake_accepted(
    addr: SocketAddr,
    root: &CertificateDer<'static>,
    cert: Option<&ClientCert>,
    id: &str,
) -> bool {
    let Ok((_endpoint, conn)) = raw_connect_as(addr, root, cert).await else { return false };
    let reply = tokio::time::timeout(Duration::from_secs(10), async {
        send_raw_and_read_reply(&conn, &anchorage_tests::frame(&hello(id))).await
    })
    .await;
    match reply {
        Ok(Ok(Some(Message::Welcome(_)))) => true,
        Ok(Ok(other)) => panic!("neither a welcome nor a TLS failure: {other:?}"),
        Ok(Err(e)) => {
            let reason = conn.close_reason();
            println!("refused at the handshake as expected: {e} ({reason:?})");
            assert!(reason.as_ref().is_some_and(client::tls_failure), "a TLS refusal, not another failure: {reason:?}");
            false
        }
        Err(_) => panic!("no answer within 10 s"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_certificates_of_the_project_ca_get_in() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = Project::start(dir.path(), 1).await;
    let addr = p.server.local_addr;
    let root = p.root();
    let good = p.device("edge-1");
    assert!(handshake_accepted(addr, &root, Some(&good), "edge-1").await, "the control: a valid certificate gets in");
    // No certificate at all.
    assert!(!handshake_accepted(addr, &root, None, "edge-1").await, "no certificate");
    // A certificate from another CA, for the same id.
    let mut other = ProjectCa::in_memory("someone-else", 30).unwrap();
    let forged = cert_of(other.issue(Kind::Client, "edge-1", &[], 30).unwrap());
    assert!(!handshake_accepted(addr, &root, Some(&forged), "edge-1").await, "another CA");
    // Expired yesterday.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let expired = cert_of(p.ca.issue_valid(Kind::Client, "edge-2", &[], now - 30 * 86_400, now - 86_400).unwrap());
    assert!(!handshake_accepted(addr, &root, Some(&expired), "edge-2").await, "expired");
    // Revoked before it connects (the server re-reads the CRL within a few seconds).
    let revoked = p.device("edge-3");
    p.ca.revoke("edge-3").unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!handshake_accepted(addr, &root, Some(&revoked), "edge-3").await, "revoked");
    assert!(handshake_accepted(addr, &root, Some(&good), "edge-1").await, "the valid one still gets in");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_id_is_the_certificates_not_the_hellos() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = Project::start(dir.path(), 3).await;
    let (addr, root) = (p.server.local_addr, p.root());
    // A live device…
    let mut options = ClientOptions::new(addr, root.clone(), "edge-1");
    options.client_cert = Some(Arc::new(p.device("edge-1")));
    let (tx, mut events) = mpsc::unbounded_channel();
    let honest = tokio::spawn(client::run(options, Box::new(fedavg_client(1)), Some(tx)));
    let first_round = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(e) = events.recv().await {
            if matches!(e, ClientEvent::RoundStarted { .. }) {
                return;
            }
        }
    });
    first_round.await.expect("the live device is in a round");
    // …and a peer with a valid certificate of its own that says it is that device.
    let impostor = p.device("edge-9");
    let (_endpoint, conn) = raw_connect_as(addr, &root, Some(&impostor)).await.unwrap();
    let reply = send_raw_and_read_reply(&conn, &anchorage_tests::frame(&hello("edge-1"))).await.unwrap();
    match reply {
        Some(Message::Refusal(r)) => {
            println!("impostor refused: {:?}: {}", r.reason, r.detail);
            assert_eq!(r.reason, RefusalReason::NotEnrolled);
            assert!(r.detail.contains("edge-9"), "the refusal names the certificate's id: {}", r.detail);
        }
        other => panic!("an impostor must be refused, got {other:?}"),
    }
    // The live device was not evicted: it finishes every round, and nothing disconnected it.
    let reason = tokio::time::timeout(Duration::from_secs(120), honest).await.expect("finishes").unwrap().unwrap();
    assert!(reason.contains("finished"), "{reason}");
    let mut rounds = 0;
    while let Ok(e) = events.try_recv() {
        match e {
            ClientEvent::Disconnected { reason } => panic!("the honest device lost its connection: {reason}"),
            ClientEvent::Acked { aggregated: true, .. } => rounds += 1,
            _ => {}
        }
    }
    assert!(rounds >= 2, "the honest device's updates were aggregated ({rounds} more rounds)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_revoked_while_connected_is_closed_within_seconds() {
    let dir = tempfile::tempdir().unwrap();
    let mut p = Project::start(dir.path(), 0).await;
    let (addr, root) = (p.server.local_addr, p.root());
    let mut options = ClientOptions::new(addr, root, "edge-7");
    options.client_cert = Some(Arc::new(p.device("edge-7")));
    options.backoff = Backoff { max_attempts: Some(3), ..Backoff::default() };
    let (tx, mut events) = mpsc::unbounded_channel();
    let device = tokio::spawn(client::run(options, Box::new(fedavg_client(7)), Some(tx)));
    let mut server_events = std::mem::replace(&mut p.server.events, mpsc::unbounded_channel().1);
    let closed = tokio::time::timeout(Duration::from_secs(60), server_events.recv()).await.expect("a round closes");
    assert!(matches!(closed, Some(ServerEvent::RoundClosed { .. })));
    let revoked_at = Instant::now();
    p.ca.revoke("edge-7").unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(30), device).await.expect("the revoked device is closed");
    let waited = revoked_at.elapsed();
    println!("revoked device closed after {waited:?}: {outcome:?}");
    let mut refused = false;
    while let Ok(e) = events.try_recv() {
        if let ClientEvent::Finished { reason } = e {
            // Either the server closes the live connection naming the revocation, or the next
            // handshake fails with TLS alert 44 (`Revoked`): any case of the word counts.
            let reason = reason.to_lowercase();
            refused |= reason.contains("revoked") || reason.contains("notenrolled");
        }
    }
    assert!(refused, "the device was told its certificate is revoked");
}
