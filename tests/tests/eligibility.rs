//! Devices that train only when they should, over real QUIC on loopback:
//! three real FedAvg clients, each reading its own fake `/sys` tree. One runs hot (85 °C against
//! `max_temperature_c = 70`) and declines every invitation with its reason; the server counts the
//! decline apart from a drop (ledger row of kind `declined`, `anchorage_declines_total`) and
//! invites the free device in its place, so every round reaches its target. The two cool devices'
//! cost records carry their condition (temperature, power mode) into the ledger.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anchorage_client::eligibility::{Eligibility, SysRoot};
use anchorage_client::methods::ClientMethod;
use anchorage_client::transport::{self as client, ClientCert, ClientOptions};
use anchorage_pki::{Kind, ProjectCa};
use anchorage_server::aggregate::RobustConfig;
use anchorage_server::engine::{EngineConfig, RoundOutcome, RoundReport};
use anchorage_server::methods::FedAvg;
use anchorage_server::store::ServerStore;
use anchorage_server::tls::Trust;
use anchorage_server::transport::{self as server, Limits, ServerEvent, ServerOptions};
use anchorage_shared::ledger::DeclineReason;
use anchorage_shared::protocol::RoundConfig;
use anchorage_tests::{fedavg_client, metric_value};

const ROUNDS: u64 = 4;
const HOT: &str = "hot-board";

/// A board's `/sys` and nvpmodel status under `root`: one thermal zone at `millicelsius`.
fn board(root: &Path, millicelsius: u32) {
    let files = [
        ("sys/class/thermal/thermal_zone0/type", "tj-therm\n".to_string()),
        ("sys/class/thermal/thermal_zone0/temp", format!("{millicelsius}\n")),
        ("var/lib/nvpmodel/status", "pmode:0001\n".to_string()),
    ];
    for (path, content) in files {
        let path = root.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ineligible_device_declines_and_another_is_invited_in_its_place() {
    let dir = tempfile::tempdir().unwrap();
    let mut ca = ProjectCa::init(&dir.path().join("ca"), "eligibility-test", 30).unwrap();
    let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 30).unwrap();
    let state = dir.path().join("state");
    let mut server = server::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity,
        trust: Trust::ProjectCa { ca: ca.cert().clone(), crl: None },
        engine: EngineConfig {
            rounds: ROUNDS,
            min_available: 3,
            // Two of the three devices per round: a decline leaves one free to take its place.
            fraction: 0.5,
            min_fit: 2,
            over_selection: 0.0,
            round_deadline: Duration::from_secs(60),
            round: RoundConfig { local_epochs: 1, batch_size: 32, learning_rate: 1e-3, deadline_ms: 0 },
            robust: RobustConfig::unbounded(),
            ..EngineConfig::default()
        },
        method: Box::new(FedAvg::default()),
        initial: fedavg_client(0).initial_blocks().unwrap(),
        limits: Limits::default(),
        store: Some(ServerStore::open(&state).unwrap()),
    })
    .await
    .unwrap();
    let eligibility: Eligibility = toml::from_str("max_temperature_c = 70").unwrap();
    let mut tasks = Vec::new();
    for (i, (id, millicelsius)) in [(HOT, 85_000), ("cool-a", 45_000), ("cool-b", 52_000)].into_iter().enumerate() {
        let root = dir.path().join(format!("sys-{id}"));
        board(&root, millicelsius);
        let device = ca.issue(Kind::Client, id, &[], 30).unwrap();
        let mut options = ClientOptions::new(server.local_addr, ca.cert().clone(), id);
        options.client_cert = Some(Arc::new(ClientCert { chain: vec![device.cert], key: device.key }));
        options.eligibility = eligibility.clone();
        options.sys_root = Some(SysRoot::new(&root));
        tasks.push(tokio::spawn(client::run(options, Box::new(fedavg_client(1 + i as u64)), None)));
    }
    let mut reports: Vec<Arc<RoundReport>> = Vec::new();
    while reports.len() < ROUNDS as usize {
        match tokio::time::timeout(Duration::from_secs(120), server.events.recv()).await.expect("rounds close") {
            Some(ServerEvent::RoundClosed { report, .. }) => reports.push(report),
            Some(ServerEvent::Finished) | None => break,
        }
    }
    for t in tasks {
        let reason = tokio::time::timeout(Duration::from_secs(60), t).await.expect("finishes").unwrap().unwrap();
        assert!(reason.contains("finished"), "{reason}");
    }
    let metrics = server.metrics.render();
    server.shutdown().await.unwrap();

    assert_eq!(reports.len(), ROUNDS as usize);
    let mut declines = 0;
    for r in &reports {
        assert_eq!(r.outcome, RoundOutcome::Aggregated, "round {}", r.round);
        assert_eq!(r.updates.len(), 2, "round {}: the target is reached", r.round);
        assert!(r.missing.is_empty(), "round {}: a decline is not missing: {:?}", r.round, r.missing);
        assert!(r.updates.iter().all(|u| u.client != HOT), "the hot board never trains");
        for (client, reason) in &r.declined {
            assert_eq!((client.as_str(), *reason), (HOT, DeclineReason::Thermal));
            declines += 1;
        }
    }
    assert!(declines > 0, "the hot board was invited at least once in {ROUNDS} rounds (seeded sampling)");
    println!("{declines} declines in {ROUNDS} rounds, each replaced");
    assert_eq!(metric_value(&metrics, "anchorage_declines_total{reason=\"thermal\"}"), Some(declines as f64));
    assert_eq!(metric_value(&metrics, "anchorage_client_rounds_total{result=\"dropped\"}"), Some(0.0));

    let ledger = anchorage_server::store::read_ledger(&state.join("anchorage.db")).unwrap();
    let declined: Vec<_> = ledger.iter().filter(|r| r.declined.is_some()).collect();
    assert_eq!(declined.len(), declines);
    assert!(declined.iter().all(|r| r.client == HOT && r.declined == Some(DeclineReason::Thermal) && !r.dropped));
    let reported: Vec<_> = ledger.iter().filter(|r| r.declined.is_none()).collect();
    assert_eq!(reported.len(), 2 * ROUNDS as usize, "one cost record per update: {ledger:?}");
    for r in reported {
        let expected = if r.client == "cool-a" { 45.0 } else { 52.0 };
        assert_eq!(r.temperature_c, Some(expected), "{r:?}");
        assert_eq!(r.power_mode.as_deref(), Some("nvpmodel 1"), "{r:?}");
        assert!(!r.dropped);
    }
}
