//! Device profiles: how fast a simulated client computes, what it draws, and whether it straggles.
//!
//! Both clocks use [`SimulatedDevice`], a wrapper around a client's method: it applies FedEvolve's
//! straggler definition (with probability `straggler_ratio` a client runs a uniform random number
//! of local epochs in 1..τ instead of τ) and charges `compute_scale` × the host's measured compute
//! time — on the real clock by sleeping the difference, on the virtual clock by advancing
//! simulated time (the wrapper only reports the charged seconds).

use anchorage_shared::MetricKey;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anchorage_client::methods::{ClientMethod, TrainError, Trained};
use anchorage_shared::protocol::{Broadcast, Metric};
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::ParamBlock;
use anyhow::Context;
use serde::{Deserialize, Serialize};

/// A kind of device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeviceProfile {
    pub name: String,
    /// Compute seconds on this device per second on the simulating host (2.0: twice as slow).
    pub compute_scale: f64,
    /// Simulated seconds each local epoch takes on this device, whatever the host measures
    /// (a figure measured on the device; runs whose timing does not depend on the host).
    /// Overrides `compute_scale`.
    pub compute_seconds: Option<f64>,
    /// Power drawn while computing, in watts (energy estimate).
    pub compute_watts: f64,
    /// Power drawn by the radio while transferring, in watts.
    pub radio_watts: f64,
    /// Share of the fleet with this profile (weights need not sum to 1).
    pub share: f64,
    /// Virtual clock: chance that the device crashes when a round's broadcast reaches it (the
    /// round's work is lost; the process restarts from its store).
    pub crash_probability: f64,
    /// Seconds a crashed device stays away before it rejoins.
    pub rejoin_seconds: f64,
    /// Virtual clock: the device is reachable `on_seconds`, then away `off_seconds`, repeatedly,
    /// from a random phase (e.g. a board that sleeps or loses power on a schedule).
    pub on_off: Option<OnOff>,
    /// Virtual clock: a CSV file of the intervals when the device is reachable (FedScale-style
    /// availability trace): header `start_seconds,end_seconds`, one interval per line, in any
    /// order, in simulated seconds from the start of the run (fields may be quoted; blank and `#` lines are skipped;
    /// relative paths: from the working directory). The trace repeats every `trace_period_seconds`, by default its last end. Every
    /// device of the profile follows the same trace. Excludes `on_off`.
    pub availability_trace: Option<PathBuf>,
    /// Period of `availability_trace` (at least its last end).
    pub trace_period_seconds: Option<f64>,
    /// Virtual clock: a battery that drains while training and charges on a schedule
    /// ([`crate::power`]); none: mains-powered.
    pub battery: Option<crate::power::BatteryModel>,
    /// Virtual clock: heating under load and throttling ([`crate::power`]); none: never hot.
    pub thermal: Option<crate::power::ThermalModel>,
    /// Virtual clock: when the device may train, as client.toml's `[eligibility]`; an invited
    /// device that may not declines. Empty: always.
    pub eligibility: anchorage_client::eligibility::Eligibility,
}

/// An availability cycle.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OnOff {
    pub on_seconds: f64,
    pub off_seconds: f64,
}

/// When a device is reachable, on its own timeline (the virtual clock adds a phase). The cycle
/// and the trace share one code path: a list of windows repeated with a period.
#[derive(Debug, Clone, PartialEq)]
pub enum Availability {
    Always,
    /// On from 0 to `on_seconds`, then off until `on_seconds + off_seconds`, repeated. Build it
    /// with [`Availability::cycle`]; an unchecked cycle with no on-time counts as always on.
    Cycle(OnOff),
    /// Reachable in these windows (sorted, disjoint, non-empty, within one period), repeated
    /// every period. Build it with [`Availability::read_trace`] or [`Availability::parse_trace`].
    Trace(Vec<(Duration, Duration)>, Duration),
}

/// The header of an availability trace file.
pub const TRACE_HEADER: &str = "start_seconds,end_seconds";

impl Availability {
    /// A checked on/off cycle (finite, non-negative seconds; some on-time).
    pub fn cycle(cycle: OnOff) -> anyhow::Result<Self> {
        for (name, v) in [("on_seconds", cycle.on_seconds), ("off_seconds", cycle.off_seconds)] {
            anyhow::ensure!(v.is_finite() && v >= 0.0, "on_off: {name} must be a finite number ≥ 0, not {v}");
            Duration::try_from_secs_f64(v).with_context(|| format!("on_off: {name} {v} is too large"))?;
        }
        anyhow::ensure!(cycle.on_seconds > 0.0, "on_off: on_seconds must be positive (the device is never on)");
        Ok(if cycle.off_seconds == 0.0 { Self::Always } else { Self::Cycle(cycle) })
    }

    /// Reads a trace file (see [`DeviceProfile::availability_trace`]); errors name the file
    /// and the line.
    pub fn read_trace(path: &Path, period_seconds: Option<f64>) -> anyhow::Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading availability trace {}", path.display()))?;
        Self::parse_trace(&text, &path.display().to_string(), period_seconds)
    }

    /// Parses a trace's text (CSV: fields may be quoted and padded with spaces); `source` names
    /// it in errors (`source:line: ...`).
    pub fn parse_trace(text: &str, source: &str, period_seconds: Option<f64>) -> anyhow::Result<Self> {
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(false)
            .flexible(true)
            .trim(csv::Trim::All)
            .comment(Some(b'#'))
            .from_reader(text.as_bytes());
        // The line a record starts on. The reader's line count leaves out blank and comment
        // lines, and its byte offset is where it began reading, before those it skipped.
        let bytes = text.as_bytes();
        let line = |p: Option<&csv::Position>| {
            let mut at = p.map_or(0, |p| p.byte() as usize).min(bytes.len());
            while let Some(end) = bytes[at..].iter().position(|&b| b == b'\n') {
                let l = &bytes[at..at + end];
                if !(l.is_empty() || l == b"\r" || l.starts_with(b"#")) {
                    break;
                }
                at += end + 1;
            }
            1 + bytes[..at].iter().filter(|&&b| b == b'\n').count()
        };
        // Records with their line numbers; blank lines and comments (also indented ones) skipped.
        let mut records = reader.records().filter_map(|r| match r {
            Ok(r) if r.iter().all(str::is_empty) || r.get(0).is_some_and(|f| f.starts_with('#')) => None,
            Ok(r) => Some(Ok((line(r.position()), r))),
            Err(e) => Some(Err(e)),
        });
        let shown = |r: &csv::StringRecord| r.iter().collect::<Vec<_>>().join(",");
        let line_of = |e: &csv::Error| e.position().map_or(String::new(), |p| format!(":{}", line(Some(p))));
        let header: Vec<&str> = TRACE_HEADER.split(',').collect();
        match records.next() {
            Some(Ok((_, r))) if r.iter().eq(header.iter().copied()) => {}
            Some(Ok((n, r))) => {
                anyhow::bail!("{source}:{n}: expected the header `{TRACE_HEADER}`, found `{}`", shown(&r))
            }
            Some(Err(e)) => anyhow::bail!("{source}{}: {e}", line_of(&e)),
            None => anyhow::bail!("{source}: empty file, expected the header `{TRACE_HEADER}` and intervals"),
        }
        let mut windows = Vec::new();
        let mut last_end = 0.0f64;
        for record in records {
            let (n, record) = record.map_err(|e| anyhow::anyhow!("{source}{}: {e}", line_of(&e)))?;
            let (Some(start), Some(end), None) = (record.get(0), record.get(1), record.get(2)) else {
                anyhow::bail!("{source}:{n}: expected two numbers `{TRACE_HEADER}`, found `{}`", shown(&record))
            };
            let number = |name: &str, field: &str| -> anyhow::Result<f64> {
                let v: f64 =
                    field.parse().map_err(|_| anyhow::anyhow!("{source}:{n}: {name} `{field}` is not a number"))?;
                anyhow::ensure!(v.is_finite(), "{source}:{n}: {name} `{field}` is not finite");
                anyhow::ensure!(v >= 0.0, "{source}:{n}: {name} {v} is negative");
                Ok(v)
            };
            let (text_end, (start, end)) = (end, (number("start_seconds", start)?, number("end_seconds", end)?));
            anyhow::ensure!(end >= start, "{source}:{n}: end_seconds {end} is before start_seconds {start}");
            let (s, e) = (Duration::try_from_secs_f64(start), Duration::try_from_secs_f64(end));
            let (Ok(s), Ok(e)) = (s, e) else { anyhow::bail!("{source}:{n}: {text_end} seconds is too large") };
            last_end = last_end.max(end);
            windows.push((s, e));
        }
        Self::from_windows(windows, last_end, period_seconds, source)
    }

    /// The availability of a trace's windows (`last_end`: the latest end in the file), repeated
    /// every `period_seconds` (by default the latest end): empty windows dropped, the others
    /// sorted and merged; a trace that covers its whole period is [`Availability::Always`].
    fn from_windows(
        mut windows: Vec<(Duration, Duration)>,
        last_end: f64,
        period_seconds: Option<f64>,
        source: &str,
    ) -> anyhow::Result<Self> {
        let period = match period_seconds {
            Some(p) => {
                anyhow::ensure!(
                    p.is_finite() && p > 0.0 && p >= last_end,
                    "{source}: trace_period_seconds {p} must be positive and at least the trace's last end ({last_end})"
                );
                Duration::try_from_secs_f64(p)
                    .with_context(|| format!("{source}: trace_period_seconds {p} is too large"))?
            }
            None => windows.iter().map(|w| w.1).max().unwrap_or_default(),
        };
        windows.retain(|(s, e)| s < e);
        anyhow::ensure!(
            !windows.is_empty(),
            "{source}: no interval of positive length (the device is never reachable)"
        );
        windows.sort();
        let mut merged: Vec<(Duration, Duration)> = Vec::with_capacity(windows.len());
        for (s, e) in windows {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        Ok(if merged == [(Duration::ZERO, period)] { Self::Always } else { Self::Trace(merged, period) })
    }

    /// Where the device starts on its timeline: a cycle at a random point of its on-time (the
    /// first departure comes after a uniform fraction of it), a trace at 0.
    pub fn start_phase(&self, rng: &mut Rng) -> Duration {
        match self {
            Self::Cycle(c) => Duration::try_from_secs_f64(c.on_seconds * (1.0 - rng.f64())).unwrap_or_default(),
            _ => Duration::ZERO,
        }
    }

    /// The window of availability that holds `t`, or else the next one: its start (≤ `t` when
    /// the device is reachable at `t`) and its end (`None`: it never ends).
    pub fn window(&self, t: Duration) -> (Duration, Option<Duration>) {
        let secs = |v: f64| Duration::try_from_secs_f64(v).unwrap_or_default();
        let cycle;
        let (windows, period): (&[(Duration, Duration)], Duration) = match self {
            Self::Always => return (t, None),
            Self::Cycle(c) => {
                let on = secs(c.on_seconds);
                cycle = [(Duration::ZERO, on)];
                (&cycle, on.saturating_add(secs(c.off_seconds)))
            }
            Self::Trace(w, p) => (w, *p),
        };
        let (Some(first), Some(last)) = (windows.first(), windows.last()) else { return (t, None) };
        let (p, tn) = (period.as_nanos(), t.as_nanos());
        if p == 0 || first.1.is_zero() {
            return (t, None); // degenerate (unchecked): treated as always reachable
        }
        // The last window runs on into the next period's first one.
        let wraps = first.0.is_zero() && last.1 == period;
        if wraps && windows.len() == 1 {
            return (t, None);
        }
        let base = tn / p * p;
        let x = tn - base;
        let (s, e, base) = match windows.iter().find(|w| x < w.1.as_nanos()) {
            Some(w) => (w.0.as_nanos(), w.1.as_nanos(), base),
            None => (first.0.as_nanos(), first.1.as_nanos(), base + p),
        };
        let start = base + s;
        let end = base + e + if wraps && e == p { first.1.as_nanos() } else { 0 };
        (nanos(start), Some(nanos(end)))
    }

    /// Whether the device is reachable at `t`.
    pub fn available_at(&self, t: Duration) -> bool {
        self.window(t).0 <= t
    }

    /// The first time from `t` on when the device is reachable.
    pub fn next_available(&self, t: Duration) -> Duration {
        self.window(t).0.max(t)
    }

    /// When the window that holds `t` (or else the next one) ends; `None`: never.
    pub fn window_end(&self, t: Duration) -> Option<Duration> {
        self.window(t).1
    }
}

fn nanos(n: u128) -> Duration {
    Duration::new((n / 1_000_000_000) as u64, (n % 1_000_000_000) as u32)
}

impl Default for DeviceProfile {
    fn default() -> Self {
        Self {
            name: "host".into(),
            compute_scale: 1.0,
            compute_watts: 15.0,
            radio_watts: 1.0,
            share: 1.0,
            crash_probability: 0.0,
            rejoin_seconds: 30.0,
            on_off: None,
            availability_trace: None,
            trace_period_seconds: None,
            compute_seconds: None,
            battery: None,
            thermal: None,
            eligibility: Default::default(),
        }
    }
}

impl DeviceProfile {
    /// The names [`DeviceProfile::preset`] knows.
    pub const PRESETS: &'static [&'static str] =
        &["host", "desktop", "jetson-orin", "jetson-nano", "raspberry-pi-4", "phone"];

    /// Named presets (rough figures relative to a desktop CPU core): `host`, `desktop`,
    /// `jetson-orin`, `jetson-nano`, `raspberry-pi-4`, `phone`.
    pub fn preset(name: &str) -> Option<Self> {
        let p = |compute_scale: f64, compute_watts: f64, radio_watts: f64| DeviceProfile {
            name: name.into(),
            compute_scale,
            compute_watts,
            radio_watts,
            ..DeviceProfile::default()
        };
        Some(match name {
            "host" => Self::default(),
            "desktop" => p(0.5, 65.0, 2.0),
            "jetson-orin" => p(1.0, 15.0, 1.5),
            "jetson-nano" => p(4.0, 10.0, 1.5),
            "raspberry-pi-4" => p(8.0, 6.0, 1.2),
            "phone" => p(3.0, 4.0, 1.0),
            _ => return None,
        })
    }

    /// When the device is reachable: `on_off`, `availability_trace` (read and checked here) or
    /// always.
    pub fn availability(&self) -> anyhow::Result<Availability> {
        let what = || format!("availability of device profile `{}`", self.name);
        match (&self.on_off, &self.availability_trace) {
            (Some(_), Some(_)) => anyhow::bail!("{}: set `on_off` or `availability_trace`, not both", what()),
            (_, None) if self.trace_period_seconds.is_some() => {
                anyhow::bail!("{}: `trace_period_seconds` needs an `availability_trace`", what())
            }
            (Some(cycle), None) => Availability::cycle(*cycle).with_context(what),
            (None, Some(path)) => Availability::read_trace(path, self.trace_period_seconds).with_context(what),
            (None, None) => Ok(Availability::Always),
        }
    }

    /// Estimated joules of a round: compute at compute power, transfer at radio power.
    pub fn joules(&self, compute_seconds: f64, transfer_seconds: f64) -> f64 {
        compute_seconds * self.compute_watts + transfer_seconds * self.radio_watts
    }
}

/// Deals profiles to `clients` clients in proportion to their shares (largest remainder, then a
/// seeded shuffle so the kinds are spread over client ids). The clients of a profile share it: a
/// fleet of a million devices holds a handful of profiles, not a million copies.
pub fn assign(profiles: &[DeviceProfile], clients: usize, seed: u64) -> Vec<Arc<DeviceProfile>> {
    if profiles.is_empty() {
        // One default profile, shared by every client.
        return std::iter::repeat_n(Arc::new(DeviceProfile::default()), clients).collect();
    }
    let weighted: Vec<(Arc<DeviceProfile>, f64)> = profiles.iter().map(|p| (Arc::new(p.clone()), p.share)).collect();
    deal_by_share(&weighted, clients, seed)
}

/// Deals `n` items in proportion to their shares (largest remainder), then shuffles them with
/// `seed` so the kinds are spread over client ids. Empty `items` give an empty list.
pub fn deal_by_share<T: Clone>(items: &[(T, f64)], n: usize, seed: u64) -> Vec<T> {
    if items.is_empty() {
        return Vec::new();
    }
    let total: f64 = items.iter().map(|(_, s)| s.max(0.0)).sum::<f64>().max(f64::MIN_POSITIVE);
    let exact: Vec<f64> = items.iter().map(|(_, s)| s.max(0.0) / total * n as f64).collect();
    let mut counts: Vec<usize> = exact.iter().map(|e| e.floor() as usize).collect();
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
    for &i in order.iter().cycle().take(n.saturating_sub(counts.iter().sum::<usize>())) {
        counts[i] += 1;
    }
    let mut out: Vec<T> =
        counts.iter().enumerate().flat_map(|(i, &k)| std::iter::repeat_n(items[i].0.clone(), k)).collect();
    Rng::new(seed).shuffle(&mut out);
    out
}

/// CPU time of the calling thread (Linux's CLOCK_THREAD_CPUTIME_ID); `None` where it cannot be read.
fn thread_cpu_time() -> Option<Duration> {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid, writable timespec for the call.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } == 0;
    ok.then(|| Duration::new(t.tv_sec.max(0) as u64, t.tv_nsec.clamp(0, 999_999_999) as u32))
}

/// Whether the real clock sleeps to charge the device's slowness.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Charge {
    /// Sleep for the extra time (real clock).
    Sleep,
    /// Only report it (virtual clock).
    Report,
}

/// At most `limit` simulated devices of this process train at once, each on one of the pool's
/// `limit` threads; the others wait their turn. A process that hosts hundreds of devices (a fleet
/// worker, the real clock) would otherwise run them all at once, and their measured compute
/// seconds would measure contention, not work. Waiting for the pool is not charged as compute.
///
/// Dedicated threads (rayon's `install` from the device's blocking thread), not slots on the
/// callers' threads: the matmul kernels keep a scratch buffer per thread that trains, and with
/// slots every blocking thread that ever trained kept one (214 MB at peak on the 1,000-device
/// peer job under `heaptrack` of `anchorage sim --clock real`).
///
/// One thread per core (`[systems] threads`): burn 0.22.1's autodiff keeps a graph (and its lock)
/// per training and takes its process-wide lock only to find the graph of each recorded op, so
/// independent trainings scale: 2.0× the steps per second on 2 threads (`anchorage microbench`,
/// `parallel_speedup`).
pub struct ComputePool {
    threads: rayon::ThreadPool,
}

impl std::fmt::Debug for ComputePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ComputePool").field("threads", &self.threads.current_num_threads()).finish()
    }
}

impl ComputePool {
    /// A pool of `limit` threads (at least 1).
    pub fn new(limit: usize) -> anyhow::Result<Self> {
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(limit.max(1))
            .thread_name(|i| format!("anchorage-train-{i}"))
            .build()?;
        Ok(Self { threads })
    }

    /// Runs `work` on one of the pool's threads, after waiting for one; the caller blocks.
    pub fn run<T: Send>(&self, work: impl FnOnce() -> T + Send) -> T {
        self.threads.install(work)
    }
}

/// A client's method on a simulated device. See the module docs.
pub struct SimulatedDevice<M> {
    inner: M,
    /// Where its training takes turns with the process's other devices (none: no limit).
    pool: Option<Arc<ComputePool>>,
    profile: Arc<DeviceProfile>,
    straggler_ratio: f64,
    charge: Charge,
    rng: Rng,
    /// The round whose training never finishes (a crash; the sim then aborts the client).
    crash_round: Option<u64>,
    /// Local epochs the last round ran (τ, or fewer for a straggler).
    pub last_epochs: u32,
    /// A Byzantine device: uploads global + scale·(trained − global).
    attack: Option<(f32, Option<u64>)>,
}

impl<M: ClientMethod> SimulatedDevice<M> {
    pub fn new(inner: M, profile: Arc<DeviceProfile>, straggler_ratio: f64, charge: Charge, seed: u64) -> Self {
        Self {
            inner,
            pool: None,
            profile,
            straggler_ratio,
            charge,
            rng: Rng::derive(seed, 0x57A6),
            crash_round: None,
            last_epochs: 0,
            attack: None,
        }
    }

    pub fn profile(&self) -> &DeviceProfile {
        &self.profile
    }

    /// Trains in `pool`'s slots.
    pub fn in_pool(&mut self, pool: Arc<ComputePool>) {
        self.pool = Some(pool);
    }

    /// Crash in `round`: its training fails before anything is uploaded, whatever the timing of
    /// the abort that kills the client.
    pub fn crash_in(&mut self, round: u64) {
        self.crash_round = Some(round);
    }

    /// Turns this device Byzantine: every update it sends is the broadcast plus `scale` times its
    /// honest change (`scale` = −10: the scaled sign-flip attack), claiming `claim` samples if set.
    pub fn attack(&mut self, scale: f32, claim: Option<u64>) {
        self.attack = Some((scale, claim));
    }
}

impl<M: ClientMethod> ClientMethod for SimulatedDevice<M> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn num_samples(&self) -> u64 {
        self.inner.num_samples()
    }

    fn global_accuracy(
        &self,
        broadcast: &Broadcast,
        test: &anchorage_model::FeatureCache,
    ) -> Result<Option<f64>, TrainError> {
        self.inner.global_accuracy(broadcast, test)
    }

    fn global_probes(
        &self,
        broadcast: &Broadcast,
        test: &anchorage_model::FeatureCache,
    ) -> Result<anchorage_client::methods::Probes, TrainError> {
        self.inner.global_probes(broadcast, test)
    }

    fn initial_blocks(&self) -> Result<Vec<anchorage_shared::tensor::ParamBlock>, TrainError> {
        self.inner.initial_blocks()
    }

    fn device_state(&self) -> Result<Vec<anchorage_shared::tensor::ParamBlock>, TrainError> {
        self.inner.device_state()
    }

    fn restore_device_state(&mut self, blocks: &[anchorage_shared::tensor::ParamBlock]) -> Result<(), TrainError> {
        self.inner.restore_device_state(blocks)
    }

    fn train(&mut self, broadcast: &Broadcast) -> Result<Trained, TrainError> {
        self.train_measured(broadcast).map(|(trained, _)| trained)
    }

    /// Trains the inner method (fewer epochs for a straggler) and charges the device's compute
    /// time: `compute_scale` × the host's CPU time of the inner `train`, the wait for the pool
    /// not counted. The one measurement of compute time on both of the simulator's clocks; the
    /// real clock sleeps off the difference to the wall time.
    fn train_measured(&mut self, broadcast: &Broadcast) -> Result<(Trained, Duration), TrainError> {
        if self.crash_round == Some(broadcast.round) {
            return Err(TrainError::Crashed(broadcast.round));
        }
        let tau = broadcast.config.local_epochs.max(1);
        let straggles = self.straggler_ratio > 0.0 && self.rng.f64() < self.straggler_ratio;
        let epochs = if straggles { 1 + self.rng.below(tau as u64) as u32 } else { tau };
        self.last_epochs = epochs;
        let inner = &mut self.inner;
        let mut work = || {
            let (started, cpu_started) = (Instant::now(), thread_cpu_time());
            let update = if epochs == tau {
                inner.train(broadcast)
            } else {
                let mut b = broadcast.clone();
                b.config.local_epochs = epochs;
                inner.train(&b)
            };
            let wall = started.elapsed();
            // The work done: this thread's CPU time, which other threads of a busy host (QUIC,
            // the server, other devices) do not stretch as they stretch the wall time.
            let cpu = match (cpu_started, thread_cpu_time()) {
                (Some(a), Some(b)) => b.saturating_sub(a),
                _ => wall,
            };
            (update, cpu, wall)
        };
        let (update, measured, wall) = match &self.pool {
            Some(pool) => pool.run(work),
            None => work(),
        };
        let mut update = update?;
        let charged = match self.profile.compute_seconds {
            Some(per_epoch) => Duration::from_secs_f64(per_epoch.max(0.0) * f64::from(epochs)),
            None => measured.mul_f64(self.profile.compute_scale.max(0.0)),
        };
        if self.charge == Charge::Sleep && charged > wall {
            std::thread::sleep(charged - wall);
        }
        if let Some((scale, claim)) = self.attack {
            if let Some(n) = claim {
                update.num_samples = n;
            }
            for block in &mut update.blocks {
                let base = broadcast.blocks.iter().find(|b| b.name == block.name).and_then(|b| b.decode().ok());
                // A top-k delta stands for base + delta.
                let trained = block.decode_against(base.as_deref().unwrap_or_default())?;
                let base = base.filter(|b| b.len() == trained.len()).unwrap_or_else(|| vec![0.0; trained.len()]);
                let values: Vec<f32> = trained.iter().zip(&base).map(|(t, g)| g + scale * (t - g)).collect();
                *block = ParamBlock::encode(block.name.clone(), &block.tensor.shape, &values, block.tensor.encoding);
            }
        }
        update.metrics.push(Metric::new(MetricKey::LocalEpochs, epochs as f64));
        update.metrics.push(Metric::new(MetricKey::Straggler, if straggles { 1.0 } else { 0.0 }));
        Ok((update, charged))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_preset_exists() {
        for name in DeviceProfile::PRESETS {
            assert!(DeviceProfile::preset(name).is_some(), "{name}");
        }
    }

    #[test]
    fn shares_are_dealt_exactly_and_seeded() {
        let profiles = vec![
            DeviceProfile { share: 0.5, ..DeviceProfile::preset("jetson-nano").unwrap() },
            DeviceProfile { share: 0.3, ..DeviceProfile::preset("raspberry-pi-4").unwrap() },
            DeviceProfile { share: 0.2, ..DeviceProfile::preset("desktop").unwrap() },
        ];
        let fleet = assign(&profiles, 10, 1);
        let count = |n: &str| fleet.iter().filter(|p| p.name == n).count();
        assert_eq!((count("jetson-nano"), count("raspberry-pi-4"), count("desktop")), (5, 3, 2));
        assert_eq!(fleet, assign(&profiles, 10, 1));
        assert_eq!(assign(&profiles, 7, 1).len(), 7);
        let defaults = assign(&[], 3, 1);
        assert_eq!(defaults.len(), 3);
        assert!(
            defaults.iter().all(|p| **p == DeviceProfile::default() && Arc::ptr_eq(p, &defaults[0])),
            "one, shared"
        );
        let nanos: Vec<_> = fleet.iter().filter(|p| p.name == "jetson-nano").collect();
        assert!(nanos.iter().all(|p| Arc::ptr_eq(p, nanos[0])), "a profile's clients share it");
    }

    fn s(v: f64) -> Duration {
        Duration::from_secs_f64(v)
    }

    fn trace(text: &str, period: Option<f64>) -> anyhow::Result<Availability> {
        Availability::parse_trace(text, "t.csv", period)
    }

    #[test]
    fn a_trace_is_parsed_sorted_and_merged() {
        let a = trace("start_seconds,end_seconds\n50, 60\n\n10,20\n15,30\n40,40\n", None).unwrap();
        assert_eq!(a, Availability::Trace(vec![(s(10.0), s(30.0)), (s(50.0), s(60.0))], s(60.0)));
        let a = trace(" start_seconds , end_seconds \n0,5\n", Some(8.0)).unwrap();
        assert_eq!(a, Availability::Trace(vec![(s(0.0), s(5.0))], s(8.0)));
        assert_eq!(trace("start_seconds,end_seconds\n0,5\n5,9\n", None).unwrap(), Availability::Always);
    }

    #[test]
    fn a_trace_is_csv_with_quotes_comments_and_crlf() {
        let text = "# written by a spreadsheet\r\n\"start_seconds\",\"end_seconds\"\r\n  # indented\r\n\"10\",\" 20 \"\r\n\r\n30,\"40\"\r\n";
        assert_eq!(
            trace(text, Some(50.0)).unwrap(),
            Availability::Trace(vec![(s(10.0), s(20.0)), (s(30.0), s(40.0))], s(50.0))
        );
        // A quoted comma is one field, not two: the line numbers count the comment and blank lines.
        let e = format!("{:#}", trace("# c\nstart_seconds,end_seconds\n\n\"1,5\",9\n", None).unwrap_err());
        assert!(e.contains("t.csv:4: start_seconds `1,5` is not a number"), "{e}");
        let e =
            format!("{:#}", trace("# c\r\nstart_seconds,end_seconds\r\n\r\n# c\r\n1,2\r\n5,4\r\n", None).unwrap_err());
        assert!(e.contains("t.csv:6: end_seconds 4 is before start_seconds 5"), "{e}");
        let e = format!("{:#}", trace("\"start_seconds,end_seconds\"\n1,2\n", None).unwrap_err());
        assert!(e.contains("t.csv:1: expected the header"), "{e}");
    }

    #[test]
    fn trace_queries_repeat_with_the_period() {
        let a = trace("start_seconds,end_seconds\n10,20\n30,40\n", Some(50.0)).unwrap();
        assert!(!a.available_at(s(0.0)) && a.available_at(s(10.0)) && !a.available_at(s(20.0)));
        assert_eq!(a.window(s(5.0)), (s(10.0), Some(s(20.0))));
        assert_eq!(a.window(s(12.0)), (s(10.0), Some(s(20.0))));
        assert_eq!(a.window(s(20.0)), (s(30.0), Some(s(40.0))), "windows are half-open");
        assert_eq!(a.next_available(s(45.0)), s(60.0), "the next period");
        assert_eq!(a.window_end(s(45.0)), Some(s(70.0)));
        assert_eq!(a.window(s(135.0)), (s(130.0), Some(s(140.0))));
        assert_eq!(a.next_available(s(15.0)), s(15.0));
        // Period = last end: [0, 10) joins [25, 40) across the wrap.
        let w = trace("start_seconds,end_seconds\n25,40\n0,10\n", None).unwrap();
        assert!(w.available_at(s(39.0)) && w.available_at(s(40.0)) && !w.available_at(s(50.0)));
        assert_eq!(w.window_end(s(30.0)), Some(s(50.0)), "on through the wrap until 40 + 10");
        assert_eq!(w.window_end(s(5.0)), Some(s(10.0)));
        assert_eq!(w.window(s(50.0)), (s(65.0), Some(s(90.0))));
        assert_eq!(Availability::Always.window(s(7.0)), (s(7.0), None));
    }

    #[test]
    fn a_cycle_uses_the_same_windows() {
        let c = Availability::cycle(OnOff { on_seconds: 3.0, off_seconds: 2.0 }).unwrap();
        assert_eq!(c.window(s(1.0)), (s(0.0), Some(s(3.0))));
        assert_eq!(c.window(s(3.5)), (s(5.0), Some(s(8.0))));
        assert!(c.available_at(s(11.0)) && !c.available_at(s(14.0)));
        let phase = c.start_phase(&mut Rng::new(1));
        assert!(phase <= s(3.0) && c.available_at(phase));
        assert_eq!(Availability::cycle(OnOff { on_seconds: 3.0, off_seconds: 0.0 }).unwrap(), Availability::Always);
        for bad in [(0.0, 1.0), (-1.0, 1.0), (1.0, f64::NAN), (1.0, 1e300)] {
            assert!(Availability::cycle(OnOff { on_seconds: bad.0, off_seconds: bad.1 }).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn bad_traces_are_clear_errors() {
        let err = |text: &str, period: Option<f64>| format!("{:#}", trace(text, period).unwrap_err());
        let h = "start_seconds,end_seconds\n";
        assert!(err("", None).contains("t.csv: empty"));
        assert!(err("start,end\n1,2\n", None).contains("t.csv:1: expected the header"));
        assert!(err(&format!("{h}1,2\n3,x\n"), None).contains("t.csv:3: end_seconds `x` is not a number"));
        assert!(err(&format!("{h}1,2,3\n"), None).contains("t.csv:2: expected two numbers"));
        let e = err(&format!("{h}\n5,4\n"), None);
        assert!(e.contains("t.csv:3: end_seconds 4 is before start_seconds 5"), "{e}");
        assert!(err(&format!("{h}-1,4\n"), None).contains("t.csv:2: start_seconds -1 is negative"));
        assert!(err(&format!("{h}1,inf\n"), None).contains("t.csv:2: end_seconds `inf` is not finite"));
        assert!(err(&format!("{h}1,1e300\n"), None).contains("t.csv:2: 1e300 seconds is too large"));
        assert!(err(&format!("{h}3,3\n"), None).contains("no interval of positive length"));
        assert!(err(&format!("{h}0,10\n"), Some(5.0)).contains("trace_period_seconds 5"));
        let missing = DeviceProfile {
            name: "flaky".into(),
            availability_trace: Some("/nonexistent/trace.csv".into()),
            ..DeviceProfile::default()
        };
        let e = format!("{:#}", missing.availability().unwrap_err());
        assert!(e.contains("`flaky`") && e.contains("reading availability trace /nonexistent/trace.csv"), "{e}");
        let both = DeviceProfile { on_off: Some(OnOff { on_seconds: 1.0, off_seconds: 1.0 }), ..missing.clone() };
        assert!(format!("{:#}", both.availability().unwrap_err()).contains("not both"));
        let orphan = DeviceProfile { trace_period_seconds: Some(3.0), ..DeviceProfile::default() };
        assert!(format!("{:#}", orphan.availability().unwrap_err()).contains("needs an `availability_trace`"));
    }

    #[test]
    fn a_profile_reads_its_trace_file() {
        let path = std::env::temp_dir().join(format!("anchorage-trace-{}.csv", std::process::id()));
        std::fs::write(&path, "start_seconds,end_seconds\n0,10\n20,30\n").unwrap();
        let p = DeviceProfile { availability_trace: Some(path.clone()), ..DeviceProfile::default() };
        assert_eq!(
            p.availability().unwrap(),
            Availability::Trace(vec![(s(0.0), s(10.0)), (s(20.0), s(30.0))], s(30.0))
        );
        let toml = toml::to_string(&p).unwrap();
        assert_eq!(toml::from_str::<DeviceProfile>(&toml).unwrap(), p, "{toml}");
        let _ = std::fs::remove_file(&path);
        assert_eq!(DeviceProfile::default().availability().unwrap(), Availability::Always);
    }

    #[test]
    fn energy_is_power_times_time() {
        let p = DeviceProfile { compute_watts: 10.0, radio_watts: 2.0, ..DeviceProfile::default() };
        assert_eq!(p.joules(3.0, 5.0), 40.0);
    }
}

#[cfg(test)]
mod deal_tests {
    use super::*;
    use crate::config::{FederationConfig, SystemsConfig};

    #[test]
    fn a_link_mix_is_dealt_by_share() {
        let config = crate::SimConfig {
            federation: FederationConfig { clients: 10, ..Default::default() },
            systems: SystemsConfig {
                link_mix: vec![
                    crate::LinkShare { preset: crate::network::LinkPreset::Wifi, share: 0.7, outages: vec![] },
                    crate::LinkShare { preset: crate::network::LinkPreset::ThreeG, share: 0.3, outages: vec![] },
                ],
                client_links: vec![crate::ClientLink { client: 0, profile: Default::default() }],
                ..Default::default()
            },
            ..Default::default()
        };
        let links = config.links().unwrap();
        assert_eq!(links.len(), 10);
        assert_eq!(links[0], Some(Default::default()), "an explicit client link wins");
        let slow = links.iter().filter(|l| l.as_ref().is_some_and(|p| p.up.bandwidth_bps == 0.5e6)).count();
        assert!((2..=3).contains(&slow), "30% of the fleet on 3g (one slot taken by the explicit link): {slow}");
        let bad = toml::from_str::<crate::SimConfig>("link = \"carrier-pigeon\"").unwrap_err().to_string();
        assert!(bad.contains("unknown variant `carrier-pigeon`") && bad.contains("`lte`"), "{bad}");
        assert!(deal_by_share::<u8>(&[], 3, 1).is_empty());
    }
}
