//! A device's QUIC endpoint: its own UDP socket (a device in the field, or one behind the
//! simulator's link model), or one endpoint that the in-process devices of a simulator or fleet
//! worker share.
//!
//! Why share: each quinn endpoint allocates a receive buffer of
//! `max_udp_payload_size × GRO segments × BATCH_SIZE` (1472 × 64 × 32 ≈ 3 MB on Linux) and runs
//! its own driver task. A thousand devices in one process would hold about a gigabyte that way. A
//! shared endpoint opens each device's connection with that device's own client config (its
//! certificate, ALPN and timers), so the server sees the same handshakes; only the UDP port is
//! common, and devices on loopback already share their address.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::io::udp_socket;
use anyhow::Context;
use quinn::crypto::rustls::QuicClientConfig;

use super::{ClientOptions, SocketWrapper, client_crypto};

/// Kernel buffer sizes asked for a device's socket.
const SOCKET_BUFFER: usize = 4 << 20;

/// The endpoint a device connects through, with its own client config.
pub struct DeviceEndpoint {
    endpoint: quinn::Endpoint,
    config: quinn::ClientConfig,
    /// Bound for this device alone: closing the device closes it, and leaving waits for it to go
    /// idle. A shared endpoint outlives the device; its owner closes it.
    own: bool,
}

impl DeviceEndpoint {
    /// The endpoint of `options`: the shared one when given (and no socket wrapper asks for a
    /// socket of the device's own), else one bound for this device.
    pub fn new(options: &ClientOptions) -> anyhow::Result<Self> {
        let config = client_config(options)?;
        Ok(match (&options.shared_endpoint, &options.socket_wrapper) {
            (Some(shared), None) => Self { endpoint: shared.clone(), config, own: false },
            _ => Self { endpoint: bind(options.server, options.socket_wrapper.as_ref())?, config, own: true },
        })
    }

    /// A connection attempt to `options`' server with this device's config.
    pub fn connect(&self, options: &ClientOptions) -> anyhow::Result<quinn::Connecting> {
        Ok(self.endpoint.connect_with(self.config.clone(), options.server, &options.server_name)?)
    }

    /// The device is leaving: an endpoint of its own is closed (every connection on it with
    /// `reason`); a shared one is left to its owner.
    pub fn close(&self, reason: &[u8]) {
        if self.own {
            self.endpoint.close(quinn::VarInt::from_u32(0), reason);
        }
    }

    /// Gives the last close frames up to `limit` to leave an endpoint of the device's own. A
    /// shared endpoint's driver keeps running, so a closed connection's frames go out anyway.
    pub async fn wait_idle(&self, limit: Duration) {
        if self.own {
            tokio::time::timeout(limit, self.endpoint.wait_idle()).await.ok();
        }
    }
}

/// The QUIC endpoint of `options` alone: its socket (wrapped when asked), its timers, and a
/// default client config that trusts `server_cert` and shows `client_cert`.
pub fn endpoint(options: &ClientOptions) -> anyhow::Result<quinn::Endpoint> {
    let mut endpoint = bind(options.server, options.socket_wrapper.as_ref())?;
    endpoint.set_default_client_config(client_config(options)?);
    Ok(endpoint)
}

/// One endpoint for many in-process devices that talk to `server` ([`ClientOptions::shared_endpoint`]);
/// it has no client config of its own: each device brings its own.
pub fn shared_endpoint(server: SocketAddr) -> anyhow::Result<quinn::Endpoint> {
    bind(server, None)
}

/// The any-address of `server`'s family, port 0.
fn unspecified(server: SocketAddr) -> anyhow::Result<SocketAddr> {
    Ok(if server.is_ipv4() { "0.0.0.0:0".parse()? } else { "[::]:0".parse()? })
}

/// A socket for talking to `server` and an endpoint on it, the socket wrapped when asked.
fn bind(server: SocketAddr, wrapper: Option<&SocketWrapper>) -> anyhow::Result<quinn::Endpoint> {
    let socket = udp_socket(unspecified(server)?, SOCKET_BUFFER).context("binding the client socket")?;
    match wrapper {
        Some(wrap) => {
            let socket = (wrap.0)(socket).context("wrapping the client socket")?;
            quinn::Endpoint::new_with_abstract_socket(
                quinn::EndpointConfig::default(),
                None,
                socket,
                Arc::new(quinn::TokioRuntime),
            )
        }
        None => quinn::Endpoint::new(quinn::EndpointConfig::default(), None, socket, Arc::new(quinn::TokioRuntime)),
    }
    .context("starting the QUIC endpoint")
}

/// The device's client config: its timers and windows, the server it trusts, the certificate it
/// shows, the protocols it offers.
fn client_config(options: &ClientOptions) -> anyhow::Result<quinn::ClientConfig> {
    let mut transport = quinn::TransportConfig::default();
    transport
        .max_idle_timeout(Some(options.idle_timeout.try_into().context("idle timeout")?))
        .keep_alive_interval(Some(options.keep_alive))
        .send_window(16 << 20)
        .stream_receive_window(quinn::VarInt::from_u32(8 << 20))
        .receive_window(quinn::VarInt::from_u32(16 << 20));
    let mut crypto = client_crypto(&options.server_cert, options.client_cert.as_deref())?;
    if options.resume_broadcasts {
        crypto.alpn_protocols.insert(0, crate::broadcasts::RESUMABLE_BROADCASTS_ALPN.to_vec());
    }
    let mut config = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(crypto)?));
    config.transport_config(Arc::new(transport));
    Ok(config)
}
