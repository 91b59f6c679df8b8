//! The promises a swarm run checks after every step, each a named [`Invariant`], judged from
//! what the run shows its watcher ([`Seen`]). The checker keeps only what the promises need:
//! the rounds closed with the devices each counted, the acks still waiting for their round,
//! the ledger's keys, who is online, when the federation last made progress.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::time::Duration;

use anchorage_server::engine::RoundOutcome;

use crate::setup::client_id;
use crate::virtual_clock::{Seen, Step};

/// One promise of Anchorage, as the checker tests it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub enum Invariant {
    /// An ack `aggregated: true` from the root means the update is in that round's global
    /// model (buffered: in a later version); from a relay, that the relay's partial of that
    /// round reached the root holding it.
    AckMeansCounted,
    /// An ack `aggregated: true` is queued only after its server committed what it acknowledges:
    /// the accepted update (a relay's partial, at the root), or, under SecAgg, the closed round
    /// that holds the device.
    AckAfterCommit,
    /// A device is counted at most once in a round, across relays.
    CountedOnce,
    /// Round numbers only grow and are never reused.
    RoundsGrow,
    /// Every round acked before the root's goodbye has its cost record in the root's ledger,
    /// exactly once.
    CostOnce,
    /// The global model stays finite.
    FiniteModel,
    /// A restarted relay is counted again within [`BACK_WITHIN`] rounds; a device that comes
    /// back is invited again within as many (when every device is invited every round).
    BackWithinRounds,
    /// While `min_available` honest devices are online, rounds keep closing with a model; the
    /// run ends with the root's goodbye, and not with every round failed.
    Liveness,
    /// No server takes an honest federation for a damaged one: the swarm never rolls a store
    /// back, so no server sees rollback evidence (devices ahead of its rounds).
    NoFalseAlarm,
}

/// Every invariant, in the order the ledger of a long run lists them.
pub const INVARIANTS: [Invariant; 9] = [
    Invariant::AckMeansCounted,
    Invariant::AckAfterCommit,
    Invariant::CountedOnce,
    Invariant::RoundsGrow,
    Invariant::CostOnce,
    Invariant::FiniteModel,
    Invariant::BackWithinRounds,
    Invariant::Liveness,
    Invariant::NoFalseAlarm,
];

impl Invariant {
    pub fn name(self) -> &'static str {
        match self {
            Self::AckMeansCounted => "ack_means_counted",
            Self::AckAfterCommit => "ack_after_commit",
            Self::CountedOnce => "counted_once",
            Self::RoundsGrow => "rounds_grow",
            Self::CostOnce => "cost_once",
            Self::FiniteModel => "finite_model",
            Self::BackWithinRounds => "back_within_rounds",
            Self::Liveness => "liveness",
            Self::NoFalseAlarm => "no_false_alarm",
        }
    }
}

/// Rounds within which a restarted peer is counted (or invited) again.
pub const BACK_WITHIN: u64 = 2;

/// A broken promise: which, at which step and simulated time, and what the checker saw.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Violation {
    pub invariant: Invariant,
    pub step: u64,
    pub at: Duration,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invariant {} broke at step {} ({:.3} simulated s): {}",
            self.invariant.name(),
            self.step,
            self.at.as_secs_f64(),
            self.detail
        )
    }
}

/// What the checker needs to know of the drawn federation.
#[derive(Debug, Clone)]
pub struct Expect {
    pub rounds: u64,
    pub clients: usize,
    /// Devices online that let a round open.
    pub min_available: usize,
    /// Buffered versions instead of synchronous rounds.
    pub buffered: bool,
    /// Every connected device is invited to every round (fraction 1, no eligibility), so a
    /// device that comes back must be invited again.
    pub invites_all: bool,
    /// The longest a healthy federation may go without closing a round (deadlines, outages,
    /// rejoins).
    pub stall: Duration,
    /// Devices whose updates are hostile (not honest: they do not count toward liveness).
    pub hostile: BTreeSet<usize>,
}

/// However few devices are online, a run that closes no round for this many stall bounds is
/// over: a federation that cannot go on is a broken `liveness`, never a run that goes on forever.
pub const GIVE_UP_AFTER_STALLS: u32 = 8;

/// The checker's state over one run.
#[derive(Debug)]
pub struct Checker {
    expect: Expect,
    /// Rounds closed (aggregated), with the devices each counted.
    closed: BTreeMap<u64, BTreeSet<String>>,
    last_round: Option<u64>,
    /// Acks `aggregated: true` whose round has not closed yet: (client, round).
    waiting: Vec<(String, u64)>,
    /// Accepted updates each server (`None`: the root) committed: (server, client, round).
    committed: BTreeSet<(Option<usize>, String, u64)>,
    /// The partial each relay last had accepted, per round: its members.
    partials: HashMap<(usize, u64), Vec<String>>,
    /// Rounds that closed without a model.
    failed: u64,
    /// Buffered: the (client, round) of every update a version aggregated.
    in_versions: BTreeSet<(String, u64)>,
    /// (client, round) acked as aggregated: each owes one cost record.
    owed_costs: BTreeSet<(String, u64)>,
    filed: BTreeSet<(String, u64, bool, bool)>,
    online: BTreeSet<usize>,
    /// Devices back after going away, and the last closed round then.
    back: BTreeMap<usize, u64>,
    /// Relays restarted, and the last closed round then.
    restarted: BTreeMap<usize, u64>,
    last_progress: Duration,
    finished: bool,
    /// Checks made (one per promise tested).
    pub checks: u64,
}

type Verdict = Result<(), (Invariant, String)>;

impl Checker {
    /// Every device starts online.
    pub fn new(expect: Expect) -> Self {
        Self {
            online: (0..expect.clients).collect(),
            expect,
            closed: BTreeMap::new(),
            last_round: None,
            waiting: Vec::new(),
            committed: BTreeSet::new(),
            partials: HashMap::new(),
            owed_costs: BTreeSet::new(),
            in_versions: BTreeSet::new(),
            failed: 0,
            filed: BTreeSet::new(),
            back: BTreeMap::new(),
            restarted: BTreeMap::new(),
            last_progress: Duration::ZERO,
            finished: false,
            checks: 0,
        }
    }

    /// Rounds closed with a model so far.
    pub fn rounds(&self) -> u64 {
        self.closed.len() as u64 - self.failed
    }

    /// What one step showed, checked in order; the first broken promise.
    pub fn step(&mut self, step: &Step) -> Result<(), Violation> {
        let broke = |(invariant, detail)| Violation { invariant, step: step.number, at: step.now, detail };
        for seen in step.seen {
            self.seen(seen).map_err(broke)?;
        }
        self.stalled(step.now).map_err(broke)
    }

    /// The end of the run (its last step `step` at `at`): what is still owed.
    pub fn end(&mut self, step: u64, at: Duration) -> Result<(), Violation> {
        let broke = |(invariant, detail)| Violation { invariant, step, at, detail };
        self.checks += 1;
        if !self.finished {
            let rounds = self.closed.len();
            return Err(broke((
                Invariant::Liveness,
                format!("the run stopped after {rounds} of {} rounds, unfinished", self.expect.rounds),
            )));
        }
        if self.rounds() == 0 && self.failed > 0 {
            return Err(broke((Invariant::Liveness, format!("every one of the {} rounds failed", self.failed))));
        }
        if let Some((client, round)) = self.waiting.first() {
            return Err(broke((
                Invariant::AckMeansCounted,
                format!("{client}'s update of round {round} was acked as aggregated and no round counted it"),
            )));
        }
        for (client, round) in &self.owed_costs {
            self.checks += 1;
            if !self.filed.contains(&(client.clone(), *round, false, false)) {
                return Err(broke((
                    Invariant::CostOnce,
                    format!("{client}'s round {round} was acked and the root's ledger has no record of it"),
                )));
            }
        }
        Ok(())
    }

    fn seen(&mut self, seen: &Seen) -> Verdict {
        match seen {
            Seen::Ack { relay, client, round, aggregated: true } => self.acked(*relay, client, *round),
            Seen::Ack { .. } => Ok(()),
            Seen::Committed { relay, client, round } => {
                self.committed.insert((*relay, client.clone(), *round));
                Ok(())
            }
            Seen::AckQueued { relay, client, round, aggregated: true } => self.ack_queued(*relay, client, *round),
            Seen::AckQueued { .. } => Ok(()),
            Seen::PartialAccepted { relay, round, members } => {
                self.partials.insert((*relay, *round), members.clone());
                Ok(())
            }
            Seen::Invited { clients, .. } => {
                for c in clients {
                    if let Some(i) = client_index(c) {
                        self.back.remove(&i);
                    }
                }
                Ok(())
            }
            Seen::Closed { report, finite } => {
                self.checks += 1;
                if !finite {
                    return Err((
                        Invariant::FiniteModel,
                        format!("round {}'s global model holds a value that is not finite", report.round),
                    ));
                }
                if matches!(report.outcome, RoundOutcome::Failed { .. }) {
                    return self.failed_round(report.round);
                }
                let updates = report.updates.iter().map(|u| u.client.clone()).collect();
                let staleness = |u: &anchorage_server::engine::UpdateReport| {
                    u.metrics.iter().find(|(k, _)| k == "staleness").map_or(0, |(_, s)| *s as u64)
                };
                let trained = report.updates.iter().map(|u| (u.client.clone(), staleness(u))).collect();
                self.closed_round(report.round, updates, trained, report.closed)
            }
            Seen::Filed { record, repeated } => self.filed(record, *repeated),
            Seen::Online { client } => {
                if self.online.insert(*client)
                    && let Some(round) = self.last_round
                {
                    self.back.insert(*client, round);
                }
                Ok(())
            }
            Seen::Offline { client, .. } => {
                self.online.remove(client);
                self.back.remove(client);
                Ok(())
            }
            Seen::RelayRestarted { relay } => {
                self.restarted.insert(*relay, self.last_round.unwrap_or(0));
                Ok(())
            }
            Seen::RelayDown { relay } => {
                // Not back until it has started again.
                self.restarted.remove(relay);
                Ok(())
            }
            Seen::RollbackEvidence { relay, devices } => {
                self.checks += 1;
                let server = relay.map_or_else(|| "the root".to_string(), |r| format!("relay-{r}"));
                Err((
                    Invariant::NoFalseAlarm,
                    format!(
                        "{server} counts {devices} devices that trained rounds it never announced; no store was rolled back"
                    ),
                ))
            }
            Seen::Finished => {
                self.finished = true;
                Ok(())
            }
        }
    }

    /// `relay` (`None`: the root) queued an ack `aggregated: true` of `client`'s update of `round`.
    fn ack_queued(&mut self, relay: Option<usize>, client: &str, round: u64) -> Verdict {
        self.checks += 1;
        let committed = self.committed.contains(&(relay, client.to_string(), round));
        let in_closed_round = relay.is_none() && self.closed.get(&round).is_some_and(|c| c.contains(client));
        if committed || in_closed_round {
            return Ok(());
        }
        let server = relay.map_or_else(|| "the root".to_string(), |r| format!("relay-{r}"));
        Err((
            Invariant::AckAfterCommit,
            format!("{server} acked {client}'s update of round {round} as aggregated before committing it"),
        ))
    }

    /// A record reached the root's ledger: its key is new unless the ledger said it held it.
    fn filed(&mut self, record: &anchorage_shared::ledger::CostRecord, repeated: bool) -> Verdict {
        self.checks += 1;
        let key = (record.client.clone(), record.round, record.declined.is_some(), record.dropped);
        if self.filed.insert(key) == repeated {
            return Err((
                Invariant::CostOnce,
                format!(
                    "the ledger said {repeated} to holding {}'s record of round {} already, and it {}",
                    record.client,
                    record.round,
                    if repeated { "did not" } else { "did" }
                ),
            ));
        }
        Ok(())
    }

    /// A round that closed without a model: no ack of the root's may have promised it one.
    fn failed_round(&mut self, round: u64) -> Verdict {
        self.checks += 1;
        if let Some(last) = self.last_round.filter(|&last| round <= last) {
            return Err((Invariant::RoundsGrow, format!("round {round} closed after round {last}")));
        }
        self.last_round = Some(round);
        self.failed += 1;
        if let Some((client, _)) = self.waiting.iter().find(|(_, r)| *r == round) {
            return Err((
                Invariant::AckMeansCounted,
                format!("{client}'s update of round {round} was acked as aggregated and round {round} failed"),
            ));
        }
        self.closed.insert(round, BTreeSet::new());
        Ok(())
    }

    /// An ack as aggregated, the root's or a relay's (which repeats its parent's ack of the
    /// partial holding the update): checked at once if its round has closed, else when it does.
    fn acked(&mut self, relay: Option<usize>, client: &str, round: u64) -> Verdict {
        // After the root's goodbye its ledger takes no more records: an ack then (a device back
        // late, acked again for an update its relay had counted) owes none.
        if !self.finished {
            self.owed_costs.insert((client.to_string(), round));
        }
        if self.expect.buffered {
            if !self.in_versions.contains(&(client.to_string(), round)) {
                self.waiting.push((client.to_string(), round));
            }
            return Ok(());
        }
        match self.closed.get(&round) {
            Some(counted) => {
                self.checks += 1;
                if counted.contains(client) {
                    Ok(())
                } else {
                    let by = relay.map_or("the root".to_string(), |r| format!("relay-{r}"));
                    Err((
                        Invariant::AckMeansCounted,
                        format!(
                            "{by} acked {client}'s update of round {round} as aggregated after that round closed without it"
                        ),
                    ))
                }
            }
            None => {
                self.waiting.push((client.to_string(), round));
                Ok(())
            }
        }
    }

    /// A round closed with these updates (devices, or relays whose partials hold devices).
    fn closed_round(&mut self, round: u64, updates: Vec<String>, trained: Vec<(String, u64)>, at: Duration) -> Verdict {
        self.checks += 1;
        if let Some(last) = self.last_round.filter(|&last| round <= last) {
            return Err((Invariant::RoundsGrow, format!("round {round} closed after round {last}")));
        }
        self.last_round = Some(round);
        self.last_progress = at;
        let mut counted = BTreeSet::new();
        for update in &updates {
            let members = match relay_index(update) {
                Some(r) => {
                    self.restarted.remove(&r);
                    self.partials.get(&(r, round)).cloned().unwrap_or_default()
                }
                None => vec![update.clone()],
            };
            for device in members {
                self.checks += 1;
                if !counted.insert(device.clone()) {
                    return Err((Invariant::CountedOnce, format!("{device} is counted twice in round {round}")));
                }
            }
        }
        if self.expect.buffered {
            // A version's line for an update trained on version v − 1 − staleness names round
            // v − staleness, the round its ack named.
            for (device, staleness) in trained {
                let key = (device, round.saturating_sub(staleness));
                self.waiting.retain(|w| *w != key);
                self.in_versions.insert(key);
            }
        } else {
            for (client, _) in self.waiting.iter().filter(|(_, r)| *r == round) {
                self.checks += 1;
                if !counted.contains(client) {
                    return Err((
                        Invariant::AckMeansCounted,
                        format!(
                            "{client}'s update of round {round} was acked as aggregated and round {round} closed without it"
                        ),
                    ));
                }
            }
            self.waiting.retain(|(_, r)| *r != round);
        }
        self.closed.insert(round, counted);
        self.back_within(round)
    }

    /// Peers back (or restarted) more than [`BACK_WITHIN`] rounds ago and not seen since.
    fn back_within(&mut self, round: u64) -> Verdict {
        self.checks += 1;
        if let Some((relay, since)) = self.restarted.iter().find(|(_, since)| round > *since + BACK_WITHIN) {
            return Err((
                Invariant::BackWithinRounds,
                format!(
                    "relay-{relay} restarted after round {since} and no round since counted it (round {round} closed)"
                ),
            ));
        }
        if self.expect.invites_all
            && let Some((client, since)) =
                self.back.iter().find(|(c, since)| self.online.contains(c) && round > *since + BACK_WITHIN)
        {
            return Err((
                Invariant::BackWithinRounds,
                format!(
                    "{} came back after round {since} and was not invited again (round {round} closed)",
                    client_id(*client)
                ),
            ));
        }
        Ok(())
    }

    /// Liveness: no round has closed for longer than a healthy federation allows, while enough
    /// honest devices are online (or for [`GIVE_UP_AFTER_STALLS`] times as long, however many are).
    fn stalled(&mut self, now: Duration) -> Verdict {
        if self.finished || now.saturating_sub(self.last_progress) <= self.expect.stall {
            return Ok(());
        }
        self.checks += 1;
        let honest = self.online.iter().filter(|c| !self.expect.hostile.contains(c)).count();
        let waited = now.saturating_sub(self.last_progress);
        if honest < self.expect.min_available && waited <= self.expect.stall * GIVE_UP_AFTER_STALLS {
            return Ok(());
        }
        Err((
            Invariant::Liveness,
            format!(
                "no round closed for {:.1} simulated s (the last at {:.1} s) with {honest} honest devices online",
                now.saturating_sub(self.last_progress).as_secs_f64(),
                self.last_progress.as_secs_f64()
            ),
        ))
    }
}

/// The index of a device id (`client-<i>`).
fn client_index(id: &str) -> Option<usize> {
    let i: usize = id.strip_prefix("client-")?.parse().ok()?;
    (client_id(i) == id).then_some(i)
}

/// The index of a relay id (`relay-<r>`).
fn relay_index(id: &str) -> Option<usize> {
    id.strip_prefix("relay-")?.parse().ok()
}
