//! Reading whole files, gunzipping them when they start with the gzip magic, and finding a file
//! among candidate names.

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::DataError;

/// The gzip magic bytes.
pub(crate) const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Reads `path`; if it starts with the gzip magic, returns the decompressed bytes.
pub(crate) fn read_maybe_gz(path: &Path) -> Result<Vec<u8>, DataError> {
    let raw = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
    if raw.starts_with(&GZIP_MAGIC) {
        // The gzip trailer's ISIZE (the last 4 bytes) is the uncompressed size mod 2^32: reserving
        // exactly that keeps read_to_end from doubling its buffer past the data (78 MB held for
        // MNIST's 47 MB of training images otherwise). Only a hint: a multi-member or >4 GiB file
        // still reads whole.
        let isize =
            raw.len().checked_sub(4).map(|at| u32::from_le_bytes([raw[at], raw[at + 1], raw[at + 2], raw[at + 3]]));
        // Capped by deflate's largest ratio (about 1032:1), so a forged trailer cannot reserve more.
        let hint = isize.map_or(raw.len() * 4, |n| n as usize).min(raw.len().saturating_mul(1032));
        let mut out = Vec::with_capacity(hint);
        flate2::read::MultiGzDecoder::new(raw.as_slice())
            .read_to_end(&mut out)
            .map_err(|e| DataError::Gzip { path: path.to_path_buf(), message: e.to_string() })?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// The first of `dir/<name>` and `dir/<name>.gz` (for each name, in order) that exists.
pub(crate) fn find_file(dir: &Path, names: &[String], what: &str) -> Result<PathBuf, DataError> {
    let mut candidates = Vec::new();
    for name in names {
        for n in [name.clone(), format!("{name}.gz")] {
            let p = dir.join(&n);
            if p.is_file() {
                return Ok(p);
            }
            candidates.push(n);
        }
    }
    Err(DataError::NotFound { dir: dir.to_path_buf(), what: what.to_string(), candidates })
}
