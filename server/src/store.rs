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
        bytes.extend(
            postcard::to_allocvec(checkpoint)
                .map_err(|e| StoreError::Corrupt { path: path.clone(), detail: e.to_string() })?,
        );
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
            method_state: vec![1, 2, 3],
            prototypes: vec![],
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

/// The durable cost ledger: `ledger.jsonl` in the state folder, one JSON record per line,
/// appended and synced record by record so a restart keeps every record written before it. A line
/// torn by a crash is skipped when read back (and counted), never rewritten.
impl ServerStore {
    pub fn ledger_path(&self) -> PathBuf {
        self.dir.join("ledger.jsonl")
    }

    /// Appends records and syncs them to disk.
    pub fn append_ledger(&self, records: &[anchorage_shared::ledger::CostRecord]) -> Result<(), StoreError> {
        use std::io::Write;
        let path = self.ledger_path();
        let io = |source| StoreError::Io { path: path.clone(), source };
        std::fs::create_dir_all(&self.dir).map_err(|source| StoreError::Io { path: self.dir.clone(), source })?;
        let mut text = String::new();
        for r in records {
            text.push_str(
                &serde_json::to_string(r)
                    .map_err(|e| StoreError::Corrupt { path: path.clone(), detail: e.to_string() })?,
            );
            text.push('\n');
        }
        // A line torn by a crash must not swallow the next record: start on a fresh line.
        if ends_mid_line(&path).map_err(io)? {
            text.insert(0, '\n');
        }
        let mut file = std::fs::OpenOptions::new().create(true).append(true).open(&path).map_err(io)?;
        file.write_all(text.as_bytes()).map_err(io)?;
        file.sync_data().map_err(io)
    }

    /// Every record written so far, and how many unreadable lines were skipped.
    pub fn load_ledger(&self) -> Result<(Vec<anchorage_shared::ledger::CostRecord>, usize), StoreError> {
        let path = self.ledger_path();
        let Some(bytes) = read_if_exists(&path).map_err(|source| StoreError::Io { path: path.clone(), source })? else {
            return Ok((Vec::new(), 0));
        };
        let text = String::from_utf8_lossy(&bytes);
        let (mut records, mut skipped) = (Vec::new(), 0);
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            match serde_json::from_str(line) {
                Ok(r) => records.push(r),
                Err(e) => {
                    skipped += 1;
                    tracing::warn!(path = %path.display(), line = i + 1, error = %e, "skipping an unreadable ledger line");
                }
            }
        }
        Ok((records, skipped))
    }
}

/// Whether a file exists and its last byte is not a newline.
fn ends_mid_line(path: &Path) -> std::io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if file.metadata()?.len() == 0 {
        return Ok(false);
    }
    file.seek(SeekFrom::End(-1))?;
    let mut last = [0u8; 1];
    file.read_exact(&mut last)?;
    Ok(last[0] != b'\n')
}

#[cfg(test)]
mod ledger_tests {
    use super::*;
    use anchorage_shared::ledger::CostRecord;

    #[test]
    fn the_ledger_survives_reopening_and_skips_a_torn_line() {
        let dir = std::env::temp_dir().join(format!("anchorage-ledger-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = ServerStore::new(&dir);
        assert_eq!(store.load_ledger().unwrap(), (vec![], 0));
        let a = CostRecord { client: "a".into(), round: 1, wire_up: 10, joules: 1.5, ..Default::default() };
        let b = CostRecord { client: "b".into(), round: 1, dropped: true, ..Default::default() };
        store.append_ledger(&[a.clone()]).unwrap();
        store.append_ledger(&[b.clone()]).unwrap();
        let reopened = ServerStore::new(&dir);
        assert_eq!(reopened.load_ledger().unwrap(), (vec![a.clone(), b.clone()], 0));
        // A crash mid-append leaves half a line: it is skipped, the rest is kept, and appending goes on.
        let mut f = std::fs::OpenOptions::new().append(true).open(reopened.ledger_path()).unwrap();
        std::io::Write::write_all(&mut f, b"{\"client\":\"c\",\"rou").unwrap();
        drop(f);
        let (records, skipped) = reopened.load_ledger().unwrap();
        assert_eq!((records.len(), skipped), (2, 1));
        let c = CostRecord { client: "c".into(), round: 2, ..Default::default() };
        reopened.append_ledger(&[c.clone()]).unwrap();
        assert_eq!(reopened.load_ledger().unwrap(), (vec![a, b, c], 1), "the record after a torn line is kept");
    }
}
