//! Resumable broadcasts over real QUIC on loopback, against the real server
//! and the real client: a device whose link goes dark in the middle of a 20 MB broadcast, long
//! enough that its connection dies, reconnects and receives only what it did not hold. Measured
//! side by side in one run with a device that does not take resumable broadcasts (an older
//! client: the server sends it the broadcast whole on a uni stream, again from byte 0).
//! And the server's side of the protocol with a raw device: an older device keeps getting uni
//! streams; an answer past the end is refused with a reason, a log line and a metric.
//!
//! `cargo test -p anchorage-tests --test broadcast_resume -- --nocapture` prints the figures
//! (benches/README.md, "Broadcasts through outages").

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anchorage_client::methods::{ClientMethod, TrainError, Trained};
use anchorage_client::transport::{Backoff, ClientCert, ClientEvent, ClientOptions, SocketWrapper};
use anchorage_model::FeatureCache;
use anchorage_pki::{Kind, ProjectCa};
use anchorage_server::engine::EngineConfig;
use anchorage_server::methods::FedAvg;
use anchorage_server::tls::Trust;
use anchorage_server::transport::{self as server, Limits, ServerHandle, ServerOptions};
use anchorage_shared::frame::DEFAULT_MAX_FRAME;
use anchorage_shared::io::read_frame;
use anchorage_shared::protocol::{Broadcast, Message, TransferResume};
use anchorage_shared::tensor::{Encoding, ParamBlock};
use anchorage_shared::transfer::{CHUNK_BYTES, MAX_CHUNK_FRAME, RESUMABLE_BROADCASTS_ALPN};
use anchorage_sim::network::{DuplexProfile, DuplexStats, LinkHandle, LinkProfile, Outage, ShapedSocket};
use anchorage_tests::{join, metric_value, raw_connect_as, write};
use quinn::crypto::rustls::QuicClientConfig;
use tokio::sync::mpsc;

/// Values of the model's one block: 20 MB of f32.
const BIG: usize = 5_000_000;
/// The downlink: 24 Mbit/s, so the broadcast takes at least 6.7 s, and goes dark from 4 s to
/// 10 s: past the device's 3 s idle timeout, so its connection dies in the middle.
const DOWN_BPS: f64 = 24e6;
const DARK: Outage = Outage { start_ms: 4_000, duration_ms: 6_000, every_ms: None };

async fn start(dir: &std::path::Path, values: usize) -> (ServerHandle, ProjectCa) {
    let mut ca = ProjectCa::init(&dir.join("ca"), "broadcast-resume-test", 30).unwrap();
    let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 30).unwrap();
    let values: Vec<f32> = (0..values).map(|i| ((i % 89) as f32 - 44.0) * 1e-3).collect();
    let server = server::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity,
        trust: Trust::ProjectCa { ca: ca.cert().clone(), crl: None },
        engine: EngineConfig {
            rounds: 1,
            min_available: 1,
            min_fit: 1,
            round_deadline: Duration::from_secs(600),
            ..EngineConfig::default()
        },
        method: Box::new(FedAvg::default()),
        initial: vec![ParamBlock::encode("head.weight", &[values.len() as u32], &values, Encoding::F32)],
        limits: Limits::default(),
        store: None,
    })
    .await
    .unwrap();
    (server, ca)
}

/// A device that "trains" at once: its update is the global blocks it was sent, nudged.
struct Echo;

impl ClientMethod for Echo {
    fn name(&self) -> &'static str {
        "fedavg"
    }
    fn num_samples(&self) -> u64 {
        10
    }
    fn train(&mut self, b: &Broadcast) -> Result<Trained, TrainError> {
        let nudged = |block: &ParamBlock| {
            let values: Vec<f32> = block
                .decode()
                .unwrap()
                .iter()
                .enumerate()
                .map(|(i, v)| v + if i % 2 == 0 { 1e-3 } else { -1e-3 })
                .collect();
            ParamBlock::encode(block.name.clone(), &block.tensor.shape, &values, Encoding::F32)
        };
        let blocks = b.blocks.iter().map(nudged).collect();
        Ok(Trained { prototypes_are: Default::default(), num_samples: 10, blocks, prototypes: vec![], metrics: vec![] })
    }
    fn global_accuracy(&self, _: &Broadcast, _: &FeatureCache) -> Result<Option<f64>, TrainError> {
        Ok(None)
    }
    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
        Ok(Vec::new())
    }
}

/// What one device's round through the dark link came to.
#[derive(Debug)]
struct Run {
    /// The broadcast's parameter bytes (the cost record's `payload_down`).
    payload: u64,
    /// Bytes the device received until the broadcast was delivered (the datagrams that got
    /// through the downlink).
    down_at_broadcast: u64,
    /// Bytes the server sent toward the device meanwhile (what the outage and the link's full
    /// queue dropped included).
    sent_at_broadcast: u64,
    /// The cost record's `wire_down`: what the device counted for the broadcast.
    wire_down: u64,
    /// From the device's start to the broadcast's delivery, and to its round's end.
    broadcast_s: f64,
    round_s: f64,
    link: DuplexStats,
}

/// The real client with `resume_broadcasts` through the dark link, until its round is done.
async fn through_the_dark(resume_broadcasts: bool) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let (server, mut ca) = start(dir.path(), BIG).await;
    let device = ca.issue(Kind::Client, "edge", &[], 30).unwrap();
    let mut options = ClientOptions::new(server.local_addr, ca.cert().clone(), "edge");
    options.client_cert = Some(Arc::new(ClientCert { chain: vec![device.cert], key: device.key }));
    options.resume_broadcasts = resume_broadcasts;
    options.keep_alive = Duration::from_secs(1);
    options.idle_timeout = Duration::from_secs(3);
    options.backoff = Backoff { initial: Duration::from_millis(100), max: Duration::from_secs(1), max_attempts: None };
    let down = LinkProfile {
        bandwidth_bps: DOWN_BPS,
        latency_ms: 20.0,
        buffer_bytes: 1 << 20,
        outages: vec![DARK],
        ..LinkProfile::default()
    };
    let up = LinkProfile { latency_ms: 20.0, outages: vec![DARK], ..LinkProfile::default() };
    let link: Arc<Mutex<Option<LinkHandle>>> = Arc::default();
    let filled = link.clone();
    options.socket_wrapper = Some(SocketWrapper(Arc::new(move |socket| {
        let (shaped, handle) = ShapedSocket::new(socket, DuplexProfile::new(up.clone(), down.clone()), 41)?;
        *filled.lock().unwrap() = Some(handle);
        Ok(shaped as Arc<dyn quinn::AsyncUdpSocket>)
    })));
    let stats = move || link.lock().unwrap().as_ref().map(LinkHandle::stats).unwrap_or_default();

    let started = Instant::now();
    let (tx, mut events) = mpsc::unbounded_channel();
    let client = tokio::spawn(anchorage_client::transport::run(options, Box::new(Echo), Some(tx)));
    let (mut down_at_broadcast, mut broadcast_s, mut reconnects) = (None, 0.0, 0);
    let cost = loop {
        let event = tokio::time::timeout(Duration::from_secs(120), events.recv()).await;
        match event.expect("the round ends within 2 minutes").expect("the client runs") {
            ClientEvent::RoundStarted { round: 1 } if down_at_broadcast.is_none() => {
                let down = stats().down;
                down_at_broadcast = Some((down.delivered_bytes, down.bytes));
                broadcast_s = started.elapsed().as_secs_f64();
            }
            ClientEvent::Disconnected { .. } => reconnects += 1,
            ClientEvent::RoundDone { cost, aggregated } => {
                assert!(aggregated, "the round aggregated the device's update");
                break cost;
            }
            _ => {}
        }
    };
    let round_s = started.elapsed().as_secs_f64();
    let _ = tokio::time::timeout(Duration::from_secs(10), client).await;
    server.shutdown().await.unwrap();
    let link = stats();
    assert!(reconnects >= 1, "the outage broke the connection");
    assert!(link.down.lost_outage > 0, "the outage fell inside the broadcast: {link:?}");
    let run = Run {
        payload: cost.payload_down,
        down_at_broadcast: down_at_broadcast.expect("the broadcast arrived").0,
        sent_at_broadcast: down_at_broadcast.expect("the broadcast arrived").1,
        wire_down: cost.wire_down,
        broadcast_s,
        round_s,
        link,
    };
    println!(
        "resume_broadcasts = {resume_broadcasts}: a {} B broadcast through a 6 s outage: {} B received until it \
         arrived ({:.3}x; {} B sent into the link), the device's cost record counts {} B ({:.3}x); broadcast at \
         {:.1} s, round done at {:.1} s; {:?}",
        run.payload,
        run.down_at_broadcast,
        run.down_at_broadcast as f64 / run.payload as f64,
        run.sent_at_broadcast,
        run.wire_down,
        run.wire_down as f64 / run.payload as f64,
        run.broadcast_s,
        run.round_s,
        run.link.down
    );
    run
}

/// The device resumes the broadcast where its lost connection left it, instead of
/// receiving all of it again (the baseline, measured in the same run, receives it about 1.6
/// times).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broadcast_broken_off_by_an_outage_resumes_instead_of_starting_again() {
    let resumed = through_the_dark(true).await;
    let again = through_the_dark(false).await;
    println!();
    println!(
        "| device | received until the broadcast arrived | × payload | sent into the link | broadcast at | round done at |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, r) in [("resumes broadcasts", &resumed), ("receives from byte 0 (before)", &again)] {
        println!(
            "| {name} | {:.1} MB | {:.3} | {:.1} MB | {:.1} s | {:.1} s |",
            r.down_at_broadcast as f64 / 1e6,
            r.down_at_broadcast as f64 / r.payload as f64,
            r.sent_at_broadcast as f64 / 1e6,
            r.broadcast_s,
            r.round_s
        );
    }
    assert!(resumed.payload >= 20_000_000, "a 20 MB broadcast: {}", resumed.payload);
    let ratio = resumed.down_at_broadcast as f64 / resumed.payload as f64;
    assert!(ratio <= 1.15, "{ratio:.3}x the broadcast went down the link with resume");
    let baseline = again.down_at_broadcast as f64 / again.payload as f64;
    assert!(baseline > 1.3, "{baseline:.3}x without resume: the outage did not make it start again?");
    assert!(
        resumed.wire_down >= resumed.payload,
        "the cost record counts the bytes of both connections: {} < {}",
        resumed.wire_down,
        resumed.payload
    );
}

/// A bare QUIC connection that offers `alpn` only.
async fn connect_with_alpn(server: &ServerHandle, ca: &mut ProjectCa, id: &str, alpn: &[u8]) -> quinn::Connection {
    let identity = ca.issue(Kind::Client, id, &[], 30).unwrap();
    let cert = ClientCert { chain: vec![identity.cert], key: identity.key };
    let mut crypto = anchorage_client::transport::client_crypto(ca.cert(), Some(&cert)).unwrap();
    crypto.alpn_protocols = vec![alpn.to_vec()];
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(crypto).unwrap())));
    endpoint.connect(server.local_addr, "localhost").unwrap().await.unwrap()
}

/// The server's side with raw devices: an older device gets the broadcast whole on a uni
/// stream; one that takes resumable broadcasts gets an offer, and the chunks from the offset it
/// answers; an answer past the end of the broadcast is refused (the connection closes with the
/// reason, a log line, `anchorage_transfers_total{outcome="broadcast_refused"}`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_devices_get_uni_streams_and_answers_past_the_end_are_refused() {
    // Each device is the one its server samples (min_fit 1): a server each. A 2 MiB broadcast:
    // 32 chunks.
    let read = |d| Duration::from_secs(d);

    // An older device (ALPN `anchorage/1` only): the broadcast on a uni stream.
    let dir = tempfile::tempdir().unwrap();
    let (server, mut ca) = start(dir.path(), 1 << 19).await;
    let identity = ca.issue(Kind::Client, "old", &[], 30).unwrap();
    let cert = ClientCert { chain: vec![identity.cert], key: identity.key };
    let (_endpoint, old) = raw_connect_as(server.local_addr, ca.cert(), Some(&cert)).await.unwrap();
    let _control = join(&old, "old").await;
    let mut uni = tokio::time::timeout(read(20), old.accept_uni()).await.unwrap().unwrap();
    let frame = read_frame(&mut uni, DEFAULT_MAX_FRAME).await.unwrap();
    assert!(matches!(frame, Some((Message::Broadcast(ref b), _)) if b.round == 1), "{frame:?}");
    server.shutdown().await.unwrap();

    // A device that takes resumable broadcasts, and says it holds 3 chunks: they are not sent.
    let dir = tempfile::tempdir().unwrap();
    let (server, mut ca) = start(dir.path(), 1 << 19).await;
    let new = connect_with_alpn(&server, &mut ca, "new", RESUMABLE_BROADCASTS_ALPN).await;
    let _control = join(&new, "new").await;
    let (mut send, mut recv) = tokio::time::timeout(read(20), new.accept_bi()).await.unwrap().unwrap();
    let Some((Message::TransferOffer(offer), _)) = read_frame(&mut recv, MAX_CHUNK_FRAME).await.unwrap() else {
        panic!("a broadcast transfer begins with its offer")
    };
    assert_eq!(offer.round, 1);
    let held = 3 * CHUNK_BYTES as u64;
    write(&mut send, &Message::TransferResume(TransferResume { transfer: offer.transfer, offset: held }))
        .await
        .unwrap();
    let mut at = held;
    while let Some((msg, _)) = read_frame(&mut recv, MAX_CHUNK_FRAME).await.unwrap() {
        let Message::Chunk(chunk) = msg else { panic!("chunks follow the answer: {msg:?}") };
        assert_eq!(chunk.offset, at, "from the answer's offset, in order");
        assert_eq!(anchorage_shared::transfer::sha256(&chunk.data), chunk.hash);
        at += chunk.data.len() as u64;
    }
    assert_eq!(at, offer.total, "every chunk past what the device held");
    let completed = "anchorage_transfers_total{outcome=\"broadcast_completed\"}";
    let cap = Instant::now() + read(10);
    while metric_value(&server.metrics.render(), completed) != Some(1.0) && Instant::now() < cap {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let text = server.metrics.render();
    assert_eq!(metric_value(&text, completed), Some(1.0));
    assert_eq!(metric_value(&text, "anchorage_transfers_total{outcome=\"broadcast_resumed\"}"), Some(1.0));
    server.shutdown().await.unwrap();

    // A device that answers past the end: refused.
    let dir = tempfile::tempdir().unwrap();
    let (server, mut ca) = start(dir.path(), 1 << 19).await;
    let liar = connect_with_alpn(&server, &mut ca, "liar", RESUMABLE_BROADCASTS_ALPN).await;
    let _control = join(&liar, "liar").await;
    let (mut send, mut recv) = tokio::time::timeout(read(20), liar.accept_bi()).await.unwrap().unwrap();
    let Some((Message::TransferOffer(offer), _)) = read_frame(&mut recv, MAX_CHUNK_FRAME).await.unwrap() else {
        panic!("a broadcast transfer begins with its offer")
    };
    let past = TransferResume { transfer: offer.transfer, offset: offer.total + 1 };
    write(&mut send, &Message::TransferResume(past)).await.unwrap();
    let closed = tokio::time::timeout(read(20), liar.closed()).await.expect("the server closes the connection");
    let why = closed.to_string();
    println!("an answer past the end: {why}");
    assert!(why.contains("past the end"), "{why}");
    let text = server.metrics.render();
    assert_eq!(metric_value(&text, "anchorage_transfers_total{outcome=\"broadcast_refused\"}"), Some(1.0));
    server.shutdown().await.unwrap();
}
