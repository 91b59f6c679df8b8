//! MNIST in the official idx format (`train-images-idx3-ubyte`, …), plain or gzipped.
//!
//! idx: a big-endian u32 magic (`0x00000803` for u8 images of rank 3, `0x00000801` for u8 labels
//! of rank 1), one big-endian u32 per dimension, then the bytes.

use std::path::{Path, PathBuf};

use super::Split;
use super::source::{find_file, read_maybe_gz};
use crate::{DataError, ImageSet};

/// Magic number of an idx file of u8 images (rank 3).
pub const IMAGES_MAGIC: u32 = 0x0000_0803;
/// Magic number of an idx file of u8 labels (rank 1).
pub const LABELS_MAGIC: u32 = 0x0000_0801;

fn be_u32(bytes: &[u8], at: usize) -> Option<u32> {
    bytes.get(at..at + 4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
}

fn header(path: &Path, bytes: &[u8], magic: u32, rank: usize, what: &'static str) -> Result<Vec<usize>, DataError> {
    let head = 4 + 4 * rank;
    let short = || DataError::BadLength {
        path: path.to_path_buf(),
        expected: head as u64,
        found: bytes.len() as u64,
        what: format!("at least the {head}-byte idx header of {what}"),
    };
    let found = be_u32(bytes, 0).ok_or_else(short)?;
    if found != magic {
        return Err(DataError::BadMagic { path: path.to_path_buf(), expected: magic, found, what });
    }
    let dims: Vec<usize> =
        (0..rank).map(|d| be_u32(bytes, 4 + 4 * d).map(|v| v as usize)).collect::<Option<_>>().ok_or_else(short)?;
    let body: u64 = dims.iter().map(|&d| d as u64).product();
    let expected = head as u64 + body;
    if bytes.len() as u64 != expected {
        return Err(DataError::BadLength {
            path: path.to_path_buf(),
            expected,
            found: bytes.len() as u64,
            what: format!("idx header {dims:?} of {what}"),
        });
    }
    Ok(dims)
}

/// Reads an idx3 image file: `(count, rows, cols, pixels)`.
pub fn read_images(path: &Path) -> Result<(usize, usize, usize, Vec<u8>), DataError> {
    let mut bytes = read_maybe_gz(path)?;
    let dims = header(path, &bytes, IMAGES_MAGIC, 3, "u8 images")?;
    bytes.drain(..16);
    Ok((dims[0], dims[1], dims[2], bytes))
}

/// Reads an idx1 label file (labels must be below 10).
pub fn read_labels(path: &Path) -> Result<Vec<u32>, DataError> {
    let bytes = read_maybe_gz(path)?;
    header(path, &bytes, LABELS_MAGIC, 1, "u8 labels")?;
    let labels: Vec<u32> = bytes[8..].iter().map(|&b| b as u32).collect();
    if let Some((record, &label)) = labels.iter().enumerate().find(|(_, l)| **l >= 10) {
        return Err(DataError::BadLabel { path: path.to_path_buf(), record, label, num_classes: 10 });
    }
    Ok(labels)
}

fn names(split: Split) -> (&'static str, &'static str) {
    match split {
        Split::Train => ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        Split::Test => ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
    }
}

fn paths(dir: &Path, split: Split) -> Result<(PathBuf, PathBuf), DataError> {
    let (img, lab) = names(split);
    // Also accept the dotted spelling some mirrors use (`train-images.idx3-ubyte`).
    let alt = |n: &str| n.replacen("-idx", ".idx", 1);
    let images = find_file(dir, &[img.to_string(), alt(img)], "MNIST images (idx3)")?;
    let labels = find_file(dir, &[lab.to_string(), alt(lab)], "MNIST labels (idx1)")?;
    Ok((images, labels))
}

/// The labels of a split, without reading the images.
pub fn load_labels(dir: &Path, split: Split) -> Result<Vec<u32>, DataError> {
    let (_, labels) = paths(dir, split)?;
    read_labels(&labels)
}

/// Loads a split from `dir` (holding the four idx files, plain or `.gz`): 1×28×28 images, 10 classes.
pub fn load(dir: &Path, split: Split) -> Result<ImageSet, DataError> {
    let (images_path, labels_path) = paths(dir, split)?;
    let (n, rows, cols, pixels) = read_images(&images_path)?;
    let labels = read_labels(&labels_path)?;
    if labels.len() != n {
        return Err(DataError::CountMismatch { images_path, images: n, labels_path, labels: labels.len() });
    }
    Ok(ImageSet {
        channels: 1,
        height: rows,
        width: cols,
        num_classes: 10,
        pixels,
        labels,
        class_names: (0..10).map(|c| c.to_string()).collect(),
    })
}

/// A tiny MNIST in idx format in `dir/mnist/`: `n` 4×4 images per split (pixel `i` of a split
/// is `i mod 251`), labels cycling over the ten classes. For tests and examples that need the
/// real loader on real files without the dataset.
pub fn write_tiny(dir: &Path, n: u32) -> std::io::Result<()> {
    let d = dir.join("mnist");
    std::fs::create_dir_all(&d)?;
    for prefix in ["train", "t10k"] {
        let pixels: Vec<u8> = (0..n * 16).map(|i| (i % 251) as u8).collect();
        let labels: Vec<u8> = (0..n).map(|i| (i % 10) as u8).collect();
        std::fs::write(d.join(format!("{prefix}-images-idx3-ubyte")), idx_file(IMAGES_MAGIC, &[n, 4, 4], &pixels))?;
        std::fs::write(d.join(format!("{prefix}-labels-idx1-ubyte")), idx_file(LABELS_MAGIC, &[n], &labels))?;
    }
    Ok(())
}

/// An idx file's bytes: big-endian magic, dimensions, then the body.
pub fn idx_file(magic: u32, dims: &[u32], body: &[u8]) -> Vec<u8> {
    let mut v = magic.to_be_bytes().to_vec();
    dims.iter().for_each(|d| v.extend_from_slice(&d.to_be_bytes()));
    v.extend_from_slice(body);
    v
}
