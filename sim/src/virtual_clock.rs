//! The virtual clock (FedScale's idea, with Anchorage's link model): a discrete-event loop that
//! drives the same sans-IO [`Engine`] and client [`Session`]s as the real transport, with no
//! socket and no sleeping. Training runs for real and is charged to the simulated clock as the
//! measured host seconds times `compute_scale` (the device's slowness); every message is charged
//! to its client's uplink or downlink by the same [`Link`] model that shapes real QUIC.
//!
//! The rooms: the event queue ([`events`]), the model of QUIC's timing ([`quic`]), the virtual
//! clients and how their sessions are driven ([`client`]), the trainer pool ([`trainer`]), the
//! rows waiting for their acks ([`live`]), the run itself ([`run`]), a relay tier ([`tier`],
//! driven from the run by [`uplinks`], its relays' restarts from their stores in [`restart`]),
//! and what a watcher sees of a run ([`watch`], for `anchorage swarm`).
//!
//! [`Engine`]: anchorage_server::engine::Engine
//! [`Session`]: anchorage_client::session::Session
//! [`Link`]: crate::network::Link

mod client;
mod events;
mod live;
pub(crate) mod quic;
mod restart;
mod run;
#[cfg(test)]
mod tests;
mod tier;
mod trainer;
mod uplinks;
mod watch;

pub use quic::wire_bytes;
pub use tier::UplinkCounts;
pub use watch::{Mutation, Seen, Step, WatchOptions};

use std::time::Instant;

use crate::config::SimConfig;
use crate::record::SimResult;
use crate::recorder::Recorder;
use run::VirtualRun;

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

/// [`run_virtual`] with a watcher: after every step (an event, a deadline or trainings that
/// land) `watcher` gets what the engines promised in it, and may end the run (`Break`: the
/// result is then `None`). `options`: a stand-in for a bug, for the checkers' own tests, and the
/// faults only a watched run injects. Returns the result and the messages sent again.
pub fn run_virtual_watched(
    config: &SimConfig,
    options: WatchOptions,
    mut watcher: impl FnMut(Step) -> std::ops::ControlFlow<()>,
) -> anyhow::Result<(Option<SimResult>, u64)> {
    let started = Instant::now();
    let mut recorder = Recorder::silent();
    let mut run = VirtualRun::new(config, &mut recorder)?;
    run.watch = Some(watch::Watch::new(options));
    run.start();
    let mut number = 0;
    loop {
        let more = run.step(&mut recorder);
        number += 1;
        // The watcher sees what a failing step did before the run reports its error.
        let seen = run.watch.as_mut().map(|w| std::mem::take(&mut w.seen)).unwrap_or_default();
        let duplicated = run.watch.as_ref().map_or(0, |w| w.duplicated);
        if watcher(Step { number, now: run.now, seen: &seen }).is_break() {
            return Ok((None, duplicated));
        }
        if !more? {
            break;
        }
    }
    let duplicated = run.watch.as_ref().map_or(0, |w| w.duplicated);
    Ok((Some(run.finish(config, &mut recorder, started)?), duplicated))
}
