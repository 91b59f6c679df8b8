//! A client whose input arrives after round 0: keys are advertised and shared while it trains,
//! round 2 waits for the input ([`SecAggError::NoInput`], state unchanged), and the sum is right.

use std::collections::BTreeSet;

use super::Harness;
use crate::{Advance, ClientId, ClientState, Params, SecAggError, ServerMessage, Stage};

const PARAMS: Params = Params { degree: 6, threshold: 4 };

/// Rounds 0 and 1 with no client holding an input, then round 2's messages.
fn at_masked_input(h: &mut Harness) -> Vec<(ClientId, ServerMessage)> {
    assert!(h.clients.values().all(ClientState::needs_input));
    for _ in 0..2 {
        h.stage(&BTreeSet::new());
        h.server.advance().unwrap();
    }
    h.outgoing()
}

/// Answers round 2's `msgs` and runs rounds 2 and 4 to the aggregate's sum.
fn finish(h: &mut Harness, msgs: Vec<(ClientId, ServerMessage)>) -> Vec<u32> {
    let replies = h.answer(msgs);
    h.deliver(replies);
    h.server.advance().unwrap();
    h.stage(&BTreeSet::new());
    let Advance::Done(aggregate) = h.server.advance().unwrap() else { panic!("round not done") };
    aggregate.sum
}

#[test]
fn inputs_that_arrive_after_share_keys_sum_to_the_plain_sum() {
    let mut h = Harness::new(12, PARAMS, 40, 31).awaiting_inputs(31);
    let msgs = at_masked_input(&mut h);
    for (c, x) in &h.inputs {
        h.clients.get_mut(c).unwrap().provide_input(x.clone());
    }
    assert!(h.clients.values().all(|c| !c.needs_input()));
    assert_eq!(finish(&mut h, msgs), h.plain_sum(&BTreeSet::new()));
    assert!(h.clients.values().all(|c| !c.needs_input()), "a masked client needs nothing more");
}

#[test]
fn round_2_without_an_input_is_refused_unchanged_and_retried() {
    let mut h = Harness::new(10, PARAMS, 16, 32).awaiting_inputs(32);
    let msgs = at_masked_input(&mut h);
    for (c, m) in &msgs {
        let client = h.clients.get_mut(c).unwrap();
        assert_eq!(client.handle_message(m.clone()), Err(SecAggError::NoInput));
        assert_eq!(SecAggError::NoInput.reason(), "no_input");
        assert_eq!(client.stage(), Stage::MaskedInput);
        assert!(client.needs_input());
        client.provide_input(h.inputs[c].clone());
    }
    assert_eq!(finish(&mut h, msgs), h.plain_sum(&BTreeSet::new()));
}

#[test]
fn an_input_of_the_wrong_length_is_refused_and_can_be_replaced() {
    let mut h = Harness::new(10, PARAMS, 16, 33).awaiting_inputs(33);
    let msgs = at_masked_input(&mut h);
    let (c, m) = msgs[0].clone();
    let client = h.clients.get_mut(&c).unwrap();
    client.provide_input(vec![1; 15]);
    let err = client.handle_message(m).unwrap_err();
    assert_eq!(err, SecAggError::WrongLength { what: "input vector", expected: 16, got: 15 });
    assert_eq!(client.stage(), Stage::MaskedInput);
    for (c, x) in &h.inputs {
        h.clients.get_mut(c).unwrap().provide_input(x.clone());
    }
    assert_eq!(finish(&mut h, msgs), h.plain_sum(&BTreeSet::new()));
}

#[test]
fn an_early_input_is_still_checked_in_round_0() {
    let mut h = Harness::new(10, PARAMS, 16, 34).awaiting_inputs(34);
    let (c, setup) = h.outgoing().remove(0);
    let client = h.clients.get_mut(&c).unwrap();
    client.provide_input(vec![0; 17]);
    assert!(!client.needs_input());
    let err = client.handle_message(setup.clone()).unwrap_err();
    assert_eq!(err, SecAggError::WrongLength { what: "input vector", expected: 16, got: 17 });
    assert_eq!(client.stage(), Stage::AdvertiseKeys);
    client.provide_input(vec![0; 16]);
    assert!(client.handle_message(setup).is_ok());
}
