//! SecAgg+ secure aggregation (Bell, Bonawitz, Gascón, Lepoint, Raykova 2020, "Secure
//! Single-Server Aggregation with (Poly)Logarithmic Overhead"), the sparse-graph form of SecAgg
//! (Bonawitz et al. 2017, "Practical Secure Aggregation for Privacy-Preserving Machine
//! Learning"), as two I/O-free state machines in the manner of quinn-proto: [`ClientState`] and
//! [`ServerState`] take messages in and hand messages out; the shells own sockets and clocks.
//!
//! # The round
//!
//! 1. **Advertise keys** (round 0). The server sends the [`RoundConfig`] (sample, [`Params`], graph
//!    seed, vector length); each client draws two x25519 key pairs (mask agreement s_u, share
//!    encryption c_u) and a self-mask seed b_u, and sends its public keys.
//! 2. **Share keys** (round 1). Each client gets the keys of its neighbours on the round's graph
//!    ([`graph`]: a randomly relabelled Harary graph of degree k = O(log n)), splits b_u and s_u
//!    t-out-of-k with Shamir and sends each neighbour its pair, AEAD-sealed under a key agreed
//!    through c.
//! 3. **Masked input** (round 2). Each client opens the shares addressed to it and sends
//!    y_u = x_u + PRG(b_u) + Σ_v ±PRG(s_{u,v}) mod 2^32 over the neighbours v that shared; the
//!    server adds the y_u into one running sum.
//! 4. **Unmask** (round 4). The server tells each survivor which of its neighbours survived and
//!    which dropped; it answers with the b shares of the survivors and the s shares of the
//!    dropped, never both for one peer. From t shares each the server rebuilds the b_u and s_v,
//!    strips the masks, and outputs only the [`Aggregate`]: the sum and the number of
//!    contributors. A round where some secret has fewer than t shares fails with
//!    [`SecAggError::BelowThreshold`] and outputs nothing.
//!
//! The server never receives an unmasked vector: [`ClientState`] holds the input and wipes it once
//! masked; [`ServerState`] keeps only the running sum ([`ServerState::held_vectors`]).
//!
//! # Vectors
//!
//! The protocol sums `u32` vectors mod 2^32. [`quantize`] turns f32 updates into such vectors
//! with a clipping range sized so that a sum of up to `max_clients` never wraps. A caller may
//! put several things in one vector, e.g. quantised prototype sums followed by raw per-class
//! counts: each segment is summed element-wise, and each segment's own bound (quantiser levels,
//! or count ≤ (2^32 − 1) / n) rules out overflow. [`layout`] is that vector for a federated
//! update: the clipped delta from the global model, prototype sums and counts ([`Layout`]), and
//! the frame that carries the layout to a device with round 0 ([`ServerFrame`]).
//!
//! # Security model
//!
//! Semi-honest server and clients, with the client-side checks of Bonawitz et al.: a client
//! answers round 4 once, refuses to reveal both shares of one peer
//! ([`SecAggError::BothShares`]), and refuses lists that do not partition the neighbours it holds
//! shares of or that leave fewer than t survivors. The consistency check of Bonawitz et al.'s
//! round 3 (signed survivor lists, which needs a PKI binding keys to devices) is not run, so a
//! malicious server that lies about dropouts is only bounded by t > k/2 and those checks.
//! Key pairs are fresh per round; every seed and AEAD key is bound to the round and both ids.
//!
//! # Crates
//!
//! - `x25519-dalek` 3 / `curve25519-dalek` 5 (dalek-cryptography, BSD-3-Clause): the key
//!   agreements; curve25519-dalek's `Scalar` (with its `group` feature) is the prime field Z_ℓ,
//!   ℓ = 2^252 + 27742317777372353535851937790883648493, that the secrets are shared over.
//! - `vsss-rs` 6 (Apache-2.0 OR MIT): Shamir sharing over any `ff::PrimeField`, with chosen
//!   x-coordinates, maintained through 2025–26, no_std; chosen over `sharks`/`blahaj` (GF(256)
//!   byte-wise sharing, at most 255 holders, no prime field) and over writing Lagrange
//!   interpolation here.
//! - `chacha20` 0.10 (RustCrypto, MIT OR Apache-2.0): the mask PRG and the seeded RNG; already in
//!   Cargo.lock through rand 0.10, and it implements the rand_core 0.10 traits that vsss-rs and
//!   curve25519-dalek 5 take (rand_chacha 0.9 implements rand_core 0.9).
//! - `ring` (already the TLS stack's): HKDF-SHA256 for every derived seed and key,
//!   ChaCha20-Poly1305 for the shares.

#![warn(missing_docs)]

mod client;
pub mod error;
pub mod graph;
mod keys;
pub mod layout;
mod mask;
pub mod messages;
pub mod quantize;
mod recover;
mod server;
mod shares;
#[cfg(test)]
mod tests;

pub use client::ClientState;
pub use error::SecAggError;
pub use graph::{Graph, Params};
pub use layout::{Layout, ServerFrame};
pub use messages::{ClientId, ClientMessage, PublicKeys, RoundConfig, ServerMessage, Stage};
pub use quantize::{Quantizer, Rounding};
pub use server::{Advance, Aggregate, ServerState};
