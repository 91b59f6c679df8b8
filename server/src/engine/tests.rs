//! Engine tests on a fake clock: the engine owns no clock, so each test passes `now` itself.

use std::collections::BTreeSet;
use std::time::Duration;

use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::{Capabilities, Goodbye, Hello, Message, RefusalReason, Update};
use anchorage_shared::tensor::{Encoding, ParamBlock};

use super::*;
use crate::engine::AggregationMode;
use crate::methods::FedAvg;

const DEADLINE: Duration = Duration::from_secs(10);

pub(super) fn config(min_available: usize, min_fit: usize) -> EngineConfig {
    // The papers' plain mean, so that the arithmetic below is FedAvg's; the bounds have their own tests.
    let robust = crate::aggregate::RobustConfig::unbounded();
    EngineConfig { rounds: 3, min_available, min_fit, round_deadline: DEADLINE, robust, ..EngineConfig::default() }
}

pub(super) fn engine(config: EngineConfig) -> Engine {
    Engine::new(config, Box::new(FedAvg::default()), vec![block(&[0.0, 0.0])])
}

pub(super) fn block(values: &[f32]) -> ParamBlock {
    ParamBlock::encode("head.weight", &[values.len() as u32], values, Encoding::F32)
}

pub(super) fn hello(id: &str) -> Message {
    let mut methods = heapless::Vec::new();
    methods.push(heapless::String::try_from("fedavg").unwrap()).unwrap();
    Message::Hello(Box::new(Hello {
        client_id: id.into(),
        capabilities: Capabilities { backend: "flex".into(), memory_mb: 256, methods },
        num_samples: 10,
        last_round: None,
    }))
}

pub(super) fn update(round: u64, values: &[f32], n: u64) -> Message {
    Message::Update(Update {
        prototypes_are: Default::default(),
        round,
        num_samples: n,
        blocks: vec![block(values)],
        prototypes: vec![],
        metrics: vec![],
        compute_seconds: 0.5,
    })
}

pub(super) fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

pub(crate) fn drain(e: &mut Engine) -> Vec<Action> {
    std::iter::from_fn(|| e.poll_action()).collect()
}

fn broadcast_targets(actions: &[Action]) -> Vec<Vec<ClientId>> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Broadcast { to, .. } => Some(to.clone()),
            _ => None,
        })
        .collect()
}

pub(super) fn reports(actions: &[Action]) -> Vec<Arc<RoundReport>> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::RoundClosed(r, _) => Some(r.clone()),
            _ => None,
        })
        .collect()
}

fn acks(actions: &[Action], client: &str) -> Vec<(u64, bool)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { to, msg: Message::Ack(ack) } if to == client => Some((ack.round, ack.aggregated)),
            _ => None,
        })
        .collect()
}

pub(crate) fn refusals(actions: &[Action], client: &str) -> Vec<RefusalReason> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { to, msg: Message::Refusal(r) } if to == client => Some(r.reason),
            Action::Close { client: to, refusal } if to == client => Some(refusal.reason),
            _ => None,
        })
        .collect()
}

pub(super) fn join(e: &mut Engine, now: Duration, ids: &[&str]) -> Vec<Action> {
    for id in ids {
        e.handle_message(now, id, hello(id));
    }
    drain(e)
}

#[test]
fn a_round_waits_for_enough_clients_then_samples_them() {
    let mut e = engine(config(3, 3));
    let actions = join(&mut e, secs(0), &["a", "b"]);
    assert!(broadcast_targets(&actions).is_empty(), "two of three clients: no round yet");
    assert_eq!(e.open_round(), None);
    let actions = join(&mut e, secs(1), &["c"]);
    assert_eq!(broadcast_targets(&actions), vec![vec!["a".to_string(), "b".into(), "c".into()]]);
    assert_eq!(e.open_round(), Some(1));
    assert_eq!(e.poll_timeout(), Some(secs(1) + DEADLINE));
}

#[test]
fn fedavg_round_closes_when_all_updates_arrived() {
    let mut e = engine(config(2, 2));
    join(&mut e, secs(0), &["a", "b"]);
    e.handle_message(secs(2), "a", update(1, &[1.0, 2.0], 1));
    assert_eq!(acks(&drain(&mut e), "a"), vec![(1, true)]);
    assert_eq!(e.open_round(), Some(1), "still waiting for b");
    e.handle_message(secs(3), "b", update(1, &[5.0, 6.0], 3));
    let actions = drain(&mut e);
    let r = reports(&actions);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].outcome, RoundOutcome::Aggregated);
    assert_eq!(r[0].updates.len(), 2);
    assert_eq!(r[0].closed, secs(3));
    assert_eq!(e.global()[0].decode().unwrap(), vec![4.0, 5.0], "sample-weighted mean");
    assert!(
        matches!(actions.iter().position(|a| matches!(a, Action::Persist(Persist::Closed { .. }))), Some(i)
        if i < actions.iter().position(|a| matches!(a, Action::Broadcast { .. })).unwrap()),
        "persist before announcing round 2"
    );
    assert_eq!(e.open_round(), Some(2));
}

#[test]
fn deadline_closes_a_round_with_a_silent_client() {
    let mut e = engine(config(2, 2));
    join(&mut e, secs(0), &["a", "b"]);
    e.handle_message(secs(1), "a", update(1, &[2.0, 2.0], 1));
    e.handle_disconnect(secs(2), "b");
    drain(&mut e);
    e.handle_timeout(secs(9));
    assert_eq!(e.open_round(), Some(1), "the deadline has not passed");
    e.handle_timeout(secs(10));
    let r = reports(&drain(&mut e));
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].outcome, RoundOutcome::Aggregated);
    assert_eq!(r[0].missing, vec!["b".to_string()]);
    assert_eq!(e.stats().dropped, 1);
    assert_eq!(e.global()[0].decode().unwrap(), vec![2.0, 2.0]);
    assert_eq!(e.open_round(), None, "only one client connected: round 2 waits");
}

#[test]
fn too_few_updates_fail_the_round_and_keep_the_model() {
    let mut e = engine(EngineConfig { min_updates: 2, ..config(2, 2) });
    join(&mut e, secs(0), &["a", "b"]);
    e.handle_message(secs(1), "a", update(1, &[9.0, 9.0], 1));
    e.handle_timeout(secs(10));
    let r = reports(&drain(&mut e));
    assert!(matches!(&r[0].outcome, RoundOutcome::Failed { reason } if reason.contains("1 of at least 2")));
    assert_eq!(e.global()[0].decode().unwrap(), vec![0.0, 0.0]);
    assert_eq!(e.stats().failed_rounds, 1);
    assert_eq!(e.open_round(), Some(2), "the next round opens anyway");
}

#[test]
fn a_duplicate_update_is_counted_once() {
    let mut e = engine(config(2, 2));
    join(&mut e, secs(0), &["a", "b"]);
    e.handle_message(secs(1), "a", update(1, &[1.0, 1.0], 1));
    e.handle_message(secs(2), "a", update(1, &[100.0, 100.0], 1));
    let actions = drain(&mut e);
    assert_eq!(acks(&actions, "a"), vec![(1, true), (1, true)], "both copies acknowledged");
    e.handle_message(secs(3), "b", update(1, &[3.0, 3.0], 1));
    let r = reports(&drain(&mut e));
    assert_eq!(r[0].duplicates, 1);
    assert_eq!(r[0].updates.len(), 2);
    assert_eq!(e.global()[0].decode().unwrap(), vec![2.0, 2.0], "the second copy is not aggregated");
    // A resend after the round closed (the ack was lost) is still a duplicate, not a late update.
    e.handle_message(secs(4), "a", update(1, &[1.0, 1.0], 1));
    assert_eq!(acks(&drain(&mut e), "a"), vec![(1, true)]);
    assert_eq!(e.stats().duplicate_updates, 2);
    assert_eq!(e.stats().late_updates, 0);
}

#[test]
fn a_late_update_is_acknowledged_and_counted_not_aggregated() {
    let mut e = engine(config(2, 2));
    join(&mut e, secs(0), &["a", "b"]);
    e.handle_message(secs(1), "a", update(1, &[2.0, 2.0], 1));
    e.handle_timeout(secs(10));
    drain(&mut e);
    let before = e.global().to_vec();
    e.handle_message(secs(12), "b", update(1, &[50.0, 50.0], 1));
    let actions = drain(&mut e);
    assert_eq!(acks(&actions, "b"), vec![(1, false)]);
    assert_eq!(e.stats().late_updates, 1);
    assert_eq!(e.global(), before.as_slice());
}

#[test]
fn updates_that_do_not_belong_are_refused() {
    let mut e = engine(EngineConfig { min_fit: 1, fraction: 0.0, ..config(2, 1) });
    join(&mut e, secs(0), &["a", "b"]);
    let sampled = e.open().unwrap().sampled.iter().next().unwrap().clone();
    let other = if sampled == "a" { "b" } else { "a" };
    e.handle_message(secs(1), other, update(1, &[1.0, 1.0], 1));
    assert_eq!(refusals(&drain(&mut e), other), vec![RefusalReason::NotSampled]);
    e.handle_message(secs(1), &sampled, update(7, &[1.0, 1.0], 1));
    assert_eq!(refusals(&drain(&mut e), &sampled), vec![RefusalReason::NotSampled], "round 7 is not open");
    e.handle_message(secs(1), &sampled, update(1, &[1.0, 1.0, 1.0], 1));
    assert_eq!(refusals(&drain(&mut e), &sampled), vec![RefusalReason::ShapeMismatch]);
    e.handle_message(secs(1), &sampled, update(1, &[1.0, 1.0], 0));
    assert_eq!(refusals(&drain(&mut e), &sampled), vec![RefusalReason::Malformed]);
    e.handle_message(secs(1), "stranger", update(1, &[1.0, 1.0], 1));
    assert_eq!(refusals(&drain(&mut e), "stranger"), vec![RefusalReason::NotEnrolled]);
    assert_eq!(e.open_round(), Some(1), "nothing refused was accepted");
    e.handle_message(secs(2), &sampled, update(1, &[1.0, 1.0], 1));
    assert_eq!(reports(&drain(&mut e)).len(), 1);
    assert_eq!(e.stats().refused, 5);
}

#[test]
fn hellos_that_lie_or_run_another_method_are_closed() {
    let mut e = engine(config(2, 2));
    e.handle_message(secs(0), "conn-1", hello("someone-else"));
    assert_eq!(refusals(&drain(&mut e), "conn-1"), vec![RefusalReason::NotEnrolled]);
    let mut h = hello("x");
    if let Message::Hello(h) = &mut h {
        h.capabilities.methods.clear();
    }
    e.handle_message(secs(0), "x", h);
    assert_eq!(refusals(&drain(&mut e), "x"), vec![RefusalReason::UnknownMethod]);
    assert_eq!(e.connected(), 0);
}

#[test]
fn the_connected_count_follows_hellos_and_departures() {
    // Kept, not counted (a hello at a million devices must not walk them all): a repeated hello,
    // a repeated departure and the departure of a stranger change it by the right amount.
    let mut e = engine(config(10, 5));
    for id in ["a", "b", "a", "c"] {
        e.handle_message(secs(0), id, hello(id));
    }
    assert_eq!(e.connected(), 3);
    e.handle_disconnect(secs(1), "b");
    e.handle_disconnect(secs(1), "b");
    e.handle_disconnect(secs(1), "nobody");
    e.handle_message(secs(1), "c", Message::Goodbye(Goodbye { reason: "done".into() }));
    assert_eq!(e.connected(), 1);
    e.handle_message(secs(2), "b", hello("b"));
    assert_eq!(e.connected(), 2);
}

#[test]
fn over_selection_invites_more_and_closes_at_the_target() {
    let mut e = engine(EngineConfig { fraction: 0.5, min_fit: 1, over_selection: 0.5, ..config(4, 1) });
    let actions = join(&mut e, secs(0), &["a", "b", "c", "d"]);
    let invited = broadcast_targets(&actions).remove(0);
    assert_eq!(invited.len(), 3, "target 2, plus 50%");
    assert_eq!(e.open().unwrap().target, 2);
    e.handle_message(secs(1), &invited[0], update(1, &[1.0, 1.0], 1));
    e.handle_message(secs(2), &invited[1], update(1, &[3.0, 3.0], 1));
    let r = reports(&drain(&mut e));
    assert_eq!(r.len(), 1, "closed at the target, before the deadline");
    assert_eq!(r[0].sampled, 3);
    assert_eq!(r[0].missing, vec![invited[2].clone()]);
    // The third invitee's update now arrives late.
    e.handle_message(secs(3), &invited[2], update(1, &[3.0, 3.0], 1));
    assert_eq!(acks(&drain(&mut e), &invited[2]), vec![(1, false)]);
}

#[test]
fn sampling_is_seeded() {
    let pick = |seed: u64| {
        let mut e = engine(EngineConfig { fraction: 0.25, min_fit: 1, seed, ..config(8, 1) });
        let ids: Vec<String> = (0..8).map(|i| format!("c{i}")).collect();
        let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        broadcast_targets(&join(&mut e, secs(0), &refs)).remove(0)
    };
    assert_eq!(pick(1), pick(1));
    assert!((0..20).map(pick).collect::<BTreeSet<_>>().len() > 1, "different seeds sample differently");
}

#[test]
fn a_reconnecting_sampled_client_gets_the_broadcast_again() {
    let mut e = engine(config(2, 2));
    join(&mut e, secs(0), &["a", "b"]);
    e.handle_disconnect(secs(1), "b");
    let actions = join(&mut e, secs(2), &["b"]);
    assert_eq!(broadcast_targets(&actions), vec![vec!["b".to_string()]]);
    e.handle_message(secs(3), "a", update(1, &[1.0, 1.0], 1));
    e.handle_message(secs(3), "b", update(1, &[1.0, 1.0], 1));
    assert_eq!(reports(&drain(&mut e)).len(), 1);
}

#[test]
fn the_federation_finishes_and_resumes_from_its_checkpoint() {
    let mut e = engine(config(2, 2));
    join(&mut e, secs(0), &["a", "b"]);
    let mut checkpoint = None;
    for round in 1..=3 {
        e.handle_message(secs(round), "a", update(round, &[round as f32, 0.0], 1));
        e.handle_message(secs(round), "b", update(round, &[round as f32, 0.0], 1));
        for a in drain(&mut e) {
            if let Action::Persist(Persist::Closed { checkpoint: c, .. }) = a {
                checkpoint = Some(c);
            }
        }
    }
    assert!(e.is_finished());
    let checkpoint = checkpoint.unwrap();
    assert_eq!(checkpoint.round, 3);
    // A restarted engine with more rounds configured continues at round 4 from the saved model.
    let mut resumed =
        Engine::resume(EngineConfig { rounds: 5, ..config(2, 2) }, Box::new(FedAvg::default()), (*checkpoint).clone());
    assert_eq!(resumed.global()[0].decode().unwrap(), vec![3.0, 0.0]);
    join(&mut resumed, secs(0), &["a", "b"]);
    assert_eq!(resumed.open_round(), Some(4));
    // A restarted engine whose rounds are done says goodbye to whoever connects.
    let mut done = Engine::resume(config(2, 2), Box::new(FedAvg::default()), (*checkpoint).clone());
    let actions = join(&mut done, secs(0), &["a"]);
    assert!(actions.iter().any(|a| matches!(a, Action::Send { msg: Message::Goodbye(_), .. })));
}

#[test]
fn goodbyes_and_finished_follow_the_last_round() {
    let mut e = engine(EngineConfig { rounds: 1, ..config(2, 2) });
    join(&mut e, secs(0), &["a", "b"]);
    e.handle_message(secs(1), "a", update(1, &[1.0, 1.0], 1));
    e.handle_message(secs(1), "b", update(1, &[1.0, 1.0], 1));
    let actions = drain(&mut e);
    let goodbyes = actions.iter().filter(|a| matches!(a, Action::Send { msg: Message::Goodbye(_), .. })).count();
    assert_eq!(goodbyes, 2);
    assert!(matches!(actions.last(), Some(Action::Finished)));
    assert_eq!(e.open_round(), None);
}

fn ledger(actions: &[Action]) -> Vec<CostRecord> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Ledger(r) => Some(r.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn cost_reports_and_dropped_clients_land_in_the_ledger() {
    let mut e = engine(config(2, 2));
    join(&mut e, secs(0), &["a", "b"]);
    e.handle_message(secs(1), "a", update(1, &[1.0, 1.0], 1));
    e.handle_timeout(secs(10));
    let dropped = ledger(&drain(&mut e));
    assert_eq!(dropped.len(), 1);
    assert!(dropped[0].dropped && dropped[0].client == "b" && dropped[0].round == 1 && dropped[0].payload_down == 8);
    // A client's report is filed under its connection's identity, whatever it claims.
    let report = CostRecord { client: "someone-else".into(), round: 1, wire_up: 1234, ..CostRecord::default() };
    e.handle_message(secs(11), "a", Message::Cost(report));
    let filed = ledger(&drain(&mut e));
    assert_eq!((filed[0].client.as_str(), filed[0].wire_up), ("a", 1234));
    // Reports for rounds the client was not invited to, or with impossible byte counts, are
    // dropped and counted (no refusal: that would make the device set its unsent update aside).
    let refused_before = e.stats().refused;
    for bogus in [
        CostRecord { round: 99, ..CostRecord::default() },
        CostRecord { round: 1, wire_up: 1 << 60, ..CostRecord::default() },
        CostRecord { round: 1, payload_down: u64::from(u32::MAX) + 1, ..CostRecord::default() },
    ] {
        e.handle_message(secs(11), "a", Message::Cost(bogus));
        let actions = drain(&mut e);
        assert!(ledger(&actions).is_empty() && refusals(&actions, "a").is_empty(), "{actions:?}");
    }
    assert_eq!(e.stats().refused, refused_before + 3);
    // A flood of made-up rounds from one peer writes nothing.
    for round in 2..20_000 {
        e.handle_message(secs(11), "a", Message::Cost(CostRecord { round, wire_up: 1, ..CostRecord::default() }));
    }
    let flood = ledger(&drain(&mut e));
    assert!(flood.len() <= 1, "at most the open round 2, got {} records", flood.len());
    // Each invitation takes one record: a second valid-looking one for round 1 is dropped too.
    e.handle_message(secs(11), "a", Message::Cost(CostRecord { round: 1, wire_up: 99, ..CostRecord::default() }));
    assert!(ledger(&drain(&mut e)).is_empty());
    assert!(e.stats().dropped_cost_records >= 20_000, "{:?}", e.stats());
    // Strangers are refused.
    e.handle_message(secs(11), "x", Message::Cost(CostRecord { round: 1, ..CostRecord::default() }));
    assert_eq!(refusals(&drain(&mut e), "x"), vec![RefusalReason::NotEnrolled]);
}

pub(super) fn buffered(buffer: usize, concurrency: usize, max_staleness: u64) -> EngineConfig {
    EngineConfig { mode: AggregationMode::Buffered { buffer, concurrency, max_staleness }, rounds: 10, ..config(2, 1) }
}

pub(super) fn dispatched(actions: &[Action]) -> Vec<(ClientId, u64)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Broadcast { to, msg } => match msg.as_ref() {
                Message::Broadcast(b) => Some(to.iter().map(|c| (c.clone(), b.round)).collect::<Vec<_>>()),
                _ => None,
            },
            _ => None,
        })
        .flatten()
        .collect()
}

#[test]
fn buffered_mode_keeps_clients_busy_and_aggregates_every_k_updates() {
    let mut e = engine(buffered(2, 3, 5));
    let actions = join(&mut e, secs(0), &["a", "b", "c", "d"]);
    let first = dispatched(&actions);
    assert_eq!(first.len(), 3, "concurrency 3 of 4 connected: {first:?}");
    assert!(first.iter().all(|(_, r)| *r == 1), "all train on version 0 (round 1)");
    let (x, y, z) = (first[0].0.clone(), first[1].0.clone(), first[2].0.clone());
    e.handle_message(secs(1), &x, update(1, &[2.0, 2.0], 1));
    let a1 = drain(&mut e);
    assert_eq!(acks(&a1, &x), vec![(1, true)]);
    assert!(reports(&a1).is_empty(), "one update in a buffer of two");
    let refill = dispatched(&a1);
    assert_eq!(refill.len(), 1, "the freed slot goes to the idle client");
    assert_ne!(refill[0].0, x, "a client does not train twice on the same version");
    e.handle_message(secs(2), &y, update(1, &[4.0, 4.0], 1));
    let a2 = drain(&mut e);
    let r = reports(&a2);
    assert_eq!((r.len(), r[0].round), (1, 1), "two buffered updates make version 1");
    assert_eq!(e.global()[0].decode().unwrap(), vec![3.0, 3.0]);
    assert!(
        dispatched(&a2).iter().any(|(c, round)| (c == &x || c == &y) && *round == 2),
        "freed clients train on version 1"
    );
    // z trained on version 0 and arrives after version 1: staleness 1, rebased and down-weighted.
    e.handle_message(secs(3), &z, update(1, &[0.0, 0.0], 1));
    let a3 = drain(&mut e);
    assert_eq!(acks(&a3, &z), vec![(1, true)]);
    assert_eq!(e.last_round(), 1);
}

/// A device whose update waits in the buffer trains again only on the next version: it is
/// counted once in a version (the swarm's seeds 482, 495, 623 and 804 counted one twice). When
/// nobody is left to fill the buffer, it forms a short version.
#[test]
fn a_buffered_device_is_counted_once_in_a_version() {
    let mut e = engine(buffered(2, 3, 5));
    let first = dispatched(&join(&mut e, secs(0), &["a", "b", "c"]));
    assert_eq!(first.len(), 3);
    let (x, y, z) = (first[0].0.clone(), first[1].0.clone(), first[2].0.clone());
    e.handle_message(secs(1), &x, update(1, &[2.0, 2.0], 1));
    e.handle_message(secs(2), &y, update(1, &[4.0, 4.0], 1));
    assert_eq!(reports(&drain(&mut e)).len(), 1, "version 1 from x and y");
    // z trained on version 0: its update waits in the buffer, and z is not sent version 1.
    e.handle_message(secs(3), &z, update(1, &[0.0, 0.0], 1));
    let a3 = drain(&mut e);
    assert_eq!(acks(&a3, &z), vec![(1, true)]);
    assert!(!dispatched(&a3).iter().any(|(c, _)| c == &z), "z is in the buffer: {:?}", dispatched(&a3));
    e.handle_message(secs(4), &x, update(2, &[1.0, 1.0], 1));
    let a4 = drain(&mut e);
    let version = reports(&a4);
    assert_eq!(version.len(), 1, "version 2 from z's and x's");
    let counted: Vec<&str> = version[0].updates.iter().map(|u| u.client.as_str()).collect();
    assert_eq!(counted.len(), 2);
    assert!(counted.contains(&z.as_str()) && counted.contains(&x.as_str()), "{counted:?}");
    assert!(dispatched(&a4).iter().any(|(c, round)| c == &z && *round == 3), "z trains on version 2");

    // A buffer of three and two devices: once both wait in it, it forms a short version.
    let mut e = engine(buffered(3, 2, 5));
    let first = dispatched(&join(&mut e, secs(0), &["a", "b"]));
    e.handle_message(secs(1), &first[0].0, update(1, &[2.0, 2.0], 1));
    assert!(reports(&drain(&mut e)).is_empty());
    e.handle_message(secs(2), &first[1].0, update(1, &[4.0, 4.0], 1));
    let a2 = drain(&mut e);
    let version = reports(&a2);
    assert_eq!((version.len(), version[0].updates.len()), (1, 2), "a short version of two");
    assert_eq!(dispatched(&a2).len(), 2, "both train on version 1");
}

/// A device dispatched to train on version 0 that answers with round 0 (no training's round)
/// is refused, not taken for version 0's update (whose rebase would read version −1).
#[test]
fn buffered_mode_refuses_an_update_for_round_zero() {
    let mut e = engine(buffered(2, 3, 5));
    let actions = join(&mut e, secs(0), &["a", "b", "c"]);
    let first = dispatched(&actions);
    let (x, y) = (first[0].0.clone(), first[1].0.clone());
    e.handle_message(secs(1), &x, update(0, &[2.0, 2.0], 1));
    let a1 = drain(&mut e);
    assert_eq!(refusals(&a1, &x), vec![RefusalReason::Malformed]);
    assert!(acks(&a1, &x).is_empty());
    // x's real update still counts, and the buffer fills as usual.
    e.handle_message(secs(2), &x, update(1, &[2.0, 2.0], 1));
    e.handle_message(secs(2), &y, update(1, &[4.0, 4.0], 1));
    let r = reports(&drain(&mut e));
    assert_eq!((r.len(), r[0].round), (1, 1), "version 1 from the two round-1 updates");
}

#[test]
fn buffered_mode_counts_too_stale_updates_and_frees_expired_slots() {
    let mut e = engine(EngineConfig { round_deadline: secs(5), ..buffered(1, 2, 0) });
    let first = dispatched(&join(&mut e, secs(0), &["a", "b"]));
    let (x, y) = (first[0].0.clone(), first[1].0.clone());
    e.handle_message(secs(1), &x, update(1, &[1.0, 1.0], 1));
    assert_eq!(reports(&drain(&mut e)).len(), 1, "buffer of one: version 1 at once");
    // y trained on version 0; with max staleness 0 its update is counted, not used.
    e.handle_message(secs(2), &y, update(1, &[50.0, 50.0], 1));
    assert_eq!(acks(&drain(&mut e), &y), vec![(1, false)]);
    assert_eq!(e.stats().late_updates, 1);
    assert_eq!(e.global()[0].decode().unwrap(), vec![1.0, 1.0]);
    // Whoever is training on version 1 now and stays silent loses its slot at the deadline.
    assert!(e.poll_timeout().is_some());
    let dropped_before = e.stats().dropped;
    e.handle_timeout(secs(30));
    assert!(e.stats().dropped > dropped_before);
}

#[test]
fn buffered_mode_makes_no_version_past_the_last() {
    // One version, a buffer of one, two clients training: the second update arrives after the
    // federation finished and must not make a version 2.
    let mut e = engine(EngineConfig { rounds: 1, ..buffered(1, 2, 5) });
    let first = dispatched(&join(&mut e, secs(0), &["a", "b"]));
    let (x, y) = (first[0].0.clone(), first[1].0.clone());
    e.handle_message(secs(1), &x, update(1, &[1.0, 1.0], 1));
    let a1 = drain(&mut e);
    assert_eq!(reports(&a1).len(), 1);
    assert!(a1.iter().any(|a| matches!(a, Action::Finished)));
    e.handle_message(secs(2), &y, update(1, &[9.0, 9.0], 1));
    let a2 = drain(&mut e);
    assert!(reports(&a2).is_empty(), "no version after the last");
    assert_eq!(acks(&a2, &y), vec![(1, false)]);
    assert_eq!((e.last_round(), e.global()[0].decode().unwrap()), (1, vec![1.0, 1.0]));
}

#[test]
fn the_aggregation_mode_reads_from_toml() {
    let c: EngineConfig =
        toml::from_str("rounds = 5\n[mode]\nkind = \"buffered\"\nbuffer = 4\nconcurrency = 8\nmax_staleness = 3\n")
            .unwrap();
    assert_eq!(c.mode, AggregationMode::Buffered { buffer: 4, concurrency: 8, max_staleness: 3 });
    let d: EngineConfig = toml::from_str("rounds = 5\n").unwrap();
    assert_eq!(d.mode, AggregationMode::Synchronous);
    assert!(toml::from_str::<EngineConfig>("[mode]\nkind = \"buffered\"\nbufer = 4\n").is_err(), "typos are errors");
}

/// What a store would hold after committing every `Persist` of `actions` (the shell's part,
/// without the database): the newest checkpoint, the open round, the accepted updates since.
fn replay_into(recovered: &mut Recovered, actions: &[Action]) {
    for a in actions {
        match a {
            Action::Persist(Persist::Opened(o)) => recovered.open = Some(o.clone()),
            Action::Persist(Persist::Accepted(u)) => recovered.pending.push((**u).clone()),
            Action::Persist(Persist::Closed { checkpoint, .. }) => {
                recovered.last_accepted = recovered.pending.drain(..).map(|p| p.client).collect();
                recovered.checkpoint = (**checkpoint).clone();
                recovered.open = None;
            }
            _ => {}
        }
    }
}

#[test]
fn every_ack_and_broadcast_follows_the_commit_it_depends_on() {
    let mut e = engine(config(2, 2));
    let actions = join(&mut e, secs(0), &["a", "b"]);
    let opened = actions.iter().position(|a| matches!(a, Action::Persist(Persist::Opened(_)))).unwrap();
    let broadcast = actions.iter().position(|a| matches!(a, Action::Broadcast { .. })).unwrap();
    assert!(opened < broadcast, "the invitations are durable before the broadcast");
    e.handle_message(secs(1), "a", update(1, &[1.0, 2.0], 1));
    let actions = drain(&mut e);
    let accepted = actions.iter().position(|a| matches!(a, Action::Persist(Persist::Accepted(u)) if u.client == "a"));
    let ack = actions.iter().position(|a| matches!(a, Action::Send { msg: Message::Ack(_), .. }));
    assert!(matches!((accepted, ack), (Some(p), Some(k)) if p < k), "ack after commit: {actions:?}");
}

#[test]
fn a_crash_mid_round_resumes_the_round_with_its_acked_updates() {
    let mut e = engine(EngineConfig { rounds: 5, ..config(3, 3) });
    let mut stored = Recovered {
        checkpoint: e.checkpoint(),
        open: None,
        pending: vec![],
        last_accepted: vec![],
        round_floor: 0,
        invitations: vec![],
        privacy: None,
    };
    replay_into(&mut stored, &join(&mut e, secs(0), &["a", "b", "c"]));
    e.handle_message(secs(1), "a", update(1, &[1.0, 1.0], 1));
    e.handle_message(secs(1), "b", update(1, &[3.0, 3.0], 1));
    replay_into(&mut stored, &drain(&mut e));
    // kill -9: only what was committed is left.
    let mut resumed =
        Engine::recover(EngineConfig { rounds: 5, ..config(3, 3) }, Box::new(FedAvg::default()), stored.clone());
    assert_eq!(resumed.open_round(), Some(1), "the same round, not a new one");
    let actions = join(&mut resumed, secs(0), &["a", "b", "c"]);
    assert_eq!(broadcast_targets(&actions), vec![vec!["c".to_string()]], "only c still owes an update");
    // a resends its acked update: a duplicate, acked again, never NotSampled.
    resumed.handle_message(secs(1), "a", update(1, &[1.0, 1.0], 1));
    let actions = drain(&mut resumed);
    assert_eq!((acks(&actions, "a"), refusals(&actions, "a")), (vec![(1, true)], vec![]));
    assert_eq!(resumed.stats().duplicate_updates, 1);
    resumed.handle_message(secs(2), "c", update(1, &[5.0, 5.0], 1));
    let r = reports(&drain(&mut resumed));
    assert_eq!(r.len(), 1);
    let clients: Vec<&str> = r[0].updates.iter().map(|u| u.client.as_str()).collect();
    assert_eq!(clients, ["a", "b", "c"], "the round closes with every update acked before the crash");
    assert_eq!(resumed.global()[0].decode().unwrap(), vec![3.0, 3.0]);
}

#[test]
fn a_recovered_round_that_holds_its_target_closes_at_once() {
    let mut e = engine(config(2, 2));
    let mut stored = Recovered {
        checkpoint: e.checkpoint(),
        open: None,
        pending: vec![],
        last_accepted: vec![],
        round_floor: 0,
        invitations: vec![],
        privacy: None,
    };
    replay_into(&mut stored, &join(&mut e, secs(0), &["a", "b"]));
    e.handle_message(secs(1), "a", update(1, &[1.0, 1.0], 1));
    e.handle_message(secs(1), "b", update(1, &[3.0, 3.0], 1));
    // The crash came after both accepts were committed but before the close was.
    let actions = drain(&mut e);
    let before_close = actions.iter().position(|a| matches!(a, Action::Persist(Persist::Closed { .. }))).unwrap();
    replay_into(&mut stored, &actions[..before_close]);
    let mut resumed = Engine::recover(config(2, 2), Box::new(FedAvg::default()), stored);
    let r = reports(&drain(&mut resumed));
    assert_eq!((r.len(), r[0].round, r[0].updates.len()), (1, 1, 2));
    assert_eq!(resumed.last_round(), 1);
    // After the close, a resend of an aggregated update is a duplicate, not a late update.
    join(&mut resumed, secs(0), &["a", "b"]);
    resumed.handle_message(secs(1), "a", update(1, &[1.0, 1.0], 1));
    assert_eq!(acks(&drain(&mut resumed), "a"), vec![(1, true)]);
    assert_eq!((resumed.stats().duplicate_updates, resumed.stats().late_updates), (1, 0));
}

#[test]
fn a_buffered_engine_restores_its_accepted_updates() {
    let mode = AggregationMode::Buffered { buffer: 2, concurrency: 2, max_staleness: 2 };
    let cfg = || EngineConfig { mode: mode.clone(), rounds: 3, ..config(2, 2) };
    let mut e = engine(cfg());
    let mut stored = Recovered {
        checkpoint: e.checkpoint(),
        open: None,
        pending: vec![],
        last_accepted: vec![],
        round_floor: 0,
        invitations: vec![],
        privacy: None,
    };
    replay_into(&mut stored, &join(&mut e, secs(0), &["a", "b"]));
    e.handle_message(secs(1), "a", update(1, &[2.0, 2.0], 1));
    replay_into(&mut stored, &drain(&mut e));
    assert_eq!(stored.pending.len(), 1, "the accepted update was committed");
    let mut resumed = Engine::recover(cfg(), Box::new(FedAvg::default()), stored);
    join(&mut resumed, secs(0), &["a", "b"]);
    resumed.handle_message(secs(1), "b", update(1, &[4.0, 4.0], 1));
    let r = reports(&drain(&mut resumed));
    assert_eq!(r.len(), 1, "a's update from before the crash fills the buffer with b's");
    assert_eq!(resumed.global()[0].decode().unwrap(), vec![3.0, 3.0]);
}

// Screening and robust aggregation (`[engine.robust]`): no single update can break the model.

fn robust(robust: crate::aggregate::RobustConfig, clients: usize) -> EngineConfig {
    EngineConfig { robust, rounds: 5, ..config(clients, clients) }
}

#[test]
fn a_nan_or_huge_update_is_refused_and_the_next_honest_round_aggregates() {
    use crate::aggregate::RobustConfig;
    // The default screening: finite values within max_abs_value (1e6), nothing else.
    let mut e = engine(robust(RobustConfig::default(), 3));
    join(&mut e, secs(0), &["a", "b", "c"]);
    e.handle_message(secs(1), "a", update(1, &[f32::NAN, 0.0], 10));
    e.handle_message(secs(1), "b", update(1, &[1e30, 1e30], 1_000_000_000_000_000_000));
    e.handle_message(secs(1), "c", update(1, &[1.0, 3.0], 10));
    let actions = drain(&mut e);
    assert_eq!(refusals(&actions, "a"), vec![RefusalReason::BadTensor], "non-finite: refused, never acked");
    assert_eq!(refusals(&actions, "b"), vec![RefusalReason::BadTensor], "beyond max_abs_value: refused");
    assert!(acks(&actions, "a").is_empty() && acks(&actions, "b").is_empty());
    e.handle_timeout(secs(11));
    let r = reports(&drain(&mut e));
    assert_eq!(r[0].outcome, RoundOutcome::Aggregated);
    assert_eq!(r[0].updates.len(), 1);
    assert_eq!(e.global()[0].decode().unwrap(), vec![1.0, 3.0], "only the honest update");
    // Round 2: every device is honest, and every update aggregates.
    for (c, v) in [("a", 2.0), ("b", 3.0), ("c", 4.0)] {
        e.handle_message(secs(12), c, update(2, &[v, v], 10));
    }
    let actions = drain(&mut e);
    assert_eq!(acks(&actions, "a"), vec![(2, true)]);
    let r = reports(&actions);
    assert_eq!((r[0].round, &r[0].outcome, r[0].updates.len()), (2, &RoundOutcome::Aggregated, 3));
    assert_eq!(e.global()[0].decode().unwrap(), vec![3.0, 3.0]);
}

#[test]
fn a_late_update_is_acked_not_aggregated_only_if_its_values_pass_the_screen() {
    use crate::aggregate::RobustConfig;
    let mut e = engine(robust(RobustConfig::default(), 2));
    join(&mut e, secs(0), &["a", "b", "c"]);
    e.handle_message(secs(1), "a", update(1, &[1.0, 1.0], 10));
    e.handle_message(secs(1), "b", update(1, &[2.0, 2.0], 10));
    let r = reports(&drain(&mut e));
    assert_eq!((r[0].round, &r[0].outcome), (1, &RoundOutcome::Aggregated), "round 1 closed on two updates");
    // Round 1 is closed: c's garbage arrives late.
    e.handle_message(secs(2), "c", update(1, &[1e30, 1e30], 10));
    let actions = drain(&mut e);
    assert_eq!(refusals(&actions, "c"), vec![RefusalReason::BadTensor], "late garbage is refused");
    assert!(acks(&actions, "c").is_empty(), "an ack never covers values the screen refuses");
    e.handle_message(secs(2), "c", update(1, &[1.5, 1.5], 10));
    assert_eq!(acks(&drain(&mut e), "c"), vec![(1, false)], "a sane late update: acked, not aggregated");
}

#[test]
fn a_huge_update_with_a_huge_sample_count_is_bounded_in_the_aggregate_it_was_acked_into() {
    use crate::aggregate::RobustConfig;
    let mut e = engine(robust(RobustConfig { max_norm_z: Some(3.5), ..RobustConfig::default() }, 5));
    join(&mut e, secs(0), &["a", "b", "c", "d", "x"]);
    for (c, v) in [("a", 1.0), ("b", 1.1), ("c", 0.9), ("d", 1.0)] {
        e.handle_message(secs(1), c, update(1, &[v, v], 10));
    }
    e.handle_message(secs(1), "x", update(1, &[5e5, -5e5], 1_000_000_000_000_000_000));
    let actions = drain(&mut e);
    assert_eq!(acks(&actions, "x"), vec![(1, true)], "within max_abs_value and no max_norm: accepted");
    let r = reports(&actions);
    assert_eq!(r[0].outcome, RoundOutcome::Aggregated);
    assert_eq!(r[0].updates.len(), 5, "an acked update is in the aggregate");
    assert_eq!(r[0].refused, 0);
    assert_eq!(r[0].influence.weight_clipped, vec!["x"]);
    assert_eq!(r[0].influence.norm_clipped, vec!["x"]);
    // Norms √2·{1, 1.1, 0.9, 1, 5e5}: median 1.414, MAD 0.1414 → the z bound 1.414 + 3.5·0.1414/0.6745
    // = 2.148 (under norm_cap's 2.83); x is scaled to (1.519, −1.519) and weighs the median 10:
    // (40 + 15.19)/50 = 1.104 and (40 − 15.19)/50 = 0.496.
    let global = e.global()[0].decode().unwrap();
    assert!((global[0] - 1.104).abs() < 1e-3 && (global[1] - 0.496).abs() < 1e-3, "{global:?}");
}

#[test]
fn claimed_sample_counts_are_capped_and_the_median_ignores_them() {
    use crate::aggregate::{AggregationRule, RobustConfig};
    // Mean with max_samples 100: (100·10 + 10·1 + 10·1)/120 = 1020/120 = 8.5 (uncapped: ≈ 10).
    let mut e = engine(robust(RobustConfig { max_samples: 100, ..RobustConfig::unbounded() }, 3));
    join(&mut e, secs(0), &["a", "b", "x"]);
    e.handle_message(secs(1), "a", update(1, &[1.0, 1.0], 10));
    e.handle_message(secs(1), "b", update(1, &[1.0, 1.0], 10));
    e.handle_message(secs(1), "x", update(1, &[10.0, 10.0], 1_000_000_000_000_000_000));
    let r = reports(&drain(&mut e));
    assert_eq!(r[0].updates.iter().find(|u| u.client == "x").unwrap().num_samples, 100);
    assert_eq!(e.global()[0].decode().unwrap(), vec![8.5, 8.5]);
    // The median: {1, 1, 1e5} → 1, whatever x claims.
    let rule = RobustConfig { aggregation: AggregationRule::Median, ..RobustConfig::unbounded() };
    let mut e = engine(robust(rule, 3));
    join(&mut e, secs(0), &["a", "b", "x"]);
    e.handle_message(secs(1), "a", update(1, &[1.0, 1.0], 10));
    e.handle_message(secs(1), "b", update(1, &[1.0, 1.0], 10));
    e.handle_message(secs(1), "x", update(1, &[1e5, 1e5], 1_000_000_000_000_000_000));
    let actions = drain(&mut e);
    assert_eq!(acks(&actions, "x"), vec![(1, true)]);
    assert_eq!(e.global()[0].decode().unwrap(), vec![1.0, 1.0]);
}

#[test]
fn buffered_mode_screens_updates_too() {
    use crate::aggregate::RobustConfig;
    let mode = AggregationMode::Buffered { buffer: 2, concurrency: 3, max_staleness: 2 };
    let robust = RobustConfig { max_norm: Some(100.0), ..RobustConfig::default() };
    let mut e = engine(EngineConfig { mode, robust, rounds: 3, ..config(3, 3) });
    join(&mut e, secs(0), &["a", "b", "x"]);
    e.handle_message(secs(1), "x", update(1, &[1e30, 1e30], 10));
    assert_eq!(refusals(&drain(&mut e), "x"), vec![RefusalReason::BadTensor]);
    e.handle_message(secs(1), "a", update(1, &[2.0, 2.0], 1));
    e.handle_message(secs(1), "b", update(1, &[4.0, 4.0], 1));
    let r = reports(&drain(&mut e));
    assert_eq!((r.len(), r[0].updates.len()), (1, 2));
    assert_eq!(e.global()[0].decode().unwrap(), vec![3.0, 3.0]);
}

#[test]
fn the_robust_table_reads_from_toml() {
    use crate::aggregate::AggregationRule;
    let c: EngineConfig = toml::from_str(
        "rounds = 3\n[robust]\nmax_norm_z = 3.5\nmax_samples = 5000\n[robust.aggregation]\nrule = \"krum\"\nbyzantine = 2\nselect = 4\n",
    )
    .unwrap();
    assert_eq!(c.robust.aggregation, AggregationRule::Krum { byzantine: 2, select: 4 });
    assert_eq!((c.robust.max_norm_z, c.robust.max_samples, c.robust.max_norm), (Some(3.5), 5000, None));
    assert_eq!(c.round_info(1).rule, AggregationRule::Krum { byzantine: 2, select: 4 });
    let d: EngineConfig = toml::from_str("rounds = 3\n").unwrap();
    assert_eq!(d.robust, crate::aggregate::RobustConfig::default());
}

#[test]
fn the_layout_is_the_operators_never_the_first_updates() {
    // No initial model: the first update may not fix the layout (a stranger answering round 1
    // first would otherwise lock every honest device out with a shape mismatch).
    let mut e = Engine::new(config(1, 1), Box::new(FedAvg::default()), Vec::new());
    join(&mut e, secs(0), &["a"]);
    e.handle_message(secs(1), "a", update(1, &[1.0, 2.0, 3.0], 1));
    assert_eq!(refusals(&drain(&mut e), "a"), vec![RefusalReason::ShapeMismatch]);
    assert!(e.global().is_empty());
    // With the operator's model, an update of another layout is refused and the right one taken.
    let mut e = engine(config(2, 2));
    join(&mut e, secs(0), &["stranger", "honest"]);
    e.handle_message(secs(1), "stranger", update(1, &[1.0, 2.0, 3.0], 1));
    assert_eq!(refusals(&drain(&mut e), "stranger"), vec![RefusalReason::ShapeMismatch]);
    e.handle_message(secs(1), "honest", update(1, &[1.0, 2.0], 1));
    assert_eq!(acks(&drain(&mut e), "honest"), vec![(1, true)]);
}

/// Honest clients on a quadratic: client i pulls the model towards its own optimum θ_i (non-IID)
/// with noise, holds its own sample count, and sends w + lr·(θ_i − w) + noise each round. Under the
/// shipped `[engine.robust]` (the defaults plus `max_norm_z = 3.5`) every update of every round is
/// acked as aggregated and is in the round's aggregate: nobody honest is screened out, whatever
/// the federation's size.
#[test]
fn no_honest_update_is_screened_out_of_a_clean_federation_of_3_to_100_over_200_rounds() {
    const DIM: usize = 512;
    const ROUNDS: u64 = 200;
    for n in [3usize, 5, 10, 100] {
        let mut rng = anchorage_shared::rng::Rng::new(7 + n as u64);
        let optima: Vec<Vec<f32>> = (0..n).map(|_| (0..DIM).map(|_| rng.f32() * 2.0 - 1.0).collect()).collect();
        let samples: Vec<u64> = (0..n).map(|_| 100 + rng.below(1900)).collect();
        let robust = crate::aggregate::RobustConfig { max_norm_z: Some(3.5), ..Default::default() };
        let config = EngineConfig { rounds: ROUNDS, min_available: n, min_fit: n, robust, ..config(n, n) };
        let mut e = Engine::new(config, Box::new(FedAvg::default()), vec![block(&[0.0; DIM])]);
        let ids: Vec<String> = (0..n).map(|i| format!("c{i}")).collect();
        let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
        let mut actions = join(&mut e, secs(0), &id_refs);
        let (mut acked, mut aggregated, mut clipped) = (0usize, 0usize, 0usize);
        for round in 1..=ROUNDS {
            let global = match actions.iter().find_map(|a| match a {
                Action::Broadcast { msg, .. } => match msg.as_ref() {
                    Message::Broadcast(b) => Some(b.blocks[0].decode().unwrap()),
                    _ => None,
                },
                _ => None,
            }) {
                Some(g) => g,
                None => panic!("n = {n}: round {round} was not broadcast"),
            };
            let now = secs(round);
            let mut round_actions = Vec::new();
            for (i, id) in ids.iter().enumerate() {
                let values: Vec<f32> = global
                    .iter()
                    .zip(&optima[i])
                    .map(|(&w, &t)| w + 0.3 * (t - w) + 0.02 * (rng.f32() - 0.5))
                    .collect();
                e.handle_message(now, id, update(round, &values, samples[i]));
                round_actions.extend(drain(&mut e));
            }
            for id in &ids {
                assert!(refusals(&round_actions, id).is_empty(), "n = {n}, round {round}: {id} refused");
                acked += acks(&round_actions, id).iter().filter(|a| **a == (round, true)).count();
            }
            let report = reports(&round_actions).pop().expect("the round closed");
            assert_eq!(report.outcome, RoundOutcome::Aggregated);
            assert_eq!(report.refused, 0, "n = {n}, round {round}");
            aggregated += report.updates.len();
            clipped += report.influence.norm_clipped.len();
            if n < crate::aggregate::MIN_Z_UPDATES {
                assert!(report.influence.skipped.iter().any(|s| s.starts_with("max_norm_z")), "{:?}", report.influence);
            }
            actions = round_actions;
        }
        println!("n = {n}: {acked} acked aggregated, {aggregated} in aggregates, {clipped} norm-clipped");
        assert_eq!(acked, n * ROUNDS as usize);
        assert_eq!(aggregated, n * ROUNDS as usize);
    }
}

fn hello_at(id: &str, last_round: u64) -> Message {
    let Message::Hello(mut h) = hello(id) else { unreachable!() };
    h.last_round = Some(last_round);
    Message::Hello(h)
}

/// The devices' last rounds witness what the server announced: after its store lost rounds,
/// devices that trained round 24 stop new rounds (two of them: one hostile device alone cannot
/// halt the federation with a made-up number, it only raises the alarm).
#[test]
fn devices_that_trained_rounds_the_store_never_saw_stop_new_rounds() {
    let mut e = engine(config(3, 3));
    e.handle_message(secs(0), "a", hello_at("a", 24));
    e.handle_message(secs(0), "b", hello("b"));
    e.handle_message(secs(0), "c", hello("c"));
    drain(&mut e);
    assert_eq!(e.devices_ahead(), 1);
    assert_eq!(e.rollback_suspected(), None, "one device alone raises the alarm, no more");
    assert_eq!(e.open_round(), Some(1), "and rounds go on");

    let mut e = engine(config(3, 3));
    e.handle_message(secs(0), "a", hello_at("a", 24));
    e.handle_message(secs(0), "b", hello_at("b", 23));
    e.handle_message(secs(0), "c", hello("c"));
    let actions = drain(&mut e);
    assert_eq!(e.rollback_suspected(), Some((2, 24)));
    assert!(broadcast_targets(&actions).is_empty(), "no round opens until the operator decides");
    assert_eq!(e.open_round(), None);
    // A device at the server's own round is no evidence.
    let mut e = engine(config(2, 2));
    e.handle_message(secs(0), "a", hello_at("a", 1));
    e.handle_message(secs(0), "b", hello_at("b", 1));
    drain(&mut e);
    assert_eq!((e.devices_ahead(), e.open_round()), (0, Some(1)));
}

/// After an accepted rollback the engine resumes the restored model and numbers rounds above
/// every round ever announced.
#[test]
fn after_an_accepted_rollback_round_numbers_are_not_reused() {
    let e = engine(config(2, 2));
    let stored = Recovered {
        checkpoint: e.checkpoint(),
        open: None,
        pending: vec![],
        last_accepted: vec![],
        round_floor: 26,
        invitations: vec![],
        privacy: None,
    };
    let mut e = Engine::recover(config(2, 2), Box::new(FedAvg::default()), stored);
    e.handle_message(secs(0), "a", hello_at("a", 26));
    e.handle_message(secs(0), "b", hello_at("b", 25));
    drain(&mut e);
    assert_eq!(e.rollback_suspected(), None);
    assert_eq!(e.open_round(), Some(27));
}

fn cost_acks(actions: &[Action], client: &str) -> Vec<u64> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { to, msg: Message::CostAck(c) } if to == client => Some(c.round),
            _ => None,
        })
        .collect()
}

/// A cost record is confirmed after the ledger append is queued; a resend (the confirmation was
/// lost, or the server restarted before committing) is confirmed again, once in the ledger.
#[test]
fn cost_records_are_confirmed_and_a_restarted_engine_confirms_resends() {
    let mut e = engine(config(2, 2));
    join(&mut e, secs(0), &["a", "b"]);
    e.handle_message(secs(1), "a", update(1, &[1.0, 1.0], 1));
    e.handle_message(secs(1), "b", update(1, &[1.0, 1.0], 1));
    drain(&mut e);
    let record = CostRecord { round: 1, wire_up: 100, ..CostRecord::default() };
    e.handle_message(secs(2), "a", Message::Cost(record.clone()));
    let actions = drain(&mut e);
    let ledger = actions.iter().position(|a| matches!(a, Action::Ledger(_))).expect("into the ledger");
    let ack = actions.iter().position(|a| matches!(a, Action::Send { msg: Message::CostAck(_), .. })).unwrap();
    assert!(ledger < ack, "committed before confirmed");
    e.handle_message(secs(3), "a", Message::Cost(record.clone()));
    let actions = drain(&mut e);
    assert_eq!(cost_acks(&actions, "a"), vec![1], "a resend is confirmed again");
    assert!(!actions.iter().any(|a| matches!(a, Action::Ledger(_))), "and not written twice");

    // After a restart the engine knows the last rounds' invitations from the store: b's record,
    // sent before the crash and never committed, is taken when b resends it.
    let stored = Recovered {
        checkpoint: e.checkpoint(),
        open: None,
        pending: vec![],
        last_accepted: vec![],
        round_floor: 0,
        invitations: vec![(1, vec!["a".into(), "b".into()], vec!["a".into()])],
        privacy: None,
    };
    let mut e = Engine::recover(config(2, 2), Box::new(FedAvg::default()), stored);
    e.handle_message(secs(0), "b", hello("b"));
    e.handle_message(secs(0), "b", Message::Cost(record.clone()));
    let actions = drain(&mut e);
    assert!(actions.iter().any(|a| matches!(a, Action::Ledger(r) if r.client == "b" && r.round == 1)));
    assert_eq!(cost_acks(&actions, "b"), vec![1]);
    e.handle_message(secs(0), "a", hello("a"));
    e.handle_message(secs(0), "a", Message::Cost(record));
    let actions = drain(&mut e);
    assert!(!actions.iter().any(|a| matches!(a, Action::Ledger(_))), "a's record is already in the ledger");
    assert_eq!(cost_acks(&actions, "a"), vec![1]);
}

/// A cost record beyond physical ranges (joules = 1e300, for one) is dropped and counted, never
/// written: it never reaches anchorage_client_energy_joules_total.
#[test]
fn cost_records_beyond_physical_ranges_are_dropped_and_counted() {
    let mut e = engine(config(2, 2));
    join(&mut e, secs(0), &["a", "b"]);
    for bad in [
        CostRecord { round: 1, joules: 1e300, ..CostRecord::default() },
        CostRecord { round: 1, wall_seconds: 1e9, ..CostRecord::default() },
        CostRecord { round: 1, rtt_seconds: 1e6, ..CostRecord::default() },
    ] {
        e.handle_message(secs(1), "a", Message::Cost(bad));
    }
    let actions = drain(&mut e);
    assert!(!actions.iter().any(|a| matches!(a, Action::Ledger(_))), "none is written");
    assert!(cost_acks(&actions, "a").is_empty(), "none is confirmed");
    assert_eq!(e.stats().dropped_cost_records, 3);
    e.handle_message(secs(1), "a", Message::Cost(CostRecord { round: 1, joules: 12.5, ..CostRecord::default() }));
    assert!(drain(&mut e).iter().any(|a| matches!(a, Action::Ledger(r) if r.joules == 12.5)), "a real one is");
}

#[test]
fn a_federation_resumed_after_its_last_round_says_it_is_finished_at_once() {
    let mut e = engine(EngineConfig { rounds: 1, ..config(1, 1) });
    join(&mut e, secs(0), &["a"]);
    e.handle_message(secs(1), "a", update(1, &[1.0, 1.0], 1));
    let checkpoint = drain(&mut e)
        .into_iter()
        .find_map(|a| match a {
            Action::Persist(Persist::Closed { checkpoint, .. }) => Some(checkpoint),
            _ => None,
        })
        .expect("round 1 closed");
    // Restarted on its state: the owner hears that the run is over before anyone connects
    // (before, the engine said nothing and its owner listened for rounds that never came).
    let mut done =
        Engine::resume(EngineConfig { rounds: 1, ..config(1, 1) }, Box::new(FedAvg::default()), (*checkpoint).clone());
    assert!(done.is_finished());
    assert!(matches!(drain(&mut done).as_slice(), [Action::Finished]));
    // A device that connects is told so.
    let actions = join(&mut done, secs(0), &["a"]);
    assert!(actions.iter().any(|a| matches!(a, Action::Send { msg: Message::Goodbye(_), .. })), "{actions:?}");
    assert!(broadcast_targets(&actions).is_empty());
    // With more rounds configured it is not finished, and says nothing of the kind.
    let mut more =
        Engine::resume(EngineConfig { rounds: 2, ..config(1, 1) }, Box::new(FedAvg::default()), (*checkpoint).clone());
    assert!(drain(&mut more).is_empty());
}

#[test]
fn a_round_report_carries_the_devices_own_evaluation_and_who_was_missing() {
    let mut e = engine(EngineConfig { min_updates: 1, ..config(3, 3) });
    join(&mut e, secs(0), &["a", "b", "c"]);
    let evaluated = |round, values: &[f32], n, accuracy: Option<f64>| {
        let Message::Update(mut u) = update(round, values, n) else { unreachable!() };
        u.metrics = accuracy
            .iter()
            .map(|a| anchorage_shared::protocol::Metric { name: "local_accuracy".into(), value: *a })
            .collect();
        Message::Update(u)
    };
    e.handle_message(secs(1), "a", evaluated(1, &[1.0, 1.0], 100, Some(0.5)));
    e.handle_message(secs(2), "b", evaluated(1, &[1.0, 1.0], 300, Some(0.9)));
    drain(&mut e);
    // c never answers: the round closes at its deadline without it.
    e.handle_timeout(secs(0) + DEADLINE);
    let r = reports(&drain(&mut e)).pop().expect("the round closed at its deadline");
    assert_eq!(r.outcome, RoundOutcome::Aggregated);
    assert_eq!((r.sampled, r.target, r.updates.len()), (3, 3, 2));
    assert_eq!(r.missing, vec!["c".to_string()]);
    let (accuracy, reporting) = r.device_accuracy().expect("two devices reported their accuracy");
    assert!((accuracy - 0.8).abs() < 1e-9 && reporting == 2, "{accuracy} from {reporting}");
    assert_eq!(r.held_out_accuracy, None, "the engine does not evaluate: its owner does");
}

/// `compact` moves the per-device state to fresh allocations and changes nothing the engine
/// does: the same round closes the same way with and without a compaction in the middle.
#[test]
fn compacting_changes_nothing_the_engine_does() {
    let run = |compact: bool| {
        let mut e = engine(config(2, 2));
        join(&mut e, secs(0), &["a", "b", "c"]);
        e.handle_message(secs(1), "a", update(1, &[1.0, 2.0], 1));
        e.handle_disconnect(secs(1), "c");
        if compact {
            e.compact();
        }
        let mut actions = drain(&mut e);
        e.handle_message(secs(2), "b", update(1, &[5.0, 6.0], 3));
        e.handle_message(
            secs(3),
            "a",
            Message::Cost(CostRecord { client: "a".into(), round: 1, ..Default::default() }),
        );
        actions.extend(drain(&mut e));
        (format!("{actions:?}"), e.global()[0].decode().unwrap(), e.open_round(), e.stats().dropped_cost_records)
    };
    assert_eq!(run(true), run(false));
}

fn decline(round: u64, reason: anchorage_shared::ledger::DeclineReason) -> Message {
    Message::Decline(anchorage_shared::protocol::Decline { round, reason, detail: "test".into() })
}

/// A decline is recorded as such, never as a drop; a free device is invited in its
/// place (persisted first), and the round reaches its target with it.
#[test]
fn a_decline_is_replaced_by_another_invitation_and_is_not_a_drop() {
    use anchorage_shared::ledger::DeclineReason;
    let mut e = engine(EngineConfig { fraction: 0.5, ..config(4, 2) });
    let actions = join(&mut e, secs(0), &["a", "b", "c", "d"]);
    let invited: BTreeSet<ClientId> = broadcast_targets(&actions).concat().into_iter().collect();
    assert_eq!(invited.len(), 2, "half of four");
    let mut invited = invited.into_iter();
    let (decliner, stayer) = (invited.next().unwrap(), invited.next().unwrap());
    e.handle_message(secs(1), &decliner, decline(1, DeclineReason::Thermal));
    let actions = drain(&mut e);
    let replacement = match broadcast_targets(&actions).as_slice() {
        [one] if one.len() == 1 => one[0].clone(),
        other => panic!("expected one new invitation, got {other:?}"),
    };
    assert!(replacement != decliner && replacement != stayer);
    let persisted_first = actions.iter().position(|a| matches!(a, Action::Persist(Persist::Invited { .. })));
    let broadcast_at = actions.iter().position(|a| matches!(a, Action::Broadcast { .. }));
    assert!(persisted_first < broadcast_at && persisted_first.is_some(), "the invitation is durable first");
    let declined = ledger(&actions);
    assert_eq!(declined.len(), 1);
    assert_eq!((declined[0].declined, declined[0].dropped), (Some(DeclineReason::Thermal), false));
    // A second decline from the same device, or one from a device not invited, changes nothing.
    e.handle_message(secs(1), &decliner, decline(1, DeclineReason::Thermal));
    assert!(drain(&mut e).is_empty());
    // The stayer and the replacement answer: the round closes at its target with no drop.
    e.handle_message(secs(2), &stayer, update(1, &[1.0, 1.0], 10));
    e.handle_message(secs(3), &replacement, update(1, &[3.0, 3.0], 10));
    let actions = drain(&mut e);
    let report = reports(&actions).pop().expect("the round closed");
    assert_eq!(report.outcome, RoundOutcome::Aggregated);
    assert!(report.missing.is_empty(), "{:?}", report.missing);
    assert_eq!(report.declined, vec![(decliner.clone(), DeclineReason::Thermal)]);
    assert_eq!(e.stats().dropped, 0);
    assert!(ledger(&actions).iter().all(|r| !r.dropped));
}

/// With no free device, a decline leaves the round short; at the deadline it closes with the
/// decliner counted as declined, not missing.
#[test]
fn a_decline_with_no_free_device_is_not_counted_missing() {
    use anchorage_shared::ledger::DeclineReason;
    let mut e = engine(EngineConfig { min_updates: 1, ..config(2, 2) });
    join(&mut e, secs(0), &["a", "b"]);
    e.handle_message(secs(1), "a", decline(1, DeclineReason::Battery));
    let actions = drain(&mut e);
    assert!(broadcast_targets(&actions).is_empty(), "nobody free to invite");
    e.handle_message(secs(2), "b", update(1, &[1.0, 1.0], 10));
    drain(&mut e);
    e.handle_timeout(secs(1) + DEADLINE);
    let report = reports(&drain(&mut e)).pop().expect("closed at the deadline");
    assert_eq!(report.outcome, RoundOutcome::Aggregated);
    assert!(report.missing.is_empty());
    assert_eq!(report.declined, vec![("a".to_string(), DeclineReason::Battery)]);
    assert_eq!(e.stats().dropped, 0);
}

/// Buffered mode: a declining device's slot goes to another device at once, and the decliner
/// is not picked again for the same version.
#[test]
fn a_buffered_decline_frees_its_slot_for_another_device() {
    use anchorage_shared::ledger::DeclineReason;
    let mode = AggregationMode::Buffered { buffer: 2, concurrency: 1, max_staleness: 4 };
    let mut e = engine(EngineConfig { mode, ..config(1, 1) });
    let actions = join(&mut e, secs(0), &["a", "b"]);
    let first = broadcast_targets(&actions).concat();
    assert_eq!(first.len(), 1);
    e.handle_message(secs(1), &first[0], decline(1, DeclineReason::Window));
    let actions = drain(&mut e);
    let next = broadcast_targets(&actions).concat();
    assert_eq!(next.len(), 1);
    assert_ne!(next[0], first[0], "the decliner is not asked again for this version");
    assert_eq!(ledger(&actions).iter().filter(|r| r.declined == Some(DeclineReason::Window)).count(), 1);
}

/// `[engine.policy] selection = "least_recent"` through the engine: with half of 4 devices a
/// round, rounds 1 and 2 invite all four between them, and round 3 the first two again.
#[test]
fn least_recent_selection_rotates_through_the_fleet() {
    let policy = super::RoundPolicy { selection: super::Selection::LeastRecent, ..Default::default() };
    let mut e = engine(EngineConfig { fraction: 0.5, min_fit: 1, policy, ..config(4, 1) });
    let mut actions = join(&mut e, secs(0), &["a", "b", "c", "d"]);
    let mut invited: Vec<Vec<ClientId>> = Vec::new();
    for round in 1..=3 {
        let to = broadcast_targets(&actions).pop().expect("a round opened");
        for id in &to {
            e.handle_message(secs(round), id, update(round, &[1.0, 1.0], 1));
        }
        invited.push(to);
        actions = drain(&mut e);
    }
    let first_two: BTreeSet<&ClientId> = invited[0].iter().chain(&invited[1]).collect();
    assert_eq!(first_two.len(), 4, "every device once in two rounds: {invited:?}");
    assert_eq!(invited[2], invited[0], "then the ones invited longest ago: {invited:?}");
}

/// `[engine.policy] schedule`: each round's broadcast carries the schedule's learning rate.
#[test]
fn the_schedule_sets_each_broadcasts_learning_rate() {
    let policy = super::RoundPolicy { schedule: super::Schedule::Step { every: 1, gamma: 0.5 }, ..Default::default() };
    let mut e = engine(EngineConfig { policy, ..config(1, 1) });
    let mut actions = join(&mut e, secs(0), &["a"]);
    let mut rates = Vec::new();
    for round in 1..=3 {
        let rate = actions.iter().find_map(|a| match a {
            Action::Broadcast { msg, .. } => match msg.as_ref() {
                Message::Broadcast(b) => Some(b.config.learning_rate),
                _ => None,
            },
            _ => None,
        });
        rates.push(rate.expect("a broadcast"));
        e.handle_message(secs(round), "a", update(round, &[1.0, 1.0], 1));
        actions = drain(&mut e);
    }
    let base = EngineConfig::default().round.learning_rate;
    assert_eq!(rates, [base, base * 0.5, base * 0.25]);
}

/// A method's `configure_round` can give single devices other settings: they get a broadcast
/// of their own (encoded once per distinct setting), the others the round's.
#[test]
fn a_method_may_give_single_devices_their_own_settings() {
    struct Tailored(FedAvg);
    impl crate::methods::ServerMethod for Tailored {
        fn name(&self) -> &'static str {
            "fedavg"
        }
        fn aggregate(
            &mut self,
            round: &crate::methods::RoundInfo,
            global: &[ParamBlock],
            updates: &[(&str, &Update)],
        ) -> Result<Vec<ParamBlock>, crate::methods::MethodError> {
            self.0.aggregate(round, global, updates)
        }
        fn configure_round(&mut self, _ctx: &super::RoundContext, plan: &mut super::RoundPlan) {
            let mut slow = plan.config.clone();
            slow.local_epochs = 5;
            plan.per_device.insert("b".into(), slow);
        }
    }
    let mut e = Engine::new(config(2, 2), Box::new(Tailored(FedAvg::default())), vec![block(&[0.0, 0.0])]);
    let actions = join(&mut e, secs(0), &["a", "b"]);
    let epochs: Vec<(Vec<ClientId>, u32)> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Broadcast { to, msg } => match msg.as_ref() {
                Message::Broadcast(b) => Some((to.clone(), b.config.local_epochs)),
                _ => None,
            },
            _ => None,
        })
        .collect();
    let base = EngineConfig::default().round.local_epochs;
    assert_eq!(epochs, vec![(vec!["a".to_string()], base), (vec!["b".to_string()], 5)]);
}
