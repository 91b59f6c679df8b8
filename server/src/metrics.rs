//! The server's metrics, on `prometheus-client`: one [`Registry`] per server, so that servers
//! that share a process (the simulator, the tests) never mix their counts. [`http`] serves them
//! (`GET /metrics`) beside the health probes (`/healthz`, `/readyz`) on the port `[metrics]`
//! names; [`process`] adds the process's own CPU, memory and file descriptors.
//!
//! Names follow Prometheus' conventions: the `anchorage_` prefix, the unit in the name
//! (`_seconds`, `_bytes`), `_total` on counters, and what varies as a label with a fixed set of
//! values (`direction`, `kind`, `reason`, `outcome`, `result`, `phase`). Every labelled series
//! exists from the start, at 0. The one label whose values come from outside is `device` on
//! `anchorage_device_last_seen_timestamp_seconds`, bounded by `[metrics] device_series`.
//!
//! The totals of what clients report (`anchorage_client_*`: bytes, seconds, energy, rounds) are
//! replayed from the durable cost ledger at start, and the devices' last-seen times and the last
//! round's close from the client registry and the rounds table, so they survive a restart. The
//! other counters count from the process's start (Prometheus' `rate` and `increase` handle the
//! reset).

pub mod condition;
pub mod http;
pub mod process;
pub use process::{
    AllocatorStats, flush_allocator_if_requested, request_allocator_flush, set_allocator_flush, set_allocator_probe,
};
pub mod rounds;
pub mod secagg;
pub mod text;

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::RefusalReason;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use crate::engine::{RoundOutcome, RoundReport};

/// One label and its value.
type Label = [(&'static str, &'static str); 1];
type FloatCounter = Counter<f64, AtomicU64>;

/// Upper bounds (seconds) of the round-time histograms: sub-second loopback rounds up to
/// hour-long field rounds with slow devices.
pub const SECONDS_BUCKETS: [f64; 15] =
    [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0];

/// Devices with their own last-seen series by default (`[metrics] device_series`).
pub const DEFAULT_DEVICE_SERIES: usize = 1000;
/// A device silent this long is taken as retired: it leaves the per-device series (it is still
/// counted in `anchorage_devices_silent`).
pub const RETIRED_AFTER_SECONDS: i64 = 30 * 86_400;

/// `outcome` of `anchorage_updates_total`.
/// The `result` labels of `anchorage_client_rounds`: one ledger row each.
const CLIENT_ROUND_RESULTS: [&str; 4] = ["completed", "late", "dropped", "declined"];

pub mod outcome {
    /// Committed to the store and acknowledged, for the round it answers.
    pub const ACCEPTED: &str = "accepted";
    /// Arrived after its round closed: acknowledged, counted, not aggregated.
    pub const LATE: &str = "late";
    /// A resend of an update already accepted: acknowledged again, counted once.
    pub const DUPLICATE: &str = "duplicate";
    pub const ALL: [&str; 3] = [ACCEPTED, LATE, DUPLICATE];
}

/// `reason` of `anchorage_refusals_total` for refusals of the transport (before the engine sees
/// a message); the engine's own carry a [`RefusalReason`] ([`refusal_reason`]).
pub mod reason {
    /// `[limits] max_connections` connections were open.
    pub const CONNECTION_LIMIT: &str = "connection_limit";
    /// `[limits] max_handshakes_per_ip` handshakes were in progress from the peer's address.
    pub const HANDSHAKE_LIMIT: &str = "handshake_limit";
    /// The certificate names no usable id, does not parse, is for another purpose or its
    /// signature is wrong (one count per refused handshake).
    pub const BAD_CERTIFICATE: &str = "bad_certificate";
    /// The certificate is on the revocation list (one count per refused handshake, and per live
    /// connection closed on a revocation).
    pub const REVOKED: &str = "revoked";
    /// Two devices hold one certificate (their connections keep evicting each other).
    pub const CERTIFICATE_CONFLICT: &str = "certificate_conflict";
    /// TLS refused the handshake: a certificate another CA signed (alert unknown_ca).
    pub const UNKNOWN_CA: &str = "unknown_ca";
    /// TLS refused the handshake: a certificate out of its validity period.
    pub const CERTIFICATE_EXPIRED: &str = "certificate_expired";
    /// TLS refused the handshake: the peer showed no certificate under mutual TLS.
    pub const NO_CERTIFICATE: &str = "no_certificate";
    /// TLS refused the handshake for another reason (no common protocol, a malformed message).
    pub const TLS_HANDSHAKE: &str = "tls_handshake";
    pub const TRANSPORT: [&str; 9] = [
        CONNECTION_LIMIT,
        HANDSHAKE_LIMIT,
        BAD_CERTIFICATE,
        REVOKED,
        CERTIFICATE_CONFLICT,
        UNKNOWN_CA,
        CERTIFICATE_EXPIRED,
        NO_CERTIFICATE,
        TLS_HANDSHAKE,
    ];
}

/// The label value of a protocol refusal.
pub fn refusal_reason(r: RefusalReason) -> &'static str {
    match r {
        RefusalReason::VersionMismatch => "version_mismatch",
        RefusalReason::Malformed => "malformed",
        RefusalReason::TooLarge => "too_large",
        RefusalReason::ShapeMismatch => "shape_mismatch",
        RefusalReason::NotEnrolled => "not_enrolled",
        RefusalReason::NotSampled => "not_sampled",
        RefusalReason::Duplicate => "duplicate",
        RefusalReason::ServerBusy => "server_busy",
        RefusalReason::UnknownMethod => "unknown_method",
        RefusalReason::BadTensor => "bad_tensor",
        // The same label as a revoked certificate's refused handshake (in `reason::TRANSPORT`).
        RefusalReason::Revoked => reason::REVOKED,
    }
}

const PROTOCOL_REASONS: [RefusalReason; 10] = [
    RefusalReason::VersionMismatch,
    RefusalReason::Malformed,
    RefusalReason::TooLarge,
    RefusalReason::ShapeMismatch,
    RefusalReason::NotEnrolled,
    RefusalReason::NotSampled,
    RefusalReason::Duplicate,
    RefusalReason::ServerBusy,
    RefusalReason::UnknownMethod,
    RefusalReason::BadTensor,
];

/// Seconds since the Unix epoch.
pub fn unix_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// The metrics of one server.
#[derive(Debug)]
pub struct ServerMetrics {
    registry: Registry,
    connections: Counter,
    frames: Family<Label, Counter>,
    frame_bytes: Family<Label, Counter>,
    decode_errors: Counter,
    refusals: Family<Label, Counter>,
    updates: Family<Label, Counter>,
    /// A relay's partial aggregates, by outcome: `sent`, `acked`, `refused`.
    relay_partials: Family<Label, Counter>,
    /// Whether a relay holds a welcomed connection to its parent.
    relay_parent_connected: Gauge,
    store_errors: Counter,
    rounds_closed: Family<Label, Counter>,
    last_round: Gauge,
    last_round_closed: Gauge<f64, AtomicU64>,
    round_duration: Histogram,
    clients_connected: Gauge,
    clients_sampled: Gauge,
    client_rounds: Family<Label, Counter>,
    client_bytes: Family<[(&'static str, &'static str); 2], Counter>,
    client_seconds: Family<Label, FloatCounter>,
    client_energy: FloatCounter,
    client_round_duration: Histogram,
    crl_stale: Gauge,
    crl_reload_failures: Counter,
    endpoint_renewals: Counter,
    transfers: Family<Label, Counter>,
    transfer_bytes_resumed: Counter,
    devices_ahead: Gauge,
    rounds_halted: Gauge,
    certificate_conflicts: Counter,
    cost_records_dropped: Gauge,
    influence_bounded: Family<Label, Counter>,
    /// Declines and the devices' reported condition.
    condition: condition::ConditionMetrics,
    devices: std::sync::Arc<Devices>,
    /// The last round's quality, the shortfall of devices, the end of the run.
    status: std::sync::Arc<rounds::RoundStatus>,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ServerMetrics {
    pub fn new() -> Self {
        let mut root = Registry::default();
        let r = root.sub_registry_with_prefix("anchorage");
        let m = Self::unregistered();
        m.register_protocol(r);
        m.register_rounds(r);
        m.register_clients(r);
        m.register_trust(r);
        m.condition.register(r);

        r.register_collector(Box::new(m.devices.clone()));
        r.register_collector(Box::new(m.status.clone()));

        m.create_fixed_series();
        Self { registry: root, ..m }
    }

    /// Every metric at zero, registered nowhere yet.
    fn unregistered() -> Self {
        Self {
            registry: Registry::default(),
            connections: Counter::default(),
            frames: Family::default(),
            frame_bytes: Family::default(),
            decode_errors: Counter::default(),
            refusals: Family::default(),
            updates: Family::default(),
            relay_partials: Family::default(),
            relay_parent_connected: Gauge::default(),
            store_errors: Counter::default(),
            rounds_closed: Family::default(),
            last_round: Gauge::default(),
            last_round_closed: Gauge::default(),
            round_duration: Histogram::new(SECONDS_BUCKETS),
            clients_connected: Gauge::default(),
            clients_sampled: Gauge::default(),
            client_rounds: Family::default(),
            client_bytes: Family::default(),
            client_seconds: Family::default(),
            client_energy: FloatCounter::default(),
            client_round_duration: Histogram::new(SECONDS_BUCKETS),
            crl_stale: Gauge::default(),
            crl_reload_failures: Counter::default(),
            endpoint_renewals: Counter::default(),
            transfers: Family::default(),
            transfer_bytes_resumed: Counter::default(),
            devices_ahead: Gauge::default(),
            rounds_halted: Gauge::default(),
            certificate_conflicts: Counter::default(),
            cost_records_dropped: Gauge::default(),
            influence_bounded: Family::default(),
            condition: condition::ConditionMetrics::default(),
            devices: std::sync::Arc::new(Devices::default()),
            status: std::sync::Arc::new(rounds::RoundStatus::default()),
        }
    }

    /// Connections, frames, refusals, acknowledged updates, store errors.
    fn register_protocol(&self, r: &mut Registry) {
        r.register("connections", "QUIC connections accepted for a handshake.", self.connections.clone());
        r.register("frames", "Protocol frames read from (up) and written to (down) clients.", self.frames.clone());
        r.register_with_unit(
            "frame",
            "Bytes of protocol frames read from (up) and written to (down) clients.",
            Unit::Bytes,
            self.frame_bytes.clone(),
        );
        r.register("decode_errors", "Frames from clients that could not be read.", self.decode_errors.clone());
        r.register(
            "refusals",
            "Messages and connections refused, by reason (protocol refusals, limits, certificates).",
            self.refusals.clone(),
        );
        r.register(
            "updates",
            "Updates acknowledged, by outcome: accepted for their round, late (their round had closed), \
             duplicate (a resend of an accepted one).",
            self.updates.clone(),
        );
        r.register("store_errors", "Failed writes of durable state.", self.store_errors.clone());
    }

    /// The rounds: closed, last, duration, who was connected and sampled, influence bounds, dropped cost records.
    fn register_rounds(&self, r: &mut Registry) {
        r.register(
            "relay_partials",
            "A relay's partial aggregates sent to its parent, acked and refused (zero at the root).",
            self.relay_partials.clone(),
        );
        r.register(
            "relay_parent_connected",
            "1 while a relay holds a welcomed connection to its parent (0 at the root).",
            self.relay_parent_connected.clone(),
        );
        r.register(
            "rounds_closed",
            "Rounds closed since this process started, by outcome.",
            self.rounds_closed.clone(),
        );
        r.register("last_round", "The last round that closed.", self.last_round.clone());
        r.register_with_unit(
            "last_round_closed_timestamp",
            "When the last round closed (Unix time; kept across restarts).",
            Unit::Seconds,
            self.last_round_closed.clone(),
        );
        r.register_with_unit(
            "round_duration",
            "Time from a round's opening to its close.",
            Unit::Seconds,
            self.round_duration.clone(),
        );
        r.register("clients_connected", "Clients connected now (a valid hello).", self.clients_connected.clone());
        r.register("clients_sampled", "Clients invited to the round opened last.", self.clients_sampled.clone());
        r.register(
            "cost_records_dropped",
            "Cost records dropped since the federation began (not invited, repeated, beyond the frame limits or physical ranges).",
            self.cost_records_dropped.clone(),
        );
        r.register(
            "influence_bounded",
            "Updates whose weight or change the round's influence bounds lowered, by bound.",
            self.influence_bounded.clone(),
        );
    }

    /// What clients reported in their cost records: rounds, traffic, time, energy.
    fn register_clients(&self, r: &mut Registry) {
        r.register(
            "client_rounds",
            "Rounds of sampled clients as clients reported them: completed, late (after the close), \
             dropped (nothing before the deadline), declined (the device said it should not train now).",
            self.client_rounds.clone(),
        );
        r.register_with_unit(
            "client_traffic",
            "Bytes clients reported, by direction and kind (payload: parameter and prototype values; \
             wire: UDP bytes, QUIC overhead and retransmissions included).",
            Unit::Bytes,
            self.client_bytes.clone(),
        );
        r.register_with_unit(
            "client_time",
            "Client seconds reported, by phase (compute, transfer, wait).",
            Unit::Seconds,
            self.client_seconds.clone(),
        );
        r.register_with_unit(
            "client_energy",
            "Estimated energy of clients' rounds (compute and radio).",
            Unit::Joules,
            self.client_energy.clone(),
        );
        r.register_with_unit(
            "client_round_duration",
            "A client's time in one round: compute + transfer + wait, as it reported it.",
            Unit::Seconds,
            self.client_round_duration.clone(),
        );
    }

    /// Revocation list, rollback witnesses, certificate conflicts.
    fn register_trust(&self, r: &mut Registry) {
        r.register(
            "crl_stale",
            "1 while revoked.crl is missing or does not parse and the server keeps its last good list, else 0.",
            self.crl_stale.clone(),
        );
        r.register(
            "devices_ahead",
            "Devices whose hello named a round this server never announced (the store may have been rolled back).",
            self.devices_ahead.clone(),
        );
        r.register(
            "rounds_halted",
            "1 while no round opens because devices witnessed a rollback (anchorage-server accept-rollback), else 0.",
            self.rounds_halted.clone(),
        );
        r.register(
            "certificate_conflicts",
            "Times two live connections kept presenting one certificate (both refused; revoke it).",
            self.certificate_conflicts.clone(),
        );
        r.register(
            "crl_reload_failures",
            "Changes of revoked.crl that could not be loaded (missing or not a CRL).",
            self.crl_reload_failures.clone(),
        );
        r.register(
            "endpoint_renewals",
            "Times the QUIC endpoint was replaced by a fresh one after a large fleet had left.",
            self.endpoint_renewals.clone(),
        );
        r.register(
            "transfers",
            "Resumable uploads by outcome: completed, resumed (began past offset 0), kept (interrupted, held for a resume), dropped (held bytes let go: round closed, over the bound), refused (a bad chunk, whole or saved file), saved (written at shutdown for the next start), restored (read back at start).",
            self.transfers.clone(),
        );
        r.register(
            "transfer_bytes_resumed",
            "Bytes of uploads a device did not send again because the server held them from an interrupted attempt.",
            self.transfer_bytes_resumed.clone(),
        );
    }

    /// Every series of a fixed label set exists from the start, at 0.
    fn create_fixed_series(&self) {
        for direction in ["up", "down"] {
            let _ = self.frames.get_or_create(&[("direction", direction)]);
            let _ = self.frame_bytes.get_or_create(&[("direction", direction)]);
            for kind in ["payload", "wire"] {
                let _ = self.client_bytes.get_or_create(&[("direction", direction), ("kind", kind)]);
            }
        }
        for r in PROTOCOL_REASONS.map(refusal_reason).iter().chain(&reason::TRANSPORT) {
            let _ = self.refusals.get_or_create(&[("reason", r)]);
        }
        for o in outcome::ALL {
            let _ = self.updates.get_or_create(&[("outcome", o)]);
        }
        for o in ["sent", "acked", "refused"] {
            let _ = self.relay_partials.get_or_create(&[("outcome", o)]);
        }
        for o in ["completed", "resumed", "kept", "dropped", "refused", "saved", "restored"] {
            let _ = self.transfers.get_or_create(&[("outcome", o)]);
        }
        for o in ["aggregated", "failed"] {
            let _ = self.rounds_closed.get_or_create(&[("outcome", o)]);
        }
        for r in CLIENT_ROUND_RESULTS {
            let _ = self.client_rounds.get_or_create(&[("result", r)]);
        }
        for p in ["compute", "transfer", "wait"] {
            let _ = self.client_seconds.get_or_create(&[("phase", p)]);
        }
    }

    /// The exposition, without OpenMetrics' closing `# EOF` (so that several registries can be
    /// written one after the other; [`http`] adds it).
    pub fn encode(&self, out: &mut String) -> std::fmt::Result {
        prometheus_client::encoding::text::encode_registry(out, &self.registry)
    }

    /// The whole exposition (OpenMetrics text).
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = self.encode(&mut out);
        let _ = prometheus_client::encoding::text::encode_eof(&mut out);
        out
    }

    pub fn connection_accepted(&self) {
        self.connections.inc();
    }

    /// A frame of `bytes` read from a client.
    pub fn frame_in(&self, bytes: usize) {
        self.frames.get_or_create(&[("direction", "up")]).inc();
        self.frame_bytes.get_or_create(&[("direction", "up")]).inc_by(bytes as u64);
    }

    /// A frame of `bytes` queued for `clients` clients.
    pub fn frames_out(&self, bytes: usize, clients: u64) {
        self.frames.get_or_create(&[("direction", "down")]).inc_by(clients);
        self.frame_bytes.get_or_create(&[("direction", "down")]).inc_by((bytes as u64).saturating_mul(clients));
    }

    pub fn decode_error(&self) {
        self.decode_errors.inc();
    }

    /// A refusal, by its label value ([`refusal_reason`] or one of [`reason`]).
    pub fn refused(&self, reason: &'static str) {
        self.refusals.get_or_create(&[("reason", reason)]).inc();
    }

    /// A relay's partial aggregate: `sent`, `acked` or `refused` by the parent.
    pub fn relay_partial(&self, outcome: &'static str) {
        self.relay_partials.get_or_create(&[("outcome", outcome)]).inc();
    }

    /// Whether a relay's link to its parent is up.
    pub fn set_relay_parent_connected(&self, up: bool) {
        self.relay_parent_connected.set(i64::from(up));
    }

    /// An acknowledged update, by [`outcome`].
    pub fn update(&self, outcome: &'static str) {
        self.updates.get_or_create(&[("outcome", outcome)]).inc();
    }

    pub fn store_error(&self) {
        self.store_errors.inc();
    }

    /// A round closed (now).
    pub fn round_closed(&self, report: &RoundReport) {
        let outcome = match report.outcome {
            RoundOutcome::Aggregated => "aggregated",
            RoundOutcome::Failed { .. } => "failed",
        };
        self.rounds_closed.get_or_create(&[("outcome", outcome)]).inc();
        self.last_round.set(i64::try_from(report.round).unwrap_or(i64::MAX));
        self.round_duration.observe(report.closed.saturating_sub(report.started).as_secs_f64());
        self.set_last_round_closed_at(unix_now());
        let clipped =
            [("weight", report.influence.weight_clipped.len()), ("norm", report.influence.norm_clipped.len())];
        for (bound, n) in clipped {
            self.influence_bounded.get_or_create(&[("bound", bound)]).inc_by(n as u64);
        }
        self.status.round_closed(report, unix_now());
    }

    /// The engine's rule for opening a round, for `anchorage_waiting_for_devices` and `/readyz`.
    pub fn expect_devices(&self, rule: rounds::Opening) {
        self.status.expect(rule, unix_now());
    }

    /// The global model after `round` scored `accuracy` on the operator's held-out set.
    pub fn held_out_evaluated(&self, round: u64, accuracy: f64) {
        self.status.held_out(round, accuracy);
    }

    /// Every configured round has closed (`anchorage_run_finished 1`, and `/readyz` says so).
    pub fn set_run_finished(&self) {
        self.status.finished(unix_now());
    }

    pub fn run_finished(&self) -> bool {
        self.status.is_finished()
    }

    /// The shortfall of devices to open the next round, if any.
    pub fn waiting(&self) -> Option<rounds::Waiting> {
        self.status.waiting(unix_now())
    }

    /// What `/readyz` says below `ready`: the end of the run, halted rounds, or a stall.
    pub fn status_note(&self) -> Option<String> {
        self.status.note(unix_now())
    }

    /// The last closed round's device accuracy and how many updates reported one.
    pub fn round_device_accuracy(&self) -> Option<(f64, usize)> {
        self.status.device_accuracy()
    }

    /// The last held-out evaluation: (round, accuracy).
    pub fn held_out_accuracy(&self) -> Option<(u64, f64)> {
        self.status.held_out_accuracy()
    }

    /// The devices' rollback witness: how many reported rounds beyond this server's, and
    /// whether that stopped new rounds.
    pub fn set_rollback_evidence(&self, devices_ahead: usize, halted: bool) {
        self.devices_ahead.set(devices_ahead as i64);
        self.rounds_halted.set(i64::from(halted));
        self.status.halted(halted, unix_now());
    }

    /// The engine's count of dropped cost records (its checkpointed total).
    pub fn set_engine_drops(&self, dropped_cost_records: u64) {
        self.cost_records_dropped.set(i64::try_from(dropped_cost_records).unwrap_or(i64::MAX));
    }

    /// Two devices hold one certificate.
    pub fn certificate_conflict(&self) {
        self.certificate_conflicts.inc();
    }

    pub fn certificate_conflicts_total(&self) -> u64 {
        self.certificate_conflicts.get()
    }

    /// Devices reporting rounds beyond this server's (see [`Self::set_rollback_evidence`]).
    pub fn devices_ahead(&self) -> i64 {
        self.devices_ahead.get()
    }

    /// Whether rounds are halted for a suspected rollback.
    pub fn rounds_halted(&self) -> bool {
        self.rounds_halted.get() == 1
    }

    /// When the last round closed (Unix seconds; the store's record at start).
    pub fn set_last_round_closed_at(&self, unix: i64) {
        self.last_round_closed.set(unix as f64);
    }

    pub fn set_connected(&self, clients: usize) {
        self.clients_connected.set(clients as i64);
        self.status.connected(clients, unix_now());
    }

    pub fn set_sampled(&self, clients: usize) {
        self.clients_sampled.set(clients as i64);
    }

    /// Adds one cost record (a client's round) to the totals.
    pub fn record_cost(&self, c: &CostRecord) {
        self.condition.record(c);
        let result = match (c.declined.is_some(), c.dropped, c.straggler) {
            (true, _, _) => "declined",
            (false, true, _) => "dropped",
            (false, false, true) => "late",
            (false, false, false) => "completed",
        };
        self.client_rounds.get_or_create(&[("result", result)]).inc();
        for (direction, kind, v) in [
            ("up", "payload", c.payload_up),
            ("up", "wire", c.wire_up),
            ("down", "payload", c.payload_down),
            ("down", "wire", c.wire_down),
        ] {
            self.client_bytes.get_or_create(&[("direction", direction), ("kind", kind)]).inc_by(v);
        }
        let secs = |s: f64| if s.is_finite() { s.max(0.0) } else { 0.0 };
        for (phase, v) in [("compute", c.compute_seconds), ("transfer", c.transfer_seconds), ("wait", c.wait_seconds)] {
            self.client_seconds.get_or_create(&[("phase", phase)]).inc_by(secs(v));
        }
        self.client_energy.inc_by(secs(c.joules));
        if !c.dropped && c.declined.is_none() {
            self.client_round_duration
                .observe(secs(c.compute_seconds) + secs(c.transfer_seconds) + secs(c.wait_seconds));
        }
    }

    /// Whether the revocation list in use is stale (its file is missing or damaged).
    pub fn set_crl_stale(&self, stale: bool) {
        self.crl_stale.set(i64::from(stale));
    }

    /// A change of the CRL file that could not be loaded.
    pub fn crl_reload_failed(&self) {
        self.crl_reload_failures.inc();
    }

    /// A resumable upload's step, by outcome (`transport::transfers`).
    pub fn transfer(&self, outcome: &'static str) {
        self.transfers(outcome, 1);
    }

    /// `n` resumable uploads' steps of one outcome.
    pub fn transfers(&self, outcome: &'static str, n: u64) {
        self.transfers.get_or_create(&[("outcome", outcome)]).inc_by(n);
    }

    /// An upload resumed at `offset` bytes: they were not sent again.
    pub fn transfer_resumed(&self, offset: u64) {
        self.transfer("resumed");
        self.transfer_bytes_resumed.inc_by(offset);
    }

    /// Uploads of `outcome` so far.
    pub fn transfers_total(&self, outcome: &'static str) -> u64 {
        self.transfers.get(&[("outcome", outcome)]).map_or(0, |c| c.get())
    }

    /// The QUIC endpoint was renewed (`transport::endpoint::Listener`).
    pub fn endpoint_renewed(&self) {
        self.endpoint_renewals.inc();
    }

    /// A client was heard from at `unix` (seconds).
    pub fn seen(&self, client: &str, unix: i64) {
        self.devices.seen(client, unix);
    }

    /// Copies the per-device last-seen map into fresh allocations (after most of a fleet left:
    /// see the engine loop's `compact_after_departures`).
    pub fn compact(&self) {
        self.devices.compact();
    }

    /// Devices with their own last-seen series (the longest silent first); the rest are counted
    /// in `anchorage_devices_silent` only.
    pub fn set_device_series(&self, max: usize) {
        self.devices.max_series.store(max, Ordering::Relaxed);
    }

    // Totals for the simulator's summary and the tests.

    /// Refusals of every reason.
    pub fn refusals_total(&self) -> u64 {
        let mut total = 0;
        for r in PROTOCOL_REASONS.map(refusal_reason).iter().chain(&reason::TRANSPORT) {
            total += self.refusals.get(&[("reason", r)]).map_or(0, |c| c.get());
        }
        total
    }

    /// Refusals of one reason.
    pub fn refusals_of(&self, reason: &'static str) -> u64 {
        self.refusals.get(&[("reason", reason)]).map_or(0, |c| c.get())
    }

    pub fn decode_errors_total(&self) -> u64 {
        self.decode_errors.get()
    }

    pub fn updates_total(&self, outcome: &'static str) -> u64 {
        self.updates.get(&[("outcome", outcome)]).map_or(0, |c| c.get())
    }

    /// Rounds closed since the process started, aggregated or failed.
    pub fn rounds_closed_total(&self) -> u64 {
        ["aggregated", "failed"].iter().map(|o| self.rounds_closed.get(&[("outcome", o)]).map_or(0, |c| c.get())).sum()
    }

    /// Cost records counted (one per client per round), those replayed from the store included.
    pub fn client_rounds_total(&self) -> u64 {
        CLIENT_ROUND_RESULTS.iter().map(|r| self.client_rounds.get(&[("result", r)]).map_or(0, |c| c.get())).sum()
    }

    /// Bytes clients reported for one direction (`up`, `down`) and kind (`payload`, `wire`).
    pub fn client_bytes_total(&self, direction: &'static str, kind: &'static str) -> u64 {
        self.client_bytes.get(&[("direction", direction), ("kind", kind)]).map_or(0, |c| c.get())
    }
}

/// When each device was last heard from, exported at each scrape with a bounded number of
/// series: `anchorage_devices_known`, `anchorage_devices_silent{since}` over every device, and
/// `anchorage_device_last_seen_timestamp_seconds{device}` for at most `max_series` devices (the
/// longest silent first, none silent for more than [`RETIRED_AFTER_SECONDS`]).
#[derive(Debug)]
struct Devices {
    seen: Mutex<HashMap<String, i64>>,
    max_series: AtomicUsize,
}

impl Default for Devices {
    fn default() -> Self {
        Self { seen: Mutex::default(), max_series: AtomicUsize::new(DEFAULT_DEVICE_SERIES) }
    }
}

impl Devices {
    fn compact(&self) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        *seen = seen.iter().map(|(id, t)| (id.clone(), *t)).collect();
    }

    fn seen(&self, client: &str, unix: i64) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        match seen.get_mut(client) {
            Some(t) => *t = (*t).max(unix),
            None => {
                seen.insert(client.to_string(), unix);
            }
        }
    }
}

/// `since` of `anchorage_devices_silent`.
const SILENT_PERIODS: [(&str, i64); 3] = [("1h", 3_600), ("1d", 86_400), ("7d", 7 * 86_400)];

impl Collector for Devices {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let now = unix_now();
        let mut list: Vec<(i64, String)> = {
            let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            seen.iter().map(|(id, t)| (*t, id.clone())).collect()
        };
        let known = ConstGauge::new(list.len() as i64);
        known.encode(encoder.encode_descriptor(
            "devices_known",
            "Devices that ever said a valid hello to this server.",
            None,
            known.metric_type(),
        )?)?;
        let mut silent = encoder.encode_descriptor(
            "devices_silent",
            "Known devices not heard from for at least `since`.",
            None,
            MetricType::Gauge,
        )?;
        for (label, secs) in SILENT_PERIODS {
            let n = list.iter().filter(|(t, _)| now - t >= secs).count();
            ConstGauge::new(n as i64).encode(silent.encode_family(&[("since", label)])?)?;
        }
        list.retain(|(t, _)| now - t < RETIRED_AFTER_SECONDS);
        list.sort_unstable();
        list.truncate(self.max_series.load(Ordering::Relaxed));
        let mut last_seen = encoder.encode_descriptor(
            "device_last_seen_timestamp",
            "When a device was last heard from (Unix time; a hello, a heartbeat, any message).",
            Some(&Unit::Seconds),
            MetricType::Gauge,
        )?;
        for (t, id) in &list {
            ConstGauge::new(*t).encode(last_seen.encode_family(&[("device", id.as_str())])?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn cost_records_add_up_in_the_exposition() {
        let m = ServerMetrics::new();
        m.record_cost(&CostRecord {
            wire_up: 1000,
            payload_up: 900,
            compute_seconds: 1.5,
            transfer_seconds: 0.25,
            wait_seconds: 0.25,
            joules: 2.0,
            ..Default::default()
        });
        m.record_cost(&CostRecord { wire_up: 500, dropped: true, ..Default::default() });
        m.record_cost(&CostRecord { compute_seconds: f64::NAN, straggler: true, ..Default::default() });
        let text = m.render();
        let v = |s| value(&text, s).unwrap_or_else(|| panic!("{s} in\n{text}"));
        assert_eq!(v("anchorage_client_traffic_bytes_total{direction=\"up\",kind=\"wire\"}"), 1500.0);
        assert_eq!(v("anchorage_client_traffic_bytes_total{direction=\"down\",kind=\"payload\"}"), 0.0);
        assert_eq!(v("anchorage_client_time_seconds_total{phase=\"compute\"}"), 1.5);
        assert_eq!(v("anchorage_client_energy_joules_total"), 2.0);
        assert_eq!(v("anchorage_client_rounds_total{result=\"dropped\"}"), 1.0);
        assert_eq!(v("anchorage_client_rounds_total{result=\"late\"}"), 1.0);
        assert_eq!(v("anchorage_client_rounds_total{result=\"completed\"}"), 1.0);
        // A dropped client has no round time; the others' compute + transfer + wait.
        assert_eq!(v("anchorage_client_round_duration_seconds_count"), 2.0);
        assert_eq!(v("anchorage_client_round_duration_seconds_sum"), 2.0);
        assert_eq!(m.client_rounds_total(), 3);
        assert!(text.contains("# TYPE anchorage_last_round gauge"), "{text}");
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn every_labelled_series_exists_from_the_start() {
        let m = ServerMetrics::new();
        let text = m.render();
        for series in [
            "anchorage_refusals_total{reason=\"not_enrolled\"}",
            "anchorage_refusals_total{reason=\"connection_limit\"}",
            "anchorage_updates_total{outcome=\"late\"}",
            "anchorage_rounds_closed_total{outcome=\"failed\"}",
            "anchorage_frame_bytes_total{direction=\"down\"}",
            "anchorage_devices_silent{since=\"1d\"}",
            "anchorage_devices_known",
            "anchorage_crl_stale",
            "anchorage_crl_reload_failures_total",
            "anchorage_endpoint_renewals_total",
        ] {
            assert_eq!(value(&text, series), Some(0.0), "{series} in\n{text}");
        }
        m.refused(refusal_reason(RefusalReason::NotSampled));
        m.refused(reason::REVOKED);
        assert_eq!((m.refusals_total(), m.refusals_of("revoked")), (2, 1));
    }

    /// A round report whose updates carry the devices' own evaluation.
    fn report(round: u64, accuracies: &[(u64, Option<f64>)], missing: &[&str]) -> RoundReport {
        use crate::engine::UpdateReport;
        RoundReport {
            round,
            outcome: RoundOutcome::Aggregated,
            sampled: accuracies.len() + missing.len(),
            target: accuracies.len() + missing.len(),
            updates: accuracies
                .iter()
                .enumerate()
                .map(|(i, (n, a))| UpdateReport {
                    client: format!("edge-{i}"),
                    num_samples: *n,
                    payload_up: 0,
                    prototypes: 0,
                    compute_seconds: 0.0,
                    arrived_after: std::time::Duration::ZERO,
                    metrics: a.iter().map(|a| ("local_accuracy".to_string(), *a)).collect(),
                })
                .collect(),
            missing: missing.iter().map(|m| m.to_string()).collect(),
            declined: Vec::new(),
            duplicates: 0,
            refused: 0,
            late_total: 0,
            payload_down: 0,
            started: std::time::Duration::ZERO,
            closed: std::time::Duration::from_secs(1),
            influence: Default::default(),
            held_out_accuracy: None,
            privacy: None,
            secagg: None,
        }
    }

    #[test]
    fn a_rounds_quality_and_a_shortfall_of_devices_are_exported() {
        let m = ServerMetrics::new();
        let text = m.render();
        // Before any round: the families are declared, the accuracy series absent, nobody waited for.
        assert!(text.contains("# TYPE anchorage_round_device_accuracy gauge"), "{text}");
        assert_eq!(value(&text, "anchorage_round_device_accuracy"), None, "{text}");
        assert_eq!(value(&text, "anchorage_round_held_out_accuracy"), None, "{text}");
        assert_eq!(value(&text, "anchorage_waiting_for_devices"), Some(0.0), "{text}");
        assert_eq!(value(&text, "anchorage_run_finished"), Some(0.0), "{text}");

        // 100 samples at 50%, 300 at 90%, one update without an evaluation; one device missing.
        m.round_closed(&report(4, &[(100, Some(0.5)), (300, Some(0.9)), (50, None)], &["edge-9"]));
        m.held_out_evaluated(4, 0.75);
        let text = m.render();
        let v = |s: &str| value(&text, s).unwrap_or_else(|| panic!("{s} in\n{text}"));
        assert!((v("anchorage_round_device_accuracy") - 0.8).abs() < 1e-9, "{text}");
        assert_eq!(v("anchorage_round_device_accuracy_reports"), 2.0);
        assert_eq!(
            (v("anchorage_round_held_out_accuracy"), v("anchorage_round_held_out_evaluated_round")),
            (0.75, 4.0)
        );
        assert_eq!(v("anchorage_round_missing_devices"), 1.0);
        assert!(m.round_device_accuracy().is_some_and(|(a, n)| (a - 0.8).abs() < 1e-9 && n == 2));

        // Two devices needed, one connected: waiting for one since now.
        m.expect_devices(rounds::Opening {
            min_available: 2,
            stall_after: std::time::Duration::from_secs(60),
            rounds: 0,
            between_rounds: true,
            round_open: false,
        });
        m.set_connected(1);
        let text = m.render();
        assert_eq!(value(&text, "anchorage_waiting_for_devices"), Some(1.0), "{text}");
        let since = value(&text, "anchorage_waiting_since_seconds").unwrap();
        assert!((since - unix_now() as f64).abs() <= 2.0, "{since}");
        assert_eq!(m.waiting().map(|w| (w.needed, w.connected, w.stalled)), Some((1, 1, false)));
        m.set_connected(2);
        assert_eq!(value(&m.render(), "anchorage_waiting_since_seconds"), Some(0.0), "a round opens");
        m.set_run_finished();
        assert_eq!(value(&m.render(), "anchorage_run_finished"), Some(1.0));
    }

    #[test]
    fn the_exposition_passes_the_text_formats_lint() {
        let m = ServerMetrics::new();
        m.round_closed(&report(1, &[(10, Some(0.5))], &[]));
        m.held_out_evaluated(1, 0.5);
        m.seen("edge-1", unix_now());
        let text = text::to_text_format(&m.render());
        assert_eq!(text::lint(&text), Vec::<String>::new(), "{text}");
        // Every counter family's name ends in `_total`, and each has a help text and a type.
        for line in text.lines().filter(|l| l.starts_with("# TYPE ") && l.ends_with(" counter")) {
            let name = line.split(' ').nth(2).unwrap();
            assert!(name.ends_with("_total"), "{line}");
            assert!(text.contains(&format!("# HELP {name} ")), "{name} has a help text");
        }
    }

    #[test]
    fn two_servers_in_one_process_keep_their_own_counts() {
        let (a, b) = (ServerMetrics::new(), ServerMetrics::new());
        a.update(outcome::ACCEPTED);
        a.update(outcome::ACCEPTED);
        b.update(outcome::LATE);
        assert_eq!((a.updates_total(outcome::ACCEPTED), b.updates_total(outcome::ACCEPTED)), (2, 0));
        assert_eq!(value(&b.render(), "anchorage_updates_total{outcome=\"late\"}"), Some(1.0));
        assert_eq!(value(&a.render(), "anchorage_updates_total{outcome=\"late\"}"), Some(0.0));
    }

    #[test]
    fn device_series_are_bounded_and_the_silent_are_counted() {
        let m = ServerMetrics::new();
        let now = unix_now();
        m.seen("fresh", now);
        m.seen("quiet", now - 2 * 86_400);
        m.seen("quiet", now - 3 * 86_400); // an older time never moves it back
        m.seen("gone", now - 40 * 86_400);
        m.seen("with \"quotes\"", now - 10);
        let text = m.render();
        assert_eq!(value(&text, "anchorage_devices_known"), Some(4.0));
        assert_eq!(value(&text, "anchorage_devices_silent{since=\"1d\"}"), Some(2.0));
        assert_eq!(value(&text, "anchorage_devices_silent{since=\"7d\"}"), Some(1.0));
        let quiet = format!("anchorage_device_last_seen_timestamp_seconds{{device=\"quiet\"}} {}", now - 2 * 86_400);
        assert!(text.contains(&quiet), "{text}");
        assert!(!text.contains("device=\"gone\""), "a retired device has no series: {text}");
        assert!(text.contains(r#"device="with \"quotes\"""#), "label values are escaped: {text}");
        // At most one series: the longest silent one.
        m.set_device_series(1);
        let text = m.render();
        assert_eq!(text.matches("anchorage_device_last_seen_timestamp_seconds{").count(), 1, "{text}");
        assert!(text.contains("device=\"quiet\""), "{text}");
    }
}
