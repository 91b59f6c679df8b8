//! The swarm's own promises: a seed gives the same run bit for bit, every checker catches the
//! bug it is there for (each mutation breaks its invariant, with the seed printed), a refused
//! federation is refused before the run with the table's message, and the CI seeds hold.

use std::sync::Arc;
use std::time::Duration;

use anchorage_server::engine::{RoundOutcome, RoundReport, UpdateReport};

use super::checker::{Checker, Expect};
use super::{Invariant, Outcome, Verdict, draw, run_seed};
use crate::virtual_clock::{Mutation, Seen, Step};

/// The first seed from `from` whose drawn text satisfies `wanted` and that the table lets run,
/// with its run.
fn seed_where(from: u64, wanted: impl Fn(&str) -> bool) -> (u64, Outcome) {
    (from..from + 500)
        .filter(|&s| wanted(&draw(s).toml))
        .map(|s| (s, run_seed(s, None)))
        .find(|(_, o)| !matches!(o.verdict, Verdict::Refused(_)))
        .expect("a seed in 500 draws")
}

/// A small synchronous federation with no relays and no DP (quick, and every mutation applies).
fn plain(t: &str) -> bool {
    !t.contains("[relays]") && !t.contains("buffered") && !t.contains("[privacy]") && !t.contains("[secagg]")
}

#[test]
fn a_seed_gives_the_same_run_bit_for_bit() {
    let (seed, a) = seed_where(0, |t| t.contains("[relays]") && t.contains("crash_probability"));
    let b = run_seed(seed, None);
    assert!(a.steps > 10, "seed {seed} ran {} steps", a.steps);
    assert_eq!((a.trace, a.steps, a.checks), (b.trace, b.steps, b.checks), "seed {seed}");
    assert_eq!(a.verdict, b.verdict);
    let other = run_seed(seed + 1, None);
    assert_ne!(a.trace, other.trace, "seeds {seed} and {} ran alike", seed + 1);
}

#[test]
fn every_checker_catches_its_bug_with_the_seed_printed() {
    let (seed, _) = seed_where(0, plain);
    let cases = [
        (Mutation::ForgetAckedUpdate, Invariant::AckMeansCounted),
        (Mutation::CountTwice, Invariant::CountedOnce),
        (Mutation::ReuseRound, Invariant::RoundsGrow),
        (Mutation::PoisonModel, Invariant::FiniteModel),
        (Mutation::LoseCost, Invariant::CostOnce),
        (Mutation::DropBroadcasts, Invariant::Liveness),
        (Mutation::ClaimAhead, Invariant::NoFalseAlarm),
        (Mutation::AckUncommitted, Invariant::AckAfterCommit),
    ];
    let (three_rounds, _) = seed_where(0, |t| plain(t) && !t.contains("rounds = 2\n"));
    for (mutation, invariant) in cases {
        let seed = if mutation == Mutation::ReuseRound { three_rounds } else { seed };
        let outcome = run_seed(seed, Some(mutation));
        let Verdict::Broken(v) = &outcome.verdict else { panic!("{mutation:?} on seed {seed}: {:?}", outcome.verdict) };
        assert_eq!(v.invariant, invariant, "{mutation:?} on seed {seed}: {v}");
        let line = outcome.failure().expect("a failure line");
        assert!(line.contains(&format!("anchorage swarm --seed {seed} --mutate {}", mutation.name())), "{line}");
        println!("{line}");
    }
}

/// A round closed with a model, counting `clients`.
fn closed(round: u64, clients: &[&str]) -> Seen {
    let updates = clients.iter().map(|c| UpdateReport { client: c.to_string(), ..UpdateReport::default() }).collect();
    let report = RoundReport {
        round,
        outcome: RoundOutcome::Aggregated,
        sampled: clients.len(),
        target: clients.len(),
        updates,
        missing: Vec::new(),
        declined: Vec::new(),
        duplicates: 0,
        refused: 0,
        late_total: 0,
        payload_down: 0,
        started: Duration::ZERO,
        closed: Duration::from_secs(round),
        influence: Default::default(),
        held_out_accuracy: None,
        privacy: None,
        secagg: None,
    };
    Seen::Closed { report: Arc::new(report), finite: true }
}

fn expect(invites_all: bool) -> Expect {
    Expect {
        rounds: 6,
        clients: 2,
        min_available: 1,
        buffered: false,
        invites_all,
        stall: Duration::from_secs(1000),
        hostile: Default::default(),
    }
}

/// Feeds `seen` to a checker one step each; the first violation.
fn feed(checker: &mut Checker, seen: Vec<Seen>) -> Option<Invariant> {
    seen.into_iter().enumerate().find_map(|(i, s)| {
        let step = Step { number: i as u64 + 1, now: Duration::from_secs(i as u64), seen: std::slice::from_ref(&s) };
        checker.step(&step).err().map(|v| v.invariant)
    })
}

/// With fewer honest devices online than `min_available` a stall is no broken promise, until
/// it lasts [`super::checker::GIVE_UP_AFTER_STALLS`] stall bounds: then the run ends as broken
/// `liveness` instead of going on forever (`clients` below `min_available` did, in `--shrink`).
#[test]
fn a_federation_that_cannot_go_on_ends_as_broken_liveness() {
    let at = |secs: u64, seen: &[Seen]| -> Option<Invariant> {
        let mut checker = Checker::new(Expect { min_available: 3, ..expect(false) });
        let first = Step { number: 1, now: Duration::ZERO, seen };
        checker.step(&first).err().map(|v| v.invariant).or_else(|| {
            let later = Step { number: 2, now: Duration::from_secs(secs), seen: &[] };
            checker.step(&later).err().map(|v| v.invariant)
        })
    };
    let stall = expect(false).stall.as_secs();
    assert_eq!(at(stall * 2, &[]), None, "2 honest devices of min_available 3: no promise yet");
    assert_eq!(at(stall * u64::from(super::checker::GIVE_UP_AFTER_STALLS) + 1, &[]), Some(Invariant::Liveness));
}

#[test]
fn a_device_back_and_never_invited_again_is_caught() {
    let back = |invited: bool| {
        let mut seen = vec![closed(1, &["client-000", "client-001"]), Seen::Offline { client: 1, crash: true }];
        seen.push(Seen::Online { client: 1 });
        for round in 2..=4 {
            let clients =
                if invited { vec!["client-000".into(), "client-001".into()] } else { vec!["client-000".into()] };
            seen.push(Seen::Invited { round, clients });
            seen.push(closed(round, &["client-000"]));
        }
        feed(&mut Checker::new(expect(true)), seen)
    };
    assert_eq!(back(false), Some(Invariant::BackWithinRounds));
    assert_eq!(back(true), None, "invited again: the promise holds");
}

#[test]
fn a_relay_restarted_and_never_counted_again_is_caught() {
    let mut seen = vec![closed(1, &["relay-0", "relay-1"]), Seen::RelayRestarted { relay: 1 }];
    for round in 2..=4 {
        seen.push(closed(round, &["relay-0"]));
    }
    assert_eq!(feed(&mut Checker::new(expect(false)), seen), Some(Invariant::BackWithinRounds));
}

/// A relay that went down again after a restart is not due back until it has started again;
/// from then on, the promise counts again.
#[test]
fn a_relay_down_again_is_not_due_back_until_it_starts() {
    let mut seen =
        vec![closed(1, &["relay-0", "relay-1"]), Seen::RelayRestarted { relay: 1 }, Seen::RelayDown { relay: 1 }];
    for round in 2..=4 {
        seen.push(closed(round, &["relay-0"]));
    }
    assert_eq!(feed(&mut Checker::new(expect(false)), seen.clone()), None, "down: not back yet");
    seen.push(Seen::RelayRestarted { relay: 1 });
    for round in 5..=7 {
        seen.push(closed(round, &["relay-0"]));
    }
    assert_eq!(feed(&mut Checker::new(expect(false)), seen), Some(Invariant::BackWithinRounds));
}

#[test]
fn a_relay_ack_of_an_update_its_partial_did_not_bring_into_the_round_is_caught() {
    let ack = Seen::Ack { relay: Some(0), client: "client-000".into(), round: 1, aggregated: true };
    let accepted = |members: &[&str]| Seen::PartialAccepted {
        relay: 0,
        round: 1,
        members: members.iter().map(|m| m.to_string()).collect(),
    };
    let run = |seen: Vec<Seen>| {
        let mut seen = seen;
        seen.push(closed(1, &["relay-0"]));
        feed(&mut Checker::new(expect(false)), seen)
    };
    assert_eq!(run(vec![ack.clone()]), Some(Invariant::AckMeansCounted), "no partial of relay-0 counted");
    assert_eq!(run(vec![ack.clone(), accepted(&["client-001"])]), Some(Invariant::AckMeansCounted), "not in it");
    assert_eq!(run(vec![ack, accepted(&["client-000"])]), None);
}

#[test]
fn a_federation_the_table_refuses_is_refused_before_the_run() {
    let seed = (0..500).find(|&s| matches!(run_seed(s, None).verdict, Verdict::Refused(_))).expect("a refused draw");
    let outcome = run_seed(seed, None);
    let Verdict::Refused(why) = &outcome.verdict else { unreachable!() };
    assert_eq!(outcome.steps, 0, "refused before the first step");
    assert!(why.contains('`') || why.contains('['), "the table's message: {why}");
}

/// The CI set: seeds drawn over every topology (0 to 4 relays, restarts, outages, failovers),
/// both modes, SecAgg, DP, hostile devices, crashes and cycles; each must hold. 29 and 84
/// failed every round before a secure round waited for three devices; 23 and 88 broke
/// `ack_means_counted` while a relay acked an update on its arrival (its partial reached the
/// root after the root closed the round: a slow link, a restart in the last round); 482 broke
/// `counted_once` while a buffered device could be dispatched again with its update in the
/// buffer; 568 (`liveness`) while a restarted relay told devices resending the round it waited
/// to reopen that they were not sampled; 1385 (`liveness`) while a relay's store could hold two
/// open rounds, or a round above a gap its parent ran without it; 5878 (SecAgg over 3g) failed
/// every round while the draw left the stages' timeout at 30 s; 298 (`no_false_alarm`: a relay
/// down for a while, its devices back from rounds its sibling ran) while a relay took devices'
/// rounds as rollback evidence; 1029 restarts a relay twice in one round, the second time down
/// for 42 s (not due back while down).
pub(super) const CI_SEEDS: &[u64] =
    &[2, 3, 5, 6, 7, 9, 10, 11, 13, 16, 23, 29, 58, 84, 88, 298, 482, 568, 1029, 1385, 5878];

#[test]
fn the_ci_seeds_hold() {
    for &seed in CI_SEEDS {
        let outcome = run_seed(seed, None);
        assert!(!matches!(outcome.verdict, Verdict::Broken(_)), "{}", outcome.failure().unwrap_or_default());
    }
}

/// Seed 45's draw before deadlines were drawn to fit the links: buffered, 3 devices, all three
/// dispatched on version 0, two of them give up (a crash, a slow 3g link). Before the fix the
/// two were never idle again for version 0, the buffer never filled and the run stopped with
/// no event left after 0 of 6 versions ("the run stopped after 0 of 6 rounds, unfinished").
const BUFFERED_GIVEN_UP: &str = r#"clock = "virtual"
seed = 45
threads = 1
clients = 3
rounds = 6
round_deadline_secs = 25.0
local_epochs = 2
batch_size = 16
train_per_class = 10
test_per_class = 4
eval_every = 1000
fraction = 1
over_selection = 0.5
min_available = 1
aggregation = { kind = "buffered", buffer = 2, concurrency = 3, max_staleness = 2 }
link = "3g"
encoding = "f16"
top_k = 1
robust = { max_norm_z = 3.5 }

[[devices]]
name = "kind-0"
share = 1.0
compute_seconds = 2
crash_probability = 0.05
rejoin_seconds = 9.0

[[devices]]
name = "kind-1"
share = 1.0
compute_seconds = 2
crash_probability = 0.05
rejoin_seconds = 22.0

[method]
name = "fedavg"
"#;

#[test]
fn a_buffered_version_that_devices_gave_up_on_still_fills() {
    let drawn = super::Drawn { toml: BUFFERED_GIVEN_UP.into(), faults: Default::default() };
    let outcome = super::run_drawn(45, &drawn, None);
    assert!(matches!(outcome.verdict, Verdict::Held { rounds: 6 }), "{:?}", outcome.verdict);
}

/// `--shrink` finds a smaller federation that breaks the same promise: seed 2 under the
/// count-twice mutation shrinks, within 40 runs, to a config with fewer keys and no more
/// clients or rounds, which still breaks `counted_once` when run again.
#[test]
fn shrink_finds_a_smaller_config_that_breaks_the_same_promise() {
    let drawn = draw(2);
    let (small, runs) = super::shrink(2, &drawn, Some(Mutation::CountTwice), Invariant::CountedOnce, 40);
    assert!(runs > 0 && runs <= 40, "{runs} runs");
    let keys = |t: &str| t.lines().filter(|l| l.contains(" = ")).count();
    assert!(keys(&small.toml) < keys(&drawn.toml), "smaller:\n{}", small.toml);
    let table: toml::Table = toml::from_str(&small.toml).unwrap();
    let drawn_table: toml::Table = toml::from_str(&drawn.toml).unwrap();
    for key in ["clients", "rounds"] {
        assert!(table[key].as_integer() <= drawn_table[key].as_integer(), "{key}: {}", small.toml);
    }
    let again = super::run_drawn(2, &small, Some(Mutation::CountTwice));
    assert!(
        matches!(&again.verdict, Verdict::Broken(v) if v.invariant == Invariant::CountedOnce),
        "{:?}",
        again.verdict
    );
}
