//! The engine's typed errors: why a configuration cannot run, why the privacy state cannot be
//! made, why an update's prototypes are in the wrong form.

use anchorage_shared::privacy::{PrivacyConfigError, PrivacyError};

/// Why a federation's configuration cannot run. The server's start, `check-config`,
/// `anchorage provision` and the simulator show it as it is.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    /// The compatibility table refuses the combination ([`super::compat::RULES`]).
    #[error("{0}")]
    Combination(String),
    /// `[engine.policy]`'s learning-rate schedule cannot be followed.
    #[error("[engine.policy] schedule {0}")]
    Schedule(&'static str),
    /// `[engine.secagg]`'s values cannot hold.
    #[error("{0}")]
    SecAgg(String),
    /// `[engine.privacy]`'s values cannot hold.
    #[error(transparent)]
    Privacy(#[from] PrivacyStateError),
}

/// Why the privacy state cannot be made or continued.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PrivacyStateError {
    /// The `[privacy]` table is refused, or no noise multiplier reaches its ε.
    #[error(transparent)]
    Config(#[from] PrivacyConfigError),
    /// The accountant refused a parameter.
    #[error("[privacy] {0}")]
    Accountant(#[from] PrivacyError),
    /// The adaptive clip's count noise would be too small for the noise multiplier.
    #[error("[privacy] adaptive.count_noise_multiplier is too small for σ")]
    CountNoise,
    /// The configured δ is not the one the federation's account was kept at.
    #[error("[privacy] delta is {configured}, the federation's account is at δ = {accounted}")]
    Delta { configured: f64, accounted: f64 },
}

/// Why an update's prototypes are not in the form `[privacy]` expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PrototypeFormError {
    #[error("[privacy] is on here: prototypes must come as sums (the device's [privacy] is off?)")]
    SumsExpected,
    #[error("prototype sums arrived, but [privacy] is off here")]
    SumsUnexpected,
}
