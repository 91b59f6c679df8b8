//! Durable local state:
//! - the update that was trained but not yet acknowledged. It is written before the upload
//!   starts, so a crash or a lost connection never loses trained work;
//! - the method's device state: what it keeps on the device and never uploads (FedTA's anchors
//!   and heads, see [`crate::methods::ClientMethod::device_state`]), written after every round.

use std::path::{Path, PathBuf};

use anchorage_shared::io::{read_if_exists, write_atomic};
use anchorage_shared::protocol::{Message, Update};
use anchorage_shared::tensor::ParamBlock;

/// The store could not read or write.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot access {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is corrupt ({detail}); it was left untouched")]
    Corrupt { path: PathBuf, detail: String },
}

const MAGIC: &[u8; 8] = b"ANCHUPD1";
const STATE_MAGIC: &[u8; 8] = b"ANCHDEV1";

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
        match update {
            Some(u) => save_framed(&path, MAGIC, u),
            None => match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(StoreError::Io { path, source: e }),
                _ => Ok(()),
            },
        }
    }

    fn state_path(&self) -> PathBuf {
        self.dir.join("device-state.bin")
    }

    /// Saves the method's device state, atomically (the previous one stays until the new one is
    /// whole on disk).
    pub fn save_device_state(&self, blocks: &[ParamBlock]) -> Result<(), StoreError> {
        save_framed(&self.state_path(), STATE_MAGIC, &blocks)
    }

    /// The method's device state, if one was saved; a file that does not decode to valid blocks is
    /// an error and is left as it is.
    pub fn load_device_state(&self) -> Result<Option<Vec<ParamBlock>>, StoreError> {
        let path = self.state_path();
        let Some(blocks) = load_framed::<Vec<ParamBlock>>(&path, STATE_MAGIC)? else { return Ok(None) };
        for b in &blocks {
            b.validate().map_err(|e| StoreError::Corrupt { path: path.clone(), detail: e.to_string() })?;
        }
        Ok(Some(blocks))
    }

    /// Moves a device state that cannot be used aside (`device-state.bin.refused-<unix time>`),
    /// so the next save does not overwrite what an operator may want to look at. Returns where
    /// it went.
    pub fn set_aside_device_state(&self) -> Result<PathBuf, StoreError> {
        let path = self.state_path();
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let aside = self.dir.join(format!("device-state.bin.refused-{secs}"));
        std::fs::rename(&path, &aside).map_err(|source| StoreError::Io { path, source })?;
        Ok(aside)
    }

    /// The unacknowledged update, if one was saved.
    pub fn load_pending(&self) -> Result<Option<Update>, StoreError> {
        let path = self.pending_path();
        let Some(update) = load_framed::<Update>(&path, MAGIC)? else { return Ok(None) };
        Message::Update(update.clone())
            .validate()
            .map_err(|e| StoreError::Corrupt { path: path.clone(), detail: e.to_string() })?;
        Ok(Some(update))
    }
}

/// Writes `magic` and the postcard encoding of `value` to `path`, atomically.
fn save_framed<T: serde::Serialize + ?Sized>(path: &Path, magic: &[u8; 8], value: &T) -> Result<(), StoreError> {
    let mut bytes = magic.to_vec();
    bytes.extend(
        postcard::to_allocvec(value).map_err(|e| StoreError::Corrupt { path: path.into(), detail: e.to_string() })?,
    );
    write_atomic(path, &bytes).map_err(|source| StoreError::Io { path: path.into(), source })
}

/// What [`save_framed`] wrote to `path`, `None` when there is no file; a wrong header or body is
/// [`StoreError::Corrupt`].
fn load_framed<T: serde::de::DeserializeOwned>(path: &Path, magic: &[u8; 8]) -> Result<Option<T>, StoreError> {
    let Some(bytes) = read_if_exists(path).map_err(|source| StoreError::Io { path: path.into(), source })? else {
        return Ok(None);
    };
    let corrupt = |detail: String| StoreError::Corrupt { path: path.into(), detail };
    let body = bytes
        .strip_prefix(magic.as_slice())
        .ok_or_else(|| corrupt(format!("missing {} header", String::from_utf8_lossy(magic))))?;
    postcard::from_bytes(body).map(Some).map_err(|e| corrupt(e.to_string()))
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

    #[test]
    fn device_state_survives_and_a_corrupt_one_is_refused_and_set_aside() {
        let dir = std::env::temp_dir().join(format!("anchorage-client-state-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = ClientStore::new(&dir);
        assert!(store.load_device_state().unwrap().is_none());
        let blocks = vec![
            ParamBlock::encode("tail.values", &[2, 2], &[1.0, -2.0, 3.5, 0.0], Encoding::F32),
            ParamBlock::encode("tail.seated", &[1], &[7.0], Encoding::F32),
        ];
        store.save_device_state(&blocks).unwrap();
        assert_eq!(ClientStore::new(&dir).load_device_state().unwrap(), Some(blocks.clone()));
        // Cut short: refused, not half-loaded.
        let path = dir.join("device-state.bin");
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 5]).unwrap();
        assert!(matches!(store.load_device_state(), Err(StoreError::Corrupt { .. })));
        // A non-finite value is refused too.
        let nan = vec![ParamBlock::encode("tail.values", &[1], &[f32::NAN], Encoding::F32)];
        store.save_device_state(&nan).unwrap();
        assert!(matches!(store.load_device_state(), Err(StoreError::Corrupt { .. })));
        let aside = store.set_aside_device_state().unwrap();
        assert!(aside.exists() && !path.exists(), "the refused file is kept beside, not deleted");
        assert!(store.load_device_state().unwrap().is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
