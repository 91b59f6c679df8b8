//! Two devices that share one certificate: the engine loop's bookkeeping of connections that
//! replace each other ([`FlapGuard`]), and the refusal both get once that is a conflict.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use anchorage_shared::protocol::{Refusal, RefusalReason};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::Outbound;
use crate::engine::ClientId;

/// Two devices holding one certificate evict each other's connection over and over. A new
/// connection's hello replaces the client's current connection at once, and the old one is set
/// aside: its messages go nowhere. A device that restarted, crashed or moved to a new address
/// left that old connection silent, and it goes when QUIC's idle timeout closes it. An old
/// connection that sends again is a second live holder: it is closed, and that counts as a
/// replacement. [`FLAP_LIMIT`] replacements inside [`FLAP_WINDOW`] are a security event: both
/// holders are refused for [`FLAP_QUARANTINE`], the error log tells the operator to revoke the
/// certificate, and `anchorage_certificate_conflicts_total` counts it. A crash loop is never one.
#[derive(Default)]
pub(super) struct FlapGuard {
    replaced: HashMap<ClientId, VecDeque<Instant>>,
    quarantined: HashMap<ClientId, Instant>,
    /// Connections replaced by a newer one of the same client and not yet closed, by id.
    set_aside: HashMap<u64, (ClientId, mpsc::UnboundedSender<Outbound>)>,
}

pub(super) const FLAP_LIMIT: usize = 4;
pub(super) const FLAP_WINDOW: Duration = Duration::from_secs(60);
pub(super) const FLAP_QUARANTINE: Duration = Duration::from_secs(600);

/// What a message on a set-aside connection means.
pub(super) enum SecondHolder {
    /// Another live holder: its connection was closed; not (yet) a conflict.
    Evicted,
    /// The replacement that makes it a conflict: refuse the client's current connection too.
    Conflict,
}

impl FlapGuard {
    /// Whether `client` is refused now.
    pub(super) fn quarantined(&mut self, client: &str, now: Instant) -> bool {
        match self.quarantined.get(client) {
            Some(until) if *until > now => true,
            Some(_) => {
                self.quarantined.remove(client);
                false
            }
            None => false,
        }
    }

    /// `client`'s connection `conn` was replaced by a newer one: it is set aside until it sends
    /// again or closes.
    pub(super) fn set_aside(&mut self, conn: u64, client: &str, out: mpsc::UnboundedSender<Outbound>) {
        self.set_aside.insert(conn, (client.into(), out));
    }

    /// Whether `conn` is a set-aside connection (its messages go nowhere).
    pub(super) fn is_set_aside(&self, conn: u64) -> bool {
        self.set_aside.contains_key(&conn)
    }

    /// A message arrived on connection `conn`. `None` unless it was set aside; then its holder
    /// is live beside the current one: the old connection is closed and the replacement counts.
    pub(super) fn heard(&mut self, conn: u64, now: Instant) -> Option<SecondHolder> {
        let (client, out) = self.set_aside.remove(&conn)?;
        let _ = out.send(Outbound::Close(Refusal::new(RefusalReason::Duplicate, "replaced by a newer connection")));
        Some(if self.replaced(&client, now) { SecondHolder::Conflict } else { SecondHolder::Evicted })
    }

    /// Connection `conn` closed.
    pub(super) fn closed(&mut self, conn: u64) {
        self.set_aside.remove(&conn);
    }

    /// A live connection of `client` was replaced; true when that makes it a conflict.
    fn replaced(&mut self, client: &str, now: Instant) -> bool {
        let times = self.replaced.entry(client.into()).or_default();
        times.push_back(now);
        while times.front().is_some_and(|t| now.duration_since(*t) > FLAP_WINDOW) {
            times.pop_front();
        }
        if times.len() < FLAP_LIMIT {
            return false;
        }
        self.replaced.remove(client);
        self.quarantined.insert(client.into(), now + FLAP_QUARANTINE);
        self.set_aside.retain(|_, (c, out)| {
            let other = c.as_str() == client;
            if other {
                let _ = out.send(Outbound::Close(conflict_refusal(client)));
            }
            !other
        });
        true
    }
}

pub(super) fn conflict_refusal(client: &str) -> Refusal {
    Refusal::new(
        RefusalReason::Duplicate,
        format!(
            "the certificate of `{client}` is in use by two devices at once; it is refused until the operator revokes it"
        ),
    )
}
