use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anchorage_model::FeatureCache;
use anchorage_shared::frame::encode_frame;
use anchorage_shared::io::{FrameIoError, read_frame, write_frame};
use anchorage_shared::protocol::{Broadcast, Heartbeat, Message};
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::ParamBlock;
use anchorage_shared::transfer;
use rustls::pki_types::CertificateDer;
use tokio::sync::mpsc;

use super::backoff::Failures;
use super::client::Client;
use super::upload::resume_answer;
use super::*;
use crate::methods::{ClientMethod, TrainError, Trained};
use crate::metrics::ClientMetrics;
use crate::store::ClientStore;

/// After a failed attempt or a lost connection a device tries its next relay,
/// round robin; without fallbacks it stays with its server.
#[test]
fn fail_over_takes_the_next_address_round_robin() {
    let addr = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    let cert = CertificateDer::from(vec![0u8; 4]);
    let mut options = ClientOptions::new(addr(1), cert.clone(), "edge-1");
    options.fail_over();
    assert_eq!(options.server, addr(1));
    options.fallbacks = vec![addr(2), addr(3)];
    let seen: Vec<u16> = (0..4)
        .map(|_| {
            options.fail_over();
            options.server.port()
        })
        .collect();
    assert_eq!(seen, vec![2, 3, 1, 2]);
    assert_eq!(options.fallbacks.len(), 2);
}

/// A device on a fallback goes back to its own address once `home_after` has passed, with
/// the round-robin order as it was; at home, nothing is due.
#[test]
fn a_device_on_a_fallback_goes_back_to_its_own_address() {
    let addr = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    let mut options = ClientOptions::new(addr(1), CertificateDer::from(vec![0u8; 4]), "edge-1");
    options.fallbacks = vec![addr(2), addr(3)];
    options.home_after = std::time::Duration::from_secs(3600);
    assert!(!options.due_home(), "at home");
    options.fail_over();
    options.fail_over();
    assert_eq!(options.server, addr(3));
    assert!(!options.due_home(), "away, not for long");
    options.home_after = std::time::Duration::ZERO;
    assert!(options.due_home());
    options.go_home();
    assert_eq!((options.server, options.fallbacks.clone()), (addr(1), vec![addr(2), addr(3)]));
    assert!(!options.due_home(), "home again");
    // Round robin back to its own address counts as home too.
    options.fail_over();
    options.fail_over();
    options.fail_over();
    assert_eq!(options.server, addr(1));
    assert!(!options.due_home());
}

/// A method that never trains; it refuses any device state when `refuse_state`.
struct Idle {
    refuse_state: bool,
}

impl ClientMethod for Idle {
    fn name(&self) -> &'static str {
        "fedavg"
    }
    fn num_samples(&self) -> u64 {
        1
    }
    fn train(&mut self, _: &Broadcast) -> Result<Trained, TrainError> {
        Err(TrainError::NoData)
    }
    fn global_accuracy(&self, _: &Broadcast, _: &FeatureCache) -> Result<Option<f64>, TrainError> {
        Ok(None)
    }
    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
        Ok(Vec::new())
    }
    fn restore_device_state(&mut self, _: &[ParamBlock]) -> Result<(), TrainError> {
        if self.refuse_state { Err(TrainError::NoData) } else { Ok(()) }
    }
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("anchorage-client-transport-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn names(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

/// A throwaway self-signed certificate for `localhost` (these tests never complete a handshake).
fn test_cert() -> CertificateDer<'static> {
    rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap().cert.der().clone()
}

/// Options for a "server" that is a bound UDP socket nobody reads: a server that is down
/// and answers no Initial packet.
fn silent_server(client: &str) -> (std::net::UdpSocket, ClientOptions) {
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let cert = test_cert();
    let mut options = ClientOptions::new(silent.local_addr().unwrap(), cert, client);
    options.connect_timeout = Duration::from_millis(300);
    options.idle_timeout = Duration::from_secs(30);
    options.backoff =
        Backoff { initial: Duration::from_millis(10), max: Duration::from_millis(20), max_attempts: Some(3) };
    (silent, options)
}

/// A QUIC server config with a throwaway self-signed certificate for `localhost`, and that
/// certificate.
fn self_signed_server() -> (quinn::ServerConfig, CertificateDer<'static>) {
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let cert = certified.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
    let mut crypto = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert.clone()], key)
        .unwrap();
    crypto.alpn_protocols = vec![ALPN.to_vec()];
    let config =
        quinn::ServerConfig::with_crypto(Arc::new(quinn::crypto::rustls::QuicServerConfig::try_from(crypto).unwrap()));
    (config, cert)
}

/// A QUIC connection on loopback: the server's side, the client's side, and both endpoints
/// (keep them alive for the connection's life).
pub(crate) async fn loopback() -> (quinn::Connection, quinn::Connection, [quinn::Endpoint; 2]) {
    let (config, cert) = self_signed_server();
    let server = quinn::Endpoint::server(config, "127.0.0.1:0".parse().unwrap()).unwrap();
    let options = ClientOptions::new(server.local_addr().unwrap(), cert, "c");
    let client = endpoint(&options).unwrap();
    let accepted = tokio::spawn({
        let server = server.clone();
        async move { server.accept().await.unwrap().await.unwrap() }
    });
    let client_conn = client.connect(options.server, "localhost").unwrap().await.unwrap();
    (accepted.await.unwrap(), client_conn, [server, client])
}

/// The server's answer to an upload's offer: one that names another transfer, resumes past
/// the end or is not an answer is refused, logged and counted by reason; a stream that
/// ended is an error but no refusal.
#[test]
fn a_bad_answer_to_an_upload_is_refused_and_counted() {
    use crate::metrics::{MALFORMED, UP};
    use anchorage_shared::protocol::TransferResume;
    let frame = vec![7u8; 1000];
    let offer = transfer::offer(&frame, 3);
    let metrics = ClientMetrics::new();
    let answer = |transfer, offset| Ok(Some((Message::TransferResume(TransferResume { transfer, offset }), 40)));
    assert_eq!(resume_answer(&offer, answer(offer.transfer, 500), &metrics).unwrap(), 500);
    assert_eq!(resume_answer(&offer, answer(offer.transfer, 1000), &metrics).unwrap(), 1000);

    let e = resume_answer(&offer, answer(offer.transfer, 1001), &metrics).unwrap_err().to_string();
    assert!(e.contains("bad_offset") && e.contains("past the end"), "{e}");
    assert_eq!(metrics.transfers_refused(UP, "bad_offset"), 1);
    let e = resume_answer(&offer, answer([9; 32], 0), &metrics).unwrap_err().to_string();
    assert!(e.contains("another transfer"), "{e}");
    assert_eq!(metrics.transfers_refused(UP, "bad_offer"), 1);
    let heartbeat = Ok(Some((Message::Heartbeat(Heartbeat { seq: 1 }), 10)));
    assert!(resume_answer(&offer, heartbeat, &metrics).unwrap_err().to_string().contains("instead of an answer"));
    assert_eq!(metrics.transfers_refused(UP, MALFORMED), 1);

    assert!(resume_answer(&offer, Ok(None), &metrics).is_err());
    let reset = Err(FrameIoError::Io(std::io::Error::from(std::io::ErrorKind::ConnectionReset)));
    assert!(resume_answer(&offer, reset, &metrics).is_err());
    let total: u64 = crate::metrics::REFUSAL_REASONS.iter().map(|r| metrics.transfers_refused(UP, r)).sum();
    assert_eq!(total, 3, "a stream that ended is not a refusal");
    assert_eq!(metrics.transfers_refused(crate::metrics::DOWN, "bad_offset"), 0);
}

/// The same over QUIC: a server that answers an upload's offer past its end.
#[tokio::test]
async fn an_upload_resumed_past_its_end_is_refused_and_counted() {
    use anchorage_shared::protocol::TransferResume;
    let (server, client, _endpoints) = loopback().await;
    let answering = tokio::spawn(async move {
        let (mut send, mut recv) = server.accept_bi().await.unwrap();
        let Some((Message::TransferOffer(offer), _)) = read_frame(&mut recv, usize::MAX).await.unwrap() else {
            panic!("not an offer")
        };
        let past = TransferResume { transfer: offer.transfer, offset: offer.total + 1 };
        write_frame(&mut send, &encode_frame(&Message::TransferResume(past), usize::MAX).unwrap()).await.unwrap();
        let _ = send.finish();
        let _ = recv.read_to_end(usize::MAX).await;
        server
    });
    let metrics = ClientMetrics::new();
    let e = send_resumable(&client, &[1u8; 5000], 2, None, &metrics).await.unwrap_err();
    assert!(format!("{e:#}").contains("past the end"), "{e:#}");
    assert_eq!(metrics.transfers_refused(crate::metrics::UP, "bad_offset"), 1);
    client.close(quinn::VarInt::from_u32(0), b"done");
    let _ = answering.await;
}

/// An invited device that may not train now: the values its reading refused and its
/// decline are counted, and nothing is trained.
#[tokio::test]
async fn refused_readings_and_declines_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    crate::eligibility::fake::write(
        dir.path(),
        &[
            ("sys/class/thermal/thermal_zone0/type", "cpu-thermal\n"),
            ("sys/class/thermal/thermal_zone0/temp", "90000\n"),
            ("proc/loadavg", "load: high\n"),
        ],
    );
    let (_silent, mut options) = silent_server("c");
    options.sys_root = Some(crate::eligibility::SysRoot::new(dir.path()));
    options.eligibility.max_temperature_c = Some(80.0);
    let metrics = options.metrics.clone();
    let ((trained, _t), (uploaded, _u)) = (mpsc::unbounded_channel(), mpsc::unbounded_channel());
    let mut client = Client::new(options, Box::new(Idle { refuse_state: false }), None, trained, uploaded).unwrap();
    let config = anchorage_shared::protocol::RoundConfig {
        local_epochs: 1,
        batch_size: 8,
        learning_rate: 0.1,
        deadline_ms: 1000,
    };
    client.train(Broadcast { round: 4, task: 0, config, blocks: Vec::new(), prototypes: Vec::new() });
    let text = metrics.encode_text();
    assert!(text.contains("\nanchorage_device_readings_refused_total 1\n"), "{text}");
    assert!(text.contains("\nanchorage_device_rounds_declined_total{reason=\"thermal\"} 1\n"), "{text}");
    assert!(text.contains("\nanchorage_device_rounds_trained_total 0\n"), "{text}");
}

#[test]
fn defaults_notice_a_restarted_server_within_seconds() {
    let cert = test_cert();
    let options = ClientOptions::new("127.0.0.1:4433".parse().unwrap(), cert, "c");
    assert_eq!(
        (options.keep_alive, options.idle_timeout, options.connect_timeout),
        (Duration::from_secs(2), Duration::from_secs(15), Duration::from_secs(2))
    );
    let config = crate::config::ConnectionConfig::default();
    assert_eq!(
        (config.keep_alive(), config.idle_timeout(), config.connect_timeout()),
        (options.keep_alive, options.idle_timeout, options.connect_timeout),
        "client.toml's defaults are the library's"
    );
}

#[test]
fn a_connection_that_was_up_resets_the_backoff() {
    let backoff = Backoff::default();
    let mut rng = Rng::derive(1, 2);
    let mut failures = Failures::default();
    for _ in 0..6 {
        failures.failed();
    }
    assert!(backoff.delay(failures.failed(), &mut rng) > backoff.initial, "six failures in a row back off");
    failures.connected();
    // The connection is lost: the first retry waits no more than the initial delay.
    let attempt = failures.failed();
    assert_eq!(attempt, 1);
    let delay = backoff.delay(attempt, &mut rng);
    assert!(delay >= backoff.initial / 2 && delay <= backoff.initial, "{delay:?}");
    // And a second loss in a row (the server is still down) backs off from there.
    assert_eq!(failures.failed(), 2);
}

/// A QUIC server on loopback that completes every handshake and closes the connection at
/// once (no welcome): a server that keeps turning the device away for a reason a retry may
/// clear. Returns its address, its certificate and the count of connections it took.
fn closing_server(
    close: fn(&quinn::Connection),
) -> (SocketAddr, CertificateDer<'static>, Arc<std::sync::atomic::AtomicUsize>) {
    let (config, cert) = self_signed_server();
    let endpoint = quinn::Endpoint::server(config, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = endpoint.local_addr().unwrap();
    let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = count.clone();
    tokio::spawn(async move {
        while let Some(incoming) = endpoint.accept().await {
            if let Ok(conn) = incoming.await {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                close(&conn);
            }
        }
    });
    (addr, cert, count)
}

/// A connection that ends before the server's welcome is a failed attempt: the backoff
/// grows. (Were it to restart from the initial delay at every handshake, a device the server
/// turns away at once would retry about 5 times a second forever.)
#[tokio::test]
async fn a_server_that_closes_before_the_welcome_is_retried_with_growing_backoff() {
    let (addr, cert, count) = closing_server(|c| c.close(quinn::VarInt::from_u32(7), b"not now"));
    let mut options = ClientOptions::new(addr, cert, "c");
    options.backoff = Backoff { initial: Duration::from_millis(50), max: Duration::from_secs(60), max_attempts: None };
    let ran =
        tokio::time::timeout(Duration::from_secs(3), run(options, Box::new(Idle { refuse_state: false }), None)).await;
    assert!(ran.is_err(), "a transient refusal does not stop the client: {ran:?}");
    let connections = count.load(std::sync::atomic::Ordering::SeqCst);
    println!("connections turned away in 3 s: {connections}");
    // Delays of at least 25, 50, 100, 200, 400, 800 and 1600 ms: 8 connections at most in 3 s
    // (a backoff that restarts at every handshake makes about 60).
    assert!((3..=8).contains(&connections), "{connections} connections in 3 s");
}

/// The server's TLS alerts about this device's certificate stop the client; other alerts
/// and closes are retried.
#[test]
fn the_servers_certificate_alerts_are_definite_refusals() {
    let closed = |alert: u8| {
        quinn::ConnectionError::ConnectionClosed(quinn::ConnectionClose {
            error_code: quinn::TransportErrorCode::crypto(alert),
            frame_type: None,
            reason: Default::default(),
        })
    };
    let kind = |alert| definite_refusal(&closed(alert)).map(|(k, _)| k);
    assert_eq!(kind(44), Some(RefusalKind::Revoked));
    assert_eq!(kind(48), Some(RefusalKind::UnknownCa));
    assert_eq!(kind(45), Some(RefusalKind::Expired));
    assert_eq!(kind(42), Some(RefusalKind::BadCertificate));
    assert_eq!(kind(49), Some(RefusalKind::BadCertificate));
    assert_eq!(kind(116), Some(RefusalKind::NoCertificate));
    assert_eq!(kind(120), Some(RefusalKind::Incompatible));
    assert_eq!(kind(80), None, "internal_error may clear");
    assert_eq!(kind(40), None, "handshake_failure may clear");
    let (_, detail) = definite_refusal(&closed(44)).unwrap();
    assert!(detail.contains("44") && detail.contains("CertificateRevoked"), "{detail}");
    let app = quinn::ConnectionError::ApplicationClosed(quinn::ApplicationClose {
        error_code: quinn::VarInt::from_u32(1),
        reason: Default::default(),
    });
    assert!(definite_refusal(&app).is_none());
    assert!(definite_refusal(&quinn::ConnectionError::TimedOut).is_none());
    // What the operator reads.
    let refused = Refused {
        client: "edge-9".into(),
        server: "127.0.0.1:4433".parse().unwrap(),
        kind: RefusalKind::Revoked,
        detail: "TLS alert 44".into(),
    };
    let text = refused.to_string();
    assert!(
        text.contains("edge-9") && text.contains("revoked") && text.contains("anchorage ca issue client edge-9"),
        "{text}"
    );
}

/// A server that does not answer costs `connect_timeout` an attempt, not the idle timeout,
/// and each timed-out attempt counts as a failure.
#[tokio::test]
async fn a_connect_attempt_to_a_silent_server_times_out() {
    let (_silent, options) = silent_server("c");
    let started = Instant::now();
    let result =
        tokio::time::timeout(Duration::from_secs(10), run(options, Box::new(Idle { refuse_state: false }), None))
            .await
            .expect("gave up long before the 30 s idle timeout");
    let error = result.unwrap_err().to_string();
    assert!(error.contains("after 3 attempts") && error.contains("no answer within 300ms"), "{error}");
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(5), "{took:?}");
}

/// Corrupt files, and a device state the method refuses, are set aside at start: the client
/// goes on to connect (here to a silent server) instead of failing at start.
#[tokio::test]
async fn corrupt_or_refused_files_do_not_stop_the_client_at_start() {
    for refuse_state in [false, true] {
        let dir = temp_dir(&format!("start-{refuse_state}"));
        let store = ClientStore::new(&dir);
        std::fs::write(dir.join("pending-update.bin"), b"ANCHUPD2 not what it was").unwrap();
        if refuse_state {
            let blocks = [ParamBlock::encode("tail.values", &[1], &[1.0], anchorage_shared::tensor::Encoding::F32)];
            store.save_device_state(&blocks).unwrap();
        } else {
            std::fs::write(dir.join("device-state.bin"), b"ANCHDEV2\0\0\0\0").unwrap();
        }
        let (_silent, mut options) = silent_server("c");
        options.backoff.max_attempts = Some(1);
        options.store = Some(store);
        let (tx, mut rx) = mpsc::unbounded_channel();
        let error = run(options, Box::new(Idle { refuse_state }), Some(tx)).await.unwrap_err().to_string();
        assert!(error.contains("could not reach"), "it got as far as connecting: {error}");
        assert!(rx.try_recv().is_err(), "no event: it never connected");
        let files = names(&dir);
        assert_eq!(files.len(), 2, "{files:?}");
        assert!(files[0].starts_with("device-state.bin.corrupt-") || files[0].starts_with("device-state.bin.refused-"));
        assert_eq!(files[0].contains("refused"), refuse_state, "{files:?}");
        assert!(files[1].starts_with("pending-update.bin.corrupt-"), "{files:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
