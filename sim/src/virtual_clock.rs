//! The virtual clock (FedScale's idea, with Anchorage's link model): a discrete-event loop that
//! drives the same sans-IO [`Engine`] and client [`Session`]s as the real transport, with no
//! socket and no sleeping. Training runs for real and is charged to the simulated clock as the
//! measured host seconds times `compute_scale` (the device's slowness); every message is charged
//! to its client's uplink or downlink by the same [`Link`] model that shapes real QUIC.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anchorage_client::methods::ClientMethod;
use anchorage_client::session::{Session, SessionAction, UploadMeasure};
use anchorage_server::engine::{Action, Engine, EngineConfig};
use anchorage_shared::frame::encode_frame;
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::{Broadcast, Capabilities, Message, Update};
use anchorage_shared::rng::Rng;
use anchorage_shared::transfer::CHUNK_BYTES;
use anyhow::Context;

use crate::config::SimConfig;
use crate::device::{Availability, Charge, DeviceProfile};
use crate::network::{Link, LinkProfile};
use crate::record::{RoundRow, RunSummary, SimResult, SummaryInputs, initial_of};
use crate::recorder::Recorder;
use crate::setup::{Evaluator, Setup, client_id};

mod tier;

pub use tier::UplinkCounts;

/// Payload bytes a QUIC packet carries, and the bytes of headers, framing and AEAD tag around it
/// (measured on loopback: about 3% over the payload for a 1 MB upload).
const PACKET_PAYLOAD: u64 = 1200;
const PACKET_OVERHEAD: u64 = 40;

/// Wire bytes of a frame of `bytes` under the packet model.
pub fn wire_bytes(bytes: u64) -> u64 {
    bytes + bytes.div_ceil(PACKET_PAYLOAD) * PACKET_OVERHEAD
}

enum Event {
    /// `conn`: the client's connection when the message left (see [`VirtualClient::conn`]).
    ToServer {
        from: usize,
        msg: Message,
        conn: u64,
    },
    /// `wire`: the bytes the message put on the wire, a broadcast's resends after outages included.
    ToClient {
        to: usize,
        msg: Message,
        wire: u64,
        conn: u64,
    },
    /// Training finished, with the device's compute time; `life` tells whether the process
    /// that trained still runs.
    Trained {
        client: usize,
        life: u64,
        round: u64,
        result: Result<(Update, Duration), String>,
    },
    /// The device becomes unreachable; it returns after `back_after`. `crash`: the process restarts
    /// (work in progress is lost, the store survives).
    Offline {
        client: usize,
        back_after: Duration,
        crash: bool,
    },
    Online {
        client: usize,
    },
    /// From the root to relay `relay` over its link (`[relays]`).
    ToRelay {
        relay: usize,
        msg: Message,
    },
    /// From relay `relay` to the root over its link.
    ToRoot {
        relay: usize,
        msg: Message,
    },
}

/// Events ordered by time, then by insertion (deterministic for equal times).
#[derive(Default)]
struct Queue {
    heap: BinaryHeap<Reverse<(Duration, u64)>>,
    events: HashMap<u64, Event>,
    seq: u64,
}

impl Queue {
    fn push(&mut self, at: Duration, event: Event) {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq)));
        self.events.insert(self.seq, event);
    }

    fn peek_time(&self) -> Option<Duration> {
        self.heap.peek().map(|Reverse((t, _))| *t)
    }

    fn peek(&self) -> Option<(Duration, &Event)> {
        let Reverse((t, seq)) = self.heap.peek()?;
        self.events.get(seq).map(|e| (*t, e))
    }

    fn pop(&mut self) -> Option<(Duration, Event)> {
        let Reverse((t, seq)) = self.heap.pop()?;
        self.events.remove(&seq).map(|e| (t, e))
    }
}

/// The server's default `read_stall`: a stream that brings no byte for this long is let go (a
/// one-frame upload's connection is closed with it).
const STALL: Duration = Duration::from_secs(30);

/// How long a device that fails over takes to reach its next relay (its backoff's first step).
const FAILOVER_DELAY: Duration = Duration::from_millis(200);
/// How long a device that failed over stays on the other relay after its ack there.
const HOME_AFTER: Duration = Duration::from_secs(1);

/// The sender's probe timeout on a path of round-trip time `rtt` (RFC 9002, section 6.2: the
/// smoothed RTT, four times its variation, here taken as half the RTT, and quinn's 25 ms
/// maximum ACK delay); it doubles at each unanswered probe.
fn probe_timeout(rtt: Duration) -> Duration {
    rtt.mul_f64(1.5) + Duration::from_millis(25)
}

/// When the sender's next probe after an outage `cut` .. `back` gets through: the first of
/// `cut + pto·(2^k − 1)` at or after `back`.
fn first_probe_after(cut: Duration, back: Duration, pto: Duration) -> Duration {
    let mut probe = pto;
    let mut at = cut + probe;
    while at < back {
        probe *= 2;
        at += probe;
    }
    at
}

/// One direction of a client's path on the virtual clock: in-order, one message at a time.
struct Path {
    link: Link,
    free_at: Duration,
}

impl Path {
    fn new(profile: LinkProfile, seed: u64) -> Self {
        Self { link: Link::new(profile, seed), free_at: Duration::ZERO }
    }

    /// When a message of `bytes` sent at `now` arrives (after any outage and the messages ahead).
    fn carry(&mut self, now: Duration, bytes: u64) -> Duration {
        let start = self.link.next_up(now.max(self.free_at));
        // `next_up` left every outage behind, so the transfer is possible.
        let d = self.link.transfer_time(start, wire_bytes(bytes)).unwrap_or_default();
        self.free_at = start + d;
        start + d
    }

    /// When a transfer of `bytes` (an upload, or a broadcast to one device) started at `now`
    /// arrives, and the bytes it put on the wire, when outages may break it off (`carry` lets
    /// one only delay the start). At an outage the transfer stops; it goes on two round trips
    /// after the sender's first probe after the outage ([`first_probe_after`]). If that is more
    /// than [`STALL`] after the cut, the receiver has let the stream go (the server's read
    /// stall; for a broadcast, the device's idle timeout, 30 s on the simulator's devices): a
    /// resumable transfer is offered again (one round trip) and goes on from the last whole
    /// chunk the receiver holds; a one-frame upload's or uni-stream broadcast's connection was
    /// closed, so the device reconnects (two round trips) and it is all sent again. Otherwise
    /// QUIC carries on and nothing is sent twice.
    fn carry_transfer(&mut self, now: Duration, bytes: u64, resume: bool) -> (Duration, u64) {
        let rtt = self.link.base_rtt();
        let mut left = bytes;
        let mut wire = 0;
        let mut t = now.max(self.free_at);
        loop {
            // A restart may fall inside the next outage: it begins when the link is back.
            t = self.link.next_up(t);
            if t.saturating_sub(now) > GIVE_UP {
                // Repeating outages shorter-spaced than the upload: it never gets through whole.
                tracing::debug!(
                    bytes,
                    resume,
                    "an upload has not got through in a simulated day; charged as arriving now"
                );
                self.free_at = t;
                return (t, wire);
            }
            let d = self.link.transfer_time(t, wire_bytes(left)).unwrap_or_default();
            let Some(cut) = self.link.outage_starting_in(t, t + d) else {
                wire += wire_bytes(left);
                self.free_at = t + d;
                return (t + d, wire);
            };
            let done = (left as f64 * (cut - t).as_secs_f64() / d.as_secs_f64().max(1e-9)) as u64;
            wire += wire_bytes(done);
            // A bulk transfer keeps the bottleneck's buffer full: its RTT, and so its probe
            // timeout, include the queue. The probe's ACK reveals the loss (one round trip) and
            // the lost bytes are sent again (another): only then does the server read a new byte.
            let loaded = self.link.loaded_rtt();
            let probe = first_probe_after(cut, self.link.next_up(cut), probe_timeout(loaded));
            let next_byte = probe + 2 * loaded;
            if next_byte - cut <= STALL {
                (left, t) = (left - done, next_byte);
            } else if resume {
                let held = (bytes - left + done) / CHUNK_BYTES as u64 * CHUNK_BYTES as u64;
                (left, t) = (bytes - held, next_byte + rtt);
            } else {
                (left, t) = (bytes, next_byte + 2 * rtt);
            }
        }
    }
}

/// How long the virtual clock follows one upload through outages before it charges it as arriving
/// (the device would go on trying; by then its round is long closed). Bounds the loop of
/// [`Path::carry_transfer`] under repeating outages that leave no gap long enough.
const GIVE_UP: Duration = Duration::from_secs(24 * 3600);

struct VirtualClient {
    session: Session,
    device: Arc<DeviceProfile>,
    /// When the device is reachable (on its own timeline, `phase` ahead of the simulated clock).
    availability: Availability,
    phase: Duration,
    rng: Rng,
    online: bool,
    /// Incremented whenever the device goes away or comes back: messages in flight across such a
    /// change are lost.
    conn: u64,
    /// Incremented by every crash: results of an earlier life are discarded.
    life: u64,
    /// `None` while the method trains on the pool ([`Trainer`]).
    method: Option<Box<dyn ClientMethod>>,
    /// Uploads resume after an outage breaks them off (`SystemsConfig::resume_uploads`).
    resume_uploads: bool,
    /// So do broadcasts larger than a chunk (`SystemsConfig::resume_broadcasts`).
    resume_broadcasts: bool,
    /// Battery, temperature and eligibility.
    power: crate::power::Power,
    up: Path,
    down: Path,
}

/// Runs the federation of `config` on the virtual clock, silently, with no run folder.
pub fn run_virtual(config: &SimConfig) -> anyhow::Result<SimResult> {
    run_virtual_recorded(config, &mut Recorder::silent())
}

/// [`run_virtual`], reporting each round to `recorder` (console and run folder) once its acks
/// are in; a stop request ends the run after the round in flight.
pub fn run_virtual_recorded(config: &SimConfig, recorder: &mut Recorder) -> anyhow::Result<SimResult> {
    let started = Instant::now();
    let mut run = VirtualRun::new(config, recorder)?;
    run.start();
    while run.step(recorder)? {}
    run.finish(config, recorder, started)
}

/// One run on the virtual clock: the engine, the fleet, the event queue and what the run has
/// recorded so far. [`VirtualRun::step`] handles one event and the engine's actions after it.
struct VirtualRun {
    /// The server's engine: the root of a tier when `tier` is set.
    engine: Engine,
    /// `[relays]`: the relays between the clients and the root.
    tier: Option<tier::Tier>,
    schedule: EngineConfig,
    evaluator: Evaluator,
    devices: Vec<Arc<DeviceProfile>>,
    clients: Vec<VirtualClient>,
    index: HashMap<String, usize>,
    queue: Queue,
    trainer: Trainer,
    now: Duration,
    initial_accuracy: f64,
    chance: f64,
    live: LiveRows,
    rows: Vec<RoundRow>,
    reports: Vec<anchorage_server::RoundReport>,
    ledger: Vec<CostRecord>,
    /// Cost records the clients' sessions completed, to file in the ledger.
    completed: Vec<(usize, CostRecord)>,
    accuracy_rows: Vec<crate::accuracy::AccuracyRow>,
    stopping: bool,
    finished: bool,
    /// `stop_after_hours` on the simulated clock.
    horizon: Option<Duration>,
}

/// Each device's availability; a trace is read once per profile, and a bad one is an error here,
/// before the run.
fn availabilities(devices: &[Arc<DeviceProfile>]) -> anyhow::Result<Vec<Availability>> {
    let mut read: Vec<(&Arc<DeviceProfile>, Availability)> = Vec::new();
    let mut out = Vec::with_capacity(devices.len());
    for d in devices {
        let a = match read.iter().find(|(p, _)| Arc::ptr_eq(p, d) || *p == d) {
            Some((_, a)) => a.clone(),
            None => {
                let a = d.availability()?;
                read.push((d, a.clone()));
                a
            }
        };
        out.push(a);
    }
    Ok(out)
}

/// The fleet of `config`: each method with its session, device, availability, power model and
/// links.
fn virtual_clients<M: ClientMethod + 'static>(
    config: &SimConfig,
    methods: Vec<M>,
    devices: &[Arc<DeviceProfile>],
) -> anyhow::Result<Vec<VirtualClient>> {
    let links = config.links()?;
    let availabilities = availabilities(devices)?;
    let metered = config.metered_links();
    let powers = devices.iter().map(|d| crate::power::Power::of(d)).collect::<anyhow::Result<Vec<_>>>()?;
    let mut names = heapless::Vec::new();
    let name = methods.first().map_or("", |m| m.name());
    let _ = names.push(heapless::String::try_from(name).unwrap_or_default());
    let capabilities = Arc::new(Capabilities { backend: "virtual".into(), memory_mb: 1024, methods: names });
    let clients = methods
        .into_iter()
        .enumerate()
        .map(|(i, method)| {
            let profile = links[i].clone().unwrap_or_default();
            let mut session = Session::new(client_id(i), capabilities.clone(), method.num_samples(), None)
                .payload_down_without_prototypes();
            let seed = config.federation.seed.wrapping_add(5000 + i as u64);
            if config.secagg.enabled {
                // Seeded: a simulation is reproducible; a device in the field takes the OS's entropy.
                let mut entropy = [0u8; 32];
                let mut rng = Rng::derive(seed, 0x5EC);
                entropy.chunks_exact_mut(8).for_each(|c| c.copy_from_slice(&rng.next_u64().to_le_bytes()));
                session = session.with_secure_aggregation(entropy);
            }
            VirtualClient {
                session,
                device: devices[i].clone(),
                availability: availabilities[i].clone(),
                phase: Duration::ZERO,
                rng: Rng::derive(seed, 0xC4A5),
                online: true,
                conn: 0,
                life: 0,
                method: Some(Box::new(method) as Box<dyn ClientMethod>),
                resume_uploads: config.systems.resume_uploads,
                resume_broadcasts: config.systems.resume_broadcasts,
                power: powers[i].clone().on_metered_link(metered[i]),
                up: Path::new(profile.up, seed),
                down: Path::new(profile.down, seed ^ 0x5EED_D0A1),
            }
        })
        .collect();
    Ok(clients)
}

impl VirtualRun {
    /// The setup of `config` on the virtual clock, its initial evaluation told to `recorder`.
    fn new(config: &SimConfig, recorder: &mut Recorder) -> anyhow::Result<Self> {
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
        })
    }

    /// Brings every device online (or schedules it for its first window) and lets it speak.
    fn start(&mut self) {
        let now = self.now;
        for (i, c) in self.clients.iter_mut().enumerate() {
            // Devices on an availability cycle start at a random phase of it; a trace starts at 0.
            c.phase = c.availability.start_phase(&mut c.rng);
            let (start, _) = c.window(now);
            if start > now {
                c.online = false;
                self.queue.push(start, Event::Online { client: i });
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
    fn drive(&mut self, i: usize) {
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
                tier.relays[r].cost(self.now, cost.clone());
                self.drive_uplink(r);
            }
            self.live.cost(self.ledger.len(), &cost);
            self.ledger.push(cost);
            self.live.emit_complete(&self.ledger, recorder)?;
        }
        Ok(())
    }

    /// Handles the next thing to happen (a landed training, the engine's deadline or the next
    /// event) and the engine's actions after it; `false` once the run is over.
    fn step(&mut self, recorder: &mut Recorder) -> anyhow::Result<bool> {
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
            let delivered = self.on_event(event);
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
    fn on_event(&mut self, event: Event) -> bool {
        let now = self.now;
        match event {
            Event::ToServer { from, msg, conn } => {
                let c = &self.clients[from];
                if !c.online || conn != c.conn {
                    return false; // sent on a connection that is gone: lost
                }
                self.engine_of(from).handle_message(now, &client_id(from), msg)
            }
            Event::ToRelay { relay, msg } => self.relay_received(relay, msg),
            Event::ToRoot { relay, msg } => {
                let id = self.tier.as_ref().map(|t| t.relays[relay].id.clone()).unwrap_or_default();
                self.engine.handle_message(now, &id, msg)
            }
            Event::ToClient { to, msg, wire, conn } => return self.deliver(to, msg, wire, conn),
            Event::Offline { client, back_after, crash } => self.offline(client, back_after, crash),
            Event::Online { client } => return self.online(client),
            Event::Trained { client, life, .. } if life != self.clients[client].life => {}
            Event::Trained { client, life: _, round, result } => {
                let c = &mut self.clients[client];
                match result {
                    Ok((update, compute)) => c.session.trained(update, compute),
                    Err(e) => c.session.training_failed(round, &e),
                }
                self.drive(client);
            }
        }
        true
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
        let _ = c.session.handle_message(now, msg, wire);
        self.drive(to);
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
        c.online = true;
        c.conn += 1;
        c.session.connected();
        if !self.finished {
            schedule_departure(client, c, now, &mut self.queue);
        }
        self.drive(client);
        true
    }

    /// One of the engine's actions: messages onto the links, dropped clients' cost records, a
    /// closed round evaluated and recorded, the end.
    fn on_action(&mut self, action: Action, recorder: &mut Recorder) -> anyhow::Result<()> {
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
                if let Some(t) = self.tier.as_mut() {
                    t.root_ledger.push(record);
                }
            }
            Action::Send { .. } | Action::Close { .. } | Action::Broadcast { .. } => self.send_to_clients(action),
            // The sim keeps the clients' own cost records; a dropped client's record comes from the engine.
            Action::Ledger(record) => {
                if record.dropped || record.declined.is_some() {
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

    /// An engine's message to clients onto their links (the root's, or a relay's).
    fn send_to_clients(&mut self, action: Action) {
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

    /// Relay `r`'s engine.
    fn engine_of_relay(&mut self, r: usize) -> &mut Engine {
        match self.tier.as_mut() {
            Some(t) => &mut t.relays[r].engine,
            None => &mut self.engine,
        }
    }

    /// The engine client `client` talks to: its relay's, or the server's.
    fn engine_of(&mut self, client: usize) -> &mut Engine {
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
        for relay in self.tier.iter_mut().flat_map(|t| t.relays.iter_mut()) {
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
                    self.on_relay_action(r, action);
                }
            }
            if !acted {
                return Ok(());
            }
        }
    }

    /// One of relay `r`'s actions: messages to its clients, their dropped records, and its
    /// closed round's partial aggregate up its link to the root.
    fn on_relay_action(&mut self, r: usize, action: Action) {
        let now = self.now;
        if let Action::Send { to, msg: Message::Ack(ack) } = &action
            && let Some(&client) = self.index.get(to)
            && self.tier.as_ref().is_some_and(|t| t.relay_of(client) == r)
        {
            if self.tier.as_mut().is_some_and(|t| t.fails_over(client, ack.round)) {
                // The ack is lost with the connection; the device comes back on its next relay.
                self.reconnect_elsewhere(r, client);
                return;
            }
            if self.tier.as_mut().is_some_and(|t| t.acked_away(client, ack.round)) {
                // Acked where it failed over to: once the ack is in, it goes back to its own relay.
                let back_after = FAILOVER_DELAY;
                self.queue.push(now + HOME_AFTER, Event::Offline { client, back_after, crash: false });
            }
        }
        match action {
            Action::Send { .. } | Action::Close { .. } | Action::Broadcast { .. } => self.send_to_clients(action),
            Action::Ledger(record) => {
                if record.dropped || record.declined.is_some() {
                    self.live.cost(self.ledger.len(), &record);
                    self.ledger.push(record.clone());
                }
                if let Some(tier) = self.tier.as_mut() {
                    tier.relays[r].cost(now, record);
                }
                self.drive_uplink(r);
            }
            Action::RoundClosed(_, checkpoint) => {
                let Some(tier) = self.tier.as_mut() else { return };
                if let Some(partial) = anchorage_server::relay::partial_of(&checkpoint) {
                    tier.relays[r].uplink.partial_closed(partial);
                }
                self.drive_uplink(r);
            }
            Action::Persist(_) | Action::Finished => {}
        }
    }

    /// Client `client`'s connection to relay `r` breaks; it connects to the relay the tier has
    /// it on now, after [`FAILOVER_DELAY`].
    fn reconnect_elsewhere(&mut self, r: usize, client: usize) {
        let now = self.now;
        self.engine_of_relay(r).handle_disconnect(now, &client_id(client));
        let c = &mut self.clients[client];
        if c.online {
            c.online = false;
            c.conn += 1;
            c.session.disconnected();
            self.queue.push(now + FAILOVER_DELAY, Event::Online { client });
        }
    }

    /// Carries out relay `r`'s uplink actions: what goes up travels its link to the root.
    fn drive_uplink(&mut self, r: usize) {
        let now = self.now;
        let Some(tier) = self.tier.as_mut() else { return };
        let relay = &mut tier.relays[r];
        for msg in relay.carry_out(now) {
            let (at, _) = relay.up.carry_transfer(now, frame_len(&msg), true);
            self.queue.push(at, Event::ToRoot { relay: r, msg });
        }
    }

    /// The root's message onto relay `r`'s link.
    fn send_to_relay(&mut self, r: usize, msg: Message) {
        let Some(tier) = self.tier.as_mut() else { return };
        let (at, _) = tier.relays[r].down.carry_transfer(self.now, frame_len(&msg), true);
        self.queue.push(at, Event::ToRelay { relay: r, msg });
    }

    /// The root's message reaches relay `r`'s uplink session.
    fn relay_received(&mut self, r: usize, msg: Message) {
        let now = self.now;
        let Some(relay) = self.tier.as_mut().map(|t| &mut t.relays[r]) else { return };
        relay.uplink.handle_message(now, msg);
        self.drive_uplink(r);
    }

    /// The run's result: rows with their final wire bytes, the summary, the run folder finished.
    fn finish(mut self, config: &SimConfig, recorder: &mut Recorder, started: Instant) -> anyhow::Result<SimResult> {
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

/// Closed rounds whose rows wait for their acks: a row's wire bytes are the acked updates' and
/// arrive after the round closes. A row goes to the recorder once every aggregated update's cost
/// record is in, or when the next round closes, or at the end.
#[derive(Default)]
struct LiveRows {
    waiting: std::collections::VecDeque<Waiting>,
    /// Per round: indices into the ledger of its cost records.
    costs: HashMap<u64, Vec<usize>>,
}

struct Waiting {
    row: RoundRow,
    accuracy: Vec<crate::accuracy::AccuracyRow>,
    acks: usize,
    closed_at: Duration,
}

impl LiveRows {
    fn cost(&mut self, index: usize, record: &CostRecord) {
        self.costs.entry(record.round).or_default().push(index);
    }

    fn closed(&mut self, row: RoundRow, accuracy: Vec<crate::accuracy::AccuracyRow>, acks: usize, at: Duration) {
        self.waiting.push_back(Waiting { row, accuracy, acks, closed_at: at });
    }

    fn emit_complete(&mut self, ledger: &[CostRecord], recorder: &mut Recorder) -> anyhow::Result<()> {
        while let Some(w) = self.waiting.front() {
            let acked = self.costs.get(&w.row.round).map_or(0, |c| c.iter().filter(|&&i| !ledger[i].dropped).count());
            if acked < w.acks {
                break;
            }
            self.emit_front(ledger, recorder)?;
        }
        Ok(())
    }

    fn flush(&mut self, ledger: &[CostRecord], recorder: &mut Recorder) -> anyhow::Result<()> {
        while !self.waiting.is_empty() {
            self.emit_front(ledger, recorder)?;
        }
        Ok(())
    }

    fn emit_front(&mut self, ledger: &[CostRecord], recorder: &mut Recorder) -> anyhow::Result<()> {
        let Some(mut w) = self.waiting.pop_front() else { return Ok(()) };
        let costs: Vec<CostRecord> =
            self.costs.remove(&w.row.round).unwrap_or_default().into_iter().map(|i| ledger[i].clone()).collect();
        (w.row.wire_up, w.row.wire_down) = costs.iter().fold((0, 0), |(u, d), c| (u + c.wire_up, d + c.wire_down));
        recorder.round(&w.row, &costs, &w.accuracy, Some(w.closed_at))
    }
}

impl VirtualClient {
    /// The device's window of availability that holds `now`, or else the next one, on the
    /// simulated clock: (start, end; `None`: it never ends).
    fn window(&self, now: Duration) -> (Duration, Option<Duration>) {
        let (start, end) = self.availability.window(now + self.phase);
        (start.saturating_sub(self.phase), end.map(|e| e.saturating_sub(self.phase)))
    }
}

/// Trains the sampled clients on a pool of threads, deterministically. A training sees only its
/// own client's method and the broadcast, so it can run while the clock handles other clients'
/// events; its result lands as a `Trained` event at its start time plus its measured compute
/// time, before the clock handles anything that could see it (an engine event, or an event for
/// that client). With one thread (or a single-core host) it trains in place, as the clock
/// always did.
struct Trainer {
    pool: Option<rayon::ThreadPool>,
    done_tx: std::sync::mpsc::Sender<Trained>,
    done_rx: std::sync::mpsc::Receiver<Trained>,
    /// Client → (start time, round, life) of its training in flight.
    in_flight: HashMap<usize, (Duration, u64, u64)>,
}

/// A training's outcome and the device's compute time, with the method it borrowed.
struct Trained {
    client: usize,
    method: Box<dyn ClientMethod>,
    result: Result<(Update, Duration), String>,
}

impl Trainer {
    fn new(threads: usize) -> anyhow::Result<Self> {
        let pool = if threads > 1 {
            Some(rayon::ThreadPoolBuilder::new().num_threads(threads).thread_name(|i| format!("train-{i}")).build()?)
        } else {
            None
        };
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        Ok(Self { pool, done_tx, done_rx, in_flight: HashMap::new() })
    }

    /// Client `i` trains on `b` from `now`.
    fn start(&mut self, i: usize, c: &mut VirtualClient, now: Duration, b: Broadcast, queue: &mut Queue) {
        let Some(mut method) = c.method.take() else {
            tracing::warn!(client = i, "a second training before the first landed; ignored");
            return;
        };
        let round = b.round;
        match &self.pool {
            Some(pool) => {
                self.in_flight.insert(i, (now, round, c.life));
                let tx = self.done_tx.clone();
                pool.spawn(move || {
                    let result = method.train_timed(&b).map_err(|e| e.to_string());
                    let _ = tx.send(Trained { client: i, method, result });
                });
            }
            None => {
                let result = method.train_timed(&b).map_err(|e| e.to_string());
                land(c, i, method, result, now, round, queue);
            }
        }
    }

    /// Whether the next event (or the engine's deadline `timeout`) could see a training in flight.
    fn must_land(&self, queue: &Queue, timeout: Option<Duration>) -> bool {
        if self.in_flight.is_empty() {
            return false;
        }
        match queue.peek() {
            Some((t, Event::ToClient { to, .. })) => {
                self.in_flight.contains_key(to) || timeout.is_some_and(|deadline| deadline <= t)
            }
            _ => true,
        }
    }

    /// Waits for every training in flight and queues their `Trained` events.
    fn land_all(&mut self, clients: &mut [VirtualClient], queue: &mut Queue) -> anyhow::Result<()> {
        while !self.in_flight.is_empty() {
            let done = self.done_rx.recv().context("a training thread of the virtual clock died")?;
            let (started, round, _) = self.in_flight.remove(&done.client).context("an unexpected training result")?;
            land(&mut clients[done.client], done.client, done.method, done.result, started, round, queue);
        }
        Ok(())
    }
}

/// A finished training: the method goes back to its client, and a `Trained` event (which hands
/// the compute time to the session) to `started` + the device's compute time.
fn land(
    c: &mut VirtualClient,
    i: usize,
    method: Box<dyn ClientMethod>,
    result: Result<(Update, Duration), String>,
    started: Duration,
    round: u64,
    queue: &mut Queue,
) {
    c.method = Some(method);
    // The device model charged it (host CPU time × its scale): `SimulatedDevice::train_timed`;
    // a throttled device takes longer (`crate::power`).
    let result = result.map(|(update, compute)| (update, c.power.train(started, round, compute)));
    let compute = result.as_ref().map_or(Duration::ZERO, |(_, compute)| *compute);
    queue.push(started + compute, Event::Trained { client: i, life: c.life, round, result });
}

/// Queues a reachable device's departure at the end of its window, back at the start of the next.
fn schedule_departure(client: usize, c: &VirtualClient, now: Duration, queue: &mut Queue) {
    if let (_, Some(end)) = c.window(now) {
        let (back, _) = c.window(end);
        queue.push(end, Event::Offline { client, back_after: back.saturating_sub(end), crash: false });
    }
}

fn frame_len(msg: &Message) -> u64 {
    encode_frame(msg, usize::MAX).map(|f| f.len() as u64).unwrap_or(0)
}

fn send_down(
    index: &HashMap<String, usize>,
    clients: &mut [VirtualClient],
    queue: &mut Queue,
    now: Duration,
    to: &str,
    msg: Message,
) {
    let Some(&i) = index.get(to) else { return };
    let bytes = frame_len(&msg);
    let at = clients[i].down.carry(now, bytes);
    queue.push(at, Event::ToClient { to: i, msg, wire: wire_bytes(bytes), conn: clients[i].conn });
}

/// Carries out client `i`'s session's actions at `now`; the cost records it completes go to
/// `completed`.
fn drive_client(
    i: usize,
    now: Duration,
    c: &mut VirtualClient,
    queue: &mut Queue,
    trainer: &mut Trainer,
    completed: &mut Vec<(usize, CostRecord)>,
) {
    while let Some(action) = c.session.poll_action() {
        match action {
            SessionAction::Send(msg) => {
                let at = c.up.carry(now, frame_len(&msg));
                queue.push(at, Event::ToServer { from: i, msg, conn: c.conn });
            }
            SessionAction::Train(b) => match c.power.decide(now) {
                Ok(()) => trainer.start(i, c, now, b, queue),
                // The session queues the decline; this loop sends it.
                Err(decline) => c.session.declined(b.round, decline.kind(), &decline.to_string()),
            },
            SessionAction::Upload(update) => upload(i, now, c, queue, update.round, Message::Update(update)),
            SessionAction::UploadMasked { round, msg } => upload(i, now, c, queue, round, msg),
            SessionAction::Cost(record) => completed.push((i, record)),
            SessionAction::Persist(_) | SessionAction::SetAsidePending { .. } | SessionAction::Finished { .. } => {}
        }
    }
}

/// Sends an upload (an update, or a masked vector under secure aggregation) as a transfer over
/// client `i`'s link: the session hears what it took, the server gets it when the last byte is in.
fn upload(i: usize, now: Duration, c: &mut VirtualClient, queue: &mut Queue, round: u64, msg: Message) {
    let bytes = frame_len(&msg);
    let (at, wire_bytes) = c.up.carry_transfer(now, bytes, c.resume_uploads);
    // The link model knows at once when the last byte arrives.
    let measure = UploadMeasure { wire_bytes, transfer: at - now, rtt: Duration::ZERO };
    c.session.uploaded(at, round, measure);
    queue.push(at, Event::ToServer { from: i, msg, conn: c.conn });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DataConfig, FederationConfig, SystemsConfig};
    use crate::device::{self, OnOff};
    use crate::network::LinkPreset;

    fn config(flaky: DeviceProfile) -> SimConfig {
        let steady =
            DeviceProfile { name: "steady".into(), compute_scale: 0.0, share: 2.0, ..DeviceProfile::default() };
        SimConfig {
            federation: FederationConfig {
                clients: 3,
                rounds: 4,
                seed: 21,
                local_epochs: 1,
                min_available: Some(2),
                ..Default::default()
            },
            data: DataConfig { train_per_class: 20, test_per_class: 5, ..Default::default() },
            systems: SystemsConfig {
                link: Some(LinkPreset::Lte),
                devices: vec![steady, DeviceProfile { name: "flaky".into(), compute_scale: 0.0, share: 1.0, ..flaky }],
                ..Default::default()
            },
            ..SimConfig::default()
        }
    }

    fn clients_of(result: &SimResult, round: u64) -> Vec<String> {
        let report = result.reports.iter().find(|r| r.round == round).expect("round report");
        report.updates.iter().map(|u| u.client.to_string()).collect()
    }

    /// Trainings run on every core by default; the accuracy records are the same to
    /// the bit on one thread or several (a training sees only its own client and the broadcast).
    #[test]
    fn one_thread_or_several_give_the_same_run() {
        let on = |threads| SimConfig {
            federation: FederationConfig { clients: 6, rounds: 3, seed: 5, local_epochs: 1, ..Default::default() },
            data: DataConfig { train_per_class: 20, test_per_class: 5, ..Default::default() },
            systems: SystemsConfig { threads, ..Default::default() },
            ..SimConfig::default()
        };
        let one = run_virtual(&on(1)).unwrap();
        for threads in [2, 3] {
            let several = run_virtual(&on(threads)).unwrap();
            assert_eq!(one.accuracy, several.accuracy, "{threads} threads");
            let weights = |r: &SimResult| -> Vec<Vec<u64>> {
                r.reports.iter().map(|p| p.updates.iter().map(|u| u.num_samples).collect()).collect()
            };
            assert_eq!(weights(&one), weights(&several));
        }
    }

    #[test]
    fn a_device_away_in_round_two_by_its_trace_misses_it_and_returns() {
        // Rounds take about 3.3 simulated s on LTE (round 2 from about 3.3 s); the flaky device is
        // away from 4 s to 10 s, and round 2 closes at its 5 s deadline without it.
        let path = std::env::temp_dir().join(format!("anchorage-vc-trace-{}.csv", std::process::id()));
        std::fs::write(&path, "start_seconds,end_seconds\n10,1000\n0,4\n").unwrap();
        let flaky = DeviceProfile { availability_trace: Some(path.clone()), ..DeviceProfile::default() };
        let mut c = config(flaky);
        c.federation.round_deadline_secs = 5.0;
        c.federation.rounds = 6;
        c.federation.min_available = Some(3);
        let result = run_virtual(&c).unwrap();
        let _ = std::fs::remove_file(&path);
        let fleet = device::assign(&c.systems.devices, c.federation.clients, c.federation.seed);
        let flaky = client_id(fleet.iter().position(|d| d.name == "flaky").unwrap());
        let report = |round: u64| result.reports.iter().find(|r| r.round == round).unwrap();
        assert!(report(2).started < Duration::from_secs(4) && report(2).closed > Duration::from_secs(4));
        assert!(clients_of(&result, 1).contains(&flaky), "in round 1: {:?}", clients_of(&result, 1));
        assert!(!clients_of(&result, 2).contains(&flaky), "away in round 2: {:?}", clients_of(&result, 2));
        assert_eq!(clients_of(&result, 2).len(), 2, "the others carry round 2");
        assert!(report(2).closed < Duration::from_secs(10), "round 2 closed while the device was away");
        let back = (3..=c.federation.rounds).find(|&r| clients_of(&result, r).contains(&flaky));
        assert!(back.is_some(), "aggregated again after it returns: {:?}", result.reports);
        assert!(result.summary.rounds.iter().all(|r| r.outcome == "aggregated"));
    }

    #[test]
    fn an_on_off_cycle_still_runs_and_a_bad_trace_fails_before_the_run() {
        let cycle =
            DeviceProfile { on_off: Some(OnOff { on_seconds: 4.0, off_seconds: 1.0 }), ..DeviceProfile::default() };
        let result = run_virtual(&config(cycle)).unwrap();
        assert_eq!(result.summary.rounds.len(), 4);
        let bad =
            DeviceProfile { availability_trace: Some("/nonexistent/trace.csv".into()), ..DeviceProfile::default() };
        let err = format!("{:#}", run_virtual(&config(bad)).unwrap_err());
        assert!(err.contains("reading availability trace /nonexistent/trace.csv"), "{err}");
    }

    #[test]
    fn a_device_away_at_the_start_joins_when_its_trace_begins() {
        let path = std::env::temp_dir().join(format!("anchorage-vc-late-{}.csv", std::process::id()));
        std::fs::write(&path, "start_seconds,end_seconds\n3,1000\n").unwrap();
        let late = DeviceProfile { availability_trace: Some(path.clone()), ..DeviceProfile::default() };
        let c = config(late);
        let result = run_virtual(&c).unwrap();
        let _ = std::fs::remove_file(&path);
        let fleet = device::assign(&c.systems.devices, c.federation.clients, c.federation.seed);
        let late = client_id(fleet.iter().position(|d| d.name == "flaky").unwrap());
        assert!(!clients_of(&result, 1).contains(&late), "away in round 1: {:?}", clients_of(&result, 1));
        assert!((2..=c.federation.rounds).any(|r| clients_of(&result, r).contains(&late)), "joins later");
    }
}

#[cfg(test)]
mod outage_tests {
    use super::*;
    use crate::network::{LinkPreset, Outage};

    /// 3g's uplink, dark for 20 s every 60 s from 60 s.
    fn flaky_3g() -> LinkProfile {
        let outages =
            (0..40).map(|k| Outage { start_ms: 60_000 + 60_000 * k, duration_ms: 20_000, every_ms: None }).collect();
        LinkProfile { outages, ..LinkPreset::ThreeG.profile().up }
    }

    /// A 20 MB broadcast over 3g's downlink, dark 40 s every 80 s (`benches/outages`): the device
    /// that resumes broadcasts gets the round's model sooner and for fewer bytes than one that
    /// receives it again from the start after each connection the outages end. Before the
    /// virtual clock modelled it, an outage only delayed a broadcast's start, and both were alike.
    #[test]
    fn a_broadcast_broken_off_by_outages_resumes_or_is_received_again() {
        let run = |text: &str| {
            let config: SimConfig = toml::from_str(text).unwrap();
            let result = run_virtual(&config).unwrap();
            let record = result.ledger.iter().find(|r| !r.dropped).expect("the device's cost record").clone();
            (record.wire_down as f64 / record.payload_down as f64, result.reports[0].closed.as_secs_f64())
        };
        let (resumed, resumed_round) = run(include_str!("../../benches/outages/broadcast-3g-resume.toml"));
        let (again, again_round) = run(include_str!("../../benches/outages/broadcast-3g-restart.toml"));
        println!(
            "20 MB broadcast over 3g with outages: resumed {resumed:.3}x, round {resumed_round:.0} s; received again {again:.3}x, round {again_round:.0} s"
        );
        assert!(resumed <= 1.15, "resumed: {resumed:.3}x the payload down");
        assert!(again > 1.5 && again_round > resumed_round, "received again: {again:.3}x, {again_round:.0} s");
    }

    #[test]
    fn an_upload_broken_off_by_outages_resumes_or_starts_again() {
        let bytes = 20_000_000;
        let (resumed_at, resumed_wire) = Path::new(flaky_3g(), 7).carry_transfer(Duration::ZERO, bytes, true);
        let (restarted_at, restarted_wire) = Path::new(flaky_3g(), 7).carry_transfer(Duration::ZERO, bytes, false);
        let clean = Path::new(LinkPreset::ThreeG.profile().up, 7).carry(Duration::ZERO, bytes);
        println!(
            "20 MB over 3g, dark 20 s every 60 s: resumed {:.0} s, {:.3}x on the wire; started again {:.0} s, {:.3}x; no outage {:.0} s",
            resumed_at.as_secs_f64(),
            resumed_wire as f64 / bytes as f64,
            restarted_at.as_secs_f64(),
            restarted_wire as f64 / bytes as f64,
            clean.as_secs_f64()
        );
        assert!(resumed_wire as f64 <= 1.15 * bytes as f64, "resumed: {resumed_wire} B on the wire");
        assert!(restarted_wire as f64 > 2.0 * bytes as f64, "started again: {restarted_wire} B on the wire");
        assert!(clean < resumed_at && resumed_at < restarted_at);
        // A transfer that no outage breaks off costs what `carry` charges.
        let (at, wire) = Path::new(LinkPreset::ThreeG.profile().up, 7).carry_transfer(Duration::ZERO, bytes, true);
        assert_eq!((at, wire), (clean, wire_bytes(bytes)));
    }

    /// Repeating outages that leave no gap long enough for the whole frame: the one-frame upload
    /// never gets through, and the loop ends after a simulated day instead of running forever;
    /// the resumable one gets through.
    #[test]
    fn an_upload_that_never_fits_between_repeating_outages_is_given_up_on() {
        // 3g dark 20 s of every minute: the device reconnects about 30 s after each cut (past the
        // server's stall), which leaves about 30 s before the next; 2 MB takes 33 s at 0.5 Mbit/s.
        let outage = Outage { start_ms: 10_000, duration_ms: 20_000, every_ms: Some(60_000) };
        let profile = LinkProfile { outages: vec![outage], ..LinkPreset::ThreeG.profile().up };
        let bytes = 2_000_000;
        let (at, wire) = Path::new(profile.clone(), 7).carry_transfer(Duration::ZERO, bytes, false);
        assert!(at >= GIVE_UP && at < GIVE_UP + Duration::from_secs(60), "{at:?}");
        assert!(wire > 10 * bytes, "a day of attempts: {wire} B");
        let (at, wire) = Path::new(profile, 7).carry_transfer(Duration::ZERO, bytes, true);
        assert!(at < Duration::from_secs(3600) && (wire as f64) < 1.3 * bytes as f64, "{at:?} {wire}");
    }

    #[test]
    fn quic_probes_back_off_through_an_outage() {
        let s = Duration::from_secs;
        // With a 1 s probe timeout, probes go 1, 3, 7, 15, 31 s after the cut: a 20 s outage is
        // answered at 31 s, past the server's 30 s stall; a 10 s one at 15 s.
        assert_eq!(first_probe_after(s(100), s(120), s(1)), s(131));
        assert_eq!(first_probe_after(s(100), s(110), s(1)), s(115));
        assert_eq!(first_probe_after(s(100), s(100), s(1)), s(101));
        // A 190 ms round trip: 310 ms; probes at 310 ms × (2^k − 1), so a 20 s outage is answered
        // at 39.4 s (127 × 310 ms), past the stall.
        let pto = probe_timeout(Duration::from_millis(190));
        assert_eq!(pto, Duration::from_millis(310));
        assert_eq!(first_probe_after(s(0), s(20), pto), pto * 127);
    }
}
