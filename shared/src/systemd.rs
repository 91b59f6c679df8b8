//! systemd's service notifications (sd_notify(3)) for `anchorage-server` and `anchorage-client`
//! under a `Type=notify` unit (deploy/systemd/): `READY=1` once the service does its job (the
//! server listens, the client is configured), `WATCHDOG=1` at half of the unit's `WatchdogSec`
//! for as long as the service's tokio runtime runs its tasks, `STOPPING=1` when it shuts down,
//! and a `STATUS=` line for `systemctl status`. One copy for both binaries.
//!
//! Everything here does nothing when `NOTIFY_SOCKET` is unset: a manual run, a test, a container.
//! A notification that cannot be sent is logged and never stops the service.

use std::time::Duration;

use sd_notify::NotifyState;

/// Whether a service manager waits for our notifications (`NOTIFY_SOCKET` is set).
pub fn enabled() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some()
}

/// Tells systemd the service is up (`READY=1`, `status` as its status line) and, when the unit
/// sets `WatchdogSec`, pings the watchdog from a task on the current tokio runtime every half
/// period. The pings come from the runtime that runs the service, so a runtime that stops
/// scheduling tasks stops them, and systemd restarts the service (`Restart=on-failure`).
/// Returns the watchdog task, if any; it ends with the runtime (or abort it).
pub fn ready(status: &str) -> Option<tokio::task::JoinHandle<()>> {
    if !enabled() {
        return None;
    }
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
    let period = watchdog_period(sd_notify::watchdog_enabled())?;
    tracing::info!(every_ms = period.as_millis() as u64, "systemd watchdog: pinging");
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            send(&[NotifyState::Watchdog]);
        }
    }))
}

/// A new status line for `systemctl status`.
pub fn status(status: &str) {
    if enabled() {
        send(&[NotifyState::Status(status)]);
    }
}

/// Tells systemd the service is shutting down (`STOPPING=1`), so that the time until exit is
/// not taken for a hang.
pub fn stopping(status: &str) {
    if enabled() {
        send(&[NotifyState::Stopping, NotifyState::Status(status)]);
    }
}

/// How often to ping a watchdog of `timeout`: half of it, as sd_watchdog_enabled(3) advises, and
/// not more often than every 100 ms. `None` without a watchdog.
pub fn watchdog_period(timeout: Option<Duration>) -> Option<Duration> {
    let timeout = timeout.filter(|t| !t.is_zero())?;
    Some((timeout / 2).max(Duration::from_millis(100)))
}

fn send(states: &[NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::warn!(error = %e, "cannot notify systemd (NOTIFY_SOCKET)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::format;
    use std::os::unix::net::UnixDatagram;
    use std::string::String;

    #[test]
    fn the_watchdog_is_pinged_at_half_its_period() {
        assert_eq!(watchdog_period(None), None);
        assert_eq!(watchdog_period(Some(Duration::ZERO)), None);
        assert_eq!(watchdog_period(Some(Duration::from_secs(60))), Some(Duration::from_secs(30)));
        assert_eq!(watchdog_period(Some(Duration::from_millis(50))), Some(Duration::from_millis(100)));
    }

    /// The messages a unit's manager receives, from a socket of our own in NOTIFY_SOCKET (the one
    /// test in this crate that sets the environment).
    #[tokio::test(flavor = "current_thread")]
    async fn ready_watchdog_and_stopping_reach_the_notify_socket() {
        let dir = std::env::temp_dir().join(format!("anchorage-notify-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let socket = UnixDatagram::bind(&path).unwrap();
        socket.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        // SAFETY: no other thread of this test binary reads or writes these variables.
        unsafe {
            std::env::set_var("NOTIFY_SOCKET", &path);
            std::env::set_var("WATCHDOG_USEC", "400000");
            std::env::remove_var("WATCHDOG_PID");
        }
        let recv = || {
            let mut buf = [0u8; 256];
            let n = socket.recv(&mut buf).unwrap();
            String::from_utf8_lossy(&buf[..n]).into_owned()
        };
        let watchdog = ready("listening").expect("a watchdog task");
        assert_eq!(recv(), "READY=1\nSTATUS=listening\n");
        // The first ping at once, the next 200 ms (half of WATCHDOG_USEC) later.
        let start = std::time::Instant::now();
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(recv(), "WATCHDOG=1\n");
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(recv(), "WATCHDOG=1\n");
        assert!(start.elapsed() >= Duration::from_millis(200));
        watchdog.abort();
        stopping("SIGTERM");
        assert_eq!(recv(), "STOPPING=1\nSTATUS=SIGTERM\n");
        unsafe {
            std::env::remove_var("NOTIFY_SOCKET");
            std::env::remove_var("WATCHDOG_USEC");
        }
        assert!(ready("x").is_none(), "no NOTIFY_SOCKET, no notification");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
