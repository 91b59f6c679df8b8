//! A certificate with its private key, and the two files a site folder keeps them in
//! (`cert.der`, `key.der`; the key mode 0600 from the moment it is written).

use std::path::Path;

use anyhow::Context;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A certificate and its private key.
pub struct Identity {
    /// The certificate, DER.
    pub cert: CertificateDer<'static>,
    /// Its private key.
    pub key: PrivateKeyDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Self { cert: self.cert.clone(), key: self.key.clone_key() }
    }
}

#[cfg(feature = "issue")]
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
/// The private-key file of a TLS folder (PKCS#8 DER, mode 0600).
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

#[cfg(feature = "issue")]
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
