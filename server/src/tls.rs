//! TLS for the QUIC endpoint: rustls with the `ring` provider only, TLS 1.3, ALPN `anchorage/1`.
//!
//! By default the server presents a certificate signed by the project CA ([`anchorage_pki::ca`]) and asks
//! every client for one (mutual TLS). In the explicit development mode it presents a self-signed
//! certificate that clients pin, and asks for none.

use std::sync::Arc;

use anyhow::Context;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer};
use rustls::server::danger::ClientCertVerifier;

/// What to do about a missing or damaged `revoked.crl`.
pub const CRL_HINT: &str = "Copy the project CA's revoked.crl there (`anchorage ca init` and `anchorage ca revoke` \
     write it in the CA folder, even when nothing is revoked; `anchorage provision` and `anchorage ca issue server` \
     write it into the server's folder)";

/// ALPN protocol id of Anchorage v1.
pub const ALPN: &[u8] = b"anchorage/1";

use anchorage_pki::Identity;

/// How the server decides who a peer is.
#[derive(Debug, Clone)]
pub enum Trust {
    /// Mutual TLS (the default): a client needs a certificate the project CA signed, within its
    /// validity period and not on the revocation list, and its id is the one in the certificate.
    /// The CRL file (`revoked.crl`) must exist at start and is re-read while the server runs;
    /// `crl: None` (the simulator's in-memory CA) checks no revocations.
    ProjectCa { ca: CertificateDer<'static>, crl: Option<std::path::PathBuf> },
    /// Development only (`insecure_dev = true`): no client certificates; the hello names the
    /// client, so anyone who reaches the port can claim any name.
    InsecureDev,
}

impl Trust {
    /// The CRL as it is on disk now, checked to parse. Under mutual TLS with a CRL path the file
    /// must exist: a server without its revocation list would welcome revoked certificates, so
    /// a missing or unreadable one is an error that names the file (the server fails closed).
    pub fn read_crl(&self) -> anyhow::Result<Option<rustls::pki_types::CertificateRevocationListDer<'static>>> {
        let Self::ProjectCa { crl: Some(path), .. } = self else { return Ok(None) };
        let bytes = match std::fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => anyhow::bail!(
                "the revocation list {} is missing; without it revoked certificates would get in, so the \
                 server does not start. {CRL_HINT}",
                path.display()
            ),
            Err(e) => return Err(e).with_context(|| format!("reading the revocation list {}", path.display())),
        };
        anchorage_pki::revoked_serials(&bytes)
            .with_context(|| format!("the revocation list {} is not a CRL. {CRL_HINT}", path.display()))?;
        Ok(Some(bytes.into()))
    }

    /// The server-side rustls config for this trust, checking client certificates against `crl`
    /// (read once by the caller with [`Trust::read_crl`], so the verifier and the list the server
    /// applies to live connections are the same).
    pub fn server_crypto(
        &self,
        identity: &Identity,
        crl: Option<rustls::pki_types::CertificateRevocationListDer<'static>>,
    ) -> anyhow::Result<rustls::ServerConfig> {
        self.server_crypto_logged(identity, crl, Arc::new(RefusalLog::default()))
    }

    /// [`Trust::server_crypto`], logging refused client certificates through `log` (the server
    /// keeps one across revocation-list reloads, so its rate limit holds).
    pub fn server_crypto_logged(
        &self,
        identity: &Identity,
        crl: Option<rustls::pki_types::CertificateRevocationListDer<'static>>,
        log: Arc<RefusalLog>,
    ) -> anyhow::Result<rustls::ServerConfig> {
        match self {
            Self::InsecureDev => server_crypto(identity, None),
            Self::ProjectCa { ca, .. } => server_crypto(identity, Some(client_verifier_logged(ca, crl, log)?)),
        }
    }
}

/// The one crypto provider (ring); configs are built with it explicitly, so no process-wide
/// default is needed and two providers can never collide.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Mutual TLS: accepts only client certificates chained to `ca`, in their validity period, not
/// on `crl`, and naming a device id ([`anchorage_pki::peer_id`]). Refusals are logged to a fresh
/// [`RefusalLog`]; the server passes its own to [`client_verifier_logged`].
pub fn client_verifier(
    ca: &CertificateDer<'static>,
    crl: Option<CertificateRevocationListDer<'static>>,
) -> anyhow::Result<Arc<dyn ClientCertVerifier>> {
    client_verifier_logged(ca, crl, Arc::new(RefusalLog::default()))
}

/// [`client_verifier`], logging each refused certificate (its id, serial and why) through `log`.
///
/// What a device is told, as the TLS alert that ends its handshake (rustls picks it from the
/// verdict; a device exits on any of these rather than retrying, `anchorage-client`'s
/// `transport::definite_refusal`):
///
/// | verdict | alert | `anchorage_refusals_total{reason}` |
/// |---|---|---|
/// | on the revocation list | certificate_revoked (44) | `revoked` |
/// | not signed by the project CA | unknown_ca (48) | `unknown_ca` |
/// | expired or not yet valid | certificate_expired (45) | `certificate_expired` |
/// | names no device id | access_denied (49) | `bad_certificate` |
/// | unreadable, wrong purpose, bad signature | bad_certificate (42), unsupported_certificate (43), certificate_unknown (46), decrypt_error (51) | `bad_certificate` |
/// | no certificate at all (rustls itself) | certificate_required (116) | `no_certificate` |
pub fn client_verifier_logged(
    ca: &CertificateDer<'static>,
    crl: Option<CertificateRevocationListDer<'static>>,
    log: Arc<RefusalLog>,
) -> anyhow::Result<Arc<dyn ClientCertVerifier>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).context("the project CA certificate")?;
    let builder = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
    let builder = match crl {
        Some(crl) => builder.with_crls([crl]),
        None => builder,
    };
    let inner = builder.build().context("building the client certificate verifier")?;
    Ok(Arc::new(DeviceVerifier { inner, log }))
}

/// The `reason` label of `anchorage_refusals_total` for a handshake that this server's TLS ended
/// with `alert` (see [`client_verifier_logged`]).
pub fn alert_reason(alert: u8) -> &'static str {
    use crate::metrics::reason;
    use rustls::AlertDescription as A;
    match A::from(alert) {
        A::CertificateRevoked => reason::REVOKED,
        A::UnknownCA => reason::UNKNOWN_CA,
        A::CertificateExpired => reason::CERTIFICATE_EXPIRED,
        A::CertificateRequired => reason::NO_CERTIFICATE,
        A::BadCertificate
        | A::UnsupportedCertificate
        | A::CertificateUnknown
        | A::AccessDenied
        | A::DecryptError
        | A::BadCertificateStatusResponse => reason::BAD_CERTIFICATE,
        _ => reason::TLS_HANDSHAKE,
    }
}

/// Whether the alert is a verdict on the certificate a device showed, which [`DeviceVerifier`]
/// has logged with the device's id (the accept path logs the others, by address).
pub fn alert_is_certificate_verdict(alert: u8) -> bool {
    use crate::metrics::reason;
    [reason::REVOKED, reason::UNKNOWN_CA, reason::CERTIFICATE_EXPIRED, reason::BAD_CERTIFICATE]
        .contains(&alert_reason(alert))
}

/// The project CA's verifier, plus: a certificate must name a device id, and every refusal is
/// logged (rate-limited by [`RefusalLog`]) with the id and serial the certificate claims. The
/// accept path counts the refused handshakes (`anchorage_refusals_total`), one per handshake.
#[derive(Debug)]
struct DeviceVerifier {
    inner: Arc<dyn ClientCertVerifier>,
    log: Arc<RefusalLog>,
}

impl DeviceVerifier {
    /// Logs a refused certificate (rate-limited) and gives the error back.
    fn refused(&self, cert: &CertificateDer<'_>, error: rustls::Error) -> rustls::Error {
        let alert = match &error {
            rustls::Error::InvalidCertificate(e) => u8::from(rustls::AlertDescription::from(e.clone())),
            _ => u8::from(rustls::AlertDescription::BadCertificate),
        };
        let reason = alert_reason(alert);
        // The id the certificate claims (not proven: it may be a foreign CA's).
        let (who, serial) = match anchorage_pki::peer_id(cert) {
            Ok((id, serial)) => (id, serial),
            Err(_) => ("(a certificate without an id)".to_string(), "-".to_string()),
        };
        if let Some(since) = self.log.note(reason, &who, std::time::Instant::now()) {
            use crate::metrics::reason as r;
            let advice = match reason {
                r::REVOKED => "its certificate is on revoked.crl; to let the device back, issue it a new one",
                r::UNKNOWN_CA => {
                    "not signed by this project's CA (another project's device, or an old site folder): \
                     re-provision it from this CA"
                }
                r::CERTIFICATE_EXPIRED => {
                    "expired or not yet valid by this server's clock: `anchorage ca renew <id>` and copy the new pair"
                }
                _ => "the certificate is unusable here: re-provision the device from this project's CA",
            };
            tracing::warn!(
                reason,
                client = %who,
                serial = %serial,
                alert,
                error = %error,
                more_refused_since_last_line = since,
                "handshake refused ({reason}) for `{who}`: {advice}{}",
                RefusalLog::since_text(since)
            );
        }
        error
    }
}

impl ClientCertVerifier for DeviceVerifier {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        let verified =
            self.inner.verify_client_cert(end_entity, intermediates, now).map_err(|e| self.refused(end_entity, e))?;
        // A certificate of the project CA that names no device cannot be told apart from another:
        // refused here (access_denied), not after the handshake.
        if anchorage_pki::peer_id(end_entity).is_err() {
            let e = rustls::Error::InvalidCertificate(rustls::CertificateError::ApplicationVerificationFailure);
            return Err(self.refused(end_entity, e));
        }
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss).map_err(|e| self.refused(cert, e))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss).map_err(|e| self.refused(cert, e))
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// Rate limit of the refusal log: one line per (reason, who) per [`RefusalLog::WINDOW`], the
/// next line saying how many were refused meanwhile. Every refusal is still counted
/// (`anchorage_refusals_total`); only the log lines are limited, so a revoked device that
/// retries 5 times a second writes one line a minute, not 300.
#[derive(Debug, Default)]
pub struct RefusalLog {
    seen: std::sync::Mutex<std::collections::HashMap<(&'static str, String), Seen>>,
}

#[derive(Debug, Clone, Copy)]
struct Seen {
    logged_at: std::time::Instant,
    /// Refused since that line, not logged.
    since: u64,
}

impl RefusalLog {
    /// At most one line per reason and device (or address) in this long.
    pub const WINDOW: std::time::Duration = std::time::Duration::from_secs(60);
    /// Distinct (reason, who) pairs remembered; beyond it (a flood of made-up ids) the refusals
    /// of a reason share one line a minute.
    const MAX_ENTRIES: usize = 4096;

    /// The tail of a refusal's line: how many went unlogged since the pair's previous line.
    pub fn since_text(since: u64) -> String {
        match since {
            0 => String::new(),
            n => format!(" ({n} more refused since the last line; one line a minute per device and reason)"),
        }
    }

    /// A refusal of `who` for `reason` at `now`: `Some(n)` when a line is due (n: refusals of
    /// the pair not logged since its last line), `None` while the pair's minute is not over.
    pub fn note(&self, reason: &'static str, who: &str, now: std::time::Instant) -> Option<u64> {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let mut key = (reason, who.to_string());
        if !seen.contains_key(&key) && seen.len() >= Self::MAX_ENTRIES {
            seen.retain(|_, s| now.saturating_duration_since(s.logged_at) < Self::WINDOW || s.since > 0);
            if seen.len() >= Self::MAX_ENTRIES {
                key = (reason, "(many)".to_string());
            }
        }
        match seen.get_mut(&key) {
            Some(s) if now.saturating_duration_since(s.logged_at) < Self::WINDOW => {
                s.since += 1;
                None
            }
            Some(s) => {
                let since = s.since;
                *s = Seen { logged_at: now, since: 0 };
                Some(since)
            }
            None => {
                seen.insert(key, Seen { logged_at: now, since: 0 });
                Some(0)
            }
        }
    }
}

/// Server-side rustls config. `client_verifier` is `None` for server-only authentication.
pub fn server_crypto(
    identity: &Identity,
    client_verifier: Option<Arc<dyn ClientCertVerifier>>,
) -> anyhow::Result<rustls::ServerConfig> {
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with ring")?;
    let builder = match client_verifier {
        Some(v) => builder.with_client_cert_verifier(v),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(vec![identity.cert.clone()], identity.key.clone_key())
        .context("server certificate")?;
    // Resumable broadcasts first, for the devices that take them; `anchorage/1` for
    // the others.
    config.alpn_protocols = vec![anchorage_shared::transfer::RESUMABLE_BROADCASTS_ALPN.to_vec(), ALPN.to_vec()];
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn the_refusal_log_writes_one_line_a_minute_per_device_and_reason() {
        let log = RefusalLog::default();
        let t0 = Instant::now();
        assert_eq!(log.note("revoked", "edge-1", t0), Some(0), "the first refusal is logged");
        // Five times a second for a minute: no more lines for that pair...
        for i in 1..300u64 {
            assert_eq!(log.note("revoked", "edge-1", t0 + Duration::from_millis(200 * i)), None);
        }
        // ...but another device, or another reason, gets its own line.
        assert_eq!(log.note("revoked", "edge-2", t0 + Duration::from_secs(1)), Some(0));
        assert_eq!(log.note("unknown_ca", "edge-1", t0 + Duration::from_secs(1)), Some(0));
        // After the minute: one line, with how many went unlogged.
        assert_eq!(log.note("revoked", "edge-1", t0 + RefusalLog::WINDOW + Duration::from_millis(1)), Some(299));
        assert_eq!(log.note("revoked", "edge-1", t0 + RefusalLog::WINDOW + Duration::from_secs(1)), None);
        assert!(RefusalLog::since_text(299).contains("299 more refused since the last line"));
        assert_eq!(RefusalLog::since_text(0), "");
    }

    #[test]
    fn made_up_ids_cannot_grow_the_refusal_log_without_bound() {
        let log = RefusalLog::default();
        let t0 = Instant::now();
        for i in 0..RefusalLog::MAX_ENTRIES + 100 {
            log.note("unknown_ca", &format!("fake-{i}"), t0);
        }
        let len = log.seen.lock().unwrap().len();
        assert!(len <= RefusalLog::MAX_ENTRIES + 1, "{len}");
        // Beyond the bound the flood shares one line a minute.
        assert_eq!(log.note("unknown_ca", "fake-new", t0), None);
    }

    #[test]
    fn each_certificate_verdict_has_its_own_alert_and_reason() {
        use rustls::{AlertDescription, CertificateError};
        let reason_of = |e: CertificateError| alert_reason(u8::from(AlertDescription::from(e)));
        assert_eq!(reason_of(CertificateError::Revoked), "revoked");
        assert_eq!(reason_of(CertificateError::UnknownIssuer), "unknown_ca");
        assert_eq!(reason_of(CertificateError::Expired), "certificate_expired");
        assert_eq!(reason_of(CertificateError::NotValidYet), "certificate_expired");
        assert_eq!(reason_of(CertificateError::ApplicationVerificationFailure), "bad_certificate");
        assert_eq!(reason_of(CertificateError::BadEncoding), "bad_certificate");
        assert_eq!(alert_reason(u8::from(AlertDescription::CertificateRequired)), "no_certificate");
        assert_eq!(alert_reason(u8::from(AlertDescription::NoApplicationProtocol)), "tls_handshake");
        assert!(alert_is_certificate_verdict(44) && alert_is_certificate_verdict(48));
        assert!(!alert_is_certificate_verdict(116) && !alert_is_certificate_verdict(120));
        // Every label is one the exposition lists from the start.
        for alert in 0..=255u8 {
            assert!(crate::metrics::reason::TRANSPORT.contains(&alert_reason(alert)), "{alert}");
        }
    }
}
