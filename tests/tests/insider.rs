//! An enrolled device that misbehaves, over real QUIC on loopback. The
//! server runs the shipped `[engine.robust]` of deploy/project.toml (the defaults, `max_norm_z =
//! 3.5`, `max_samples = 10⁶`); every round invites and waits for all three devices: two honest
//! FedAvg devices and one with its own valid certificate that answers every broadcast itself.
//! - the global model sent back claiming 10¹⁸ samples: refused before the ack ("does not change");
//! - a uniform shift of +2·10⁻⁵ per value claiming 10¹⁸ samples: refused before the ack ("move the
//!   same way");
//! - a plausible change in a direction of its own claiming 10¹⁸ samples: aggregated, and the global
//!   step moves at most 2/n of it (unbounded, it moved 99.8 %);
//! - three honest devices and nobody else: every update acked `aggregated: true` is in its round's
//!   aggregate, every round.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anchorage_client::methods::ClientMethod;
use anchorage_client::transport::{self as client, ClientCert, ClientEvent, ClientOptions};
use anchorage_pki::{Kind, ProjectCa};
use anchorage_server::aggregate::RobustConfig;
use anchorage_server::engine::{EngineConfig, RoundOutcome, RoundReport};
use anchorage_server::methods::FedAvg;
use anchorage_server::store::ServerStore;
use anchorage_server::tls::Trust;
use anchorage_server::transport::{self as server, Limits, ServerEvent, ServerOptions};
use anchorage_shared::frame::DEFAULT_MAX_FRAME;
use anchorage_shared::io::read_frame;
use anchorage_shared::protocol::{
    Broadcast, Heartbeat, KIND_UPDATE, Message, PROTOCOL_VERSION, RefusalReason, RoundConfig, Update,
};
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use anchorage_tests::{fedavg_client, hello, join, raw_connect_as, write};
use rustls::pki_types::CertificateDer;
use tokio::sync::mpsc;

const ATTACKER: &str = "mallory";
const CLAIM: u64 = 1_000_000_000_000_000_000;
/// A round whose hostile update is refused waits for it until this deadline.
const SHORT: Duration = Duration::from_secs(3);
const LONG: Duration = Duration::from_secs(60);

/// What the hostile device sends for a broadcast.
type Attack = fn(&Broadcast) -> Update;

/// The server's `[engine.robust]` as deploy/project.toml ships it.
fn shipped_robust() -> RobustConfig {
    RobustConfig { max_norm_z: Some(3.5), max_samples: 1_000_000, ..RobustConfig::default() }
}

struct Outcome {
    /// Each closed round's report, with the global model it made.
    rounds: Vec<(Arc<RoundReport>, Vec<ParamBlock>)>,
    /// The hostile device's acks and refusals.
    replies: Vec<Message>,
    /// (client, round) of every honest ack that said `aggregated: true`.
    honest_acks: Vec<(String, u64)>,
}

fn device(ca: &mut ProjectCa, id: &str) -> ClientCert {
    let identity = ca.issue(Kind::Client, id, &[], 30).unwrap();
    ClientCert { chain: vec![identity.cert], key: identity.key }
}

/// `honest` real FedAvg devices and, with `attack`, one hostile device; every round waits for all.
async fn run(rounds: u64, honest: &[&str], attack: Option<Attack>, deadline: Duration) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    let devices = honest.len() + attack.is_some() as usize;
    let mut ca = ProjectCa::init(&dir.path().join("ca"), "insider-test", 30).unwrap();
    let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 30).unwrap();
    let mut server = server::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity,
        trust: Trust::ProjectCa { ca: ca.cert().clone(), crl: None },
        engine: EngineConfig {
            rounds,
            min_available: devices,
            fraction: 1.0,
            min_fit: devices,
            over_selection: 0.0,
            round_deadline: deadline,
            round: RoundConfig { local_epochs: 1, batch_size: 32, learning_rate: 1e-3, deadline_ms: 0 },
            robust: shipped_robust(),
            ..EngineConfig::default()
        },
        method: Box::new(FedAvg::default()),
        initial: fedavg_client(0).initial_blocks().unwrap(),
        limits: Limits::default(),
        store: Some(ServerStore::open(dir.path().join("state")).unwrap()),
    })
    .await
    .unwrap();
    let addr = server.local_addr;
    let root: CertificateDer<'static> = ca.cert().clone();

    let (replies_tx, mut replies_rx) = mpsc::unbounded_channel();
    let mut hostile = Vec::new();
    if let Some(attack) = attack {
        let cert = device(&mut ca, ATTACKER);
        let (endpoint, conn) = raw_connect_as(addr, &root, Some(&cert)).await.unwrap();
        let (mut control, mut control_rx) = conn.open_bi().await.unwrap();
        write(&mut control, &hello(ATTACKER)).await.unwrap();
        let (welcome, _) = read_frame(&mut control_rx, DEFAULT_MAX_FRAME).await.unwrap().unwrap();
        assert!(matches!(welcome, Message::Welcome(_)), "{welcome:?}");
        hostile.push(tokio::spawn(async move {
            while let Ok(Some((msg, _))) = read_frame(&mut control_rx, DEFAULT_MAX_FRAME).await {
                if matches!(msg, Message::Ack(_) | Message::Refusal(_)) {
                    let _ = replies_tx.send(msg);
                }
            }
        }));
        let sender = conn.clone();
        hostile.push(tokio::spawn(async move {
            let _keep = (endpoint, control);
            while let Ok(mut stream) = sender.accept_uni().await {
                let Ok(Some((Message::Broadcast(b), _))) = read_frame(&mut stream, DEFAULT_MAX_FRAME).await else {
                    continue;
                };
                let mut uni = sender.open_uni().await.unwrap();
                write(&mut uni, &Message::Update(attack(&b))).await.unwrap();
                uni.finish().unwrap();
            }
        }));
    }
    let mut tasks = Vec::new();
    let (events_tx, mut events) = mpsc::unbounded_channel();
    for (i, id) in honest.iter().enumerate() {
        let mut options = ClientOptions::new(addr, root.clone(), *id);
        options.client_cert = Some(Arc::new(device(&mut ca, id)));
        let (tx, id) = (events_tx.clone(), id.to_string());
        let (relay_tx, mut relay_rx) = mpsc::unbounded_channel();
        tasks.push(tokio::spawn(client::run(options, Box::new(fedavg_client(1 + i as u64)), Some(relay_tx))));
        tokio::spawn(async move {
            while let Some(e) = relay_rx.recv().await {
                let _ = tx.send((id.clone(), e));
            }
        });
    }
    let mut closed = Vec::new();
    while closed.len() < rounds as usize {
        match tokio::time::timeout(Duration::from_secs(120), server.events.recv()).await.expect("rounds close") {
            Some(ServerEvent::RoundClosed { report, checkpoint }) => closed.push((report, checkpoint.global.clone())),
            Some(ServerEvent::Finished) | None => break,
        }
    }
    for t in tasks {
        let reason = tokio::time::timeout(Duration::from_secs(60), t).await.expect("finishes").unwrap().unwrap();
        assert!(reason.contains("finished"), "{reason}");
    }
    for h in hostile {
        h.abort();
    }
    server.shutdown().await.unwrap();
    let mut honest_acks = Vec::new();
    while let Ok((id, e)) = events.try_recv() {
        if let ClientEvent::Acked { round, aggregated: true } = e {
            honest_acks.push((id, round));
        }
    }
    let mut replies = Vec::new();
    while let Ok(m) = replies_rx.try_recv() {
        replies.push(m);
    }
    Outcome { rounds: closed, replies, honest_acks }
}

fn values(blocks: &[ParamBlock]) -> Vec<f32> {
    blocks.iter().flat_map(|b| b.decode().unwrap()).collect()
}

/// The broadcast's global model with `delta(i)` added to value i, claiming [`CLAIM`] samples.
fn shifted(b: &Broadcast, delta: impl Fn(usize) -> f32) -> Update {
    let mut i = 0;
    let blocks = b
        .blocks
        .iter()
        .map(|block| {
            let moved: Vec<f32> = block
                .decode()
                .unwrap()
                .into_iter()
                .map(|v| {
                    i += 1;
                    v + delta(i - 1)
                })
                .collect();
            ParamBlock::encode(block.name.clone(), &block.tensor.shape, &moved, Encoding::F32)
        })
        .collect();
    Update {
        prototypes_are: Default::default(),
        round: b.round,
        num_samples: CLAIM,
        blocks,
        prototypes: vec![],
        metrics: vec![],
        compute_seconds: 0.1,
    }
}

/// The hostile device's own direction for a round: ±3·10⁻⁴ per value, signs from a seeded
/// generator (half up, half down, so no sign screen can tell it from a gradient step).
fn own_direction(round: u64, len: usize) -> Vec<f32> {
    let mut rng = Rng::derive(0xbad, round);
    (0..len).map(|_| if rng.below(2) == 0 { 3e-4 } else { -3e-4 }).collect()
}

fn own_direction_attack(b: &Broadcast) -> Update {
    let len = values(&b.blocks).len();
    let d = own_direction(b.round, len);
    shifted(b, |i| d[i])
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

/// Every round aggregated, and every honest update acked as aggregated is in its round's report.
fn assert_acks_are_true(outcome: &Outcome, honest: &[&str], rounds: u64) {
    assert_eq!(outcome.rounds.len(), rounds as usize, "every round closed");
    for (report, _) in &outcome.rounds {
        assert_eq!(report.outcome, RoundOutcome::Aggregated, "round {}", report.round);
    }
    assert_eq!(outcome.honest_acks.len(), honest.len() * rounds as usize, "{:?}", outcome.honest_acks);
    for (client, round) in &outcome.honest_acks {
        let (report, _) = &outcome.rounds[*round as usize - 1];
        assert!(
            report.updates.iter().any(|u| &u.client == client),
            "{client}'s round-{round} update was acked as aggregated but is not in the aggregate"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_global_model_sent_back_claiming_1e18_samples_is_refused_and_training_goes_on() {
    let honest = ["edge-1", "edge-2"];
    let outcome = run(3, &honest, Some(|b: &Broadcast| shifted(b, |_| 0.0)), SHORT).await;
    let refused = refusals(&outcome);
    println!("attacker's replies: {refused:?}");
    assert_eq!(refused.len(), 3, "{:?}", outcome.replies);
    assert!(
        refused.iter().all(|(r, d)| *r == RefusalReason::BadTensor && d.contains("does not change")),
        "{refused:?}"
    );
    // Each round waits for 3 updates, gets the 2 honest ones and closes at its deadline on them:
    // the refused claim does not freeze the model.
    assert_acks_are_true(&outcome, &honest, 3);
    let mut previous = values(&fedavg_client(0).initial_blocks().unwrap());
    for (report, global) in &outcome.rounds {
        assert!(report.updates.iter().all(|u| u.client != ATTACKER), "round {}", report.round);
        let now = values(global);
        let step = now.iter().zip(&previous).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum::<f64>().sqrt();
        println!("round {}: global step {step:.3e}", report.round);
        assert!(step > 1e-3, "round {}: training goes on (step {step:.3e})", report.round);
        previous = now;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_uniform_shift_claiming_1e18_samples_is_refused_before_the_ack() {
    let honest = ["edge-1", "edge-2"];
    let outcome = run(3, &honest, Some(|b: &Broadcast| shifted(b, |_| 2e-5)), SHORT).await;
    let refused = refusals(&outcome);
    println!("attacker's replies: {refused:?}");
    assert_eq!(refused.len(), 3, "{:?}", outcome.replies);
    assert!(
        refused.iter().all(|(r, d)| *r == RefusalReason::BadTensor && d.contains("move the same way")),
        "{refused:?}"
    );
    assert!(outcome.replies.iter().all(|m| !matches!(m, Message::Ack(_))), "never acked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_claiming_1e18_samples_moves_the_global_at_most_2_over_n_of_its_change() {
    const ROUNDS: u64 = 4;
    let honest = ["edge-1", "edge-2"];
    let outcome = run(ROUNDS, &honest, Some(own_direction_attack), LONG).await;
    assert!(refusals(&outcome).is_empty(), "a plausible change passes the screens: {:?}", outcome.replies);
    let n = 3.0;
    let mut previous = values(&fedavg_client(0).initial_blocks().unwrap());
    for (report, global) in &outcome.rounds {
        assert!(
            report.updates.iter().any(|u| u.client == ATTACKER),
            "the attacker's update is in round {}",
            report.round
        );
        let now = values(global);
        let d = own_direction(report.round, now.len());
        let dot: f64 = now.iter().zip(&previous).zip(&d).map(|((a, b), d)| (*a as f64 - *b as f64) * *d as f64).sum();
        let pull = dot / d.iter().map(|d| (*d as f64).powi(2)).sum::<f64>();
        println!(
            "round {}: the global moved {:.1}% of the attacker's change (bound 2/n = {:.1}%); influence {:?}",
            report.round,
            100.0 * pull,
            200.0 / n,
            report.influence
        );
        assert!(pull <= 2.0 / n, "round {}: pull {pull}", report.round);
        assert!(report.influence.weight_clipped.iter().any(|c| c == ATTACKER), "{:?}", report.influence);
        previous = now;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_honest_devices_under_the_shipped_config_are_never_screened_out_after_their_ack() {
    const ROUNDS: u64 = 20;
    let honest = ["edge-1", "edge-2", "edge-3"];
    let outcome = run(ROUNDS, &honest, None, LONG).await;
    assert_acks_are_true(&outcome, &honest, ROUNDS);
    for (report, _) in &outcome.rounds {
        assert_eq!(report.updates.len(), 3, "round {}: {:?}", report.round, report.updates);
        assert_eq!(report.refused, 0);
        assert!(
            report.influence.skipped.iter().any(|s| s.starts_with("max_norm_z")),
            "a MAD over 3 norms does not run, and the report says so: {:?}",
            report.influence
        );
    }
    println!(
        "{} rounds, {} honest acks, each in its round's aggregate",
        outcome.rounds.len(),
        outcome.honest_acks.len()
    );
}

/// A second holder of a live device's certificate, where the two would evict each other without
/// end. Each new connection replaces the current one; the replaced holder, still alive, keeps
/// sending on its old connection, which is closed, and that is one replacement. After 4 in a
/// minute both holders are refused, with a message that tells the operator to revoke it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_holders_of_one_certificate_are_both_refused_once_they_flap() {
    let dir = tempfile::tempdir().unwrap();
    let (server, mut ca) = start_with(dir.path(), Limits::default()).await;
    let root: CertificateDer<'static> = ca.cert().clone();
    let twin = device(&mut ca, "twin");
    let mut replies = Vec::new();
    let mut held = Vec::new();
    // Two live devices alternating: each keeps sending heartbeats on its connection.
    for _ in 0..8 {
        let (endpoint, conn, reply) = hello_as(server.local_addr, &root, &twin, "twin", true).await;
        replies.push(reply);
        held.push((endpoint, conn));
        // The replaced holder's next heartbeat arrives.
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let kinds = reply_kinds(&replies);
    println!("{kinds:#?}");
    // Hellos 2 to 5 each set a live connection aside, which then sends: the 4th is the conflict,
    // which refuses the 5th connection too (after its welcome).
    assert_eq!(kinds[..5], ["welcome"; 5], "{kinds:?}");
    assert!(kinds[5..].iter().all(|k| k.contains("in use by two devices")), "then both holders are refused: {kinds:?}");
    assert_eq!(server.metrics.certificate_conflicts_total(), 1);
    server.shutdown().await.unwrap();
}

/// A device that restarts over and over (a crash loop under systemd, a flaky path that comes
/// back from a new address) leaves each old connection silent, still open on the server until
/// QUIC's idle timeout. Eight restarts inside a few seconds: every hello is welcomed, no
/// certificate conflict is counted, and the last connection is the device's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_restarted_again_and_again_is_not_taken_for_a_stolen_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (server, mut ca) = start_with(dir.path(), Limits::default()).await;
    let root: CertificateDer<'static> = ca.cert().clone();
    let looping = device(&mut ca, "looping");
    let mut replies = Vec::new();
    let mut held = Vec::new();
    for _ in 0..8 {
        // Silent after its hello, never closed: the process that held it is gone.
        let (endpoint, conn, reply) = hello_as(server.local_addr, &root, &looping, "looping", false).await;
        replies.push(reply);
        held.push((endpoint, conn));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let kinds = reply_kinds(&replies);
    println!("{kinds:#?}");
    assert_eq!(kinds, ["welcome"; 8], "a restart is a reconnect, never a conflict");
    assert_eq!(server.metrics.certificate_conflicts_total(), 0);
    let (_, last) = held.last().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(last.close_reason().is_none(), "the newest connection is open: {:?}", last.close_reason());
    let connected = anchorage_tests::metric_value(&server.metrics.render(), "anchorage_clients_connected");
    assert_eq!(connected, Some(1.0), "one device, connected once");
    server.shutdown().await.unwrap();
}

/// A connection as `id` with `cert` and its hello's answer; a task holds its control stream open
/// and, with `live`, sends heartbeats on it every 100 ms until the connection closes.
async fn hello_as(
    server: SocketAddr,
    root: &CertificateDer<'static>,
    cert: &ClientCert,
    id: &str,
    live: bool,
) -> (quinn::Endpoint, quinn::Connection, Message) {
    let (endpoint, conn) = raw_connect_as(server, root, Some(cert)).await.unwrap();
    let (mut control, mut control_rx) = conn.open_bi().await.unwrap();
    write(&mut control, &hello(id)).await.unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(10), read_frame(&mut control_rx, DEFAULT_MAX_FRAME))
        .await
        .expect("an answer");
    let reply = match reply {
        Ok(Some((msg, _))) => msg,
        other => panic!("{other:?}"),
    };
    // The control stream stays open either way (a dropped one would end the connection).
    tokio::spawn(async move {
        if !live {
            return std::future::pending::<()>().await;
        }
        for seq in 0.. {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if write(&mut control, &Message::Heartbeat(Heartbeat { seq })).await.is_err() {
                break;
            }
        }
    });
    (endpoint, conn, reply)
}

fn reply_kinds(replies: &[Message]) -> Vec<String> {
    replies
        .iter()
        .map(|m| match m {
            Message::Refusal(r) => format!("refused: {}", r.detail),
            m => m.kind_name().to_string(),
        })
        .collect()
}

/// A CA-mode server with `limits` and no round to run (it waits for more devices than connect).
async fn start_with(dir: &std::path::Path, limits: Limits) -> (anchorage_server::transport::ServerHandle, ProjectCa) {
    let mut ca = ProjectCa::init(&dir.join("ca"), "insider-test", 30).unwrap();
    let identity = ca.issue(Kind::Server, "server", &["localhost".into()], 30).unwrap();
    let server = server::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity,
        trust: Trust::ProjectCa { ca: ca.cert().clone(), crl: None },
        engine: EngineConfig { rounds: 1, min_available: 5, ..EngineConfig::default() },
        method: Box::new(FedAvg::default()),
        initial: fedavg_client(0).initial_blocks().unwrap(),
        limits,
        store: None,
    })
    .await
    .unwrap();
    (server, ca)
}

/// A 64 MiB upload fed 1 byte every 20 s, which would be held open as long as the trickle lasts.
/// Each byte comes within the stall timeout, so only the upload's pace can tell: below
/// `min_upload_rate` once `read_stall` has passed, the device is refused and closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_trickled_a_byte_at_a_time_is_closed_at_the_minimum_rate() {
    let dir = tempfile::tempdir().unwrap();
    let stall = Duration::from_secs(2);
    let limits = Limits { read_stall: stall, min_upload_rate: 1024, ..Limits::default() };
    let (server, mut ca) = start_with(dir.path(), limits).await;
    let root = ca.cert().clone();
    let (_endpoint, conn) = raw_connect_as(server.local_addr, &root, Some(&device(&mut ca, "trickle"))).await.unwrap();
    let (_send, mut control) = join(&conn, "trickle").await;
    let mut uni = conn.open_uni().await.unwrap();
    let declared = (DEFAULT_MAX_FRAME - 16) as u32;
    let mut head = declared.to_le_bytes().to_vec();
    head.extend([PROTOCOL_VERSION, KIND_UPDATE]);
    uni.write_all(&head).await.unwrap();
    let started = Instant::now();
    let feeder = tokio::spawn(async move {
        // One byte a second: never a stall of 2 s.
        for _ in 0..30 {
            if uni.write_all(&[0]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    let reply = tokio::time::timeout(Duration::from_secs(20), read_frame(&mut control, DEFAULT_MAX_FRAME))
        .await
        .expect("the trickle is cut off well before it ends");
    println!("trickled upload answered after {:?}: {reply:?}", started.elapsed());
    match reply {
        Ok(Some((Message::Refusal(r), _))) => assert!(r.detail.contains("slower than the minimum"), "{}", r.detail),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(10), "cut off soon after the grace of read_stall");
    feeder.abort();
    server.shutdown().await.unwrap();
}
