//! Resumable uploads (the chunking is `anchorage_shared::transfer`). A device opens a
//! bi stream, offers its update by hash and size, and the server answers with the bytes of it
//! that it holds from an earlier, interrupted attempt; the device sends the chunks from there.
//! A complete, verified update goes to the engine like a one-frame upload.
//!
//! What an interrupted upload leaves is kept per device (one transfer each: a new offer
//! replaces an older one), within `Limits::max_kept_upload_bytes` over all devices, and let go
//! when its round closes. Kept bytes live in memory, and a graceful shutdown writes them to the
//! state folder for the next start ([`super::saved_uploads`]); a crash loses them and the device
//! sends its update from the start again (as without resumable uploads): writing every
//! chunk to the store as well would double the disk writes of every upload.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anchorage_shared::frame::{decode_frame, encode_frame};
use anchorage_shared::io::{FrameIoError, Pace, ReadLimits, read_frame_limited, write_frame};
use anchorage_shared::priority::Priority;
use anchorage_shared::protocol::{KIND_CHUNK, Message, Refusal, RefusalReason, TransferOffer, TransferResume};
use anchorage_shared::transfer::{Assembly, MAX_CHUNK_FRAME, TransferError, hex};
use tokio::sync::mpsc;

use super::Outbound;
use super::connection::ConnCtx;
use super::streams::prioritise;
use crate::engine::ClientId;

/// How long a new attempt waits for an older connection's task to let go of its transfer (it
/// does once the engine loop has closed the connection the device replaced).
const HANDOVER: Duration = Duration::from_secs(10);

/// The uploads that devices left unfinished, by device.
#[derive(Default)]
pub(super) struct KeptUploads {
    by_device: Mutex<HashMap<ClientId, Kept>>,
}

struct Kept {
    transfer: [u8; 32],
    round: u64,
    /// `None` once complete or let go; locked while a connection is receiving it.
    slot: Arc<tokio::sync::Mutex<Option<Assembly>>>,
}

impl KeptUploads {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<ClientId, Kept>> {
        self.by_device.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The slot of `client`'s transfer `offer` (a new one replaces any other of the device's).
    fn slot(&self, client: &str, offer: &TransferOffer) -> Arc<tokio::sync::Mutex<Option<Assembly>>> {
        let mut map = self.map();
        match map.get(client) {
            Some(kept) if kept.transfer == offer.transfer => kept.slot.clone(),
            _ => {
                let slot = Arc::new(tokio::sync::Mutex::new(None));
                let kept = Kept { transfer: offer.transfer, round: offer.round, slot: slot.clone() };
                map.insert(client.into(), kept);
                slot
            }
        }
    }

    fn forget(&self, client: &str, transfer: &[u8; 32]) {
        let mut map = self.map();
        if map.get(client).is_some_and(|k| &k.transfer == transfer) {
            map.remove(client);
        }
    }

    /// Bytes held for resumes, over the transfers no connection is receiving now.
    fn kept_bytes(&self) -> u64 {
        self.map().values().filter_map(|k| k.slot.try_lock().ok()).filter_map(|s| s.as_ref().map(Assembly::held)).sum()
    }

    /// Takes every kept upload out (for [`super::saved_uploads`]), waiting up to `wait` for the
    /// connections still receiving one to let go of it.
    pub(super) async fn take_all(&self, wait: Duration) -> Vec<(ClientId, Assembly)> {
        let kept: Vec<_> = self.map().drain().map(|(client, kept)| (client, kept.slot)).collect();
        let deadline = tokio::time::Instant::now() + wait;
        let mut taken = Vec::with_capacity(kept.len());
        for (client, slot) in kept {
            if let Ok(mut slot) = tokio::time::timeout_at(deadline, slot.lock()).await
                && let Some(assembly) = slot.take()
            {
                taken.push((client, assembly));
            }
        }
        taken
    }

    /// Keeps `assembly` for `client` again (read back after a restart).
    pub(super) fn restore(&self, client: ClientId, assembly: Assembly) {
        let (transfer, round) = (assembly.offer.transfer, assembly.offer.round);
        let slot = Arc::new(tokio::sync::Mutex::new(Some(assembly)));
        self.map().insert(client, Kept { transfer, round, slot });
    }

    /// Lets go of what is kept for rounds before `round` (they closed); returns how many.
    pub(super) fn drop_before(&self, round: u64) -> usize {
        let mut map = self.map();
        let before = map.len();
        map.retain(|_, kept| kept.round >= round);
        let after = map.len();
        map.shrink_to(after * 2);
        before - after
    }
}

impl ConnCtx {
    /// Chunk frames: each up to a chunk's size, at the upload pace; the whole stream within the
    /// upload deadline.
    fn chunk_limits(&self) -> ReadLimits<'static> {
        let small = (self.limits.max_control_frame as usize).min(self.max_frame);
        ReadLimits {
            max_frame: MAX_CHUNK_FRAME,
            max_small: small,
            large_kinds: &[KIND_CHUNK],
            stall: Some(self.limits.read_stall),
            pace: Some(Pace {
                min_bytes_per_sec: self.limits.min_upload_rate,
                grace: self.limits.read_stall,
                deadline: self.limits.upload_deadline,
            }),
        }
    }

    /// Accepts transfer streams (the bi streams after the control stream), each received in a
    /// task of its own that outlives a lost connection long enough to keep what arrived. A bad
    /// one closes the connection with a refusal.
    pub(super) async fn accept_transfers(
        &self,
        conn: &quinn::Connection,
        client: ClientId,
        out: mpsc::UnboundedSender<Outbound>,
    ) -> bool {
        while let Ok((send, recv)) = conn.accept_bi().await {
            let (ctx, client, out) = (self.clone(), client.clone(), out.clone());
            tokio::spawn(async move {
                let deadline = ctx.limits.upload_deadline;
                match tokio::time::timeout(deadline, ctx.receive_transfer(send, recv, &client)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(refusal)) => {
                        let _ = out.send(Outbound::Close(refusal));
                    }
                    Err(_) => {
                        tracing::info!(%client, ?deadline, "an upload ran past the upload deadline; its bytes are kept")
                    }
                }
            });
        }
        false
    }

    /// One transfer stream: the offer, the answer, the chunks; the update to the engine once
    /// whole. A stream that breaks off leaves its bytes kept; a bad chunk is refused (and what
    /// was held stays held).
    async fn receive_transfer(
        &self,
        mut send: quinn::SendStream,
        mut recv: quinn::RecvStream,
        client: &ClientId,
    ) -> Result<(), Refusal> {
        let refuse = |reason: RefusalReason, detail: String| self.refused(client, reason, detail);
        // This side of the stream carries only the answer to the offer, which the device waits
        // for before it sends a chunk: a control message.
        prioritise(&send, Priority::Control.when(self.limits.stream_priorities));
        let Some(offer) = self.read_offer(&mut recv).await.map_err(|(r, d)| refuse(r, d))? else { return Ok(()) };
        // Checked before it can replace what the device has kept.
        let max = self.max_frame as u64;
        let fresh = Assembly::new(offer.clone(), max).map_err(|e| refuse(RefusalReason::TooLarge, e.to_string()))?;
        let kept = self.uploads.slot(client, &offer);
        let Ok(mut slot) = tokio::time::timeout(HANDOVER, kept.lock_owned()).await else {
            tracing::info!(%client, transfer = %hex(&offer.transfer), "an older connection still holds this upload; retry");
            return Ok(());
        };
        let assembly = match slot.take() {
            None => fresh,
            Some(held) if held.offer == offer => held,
            Some(held) => {
                let detail = format!(
                    "offered {} bytes for round {}; the transfer held under this hash has {} bytes for round {}",
                    offer.total, offer.round, held.offer.total, held.offer.round
                );
                *slot = Some(held);
                return Err(refuse(RefusalReason::Malformed, detail));
            }
        };
        let offset = assembly.held();
        if offset > 0 {
            self.metrics.transfer_resumed(offset);
            tracing::info!(%client, round = offer.round, offset, total = offer.total, "resuming an upload");
        }
        let assembly = slot.insert(assembly);
        let answer = Message::TransferResume(TransferResume { transfer: offer.transfer, offset });
        let Ok(frame) = encode_frame(&answer, usize::MAX) else { return Ok(()) };
        if write_frame(&mut send, &frame).await.is_err() {
            return Ok(());
        }
        while !assembly.is_complete() {
            match read_frame_limited(&mut recv, &self.chunk_limits()).await {
                Ok(Some((Message::Chunk(chunk), n))) => {
                    self.count_in(n);
                    assembly.accept(&chunk).map_err(|e| refuse(refusal_of(&e), e.to_string()))?;
                }
                Ok(Some((other, _))) => {
                    return Err(refuse(RefusalReason::Malformed, format!("{} inside a transfer", other.kind_name())));
                }
                Ok(None) | Err(FrameIoError::Io(_)) => {
                    self.interrupted(client, &offer, &mut slot);
                    return Ok(());
                }
                Err(e) => return Err(refuse(RefusalReason::Malformed, e.to_string())),
            }
        }
        let whole = slot.take().expect("complete above").finish();
        self.uploads.forget(client, &offer.transfer);
        let _ = send.finish();
        let frame = whole.map_err(|e| refuse(refusal_of(&e), e.to_string()))?;
        self.deliver(&frame, client).map_err(|detail| refuse(RefusalReason::Malformed, detail))
    }

    /// A transfer stream's first frame, its offer; `None` when the stream ended first.
    async fn read_offer(&self, recv: &mut quinn::RecvStream) -> Result<Option<TransferOffer>, (RefusalReason, String)> {
        match read_frame_limited(recv, &self.control_limits()).await {
            Ok(Some((Message::TransferOffer(offer), n))) => {
                self.count_in(n);
                Ok(Some(offer))
            }
            Ok(Some((other, _))) => {
                Err((RefusalReason::Malformed, format!("a transfer began with {}", other.kind_name())))
            }
            Ok(None) | Err(FrameIoError::Io(_)) => Ok(None),
            Err(e) => Err((RefusalReason::Malformed, e.to_string())),
        }
    }

    /// A whole transfer, decoded: an update (or a masked vector, under secure aggregation; or a
    /// relay's partial aggregate) goes to the engine like a one-frame upload.
    fn deliver(&self, frame: &[u8], client: &ClientId) -> Result<(), String> {
        match decode_frame(frame, self.max_frame) {
            Ok(msg @ (Message::Update(_) | Message::SecAgg(_) | Message::Partial(_))) => {
                self.metrics.transfer("completed");
                let _ = self.inputs.send(super::Input::Message { conn: self.id, client: client.clone(), msg });
                Ok(())
            }
            Ok(other) => Err(format!("a transfer of a {}", other.kind_name())),
            Err(e) => Err(e.to_string()),
        }
    }

    /// A refused transfer: counted, logged, and the refusal the connection closes with.
    fn refused(&self, client: &ClientId, reason: RefusalReason, detail: String) -> Refusal {
        self.metrics.transfer("refused");
        tracing::warn!(%client, %detail, "upload refused");
        Refusal::new(reason, detail)
    }

    /// The stream broke off: what arrived is kept for a resume, within the bound.
    fn interrupted(&self, client: &ClientId, offer: &TransferOffer, slot: &mut Option<Assembly>) {
        let held = slot.as_ref().map_or(0, Assembly::held);
        let bound = self.limits.max_kept_upload_bytes;
        if self.uploads.kept_bytes() + held > bound {
            *slot = None;
            self.uploads.forget(client, &offer.transfer);
            self.metrics.transfer("dropped");
            tracing::warn!(%client, held, bound, "an interrupted upload is not kept: max_kept_upload_bytes is reached");
        } else {
            self.metrics.transfer("kept");
            tracing::info!(%client, round = offer.round, held, total = offer.total, "upload interrupted; its bytes are kept for a resume");
        }
    }
}

fn refusal_of(e: &TransferError) -> RefusalReason {
    match e {
        TransferError::TooLarge { .. } => RefusalReason::TooLarge,
        _ => RefusalReason::Malformed,
    }
}
