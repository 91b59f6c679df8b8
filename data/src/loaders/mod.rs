//! Loaders of the real datasets: MNIST idx, CIFAR-10/100 binary records, image folders (directory,
//! `.tar` or `.tar.gz`) and the Tiny-ImageNet-100 layout. Every loader returns an [`ImageSet`]
//! (u8, CHW) — call [`ImageSet::to_dataset`](crate::images::ImageSet::to_dataset) for f32 in [0, 1] — and never panics on file input:
//! a missing, truncated or corrupt file is a [`DataError`](crate::DataError) naming the file and
//! what was expected.
//!
//! [`ImageSet`]: crate::ImageSet

pub mod cifar;
pub(crate) mod decode;
pub mod image_folder;
pub mod mnist;
pub(crate) mod source;
pub mod tiny_imagenet;

pub use decode::resize_bilinear;

/// Which half of a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Split {
    Train,
    Test,
}
