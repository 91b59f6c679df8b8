//! `[privacy]`: differential privacy of what leaves a device, one table read by the
//! server (`[engine.privacy]`), the devices (`[privacy]` of client.toml) and the simulator
//! (`[privacy]` of a scenario, given to both).
//!
//! - Parameter updates: DP-FedAvg (McMahan, Ramage, Talwar, Zhang 2018, "Learning Differentially
//!   Private Recurrent Language Models", Algorithm 1): each device's delta from the broadcast
//!   model is clipped to L2 norm `clip` (all shared blocks together), the round averages the
//!   clipped deltas with equal weights, and Gaussian noise of standard deviation
//!   `noise_multiplier · clip` goes on their sum: by the server (`noise = "central"`, a trusted
//!   server) or by each device on its own delta (`"local"`, an untrusted one).
//! - Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially Private
//!   Learning with Adaptive Clipping", Algorithm 1): the clip follows the `target_quantile` of the
//!   deltas' norms, C ← C·exp(−η(b̄ − γ)), from a noised count of the deltas within the clip.
//! - Prototypes: each sample's feature is clipped to `prototype_clip` before a device sums it,
//!   and devices send per-class sums and counts (not means) so that the noise, a buffer and a
//!   secure sum all work on sums; Gaussian noise of `noise_multiplier · prototype_clip` goes on
//!   each sum and of `noise_multiplier` on each count.
//!
//! The accountant ([`super::Accountant`]) turns the noise multiplier and each round's sampling
//! rate into ε at `delta`; the server refuses new rounds once `max_epsilon` would be passed.

use serde::{Deserialize, Serialize};

/// Who adds the noise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NoiseSite {
    /// No differential privacy (the default): updates and prototypes as the methods make them.
    #[default]
    Off,
    /// The server clips and noises the round's sum (it is trusted with each update).
    Central,
    /// Each device clips and noises what it sends (the server is not trusted).
    Local,
}

impl NoiseSite {
    /// The name configs use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Central => "central",
            Self::Local => "local",
        }
    }
}

/// Adaptive clipping's settings (Andrew et al. 2021, Algorithm 1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdaptiveClip {
    /// γ: the share of deltas the clip should leave unclipped (their norms' quantile).
    pub target_quantile: f64,
    /// η_C: the geometric learning rate of the clip.
    pub learning_rate: f64,
    /// σ_b: noise multiplier of the count of unclipped deltas (the paper's default m/20 for m
    /// devices per round; here as a multiplier of that count's sensitivity, 1).
    pub count_noise_multiplier: f64,
}

impl Default for AdaptiveClip {
    /// The paper's defaults: γ = 0.5, η_C = 0.2.
    fn default() -> Self {
        Self { target_quantile: 0.5, learning_rate: 0.2, count_noise_multiplier: 1.0 }
    }
}

/// The `[privacy]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrivacyConfig {
    /// Who adds the noise (off by default).
    pub noise: NoiseSite,
    /// C: the L2 bound of one device's update delta, all shared blocks together (the initial
    /// clip under adaptive clipping).
    pub clip: f64,
    /// σ: the noise on a round's sum of clipped deltas has standard deviation σ·C. Unset, it
    /// is the smallest that keeps `target_epsilon` after the run's rounds.
    pub noise_multiplier: Option<f64>,
    /// The ε to reach after the run's rounds (sets σ when `noise_multiplier` is unset).
    pub target_epsilon: Option<f64>,
    /// δ of the (ε, δ) guarantee: below one over the number of devices.
    pub delta: f64,
    /// No round opens that would take ε past this (default: `target_epsilon`; neither: no
    /// limit, ε is reported only).
    pub max_epsilon: Option<f64>,
    /// The L2 bound of one sample's feature before it enters a prototype sum.
    pub prototype_clip: f64,
    /// Adaptive clipping of update deltas (central noise only); absent: a fixed clip.
    pub adaptive: Option<AdaptiveClip>,
}

impl Default for PrivacyConfig {
    fn default() -> Self {
        Self {
            noise: NoiseSite::Off,
            clip: 1.0,
            noise_multiplier: None,
            target_epsilon: None,
            delta: 1e-5,
            max_epsilon: None,
            prototype_clip: 1.0,
            adaptive: None,
        }
    }
}

/// Why a `[privacy]` table is refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PrivacyConfigError {
    /// A setting that cannot work, and why.
    #[error("[privacy] {0}")]
    Invalid(alloc::string::String),
}

impl PrivacyConfig {
    /// Whether differential privacy is on.
    pub fn is_on(&self) -> bool {
        self.noise != NoiseSite::Off
    }

    /// Whether it is off (configs leave the table out then).
    pub fn is_off(&self) -> bool {
        !self.is_on()
    }

    /// The ε limit rounds stop at, if any.
    pub fn epsilon_limit(&self) -> Option<f64> {
        self.max_epsilon.or(self.target_epsilon)
    }

    /// Refuses values that make no guarantee or no sense; says which key and why.
    pub fn check(&self) -> Result<(), PrivacyConfigError> {
        let bad = |why: &str| Err(PrivacyConfigError::Invalid(why.into()));
        if !self.is_on() {
            return Ok(());
        }
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !(positive(self.clip) && positive(self.prototype_clip)) {
            return bad("clip and prototype_clip must be finite and positive");
        }
        if !(self.delta > 0.0 && self.delta < 1.0) {
            return bad("delta must be in (0, 1)");
        }
        match (self.noise_multiplier, self.target_epsilon) {
            (None, None) => return bad("set noise_multiplier or target_epsilon"),
            (Some(s), _) if !(s.is_finite() && s > 0.0) => return bad("noise_multiplier must be finite and positive"),
            (_, Some(e)) if !(e.is_finite() && e > 0.0) => return bad("target_epsilon must be finite and positive"),
            _ => {}
        }
        if self.max_epsilon.is_some_and(|e| !(e.is_finite() && e > 0.0)) {
            return bad("max_epsilon must be finite and positive");
        }
        if let Some(a) = &self.adaptive {
            if self.noise == NoiseSite::Local {
                return bad("adaptive clipping needs central noise: the server sets the clip from every delta's norm");
            }
            let fine = a.target_quantile > 0.0
                && a.target_quantile < 1.0
                && a.learning_rate.is_finite()
                && a.learning_rate > 0.0
                && a.count_noise_multiplier.is_finite()
                && a.count_noise_multiplier > 0.0;
            if !fine {
                return bad(
                    "adaptive needs target_quantile in (0, 1) and positive learning_rate and count_noise_multiplier",
                );
            }
        }
        Ok(())
    }

    /// σ: `noise_multiplier`, or the smallest that keeps `target_epsilon` at `delta` after
    /// `rounds` rounds at sampling rate `q` (1 under local noise: each participation releases
    /// the device's own data), each round releasing the deltas' sum and, for a method that
    /// sends `prototypes`, the prototype sums and counts too (multiplier σ/√2 for that pair).
    /// The server's accountant and the devices' noise both come from here.
    pub fn noise_multiplier(&self, rounds: u64, q: f64, prototypes: bool) -> Result<f64, PrivacyConfigError> {
        use alloc::format;
        if let Some(sigma) = self.noise_multiplier {
            return Ok(sigma);
        }
        let eps =
            self.target_epsilon.ok_or(PrivacyConfigError::Invalid("set noise_multiplier or target_epsilon".into()))?;
        if rounds == 0 {
            return Err(PrivacyConfigError::Invalid(
                "target_epsilon needs a number of rounds to spread it over".into(),
            ));
        }
        let q = if self.noise == NoiseSite::Local { 1.0 } else { q.clamp(f64::MIN_POSITIVE, 1.0) };
        let scales: &[f64] = if prototypes { &[1.0, core::f64::consts::FRAC_1_SQRT_2] } else { &[1.0] };
        super::noise_multiplier_for_mechanisms(eps, self.delta, q, rounds, &super::default_orders(), scales).map_err(
            |e| PrivacyConfigError::Invalid(format!("no noise multiplier reaches ε = {eps} in {rounds} rounds: {e}")),
        )
    }

    /// The noise multiplier of the deltas' sum: the configured or computed σ, which under
    /// adaptive clipping pays for the noised count: σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) (Andrew et al.
    /// 2021, Theorem 1), so the pair costs what σ alone would.
    pub fn delta_noise_multiplier(&self, sigma: f64) -> Option<f64> {
        match &self.adaptive {
            None => Some(sigma),
            Some(a) => {
                let rest = 1.0 / (sigma * sigma) - 1.0 / (4.0 * a.count_noise_multiplier * a.count_noise_multiplier);
                (rest > 0.0).then(|| 1.0 / libm::sqrt(rest))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;

    #[test]
    fn off_by_default_and_bad_tables_are_refused_with_the_key() {
        assert!(!PrivacyConfig::default().is_on());
        assert!(PrivacyConfig::default().check().is_ok());
        let on = PrivacyConfig { noise: NoiseSite::Central, noise_multiplier: Some(1.0), ..PrivacyConfig::default() };
        assert!(on.check().is_ok());
        let none = PrivacyConfig { noise_multiplier: None, ..on.clone() };
        assert!(none.check().unwrap_err().to_string().contains("target_epsilon"));
        let clip = PrivacyConfig { clip: f64::NAN, ..on.clone() };
        assert!(clip.check().unwrap_err().to_string().contains("clip"));
        let local = PrivacyConfig { noise: NoiseSite::Local, adaptive: Some(AdaptiveClip::default()), ..on };
        assert!(local.check().unwrap_err().to_string().contains("central"));
    }

    #[test]
    fn adaptive_clipping_pays_for_its_count_out_of_sigma() {
        let c = PrivacyConfig {
            adaptive: Some(AdaptiveClip { count_noise_multiplier: 5.0, ..AdaptiveClip::default() }),
            ..PrivacyConfig::default()
        };
        // σ = 1, σ_b = 5: σ_Δ = (1 − 1/100)^(−1/2).
        let s = c.delta_noise_multiplier(1.0).unwrap();
        assert!((s - (0.99f64).powf(-0.5)).abs() < 1e-12, "{s}");
        assert!(c.delta_noise_multiplier(20.0).is_none(), "σ_b too small for this σ");
    }
}
