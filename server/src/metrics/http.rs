//! The metrics port, served by hyper: `GET /metrics` (the server's metrics, the process's,
//! `anchorage_build_info`: OpenMetrics to a client that asks for it in `Accept`, as Prometheus
//! does, else Prometheus' text format, which `curl | promtool check metrics` reads), `GET /healthz`
//! (200 while the process runs) and `GET /readyz` (200 once the store is open and the QUIC
//! endpoint listens, 503 before that and from the start of a shutdown). The port comes up before
//! the store is opened, so a probe can tell a server that is still checking a large database from
//! one that is down.
//!
//! `/readyz` stays 200 while the server is stalled (short of devices for longer than a round's
//! deadline) or its run is over, and says so in the body below `ready`: readiness means "send it
//! traffic", and a stalled server needs exactly that (on Kubernetes a 503 would take the pod out
//! of its Service, and the devices it waits for could no longer reach it); a finished one tells
//! the devices that connect that the federation finished. Alerts watch the stall
//! (`anchorage_waiting_for_devices`, `AnchorageStalled`).
//!
//! A flood of idle or slow connections cannot starve the probes: at most [`MAX_CONNECTIONS`] are
//! held, a request's head must arrive within [`HEADER_TIME`], and when the port is full the
//! oldest connection that has not sent a request yet is dropped to make room (counted in
//! `anchorage_http_connections_dropped_total`, logged at most every [`LOG_EVERY`]).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use super::ServerMetrics;
use super::process::ProcessCollector;

/// `Content-Type` of the exposition.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Connections held at once (a scrape, two probes and room); beyond it the oldest idle one goes.
pub const MAX_CONNECTIONS: usize = 64;
/// A request's head must arrive within this (a probe sends it at once).
pub const HEADER_TIME: Duration = Duration::from_secs(3);
/// A request must arrive, and its answer leave, within this.
const REQUEST_TIME: Duration = Duration::from_secs(10);
/// Dropped connections are logged at most this often (with the count since the last line).
const LOG_EVERY: Duration = Duration::from_secs(10);

/// `reason` of `anchorage_http_connections_dropped_total`.
pub mod dropped {
    /// Idle (no request yet) and the oldest when the port was full.
    pub const EVICTED: &str = "evicted";
    /// No complete request within the time allowed.
    pub const TIMEOUT: &str = "timeout";
    /// The port was full of connections being answered.
    pub const BUSY: &str = "busy";
    pub const ALL: [&str; 3] = [EVICTED, TIMEOUT, BUSY];
}

/// The version and commit this binary was built from.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const GIT_COMMIT: &str = match option_env!("ANCHORAGE_GIT_COMMIT") {
    Some(c) => c,
    None => "unknown",
};

const STARTING: u8 = 0;
const READY: u8 = 1;
const STOPPING: u8 = 2;

/// What the metrics port answers with: the server's metrics once it runs, its readiness, and
/// the metrics of the port itself and the process.
#[derive(Debug)]
pub struct Exporter {
    registry: Registry,
    state: AtomicU8,
    ready: Gauge,
    requests: Family<[(&'static str, &'static str); 2], Counter>,
    dropped: Family<[(&'static str, &'static str); 1], Counter>,
    server: OnceLock<Arc<ServerMetrics>>,
}

impl Default for Exporter {
    fn default() -> Self {
        Self::new()
    }
}

impl Exporter {
    pub fn new() -> Self {
        let mut root = Registry::default();
        root.register_collector(Box::new(ProcessCollector));
        let r = root.sub_registry_with_prefix("anchorage");
        let build: Family<[(&'static str, &'static str); 2], Gauge> = Family::default();
        build.get_or_create(&[("version", VERSION), ("git_commit", GIT_COMMIT)]).set(1);
        r.register("build_info", "The version and git commit of this server; always 1.", build);
        let ready = Gauge::default();
        r.register("ready", "1 while the server serves (store open, QUIC listening), else 0.", ready.clone());
        let requests = Family::default();
        r.register("http_requests", "Requests to the metrics port, by path and status code.", requests.clone());
        let dropped: Family<[(&'static str, &'static str); 1], Counter> = Family::default();
        for reason in dropped::ALL {
            let _ = dropped.get_or_create(&[("reason", reason)]);
        }
        r.register(
            "http_connections_dropped",
            "Connections to the metrics port closed unanswered: evicted (idle, the port was full), timeout \
             (no request in time), busy (full of requests being answered).",
            dropped.clone(),
        );
        Self { registry: root, state: AtomicU8::new(STARTING), ready, requests, dropped, server: OnceLock::new() }
    }

    /// A connection closed unanswered, by [`dropped`] reason.
    fn dropped(&self, reason: &'static str) {
        self.dropped.get_or_create(&[("reason", reason)]).inc();
    }

    /// The running server's metrics; from now on `/metrics` includes them. Only the first call
    /// counts.
    pub fn attach(&self, metrics: Arc<ServerMetrics>) {
        let _ = self.server.set(metrics);
    }

    /// The store is open and QUIC listens: `/readyz` answers 200.
    pub fn set_ready(&self) {
        if self.state.compare_exchange(STARTING, READY, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
            self.ready.set(1);
        }
    }

    /// A shutdown began: `/readyz` answers 503 from now on.
    pub fn set_stopping(&self) {
        self.state.store(STOPPING, Ordering::SeqCst);
        self.ready.set(0);
    }

    pub fn is_ready(&self) -> bool {
        self.state.load(Ordering::SeqCst) == READY
    }

    /// The whole exposition in OpenMetrics: the server's metrics (once attached), the port's and
    /// the process's.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(16 << 10);
        if let Some(server) = self.server.get() {
            let _ = server.encode(&mut out);
        }
        let _ = prometheus_client::encoding::text::encode_registry(&mut out, &self.registry);
        let _ = prometheus_client::encoding::text::encode_eof(&mut out);
        out
    }

    /// The whole exposition in Prometheus' text format (version 0.0.4).
    pub fn render_text(&self) -> String {
        super::text::to_text_format(&self.render())
    }

    /// The answer to one request; `accept` is its `Accept` header.
    pub fn answer(&self, method: &Method, path: &str, accept: Option<&str>) -> Response<Full<Bytes>> {
        let (label, (status, content_type, body)) = match path {
            "/metrics" if accept.is_some_and(|a| a.contains("application/openmetrics-text")) => {
                ("/metrics", (StatusCode::OK, OPENMETRICS, self.render()))
            }
            "/metrics" => ("/metrics", (StatusCode::OK, super::text::TEXT_FORMAT, self.render_text())),
            "/healthz" => ("/healthz", (StatusCode::OK, "text/plain; charset=utf-8", "ok\n".to_string())),
            "/readyz" => ("/readyz", self.readiness()),
            _ => (
                "other",
                (
                    StatusCode::NOT_FOUND,
                    "text/plain; charset=utf-8",
                    "not found: try GET /metrics, /healthz or /readyz\n".to_string(),
                ),
            ),
        };
        let (status, content_type, body) = if method == Method::GET || method == Method::HEAD {
            (status, content_type, body)
        } else {
            (StatusCode::METHOD_NOT_ALLOWED, "text/plain; charset=utf-8", "only GET and HEAD\n".to_string())
        };
        let code = match status {
            StatusCode::OK => "200",
            StatusCode::NOT_FOUND => "404",
            StatusCode::METHOD_NOT_ALLOWED => "405",
            StatusCode::SERVICE_UNAVAILABLE => "503",
            _ => "other",
        };
        self.requests.get_or_create(&[("path", label), ("code", code)]).inc();
        if status != StatusCode::OK && status != StatusCode::SERVICE_UNAVAILABLE {
            tracing::debug!(%method, path, %status, "metrics port: bad request");
        }
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        response.headers_mut().insert(header::CONTENT_TYPE, header::HeaderValue::from_static(content_type));
        if status == StatusCode::METHOD_NOT_ALLOWED {
            response.headers_mut().insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
        }
        response
    }

    fn readiness(&self) -> (StatusCode, &'static str, String) {
        let text = "text/plain; charset=utf-8";
        match self.state.load(Ordering::SeqCst) {
            READY => {
                let note = self.server.get().and_then(|m| m.status_note());
                (StatusCode::OK, text, note.map_or_else(|| "ready\n".into(), |n| format!("ready\n{n}\n")))
            }
            STARTING => (StatusCode::SERVICE_UNAVAILABLE, text, "starting: opening the store\n".into()),
            _ => (StatusCode::SERVICE_UNAVAILABLE, text, "shutting down\n".into()),
        }
    }
}

/// One connection the port holds: whether its request has arrived, and how to drop it.
struct Held {
    answering: Arc<AtomicBool>,
    task: tokio::task::AbortHandle,
}

/// Serves the exporter's answers on `bind` until `shutdown` turns true (or its sender goes).
/// Returns the bound address.
pub async fn serve(
    bind: SocketAddr,
    exporter: Arc<Exporter>,
    mut shutdown: watch::Receiver<bool>,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(bind).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        // Oldest first; only this task touches it.
        let mut held: VecDeque<Held> = VecDeque::with_capacity(MAX_CONNECTIONS);
        let (mut unlogged, mut logged_at) = (0u64, None::<Instant>);
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok((stream, remote)) => {
                        held.retain(|h| !h.task.is_finished());
                        if held.len() >= MAX_CONNECTIONS {
                            let reason = match held.iter().position(|h| !h.answering.load(Ordering::SeqCst)) {
                                Some(i) => {
                                    if let Some(idle) = held.remove(i) {
                                        idle.task.abort();
                                    }
                                    dropped::EVICTED
                                }
                                None => dropped::BUSY,
                            };
                            exporter.dropped(reason);
                            unlogged += 1;
                            if logged_at.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
                                tracing::warn!(%remote, max = MAX_CONNECTIONS, dropped = unlogged, "metrics port full: \
                                    idle connections dropped to keep the probes answered (a flood, or a client that \
                                    connects and sends nothing)");
                                (unlogged, logged_at) = (0, Some(Instant::now()));
                            }
                            if reason == dropped::BUSY {
                                continue;
                            }
                        }
                        let answering = Arc::new(AtomicBool::new(false));
                        let task = tokio::spawn(connection(stream, remote, exporter.clone(), answering.clone()));
                        held.push_back(Held { answering, task: task.abort_handle() });
                    }
                    Err(e) => {
                        // Out of file descriptors, most likely: say so, and do not spin.
                        tracing::warn!(error = %e, "metrics port: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                changed = shutdown.changed() => if changed.is_err() || *shutdown.borrow() { break },
            }
        }
        for h in held {
            h.task.abort();
        }
    });
    Ok(addr)
}

/// Answers one request on `stream` (no keep-alive), within [`HEADER_TIME`] for its head and
/// [`REQUEST_TIME`] in all.
async fn connection(
    stream: tokio::net::TcpStream,
    remote: SocketAddr,
    exporter: Arc<Exporter>,
    answering: Arc<AtomicBool>,
) {
    let served = exporter.clone();
    let flag = answering.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        flag.store(true, Ordering::SeqCst);
        let accept = req.headers().get(header::ACCEPT).and_then(|a| a.to_str().ok());
        let response = served.answer(req.method(), req.uri().path(), accept);
        async move { Ok::<_, Infallible>(response) }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIME)
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    // hyper's header timer may start only with the first byte; this one starts now.
    let outcome = tokio::time::timeout(REQUEST_TIME, async {
        tokio::select! {
            done = &mut connection => return Some(done),
            _ = tokio::time::sleep(HEADER_TIME) => {}
        }
        if answering.load(Ordering::SeqCst) { Some(connection.await) } else { None }
    })
    .await;
    match outcome {
        Ok(Some(Ok(()))) => {}
        Ok(Some(Err(e))) if e.is_timeout() => exporter.dropped(dropped::TIMEOUT),
        Ok(Some(Err(e))) => tracing::debug!(%remote, error = %e, "metrics port: connection failed"),
        Ok(None) | Err(_) => {
            exporter.dropped(dropped::TIMEOUT);
            tracing::debug!(%remote, "metrics port: request too slow; closed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn get(addr: SocketAddr, request: &str) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn health_readiness_and_metrics_over_http() {
        let exporter = Arc::new(Exporter::new());
        let (stop, rx) = watch::channel(false);
        let addr = serve(SocketAddr::from(([127, 0, 0, 1], 0)), exporter.clone(), rx).await.unwrap();
        let req = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(get(addr, &req("/healthz")).await.starts_with("HTTP/1.1 200"));
        // Before the store is open and QUIC listens: not ready, and the port's own metrics only.
        let starting = get(addr, &req("/readyz")).await;
        assert!(starting.starts_with("HTTP/1.1 503") && starting.contains("starting"), "{starting}");
        let early = get(addr, &req("/metrics")).await;
        assert!(early.starts_with("HTTP/1.1 200") && early.contains("anchorage_ready 0"), "{early}");
        assert!(
            early.contains("anchorage_build_info{version=\"") && early.contains("# TYPE anchorage_ready gauge"),
            "{early}"
        );
        assert!(!early.contains("anchorage_rounds_closed_total"), "{early}");

        let metrics = Arc::new(ServerMetrics::new());
        metrics.update(super::super::outcome::ACCEPTED);
        exporter.attach(metrics);
        exporter.set_ready();
        let ok = get(addr, &req("/readyz")).await;
        assert!(ok.starts_with("HTTP/1.1 200") && ok.ends_with("ready\n"), "{ok}");
        // Prometheus asks for OpenMetrics and gets it; anyone else gets the text format, which
        // `promtool check metrics` reads.
        let open = get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5\r\n\r\n").await;
        assert!(open.contains(OPENMETRICS) && open.contains("# TYPE anchorage_updates counter"), "{open}");
        assert_eq!(open.matches("# EOF").count(), 1);
        let full = get(addr, &req("/metrics")).await;
        assert!(
            full.contains(super::super::text::TEXT_FORMAT)
                && full.contains("# TYPE anchorage_updates_total counter\n")
                && full.contains("\nanchorage_updates_total{outcome=\"accepted\"} 1\n"),
            "{full}"
        );
        assert!(full.contains("anchorage_ready 1"), "{full}");
        let body = full.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        assert_eq!(super::super::text::lint(body), Vec::<String>::new(), "{body}");
        if cfg!(target_os = "linux") {
            assert!(full.contains("process_resident_memory_bytes ") && full.contains("process_cpu_seconds_total "));
        }
        // The HTTP Date header, which `anchorage-client doctor` reads the server's clock from.
        assert!(full.to_ascii_lowercase().contains("\r\ndate: "), "{full}");
        assert_eq!(full.matches("# EOF").count(), 0, "no OpenMetrics end marker in the text format");

        // Bad input: an answer, a count, no crash.
        assert!(get(addr, &req("/")).await.starts_with("HTTP/1.1 404"));
        assert!(
            get(addr, "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
                .await
                .starts_with("HTTP/1.1 405")
        );
        let garbage = get(addr, "\x16\x03\x01 not http at all\r\n\r\n").await;
        assert!(garbage.is_empty() || garbage.starts_with("HTTP/1.1 400"), "{garbage}");
        let counted = exporter.render();
        assert!(counted.contains("anchorage_http_requests_total{path=\"other\",code=\"404\"} 1"), "{counted}");
        assert!(counted.contains("anchorage_http_requests_total{path=\"/metrics\",code=\"405\"} 1"), "{counted}");

        exporter.set_stopping();
        let stopping = get(addr, &req("/readyz")).await;
        assert!(stopping.starts_with("HTTP/1.1 503") && stopping.contains("shutting down"), "{stopping}");
        assert!(!exporter.is_ready());
        let _ = stop.send(true);
    }

    #[test]
    fn readiness_stays_200_and_says_when_the_server_is_stalled_or_finished() {
        let exporter = Exporter::new();
        let metrics = Arc::new(ServerMetrics::new());
        exporter.attach(metrics.clone());
        exporter.set_ready();
        assert_eq!(exporter.readiness(), (StatusCode::OK, "text/plain; charset=utf-8", "ready\n".to_string()));
        // Short of devices for longer than the stall threshold (here: at once): still ready, the
        // body says why no round opens.
        metrics.expect_devices(super::super::rounds::Opening {
            min_available: 2,
            stall_after: Duration::ZERO,
            rounds: 3,
            between_rounds: true,
            round_open: false,
        });
        metrics.set_connected(1);
        let (status, _, body) = exporter.readiness();
        assert_eq!(status, StatusCode::OK);
        assert!(body.starts_with("ready\nstalled: waiting for 1 device since 20"), "{body}");
        assert!(body.contains("1 of min_available = 2 connected"), "{body}");
        metrics.set_connected(2);
        assert_eq!(exporter.readiness().2, "ready\n");
        metrics.set_run_finished();
        let (status, _, body) = exporter.readiness();
        assert_eq!(status, StatusCode::OK);
        assert!(body.starts_with("ready\nfinished: the run is over: all 3 configured rounds have closed"), "{body}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn probes_are_answered_while_200_idle_connections_are_held() {
        let exporter = Arc::new(Exporter::new());
        let (stop, rx) = watch::channel(false);
        let addr = serve(SocketAddr::from(([127, 0, 0, 1], 0)), exporter.clone(), rx).await.unwrap();
        let metrics = Arc::new(ServerMetrics::new());
        metrics.seen("edge-secret-007", super::super::unix_now());
        metrics.set_device_series(0); // `[metrics] device_ids = false`, the default
        exporter.attach(metrics);
        exporter.set_ready();
        // 200 connections that send nothing, all held open by this side.
        let mut idle = Vec::new();
        for _ in 0..200 {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let req = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n");
        for path in ["/healthz", "/readyz"] {
            let started = Instant::now();
            let answer = tokio::time::timeout(Duration::from_secs(3), get(addr, &req(path))).await;
            let answer = answer.unwrap_or_else(|_| panic!("{path} within 3 s with 200 idle connections"));
            println!("{path} answered in {:?} with 200 idle connections", started.elapsed());
            assert!(answer.starts_with("HTTP/1.1 200"), "{path}: {answer:?}");
        }
        let text = get(addr, &req("/metrics")).await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        assert!(!text.contains("edge-secret-007"), "no device id on /metrics: {text}");
        assert!(text.contains("anchorage_devices_known 1"), "{text}");
        let evicted = text
            .lines()
            .find_map(|l| l.strip_prefix("anchorage_http_connections_dropped_total{reason=\"evicted\"} "))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("the drop counter in {text}"));
        assert!(evicted >= (200 - MAX_CONNECTIONS) as f64, "{evicted} idle connections evicted");
        // An idle connection is closed once its head is overdue.
        let mut last = idle.pop().unwrap();
        let mut buf = [0u8; 16];
        let closed = tokio::time::timeout(HEADER_TIME + Duration::from_secs(3), last.read(&mut buf)).await;
        assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "an idle connection is closed: {closed:?}");
        let _ = stop.send(true);
    }
}
