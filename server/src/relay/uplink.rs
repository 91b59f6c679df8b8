//! A relay's link to its parent (issue 37): a QUIC client that shows the relay's certificate
//! (the relay role) and speaks the device protocol upward: its hello, the parent's broadcasts
//! in (each handed to the relay's engine), one partial aggregate per round out on its own
//! stream, sent again after every reconnect until the parent acks it, and its devices' cost
//! records in one batch per round, kept until the parent confirms the round.
//!
//! One task owns the state ([`Uplink::run`]); per connection, a reader task turns the control
//! stream's frames and the broadcasts' streams into [`Inbound`]s, so that no read is ever cut
//! in half by the loop's `select!`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anchorage_pki::Identity;
use anchorage_shared::frame::encode_frame;
use anchorage_shared::io::{read_frame, write_frame};
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::{Broadcast, CostBatch, Message, Partial, RefusalReason};
use anyhow::Context;
use quinn::crypto::rustls::QuicClientConfig;
use rustls::pki_types::CertificateDer;
use tokio::sync::{mpsc, watch};

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
    /// The relay's engine, to fold a round again without devices its parent counted elsewhere.
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

/// What a connection's reader task reports.
enum Inbound {
    Control(Message),
    Broadcast(Broadcast),
    Closed(String),
}

/// What waits for the parent's confirmation.
#[derive(Default)]
struct Owed {
    partial: Option<Partial>,
    /// Cost records by round, until the parent's cost ack of the round.
    costs: BTreeMap<u64, Vec<CostRecord>>,
    /// Rounds whose records changed since their batch last went up (all of them after a reconnect).
    fresh: std::collections::BTreeSet<u64>,
    /// The last acked partial's round and devices: whose cost records the last batch waits for.
    last_members: (u64, Vec<String>),
}

impl Owed {
    fn cost(&mut self, record: CostRecord) {
        self.fresh.insert(record.round);
        self.costs.entry(record.round).or_default().push(record);
    }

    /// Whether every device of the last acked partial has its cost record of that round here.
    fn last_round_costed(&self) -> bool {
        let (round, members) = &self.last_members;
        let records = self.costs.get(round).map_or(&[][..], Vec::as_slice);
        members.iter().all(|m| records.iter().any(|r| &r.client == m))
    }
}

/// Delay before the first reconnect, doubled up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// How often cost batches with new records go up.
const COST_EVERY: Duration = Duration::from_millis(250);
/// After the parent's goodbye, how long the last round's cost records may take to arrive (the
/// root stays a second after its goodbye).
const LAST_COSTS: Duration = Duration::from_millis(600);
/// After the parent's goodbye, how long the parent may take to confirm the last batches.
const LAST_CONFIRMATIONS: Duration = Duration::from_secs(3);

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
        let mut owed = Owed::default();
        let mut backoff = FIRST_BACKOFF;
        loop {
            if *ch.stop.borrow() {
                return Ok(Ended::Stopped);
            }
            match self.session(&endpoint, &mut ch, &mut owed).await {
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

    /// One connection: hello, welcome, then broadcasts down and partials and cost batches up
    /// until it closes (`Ok(None)`: reconnect) or the federation ends.
    async fn session(
        &self,
        endpoint: &quinn::Endpoint,
        ch: &mut Channels,
        owed: &mut Owed,
    ) -> anyhow::Result<Option<Ended>> {
        let conn = endpoint.connect(self.parent, &self.server_name)?.await.context("connecting to the parent")?;
        let (mut control, recv) = conn.open_bi().await?;
        self.send(&mut control, &super::hello(&self.relay_id, &self.method, self.last_round)).await?;
        let (tx, mut inbound) = mpsc::unbounded_channel();
        let reader = tokio::spawn(read_control(recv, tx.clone(), self.max_frame));
        let broadcasts = tokio::spawn(read_broadcasts(conn.clone(), tx, self.max_frame));
        let result = self.serve(&conn, &mut control, &mut inbound, ch, owed).await;
        self.metrics.set_relay_parent_connected(false);
        reader.abort();
        broadcasts.abort();
        conn.close(0u32.into(), b"relay uplink closing");
        result
    }

    async fn serve(
        &self,
        conn: &quinn::Connection,
        control: &mut quinn::SendStream,
        inbound: &mut mpsc::UnboundedReceiver<Inbound>,
        ch: &mut Channels,
        owed: &mut Owed,
    ) -> anyhow::Result<Option<Ended>> {
        match inbound.recv().await {
            Some(Inbound::Control(Message::Welcome(w))) => {
                tracing::info!(parent = %w.server_id, "uplink joined");
                self.metrics.set_relay_parent_connected(true);
            }
            Some(Inbound::Control(Message::Refusal(r))) => {
                anyhow::bail!(Definite(format!("{:?}: {}", r.reason, r.detail)))
            }
            Some(Inbound::Closed(why)) => anyhow::bail!("the parent closed before its welcome: {why}"),
            _ => anyhow::bail!("the parent answered the hello with something else"),
        }
        if let Some(p) = &owed.partial {
            self.send_partial(conn, p).await?;
        }
        owed.fresh = owed.costs.keys().copied().collect();
        let mut tick = tokio::time::interval(COST_EVERY);
        loop {
            tokio::select! {
                msg = inbound.recv() => match msg {
                    Some(Inbound::Broadcast(b)) => { let _ = ch.rounds.send(b); }
                    Some(Inbound::Control(Message::Refusal(r))) if r.reason == RefusalReason::Duplicate && owed.partial.is_some() => {
                        self.refold(conn, &r.detail, owed).await?;
                    }
                    Some(Inbound::Control(msg)) => if let Some(ended) = self.on_control(msg, owed) {
                        // The last round's cost records are on their way: send what comes shortly.
                        self.last_costs(control, inbound, ch, owed).await;
                        return Ok(Some(ended));
                    },
                    Some(Inbound::Closed(why)) => { tracing::info!(%why, "the parent's connection closed"); return Ok(None) }
                    None => return Ok(None),
                },
                p = ch.partials.recv() => {
                    let Some(p) = p else { return Ok(Some(Ended::Stopped)) };
                    tracing::info!(round = p.update.round, devices = p.members.len(), samples = p.update.num_samples, "partial aggregate up");
                    owed.partial = Some(p);
                    if let Some(p) = &owed.partial { self.send_partial(conn, p).await?; }
                }
                c = ch.costs.recv() => if let Some(c) = c { owed.cost(c) },
                _ = tick.tick() => self.send_costs(control, owed).await?,
                _ = ch.stop.changed() => return Ok(Some(Ended::Stopped)),
            }
        }
    }

    /// A control message from the parent; `Some` when it ends the link.
    fn on_control(&self, msg: Message, owed: &mut Owed) -> Option<Ended> {
        match msg {
            Message::Ack(ack) => {
                if let Some(p) = owed.partial.take_if(|p| p.update.round == ack.round) {
                    self.metrics.relay_partial("acked");
                    tracing::info!(
                        round = ack.round,
                        aggregated = ack.aggregated,
                        "the parent acked the partial aggregate"
                    );
                    owed.last_members = (ack.round, p.members.into_iter().map(|m| m.device).collect());
                }
            }
            Message::CostAck(ack) => {
                owed.costs.remove(&ack.round);
            }
            Message::Refusal(r) => {
                tracing::warn!(reason = ?r.reason, detail = %r.detail, "the parent refused");
                // A partial it will never take (not sampled, a duplicate, malformed) is not sent again.
                if matches!(r.reason, RefusalReason::NotSampled | RefusalReason::Duplicate | RefusalReason::Malformed)
                    && owed.partial.take().is_some()
                {
                    self.metrics.relay_partial("refused");
                }
            }
            Message::Goodbye(g) => return Some(Ended::Finished(g.reason)),
            _ => {}
        }
        None
    }

    /// The parent counted some of the owed partial's devices through another relay (they failed
    /// over): the round goes up again without them, or, where the relay cannot fold it again
    /// (a restart lost the round's updates), not at all. Nothing is counted twice either way.
    async fn refold(&self, conn: &quinn::Connection, detail: &str, owed: &mut Owed) -> anyhow::Result<()> {
        let devices = super::duplicate_devices(detail).unwrap_or_default();
        let again = match (&self.control, devices.is_empty()) {
            (Some(control), false) => control.refold_without(devices.clone()).await,
            _ => None,
        };
        self.metrics.relay_partial("refused");
        match again {
            Some(p) => {
                tracing::warn!(
                    round = p.update.round,
                    ?devices,
                    "the parent counted these devices through another relay; sending the round without them"
                );
                owed.partial = Some(p);
                if let Some(p) = &owed.partial {
                    self.send_partial(conn, p).await?;
                }
            }
            None => {
                tracing::warn!(
                    ?devices,
                    "the parent counted devices of this partial elsewhere, and it cannot be folded again: dropped"
                );
                owed.partial = None;
            }
        }
        Ok(())
    }

    /// After the parent's goodbye: the cost records that arrive shortly go up, and the link
    /// stays until the parent confirms every owed round (bounded), so that closing does not
    /// throw the last batches away.
    async fn last_costs(
        &self,
        control: &mut quinn::SendStream,
        inbound: &mut mpsc::UnboundedReceiver<Inbound>,
        ch: &mut Channels,
        owed: &mut Owed,
    ) {
        let arrived = async {
            while !owed.last_round_costed() {
                match ch.costs.recv().await {
                    Some(c) => owed.cost(c),
                    None => return,
                }
            }
        };
        let _ = tokio::time::timeout(LAST_COSTS, arrived).await;
        if let Err(e) = self.send_costs(control, owed).await {
            tracing::warn!(error = %e, "the last cost records could not go up");
            return;
        }
        let confirmed = async {
            while !owed.costs.is_empty() {
                match inbound.recv().await {
                    Some(Inbound::Control(Message::CostAck(ack))) => drop(owed.costs.remove(&ack.round)),
                    Some(Inbound::Control(_)) => {}
                    _ => return,
                }
            }
        };
        if tokio::time::timeout(LAST_CONFIRMATIONS, confirmed).await.is_err() {
            tracing::warn!(rounds = ?owed.costs.keys().collect::<Vec<_>>(), "the parent did not confirm the last cost records");
        }
    }

    /// The owed cost records of each round that has new ones, one batch a round (the parent's
    /// ledger ignores a row it holds, so a batch may go up again whole).
    async fn send_costs(&self, control: &mut quinn::SendStream, owed: &mut Owed) -> anyhow::Result<()> {
        for round in std::mem::take(&mut owed.fresh) {
            if let Some(records) = owed.costs.get(&round) {
                self.send(control, &Message::CostBatch(CostBatch { records: records.clone() })).await?;
            }
        }
        Ok(())
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
        self.metrics.relay_partial("sent");
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
