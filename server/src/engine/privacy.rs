//! Differential privacy on the server (the table: [`PrivacyConfig`]): what a round's
//! updates become before the method aggregates them, and the privacy they spent.
//!
//! With central noise the server is trusted with each update and privatizes the round's sum
//! (McMahan et al. 2018, "Learning Differentially Private Recurrent Language Models",
//! Algorithm 1, DP-FedAvg with fixed-size sampling's estimator):
//!
//! - each update's delta from the global model (all its blocks as one vector) is clipped to
//!   L2 norm C, and every update gets the same weight (`num_samples` = 1, so no claimed count
//!   changes the sensitivity);
//! - N(0, (σ_Δ·C)²) goes on the sum of the clipped deltas. It is added to the first update's
//!   delta, so that the method's equal-weight mean of m updates carries N(0, (σ_Δ·C/m)²): the
//!   noise is on the method's input, and whatever the method does after (FedAvgM's momentum) is
//!   post-processing;
//! - with adaptive clipping, C follows the target quantile of the deltas' norms from a noised
//!   count of those within it (Andrew et al. 2021, Algorithm 1), and σ_Δ pays for that count;
//! - prototypes arrive as per-class sums of features each clipped on the device, with counts
//!   (the update's `prototypes_are` says so); the round's sums get N(0, (σ·C_p)²) per
//!   coordinate and its counts N(0, σ²), and the method sees one prototype per class, their
//!   quotient, with the noised count (so a count-weighted fusion sees the noised sums).
//!
//! With local noise the devices did all of this to what they sent; the server only sums the
//! prototypes and gives equal weights. Either way the accountant ([`Accountant`]) steps once per
//! aggregated round: the Gaussian mechanism of the deltas at the round's sampling rate q (its
//! invited devices over the connected ones) and, for a method that sends prototypes, that of the
//! prototype sums, whose joint (sum, count) sensitivity makes it σ/√2. Under local noise q is 1:
//! the ε of a device that took part in every round.
//!
//! The account goes into each round report (`privacy`), so a restarted server continues it from
//! the last report; a round that would take ε past the limit is not opened.

use std::collections::BTreeMap;

use anchorage_shared::privacy::mechanism::{adapt_clip, add_gaussian, clip_in_place, noisy_count};
use anchorage_shared::privacy::{Accountant, NoiseSite, PrivacyConfig, PrivacyError};
use anchorage_shared::protocol::{PrototypeForm, Update};
use anchorage_shared::prototype::Prototype;
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use serde::{Deserialize, Serialize};

use super::{ConfigError, PrivacyStateError, PrototypeFormError};

/// Where the privacy of a federation stands after a round (in its report).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrivacyAccount {
    /// ε at `delta` spent so far.
    pub epsilon: f64,
    pub delta: f64,
    /// Where the noise was added (`central` or `local`).
    pub noise: NoiseSite,
    /// σ of the rounds so far, and the clip of the last.
    pub noise_multiplier: f64,
    pub clip: f64,
    /// This round's sampling rate q.
    pub sampling_rate: f64,
    /// Rounds aggregated under privacy.
    pub rounds: u64,
    /// The accountant (Rényi DP summed over the mechanisms so far): what a restart continues from.
    pub accountant: Accountant,
}

/// Refuses an `[engine.privacy]` whose values cannot hold: a bad table, or an ε no σ reaches.
/// Which features it combines with is the compatibility table's ([`super::compat`]).
pub(super) fn check_config(
    engine: &super::EngineConfig,
    method: &anchorage_shared::method::MethodConfig,
) -> Result<(), ConfigError> {
    let config = &engine.privacy;
    if !config.is_on() {
        return Ok(());
    }
    config.check().map_err(PrivacyStateError::from)?;
    PrivacyState::new(config, (engine.rounds, engine.fraction), sends_prototypes(method.name()), 0, None)?;
    Ok(())
}

/// Whether the method `name` uploads prototypes (the registry's `shared`).
pub(super) fn sends_prototypes(name: &str) -> bool {
    anchorage_shared::method::info(name).is_some_and(|m| m.shared.has_prototypes())
}

/// The server's privacy state.
#[derive(Debug)]
pub(super) struct PrivacyState {
    config: PrivacyConfig,
    /// σ: the noise multiplier of the sums (the accountant's).
    sigma: f64,
    /// The clip of the next round's deltas (moves under adaptive clipping).
    clip: f64,
    accountant: Accountant,
    rng: Rng,
    last_q: f64,
    rounds: u64,
    /// The method sends prototypes: each round releases their sums too.
    prototypes: bool,
}

impl PrivacyState {
    /// The state of a federation of `rounds` rounds at expected sampling rate `q` of a method
    /// that sends `prototypes` or not, continued from `account` (a restart); `None` when
    /// privacy is off. Fails when σ can't be found.
    pub(super) fn new(
        config: &PrivacyConfig,
        (rounds, q): (u64, f64),
        prototypes: bool,
        seed: u64,
        account: Option<&PrivacyAccount>,
    ) -> Result<Option<Self>, PrivacyStateError> {
        if !config.is_on() {
            return Ok(None);
        }
        let q = if config.noise == NoiseSite::Local { 1.0 } else { q.clamp(f64::MIN_POSITIVE, 1.0) };
        let sigma = config.noise_multiplier(rounds, q, prototypes)?;
        config.delta_noise_multiplier(sigma).ok_or(PrivacyStateError::CountNoise)?;
        let (accountant, clip, rounds) = match account {
            Some(a) if a.accountant.delta() != config.delta => {
                return Err(PrivacyStateError::Delta { configured: config.delta, accounted: a.delta });
            }
            Some(a) => (a.accountant.clone(), a.clip, a.rounds),
            None => (Accountant::with_default_orders(config.delta)?, config.clip, 0),
        };
        let rng = Rng::derive(seed, 0xD9 ^ rounds);
        Ok(Some(Self { config: config.clone(), sigma, clip, accountant, rng, last_q: q, rounds, prototypes }))
    }

    /// Refuses an update whose prototypes are not what `[privacy]` expects (sums, with the
    /// marker): a device whose `[privacy]` is off would otherwise be taken for noised sums.
    pub(super) fn check_update(update: &Update, config: &PrivacyConfig) -> Result<(), PrototypeFormError> {
        let marked = update.prototypes_are == PrototypeForm::Sums;
        match (config.is_on() && !update.prototypes.is_empty(), marked) {
            (true, false) => Err(PrototypeFormError::SumsExpected),
            (false, true) if !config.is_on() => Err(PrototypeFormError::SumsUnexpected),
            _ => Ok(()),
        }
    }

    /// Whether a round at sampling rate `q` would keep ε within the limit.
    pub(super) fn may_open(&self) -> bool {
        let Some(limit) = self.config.epsilon_limit() else { return true };
        let mut next = self.accountant.clone();
        self.step(&mut next, self.last_q, self.prototypes).is_ok_and(|()| next.epsilon().0 <= limit)
    }

    /// The round's updates, privatized (see the module doc); `connected` devices could have
    /// been invited, `invited` were.
    pub(super) fn privatize(
        &mut self,
        updates: &[(&str, &Update)],
        global: &[ParamBlock],
        invited: usize,
        connected: usize,
    ) -> Vec<Update> {
        if self.config.noise == NoiseSite::Central {
            self.last_q = (invited as f64 / connected.max(invited).max(1) as f64).clamp(f64::MIN_POSITIVE, 1.0);
        }
        let mut out: Vec<Update> = updates.iter().map(|(_, u)| Update { num_samples: 1, ..(*u).clone() }).collect();
        if self.config.noise == NoiseSite::Central {
            self.clip_and_noise_blocks(&mut out, global);
        }
        self.merge_prototypes(&mut out);
        out
    }

    /// Steps the accountant for the round just aggregated (`with_prototypes`: the method sent some).
    pub(super) fn account(&mut self, with_prototypes: bool) -> Result<(), PrivacyError> {
        let mut accountant = self.accountant.clone();
        self.step(&mut accountant, self.last_q, with_prototypes)?;
        self.accountant = accountant;
        self.rounds += 1;
        Ok(())
    }

    fn step(&self, accountant: &mut Accountant, q: f64, with_prototypes: bool) -> Result<(), PrivacyError> {
        accountant.step(q, self.sigma)?;
        if with_prototypes {
            accountant.step(q, self.sigma / std::f64::consts::SQRT_2)?;
        }
        Ok(())
    }

    /// The account after the rounds so far.
    pub(super) fn snapshot(&self) -> PrivacyAccount {
        PrivacyAccount {
            epsilon: self.accountant.epsilon().0,
            delta: self.config.delta,
            noise: self.config.noise,
            noise_multiplier: self.sigma,
            clip: self.clip,
            sampling_rate: self.last_q,
            rounds: self.rounds,
            accountant: self.accountant.clone(),
        }
    }

    /// Clips each update's delta to the clip, noises their sum through the first one, and
    /// moves the clip (adaptive clipping).
    fn clip_and_noise_blocks(&mut self, updates: &mut [Update], global: &[ParamBlock]) {
        let base: BTreeMap<&str, Vec<f32>> =
            global.iter().filter_map(|b| Some((b.name.as_str(), b.decode().ok()?))).collect();
        let mut unclipped = 0;
        let mut deltas: Vec<Vec<Vec<f32>>> = Vec::with_capacity(updates.len());
        for update in updates.iter() {
            let mut delta: Vec<Vec<f32>> = update.blocks.iter().map(|b| block_delta(b, &base)).collect();
            if clip_in_place(&mut delta, self.clip) <= self.clip {
                unclipped += 1;
            }
            deltas.push(delta);
        }
        let sigma_delta = self.config.delta_noise_multiplier(self.sigma).unwrap_or(self.sigma);
        if let Some(first) = deltas.first_mut() {
            first.iter_mut().for_each(|d| add_gaussian(d, sigma_delta * self.clip, &mut self.rng));
        }
        for (update, delta) in updates.iter_mut().zip(deltas) {
            for (block, d) in update.blocks.iter_mut().zip(delta) {
                *block = rebuilt(block, &d, &base);
            }
        }
        if let Some(adaptive) = &self.config.adaptive {
            self.clip = adapt_clip(self.clip, unclipped, updates.len(), adaptive, &mut self.rng);
        }
    }

    /// Sums the round's prototype sums per class (noised, under central noise) and hands the
    /// method their quotients: one prototype per class, on the first update that has any.
    fn merge_prototypes(&mut self, updates: &mut [Update]) {
        let mut classes: BTreeMap<u32, (Vec<f32>, u64)> = BTreeMap::new();
        for update in updates.iter_mut() {
            for p in std::mem::take(&mut update.prototypes) {
                let Ok(values) = p.values() else { continue };
                let (sum, count) = classes.entry(p.class).or_insert_with(|| (vec![0.0; values.len()], 0));
                if sum.len() == values.len() {
                    sum.iter_mut().zip(&values).for_each(|(s, v)| *s += v);
                    *count += p.count;
                }
            }
        }
        let central = self.config.noise == NoiseSite::Central;
        let merged: Vec<Prototype> = classes
            .into_iter()
            .filter_map(|(class, (mut sum, count))| {
                let count = if central {
                    add_gaussian(&mut sum, self.sigma * self.config.prototype_clip, &mut self.rng);
                    noisy_count(count, self.sigma, &mut self.rng)
                } else {
                    count
                };
                (count > 0).then(|| {
                    let mean: Vec<f32> = sum.iter().map(|s| s / count as f32).collect();
                    Prototype::encode(class, count, &mean, Encoding::F32)
                })
            })
            .collect();
        if let Some(first) = updates.first_mut() {
            first.prototypes = merged;
        }
    }
}

/// An update block's delta from the global block of its name (its values when there is none).
fn block_delta(block: &ParamBlock, base: &BTreeMap<&str, Vec<f32>>) -> Vec<f32> {
    let values = block.decode().unwrap_or_default();
    match base.get(block.name.as_str()) {
        Some(g) if g.len() == values.len() => values.iter().zip(g).map(|(v, g)| v - g).collect(),
        _ => values,
    }
}

/// The block `global + delta`, in f32.
fn rebuilt(block: &ParamBlock, delta: &[f32], base: &BTreeMap<&str, Vec<f32>>) -> ParamBlock {
    let values: Vec<f32> = match base.get(block.name.as_str()) {
        Some(g) if g.len() == delta.len() => g.iter().zip(delta).map(|(g, d)| g + d).collect(),
        _ => delta.to_vec(),
    };
    ParamBlock::encode(block.name.clone(), &block.tensor.shape, &values, Encoding::F32)
}
