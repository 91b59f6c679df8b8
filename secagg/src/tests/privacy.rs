//! What the server holds and can be made to learn: only masked vectors and their running sum,
//! never both shares of one client, and no way to ask for one client's input.

use std::collections::{BTreeMap, BTreeSet};

use super::{Harness, ids, pick};
use crate::keys;
use crate::mask::{self, Op};
use crate::shares;
use crate::{Advance, ClientId, ClientMessage, Params, SecAggError as E, ServerMessage, Stage};

/// The share of elements of `a` within 2^24 of `b` mod 2^32 (about 2^-7 for a uniform `a`).
fn close_fraction(a: &[u32], b: &[u32]) -> f64 {
    let close = a.iter().zip(b).filter(|&(&x, &y)| x.wrapping_sub(y).min(y.wrapping_sub(x)) < 1 << 24).count();
    close as f64 / a.len() as f64
}

fn assert_far_from_every_input(h: &Harness, v: &[u32], what: &str) {
    for (c, x) in &h.inputs {
        let f = close_fraction(v, x);
        assert!(f < 0.05, "{what} is close to client {c}'s input in {f} of its elements");
    }
}

#[test]
fn the_server_only_ever_holds_masked_vectors_and_their_running_sum() {
    let mut h = Harness::new(30, Params::recommended(30, 0.1), 256, 31);
    let dropped = pick(30, 3, 31);
    for _ in 0..2 {
        h.stage(&BTreeSet::new());
        h.server.advance().unwrap();
    }
    let msgs = h.outgoing().into_iter().filter(|(c, _)| !dropped.contains(c)).collect();
    for (c, reply) in h.answer(msgs) {
        let ClientMessage::Masked { vector, .. } = &reply else { panic!() };
        assert_far_from_every_input(&h, vector, &format!("client {c}'s masked vector"));
        h.server.handle_message(c, reply).unwrap();
        let held = h.server.held_vectors();
        assert_eq!(held.len(), 1, "one running sum, no per-client vector");
        assert_far_from_every_input(&h, held[0], "the running sum");
    }
    h.server.advance().unwrap();
    h.stage(&BTreeSet::new());
    let Advance::Done(aggregate) = h.server.advance().unwrap() else { panic!() };
    assert_eq!(aggregate.sum, h.plain_sum(&dropped));
    assert!(h.server.held_vectors().is_empty(), "the sum left with the aggregate");
}

#[test]
fn every_share_the_server_collects_still_does_not_unmask_one_client() {
    let mut h = Harness::new(20, Params { degree: 8, threshold: 5 }, 256, 32);
    for _ in 0..2 {
        h.stage(&BTreeSet::new());
        h.server.advance().unwrap();
    }
    let masked: BTreeMap<ClientId, Vec<u32>> = h
        .stage(&BTreeSet::new())
        .into_iter()
        .map(|(c, m)| match m {
            ClientMessage::Masked { vector, .. } => (c, vector),
            _ => panic!(),
        })
        .collect();
    h.server.advance().unwrap();
    h.stage(&BTreeSet::new());
    for (u, y) in &masked {
        // u survived: the server may rebuild b_u, but holds no share of u's mask key.
        assert!(!h.server.mask_key_shares.contains_key(u));
        let b = shares::combine(&h.server.self_mask_shares[u], h.server.threshold()).unwrap();
        let mut z = y.clone();
        mask::apply(&mut z, &keys::self_mask_seed(&b, h.round), Op::Sub);
        assert_far_from_every_input(&h, &z, &format!("client {u}'s vector less its self-mask"));
    }
}

#[test]
fn a_client_never_reveals_both_shares_of_one_peer() {
    let mut h = Harness::new(12, Params { degree: 6, threshold: 4 }, 8, 33);
    for _ in 0..3 {
        h.stage(&BTreeSet::new());
        h.server.advance().unwrap();
    }
    let msgs: BTreeMap<_, _> = h.outgoing().into_iter().collect();
    let (&c, ServerMessage::Unmask { round, survivors, .. }) = msgs.iter().next().unwrap() else { panic!() };
    let (round, survivors) = (*round, survivors.clone());
    let target = survivors[0];
    let ask = |s: Vec<ClientId>, d: Vec<ClientId>| ServerMessage::Unmask { round, survivors: s, dropped: d };
    let client = h.clients.get_mut(&c).unwrap();
    assert_eq!(client.handle_message(ask(survivors.clone(), vec![target])), Err(E::BothShares(target)));
    assert!(client.handle_message(ask(survivors.clone(), vec![])).is_ok());
    assert_eq!(client.stage(), Stage::Done);
    let flipped = ask(survivors[1..].to_vec(), vec![target]);
    assert_eq!(client.handle_message(flipped), Err(E::BothShares(target)));
    assert!(matches!(client.handle_message(ask(survivors, vec![])), Err(E::WrongStage { .. })));
}

#[test]
fn a_server_that_declares_all_but_one_client_dropped_gets_no_share() {
    let n = 15;
    let mut h = Harness::new(n, Params { degree: 6, threshold: 4 }, 8, 34);
    for _ in 0..3 {
        h.stage(&BTreeSet::new());
        h.server.advance().unwrap();
    }
    let msgs: BTreeMap<_, _> = h.outgoing().into_iter().collect();
    let target = ids(n)[0];
    for (c, msg) in msgs {
        let ServerMessage::Unmask { round, survivors, dropped } = msg else { panic!() };
        let all: Vec<ClientId> = survivors.iter().chain(&dropped).copied().collect();
        let (s, d): (Vec<_>, Vec<_>) = all.into_iter().partition(|&v| v == target);
        let lie = ServerMessage::Unmask { round, survivors: s, dropped: d };
        let refused = h.clients.get_mut(&c).unwrap().handle_message(lie).unwrap_err();
        assert!(matches!(refused, E::BelowThreshold { .. }), "client {c}: {refused}");
    }
}
