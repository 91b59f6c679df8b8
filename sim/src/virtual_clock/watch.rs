//! What a run shows a watcher (`anchorage swarm`'s checkers, `crate::swarm`): the promises the
//! engines make, as they make them, in event order. A run with no watcher records nothing.
//!
//! A [`Mutation`] changes what one engine does before the run carries it out: a stand-in for a
//! bug, so that a test can show a checker catching it.

use std::sync::Arc;
use std::time::Duration;

use anchorage_server::engine::{Checkpoint, RoundReport};
use anchorage_shared::ledger::CostRecord;

/// One thing the watcher sees. `relay`: `None` for the root (or the only server).
#[derive(Debug, Clone)]
pub enum Seen {
    /// An engine acked a device's update of `round`.
    Ack {
        relay: Option<usize>,
        client: String,
        round: u64,
        aggregated: bool,
    },
    /// An engine queued an ack of `client`'s update of `round` (before the run carries it out).
    AckQueued {
        relay: Option<usize>,
        client: String,
        round: u64,
        aggregated: bool,
    },
    /// An engine's store committed `client`'s accepted update of `round` (a relay's partial, at
    /// the root).
    Committed {
        relay: Option<usize>,
        client: String,
        round: u64,
    },
    /// The root acked relay `relay`'s partial of `round` (these members in it) as aggregated.
    PartialAccepted {
        relay: usize,
        round: u64,
        members: Vec<String>,
    },
    /// The root (or the only server) invited `clients` (relays, behind a tier) into `round`.
    Invited {
        round: u64,
        clients: Vec<String>,
    },
    /// The root closed a round; `finite`: every value of the new global model is finite.
    Closed {
        report: Arc<RoundReport>,
        finite: bool,
    },
    /// A record reached the root's ledger; `repeated`: the ledger held its key already (and
    /// kept the first).
    Filed {
        record: CostRecord,
        repeated: bool,
    },
    /// A device came online, or went away (`crash`: its process restarted).
    Online {
        client: usize,
    },
    Offline {
        client: usize,
        crash: bool,
    },
    /// Relay `relay`'s process restarted from its store.
    RelayRestarted {
        relay: usize,
    },
    /// Relay `relay`'s process died, to start again later ([`Seen::RelayRestarted`]).
    RelayDown {
        relay: usize,
    },
    /// A server counts `devices` that trained a round it never announced (rollback evidence:
    /// at [`anchorage_server::engine::ROLLBACK_QUORUM`] of them it stops opening rounds).
    RollbackEvidence {
        relay: Option<usize>,
        devices: usize,
    },
    /// The root said the federation is over.
    Finished,
}

/// A stand-in for a bug in an engine, for the tests that show a checker catching it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
pub enum Mutation {
    /// The root's reports leave out the first update of each round it acked.
    ForgetAckedUpdate,
    /// The root's reports list the first update twice.
    CountTwice,
    /// The root's third round reuses the second's number.
    ReuseRound,
    /// The root's global model gets a NaN at round 2.
    PoisonModel,
    /// The root's ledger loses the first device record it is given.
    LoseCost,
    /// The root's broadcasts never leave it.
    DropBroadcasts,
    /// The root's broadcasts leave out every device that has come back after going away.
    ForgetReturned,
    /// The root acks its first accepted update without committing it (its store loses the write).
    AckUncommitted,
    /// Each device's hello names a round five beyond the one its server last announced (a
    /// witness miscounted: the server takes its store for rolled back).
    ClaimAhead,
}

impl Mutation {
    /// The name `--mutate` takes.
    pub fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self).map(|v| v.get_name().to_string()).unwrap_or_default()
    }
}

/// What a watched run does beyond the federation's config: the mutation under test, and the
/// faults only the swarm injects.
#[derive(Debug, Clone, Copy, Default)]
pub struct WatchOptions {
    pub mutation: Option<Mutation>,
    /// Each message a device or relay sends up arrives again, this probability, 0 to 2 s later
    /// (a resend after a timeout: a duplicate, and reordered against what was sent between).
    pub duplicate: f64,
    /// Seeds the duplicates.
    pub seed: u64,
}

/// The watcher's view of a run: what it has seen since the last event, and the mutation on.
#[derive(Debug)]
pub(super) struct Watch {
    pub(super) seen: Vec<Seen>,
    pub(super) mutation: Option<Mutation>,
    duplicate: f64,
    rng: anchorage_shared::rng::Rng,
    /// Messages sent again.
    pub(super) duplicated: u64,
    /// Device records the root's ledger was given (for [`Mutation::LoseCost`]).
    filed: u64,
    /// Accepted updates the root committed (for [`Mutation::AckUncommitted`]).
    commits: u64,
    /// Devices that came back after going away (for [`Mutation::ForgetReturned`]).
    returned: std::collections::BTreeSet<String>,
    /// The rollback evidence each server (`None`: the root) last showed, in devices.
    evidence: std::collections::BTreeMap<Option<usize>, usize>,
}

impl Watch {
    pub(super) fn new(options: WatchOptions) -> Self {
        Self {
            seen: Vec::new(),
            mutation: options.mutation,
            duplicate: options.duplicate,
            rng: anchorage_shared::rng::Rng::derive(options.seed, 0xD0B1E),
            duplicated: 0,
            filed: 0,
            commits: 0,
            returned: Default::default(),
            evidence: Default::default(),
        }
    }

    /// Server `relay` (`None`: the root) counts `devices` ahead of its rounds: seen when the
    /// count grows.
    pub(super) fn evidence(&mut self, relay: Option<usize>, devices: usize) {
        let last = self.evidence.entry(relay).or_default();
        if devices > *last {
            self.seen.push(Seen::RollbackEvidence { relay, devices });
        }
        *last = devices;
    }

    /// When a message sent up now arrives again, if it does.
    pub(super) fn again(&mut self, now: Duration) -> Option<Duration> {
        if self.duplicate <= 0.0 || self.rng.f64() >= self.duplicate {
            return None;
        }
        self.duplicated += 1;
        Some(now + Duration::from_secs_f64(2.0 * self.rng.f64()))
    }

    /// The root's closed round as the mutation changes it; `None` when it passes unchanged.
    pub(super) fn mutate_close(
        &self,
        report: &Arc<RoundReport>,
        checkpoint: &Arc<Checkpoint>,
    ) -> Option<(Arc<RoundReport>, Arc<Checkpoint>)> {
        let mut r = (**report).clone();
        let mut c = (**checkpoint).clone();
        match self.mutation? {
            Mutation::ForgetAckedUpdate if !r.updates.is_empty() => {
                r.updates.remove(0);
            }
            Mutation::CountTwice if !r.updates.is_empty() => r.updates.push(r.updates[0].clone()),
            Mutation::ReuseRound if r.round == 3 => r.round = 2,
            Mutation::PoisonModel if r.round == 2 => {
                let block = c.global.first_mut()?;
                let mut values = block.tensor.decode().ok()?;
                *values.first_mut()? = f32::NAN;
                let shape = block.tensor.shape.clone();
                let encoding = block.tensor.encoding;
                block.tensor = anchorage_shared::tensor::EncodedTensor::encode(&shape, &values, encoding);
            }
            _ => return None,
        }
        Some((Arc::new(r), Arc::new(c)))
    }

    /// Whether the root's ledger loses this device record (the mutation's stand-in for a bug).
    pub(super) fn loses(&mut self, record: &CostRecord) -> bool {
        if record.dropped || record.declined.is_some() {
            return false;
        }
        self.filed += 1;
        self.mutation == Some(Mutation::LoseCost) && self.filed == 1
    }

    /// Whether the root's commit of an accepted update is lost (the mutation's stand-in for a bug).
    pub(super) fn loses_commit(&mut self) -> bool {
        self.commits += 1;
        self.mutation == Some(Mutation::AckUncommitted) && self.commits == 1
    }

    /// Device `client` came back after going away.
    pub(super) fn returned(&mut self, client: String) {
        if self.mutation == Some(Mutation::ForgetReturned) {
            self.returned.insert(client);
        }
    }

    /// The devices a broadcast reaches, as the mutation changes them.
    pub(super) fn recipients(&self, to: &[String]) -> Vec<String> {
        to.iter().filter(|c| !self.returned.contains(*c)).cloned().collect()
    }

    /// A device's hello to a server whose last round is `server_round`, as the mutation changes it.
    pub(super) fn mutate_hello(&self, msg: &mut anchorage_shared::protocol::Message, server_round: u64) {
        if let anchorage_shared::protocol::Message::Hello(hello) = msg
            && self.mutation == Some(Mutation::ClaimAhead)
        {
            hello.last_round = Some(server_round + 5);
        }
    }

    /// Whether the root's broadcast of `round` never leaves it.
    pub(super) fn drops_broadcast(&self, round: u64) -> bool {
        self.mutation == Some(Mutation::DropBroadcasts) && round >= 1
    }
}

/// Whether every value of `checkpoint`'s global model is finite (a block that does not decode
/// counts as not finite).
pub(super) fn finite(checkpoint: &Checkpoint) -> bool {
    checkpoint.global.iter().all(|b| b.tensor.decode().is_ok_and(|v| v.iter().all(|x| x.is_finite())))
}

/// What one step of a watched run hands its watcher.
pub struct Step<'a> {
    /// The step's number (1 for the first), and the simulated time after it.
    pub number: u64,
    pub now: Duration,
    pub seen: &'a [Seen],
}
