//! The revocation list as the server follows it: re-read when its file changes, pushed to the
//! endpoint (new handshakes) and to every live connection (which closes when its certificate
//! appears on it), kept as it was when a new file does not read (fail closed).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::ServerMetrics;
use super::endpoint::{Crl, Listener, quic_server_config};
use crate::tls::{RefusalLog, Trust};
use anchorage_pki::Identity;

/// Serial numbers on the project CA's revocation list, as the server last read it.
pub type Revoked = Arc<std::collections::BTreeSet<String>>;

/// Under mutual TLS, re-reads the CRL when its file changes (every 2 s): new handshakes are
/// checked against the new list at once, and live connections whose certificate it revokes are
/// closed. Returns the list as a watch every connection follows.
///
/// A CRL that disappears or does not parse keeps the last good list (fail closed): one error
/// line when that starts, `anchorage_crl_stale` 1 until a good file is back (retried every
/// tick), and `anchorage_crl_reload_failures_total` counts each failed change.
pub(super) fn watch_revocations(
    listener: &Listener,
    trust: &Trust,
    identity: &Identity,
    first: &Crl,
    transport: Arc<quinn::TransportConfig>,
    metrics: Arc<ServerMetrics>,
    refusals: Arc<RefusalLog>,
) -> anyhow::Result<watch::Receiver<Revoked>> {
    let serials = |crl: Option<&[u8]>| -> anyhow::Result<Revoked> {
        Ok(Arc::new(crl.map(anchorage_pki::revoked_serials).transpose()?.unwrap_or_default()))
    };
    let trust = trust.clone();
    let (tx, rx) = watch::channel(serials(first.as_deref())?);
    metrics.set_crl_stale(false);
    let Trust::ProjectCa { crl: Some(path), .. } = &trust else { return Ok(rx) };
    let (path, identity, listener) = (path.clone(), identity.clone(), listener.clone());
    let modified = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let mut seen = modified(&path);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(2));
        // The error of the last failed reload while the list is stale.
        let mut stale: Option<String> = None;
        while !tx.is_closed() {
            tick.tick().await;
            let now = modified(&path);
            let changed = now != seen;
            if !changed && stale.is_none() {
                continue;
            }
            seen = now;
            let reloaded = trust.read_crl().and_then(|crl| {
                let list = serials(crl.as_deref())?;
                Ok((quic_server_config(&trust, &identity, crl, &transport, &refusals)?, list))
            });
            match reloaded {
                Ok((config, list)) => {
                    listener.set_server_config(config);
                    if stale.take().is_some() {
                        metrics.set_crl_stale(false);
                        tracing::info!(crl = %path.display(), revoked = list.len(), "revocation list readable again; reloaded");
                    } else {
                        tracing::info!(crl = %path.display(), revoked = list.len(), "revocation list reloaded");
                    }
                    let _ = tx.send(list);
                }
                Err(e) => {
                    let error = format!("{e:#}");
                    if changed {
                        metrics.crl_reload_failed();
                    }
                    if stale.as_deref() != Some(error.as_str()) {
                        let kept = tx.borrow().len();
                        tracing::error!(
                            crl = %path.display(),
                            error = %error,
                            revoked = kept,
                            "REVOCATION LIST STALE: keeping the last good list ({kept} revoked); certificates \
                             revoked since are not refused until a good revoked.crl is back"
                        );
                        metrics.set_crl_stale(true);
                        stale = Some(error);
                    }
                }
            }
        }
    });
    Ok(rx)
}

/// Completes when `serial` appears on the revocation list; never without a serial.
pub(super) async fn revoked(list: &mut watch::Receiver<Revoked>, serial: Option<&str>) {
    let Some(serial) = serial else { return std::future::pending().await };
    if list.wait_for(|l| l.contains(serial)).await.is_err() {
        std::future::pending::<()>().await;
    }
}
