//! Every class of malformed message is refused with its typed error, by the server and by a
//! client, and the refusing state is unchanged: the round still ends with the right sum.

use std::collections::{BTreeMap, BTreeSet};

use super::Harness;
use crate::keys;
use crate::messages::EncryptedShare;
use crate::shares::SharePair;
use crate::{Advance, Aggregate, ClientId, ClientMessage, Params, PublicKeys, SecAggError as E, ServerMessage};

type Sealed = Vec<(ClientId, EncryptedShare)>;
type Answers = Vec<(ClientId, [u8; 32])>;
type Keys = Vec<(ClientId, PublicKeys)>;

const SPARSE: Params = Params { degree: 6, threshold: 4 };

/// Runs `stages` whole stages, then returns the next stage's server messages by client.
fn at_stage(h: &mut Harness, stages: usize) -> BTreeMap<ClientId, ServerMessage> {
    for _ in 0..stages {
        h.stage(&BTreeSet::new());
        h.server.advance().unwrap();
    }
    h.outgoing().into_iter().collect()
}

/// Answers `msgs` genuinely, then runs the round to its end.
fn finish(h: &mut Harness, msgs: BTreeMap<ClientId, ServerMessage>) -> Aggregate {
    let replies = h.answer(msgs.into_iter().collect());
    h.deliver(replies);
    loop {
        match h.server.advance().unwrap() {
            Advance::Done(aggregate) => return aggregate,
            Advance::Next(_) => {
                h.stage(&BTreeSet::new());
            }
        }
    }
}

fn first(msgs: &BTreeMap<ClientId, ServerMessage>) -> (ClientId, ServerMessage) {
    msgs.iter().next().map(|(c, m)| (*c, m.clone())).unwrap()
}

#[test]
fn undecodable_bytes_are_refused() {
    assert!(matches!(ClientMessage::decode(&[0xff, 0x01]), Err(E::Decode(_))));
    assert!(matches!(ServerMessage::decode(&[]), Err(E::Decode(_))));
    let masked = ClientMessage::Masked { round: 1, vector: vec![1, 2] }.encode();
    let mut odd = masked.clone();
    odd[2] -= 1; // a byte string of 7 bytes: not whole u32s
    odd.pop();
    assert!(matches!(ClientMessage::decode(&odd), Err(E::Decode(_))));
    assert_eq!(ClientMessage::decode(&masked).unwrap(), ClientMessage::Masked { round: 1, vector: vec![1, 2] });
}

#[test]
fn the_server_refuses_malformed_round_0_messages() {
    let mut h = Harness::new(20, SPARSE, 8, 21);
    let msgs = h.outgoing();
    let keys = h.answer(msgs);
    let (c, good) = keys[0].clone();
    let r = h.round;
    assert_eq!(h.server.handle_message(ClientId(5), good.clone()), Err(E::UnknownSender(ClientId(5))));
    let masked = ClientMessage::Masked { round: r, vector: vec![0; 8] };
    assert!(matches!(h.server.handle_message(c, masked), Err(E::WrongStage { .. })));
    let ClientMessage::Keys { keys: pk, .. } = good.clone() else { panic!() };
    let stale = ClientMessage::Keys { round: r + 1, keys: pk };
    assert_eq!(h.server.handle_message(c, stale), Err(E::WrongRound { expected: r, got: r + 1 }));
    let low_order = ClientMessage::Keys { round: r, keys: PublicKeys { mask: [0; 32], encrypt: pk.encrypt } };
    assert_eq!(h.server.handle_message(c, low_order), Err(E::BadKey(c)));
    h.deliver(keys);
    assert_eq!(h.server.handle_message(c, good), Err(E::Duplicate(c)));
    assert_eq!(finish(&mut h, BTreeMap::new()).sum, h.plain_sum(&BTreeSet::new()));
}

#[test]
fn the_server_refuses_malformed_share_lists() {
    let mut h = Harness::new(20, SPARSE, 8, 22);
    let silent: BTreeSet<ClientId> = [super::ids(20)[19]].into();
    h.stage(&silent);
    h.server.advance().unwrap();
    let msgs = h.outgoing();
    let replies = h.answer(msgs);
    let (c, ClientMessage::Shares { round, shares }) = replies[0].clone() else { panic!() };
    let with = |f: &dyn Fn(&mut Sealed)| {
        let mut s = shares.clone();
        f(&mut s);
        ClientMessage::Shares { round, shares: s }
    };
    let stranger = super::ids(20).into_iter().find(|v| *v != c && !shares.iter().any(|(to, _)| to == v)).unwrap();
    assert_eq!(h.server.handle_message(c, with(&|s| s[0].0 = stranger)), Err(E::NotNeighbour(stranger)));
    assert!(matches!(
        h.server.handle_message(
            c,
            with(&|s| {
                s[0].1.0.pop();
            })
        ),
        Err(E::WrongLength { .. })
    ));
    assert_eq!(h.server.handle_message(c, with(&|s| s[1].0 = s[0].0)), Err(E::Duplicate(shares[0].0)));
    assert!(matches!(
        h.server.handle_message(
            c,
            with(&|s| {
                s.pop();
            })
        ),
        Err(E::WrongLength { .. })
    ));
    assert_eq!(
        h.server.handle_message(silent.first().copied().unwrap(), with(&|_| ())),
        Err(E::Excluded(silent.first().copied().unwrap()))
    );
    h.deliver(replies);
    assert_eq!(finish(&mut h, BTreeMap::new()).sum, h.plain_sum(&silent));
}

#[test]
fn the_server_refuses_malformed_masked_vectors_and_unmask_answers() {
    let mut h = Harness::new(20, SPARSE, 8, 23);
    let msgs = at_stage(&mut h, 2);
    let replies = h.answer(msgs.into_iter().collect());
    let (c, good) = replies[0].clone();
    let short = ClientMessage::Masked { round: h.round, vector: vec![0; 7] };
    assert_eq!(h.server.handle_message(c, short), Err(E::WrongLength { what: "masked vector", expected: 8, got: 7 }));
    h.deliver(replies);
    assert_eq!(h.server.handle_message(c, good.clone()), Err(E::Duplicate(c)));
    h.server.advance().unwrap();
    let msgs = h.outgoing();
    let answers = h.answer(msgs);
    assert!(matches!(h.server.handle_message(c, good), Err(E::WrongStage { .. })), "a late masked vector is refused");
    let (c, ClientMessage::Unmask { round, self_mask, mask_key }) = answers[0].clone() else { panic!() };
    let with = |f: &dyn Fn(&mut Answers)| {
        let mut s = self_mask.clone();
        f(&mut s);
        ClientMessage::Unmask { round, self_mask: s, mask_key: mask_key.clone() }
    };
    assert_eq!(h.server.handle_message(c, with(&|s| s[0].0 = c)), Err(E::WrongPeer { from: c }));
    assert_eq!(h.server.handle_message(c, with(&|s| s[0].1 = [0xff; 32])), Err(E::BadShare(c)));
    assert_eq!(h.server.handle_message(c, with(&|s| s[1].0 = s[0].0)), Err(E::Duplicate(self_mask[0].0)));
    assert!(matches!(
        h.server.handle_message(
            c,
            with(&|s| {
                s.pop();
            })
        ),
        Err(E::WrongLength { .. })
    ));
    h.deliver(answers);
    let Advance::Done(aggregate) = h.server.advance().unwrap() else { panic!() };
    assert_eq!(aggregate.sum, h.plain_sum(&BTreeSet::new()));
}

#[test]
fn a_client_refuses_a_malformed_setup() {
    let mut h = Harness::new(10, SPARSE, 8, 24);
    let msgs: BTreeMap<_, _> = h.outgoing().into_iter().collect();
    let (c, ServerMessage::Setup(config)) = first(&msgs) else { panic!() };
    let client = h.clients.get_mut(&c).unwrap();
    let early = ServerMessage::ShareKeys { round: config.round, keys: vec![] };
    assert!(matches!(client.handle_message(early), Err(E::WrongStage { .. })));
    let mut cfg = config.clone();
    cfg.vector_len = 9;
    assert!(matches!(client.handle_message(ServerMessage::Setup(cfg)), Err(E::WrongLength { .. })));
    let mut cfg = config.clone();
    cfg.clients.retain(|&v| v != c);
    assert!(matches!(client.handle_message(ServerMessage::Setup(cfg)), Err(E::BadParams(_))));
    let mut cfg = config.clone();
    cfg.params.threshold = 2;
    assert!(matches!(client.handle_message(ServerMessage::Setup(cfg)), Err(E::BadParams(_))));
    assert_eq!(finish(&mut h, msgs).sum, h.plain_sum(&BTreeSet::new()));
}

#[test]
fn a_client_refuses_malformed_neighbour_keys() {
    let mut h = Harness::new(20, SPARSE, 8, 25);
    let msgs = at_stage(&mut h, 1);
    let (c, ServerMessage::ShareKeys { round, keys }) = first(&msgs) else { panic!() };
    let with = |f: &dyn Fn(&mut Keys)| {
        let mut k = keys.clone();
        f(&mut k);
        ServerMessage::ShareKeys { round, keys: k }
    };
    let stranger = super::ids(20).into_iter().find(|v| !keys.iter().any(|(n, _)| n == v) && *v != c).unwrap();
    let client = h.clients.get_mut(&c).unwrap();
    let stale = ServerMessage::ShareKeys { round: round + 1, keys: keys.clone() };
    assert_eq!(client.handle_message(stale), Err(E::WrongRound { expected: round, got: round + 1 }));
    assert_eq!(client.handle_message(with(&|k| k[0].0 = stranger)), Err(E::NotNeighbour(stranger)));
    assert_eq!(client.handle_message(with(&|k| k[0].0 = c)), Err(E::NotNeighbour(c)));
    assert_eq!(client.handle_message(with(&|k| k[1].0 = k[0].0)), Err(E::Duplicate(keys[0].0)));
    assert_eq!(client.handle_message(with(&|k| k[0].1.encrypt = [0; 32])), Err(E::BadKey(keys[0].0)));
    assert!(matches!(client.handle_message(with(&|k| k.truncate(3))), Err(E::BelowThreshold { .. })));
    assert_eq!(finish(&mut h, msgs).sum, h.plain_sum(&BTreeSet::new()));
}

#[test]
fn a_client_refuses_malformed_encrypted_shares() {
    let mut h = Harness::new(20, SPARSE, 8, 26);
    let msgs = at_stage(&mut h, 2);
    let (c, ServerMessage::CollectMasked { round, shares }) = first(&msgs) else { panic!() };
    let with = |f: &dyn Fn(&mut Sealed)| {
        let mut s = shares.clone();
        f(&mut s);
        ServerMessage::CollectMasked { round, shares: s }
    };
    let (v, w) = (shares[0].0, shares[1].0);
    let forged = forged_share(&h, v, c, w, round);
    let client = h.clients.get_mut(&c).unwrap();
    assert_eq!(client.handle_message(with(&|s| s[0].1.0[3] ^= 1)), Err(E::BadTag(v)));
    assert_eq!(client.handle_message(with(&|s| s[0] = s[1].clone())), Err(E::Duplicate(w)));
    assert_eq!(client.handle_message(with(&|s| s[0].1 = s[1].1.clone())), Err(E::BadTag(v)), "relabelled");
    assert!(matches!(client.handle_message(with(&|s| s[0].1.0.push(0))), Err(E::WrongLength { .. })));
    assert_eq!(client.handle_message(with(&|s| s[0].0 = c)), Err(E::NotNeighbour(c)));
    assert_eq!(client.handle_message(with(&|s| s[0].1 = forged.clone())), Err(E::WrongPeer { from: v }));
    assert!(matches!(client.handle_message(with(&|s| s.truncate(3))), Err(E::BelowThreshold { .. })));
    assert_eq!(finish(&mut h, msgs).sum, h.plain_sum(&BTreeSet::new()));
}

/// A share pair that `v` seals correctly to `c` but that names `w` as its holder (a lying peer).
fn forged_share(h: &Harness, v: ClientId, c: ClientId, w: ClientId, round: u64) -> EncryptedShare {
    let secrets = h.clients[&v].secrets().unwrap();
    let to = h.clients[&c].secrets().unwrap().public();
    let pair = SharePair { round, owner: v, holder: w, self_mask: [1; 32], mask_key: [2; 32] };
    let shared = keys::agree(&secrets.encrypt_key, &to.encrypt, c).unwrap();
    let key = keys::share_key(&shared, round, v, c);
    EncryptedShare(keys::seal(&key, &keys::share_aad(round, v, c), &pair.to_bytes()))
}

#[test]
fn a_client_refuses_inconsistent_survivor_and_dropped_lists() {
    let mut h = Harness::new(20, SPARSE, 8, 27);
    let msgs = at_stage(&mut h, 3);
    let (c, ServerMessage::Unmask { round, survivors, dropped }) = first(&msgs) else { panic!() };
    assert!(dropped.is_empty() && survivors.len() == 6);
    let stranger = super::ids(20).into_iter().find(|v| !survivors.contains(v) && *v != c).unwrap();
    let ask = |s: Vec<ClientId>, d: Vec<ClientId>| ServerMessage::Unmask { round, survivors: s, dropped: d };
    let client = h.clients.get_mut(&c).unwrap();
    let missing = survivors[1..].to_vec();
    assert!(matches!(client.handle_message(ask(missing.clone(), vec![])), Err(E::Inconsistent(_))));
    let with_stranger = [survivors.clone(), vec![stranger]].concat();
    assert!(matches!(client.handle_message(ask(with_stranger, vec![])), Err(E::Inconsistent(_))));
    assert!(matches!(client.handle_message(ask(survivors.clone(), vec![c])), Err(E::Inconsistent(_))));
    let twice = [survivors.clone(), vec![survivors[0]]].concat();
    assert_eq!(client.handle_message(ask(twice, vec![])), Err(E::Duplicate(survivors[0])));
    assert!(matches!(
        client.handle_message(ask(survivors[..3].to_vec(), survivors[3..].to_vec())),
        Err(E::BelowThreshold { .. })
    ));
    let stale = ServerMessage::Unmask { round: round + 1, survivors: survivors.clone(), dropped: vec![] };
    assert!(matches!(client.handle_message(stale), Err(E::WrongRound { .. })));
    let Advance::Done(aggregate) = ({
        let replies = h.answer(msgs.into_iter().collect());
        h.deliver(replies);
        h.server.advance().unwrap()
    }) else {
        panic!()
    };
    assert_eq!(aggregate.sum, h.plain_sum(&BTreeSet::new()));
}
