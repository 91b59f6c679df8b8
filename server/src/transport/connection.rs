//! One connection from handshake to close: the handshake's outcome (a refusal counted and
//! logged), who the peer is (its certificate's id under mutual TLS, checked against the
//! revocation list), its hello, and then its streams until it closes or is refused.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::frame::encode_frame;
use anchorage_shared::io::{FrameIoError, read_frame_limited, write_frame};
use anchorage_shared::priority::Priority;
use anchorage_shared::protocol::{DecodeError, Message, Refusal, RefusalReason};
use anyhow::Context;
use quinn::VarInt;
use tokio::sync::{mpsc, watch};

use super::accept::HandshakeSlot;
use super::broadcasts::{BroadcastTransfers, takes_transfers};
use super::revocation::{Revoked, revoked};
use super::streams::{prioritise, write_loop};
use super::{Input, Limits, Outbound, ServerMetrics};
use crate::engine::ClientId;
use crate::metrics::{reason, refusal_reason};
use crate::tls::RefusalLog;

/// What a connection task needs.
#[derive(Clone)]
pub(super) struct ConnCtx {
    pub(super) id: u64,
    pub(super) inputs: mpsc::UnboundedSender<Input>,
    pub(super) metrics: Arc<ServerMetrics>,
    pub(super) max_frame: usize,
    pub(super) limits: Limits,
    pub(super) revoked: watch::Receiver<Revoked>,
    /// The rate limit of refused handshakes' log lines.
    pub(super) refusals: Arc<RefusalLog>,
    /// Uploads left unfinished by this server's connections.
    pub(super) uploads: Arc<super::transfers::KeptUploads>,
}

/// Who a peer's certificate says it is (mutual TLS).
struct Certified {
    id: String,
    serial: String,
    /// SHA-256 (hex) of the certificate, for the client registry.
    fingerprint: String,
    /// Whether it carries the relay role.
    relay: bool,
}

/// The certificate a peer showed, read once; `None` when it showed none (development mode).
fn certified(conn: &quinn::Connection) -> anyhow::Result<Option<Certified>> {
    let Some(identity) = conn.peer_identity() else { return Ok(None) };
    let chain = identity
        .downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
        .map_err(|_| anyhow::anyhow!("the peer identity is not a certificate chain"))?;
    let leaf = chain.first().context("an empty certificate chain")?;
    let (id, serial) = anchorage_pki::peer_id(leaf)?;
    let digest = ring::digest::digest(&ring::digest::SHA256, leaf.as_ref());
    let fingerprint = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    let relay = anchorage_pki::cert::is_relay(leaf.as_ref());
    Ok(Some(Certified { id, serial, fingerprint, relay }))
}

/// The refusal that answers a frame that could not be read. A frame that stalled or crawled
/// (`read_stall`, `min_upload_rate`, the upload deadline) is `ServerBusy`: the device keeps its
/// update and sends it again (an outage is not a malformed update; `Malformed` made a device
/// throw its update away after one outage longer than the stall).
pub(super) fn refusal_for(e: &FrameIoError) -> Refusal {
    let reason = match e {
        FrameIoError::Decode(DecodeError::WrongVersion { .. }) => RefusalReason::VersionMismatch,
        FrameIoError::Decode(DecodeError::Oversized { .. }) => RefusalReason::TooLarge,
        FrameIoError::Decode(DecodeError::Tensor(_)) => RefusalReason::BadTensor,
        FrameIoError::Io(io) if io.kind() == std::io::ErrorKind::TimedOut => RefusalReason::ServerBusy,
        _ => RefusalReason::Malformed,
    };
    Refusal::new(reason, e.to_string())
}

/// Who a connection's peer is, once its handshake and hello are done.
struct Peer {
    client: ClientId,
    remote: SocketAddr,
    /// Its certificate's serial number and fingerprint (mutual TLS).
    serial: Option<String>,
    fingerprint: Option<String>,
    /// Its certificate carries the relay role; in the development mode (no certificates) any
    /// peer may act as a relay.
    relay: bool,
}

impl ConnCtx {
    /// Completes the handshake, establishes who the peer is (its certificate's id, not revoked)
    /// and reads its hello; then serves the connection until it closes or is refused.
    pub(super) async fn run(self, incoming: quinn::Incoming, handshake: HandshakeSlot) -> anyhow::Result<()> {
        let remote = incoming.remote_address();
        let conn = match incoming.await {
            Ok(conn) => conn,
            Err(e) => {
                self.handshake_failed(remote, &e);
                return Ok(());
            }
        };
        drop(handshake);
        // Mutual TLS: the handshake proved the certificate; its id is who this peer is.
        let certified = match certified(&conn) {
            Ok(c) => c,
            Err(e) => {
                self.metrics.refused(reason::BAD_CERTIFICATE);
                tracing::warn!(%remote, error = %format!("{e:#}"), "refusing a certificate without a usable id");
                conn.close(VarInt::from_u32(1), b"certificate names no id");
                return Ok(());
            }
        };
        let (mut control_send, mut control_recv) = tokio::time::timeout(self.limits.hello_timeout, conn.accept_bi())
            .await
            .context("no control stream in time")??;
        let Some(hello) = self.read_hello(&conn, &mut control_send, &mut control_recv).await? else {
            return Ok(());
        };
        // Under mutual TLS the id is the certificate's and the engine refuses a hello that names
        // another; in the development mode the hello names the client.
        let Message::Hello(h) = &hello else { unreachable!("matched above") };
        let serial = certified.as_ref().map(|c| c.serial.clone());
        let fingerprint = certified.as_ref().map(|c| c.fingerprint.clone());
        let relay = certified.as_ref().is_none_or(|c| c.relay);
        let client = certified.map_or_else(|| h.client_id.clone(), |c| c.id);
        if serial.as_ref().is_some_and(|s| self.revoked.borrow().contains(s)) {
            let refusal = Refusal::new(RefusalReason::Revoked, "certificate revoked");
            return self.refuse(&conn, &mut control_send, refusal, Some(reason::REVOKED), &client).await;
        }
        let peer = Peer { client, remote, serial, fingerprint, relay };
        self.serve(conn, control_send, control_recv, peer, hello).await
    }

    /// Reports the hello to the engine loop, then reads the control and upload streams and
    /// writes what the engine sends, until the connection closes, or a bad frame or a revoked
    /// certificate refuses it; then tells the engine loop it closed.
    async fn serve(
        &self,
        conn: quinn::Connection,
        control_send: quinn::SendStream,
        control_recv: quinn::RecvStream,
        peer: Peer,
        hello: Message,
    ) -> anyhow::Result<()> {
        let Peer { client, remote, serial, fingerprint, relay } = peer;
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        self.inputs.send(Input::Hello(super::Arrival {
            conn: self.id,
            client: client.clone(),
            fingerprint,
            relay,
            msg: hello,
            out: out_tx.clone(),
        }))?;
        tracing::info!(%client, %remote, "client connected");

        let priorities = self.limits.stream_priorities;
        prioritise(&control_send, Priority::Control.when(priorities));
        let broadcasts = takes_transfers(&conn).then(|| BroadcastTransfers { metrics: self.metrics.clone() });
        let timing = (self.limits.read_stall, priorities);
        let mut writer = tokio::spawn(write_loop(conn.clone(), control_send, out_rx, timing, broadcasts));
        let control = self.read_loop(control_recv, client.clone(), out_tx.clone());
        let uploads = self.accept_uploads(&conn, client.clone(), out_tx.clone());
        let transfers = self.accept_transfers(&conn, client.clone(), out_tx.clone());
        let mut revocations = self.revoked.clone();
        let refused = tokio::select! {
            refused = control => refused,
            refused = uploads => refused,
            refused = transfers => refused,
            _ = conn.closed() => false,
            _ = revoked(&mut revocations, serial.as_deref()) => {
                tracing::warn!(%client, "certificate revoked while connected; closing");
                self.metrics.refused(reason::REVOKED);
                let refusal = Refusal::new(RefusalReason::Revoked, "certificate revoked");
                let _ = out_tx.send(Outbound::Close(refusal));
                true
            }
        };
        if refused {
            // Let the writer deliver the refusal and close the connection itself.
            let _ = tokio::time::timeout(Duration::from_secs(3), &mut writer).await;
        }
        writer.abort();
        let _ = self.inputs.send(Input::Closed { conn: self.id, client: client.clone() });
        let why = conn.close_reason().map_or_else(|| "the connection is still open".to_string(), |e| e.to_string());
        tracing::info!(%client, reason = %why, "client disconnected");
        Ok(())
    }

    /// A handshake that did not complete. One this server's TLS refused (a certificate it does
    /// not accept, none at all) is counted under its reason every time, and logged at most once
    /// a minute per reason and device (the verifier logs a certificate's verdict with the id the
    /// certificate names) or, for the others, per reason and address.
    fn handshake_failed(&self, remote: SocketAddr, e: &quinn::ConnectionError) {
        let crypto = |code: u64| (0x100..=0x1ff).contains(&code).then(|| (code - 0x100) as u8);
        let now = std::time::Instant::now();
        let ip = remote.ip().to_string();
        match e {
            // Our TLS ended it, with this alert.
            quinn::ConnectionError::TransportError(t) => {
                let Some(alert) = crypto(u64::from(t.code)) else {
                    tracing::debug!(%remote, error = %e, "handshake did not complete");
                    return;
                };
                let reason = crate::tls::alert_reason(alert);
                self.metrics.refused(reason);
                if crate::tls::alert_is_certificate_verdict(alert) {
                    // The verifier logged it, with the id the certificate names.
                    tracing::debug!(%remote, reason, alert, error = %e, "handshake refused");
                } else if let Some(since) = self.refusals.note(reason, &ip, now) {
                    let what = if reason == reason::NO_CERTIFICATE {
                        "the device showed no certificate: give its client.toml `cert` and `key` from this \
                         project's CA (`anchorage provision`)"
                    } else {
                        "TLS could not agree with the peer (an old or foreign client?)"
                    };
                    tracing::warn!(
                        %remote,
                        reason,
                        alert,
                        error = %e,
                        more_refused_since_last_line = since,
                        "handshake refused ({reason}) from {ip}: {what}{}",
                        RefusalLog::since_text(since)
                    );
                }
            }
            // The peer's TLS ended it: a device that does not trust this server's certificate.
            quinn::ConnectionError::ConnectionClosed(c) if crypto(u64::from(c.error_code)).is_some() => {
                if let Some(since) = self.refusals.note("peer_refused_server", &ip, now) {
                    tracing::warn!(
                        %remote,
                        error = %e,
                        more_since_last_line = since,
                        "a device at {ip} refused this server's certificate: check that it names the address the \
                         devices dial (their `server_name`) and comes from the CA in their `server_cert`{}",
                        RefusalLog::since_text(since)
                    );
                }
            }
            _ => tracing::debug!(%remote, error = %e, "handshake did not complete"),
        }
    }

    /// The connection's first message, which must be a hello (in time, readable); anything else
    /// is refused and gives `None`, as does a stream that ends first.
    async fn read_hello(
        &self,
        conn: &quinn::Connection,
        control_send: &mut quinn::SendStream,
        control_recv: &mut quinn::RecvStream,
    ) -> anyhow::Result<Option<Message>> {
        let remote = conn.remote_address().ip().to_string();
        let first =
            tokio::time::timeout(self.limits.hello_timeout, read_frame_limited(control_recv, &self.control_limits()))
                .await
                .context("no hello in time")?;
        match first {
            Ok(Some((msg @ Message::Hello(_), n))) => {
                self.count_in(n);
                Ok(Some(msg))
            }
            Ok(Some((other, _))) => {
                let refusal =
                    Refusal::new(RefusalReason::NotEnrolled, format!("expected hello, got {}", other.kind_name()));
                self.refuse(conn, control_send, refusal, None, &remote).await.map(|()| None)
            }
            Ok(None) => Ok(None),
            Err(e) => {
                self.metrics.decode_error();
                self.refuse(conn, control_send, refusal_for(&e), None, &remote).await.map(|()| None)
            }
        }
    }

    /// Refuses a connection: `label` counts it under another reason than the refusal's own.
    async fn refuse(
        &self,
        conn: &quinn::Connection,
        control: &mut quinn::SendStream,
        refusal: Refusal,
        label: Option<&'static str>,
        who: &str,
    ) -> anyhow::Result<()> {
        let label = label.unwrap_or(refusal_reason(refusal.reason));
        self.metrics.refused(label);
        // Counted every time; logged at most once a minute per reason and peer.
        if let Some(since) = self.refusals.note(label, who, std::time::Instant::now()) {
            tracing::warn!(
                who,
                reason = ?refusal.reason,
                detail = %refusal.detail,
                more_refused_since_last_line = since,
                "refusing connection{}",
                RefusalLog::since_text(since)
            );
        }
        if let Ok(frame) = encode_frame(&Message::Refusal(refusal), self.max_frame) {
            let _ = write_frame(control, &frame).await;
            let _ = control.finish();
            let _ = tokio::time::timeout(Duration::from_secs(1), control.stopped()).await;
        }
        conn.close(VarInt::from_u32(1), b"refused");
        Ok(())
    }
}
