//! anchorage-shared: the language the Anchorage client and server both speak.
//!
//! `#![no_std]` + `alloc` so the same definitions can run on a microcontroller-class
//! device; the `std` feature (on by default) adds `std::error::Error` impls.
//!
//! - [`protocol`]: versioned messages and their typed decode errors.
//! - [`checks`]: what the programs' pre-start checks report (check-config, doctor).
//! - [`frame`]: length-prefixed framing with a configurable maximum, and an incremental reader.
//! - [`tensor`]: named parameter blocks and their wire encodings (f32, f16, bf16, int8 + scale,
//!   a top-k delta, zstd).
//! - [`sparse`]: the top-k delta's layout and selection (error feedback lives on the device).
//! - [`compress`]: zstd over an encoded block, bounded by the block's declared size.
//! - [`prototype`]: class prototypes as they travel.
//! - [`prototype_rules`]: the papers' prototype rules (fusion, evolving prototype, translation, BGPS).
//! - [`method`]: every method's typed config and the one registry both halves and the simulator read.
//! - [`metric`]: the typed names of the metrics a device reports.
//! - [`math`]: weighted means and cosine similarity, the one copy used everywhere.
//! - [`ledger`]: the cost record of one client in one round.
//! - [`priority`]: the send priorities of the QUIC streams both sides open.
//! - [`privacy`]: the differential-privacy accountant (RDP of the sampled Gaussian, ε at δ).
//! - [`io`] (feature `io`): async frame reading/writing and atomic files, for the tokio shells.
//! - [`systemd`] (feature `io`): sd_notify readiness, watchdog and stopping for the two services.
//! - `logging` (feature `logging`): the binaries' log set-up (text or JSON lines on stderr).
//! - [`rng`]: a small seeded generator, so every sampled choice is reproducible byte for byte.
//! - [`skip`] (feature `std`): how a test says loudly that it skipped a check it cannot run here.
#![no_std]
#![warn(missing_docs)]
extern crate alloc;
#[cfg(feature = "std")]
extern crate std;

pub mod checks;
pub mod compress;
pub mod frame;
#[cfg(feature = "io")]
pub mod io;
pub mod ledger;
#[cfg(feature = "logging")]
pub mod logging;
pub mod math;
pub mod method;
pub mod metric;
pub mod priority;
pub mod privacy;
pub mod protocol;
pub mod prototype;
pub mod prototype_rules;
pub mod rng;
#[cfg(feature = "std")]
pub mod skip;
pub mod sparse;
#[cfg(feature = "io")]
pub mod systemd;
pub mod tensor;
#[cfg(feature = "io")]
pub mod transfer;

pub use frame::{FrameError, FrameReader, encode_frame};
pub use method::MethodConfig;
pub use metric::MetricKey;
pub use protocol::{DecodeError, Message, PROTOCOL_VERSION};
pub use prototype::Prototype;
pub use tensor::{Dense, EncodedTensor, Encoding, Packed, ParamBlock, TensorError};
