//! Session tests: the state machine driven by hand, no socket and no training.

use anchorage_shared::protocol::{
    Ack, Broadcast, CostAck, Goodbye, Message, Refusal, RefusalReason, RoundConfig, Update, Welcome,
};

use super::*;

/// The compute time the tests' trainings report: the `compute_seconds` of [`update`].
const COMPUTE: Duration = Duration::from_millis(100);

/// Messages at time zero, no wire bytes (the tests of the cost record pass their own).
trait Receive {
    fn receive(&mut self, msg: Message) -> Result<(), SessionError>;
}

impl Receive for Session {
    fn receive(&mut self, msg: Message) -> Result<(), SessionError> {
        self.handle_message(Duration::ZERO, msg, 0)
    }
}

fn capabilities() -> Capabilities {
    let mut methods = heapless::Vec::new();
    methods.push(heapless::String::try_from("fedavg").unwrap()).unwrap();
    Capabilities { backend: "flex".into(), memory_mb: 128, methods }
}

fn welcome() -> Message {
    Message::Welcome(Welcome {
        server_id: "s".into(),
        method: "fedavg".into(),
        max_frame_bytes: 1 << 20,
        heartbeat_ms: 1000,
        current_round: None,
    })
}

fn broadcast(round: u64) -> Broadcast {
    Broadcast {
        round,
        task: 0,
        config: RoundConfig { local_epochs: 1, batch_size: 8, learning_rate: 0.01, deadline_ms: 1000 },
        blocks: vec![],
        prototypes: vec![],
    }
}

fn update(round: u64) -> Update {
    Update {
        prototypes_are: Default::default(),
        round,
        num_samples: 5,
        blocks: vec![],
        prototypes: vec![],
        metrics: vec![],
        compute_seconds: 0.1,
    }
}

/// A method's result that becomes `u` once the session stamps its round and compute time.
fn content(u: Update) -> Trained {
    let Update { num_samples, blocks, prototypes, prototypes_are, metrics, .. } = u;
    Trained { num_samples, blocks, prototypes, prototypes_are, metrics }
}

fn drain(s: &mut Session) -> Vec<SessionAction> {
    std::iter::from_fn(|| s.poll_action()).collect()
}

/// A session that said hello and was welcomed; only the actions after the welcome remain queued.
fn joined(pending: Option<Update>) -> Session {
    let mut s = Session::new("c1", capabilities(), 5, pending);
    s.connected();
    assert!(matches!(&drain(&mut s)[..], [SessionAction::Send(Message::Hello(_))]));
    s.receive(welcome()).unwrap();
    s
}

#[test]
fn join_train_upload_ack() {
    let mut s = Session::new("c1", capabilities(), 5, None);
    s.connected();
    let actions = drain(&mut s);
    assert!(
        matches!(&actions[..], [SessionAction::Send(Message::Hello(h))] if h.client_id == "c1" && h.last_round.is_none())
    );
    assert_eq!(s.state(), SessionState::Joining);
    s.receive(welcome()).unwrap();
    assert_eq!(s.state(), SessionState::Idle);
    s.receive(Message::Broadcast(broadcast(1))).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Train(broadcast(1))]);
    assert_eq!(s.state(), SessionState::Training { round: 1 });
    s.trained(1, content(update(1)), COMPUTE);
    // Persisted before it is uploaded.
    assert_eq!(drain(&mut s), vec![SessionAction::Persist(Some(update(1))), SessionAction::Upload(update(1))]);
    assert_eq!(s.state(), SessionState::Uploading { round: 1 });
    s.receive(Message::Ack(Ack { round: 1, aggregated: true })).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Persist(None)]);
    assert_eq!(s.state(), SessionState::Idle);
    assert!(s.pending().is_none());
}

#[test]
fn an_unacknowledged_update_is_resent_after_reconnecting() {
    let mut s = joined(None);
    s.receive(Message::Broadcast(broadcast(1))).unwrap();
    s.trained(1, content(update(1)), COMPUTE);
    drain(&mut s);
    s.disconnected();
    assert_eq!(s.state(), SessionState::Disconnected);
    s.connected();
    let actions = drain(&mut s);
    assert!(matches!(&actions[..], [SessionAction::Send(Message::Hello(h))] if h.last_round == Some(1)));
    s.receive(welcome()).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Upload(update(1))]);
}

#[test]
fn a_restored_pending_update_is_resent_after_a_restart() {
    let mut s = joined(Some(update(4)));
    assert_eq!(drain(&mut s), vec![SessionAction::Upload(update(4))]);
    // The broadcast of the same round (re-sent by the server) does not retrain: it resends.
    s.receive(Message::Broadcast(broadcast(4))).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Upload(update(4))]);
    // An older round's broadcast is ignored.
    s.receive(Message::Broadcast(broadcast(3))).unwrap();
    assert!(drain(&mut s).is_empty());
}

#[test]
fn training_outlives_a_dropped_connection() {
    let mut s = joined(None);
    s.receive(Message::Broadcast(broadcast(2))).unwrap();
    drain(&mut s);
    s.disconnected();
    assert_eq!(s.state(), SessionState::Training { round: 2 });
    s.trained(2, content(update(2)), COMPUTE);
    assert_eq!(drain(&mut s), vec![SessionAction::Persist(Some(update(2)))], "no upload without a connection");
    s.connected();
    s.receive(welcome()).unwrap();
    assert_eq!(drain(&mut s).last(), Some(&SessionAction::Upload(update(2))));
}

#[test]
fn a_second_broadcast_while_training_is_ignored() {
    let mut s = joined(None);
    s.receive(Message::Broadcast(broadcast(1))).unwrap();
    s.receive(Message::Broadcast(broadcast(1))).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Train(broadcast(1))]);
}

#[test]
fn refusals_drop_hopeless_updates_or_end_the_session() {
    let mut s = joined(None);
    s.receive(Message::Broadcast(broadcast(1))).unwrap();
    s.trained(1, content(update(1)), COMPUTE);
    drain(&mut s);
    let refuse = |reason| Message::Refusal(Refusal::new(reason, "test"));
    s.receive(refuse(RefusalReason::ShapeMismatch)).unwrap();
    assert_eq!(
        drain(&mut s),
        vec![SessionAction::SetAsidePending { round: 1, reason: "ShapeMismatch: test".into() }],
        "a refused update is set aside, not deleted"
    );
    assert_eq!(s.state(), SessionState::Idle);
    assert!(s.pending().is_none());
    assert!(s.refusal().is_none(), "a refused update does not end the session");
    s.receive(refuse(RefusalReason::VersionMismatch)).unwrap();
    assert!(matches!(&drain(&mut s)[..], [SessionAction::Finished { .. }]));
    assert_eq!(s.state(), SessionState::Finished);
    assert_eq!(s.refusal().map(|r| r.reason), Some(RefusalReason::VersionMismatch), "the shell stops on it");
    s.receive(refuse(RefusalReason::NotEnrolled)).unwrap();
    assert!(drain(&mut s).is_empty(), "the session ends once");
    s.receive(Message::Broadcast(broadcast(2))).unwrap();
    assert!(drain(&mut s).is_empty(), "a finished session trains no more");
}

#[test]
fn goodbye_finishes_and_unexpected_messages_are_errors() {
    let mut s = Session::new("c1", capabilities(), 5, None);
    assert!(matches!(s.receive(welcome()), Err(SessionError::Unexpected { kind: "welcome", .. })));
    let mut s = joined(None);
    assert!(s.receive(Message::Update(update(1))).is_err());
    s.receive(Message::Goodbye(Goodbye { reason: "federation finished".into() })).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Finished { reason: "federation finished".into() }]);
    assert!(s.refusal().is_none(), "a goodbye is the end of the run, not a refusal");
    s.connected();
    assert!(drain(&mut s).is_empty(), "no hello after the end");
}

#[test]
fn a_stale_ack_does_not_clear_a_newer_update() {
    let mut s = joined(None);
    s.receive(Message::Broadcast(broadcast(3))).unwrap();
    s.trained(3, content(update(3)), COMPUTE);
    drain(&mut s);
    s.receive(Message::Ack(Ack { round: 2, aggregated: true })).unwrap();
    assert!(drain(&mut s).is_empty());
    assert_eq!(s.pending(), Some(&update(3)));
}

#[test]
fn a_final_refusal_sets_the_update_aside_and_it_is_never_resent() {
    for reason in
        [RefusalReason::ShapeMismatch, RefusalReason::BadTensor, RefusalReason::NotSampled, RefusalReason::Malformed]
    {
        // Restored after a restart and resent after the welcome, then refused.
        let mut s = joined(Some(update(3)));
        assert_eq!(drain(&mut s), vec![SessionAction::Upload(update(3))]);
        s.receive(Message::Refusal(Refusal::new(reason, "round 3 is not open"))).unwrap();
        let actions = drain(&mut s);
        assert!(
            matches!(&actions[..], [SessionAction::SetAsidePending { round: 3, reason: r }]
                if r == &format!("{reason:?}: round 3 is not open")),
            "{reason:?}: {actions:?}"
        );
        assert!(!actions.contains(&SessionAction::Persist(None)), "{reason:?}: never deleted");
        assert_eq!((s.pending(), s.state()), (None, SessionState::Idle), "{reason:?}");
        // Not resent: neither after reconnecting nor on the same round's broadcast.
        s.disconnected();
        s.connected();
        s.receive(welcome()).unwrap();
        s.receive(Message::Broadcast(broadcast(3))).unwrap();
        let actions = drain(&mut s);
        assert!(!actions.iter().any(|a| matches!(a, SessionAction::Upload(_))), "{reason:?}: {actions:?}");
        // A second refusal with nothing pending sets nothing aside.
        s.receive(Message::Refusal(Refusal::new(reason, "again"))).unwrap();
        assert!(drain(&mut s).is_empty(), "{reason:?}");
    }
}

#[test]
fn passing_refusals_keep_the_pending_update() {
    for reason in [RefusalReason::Duplicate, RefusalReason::TooLarge, RefusalReason::ServerBusy] {
        let mut s = joined(Some(update(3)));
        drain(&mut s);
        s.receive(Message::Refusal(Refusal::new(reason, "test"))).unwrap();
        assert!(drain(&mut s).is_empty(), "{reason:?}: neither cleared nor set aside");
        assert_eq!(s.pending(), Some(&update(3)), "{reason:?}");
    }
}

#[test]
fn only_the_ack_for_its_round_clears_the_pending_update() {
    let mut s = joined(Some(update(3)));
    assert_eq!(drain(&mut s), vec![SessionAction::Upload(update(3))]);
    // Acks for other rounds, older and newer (a previous update's late ack, a confused
    // server): the update stays, on disk and in memory, and is resent after reconnecting.
    for round in [2, 4, 0, u64::MAX] {
        s.receive(Message::Ack(Ack { round, aggregated: true })).unwrap();
        assert!(drain(&mut s).is_empty(), "ack for round {round}");
        assert_eq!(s.pending(), Some(&update(3)), "ack for round {round}");
        assert_eq!(s.state(), SessionState::Uploading { round: 3 });
    }
    s.disconnected();
    s.connected();
    drain(&mut s);
    s.receive(welcome()).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Upload(update(3))]);
    // Its own ack, even a late one (not aggregated), clears it.
    s.receive(Message::Ack(Ack { round: 3, aggregated: false })).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Persist(None)]);
    assert_eq!((s.pending(), s.state()), (None, SessionState::Idle));
}

/// A broadcast with 10 f32 values of blocks (40 payload bytes) and one prototype of 4 (16 bytes).
fn broadcast_with_payload(round: u64) -> Broadcast {
    use anchorage_shared::prototype::Prototype;
    use anchorage_shared::tensor::{Encoding, ParamBlock};
    Broadcast {
        blocks: vec![ParamBlock::encode("head.weight", &[10], &[0.5; 10], Encoding::F32)],
        prototypes: vec![Prototype::encode(3, 7, &[1.0; 4], Encoding::F32)],
        ..broadcast(round)
    }
}

/// An update with 6 f32 values (24 payload bytes); the method leaves `compute_seconds` at zero.
fn trained_update(round: u64) -> Update {
    use anchorage_shared::tensor::{Encoding, ParamBlock};
    let blocks = vec![ParamBlock::encode("head.weight", &[6], &[0.25; 6], Encoding::F32)];
    Update { blocks, compute_seconds: 0.0, ..update(round) }
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// One round as a shell drives it, with the times and wire bytes it measured: the session
/// produces the round's cost record once the update is both uploaded and acknowledged, from
/// those inputs and the payloads it saw.
#[test]
fn the_session_builds_the_rounds_cost_record_from_what_the_shell_measured() {
    let mut s = joined(None);
    s.handle_message(secs(10.0), Message::Broadcast(broadcast_with_payload(1)), 1_100).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Train(broadcast_with_payload(1))]);
    s.trained(1, content(trained_update(1)), secs(2.5));
    let stamped = Update { compute_seconds: 2.5, ..trained_update(1) };
    assert_eq!(
        drain(&mut s),
        vec![SessionAction::Persist(Some(stamped.clone())), SessionAction::Upload(stamped)],
        "the update carries the compute seconds the caller measured"
    );
    let upload = UploadMeasure { wire_bytes: 2_000, transfer: secs(0.5), rtt: secs(0.02) };
    s.uploaded(secs(13.5), 1, upload);
    assert!(drain(&mut s).is_empty(), "no record before the ack");
    s.handle_message(secs(14.0), Message::Ack(Ack { round: 1, aggregated: true }), 60).unwrap();
    let record = CostRecord {
        client: "c1".into(),
        round: 1,
        payload_down: 40 + 16,
        payload_up: 24,
        wire_down: 1_100,
        wire_up: 2_000,
        compute_seconds: 2.5,
        transfer_seconds: 0.5,
        wait_seconds: 1.0,
        wall_seconds: 4.0,
        rtt_seconds: 0.02,
        joules: 0.0,
        straggler: false,
        dropped: false,
        ..CostRecord::default()
    };
    // Reported before the update's file is deleted, and once.
    assert_eq!(drain(&mut s), vec![SessionAction::Cost(record), SessionAction::Persist(None)]);
    s.uploaded(secs(15.0), 1, upload);
    s.handle_message(secs(15.0), Message::Ack(Ack { round: 1, aggregated: true }), 60).unwrap();
    assert!(drain(&mut s).is_empty(), "the round's record is made once");
}

/// On the real clock the ack may overtake the upload's own measurement: the record waits for
/// it, and its wall time runs until then. A late update's record is a straggler's.
#[test]
fn an_ack_before_the_uploads_measurement_completes_the_record_with_it() {
    let mut s = joined(None);
    s.handle_message(secs(1.0), Message::Broadcast(broadcast_with_payload(2)), 500).unwrap();
    s.trained(2, content(trained_update(2)), secs(1.0));
    drain(&mut s);
    s.handle_message(secs(3.0), Message::Ack(Ack { round: 2, aggregated: false }), 60).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Persist(None)], "the upload is not measured yet");
    s.uploaded(secs(4.0), 2, UploadMeasure { wire_bytes: 900, transfer: secs(2.0), rtt: Duration::ZERO });
    let actions = drain(&mut s);
    let [SessionAction::Cost(r)] = &actions[..] else { panic!("{actions:?}") };
    assert_eq!((r.wall_seconds, r.wait_seconds, r.wire_up, r.straggler), (3.0, 0.0, 900, true));
}

/// The first copy of a round's broadcast opens its record (one sent again after reconnecting
/// does not restart it); the virtual clock's crash keeps the records of the rounds in flight, and
/// its ledger counts only the blocks of a broadcast.
#[test]
fn a_resent_broadcast_and_a_restart_keep_the_rounds_record() {
    let mut s = joined(None).payload_down_without_prototypes();
    s.handle_message(secs(1.0), Message::Broadcast(broadcast_with_payload(3)), 500).unwrap();
    s.trained(3, content(trained_update(3)), secs(0.5));
    drain(&mut s);
    s.restart(5);
    assert_eq!((s.state(), s.pending().map(|u| u.round)), (SessionState::Disconnected, Some(3)));
    s.connected();
    s.receive(welcome()).unwrap();
    s.handle_message(secs(6.0), Message::Broadcast(broadcast_with_payload(3)), 700).unwrap();
    s.uploaded(secs(7.0), 3, UploadMeasure { wire_bytes: 900, transfer: secs(1.0), rtt: Duration::ZERO });
    s.handle_message(secs(8.0), Message::Ack(Ack { round: 3, aggregated: true }), 60).unwrap();
    let record = drain(&mut s).into_iter().find_map(|a| match a {
        SessionAction::Cost(r) => Some(r),
        _ => None,
    });
    let r = record.expect("a record for round 3");
    assert_eq!((r.payload_down, r.wire_down, r.wall_seconds, r.compute_seconds), (40, 500, 7.0, 0.5));
}

/// An ineligible device declines instead of training: it says why, keeps no cost record of the
/// round, and trains on the same round's broadcast if it is sent again once the device is
/// eligible.
#[test]
fn a_declined_round_is_told_to_the_server_and_may_be_trained_later() {
    let mut s = joined(None);
    s.receive(Message::Broadcast(broadcast(3))).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Train(broadcast(3))]);
    s.declined(3, DeclineReason::Thermal, &"é".repeat(200));
    let actions = drain(&mut s);
    let [SessionAction::Send(Message::Decline(d))] = &actions[..] else { panic!("{actions:?}") };
    assert_eq!((d.round, d.reason), (3, DeclineReason::Thermal));
    assert!(d.detail.len() <= MAX_DECLINE_DETAIL, "the detail is cut on a character boundary");
    assert_eq!(s.state(), SessionState::Idle);
    // A decline for a round it is not training is ignored.
    s.declined(4, DeclineReason::Battery, "x");
    assert!(drain(&mut s).is_empty());
    // The round's broadcast again: trained this time.
    s.receive(Message::Broadcast(broadcast(3))).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Train(broadcast(3))]);
}

/// One round from its broadcast to its complete record, on a welcomed session, with what the
/// device read of itself after training, if anything: the actions of the round's ack.
fn a_round_recorded(s: &mut Session, round: u64, readings: Option<&Readings>) -> Vec<SessionAction> {
    s.receive(Message::Broadcast(broadcast(round))).unwrap();
    if let Some(readings) = readings {
        s.condition(round, readings);
    }
    s.trained(round, content(update(round)), COMPUTE);
    s.uploaded(secs(1.0), round, UploadMeasure::default());
    drain(s);
    s.receive(Message::Ack(Ack { round, aggregated: true })).unwrap();
    drain(s)
}

/// The connection drops and comes back: the actions after the new welcome.
fn reconnected(s: &mut Session) -> Vec<SessionAction> {
    s.disconnected();
    s.connected();
    drain(s);
    s.receive(welcome()).unwrap();
    drain(s)
}

/// Reporting costs, a complete record is sent to the server's ledger right after its `Cost`,
/// and sent again after every welcome until the server confirms it; a confirmed one is not sent
/// again, and only the newest 8 are kept.
#[test]
fn an_unconfirmed_cost_record_is_sent_again_after_a_reconnect() {
    let mut s = joined(None).reporting_costs();
    let actions = a_round_recorded(&mut s, 1, None);
    let [SessionAction::Cost(r1), SessionAction::Send(Message::Cost(sent)), SessionAction::Persist(None)] =
        &actions[..]
    else {
        panic!("{actions:?}")
    };
    assert_eq!(r1, sent);
    let actions = a_round_recorded(&mut s, 2, None);
    let Some(SessionAction::Cost(r2)) = actions.first().cloned() else { panic!("{actions:?}") };
    s.receive(Message::CostAck(CostAck { round: 1 })).unwrap();
    assert!(drain(&mut s).is_empty());
    assert_eq!(reconnected(&mut s), vec![SessionAction::Send(Message::Cost(r2.clone()))], "round 1's is confirmed");
    assert_eq!(reconnected(&mut s), vec![SessionAction::Send(Message::Cost(r2))], "until it is confirmed");
    s.receive(Message::CostAck(CostAck { round: 2 })).unwrap();
    assert!(reconnected(&mut s).is_empty(), "every record is confirmed");

    for round in 3..=12 {
        a_round_recorded(&mut s, round, None);
    }
    let rounds: Vec<u64> = reconnected(&mut s)
        .iter()
        .map(|a| match a {
            SessionAction::Send(Message::Cost(r)) => r.round,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(rounds, (5..=12).collect::<Vec<_>>(), "the newest 8, oldest first");

    // A session that does not report (the simulator's) only emits the record.
    let mut s = joined(None);
    let actions = a_round_recorded(&mut s, 1, None);
    assert!(matches!(&actions[..], [SessionAction::Cost(_), SessionAction::Persist(None)]), "{actions:?}");
    assert!(reconnected(&mut s).is_empty());
}

/// What the device read of itself after training goes into the round's record, as
/// `eligibility::fill_condition` writes it; a round without readings (the simulator's devices)
/// carries no condition.
#[test]
fn the_devices_condition_lands_in_the_rounds_cost_record() {
    let readings = Readings {
        top_freq_ratio: Some(0.4),
        power_mode: Some("nvpmodel 2".into()),
        errors: vec!["thermal_zone0/temp: not a number".into()],
        ..Readings::default()
    };
    let cost = |actions: Vec<SessionAction>| {
        actions.into_iter().find_map(|a| match a {
            SessionAction::Cost(r) => Some(r),
            _ => None,
        })
    };
    let mut s = joined(None);
    let r = cost(a_round_recorded(&mut s, 1, Some(&readings))).expect("round 1's record");
    assert_eq!(
        (r.throttled, r.power_mode.as_deref(), r.readings_refused, r.temperature_c, r.battery_percent),
        (Some(true), Some("nvpmodel 2"), Some(1), None, None)
    );
    // The same round without readings, filled by `fill_condition`: the condition is all that
    // differs.
    let mut expected = cost(a_round_recorded(&mut joined(None), 1, None)).expect("a record");
    assert_ne!(r, expected);
    crate::eligibility::fill_condition(&mut expected, &readings);
    assert_eq!(r, expected);
    let r = cost(a_round_recorded(&mut s, 2, None)).expect("round 2's record");
    assert_eq!((r.throttled, r.power_mode, r.readings_refused), (None, None, None));
}

/// A Setup for a three-device SecAgg round in which this device is `you`, over a layout of
/// no blocks and no prototypes (the vector holds only the weight).
fn secagg_setup(round: u64, you: u32) -> Message {
    use anchorage_secagg::{ClientId, Layout, Params, RoundConfig as SecAggRound, ServerFrame, ServerMessage};
    let layout = Layout {
        blocks: vec![],
        classes: 0,
        dim: 0,
        clip: 1.0,
        prototype_clip: 1.0,
        max_count: 1,
        max_clients: 3,
        weight_scale: 0.0,
    };
    let config = SecAggRound {
        round,
        clients: (0..3).map(ClientId).collect(),
        params: Params { degree: 2, threshold: 2 },
        graph_seed: [1; 32],
        vector_len: layout.vector_len() as u32,
    };
    let frame = ServerFrame { layout: Some(layout), you: Some(ClientId(you)), message: ServerMessage::Setup(config) };
    Message::SecAgg(anchorage_shared::protocol::SecAggFrame { round, body: frame.encode() })
}

#[test]
fn under_secure_aggregation_an_update_never_leaves_in_the_clear() {
    // A pending update from before a restart is not resent after the welcome, nor when the
    // round's broadcast comes again.
    let mut s = Session::new("c1", capabilities(), 5, Some(update(3))).with_secure_aggregation([7; 32]);
    s.connected();
    s.receive(welcome()).unwrap();
    s.receive(Message::Broadcast(broadcast(3))).unwrap();
    let actions = drain(&mut s);
    assert!(!actions.iter().any(|a| matches!(a, SessionAction::Upload(_))), "{actions:?}");
    // A fresh round: keys go out at once; the trained update is persisted, never uploaded.
    s.receive(Message::Broadcast(broadcast(4))).unwrap();
    s.receive(secagg_setup(4, 1)).unwrap();
    s.trained(4, content(update(4)), COMPUTE);
    let actions = drain(&mut s);
    assert!(actions.iter().any(|a| matches!(a, SessionAction::Send(Message::SecAgg(f)) if f.round == 4)), "keys sent");
    assert!(actions.iter().any(|a| matches!(a, SessionAction::Persist(Some(u)) if u.round == 4)), "persisted");
    assert!(!actions.iter().any(|a| matches!(a, SessionAction::Upload(_))), "{actions:?}");
    // The same Setup again (its answer lost with a connection) gets the same answer.
    s.receive(secagg_setup(4, 1)).unwrap();
    assert!(matches!(drain(&mut s).as_slice(), [SessionAction::Send(Message::SecAgg(_))]));
}

#[test]
fn secure_aggregation_messages_that_do_not_fit_are_refused_with_their_reason() {
    let mut plain = joined(None);
    let err = plain.receive(secagg_setup(1, 0)).unwrap_err();
    assert!(matches!(err, SessionError::SecAgg { reason: "off", .. }), "{err}");
    let mut s = Session::new("c1", capabilities(), 5, None).with_secure_aggregation([7; 32]);
    s.connected();
    s.receive(welcome()).unwrap();
    let garbage = Message::SecAgg(anchorage_shared::protocol::SecAggFrame { round: 1, body: vec![0xff; 5] });
    assert!(matches!(s.receive(garbage), Err(SessionError::SecAgg { reason: "decode", .. })));
    let err = s.receive(secagg_setup(1, 9)).unwrap_err();
    assert!(matches!(err, SessionError::SecAgg { reason: "bad_params", .. }), "not in the round's sample: {err}");
}
