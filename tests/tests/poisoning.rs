//! Poisoning over real QUIC on loopback: a device with a valid certificate of the project CA that
//! answers every round with a hostile update or floods the cost ledger. Two honest devices train
//! beside it on a server with the default `[engine.robust]`; each attack must fail:
//! - values of 1e30 claiming 10¹⁸ samples: refused before the ack (in its round or late), the model
//!   stays finite and every round aggregates the honest devices;
//! - a model of another layout in round 1 (a stranger answering first cannot impose it): refused,
//!   round 1 aggregates the operator's layout;
//! - 20,000 cost records for made-up rounds and repeats for real ones: at most one ledger row per
//!   round the peer was invited to.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anchorage_client::methods::ClientMethod;
use anchorage_client::transport::{self as client, ClientCert, ClientEvent, ClientOptions};
use anchorage_pki::{Kind, ProjectCa};
use anchorage_server::engine::{EngineConfig, RoundOutcome};
use anchorage_server::methods::FedAvg;
use anchorage_server::store::{ServerStore, read_ledger};
use anchorage_server::tls::Trust;
use anchorage_server::transport::{self as server, Limits, ServerEvent, ServerOptions};
use anchorage_shared::frame::DEFAULT_MAX_FRAME;
use anchorage_shared::io::read_frame;
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::{Broadcast, Message, RefusalReason, RoundConfig, Update};
use anchorage_shared::tensor::{Encoding, ParamBlock};
use anchorage_tests::{fedavg_client, hello, raw_connect_as, write};
use rustls::pki_types::CertificateDer;
use tokio::sync::mpsc;

const ROUNDS: u64 = 3;
const HONEST: [&str; 2] = ["edge-1", "edge-2"];
const ATTACKER: &str = "mallory";

/// What the attacker does with each broadcast: the update it sends (if any), and the cost
/// records it sends on its control stream.
type Attack = fn(&Broadcast) -> (Option<Update>, Vec<CostRecord>);

/// What one run shows: the server's round reports with their global models, the attacker's
/// replies, the honest devices' aggregated acks, and the state folder (ledger).
struct Outcome {
    rounds: Vec<(Arc<anchorage_server::engine::RoundReport>, Vec<ParamBlock>)>,
    replies: Vec<Message>,
    honest_aggregated: usize,
}

fn device(ca: &mut ProjectCa, id: &str) -> ClientCert {
    let identity = ca.issue(Kind::Client, id, &[], 30).unwrap();
    ClientCert { chain: vec![identity.cert], key: identity.key }
}

/// A server with the default robust settings and a state folder; the attacker joins first, then
/// the two honest devices; every round invites all three and closes on two updates.
async fn run(dir: &Path, attack: Attack) -> Outcome {
    let mut ca = ProjectCa::init(&dir.join("ca"), "poisoning-test", 30).unwrap();
    let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 30).unwrap();
    let mut server = server::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity,
        trust: Trust::ProjectCa { ca: ca.cert().clone(), crl: None },
        engine: EngineConfig {
            rounds: ROUNDS,
            min_available: 3,
            fraction: 0.5,
            min_fit: 2,
            over_selection: 0.5,
            round_deadline: Duration::from_secs(30),
            round: RoundConfig { local_epochs: 1, batch_size: 32, learning_rate: 1e-3, deadline_ms: 0 },
            ..EngineConfig::default()
        },
        method: Box::new(FedAvg::default()),
        initial: fedavg_client(0).initial_blocks().unwrap(),
        limits: Limits::default(),
        store: Some(ServerStore::open(dir.join("state")).unwrap()),
    })
    .await
    .unwrap();
    let addr = server.local_addr;
    let root: CertificateDer<'static> = ca.cert().clone();

    let attacker_cert = device(&mut ca, ATTACKER);
    let (_endpoint, conn) = raw_connect_as(addr, &root, Some(&attacker_cert)).await.unwrap();
    let (mut control, mut control_rx) = conn.open_bi().await.unwrap();
    write(&mut control, &hello(ATTACKER)).await.unwrap();
    let (welcome, _) = read_frame(&mut control_rx, DEFAULT_MAX_FRAME).await.unwrap().unwrap();
    assert!(matches!(welcome, Message::Welcome(_)), "{welcome:?}");
    let replies = Arc::new(std::sync::Mutex::new(Vec::new()));
    let reader_replies = replies.clone();
    let reader = tokio::spawn(async move {
        while let Ok(Some((msg, _))) = read_frame(&mut control_rx, DEFAULT_MAX_FRAME).await {
            if matches!(msg, Message::Ack(_) | Message::Refusal(_)) {
                reader_replies.lock().unwrap().push(msg);
            }
        }
    });
    let updates_sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let attacker_sent = updates_sent.clone();
    let attacker_conn = conn.clone();
    let attacker = tokio::spawn(async move {
        while let Ok(mut stream) = attacker_conn.accept_uni().await {
            let Ok(Some((Message::Broadcast(b), _))) = read_frame(&mut stream, DEFAULT_MAX_FRAME).await else {
                continue;
            };
            let (update, costs) = attack(&b);
            if let Some(update) = update {
                let mut uni = attacker_conn.open_uni().await.unwrap();
                write(&mut uni, &Message::Update(update)).await.unwrap();
                uni.finish().unwrap();
                attacker_sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            for record in costs {
                write(&mut control, &Message::Cost(record)).await.unwrap();
            }
        }
    });

    let mut honest = Vec::new();
    let (events_tx, mut events) = mpsc::unbounded_channel();
    for (i, id) in HONEST.iter().enumerate() {
        let mut options = ClientOptions::new(addr, root.clone(), *id);
        options.client_cert = Some(Arc::new(device(&mut ca, id)));
        honest.push(tokio::spawn(client::run(options, Box::new(fedavg_client(1 + i as u64)), Some(events_tx.clone()))));
    }
    let mut rounds = Vec::new();
    while rounds.len() < ROUNDS as usize {
        match tokio::time::timeout(Duration::from_secs(120), server.events.recv()).await.expect("rounds close") {
            Some(ServerEvent::RoundClosed { report, checkpoint }) => rounds.push((report, checkpoint.global.clone())),
            Some(ServerEvent::Finished) | None => break,
        }
    }
    for h in honest {
        let reason = tokio::time::timeout(Duration::from_secs(60), h).await.expect("finishes").unwrap().unwrap();
        assert!(reason.contains("finished"), "{reason}");
    }
    let mut honest_aggregated = 0;
    while let Ok(e) = events.try_recv() {
        honest_aggregated += matches!(e, ClientEvent::Acked { aggregated: true, .. }) as usize;
    }
    // Every update the attacker sent gets its reply before the server goes (10 s at most).
    for _ in 0..100 {
        if replies.lock().unwrap().len() >= updates_sent.load(std::sync::atomic::Ordering::SeqCst) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    attacker.abort();
    conn.close(0u32.into(), b"done");
    server.shutdown().await.unwrap();
    reader.abort();
    let replies = std::mem::take(&mut *replies.lock().unwrap());
    Outcome { rounds, replies, honest_aggregated }
}

/// The global model is finite, and small (a trained MLP's weights are far below 100).
fn assert_sane(global: &[ParamBlock]) {
    for block in global {
        let values = block.decode().unwrap_or_else(|e| panic!("the global model does not decode: {e}"));
        let largest = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(largest < 100.0, "block {} holds {largest}", block.name);
    }
}

/// Every round aggregated exactly the two honest devices' updates, into a sane model.
fn assert_honest_rounds(outcome: &Outcome) {
    assert_eq!(outcome.rounds.len(), ROUNDS as usize, "every round closed");
    for (report, global) in &outcome.rounds {
        assert_eq!(report.outcome, RoundOutcome::Aggregated, "round {}", report.round);
        let mut clients: Vec<&str> = report.updates.iter().map(|u| u.client.as_str()).collect();
        clients.sort();
        assert_eq!(clients, HONEST, "round {} aggregated the honest devices only", report.round);
        assert_sane(global);
    }
    assert_eq!(outcome.honest_aggregated, 2 * ROUNDS as usize, "each honest update was acked as aggregated");
}

fn refusals(outcome: &Outcome) -> Vec<(RefusalReason, String)> {
    outcome
        .replies
        .iter()
        .filter_map(|m| match m {
            Message::Refusal(r) => Some((r.reason, r.detail.clone())),
            _ => None,
        })
        .collect()
}

/// The global blocks of the broadcast with every value replaced by `value`.
fn filled(b: &Broadcast, value: f32) -> Vec<ParamBlock> {
    b.blocks
        .iter()
        .map(|block| {
            let n = block.decode().unwrap().len();
            ParamBlock::encode(block.name.clone(), &block.tensor.shape, &vec![value; n], Encoding::F32)
        })
        .collect()
}

fn update(round: u64, num_samples: u64, blocks: Vec<ParamBlock>) -> Update {
    Update {
        prototypes_are: Default::default(),
        round,
        num_samples,
        blocks,
        prototypes: vec![],
        metrics: vec![],
        compute_seconds: 0.1,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_of_1e30_claiming_1e18_samples_is_refused_and_honest_rounds_aggregate() {
    let dir = tempfile::tempdir().unwrap();
    let outcome =
        run(dir.path(), |b| (Some(update(b.round, 1_000_000_000_000_000_000, filled(b, 1e30))), vec![])).await;
    let refused = refusals(&outcome);
    println!("attacker's replies: {refused:?}");
    assert_eq!(refused.len(), ROUNDS as usize, "refused in every round: {:?}", outcome.replies);
    assert!(refused.iter().all(|(r, d)| *r == RefusalReason::BadTensor && d.contains("max_abs_value")), "{refused:?}");
    assert!(outcome.replies.iter().all(|m| !matches!(m, Message::Ack(_))), "never acked");
    assert_honest_rounds(&outcome);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_of_another_layout_in_round_one_is_refused_and_the_operators_layout_stays() {
    let dir = tempfile::tempdir().unwrap();
    let stranger = |b: &Broadcast| {
        let layout = vec![ParamBlock::encode("head.weight", &[3], &[0.5, 0.5, 0.5], Encoding::F32)];
        (Some(update(b.round, 10, layout)), vec![])
    };
    let outcome = run(dir.path(), stranger).await;
    let refused = refusals(&outcome);
    println!("stranger's replies: {refused:?}");
    assert!(!refused.is_empty() && refused.iter().all(|(r, _)| *r == RefusalReason::ShapeMismatch), "{refused:?}");
    assert_honest_rounds(&outcome);
    let initial = fedavg_client(0).initial_blocks().unwrap();
    for (_, global) in &outcome.rounds {
        let layout = |blocks: &[ParamBlock]| -> Vec<(String, Vec<u32>)> {
            blocks.iter().map(|b| (b.name.clone(), b.tensor.shape.clone())).collect()
        };
        assert_eq!(layout(global), layout(&initial), "the operator's layout");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cost_record_flood_writes_at_most_one_row_per_invitation() {
    let dir = tempfile::tempdir().unwrap();
    // Each broadcast: no update, then 10,000 records for made-up rounds, one for the real round
    // claiming a petabyte of wire bytes, and five plausible ones for the real round.
    let flood = |b: &Broadcast| {
        let mut records: Vec<CostRecord> = (1_000_000..1_010_000)
            .map(|round| CostRecord { round, wire_up: 1 << 40, ..CostRecord::default() })
            .collect();
        records.push(CostRecord { round: b.round, wire_up: 1 << 50, ..CostRecord::default() });
        records.extend((1..=5).map(|i| CostRecord { round: b.round, wire_up: 1000 * i, ..CostRecord::default() }));
        (None, records)
    };
    let outcome = run(dir.path(), flood).await;
    assert_honest_rounds(&outcome);
    let ledger = read_ledger(&dir.path().join("state").join("anchorage.db")).unwrap();
    let attackers: Vec<&CostRecord> = ledger.iter().filter(|r| r.client == ATTACKER).collect();
    println!(
        "ledger: {} rows, {} of them the attacker's: {:?}",
        ledger.len(),
        attackers.len(),
        attackers.iter().map(|r| (r.round, r.wire_up, r.dropped)).collect::<Vec<_>>()
    );
    let sent: usize = ROUNDS as usize * 10_006;
    assert!(sent >= 30_000);
    let cost_rows: Vec<&&CostRecord> = attackers.iter().filter(|r| !r.dropped).collect();
    assert!(cost_rows.len() <= ROUNDS as usize, "at most one record per invitation: {}", cost_rows.len());
    assert!(cost_rows.iter().all(|r| r.round <= ROUNDS && r.wire_up <= 5000), "made-up rounds and bytes are dropped");
    let total_wire: u64 = ledger.iter().map(|r| r.wire_up).sum();
    assert!(total_wire < 1 << 30, "the ledger's upload total stays plausible: {total_wire} bytes");
}
