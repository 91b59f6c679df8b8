//! The virtual clients: each method with its session, device, availability, power model and
//! links, and how the clock carries out what a session asks (messages, trainings, uploads).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anchorage_client::methods::ClientMethod;
use anchorage_client::session::{Session, SessionAction, UploadMeasure};
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::{Capabilities, Message};
use anchorage_shared::rng::Rng;

use super::events::{Event, Queue};
use super::quic::{Path, frame_len, wire_bytes};
use super::trainer::Trainer;
use crate::config::SimConfig;
use crate::device::{Availability, DeviceProfile};
use crate::setup::client_id;

pub(super) struct VirtualClient {
    pub(super) session: Session,
    pub(super) device: Arc<DeviceProfile>,
    /// When the device is reachable (on its own timeline, `phase` ahead of the simulated clock).
    pub(super) availability: Availability,
    pub(super) phase: Duration,
    pub(super) rng: Rng,
    pub(super) online: bool,
    /// Incremented whenever the device goes away or comes back: messages in flight across such a
    /// change are lost.
    pub(super) conn: u64,
    /// Incremented by every crash: results of an earlier life are discarded.
    pub(super) life: u64,
    /// `None` while the method trains on the pool ([`Trainer`]).
    pub(super) method: Option<Box<dyn ClientMethod>>,
    /// Uploads resume after an outage breaks them off (`SystemsConfig::resume_uploads`).
    pub(super) resume_uploads: bool,
    /// So do broadcasts larger than a chunk (`SystemsConfig::resume_broadcasts`).
    pub(super) resume_broadcasts: bool,
    /// Battery, temperature and eligibility.
    pub(super) power: crate::power::Power,
    pub(super) up: Path,
    pub(super) down: Path,
}

impl VirtualClient {
    /// The device's window of availability that holds `now`, or else the next one, on the
    /// simulated clock: (start, end; `None`: it never ends).
    pub(super) fn window(&self, now: Duration) -> (Duration, Option<Duration>) {
        let (start, end) = self.availability.window(now + self.phase);
        (start.saturating_sub(self.phase), end.map(|e| e.saturating_sub(self.phase)))
    }
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
pub(super) fn virtual_clients<M: ClientMethod + 'static>(
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

/// Queues a reachable device's departure at the end of its window, back at the start of the next.
pub(super) fn schedule_departure(client: usize, c: &VirtualClient, now: Duration, queue: &mut Queue) {
    if let (_, Some(end)) = c.window(now) {
        let (back, _) = c.window(end);
        queue.push(end, Event::Offline { client, back_after: back.saturating_sub(end), crash: false });
    }
}

pub(super) fn send_down(
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
pub(super) fn drive_client(
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
