//! The project CA: one root that signs the server's and every device's certificate, the way
//! NVFlare's provisioning and Flower's node authentication work. A certificate carries its
//! holder's id in the subject alternative name (and common name); the server takes a peer's id
//! from its certificate, never from what the peer says. Revocation is a standard X.509 CRL signed
//! by the root (`revoked.crl`), which rustls checks during the handshake and which the server
//! re-reads while it runs.
//!
//! No hand-written crypto: rcgen makes keys, certificates and CRLs; rustls / webpki verify them;
//! x509-parser reads ids and serial numbers back.
//!
//! Files of a CA folder: `ca.der` (the root, given to every site), `ca.key` (mode 0600, stays
//! with the operator), `issued.json` (what was issued and revoked), `revoked.crl`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyIdMethod, KeyPair, KeyUsagePurpose, RevocationReason, RevokedCertParams,
    SerialNumber,
};
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use serde::{Deserialize, Serialize};

use crate::cert::serial_hex;
use crate::identity::{Identity, write_private};
use crate::unix_now;

/// The root certificate's file in a CA folder (DER, given to every site).
pub const CA_CERT: &str = "ca.der";
/// The root's private-key file in a CA folder (mode 0600, stays with the operator).
pub const CA_KEY: &str = "ca.key";
/// The file of a CA folder that lists what was issued and revoked.
pub const INDEX: &str = "issued.json";
/// The revocation list's file in a CA folder (an X.509 CRL signed by the root).
pub const CRL: &str = "revoked.crl";

/// Who a certificate is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// The server: a certificate for TLS server authentication.
    Server,
    /// A device: a certificate for TLS client authentication.
    Client,
    /// A relay: a server to its devices and a client of its parent, so both extended
    /// key usages, and the relay role in its subject ([`crate::cert::RELAY_UNIT`]), which is
    /// what lets it send a parent partial aggregates.
    Relay,
}

impl Kind {
    /// As `anchorage ca list` writes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Server => "server",
            Self::Client => "client",
            Self::Relay => "relay",
        }
    }

    /// Whether the site serves devices (its folder gets the revocation list it checks them against).
    pub fn serves(self) -> bool {
        matches!(self, Self::Server | Self::Relay)
    }
}

/// One certificate the CA signed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Issued {
    /// The holder's id, as its certificate carries it.
    pub id: String,
    /// Who the certificate is for.
    pub kind: Kind,
    /// Serial number, lowercase hex without leading zeros.
    pub serial: String,
    /// Unix seconds.
    pub not_after: i64,
    /// Unix seconds, when revoked.
    #[serde(default)]
    pub revoked_at: Option<i64>,
}

/// A project CA, on disk or (for the simulator's own loopback federation) in memory.
pub struct ProjectCa {
    dir: Option<PathBuf>,
    cert: CertificateDer<'static>,
    key: KeyPair,
    issued: Vec<Issued>,
}

impl std::fmt::Debug for ProjectCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProjectCa").field("dir", &self.dir).field("issued", &self.issued.len()).finish()
    }
}

fn at(unix: i64) -> anyhow::Result<time::OffsetDateTime> {
    time::OffsetDateTime::from_unix_timestamp(unix).context("a time outside the certificate range")
}

/// A fresh positive serial number (16 random bytes, top bit clear so DER needs no padding).
fn new_serial() -> anyhow::Result<Vec<u8>> {
    let mut bytes = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
        .map_err(|_| anyhow::anyhow!("the system's random number generator failed"))?;
    bytes[0] = (bytes[0] & 0x7f) | 0x40;
    Ok(bytes.to_vec())
}

impl ProjectCa {
    /// Makes a new root valid for `days` in `dir` (which must not hold one already).
    pub fn init(dir: &Path, name: &str, days: u32) -> anyhow::Result<Self> {
        anyhow::ensure!(
            !dir.join(CA_KEY).exists() && !dir.join(CA_CERT).exists(),
            "{} already holds a CA; a second root would orphan every certificate it signed",
            dir.display()
        );
        let mut ca = Self::in_memory(name, days)?;
        ca.dir = Some(dir.to_path_buf());
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        write_private(&dir.join(CA_KEY), &ca.key.serialize_der())?;
        anchorage_shared::io::write_atomic(&dir.join(CA_CERT), ca.cert.as_ref())
            .with_context(|| format!("writing {}", dir.join(CA_CERT).display()))?;
        ca.save()?;
        Ok(ca)
    }

    /// A root that lives only in this process (the simulator's loopback federation).
    pub fn in_memory(name: &str, days: u32) -> anyhow::Result<Self> {
        let key = KeyPair::generate().context("generating the CA key")?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, format!("{name} root CA"));
        params.distinguished_name.push(DnType::OrganizationName, "Anchorage project CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        params.serial_number = Some(SerialNumber::from_slice(&new_serial()?));
        let now = unix_now();
        params.not_before = at(now - 3600)?;
        params.not_after = at(now + i64::from(days) * 86_400)?;
        params.key_identifier_method = KeyIdMethod::Sha256;
        let cert = params.self_signed(&key).context("signing the CA certificate")?;
        Ok(Self { dir: None, cert: cert.der().clone(), key, issued: Vec::new() })
    }

    /// Opens the CA in `dir`.
    pub fn open(dir: &Path) -> anyhow::Result<Self> {
        let read = |name: &str| {
            let path = dir.join(name);
            std::fs::read(&path).with_context(|| format!("reading {} (run `anchorage ca init` first?)", path.display()))
        };
        let cert = CertificateDer::from(read(CA_CERT)?);
        let key_der = read(CA_KEY)?;
        let key = KeyPair::try_from(key_der.as_slice())
            .with_context(|| format!("{} is not a private key", dir.join(CA_KEY).display()))?;
        let index = dir.join(INDEX);
        let issued = match std::fs::read(&index) {
            Ok(bytes) => serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", index.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e).with_context(|| format!("reading {}", index.display())),
        };
        Ok(Self { dir: Some(dir.to_path_buf()), cert, key, issued })
    }

    /// This CA without its folder: what it issues from now on is not recorded in the folder's
    /// index (a fleet worker's short-lived certificates for simulated devices).
    pub fn detached(mut self) -> Self {
        self.dir = None;
        self
    }

    /// The root certificate every site trusts.
    pub fn cert(&self) -> &CertificateDer<'static> {
        &self.cert
    }

    /// What this CA issued, revoked ones included.
    pub fn issued(&self) -> &[Issued] {
        &self.issued
    }

    fn issuer(&self) -> anyhow::Result<Issuer<'static, &KeyPair>> {
        Issuer::from_ca_cert_der(&self.cert, &self.key).context("reading the CA certificate")
    }

    /// Signs a certificate for `id` valid for `days` (a server's also for its DNS `names`).
    /// A client's id must be a DNS-label-like name (letters, digits, `-`, `.`).
    pub fn issue(&mut self, kind: Kind, id: &str, names: &[String], days: u32) -> anyhow::Result<Identity> {
        let now = unix_now();
        self.issue_valid(kind, id, names, now - 3600, now + i64::from(days) * 86_400)
    }

    /// [`ProjectCa::issue`] with explicit validity (tests make expired certificates with it).
    pub fn issue_valid(
        &mut self,
        kind: Kind,
        id: &str,
        names: &[String],
        not_before: i64,
        not_after: i64,
    ) -> anyhow::Result<Identity> {
        anyhow::ensure!(
            !id.is_empty()
                && id.len() <= 63
                && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_'),
            "`{id}` is not a valid id: 1 to 63 letters, digits, `-`, `_` or `.`"
        );
        let mut sans: Vec<String> = vec![id.to_string()];
        sans.extend(names.iter().filter(|n| n.as_str() != id).cloned());
        let mut params = CertificateParams::new(sans).with_context(|| format!("names for `{id}`"))?;
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, id);
        if kind == Kind::Relay {
            params.distinguished_name.push(DnType::OrganizationalUnitName, crate::cert::RELAY_UNIT);
        }
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = match kind {
            Kind::Server => vec![ExtendedKeyUsagePurpose::ServerAuth],
            Kind::Client => vec![ExtendedKeyUsagePurpose::ClientAuth],
            Kind::Relay => vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth],
        };
        let serial = new_serial()?;
        params.serial_number = Some(SerialNumber::from_slice(&serial));
        params.not_before = at(not_before)?;
        params.not_after = at(not_after)?;
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate().context("generating a key")?;
        let cert = params.signed_by(&key, &self.issuer()?).with_context(|| format!("signing `{id}`"))?;
        self.issued.push(Issued { id: id.into(), kind, serial: serial_hex(&serial), not_after, revoked_at: None });
        self.save()?;
        Ok(Identity {
            cert: cert.der().clone(),
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        })
    }

    /// Revokes every certificate of `id` not revoked yet and rewrites the CRL; returns them.
    pub fn revoke(&mut self, id: &str) -> anyhow::Result<Vec<Issued>> {
        self.revoke_where(id, None)
    }

    /// [`ProjectCa::revoke`], or only the certificate of `id` with `serial` (the old one after a
    /// renewal, say).
    pub fn revoke_where(&mut self, id: &str, serial: Option<&str>) -> anyhow::Result<Vec<Issued>> {
        let now = unix_now();
        let wanted = serial.map(|s| s.trim_start_matches('0').to_ascii_lowercase());
        let mut revoked = Vec::new();
        for i in self
            .issued
            .iter_mut()
            .filter(|i| i.id == id && i.revoked_at.is_none() && wanted.as_ref().is_none_or(|w| *w == i.serial))
        {
            i.revoked_at = Some(now);
            revoked.push(i.clone());
        }
        anyhow::ensure!(!revoked.is_empty(), "no certificate of `{id}` to revoke (see `anchorage ca list`)");
        self.save()?;
        Ok(revoked)
    }

    /// The CRL of every revoked certificate, signed by the root, valid for a year (the server
    /// re-reads it when the file changes; webpki does not enforce its next update).
    pub fn crl(&self) -> anyhow::Result<CertificateRevocationListDer<'static>> {
        let now = unix_now();
        let revoked_certs = self
            .issued
            .iter()
            .filter_map(|i| i.revoked_at.map(|t| (i, t)))
            .map(|(i, t)| {
                Ok(RevokedCertParams {
                    serial_number: SerialNumber::from_slice(&hex_bytes(&i.serial)?),
                    revocation_time: at(t)?,
                    reason_code: Some(RevocationReason::Unspecified),
                    invalidity_date: None,
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let params = CertificateRevocationListParams {
            this_update: at(now - 60)?,
            next_update: at(now + 365 * 86_400)?,
            crl_number: SerialNumber::from_slice(&now.to_be_bytes()),
            issuing_distribution_point: None,
            revoked_certs,
            key_identifier_method: KeyIdMethod::Sha256,
        };
        let crl = params.signed_by(&self.issuer()?).context("signing the revocation list")?;
        Ok(crl.der().clone())
    }

    /// Writes the index and the CRL (on-disk CAs only).
    fn save(&self) -> anyhow::Result<()> {
        let Some(dir) = &self.dir else { return Ok(()) };
        let index = dir.join(INDEX);
        anchorage_shared::io::write_atomic(&index, serde_json::to_string_pretty(&self.issued)?.as_bytes())
            .with_context(|| format!("writing {}", index.display()))?;
        let crl = dir.join(CRL);
        anchorage_shared::io::write_atomic(&crl, self.crl()?.as_ref())
            .with_context(|| format!("writing {}", crl.display()))
    }
}

fn hex_bytes(hex: &str) -> anyhow::Result<Vec<u8>> {
    let hex = if hex.len() % 2 == 1 { format!("0{hex}") } else { hex.to_string() };
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).with_context(|| format!("serial `{hex}` is not hex")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cert::{is_relay, peer_id, revoked_serials};

    /// A relay's certificate serves devices and is a client of its parent, and only it carries
    /// the relay role.
    #[test]
    fn a_relay_certificate_carries_the_relay_role_and_both_usages() {
        let mut ca = ProjectCa::in_memory("test", 30).unwrap();
        let relay = ca.issue(Kind::Relay, "relay-0", &["relay-0.example.org".into()], 10).unwrap();
        let device = ca.issue(Kind::Client, "edge-001", &[], 10).unwrap();
        let server = ca.issue(Kind::Server, "server", &[], 10).unwrap();
        assert!(is_relay(relay.cert.as_ref()));
        assert!(!is_relay(device.cert.as_ref()) && !is_relay(server.cert.as_ref()));
        assert!(!is_relay(b"not a certificate"));
        assert_eq!(peer_id(&relay.cert).unwrap().0, "relay-0");
        let (_, x509) = x509_parser::parse_x509_certificate(relay.cert.as_ref()).unwrap();
        let eku = x509.extended_key_usage().unwrap().unwrap().value;
        assert!(eku.server_auth && eku.client_auth);
        assert_eq!(ca.issued().iter().map(|i| i.kind.name()).collect::<Vec<_>>(), ["relay", "client", "server"]);
        assert!(Kind::Relay.serves() && Kind::Server.serves() && !Kind::Client.serves());
    }

    #[test]
    fn issued_certificates_name_their_holder_and_revocation_lists_them() {
        let dir = tempfile::tempdir().unwrap();
        let mut ca = ProjectCa::init(dir.path(), "test", 30).unwrap();
        assert!(ProjectCa::init(dir.path(), "test", 30).is_err(), "a second root is refused");
        let a = ca.issue(Kind::Client, "edge-001", &[], 10).unwrap();
        let server = ca.issue(Kind::Server, "server", &["localhost".into()], 10).unwrap();
        let (id, serial) = peer_id(&a.cert).unwrap();
        assert_eq!(id, "edge-001");
        assert_eq!(peer_id(&server.cert).unwrap().0, "server");
        assert!(ca.issue(Kind::Client, "no spaces", &[], 1).is_err());
        // After a renewal, only the old certificate is revoked by its serial.
        let renewed = ca.issue(Kind::Client, "edge-001", &[], 10).unwrap();
        let revoked = ca.revoke_where("edge-001", Some(&serial)).unwrap();
        assert_eq!(revoked.iter().map(|r| r.serial.clone()).collect::<Vec<_>>(), vec![serial.clone()]);
        assert!(ca.revoke_where("edge-001", Some(&serial)).is_err(), "already revoked");
        let (_, renewed_serial) = peer_id(&renewed.cert).unwrap();
        assert_eq!(ca.revoke("edge-001").unwrap()[0].serial, renewed_serial, "the id's remaining certificate");
        assert!(ca.revoke("edge-001").is_err(), "nothing left to revoke");
        let reopened = ProjectCa::open(dir.path()).unwrap();
        assert_eq!(reopened.issued().len(), 3);
        let crl = std::fs::read(dir.path().join(CRL)).unwrap();
        let listed = revoked_serials(&crl).unwrap();
        assert!(listed.contains(&serial) && listed.contains(&renewed_serial) && listed.len() == 2, "{listed:?}");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join(CA_KEY)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the CA key is private");
    }
}
