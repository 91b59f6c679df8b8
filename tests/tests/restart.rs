//! Durability over real QUIC: a restarted server resumes from its checkpoint; a restarted client
//! resends the update it trained but never saw acknowledged, and the server counts it once; a
//! restarted FedTA client trains on from the anchors and heads its store kept.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anchorage_client::methods::{ClientMethod, MethodContext};
use anchorage_client::store::ClientStore;
use anchorage_client::transport::{self as client, ClientOptions};
use anchorage_model::train::OptimizerKind;
use anchorage_model::{BlockLayout, ModelSpec, Trainable};
use anchorage_pki::Identity;
use anchorage_server::RoundReport;
use anchorage_server::engine::EngineConfig;
use anchorage_server::methods::FedAvg;
use anchorage_server::store::ServerStore;
use anchorage_server::transport::{self as server, Limits, ServerEvent, ServerHandle, ServerOptions};
use anchorage_shared::method::FedTaConfig;
use anchorage_shared::protocol::{Metric, RoundConfig, Update};
use anchorage_shared::tensor::Encoding;
use anchorage_tests::fedavg_client;
use burn::tensor::Device;

/// A folder named `name` inside the test's own temporary folder (removed when the test ends).
fn temp_dir(tmp: &tempfile::TempDir, name: &str) -> PathBuf {
    tmp.path().join(name)
}

async fn start(
    identity: &Identity,
    rounds: u64,
    min_clients: usize,
    store: &ServerStore,
    initial: Vec<anchorage_shared::tensor::ParamBlock>,
) -> ServerHandle {
    server::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity: identity.clone(),
        trust: anchorage_server::tls::Trust::InsecureDev,
        engine: EngineConfig {
            rounds,
            min_available: min_clients,
            min_fit: min_clients,
            round_deadline: Duration::from_secs(30),
            round: RoundConfig { local_epochs: 1, batch_size: 32, learning_rate: 1e-3, deadline_ms: 0 },
            ..EngineConfig::default()
        },
        method: Box::new(FedAvg::default()),
        initial,
        limits: Limits::default(),
        store: Some(store.clone()),
    })
    .await
    .expect("server starts")
}

/// Clients `c0` and `c1`, running until the federation says goodbye.
fn spawn_clients(addr: SocketAddr, identity: &Identity) -> Vec<tokio::task::JoinHandle<anyhow::Result<String>>> {
    (0..2)
        .map(|i| {
            tokio::spawn(client::run(
                ClientOptions::new(addr, identity.cert.clone(), format!("c{i}")),
                Box::new(fedavg_client(i)),
                None,
            ))
        })
        .collect()
}

async fn reports_until_finished(server: &mut ServerHandle) -> Vec<RoundReport> {
    let mut reports = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(60), server.events.recv()).await.expect("server makes progress")
        {
            Some(ServerEvent::RoundClosed { report, .. }) => reports.push((*report).clone()),
            Some(ServerEvent::Finished) | None => return reports,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_server_resumes_from_its_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let identity = anchorage_pki::identity::self_signed(&["localhost"]).unwrap();
    let state_dir = temp_dir(&tmp, "server-restart");
    let store = ServerStore::open(&state_dir).unwrap();
    let initial =
        Trainable::new(&ModelSpec::embedded_default().net(), &Device::flex()).to_blocks(Encoding::F32).unwrap();

    let mut first = start(&identity, 2, 2, &store, initial.clone()).await;
    let addr = first.local_addr;
    let clients = spawn_clients(addr, &identity);
    let reports = reports_until_finished(&mut first).await;
    assert_eq!(reports.iter().map(|r| r.round).collect::<Vec<_>>(), vec![1, 2]);
    for c in clients {
        c.await.unwrap().unwrap();
    }
    first.shutdown().await.unwrap();
    let saved = store.recover("fedavg").unwrap().expect("a global version after round 2").checkpoint;
    assert_eq!(saved.round, 2);
    assert_ne!(saved.global, initial, "the checkpoint holds the trained global model");

    // The clients' cost reports are in the server's durable ledger, under their connection identity.
    let ledger = store.load_ledger().unwrap();
    println!("ledger after the first run: {} records", ledger.len());
    assert!(ledger.len() >= 2, "cost records of the first rounds are on disk: {ledger:?}");
    assert!(
        ledger.iter().all(|c| (c.client == "c0" || c.client == "c1") && c.wire_up >= c.payload_up && c.payload_up > 0)
    );

    // A new process on the same state folder, allowed two more rounds: it continues at round 3.
    drop(store);
    let store = ServerStore::open(&state_dir).unwrap();
    let mut second = start(&identity, 4, 2, &store, initial.clone()).await;
    assert_eq!(
        second.metrics.client_rounds_total(),
        ledger.len() as u64,
        "the ledger totals are replayed into the metrics after a restart"
    );
    let addr = second.local_addr;
    let clients = spawn_clients(addr, &identity);
    let reports = reports_until_finished(&mut second).await;
    assert_eq!(reports.iter().map(|r| r.round).collect::<Vec<_>>(), vec![3, 4]);
    for c in clients {
        c.await.unwrap().unwrap();
    }
    second.shutdown().await.unwrap();
    assert_eq!(store.recover("fedavg").unwrap().unwrap().checkpoint.round, 4);
    let after = store.load_ledger().unwrap();
    assert!(after.len() > ledger.len() && after.starts_with(&ledger), "the second run appended to the same ledger");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_client_resends_its_unacknowledged_update_once() {
    let tmp = tempfile::tempdir().unwrap();
    let identity = anchorage_pki::identity::self_signed(&["localhost"]).unwrap();
    let spec = ModelSpec::embedded_default();
    let initial = Trainable::new(&spec.net(), &Device::flex()).to_blocks(Encoding::F32).unwrap();
    let mut server =
        start(&identity, 1, 1, &ServerStore::open(temp_dir(&tmp, "resend-server")).unwrap(), initial.clone()).await;

    // The client crashed after training round 1 and persisting the update, before the ack.
    let client_store = ClientStore::new(temp_dir(&tmp, "resend-client"));
    let trained = Trainable::new(&ModelSpec { seed: 99, ..spec.clone() }.net(), &Device::flex())
        .to_blocks(Encoding::F32)
        .unwrap();
    let pending = Update {
        prototypes_are: Default::default(),
        round: 1,
        num_samples: 42,
        blocks: trained.clone(),
        prototypes: vec![],
        metrics: vec![Metric { name: "marker".into(), value: 7.0 }],
        compute_seconds: 123.0,
    };
    client_store.save_pending(Some(&pending)).unwrap();

    let mut options = ClientOptions::new(server.local_addr, identity.cert.clone(), "crashed");
    options.store = Some(client_store.clone());
    let handle = tokio::spawn(client::run(options, Box::new(fedavg_client(5)), None));
    let reports = reports_until_finished(&mut server).await;
    handle.await.unwrap().unwrap();

    assert_eq!(reports.len(), 1);
    let r = &reports[0];
    assert_eq!(r.updates.len(), 1);
    assert_eq!(r.updates[0].client, "crashed");
    assert_eq!(r.updates[0].compute_seconds, 123.0, "the persisted update was sent, not a retrained one");
    assert_eq!(r.updates[0].num_samples, 42);
    assert_eq!(client_store.load_pending().unwrap(), None, "the acknowledged update is cleared from the store");
    // Nothing follows `Finished`: no second round was opened by the resent copy.
    let after = tokio::time::timeout(Duration::from_millis(200), server.events.recv()).await;
    assert!(
        !matches!(after, Ok(Some(ServerEvent::RoundClosed { .. }))),
        "no further round after the federation finished"
    );
    server.shutdown().await.unwrap();
}

/// A client whose server is unreachable leaves at once on its stop signal (SIGTERM in the
/// binary), whether it is connecting or backing off between attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_while_the_server_is_unreachable() {
    let identity = anchorage_pki::identity::self_signed(&["localhost"]).unwrap();
    // A port nothing listens on: bind a UDP socket, note its port, drop it.
    let addr = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut options = ClientOptions::new(addr, identity.cert.clone(), "lonely");
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    options.stop = Some(stop_rx);
    options.backoff.initial = Duration::from_secs(30);
    options.backoff.max = Duration::from_secs(30);
    let handle = tokio::spawn(client::run(options, Box::new(fedavg_client(5)), None));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!handle.is_finished(), "the client keeps trying while nobody answers");
    stop_tx.send(true).unwrap();
    let reason = tokio::time::timeout(Duration::from_secs(5), handle)
        .await
        .expect("the client left within 5 s of the stop signal")
        .unwrap()
        .unwrap();
    assert_eq!(reason, "stopped");
}

/// FedTA's anchors and heads never leave the device, so the client's store keeps them: after a
/// restart the device trains on from them. Two sessions over real QUIC on loopback; the second
/// is run twice, by a client restored from the first session's state and by a fresh one with
/// the same seed and the same broadcast, and their trained tails must differ. A state file the
/// method refuses is set aside and the client trains from a fresh state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_fedta_client_keeps_its_anchors_and_heads() {
    let tmp = tempfile::tempdir().unwrap();
    use anchorage_server::methods::FedTaServer;
    let identity = anchorage_pki::identity::self_signed(&["localhost"]).unwrap();
    let method =
        FedTaConfig { ie_pool: 3, ie_length: 2, ie_top_n: 2, anchors: 4, anchor_dim: 4, ..FedTaConfig::default() };
    let initial = fedta_client(&method).initial_blocks().unwrap();
    async fn session(
        identity: &Identity,
        method: &FedTaConfig,
        initial: &[anchorage_shared::tensor::ParamBlock],
        name: &str,
        store: &ClientStore,
        rounds: u64,
        tmp: &tempfile::TempDir,
    ) {
        let mut server = server::start(ServerOptions {
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            identity: identity.clone(),
            trust: anchorage_server::tls::Trust::InsecureDev,
            engine: EngineConfig {
                rounds,
                min_available: 1,
                min_fit: 1,
                round_deadline: Duration::from_secs(30),
                round: RoundConfig { local_epochs: 2, batch_size: 8, learning_rate: 1e-2, deadline_ms: 0 },
                ..EngineConfig::default()
            },
            method: Box::new(FedTaServer::new(method.clone(), None)),
            initial: initial.to_vec(),
            limits: Limits::default(),
            store: Some(ServerStore::open(temp_dir(tmp, name)).unwrap()),
        })
        .await
        .expect("server starts");
        let mut options = ClientOptions::new(server.local_addr, identity.cert.clone(), "edge");
        options.store = Some(store.clone());
        let handle = tokio::spawn(client::run(options, Box::new(fedta_client(method)), None));
        let reports = reports_until_finished(&mut server).await;
        handle.await.unwrap().unwrap();
        assert_eq!(reports.len() as u64, rounds, "{name}: every round closed");
        server.shutdown().await.unwrap();
    }
    let state_of = |store: &ClientStore| store.load_device_state().unwrap().expect("a device state was saved");
    let tail = |blocks: &[anchorage_shared::tensor::ParamBlock]| {
        blocks.iter().filter(|b| b.name.starts_with("tail.")).cloned().collect::<Vec<_>>()
    };

    let kept = ClientStore::new(temp_dir(&tmp, "fedta-kept"));
    session(&identity, &method, &initial, "fedta-s1", &kept, 2, &tmp).await;
    let first = state_of(&kept);
    let names: Vec<&str> = first.iter().map(|b| b.name.as_str()).collect();
    assert!(names.contains(&"tail.values") && names.contains(&"ie_head.weight"), "{names:?}");

    // Session 2: restored from the kept state, and a fresh device for comparison.
    session(&identity, &method, &initial, "fedta-s2", &kept, 1, &tmp).await;
    let fresh = ClientStore::new(temp_dir(&tmp, "fedta-fresh"));
    session(&identity, &method, &initial, "fedta-s2-fresh", &fresh, 1, &tmp).await;
    let (restored, control) = (state_of(&kept), state_of(&fresh));
    assert!(tail(&restored) != tail(&control), "the restarted device trained on from its saved tail");
    assert!(tail(&restored) != tail(&first), "and it trained");

    // A state of another model (anchor width 5) is refused, set aside and replaced.
    let other = FedTaConfig { anchor_dim: 5, ..method.clone() };
    session(&identity, &other, &fedta_client(&other).initial_blocks().unwrap(), "fedta-s3", &kept, 1, &tmp).await;
    let replaced = state_of(&kept);
    let width = replaced.iter().find(|b| b.name == "tail.values").unwrap().tensor.shape.clone();
    assert_eq!(width, vec![4, 5], "a fresh tail of the new shape");
    let aside = std::fs::read_dir(kept.dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("device-state.bin.refused-"));
    assert_eq!(aside.count(), 1, "the refused state is kept beside");
}

/// A FedTA client on the embedded backbone (24 features) and 3 classes of 8×8 images whose
/// brightness depends on the class.
fn fedta_client(method: &FedTaConfig) -> anchorage_client::methods::FedTaClient {
    use anchorage_client::methods::TaskStream;
    use anchorage_data::Dataset;
    use anchorage_model::FrozenBackbone;
    use anchorage_model::backbone::InputBackbone;
    let plain = Device::flex();
    let spec = ModelSpec { input_dim: 3 * 8 * 8, feature_dim: 24, ..ModelSpec::embedded_default() };
    let backbone: std::sync::Arc<dyn anchorage_model::backbone::Backbone + Send + Sync> =
        std::sync::Arc::new(FrozenBackbone::new(&spec, &plain));
    let images = |n: usize, seed: u64| {
        let mut rng = anchorage_shared::rng::Rng::new(seed);
        let labels: Vec<u32> = (0..n as u32).map(|i| i % 3).collect();
        let pixels: Vec<f32> = labels
            .iter()
            .flat_map(|&l| (0..192).map(|_| 0.2 * l as f32 + 0.6 * rng.f32()).collect::<Vec<_>>())
            .collect();
        Dataset::new(vec![3, 8, 8], 3, pixels, labels).unwrap()
    };
    let stream = TaskStream::build(backbone.as_ref(), &[(vec![0, 1, 2], images(24, 1), images(12, 2))], &plain);
    let context = MethodContext {
        net: anchorage_model::NetSpec { input_dim: 24, hidden: vec![], num_classes: 3, seed: 5, residual: false },
        stream,
        device: plain.autodiff(),
        optimizer: OptimizerKind::Adam,
        encoding: Encoding::F32,
        seed: 3,
        backbone: Some(InputBackbone { net: backbone, sample_shape: vec![3, 8, 8] }),
        prototype_release: Default::default(),
    };
    anchorage_client::methods::FedTaClient::new(context, method.clone()).unwrap()
}
