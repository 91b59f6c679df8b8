//! The project's PKI, in one place: who a certificate names ([`cert`]), a certificate with its
//! key on disk ([`identity`]), the project CA that signs and revokes ([`ca`]) and the files a
//! site folder holds ([`site`]). The server's TLS, the client's `doctor` and the operator's
//! `anchorage ca` / `anchorage provision` all use these; none writes its own.
//!
//! No hand-written crypto: rcgen makes keys, certificates and CRLs; rustls / webpki verify them
//! (in the server's and the client's TLS set-up); x509-parser reads ids and serials back.

#![warn(missing_docs)]

pub mod cert;
pub mod identity;
pub mod tls;

#[cfg(feature = "issue")]
pub mod ca;
#[cfg(feature = "issue")]
pub mod site;

pub use cert::{CertInfo, cert_info, cert_names, device_id, peer_id, revoked_serials, serial_hex};
pub use identity::{CERT_FILE, Identity, KEY_FILE, load_identity, save_identity, write_private};

#[cfg(feature = "issue")]
pub use ca::{CA_CERT, CA_KEY, CRL, INDEX, Issued, Kind, ProjectCa};

/// Now, in unix seconds.
#[cfg(feature = "issue")]
pub(crate) fn unix_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}
