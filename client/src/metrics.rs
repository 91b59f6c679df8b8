//! The device's own metrics, on `prometheus-client`, written as a Prometheus
//! **textfile** for node_exporter's textfile collector: the device opens no listening port.
//! `[metrics] textfile` in client.toml names the file; [`write_every`] rewrites it every
//! `every_s` seconds and [`ClientMetrics::write_textfile`] once more at exit.
//!
//! Names follow the server's conventions (`server/src/metrics.rs`) with the prefix
//! `anchorage_device_` (the server's `anchorage_client_*` are what devices *report* to it): the
//! unit in the name, `_total` on counters, labels with a fixed set of values, and every labelled
//! series present from the start at 0. The shell (`crate::transport`, `crate::broadcasts`)
//! counts; the sans-IO session counts nothing.
//!
//! The file is in Prometheus' text format (version 0.0.4, what the textfile collector parses):
//! `prometheus-client` writes OpenMetrics, whose counter families are named without `_total` and
//! carry `# UNIT` lines, so [`ClientMetrics::encode_text`] renames and drops those.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use anchorage_shared::ledger::{CostRecord, DeclineReason};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

/// One label and its value.
type Label = [(&'static str, &'static str); 1];
type FloatCounter = Counter<f64, AtomicU64>;

/// `direction` of a transfer: from the server to the device (a broadcast).
pub const DOWN: &str = "down";
/// `direction` of a transfer: from the device to the server (an update).
pub const UP: &str = "up";
/// `reason` of a refused transfer whose frame was not what was expected (another message, or
/// one that does not decode); the others are `TransferError::reason`'s.
pub const MALFORMED: &str = "malformed";
/// Every `reason` of `anchorage_device_transfers_refused_total`.
pub const REFUSAL_REASONS: [&str; 5] = ["bad_hash", "bad_offset", "too_large", "bad_offer", MALFORMED];

/// The metrics of one device (one per [`crate::transport::ClientOptions`], so that the devices
/// of a simulation never mix their counts).
#[derive(Debug)]
pub struct ClientMetrics {
    registry: Registry,
    transfers_refused: Family<[(&'static str, &'static str); 2], Counter>,
    transfers_resumed: Family<Label, Counter>,
    readings_refused: Counter,
    secagg_refused: Family<Label, Counter>,
    rounds_trained: Counter,
    training_failures: Counter,
    rounds_declined: Family<Label, Counter>,
    uploads: Counter,
    traffic: Family<Label, Counter>,
    compute: FloatCounter,
    connection_attempts: Family<Label, Counter>,
    connections_lost: Counter,
    connected: Gauge,
    last_round: Gauge,
    info: Family<Label, Gauge>,
}

impl Default for ClientMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ClientMetrics {
    pub fn new() -> Self {
        let m = Self {
            registry: Registry::default(),
            transfers_refused: Family::default(),
            transfers_resumed: Family::default(),
            readings_refused: Counter::default(),
            secagg_refused: Family::default(),
            rounds_trained: Counter::default(),
            training_failures: Counter::default(),
            rounds_declined: Family::default(),
            uploads: Counter::default(),
            traffic: Family::default(),
            compute: FloatCounter::default(),
            connection_attempts: Family::default(),
            connections_lost: Counter::default(),
            connected: Gauge::default(),
            last_round: Gauge::default(),
            info: Family::default(),
        };
        let mut root = Registry::default();
        m.register(root.sub_registry_with_prefix("anchorage_device"));
        m.create_fixed_series();
        Self { registry: root, ..m }
    }

    fn register(&self, r: &mut Registry) {
        r.register(
            "transfers_refused",
            "Resumable transfers refused by this device, by direction (down: a broadcast, up: the server's answer \
             to an upload) and reason (a chunk or whole with a wrong hash, an offset that leaves a gap or runs past \
             the end, an offer over the frame limit or unlike the one held, a malformed frame)",
            self.transfers_refused.clone(),
        );
        r.register(
            "transfers_resumed",
            "Transfers that began past offset 0 because the other side held part of them, by direction",
            self.transfers_resumed.clone(),
        );
        r.register(
            "readings_refused",
            "Values this device read of itself (sysfs, procfs) and refused as wrong (each also a warning in the log)",
            self.readings_refused.clone(),
        );
        r.register(
            "secagg_refused",
            "Secure aggregation messages from the server this device refused, by reason (undecodable, a wrong \
             round or stage, a bad key or share, a second Setup of a round it unmasked); each also a warning",
            self.secagg_refused.clone(),
        );
        r.register("rounds_trained", "Rounds this device trained", self.rounds_trained.clone());
        r.register("training_failures", "Trainings that failed", self.training_failures.clone());
        r.register(
            "rounds_declined",
            "Invitations this device declined, by reason ([eligibility] of client.toml)",
            self.rounds_declined.clone(),
        );
        r.register("uploads", "Updates uploaded whole (each acknowledged by QUIC)", self.uploads.clone());
        r.register_with_unit(
            "round_traffic",
            "UDP bytes of rounds as their cost records measured them (QUIC overhead and retransmissions included), \
             by direction",
            Unit::Bytes,
            self.traffic.clone(),
        );
        r.register_with_unit(
            "round_compute",
            "Seconds of training, from the rounds' cost records",
            Unit::Seconds,
            self.compute.clone(),
        );
        r.register(
            "connection_attempts",
            "Attempts to connect to the server, by outcome (connected, failed)",
            self.connection_attempts.clone(),
        );
        r.register(
            "connections_lost",
            "Connections to the server lost (the device reconnects with backoff)",
            self.connections_lost.clone(),
        );
        r.register("connected", "1 while connected to the server, else 0", self.connected.clone());
        r.register("last_round", "The round of the last broadcast this device received", self.last_round.clone());
        r.register("info", "This device's anchorage-client release (always 1)", self.info.clone());
    }

    /// Every series of a fixed label set exists from the start, at 0.
    fn create_fixed_series(&self) {
        for direction in [DOWN, UP] {
            for reason in REFUSAL_REASONS {
                let _ = self.transfers_refused.get_or_create(&[("direction", direction), ("reason", reason)]);
            }
            let _ = self.transfers_resumed.get_or_create(&[("direction", direction)]);
            let _ = self.traffic.get_or_create(&[("direction", direction)]);
        }
        for reason in DeclineReason::ALL {
            let _ = self.rounds_declined.get_or_create(&[("reason", reason.name())]);
        }
        for outcome in ["connected", "failed"] {
            let _ = self.connection_attempts.get_or_create(&[("outcome", outcome)]);
        }
        self.info.get_or_create(&[("version", env!("CARGO_PKG_VERSION"))]).set(1);
    }

    /// A transfer refused: `direction` is [`DOWN`] or [`UP`], `reason` one of [`REFUSAL_REASONS`]
    /// (`TransferError::reason`, or [`MALFORMED`]).
    pub fn transfer_refused(&self, direction: &'static str, reason: &'static str) {
        debug_assert!(REFUSAL_REASONS.contains(&reason), "{reason}");
        self.transfers_refused.get_or_create(&[("direction", direction), ("reason", reason)]).inc();
    }

    /// Transfers refused so far in `direction` for `reason`.
    pub fn transfers_refused(&self, direction: &'static str, reason: &'static str) -> u64 {
        self.transfers_refused.get_or_create(&[("direction", direction), ("reason", reason)]).get()
    }

    /// A transfer resumed past offset 0.
    pub fn transfer_resumed(&self, direction: &'static str) {
        self.transfers_resumed.get_or_create(&[("direction", direction)]).inc();
    }

    /// `n` values refused by one reading of the device.
    /// A secure aggregation message refused for `reason` (`SecAggError::reason`).
    pub fn secagg_refused(&self, reason: &'static str) {
        self.secagg_refused.get_or_create(&[("reason", reason)]).inc();
    }

    /// How many secure aggregation messages were refused for `reason`.
    pub fn secagg_refusals(&self, reason: &'static str) -> u64 {
        self.secagg_refused.get_or_create(&[("reason", reason)]).get()
    }

    pub fn readings_refused(&self, n: usize) {
        self.readings_refused.inc_by(n as u64);
    }

    pub fn trained(&self) {
        self.rounds_trained.inc();
    }

    pub fn training_failed(&self) {
        self.training_failures.inc();
    }

    pub fn declined(&self, reason: DeclineReason) {
        self.rounds_declined.get_or_create(&[("reason", reason.name())]).inc();
    }

    /// An update uploaded whole, resumed at `resumed_at` (0: sent from its start).
    pub fn uploaded(&self, resumed_at: u64) {
        self.uploads.inc();
        if resumed_at > 0 {
            self.transfer_resumed(UP);
        }
    }

    /// A round's complete cost record: its wire bytes and compute time.
    pub fn recorded(&self, record: &CostRecord) {
        self.traffic.get_or_create(&[("direction", DOWN)]).inc_by(record.wire_down);
        self.traffic.get_or_create(&[("direction", UP)]).inc_by(record.wire_up);
        if record.compute_seconds.is_finite() && record.compute_seconds > 0.0 {
            self.compute.inc_by(record.compute_seconds);
        }
    }

    /// A connection attempt came up (`true`) or failed.
    pub fn connect_attempt(&self, connected: bool) {
        let outcome = if connected { "connected" } else { "failed" };
        self.connection_attempts.get_or_create(&[("outcome", outcome)]).inc();
        if connected {
            self.connected.set(1);
        }
    }

    /// The connection ended: lost (`true`), or closed on leaving.
    pub fn disconnected(&self, lost: bool) {
        self.connected.set(0);
        if lost {
            self.connections_lost.inc();
        }
    }

    /// A broadcast of `round` arrived.
    pub fn broadcast(&self, round: u64) {
        self.last_round.set(i64::try_from(round).unwrap_or(i64::MAX));
    }

    /// The exposition in Prometheus' text format (0.0.4): counter families named with `_total`,
    /// no `# UNIT`, no `# EOF`.
    pub fn encode_text(&self) -> String {
        let mut openmetrics = String::new();
        // Writing into a String does not fail.
        let _ = prometheus_client::encoding::text::encode_registry(&mut openmetrics, &self.registry);
        to_text_format(&openmetrics)
    }

    /// Writes [`Self::encode_text`] to `path` atomically, readable by node_exporter: a temporary
    /// file in the same folder (a name that does not end in `.prom`, which the collector skips),
    /// mode 0644 whatever the umask, fsync, rename over `path`. The folder is not created (a
    /// missing one is a wrong path, and `anchorage-client check-config` says so).
    pub fn write_textfile(&self, path: &Path) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let mut tmp = tempfile::Builder::new().prefix(".anchorage-device-").suffix(".tmp").tempfile_in(dir)?;
        // The service's umask (0077) would leave it unreadable by node_exporter's user.
        tmp.as_file().set_permissions(std::fs::Permissions::from_mode(0o644))?;
        tmp.write_all(self.encode_text().as_bytes())?;
        tmp.as_file().sync_all()?;
        tmp.persist(path).map_err(|e| e.error)?;
        Ok(())
    }
}

/// `openmetrics` (as `prometheus-client` writes it: counters and gauges) in Prometheus' text
/// format: counter families renamed with `_total`, `# UNIT` and `# EOF` left out.
fn to_text_format(openmetrics: &str) -> String {
    let counters: std::collections::BTreeSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .filter(|name| !name.ends_with("_total"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len() + 64);
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].into_iter().find_map(|tag| {
            let (name, rest) = line.strip_prefix(tag)?.split_once(' ')?;
            counters.contains(name).then(|| format!("{tag}{name}_total {rest}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// Writes `metrics` to `path` now and every `every` after, until the task is dropped or
/// aborted (the runner writes once more at exit). A failed write is logged once, not at every
/// tick, until a write succeeds again.
pub async fn write_every(metrics: Arc<ClientMetrics>, path: std::path::PathBuf, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tick.tick().await;
        match metrics.write_textfile(&path) {
            Ok(()) if failing => {
                failing = false;
                tracing::info!(textfile = %path.display(), "writing the metrics textfile works again");
            }
            Ok(()) => {}
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(
                    textfile = %path.display(),
                    error = %e,
                    "could not write the metrics textfile ([metrics] textfile in client.toml: its folder must exist \
                     and be writable by this service); retrying every {every:?}"
                );
            }
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What node_exporter's textfile collector needs of a file: every line a `# HELP`, a
    /// `# TYPE` (counter or gauge) or a sample of the family typed last, with a legal name and a
    /// number; no family typed twice. Returns the samples, `name{labels}` → value.
    pub(crate) fn parse_text_format(text: &str) -> std::collections::BTreeMap<String, f64> {
        let legal = |n: &str| {
            !n.is_empty()
                && !n.starts_with(|c: char| c.is_ascii_digit())
                && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        };
        let (mut samples, mut typed, mut family) = (std::collections::BTreeMap::new(), Vec::new(), String::new());
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap();
                assert!(legal(name) && !help.is_empty(), "{line}");
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert!(legal(name) && ["counter", "gauge"].contains(&kind), "{line}");
                assert!(!name.ends_with("_total") || kind == "counter", "{line}");
                assert!(kind != "counter" || name.ends_with("_total"), "{line}");
                assert!(!typed.contains(&name.to_string()), "typed twice: {line}");
                typed.push(name.to_string());
                family = name.to_string();
            } else {
                assert!(!line.starts_with('#'), "{line}");
                let (series, value) = line.rsplit_once(' ').unwrap();
                let name = series.split('{').next().unwrap();
                assert!(legal(name) && name == family, "a sample outside its family: {line}");
                if let Some(labels) = series.strip_prefix(name).filter(|l| !l.is_empty()) {
                    assert!(labels.starts_with('{') && labels.ends_with('}'), "{line}");
                }
                samples.insert(series.to_string(), value.parse::<f64>().unwrap());
            }
        }
        samples
    }

    #[test]
    fn every_labelled_series_is_there_from_the_start_and_counts() {
        let m = ClientMetrics::new();
        let samples = parse_text_format(&m.encode_text());
        assert_eq!(samples.keys().filter(|k| k.starts_with("anchorage_device_transfers_refused_total{")).count(), 10);
        assert_eq!(samples["anchorage_device_transfers_refused_total{direction=\"up\",reason=\"malformed\"}"], 0.0);
        assert_eq!(samples["anchorage_device_rounds_declined_total{reason=\"thermal\"}"], 0.0);
        assert_eq!(samples["anchorage_device_readings_refused_total"], 0.0);
        let info = format!("anchorage_device_info{{version=\"{}\"}}", env!("CARGO_PKG_VERSION"));
        assert_eq!(samples[&info], 1.0);

        m.transfer_refused(DOWN, "bad_hash");
        m.readings_refused(3);
        m.declined(DeclineReason::Battery);
        m.uploaded(4096);
        m.connect_attempt(true);
        m.broadcast(12);
        m.recorded(&CostRecord { wire_up: 1000, wire_down: 5000, compute_seconds: 1.5, ..Default::default() });
        let samples = parse_text_format(&m.encode_text());
        assert_eq!(samples["anchorage_device_transfers_refused_total{direction=\"down\",reason=\"bad_hash\"}"], 1.0);
        assert_eq!(samples["anchorage_device_readings_refused_total"], 3.0);
        assert_eq!(samples["anchorage_device_rounds_declined_total{reason=\"battery\"}"], 1.0);
        assert_eq!(samples["anchorage_device_uploads_total"], 1.0);
        assert_eq!(samples["anchorage_device_transfers_resumed_total{direction=\"up\"}"], 1.0);
        assert_eq!(samples["anchorage_device_connection_attempts_total{outcome=\"connected\"}"], 1.0);
        assert_eq!(samples["anchorage_device_connected"], 1.0);
        assert_eq!(samples["anchorage_device_last_round"], 12.0);
        assert_eq!(samples["anchorage_device_round_traffic_bytes_total{direction=\"down\"}"], 5000.0);
        assert_eq!(samples["anchorage_device_round_compute_seconds_total"], 1.5);
        m.disconnected(true);
        let samples = parse_text_format(&m.encode_text());
        assert_eq!(
            (samples["anchorage_device_connected"], samples["anchorage_device_connections_lost_total"]),
            (0.0, 1.0)
        );
    }

    /// The textfile is replaced whole (a rename: a reader sees the old file or the new one),
    /// readable by others, leaves no temporary file, parses, and carries the counts.
    #[test]
    fn the_textfile_is_written_atomically_and_parses() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("anchorage-client.prom");
        let m = ClientMetrics::new();
        std::fs::write(&path, "old").unwrap();
        let old_inode = std::fs::metadata(&path).unwrap().ino();
        m.transfer_refused(UP, "bad_offset");
        m.write_textfile(&path).unwrap();
        let meta = std::fs::metadata(&path).unwrap();
        assert_ne!(meta.ino(), old_inode, "a new file renamed over the old one, not rewritten in place");
        assert_eq!(meta.permissions().mode() & 0o777, 0o644, "node_exporter's user reads it");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, [std::ffi::OsString::from("anchorage-client.prom")], "no temporary file is left");
        let samples = parse_text_format(&std::fs::read_to_string(&path).unwrap());
        assert_eq!(samples["anchorage_device_transfers_refused_total{direction=\"up\",reason=\"bad_offset\"}"], 1.0);
        assert!(samples.len() > 20, "{samples:?}");
        promtool_check_metrics(&path);

        // A folder that is not there is an error, and nothing is created.
        let missing = dir.path().join("nowhere/anchorage-client.prom");
        assert!(m.write_textfile(&missing).is_err());
        assert!(!dir.path().join("nowhere").exists());
    }

    /// `promtool check metrics < path` (what node_exporter's parser and Prometheus' lint say of
    /// the text format), where promtool is installed; a loud SKIPPED line where it is not.
    fn promtool_check_metrics(path: &Path) {
        let out = std::process::Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(std::fs::File::open(path).unwrap())
            .output();
        let out = match out {
            Ok(out) => out,
            Err(e) => {
                anchorage_shared::skip::skipped(&format!(
                    "`promtool check metrics` on the device's textfile: promtool is not installed ({e}); install \
                     it with `apt-get install prometheus`. The Rust check above ran."
                ));
                return;
            }
        };
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && said.trim().is_empty(), "promtool check metrics: {}\n{said}", out.status);
    }

    #[tokio::test]
    async fn the_writer_rewrites_the_file_on_its_interval() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("anchorage-client.prom");
        let m = Arc::new(ClientMetrics::new());
        let writer = tokio::spawn(write_every(m.clone(), path.clone(), Duration::from_millis(20)));
        tokio::time::sleep(Duration::from_millis(60)).await;
        m.broadcast(7);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let samples = parse_text_format(&std::fs::read_to_string(&path).unwrap_or_default());
            if samples.get("anchorage_device_last_round") == Some(&7.0) {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "the writer did not rewrite the file");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        writer.abort();
    }
}
