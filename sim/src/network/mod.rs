//! The network model: one [`link::Link`] per direction of every client's path, used both by the
//! virtual clock and, through [`socket::ShapedSocket`], under real QUIC.

pub mod link;
pub mod socket;

pub use link::{BurstLoss, DuplexProfile, Link, LinkPreset, LinkProfile, LinkStats, Outage};
pub use socket::{DuplexStats, LinkHandle, ShapedSocket};
