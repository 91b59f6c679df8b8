//! anchorage-data: datasets, loaders, transforms and seeded partitions for clients and the simulator.
//!
//! Everything random draws from [`anchorage_shared::rng::Rng`], so the same seed gives the same
//! data and the same split byte for byte. Library code never panics on file input: a missing or
//! corrupt file is a [`DataError`] that names the file and what was expected.

pub mod circle;
mod dataset;
mod describe;
pub mod domain;
mod error;
mod images;
pub mod loaders;
pub mod partition;
pub mod spec;
pub mod synthetic;
pub mod transform;

pub use dataset::Dataset;
pub use describe::{Description, Summary, TaskRow, describe, describe_split};
pub use error::DataError;
pub use images::ImageSet;
pub use spec::{
    DataSpec, DatasetKind, EvaluateOn, FilesChecked, LabelPools, LoadedData, PartitionSpec, build_split, check_files,
    label_pools, load, load_rows,
};
pub use synthetic::SyntheticConfig;
