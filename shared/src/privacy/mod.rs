//! Differential-privacy accounting (issue 34, item 3).
//!
//! - [`accountant`]: Rényi DP of the Poisson-sampled Gaussian mechanism, its composition over rounds, the
//!   conversion to (ε, δ), the noise multiplier for a target ε, and the [`Accountant`] a server keeps.
//!
//! `reference.py` beside this file prints the reference values the tests compare with (Google's
//! dp-accounting); see the tests' table for the version and the command.

pub mod accountant;

pub use accountant::{
    Accountant, DEFAULT_ORDERS_LEN, PrivacyError, default_orders, epsilon_from_rdp, noise_multiplier_for,
    rdp_sampled_gaussian, rdp_sampled_gaussian_orders,
};

#[cfg(test)]
mod tests;
