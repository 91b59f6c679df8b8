//! anchorage-data: datasets, transforms and seeded partitions for clients and the simulator.
//!
//! Everything random draws from [`anchorage_shared::rng::Rng`], so the same seed gives the same
//! data and the same split byte for byte.

mod dataset;
mod error;
pub mod partition;
pub mod synthetic;

pub use dataset::Dataset;
pub use error::DataError;
pub use synthetic::SyntheticConfig;
