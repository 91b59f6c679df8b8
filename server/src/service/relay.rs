//! The server program as a relay: `server.toml` with a `[parent]` table, or the
//! `anchorage-relay` program. The engine runs in the relay role ([`crate::engine::Role::Relay`]); the
//! uplink ([`crate::relay::uplink`]) brings the parent's rounds in and takes each round's
//! partial aggregate, and the devices' cost records, up.

use std::net::{SocketAddr, ToSocketAddrs};

use anchorage_shared::method::MethodConfig;
use anchorage_shared::protocol::{Broadcast, Partial};
use anyhow::Context;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::config::{ParentSection, ServerConfig};
use crate::engine::Checkpoint;
use crate::relay::uplink::{Channels, Ended, Uplink};
use crate::relay::{check, partial_of};
use crate::tls::Trust;
use crate::transport::ServerHandle;

/// Refuses a relay that cannot carry `method` (a partial aggregate cannot stand in for its
/// devices' updates) or that would not check its parent's certificate.
pub(super) fn check_relay(config: &ServerConfig, method: &MethodConfig) -> anyhow::Result<()> {
    check(&config.engine, method)
        .map_err(|why| anyhow::anyhow!("this relay cannot carry `{}`: {why}", method.name()))?;
    anyhow::ensure!(
        !config.insecure_dev,
        "a relay checks its parent's certificate against the project CA: [parent] needs the project's certificates, \
         not insecure_dev"
    );
    Ok(())
}

/// A running uplink, as the serving loop sees it.
pub(super) struct RelayLink {
    partials: mpsc::UnboundedSender<Partial>,
    rounds: mpsc::UnboundedReceiver<Broadcast>,
    task: JoinHandle<anyhow::Result<Ended>>,
    _stop: watch::Sender<bool>,
}

/// What the relay link reports to the serving loop.
pub(super) enum ParentEvent {
    Round(Broadcast),
    Ended(anyhow::Result<Ended>),
}

impl RelayLink {
    /// Starts the uplink for the relay `server`; the partial aggregate its store holds for its
    /// last round goes up first (the parent acks a copy it has, counts a late one).
    pub(super) fn start(
        config: &ServerConfig,
        parent: &ParentSection,
        server: &mut ServerHandle,
        trust: &Trust,
    ) -> anyhow::Result<Self> {
        let (identity, _) = super::identity_and_trust(config)?;
        let Trust::ProjectCa { ca, .. } = trust else { anyhow::bail!("a relay needs the project CA") };
        let relay_id = anchorage_pki::peer_id(&identity.cert)?.0;
        anyhow::ensure!(
            anchorage_pki::cert::is_relay(identity.cert.as_ref()),
            "{}'s certificate `{relay_id}` has no relay role: issue it with `anchorage ca issue relay {relay_id}`",
            config.tls_dir.display()
        );
        let address = resolve(&parent.address)?;
        let (partials, partials_rx) = mpsc::unbounded_channel();
        let (rounds_tx, rounds) = mpsc::unbounded_channel();
        let (stop, stop_rx) = watch::channel(false);
        let start = server.relay.take().context("the server was not started as a relay")?;
        if let Some(p) = start.partial {
            let _ = partials.send(p);
        }
        let uplink = Uplink {
            parent: address,
            server_name: parent.server_name.clone(),
            identity,
            ca: ca.clone(),
            relay_id,
            method: config.method.config()?.name().into(),
            last_round: Some(start.last_round).filter(|r| *r > 0),
            max_frame: config.engine.max_frame_bytes as usize,
            metrics: server.metrics.clone(),
            control: Some(server.relay_control()),
        };
        tracing::info!(parent = %address, "relay: joining the parent");
        let channels = Channels { partials: partials_rx, costs: start.costs, rounds: rounds_tx, stop: stop_rx };
        Ok(Self { partials, rounds, task: tokio::spawn(uplink.run(channels)), _stop: stop })
    }

    /// A closed round's partial aggregate goes up (a failed round has none).
    pub(super) fn round_closed(&self, checkpoint: &Checkpoint) {
        if let Some(p) = partial_of(checkpoint) {
            let _ = self.partials.send(p);
        }
    }

    /// The next thing the parent said; pending forever without a link.
    pub(super) async fn next(link: &mut Option<Self>) -> ParentEvent {
        let Some(link) = link.as_mut() else { return std::future::pending().await };
        tokio::select! {
            Some(b) = link.rounds.recv() => ParentEvent::Round(b),
            ended = &mut link.task => ParentEvent::Ended(ended.unwrap_or_else(|e| Err(anyhow::anyhow!("uplink task: {e}")))),
        }
    }
}

fn resolve(address: &str) -> anyhow::Result<SocketAddr> {
    address
        .to_socket_addrs()
        .with_context(|| format!("[parent] address `{address}`"))?
        .next()
        .with_context(|| format!("[parent] address `{address}` resolves to nothing"))
}
