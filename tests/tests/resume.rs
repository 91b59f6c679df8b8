//! Resumable uploads over real QUIC on loopback, against the real server: a device
//! whose connection breaks in the middle of an update offers it again after reconnecting, and
//! the server answers with the bytes it holds; the device sends only the rest. Bad chunks and
//! chunks past the end are refused with a reason, a log line and a metric, and lose nothing held.
//! `tests/tests/network.rs` runs the real client through the link model.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anchorage_client::transport::ClientCert;
use anchorage_pki::{Kind, ProjectCa};
use anchorage_server::engine::EngineConfig;
use anchorage_server::methods::FedAvg;
use anchorage_server::store::ServerStore;
use anchorage_server::tls::Trust;
use anchorage_server::transport::{self as server, Limits, ServerHandle, ServerOptions};
use anchorage_shared::frame::DEFAULT_MAX_FRAME;
use anchorage_shared::io::read_frame;
use anchorage_shared::protocol::{Chunk, Message, RefusalReason, TransferOffer, Update};
use anchorage_shared::tensor::{Encoding, ParamBlock};
use anchorage_shared::transfer::{self, CHUNK_BYTES};
use anchorage_tests::{frame, join, metric_value, raw_connect_as, write};

/// Values of the model's one block: 2 MiB of f32, so an update is 32 chunks.
const VALUES: usize = 1 << 19;

async fn start(dir: &Path) -> (ServerHandle, ProjectCa) {
    let mut ca = ProjectCa::init(&dir.join("ca"), "resume-test", 30).unwrap();
    let server = start_with(&mut ca, None).await;
    (server, ca)
}

/// A server of `ca`'s project, with its state in `store` (`None`: in memory).
async fn start_with(ca: &mut ProjectCa, store: Option<ServerStore>) -> ServerHandle {
    let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 30).unwrap();
    server::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity,
        trust: Trust::ProjectCa { ca: ca.cert().clone(), crl: None },
        engine: EngineConfig { rounds: 1, min_available: 1, min_fit: 1, ..EngineConfig::default() },
        method: Box::new(FedAvg::default()),
        initial: vec![ParamBlock::encode("head.weight", &[VALUES as u32], &vec![0.0; VALUES], Encoding::F32)],
        limits: Limits::default(),
        store,
    })
    .await
    .unwrap()
}

fn update_frame() -> Vec<u8> {
    let values: Vec<f32> = (0..VALUES).map(|i| ((i % 97) as f32 - 48.0) * 1e-3).collect();
    let update = Update {
        prototypes_are: Default::default(),
        round: 1,
        num_samples: 10,
        blocks: vec![ParamBlock::encode("head.weight", &[VALUES as u32], &values, Encoding::F32)],
        prototypes: vec![],
        metrics: vec![],
        compute_seconds: 0.1,
    };
    frame(&Message::Update(update))
}

/// A connected device that said hello: its endpoint, connection and control stream.
struct Device {
    endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    control: (quinn::SendStream, quinn::RecvStream),
}

impl Device {
    async fn connect(server: &ServerHandle, ca: &mut ProjectCa, id: &str) -> Self {
        let identity = ca.issue(Kind::Client, id, &[], 30).unwrap();
        let cert = ClientCert { chain: vec![identity.cert], key: identity.key };
        let (endpoint, conn) = raw_connect_as(server.local_addr, ca.cert(), Some(&cert)).await.unwrap();
        let control = join(&conn, id).await;
        Self { endpoint, conn, control }
    }

    /// Offers `offer` on a new transfer stream; the server's answer (the offset it holds).
    async fn offer(&self, offer: &TransferOffer) -> (quinn::SendStream, u64) {
        let (mut send, mut recv) = self.conn.open_bi().await.unwrap();
        write(&mut send, &Message::TransferOffer(offer.clone())).await.unwrap();
        match read_frame(&mut recv, DEFAULT_MAX_FRAME).await.unwrap() {
            Some((Message::TransferResume(r), _)) => {
                assert_eq!(r.transfer, offer.transfer);
                (send, r.offset)
            }
            other => panic!("expected the server's answer to the offer, got {other:?}"),
        }
    }

    /// The link breaks: the device's side of the connection is gone without a goodbye.
    async fn lose_link(self) -> u64 {
        let sent = self.conn.stats().udp_tx.bytes;
        self.conn.close(0u32.into(), b"link lost");
        self.endpoint.wait_idle().await;
        sent
    }

    /// The server's ack of the update (it was whole and aggregated).
    async fn expect_ack(&mut self) -> anchorage_shared::protocol::Ack {
        match self.next_control().await {
            Message::Ack(ack) => ack,
            other => panic!("expected the update's ack, got {other:?}"),
        }
    }

    /// The server's refusal, which closes the connection.
    async fn expect_refusal(&mut self) -> anchorage_shared::protocol::Refusal {
        match self.next_control().await {
            Message::Refusal(r) => r,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    /// The next message on the control stream that is not a heartbeat.
    async fn next_control(&mut self) -> Message {
        loop {
            let read =
                tokio::time::timeout(Duration::from_secs(20), read_frame(&mut self.control.1, DEFAULT_MAX_FRAME));
            match read.await.expect("an answer within 20 s").unwrap() {
                Some((Message::Heartbeat(_), _)) => continue,
                Some((msg, _)) => return msg,
                None => panic!("the control stream ended"),
            }
        }
    }
}

async fn send_chunks(send: &mut quinn::SendStream, chunks: impl IntoIterator<Item = Chunk>) {
    for chunk in chunks {
        write(send, &Message::Chunk(chunk)).await.unwrap();
    }
}

/// Waits (bounded) until the server's `series` reaches `want`.
async fn metric_reaches(server: &ServerHandle, series: &str, want: f64) -> f64 {
    let cap = Instant::now() + Duration::from_secs(15);
    loop {
        let v = metric_value(&server.metrics.render(), series).unwrap_or(0.0);
        if v >= want || Instant::now() > cap {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_upload_resumes_from_what_the_server_holds() {
    let dir = tempfile::tempdir().unwrap();
    let (server, mut ca) = start(dir.path()).await;
    let whole = update_frame();
    let offer = transfer::offer(&whole, 1);
    let chunks: Vec<Chunk> = transfer::chunks_from(&whole, 0).collect();
    let half = chunks.len() / 2;

    // First attempt: half of the chunks arrive, then the link breaks.
    let device = Device::connect(&server, &mut ca, "traveller").await;
    let (mut send, offset) = device.offer(&offer).await;
    assert_eq!(offset, 0, "nothing is held before the first attempt");
    send_chunks(&mut send, chunks[..half].iter().cloned()).await;
    let held = (half * CHUNK_BYTES) as u64;
    let up = "anchorage_frame_bytes_total{direction=\"up\"}";
    assert!(metric_reaches(&server, up, held as f64).await >= held as f64, "the server read the first half");
    let first_wire = device.lose_link().await;
    assert_eq!(metric_reaches(&server, "anchorage_transfers_total{outcome=\"kept\"}", 1.0).await, 1.0);

    // Second attempt, on a new connection: the server holds the first half; the rest completes it.
    let mut device = Device::connect(&server, &mut ca, "traveller").await;
    let (mut send, offset) = device.offer(&offer).await;
    assert_eq!(offset, held, "the server holds every chunk that arrived");
    send_chunks(&mut send, transfer::chunks_from(&whole, offset)).await;
    send.finish().unwrap();
    let ack = device.expect_ack().await;
    assert!(ack.round == 1 && ack.aggregated, "{ack:?}");
    let second_wire = device.conn.stats().udp_tx.bytes;
    let text = server.metrics.render();
    assert_eq!(metric_value(&text, "anchorage_transfers_total{outcome=\"resumed\"}"), Some(1.0));
    assert_eq!(metric_value(&text, "anchorage_transfers_total{outcome=\"completed\"}"), Some(1.0));
    assert_eq!(metric_value(&text, "anchorage_transfer_bytes_resumed_total"), Some(held as f64));
    let ratio = (first_wire + second_wire) as f64 / whole.len() as f64;
    println!(
        "a {} B update, interrupted after {held} B: {first_wire} + {second_wire} B on the wire ({ratio:.3}x the payload)",
        whole.len()
    );
    assert!(ratio <= 1.15, "wire bytes {ratio:.3}x the payload (restarting from zero would be about 1.5x)");
    server.shutdown().await.unwrap();
}

/// The server restarts (gracefully: an upgrade, a `systemctl restart`) in the middle of an
/// upload: what it held is saved in its state folder and read back, and the device goes on from
/// there (a server that kept nothing would answer the offer with 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_interrupted_by_a_server_restart_resumes_from_what_it_held() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let mut ca = ProjectCa::init(&dir.path().join("ca"), "resume-test", 30).unwrap();
    let server = start_with(&mut ca, Some(ServerStore::open(&state).unwrap())).await;
    let whole = update_frame();
    let offer = transfer::offer(&whole, 1);
    let chunks: Vec<Chunk> = transfer::chunks_from(&whole, 0).collect();
    let half = chunks.len() / 2;

    // Half the chunks arrive; the server shuts down while the device's connection is open.
    let device = Device::connect(&server, &mut ca, "patient").await;
    let (mut send, _) = device.offer(&offer).await;
    send_chunks(&mut send, chunks[..half].iter().cloned()).await;
    let held = (half * CHUNK_BYTES) as u64;
    let up = "anchorage_frame_bytes_total{direction=\"up\"}";
    assert!(metric_reaches(&server, up, held as f64).await >= held as f64, "the server read the first half");
    let metrics = server.metrics.clone();
    server.shutdown().await.unwrap();
    assert_eq!(metric_value(&metrics.render(), "anchorage_transfers_total{outcome=\"saved\"}"), Some(1.0));
    drop(device);

    let server = start_with(&mut ca, Some(ServerStore::open(&state).unwrap())).await;
    let restored = "anchorage_transfers_total{outcome=\"restored\"}";
    assert_eq!(metric_value(&server.metrics.render(), restored), Some(1.0));
    let mut device = Device::connect(&server, &mut ca, "patient").await;
    let (mut send, offset) = device.offer(&offer).await;
    assert_eq!(offset, held, "the restarted server holds what the first one received");
    send_chunks(&mut send, transfer::chunks_from(&whole, offset)).await;
    send.finish().unwrap();
    let ack = device.expect_ack().await;
    assert!(ack.round == 1 && ack.aggregated, "{ack:?}");
    println!("a {} B upload: {held} B held across the server's restart, the rest sent after it", whole.len());
    server.shutdown().await.unwrap();
    assert!(
        !state.join("kept-uploads").exists() || std::fs::read_dir(state.join("kept-uploads")).unwrap().count() == 0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_chunks_and_chunks_past_the_end_are_refused_and_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (server, mut ca) = start(dir.path()).await;
    let whole = update_frame();
    let offer = transfer::offer(&whole, 1);
    let chunks: Vec<Chunk> = transfer::chunks_from(&whole, 0).collect();
    let held = (2 * CHUNK_BYTES) as u64;

    // Two good chunks, then one whose bytes do not match its hash.
    let mut device = Device::connect(&server, &mut ca, "garbler").await;
    let (mut send, _) = device.offer(&offer).await;
    send_chunks(&mut send, chunks[..2].iter().cloned()).await;
    let mut flipped = chunks[2].clone();
    flipped.data[7] ^= 0x10;
    send_chunks(&mut send, [flipped]).await;
    let r = device.expect_refusal().await;
    assert_eq!(r.reason, RefusalReason::Malformed);
    assert!(r.detail.contains("do not match its hash"), "{}", r.detail);
    device.lose_link().await;

    // Nothing held was lost; now a chunk that runs past the end of the transfer.
    let mut device = Device::connect(&server, &mut ca, "garbler").await;
    let (mut send, offset) = device.offer(&offer).await;
    assert_eq!(offset, held, "the refused chunk cost nothing held");
    let data = vec![1; 100];
    let past = Chunk { offset: whole.len() as u64 - 50, hash: transfer::sha256(&data), data };
    send_chunks(&mut send, [past]).await;
    let r = device.expect_refusal().await;
    assert!(r.detail.contains("runs past the end"), "{}", r.detail);
    device.lose_link().await;

    // An offer over the frame limit is refused before any chunk.
    let mut device = Device::connect(&server, &mut ca, "garbler").await;
    let huge = TransferOffer { transfer: [9; 32], total: DEFAULT_MAX_FRAME as u64 + 1, round: 1 };
    let (mut send, _) = device.conn.open_bi().await.unwrap();
    write(&mut send, &Message::TransferOffer(huge)).await.unwrap();
    let r = device.expect_refusal().await;
    assert_eq!(r.reason, RefusalReason::TooLarge, "{}", r.detail);
    device.lose_link().await;
    assert_eq!(metric_value(&server.metrics.render(), "anchorage_transfers_total{outcome=\"refused\"}"), Some(3.0));

    // The first offer is still resumable at the same offset, and completes.
    let mut device = Device::connect(&server, &mut ca, "garbler").await;
    let (mut send, offset) = device.offer(&offer).await;
    assert_eq!(offset, held, "refusals lost nothing held");
    send_chunks(&mut send, transfer::chunks_from(&whole, offset)).await;
    send.finish().unwrap();
    let ack = device.expect_ack().await;
    assert!(ack.aggregated, "{ack:?}");
    server.shutdown().await.unwrap();
}

/// A device whose address changes in the middle of an upload (NAT rebinding,
/// Wi-Fi to LTE: quinn's `Endpoint::rebind` moves it to a new socket) carries on: the same
/// connection, no new handshake, and the transfer neither restarts nor needs a resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_whose_address_changes_mid_upload_carries_on() {
    let dir = tempfile::tempdir().unwrap();
    let (server, mut ca) = start(dir.path()).await;
    let whole = update_frame();
    let offer = transfer::offer(&whole, 1);
    let chunks: Vec<Chunk> = transfer::chunks_from(&whole, 0).collect();
    let half = chunks.len() / 2;

    let mut device = Device::connect(&server, &mut ca, "commuter").await;
    let (mut send, offset) = device.offer(&offer).await;
    assert_eq!(offset, 0);
    send_chunks(&mut send, chunks[..half].iter().cloned()).await;
    let old_port = device.endpoint.local_addr().unwrap().port();
    device.endpoint.rebind(std::net::UdpSocket::bind("127.0.0.1:0").unwrap()).unwrap();
    let new_port = device.endpoint.local_addr().unwrap().port();
    assert_ne!(old_port, new_port, "the device is on a new address");
    send_chunks(&mut send, chunks[half..].iter().cloned()).await;
    send.finish().unwrap();
    let ack = device.expect_ack().await;
    assert!(ack.round == 1 && ack.aggregated, "{ack:?}");
    let text = server.metrics.render();
    println!("rebound from port {old_port} to {new_port} mid-upload");
    assert_eq!(metric_value(&text, "anchorage_connections_total"), Some(1.0), "no second handshake");
    assert_eq!(metric_value(&text, "anchorage_transfers_total{outcome=\"completed\"}"), Some(1.0));
    assert_eq!(metric_value(&text, "anchorage_transfers_total{outcome=\"resumed\"}"), Some(0.0), "nothing resumed");
    assert_eq!(metric_value(&text, "anchorage_transfers_total{outcome=\"kept\"}"), Some(0.0), "nothing broke off");
    assert!(device.conn.close_reason().is_none(), "the same connection lives on");
    server.shutdown().await.unwrap();
}
