//! Bounded influence per device: one update's voice in a round stays within a budget the
//! operator sets in `[engine.robust]`, whatever it claims, and no bound ever drops an update that
//! was acked (an ack means "in this round's aggregate").
//!
//! Two bounds run on the round's updates when it closes, before the method aggregates them:
//! - **Weight clipping.** n_i ← min(n_i, ⌈`weight_cap` · m_n⌉), m_n the round's lower median of the
//!   claimed sample counts (prototype counts per class alike). With `weight_cap` = 1 an update holds
//!   at most 1/⌈n/2⌉ ≤ 2/n of the round's weight, whatever count it claims.
//! - **Norm bounding** (Sun et al. 2019, "Can You Really Backdoor Federated Learning?", §4: the
//!   server clips each delta to a norm bound; here the bound follows the round, as in Andrew et al.
//!   2021, "Differentially Private Learning with Adaptive Clipping", which sets it at a quantile of
//!   the updates' norms): Δ_i ← Δ_i · min(1, τ/‖Δ_i‖) with τ = `norm_cap` · m_Δ, m_Δ the lower
//!   median delta norm. `max_norm_z` tightens τ to med + z · scale of the robust z-score
//!   (winsorising instead of dropping), and runs only with [`MIN_Z_UPDATES`] updates or more.
//!
//! Two screens of the change's shape run per update, before the ack
//! ([`RobustConfig::screen_change`]): a change that is nothing or far smaller than the previous
//! round's median (`min_norm_ratio`), and a change whose coordinates nearly all move one way
//! (`max_sign_agreement`), which an honest gradient step does not do.

use std::borrow::Cow;

use anchorage_shared::protocol::Update;
use anchorage_shared::tensor::{Encoding, ParamBlock};
use serde::{Deserialize, Serialize};

use super::{RobustConfig, ScreenReason};

/// Fewest updates for which the robust z-score of the norms means anything: a MAD over 3
/// values is degenerate (one of them is always "the outlier").
pub const MIN_Z_UPDATES: usize = 5;

/// Fewest changed coordinates on which the sign-agreement screen judges a change.
pub const MIN_SIGN_VALUES: usize = 256;

/// What the bounds did to one round, kept in its report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InfluenceReport {
    /// Clients whose sample (or prototype) count was lowered to the round's cap.
    pub weight_clipped: Vec<String>,
    /// Clients whose delta was scaled down to the round's norm bound.
    pub norm_clipped: Vec<String>,
    /// The round's lower median delta norm (the next round's `min_norm_ratio` reference).
    pub median_norm: Option<f64>,
    /// The norm bound τ applied this round, if any.
    pub norm_bound: Option<f64>,
    /// Rules that did not run this round, and why (too few updates, no reference yet).
    pub skipped: Vec<String>,
}

/// The lower median: the ⌈n/2⌉-th smallest value (for two values, the smaller), so that one
/// large value can never set it.
pub fn lower_median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.to_vec();
    v.sort_unstable_by(f64::total_cmp);
    v.get(v.len().checked_sub(1)? / 2).copied()
}

impl RobustConfig {
    /// The shape-of-change screens, before the ack. `norm` is the update's delta norm from
    /// `reference` ([`RobustConfig::screen_update`]), `previous_median` the last aggregated round's
    /// lower median norm. An update with prototypes is not judged on its blocks alone (FedTA's
    /// input enhancement may stay unchanged while its prototypes carry the round).
    pub fn screen_change(
        &self,
        update: &Update,
        reference: &[ParamBlock],
        norm: f64,
        previous_median: Option<f64>,
    ) -> Result<(), ScreenReason> {
        if update.blocks.is_empty() || !update.prototypes.is_empty() {
            return Ok(());
        }
        if norm == 0.0 && (self.min_norm_ratio.is_some() || self.max_sign_agreement.is_some()) {
            return Err(ScreenReason::NoChange);
        }
        if let Some(bound) = self.max_sign_agreement {
            let (agreement, counted) = sign_agreement(update, reference)?;
            if counted >= MIN_SIGN_VALUES && agreement > bound {
                return Err(ScreenReason::OneWay { agreement, bound });
            }
        }
        if let Some(ratio) = self.min_norm_ratio
            && let Some(median) = previous_median.filter(|m| *m > 0.0)
            && norm < ratio * median
        {
            return Err(ScreenReason::TooSmall { norm, bound: ratio * median });
        }
        Ok(())
    }

    /// Applies the weight and norm bounds to a round's updates (`norms[i]` is update i's delta
    /// norm from `reference`). Never drops an update.
    pub fn bound_round<'a>(
        &self,
        updates: &mut [(&'a str, Cow<'a, Update>)],
        norms: &[f64],
        reference: &[ParamBlock],
    ) -> InfluenceReport {
        let mut report = InfluenceReport { median_norm: lower_median(norms), ..InfluenceReport::default() };
        if let Some(cap) = self.weight_cap {
            clip_weights(updates, cap, &mut report);
        }
        let mut bound = self.norm_cap.zip(report.median_norm).map(|(c, m)| c * m);
        if let Some(z) = self.max_norm_z {
            if norms.len() < MIN_Z_UPDATES {
                report.skipped.push(format!(
                    "max_norm_z: {} updates, the robust z-score needs at least {MIN_Z_UPDATES}",
                    norms.len()
                ));
            } else if let Some((center, scale)) = robust_center_scale(norms) {
                let tz = center + z * scale;
                bound = Some(bound.map_or(tz, |b| b.min(tz)));
            }
        }
        report.norm_bound = bound.filter(|b| *b > 0.0);
        if let Some(tau) = report.norm_bound {
            for ((client, update), &norm) in updates.iter_mut().zip(norms) {
                if norm > tau {
                    scale_delta(update.to_mut(), reference, tau / norm);
                    report.norm_clipped.push((*client).to_string());
                }
            }
        }
        report
    }
}

/// n_i ← min(n_i, ⌈cap · lower median⌉) for sample counts, and per class for prototype counts.
fn clip_weights(updates: &mut [(&str, Cow<'_, Update>)], cap: f64, report: &mut InfluenceReport) {
    let counts: Vec<f64> = updates.iter().map(|(_, u)| u.num_samples as f64).collect();
    let limit = |m: f64| (cap * m).ceil().max(1.0) as u64;
    let sample_cap = lower_median(&counts).map(limit);
    let mut class_caps = std::collections::BTreeMap::<u32, Vec<f64>>::new();
    for (_, u) in updates.iter() {
        for p in &u.prototypes {
            class_caps.entry(p.class).or_default().push(p.count as f64);
        }
    }
    let class_caps: std::collections::BTreeMap<u32, u64> =
        class_caps.into_iter().filter_map(|(c, v)| lower_median(&v).map(|m| (c, limit(m)))).collect();
    for (client, update) in updates.iter_mut() {
        let over_samples = sample_cap.is_some_and(|c| update.num_samples > c);
        let over_class = update.prototypes.iter().any(|p| class_caps.get(&p.class).is_some_and(|&c| p.count > c));
        if !over_samples && !over_class {
            continue;
        }
        let u = update.to_mut();
        if let Some(c) = sample_cap {
            u.num_samples = u.num_samples.min(c);
        }
        for p in &mut u.prototypes {
            if let Some(&c) = class_caps.get(&p.class) {
                p.count = p.count.min(c);
            }
        }
        report.weight_clipped.push((*client).to_string());
    }
}

/// Rewrites `update`'s blocks as reference + factor · (block − reference) (a block the reference
/// lacks counts from zero), in f32.
fn scale_delta(update: &mut Update, reference: &[ParamBlock], factor: f64) {
    for block in &mut update.blocks {
        let Ok(values) = block.decode() else { continue };
        let base = reference.iter().find(|r| r.name == block.name).and_then(|r| r.decode().ok());
        let scaled: Vec<f32> = match base.filter(|b| b.len() == values.len()) {
            Some(base) => {
                values.iter().zip(&base).map(|(&v, &b)| (b as f64 + factor * (v as f64 - b as f64)) as f32).collect()
            }
            None => values.iter().map(|&v| (factor * v as f64) as f32).collect(),
        };
        *block = ParamBlock::encode(block.name.clone(), &block.tensor.shape, &scaled, Encoding::F32);
    }
}

/// The share of the changed coordinates that move the majority's way, and how many changed.
pub fn sign_agreement(update: &Update, reference: &[ParamBlock]) -> Result<(f64, usize), ScreenReason> {
    let (mut up, mut down) = (0usize, 0usize);
    for block in &update.blocks {
        let values = block.decode().map_err(|e| ScreenReason::BadTensor(e.to_string()))?;
        let base = reference.iter().find(|r| r.name == block.name).and_then(|r| r.decode().ok());
        let base = base.filter(|b| b.len() == values.len());
        for (i, &v) in values.iter().enumerate() {
            let d = v - base.as_ref().map_or(0.0, |b| b[i]);
            up += (d > 0.0) as usize;
            down += (d < 0.0) as usize;
        }
    }
    let counted = up + down;
    Ok(if counted == 0 { (0.0, 0) } else { (up.max(down) as f64 / counted as f64, counted) })
}

/// The modified z-score's centre and scale (Iglewicz & Hoaglin 1993): the median and MAD/0.6745
/// (1.2533 · mean absolute deviation when MAD = 0); none with fewer than 3 values or no spread.
pub fn robust_center_scale(values: &[f64]) -> Option<(f64, f64)> {
    if values.len() < 3 {
        return None;
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_unstable_by(f64::total_cmp);
        let m = v.len();
        if m % 2 == 1 { v[m / 2] } else { (v[m / 2 - 1] + v[m / 2]) / 2.0 }
    };
    let med = median(&mut values.to_vec());
    let mut dev: Vec<f64> = values.iter().map(|x| (x - med).abs()).collect();
    let mean_ad = dev.iter().sum::<f64>() / dev.len() as f64;
    let mad = median(&mut dev);
    if mad > 0.0 {
        Some((med, mad / 0.6745))
    } else if mean_ad > 0.0 {
        Some((med, 1.253314 * mean_ad))
    } else {
        None
    }
}
