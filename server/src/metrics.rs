//! The server's counters and their Prometheus text exposition, served over plain HTTP
//! (`GET /metrics`) on the port the config names. Ledger totals are replayed from the durable
//! ledger at start, so they survive a restart.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anchorage_shared::ledger::CostRecord;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

/// Counters of the transport, the engine and the cost ledger.
#[derive(Debug, Default)]
pub struct ServerMetrics {
    pub connections: AtomicU64,
    pub frames_in: AtomicU64,
    pub bytes_in: AtomicU64,
    pub frames_out: AtomicU64,
    pub decode_errors: AtomicU64,
    pub refusals: AtomicU64,
    pub store_errors: AtomicU64,
    pub rounds_closed: AtomicU64,
    /// The last round that closed (a gauge).
    pub round: AtomicU64,
    pub ledger_records: AtomicU64,
    pub payload_up_bytes: AtomicU64,
    pub payload_down_bytes: AtomicU64,
    pub wire_up_bytes: AtomicU64,
    pub wire_down_bytes: AtomicU64,
    pub compute_micros: AtomicU64,
    pub transfer_micros: AtomicU64,
    pub wait_micros: AtomicU64,
    pub millijoules: AtomicU64,
    pub dropped: AtomicU64,
    pub stragglers: AtomicU64,
}

impl ServerMetrics {
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// Adds one ledger record to the totals.
    pub fn record_cost(&self, c: &CostRecord) {
        let add = |a: &AtomicU64, v: u64| a.fetch_add(v, Ordering::Relaxed);
        let micros = |s: f64| (s.max(0.0) * 1e6) as u64;
        add(&self.ledger_records, 1);
        add(&self.payload_up_bytes, c.payload_up);
        add(&self.payload_down_bytes, c.payload_down);
        add(&self.wire_up_bytes, c.wire_up);
        add(&self.wire_down_bytes, c.wire_down);
        add(&self.compute_micros, micros(c.compute_seconds));
        add(&self.transfer_micros, micros(c.transfer_seconds));
        add(&self.wait_micros, micros(c.wait_seconds));
        add(&self.millijoules, (c.joules.max(0.0) * 1e3) as u64);
        add(&self.dropped, c.dropped as u64);
        add(&self.stragglers, c.straggler as u64);
    }

    /// The Prometheus text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        let mut out = String::new();
        let g = Self::get;
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, f64)]| {
            let _ = writeln!(out, "# HELP anchorage_{name} {help}\n# TYPE anchorage_{name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(out, "anchorage_{name}{labels} {v}");
            }
        };
        metric("connections_total", "counter", "QUIC connections accepted.", &[("", g(&self.connections) as f64)]);
        metric("frames_in_total", "counter", "Frames received from clients.", &[("", g(&self.frames_in) as f64)]);
        metric("bytes_in_total", "counter", "Frame bytes received from clients.", &[("", g(&self.bytes_in) as f64)]);
        metric("frames_out_total", "counter", "Frames sent to clients.", &[("", g(&self.frames_out) as f64)]);
        metric("decode_errors_total", "counter", "Malformed frames received.", &[("", g(&self.decode_errors) as f64)]);
        metric("refusals_total", "counter", "Messages or clients refused.", &[("", g(&self.refusals) as f64)]);
        metric(
            "store_errors_total",
            "counter",
            "Failed writes of durable state.",
            &[("", g(&self.store_errors) as f64)],
        );
        metric(
            "rounds_closed_total",
            "counter",
            "Rounds closed since this process started.",
            &[("", g(&self.rounds_closed) as f64)],
        );
        metric("round", "gauge", "The last round that closed.", &[("", g(&self.round) as f64)]);
        metric(
            "ledger_records_total",
            "counter",
            "Cost ledger records (one per client per round).",
            &[("", g(&self.ledger_records) as f64)],
        );
        metric(
            "ledger_bytes_total",
            "counter",
            "Bytes in the cost ledger, by direction and kind (payload: parameter values; wire: UDP bytes).",
            &[
                ("{direction=\"up\",kind=\"payload\"}", g(&self.payload_up_bytes) as f64),
                ("{direction=\"up\",kind=\"wire\"}", g(&self.wire_up_bytes) as f64),
                ("{direction=\"down\",kind=\"payload\"}", g(&self.payload_down_bytes) as f64),
                ("{direction=\"down\",kind=\"wire\"}", g(&self.wire_down_bytes) as f64),
            ],
        );
        metric(
            "ledger_seconds_total",
            "counter",
            "Client seconds in the cost ledger, by phase.",
            &[
                ("{phase=\"compute\"}", g(&self.compute_micros) as f64 / 1e6),
                ("{phase=\"transfer\"}", g(&self.transfer_micros) as f64 / 1e6),
                ("{phase=\"wait\"}", g(&self.wait_micros) as f64 / 1e6),
            ],
        );
        metric(
            "ledger_joules_total",
            "counter",
            "Estimated client energy.",
            &[("", g(&self.millijoules) as f64 / 1e3)],
        );
        metric(
            "ledger_dropped_total",
            "counter",
            "Sampled clients that sent nothing before the deadline.",
            &[("", g(&self.dropped) as f64)],
        );
        metric(
            "ledger_stragglers_total",
            "counter",
            "Updates that arrived after their round closed.",
            &[("", g(&self.stragglers) as f64)],
        );
        out
    }
}

/// Serves `GET /metrics` on `bind` until `shutdown` turns true. Returns the bound address.
pub async fn serve(
    bind: SocketAddr,
    metrics: Arc<ServerMetrics>,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(bind).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => { tokio::spawn(answer(stream, metrics.clone())); }
                    Err(e) => tracing::warn!(error = %e, "metrics listener accept failed"),
                },
                _ = shutdown.changed() => break,
            }
        }
    });
    Ok(addr)
}

/// One HTTP/1.1 exchange: a bounded request head, then the exposition or a 404.
async fn answer(mut stream: tokio::net::TcpStream, metrics: Arc<ServerMetrics>) {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let read = async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
    };
    if tokio::time::timeout(std::time::Duration::from_secs(5), read).await.is_err() {
        return;
    }
    let (status, body) = if head.starts_with(b"GET /metrics ") || head.starts_with(b"GET /metrics?") {
        ("200 OK", metrics.render())
    } else {
        ("404 Not Found", "try GET /metrics\n".to_string())
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ledger_records_add_up_in_the_exposition() {
        let m = ServerMetrics::default();
        m.record_cost(&CostRecord {
            wire_up: 1000,
            payload_up: 900,
            compute_seconds: 1.5,
            joules: 2.0,
            ..Default::default()
        });
        m.record_cost(&CostRecord { wire_up: 500, dropped: true, ..Default::default() });
        let text = m.render();
        assert!(text.contains("anchorage_ledger_bytes_total{direction=\"up\",kind=\"wire\"} 1500"), "{text}");
        assert!(text.contains("anchorage_ledger_seconds_total{phase=\"compute\"} 1.5"));
        assert!(text.contains("anchorage_ledger_dropped_total 1"));
        assert!(text.contains("# TYPE anchorage_round gauge"));
    }

    #[tokio::test]
    async fn metrics_are_served_over_http() {
        let m = Arc::new(ServerMetrics::default());
        m.rounds_closed.fetch_add(3, Ordering::Relaxed);
        let (_tx, rx) = watch::channel(false);
        let addr = serve(SocketAddr::from(([127, 0, 0, 1], 0)), m, rx).await.unwrap();
        let get = |path: &'static str| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).await.unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        let ok = get("/metrics").await;
        assert!(ok.starts_with("HTTP/1.1 200") && ok.contains("anchorage_rounds_closed_total 3"), "{ok}");
        assert!(get("/").await.starts_with("HTTP/1.1 404"));
    }
}
