//! Connecting: attempts with backoff until one is up, the stop signal, or a refusal for good.

use anchorage_shared::priority::Priority;

use super::super::backoff::{human, sleep_or_stop, stopped};
use super::super::refusal::{RefusalKind, definite_refusal, tls_error, tls_failure};
use super::super::upload::prioritise;
use super::{Client, ClientEvent, Connected};

impl Client {
    /// A connection and its control stream, after as many attempts (with backoff) as it takes;
    /// or the stop signal, or the server's refusal for good.
    pub(super) async fn connect(
        &mut self,
        stop: &mut Option<tokio::sync::watch::Receiver<bool>>,
    ) -> anyhow::Result<Connected> {
        loop {
            // The stop signal is watched while connecting and backing off too: a client whose
            // server is unreachable must still leave at once on SIGTERM. A server that is down
            // does not answer at all: without the connect timeout the attempt would wait out the
            // whole idle timeout.
            let options = &self.options;
            let connecting = self.endpoint.connect(options)?;
            let attempt = async {
                let conn = connecting.await.map_err(|e| match definite_refusal(&e) {
                    Some(refusal) => Err(refusal),
                    None => {
                        if tls_failure(&e) {
                            tls_error(options, &e);
                        }
                        Ok(e.to_string())
                    }
                })?;
                // Fails only if the connection is already gone: a failed attempt, not a fatal error,
                // unless the server's verdict on this device's certificate closed it (it comes
                // right after the handshake's last flight).
                let streams = conn.open_bi().await.map_err(|e| match definite_refusal(&e) {
                    Some(refusal) => Err(refusal),
                    None => Ok(format!("opening the control stream: {e}")),
                })?;
                Ok::<_, Result<String, (RefusalKind, String)>>((conn, streams))
            };
            let connected = tokio::select! {
                c = tokio::time::timeout(options.connect_timeout, attempt) => c
                    .unwrap_or_else(|_| Err(Ok(format!("no answer within {:?}", options.connect_timeout)))),
                _ = stopped(stop) => return Ok(Connected::Stopped),
            };
            self.options.metrics.connect_attempt(connected.is_ok());
            match connected {
                Ok((conn, (control, control_recv))) => {
                    prioritise(&control, Priority::Control.when(self.options.stream_priorities));
                    // The backoff's count starts again at the server's welcome, not here: a
                    // server that closes every connection at once is not reached.
                    self.emit(ClientEvent::Connected);
                    return Ok(Connected::Up(conn, control, control_recv));
                }
                Err(Err((kind, detail))) => return Ok(Connected::Refused(self.refusal(kind, detail))),
                Err(Ok(e)) => {
                    let failures = self.failures.failed();
                    self.options.fail_over();
                    if self.options.backoff.max_attempts.is_some_and(|m| failures >= m) {
                        anyhow::bail!("could not reach {} after {failures} attempts: {e}", self.options.server);
                    }
                    let delay = self.options.backoff.delay(failures, &mut self.rng);
                    tracing::info!(
                        client = %self.options.client_id,
                        server = %self.options.server,
                        error = %e,
                        attempt = failures,
                        delay_s = delay.as_secs_f64(),
                        "connect failed (transient: the server may be down, restarting or unreachable); \
                         retrying in {}, backing off up to {}",
                        human(delay),
                        human(self.options.backoff.max)
                    );
                    if sleep_or_stop(delay, stop).await {
                        return Ok(Connected::Stopped);
                    }
                }
            }
        }
    }
}
