//! The virtual clock (FedScale's idea, with Anchorage's link model): a discrete-event loop that
//! drives the same sans-IO [`Engine`] and client [`Session`]s as the real transport, with no
//! socket and no sleeping. Training runs for real and is charged to the simulated clock as the
//! measured host seconds times `compute_scale` (the device's slowness); every message is charged
//! to its client's uplink or downlink by the same [`Link`] model that shapes real QUIC.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::time::{Duration, Instant};

use anchorage_client::methods::ClientMethod;
use anchorage_client::session::{Session, SessionAction};
use anchorage_server::engine::{Action, Engine};
use anchorage_server::methods::FedAvg;
use anchorage_shared::frame::encode_frame;
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::{Capabilities, Message};
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::payload_bytes;

use crate::device::{Charge, DeviceProfile};
use crate::network::{Link, LinkProfile};
use crate::record::{RoundRow, RunSummary, SummaryInputs};
use crate::run::{SimConfig, SimResult};
use crate::setup::{Setup, client_id};

/// Payload bytes a QUIC packet carries, and the bytes of headers, framing and AEAD tag around it
/// (measured on loopback: about 3% over the payload for a 1 MB upload).
const PACKET_PAYLOAD: u64 = 1200;
const PACKET_OVERHEAD: u64 = 40;

/// Wire bytes of a frame of `bytes` under the packet model.
pub fn wire_bytes(bytes: u64) -> u64 {
    bytes + bytes.div_ceil(PACKET_PAYLOAD) * PACKET_OVERHEAD
}

enum Event {
    ToServer {
        from: usize,
        msg: Message,
    },
    /// `bytes`: the frame's length, computed once per message (once per broadcast, not per client).
    ToClient {
        to: usize,
        msg: Message,
        bytes: u64,
    },
    /// Training finished; `life` tells whether the process that trained still runs.
    Trained {
        client: usize,
        life: u64,
        round: u64,
        result: Result<anchorage_shared::protocol::Update, String>,
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

    fn pop(&mut self) -> Option<(Duration, Event)> {
        let Reverse((t, seq)) = self.heap.pop()?;
        self.events.remove(&seq).map(|e| (t, e))
    }
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
}

struct VirtualClient {
    session: Session,
    capabilities: Capabilities,
    device: DeviceProfile,
    rng: Rng,
    online: bool,
    /// Incremented by every crash: results of an earlier life are discarded.
    life: u64,
    method: Box<dyn ClientMethod>,
    up: Path,
    down: Path,
    /// Cost of the round in flight, and when its broadcast arrived.
    costs: HashMap<u64, (CostRecord, Duration)>,
}

/// Runs the federation of `config` on the virtual clock.
pub fn run_virtual(config: &SimConfig) -> anyhow::Result<SimResult> {
    run_virtual_with_progress(config, false)
}

/// [`run_virtual`], with a progress bar (rounds, simulated time, ETA) on the terminal.
pub fn run_virtual_with_progress(config: &SimConfig, progress: bool) -> anyhow::Result<SimResult> {
    let bar = if progress { indicatif::ProgressBar::new(config.rounds) } else { indicatif::ProgressBar::hidden() };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} round {pos}/{len} [{bar:30}] {elapsed_precise} eta {eta} {msg}",
        )?
        .progress_chars("=> "),
    );
    let started = Instant::now();
    let Setup { spec, engine: engine_config, initial, clients, devices, train_len: _, test_len: _, evaluator } =
        Setup::new(config, Charge::Report)?;
    let mut engine = Engine::new(engine_config, Box::new(FedAvg::default()), initial.clone());
    let links = config.links()?;
    let mut clients: Vec<VirtualClient> = clients
        .into_iter()
        .enumerate()
        .map(|(i, method)| {
            let profile = links[i].clone().unwrap_or_default();
            let mut methods = heapless::Vec::new();
            let _ = methods.push(heapless::String::try_from(method.name()).unwrap_or_default());
            let capabilities = Capabilities { backend: "virtual".into(), memory_mb: 1024, methods };
            let session = Session::new(client_id(i), capabilities.clone(), method.num_samples(), None);
            let seed = config.seed.wrapping_add(5000 + i as u64);
            Ok(VirtualClient {
                session,
                capabilities,
                device: devices[i].clone(),
                rng: Rng::derive(seed, 0xC4A5),
                online: true,
                life: 0,
                method: Box::new(method) as Box<dyn ClientMethod>,
                up: Path::new(profile.up, seed),
                down: Path::new(profile.down, seed ^ 0x5EED_D0A1),
                costs: HashMap::new(),
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let index: HashMap<String, usize> = (0..clients.len()).map(|i| (client_id(i), i)).collect();

    let initial_accuracy = evaluator.accuracy(&initial)?;
    let mut queue = Queue::default();
    let mut now = Duration::ZERO;
    let mut rows = Vec::new();
    let mut reports = Vec::new();
    let mut ledger = Vec::new();
    let mut finished = false;

    for (i, c) in clients.iter_mut().enumerate() {
        c.session.connected();
        // Devices on an availability cycle start at a random phase of it.
        if let Some(cycle) = c.device.on_off {
            let first_off = Duration::from_secs_f64(cycle.on_seconds.max(0.0) * c.rng.f64());
            queue.push(
                first_off,
                Event::Offline {
                    client: i,
                    back_after: Duration::from_secs_f64(cycle.off_seconds.max(0.0)),
                    crash: false,
                },
            );
        }
    }
    for i in 0..clients.len() {
        drive_client(i, now, &mut clients, &mut queue);
    }
    loop {
        // The engine's deadline fires before the next event, if it comes first.
        let next = queue.peek_time();
        if let Some(deadline) = engine.poll_timeout()
            && next.is_none_or(|t| deadline <= t)
        {
            now = now.max(deadline);
            engine.handle_timeout(now);
        } else if let Some((t, event)) = queue.pop() {
            now = t;
            match event {
                Event::ToServer { from, msg } => engine.handle_message(now, &client_id(from), msg),
                Event::ToClient { to, msg, bytes } => {
                    let c = &mut clients[to];
                    if !c.online {
                        continue; // unreachable: the datagrams are lost
                    }
                    if matches!(msg, Message::Broadcast(_))
                        && c.device.crash_probability > 0.0
                        && c.rng.f64() < c.device.crash_probability
                    {
                        let back_after = Duration::from_secs_f64(c.device.rejoin_seconds.max(0.0));
                        queue.push(now, Event::Offline { client: to, back_after, crash: true });
                        continue;
                    }
                    match &msg {
                        Message::Broadcast(b) => {
                            let cost = CostRecord {
                                client: client_id(to),
                                round: b.round,
                                payload_down: payload_bytes(&b.blocks) as u64,
                                wire_down: wire_bytes(bytes),
                                ..CostRecord::default()
                            };
                            c.costs.entry(b.round).or_insert((cost, now));
                        }
                        Message::Ack(ack) => {
                            if let Some((mut cost, at)) = c.costs.remove(&ack.round) {
                                cost.wall_seconds = (now - at).as_secs_f64();
                                cost.straggler = !ack.aggregated;
                                cost.wait_seconds =
                                    (cost.wall_seconds - cost.compute_seconds - cost.transfer_seconds).max(0.0);
                                cost.joules = devices[to].joules(cost.compute_seconds, cost.transfer_seconds);
                                ledger.push(cost);
                            }
                        }
                        _ => {}
                    }
                    let _ = c.session.handle_message(msg);
                    drive_client(to, now, &mut clients, &mut queue);
                }
                Event::Offline { client, back_after, crash } => {
                    let c = &mut clients[client];
                    if c.online {
                        c.online = false;
                        engine.handle_disconnect(now, &client_id(client));
                        if crash {
                            // The process restarts: a new session from what the store kept.
                            c.life += 1;
                            let pending = c.session.pending().cloned();
                            c.session = Session::new(
                                client_id(client),
                                c.capabilities.clone(),
                                c.method.num_samples(),
                                pending,
                            );
                        } else {
                            c.session.disconnected();
                        }
                        if !finished {
                            queue.push(now + back_after, Event::Online { client });
                        }
                    }
                }
                Event::Online { client } => {
                    let c = &mut clients[client];
                    if !c.online {
                        c.online = true;
                        c.session.connected();
                        if let Some(cycle) = c.device.on_off.filter(|_| !finished) {
                            let off = Duration::from_secs_f64(cycle.off_seconds.max(0.0));
                            queue.push(
                                now + Duration::from_secs_f64(cycle.on_seconds.max(0.0)),
                                Event::Offline { client, back_after: off, crash: false },
                            );
                        }
                        drive_client(client, now, &mut clients, &mut queue);
                    }
                }
                Event::Trained { client, life, .. } if life != clients[client].life => {}
                Event::Trained { client, life: _, round, result } => {
                    let c = &mut clients[client];
                    match result {
                        Ok(update) => c.session.trained(update),
                        Err(e) => c.session.training_failed(round, &e),
                    }
                    drive_client(client, now, &mut clients, &mut queue);
                }
            }
        } else {
            break;
        }
        while let Some(action) = engine.poll_action() {
            match action {
                Action::Send { to, msg } => send_down(&index, &mut clients, &mut queue, now, &to, msg),
                Action::Close { client, refusal } => {
                    send_down(&index, &mut clients, &mut queue, now, &client, Message::Refusal(refusal))
                }
                Action::Broadcast { to, msg } => {
                    let bytes = frame_len(&msg);
                    for client in to {
                        if let Some(&i) = index.get(&client) {
                            let at = clients[i].down.carry(now, bytes);
                            queue.push(at, Event::ToClient { to: i, msg: (*msg).clone(), bytes });
                        }
                    }
                }
                // The sim keeps the clients' own cost records; a dropped client's record comes from the engine.
                Action::Ledger(record) => {
                    if record.dropped {
                        ledger.push(record);
                    }
                }
                Action::Persist(_) => {}
                Action::RoundClosed(report, checkpoint) => {
                    let accuracy = evaluator.accuracy(&checkpoint.global)?;
                    rows.push(RoundRow::from_report(&report, accuracy, &[]));
                    reports.push((*report).clone());
                    bar.inc(1);
                    bar.set_message(format!("simulated {:.0} s, acc {:.1}%", now.as_secs_f64(), accuracy * 100.0));
                }
                Action::Finished => finished = true,
            }
        }
        if finished && queue.peek_time().is_none() {
            break;
        }
    }

    // Acks of a round's last updates arrive after it closed: total the wire bytes at the end.
    for row in rows.iter_mut() {
        let costs = ledger.iter().filter(|c| c.round == row.round);
        (row.wire_up, row.wire_down) = costs.fold((0, 0), |(u, d), c| (u + c.wire_up, d + c.wire_down));
    }
    let inputs = SummaryInputs {
        initial_accuracy,
        chance: 1.0 / spec.num_classes as f64,
        late_updates: reports.last().map(|r| r.late_total).unwrap_or(0),
        refused: engine.stats().refused,
        decode_errors: 0,
        wall_seconds: started.elapsed().as_secs_f64(),
    };
    let summary = RunSummary::new(inputs, rows, &ledger);
    bar.finish_and_clear();
    tracing::info!(simulated = ?now, wall = summary.wall_seconds, "virtual run finished");
    Ok(SimResult { summary, ledger, reports, run_dir: None, link_stats: Vec::new() })
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
    queue.push(at, Event::ToClient { to: i, msg, bytes });
}

/// Carries out a client session's actions at `now`.
fn drive_client(i: usize, now: Duration, clients: &mut [VirtualClient], queue: &mut Queue) {
    let c = &mut clients[i];
    while let Some(action) = c.session.poll_action() {
        match action {
            SessionAction::Send(msg) => {
                let at = c.up.carry(now, frame_len(&msg));
                queue.push(at, Event::ToServer { from: i, msg });
            }
            SessionAction::Train(b) => {
                let round = b.round;
                // The device wrapper reports the device's compute seconds (host time × its scale).
                let result = c.method.train(&b).map_err(|e| e.to_string());
                let compute = Duration::from_secs_f64(result.as_ref().map(|u| u.compute_seconds).unwrap_or(0.0));
                if let Some((cost, _)) = c.costs.get_mut(&round) {
                    cost.compute_seconds = compute.as_secs_f64();
                }
                queue.push(now + compute, Event::Trained { client: i, life: c.life, round, result });
            }
            SessionAction::Upload(update) => {
                let msg = Message::Update(update);
                let bytes = frame_len(&msg);
                let at = c.up.carry(now, bytes);
                if let Message::Update(u) = &msg
                    && let Some((cost, _)) = c.costs.get_mut(&u.round)
                {
                    cost.payload_up = payload_bytes(&u.blocks) as u64;
                    cost.wire_up = wire_bytes(bytes);
                    cost.transfer_seconds = (at - now).as_secs_f64();
                }
                queue.push(at, Event::ToServer { from: i, msg });
            }
            SessionAction::Persist(_) | SessionAction::Finished { .. } => {}
        }
    }
}
