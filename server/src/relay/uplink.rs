//! A relay's link to its parent over QUIC: the shell of the [`UplinkSession`], which holds the
//! protocol (hello, partials owed until acked, refolds, cost batches until confirmed). The shell
//! shows the relay's certificate (the relay role), carries the session's frames, hands the
//! parent's broadcasts to the relay's engine and asks the engine for refolds.
//!
//! One task owns the session ([`Uplink::run`]); per connection, a reader task turns the control
//! stream's frames and the broadcasts' streams into [`Inbound`]s, so that no read is ever cut
//! in half by the loop's `select!`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anchorage_pki::Identity;
use anchorage_shared::frame::encode_frame;
use anchorage_shared::io::{read_frame, write_frame};
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::{Broadcast, Message, Partial};
use anyhow::Context;
use quinn::crypto::rustls::QuicClientConfig;
use rustls::pki_types::CertificateDer;
use tokio::sync::{mpsc, watch};

use super::session::{UplinkAction, UplinkSession};

/// Where a relay's parent is and how the relay reaches it.
pub struct Uplink {
    /// The parent's QUIC address.
    pub parent: SocketAddr,
    /// The name the parent's certificate is issued for.
    pub server_name: String,
    /// The relay's certificate (with the relay role) and key.
    pub identity: Identity,
    /// The project CA (the parent's certificate is checked against it).
    pub ca: CertificateDer<'static>,
    /// The relay's id, as its certificate names it.
    pub relay_id: String,
    /// The method the federation runs.
    pub method: String,
    /// The last round this relay closed (its witness in the hello).
    pub last_round: Option<u64>,
    /// Largest frame sent or read.
    pub max_frame: usize,
    /// The relay's metrics (its partials, its link to the parent).
    pub metrics: Arc<crate::metrics::ServerMetrics>,
    /// The relay's engine, to fold a round again without devices its parent counted elsewhere,
    /// and to ack its devices as the parent acked their partial.
    pub control: Option<crate::transport::RelayControl>,
}

/// What the relay's owner hands the uplink, and what it gets back.
pub struct Channels {
    /// Partial aggregates to send (each closed round's, and a restarted relay's last one).
    pub partials: mpsc::UnboundedReceiver<Partial>,
    /// The devices' cost records, once the relay's ledger holds them.
    pub costs: mpsc::UnboundedReceiver<CostRecord>,
    /// The parent's broadcasts, for the relay's engine.
    pub rounds: mpsc::UnboundedSender<Broadcast>,
    /// Set to stop.
    pub stop: watch::Receiver<bool>,
}

/// How the link ended.
#[derive(Debug, PartialEq)]
pub enum Ended {
    /// The parent said goodbye (the federation is over).
    Finished(String),
    /// The owner stopped it.
    Stopped,
}

/// One connection's streams, as the shell holds them.
struct Link<'a> {
    conn: &'a quinn::Connection,
    control: &'a mut quinn::SendStream,
    inbound: &'a mut mpsc::UnboundedReceiver<Inbound>,
}

/// What a connection's reader task reports.
enum Inbound {
    Control(Message),
    Broadcast(Broadcast),
    Closed(String),
}

/// Delay before the first reconnect, doubled up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

impl Uplink {
    /// Keeps the relay connected to its parent until the parent says goodbye or `stop` is set;
    /// refused for good (an unknown certificate, another method) it returns the error.
    pub async fn run(self, mut ch: Channels) -> anyhow::Result<Ended> {
        let mut endpoint = quinn::Endpoint::client((std::net::Ipv6Addr::UNSPECIFIED, 0).into())
            .or_else(|_| quinn::Endpoint::client((std::net::Ipv4Addr::UNSPECIFIED, 0).into()))
            .context("a UDP socket for the uplink")?;
        let chain = [self.identity.cert.clone()];
        let crypto =
            anchorage_pki::tls::client_config(&self.ca, Some((&chain, &self.identity.key)), &[crate::tls::ALPN])?;
        let mut client = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(crypto)?));
        let mut transport = quinn::TransportConfig::default();
        transport.keep_alive_interval(Some(Duration::from_secs(5)));
        client.transport_config(Arc::new(transport));
        endpoint.set_default_client_config(client);
        let mut session = UplinkSession::new(super::hello(&self.relay_id, &self.method, self.last_round), None);
        let start = Instant::now();
        let mut backoff = FIRST_BACKOFF;
        loop {
            if *ch.stop.borrow() {
                return Ok(Ended::Stopped);
            }
            match self.connection(&endpoint, &mut ch, &mut session, start).await {
                Ok(Some(ended)) => {
                    endpoint.close(0u32.into(), b"relay done");
                    return Ok(ended);
                }
                Ok(None) => backoff = FIRST_BACKOFF,
                Err(e) if is_definite(&e) => return Err(e),
                Err(e) => tracing::warn!(parent = %self.parent, error = %format!("{e:#}"), "uplink lost; reconnecting"),
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = ch.stop.changed() => return Ok(Ended::Stopped),
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// One connection: the session's hello, then the parent's messages in and what the
    /// session asks for out, until the connection closes (`Ok(None)`: reconnect) or the link ends.
    async fn connection(
        &self,
        endpoint: &quinn::Endpoint,
        ch: &mut Channels,
        session: &mut UplinkSession,
        start: Instant,
    ) -> anyhow::Result<Option<Ended>> {
        let conn = endpoint.connect(self.parent, &self.server_name)?.await.context("connecting to the parent")?;
        let (mut control, recv) = conn.open_bi().await?;
        let (tx, mut inbound) = mpsc::unbounded_channel();
        let reader = tokio::spawn(read_control(recv, tx.clone(), self.max_frame));
        let broadcasts = tokio::spawn(read_broadcasts(conn.clone(), tx, self.max_frame));
        session.connected(start.elapsed());
        let mut link = Link { conn: &conn, control: &mut control, inbound: &mut inbound };
        let result = self.serve(&mut link, ch, session, start).await;
        session.disconnected(start.elapsed());
        let ended = match result {
            Ok(None) => self.carry_out(&mut link, ch, session).await,
            other => other,
        };
        self.metrics.set_relay_parent_connected(false);
        reader.abort();
        broadcasts.abort();
        conn.close(0u32.into(), b"relay uplink closing");
        ended
    }

    /// Feeds the session until the connection closes or the session ends the link.
    async fn serve(
        &self,
        link: &mut Link<'_>,
        ch: &mut Channels,
        session: &mut UplinkSession,
        start: Instant,
    ) -> anyhow::Result<Option<Ended>> {
        loop {
            if let Some(ended) = self.carry_out(link, ch, session).await? {
                return Ok(Some(ended));
            }
            let wake = session.poll_timeout().map(|t| start + t);
            tokio::select! {
                msg = link.inbound.recv() => match msg {
                    Some(Inbound::Control(msg)) => session.handle_message(start.elapsed(), msg),
                    Some(Inbound::Broadcast(b)) => session.handle_message(start.elapsed(), Message::Broadcast(b)),
                    Some(Inbound::Closed(why)) => { tracing::info!(%why, "the parent's connection closed"); return Ok(None) }
                    None => return Ok(None),
                },
                p = ch.partials.recv() => match p {
                    Some(p) => session.partial_closed(p),
                    None => return Ok(Some(Ended::Stopped)),
                },
                c = ch.costs.recv() => if let Some(c) = c { session.cost(start.elapsed(), c) },
                _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now).into()), if wake.is_some() => {
                    session.handle_timeout(start.elapsed());
                }
                _ = ch.stop.changed() => return Ok(Some(Ended::Stopped)),
            }
        }
    }

    /// Carries out what the session asks, in order.
    async fn carry_out(
        &self,
        link: &mut Link<'_>,
        ch: &mut Channels,
        session: &mut UplinkSession,
    ) -> anyhow::Result<Option<Ended>> {
        while let Some(action) = session.poll_action() {
            match action {
                UplinkAction::Joined => self.metrics.set_relay_parent_connected(true),
                UplinkAction::Send(msg) => self.send(link.control, &msg).await?,
                UplinkAction::SendPartial(p) => self.send_partial(link.conn, &p).await?,
                UplinkAction::OpenRound(b) => drop(ch.rounds.send(b)),
                UplinkAction::Refold(devices) => {
                    let again = match &self.control {
                        Some(control) => control.refold_without(devices).await,
                        None => None,
                    };
                    session.refolded(again);
                }
                UplinkAction::Verdict(verdict) => {
                    if let Some(control) = &self.control {
                        control.verdict(verdict);
                    }
                }
                UplinkAction::Counted(outcome) => self.metrics.relay_partial(outcome),
                UplinkAction::Finished(reason) => return Ok(Some(Ended::Finished(reason))),
                UplinkAction::Refused(why) => anyhow::bail!(Definite(why)),
            }
        }
        Ok(None)
    }

    async fn send(&self, stream: &mut quinn::SendStream, msg: &Message) -> anyhow::Result<()> {
        let frame = encode_frame(msg, self.max_frame)?;
        write_frame(stream, &frame).await?;
        Ok(())
    }

    /// A partial aggregate on its own stream, written whole.
    async fn send_partial(&self, conn: &quinn::Connection, partial: &Partial) -> anyhow::Result<()> {
        let mut stream = conn.open_uni().await?;
        self.send(&mut stream, &Message::Partial(partial.clone())).await?;
        stream.finish()?;
        Ok(())
    }
}

/// A refusal that retrying cannot change.
#[derive(Debug)]
struct Definite(String);

impl std::fmt::Display for Definite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the parent refused this relay: {}", self.0)
    }
}

impl std::error::Error for Definite {}

fn is_definite(e: &anyhow::Error) -> bool {
    e.downcast_ref::<Definite>().is_some()
}

/// The control stream's frames, in order.
async fn read_control(mut recv: quinn::RecvStream, tx: mpsc::UnboundedSender<Inbound>, max_frame: usize) {
    loop {
        match read_frame(&mut recv, max_frame).await {
            Ok(Some((msg, _))) => {
                if tx.send(Inbound::Control(msg)).is_err() {
                    return;
                }
            }
            Ok(None) => return drop(tx.send(Inbound::Closed("the control stream ended".into()))),
            Err(e) => return drop(tx.send(Inbound::Closed(e.to_string()))),
        }
    }
}

/// Each broadcast on its own stream.
async fn read_broadcasts(conn: quinn::Connection, tx: mpsc::UnboundedSender<Inbound>, max_frame: usize) {
    while let Ok(mut recv) = conn.accept_uni().await {
        match read_frame(&mut recv, max_frame).await {
            Ok(Some((Message::Broadcast(b), _))) => {
                if tx.send(Inbound::Broadcast(b)).is_err() {
                    return;
                }
            }
            Ok(Some((other, _))) => tracing::warn!(kind = other.kind_name(), "the parent sent an unexpected stream"),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "a broadcast from the parent broke off"),
        }
    }
    let _ = tx.send(Inbound::Closed(conn.close_reason().map_or_else(|| "closed".into(), |r| r.to_string())));
}
