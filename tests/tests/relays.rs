//! The relay tier over real QUIC on loopback: a root and two relays, each the server
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
        prototypes_are: Default::default(),
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

/// Device certificates for devices 0..n from the project CA.
fn device_certs(ca: &mut ProjectCa, n: usize) -> Vec<ClientCert> {
    (0..n)
        .map(|d| {
            let identity = ca.issue(Kind::Client, &device_id(d), &[], 30).unwrap();
            ClientCert { chain: vec![identity.cert], key: identity.key }
        })
        .collect()
}

/// A site folder: the CA's files and `kind`'s certificate for `id` (names: localhost).
fn site(ca: &mut ProjectCa, dir: &Path, kind: Kind, id: &str) -> PathBuf {
    let tls = dir.join(id).join("tls");
    anchorage_pki::site::issue(ca, kind, id, &["localhost".into()], 30, &tls).unwrap();
    tls
}

/// A tier's folder: the project CA (`project` names it), the initial model, and the site of the
/// root and of each relay in `relays`.
fn tier_sites(dir: &Path, project: &str, relays: &[&str]) -> ProjectCa {
    let mut ca = ProjectCa::init(&dir.join("ca"), project, 30).unwrap();
    anchorage_server::model_file::save(&dir.join("initial-model.bin"), &[block(&[0.0; 16])]).unwrap();
    site(&mut ca, dir, Kind::Server, "root");
    for relay in relays {
        site(&mut ca, dir, Kind::Relay, relay);
    }
    ca
}

/// server.toml for a root (no parent) or a relay, on `bind`, waiting for `min_available` peers.
fn config(dir: &Path, id: &str, bind: SocketAddr, min_available: usize, parent: Option<SocketAddr>) -> ServerConfig {
    toml::from_str(&config_text(dir, id, bind, min_available, parent)).unwrap()
}

/// [`config`] as server.toml's text.
fn config_text(dir: &Path, id: &str, bind: SocketAddr, min_available: usize, parent: Option<SocketAddr>) -> String {
    let state = dir.join(id).join("state");
    let tls = dir.join(id).join("tls");
    let model = dir.join("initial-model.bin");
    let parent =
        parent.map_or_else(String::new, |p| format!("[parent]\naddress = \"{p}\"\nserver_name = \"localhost\"\n"));
    format!(
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
    )
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
    for (d, cert) in device_certs(&mut ca, RELAYS * PER_RELAY).into_iter().enumerate() {
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

/// A device as raw protocol: its connection to a relay and its control stream.
struct RawDevice {
    id: String,
    _endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    /// Kept open: the control stream's end would end the session.
    _control: quinn::SendStream,
    replies: quinn::RecvStream,
}

impl RawDevice {
    async fn join(
        d: usize,
        relay: SocketAddr,
        ca: &rustls::pki_types::CertificateDer<'static>,
        cert: &ClientCert,
    ) -> Self {
        let mut last = None;
        // A relay that was just started may not listen yet.
        for _ in 0..100 {
            match raw_connect_as(relay, ca, Some(cert)).await {
                Ok((endpoint, conn)) => {
                    let (control, replies) = join(&conn, &device_id(d)).await;
                    return Self { id: device_id(d), _endpoint: endpoint, conn, _control: control, replies };
                }
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{} cannot reach {relay}: {last:?}", device_id(d));
    }

    async fn broadcast(&mut self) -> u64 {
        let mut stream = tokio::time::timeout(Duration::from_secs(30), self.conn.accept_uni())
            .await
            .unwrap_or_else(|_| panic!("{}: no broadcast", self.id))
            .unwrap();
        let (msg, _) = read_frame(&mut stream, DEFAULT_MAX_FRAME).await.unwrap().unwrap();
        let Message::Broadcast(b) = msg else { panic!("expected a broadcast, got {}", msg.kind_name()) };
        b.round
    }

    /// Sends the update on a stream of its own. A relay's ack waits for its parent's ack of the
    /// partial that holds the update ([`RawDevice::reply`]).
    async fn send(&mut self, update: Update) {
        let mut up = self.conn.open_uni().await.unwrap();
        write(&mut up, &Message::Update(update)).await.unwrap();
        up.finish().unwrap();
    }

    /// The relay's next message on the control stream (an ack, or a refusal).
    async fn reply(&mut self) -> Message {
        let reply = tokio::time::timeout(Duration::from_secs(30), read_frame(&mut self.replies, DEFAULT_MAX_FRAME));
        reply.await.unwrap_or_else(|_| panic!("{}: no answer", self.id)).unwrap().unwrap().0
    }
}

/// Waits until the store at `db` holds `n` accepted updates (the relay committed them).
async fn committed(db: &Path, n: usize) {
    for _ in 0..300 {
        if db.exists() && accepted(db).len() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{} never held {n} accepted updates", db.display());
}

/// A relay as its own process (the server program with a `[parent]` table), to kill.
struct RelayProcess {
    config: PathBuf,
    child: Option<std::process::Child>,
}

impl RelayProcess {
    fn start(config: PathBuf) -> Self {
        let mut relay = Self { config, child: None };
        relay.spawn();
        relay
    }

    fn spawn(&mut self) {
        let log = self.config.with_extension("log");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_server-process"))
            .arg("--config")
            .arg(&self.config)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("the relay process starts");
        self.child = Some(child);
    }

    fn kill(&mut self) {
        let mut child = self.child.take().expect("running");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.config.with_extension("log")).unwrap_or_default()
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The devices' updates of `round` folded as one server would, from `global`.
fn straight(round: u64, devices: &[usize], global: &[ParamBlock]) -> Vec<f32> {
    let updates: Vec<(String, Update)> = devices.iter().map(|&d| (device_id(d), device_update(round, d))).collect();
    let refs: Vec<(&str, &Update)> = updates.iter().map(|(id, u)| (id.as_str(), u)).collect();
    let info = RoundInfo { round, task: 0, last_of_task: false, rule: Default::default() };
    FedAvg::default().aggregate(&info, global, &refs).unwrap()[0].decode().unwrap()
}

fn assert_close(ours: &[f32], expected: &[f32]) {
    for (i, (a, b)) in ours.iter().zip(expected).enumerate() {
        assert!((a - b).abs() <= 1e-5, "value {i}: {a} through the relay, {b} straight");
    }
}

/// Accepted updates as (client, round, samples) in a store's database.
fn accepted(db: &Path) -> Vec<(String, u64, u64)> {
    let conn = rusqlite::Connection::open(db).unwrap();
    let mut stmt = conn.prepare("SELECT client, round, num_samples FROM updates ORDER BY round, client").unwrap();
    let row = |r: &rusqlite::Row| Ok((r.get(0)?, r.get::<_, i64>(1)? as u64, r.get::<_, i64>(2)? as u64));
    stmt.query_map([], row).unwrap().map(Result::unwrap).collect()
}

/// A relay killed (`kill -9`) mid-round loses nothing it accepted. Two of its three devices'
/// updates are committed before the kill (and not acked: the root has not acked a partial with
/// them); restarted on the same folder, the relay reopens the round when the root sends it
/// again, takes the third device's update (and the first two's resends as duplicates), and its
/// partial carries all three: each device is acked `aggregated: true` once the root acked the
/// partial, the root's model is the three devices' mean, and the relay's database holds each
/// update once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_killed_mid_round_loses_nothing_it_acked() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let mut ca = tier_sites(dir, "relay-kill-test", &["relay-0"]);
    let root_addr = free_udp_port();
    let mut root_config = config(dir, "root", root_addr, 1, None);
    root_config.engine.rounds = 1;
    let root = tokio::spawn(anchorage_server::service::serve(root_config));
    let relay_addr = free_udp_port();
    let relay_toml = dir.join("relay-0.toml");
    std::fs::write(&relay_toml, config_text(dir, "relay-0", relay_addr, 3, Some(root_addr))).unwrap();
    let mut relay = RelayProcess::start(relay_toml);
    let certs = device_certs(&mut ca, 3);
    let ca_cert = ca.cert().clone();
    let mut devices = Vec::new();
    for (d, cert) in certs.iter().enumerate() {
        devices.push(RawDevice::join(d, relay_addr, &ca_cert, cert).await);
    }
    for device in &mut devices {
        assert_eq!(device.broadcast().await, 1);
    }
    let relay_db = dir.join("relay-0").join("state").join(anchorage_server::store::DB_FILE);
    for (d, device) in devices.iter_mut().enumerate().take(2) {
        device.send(device_update(1, d)).await;
    }
    committed(&relay_db, 2).await;
    relay.kill();
    drop(devices);
    relay.spawn();
    let mut devices = Vec::new();
    for (d, cert) in certs.iter().enumerate() {
        devices.push(RawDevice::join(d, relay_addr, &ca_cert, cert).await);
    }
    assert_eq!(devices[2].broadcast().await, 1, "the reopened round goes to the device it waits for");
    for (d, device) in devices.iter_mut().enumerate() {
        device.send(device_update(1, d)).await;
    }
    for device in &mut devices {
        let reply = device.reply().await;
        assert!(matches!(reply, Message::Ack(ref a) if a.round == 1 && a.aggregated), "{reply:?}");
    }
    let served = tokio::time::timeout(Duration::from_secs(60), root).await;
    let served = served.unwrap_or_else(|_| panic!("the root finishes; relay log:\n{}", relay.log())).unwrap();
    served.expect("the root ends cleanly");

    let root_store = ServerStore::open(dir.join("root").join("state")).unwrap();
    let stored = root_store.recover("fedavg").unwrap().expect("the root's checkpoint");
    assert_eq!(stored.checkpoint.round, 1);
    assert_close(&stored.checkpoint.global[0].decode().unwrap(), &straight(1, &[0, 1, 2], &[block(&[0.0; 16])]));
    let expected: Vec<(String, u64, u64)> =
        (0..3).map(|d| (device_id(d), 1, device_update(1, d).num_samples)).collect();
    assert_eq!(accepted(&relay_db), expected, "each update once in the relay's database");
    let total = expected.iter().map(|(_, _, n)| n).sum();
    let root_db = dir.join("root").join("state").join(anchorage_server::store::DB_FILE);
    assert_eq!(accepted(&root_db), vec![("relay-0".to_string(), 1, total)], "one partial, weighted by its devices");
}

/// Relay A dies mid-round (`kill -9`) with one update committed and none acked; a device it
/// had not taken fails over to relay B and resends its update there; B takes it into its round,
/// and the root counts it once. The root's round closes at its deadline with B's partial alone:
/// B acks its three devices `aggregated: true`, the root's model is the mean of exactly those
/// updates (the failed-over one among them), and B's database holds the adopted device's update
/// once. (A's committed update stays in A's database for A's restart.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_device_fails_over_to_another_relay_and_is_counted_once() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let mut ca = tier_sites(dir, "relay-failover-test", &["relay-a", "relay-b"]);
    let root_addr = free_udp_port();
    let mut root_config = config(dir, "root", root_addr, 2, None);
    (root_config.engine.rounds, root_config.engine.min_fit) = (1, 1);
    root_config.engine.round_deadline = Duration::from_secs(8);
    let root = tokio::spawn(anchorage_server::service::serve(root_config));
    let (a_addr, b_addr) = (free_udp_port(), free_udp_port());
    let a_toml = dir.join("relay-a.toml");
    std::fs::write(&a_toml, config_text(dir, "relay-a", a_addr, 2, Some(root_addr))).unwrap();
    let mut relay_a = RelayProcess::start(a_toml);
    let relay_b = tokio::spawn(anchorage_server::service::serve(config(dir, "relay-b", b_addr, 3, Some(root_addr))));
    let certs = device_certs(&mut ca, 5);
    let ca_cert = ca.cert().clone();
    // d0, d1 on relay A; d2, d3, d4 on relay B.
    let mut on_a = Vec::new();
    for (d, cert) in certs.iter().enumerate().take(2) {
        on_a.push(RawDevice::join(d, a_addr, &ca_cert, cert).await);
    }
    let mut on_b = Vec::new();
    for (d, cert) in certs.iter().enumerate().skip(2) {
        on_b.push(RawDevice::join(d, b_addr, &ca_cert, cert).await);
    }
    for device in on_a.iter_mut().chain(on_b.iter_mut()) {
        assert_eq!(device.broadcast().await, 1);
    }
    let a_db = dir.join("relay-a").join("state").join(anchorage_server::store::DB_FILE);
    on_a[0].send(device_update(1, 0)).await;
    committed(&a_db, 1).await;
    relay_a.kill();
    drop(on_a);
    // d1 trained for round 1 and holds its update: it reaches B, the next relay on its list.
    let mut moved = RawDevice::join(1, b_addr, &ca_cert, &certs[1]).await;
    moved.send(device_update(1, 1)).await;
    for (i, device) in on_b.iter_mut().enumerate().take(2) {
        device.send(device_update(1, 2 + i)).await;
    }
    let reply = moved.reply().await;
    assert!(matches!(reply, Message::Ack(ref a) if a.round == 1 && a.aggregated), "adopted: {reply:?}");
    for device in on_b.iter_mut().take(2) {
        let reply = device.reply().await;
        assert!(matches!(reply, Message::Ack(ref a) if a.round == 1 && a.aggregated), "{reply:?}");
    }
    let served = tokio::time::timeout(Duration::from_secs(60), root).await.expect("the root finishes").unwrap();
    served.expect("the root ends cleanly");
    tokio::time::timeout(Duration::from_secs(30), relay_b).await.expect("relay B ends").unwrap().expect("cleanly");

    let root_store = ServerStore::open(dir.join("root").join("state")).unwrap();
    let stored = root_store.recover("fedavg").unwrap().expect("the root's checkpoint");
    assert_eq!(stored.checkpoint.round, 1);
    assert_close(&stored.checkpoint.global[0].decode().unwrap(), &straight(1, &[1, 2, 3], &[block(&[0.0; 16])]));
    let b_db = dir.join("relay-b").join("state").join(anchorage_server::store::DB_FILE);
    let at_b: Vec<String> = accepted(&b_db).into_iter().map(|(c, _, _)| c).collect();
    assert_eq!(at_b, vec![device_id(1), device_id(2), device_id(3)]);
    let at_a: Vec<String> = accepted(&a_db).into_iter().map(|(c, _, _)| c).collect();
    assert_eq!(at_a, vec![device_id(0)], "A's committed update is durable for its restart");
    let root_db = dir.join("root").join("state").join(anchorage_server::store::DB_FILE);
    let at_root: Vec<String> = accepted(&root_db).into_iter().map(|(c, _, _)| c).collect();
    assert_eq!(at_root, vec!["relay-b".to_string()]);
}

/// A device's method for the tier: its update nudges the broadcast's blocks.
struct Nudge;

impl anchorage_client::methods::ClientMethod for Nudge {
    fn name(&self) -> &'static str {
        "fedavg"
    }
    fn num_samples(&self) -> u64 {
        10
    }
    fn train(
        &mut self,
        b: &anchorage_shared::protocol::Broadcast,
    ) -> Result<anchorage_client::methods::Trained, anchorage_client::methods::TrainError> {
        let nudged = |block: &ParamBlock| {
            let values: Vec<f32> = block.decode().unwrap().iter().map(|v| v + 1e-3).collect();
            ParamBlock::encode(block.name.clone(), &block.tensor.shape, &values, Encoding::F32)
        };
        let blocks = b.blocks.iter().map(nudged).collect();
        Ok(anchorage_client::methods::Trained {
            prototypes_are: Default::default(),
            num_samples: 10,
            blocks,
            prototypes: vec![],
            metrics: vec![],
        })
    }
    fn global_accuracy(
        &self,
        _: &anchorage_shared::protocol::Broadcast,
        _: &anchorage_model::FeatureCache,
    ) -> Result<Option<f64>, anchorage_client::methods::TrainError> {
        Ok(None)
    }
    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, anchorage_client::methods::TrainError> {
        Ok(Vec::new())
    }
}

/// A relay that was down gets its device back: the real client, its own relay A not yet
/// running, fails over to relay B and trains a round there; A starts; after its next ack at B
/// (`home_after` 0 s) the device goes back to A, and A's database holds the device's update of a
/// later round (before, the device stayed on B and A held no device: the root waited out A's
/// deadline every round).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_device_goes_back_to_its_own_relay_once_it_is_up() {
    use anchorage_client::transport::{Backoff, ClientEvent, ClientOptions};
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let mut ca = tier_sites(dir, "relay-home-test", &["relay-a", "relay-b"]);
    let root_addr = free_udp_port();
    let mut root_config = config(dir, "root", root_addr, 1, None);
    (root_config.engine.rounds, root_config.engine.round_deadline) = (8, Duration::from_secs(4));
    let root = tokio::spawn(anchorage_server::service::serve(root_config));
    let (a_addr, b_addr) = (free_udp_port(), free_udp_port());
    let relay_b = tokio::spawn(anchorage_server::service::serve(config(dir, "relay-b", b_addr, 1, Some(root_addr))));

    let cert = device_certs(&mut ca, 1).pop().unwrap();
    let mut options = ClientOptions::new(a_addr, ca.cert().clone(), device_id(0));
    options.client_cert = Some(std::sync::Arc::new(cert));
    options.fallbacks = vec![b_addr];
    options.home_after = Duration::ZERO;
    options.connect_timeout = Duration::from_millis(500);
    options.keep_alive = Duration::from_secs(1);
    options.backoff =
        Backoff { initial: Duration::from_millis(100), max: Duration::from_millis(500), max_attempts: None };
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    options.stop = Some(stop);
    let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let device = tokio::spawn(anchorage_client::transport::run(options, Box::new(Nudge), Some(tx)));
    loop {
        let event = tokio::time::timeout(Duration::from_secs(60), events.recv()).await;
        match event.expect("a round done at relay B").expect("the device runs") {
            ClientEvent::RoundDone { aggregated, .. } => {
                assert!(aggregated, "counted through relay B");
                break;
            }
            ClientEvent::Finished { reason } => panic!("the device finished: {reason}"),
            _ => {}
        }
    }
    let b_db = dir.join("relay-b").join("state").join(anchorage_server::store::DB_FILE);
    assert!(accepted(&b_db).iter().any(|(c, _, _)| c == &device_id(0)), "the first round went through B");
    let relay_a = tokio::spawn(anchorage_server::service::serve(config(dir, "relay-a", a_addr, 1, Some(root_addr))));
    let a_db = dir.join("relay-a").join("state").join(anchorage_server::store::DB_FILE);
    committed(&a_db, 1).await;
    assert_eq!(accepted(&a_db).first().map(|(c, _, _)| c.clone()), Some(device_id(0)), "back on its own relay");
    stop_tx.send(true).unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(10), device).await;
    for task in [root, relay_a, relay_b] {
        task.abort();
    }
}
