//! The engine's task: one tokio task owns the sans-IO [`Engine`], feeds it what the connection
//! tasks report ([`Input`]), sleeps until its next timeout, and carries out its actions in order
//! (a `Persist` is committed to the store before anything queued after it).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::frame::encode_frame;
use anchorage_shared::priority::Priority;
use anchorage_shared::protocol::Message;
use anchorage_shared::tensor::ParamBlock;
use anyhow::Context;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::broadcasts::SharedBroadcast;
use super::flaps::{FLAP_LIMIT, FLAP_QUARANTINE, FLAP_WINDOW, FlapGuard, SecondHolder, conflict_refusal};
use super::transfers::KeptUploads;
use super::{Arrival, Input, Outbound, ServerEvent, ServerMetrics};
use crate::engine::{Action, ClientId, Engine, EngineConfig, Persist};
use crate::methods::ServerMethod;
use crate::metrics::{outcome, refusal_reason, unix_now};
use crate::store::ServerStore;

/// The engine a store resumes (the open round and its accepted updates included), and the
/// metrics that outlive a restart: the totals of its cost ledger, when each client was last
/// seen, when the last round closed. A new federation's initial version is stored first.
pub(super) fn recover(
    store: &ServerStore,
    config: &EngineConfig,
    method: Box<dyn ServerMethod>,
    initial: Vec<ParamBlock>,
) -> anyhow::Result<(Engine, Arc<ServerMetrics>)> {
    let engine = match store.recover(method.name())? {
        Some(recovered) => {
            tracing::info!(
                round = recovered.checkpoint.round,
                open = recovered.open.as_ref().map(|o| o.round),
                accepted = recovered.pending.len(),
                db = %store.db_path().display(),
                "resuming from the database"
            );
            Engine::recover(config.clone(), method, recovered)
        }
        None => {
            let engine = Engine::new(config.clone(), method, initial);
            store.save_initial(&engine.checkpoint())?;
            engine
        }
    };
    let metrics = Arc::new(ServerMetrics::new());
    store.load_ledger()?.iter().for_each(|r| metrics.record_cost(r));
    store.clients_last_seen()?.iter().for_each(|(client, at)| metrics.seen(client, *at));
    if let Some(at) = store.last_round_closed_at()? {
        metrics.set_last_round_closed_at(at);
    }
    Ok((engine, metrics))
}

/// Commits one engine state change on a blocking thread; an error stops the server, because
/// an ack or a broadcast must never run ahead of what the database holds.
async fn commit(store: &ServerStore, persist: Persist, metrics: &ServerMetrics) -> anyhow::Result<()> {
    let store = store.clone();
    let result = tokio::task::spawn_blocking(move || store.commit(&persist)).await.context("store task panicked")?;
    if let Err(e) = result {
        metrics.store_error();
        tracing::error!(error = %e, "could not commit to the database; stopping before anything is acknowledged");
        return Err(anyhow::Error::new(e).context("committing to the database"));
    }
    Ok(())
}

pub(super) async fn run_engine(
    mut shell: EngineShell,
    mut inputs: mpsc::UnboundedReceiver<Input>,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let mut departures_tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        // Carry out what the engine asked for first: recovery may already have closed a round.
        while let Some(action) = shell.engine.poll_action() {
            shell.act(action).await?;
        }
        shell.metrics.set_rollback_evidence(shell.engine.devices_ahead(), shell.engine.rollback_suspected().is_some());
        shell.metrics.set_engine_drops(shell.engine.stats().dropped_cost_records);
        let deadline = shell.engine.poll_timeout().map(|t| shell.start + t);
        tokio::select! {
            input = inputs.recv() => {
                let Some(input) = input else { break };
                shell.on_input(input);
            }
            _ = sleep_until(deadline) => shell.engine.handle_timeout(shell.start.elapsed()),
            _ = departures_tick.tick() => {
                let touched = touch_clients(&shell.store, std::mem::take(&mut shell.departed));
                shell.compact_after_departures(touched);
            }
            _ = shutdown.changed() => break,
        }
    }
    // The clients still connected were heard from until now.
    let at = unix_now();
    let mut departed = shell.departed;
    departed.extend(shell.conns.into_keys().map(|c| (c, at)));
    if let Some(done) = touch_clients(&shell.store, departed) {
        let _ = done.await;
    }
    Ok(())
}

/// Connections a server must have held before departures compact its per-device state.
const COMPACT_AFTER: usize = 1000;

/// The engine's task: the sans-IO engine and what its shell keeps around it (connections, the
/// store, the metrics, acks owed).
pub(super) struct EngineShell {
    engine: Engine,
    events: mpsc::UnboundedSender<ServerEvent>,
    store: Option<ServerStore>,
    metrics: Arc<ServerMetrics>,
    max_frame: usize,
    /// The engine's clock starts here.
    start: Instant,
    conns: HashMap<ClientId, (u64, mpsc::UnboundedSender<Outbound>)>,
    /// The certificate fingerprint of each connected client (stored with its last-seen row), kept
    /// while it is connected: a map of every device ever seen would grow for the server's life.
    fingerprints: HashMap<ClientId, String>,
    /// Departures' last-seen times, written on the tick in one transaction: a thousand devices
    /// leaving at once would otherwise queue a thousand blocking threads on the store's mutex
    /// (each thread's stack and arena held memory after they left).
    departed: Vec<(ClientId, i64)>,
    /// Accepted updates whose ack has not gone out yet: an ack for anything else re-acknowledges
    /// a duplicate.
    unacked: std::collections::HashSet<(ClientId, u64)>,
    /// Buffered mode opens no rounds: the sampled gauge follows its versions.
    opened_since_close: bool,
    /// Connections replaced by a newer one of their client, when a second live holder last
    /// evicted one, and ids refused for a while because two holders of one certificate kept
    /// evicting each other.
    flaps: FlapGuard,
    /// The most connections held since the per-device state was last compacted.
    most_connected: usize,
    /// Compactions owed to a fleet that is leaving: 2 while some of it is connected (one when
    /// the last has gone), 1 while the round it was invited to is open (one when it closes).
    compactions_owed: u8,
    /// Uploads left unfinished, let go when their round closes.
    uploads: Arc<KeptUploads>,
    /// A relay's devices' cost records, once in its own ledger, for its parent's.
    relay_costs: Option<mpsc::UnboundedSender<anchorage_shared::ledger::CostRecord>>,
}

impl EngineShell {
    pub(super) fn new(
        engine: Engine,
        events: mpsc::UnboundedSender<ServerEvent>,
        store: Option<ServerStore>,
        metrics: Arc<ServerMetrics>,
        max_frame: usize,
        uploads: Arc<KeptUploads>,
        relay_costs: Option<mpsc::UnboundedSender<anchorage_shared::ledger::CostRecord>>,
    ) -> Self {
        Self {
            relay_costs,
            engine,
            events,
            store,
            metrics,
            max_frame,
            start: Instant::now(),
            conns: HashMap::new(),
            fingerprints: HashMap::new(),
            departed: Vec::new(),
            unacked: std::collections::HashSet::new(),
            opened_since_close: false,
            flaps: FlapGuard::default(),
            most_connected: 0,
            compactions_owed: 0,
            uploads,
        }
    }

    /// After most of a large fleet has left (a quarter of the connections held at the most, of at
    /// least [`COMPACT_AFTER`]), copies the state kept per device into fresh allocations. The
    /// allocator keeps a page for each object that outlived its neighbours: the ids a thousand
    /// departed connections left in the engine's and the metrics' maps would each keep one of
    /// the pages their connections used. Measured with 10,000 invited silent devices
    /// (`ANCHORAGE_SILENT_FLEET=10000`, tests/tests/silent_fleet.rs): without this, 52 MB of
    /// pages held 21 MB of objects a minute after they left (RSS 75 MiB against 23 at start);
    /// with it, 23 MB held 19 MB (RSS 47 MiB). Once more when the last of the fleet has gone
    /// (the copies made while a quarter was connected sit among its connections' objects:
    /// measured, 8.6 MB of pages held beyond the live objects, RSS 45.9 MiB), and once more
    /// when the round it was invited to closes (measured: RSS 35.4 MiB once it had gone, 40.4
    /// after its round closed). `touched`: the departures' last-seen rows being written now.
    fn compact_after_departures(&mut self, touched: Option<JoinHandle<()>>) {
        self.most_connected = self.most_connected.max(self.conns.len());
        let quarter_left = self.most_connected >= COMPACT_AFTER && self.conns.len() * 4 <= self.most_connected;
        let round_open = self.engine.open_round().is_some();
        let gone = self.conns.is_empty() && (self.compactions_owed == 2 || (self.compactions_owed == 1 && !round_open));
        if !quarter_left && !gone {
            return;
        }
        tracing::debug!(held = self.most_connected, now = self.conns.len(), "compacting the per-device state");
        self.engine.compact();
        self.metrics.compact();
        self.conns.shrink_to_fit();
        self.fingerprints.shrink_to_fit();
        self.unacked.shrink_to_fit();
        self.departed.shrink_to_fit();
        self.most_connected = self.conns.len();
        self.compactions_owed = match (self.conns.is_empty(), round_open) {
            (false, _) => 2,
            (true, true) => 1,
            (true, false) => 0,
        };
        crate::metrics::request_allocator_flush();
        release_c_heap(self.store.clone(), touched);
    }

    /// Carries out one of the engine's actions (a state change is committed before its ack goes out).
    async fn act(&mut self, action: Action) -> anyhow::Result<()> {
        let metrics = &self.metrics;
        match action {
            Action::Send { to, msg } => {
                match &msg {
                    Message::Refusal(r) => metrics.refused(refusal_reason(r.reason)),
                    Message::Ack(ack) if !ack.aggregated => metrics.update(outcome::LATE),
                    // An ack of an update not accepted since the last one re-acknowledges a duplicate.
                    Message::Ack(ack) if !self.unacked.remove(&(to.clone(), ack.round)) => {
                        metrics.update(outcome::DUPLICATE)
                    }
                    _ => {}
                }
                send(&self.conns, &to, &msg, self.max_frame, Outbound::Control, metrics);
            }
            Action::Broadcast { to, msg } => match encode_frame(&msg, self.max_frame) {
                Ok(frame) => {
                    let (mut priority, mut round) = (Priority::Blocks, 0);
                    if let Message::Broadcast(b) = msg.as_ref() {
                        // A new round: what is kept of uploads for closed rounds goes.
                        metrics.transfers("dropped", self.uploads.drop_before(b.round) as u64);
                        (priority, round) = (Priority::of_broadcast(b), b.round);
                    }
                    let frame = Arc::new(SharedBroadcast::new(Arc::new(frame), round));
                    let mut sent = 0;
                    for client in to {
                        if let Some((_, out)) = self.conns.get(&client) {
                            sent += 1;
                            let _ = out.send(Outbound::Uni(frame.clone(), priority));
                        }
                    }
                    metrics.frames_out(frame.frame.len(), sent);
                }
                Err(e) => tracing::error!(error = %e, "broadcast does not fit in a frame; raise max_frame_bytes"),
            },
            Action::Close { client, refusal } => {
                metrics.refused(refusal_reason(refusal.reason));
                tracing::warn!(%client, reason = ?refusal.reason, detail = %refusal.detail, "closing client");
                if let Some((_, out)) = self.conns.remove(&client) {
                    let _ = out.send(Outbound::Close(refusal));
                }
            }
            Action::Persist(persist) => self.persist(persist).await?,
            Action::Ledger(record) => {
                let forward = self.relay_costs.as_ref().map(|to| (to, record.clone()));
                append_ledger(self.store.clone(), metrics, record).await;
                if let Some((to, record)) = forward {
                    let _ = to.send(record);
                }
            }
            Action::RoundClosed(report, checkpoint) => {
                metrics.round_closed(&report);
                if !std::mem::take(&mut self.opened_since_close) {
                    metrics.set_sampled(report.sampled);
                }
                let _ = self.events.send(ServerEvent::RoundClosed { report, checkpoint });
            }
            Action::Finished => {
                let _ = self.events.send(ServerEvent::Finished);
            }
        }
        Ok(())
    }

    /// Commits a state change to the store (the ack that depends on it goes out after).
    async fn persist(&mut self, mut persist: Persist) -> anyhow::Result<()> {
        if let Persist::Seen { client, fingerprint } = &mut persist {
            *fingerprint = self.fingerprints.get(client).cloned();
        }
        let counted = match &persist {
            Persist::Accepted(a) => Some((a.client.clone(), a.update.round)),
            Persist::Opened(opened) => {
                self.metrics.set_sampled(opened.sampled.len());
                self.opened_since_close = true;
                None
            }
            _ => None,
        };
        if let Some(store) = &self.store {
            commit(store, persist, &self.metrics).await?;
        }
        if let Some(key) = counted {
            self.metrics.update(outcome::ACCEPTED);
            self.unacked.insert(key);
        }
        Ok(())
    }

    /// What a connection task reports: a hello (a newer connection replaces an older one), a
    /// message, a closed connection.
    fn on_input(&mut self, input: Input) {
        let now = self.start.elapsed();
        match input {
            Input::Parent(broadcast) => self.engine.handle_parent_round(now, broadcast),
            Input::ParentGoodbye(reason) => self.engine.handle_parent_goodbye(&reason),
            Input::Refold { devices, reply } => {
                let _ = reply.send(self.engine.refold_without(&devices));
            }
            Input::ParentVerdict(verdict) => self.engine.handle_parent_verdict(verdict),
            Input::Hello(arrival) => self.on_hello(now, arrival),
            Input::Message { conn, client, msg } => {
                if self.flaps.is_set_aside(conn) {
                    self.on_second_holder(now, conn, &client);
                } else if self.conns.get(&client).is_some_and(|(c, _)| *c == conn) {
                    self.metrics.seen(&client, unix_now());
                    self.engine.handle_message(now, &client, msg)
                }
            }
            Input::Closed { conn, client } => {
                self.flaps.closed(conn);
                if self.conns.get(&client).is_some_and(|(c, _)| *c == conn) {
                    self.conns.remove(&client);
                    self.fingerprints.remove(&client);
                    self.metrics.set_connected(self.conns.len());
                    let at = unix_now();
                    self.metrics.seen(&client, at);
                    self.departed.push((client.clone(), at));
                    self.engine.handle_disconnect(now, &client);
                }
            }
        }
    }

    /// A hello: a client quarantined for a certificate conflict is refused; otherwise the
    /// connection becomes the client's, and an older one is set aside (see [`FlapGuard`]).
    fn on_hello(&mut self, now: Duration, arrival: Arrival) {
        let Arrival { conn, client, fingerprint, relay, msg, out } = arrival;
        if self.flaps.quarantined(&client, Instant::now()) {
            self.metrics.refused(crate::metrics::reason::CERTIFICATE_CONFLICT);
            let _ = out.send(Outbound::Close(conflict_refusal(&client)));
            return;
        }
        if let Some(f) = fingerprint {
            self.fingerprints.insert(client.clone(), f);
        }
        if let Some((old, old_out)) = self.conns.insert(client.clone(), (conn, out)) {
            tracing::info!(%client, old, conn, "client reconnected; its older connection is set aside until it closes");
            self.flaps.set_aside(old, &client, old_out);
        }
        self.metrics.set_connected(self.conns.len());
        self.metrics.seen(&client, unix_now());
        self.engine.set_relay(&client, relay);
        self.engine.handle_message(now, &client, msg);
    }

    /// A set-aside connection of `client` sent again: a second live holder of its certificate.
    /// Its connection is closed; the replacement that makes it a conflict refuses both.
    fn on_second_holder(&mut self, now: Duration, conn: u64, client: &str) {
        let Some(SecondHolder::Conflict) = self.flaps.heard(conn, Instant::now()) else {
            tracing::warn!(client, conn, "an older connection of this client still sends; closed");
            return;
        };
        tracing::error!(
            %client,
            replacements = FLAP_LIMIT,
            window_s = FLAP_WINDOW.as_secs(),
            refused_s = FLAP_QUARANTINE.as_secs(),
            "SECURITY: two live connections keep presenting the certificate of `{client}`: both are refused. \
             The certificate is in two devices' hands: revoke it (`anchorage ca revoke {client}`) and issue the \
             real device a new one"
        );
        self.metrics.certificate_conflict();
        if let Some((_, current)) = self.conns.remove(client) {
            let _ = current.send(Outbound::Close(conflict_refusal(client)));
        }
        self.metrics.set_connected(self.conns.len());
        self.engine.handle_disconnect(now, client);
    }
}

/// Appends a cost record to the ledger; only records new to it count in the metrics (a resent
/// report is not counted twice).
async fn append_ledger(
    store: Option<ServerStore>,
    metrics: &ServerMetrics,
    record: anchorage_shared::ledger::CostRecord,
) {
    let Some(store) = store else {
        metrics.record_cost(&record);
        return;
    };
    match tokio::task::spawn_blocking(move || store.append_ledger(&[record])).await {
        Ok(Ok(new)) => new.iter().for_each(|r| metrics.record_cost(r)),
        Ok(Err(e)) => {
            metrics.store_error();
            tracing::error!(error = %e, "could not append to the cost ledger");
        }
        Err(e) => tracing::error!(error = %e, "ledger task failed"),
    }
}

/// Records in the client registry when clients were last heard from (on a blocking thread; a
/// failure is logged and counted, never fatal: it only makes a last-seen time older).
fn touch_clients(store: &Option<ServerStore>, seen: Vec<(ClientId, i64)>) -> Option<JoinHandle<()>> {
    let store = store.clone()?;
    if seen.is_empty() {
        return None;
    }
    Some(tokio::task::spawn_blocking(move || {
        if let Err(e) = store.touch_clients(&seen) {
            tracing::warn!(error = %e, clients = seen.len(), "could not record when clients were last seen");
        }
    }))
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

fn send(
    conns: &HashMap<ClientId, (u64, mpsc::UnboundedSender<Outbound>)>,
    to: &str,
    msg: &Message,
    max_frame: usize,
    wrap: fn(Arc<Vec<u8>>) -> Outbound,
    metrics: &ServerMetrics,
) {
    let Some((_, out)) = conns.get(to) else { return };
    match encode_frame(msg, max_frame) {
        Ok(frame) => {
            metrics.frames_out(frame.len(), 1);
            let _ = out.send(wrap(Arc::new(frame)));
        }
        Err(e) => tracing::error!(error = %e, to, "message does not fit in a frame"),
    }
}

/// Hands SQLite's page cache and the C library's free memory back to the system, once the
/// departures' last-seen rows (`touched`) are written. SQLite (bundled) allocates with the C
/// library's malloc, not the program's allocator, and glibc keeps what a busy spell freed.
/// Measured with 10,000 invited silent devices, a minute after they left: the C heap held
/// 3.9 MB (2.4 MB in use) against 2.0 MB at start; SQLite's page cache held 1.2 MB of it.
fn release_c_heap(store: Option<ServerStore>, touched: Option<JoinHandle<()>>) {
    tokio::spawn(async move {
        if let Some(touched) = touched {
            let _ = touched.await;
        }
        let _ = tokio::task::spawn_blocking(move || {
            if let Some(store) = store {
                store.release_memory();
            }
            trim_c_heap();
        })
        .await;
    });
}

fn trim_c_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own arenas; it takes no pointer from us.
    unsafe {
        libc::malloc_trim(0);
    }
}
