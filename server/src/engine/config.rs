//! How the engine runs rounds (Flower's `fraction_fit` / `min_fit_clients` /
//! `min_available_clients`, FedScale's over-commitment, a deadline per round).

use std::time::Duration;

use anchorage_shared::frame::DEFAULT_MAX_FRAME;
use anchorage_shared::protocol::RoundConfig;
use serde::{Deserialize, Serialize};

use super::AggregationMode;
use crate::aggregate::RobustConfig;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Name the server gives in its welcome.
    pub server_id: String,
    /// Rounds to run; 0 runs until stopped.
    pub rounds: u64,
    /// Rounds of each task of the stream (FedProK's R); 0: every round is task 0.
    pub rounds_per_task: u64,
    /// Connected clients required before a round opens.
    pub min_available: usize,
    /// Fraction of connected clients whose updates a round waits for.
    pub fraction: f64,
    /// At least this many updates are waited for (capped by the clients connected).
    pub min_fit: usize,
    /// Extra clients invited on top of the target, as a fraction of it (0.3 invites 30% more);
    /// the round closes as soon as the target number of updates arrived.
    pub over_selection: f64,
    /// At the deadline, a round with fewer updates than this fails and the model stays as it was.
    pub min_updates: usize,
    /// How long a round waits for its updates.
    #[serde(with = "duration_ms")]
    pub round_deadline: Duration,
    /// How often clients should send heartbeats.
    #[serde(with = "duration_ms")]
    pub heartbeat: Duration,
    /// Largest frame accepted from a client.
    pub max_frame_bytes: u32,
    /// Local training settings sent with every broadcast.
    pub round: RoundConfig,
    /// Seed of client sampling.
    pub seed: u64,
    /// Synchronous rounds (default) or FedBuff-style buffered semi-asynchronous aggregation.
    pub mode: AggregationMode,
    /// `[engine.robust]`: update screening and the aggregation rule every method's block
    /// averaging uses (default: the sample-weighted mean, no norm bound).
    pub robust: RobustConfig,
    /// `[engine.privacy]`: differential privacy of updates and prototypes (off by
    /// default). The devices' `[privacy]` must agree.
    pub privacy: anchorage_shared::privacy::PrivacyConfig,
    /// Seed of the central noise, for reproducible simulations; unset (the field), the server
    /// draws it from the operating system at start, so nobody can predict the noise.
    pub noise_seed: Option<u64>,
    /// `[engine.secagg]`: secure aggregation (SecAgg+; off by default).
    pub secagg: super::secagg::SecAggConfig,
    /// `[engine.policy]`: how a round's devices are chosen and its learning rate scheduled
    /// (default: uniformly at random, `[engine.round]`'s rate every round).
    pub policy: super::RoundPolicy,
    /// Root or relay: set by the program from `[parent]`, never written in `[engine]`.
    #[serde(skip)]
    pub role: super::Role,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            server_id: "anchorage".into(),
            rounds: 10,
            rounds_per_task: 0,
            min_available: 2,
            fraction: 1.0,
            min_fit: 2,
            over_selection: 0.0,
            min_updates: 1,
            round_deadline: Duration::from_secs(60),
            heartbeat: Duration::from_secs(5),
            max_frame_bytes: DEFAULT_MAX_FRAME as u32,
            round: RoundConfig { local_epochs: 1, batch_size: 32, learning_rate: 1e-3, deadline_ms: 0 },
            seed: 0,
            mode: AggregationMode::Synchronous,
            robust: RobustConfig::default(),
            privacy: Default::default(),
            noise_seed: None,
            secagg: Default::default(),
            policy: Default::default(),
            role: Default::default(),
        }
    }
}

impl EngineConfig {
    /// The 0-based task of `round` (1-based).
    pub fn task_of(&self, round: u64) -> u32 {
        round.saturating_sub(1).checked_div(self.rounds_per_task).unwrap_or(0) as u32
    }

    /// Where `round` sits in the task stream.
    pub fn round_info(&self, round: u64) -> crate::methods::RoundInfo {
        let last_of_task = (self.rounds_per_task > 0 && round.is_multiple_of(self.rounds_per_task))
            || (self.rounds > 0 && round >= self.rounds);
        crate::methods::RoundInfo { round, task: self.task_of(round), last_of_task, rule: self.robust.aggregation }
    }

    /// Devices a secure round needs at least: SecAgg+'s graph is built over three or more.
    pub const SECAGG_MIN_DEVICES: usize = 3;

    /// The fewest devices a round needs: `min_fit`, and under SecAgg at least
    /// [`Self::SECAGG_MIN_DEVICES`] (a secure round of fewer cannot start and would fail).
    fn fewest(&self, of: usize) -> usize {
        if self.secagg.enabled { of.max(Self::SECAGG_MIN_DEVICES) } else { of.max(1) }
    }

    /// Connected devices a round waits for before it opens: `min_available`, and under SecAgg
    /// at least [`Self::SECAGG_MIN_DEVICES`].
    pub fn min_to_open(&self) -> usize {
        self.fewest(self.min_available)
    }

    /// Updates a round waits for, given `available` connected clients.
    pub fn sample_size(&self, available: usize) -> usize {
        let by_fraction = (self.fraction.clamp(0.0, 1.0) * available as f64).ceil() as usize;
        by_fraction.max(self.fewest(self.min_fit)).clamp(1, available.max(1))
    }

    /// Clients invited for a target of `target` updates (over-selection), capped by `available`.
    pub fn invited(&self, target: usize, available: usize) -> usize {
        let extra = (target as f64 * self.over_selection.max(0.0)).ceil() as usize;
        (target + extra).min(available)
    }
}

/// Durations as integer milliseconds in config files.
pub mod duration_ms {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}
