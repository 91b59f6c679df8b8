//! TLS for the QUIC endpoint: rustls with the `ring` provider only, TLS 1.3, ALPN `anchorage/1`.
//!
//! Today the server presents a self-signed development certificate that clients pin. Mutual TLS
//! with a project CA plugs in here: [`server_crypto`] takes the client verifier as a parameter.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::danger::ClientCertVerifier;

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

/// Loads `cert.der` and `key.der` from `dir`, creating a self-signed pair there if absent.
pub fn load_or_create(dir: &Path, names: &[&str]) -> anyhow::Result<Identity> {
    let (cert_path, key_path) = (dir.join("cert.der"), dir.join("key.der"));
    if cert_path.exists() && key_path.exists() {
        let cert = std::fs::read(&cert_path).with_context(|| format!("reading {}", cert_path.display()))?;
        let key = std::fs::read(&key_path).with_context(|| format!("reading {}", key_path.display()))?;
        return Ok(Identity {
            cert: CertificateDer::from(cert),
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key)),
        });
    }
    let id = self_signed(names)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    anchorage_shared::io::write_atomic(&cert_path, id.cert.as_ref())
        .with_context(|| format!("writing {}", cert_path.display()))?;
    anchorage_shared::io::write_atomic(&key_path, id.key.secret_der())
        .with_context(|| format!("writing {}", key_path.display()))?;
    tracing::info!(cert = %cert_path.display(), "created a self-signed development certificate; clients pin this file");
    Ok(id)
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
