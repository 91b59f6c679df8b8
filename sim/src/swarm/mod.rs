//! `anchorage swarm`: a whole federation drawn from one seed ([`mod@draw`]), run on the virtual clock
//! from the real cores (the engines, relay uplinks and device sessions), with every promise
//! checked after every step ([`checker`]). A broken promise stops the run and names the seed, the
//! step and the invariant; the same seed gives the same run, bit for bit.
//! [`shrink()`] looks for a smaller federation that still breaks the same promise.

pub mod checker;
pub mod draw;
mod shrink;
#[cfg(test)]
mod tests;

use std::hash::{DefaultHasher, Hash, Hasher};
use std::ops::ControlFlow;
use std::time::Duration;

pub use checker::{INVARIANTS, Invariant, Violation};
pub use draw::{Drawn, Faults, draw};
pub use shrink::shrink;

use crate::config::SimConfig;
use crate::virtual_clock::{Mutation, Seen, WatchOptions, run_virtual_watched};
use checker::{Checker, Expect};

/// How one seed's run ended.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub enum Verdict {
    /// Every promise held to the end, over this many closed rounds.
    Held { rounds: u64 },
    /// A promise broke.
    Broken(Violation),
    /// The drawn federation was refused before the run (the compatibility table's message, or
    /// the config reader's).
    Refused(String),
}

/// One seed's run: what was drawn, what happened, what the checker did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Outcome {
    pub seed: u64,
    pub verdict: Verdict,
    /// Steps run (events, deadlines, trainings that landed).
    pub steps: u64,
    /// Promises tested.
    pub checks: u64,
    pub faults: Faults,
    /// Device crashes and relay restarts that happened.
    pub crashes: u64,
    pub relay_restarts: u64,
    /// Messages up (device to server, relay to root) delivered twice.
    pub duplicated: u64,
    /// A hash of everything the watcher saw, step by step: equal for equal runs.
    pub trace: u64,
    /// The stand-in for a bug the run carried, if any.
    pub mutation: Option<Mutation>,
}

impl Outcome {
    /// The line a failure prints, with the seed to reproduce it.
    pub fn failure(&self) -> Option<String> {
        self.failure_of(None)
    }

    /// [`Outcome::failure`] of a run of the config file `config` (`anchorage swarm --config`),
    /// whose reproduce line names the file.
    pub fn failure_of(&self, config: Option<&std::path::Path>) -> Option<String> {
        let Verdict::Broken(v) = &self.verdict else { return None };
        let mutate = self.mutation.map(|m| format!(" --mutate {}", m.name())).unwrap_or_default();
        let file = config.map(|c| format!(" --config {}", c.display())).unwrap_or_default();
        Some(format!("seed {}: {v}\n  reproduce with `anchorage swarm{file} --seed {}{mutate}`", self.seed, self.seed))
    }
}

/// Runs seed `seed`'s federation (its drawn text `drawn`, unless given) with every checker on;
/// `mutation`: a stand-in for a bug, for the checkers' own tests.
pub fn run_seed(seed: u64, mutation: Option<Mutation>) -> Outcome {
    run_drawn(seed, &draw(seed), mutation)
}

/// Runs a drawn federation with every checker on.
pub fn run_drawn(seed: u64, drawn: &Drawn, mutation: Option<Mutation>) -> Outcome {
    let mut outcome = Outcome {
        seed,
        verdict: Verdict::Refused(String::new()),
        steps: 0,
        checks: 0,
        faults: drawn.faults,
        crashes: 0,
        relay_restarts: 0,
        duplicated: 0,
        trace: 0,
        mutation,
    };
    let config = match draw::config_of(drawn) {
        Ok(config) => config,
        Err(e) => {
            outcome.verdict = Verdict::Refused(format!("{e:#}"));
            return outcome;
        }
    };
    let mut checker = Checker::new(expect_of(&config));
    let mut hasher = DefaultHasher::new();
    let mut broken = None;
    let mut last = (0, Duration::ZERO);
    let options = WatchOptions { mutation, duplicate: duplicate_of(seed), seed };
    let result = run_virtual_watched(&config, options, |step| {
        last = (step.number, step.now);
        step.number.hash(&mut hasher);
        step.now.hash(&mut hasher);
        for seen in step.seen {
            tracing::debug!(step = step.number, at = step.now.as_secs_f64(), "{seen:?}");
            fingerprint(seen).hash(&mut hasher);
            match seen {
                Seen::Offline { crash: true, .. } => outcome.crashes += 1,
                Seen::RelayRestarted { .. } => outcome.relay_restarts += 1,
                _ => {}
            }
        }
        match checker.step(&step) {
            Ok(()) => ControlFlow::Continue(()),
            Err(v) => {
                broken = Some(v);
                ControlFlow::Break(())
            }
        }
    });
    outcome.steps = last.0;
    outcome.trace = hasher.finish();
    let result = result.map(|(r, duplicated)| {
        outcome.duplicated = duplicated;
        r
    });
    outcome.verdict = match (result, broken) {
        (_, Some(v)) => Verdict::Broken(v),
        // Refused by the setup before the first event: the compatibility table, or a value.
        (Err(e), None) if last.0 == 0 => Verdict::Refused(format!("{e:#}")),
        (Err(e), None) => Verdict::Broken(Violation {
            invariant: Invariant::Liveness,
            step: last.0,
            at: last.1,
            detail: format!("the run failed: {e:#}"),
        }),
        (Ok(_), None) => match checker.end(last.0, last.1) {
            Ok(()) => Verdict::Held { rounds: checker.rounds() },
            Err(v) => Verdict::Broken(v),
        },
    };
    outcome.checks = checker.checks;
    outcome
}

/// What the trace hashes of one `Seen`: everything but what the host measures (a report's
/// per-update metrics carry the process's peak RSS), so equal runs hash alike on any machine.
fn fingerprint(seen: &Seen) -> String {
    match seen {
        Seen::Closed { report, finite } => {
            let updates: Vec<_> = report.updates.iter().map(|u| (&u.client, u.num_samples, u.payload_up)).collect();
            let times = (report.started, report.closed);
            format!("Closed {} {:?} {updates:?} {:?} {times:?} {finite}", report.round, report.outcome, report.missing)
        }
        other => format!("{other:?}"),
    }
}

/// The probability that a message sent up arrives again, drawn from its own stream of the seed
/// (so the federation's draw does not depend on it): none in half the seeds.
pub fn duplicate_of(seed: u64) -> f64 {
    let mut rng = anchorage_shared::rng::Rng::derive(seed, 0x000D_0B1E_D4A3);
    if rng.f64() < 0.5 { 0.0 } else { [0.02, 0.1, 0.3][rng.below(3) as usize] }
}

/// What the checker expects of `config`'s federation.
fn expect_of(config: &SimConfig) -> Expect {
    let f = &config.federation;
    let s = &config.systems;
    let deadline = Duration::from_secs_f64(f.round_deadline_secs.max(1.0));
    let longest = |x: f64| Duration::from_secs_f64(x.max(0.0));
    let rejoin = s.devices.iter().map(|d| d.rejoin_seconds).fold(0.0, f64::max);
    let off = s.devices.iter().filter_map(|d| d.on_off.as_ref()).map(|o| o.off_seconds).fold(0.0, f64::max);
    let outage = s.relays.iter().flat_map(|r| &r.outages).map(|o| o.duration_ms as f64 / 1000.0).fold(0.0, f64::max);
    let down = s.relays.iter().flat_map(|r| &r.restarts).map(|r| r.down_ms as f64 / 1000.0).fold(0.0, f64::max);
    let eligibility = s.devices.iter().any(|d| d.eligibility != Default::default());
    Expect {
        rounds: f.rounds,
        clients: f.clients,
        min_available: f.min_available.unwrap_or(f.clients),
        buffered: f.aggregation != Default::default(),
        invites_all: f.fraction >= 1.0 && s.relays.is_none() && !eligibility && f.aggregation == Default::default(),
        stall: deadline * 4 + longest(rejoin + off + outage + down) + Duration::from_secs(60),
        hostile: f.attack.iter().flat_map(|a| a.clients.iter().copied()).collect(),
    }
}
