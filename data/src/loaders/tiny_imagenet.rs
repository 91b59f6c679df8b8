//! The Tiny-ImageNet(-100) layout: `<root>/train/<wnid>/*.JPEG`, `<root>/val/<wnid>/*.JPEG` and
//! `<root>/wnids.txt` (one wnid a line; label = line index), from a directory or a `.tar.gz`.
//! 64×64 JPEG, a few grayscale (converted to RGB).

use std::path::Path;

use super::Split;
use super::image_folder::{self, ClassOrder, ImageFolderOptions, Listing};
use crate::{DataError, ImageSet};

/// Image-folder options for a split (`Train` → `train/`, `Test` → `val/`), labels from `wnids.txt`.
pub fn options(split: Split) -> ImageFolderOptions {
    ImageFolderOptions {
        split: Some(match split {
            Split::Train => "train".into(),
            Split::Test => "val".into(),
        }),
        classes: ClassOrder::File("wnids.txt".into()),
        ..ImageFolderOptions::default()
    }
}

/// Loads a split (all images; see [`image_folder::load`] with [`options`] for resize or a cap per class).
pub fn load(path: &Path, split: Split) -> Result<ImageSet, DataError> {
    image_folder::load(path, &options(split))
}

/// Lists a split without decoding.
pub fn list(path: &Path, split: Split) -> Result<Listing, DataError> {
    image_folder::list(path, &options(split))
}
