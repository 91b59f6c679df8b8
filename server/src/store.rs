//! Durable server state: the checkpoint of the global model and counters, written atomically
//! after every round (DESIGN.md §3 step 5), read back on restart.

use std::path::{Path, PathBuf};

use anchorage_shared::io::{read_if_exists, write_atomic};

use crate::engine::Checkpoint;

/// Why the store could not load or save.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot access {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("checkpoint {path} is corrupt ({detail}); it was left untouched")]
    Corrupt { path: PathBuf, detail: String },
}

/// Magic and format version in front of every checkpoint file.
const MAGIC: &[u8; 8] = b"ANCHCKP1";

/// The server's state folder.
#[derive(Debug, Clone)]
pub struct ServerStore {
    dir: PathBuf,
}

impl ServerStore {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn checkpoint_path(&self) -> PathBuf {
        self.dir.join("checkpoint.bin")
    }

    /// Saves the checkpoint atomically.
    pub fn save(&self, checkpoint: &Checkpoint) -> Result<(), StoreError> {
        let path = self.checkpoint_path();
        let mut bytes = MAGIC.to_vec();
        bytes.extend(postcard::to_allocvec(checkpoint).map_err(|e| StoreError::Corrupt { path: path.clone(), detail: e.to_string() })?);
        write_atomic(&path, &bytes).map_err(|source| StoreError::Io { path, source })
    }

    /// Loads the last checkpoint, `None` when the folder holds none yet.
    pub fn load(&self) -> Result<Option<Checkpoint>, StoreError> {
        let path = self.checkpoint_path();
        let Some(bytes) = read_if_exists(&path).map_err(|source| StoreError::Io { path: path.clone(), source })? else {
            return Ok(None);
        };
        decode(&bytes).map(Some).map_err(|detail| StoreError::Corrupt { path, detail })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn decode(bytes: &[u8]) -> Result<Checkpoint, String> {
    let body = bytes.strip_prefix(MAGIC.as_slice()).ok_or("missing ANCHCKP1 header")?;
    let checkpoint: Checkpoint = postcard::from_bytes(body).map_err(|e| e.to_string())?;
    for block in &checkpoint.global {
        block.validate().map_err(|e| e.to_string())?;
    }
    Ok(checkpoint)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::EngineStats;
    use anchorage_shared::tensor::{Encoding, ParamBlock};

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("anchorage-store-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn round_trips_and_reports_corruption() {
        let store = ServerStore::new(temp_dir("rt"));
        assert!(store.load().unwrap().is_none());
        let cp = Checkpoint {
            round: 3,
            method: "fedavg".into(),
            global: vec![ParamBlock::encode("head.bias", &[2], &[1.0, -1.0], Encoding::F32)],
            stats: EngineStats { late_updates: 2, ..Default::default() },
        };
        store.save(&cp).unwrap();
        assert_eq!(store.load().unwrap(), Some(cp.clone()));
        // A torn write is impossible through `save`; a file damaged by other means is reported and kept.
        let path = store.checkpoint_path();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes.truncate(bytes.len() - 3);
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(store.load(), Err(StoreError::Corrupt { .. })));
        assert_eq!(std::fs::read(&path).unwrap(), bytes, "a corrupt checkpoint is left as it was");
    }
}
