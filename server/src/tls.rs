//! TLS for the QUIC endpoint: rustls with the `ring` provider only, TLS 1.3, ALPN `anchorage/1`.
//!
//! By default the server presents a certificate signed by the project CA ([`crate::ca`]) and asks
//! every client for one (mutual TLS). In the explicit development mode it presents a self-signed
//! certificate that clients pin, and asks for none.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::danger::ClientCertVerifier;

/// What to do about a missing or damaged `revoked.crl`.
pub const CRL_HINT: &str = "Copy the project CA's revoked.crl there (`anchorage ca init` and `anchorage ca revoke` \
     write it in the CA folder, even when nothing is revoked; `anchorage provision` and `anchorage ca issue server` \
     write it into the server's folder)";

/// ALPN protocol id of Anchorage v1.
pub const ALPN: &[u8] = b"anchorage/1";

/// A certificate and its private key.
pub struct Identity {
    pub cert: CertificateDer<'static>,
    pub key: PrivateKeyDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Self { cert: self.cert.clone(), key: self.key.clone_key() }
    }
}

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
        crate::ca::revoked_serials(&bytes)
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
        match self {
            Self::InsecureDev => server_crypto(identity, None),
            Self::ProjectCa { ca, .. } => server_crypto(identity, Some(client_verifier(ca, crl)?)),
        }
    }
}

/// The one crypto provider (ring); configs are built with it explicitly, so no process-wide
/// default is needed and two providers can never collide.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A fresh self-signed development certificate for `names` (e.g. `localhost`).
pub fn self_signed(names: &[&str]) -> anyhow::Result<Identity> {
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    let certified = rcgen::generate_simple_self_signed(names).context("generating a development certificate")?;
    Ok(Identity {
        cert: certified.cert.der().clone(),
        key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(certified.signing_key.serialize_der())),
    })
}

/// The certificate and key files of a TLS folder.
pub const CERT_FILE: &str = "cert.der";
pub const KEY_FILE: &str = "key.der";

/// Loads `cert.der` and `key.der` from `dir`. A certificate without its key, or a key without
/// its certificate, is an error that says what to do: an identity is never made again silently
/// (devices that trust the old one would be locked out).
pub fn load_identity(dir: &Path) -> anyhow::Result<Option<Identity>> {
    let (cert_path, key_path) = (dir.join(CERT_FILE), dir.join(KEY_FILE));
    match (cert_path.exists(), key_path.exists()) {
        (false, false) => Ok(None),
        (true, true) => {
            let cert = std::fs::read(&cert_path).with_context(|| format!("reading {}", cert_path.display()))?;
            let key = std::fs::read(&key_path).with_context(|| format!("reading {}", key_path.display()))?;
            warn_if_readable_by_others(&key_path);
            Ok(Some(Identity {
                cert: CertificateDer::from(cert),
                key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key)),
            }))
        }
        (true, false) => anyhow::bail!(
            "{} is missing but {} exists: restore the key from a backup, or issue a new certificate \
             (`anchorage ca issue`) and give every device the new one; a new key is not made silently",
            key_path.display(),
            cert_path.display()
        ),
        (false, true) => anyhow::bail!(
            "{} exists without its certificate {}: restore the certificate or issue a new pair",
            key_path.display(),
            cert_path.display()
        ),
    }
}

/// Writes an identity into `dir`: the key with mode 0600, then the certificate.
pub fn save_identity(dir: &Path, identity: &Identity) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    write_private(&dir.join(KEY_FILE), identity.key.secret_der())?;
    let cert_path = dir.join(CERT_FILE);
    anchorage_shared::io::write_atomic(&cert_path, identity.cert.as_ref())
        .with_context(|| format!("writing {}", cert_path.display()))
}

/// Development mode: loads `cert.der` and `key.der` from `dir`, creating a self-signed pair
/// there only when neither exists.
pub fn load_or_create(dir: &Path, names: &[&str]) -> anyhow::Result<Identity> {
    if let Some(id) = load_identity(dir)? {
        return Ok(id);
    }
    let id = self_signed(names)?;
    save_identity(dir, &id)?;
    tracing::info!(cert = %dir.join(CERT_FILE).display(), "created a self-signed development certificate; clients pin this file");
    Ok(id)
}

/// Writes a secret atomically with mode 0600 from the start (never world-readable, not even
/// for a moment).
pub fn write_private(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let context = || format!("writing {}", path.display());
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(context)?;
    file.write_all(bytes).with_context(context)?;
    file.sync_all().with_context(context)?;
    std::fs::rename(&tmp, path).with_context(context)?;
    Ok(())
}

/// A private key others can read is logged (it still works: refusing would take a device down).
fn warn_if_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        tracing::warn!(key = %path.display(), mode = format!("{:o}", meta.permissions().mode() & 0o777), "a private key is readable by other users; chmod 600 it");
    }
}

/// Mutual TLS: accepts only client certificates chained to `ca`, in their validity period, and
/// not on `crl`.
pub fn client_verifier(
    ca: &CertificateDer<'static>,
    crl: Option<CertificateRevocationListDer<'static>>,
) -> anyhow::Result<Arc<dyn ClientCertVerifier>> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).context("the project CA certificate")?;
    let builder = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
    let builder = match crl {
        Some(crl) => builder.with_crls([crl]),
        None => builder,
    };
    builder.build().context("building the client certificate verifier")
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
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(config)
}
