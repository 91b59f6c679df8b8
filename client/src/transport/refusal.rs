//! Which failures mean the server refused this device for good (stop, and tell the operator
//! what to do) and which a retry may clear.

use std::net::SocketAddr;

use super::ClientOptions;

/// Exit status of `anchorage-client` when the server refused the device for good
/// ([`Refused`]): sysexits' `EX_NOPERM`. The systemd unit does not restart on it
/// (`RestartPreventExitStatus=77`).
pub const EXIT_REFUSED: u8 = 77;

/// Whether a connection failed because TLS did not accept a certificate (ours or the server's):
/// QUIC's crypto error codes, 0x100–0x1ff, carry a TLS alert.
pub fn tls_failure(e: &quinn::ConnectionError) -> bool {
    let crypto = |code: u64| (0x100..=0x1ff).contains(&code);
    match e {
        quinn::ConnectionError::TransportError(t) => crypto(u64::from(t.code)),
        quinn::ConnectionError::ConnectionClosed(c) => crypto(u64::from(c.error_code)),
        _ => false,
    }
}

/// Why the server refused this device for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// The device's certificate is on the project's revocation list (TLS alert
    /// certificate_revoked, or the server's refusal "certificate revoked").
    Revoked,
    /// The certificate is not from the server's project CA (unknown_ca).
    UnknownCa,
    /// The certificate has expired, or is not valid yet by the server's clock (certificate_expired).
    Expired,
    /// The server does not accept the certificate: it names no device, does not parse, is not a
    /// device certificate, or its signature is wrong (bad_certificate, unsupported_certificate,
    /// certificate_unknown, access_denied, decrypt_error).
    BadCertificate,
    /// The device showed no certificate to a server that requires one (certificate_required).
    NoCertificate,
    /// The server's refusal `NotEnrolled`: it does not take this device (another id in the hello
    /// than in the certificate, or a certificate revoked moments ago).
    NotEnrolled,
    /// The server speaks another protocol version or runs another method (`VersionMismatch`,
    /// `UnknownMethod`, or no common ALPN).
    Incompatible,
}

impl RefusalKind {
    /// The kind a TLS alert from the server means; `None` for an alert that a retry may clear.
    pub fn of_alert(alert: u8) -> Option<Self> {
        Some(match alert {
            44 => Self::Revoked,
            48 => Self::UnknownCa,
            45 => Self::Expired,
            42 | 43 | 46 | 49 | 51 => Self::BadCertificate,
            116 => Self::NoCertificate,
            120 => Self::Incompatible,
            _ => return None,
        })
    }

    /// What the operator does about it.
    fn advice(self, id: &str) -> String {
        match self {
            Self::Revoked => format!(
                "the certificate of `{id}` is revoked. If this device should rejoin, issue it a new certificate \
                 (`anchorage ca issue client {id} --dir <ca> --out <site>`, or re-provision it) and copy cert.der and \
                 key.der to it; otherwise uninstall it"
            ),
            Self::UnknownCa => format!(
                "the server's project CA did not sign the certificate of `{id}`: the device holds another project's \
                 or an old folder. Re-provision it from the server's CA (`anchorage provision`, or \
                 `anchorage ca issue client {id}`) and copy its folder to the device"
            ),
            Self::Expired => format!(
                "the certificate of `{id}` has expired (or is not valid yet by the server's clock): \
                 `anchorage ca renew {id} --dir <ca> --out <site>`, then copy cert.der and key.der to the device"
            ),
            Self::BadCertificate => format!(
                "the server does not accept the certificate of `{id}` (no device id in it, unreadable, or not a \
                 device certificate): re-provision the device from the server's CA"
            ),
            Self::NoCertificate => "the server requires a device certificate: set `cert` and `key` in client.toml \
                 to this device's files from `anchorage provision`"
                .to_string(),
            Self::NotEnrolled => format!(
                "the server does not take `{id}`: check that client_id is the id in cert.der, and that the \
                 certificate is not revoked (`anchorage ca list`)"
            ),
            Self::Incompatible => "this client and the server do not speak the same protocol version or method: \
                 install the server's release of anchorage-client, or fix `method` in client.toml"
                .to_string(),
        }
    }
}

/// The server refused this device for good: retrying cannot help until an operator acts, so the
/// client stops (`anchorage-client` exits with [`EXIT_REFUSED`]).
#[derive(Debug, Clone, thiserror::Error)]
#[error("the server {server} refused `{client}` for good ({kind:?}: {detail}); {advice}", advice = kind.advice(client))]
pub struct Refused {
    pub client: String,
    pub server: SocketAddr,
    pub kind: RefusalKind,
    /// What the server said (the TLS alert, or its refusal's detail).
    pub detail: String,
}

/// Whether a closed connection means the server refused this device for good: a TLS alert
/// the *server* sent about this device's certificate (revoked, unknown CA, expired, bad, none,
/// no common protocol). Alerts of this client's own TLS (it did not trust the server's
/// certificate) are not: the server's side may be fixed without touching the device, so those
/// are retried with backoff, as are timeouts, resets and a server that is down.
pub fn definite_refusal(e: &quinn::ConnectionError) -> Option<(RefusalKind, String)> {
    let quinn::ConnectionError::ConnectionClosed(c) = e else { return None };
    let code = u64::from(c.error_code);
    if !(0x100..=0x1ff).contains(&code) {
        return None;
    }
    let alert = (code - 0x100) as u8;
    let kind = RefusalKind::of_alert(alert)?;
    Some((kind, format!("TLS alert {alert} ({:?}): {e}", rustls::AlertDescription::from(alert))))
}

/// A handshake that TLS ended for a reason a retry may clear (this client did not accept the
/// server's certificate, or the server's alert is not about this device's certificate): an error
/// that says what to check; the client keeps retrying with backoff, in case the server's side is
/// fixed, but never quietly. The server's verdicts on this device's certificate stop the client
/// instead ([`definite_refusal`]).
pub(super) fn tls_error(options: &ClientOptions, e: &quinn::ConnectionError) {
    let ours = matches!(e, quinn::ConnectionError::TransportError(_));
    tracing::error!(
        client = %options.client_id,
        server = %options.server_name,
        mutual_tls = options.client_cert.is_some(),
        error = %e,
        "TLS failed ({}): check that server_cert is the project CA (or the development server's own \
         certificate) and that the server's certificate names `server_name`; retrying with backoff",
        if ours { "this client did not accept the server's certificate" } else { "the server's alert" }
    );
}
