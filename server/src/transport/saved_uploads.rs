//! Interrupted uploads outlive a graceful restart. At shutdown the server writes what it keeps of
//! each device's interrupted upload to `<state>/kept-uploads/` (one file per device, written
//! atomically), and the next start reads them back and deletes them, so a device that offers the
//! same transfer after the restart goes on from the bytes the server held, as it would have
//! without the restart. A crash writes nothing (the device sends its update from the start, as
//! without resumable uploads): saving every chunk as it arrives would double the disk writes of
//! every upload.
//!
//! A file is `MAGIC`, the SHA-256 of the rest, then the device id (u16 length and bytes), the
//! offer (transfer hash, total, round) and the bytes held. One whose hash, layout or offer does
//! not check out is refused (a log line naming it, `anchorage_transfers_total{outcome="refused"}`)
//! and removed: it only ever held bytes a device can send again. What is read back stays within
//! `Limits::max_kept_upload_bytes`, and uploads for rounds that closed meanwhile go at the next
//! broadcast like any other kept upload.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anchorage_shared::protocol::TransferOffer;
use anchorage_shared::transfer::{Assembly, sha256};

use super::transfers::KeptUploads;
use crate::engine::ClientId;
use crate::metrics::ServerMetrics;

/// The folder, inside the state folder.
pub(super) const FOLDER: &str = "kept-uploads";
const MAGIC: &[u8; 8] = b"ANCHKU01";
/// How long shutdown waits for connections still receiving an upload to let go of it.
const LET_GO: Duration = Duration::from_secs(2);

/// Writes every kept upload to `state`'s folder; returns how many were saved.
pub(super) async fn save(uploads: &KeptUploads, state: &Path, metrics: &ServerMetrics) -> usize {
    let kept = uploads.take_all(LET_GO).await;
    if kept.is_empty() {
        return 0;
    }
    let folder = state.join(FOLDER);
    let written = tokio::task::spawn_blocking(move || {
        let mut saved = 0;
        for (client, assembly) in &kept {
            let path = folder.join(file_name(client));
            match anchorage_shared::io::write_atomic(&path, &encode(client, assembly)) {
                Ok(()) => saved += 1,
                Err(e) => {
                    tracing::warn!(%client, path = %path.display(), error = %e, "could not save an interrupted upload; the device will send it from the start")
                }
            }
        }
        saved
    });
    let saved = written.await.unwrap_or(0);
    metrics.transfers("saved", saved as u64);
    tracing::info!(saved, folder = %state.join(FOLDER).display(), "interrupted uploads saved for the next start");
    saved
}

/// Reads back what the last shutdown saved in `state`'s folder (each up to `max_total` bytes,
/// all within `bound`), keeps it in `uploads` and removes the files; returns how many came back.
pub(super) fn restore(
    uploads: &KeptUploads,
    state: &Path,
    max_total: u64,
    bound: u64,
    metrics: &ServerMetrics,
) -> usize {
    let folder = state.join(FOLDER);
    let Ok(entries) = std::fs::read_dir(&folder) else { return 0 };
    let (mut restored, mut held) = (0, 0u64);
    for path in entries.filter_map(|e| e.ok().map(|e| e.path())) {
        match read(&path, max_total) {
            Ok((client, assembly)) if held + assembly.held() <= bound => {
                held += assembly.held();
                uploads.restore(client, assembly);
                restored += 1;
            }
            Ok((client, _)) => {
                metrics.transfer("dropped");
                tracing::warn!(%client, bound, "a saved upload is not kept: max_kept_upload_bytes is reached");
            }
            Err(detail) => {
                metrics.transfer("refused");
                tracing::warn!(path = %path.display(), %detail, "a saved upload is refused; its device will send it from the start");
            }
        }
        if let Err(e) = std::fs::remove_file(&path) {
            tracing::warn!(path = %path.display(), error = %e, "could not remove a saved upload");
        }
    }
    if restored > 0 {
        metrics.transfers("restored", restored as u64);
        tracing::info!(restored, held, "interrupted uploads read back from the last shutdown");
    }
    restored
}

/// A device's file: its id's hash, so that any id makes a plain file name.
fn file_name(client: &str) -> PathBuf {
    let hash = sha256(client.as_bytes());
    let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
    PathBuf::from(format!("{hex}.part"))
}

fn encode(client: &str, assembly: &Assembly) -> Vec<u8> {
    let id = client.as_bytes();
    let held = assembly.held_bytes();
    let mut body = Vec::with_capacity(2 + id.len() + 48 + held.len());
    body.extend_from_slice(&(id.len() as u16).to_le_bytes());
    body.extend_from_slice(id);
    body.extend_from_slice(&assembly.offer.transfer);
    body.extend_from_slice(&assembly.offer.total.to_le_bytes());
    body.extend_from_slice(&assembly.offer.round.to_le_bytes());
    body.extend_from_slice(held);
    let mut file = Vec::with_capacity(MAGIC.len() + 32 + body.len());
    file.extend_from_slice(MAGIC);
    file.extend_from_slice(&sha256(&body));
    file.extend_from_slice(&body);
    file
}

fn read(path: &Path, max_total: u64) -> Result<(ClientId, Assembly), String> {
    let file = std::fs::read(path).map_err(|e| e.to_string())?;
    decode(&file, max_total)
}

fn decode(file: &[u8], max_total: u64) -> Result<(ClientId, Assembly), String> {
    let rest = file.strip_prefix(MAGIC).ok_or("not a saved upload (its magic is wrong)")?;
    let (hash, body) = rest.split_at_checked(32).ok_or("shorter than its header")?;
    if sha256(body) != hash {
        return Err(format!("its {} bytes do not match their SHA-256", body.len()));
    }
    let mut r = Reader(body);
    let id_len = u16::from_le_bytes(r.take()?) as usize;
    let id = std::str::from_utf8(r.bytes(id_len)?).map_err(|_| "its device id is not UTF-8")?.to_owned();
    let offer = TransferOffer {
        transfer: r.take()?,
        total: u64::from_le_bytes(r.take()?),
        round: u64::from_le_bytes(r.take()?),
    };
    let assembly = Assembly::resumed(offer, r.0.to_vec(), max_total).map_err(|e| e.to_string())?;
    Ok((id, assembly))
}

/// Reads a saved file's fields in order.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8], String> {
        let (head, tail) = self.0.split_at_checked(n).ok_or("cut short")?;
        self.0 = tail;
        Ok(head)
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N], String> {
        Ok(self.bytes(N)?.try_into().unwrap_or([0; N]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anchorage_shared::transfer::{chunks_from, offer};

    fn half_assembly() -> Assembly {
        let frame: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let mut assembly = Assembly::new(offer(&frame, 3), 1 << 30).unwrap();
        for chunk in chunks_from(&frame, 0).take(2) {
            assembly.accept(&chunk).unwrap();
        }
        assembly
    }

    #[tokio::test]
    async fn kept_uploads_are_saved_and_read_back_once() {
        let state = tempfile::tempdir().unwrap();
        let metrics = ServerMetrics::new();
        let uploads = KeptUploads::default();
        let assembly = half_assembly();
        uploads.restore("device/ä 1".into(), assembly.clone());
        assert_eq!(save(&uploads, state.path(), &metrics).await, 1);
        assert_eq!(uploads.take_all(LET_GO).await.len(), 0, "saving took them out");

        let back = KeptUploads::default();
        assert_eq!(restore(&back, state.path(), 1 << 30, 1 << 30, &metrics), 1);
        let taken = back.take_all(LET_GO).await;
        assert_eq!(taken[0].0, "device/ä 1");
        assert_eq!(
            (taken[0].1.offer.clone(), taken[0].1.held_bytes()),
            (assembly.offer.clone(), assembly.held_bytes())
        );
        assert_eq!(std::fs::read_dir(state.path().join(FOLDER)).unwrap().count(), 0, "read back once, then removed");
        assert_eq!(metrics.transfers_total("saved"), 1);
        assert_eq!(metrics.transfers_total("restored"), 1);
    }

    #[tokio::test]
    async fn a_damaged_or_oversized_file_is_refused_and_removed() {
        let state = tempfile::tempdir().unwrap();
        let metrics = ServerMetrics::new();
        let uploads = KeptUploads::default();
        uploads.restore("flipped".into(), half_assembly());
        uploads.restore("large".into(), half_assembly());
        save(&uploads, state.path(), &metrics).await;
        let flipped = state.path().join(FOLDER).join(file_name("flipped"));
        let mut bytes = std::fs::read(&flipped).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&flipped, bytes).unwrap();
        std::fs::write(state.path().join(FOLDER).join("stray.part"), b"ANCHKU01 short").unwrap();

        let back = KeptUploads::default();
        // The intact file's offer (300,000 bytes) is over a 200,000-byte frame limit.
        assert_eq!(restore(&back, state.path(), 200_000, 1 << 30, &metrics), 0);
        assert_eq!(metrics.transfers_total("refused"), 3, "the flipped bit, the stray file, the oversized offer");
        assert_eq!(std::fs::read_dir(state.path().join(FOLDER)).unwrap().count(), 0);
    }

    #[tokio::test]
    async fn what_is_read_back_stays_within_the_bound() {
        let state = tempfile::tempdir().unwrap();
        let metrics = ServerMetrics::new();
        let uploads = KeptUploads::default();
        for device in ["a", "b", "c"] {
            uploads.restore(device.into(), half_assembly());
        }
        save(&uploads, state.path(), &metrics).await;
        let one = half_assembly().held();
        let back = KeptUploads::default();
        assert_eq!(restore(&back, state.path(), 1 << 30, 2 * one, &metrics), 2);
        assert_eq!(metrics.transfers_total("dropped"), 1);
    }
}
