//! Bounded cost per peer over real QUIC on loopback: what one authenticated but hostile device
//! can make the server hold, and for how long.
//! - frames that declare 64 MiB and then stall: the server holds what arrived (not the declared
//!   size) and closes each at the read-stall timeout;
//! - an update of 80,000 tiny blocks: refused by the block cap, the server keeps serving;
//! - a control message larger than the control-frame cap: refused before its body is read.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anchorage_client::transport::ClientCert;
use anchorage_pki::{Kind, ProjectCa};
use anchorage_server::engine::EngineConfig;
use anchorage_server::methods::FedAvg;
use anchorage_server::tls::Trust;
use anchorage_server::transport::{self as server, Limits, ServerHandle, ServerOptions};
use anchorage_shared::frame::{DEFAULT_MAX_FRAME, LEN_BYTES};
use anchorage_shared::io::read_frame;
use anchorage_shared::protocol::{KIND_UPDATE, Message, PROTOCOL_VERSION, RefusalReason, Update};
use anchorage_shared::tensor::{Encoding, ParamBlock};
use anchorage_tests::{frame, join, raw_connect_as};

async fn start(dir: &Path, limits: Limits) -> (ServerHandle, ProjectCa) {
    let mut ca = ProjectCa::init(&dir.join("ca"), "bounds-test", 30).unwrap();
    let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 30).unwrap();
    let server = server::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity,
        trust: Trust::ProjectCa { ca: ca.cert().clone(), crl: None },
        engine: EngineConfig { rounds: 1, min_available: 100, ..EngineConfig::default() },
        method: Box::new(FedAvg::default()),
        initial: vec![ParamBlock::encode("head.weight", &[2], &[0.0; 2], Encoding::F32)],
        limits,
        store: None,
    })
    .await
    .unwrap();
    (server, ca)
}

fn device(ca: &mut ProjectCa, id: &str) -> ClientCert {
    let identity = ca.issue(Kind::Client, id, &[], 30).unwrap();
    ClientCert { chain: vec![identity.cert], key: identity.key }
}

/// Resident memory of this process (the server runs in it), from /proc.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_64_mib_frames_hold_little_and_are_closed_at_the_stall_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let stall = Duration::from_secs(2);
    let (server, mut ca) = start(dir.path(), Limits { read_stall: stall, ..Limits::default() }).await;
    let root = ca.cert().clone();
    let before = rss_bytes();
    let mut peers = Vec::new();
    for i in 0..8 {
        let id = format!("staller-{i}");
        let (endpoint, conn) = raw_connect_as(server.local_addr, &root, Some(&device(&mut ca, &id))).await.unwrap();
        let control = join(&conn, &id).await;
        // An update frame that declares 64 MiB, sends 1 KiB of it, and stops.
        let mut uni = conn.open_uni().await.unwrap();
        let declared = (DEFAULT_MAX_FRAME - 16) as u32;
        let mut head = declared.to_le_bytes().to_vec();
        head.extend([PROTOCOL_VERSION, KIND_UPDATE]);
        head.extend(vec![0u8; 1024]);
        uni.write_all(&head).await.unwrap();
        peers.push((endpoint, conn, control, uni));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let held = rss_bytes().saturating_sub(before);
    println!("8 stalled frames declaring 64 MiB each: the process grew by {} KiB", held / 1024);
    assert!(held < 64 << 20, "the server buffers what arrived, not what was declared ({held} bytes)");
    let started = Instant::now();
    for (_, conn, _, _) in &peers {
        let reason =
            tokio::time::timeout(Duration::from_secs(15), conn.closed()).await.expect("closed at the stall timeout");
        println!("stalled peer closed after {:?}: {reason}", started.elapsed());
    }
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_blocks_and_oversized_control_frames_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (server, mut ca) = start(dir.path(), Limits::default()).await;
    let root = ca.cert().clone();

    // 80,000 tiny blocks in one update.
    let (_e1, conn) = raw_connect_as(server.local_addr, &root, Some(&device(&mut ca, "many"))).await.unwrap();
    let (_send, mut control) = join(&conn, "many").await;
    let blocks = (0..80_000).map(|i| ParamBlock::encode(format!("b{i}"), &[1], &[0.0], Encoding::F32)).collect();
    let update = Update {
        prototypes_are: Default::default(),
        round: 1,
        num_samples: 1,
        blocks,
        prototypes: vec![],
        metrics: vec![],
        compute_seconds: 0.0,
    };
    let bytes = frame(&Message::Update(update));
    let started = Instant::now();
    let mut uni = conn.open_uni().await.unwrap();
    uni.write_all(&bytes).await.unwrap();
    uni.finish().unwrap();
    match read_frame(&mut control, DEFAULT_MAX_FRAME).await.unwrap() {
        Some((Message::Refusal(r), _)) => {
            println!("{} KiB update refused after {:?}: {}", bytes.len() / 1024, started.elapsed(), r.detail);
            assert!(r.detail.contains("at most 4096"), "{}", r.detail);
        }
        other => panic!("expected a refusal, got {other:?}"),
    }

    // A "hello" of 1 MiB on the control stream: refused from its header.
    let (_e2, conn) = raw_connect_as(server.local_addr, &root, Some(&device(&mut ca, "big-hello"))).await.unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let mut head = ((1u32 << 20) + 2).to_le_bytes().to_vec();
    head.extend([PROTOCOL_VERSION, 1]);
    assert_eq!(head.len(), LEN_BYTES + 2);
    send.write_all(&head).await.unwrap();
    match read_frame(&mut recv, DEFAULT_MAX_FRAME).await.unwrap() {
        Some((Message::Refusal(r), _)) => assert_eq!(r.reason, RefusalReason::TooLarge, "{}", r.detail),
        other => panic!("expected a refusal, got {other:?}"),
    }
    server.shutdown().await.unwrap();
}

/// 1,000 devices with valid certificates connect and say hello to the real server process: its
/// memory stays bounded while they are connected and comes back when they leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_connections_cost_bounded_memory() {
    use anchorage_tests::process::{Ending, ServerProcess};
    const PEERS: usize = 1000;
    let dir = tempfile::tempdir().unwrap();
    let bin = Path::new(env!("CARGO_BIN_EXE_server-process"));
    // No round opens (it would wait for more devices than connect): this measures connections.
    let mut server = ServerProcess::new(dir.path(), bin, PEERS + 1);
    server.spawn();
    assert!(server.wait_listening(Duration::from_secs(30)), "{}", server.log_tail());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let start = server.rss_bytes().unwrap();
    let peers = server.connect_peers("peer", PEERS).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let connected = server.rss_bytes().unwrap();
    anchorage_tests::process::close_peers(peers).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = server.rss_bytes().unwrap();

    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "server RSS: {:.1} MiB at start, {:.1} MiB with {PEERS} devices connected, {:.1} MiB after they left",
        mib(start),
        mib(connected),
        mib(after)
    );
    server.stop(Ending::Term);
    assert!(connected < 200 << 20, "{PEERS} connections hold {:.1} MiB", mib(connected));
    assert!(after < start + (20 << 20), "memory comes back after they leave ({:.1} MiB)", mib(after));
}

/// A device that says hello and then never reads: its 4 MiB broadcast stops at its flow-control
/// window, and the server drops it at the stall timeout instead of buffering for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let mut ca = ProjectCa::init(&dir.path().join("ca"), "slow-reader", 30).unwrap();
    let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 30).unwrap();
    let server = server::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity,
        trust: Trust::ProjectCa { ca: ca.cert().clone(), crl: None },
        engine: EngineConfig { rounds: 1, min_available: 1, min_fit: 1, ..EngineConfig::default() },
        method: Box::new(FedAvg::default()),
        initial: vec![ParamBlock::encode("head.weight", &[1 << 20], &vec![0.5; 1 << 20], Encoding::F32)],
        limits: Limits { read_stall: Duration::from_secs(2), ..Limits::default() },
        store: None,
    })
    .await
    .unwrap();
    let root = ca.cert().clone();
    let (_endpoint, conn) = raw_connect_as(server.local_addr, &root, Some(&device(&mut ca, "sloth"))).await.unwrap();
    let _control = join(&conn, "sloth").await; // the round opens and its broadcast is sent; nothing reads it
    let started = Instant::now();
    let reason =
        tokio::time::timeout(Duration::from_secs(20), conn.closed()).await.expect("the slow reader is dropped");
    println!("slow reader dropped after {:?}: {reason}", started.elapsed());
    assert!(reason.to_string().contains("not reading"), "{reason}");
    server.shutdown().await.unwrap();
}

/// quinn keeps an endpoint's routing tables at their largest, so the server replaces its
/// endpoint once a fleet of `renew_endpoint_after` connections has left (memory back
/// after 10,000 devices leave). Here the bound is 3: three devices come and go, the endpoint is
/// renewed on the same address, and a fourth device joins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_is_renewed_after_a_fleet_leaves_and_devices_still_join() {
    let dir = tempfile::tempdir().unwrap();
    let limits = Limits { renew_endpoint_after: 3, ..Limits::default() };
    let (server, mut ca) = start(dir.path(), limits).await;
    let root = ca.cert().clone();
    let renewals = |server: &ServerHandle| {
        let text = server.metrics.render();
        anchorage_tests::metric_value(&text, "anchorage_endpoint_renewals_total").unwrap_or(-1.0)
    };
    let mut fleet = Vec::new();
    for i in 0..3 {
        let id = format!("leaver-{i}");
        let (endpoint, conn) = raw_connect_as(server.local_addr, &root, Some(&device(&mut ca, &id))).await.unwrap();
        let control = join(&conn, &id).await;
        fleet.push((endpoint, conn, control));
    }
    // While one connection stays, the endpoint is kept (the 5 s check runs at least once).
    let (stayer_endpoint, stayer, stayer_control) = fleet.pop().unwrap();
    for (endpoint, conn, _) in fleet {
        conn.close(0u32.into(), b"bye");
        endpoint.wait_idle().await;
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(renewals(&server), 0.0, "renewed while a device was still connected");
    drop(stayer_control);
    stayer.close(0u32.into(), b"bye");
    stayer_endpoint.wait_idle().await;
    let deadline = Instant::now() + Duration::from_secs(15);
    while renewals(&server) < 1.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(renewals(&server), 1.0, "the emptied endpoint was renewed once");

    // The fresh endpoint answers on the same address with the same certificate: the newcomer's
    // hello is welcomed (`join` asserts it).
    let (_endpoint, conn) = raw_connect_as(server.local_addr, &root, Some(&device(&mut ca, "newcomer"))).await.unwrap();
    let _control = join(&conn, "newcomer").await;
    server.shutdown().await.unwrap();
}
