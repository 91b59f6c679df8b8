//! The trainer pool: trainings run on threads while the clock goes on, and land as events.

use std::collections::HashMap;
use std::time::Duration;

use anchorage_client::methods::{ClientMethod, Trained};
use anchorage_shared::protocol::Broadcast;
use anyhow::Context;

use super::client::VirtualClient;
use super::events::{Event, Queue};

/// Trains the sampled clients on a pool of threads, deterministically. A training sees only its
/// own client's method and the broadcast, so it can run while the clock handles other clients'
/// events; its result lands as a `Trained` event at its start time plus its measured compute
/// time, before the clock handles anything that could see it (an engine event, or an event for
/// that client). With one thread (or a single-core host) it trains in place, as the clock
/// always did.
pub(super) struct Trainer {
    pool: Option<rayon::ThreadPool>,
    done_tx: std::sync::mpsc::Sender<Landed>,
    done_rx: std::sync::mpsc::Receiver<Landed>,
    /// Client → (start time, round, life) of its training in flight.
    in_flight: HashMap<usize, (Duration, u64, u64)>,
}

/// A training's outcome and the device's compute time, with the method it borrowed.
struct Landed {
    client: usize,
    method: Box<dyn ClientMethod>,
    result: Result<(Trained, Duration), String>,
}

impl Trainer {
    pub(super) fn new(threads: usize) -> anyhow::Result<Self> {
        let pool = if threads > 1 {
            Some(rayon::ThreadPoolBuilder::new().num_threads(threads).thread_name(|i| format!("train-{i}")).build()?)
        } else {
            None
        };
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        Ok(Self { pool, done_tx, done_rx, in_flight: HashMap::new() })
    }

    /// Client `i` trains on `b` from `now`.
    pub(super) fn start(&mut self, i: usize, c: &mut VirtualClient, now: Duration, b: Broadcast, queue: &mut Queue) {
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
                    let result = method.train_measured(&b).map_err(|e| e.to_string());
                    let _ = tx.send(Landed { client: i, method, result });
                });
            }
            None => {
                let result = method.train_measured(&b).map_err(|e| e.to_string());
                land(c, i, method, result, now, round, queue);
            }
        }
    }

    /// Whether the next event (or the engine's deadline `timeout`) could see a training in flight.
    pub(super) fn must_land(&self, queue: &Queue, timeout: Option<Duration>) -> bool {
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
    pub(super) fn land_all(&mut self, clients: &mut [VirtualClient], queue: &mut Queue) -> anyhow::Result<()> {
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
    result: Result<(Trained, Duration), String>,
    started: Duration,
    round: u64,
    queue: &mut Queue,
) {
    c.method = Some(method);
    // The device model charged it (host CPU time × its scale): `SimulatedDevice::train_measured`;
    // a throttled device takes longer (`crate::power`).
    let result = result.map(|(trained, compute)| (trained, c.power.train(started, round, compute)));
    let compute = result.as_ref().map_or(Duration::ZERO, |(_, compute)| *compute);
    queue.push(started + compute, Event::Trained { client: i, life: c.life, round, result });
}
