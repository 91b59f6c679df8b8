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
        let mut out = Vec::with_capacity(raw.len() * 4);
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
