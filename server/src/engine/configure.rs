//! A round's plan (Flower's `configure_fit`): which of the eligible devices it invites and the
//! training settings each gets. The engine asks its [`RoundPolicy`] (`[engine.policy]`: the
//! device selection and the learning-rate schedule the operator picks), then the method's
//! server half ([`crate::methods::ServerMethod::configure_round`]), which may change the plan
//! further. The default policy (uniform sampling, the `[engine.round]` settings every round) is
//! the engine's sampling as it always drew it: same seed, same invitations.

use std::collections::{BTreeMap, BTreeSet};

use anchorage_shared::protocol::RoundConfig;
use anchorage_shared::rng::Rng;
use serde::{Deserialize, Serialize};

use super::ClientId;

/// What the engine knows when it plans a round.
#[derive(Debug)]
pub struct RoundContext<'a> {
    pub round: u64,
    /// The round's 0-based task.
    pub task: u32,
    /// The run's configured rounds (0: until stopped).
    pub rounds: u64,
    /// The connected devices that may be invited, in id order.
    pub available: &'a [&'a ClientId],
    /// How many to invite: the round's target plus over-selection, at most `available`.
    pub invite: usize,
    /// The last round each device was invited to (a device missing here never was, as far as
    /// this engine remembers: it keeps what it saw since its start).
    pub last_invited: &'a BTreeMap<ClientId, u64>,
}

/// A round's plan: who is invited, the settings every invited device trains with, and the
/// devices that get other settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundPlan {
    pub invited: BTreeSet<ClientId>,
    pub config: RoundConfig,
    /// Settings for single devices instead of `config` (each distinct one is one broadcast,
    /// encoded once).
    pub per_device: BTreeMap<ClientId, RoundConfig>,
}

impl RoundPlan {
    /// The settings `client` trains with.
    pub fn config_of(&self, client: &str) -> &RoundConfig {
        self.per_device.get(client).unwrap_or(&self.config)
    }
}

/// How the devices of a round are chosen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Selection {
    /// Uniformly at random, from the engine's seeded generator.
    #[default]
    Uniform,
    /// The devices invited longest ago first (never invited before any), ties broken at random:
    /// every connected device takes part as often as the others.
    LeastRecent,
}

/// A learning-rate schedule over rounds, from `[engine.round] learning_rate` as η₀.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Schedule {
    /// η₀ every round.
    #[default]
    Constant,
    /// η₀ · γ^⌊(r − 1) / every⌋: multiplied by `gamma` every `every` rounds.
    Step { every: u64, gamma: f32 },
    /// η_min + (η₀ − η_min) · (1 + cos(π (r − 1) / (R − 1))) / 2 over the run's R rounds
    /// (Loshchilov & Hutter 2017, SGDR without restarts); η₀ where R is 1 or unbounded.
    Cosine { min_lr: f32 },
}

impl Schedule {
    /// The learning rate of `round` (1-based) of a run of `rounds` rounds.
    pub fn learning_rate(&self, base: f32, round: u64, rounds: u64) -> f32 {
        match *self {
            Self::Constant => base,
            Self::Step { every, gamma } => {
                let steps = round.saturating_sub(1).checked_div(every).unwrap_or(0);
                base * gamma.powi(steps.min(i32::MAX as u64) as i32)
            }
            Self::Cosine { min_lr } if rounds > 1 => {
                let t = (round.saturating_sub(1).min(rounds - 1)) as f64 / (rounds - 1) as f64;
                let cos = (1.0 + (std::f64::consts::PI * t).cos()) / 2.0;
                (f64::from(min_lr) + (f64::from(base) - f64::from(min_lr)) * cos) as f32
            }
            Self::Cosine { .. } => base,
        }
    }

    /// Refuses a schedule that cannot be followed.
    pub fn check(&self) -> Result<(), super::ConfigError> {
        use super::ConfigError::Schedule;
        match *self {
            Self::Step { every: 0, .. } => Err(Schedule("step: every must be 1 or more")),
            Self::Step { gamma, .. } if !(gamma.is_finite() && gamma > 0.0) => {
                Err(Schedule("step: gamma must be a positive number"))
            }
            Self::Cosine { min_lr } if !(min_lr.is_finite() && min_lr >= 0.0) => {
                Err(Schedule("cosine: min_lr must be 0 or more"))
            }
            _ => Ok(()),
        }
    }
}

/// `[engine.policy]`: the operator's choice of device selection and learning-rate schedule.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoundPolicy {
    pub selection: Selection,
    pub schedule: Schedule,
}

impl RoundPolicy {
    /// Whether this is the default policy (uniform sampling, a constant learning rate).
    pub fn is_default(&self) -> bool {
        *self == Self::default()
    }

    /// The round's plan: `ctx.invite` devices as the selection picks them, each with
    /// `[engine.round]`'s settings at the schedule's learning rate.
    pub fn configure_round(&self, ctx: &RoundContext, base: &RoundConfig, rng: &mut Rng) -> RoundPlan {
        let invited = match self.selection {
            Selection::Uniform => rng
                .sample_indices(ctx.available.len(), ctx.invite)
                .into_iter()
                .map(|i| ctx.available[i].clone())
                .collect(),
            Selection::LeastRecent => least_recent(ctx, rng),
        };
        let mut config = base.clone();
        config.learning_rate = self.schedule.learning_rate(base.learning_rate, ctx.round, ctx.rounds);
        RoundPlan { invited, config, per_device: BTreeMap::new() }
    }
}

/// The `ctx.invite` devices invited longest ago (never first), ties in a seeded random order.
fn least_recent(ctx: &RoundContext, rng: &mut Rng) -> BTreeSet<ClientId> {
    let order = rng.sample_indices(ctx.available.len(), ctx.available.len());
    let mut ranked: Vec<(Option<u64>, usize, &ClientId)> = order
        .into_iter()
        .enumerate()
        .map(|(tie, i)| (ctx.last_invited.get(ctx.available[i]).copied(), tie, ctx.available[i]))
        .collect();
    ranked.sort();
    ranked.into_iter().take(ctx.invite).map(|(_, _, id)| id.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> RoundConfig {
        RoundConfig { local_epochs: 1, batch_size: 32, learning_rate: 0.1, deadline_ms: 0 }
    }

    #[test]
    fn the_schedules_follow_their_formulas() {
        let step = Schedule::Step { every: 2, gamma: 0.5 };
        let lrs: Vec<f32> = (1..=5).map(|r| step.learning_rate(0.1, r, 5)).collect();
        assert_eq!(lrs, [0.1, 0.1, 0.05, 0.05, 0.025]);
        let cosine = Schedule::Cosine { min_lr: 0.0 };
        assert!((cosine.learning_rate(0.1, 1, 5) - 0.1).abs() < 1e-7, "η₀ in the first round");
        assert!((cosine.learning_rate(0.1, 3, 5) - 0.05).abs() < 1e-7, "half way at the middle round");
        assert!(cosine.learning_rate(0.1, 5, 5).abs() < 1e-7, "η_min in the last round");
        assert_eq!(cosine.learning_rate(0.1, 7, 0), 0.1, "no end: no decay");
        assert!(Schedule::Step { every: 0, gamma: 0.5 }.check().is_err());
        assert!(Schedule::Cosine { min_lr: -1.0 }.check().is_err());
    }

    #[test]
    fn least_recent_invites_the_devices_waiting_longest() {
        let ids: Vec<ClientId> = (0..6).map(|i| format!("edge-{i}")).collect();
        let available: Vec<&ClientId> = ids.iter().collect();
        let policy = RoundPolicy { selection: Selection::LeastRecent, ..RoundPolicy::default() };
        let mut last_invited = BTreeMap::new();
        let mut rng = Rng::derive(3, 0);
        let mut seen = BTreeMap::<ClientId, usize>::new();
        for round in 1..=6 {
            let ctx = RoundContext {
                round,
                task: 0,
                rounds: 6,
                available: &available,
                invite: 2,
                last_invited: &last_invited,
            };
            let plan = policy.configure_round(&ctx, &base(), &mut rng);
            assert_eq!(plan.invited.len(), 2);
            for id in &plan.invited {
                *seen.entry(id.clone()).or_default() += 1;
                last_invited.insert(id.clone(), round);
            }
            if round % 3 == 0 {
                assert_eq!(seen.len(), 6, "every device once before any twice (round {round})");
                assert!(seen.values().all(|n| *n == (round / 3) as usize), "{seen:?}");
            }
        }
    }

    #[test]
    fn the_default_policy_draws_as_the_engine_always_did() {
        let ids: Vec<ClientId> = (0..10).map(|i| format!("edge-{i}")).collect();
        let available: Vec<&ClientId> = ids.iter().collect();
        let ctx = RoundContext {
            round: 4,
            task: 0,
            rounds: 10,
            available: &available,
            invite: 3,
            last_invited: &BTreeMap::new(),
        };
        let plan = RoundPolicy::default().configure_round(&ctx, &base(), &mut Rng::derive(7, 3));
        let drawn: BTreeSet<ClientId> =
            Rng::derive(7, 3).sample_indices(10, 3).into_iter().map(|i| ids[i].clone()).collect();
        assert_eq!(plan.invited, drawn);
        assert_eq!(plan.config, base(), "[engine.round] as written");
        assert!(plan.per_device.is_empty());
    }
}
