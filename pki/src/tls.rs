//! The TLS a peer shows when it connects: one rustls client config for devices and for relays
//! reaching their parent (ring provider only, TLS 1.3), trusting one certificate (the project
//! CA, or a development server's own) and showing a certificate where mutual TLS asks for one.

use std::sync::Arc;

use anyhow::Context;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// A client config that trusts `trusted` and shows `client` (chain, key) if given, offering
/// `alpn` in order.
pub fn client_config(
    trusted: &CertificateDer<'static>,
    client: Option<(&[CertificateDer<'static>], &PrivateKeyDer<'static>)>,
    alpn: &[&[u8]],
) -> anyhow::Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(trusted.clone()).context("the trusted certificate")?;
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("TLS 1.3 with ring")?
        .with_root_certificates(roots);
    let mut config = match client {
        Some((chain, key)) => {
            builder.with_client_auth_cert(chain.to_vec(), key.clone_key()).context("this peer's certificate and key")?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|a| a.to_vec()).collect();
    Ok(config)
}
