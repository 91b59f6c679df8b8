//! CIFAR-10 and CIFAR-100 in the official binary record layout, plain or gzipped.
//!
//! CIFAR-10: records of 1 label byte + 3,072 pixel bytes (R, G, B planes of 32×32), files
//! `data_batch_1.bin` … `data_batch_5.bin` and `test_batch.bin` (in `cifar-10-batches-bin/`).
//! CIFAR-100: records of a coarse label byte, a fine label byte, then 3,072 pixel bytes, files
//! `train.bin` and `test.bin` (in `cifar-100-binary/`).

use std::path::{Path, PathBuf};

use super::Split;
use super::source::{find_file, read_maybe_gz};
use crate::{DataError, ImageSet};

/// Pixel bytes of one CIFAR image (3 × 32 × 32, channel-major).
pub const IMAGE_BYTES: usize = 3 * 32 * 32;

/// The CIFAR-10 class names in label order.
pub const CIFAR10_CLASSES: [&str; 10] =
    ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"];

/// Which record layout (and which label of CIFAR-100).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CifarKind {
    /// 10 classes, 3,073-byte records.
    Cifar10,
    /// 100 fine classes, 3,074-byte records (coarse byte skipped).
    Cifar100Fine,
    /// 20 coarse superclasses, 3,074-byte records.
    Cifar100Coarse,
}

impl CifarKind {
    /// Bytes per record.
    pub fn record_size(self) -> usize {
        match self {
            CifarKind::Cifar10 => 1 + IMAGE_BYTES,
            _ => 2 + IMAGE_BYTES,
        }
    }

    pub fn num_classes(self) -> u32 {
        match self {
            CifarKind::Cifar10 => 10,
            CifarKind::Cifar100Fine => 100,
            CifarKind::Cifar100Coarse => 20,
        }
    }

    fn label_offset(self) -> usize {
        match self {
            CifarKind::Cifar100Fine => 1,
            _ => 0,
        }
    }

    fn label_bytes(self) -> usize {
        self.record_size() - IMAGE_BYTES
    }

    fn what(self) -> &'static str {
        match self {
            CifarKind::Cifar10 => "CIFAR-10 records: 1 label byte + 3072 pixel bytes",
            _ => "CIFAR-100 records: coarse + fine label bytes + 3072 pixel bytes",
        }
    }

    fn class_names(self) -> Vec<String> {
        match self {
            CifarKind::Cifar10 => CIFAR10_CLASSES.iter().map(|s| s.to_string()).collect(),
            _ => (0..self.num_classes()).map(|c| c.to_string()).collect(),
        }
    }
}

fn checked(path: &Path, kind: CifarKind) -> Result<Vec<u8>, DataError> {
    let bytes = read_maybe_gz(path)?;
    let rs = kind.record_size();
    if bytes.is_empty() || bytes.len() % rs != 0 {
        return Err(DataError::BadRecordSize {
            path: path.to_path_buf(),
            record_size: rs,
            len: bytes.len() as u64,
            what: kind.what(),
        });
    }
    let n = bytes.len() / rs;
    for record in 0..n {
        let label = bytes[record * rs + kind.label_offset()] as u32;
        if label >= kind.num_classes() {
            return Err(DataError::BadLabel {
                path: path.to_path_buf(),
                record,
                label,
                num_classes: kind.num_classes(),
            });
        }
    }
    Ok(bytes)
}

/// The labels of one binary file.
pub fn read_batch_labels(path: &Path, kind: CifarKind) -> Result<Vec<u32>, DataError> {
    let bytes = checked(path, kind)?;
    Ok(bytes.chunks_exact(kind.record_size()).map(|r| r[kind.label_offset()] as u32).collect())
}

/// Reads one binary file into 3×32×32 images.
pub fn read_batch(path: &Path, kind: CifarKind) -> Result<ImageSet, DataError> {
    let bytes = checked(path, kind)?;
    let rs = kind.record_size();
    let n = bytes.len() / rs;
    let mut pixels = Vec::with_capacity(n * IMAGE_BYTES);
    let mut labels = Vec::with_capacity(n);
    for r in bytes.chunks_exact(rs) {
        labels.push(r[kind.label_offset()] as u32);
        pixels.extend_from_slice(&r[kind.label_bytes()..]);
    }
    Ok(ImageSet {
        channels: 3,
        height: 32,
        width: 32,
        num_classes: kind.num_classes(),
        pixels,
        labels,
        class_names: kind.class_names(),
    })
}

/// Concatenates several binary files (in order).
pub fn read_batches(paths: &[PathBuf], kind: CifarKind) -> Result<ImageSet, DataError> {
    let mut out: Option<ImageSet> = None;
    for p in paths {
        let b = read_batch(p, kind)?;
        match out.as_mut() {
            None => out = Some(b),
            Some(o) => {
                o.pixels.extend_from_slice(&b.pixels);
                o.labels.extend_from_slice(&b.labels);
            }
        }
    }
    out.ok_or_else(|| DataError::Invalid("no CIFAR batch files given".into()))
}

/// The batch files of a split under `dir` (or `dir/cifar-10-batches-bin`, `dir/cifar-100-binary`).
pub fn batch_files(dir: &Path, kind: CifarKind, split: Split) -> Result<Vec<PathBuf>, DataError> {
    let (sub, names): (&str, Vec<String>) = match (kind, split) {
        (CifarKind::Cifar10, Split::Train) => {
            ("cifar-10-batches-bin", (1..=5).map(|i| format!("data_batch_{i}.bin")).collect())
        }
        (CifarKind::Cifar10, Split::Test) => ("cifar-10-batches-bin", vec!["test_batch.bin".into()]),
        (_, Split::Train) => ("cifar-100-binary", vec!["train.bin".into()]),
        (_, Split::Test) => ("cifar-100-binary", vec!["test.bin".into()]),
    };
    let base = if dir.join(sub).is_dir() { dir.join(sub) } else { dir.to_path_buf() };
    names.iter().map(|n| find_file(&base, std::slice::from_ref(n), "CIFAR binary batch")).collect()
}

/// Loads a split of CIFAR-10 or CIFAR-100 from the official binary files under `dir`.
pub fn load(dir: &Path, kind: CifarKind, split: Split) -> Result<ImageSet, DataError> {
    read_batches(&batch_files(dir, kind, split)?, kind)
}

/// The labels of a split, without keeping the pixels.
pub fn load_labels(dir: &Path, kind: CifarKind, split: Split) -> Result<Vec<u32>, DataError> {
    let mut labels = Vec::new();
    for p in batch_files(dir, kind, split)? {
        labels.extend(read_batch_labels(&p, kind)?);
    }
    Ok(labels)
}
