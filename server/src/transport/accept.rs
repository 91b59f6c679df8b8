//! The accept loop: every incoming connection is bounded before any cryptography runs (the
//! connections open in all, the handshakes in progress per IP address), counted, and handed to
//! a connection task of its own.

use std::collections::HashMap;
use std::sync::Arc;

use std::time::Duration;

use super::connection::ConnCtx;
use super::endpoint::Listener;
use crate::metrics::reason;
use crate::tls::RefusalLog;

/// Handshakes in progress per IP address.
type HandshakeCounts = Arc<std::sync::Mutex<HashMap<std::net::IpAddr, usize>>>;

/// How often the accept loop asks the listener whether a departed fleet's endpoint can go.
const RENEW_CHECK: Duration = Duration::from_secs(5);

/// What the accept loop needs: the listener, and the context each connection task gets a copy
/// of (with its own id).
pub(super) struct Acceptor {
    pub(super) listener: Listener,
    pub(super) conn: ConnCtx,
}

impl Acceptor {
    /// Accepts connections until the listener closes; each admitted one runs in its own task.
    /// Follows the listener's endpoint when it is renewed.
    pub(super) async fn run(self) {
        let mut next_conn = 0u64;
        let handshakes = Arc::new(std::sync::Mutex::new(HashMap::new()));
        let mut renewed = self.listener.subscribe();
        let mut check = tokio::time::interval(RENEW_CHECK);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            let endpoint = self.listener.current();
            let incoming = tokio::select! {
                incoming = endpoint.accept() => incoming,
                _ = renewed.changed() => continue,
                _ = check.tick() => {
                    if self.listener.renew_if_emptied() {
                        self.conn.metrics.endpoint_renewed();
                    }
                    continue;
                }
            };
            let Some(incoming) = incoming else {
                if self.listener.is_closed() {
                    break;
                }
                continue;
            };
            let Some(slot) = self.admit(&endpoint, &incoming, &handshakes) else {
                incoming.refuse();
                continue;
            };
            next_conn += 1;
            self.conn.metrics.connection_accepted();
            let ctx = ConnCtx { id: next_conn, ..self.conn.clone() };
            tokio::spawn(async move {
                let remote = incoming.remote_address();
                if let Err(e) = ctx.run(incoming, slot).await {
                    tracing::debug!(%remote, error = %format!("{e:#}"), "connection ended");
                }
            });
        }
    }

    /// Bounded before any cryptography runs: connections in all, handshakes per host. Each
    /// refusal is counted; the log says it at most once a minute per reason and address. The
    /// handshake's slot when the connection may go on.
    fn admit(
        &self,
        endpoint: &quinn::Endpoint,
        incoming: &quinn::Incoming,
        handshakes: &HandshakeCounts,
    ) -> Option<HandshakeSlot> {
        let remote = incoming.remote_address();
        let logged = |reason| self.conn.refusals.note(reason, &remote.ip().to_string(), std::time::Instant::now());
        let open = endpoint.open_connections();
        self.listener.note_open(open + 1);
        if open >= self.conn.limits.max_connections {
            self.conn.metrics.refused(reason::CONNECTION_LIMIT);
            if let Some(since) = logged(reason::CONNECTION_LIMIT) {
                let more = RefusalLog::since_text(since);
                tracing::warn!(%remote, max = self.conn.limits.max_connections, "connection limit reached; refused{more}");
            }
            return None;
        }
        let Some(slot) = HandshakeSlot::take(handshakes, remote.ip(), self.conn.limits.max_handshakes_per_ip) else {
            self.conn.metrics.refused(reason::HANDSHAKE_LIMIT);
            if let Some(since) = logged(reason::HANDSHAKE_LIMIT) {
                let more = RefusalLog::since_text(since);
                let max = self.conn.limits.max_handshakes_per_ip;
                tracing::warn!(%remote, max, "too many handshakes from one address; refused{more}");
            }
            return None;
        };
        Some(slot)
    }
}

/// One handshake in progress from one IP address; the count goes down when it is dropped.
pub(super) struct HandshakeSlot {
    counts: HandshakeCounts,
    ip: std::net::IpAddr,
}

impl HandshakeSlot {
    fn take(counts: &HandshakeCounts, ip: std::net::IpAddr, max: usize) -> Option<Self> {
        let mut map = counts.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(ip).or_default();
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Self { counts: counts.clone(), ip })
    }
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        let mut map = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}
