//! The relay tier on the sans-IO engines: a root and relays driven by hand, with the
//! devices' updates seeded, so that the same federation runs with and without the tier.

use std::time::Duration;

use anchorage_shared::ledger::CostRecord;
use anchorage_shared::method::{FedTaConfig, GldpConfig, MethodConfig};
use anchorage_shared::protocol::{Broadcast, Capabilities, CostBatch, Hello, Message, Partial, RefusalReason, Update};
use anchorage_shared::prototype::Prototype;
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{Encoding, ParamBlock};

use crate::aggregate::{AggregationRule, RobustConfig};
use crate::engine::tests::{drain, refusals};
use crate::engine::{Action, Checkpoint, Engine, EngineConfig, OpenedRound, Recovered};
use crate::methods::build;

const SHAPES: [(&str, usize); 2] = [("adapter.weight", 96), ("head.bias", 10)];
const CLASSES: u32 = 3;
const DIM: usize = 8;

fn block(name: &str, values: &[f32]) -> ParamBlock {
    ParamBlock::encode(name, &[values.len() as u32], values, Encoding::F32)
}

fn initial() -> Vec<ParamBlock> {
    SHAPES.iter().map(|(name, n)| block(name, &vec![0.0; *n])).collect()
}

/// Device `device`'s update of `round`, the same whichever way it travels: blocks near the
/// global's, a sample count from 1 to 400 and, for the prototype methods, a prototype of
/// some classes with their own counts.
fn device_update(round: u64, device: usize, prototypes: bool) -> Update {
    let mut rng = Rng::derive(round * 1_000 + device as u64, 37);
    let blocks =
        SHAPES.iter().map(|(name, n)| block(name, &(0..*n).map(|_| rng.normal() as f32).collect::<Vec<_>>())).collect();
    let mut uploads = Vec::new();
    for class in (0..CLASSES).filter(|_| prototypes) {
        if rng.f64() < 0.7 {
            let v: Vec<f32> = (0..DIM).map(|_| rng.normal() as f32 + class as f32).collect();
            uploads.push(Prototype::encode(class, 1 + rng.below(50), &v, Encoding::F32));
        }
    }
    let prototypes = uploads;
    Update {
        prototypes_are: Default::default(),
        round,
        num_samples: 1 + rng.below(400),
        blocks,
        prototypes,
        metrics: vec![],
        compute_seconds: 0.25,
    }
}

fn hello(id: &str, method: &str) -> Message {
    let mut methods = heapless::Vec::new();
    methods.push(heapless::String::try_from(method).unwrap()).unwrap();
    Message::Hello(Box::new(Hello {
        client_id: id.into(),
        capabilities: Capabilities { backend: "flex".into(), memory_mb: 256, methods },
        num_samples: 10,
        last_round: None,
    }))
}

fn config(participants: usize) -> EngineConfig {
    EngineConfig {
        rounds: 3,
        min_available: participants,
        min_fit: participants,
        round_deadline: Duration::from_secs(60),
        robust: RobustConfig::unbounded(),
        ..EngineConfig::default()
    }
}

fn broadcasts(actions: &[Action]) -> Vec<(Vec<String>, Broadcast)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Broadcast { to, msg } => match msg.as_ref() {
                Message::Broadcast(b) => Some((to.clone(), b.clone())),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

fn closed(actions: &[Action]) -> Vec<std::sync::Arc<Checkpoint>> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::RoundClosed(_, c) => Some(c.clone()),
            _ => None,
        })
        .collect()
}

fn device_id(device: usize) -> String {
    format!("device-{device:03}")
}

/// The global blocks and prototypes after `rounds` rounds of `devices` devices straight to the root.
fn without_tier(method: &MethodConfig, devices: usize, rounds: u64) -> Checkpoint {
    let prototypes = method.name() != "fedavg";
    let mut root = Engine::new(config(devices), build(method), initial());
    for d in 0..devices {
        root.handle_message(Duration::ZERO, &device_id(d), hello(&device_id(d), method.name()));
    }
    let mut last = None;
    for round in 1..=rounds {
        assert_eq!(root.open_round(), Some(round));
        for d in 0..devices {
            root.handle_message(Duration::ZERO, &device_id(d), Message::Update(device_update(round, d, prototypes)));
        }
        last = closed(&drain(&mut root)).pop();
    }
    (*last.expect("the last round closed")).clone()
}

/// The same federation behind `relays` relays, device d on relay d mod `relays`.
fn with_tier(method: &MethodConfig, devices: usize, relays: usize, rounds: u64) -> Checkpoint {
    let prototypes = method.name() != "fedavg";
    let mut root = Engine::new(config(relays), build(method), initial());
    let mut tier: Vec<Engine> = (0..relays)
        .map(|r| {
            let mut relay = Engine::relay(config(devices.div_ceil(relays)), method, None).expect("a relay for it");
            for d in (r..devices).step_by(relays) {
                relay.handle_message(Duration::ZERO, &device_id(d), hello(&device_id(d), method.name()));
            }
            relay
        })
        .collect();
    for r in 0..relays {
        root.set_relay(&format!("relay-{r}"), true);
        root.handle_message(Duration::ZERO, &format!("relay-{r}"), hello(&format!("relay-{r}"), method.name()));
    }
    let mut last = None;
    let mut actions = drain(&mut root);
    for round in 1..=rounds {
        let (_, parent) = broadcasts(&actions).pop().expect("the root broadcasts to its relays");
        assert_eq!(parent.round, round);
        for (r, relay) in tier.iter_mut().enumerate() {
            drain(relay);
            relay.handle_parent_round(Duration::ZERO, parent.clone());
            let (to, sent) = broadcasts(&drain(relay)).pop().expect("the relay forwards the round");
            assert_eq!((sent.round, &sent.blocks, &sent.prototypes), (round, &parent.blocks, &parent.prototypes));
            assert_eq!(to.len(), (r..devices).step_by(relays).count());
            for d in (r..devices).step_by(relays) {
                relay.handle_message(
                    Duration::ZERO,
                    &device_id(d),
                    Message::Update(device_update(round, d, prototypes)),
                );
            }
            assert_eq!(closed(&drain(relay)).len(), 1, "the relay's round closed at its target");
            let partial = relay.last_partial().expect("a partial aggregate of the round");
            assert_eq!(partial.members.len(), to.len());
            root.handle_message(Duration::ZERO, &format!("relay-{r}"), Message::Partial(partial));
        }
        actions = drain(&mut root);
        last = closed(&actions).pop();
    }
    (*last.expect("the last round closed")).clone()
}

fn values(blocks: &[ParamBlock]) -> Vec<f32> {
    blocks.iter().flat_map(|b| b.decode().unwrap()).collect()
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * (1.0 + x.abs()), "{what}[{i}]: {x} without the tier, {y} with it");
    }
}

/// The global model (blocks and prototypes) is the same, to float tolerance, with and without
/// four relays, over three rounds (the prototype rule blends each round into the last), for
/// FedAvg and for GLDP.
#[test]
fn the_tier_gives_the_global_model_of_the_devices_straight_to_the_root() {
    let methods = [MethodConfig::named("fedavg").unwrap(), MethodConfig::Gldp(GldpConfig::default())];
    for method in &methods {
        let direct = without_tier(method, 40, 3);
        let tiered = with_tier(method, 40, 4, 3);
        assert_eq!(direct.round, 3);
        assert_eq!(tiered.round, 3);
        assert_close(&values(&direct.global), &values(&tiered.global), method.name());
        assert_ne!(values(&direct.global), values(&initial()), "{}: the rounds moved the model", method.name());
        assert_eq!(direct.prototypes.len(), tiered.prototypes.len(), "{}: classes", method.name());
        for (p, q) in direct.prototypes.iter().zip(&tiered.prototypes) {
            assert_eq!((p.class, p.count), (q.class, q.count), "{}: class and count", method.name());
            assert_close(&p.values().unwrap(), &q.values().unwrap(), method.name());
        }
        if method.name() == "gldp" {
            assert_eq!(direct.prototypes.len(), CLASSES as usize, "every class has a global prototype");
        }
    }
}

/// A relay of FedAvg with three devices, the parent's round 5 already broadcast to it.
fn relay_in_round_five() -> (Engine, Broadcast) {
    let mut relay = Engine::relay(config(3), &MethodConfig::named("fedavg").unwrap(), None).unwrap();
    for d in 0..3 {
        relay.handle_message(Duration::ZERO, &device_id(d), hello(&device_id(d), "fedavg"));
    }
    assert!(broadcasts(&drain(&mut relay)).is_empty(), "a relay opens no round of its own");
    assert_eq!(relay.open_round(), None);
    let mut parent = Broadcast {
        round: 5,
        task: 2,
        config: config(3).round,
        blocks: initial(),
        prototypes: vec![Prototype::encode(1, 7, &[1.0; DIM], Encoding::F32)],
    };
    parent.config.deadline_ms = 600_000;
    relay.handle_parent_round(Duration::ZERO, parent.clone());
    (relay, parent)
}

#[test]
fn a_relay_runs_its_parents_round_and_keeps_its_partial_through_a_restart() {
    let (mut relay, parent) = relay_in_round_five();
    let actions = drain(&mut relay);
    let persisted: Vec<&crate::engine::Persist> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Persist(p @ (crate::engine::Persist::PassedOver { .. } | crate::engine::Persist::Opened(_))) => {
                Some(p)
            }
            _ => None,
        })
        .collect();
    assert!(
        matches!(persisted.as_slice(), [crate::engine::Persist::PassedOver { through: 4 }, crate::engine::Persist::Opened(o)] if o.round == 5),
        "rounds 1 to 4 were the parent's alone, committed before round 5 opens: {persisted:?}"
    );
    let (to, sent) = broadcasts(&actions).pop().expect("the parent's round goes to the devices");
    assert_eq!(to.len(), 3);
    assert_eq!((sent.round, sent.task, &sent.blocks, &sent.prototypes), (5, 2, &parent.blocks, &parent.prototypes));
    assert_eq!(sent.config.deadline_ms, 60_000, "the earlier of the parent's and the relay's deadlines");
    // The same broadcast again (the parent resends it after a reconnect) opens nothing new.
    relay.handle_parent_round(Duration::ZERO, parent.clone());
    assert!(broadcasts(&drain(&mut relay)).is_empty());
    let updates: Vec<Update> = (0..3).map(|d| device_update(5, d, false)).collect();
    for (d, u) in updates.iter().enumerate() {
        relay.handle_message(Duration::from_secs(1), &device_id(d), Message::Update(u.clone()));
    }
    let actions = drain(&mut relay);
    let checkpoint = closed(&actions).pop().expect("closed at its target");
    let partial = relay.last_partial().unwrap();
    assert_eq!(partial.update.round, 5);
    assert_eq!(partial.update.num_samples, updates.iter().map(|u| u.num_samples).sum::<u64>());
    // Blocks: the sample-weighted mean of the devices'.
    let n: f64 = partial.update.num_samples as f64;
    let mean: Vec<f32> = (0..SHAPES[0].1)
        .map(|i| {
            let sum: f64 = updates.iter().map(|u| u.num_samples as f64 * u.blocks[0].decode().unwrap()[i] as f64).sum();
            (sum / n) as f32
        })
        .collect();
    assert_close(&mean, &partial.update.blocks[0].decode().unwrap(), "the partial's block");
    assert_eq!(checkpoint.global, parent.blocks, "a relay never changes the parent's model");
    // Restart: a relay built from its store's checkpoint holds the same partial to send again.
    let recovered = Recovered {
        checkpoint: (*checkpoint).clone(),
        open: None,
        pending: vec![],
        last_accepted: vec![],
        round_floor: 0,
        invitations: vec![],
        privacy: None,
    };
    let restarted = Engine::relay(config(3), &MethodConfig::named("fedavg").unwrap(), Some(recovered)).unwrap();
    assert_eq!(restarted.last_partial(), Some(partial.clone()));
    assert_eq!(restarted.last_round(), 5);
    let hashes: std::collections::BTreeSet<[u8; 32]> = partial.members.iter().map(|m| m.hash).collect();
    assert_eq!(hashes.len(), 3, "each member named by its own update's hash");
}

/// The acks a relay sent, as (device, round, aggregated).
fn acks(actions: &[Action]) -> Vec<(String, u64, bool)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { to, msg: Message::Ack(ack) } => Some((to.clone(), ack.round, ack.aggregated)),
            _ => None,
        })
        .collect()
}

/// A relay's ack repeats its parent's: none goes out when the relay accepts an update, each
/// member of the partial gets the parent's ack (`aggregated: false` when the parent counted the
/// partial late), a device the parent counted through another relay gets none, and a device
/// that sends its update again after the verdict gets the verdict at once.
#[test]
fn a_relay_acks_its_devices_as_its_parent_acked_their_partial() {
    let verdict = |aggregated: bool, members: &[usize]| crate::engine::ParentVerdict {
        round: 5,
        aggregated,
        members: members.iter().map(|&d| device_id(d)).collect(),
    };
    for aggregated in [true, false] {
        let (mut relay, _) = relay_in_round_five();
        drain(&mut relay);
        let updates: Vec<Update> = (0..3).map(|d| device_update(5, d, false)).collect();
        for (d, u) in updates.iter().enumerate() {
            relay.handle_message(Duration::from_secs(1), &device_id(d), Message::Update(u.clone()));
        }
        let actions = drain(&mut relay);
        assert_eq!(closed(&actions).len(), 1, "closed at its target");
        assert!(acks(&actions).is_empty(), "no ack before the parent's: {:?}", acks(&actions));
        // Device 2 was counted through another relay: the partial the parent acked is without it.
        relay.handle_parent_verdict(verdict(aggregated, &[0, 1]));
        let expected: Vec<_> = [0, 1].map(|d| (device_id(d), 5, aggregated)).into();
        assert_eq!(acks(&drain(&mut relay)), expected);
        relay.handle_message(Duration::from_secs(2), &device_id(0), Message::Update(updates[0].clone()));
        assert_eq!(acks(&drain(&mut relay)), vec![(device_id(0), 5, aggregated)], "a resend gets the verdict");
        relay.handle_message(Duration::from_secs(2), &device_id(2), Message::Update(updates[2].clone()));
        assert!(acks(&drain(&mut relay)).is_empty(), "not in the partial the parent counted");
    }
    // A partial the parent refused and the relay could not fold again: nobody is acked.
    let (mut relay, _) = relay_in_round_five();
    for d in 0..3 {
        relay.handle_message(Duration::from_secs(1), &device_id(d), Message::Update(device_update(5, d, false)));
    }
    drain(&mut relay);
    relay.handle_parent_verdict(crate::engine::ParentVerdict::dropped(5));
    assert!(acks(&drain(&mut relay)).is_empty());
}

/// A relay killed mid-round loses nothing it acked: started again from its store (the open
/// round and its accepted updates), it reopens the round when its parent sends the round's
/// broadcast again, and the partial holds the updates acked before the kill.
#[test]
fn a_relay_restarted_mid_round_aggregates_what_it_acked_before() {
    let (mut relay, parent) = relay_in_round_five();
    let mut persisted = Vec::new();
    let first = device_update(5, 0, false);
    relay.handle_message(Duration::ZERO, &device_id(0), Message::Update(first.clone()));
    for a in drain(&mut relay) {
        if let Action::Persist(p) = a {
            persisted.push(p);
        }
    }
    let opened = persisted.iter().find_map(|p| match p {
        crate::engine::Persist::Opened(o) => Some(o.clone()),
        _ => None,
    });
    let accepted: Vec<_> = persisted
        .iter()
        .filter_map(|p| match p {
            crate::engine::Persist::Accepted(a) => Some((**a).clone()),
            _ => None,
        })
        .collect();
    // (Opened was persisted when the round opened, before this drain: rebuild it as the store would.)
    let opened =
        opened.unwrap_or(OpenedRound { round: 5, task: 2, target: 3, sampled: (0..3).map(device_id).collect() });
    assert_eq!(accepted.len(), 1);
    let recovered = Recovered {
        checkpoint: relay.checkpoint(),
        open: Some(opened),
        pending: accepted,
        last_accepted: vec![],
        round_floor: 0,
        invitations: vec![],
        privacy: None,
    };
    drop(relay);
    // The parent moved on while the relay was down: its broadcast of round 6 comes first. Round
    // 5 closes with the update accepted before the crash, then round 6 opens: the store never
    // holds two open rounds (seed 1385 of the swarm found a restarted relay's store with two).
    let mut moved_on =
        Engine::relay(config(3), &MethodConfig::named("fedavg").unwrap(), Some(recovered.clone())).unwrap();
    for d in 0..3 {
        moved_on.handle_message(Duration::ZERO, &device_id(d), hello(&device_id(d), "fedavg"));
    }
    moved_on.handle_parent_round(Duration::ZERO, Broadcast { round: 6, ..parent.clone() });
    let actions = drain(&mut moved_on);
    let order: Vec<(&str, u64)> = actions
        .iter()
        .filter_map(|a| match a {
            Action::RoundClosed(_, c) => Some(("closed", c.round)),
            Action::Persist(crate::engine::Persist::Opened(o)) => Some(("opened", o.round)),
            _ => None,
        })
        .collect();
    assert_eq!(order, vec![("closed", 5), ("opened", 6)]);
    let partial = moved_on.last_partial().expect("round 5's partial");
    assert_eq!(partial.members.iter().map(|m| m.device.clone()).collect::<Vec<_>>(), vec![device_id(0)]);
    assert_eq!(moved_on.open_round(), Some(6));

    let mut relay = Engine::relay(config(3), &MethodConfig::named("fedavg").unwrap(), Some(recovered)).unwrap();
    for d in 0..3 {
        relay.handle_message(Duration::ZERO, &device_id(d), hello(&device_id(d), "fedavg"));
    }
    assert_eq!(relay.open_round(), None, "the round waits for its parent's broadcast");
    // A device that sends its update before then is told to wait (it keeps the update), not
    // that it was not sampled (it would set the update aside): seed 568 of the swarm.
    relay.handle_message(Duration::ZERO, &device_id(1), Message::Update(device_update(5, 1, false)));
    assert_eq!(refusals(&drain(&mut relay), &device_id(1)), vec![RefusalReason::ServerBusy]);
    relay.handle_parent_round(Duration::ZERO, parent);
    let (to, _) = broadcasts(&drain(&mut relay)).pop().expect("the round reopens");
    assert_eq!(to, vec![device_id(1), device_id(2)], "only the devices it still waits for");
    for d in 1..3 {
        relay.handle_message(Duration::ZERO, &device_id(d), Message::Update(device_update(5, d, false)));
    }
    drain(&mut relay);
    let partial = relay.last_partial().expect("the round closed");
    let members: Vec<&str> = partial.members.iter().map(|m| m.device.as_str()).collect();
    assert_eq!(members, vec![device_id(0), device_id(1), device_id(2)]);
}

/// A device whose update one relay's accepted partial holds is not counted
/// again through another relay (it failed over and resent); the same relay's resend is a
/// duplicate acked again.
#[test]
fn the_root_counts_a_device_once_across_relays() {
    let method = MethodConfig::named("fedavg").unwrap();
    let mut root = Engine::new(config(2), build(&method), initial());
    for r in ["relay-a", "relay-b", "device-x"] {
        root.set_relay(r, r.starts_with("relay"));
        root.handle_message(Duration::ZERO, r, hello(r, "fedavg"));
    }
    drain(&mut root);
    let partial_of = |devices: &[usize]| {
        let updates: Vec<(String, Update)> =
            devices.iter().map(|&d| (device_id(d), device_update(1, d, false))).collect();
        let refs: Vec<(&str, &Update)> = updates.iter().map(|(d, u)| (d.as_str(), u)).collect();
        super::fold(1, &refs).unwrap()
    };
    let a = partial_of(&[0, 1]);
    root.handle_message(Duration::ZERO, "device-x", Message::Partial(a.clone()));
    assert_eq!(refusals(&drain(&mut root), "device-x"), vec![RefusalReason::Malformed], "a device is no relay");
    assert_eq!(root.counted_through(1, &device_id(0)), None);
    root.handle_message(Duration::ZERO, "relay-a", Message::Partial(a.clone()));
    assert!(refusals(&drain(&mut root), "relay-a").is_empty());
    assert_eq!(root.counted_through(1, &device_id(1)).map(|(r, _)| r), Some("relay-a"));
    root.handle_message(Duration::ZERO, "relay-a", Message::Partial(a.clone()));
    assert!(refusals(&drain(&mut root), "relay-a").is_empty(), "a resend from the same relay is acked again");
    let b = partial_of(&[1, 2]);
    root.handle_message(Duration::ZERO, "relay-b", Message::Partial(b));
    assert_eq!(refusals(&drain(&mut root), "relay-b"), vec![RefusalReason::Duplicate]);
    assert_eq!(root.open_round(), Some(1), "the round still waits: nothing counted twice");
    root.handle_message(Duration::ZERO, "relay-b", Message::Partial(partial_of(&[2])));
    let actions = drain(&mut root);
    let checkpoint = closed(&actions).pop().expect("closed with both relays");
    let direct: Vec<(String, Update)> = (0..3).map(|d| (device_id(d), device_update(1, d, false))).collect();
    let refs: Vec<(&str, &Update)> = direct.iter().map(|(d, u)| (d.as_str(), u)).collect();
    assert_close(&values(&checkpoint.global), &values(&super::fold(1, &refs).unwrap().update.blocks), "global");
}

#[test]
fn a_cost_batch_reaches_the_ledger_under_each_devices_name() {
    let mut root = Engine::new(config(1), build(&MethodConfig::named("fedavg").unwrap()), initial());
    root.set_relay("relay-a", true);
    root.handle_message(Duration::ZERO, "relay-a", hello("relay-a", "fedavg"));
    drain(&mut root);
    let record = |device: usize, round: u64| CostRecord { client: device_id(device), round, ..CostRecord::default() };
    let batch = CostBatch { records: vec![record(0, 1), record(1, 1)] };
    root.handle_message(Duration::ZERO, "relay-a", Message::CostBatch(batch));
    let actions = drain(&mut root);
    let ledger: Vec<&str> = actions
        .iter()
        .filter_map(|a| match a {
            Action::Ledger(r) => Some(r.client.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(ledger, vec![device_id(0), device_id(1)]);
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, Action::Send { to, msg: Message::CostAck(c) } if to == "relay-a" && c.round == 1))
    );
    let mixed = CostBatch { records: vec![record(0, 1), record(1, 2)] };
    root.handle_message(Duration::ZERO, "relay-a", Message::CostBatch(mixed));
    assert_eq!(refusals(&drain(&mut root), "relay-a"), vec![RefusalReason::Malformed]);
}

#[test]
fn relays_refuse_what_a_partial_sum_cannot_carry() {
    let fedta = MethodConfig::FedTa(FedTaConfig::default());
    let why = Engine::relay(config(2), &fedta, None).err().expect("FedTA with BGPS and SIKF").to_string();
    assert!(why.contains("bgps = false"), "{why}");
    let plain = MethodConfig::FedTa(FedTaConfig { bgps: false, sikf: false, ..FedTaConfig::default() });
    assert!(Engine::relay(config(2), &plain, None).is_ok());
    let median = EngineConfig {
        robust: RobustConfig { aggregation: AggregationRule::Median, ..RobustConfig::unbounded() },
        ..config(2)
    };
    let why = Engine::relay(median, &MethodConfig::named("fedavg").unwrap(), None).err().unwrap().to_string();
    assert!(why.contains("median"), "{why}");
    // A relay takes no partial aggregate itself (one tier).
    let (mut relay, _) = relay_in_round_five();
    drain(&mut relay);
    let p = Partial { update: device_update(5, 0, false), members: vec![] };
    relay.handle_message(Duration::ZERO, &device_id(0), Message::Partial(p));
    assert_eq!(refusals(&drain(&mut relay), &device_id(0)), vec![RefusalReason::Malformed]);
}

/// A device that failed over from another relay resends its update of the
/// parent's open round; a relay takes it into the round (and its partial), a root never takes
/// an update from a device it did not invite.
#[test]
fn a_relay_adopts_a_device_that_failed_over_and_the_root_does_not() {
    let (mut relay, _) = relay_in_round_five();
    drain(&mut relay);
    relay.handle_message(Duration::ZERO, "stranger", hello("stranger", "fedavg"));
    drain(&mut relay);
    relay.handle_message(Duration::ZERO, "stranger", Message::Update(device_update(5, 9, false)));
    let actions = drain(&mut relay);
    assert!(refusals(&actions, "stranger").is_empty(), "adopted");
    let invited = actions.iter().any(|a| {
        matches!(a, Action::Persist(crate::engine::Persist::Invited { round: 5, sampled }) if sampled.contains(&"stranger".to_string()))
    });
    assert!(invited, "the adoption is durable before the update");
    for d in 0..2 {
        relay.handle_message(Duration::ZERO, &device_id(d), Message::Update(device_update(5, d, false)));
    }
    drain(&mut relay);
    let members: Vec<String> = relay.last_partial().unwrap().members.into_iter().map(|m| m.device).collect();
    assert!(members.contains(&"stranger".to_string()) && members.len() == 3, "{members:?}");

    let mut root = Engine::new(config(1), build(&MethodConfig::named("fedavg").unwrap()), initial());
    root.handle_message(Duration::ZERO, "a", hello("a", "fedavg"));
    drain(&mut root);
    root.handle_message(Duration::ZERO, "b", hello("b", "fedavg"));
    drain(&mut root);
    root.handle_message(Duration::ZERO, "b", Message::Update(device_update(1, 0, false)));
    assert_eq!(refusals(&drain(&mut root), "b"), vec![RefusalReason::NotSampled]);
}

/// A device whose update relay A's accepted partial holds failed over to relay B, which took it
/// too (A's ack was lost): the root refuses B's partial naming the device, and B folds its round
/// again without it. The root's model holds every device once.
#[test]
fn a_relay_folds_its_round_again_without_a_device_counted_elsewhere() {
    let method = MethodConfig::named("fedavg").unwrap();
    let mut root = Engine::new(config(2), build(&method), initial());
    for r in ["relay-a", "relay-b"] {
        root.set_relay(r, true);
        root.handle_message(Duration::ZERO, r, hello(r, "fedavg"));
    }
    let (_, parent) = broadcasts(&drain(&mut root)).pop().unwrap();
    let relay_with = |devices: &[usize]| {
        let mut relay = Engine::relay(config(devices.len()), &method, None).unwrap();
        for &d in devices {
            relay.handle_message(Duration::ZERO, &device_id(d), hello(&device_id(d), "fedavg"));
        }
        relay.handle_parent_round(Duration::ZERO, parent.clone());
        for &d in devices {
            relay.handle_message(Duration::ZERO, &device_id(d), Message::Update(device_update(1, d, false)));
        }
        drain(&mut relay);
        relay
    };
    let a = relay_with(&[0, 1]);
    let mut b = relay_with(&[1, 2]);
    root.handle_message(Duration::ZERO, "relay-a", Message::Partial(a.last_partial().unwrap()));
    root.handle_message(Duration::ZERO, "relay-b", Message::Partial(b.last_partial().unwrap()));
    let refusal = drain(&mut root)
        .into_iter()
        .find_map(|a| match a {
            Action::Send { to, msg: Message::Refusal(r) } if to == "relay-b" => Some(r),
            _ => None,
        })
        .expect("B's partial refused");
    assert_eq!(refusal.reason, RefusalReason::Duplicate);
    let twice = refusal.devices;
    assert_eq!(twice, vec![device_id(1)], "the refusal names the devices in its own field");
    let again = b.refold_without(&twice).expect("B folds its round again");
    assert_eq!(again.members.iter().map(|m| m.device.as_str()).collect::<Vec<_>>(), [device_id(2)]);
    assert_eq!(b.last_partial(), Some(again.clone()), "the new partial is the relay's last");
    root.handle_message(Duration::ZERO, "relay-b", Message::Partial(again));
    let checkpoint = closed(&drain(&mut root)).pop().expect("the round closes with both relays");
    let all: Vec<(String, Update)> = (0..3).map(|d| (device_id(d), device_update(1, d, false))).collect();
    let refs: Vec<(&str, &Update)> = all.iter().map(|(d, u)| (d.as_str(), u)).collect();
    assert_close(&values(&checkpoint.global), &values(&super::fold(1, &refs).unwrap().update.blocks), "global");
    assert_eq!(b.refold_without(&[device_id(2)]), None, "nothing left to send");
}

/// Devices that trained later rounds under a sibling relay (they failed over while this relay
/// was down) are no rollback evidence at a relay: its rounds are its parent's. It opens the
/// parent's next round for them.
#[test]
fn a_relay_takes_back_devices_that_trained_rounds_under_a_sibling() {
    let mut relay = Engine::relay(config(3), &MethodConfig::named("fedavg").unwrap(), None).unwrap();
    for d in 0..3 {
        let Message::Hello(mut h) = hello(&device_id(d), "fedavg") else { unreachable!() };
        h.last_round = Some(9);
        relay.handle_message(Duration::ZERO, &device_id(d), Message::Hello(h));
    }
    drain(&mut relay);
    assert_eq!((relay.devices_ahead(), relay.rollback_suspected()), (0, None));
    let parent = Broadcast { round: 10, task: 0, config: config(3).round, blocks: initial(), prototypes: vec![] };
    relay.handle_parent_round(Duration::ZERO, parent);
    let sent = broadcasts(&drain(&mut relay));
    assert_eq!(sent.len(), 1, "the relay opens its parent's round");
    assert_eq!(sent[0].0.len(), 3);
    assert_eq!(sent[0].1.round, 10);
}
