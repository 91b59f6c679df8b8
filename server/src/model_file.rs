//! The initial-model file (`initial-model.bin`): the global model of round 1, written by
//! `anchorage provision` from the method's own model and read by the server at its first start.
//! Magic, SHA-256 of the body, then the postcard-encoded parameter blocks; a damaged file is an
//! error that names it.

use std::path::Path;

use anchorage_shared::tensor::ParamBlock;
use anyhow::Context;

const MAGIC: &[u8; 8] = b"ANCHMDL1";

/// Writes `blocks` to `path`, atomically.
pub fn save(path: &Path, blocks: &[ParamBlock]) -> anyhow::Result<()> {
    let body = postcard::to_allocvec(blocks).context("encoding the model")?;
    let mut bytes = MAGIC.to_vec();
    bytes.extend_from_slice(ring::digest::digest(&ring::digest::SHA256, &body).as_ref());
    bytes.extend_from_slice(&body);
    anchorage_shared::io::write_atomic(path, &bytes).with_context(|| format!("writing {}", path.display()))
}

/// Reads what [`save`] wrote, checking the checksum and every block.
pub fn load(path: &Path) -> anyhow::Result<Vec<ParamBlock>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading the initial model {}", path.display()))?;
    let corrupt = |why: &str| anyhow::anyhow!("the initial model {} is not usable: {why}", path.display());
    let rest = bytes.strip_prefix(MAGIC.as_slice()).ok_or_else(|| corrupt("no ANCHMDL1 header"))?;
    anyhow::ensure!(rest.len() >= 32, corrupt("cut short"));
    let (sum, body) = rest.split_at(32);
    anyhow::ensure!(ring::digest::digest(&ring::digest::SHA256, body).as_ref() == sum, corrupt("checksum mismatch"));
    let blocks: Vec<ParamBlock> = postcard::from_bytes(body).map_err(|e| corrupt(&e.to_string()))?;
    for b in &blocks {
        b.validate().map_err(|e| corrupt(&e.to_string()))?;
    }
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use anchorage_shared::tensor::Encoding;

    #[test]
    fn round_trips_and_refuses_a_damaged_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("initial-model.bin");
        let blocks = vec![ParamBlock::encode("head.weight", &[2], &[1.0, -2.0], Encoding::F32)];
        save(&path, &blocks).unwrap();
        assert_eq!(load(&path).unwrap(), blocks);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let err = load(&path).unwrap_err().to_string();
        assert!(err.contains("checksum") && err.contains("initial-model.bin"), "{err}");
    }
}
