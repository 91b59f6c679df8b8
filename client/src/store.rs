//! Durable local state: the update that was trained but not yet acknowledged. It is written
//! before the upload starts, so a crash or a lost connection never loses trained work.

use std::path::{Path, PathBuf};

use anchorage_shared::io::{read_if_exists, write_atomic};
use anchorage_shared::protocol::{Message, Update};

/// The store could not read or write.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot access {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is corrupt ({detail}); it was left untouched")]
    Corrupt { path: PathBuf, detail: String },
}

const MAGIC: &[u8; 8] = b"ANCHUPD1";

/// A client's state folder.
#[derive(Debug, Clone)]
pub struct ClientStore {
    dir: PathBuf,
}

impl ClientStore {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn pending_path(&self) -> PathBuf {
        self.dir.join("pending-update.bin")
    }

    /// Saves (or, with `None`, clears) the unacknowledged update, atomically.
    pub fn save_pending(&self, update: Option<&Update>) -> Result<(), StoreError> {
        let path = self.pending_path();
        let io = |source| StoreError::Io { path: path.clone(), source };
        match update {
            Some(u) => {
                let mut bytes = MAGIC.to_vec();
                bytes.extend(
                    postcard::to_allocvec(u)
                        .map_err(|e| StoreError::Corrupt { path: path.clone(), detail: e.to_string() })?,
                );
                write_atomic(&path, &bytes).map_err(io)
            }
            None => match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(e)),
                _ => Ok(()),
            },
        }
    }

    /// The unacknowledged update, if one was saved.
    pub fn load_pending(&self) -> Result<Option<Update>, StoreError> {
        let path = self.pending_path();
        let Some(bytes) = read_if_exists(&path).map_err(|source| StoreError::Io { path: path.clone(), source })? else {
            return Ok(None);
        };
        let corrupt = |detail: String| StoreError::Corrupt { path: path.clone(), detail };
        let body = bytes.strip_prefix(MAGIC.as_slice()).ok_or_else(|| corrupt("missing ANCHUPD1 header".into()))?;
        let update: Update = postcard::from_bytes(body).map_err(|e| corrupt(e.to_string()))?;
        Message::Update(update.clone()).validate().map_err(|e| corrupt(e.to_string()))?;
        Ok(Some(update))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anchorage_shared::tensor::{Encoding, ParamBlock};

    #[test]
    fn pending_update_survives_and_clears() {
        let dir = std::env::temp_dir().join(format!("anchorage-client-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = ClientStore::new(&dir);
        assert!(store.load_pending().unwrap().is_none());
        let u = Update {
            round: 4,
            num_samples: 10,
            blocks: vec![ParamBlock::encode("head.bias", &[3], &[1.0, 2.0, 3.0], Encoding::F32)],
            prototypes: vec![],
            metrics: vec![],
            compute_seconds: 0.5,
        };
        store.save_pending(Some(&u)).unwrap();
        assert_eq!(ClientStore::new(&dir).load_pending().unwrap(), Some(u));
        std::fs::write(dir.join("pending-update.bin"), b"ANCHUPD1garbage").unwrap();
        assert!(matches!(store.load_pending(), Err(StoreError::Corrupt { .. })));
        store.save_pending(None).unwrap();
        assert!(store.load_pending().unwrap().is_none());
        store.save_pending(None).unwrap();
    }
}
