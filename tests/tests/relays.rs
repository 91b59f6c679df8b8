//! The relay tier over real QUIC on loopback (issue 37): a root and two relays, each the server
//! program (`service::serve`) on its own site folder and SQLite store, with mutual TLS from one
//! project CA; devices are raw protocol peers with their own certificates, each sending a seeded
//! update per round to its relay. Checked from the databases: the root's global model is the
//! devices' sample-weighted mean (what one server would have made of their updates), and the
//! root's ledger holds every device's cost record of every round.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anchorage_client::transport::ClientCert;
use anchorage_pki::{Kind, ProjectCa};
use anchorage_server::config::ServerConfig;
use anchorage_server::methods::{FedAvg, RoundInfo, ServerMethod};
use anchorage_server::store::ServerStore;
use anchorage_shared::frame::DEFAULT_MAX_FRAME;
use anchorage_shared::io::read_frame;
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::{Message, Update};
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use anchorage_tests::process::free_udp_port;
use anchorage_tests::{join, raw_connect_as, write};

const ROUNDS: u64 = 2;
const PER_RELAY: usize = 3;
const RELAYS: usize = 2;

fn block(values: &[f32]) -> ParamBlock {
    ParamBlock::encode("head.weight", &[values.len() as u32], values, Encoding::F32)
}

/// Device `d`'s update of `round`: values near zero and a sample count of its own.
fn device_update(round: u64, d: usize) -> Update {
    let mut rng = Rng::derive(round * 100 + d as u64, 5);
    let values: Vec<f32> = (0..16).map(|_| rng.normal() as f32 * 0.1).collect();
    Update {
        round,
        num_samples: 5 + rng.below(100),
        blocks: vec![block(&values)],
        prototypes: vec![],
        metrics: vec![],
        compute_seconds: 0.1,
    }
}

fn device_id(d: usize) -> String {
    format!("edge-{d:02}")
}

/// A site folder: the CA's files and `kind`'s certificate for `id` (names: localhost).
fn site(ca: &mut ProjectCa, dir: &Path, kind: Kind, id: &str) -> PathBuf {
    let tls = dir.join(id).join("tls");
    anchorage_pki::site::issue(ca, kind, id, &["localhost".into()], 30, &tls).unwrap();
    tls
}

/// server.toml for a root (no parent) or a relay, on `bind`, waiting for `min_available` peers.
fn config(dir: &Path, id: &str, bind: SocketAddr, min_available: usize, parent: Option<SocketAddr>) -> ServerConfig {
    let state = dir.join(id).join("state");
    let tls = dir.join(id).join("tls");
    let model = dir.join("initial-model.bin");
    let parent =
        parent.map_or_else(String::new, |p| format!("[parent]\naddress = \"{p}\"\nserver_name = \"localhost\"\n"));
    let text = format!(
        r#"bind = "{bind}"
method = "fedavg"
state_dir = "{state}"
tls_dir = "{tls}"
initial_model = "{model}"

[engine]
rounds = {ROUNDS}
min_available = {min_available}
min_fit = {min_available}
round_deadline = 60000

[engine.robust]
weight_cap = false
norm_cap = false
min_norm_ratio = false
max_sign_agreement = false

{parent}"#,
        state = state.display(),
        tls = tls.display(),
        model = model.display(),
    );
    toml::from_str(&text).unwrap()
}

/// One device: joins its relay, and for each round takes the broadcast, sends its update,
/// waits for the ack, then sends its cost record and waits for the confirmation.
async fn device(d: usize, relay: SocketAddr, ca: rustls::pki_types::CertificateDer<'static>, cert: ClientCert) {
    let (_endpoint, conn) = raw_connect_as(relay, &ca, Some(&cert)).await.expect("the device reaches its relay");
    let (mut control, mut replies) = join(&conn, &device_id(d)).await;
    for round in 1..=ROUNDS {
        let mut stream = conn.accept_uni().await.expect("the round's broadcast");
        let (msg, _) = read_frame(&mut stream, DEFAULT_MAX_FRAME).await.unwrap().unwrap();
        let Message::Broadcast(b) = msg else { panic!("expected a broadcast, got {}", msg.kind_name()) };
        assert_eq!(b.round, round, "the relay forwards the parent's round");
        let mut up = conn.open_uni().await.unwrap();
        write(&mut up, &Message::Update(device_update(round, d))).await.unwrap();
        up.finish().unwrap();
        let (ack, _) = read_frame(&mut replies, DEFAULT_MAX_FRAME).await.unwrap().unwrap();
        assert!(matches!(ack, Message::Ack(ref a) if a.round == round && a.aggregated), "{ack:?}");
        let cost = CostRecord { round, payload_up: 64, compute_seconds: 0.1, ..CostRecord::default() };
        write(&mut control, &Message::Cost(cost)).await.unwrap();
        let (confirmed, _) = read_frame(&mut replies, DEFAULT_MAX_FRAME).await.unwrap().unwrap();
        assert!(matches!(confirmed, Message::CostAck(ref c) if c.round == round), "{confirmed:?}");
    }
    // The goodbye that the root's last round sends down through the relay.
    let (bye, _) = tokio::time::timeout(Duration::from_secs(30), read_frame(&mut replies, DEFAULT_MAX_FRAME))
        .await
        .expect("the relay passes the root's goodbye on")
        .unwrap()
        .unwrap();
    assert!(matches!(bye, Message::Goodbye(_)), "{bye:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_carry_a_federation_to_the_devices_mean() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let mut ca = ProjectCa::init(&dir.join("ca"), "relays-test", 30).unwrap();
    anchorage_server::model_file::save(&dir.join("initial-model.bin"), &[block(&[0.0; 16])]).unwrap();
    site(&mut ca, dir, Kind::Server, "root");
    let root_addr = free_udp_port();
    let root = tokio::spawn(anchorage_server::service::serve(config(dir, "root", root_addr, RELAYS, None)));
    let mut relays = Vec::new();
    let mut relay_addrs = Vec::new();
    for r in 0..RELAYS {
        let id = format!("relay-{r}");
        site(&mut ca, dir, Kind::Relay, &id);
        let addr = free_udp_port();
        relay_addrs.push(addr);
        relays.push(tokio::spawn(anchorage_server::service::serve(config(dir, &id, addr, PER_RELAY, Some(root_addr)))));
    }
    let mut devices = Vec::new();
    for d in 0..RELAYS * PER_RELAY {
        let identity = ca.issue(Kind::Client, &device_id(d), &[], 30).unwrap();
        let cert = ClientCert { chain: vec![identity.cert], key: identity.key };
        devices.push(tokio::spawn(device(d, relay_addrs[d % RELAYS], ca.cert().clone(), cert)));
    }
    for device in devices {
        tokio::time::timeout(Duration::from_secs(120), device).await.expect("the devices finish").unwrap();
    }
    for task in relays.into_iter().chain([root]) {
        let served = tokio::time::timeout(Duration::from_secs(30), task).await.expect("each program ends").unwrap();
        served.expect("each program ends cleanly");
    }

    // What one server would have made of the devices' updates, round after round.
    let mut direct = FedAvg::default();
    let mut global = vec![block(&[0.0; 16])];
    for round in 1..=ROUNDS {
        let updates: Vec<(String, Update)> =
            (0..RELAYS * PER_RELAY).map(|d| (device_id(d), device_update(round, d))).collect();
        let refs: Vec<(&str, &Update)> = updates.iter().map(|(id, u)| (id.as_str(), u)).collect();
        let info = RoundInfo { round, task: 0, last_of_task: false, rule: Default::default() };
        global = direct.aggregate(&info, &global, &refs).unwrap();
    }
    let root_store = ServerStore::open(dir.join("root").join("state")).unwrap();
    let stored = root_store.recover("fedavg").unwrap().expect("the root's checkpoint");
    assert_eq!(stored.checkpoint.round, ROUNDS);
    let (ours, expected) = (stored.checkpoint.global[0].decode().unwrap(), global[0].decode().unwrap());
    for (i, (a, b)) in ours.iter().zip(&expected).enumerate() {
        assert!((a - b).abs() <= 1e-5, "value {i}: {a} through the relays, {b} straight");
    }
    // The root's ledger holds every device's record of every round, under the device's name.
    let ledger = root_store.load_ledger().unwrap();
    for d in 0..RELAYS * PER_RELAY {
        let rounds: Vec<u64> =
            ledger.iter().filter(|r| r.client == device_id(d) && !r.dropped).map(|r| r.round).collect();
        assert_eq!(rounds, (1..=ROUNDS).collect::<Vec<_>>(), "{}'s records at the root: {ledger:?}", device_id(d));
    }
}
