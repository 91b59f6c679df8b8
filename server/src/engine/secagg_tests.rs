//! The engine under `[engine.secagg]`: a round whose sum is all the server learns,
//! devices that drop after masking, a round that cannot unmask, refused messages, and the
//! configurations that cannot hold. The devices are `anchorage-secagg`'s own client state
//! machines, driven here as the device session drives them.

use std::collections::{BTreeMap, BTreeSet};

use anchorage_secagg::{ClientMessage, ClientState, Layout, ServerFrame, ServerMessage};
use anchorage_shared::method::MethodConfig;
use anchorage_shared::protocol::{Message, RefusalReason, SecAggFrame, Update};

use super::compat::check as check_config;
use super::secagg::SecAggConfig;
use super::tests::{block, config, drain, engine, join, refusals, reports, secs, update};
use super::*;

/// A device in the test: its update, and how far it goes before it drops.
struct Device {
    update: Update,
    /// The last stage it answers (`None`: all of them).
    drops_before: Option<anchorage_secagg::Stage>,
    state: Option<ClientState>,
    layout: Option<Layout>,
}

fn secure(clients: usize) -> EngineConfig {
    let secagg = SecAggConfig { enabled: true, clip: 10.0, ..SecAggConfig::default() };
    EngineConfig { rounds: 1, secagg, ..config(clients, clients) }
}

fn devices(values: &[[f32; 2]]) -> BTreeMap<String, Device> {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let Message::Update(update) = update(1, v, 10) else { unreachable!() };
            (format!("d{i}"), Device { update, drops_before: None, state: None, layout: None })
        })
        .collect()
}

/// Delivers the engine's SecAgg messages to the devices and their answers back, until nothing
/// moves; then the clock jumps to `deadline` and it goes on. Returns every action seen.
fn run(e: &mut Engine, devices: &mut BTreeMap<String, Device>, mut actions: Vec<Action>) -> Vec<Action> {
    let mut seen = Vec::new();
    let mut now = secs(1);
    for _ in 0..12 {
        let mut replies = Vec::new();
        for action in &actions {
            if let Action::Send { to, msg: Message::SecAgg(frame) } = action
                && let Some(reply) = answer(devices.get_mut(to).unwrap(), frame)
            {
                replies.push((to.clone(), reply));
            }
        }
        seen.append(&mut actions);
        for (from, msg) in replies {
            e.handle_message(now, &from, msg);
        }
        actions = drain(e);
        if actions.is_empty() {
            now = e.poll_timeout().unwrap_or(now).max(now) + secs(1);
            e.handle_timeout(now);
            actions = drain(e);
        }
        if actions.is_empty() {
            break;
        }
    }
    seen.extend(actions);
    seen
}

fn answer(device: &mut Device, frame: &SecAggFrame) -> Option<Message> {
    let ServerFrame { layout, you, message } = ServerFrame::decode(&frame.body).unwrap();
    if device.drops_before == Some(message.stage()) {
        return None;
    }
    if let ServerMessage::Setup(_) = &message {
        device.state = Some(ClientState::awaiting_input(you.unwrap(), [you.unwrap().0 as u8 + 1; 32]));
        device.layout = layout;
    }
    let state = device.state.as_mut().unwrap();
    if let ServerMessage::CollectMasked { .. } = &message {
        let global = vec![block(&[0.0, 0.0])];
        state.provide_input(device.layout.as_ref().unwrap().encode(&device.update, &global, false).unwrap());
    }
    let reply = state.handle_message(message).unwrap();
    Some(Message::SecAgg(SecAggFrame { round: frame.round, body: reply.encode() }))
}

fn acked(actions: &[Action]) -> BTreeSet<String> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Send { to, msg: Message::Ack(ack) } if ack.aggregated => Some(to.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_secure_round_aggregates_the_sum_and_acks_only_after_the_version_is_durable() {
    let mut e = engine(secure(5));
    let mut devs = devices(&[[1.0, 2.0], [3.0, -1.0], [0.5, 0.5], [-2.0, 1.0], [2.5, 2.5]]);
    let ids: Vec<&str> = devs.keys().map(String::as_str).collect::<Vec<_>>();
    let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
    let start = join(&mut e, secs(0), &ids.iter().map(String::as_str).collect::<Vec<_>>());
    let actions = run(&mut e, &mut devs, start);
    let report = reports(&actions).into_iter().next().expect("the round closed");
    assert!(matches!(report.outcome, RoundOutcome::Aggregated), "{:?}", report.outcome);
    let g = e.global()[0].decode().unwrap();
    assert!((g[0] - 1.0).abs() < 1e-5 && (g[1] - 1.0).abs() < 1e-5, "the mean of the five deltas: {g:?}");
    let secagg = report.secagg.as_ref().expect("the report says what SecAgg did");
    assert_eq!((secagg.contributors, secagg.dropped_after_masking), (5, 0));
    assert_eq!(acked(&actions).len(), 5, "every contributor acked");
    let closed_at = actions.iter().position(|a| matches!(a, Action::Persist(Persist::Closed { .. }))).unwrap();
    let first_ack = actions.iter().position(|a| matches!(a, Action::Send { msg: Message::Ack(_), .. })).unwrap();
    assert!(closed_at < first_ack, "acks only after the version is durable");
    assert!(
        !actions.iter().any(|a| matches!(a, Action::Persist(Persist::Accepted(_)))),
        "no device's update reaches the store"
    );
}

#[test]
fn devices_that_drop_after_sharing_keys_are_unmasked_from_the_shares() {
    let mut e = engine(secure(10));
    let values: Vec<[f32; 2]> = (0..10).map(|i| [i as f32, 1.0]).collect();
    let mut devs = devices(&values);
    for id in ["d1", "d4", "d7"] {
        devs.get_mut(id).unwrap().drops_before = Some(anchorage_secagg::Stage::MaskedInput);
    }
    let ids: Vec<String> = devs.keys().cloned().collect();
    let start = join(&mut e, secs(0), &ids.iter().map(String::as_str).collect::<Vec<_>>());
    let actions = run(&mut e, &mut devs, start);
    let report = reports(&actions).into_iter().next().expect("the round closed");
    assert!(matches!(report.outcome, RoundOutcome::Aggregated), "{:?}", report.outcome);
    let survivors = [0.0, 2.0, 3.0, 5.0, 6.0, 8.0, 9.0];
    let mean = survivors.iter().sum::<f32>() / 7.0;
    let g = e.global()[0].decode().unwrap();
    assert!((g[0] - mean).abs() < 1e-5 && (g[1] - 1.0).abs() < 1e-5, "the survivors' mean {mean}: {g:?}");
    let secagg = report.secagg.as_ref().unwrap();
    assert_eq!((secagg.contributors, secagg.dropped_after_masking), (7, 3));
    assert_eq!(report.missing, vec!["d1".to_string(), "d4".into(), "d7".into()]);
    assert!(!acked(&actions).contains("d1") && acked(&actions).len() == 7);
}

#[test]
fn a_round_that_cannot_recover_enough_shares_fails_and_outputs_nothing() {
    let mut e = engine(secure(5));
    let mut devs = devices(&[[1.0, 2.0], [3.0, -1.0], [0.5, 0.5], [-2.0, 1.0], [2.5, 2.5]]);
    for id in ["d0", "d1", "d2"] {
        devs.get_mut(id).unwrap().drops_before = Some(anchorage_secagg::Stage::Unmask);
    }
    let ids: Vec<String> = devs.keys().cloned().collect();
    let start = join(&mut e, secs(0), &ids.iter().map(String::as_str).collect::<Vec<_>>());
    let actions = run(&mut e, &mut devs, start);
    let report = reports(&actions).into_iter().next().expect("the round closed");
    assert!(matches!(&report.outcome, RoundOutcome::Failed { reason } if reason.contains("secure aggregation failed")));
    assert!(report.secagg.as_ref().unwrap().failed.is_some());
    assert_eq!(e.global()[0].decode().unwrap(), vec![0.0, 0.0], "the model stays");
    assert!(acked(&actions).is_empty(), "no ack for a round that output nothing");
}

#[test]
fn malformed_secagg_messages_are_refused_counted_and_the_round_goes_on() {
    let mut e = engine(secure(3));
    let mut devs = devices(&[[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]);
    let start = join(&mut e, secs(0), &["d0", "d1", "d2"]);
    // Garbage, and a key message with an all-zero (unusable) key, before the honest answers.
    e.handle_message(secs(0), "d0", Message::SecAgg(SecAggFrame { round: 1, body: vec![0xff; 7] }));
    let zero = anchorage_secagg::PublicKeys { mask: [0; 32], encrypt: [0; 32] };
    let bad_key = ClientMessage::Keys { round: 1, keys: zero };
    e.handle_message(secs(0), "d1", Message::SecAgg(SecAggFrame { round: 1, body: bad_key.encode() }));
    let refused = drain(&mut e);
    assert_eq!(refusals(&refused, "d0"), vec![RefusalReason::Malformed]);
    assert_eq!(refusals(&refused, "d1"), vec![RefusalReason::Malformed]);
    let actions = run(&mut e, &mut devs, start);
    let report = reports(&actions).into_iter().next().expect("the round closed");
    assert!(matches!(report.outcome, RoundOutcome::Aggregated), "{:?}", report.outcome);
    let counted = &report.secagg.as_ref().unwrap().refused;
    assert_eq!((counted.get("decode"), counted.get("bad_key")), (Some(&1), Some(&1)), "{counted:?}");
}

#[test]
fn an_update_in_the_clear_is_refused_under_secure_aggregation() {
    let mut e = engine(secure(2));
    join(&mut e, secs(0), &["a", "b"]);
    e.handle_message(secs(1), "a", update(1, &[1.0, 1.0], 10));
    let actions = drain(&mut e);
    assert_eq!(refusals(&actions, "a"), vec![RefusalReason::Malformed]);
    assert!(!actions.iter().any(|a| matches!(a, Action::Persist(Persist::Accepted(_)))));
}

#[test]
fn a_server_restarted_mid_round_fails_that_round_and_opens_the_next() {
    let mut e = engine(secure(3));
    let actions = join(&mut e, secs(0), &["a", "b", "c"]);
    let opened = actions.iter().find_map(|a| match a {
        Action::Persist(Persist::Opened(o)) => Some(o.clone()),
        _ => None,
    });
    let recovered = Recovered {
        checkpoint: e.checkpoint(),
        open: opened,
        pending: Vec::new(),
        last_accepted: Vec::new(),
        round_floor: 0,
        invitations: Vec::new(),
        privacy: None,
    };
    let mut again = Engine::recover(secure(3), Box::new(crate::methods::FedAvg::default()), recovered);
    let report = reports(&drain(&mut again)).pop().expect("the resumed round closes");
    assert!(matches!(&report.outcome, RoundOutcome::Failed { reason } if reason.contains("restarted")));
}

#[test]
fn configurations_that_need_each_update_are_refused_with_why() {
    let fedavg = MethodConfig::named("fedavg").unwrap();
    let mut median = secure(3);
    median.robust.aggregation = crate::aggregate::AggregationRule::Median;
    let mut norm = secure(3);
    norm.robust.max_norm = Some(5.0);
    let mut buffered = secure(3);
    buffered.mode = AggregationMode::Buffered { buffer: 2, concurrency: 3, max_staleness: 4 };
    let mut central = secure(3);
    central.privacy.noise = anchorage_shared::privacy::NoiseSite::Central;
    for (config, says) in [(median, "Median"), (norm, "max_norm"), (buffered, "buffered"), (central, "central")] {
        let err = check_config(&config, &fedavg).expect_err(says).to_string();
        assert!(err.contains(says) && err.contains("[engine.secagg]"), "{err}");
    }
    check_config(&secure(3), &fedavg).expect("the mean with the default bounds runs");
    let mut capped = secure(3);
    capped.robust.norm_cap = Some(3.0);
    assert!(check_config(&capped, &fedavg).unwrap_err().to_string().contains("norm_cap"));
    let fedprok = MethodConfig::named("fedprok").unwrap();
    let err = check_config(&secure(3), &fedprok).expect_err("prototypes need their place in the vector").to_string();
    assert!(err.contains("prototype_dim"), "{err}");
    let sized = SecAggConfig { classes: 10, prototype_dim: 64, ..secure(3).secagg };
    check_config(&EngineConfig { secagg: sized, ..secure(3) }, &fedprok).expect("sized for prototypes");
}

#[test]
fn local_noise_under_secure_aggregation_is_accounted_each_round() {
    let privacy = anchorage_shared::privacy::PrivacyConfig {
        noise: anchorage_shared::privacy::NoiseSite::Local,
        clip: 1.0,
        noise_multiplier: Some(1.0),
        ..Default::default()
    };
    let config = EngineConfig { privacy, ..secure(3) };
    check_config(&config, &MethodConfig::named("fedavg").unwrap()).expect("local noise and SecAgg combine");
    let mut e = engine(config);
    let mut devs = devices(&[[0.1, 0.2], [0.3, -0.1], [0.2, 0.2]]);
    let start = join(&mut e, secs(0), &["d0", "d1", "d2"]);
    let actions = run(&mut e, &mut devs, start);
    let report = reports(&actions).into_iter().next().expect("the round closed");
    assert!(matches!(report.outcome, RoundOutcome::Aggregated), "{:?}", report.outcome);
    let account = report.privacy.as_ref().expect("the account");
    assert_eq!(account.rounds, 1);
    assert!(account.epsilon > 0.0);
    let g = e.global()[0].decode().unwrap();
    assert!((g[0] - 0.2).abs() < 1e-5 && (g[1] - 0.1).abs() < 1e-5, "equal weights: {g:?}");
}
