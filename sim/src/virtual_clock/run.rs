//! One run on the virtual clock: the engines, the fleet, the queue, and what it has recorded.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anchorage_server::engine::{Action, Engine, EngineConfig};
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::Message;
use anchorage_shared::transfer::CHUNK_BYTES;

use super::client::{VirtualClient, drive_client, schedule_departure, send_down, virtual_clients};
use super::events::{Event, Queue};
use super::live::LiveRows;
use super::quic::{FAILOVER_DELAY, frame_len};
use super::tier;
use super::trainer::Trainer;
use super::watch::{Seen, Watch};
use crate::config::SimConfig;
use crate::device::{Charge, DeviceProfile};
use crate::record::{RoundRow, RunSummary, SimResult, SummaryInputs, initial_of};
use crate::recorder::Recorder;
use crate::setup::{Evaluator, Setup, client_id};

/// One run on the virtual clock: the engine, the fleet, the event queue and what the run has
/// recorded so far. [`VirtualRun::step`] handles one event and the engine's actions after it.
pub(super) struct VirtualRun {
    /// The server's engine: the root of a tier when `tier` is set.
    pub(super) engine: Engine,
    /// `[relays]`: the relays between the clients and the root.
    pub(super) tier: Option<tier::Tier>,
    pub(super) schedule: EngineConfig,
    pub(super) evaluator: Evaluator,
    pub(super) devices: Vec<Arc<DeviceProfile>>,
    pub(super) clients: Vec<VirtualClient>,
    pub(super) index: HashMap<String, usize>,
    pub(super) queue: Queue,
    pub(super) trainer: Trainer,
    pub(super) now: Duration,
    pub(super) initial_accuracy: f64,
    pub(super) chance: f64,
    pub(super) live: LiveRows,
    pub(super) rows: Vec<RoundRow>,
    pub(super) reports: Vec<anchorage_server::RoundReport>,
    pub(super) ledger: Vec<CostRecord>,
    /// Cost records the clients' sessions completed, to file in the ledger.
    pub(super) completed: Vec<(usize, CostRecord)>,
    pub(super) accuracy_rows: Vec<crate::accuracy::AccuracyRow>,
    pub(super) stopping: bool,
    pub(super) finished: bool,
    /// `stop_after_hours` on the simulated clock.
    pub(super) horizon: Option<Duration>,
    /// A watcher's view (`anchorage swarm`); none: the run records nothing for one.
    pub(super) watch: Option<Watch>,
    /// The partial each relay last delivered to the root: (round, members), for the watcher.
    pub(super) last_partial: HashMap<usize, (u64, Vec<String>)>,
}

impl VirtualRun {
    /// The setup of `config` on the virtual clock, its initial evaluation told to `recorder`.
    pub(super) fn new(config: &SimConfig, recorder: &mut Recorder) -> anyhow::Result<Self> {
        let Setup {
            engine: engine_config,
            initial,
            clients,
            devices,
            evaluator,
            num_classes,
            headline,
            server_method,
            ..
        } = Setup::new(config, Charge::Report)?;
        let schedule = engine_config.clone();
        let (mut tier, engine_config) = match &config.systems.relays {
            Some(t) => {
                let (tier, root) =
                    tier::Tier::new(t, clients.len(), &engine_config, &config.method, config.federation.seed)?;
                (Some(tier), root)
            }
            None => (None, engine_config),
        };
        let mut engine = Engine::new(engine_config, server_method, initial.clone());
        if let Some(tier) = tier.as_mut() {
            tier.join(&mut engine);
        }
        let clients = virtual_clients(config, clients, &devices)?;
        let index: HashMap<String, usize> = (0..clients.len()).map(|i| (client_id(i), i)).collect();

        let initial_global = evaluator.evaluate(&initial, &[], 0)?;
        let initial_accuracy = initial_of(&initial_global);
        let chance = 1.0 / num_classes as f64;
        recorder.start(
            &format!("{headline}, virtual clock"),
            (!initial_global.is_empty()).then_some(initial_accuracy),
            chance,
            config.federation.rounds,
        )?;
        Ok(Self {
            engine,
            tier,
            schedule,
            evaluator,
            devices,
            clients,
            index,
            queue: Queue::default(),
            trainer: Trainer::new(config.systems.training_threads())?,
            now: Duration::ZERO,
            initial_accuracy,
            chance,
            live: LiveRows::default(),
            rows: Vec::new(),
            reports: Vec::new(),
            ledger: Vec::new(),
            completed: Vec::new(),
            accuracy_rows: Vec::new(),
            stopping: false,
            horizon: config
                .systems
                .stop_after_hours
                .filter(|h| h.is_finite() && *h > 0.0)
                .map(|h| Duration::from_secs_f64(h * 3600.0)),
            finished: false,
            watch: None,
            last_partial: HashMap::new(),
        })
    }

    /// Tells the watcher, if there is one.
    pub(super) fn see(&mut self, seen: impl FnOnce() -> Seen) {
        if let Some(watch) = self.watch.as_mut() {
            watch.seen.push(seen());
        }
    }

    /// Brings every device online (or schedules it for its first window) and lets it speak.
    pub(super) fn start(&mut self) {
        let now = self.now;
        for (i, c) in self.clients.iter_mut().enumerate() {
            // Devices on an availability cycle start at a random phase of it; a trace starts at 0.
            c.phase = c.availability.start_phase(&mut c.rng);
            let (start, _) = c.window(now);
            if start > now {
                c.online = false;
                self.queue.push(start, Event::Online { client: i });
                if let Some(watch) = self.watch.as_mut() {
                    watch.seen.push(Seen::Offline { client: i, crash: false });
                }
            } else {
                c.session.connected();
                schedule_departure(i, c, now, &mut self.queue);
            }
        }
        for i in 0..self.clients.len() {
            self.drive(i);
        }
    }

    /// Lets client `i`'s session act at the current time.
    pub(super) fn drive(&mut self, i: usize) {
        let c = &mut self.clients[i];
        drive_client(i, self.now, c, &mut self.queue, &mut self.trainer, &mut self.completed);
    }

    /// Files the cost records the sessions completed, with the energy their devices' profiles
    /// estimate (as the real clock does), and lets the recorder have the rows they complete.
    fn file_costs(&mut self, recorder: &mut Recorder) -> anyhow::Result<()> {
        for (i, mut cost) in std::mem::take(&mut self.completed) {
            cost.joules = self.devices[i].joules(cost.compute_seconds, cost.transfer_seconds);
            self.clients[i].power.fill(self.now, &mut cost);
            // Behind a tier, the device's relay's ledger holds the record from now on: its
            // uplink owes it to the root.
            if let Some(tier) = self.tier.as_mut() {
                let r = tier.relay_of(i);
                tier.relays[r].cost(self.now, cost.clone())?;
                self.drive_uplink(r);
            }
            if self.tier.is_none() && !self.file_at_server(&cost) {
                continue;
            }
            self.live.cost(self.ledger.len(), &cost);
            self.ledger.push(cost);
            self.live.emit_complete(&self.ledger, recorder)?;
        }
        Ok(())
    }

    /// A record reaches the ledger of the only server, as the watcher sees it; `false` when the
    /// mutation under test loses it.
    fn file_at_server(&mut self, record: &CostRecord) -> bool {
        if self.watch.as_mut().is_some_and(|w| w.loses(record)) {
            return false;
        }
        if self.watch.is_none() {
            return true;
        }
        // The server's store keeps one row per (client, round, kind), and so does the watched run.
        let repeated = self.ledger.iter().any(|held| tier::ledger_key(held) == tier::ledger_key(record));
        self.see(|| Seen::Filed { record: record.clone(), repeated });
        !repeated
    }

    /// Handles the next thing to happen (a landed training, the engine's deadline or the next
    /// event) and the engine's actions after it; `false` once the run is over.
    pub(super) fn step(&mut self, recorder: &mut Recorder) -> anyhow::Result<bool> {
        // Trainings in flight land (as Trained events at their start + compute) before anything
        // that could see them: an event for the engine, or for a client that is training.
        let timeout = self.poll_timeout();
        if self.trainer.must_land(&self.queue, timeout) {
            self.trainer.land_all(&mut self.clients, &mut self.queue)?;
            return Ok(true);
        }
        // An engine's deadline fires before the next event, if it comes first.
        let next = self.queue.peek_time();
        if let Some(deadline) = timeout
            && next.is_none_or(|t| deadline <= t)
        {
            self.now = self.now.max(deadline);
            self.handle_timeouts();
        } else if let Some((t, event)) = self.queue.pop() {
            self.now = t;
            let delivered = self.on_event(event)?;
            self.file_costs(recorder)?;
            if !delivered {
                return Ok(true);
            }
        } else {
            return Ok(false);
        }
        self.drain_actions(recorder)?;
        let settled = self.tier.as_ref().is_none_or(tier::Tier::settled);
        Ok(!(self.stopping || (self.finished && self.queue.peek_time().is_none() && settled)))
    }

    /// One event at the current time; `false` when it was lost (nothing else happens this step).
    fn on_event(&mut self, event: Event) -> anyhow::Result<bool> {
        let now = self.now;
        match event {
            Event::ToServer { from, mut msg, conn } => {
                let c = &self.clients[from];
                if !c.online || conn != c.conn {
                    return Ok(false); // sent on a connection that is gone: lost
                }
                if let Some(at) = self.watch.as_mut().and_then(|w| w.again(now)) {
                    self.queue.push(at, Event::ToServer { from, msg: msg.clone(), conn });
                }
                if let Some(watch) = self.watch.as_ref() {
                    let server_round = self.engine.last_round();
                    watch.mutate_hello(&mut msg, server_round);
                }
                self.engine_of(from).handle_message(now, &client_id(from), msg)
            }
            Event::ToRelay { relay, conn, .. } | Event::ToRoot { relay, conn, .. } if !self.relay_conn(relay, conn) => {
                return Ok(false); // sent on a connection that a restart ended: lost
            }
            Event::ToRelay { relay, msg, .. } => self.relay_received(relay, msg),
            Event::ToRoot { relay, msg, conn } => {
                if let Some(at) = self.watch.as_mut().and_then(|w| w.again(now)) {
                    self.queue.push(at, Event::ToRoot { relay, msg: msg.clone(), conn });
                }
                if let Message::Partial(p) = &msg
                    && self.watch.is_some()
                {
                    let members: Vec<String> = p.members.iter().map(|m| m.device.clone()).collect();
                    let round = p.update.round;
                    self.last_partial.insert(relay, (round, members));
                }
                let id = self.tier.as_ref().map(|t| t.relays[relay].id.clone()).unwrap_or_default();
                self.engine.handle_message(now, &id, msg)
            }
            Event::ToClient { to, msg, wire, conn } => return Ok(self.deliver(to, msg, wire, conn)),
            Event::RelayUp { relay } => self.relay_up(relay)?,
            Event::Offline { client, back_after, crash } => self.offline(client, back_after, crash),
            Event::Online { client } => return Ok(self.online(client)),
            Event::Trained { client, life, .. } if life != self.clients[client].life => {}
            Event::Trained { client, life: _, round, result } => {
                let c = &mut self.clients[client];
                match result {
                    Ok((trained, compute)) => c.session.trained(round, trained, compute),
                    Err(e) => c.session.training_failed(round, &e),
                }
                self.drive(client);
            }
        }
        Ok(true)
    }

    /// A message reaches client `to` (unless it went away, or crashes on a broadcast), charged
    /// the `wire` bytes it cost.
    fn deliver(&mut self, to: usize, msg: Message, wire: u64, conn: u64) -> bool {
        let now = self.now;
        let c = &mut self.clients[to];
        if !c.online || conn != c.conn {
            return false; // unreachable: the datagrams are lost
        }
        if matches!(msg, Message::Broadcast(_))
            && c.device.crash_probability > 0.0
            && c.rng.f64() < c.device.crash_probability
        {
            let back_after = Duration::from_secs_f64(c.device.rejoin_seconds.max(0.0));
            self.queue.push(now, Event::Offline { client: to, back_after, crash: true });
            return false;
        }
        if let Message::Ack(ack) = &msg {
            let relay = self.tier.as_ref().map(|t| t.relay_of(to));
            let (round, aggregated) = (ack.round, ack.aggregated);
            self.see(|| Seen::Ack { relay, client: client_id(to), round, aggregated });
        }
        let acked = matches!(msg, Message::Ack(_));
        let c = &mut self.clients[to];
        let _ = c.session.handle_message(now, msg, wire);
        self.drive(to);
        if acked {
            self.go_home_at_rest(to);
        }
        true
    }

    /// Client `client` goes away (a crash restarts its process: a new session from what its
    /// store kept) and, unless the run is over, comes back after `back_after`.
    fn offline(&mut self, client: usize, back_after: Duration, crash: bool) {
        let c = &mut self.clients[client];
        if !c.online {
            return;
        }
        c.online = false;
        c.conn += 1;
        let now = self.now;
        self.see(|| Seen::Offline { client, crash });
        self.engine_of(client).handle_disconnect(now, &client_id(client));
        if let Some(tier) = self.tier.as_mut() {
            tier.back_home(client);
        }
        let c = &mut self.clients[client];
        if crash {
            c.life += 1;
            c.session.restart(c.method.as_ref().map_or(0, |m| m.num_samples()));
        } else {
            c.session.disconnected();
        }
        if !self.finished {
            self.queue.push(self.now + back_after, Event::Online { client });
        }
    }

    /// Client `client` comes back, or (a crashed device that rejoins while away) waits for its
    /// next window; `false` when it waits.
    fn online(&mut self, client: usize) -> bool {
        let now = self.now;
        let c = &mut self.clients[client];
        if c.online {
            return true;
        }
        let (start, _) = c.window(now);
        if start > now {
            if !self.finished {
                self.queue.push(start, Event::Online { client });
            }
            return false;
        }
        if let Some(Err(up_at)) = self.tier.as_mut().map(|t| t.displace(client)) {
            // Every relay is down: it tries again once its own is up.
            self.queue.push(up_at.max(now) + FAILOVER_DELAY, Event::Online { client });
            return false;
        }
        let c = &mut self.clients[client];
        c.online = true;
        c.conn += 1;
        c.session.connected();
        if !self.finished {
            schedule_departure(client, c, now, &mut self.queue);
        }
        self.see(|| Seen::Online { client });
        if let Some(watch) = self.watch.as_mut() {
            watch.returned(client_id(client));
        }
        self.drive(client);
        true
    }

    /// One of the engine's actions: messages onto the links, dropped clients' cost records, a
    /// closed round evaluated and recorded, the end.
    fn on_action(&mut self, action: Action, recorder: &mut Recorder) -> anyhow::Result<()> {
        let Some(action) = self.watched(action) else { return Ok(()) };
        let now = self.now;
        let relay = |to: &str| self.tier.as_ref().and_then(|t| t.index_of(to));
        match action {
            Action::Send { to, msg } if relay(&to).is_some() => self.send_to_relay(relay(&to).unwrap_or(0), msg),
            Action::Broadcast { to, msg } if to.iter().any(|c| relay(c).is_some()) => {
                for r in to.iter().filter_map(|c| relay(c)).collect::<Vec<_>>() {
                    self.send_to_relay(r, (*msg).clone());
                }
            }
            Action::Close { client, .. } if relay(&client).is_some() => {}
            Action::Ledger(record) if relay(&record.client).is_some() => {}
            // Behind a tier the root's ledger holds what the relays' cost batches carried; the
            // sim files each record where it was made (the device's session, the relay's engine).
            Action::Ledger(record) if self.tier.is_some() => {
                if self.watch.as_mut().is_some_and(|w| w.loses(&record)) {
                    return Ok(());
                }
                if let Some(t) = self.tier.as_mut() {
                    let repeated = t.file_at_root(record.clone());
                    self.see(|| Seen::Filed { record, repeated });
                }
            }
            Action::Send { .. } | Action::Close { .. } | Action::Broadcast { .. } => self.send_to_clients(action),
            // The sim keeps the clients' own cost records; a dropped client's record comes from the engine.
            Action::Ledger(record) => {
                if (record.dropped || record.declined.is_some()) && self.file_at_server(&record) {
                    self.live.cost(self.ledger.len(), &record);
                    self.ledger.push(record);
                }
            }
            Action::Persist(_) => {}
            Action::RoundClosed(report, checkpoint) => {
                let task = self.schedule.task_of(report.round);
                let (accuracy, new_rows) = self.evaluator.evaluate_round(&report, &checkpoint, task)?;
                let row = RoundRow::from_report(&report, accuracy, &[]);
                // A closed round's row waits for its acks (the wire bytes); an earlier one still
                // waiting goes out now, with what it has.
                self.live.flush(&self.ledger, recorder)?;
                self.live.closed(row.clone(), new_rows.clone(), report.updates.len(), now);
                self.live.emit_complete(&self.ledger, recorder)?;
                self.accuracy_rows.extend(new_rows);
                self.rows.push(row);
                self.reports.push((*report).clone());
                let horizon = self.horizon.is_some_and(|h| now >= h);
                if horizon && !self.stopping {
                    tracing::info!(round = report.round, simulated = ?now, "the simulated horizon passed; the run ends");
                }
                self.stopping = recorder.stop_requested().is_some() || horizon;
            }
            // The relays pass the root's goodbye (it travels their links) on to their devices.
            Action::Finished => self.finished = true,
        }
        Ok(())
    }

    /// What the watcher sees of one of the root's actions, and the action as the mutation under
    /// test changes it (`None`: it never leaves the root).
    fn watched(&mut self, action: Action) -> Option<Action> {
        if self.watch.is_none() {
            return Some(action);
        }
        let relay = self.tier.as_ref().and_then(|t| match &action {
            Action::Send { to, .. } => t.index_of(to),
            _ => None,
        });
        if let Action::Send { to, msg: Message::Ack(ack) } = &action {
            let (client, round, aggregated) = (to.clone(), ack.round, ack.aggregated);
            self.see(|| Seen::AckQueued { relay: None, client, round, aggregated });
        }
        if let Action::Persist(anchorage_server::engine::Persist::Accepted(a)) = &action
            && !self.watch.as_mut().is_some_and(Watch::loses_commit)
        {
            let (client, round) = (a.client.clone(), a.update.round);
            self.see(|| Seen::Committed { relay: None, client, round });
        }
        let Some(watch) = self.watch.as_ref() else { return Some(action) };
        match &action {
            Action::Send { msg: Message::Ack(ack), .. } if relay.is_some() && ack.aggregated => {
                let r = relay.unwrap_or(0);
                if let Some((_, members)) = self.last_partial.get(&r).filter(|(round, _)| *round == ack.round) {
                    let (round, members) = (ack.round, members.clone());
                    self.see(|| Seen::PartialAccepted { relay: r, round, members });
                }
            }
            Action::Broadcast { to, msg } => {
                if let Message::Broadcast(b) = &**msg {
                    let clients = watch.recipients(to);
                    if watch.drops_broadcast(b.round) || clients.is_empty() {
                        return None;
                    }
                    let (round, msg) = (b.round, msg.clone());
                    self.see(|| Seen::Invited { round, clients: clients.clone() });
                    return Some(Action::Broadcast { to: clients, msg });
                }
            }
            Action::Send { to, msg: Message::Broadcast(b) } => {
                if watch.drops_broadcast(b.round) || watch.recipients(std::slice::from_ref(to)).is_empty() {
                    return None;
                }
                let (round, clients) = (b.round, vec![to.clone()]);
                self.see(|| Seen::Invited { round, clients });
            }
            Action::RoundClosed(report, checkpoint) => {
                let (report, checkpoint) =
                    watch.mutate_close(report, checkpoint).unwrap_or_else(|| (report.clone(), checkpoint.clone()));
                let finite = super::watch::finite(&checkpoint);
                self.see(|| Seen::Closed { report: report.clone(), finite });
                return Some(Action::RoundClosed(report, checkpoint));
            }
            Action::Finished => self.see(|| Seen::Finished),
            _ => {}
        }
        Some(action)
    }

    /// An engine's message to clients onto their links (the root's, or a relay's).
    pub(super) fn send_to_clients(&mut self, action: Action) {
        let now = self.now;
        match action {
            Action::Send { to, msg } => send_down(&self.index, &mut self.clients, &mut self.queue, now, &to, msg),
            Action::Close { client, refusal } => {
                send_down(&self.index, &mut self.clients, &mut self.queue, now, &client, Message::Refusal(refusal))
            }
            Action::Broadcast { to, msg } => {
                let bytes = frame_len(&msg);
                for client in to {
                    if let Some(&i) = self.index.get(&client) {
                        let c = &mut self.clients[i];
                        // Only a broadcast larger than a chunk travels as a transfer.
                        let resume = c.resume_broadcasts && bytes > CHUNK_BYTES as u64;
                        let (at, wire) = c.down.carry_transfer(now, bytes, resume);
                        let conn = c.conn;
                        self.queue.push(at, Event::ToClient { to: i, msg: (*msg).clone(), wire, conn });
                    }
                }
            }
            _ => {}
        }
    }

    /// The engine client `client` talks to: its relay's, or the server's.
    pub(super) fn engine_of(&mut self, client: usize) -> &mut Engine {
        match self.tier.as_mut() {
            Some(t) => {
                let r = t.relay_of(client);
                &mut t.relays[r].engine
            }
            None => &mut self.engine,
        }
    }

    /// When the earliest engine needs its timeout.
    fn poll_timeout(&self) -> Option<Duration> {
        let relays = self.tier.as_ref().and_then(tier::Tier::poll_timeout);
        [self.engine.poll_timeout(), relays].into_iter().flatten().min()
    }

    /// Every engine whose deadline the clock reached handles it.
    fn handle_timeouts(&mut self) {
        let now = self.now;
        if self.engine.poll_timeout().is_some_and(|t| t <= now) {
            self.engine.handle_timeout(now);
        }
        for relay in self.tier.iter_mut().flat_map(|t| t.relays.iter_mut()).filter(|r| r.down_until.is_none()) {
            if relay.engine.poll_timeout().is_some_and(|t| t <= now) {
                relay.engine.handle_timeout(now);
            }
            if relay.uplink.poll_timeout().is_some_and(|t| t <= now) {
                relay.uplink.handle_timeout(now);
            }
        }
        for r in 0..self.tier.as_ref().map_or(0, |t| t.relays.len()) {
            self.drive_uplink(r);
        }
    }

    /// Carries out the root's actions and every relay's, until none is left.
    fn drain_actions(&mut self, recorder: &mut Recorder) -> anyhow::Result<()> {
        loop {
            let mut acted = false;
            while let Some(action) = self.engine.poll_action() {
                acted = true;
                self.on_action(action, recorder)?;
            }
            for r in 0..self.tier.as_ref().map_or(0, |t| t.relays.len()) {
                while let Some(action) = self.tier.as_mut().and_then(|t| t.relays[r].engine.poll_action()) {
                    acted = true;
                    // A relay whose process is down does nothing.
                    if self.tier.as_ref().is_some_and(|t| t.is_up(r)) {
                        self.on_relay_action(r, action)?;
                    }
                }
            }
            if !acted {
                self.see_evidence();
                return Ok(());
            }
        }
    }

    /// Shows the watcher each server's rollback evidence.
    fn see_evidence(&mut self) {
        let Some(watch) = self.watch.as_mut() else { return };
        watch.evidence(None, self.engine.devices_ahead());
        for (r, relay) in self.tier.iter().flat_map(|t| t.relays.iter().enumerate()) {
            watch.evidence(Some(r), relay.engine.devices_ahead());
        }
    }

    /// The run's result: rows with their final wire bytes, the summary, the run folder finished.
    pub(super) fn finish(
        mut self,
        config: &SimConfig,
        recorder: &mut Recorder,
        started: Instant,
    ) -> anyhow::Result<SimResult> {
        self.live.flush(&self.ledger, recorder)?;
        // Acks of a round's last updates arrive after it closed: total the wire bytes at the end.
        for row in self.rows.iter_mut() {
            let costs = self.ledger.iter().filter(|c| c.round == row.round);
            (row.wire_up, row.wire_down) = costs.fold((0, 0), |(u, d), c| (u + c.wire_up, d + c.wire_down));
        }
        let inputs = SummaryInputs {
            initial_accuracy: self.initial_accuracy,
            chance: self.chance,
            late_updates: self.reports.last().map(|r| r.late_total).unwrap_or(0),
            refused: self.engine.stats().refused,
            decode_errors: 0,
            wall_seconds: started.elapsed().as_secs_f64(),
            local_eval: crate::record::LocalEval::of(config),
            privacy: crate::record::PrivacySpent::of(self.reports.iter()),
        };
        let mut summary = RunSummary::new(inputs, self.rows, &self.ledger, &self.accuracy_rows);
        summary.probes = self.evaluator.last_probes()?;
        let simulated: Duration = summary.rounds.iter().map(|r| Duration::from_secs_f64(r.seconds.max(0.0))).sum();
        recorder.finish(&mut summary, &self.ledger, &self.accuracy_rows, Some(simulated))?;
        tracing::info!(simulated = ?self.now, wall = summary.wall_seconds, "virtual run finished");
        let run_dir = recorder.dir().map(|d| d.to_path_buf());
        let tier = self.tier.map(|t| crate::record::TierOutcome {
            counts: t.counts(),
            owed: t
                .relays
                .iter()
                .map(|r| (r.uplink.owed_partial().map(|p| p.update.round), r.uplink.owed_cost_rounds()))
                .collect(),
            root_ledger: t.root_ledger,
        });
        let (ledger, reports, accuracy) = (self.ledger, self.reports, self.accuracy_rows);
        Ok(SimResult { summary, ledger, reports, run_dir, link_stats: Vec::new(), accuracy, tier })
    }
}
