//! Robust aggregation and update screening, shared by every method: no single update can break
//! the model.
//!
//! Two halves, both configured by `[engine.robust]` ([`RobustConfig`]):
//!
//! - **Screening, before the ack** ([`RobustConfig::screen_update`],
//!   [`RobustConfig::screen_change`]): every value (of blocks and prototypes) finite and within
//!   `max_abs_value`, the L2 norm of the update's delta from the current global within `max_norm`,
//!   a change that is neither nothing nor far below the last round's (`min_norm_ratio`), and
//!   not all one way (`max_sign_agreement`).
//! - **Bounded influence, when the round closes** ([`RobustConfig::screen_round`], module
//!   `influence`): `num_samples` and prototype counts capped at `max_samples`, then weights clipped
//!   to `weight_cap` × the round's median and deltas to `norm_cap` × the median norm (and the
//!   `max_norm_z` z-score). Nothing acked is dropped here.
//! - **Rules** ([`AggregationRule`]), applied by the methods' block averaging
//!   ([`crate::methods::average_blocks`]): the sample-weighted mean (FedAvg, the default),
//!   coordinate-wise median and trimmed mean (Yin et al. 2018), Krum / multi-Krum (Blanchard et
//!   al. 2017). The rules work on flat f32 vectors per block; Krum on the concatenation of all
//!   blocks of an update.
//!
//! Every rule is translation invariant (median, trimmed mean and Krum's distances do not change
//! when the same vector is added to every input), so applying them to the clients' models is the
//! same as applying them to the deltas and adding the result to the global.

use std::borrow::Cow;

mod influence;

pub use influence::{
    InfluenceReport, MIN_SIGN_VALUES, MIN_Z_UPDATES, lower_median, robust_center_scale, sign_agreement,
};

use anchorage_shared::math::weighted_mean;
use anchorage_shared::protocol::Update;
use anchorage_shared::tensor::ParamBlock;
use serde::{Deserialize, Serialize};

/// How the shared blocks of a round's (screened) updates become the next global blocks.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "rule", rename_all = "kebab-case", deny_unknown_fields, from = "RuleToml")]
pub enum AggregationRule {
    /// The sample-weighted mean w = Σ_k n_k/n · w_k (McMahan et al. 2017, Algorithm 1). Not
    /// robust: one update can move it anywhere.
    #[default]
    Mean,
    /// The coordinate-wise median (Yin et al. 2018, "Byzantine-Robust Distributed Learning:
    /// Towards Optimal Statistical Rates", Definition 1): `g_j = med{x_j^i : i ∈ [m]}` for each
    /// coordinate j; for an even count, the mean of the two middle values. Sample counts are not
    /// used (a claimed count cannot buy influence).
    Median,
    /// The coordinate-wise β-trimmed mean (Yin et al. 2018, Definition 2): for each coordinate,
    /// drop the ⌊β·m⌋ largest and ⌊β·m⌋ smallest values and average the rest,
    /// g_j = 1/((1−2β)m) Σ_{x ∈ U_j} x. `trim` is β, in [0, 0.5). Where ⌊β·m⌋ would leave
    /// nothing, it is lowered so that one value (odd m) or two (even m) remain. Unweighted.
    TrimmedMean { trim: f64 },
    /// Krum / multi-Krum (Blanchard et al. 2017, "Machine Learning with Adversaries: Byzantine
    /// Tolerant Gradient Descent", §4): each update's score is s(i) = Σ_{i→j} ‖V_i − V_j‖², the
    /// sum of squared distances to its n − f − 2 nearest other updates (f = `byzantine`); the
    /// `select` lowest-scoring updates are averaged (unweighted; `select` = 1 is Krum, > 1 is
    /// multi-Krum, §5). Distances are taken on the concatenation of all blocks of an update.
    /// The guarantee needs n ≥ 2f + 3; with fewer updates the neighbour count is clamped to at
    /// least one (a warning is logged) and `select` to at most n.
    Krum { byzantine: usize, select: usize },
}

/// [`AggregationRule`] as written: serde lets an internally tagged unit variant carry unknown
/// keys (`{ rule = "median", trim = 0.2 }` would pass silently), empty struct variants do not.
#[derive(Deserialize)]
#[serde(tag = "rule", rename_all = "kebab-case", deny_unknown_fields)]
enum RuleToml {
    Mean {},
    Median {},
    TrimmedMean { trim: f64 },
    Krum { byzantine: usize, select: usize },
}

impl From<RuleToml> for AggregationRule {
    fn from(r: RuleToml) -> Self {
        match r {
            RuleToml::Mean {} => Self::Mean,
            RuleToml::Median {} => Self::Median,
            RuleToml::TrimmedMean { trim } => Self::TrimmedMean { trim },
            RuleToml::Krum { byzantine, select } => Self::Krum { byzantine, select },
        }
    }
}

impl AggregationRule {
    /// Name as written in config files.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Mean => "mean",
            Self::Median => "median",
            Self::TrimmedMean { .. } => "trimmed-mean",
            Self::Krum { .. } => "krum",
        }
    }

    /// Checks the rule's parameters.
    pub fn validate(&self) -> Result<(), AggregateError> {
        match *self {
            Self::TrimmedMean { trim } if !(0.0..0.5).contains(&trim) => {
                Err(AggregateError::InvalidRule(format!("trimmed-mean needs 0 ≤ trim < 0.5, got {trim}")))
            }
            Self::Krum { select: 0, .. } => Err(AggregateError::InvalidRule("krum needs select ≥ 1".into())),
            _ => Ok(()),
        }
    }

    /// Aggregates the round's updates, block by block. `updates[i]` is one update: its blocks'
    /// values (every update lists the same blocks in the same order) and its weight (sample
    /// count; only the mean uses it). Returns one vector per block.
    pub fn combine(&self, updates: &[(Vec<&[f32]>, f64)]) -> Result<Vec<Vec<f32>>, AggregateError> {
        self.validate()?;
        let (first, _) = updates.first().ok_or(AggregateError::Empty)?;
        let blocks = first.len();
        for (u, _) in updates {
            if u.len() != blocks || u.iter().zip(first).any(|(a, b)| a.len() != b.len()) {
                return Err(AggregateError::Inconsistent);
            }
        }
        let column = |b: usize| -> Vec<&[f32]> { updates.iter().map(|(u, _)| u[b]).collect() };
        match *self {
            Self::Mean => (0..blocks)
                .map(|b| {
                    let parts: Vec<(&[f32], f64)> = updates.iter().map(|(u, w)| (u[b], *w)).collect();
                    weighted_mean(&parts).ok_or(AggregateError::BadWeights)
                })
                .collect(),
            Self::Median => Ok((0..blocks).map(|b| coordinate_median(&column(b))).collect()),
            Self::TrimmedMean { trim } => Ok((0..blocks).map(|b| trimmed_mean(&column(b), trim)).collect()),
            Self::Krum { byzantine, select } => {
                let flat: Vec<&[&[f32]]> = updates.iter().map(|(u, _)| u.as_slice()).collect();
                let chosen = krum_select(&flat, byzantine, select);
                Ok((0..blocks)
                    .map(|b| {
                        let parts: Vec<(&[f32], f64)> = chosen.iter().map(|&i| (updates[i].0[b], 1.0)).collect();
                        weighted_mean(&parts).unwrap_or_default()
                    })
                    .collect())
            }
        }
    }
}

/// Why a rule could not aggregate.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AggregateError {
    #[error("no updates to aggregate")]
    Empty,
    #[error("the updates disagree on their blocks' number or lengths")]
    Inconsistent,
    #[error("the updates' sample weights are not positive and finite")]
    BadWeights,
    #[error("invalid aggregation rule: {0}")]
    InvalidRule(String),
}

/// Coordinate-wise median of equally long vectors (Yin et al. 2018, Def. 1); for an even count
/// the mean of the two middle values. Empty input gives an empty vector.
pub fn coordinate_median(parts: &[&[f32]]) -> Vec<f32> {
    let dim = parts.first().map_or(0, |p| p.len());
    let mut column = vec![0f32; parts.len()];
    (0..dim)
        .map(|j| {
            for (c, p) in column.iter_mut().zip(parts) {
                *c = p[j];
            }
            column.sort_unstable_by(f32::total_cmp);
            let m = column.len();
            if m % 2 == 1 { column[m / 2] } else { ((column[m / 2 - 1] as f64 + column[m / 2] as f64) / 2.0) as f32 }
        })
        .collect()
}

/// Coordinate-wise β-trimmed mean (Yin et al. 2018, Def. 2): per coordinate, drop the
/// k = ⌊β·m⌋ smallest and largest values (k lowered to ⌊(m−1)/2⌋ if it would leave nothing) and
/// average the rest, in f64.
pub fn trimmed_mean(parts: &[&[f32]], trim: f64) -> Vec<f32> {
    let m = parts.len();
    let dim = parts.first().map_or(0, |p| p.len());
    // The small epsilon keeps 0.7·10 = 7.000000000000001 and 0.2·5 at the integer they mean.
    let k = ((trim.max(0.0) * m as f64 + 1e-9).floor() as usize).min(m.saturating_sub(1) / 2);
    let mut column = vec![0f32; m];
    (0..dim)
        .map(|j| {
            for (c, p) in column.iter_mut().zip(parts) {
                *c = p[j];
            }
            column.sort_unstable_by(f32::total_cmp);
            let kept = &column[k..m - k];
            (kept.iter().map(|&x| x as f64).sum::<f64>() / kept.len() as f64) as f32
        })
        .collect()
}

/// Squared L2 distance between two updates given as lists of blocks (the concatenation), in f64.
fn squared_distance(a: &[&[f32]], b: &[&[f32]]) -> f64 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y.iter()))
        .map(|(&x, &y)| {
            let d = x as f64 - y as f64;
            d * d
        })
        .sum()
}

/// Krum scores (Blanchard et al. 2017, §4): s(i) = Σ of the squared distances from update i to
/// its n − f − 2 nearest other updates (clamped to [1, n − 1] neighbours).
pub fn krum_scores(updates: &[&[&[f32]]], byzantine: usize) -> Vec<f64> {
    let n = updates.len();
    let neighbours = n.saturating_sub(byzantine + 2).max(1).min(n.saturating_sub(1));
    let mut dist = vec![vec![0f64; n]; n];
    for i in 0..n {
        for j in i + 1..n {
            let d = squared_distance(updates[i], updates[j]);
            dist[i][j] = d;
            dist[j][i] = d;
        }
    }
    (0..n)
        .map(|i| {
            let mut others: Vec<f64> = (0..n).filter(|&j| j != i).map(|j| dist[i][j]).collect();
            others.sort_unstable_by(f64::total_cmp);
            others.iter().take(neighbours).sum()
        })
        .collect()
}

/// The `select` updates with the lowest Krum scores, ties broken by position (multi-Krum,
/// Blanchard et al. 2017 §5; `select` = 1 is Krum). `select` is clamped to [1, n].
pub fn krum_select(updates: &[&[&[f32]]], byzantine: usize, select: usize) -> Vec<usize> {
    let n = updates.len();
    if n < 2 * byzantine + 3 {
        tracing::warn!(
            updates = n,
            byzantine,
            "krum: fewer than 2f + 3 updates, the Byzantine guarantee does not hold this round"
        );
    }
    let scores = krum_scores(updates, byzantine);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(a.cmp(&b)));
    order.truncate(select.clamp(1, n.max(1)));
    order.sort_unstable();
    order
}

/// `[engine.robust]`: screening of updates and the aggregation rule. The defaults keep plain
/// FedAvg: the mean, no norm bound, no z-score, `max_samples` = 10⁹; only values beyond
/// `max_abs_value` = 10⁶ (which no trained network or class mean holds) are refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "RobustToml")]
pub struct RobustConfig {
    /// How screened updates are combined: `{ rule = "mean" }` (default), `{ rule = "median" }`,
    /// `{ rule = "trimmed-mean", trim = 0.2 }`, `{ rule = "krum", byzantine = 2, select = 1 }`.
    pub aggregation: AggregationRule,
    /// Largest `num_samples` an update (and a prototype's `count`) may claim; larger claims are
    /// lowered to this (and logged).
    pub max_samples: u64,
    /// Largest magnitude of any value in an update's blocks or prototypes; an update holding a
    /// larger one is refused before it is acked. It keeps one update from pushing the model to
    /// magnitudes where the next sums overflow f32.
    pub max_abs_value: f64,
    /// Largest L2 norm of an update's delta from the current global (all blocks together; in
    /// buffered mode from the version the client trained on); an update beyond it is refused
    /// before it is acked. A block the global lacks (a server started without an initial model,
    /// round 1) counts from zero. None: no bound.
    pub max_norm: Option<f64>,
    /// Largest robust z-score of an update's delta norm among the round's: z_i = 0.6745 (x_i −
    /// med) / MAD (Iglewicz & Hoaglin 1993; MAD = median |x − med|; if MAD = 0 the mean absolute
    /// deviation ×1.2533 stands in). One-sided: only unusually large updates are dropped. Needs
    /// at least [`MIN_Z_UPDATES`] updates in the round (the round report says when it did not
    /// run). An update beyond it is not dropped (it was acked) but scaled down to the norm at that
    /// z-score. None: no z-score bound.
    pub max_norm_z: Option<f64>,
    /// Largest weight of one update, as a multiple of the round's lower median sample count (per
    /// class for prototype counts); see [`influence`]. 1 (the default) keeps any
    /// one update under 2/n of the round's weight. None: claimed counts up to `max_samples` count.
    #[serde(serialize_with = "toggle_out")]
    pub weight_cap: Option<f64>,
    /// Largest delta norm, as a multiple of the round's lower median delta norm; larger deltas
    /// are scaled down to it (norm bounding, Sun et al. 2019). Default 2. None: no bound.
    #[serde(serialize_with = "toggle_out")]
    pub norm_cap: Option<f64>,
    /// Smallest delta norm, as a share of the previous round's median; a smaller change (or none
    /// at all) is refused before the ack. Default 0.01. None: no check.
    #[serde(serialize_with = "toggle_out")]
    pub min_norm_ratio: Option<f64>,
    /// Largest share of an update's changed values that may move the same way (a uniform shift
    /// moves all of them); checked before the ack on updates of at least [`MIN_SIGN_VALUES`]
    /// changed values. Default 0.95. None: no check.
    #[serde(serialize_with = "toggle_out")]
    pub max_sign_agreement: Option<f64>,
}

/// Default of `max_samples`.
pub const DEFAULT_MAX_SAMPLES: u64 = 1_000_000_000;
/// Default of `max_abs_value`.
pub const DEFAULT_MAX_ABS_VALUE: f64 = 1e6;

impl Default for RobustConfig {
    fn default() -> Self {
        Self {
            aggregation: AggregationRule::Mean,
            max_samples: DEFAULT_MAX_SAMPLES,
            max_abs_value: DEFAULT_MAX_ABS_VALUE,
            max_norm: None,
            max_norm_z: None,
            weight_cap: Some(1.0),
            norm_cap: Some(2.0),
            min_norm_ratio: Some(0.01),
            max_sign_agreement: Some(0.95),
        }
    }
}

impl RobustConfig {
    /// The papers' plain rule: the sample-weighted mean with no influence bound and no
    /// shape-of-change screen (what the simulator runs unless its `[robust]` table says
    /// otherwise, so that its figures are the papers' FedAvg).
    pub fn unbounded() -> Self {
        Self { weight_cap: None, norm_cap: None, min_norm_ratio: None, max_sign_agreement: None, ..Self::default() }
    }
}

impl RobustConfig {
    /// The screens and bounds that judge each update on its own, each with whether it is set
    /// (beyond its default, for those on by default) and its name: under secure aggregation
    /// the server sees only the sum, so none of them can run.
    pub fn per_update_screens(&self) -> [(bool, &'static str); 6] {
        let d = Self::default();
        [
            (self.max_norm.is_some(), "max_norm"),
            (self.max_norm_z.is_some(), "max_norm_z"),
            (self.weight_cap.is_some() && self.weight_cap != d.weight_cap, "weight_cap"),
            (self.norm_cap.is_some() && self.norm_cap != d.norm_cap, "norm_cap"),
            (self.min_norm_ratio.is_some() && self.min_norm_ratio != d.min_norm_ratio, "min_norm_ratio"),
            (
                self.max_sign_agreement.is_some() && self.max_sign_agreement != d.max_sign_agreement,
                "max_sign_agreement",
            ),
        ]
    }
}

/// `[engine.robust]` as written, checked into a [`RobustConfig`].
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RobustToml {
    aggregation: AggregationRule,
    max_samples: u64,
    max_abs_value: f64,
    max_norm: Option<f64>,
    max_norm_z: Option<f64>,
    /// `false` turns a default bound off (`weight_cap = false`); a number sets it.
    weight_cap: Toggle,
    norm_cap: Toggle,
    min_norm_ratio: Toggle,
    max_sign_agreement: Toggle,
}

/// Writes an off bound as `false`, so that a written config reads back as the same config
/// (a missing key would read back as the default bound).
fn toggle_out<S: serde::Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => s.serialize_f64(*v),
        None => s.serialize_bool(false),
    }
}

/// A bound as written: a number, or `false` for none.
#[derive(Deserialize, Clone, Copy)]
#[serde(untagged)]
enum Toggle {
    Value(f64),
    Switch(bool),
}

impl Toggle {
    fn of(v: Option<f64>) -> Self {
        v.map_or(Self::Switch(false), Self::Value)
    }

    fn get(self, name: &str, default: Option<f64>) -> Result<Option<f64>, String> {
        match self {
            Self::Value(v) => Ok(Some(v)),
            Self::Switch(false) => Ok(None),
            Self::Switch(true) => default.map(Some).ok_or_else(|| format!("{name} = true needs a number")),
        }
    }
}

impl Default for RobustToml {
    fn default() -> Self {
        let d = RobustConfig::default();
        Self {
            aggregation: d.aggregation,
            max_samples: d.max_samples,
            max_abs_value: d.max_abs_value,
            max_norm: d.max_norm,
            max_norm_z: d.max_norm_z,
            weight_cap: Toggle::of(d.weight_cap),
            norm_cap: Toggle::of(d.norm_cap),
            min_norm_ratio: Toggle::of(d.min_norm_ratio),
            max_sign_agreement: Toggle::of(d.max_sign_agreement),
        }
    }
}

impl TryFrom<RobustToml> for RobustConfig {
    type Error = String;

    fn try_from(t: RobustToml) -> Result<Self, String> {
        let d = Self::default();
        let c = Self {
            aggregation: t.aggregation,
            max_samples: t.max_samples,
            max_abs_value: t.max_abs_value,
            max_norm: t.max_norm,
            max_norm_z: t.max_norm_z,
            weight_cap: t.weight_cap.get("weight_cap", d.weight_cap)?,
            norm_cap: t.norm_cap.get("norm_cap", d.norm_cap)?,
            min_norm_ratio: t.min_norm_ratio.get("min_norm_ratio", d.min_norm_ratio)?,
            max_sign_agreement: t.max_sign_agreement.get("max_sign_agreement", d.max_sign_agreement)?,
        };
        c.validate().map_err(|e| e.to_string())?;
        Ok(c)
    }
}

/// Why screening refused an update.
#[derive(Debug, Clone, PartialEq)]
pub enum ScreenReason {
    /// A block or prototype does not decode, or holds a non-finite value.
    BadTensor(String),
    /// A value's magnitude is beyond `max_abs_value`.
    Value { value: f64, bound: f64 },
    /// The delta's norm is beyond `max_norm` (or not finite).
    Norm { norm: f64, bound: f64 },
    /// The update changes nothing (the global model sent back).
    NoChange,
    /// The delta's norm is far below the previous round's median (`min_norm_ratio`).
    TooSmall { norm: f64, bound: f64 },
    /// Nearly all of the delta's values move the same way (`max_sign_agreement`).
    OneWay { agreement: f64, bound: f64 },
}

impl std::fmt::Display for ScreenReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BadTensor(e) => write!(f, "{e}"),
            Self::Value { value, bound } => write!(f, "a value of magnitude {value:.4e} exceeds max_abs_value {bound}"),
            Self::Norm { norm, bound } => write!(f, "update norm {norm:.4e} exceeds max_norm {bound}"),
            Self::NoChange => write!(f, "the update does not change the global model"),
            Self::TooSmall { norm, bound } => {
                write!(f, "update norm {norm:.4e} is below min_norm_ratio × the last round's median ({bound:.4e})")
            }
            Self::OneWay { agreement, bound } => write!(
                f,
                "{:.1}% of the update's changed values move the same way (max_sign_agreement {:.1}%)",
                agreement * 100.0,
                bound * 100.0
            ),
        }
    }
}

/// Above zero; false for NaN, so that a bound read as NaN is refused, not taken for "no bound".
fn positive(x: f64) -> bool {
    x > 0.0
}

/// An update screening kept out of a round.
#[derive(Debug, Clone, PartialEq)]
pub struct Screened {
    pub client: String,
    pub reason: ScreenReason,
}

impl RobustConfig {
    pub fn validate(&self) -> Result<(), AggregateError> {
        self.aggregation.validate()?;
        if self.max_samples == 0 {
            return Err(AggregateError::InvalidRule("max_samples must be at least 1".into()));
        }
        if !positive(self.max_abs_value) {
            return Err(AggregateError::InvalidRule(format!(
                "max_abs_value must be positive, got {}",
                self.max_abs_value
            )));
        }
        if let Some(b) = self.max_norm
            && !positive(b)
        {
            return Err(AggregateError::InvalidRule(format!("max_norm must be positive, got {b}")));
        }
        if let Some(z) = self.max_norm_z
            && !positive(z)
        {
            return Err(AggregateError::InvalidRule(format!("max_norm_z must be positive, got {z}")));
        }
        let positive =
            [("weight_cap", self.weight_cap), ("norm_cap", self.norm_cap), ("min_norm_ratio", self.min_norm_ratio)];
        for (name, v) in positive {
            if let Some(v) = v
                && !(v > 0.0 && v.is_finite())
            {
                return Err(AggregateError::InvalidRule(format!("{name} must be positive, got {v}")));
            }
        }
        if let Some(a) = self.max_sign_agreement
            && !(0.5..=1.0).contains(&a)
        {
            return Err(AggregateError::InvalidRule(format!("max_sign_agreement must be in [0.5, 1], got {a}")));
        }
        Ok(())
    }

    /// Whether `update` claims more samples (or a prototype more members) than `max_samples`.
    fn claims_too_much(&self, update: &Update) -> bool {
        update.num_samples > self.max_samples || update.prototypes.iter().any(|p| p.count > self.max_samples)
    }

    /// Lowers `update.num_samples` and its prototypes' counts to `max_samples`; says whether it did.
    pub fn cap_samples(&self, client: &str, update: &mut Update) -> bool {
        if !self.claims_too_much(update) {
            return false;
        }
        tracing::warn!(
            client,
            claimed = update.num_samples,
            max_samples = self.max_samples,
            "update claims more samples than max_samples; capped"
        );
        update.num_samples = update.num_samples.min(self.max_samples);
        for p in &mut update.prototypes {
            p.count = p.count.min(self.max_samples);
        }
        true
    }

    /// Checks only the values: every block and prototype decodes to finite values within
    /// `max_abs_value`. What a late update (its round closed) must pass before its ack.
    pub fn screen_values(&self, update: &Update) -> Result<(), ScreenReason> {
        let largest = largest_magnitude(update)?;
        if largest > self.max_abs_value {
            return Err(ScreenReason::Value { value: largest, bound: self.max_abs_value });
        }
        Ok(())
    }

    /// Checks one update on its own: every block and prototype decodes to finite values within
    /// `max_abs_value`, and the L2 norm of its blocks' delta from `reference` (the global it
    /// trained on; a block the reference lacks counts from zero) is finite and within `max_norm`.
    /// Returns that norm.
    pub fn screen_update(&self, update: &Update, reference: &[ParamBlock]) -> Result<f64, ScreenReason> {
        self.screen_values(update)?;
        let norm = delta_norm(update, reference)?;
        if !norm.is_finite() {
            return Err(ScreenReason::Norm { norm, bound: self.max_norm.unwrap_or(f64::INFINITY) });
        }
        if let Some(bound) = self.max_norm
            && norm > bound
        {
            return Err(ScreenReason::Norm { norm, bound });
        }
        Ok(norm)
    }

    /// Prepares a round's updates for the method: [`Self::screen_update`] on each again (a safety
    /// net: every update passed it before its ack), `num_samples` capped at `max_samples`, then the
    /// influence bounds ([`Self::bound_round`]). Returns the updates to aggregate (in input
    /// order), the ones screened out, and what the bounds did.
    pub fn screen_round<'a>(&self, inputs: &[(&'a str, &'a Update)], reference: &[ParamBlock]) -> RoundScreen<'a> {
        let mut screened = Vec::new();
        let mut kept: Vec<(&'a str, Cow<'a, Update>)> = Vec::with_capacity(inputs.len());
        let mut norms = Vec::with_capacity(inputs.len());
        for &(client, update) in inputs {
            match self.screen_update(update, reference) {
                Ok(norm) => {
                    norms.push(norm);
                    if self.claims_too_much(update) {
                        let mut capped = update.clone();
                        self.cap_samples(client, &mut capped);
                        kept.push((client, Cow::Owned(capped)));
                    } else {
                        kept.push((client, Cow::Borrowed(update)));
                    }
                }
                Err(reason) => screened.push(Screened { client: client.into(), reason }),
            }
        }
        let influence = self.bound_round(&mut kept, &norms, reference);
        RoundScreen { kept, screened, influence }
    }
}

/// A round's updates after [`RobustConfig::screen_round`].
pub struct RoundScreen<'a> {
    pub kept: Vec<(&'a str, Cow<'a, Update>)>,
    pub screened: Vec<Screened>,
    pub influence: InfluenceReport,
}

/// The largest magnitude of any value in the update's blocks and prototypes; a block or prototype
/// that does not decode or holds a non-finite value is an error.
pub fn largest_magnitude(update: &Update) -> Result<f64, ScreenReason> {
    let blocks = update.blocks.iter().map(|b| b.decode().map_err(|e| ScreenReason::BadTensor(e.to_string())));
    let prototypes = update.prototypes.iter().map(|p| {
        p.validate().map_err(|e| ScreenReason::BadTensor(format!("prototype of class {}: {e}", p.class)))?;
        p.vector.decode().map_err(|e| ScreenReason::BadTensor(format!("prototype of class {}: {e}", p.class)))
    });
    let mut largest = 0f64;
    for values in blocks.chain(prototypes) {
        largest = values?.iter().fold(largest, |m, v| m.max(v.abs() as f64));
    }
    Ok(largest)
}

/// L2 norm (f64) of `update − reference` over all blocks; a block missing from `reference`
/// counts from zero. A block that does not decode (wrong length, non-finite) is an error.
pub fn delta_norm(update: &Update, reference: &[ParamBlock]) -> Result<f64, ScreenReason> {
    let mut sum = 0f64;
    for block in &update.blocks {
        let values = block.decode().map_err(|e| ScreenReason::BadTensor(e.to_string()))?;
        let base = match reference.iter().find(|r| r.name == block.name) {
            Some(r) => Some(r.decode().map_err(|e| ScreenReason::BadTensor(format!("the global's {e}")))?),
            None => None,
        };
        match base.filter(|b| b.len() == values.len()) {
            Some(base) => {
                sum += values.iter().zip(&base).map(|(&v, &b)| (v as f64 - b as f64).powi(2)).sum::<f64>();
            }
            None => sum += values.iter().map(|&v| (v as f64).powi(2)).sum::<f64>(),
        }
    }
    Ok(sum.sqrt())
}

/// One-sided robust z-scores (Iglewicz & Hoaglin 1993, the "modified z-score"):
/// z_i = 0.6745 (x_i − med) / MAD; if MAD = 0, (x_i − med) / (1.2533 · meanAD); if both are 0,
/// or there are fewer than 3 values, every score is 0.
pub fn robust_z(values: &[f64]) -> Vec<f64> {
    match robust_center_scale(values) {
        Some((med, scale)) => values.iter().map(|x| (x - med) / scale).collect(),
        None => vec![0.0; values.len()],
    }
}

#[cfg(test)]
mod tests;
