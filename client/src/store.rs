//! Durable local state:
//! - the update that was trained but not yet acknowledged. It is written before the upload
//!   starts, so a crash or a lost connection never loses trained work;
//! - the method's device state: what it keeps on the device and never uploads (FedTA's anchors
//!   and heads, see [`crate::methods::ClientMethod::device_state`]), written after every round.
//!
//! Both files are framed: an 8-byte magic, the CRC-32 of the body and its length, then the
//! postcard body (see [`save_framed`]). The first format (magic only, no checksum) is still
//! read, so devices upgrade in place. A file that fails its check is never used and never
//! deleted: it is set aside beside the original (`<name>.corrupt-<unix secs>`) with a warning,
//! and loading goes on as if there were no file, so a bad file costs one round's work at most
//! instead of a crash loop or a garbage upload.

use std::path::{Path, PathBuf};

use anchorage_shared::io::{read_if_exists, write_atomic};
use anchorage_shared::protocol::{Message, Update};
use anchorage_shared::tensor::ParamBlock;

/// The store could not read or write.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot access {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is corrupt ({detail})")]
    Corrupt { path: PathBuf, detail: String },
}

/// The header of one kind of file: the magic written now and the older one still read.
struct Format {
    /// `magic | crc32 (u32 LE) | body length (u64 LE) | body`.
    current: &'static [u8; 8],
    /// `magic | body`, no checksum (written before checksums existed).
    legacy: &'static [u8; 8],
}

const PENDING: Format = Format { current: b"ANCHUPD2", legacy: b"ANCHUPD1" };
const DEVICE_STATE: Format = Format { current: b"ANCHDEV2", legacy: b"ANCHDEV1" };
/// Bytes of the current header: magic, checksum, body length.
const HEADER_LEN: usize = 8 + 4 + 8;

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

    /// Saves (or, with `None`, clears) the unacknowledged update, atomically. Clear it only once
    /// the server acknowledged the update; one it refused is [set aside](Self::set_aside_pending).
    pub fn save_pending(&self, update: Option<&Update>) -> Result<(), StoreError> {
        let path = self.pending_path();
        match update {
            Some(u) => save_framed(&path, &PENDING, u),
            None => match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(StoreError::Io { path, source: e }),
                _ => Ok(()),
            },
        }
    }

    /// The unacknowledged update, if one was saved. A file that fails its checksum, header,
    /// decoding or validation is set aside (`pending-update.bin.corrupt-<unix secs>`, with a
    /// warning) and this returns `Ok(None)`: it is not resent. Only an unreadable folder is an
    /// error.
    pub fn load_pending(&self) -> Result<Option<Update>, StoreError> {
        let path = self.pending_path();
        let loaded = load_framed::<Update>(&path, &PENDING).and_then(|update| match update {
            Some(u) => Message::Update(u.clone())
                .validate()
                .map(|()| Some(u))
                .map_err(|e| StoreError::Corrupt { path: path.clone(), detail: e.to_string() }),
            None => Ok(None),
        });
        self.or_set_aside(loaded)
    }

    /// Moves the unacknowledged update aside (`pending-update.bin.refused-<unix secs>`) because
    /// the server refused it for good: it is not resent, and it is kept for an operator rather
    /// than deleted. Returns where it went (`None`: there was no file).
    pub fn set_aside_pending(&self, why: &str) -> Result<Option<PathBuf>, StoreError> {
        set_aside(&self.pending_path(), "refused", why)
    }

    fn state_path(&self) -> PathBuf {
        self.dir.join("device-state.bin")
    }

    /// Saves the method's device state, atomically (the previous one stays until the new one is
    /// whole on disk).
    pub fn save_device_state(&self, blocks: &[ParamBlock]) -> Result<(), StoreError> {
        save_framed(&self.state_path(), &DEVICE_STATE, &blocks)
    }

    /// The method's device state, if one was saved. A file that fails its checksum, header or
    /// decoding, or holds an invalid block (a non-finite value), is set aside
    /// (`device-state.bin.corrupt-<unix secs>`, with a warning) and this returns `Ok(None)`: the
    /// method starts from a fresh state. Only an unreadable folder is an error.
    pub fn load_device_state(&self) -> Result<Option<Vec<ParamBlock>>, StoreError> {
        let path = self.state_path();
        let loaded = load_framed::<Vec<ParamBlock>>(&path, &DEVICE_STATE).and_then(|blocks| {
            for b in blocks.iter().flatten() {
                b.validate().map_err(|e| StoreError::Corrupt { path: path.clone(), detail: e.to_string() })?;
            }
            Ok(blocks)
        });
        self.or_set_aside(loaded)
    }

    /// Moves a device state that the method refuses (another method or model) aside
    /// (`device-state.bin.refused-<unix secs>`), so the next save does not overwrite what an
    /// operator may want to look at. Returns where it went (`None`: there was no file).
    pub fn set_aside_device_state(&self, why: &str) -> Result<Option<PathBuf>, StoreError> {
        set_aside(&self.state_path(), "refused", why)
    }

    /// `loaded`, with a corrupt file set aside and read as no file.
    fn or_set_aside<T>(&self, loaded: Result<Option<T>, StoreError>) -> Result<Option<T>, StoreError> {
        match loaded {
            Err(StoreError::Corrupt { path, detail }) => {
                set_aside(&path, "corrupt", &detail)?;
                Ok(None)
            }
            other => other,
        }
    }
}

/// Renames `path` to `<path>.<label>-<unix secs>` in the same folder (with `.1`, `.2`, … added
/// if that name is taken) and warns, naming both paths and `why`. `Ok(None)` when there is no
/// file at `path`. The one place a client file is put out of use without being deleted.
fn set_aside(path: &Path, label: &str, why: &str) -> Result<Option<PathBuf>, StoreError> {
    if !path.exists() {
        return Ok(None);
    }
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let base = format!("{}.{label}-{secs}", path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default());
    let dir = path.parent().unwrap_or(Path::new("."));
    let aside = (0..)
        .map(|i| if i == 0 { dir.join(&base) } else { dir.join(format!("{base}.{i}")) })
        .find(|p| !p.exists())
        .expect("an unused name");
    match std::fs::rename(path, &aside) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(StoreError::Io { path: path.into(), source }),
    }
    tracing::warn!(file = %path.display(), aside = %aside.display(), %why, "set a client state file aside; it is not used");
    Ok(Some(aside))
}

/// CRC-32 (IEEE 802.3; the one zlib, PNG and gzip use), table-driven. Written out here rather
/// than taken from a crate: it is a dozen lines, these files are written once a round so its
/// speed does not matter, and it keeps the device build's dependency list (what gets audited
/// for an edge device) unchanged.
fn crc32(bytes: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut table = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
                k += 1;
            }
            table[i] = c;
            i += 1;
        }
        table
    };
    !bytes.iter().fold(!0u32, |c, &b| TABLE[((c ^ u32::from(b)) & 0xFF) as usize] ^ (c >> 8))
}

/// Writes `format.current`, the CRC-32 and length of the body, and the body (the postcard
/// encoding of `value`) to `path`, atomically.
fn save_framed<T: serde::Serialize + ?Sized>(path: &Path, format: &Format, value: &T) -> Result<(), StoreError> {
    let body =
        postcard::to_allocvec(value).map_err(|e| StoreError::Corrupt { path: path.into(), detail: e.to_string() })?;
    let mut bytes = Vec::with_capacity(HEADER_LEN + body.len());
    bytes.extend_from_slice(format.current);
    bytes.extend_from_slice(&crc32(&body).to_le_bytes());
    bytes.extend_from_slice(&(body.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&body);
    write_atomic(path, &bytes).map_err(|source| StoreError::Io { path: path.into(), source })
}

/// What [`save_framed`] (or the first, checksum-less format) wrote to `path`; `None` when there
/// is no file. A wrong header, checksum, length or body is [`StoreError::Corrupt`].
fn load_framed<T: serde::de::DeserializeOwned>(path: &Path, format: &Format) -> Result<Option<T>, StoreError> {
    let Some(bytes) = read_if_exists(path).map_err(|source| StoreError::Io { path: path.into(), source })? else {
        return Ok(None);
    };
    let corrupt = |detail: String| StoreError::Corrupt { path: path.into(), detail };
    let body = if let Some(rest) = bytes.strip_prefix(format.current.as_slice()) {
        if rest.len() < HEADER_LEN - 8 {
            return Err(corrupt(format!("header cut short ({} bytes)", bytes.len())));
        }
        let (crc, rest) = rest.split_at(4);
        let (len, body) = rest.split_at(8);
        let crc = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
        let len = u64::from_le_bytes(len.try_into().expect("8 bytes"));
        if body.len() as u64 != len {
            return Err(corrupt(format!("body is {} bytes, the header says {len}", body.len())));
        }
        let actual = crc32(body);
        if actual != crc {
            return Err(corrupt(format!("checksum mismatch: CRC-32 {actual:08x}, the header says {crc:08x}")));
        }
        body
    } else if let Some(body) = bytes.strip_prefix(format.legacy.as_slice()) {
        body
    } else {
        return Err(corrupt(format!(
            "neither a {} nor a {} header",
            String::from_utf8_lossy(format.current),
            String::from_utf8_lossy(format.legacy)
        )));
    };
    match postcard::take_from_bytes(body) {
        Ok((value, [])) => Ok(Some(value)),
        Ok((_, rest)) => Err(corrupt(format!("{} bytes after the body", rest.len()))),
        Err(e) => Err(corrupt(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anchorage_shared::tensor::{Encoding, ParamBlock};

    fn temp_store(name: &str) -> (ClientStore, PathBuf) {
        let dir = std::env::temp_dir().join(format!("anchorage-client-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        (ClientStore::new(&dir), dir)
    }

    fn update(round: u64) -> Update {
        Update {
            prototypes_are: Default::default(),
            round,
            num_samples: 10,
            blocks: vec![ParamBlock::encode("head.bias", &[3], &[1.0, 2.0, 3.0], Encoding::F32)],
            prototypes: vec![],
            metrics: vec![],
            compute_seconds: 0.5,
        }
    }

    fn blocks() -> Vec<ParamBlock> {
        vec![
            ParamBlock::encode("tail.values", &[2, 2], &[1.0, -2.0, 3.5, 0.0], Encoding::F32),
            ParamBlock::encode("tail.seated", &[1], &[7.0], Encoding::F32),
        ]
    }

    /// The files in `dir` whose name starts with `prefix`.
    fn files_starting(dir: &Path, prefix: &str) -> Vec<PathBuf> {
        let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix))
            .collect();
        found.sort();
        found
    }

    #[test]
    fn crc32_is_the_ieee_one() {
        // The standard check value of CRC-32/ISO-HDLC, and the empty input.
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"The quick brown fox jumps over the lazy dog"), 0x414F_A339);
    }

    #[test]
    fn pending_update_survives_and_clears() {
        let (store, dir) = temp_store("pending");
        assert!(store.load_pending().unwrap().is_none());
        store.save_pending(Some(&update(4))).unwrap();
        let bytes = std::fs::read(dir.join("pending-update.bin")).unwrap();
        assert!(bytes.starts_with(b"ANCHUPD2"), "written in the checksummed format");
        assert_eq!(ClientStore::new(&dir).load_pending().unwrap(), Some(update(4)));
        store.save_pending(None).unwrap();
        assert!(store.load_pending().unwrap().is_none());
        store.save_pending(None).unwrap();
        assert!(std::fs::read_dir(&dir).unwrap().next().is_none(), "nothing left behind");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn both_files_are_readable_by_this_user_only() {
        use std::os::unix::fs::PermissionsExt;
        let (store, dir) = temp_store("modes");
        let mode = |name: &str| std::fs::metadata(dir.join(name)).unwrap().permissions().mode() & 0o777;
        std::fs::create_dir_all(&dir).unwrap();
        // A file left world-readable by an older client is replaced by a 0600 one.
        std::fs::write(dir.join("pending-update.bin"), b"old").unwrap();
        std::fs::set_permissions(dir.join("pending-update.bin"), std::fs::Permissions::from_mode(0o644)).unwrap();
        store.save_pending(Some(&update(1))).unwrap();
        store.save_device_state(&blocks()).unwrap();
        assert_eq!((mode("pending-update.bin"), mode("device-state.bin")), (0o600, 0o600));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn device_state_survives() {
        let (store, dir) = temp_store("state");
        assert!(store.load_device_state().unwrap().is_none());
        store.save_device_state(&blocks()).unwrap();
        assert!(std::fs::read(dir.join("device-state.bin")).unwrap().starts_with(b"ANCHDEV2"));
        assert_eq!(ClientStore::new(&dir).load_device_state().unwrap(), Some(blocks()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn files_of_the_first_format_still_load() {
        let (store, dir) = temp_store("legacy");
        std::fs::create_dir_all(&dir).unwrap();
        let mut v1 = b"ANCHUPD1".to_vec();
        v1.extend(postcard::to_allocvec(&update(7)).unwrap());
        std::fs::write(dir.join("pending-update.bin"), &v1).unwrap();
        let mut v1 = b"ANCHDEV1".to_vec();
        v1.extend(postcard::to_allocvec(&blocks()).unwrap());
        std::fs::write(dir.join("device-state.bin"), &v1).unwrap();
        assert_eq!(store.load_pending().unwrap(), Some(update(7)));
        assert_eq!(store.load_device_state().unwrap(), Some(blocks()));
        assert_eq!(files_starting(&dir, "").len(), 2, "nothing set aside");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Every way a file can go bad: each is set aside byte for byte under
    /// `<name>.corrupt-<secs>`, reads as no file, and the next save works.
    #[test]
    fn a_corrupt_file_is_set_aside_and_reads_as_none() {
        let (store, dir) = temp_store("corrupt");
        store.save_pending(Some(&update(4))).unwrap();
        store.save_device_state(&blocks()).unwrap();
        let good_pending = std::fs::read(dir.join("pending-update.bin")).unwrap();
        let good_state = std::fs::read(dir.join("device-state.bin")).unwrap();
        let flip = |bytes: &[u8], at: usize| {
            let mut b = bytes.to_vec();
            b[at] ^= 0x10;
            b
        };
        // A flipped bit in `compute_seconds` (the body's last 8 bytes): still decodes, and only the
        // checksum sees it.
        let mut data_flip = good_pending.clone();
        let n = data_flip.len();
        data_flip[n - 3] ^= 0x01;
        assert!(postcard::from_bytes::<Update>(&data_flip[HEADER_LEN..]).is_ok(), "the body still decodes");
        let mut trailing = good_state.clone();
        trailing.extend_from_slice(b"xx");
        let mut legacy_garbage = b"ANCHUPD1".to_vec();
        legacy_garbage.extend_from_slice(b"garbage");
        let cases: Vec<(&str, &str, Vec<u8>)> = vec![
            ("pending-update.bin", "flipped data bit", data_flip),
            ("pending-update.bin", "flipped checksum bit", flip(&good_pending, 9)),
            ("pending-update.bin", "flipped magic", flip(&good_pending, 0)),
            ("pending-update.bin", "cut short", good_pending[..good_pending.len() - 5].to_vec()),
            ("pending-update.bin", "header cut short", good_pending[..12].to_vec()),
            ("pending-update.bin", "empty", vec![]),
            ("pending-update.bin", "first format, bad body", legacy_garbage),
            ("device-state.bin", "flipped body bit", flip(&good_state, good_state.len() - 2)),
            ("device-state.bin", "cut short", good_state[..good_state.len() - 1].to_vec()),
            ("device-state.bin", "grown", trailing),
            ("device-state.bin", "another file's magic", [b"ANCHUPD2".as_slice(), &good_state[8..]].concat()),
        ];
        for (name, what, bytes) in cases {
            let path = dir.join(name);
            std::fs::write(&path, &bytes).unwrap();
            let before = files_starting(&dir, &format!("{name}.corrupt-"));
            let loaded_none = if name == "pending-update.bin" {
                store.load_pending().unwrap().is_none()
            } else {
                store.load_device_state().unwrap().is_none()
            };
            assert!(loaded_none, "{name}, {what}: not loaded");
            assert!(!path.exists(), "{name}, {what}: moved out of the way");
            let after = files_starting(&dir, &format!("{name}.corrupt-"));
            assert_eq!(after.len(), before.len() + 1, "{name}, {what}: set aside, not deleted");
            let aside = after.iter().find(|p| !before.contains(p)).unwrap();
            assert_eq!(std::fs::read(aside).unwrap(), bytes, "{name}, {what}: kept byte for byte");
        }
        // A non-finite value in the device state, and an update that is not valid, too.
        store.save_device_state(&[ParamBlock::encode("tail.values", &[1], &[f32::NAN], Encoding::F32)]).unwrap();
        assert!(store.load_device_state().unwrap().is_none());
        let mut bad = update(5);
        bad.blocks = vec![ParamBlock::encode("head.bias", &[1], &[f32::INFINITY], Encoding::F32)];
        store.save_pending(Some(&bad)).unwrap();
        assert!(store.load_pending().unwrap().is_none());
        assert_eq!(files_starting(&dir, "pending-update.bin.corrupt-").len(), 8);
        assert_eq!(files_starting(&dir, "device-state.bin.corrupt-").len(), 5);
        // The next save and load work.
        store.save_pending(Some(&update(6))).unwrap();
        store.save_device_state(&blocks()).unwrap();
        assert_eq!(store.load_pending().unwrap(), Some(update(6)));
        assert_eq!(store.load_device_state().unwrap(), Some(blocks()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn refused_files_are_set_aside_not_deleted() {
        let (store, dir) = temp_store("refused");
        assert_eq!(store.set_aside_pending("NotSampled").unwrap(), None, "no file: nothing to do");
        for round in [1, 2] {
            store.save_pending(Some(&update(round))).unwrap();
            let aside = store.set_aside_pending("NotSampled").unwrap().unwrap();
            assert!(aside.file_name().unwrap().to_string_lossy().starts_with("pending-update.bin.refused-"));
            assert_eq!(aside.parent(), Some(dir.as_path()), "in the same folder");
            assert!(store.load_pending().unwrap().is_none(), "not resent");
        }
        // Two in the same second keep both.
        let refused = files_starting(&dir, "pending-update.bin.refused-");
        assert_eq!(refused.len(), 2, "{refused:?}");
        let mut rounds: Vec<u64> =
            refused.iter().map(|p| load_framed::<Update>(p, &PENDING).unwrap().unwrap().round).collect();
        rounds.sort();
        assert_eq!(rounds, vec![1, 2]);

        store.save_device_state(&blocks()).unwrap();
        let aside = store.set_aside_device_state("another model").unwrap().unwrap();
        assert!(aside.exists() && !dir.join("device-state.bin").exists());
        assert!(aside.file_name().unwrap().to_string_lossy().starts_with("device-state.bin.refused-"));
        assert!(store.load_device_state().unwrap().is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
