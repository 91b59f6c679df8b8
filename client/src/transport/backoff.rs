//! Waiting between connection attempts: the backoff's delays, the count of failed attempts in
//! a row, and the waits that the stop signal cuts short.

use std::time::Duration;

use anchorage_shared::rng::Rng;

/// Exponential backoff with full jitter between reconnect attempts.
#[derive(Debug, Clone)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    /// Give up after this many failed attempts in a row (`None`: never).
    pub max_attempts: Option<u32>,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { initial: Duration::from_millis(200), max: Duration::from_secs(30), max_attempts: None }
    }
}

impl Backoff {
    /// Delay before attempt `attempt` (1-based): uniform in [d/2, d] with d = min(max, initial·2^(attempt−1))
    /// ("equal jitter"). Ours, in three lines, rather than a crate's: `backoff` is unmaintained
    /// (RUSTSEC-2025-0012) and `backon` is a retry executor around futures, where the transport
    /// needs only the next delay, drawn from its seeded generator so that tests can repeat it.
    pub fn delay(&self, attempt: u32, rng: &mut Rng) -> Duration {
        let exp = self.initial.saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
        let d = exp.min(self.max);
        d.mul_f64(0.5 + 0.5 * rng.f64())
    }
}

/// Failed connection attempts in a row, for the backoff. A connection that came up resets the
/// count, so after losing it the first retry waits only the initial delay.
#[derive(Debug, Default)]
pub(super) struct Failures(u32);

impl Failures {
    /// A connection came up.
    pub(super) fn connected(&mut self) {
        self.0 = 0;
    }

    /// An attempt failed or a connection was lost: the new count, the attempt number to pass to
    /// [`Backoff::delay`].
    pub(super) fn failed(&mut self) -> u32 {
        self.0 = self.0.saturating_add(1);
        self.0
    }
}

/// A delay as a person reads it: `850 ms`, `12.5 s`, `4.2 min`.
pub(super) fn human(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 1.0 {
        format!("{} ms", d.as_millis())
    } else if s < 120.0 {
        format!("{s:.1} s")
    } else {
        format!("{:.1} min", s / 60.0)
    }
}

/// Sleeps for `delay`; `true` when the stop signal came first.
pub(super) async fn sleep_or_stop(delay: Duration, stop: &mut Option<tokio::sync::watch::Receiver<bool>>) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(delay) => false,
        _ = stopped(stop) => true,
    }
}

/// Completes when the stop signal turns true; never without one.
pub(super) async fn stopped(stop: &mut Option<tokio::sync::watch::Receiver<bool>>) {
    match stop {
        Some(rx) => {
            if rx.wait_for(|s| *s).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
        None => std::future::pending().await,
    }
}
