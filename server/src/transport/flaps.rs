//! Two devices that share one certificate: the engine loop's bookkeeping of connections that
//! replace each other ([`FlapGuard`]), and the refusal both get once that is a conflict.

use std::collections::HashMap;
use std::time::Duration;

use anchorage_shared::protocol::{Refusal, RefusalReason};
use tokio::time::Instant;

use crate::engine::ClientId;

/// Two devices holding one certificate evict each other's connection over and over (each
/// reconnect replaces the other's live connection). [`FLAP_LIMIT`] replacements inside
/// [`FLAP_WINDOW`] are a security event: both are refused for [`FLAP_QUARANTINE`], the error log
/// tells the operator to revoke the certificate, and `anchorage_certificate_conflicts_total`
/// counts it. A device that merely reconnects (a restart, a new address) replaces its old
/// connection once.
#[derive(Default)]
pub(super) struct FlapGuard {
    replaced: HashMap<ClientId, std::collections::VecDeque<Instant>>,
    quarantined: HashMap<ClientId, Instant>,
}

pub(super) const FLAP_LIMIT: usize = 4;
pub(super) const FLAP_WINDOW: Duration = Duration::from_secs(60);
pub(super) const FLAP_QUARANTINE: Duration = Duration::from_secs(600);

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

    /// A live connection of `client` was replaced; true when that makes it a conflict.
    pub(super) fn replaced(&mut self, client: &str, now: Instant) -> bool {
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
