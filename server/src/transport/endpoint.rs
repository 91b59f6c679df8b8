//! The QUIC endpoint: its TLS server config (built again whenever the revocation list changes)
//! and, with a store, the keys that outlive a restart so that devices hear at once that their
//! old connection is gone.

use std::sync::Arc;

use anchorage_shared::io::udp_socket;
use anyhow::Context;
use quinn::crypto::rustls::QuicServerConfig;

use super::ServerOptions;
use crate::tls::{RefusalLog, Trust};
use anchorage_pki::Identity;

/// Binds the UDP socket of `options.bind` and starts the endpoint on it: the TLS config of
/// `options.trust` with `crl`, and stateless-reset keys from the store if there is one.
pub(super) fn bind(
    options: &ServerOptions,
    crl: Crl,
    transport: &Arc<quinn::TransportConfig>,
    refusals: &Arc<RefusalLog>,
) -> anyhow::Result<quinn::Endpoint> {
    let server_config = quic_server_config(&options.trust, &options.identity, crl, transport, refusals)?;
    let socket =
        udp_socket(options.bind, options.limits.socket_buffer).with_context(|| format!("binding {}", options.bind))?;
    let endpoint_config = match &options.store {
        Some(store) => restart_aware_endpoint(&store.stateless_reset_key()?),
        None => quinn::EndpointConfig::default(),
    };
    quinn::Endpoint::new(endpoint_config, Some(server_config), socket, Arc::new(quinn::TokioRuntime))
        .with_context(|| format!("starting the QUIC endpoint on {}", options.bind))
}

/// An endpoint whose keys outlive the process, so that after a restart a device's next packet
/// on its old connection is answered with a stateless reset it recognises, and it reconnects at
/// once instead of waiting out its idle timeout. Both keys matter: the connection-ID generator's
/// key (quinn drops packets whose connection ID it did not sign, before any reset) and the reset
/// key (the token the device checks).
fn restart_aware_endpoint(secret: &[u8; 32]) -> quinn::EndpointConfig {
    let derive = |label: &[u8]| {
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        ctx.update(label);
        ctx.update(secret);
        ctx.finish()
    };
    let reset = derive(b"anchorage stateless reset");
    let cid = derive(b"anchorage connection ids");
    let cid_key = u64::from_le_bytes(cid.as_ref()[..8].try_into().expect("a SHA-256 digest has 32 bytes"));
    let mut config =
        quinn::EndpointConfig::new(Arc::new(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, reset.as_ref())));
    config.cid_generator(move || Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cid_key)));
    config
}

pub(super) type Crl = Option<rustls::pki_types::CertificateRevocationListDer<'static>>;

pub(super) fn quic_server_config(
    trust: &Trust,
    identity: &Identity,
    crl: Crl,
    transport: &Arc<quinn::TransportConfig>,
    refusals: &Arc<RefusalLog>,
) -> anyhow::Result<quinn::ServerConfig> {
    let crypto = trust.server_crypto_logged(identity, crl, refusals.clone())?;
    let mut config =
        quinn::ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(crypto).context("QUIC TLS config")?));
    config.transport_config(transport.clone());
    Ok(config)
}
