//! Differential privacy: the `[privacy]` table, the Gaussian mechanism's pieces, and
//! the accounting.
//!
//! - [`config`]: `[privacy]`: who noises (server or device), the clips, σ or the ε to reach.
//! - [`mechanism`]: clipping a delta or a feature, Gaussian noise on sums and counts, adaptive
//!   clipping's step.
//! - [`accountant`]: Rényi DP of the Poisson-sampled Gaussian mechanism, its composition over rounds, the
//!   conversion to (ε, δ), the noise multiplier for a target ε, and the [`Accountant`] a server keeps.
//!
//! `reference.py` beside this file prints the reference values the tests compare with (Google's
//! dp-accounting); see the tests' table for the version and the command.

pub mod accountant;
pub mod config;
pub mod mechanism;

pub use accountant::{
    Accountant, DEFAULT_ORDERS_LEN, PrivacyError, default_orders, epsilon_from_rdp, noise_multiplier_for,
    noise_multiplier_for_mechanisms, rdp_sampled_gaussian, rdp_sampled_gaussian_orders,
};
pub use config::{AdaptiveClip, NoiseSite, PrivacyConfig, PrivacyConfigError};

#[cfg(test)]
mod tests;
