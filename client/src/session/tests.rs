//! Session tests: the state machine driven by hand, no socket and no training.

use anchorage_shared::protocol::{
    Ack, Broadcast, Goodbye, Message, Refusal, RefusalReason, RoundConfig, Update, Welcome,
};

use super::*;

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
    Update { round, num_samples: 5, blocks: vec![], prototypes: vec![], metrics: vec![], compute_seconds: 0.1 }
}

fn drain(s: &mut Session) -> Vec<SessionAction> {
    std::iter::from_fn(|| s.poll_action()).collect()
}

/// A session that said hello and was welcomed; only the actions after the welcome remain queued.
fn joined(pending: Option<Update>) -> Session {
    let mut s = Session::new("c1", capabilities(), 5, pending);
    s.connected();
    assert!(matches!(&drain(&mut s)[..], [SessionAction::Send(Message::Hello(_))]));
    s.handle_message(welcome()).unwrap();
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
    s.handle_message(welcome()).unwrap();
    assert_eq!(s.state(), SessionState::Idle);
    s.handle_message(Message::Broadcast(broadcast(1))).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Train(broadcast(1))]);
    assert_eq!(s.state(), SessionState::Training { round: 1 });
    s.trained(update(1));
    // Persisted before it is uploaded.
    assert_eq!(drain(&mut s), vec![SessionAction::Persist(Some(update(1))), SessionAction::Upload(update(1))]);
    assert_eq!(s.state(), SessionState::Uploading { round: 1 });
    s.handle_message(Message::Ack(Ack { round: 1, aggregated: true })).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Persist(None)]);
    assert_eq!(s.state(), SessionState::Idle);
    assert!(s.pending().is_none());
}

#[test]
fn an_unacknowledged_update_is_resent_after_reconnecting() {
    let mut s = joined(None);
    s.handle_message(Message::Broadcast(broadcast(1))).unwrap();
    s.trained(update(1));
    drain(&mut s);
    s.disconnected();
    assert_eq!(s.state(), SessionState::Disconnected);
    s.connected();
    let actions = drain(&mut s);
    assert!(matches!(&actions[..], [SessionAction::Send(Message::Hello(h))] if h.last_round == Some(1)));
    s.handle_message(welcome()).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Upload(update(1))]);
}

#[test]
fn a_restored_pending_update_is_resent_after_a_restart() {
    let mut s = joined(Some(update(4)));
    assert_eq!(drain(&mut s), vec![SessionAction::Upload(update(4))]);
    // The broadcast of the same round (re-sent by the server) does not retrain: it resends.
    s.handle_message(Message::Broadcast(broadcast(4))).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Upload(update(4))]);
    // An older round's broadcast is ignored.
    s.handle_message(Message::Broadcast(broadcast(3))).unwrap();
    assert!(drain(&mut s).is_empty());
}

#[test]
fn training_outlives_a_dropped_connection() {
    let mut s = joined(None);
    s.handle_message(Message::Broadcast(broadcast(2))).unwrap();
    drain(&mut s);
    s.disconnected();
    assert_eq!(s.state(), SessionState::Training { round: 2 });
    s.trained(update(2));
    assert_eq!(drain(&mut s), vec![SessionAction::Persist(Some(update(2)))], "no upload without a connection");
    s.connected();
    s.handle_message(welcome()).unwrap();
    assert_eq!(drain(&mut s).last(), Some(&SessionAction::Upload(update(2))));
}

#[test]
fn a_second_broadcast_while_training_is_ignored() {
    let mut s = joined(None);
    s.handle_message(Message::Broadcast(broadcast(1))).unwrap();
    s.handle_message(Message::Broadcast(broadcast(1))).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Train(broadcast(1))]);
}

#[test]
fn refusals_drop_hopeless_updates_or_end_the_session() {
    let mut s = joined(None);
    s.handle_message(Message::Broadcast(broadcast(1))).unwrap();
    s.trained(update(1));
    drain(&mut s);
    let refuse = |reason| Message::Refusal(Refusal { reason, detail: "test".into() });
    s.handle_message(refuse(RefusalReason::ShapeMismatch)).unwrap();
    assert_eq!(
        drain(&mut s),
        vec![SessionAction::SetAsidePending { round: 1, reason: "ShapeMismatch: test".into() }],
        "a refused update is set aside, not deleted"
    );
    assert_eq!(s.state(), SessionState::Idle);
    assert!(s.pending().is_none());
    assert!(s.refusal().is_none(), "a refused update does not end the session");
    s.handle_message(refuse(RefusalReason::VersionMismatch)).unwrap();
    assert!(matches!(&drain(&mut s)[..], [SessionAction::Finished { .. }]));
    assert_eq!(s.state(), SessionState::Finished);
    assert_eq!(s.refusal().map(|r| r.reason), Some(RefusalReason::VersionMismatch), "the shell stops on it");
    s.handle_message(refuse(RefusalReason::NotEnrolled)).unwrap();
    assert!(drain(&mut s).is_empty(), "the session ends once");
    s.handle_message(Message::Broadcast(broadcast(2))).unwrap();
    assert!(drain(&mut s).is_empty(), "a finished session trains no more");
}

#[test]
fn goodbye_finishes_and_unexpected_messages_are_errors() {
    let mut s = Session::new("c1", capabilities(), 5, None);
    assert!(matches!(s.handle_message(welcome()), Err(SessionError::Unexpected { kind: "welcome", .. })));
    let mut s = joined(None);
    assert!(s.handle_message(Message::Update(update(1))).is_err());
    s.handle_message(Message::Goodbye(Goodbye { reason: "federation finished".into() })).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Finished { reason: "federation finished".into() }]);
    assert!(s.refusal().is_none(), "a goodbye is the end of the run, not a refusal");
    s.connected();
    assert!(drain(&mut s).is_empty(), "no hello after the end");
}

#[test]
fn a_stale_ack_does_not_clear_a_newer_update() {
    let mut s = joined(None);
    s.handle_message(Message::Broadcast(broadcast(3))).unwrap();
    s.trained(update(3));
    drain(&mut s);
    s.handle_message(Message::Ack(Ack { round: 2, aggregated: true })).unwrap();
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
        s.handle_message(Message::Refusal(Refusal { reason, detail: "round 3 is not open".into() })).unwrap();
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
        s.handle_message(welcome()).unwrap();
        s.handle_message(Message::Broadcast(broadcast(3))).unwrap();
        let actions = drain(&mut s);
        assert!(!actions.iter().any(|a| matches!(a, SessionAction::Upload(_))), "{reason:?}: {actions:?}");
        // A second refusal with nothing pending sets nothing aside.
        s.handle_message(Message::Refusal(Refusal { reason, detail: "again".into() })).unwrap();
        assert!(drain(&mut s).is_empty(), "{reason:?}");
    }
}

#[test]
fn passing_refusals_keep_the_pending_update() {
    for reason in [RefusalReason::Duplicate, RefusalReason::TooLarge, RefusalReason::ServerBusy] {
        let mut s = joined(Some(update(3)));
        drain(&mut s);
        s.handle_message(Message::Refusal(Refusal { reason, detail: "test".into() })).unwrap();
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
        s.handle_message(Message::Ack(Ack { round, aggregated: true })).unwrap();
        assert!(drain(&mut s).is_empty(), "ack for round {round}");
        assert_eq!(s.pending(), Some(&update(3)), "ack for round {round}");
        assert_eq!(s.state(), SessionState::Uploading { round: 3 });
    }
    s.disconnected();
    s.connected();
    drain(&mut s);
    s.handle_message(welcome()).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Upload(update(3))]);
    // Its own ack, even a late one (not aggregated), clears it.
    s.handle_message(Message::Ack(Ack { round: 3, aggregated: false })).unwrap();
    assert_eq!(drain(&mut s), vec![SessionAction::Persist(None)]);
    assert_eq!((s.pending(), s.state()), (None, SessionState::Idle));
}
