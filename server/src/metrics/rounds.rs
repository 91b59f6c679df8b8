//! Whether the federation learns and whether it moves, as an operator asks it: the last closed
//! round's quality (the devices' own evaluation, the server's held-out evaluation, who was
//! missing), whether the server is short of devices to open its next round and since when, and
//! whether the run is over. Exported at each scrape (`anchorage_round_*`,
//! `anchorage_waiting_*`, `anchorage_run_finished`) and written into `/readyz`'s body
//! ([`RoundStatus::note`]).
//!
//! The shortfall follows the engine's rule from what the shell reports: when no round is open, a
//! round opens as soon as `min_available` devices are connected (as the transport counts them,
//! `anchorage_clients_connected`), so the server waits for `min_available − connected` more. A
//! round is open from the moment enough devices are connected until it closes (at its target
//! or its deadline), and then the next one opens at once if enough are still there. In buffered
//! mode there are no rounds to wait between: the server waits only while fewer devices than it
//! needs are connected. The shortfall is 0 while the run is over or rounds are halted for a
//! suspected rollback (each has its own gauge).

use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

use crate::engine::RoundReport;

/// The server is short of devices: no round can open until `needed` more connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiting {
    /// Devices that must still connect.
    pub needed: usize,
    /// Devices connected now.
    pub connected: usize,
    /// Devices a round needs before it opens (`min_available`).
    pub min_available: usize,
    /// When the shortfall began (Unix seconds).
    pub since: i64,
    /// It has lasted at least the stall threshold (the round deadline).
    pub stalled: bool,
}

/// How the engine opens rounds, as the service configured it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Opening {
    /// Devices that must be connected before a round opens (`min_available`; in buffered mode
    /// after the first version, 1).
    pub min_available: usize,
    /// A wait for devices longer than this is a stall (the round deadline).
    pub stall_after: Duration,
    /// Rounds of the run (0: until stopped).
    pub rounds: u64,
    /// Synchronous rounds: devices are waited for only when no round is open.
    pub between_rounds: bool,
    /// A round is open now (one the engine resumed from its store).
    pub round_open: bool,
}

/// What the exposition and `/readyz` say about the rounds; shared by the engine's shell (which
/// reports connections and closed rounds) and the service (which tells it the engine's rule, the
/// held-out evaluations and the end of the run).
#[derive(Debug, Default)]
pub struct RoundStatus {
    state: Mutex<State>,
}

#[derive(Debug, Default, Clone)]
struct State {
    last_round: Option<u64>,
    /// The last closed round's device accuracy and how many updates reported one.
    device_accuracy: Option<(f64, usize)>,
    reports: usize,
    missing: Option<usize>,
    /// The last held-out evaluation: the round it followed and the accuracy.
    held_out: Option<(u64, f64)>,
    /// The privacy spent as of the last closed round (`[engine.privacy]`).
    privacy: Option<crate::engine::privacy::PrivacyAccount>,
    /// What secure aggregation did (`[engine.secagg]`), once a secure round closed.
    secagg: Option<super::secagg::SecAggTotals>,
    /// Devices a round needs (0: not told, never waiting).
    min_available: usize,
    /// Synchronous rounds: devices are needed only between rounds.
    gated: bool,
    /// A round is open (synchronous rounds).
    round_open: bool,
    stall_after: Duration,
    /// Rounds the run is configured for (0: until stopped).
    rounds: u64,
    connected: usize,
    halted: bool,
    finished: bool,
    /// When the shortfall began (Unix seconds).
    since: Option<i64>,
}

impl State {
    fn needed(&self) -> usize {
        if self.finished || self.halted || self.min_available == 0 || (self.gated && self.round_open) {
            0
        } else {
            self.min_available.saturating_sub(self.connected)
        }
    }

    /// Starts or ends the shortfall's clock after a change.
    fn settle(&mut self, now: i64) {
        if self.needed() == 0 {
            self.since = None;
        } else if self.since.is_none() {
            self.since = Some(now);
        }
    }

    /// With no round open, the engine opens one as soon as enough devices are connected.
    fn open_if_enough(&mut self) {
        if self.gated
            && !self.finished
            && !self.halted
            && self.min_available > 0
            && self.connected >= self.min_available
        {
            self.round_open = true;
        }
    }

    fn waiting(&self, now: i64) -> Option<Waiting> {
        let needed = self.needed();
        let since = self.since.filter(|_| needed > 0)?;
        let stalled = now.saturating_sub(since) >= i64::try_from(self.stall_after.as_secs()).unwrap_or(i64::MAX);
        Some(Waiting { needed, connected: self.connected, min_available: self.min_available, since, stalled })
    }
}

impl RoundStatus {
    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        f(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The engine's rule ([`Opening`]).
    pub fn expect(&self, rule: Opening, now: i64) {
        self.with(|s| {
            (s.min_available, s.stall_after, s.rounds) = (rule.min_available, rule.stall_after, rule.rounds);
            (s.gated, s.round_open) = (rule.between_rounds, rule.between_rounds && rule.round_open);
            s.open_if_enough();
            s.settle(now);
        });
    }

    pub fn connected(&self, clients: usize, now: i64) {
        self.with(|s| {
            s.connected = clients;
            s.open_if_enough();
            s.settle(now);
        });
    }

    pub fn halted(&self, halted: bool, now: i64) {
        self.with(|s| {
            s.halted = halted;
            s.settle(now);
        });
    }

    pub fn finished(&self, now: i64) {
        self.with(|s| {
            s.finished = true;
            s.settle(now);
        });
    }

    pub fn is_finished(&self) -> bool {
        self.with(|s| s.finished)
    }

    /// A round closed: its device accuracy and who was missing (a held-out accuracy it already
    /// carries is taken too).
    pub fn round_closed(&self, report: &RoundReport, now: i64) {
        self.with(|s| {
            s.round_open = false;
            s.open_if_enough();
            s.settle(now);
            s.last_round = Some(report.round);
            s.device_accuracy = report.device_accuracy();
            s.reports = s.device_accuracy.map_or(0, |(_, n)| n);
            s.missing = Some(report.missing.len());
            if let Some(a) = report.held_out_accuracy {
                s.held_out = Some((report.round, a));
            }
            if report.privacy.is_some() {
                s.privacy = report.privacy.clone();
            }
            if let Some(secagg) = &report.secagg {
                s.secagg.get_or_insert_default().add(secagg);
            }
        });
    }

    /// The global model after `round` scored `accuracy` on the held-out set.
    pub fn held_out(&self, round: u64, accuracy: f64) {
        self.with(|s| s.held_out = Some((round, accuracy)));
    }

    /// The last held-out evaluation: (round, accuracy).
    pub fn held_out_accuracy(&self) -> Option<(u64, f64)> {
        self.with(|s| s.held_out)
    }

    /// The last closed round's device accuracy and how many reported one.
    pub fn device_accuracy(&self) -> Option<(f64, usize)> {
        self.with(|s| s.device_accuracy)
    }

    /// The shortfall of devices now, if any.
    pub fn waiting(&self, now: i64) -> Option<Waiting> {
        self.with(|s| s.waiting(now))
    }

    /// What `/readyz` adds below `ready`: the end of the run, halted rounds, or a stall (a wait
    /// for devices longer than the stall threshold); `None` when all is well.
    pub fn note(&self, now: i64) -> Option<String> {
        let s = self.with(|s| s.clone());
        if s.finished {
            let last = s.last_round.map(|r| format!(" (the last round is {r})")).unwrap_or_default();
            return Some(format!(
                "finished: the run is over: all {} configured rounds have closed{last}; devices that connect are \
                 told the federation finished",
                s.rounds
            ));
        }
        if s.halted {
            return Some(
                "halted: devices have trained rounds this server never announced (a rolled-back state folder); \
                 no round opens until the operator decides (see the log: anchorage-server accept-rollback)"
                    .into(),
            );
        }
        let w = s.waiting(now).filter(|w| w.stalled)?;
        Some(format!("stalled: {}", describe(&w, now)))
    }
}

/// "waiting for 1 device since 2026-01-02T03:04:05Z (2m 5s): 1 of min_available = 2 connected".
pub fn describe(w: &Waiting, now: i64) -> String {
    format!(
        "waiting for {} device{} since {} ({}): {} of min_available = {} connected, no round opens until {} more connect{}",
        w.needed,
        if w.needed == 1 { "" } else { "s" },
        utc(w.since),
        age(now.saturating_sub(w.since)),
        w.connected,
        w.min_available,
        w.needed,
        if w.needed == 1 { "s" } else { "" },
    )
}

/// Unix seconds as an RFC 3339 UTC time (`2026-01-02T03:04:05Z`), with the `time` crate the
/// server already uses.
pub fn utc(unix: i64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp(unix).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        t.year(),
        t.month() as u8,
        t.day(),
        t.hour(),
        t.minute(),
        t.second()
    )
}

/// A duration in seconds as `45s`, `2m 5s`, `3h 20m`, `4d 2h`.
pub fn age(secs: i64) -> String {
    let s = secs.max(0);
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86_400 => format!("{}h {}m", s / 3600, s / 60 % 60),
        _ => format!("{}d {}h", s / 86_400, s / 3600 % 24),
    }
}

impl Collector for RoundStatus {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let now = super::unix_now();
        let s = self.with(|s| s.clone());
        gauge(
            &mut encoder,
            "round_device_accuracy",
            "The devices' own evaluation of the last closed round: the sample-weighted mean of the local_accuracy \
             their updates carried (0 to 1); absent when no update of that round carried one",
            None,
            s.device_accuracy.map(|(a, _)| a),
        )?;
        gauge(
            &mut encoder,
            "round_device_accuracy_reports",
            "Updates of the last closed round that carried a local_accuracy",
            None,
            s.last_round.map(|_| s.reports as f64),
        )?;
        gauge(
            &mut encoder,
            "round_held_out_accuracy",
            "Accuracy (0 to 1) of the global model on the operator's held-out set ([evaluation] in server.toml) \
             at its last evaluation; absent before one",
            None,
            s.held_out.map(|(_, a)| a),
        )?;
        gauge(
            &mut encoder,
            "round_held_out_evaluated_round",
            "The round whose global model anchorage_round_held_out_accuracy measured",
            None,
            s.held_out.map(|(r, _)| r as f64),
        )?;
        encode_privacy(&mut encoder, s.privacy.as_ref())?;
        if let Some(secagg) = &s.secagg {
            secagg.encode(&mut encoder)?;
        }
        gauge(
            &mut encoder,
            "round_missing_devices",
            "Invited devices that sent no update before the last round closed",
            None,
            s.missing.map(|m| m as f64),
        )?;
        let waiting = s.waiting(now);
        gauge(
            &mut encoder,
            "waiting_for_devices",
            "Devices that must still connect before the next round can open (min_available minus those \
             connected); 0 while enough are connected, rounds are halted or the run is over",
            None,
            Some(waiting.map_or(0.0, |w| w.needed as f64)),
        )?;
        gauge(
            &mut encoder,
            "waiting_since",
            "When the server became short of devices to open a round (Unix time); 0 while it is not",
            Some(&Unit::Seconds),
            Some(waiting.map_or(0.0, |w| w.since as f64)),
        )?;
        gauge(
            &mut encoder,
            "run_finished",
            "1 once every configured round has closed (the server only tells devices that the federation \
             finished), else 0",
            None,
            Some(if s.finished { 1.0 } else { 0.0 }),
        )?;
        Ok(())
    }
}

/// A gauge, or only its descriptor when there is no value yet.
fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    v: Option<f64>,
) -> std::fmt::Result {
    let metric = encoder.encode_descriptor(name, help, unit, MetricType::Gauge)?;
    match v {
        Some(v) => ConstGauge::new(v).encode(metric),
        None => Ok(()),
    }
}

/// The privacy spent (`[engine.privacy]`); the descriptors only when it is off.
fn encode_privacy(
    encoder: &mut DescriptorEncoder,
    account: Option<&crate::engine::privacy::PrivacyAccount>,
) -> std::fmt::Result {
    let privacy = |f: fn(&crate::engine::privacy::PrivacyAccount) -> f64| account.map(f);
    gauge(
        encoder,
        "privacy_epsilon",
        "ε spent so far at anchorage_privacy_delta ([engine.privacy], RDP accountant); absent when privacy is off",
        None,
        privacy(|p| p.epsilon),
    )?;
    gauge(encoder, "privacy_delta", "δ of anchorage_privacy_epsilon", None, privacy(|p| p.delta))?;
    gauge(
        encoder,
        "privacy_noise_multiplier",
        "σ: the noise's standard deviation over the clip",
        None,
        privacy(|p| p.noise_multiplier),
    )?;
    gauge(
        encoder,
        "privacy_clip",
        "The L2 clip of update deltas in the last round (moves under adaptive clipping)",
        None,
        privacy(|p| p.clip),
    )?;
    gauge(encoder, "privacy_rounds", "Rounds aggregated under privacy", None, privacy(|p| p.rounds as f64))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_times_and_ages_read_as_people_write_them() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_767_323_045), "2026-01-02T03:04:05Z");
        assert_eq!(
            (age(45), age(125), age(12_000), age(200_000)),
            ("45s".into(), "2m 5s".into(), "3h 20m".into(), "2d 7h".into())
        );
    }

    #[test]
    fn a_shortfall_starts_a_clock_that_stops_when_devices_come_back() {
        let status = RoundStatus::default();
        assert_eq!(status.waiting(100), None, "no rule told: never waiting");
        let rule = Opening {
            min_available: 2,
            stall_after: Duration::from_secs(60),
            rounds: 5,
            between_rounds: true,
            round_open: false,
        };
        status.expect(rule, 100);
        let w = status.waiting(100).unwrap();
        assert_eq!((w.needed, w.connected, w.since, w.stalled), (2, 0, 100, false));
        status.connected(1, 130);
        assert_eq!(status.waiting(150).map(|w| (w.needed, w.since)), Some((1, 100)), "the clock runs on");
        assert_eq!(status.note(150), None, "not stalled before the threshold");
        let note = status.note(170).unwrap();
        assert!(note.starts_with("stalled: waiting for 1 device since 1970-01-01T00:01:40Z (1m 10s)"), "{note}");
        assert!(note.contains("1 of min_available = 2 connected"), "{note}");
        // Two connected: a round opens; devices that leave it do not make the server wait while
        // it runs (it closes at its target or deadline).
        status.connected(2, 180);
        assert_eq!(status.waiting(180), None);
        status.connected(0, 190);
        assert_eq!(status.waiting(195), None, "round open");
        let report = crate::engine::RoundReport {
            round: 1,
            outcome: crate::engine::RoundOutcome::Aggregated,
            sampled: 2,
            target: 2,
            updates: Vec::new(),
            missing: vec!["a".into(), "b".into()],
            declined: Vec::new(),
            duplicates: 0,
            refused: 0,
            late_total: 0,
            payload_down: 0,
            started: Duration::ZERO,
            closed: Duration::ZERO,
            influence: Default::default(),
            held_out_accuracy: None,
            privacy: None,
            secagg: None,
        };
        status.round_closed(&report, 200);
        assert_eq!(status.waiting(200).map(|w| (w.needed, w.since)), Some((2, 200)), "a new shortfall, a new clock");
        // Enough devices when a round closes: the next one opens at once.
        status.connected(2, 201);
        status.round_closed(&crate::engine::RoundReport { round: 2, ..report.clone() }, 202);
        assert_eq!(status.waiting(202), None);
        status.round_closed(&crate::engine::RoundReport { round: 3, ..report.clone() }, 203);
        status.connected(1, 204);
        assert!(status.waiting(204).is_none(), "round 4 runs");
        status.round_closed(&crate::engine::RoundReport { round: 4, ..report }, 205);
        assert_eq!(status.waiting(205).map(|w| w.since), Some(205));
        status.halted(true, 210);
        assert_eq!(status.waiting(210), None);
        assert!(status.note(300).unwrap().starts_with("halted"));
        status.halted(false, 220);
        status.finished(230);
        assert_eq!(status.waiting(400), None, "a finished run waits for nobody");
        assert!(status.note(400).unwrap().starts_with("finished: the run is over: all 5 configured rounds"));
    }

    #[test]
    fn buffered_mode_waits_only_while_too_few_devices_are_connected() {
        let status = RoundStatus::default();
        let rule = Opening {
            min_available: 1,
            stall_after: Duration::from_secs(1),
            rounds: 0,
            between_rounds: false,
            round_open: false,
        };
        status.expect(rule, 10);
        status.connected(1, 11);
        assert_eq!(status.waiting(11), None);
        status.connected(0, 12);
        assert_eq!(status.waiting(20).map(|w| (w.needed, w.since, w.stalled)), Some((1, 12, true)));
        // A resumed open round (synchronous): nobody is waited for until it closes.
        let resumed = RoundStatus::default();
        resumed.expect(Opening { between_rounds: true, round_open: true, min_available: 2, ..rule }, 10);
        assert_eq!(resumed.waiting(10), None);
    }
}
