//! Stream priorities over real QUIC through the link model: while a 20 MB
//! update of parameter blocks is in flight over the `3g` preset's uplink, a device sends a
//! prototype-only update (100 classes × 512 features, f32: about 205 KB) and control messages,
//! and the server's answers time how long each took. Measured side by side in one run, with the
//! priorities of `anchorage_shared::priority` and without them (`ClientOptions::stream_priorities`
//! and `[limits] stream_priorities` false: every stream at quinn's default).
//!
//! What the numbers say (benches/README.md, "Stream priorities"): without priorities the
//! prototypes take turns with the blocks, a packet each, and get half the link; with them they
//! get all of it, so they arrive in a little over half the time. A control message (a cost record,
//! answered by the server's `CostAck`) takes about the same either way: quinn's turn-taking
//! already puts it in the next packet, and what it waits behind is the link's bottleneck queue
//! (64 KiB on 3G, a second at 0.5 Mbit/s), which no stream priority can jump. The test asserts
//! the first (it fails when the priorities do nothing) and bounds the second by that queue.
//!
//! `cargo test -p anchorage-tests --test priorities -- --nocapture` prints the table.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anchorage_client::metrics::ClientMetrics;
use anchorage_client::transport::{ClientCert, ClientOptions, Priority, SocketWrapper, prioritise, send_resumable};
use anchorage_pki::{Kind, ProjectCa};
use anchorage_server::engine::EngineConfig;
use anchorage_server::methods::FedAvg;
use anchorage_server::tls::Trust;
use anchorage_server::transport::{self as server, Limits, ServerOptions};
use anchorage_shared::frame::DEFAULT_MAX_FRAME;
use anchorage_shared::io::read_frame;
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::{Message, Update};
use anchorage_shared::tensor::{Encoding, ParamBlock};
use anchorage_shared::{Prototype, encode_frame};
use anchorage_sim::network::{DuplexStats, LinkHandle, LinkPreset, ShapedSocket};
use anchorage_tests::{join, write};
use tokio::sync::mpsc;

/// Values of the update's one block: 20 MB of f32, about 5 minutes on the 3G uplink.
const BLOCK_VALUES: usize = 5_000_000;
/// The prototype-only update: a prototype per class of CIFAR-100 over ResNet-18's 512 features.
const CLASSES: u32 = 100;
const FEATURES: usize = 512;
/// How long the block upload runs before the first probe: the link's queue and the congestion
/// window are past slow start.
const WARMUP: Duration = Duration::from_secs(6);
/// Control-message probes behind the upload (the median is reported).
const PROBES: usize = 5;
/// The longest the test waits for one answer.
const ANSWER: Duration = Duration::from_secs(90);

/// What one run measured.
#[derive(Debug)]
struct Delays {
    /// A cost record's round trip (to its `CostAck`) before the upload starts.
    idle_control: Duration,
    /// The same behind the upload, each probe.
    control: Vec<Duration>,
    /// From offering the prototype-only update to the server's ack of it.
    prototypes: Duration,
    prototype_bytes: usize,
    /// UDP bytes the connection had sent up when the prototypes were offered and when their ack
    /// came.
    sent_up: (u64, u64),
    link: DuplexStats,
}

impl Delays {
    fn control_median(&self) -> Duration {
        let mut sorted = self.control.clone();
        sorted.sort();
        sorted[sorted.len() / 2]
    }
}

fn block_update() -> Vec<u8> {
    let values: Vec<f32> = (0..BLOCK_VALUES).map(|i| ((i % 97) as f32 - 48.0) * 1e-3).collect();
    let update = Update {
        prototypes_are: Default::default(),
        round: 1,
        num_samples: 10,
        blocks: vec![ParamBlock::encode("head.weight", &[BLOCK_VALUES as u32], &values, Encoding::F32)],
        prototypes: vec![],
        metrics: vec![],
        compute_seconds: 0.1,
    };
    encode_frame(&Message::Update(update), DEFAULT_MAX_FRAME).unwrap()
}

fn prototype_update() -> Update {
    let prototypes = (0..CLASSES)
        .map(|c| {
            let values: Vec<f32> = (0..FEATURES).map(|i| ((i as u32 * 31 + c * 7) % 101) as f32 * 1e-2).collect();
            Prototype::encode(c, 10, &values, Encoding::F32)
        })
        .collect();
    Update {
        prototypes_are: Default::default(),
        round: 1,
        num_samples: 10,
        blocks: vec![],
        prototypes,
        metrics: vec![],
        compute_seconds: 0.1,
    }
}

/// The server (FedAvg, no model: its broadcast is a few bytes, so the downlink stays quiet) and
/// the project CA its devices come from.
async fn start(dir: &std::path::Path, priorities: bool) -> (server::ServerHandle, ProjectCa) {
    let mut ca = ProjectCa::init(&dir.join("ca"), "priorities-test", 30).unwrap();
    let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 30).unwrap();
    let server = server::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity,
        trust: Trust::ProjectCa { ca: ca.cert().clone(), crl: None },
        engine: EngineConfig {
            rounds: 3,
            min_available: 1,
            min_fit: 1,
            round_deadline: Duration::from_secs(600),
            ..EngineConfig::default()
        },
        method: Box::new(FedAvg::default()),
        initial: vec![],
        limits: Limits { stream_priorities: priorities, ..Limits::default() },
        store: None,
    })
    .await
    .unwrap();
    (server, ca)
}

/// A QUIC connection of the client's own endpoint (its transport settings) through a `3g` link.
async fn connect(
    server: &server::ServerHandle,
    ca: &mut ProjectCa,
) -> (quinn::Endpoint, quinn::Connection, Arc<Mutex<Option<LinkHandle>>>) {
    let device = ca.issue(Kind::Client, "edge", &[], 30).unwrap();
    let mut options = ClientOptions::new(server.local_addr, ca.cert().clone(), "edge");
    options.client_cert = Some(Arc::new(ClientCert { chain: vec![device.cert], key: device.key }));
    let link: Arc<Mutex<Option<LinkHandle>>> = Arc::new(Mutex::new(None));
    let filled = link.clone();
    options.socket_wrapper = Some(SocketWrapper(Arc::new(move |socket| {
        let (shaped, handle) = ShapedSocket::new(socket, LinkPreset::ThreeG.profile(), 33)?;
        *filled.lock().unwrap() = Some(handle);
        Ok(shaped as Arc<dyn quinn::AsyncUdpSocket>)
    })));
    let endpoint = anchorage_client::transport::endpoint(&options).unwrap();
    let conn = endpoint.connect(server.local_addr, "localhost").unwrap().await.unwrap();
    (endpoint, conn, link)
}

/// The server's answers on the control stream, with when each arrived.
struct Answers(mpsc::UnboundedReceiver<(Instant, Message)>);

impl Answers {
    fn read(mut recv: quinn::RecvStream) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some((msg, _))) = read_frame(&mut recv, DEFAULT_MAX_FRAME).await {
                if tx.send((Instant::now(), msg)).is_err() {
                    return;
                }
            }
        });
        Self(rx)
    }

    /// When the first answer that `wanted` picks arrived (others are skipped).
    async fn first(&mut self, wanted: impl Fn(&Message) -> bool) -> Instant {
        let cap = tokio::time::Instant::now() + ANSWER;
        loop {
            match tokio::time::timeout_at(cap, self.0.recv()).await {
                Ok(Some((at, msg))) if wanted(&msg) => return at,
                Ok(Some((_, Message::Refusal(r)))) => panic!("refused: {r:?}"),
                Ok(Some(_)) => {}
                Ok(None) => panic!("the control stream ended"),
                Err(_) => panic!("no answer within {ANSWER:?}"),
            }
        }
    }
}

/// A cost record of round 1, and how long until the server confirmed it (`CostAck`). The first
/// goes into the ledger; the server confirms a resent one again.
async fn cost_round_trip(control: &mut quinn::SendStream, answers: &mut Answers) -> Duration {
    let sent = Instant::now();
    write(control, &Message::Cost(CostRecord { round: 1, ..CostRecord::default() })).await.unwrap();
    answers.first(|m| matches!(m, Message::CostAck(a) if a.round == 1)).await - sent
}

/// One run: connect through the link, start the block upload, and time a control message and a
/// prototype-only update behind it.
async fn measure(priorities: bool) -> Delays {
    let dir = tempfile::tempdir().unwrap();
    let (server, mut ca) = start(dir.path(), priorities).await;
    let (endpoint, conn, link) = connect(&server, &mut ca).await;
    let (mut control, recv) = join(&conn, "edge").await;
    prioritise(&control, Priority::Control.when(priorities));
    let mut broadcast = conn.accept_uni().await.unwrap();
    let first = read_frame(&mut broadcast, DEFAULT_MAX_FRAME).await.unwrap();
    assert!(matches!(first, Some((Message::Broadcast(ref b), _)) if b.round == 1), "{first:?}");
    let mut answers = Answers::read(recv);
    let idle_control = cost_round_trip(&mut control, &mut answers).await;

    let blocks = block_update();
    let (blocks_conn, block_priority) = (conn.clone(), Priority::Blocks.when(priorities));
    let upload =
        tokio::spawn(
            async move { send_resumable(&blocks_conn, &blocks, 1, block_priority, &ClientMetrics::new()).await },
        );
    tokio::time::sleep(WARMUP).await;
    let mut probes = Vec::new();
    for _ in 0..PROBES {
        probes.push(cost_round_trip(&mut control, &mut answers).await);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    let prototypes = prototype_update();
    let priority = Priority::of_update(&prototypes).when(priorities);
    assert_eq!(priority, Priority::Light.when(priorities), "a prototype-only update is light");
    let frame = encode_frame(&Message::Update(prototypes), DEFAULT_MAX_FRAME).unwrap();
    let prototype_bytes = frame.len();
    let before = conn.stats().udp_tx.bytes;
    let sent = Instant::now();
    let proto_conn = conn.clone();
    tokio::spawn(async move { send_resumable(&proto_conn, &frame, 1, priority, &ClientMetrics::new()).await });
    let acked = answers.first(|m| matches!(m, Message::Ack(a) if a.round == 1)).await;
    let after = conn.stats().udp_tx.bytes;
    assert!(!upload.is_finished(), "the block upload was in flight throughout: {:?}", upload.await);
    upload.abort();
    let stats = link.lock().unwrap().as_ref().map(LinkHandle::stats).unwrap_or_default();
    conn.close(0u32.into(), b"measured");
    endpoint.wait_idle().await;
    server.shutdown().await.unwrap();
    Delays {
        idle_control,
        control: probes,
        prototypes: acked - sent,
        prototype_bytes,
        sent_up: (before, after),
        link: stats,
    }
}

fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1e3)
}

/// Behind a 20 MB block upload on 3G, a prototype-only update arrives well
/// before it does without priorities, and a control message waits no longer than the link's
/// queue and round trip, with priorities or without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prototypes_and_control_messages_do_not_wait_behind_parameter_blocks() {
    let (without, with) = tokio::join!(measure(false), measure(true));
    println!(
        "| stream priorities | cost record → CostAck, idle link | cost record → CostAck, behind the upload (median of {PROBES}) | prototype-only update ({} B) → Ack, behind the upload |",
        with.prototype_bytes
    );
    println!("|---|---|---|---|");
    for (name, d) in [("off", &without), ("on", &with)] {
        println!("| {name} | {} | {} | {} |", ms(d.idle_control), ms(d.control_median()), ms(d.prototypes));
    }
    for (name, d) in [("without", &without), ("with", &with)] {
        println!(
            "{name} priorities: control probes {:?}; {} B sent up while the prototypes went; link {:?}",
            d.control.iter().map(|p| ms(*p)).collect::<Vec<_>>(),
            d.sent_up.1 - d.sent_up.0,
            d.link.up
        );
    }
    // The prototypes get the whole uplink instead of half of it: measured 0.6×; on a busy machine
    // the two runs may drift, hence the margin.
    let ratio = with.prototypes.as_secs_f64() / without.prototypes.as_secs_f64();
    assert!(ratio < 0.8, "with priorities the prototypes took {ratio:.2}× as long as without: {with:?} / {without:?}");
    // Behind the upload a control message waits for the link's bottleneck queue (64 KiB at
    // 0.5 Mbit/s, about 1 s) and a round trip, not for the megabytes of blocks queued in QUIC's
    // send buffer (8 MiB of stream window: over two minutes of this link).
    let queue = LinkPreset::ThreeG.profile().up;
    let drain = Duration::from_secs_f64(queue.buffer_bytes as f64 * 8.0 / queue.bandwidth_bps);
    for d in [&with, &without] {
        let bound = d.idle_control + drain + Duration::from_secs(2);
        assert!(d.control_median() < bound, "control behind the upload {:?}, bound {bound:?}", d.control);
    }
}
