//! `anchorage-client doctor --config client.toml`: checks a device before its service starts
//! (`ExecStartPre=`), from the same `client.toml`, and says what it found, one line per check:
//!
//! - **device**: the compute device training would use and why (what `auto` skipped);
//! - **memory**: the plan `max_memory_mb` gives (batch size, feature cache) and what the system has;
//! - **state**: the state folder exists or can be made, and is writable;
//! - **certificate**: this device's certificate (id, validity, days left; its id is the one the
//!   server will know it by) and the project CA's, and the key file's mode;
//! - **server**: a QUIC handshake with this device's certificate (mutual TLS, the server checks it
//!   against the CA and its revocation list), its time and the round-trip time. Nothing else is
//!   sent: no hello, so the server does not take the doctor for the device (it logs a connection
//!   that ended without one, and counts it in `anchorage_connections_total`);
//! - **clock**: the skew to the server's clock, from the HTTP `Date` header of the server's
//!   `/healthz` on its metrics port (`--health-url`; by default the server's host on port 9464,
//!   and only when that answers). The QUIC protocol itself carries no time.
//!
//! Then what the device reads of itself, with [`crate::eligibility::Readings`] (the code that
//! decides whether it trains): **thermal** (its thermal zones, the hottest), **power** (its power
//! supplies: external power online, batteries' capacity and status), **load** (the 1-minute load
//! per CPU, the CPU clock against its maximum), **network** (the IPv4 default route's interface,
//! metered or not), **eligibility** (`[eligibility]` applied to these readings now: a warning
//! when the device would decline to train) and, only when some value was refused, **readings**
//! (each refused file and value). These describe the moment, not the installation: they never
//! fail, and the verdict's counts leave them out.
//!
//! Exit status 0 when nothing failed (warnings and skipped checks included), 1 otherwise.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anchorage_pki::{CertInfo, cert_info};
use anyhow::Context;
use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

use crate::config::ClientConfig;
use crate::eligibility::{self, Eligibility, Readings, SysRoot};
use crate::{runner, transport};
use anchorage_model::device;

/// The metrics port a server listens on by default (`[metrics] bind` in server.toml).
pub const DEFAULT_METRICS_PORT: u16 = 9464;

/// `anchorage-client doctor`'s options.
#[derive(Debug, Clone, clap::Args)]
pub struct DoctorArgs {
    /// The server's health endpoint, whose HTTP Date header gives the server's clock
    /// (http://HOST:PORT/healthz on its metrics port). Default: the server's host on port 9464,
    /// skipped if it does not answer; given, it must answer.
    #[arg(long)]
    pub health_url: Option<String>,
    /// Largest clock skew to the server that passes, in seconds.
    #[arg(long, default_value_t = 60)]
    pub max_skew: u64,
    /// A certificate with fewer days left than this is a warning.
    #[arg(long, default_value_t = 30)]
    pub warn_days: i64,
    /// Time each network check may take, in milliseconds.
    #[arg(long, default_value_t = 3000)]
    pub timeout_ms: u64,
}

impl Default for DoctorArgs {
    fn default() -> Self {
        Self { health_url: None, max_skew: 60, warn_days: 30, timeout_ms: 3000 }
    }
}

pub use anchorage_shared::checks::{Check, Report, Status};

/// The lines of the device's readings ([`check_readings`]): reported, never failed, not counted.
const READINGS: [&str; 6] = ["thermal", "power", "load", "network", "eligibility", "readings"];

/// The doctor's verdict; its counts are of the checks, not of the readings.
fn verdict(report: &Report) -> String {
    if report.failed() {
        format!("doctor: NOT ready: {} failed", report.failed_names())
    } else {
        let count = |status| report.checks.iter().filter(|c| c.status == status && !READINGS.contains(&c.name)).count();
        format!(
            "doctor: ready ({} ok, {} warnings, {} skipped)",
            count(Status::Ok),
            count(Status::Warn),
            count(Status::Skip)
        )
    }
}

/// Runs every check of the device whose config is at `path`.
pub async fn run(path: &Path, args: &DoctorArgs) -> Report {
    let mut report = Report::new(verdict);
    let config = match ClientConfig::load(path) {
        Ok(c) => {
            report.checks.push(Check::new(
                "config",
                Status::Ok,
                format!("{} (device {})", path.display(), c.client_id),
            ));
            c
        }
        Err(e) => {
            report.checks.push(Check::new("config", Status::Fail, format!("{e:#}")));
            return report;
        }
    };
    let timeout = Duration::from_millis(args.timeout_ms.max(1));
    report.checks.push(check_device(&config).await);
    report.checks.push(check_memory(&config));
    report.checks.push(check_state(&config.state_dir));
    report.checks.extend(check_certificates(&config, args.warn_days, unix_now()));
    report.checks.push(check_server(&config, timeout).await);
    report.checks.push(check_clock(&config, args, timeout).await);
    let readings = Readings::read(&SysRoot::default());
    report.checks.extend(check_readings(&config.eligibility, &readings, eligibility::utc_minutes(SystemTime::now())));
    report
}

/// `anchorage-client doctor`: prints the report, returns the exit status.
pub fn main(config: &Path, args: &DoctorArgs) -> std::process::ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("doctor: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let report = runtime.block_on(run(config, args));
    print!("{}", report.render());
    if report.failed() { std::process::ExitCode::FAILURE } else { std::process::ExitCode::SUCCESS }
}

pub(crate) fn unix_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

pub(crate) async fn check_device(config: &ClientConfig) -> Check {
    match device::choose(&config.device) {
        Ok(choice) => {
            let mut detail = format!(
                "{} ({}; {:?}), from device = \"{}\"; compiled in: {}",
                choice.label,
                device::describe(choice.label),
                choice.device,
                config.device,
                device::compiled().join(", ")
            );
            #[cfg(any(feature = "wgpu", feature = "vulkan"))]
            if matches!(choice.label, "wgpu" | "vulkan") {
                detail.push_str(&format!("; Vulkan adapters: {}", device::gpu_adapters().await.join("; ")));
            }
            if !choice.skipped.is_empty() {
                detail.push_str(&format!("; auto skipped: {}", choice.skipped.join("; ")));
            }
            Check::new("device", Status::Ok, detail)
        }
        Err(e) => Check::new("device", Status::Fail, e.to_string()),
    }
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 =
        info.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?.split_whitespace().next()?.parse().ok()?;
    kib.checked_mul(1024)
}

pub(crate) fn check_memory(config: &ClientConfig) -> Check {
    let system = available_memory();
    let available = system.map(|b| format!("; the system has {} available", mib(b))).unwrap_or_default();
    match (config.max_memory_mb, runner::memory_plan(config)) {
        (None, _) => Check::new("memory", Status::Skip, format!("no budget (max_memory_mb unset){available}")),
        (Some(mb), Ok(Some((needs, plan)))) => {
            let status = match system {
                Some(avail) if avail < u64::from(mb) << 20 => Status::Warn,
                _ => Status::Ok,
            };
            Check::new(
                "memory",
                status,
                format!(
                    "max_memory_mb = {mb}: {} fixed, batch {}, feature cache {} for {} of {} samples{available}",
                    mib(needs.fixed_bytes),
                    plan.batch_size,
                    mib(plan.cache_bytes),
                    plan.cache_samples,
                    needs.samples
                ),
            )
        }
        (Some(mb), Ok(None)) => Check::new(
            "memory",
            Status::Skip,
            format!("max_memory_mb = {mb} plans the embedded model only, not a scenario share{available}"),
        ),
        (Some(_), Err(e)) => Check::new("memory", Status::Fail, format!("{e:#}")),
    }
}

/// The device's readings, one line each (see the module's documentation), and whether
/// `config` would let it train at `now_utc_minutes`.
pub(crate) fn check_readings(config: &Eligibility, readings: &Readings, now_utc_minutes: u32) -> Vec<Check> {
    let mut checks = vec![thermal_check(readings), power_check(readings), load_check(readings), route_check(readings)];
    // The decision now.
    checks.push(if !config.is_enabled() {
        Check::new("eligibility", Status::Skip, "no [eligibility] criteria: this device always trains")
    } else {
        match eligibility::decide(config, readings, now_utc_minutes) {
            Ok(()) => Check::new("eligibility", Status::Ok, format!("would train now ({})", config.describe())),
            Err(d) => Check::new(
                "eligibility",
                Status::Warn,
                format!("would decline now ({}): {d}; criteria: {}", d.reason(), config.describe()),
            ),
        }
    });
    if !readings.errors.is_empty() {
        let n = readings.errors.len();
        let what = if n == 1 { "value" } else { "values" };
        checks.push(Check::new(
            "readings",
            Status::Warn,
            format!("{n} {what} refused: {}", readings.errors.join("; ")),
        ));
    }
    checks
}

/// Thermal zones, the hottest counted one first.
fn thermal_check(readings: &Readings) -> Check {
    if readings.thermal_zones.is_empty() {
        return Check::new("thermal", Status::Skip, "no thermal zones under /sys/class/thermal");
    }
    let zones: Vec<String> = readings
        .thermal_zones
        .iter()
        .map(|z| match (z.celsius, z.counted()) {
            (Some(c), true) => format!("{} {c:.1} °C", z.label()),
            (Some(c), false) => format!("{} {c:.1} °C (not counted)", z.label()),
            (None, _) => format!("{} no reading", z.label()),
        })
        .collect();
    let hottest = readings
        .hottest()
        .map_or_else(|| "no zone readable".to_string(), |(z, c)| format!("hottest {} {c:.1} °C", z.label()));
    Check::new("thermal", Status::Ok, format!("{hottest}; {}", zones.join(", ")))
}

/// Power supplies: external power or the battery's level, then each supply.
fn power_check(readings: &Readings) -> Check {
    if readings.power_supplies.is_empty() {
        return Check::new("power", Status::Skip, "no power supplies under /sys/class/power_supply (no battery)");
    }
    let summary = match (readings.external_power(), readings.battery_percent()) {
        (Some(true), _) => "on external power".to_string(),
        (Some(false), Some(p)) => format!("on battery ({p}%)"),
        (Some(false), None) => "no external supply online and no battery".to_string(),
        (None, Some(p)) => format!("battery at {p}%, external power not reported"),
        (None, None) => "external power not reported".to_string(),
    };
    let supplies: Vec<String> = readings
        .power_supplies
        .iter()
        .map(|p| {
            let kind = match p.kind.as_deref() {
                None => "type unknown".to_string(),
                Some(k) if p.is_external() || p.is_system_battery() => k.to_string(),
                Some(k) if p.present == Some(false) => format!("{k}, none in the bay"),
                Some(k) => format!("{k}, a peripheral's"),
            };
            let mut words = vec![format!("{} ({kind})", p.name)];
            words.extend(p.online.map(|o| if o { "online" } else { "offline" }.to_string()));
            words.extend(p.capacity.map(|c| format!("{c}%")));
            words.extend(p.status.clone());
            words.join(" ")
        })
        .collect();
    Check::new("power", Status::Ok, format!("{summary}: {}", supplies.join(", ")))
}

/// The load per CPU and the CPU clock.
fn load_check(readings: &Readings) -> Check {
    let cpus = readings.cpus.map_or_else(|| "CPU count unknown".to_string(), |n| format!("{n} CPUs"));
    let clock =
        readings.freq_ratio.map(|r| format!("; CPU clock at {:.0}% of its maximum", r * 100.0)).unwrap_or_default();
    match (readings.load_1m, readings.load_per_cpu()) {
        (Some(load), Some(per_cpu)) => {
            Check::new("load", Status::Ok, format!("1-minute load {load:.2} on {cpus} ({per_cpu:.2} per CPU){clock}"))
        }
        _ => Check::new("load", Status::Skip, format!("no load average in /proc/loadavg; {cpus}{clock}")),
    }
}

/// The default route, and whether it is metered.
fn route_check(readings: &Readings) -> Check {
    match &readings.default_route {
        Some(route) => Check::new(
            "network",
            Status::Ok,
            format!(
                "IPv4 default route via {} ({})",
                route.interface,
                if route.metered { "metered: a cellular interface" } else { "unmetered" }
            ),
        ),
        None => Check::new("network", Status::Skip, "no IPv4 default route in /proc/net/route"),
    }
}

/// The state folder is writable (a probe file, removed again); one that does not exist yet is
/// not made here (the service, or systemd's `StateDirectory=`, makes it), only its parent checked.
pub(crate) fn check_state(dir: &Path) -> Check {
    if !dir.exists() {
        let parent = dir.ancestors().skip(1).find(|p| p.exists()).unwrap_or(Path::new("/"));
        let writable = tempfile_in(parent).is_ok();
        return match writable {
            true => Check::new("state", Status::Ok, format!("{} does not exist yet; it can be made", dir.display())),
            false => Check::new(
                "state",
                Status::Fail,
                format!(
                    "{} does not exist and {} is not writable: create it for the service's user",
                    dir.display(),
                    parent.display()
                ),
            ),
        };
    }
    match tempfile_in(dir) {
        Ok(()) => Check::new("state", Status::Ok, format!("{} is writable", dir.display())),
        Err(e) => Check::new("state", Status::Fail, format!("{} is not writable: {e}", dir.display())),
    }
}

/// Writes and removes a probe file in `dir`.
fn tempfile_in(dir: &Path) -> std::io::Result<()> {
    let probe = dir.join(format!(".anchorage-doctor-{}", std::process::id()));
    let written = std::fs::write(&probe, b"ok");
    let _ = std::fs::remove_file(&probe);
    written
}

/// Whether `info` is valid at `now`, in words, with the status it deserves.
fn validity(what: &str, info: &CertInfo, now: i64, warn_days: i64) -> (Status, String) {
    let days_left = (info.not_after - now).div_euclid(86_400);
    if now < info.not_before {
        let wait = info.not_before - now;
        return (
            Status::Fail,
            format!(
                "{what} is not valid yet (for another {wait} s): is this device's clock behind? (valid until {})",
                info.not_after_text
            ),
        );
    }
    if now > info.not_after {
        return (
            Status::Fail,
            format!(
                "{what} EXPIRED on {} ({} days ago): renew it (`anchorage ca renew`) and copy the new cert.der here",
                info.not_after_text,
                (now - info.not_after).div_euclid(86_400)
            ),
        );
    }
    let status = if days_left < warn_days { Status::Warn } else { Status::Ok };
    (status, format!("{what} valid until {} ({days_left} days left)", info.not_after_text))
}

pub(crate) fn check_certificates(config: &ClientConfig, warn_days: i64, now: i64) -> Vec<Check> {
    let mut checks = Vec::new();
    // The project CA (or, against a development server, the server's own certificate).
    match std::fs::read(&config.server_cert)
        .with_context(|| format!("reading {}", config.server_cert.display()))
        .and_then(|der| cert_info(&der))
    {
        Ok(ca) => {
            let (status, detail) = validity("the trusted CA certificate", &ca, now, warn_days);
            checks.push(Check::new("ca", status, format!("{detail}; {}", config.server_cert.display())));
        }
        Err(e) => checks.push(Check::new("ca", Status::Fail, format!("{e:#}"))),
    }
    let (Some(cert), Some(key)) = (&config.cert, &config.key) else {
        let status = if config.cert.is_some() != config.key.is_some() { Status::Fail } else { Status::Skip };
        checks.push(Check::new(
            "certificate",
            status,
            match status {
                Status::Fail => "client.toml names `cert` or `key` without the other",
                _ => "none configured: only a development server (insecure_dev) lets this device in",
            },
        ));
        return checks;
    };
    let info =
        match std::fs::read(cert).with_context(|| format!("reading {}", cert.display())).and_then(|d| cert_info(&d)) {
            Ok(info) => info,
            Err(e) => {
                checks.push(Check::new("certificate", Status::Fail, format!("{e:#}")));
                return checks;
            }
        };
    let (mut status, mut detail) = validity("this device's certificate", &info, now, warn_days);
    match &info.id {
        Some(id) if id == &config.client_id => detail = format!("{id}: {detail}"),
        Some(id) => {
            status = Status::Fail;
            detail = format!(
                "the certificate is {id}'s, but client.toml says client_id = \"{}\" (the server would refuse the \
                 hello): {detail}",
                config.client_id
            );
        }
        None => {
            status = Status::Fail;
            detail = format!("the certificate names no id (no DNS subject alternative name): {detail}");
        }
    }
    checks.push(Check::new("certificate", status, detail));
    checks.push(check_key(key));
    checks
}

fn check_key(key: &Path) -> Check {
    let meta = match std::fs::metadata(key) {
        Ok(m) => m,
        Err(e) => return Check::new("key", Status::Fail, format!("{}: {e}", key.display())),
    };
    if let Err(e) = std::fs::File::open(key) {
        return Check::new("key", Status::Fail, format!("{} cannot be read: {e}", key.display()));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Check::new(
                "key",
                Status::Warn,
                format!("{} is readable by others (mode {mode:04o}): chmod 0600 it", key.display()),
            );
        }
        Check::new("key", Status::Ok, format!("{} (mode {mode:04o})", key.display()))
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        Check::new("key", Status::Ok, key.display().to_string())
    }
}

/// A QUIC handshake with this device's certificate: the server checks it (CA, revocation list)
/// and closes at once if it refuses it, so the connection is held a few round trips before the
/// doctor closes it itself.
async fn check_server(config: &ClientConfig, timeout: Duration) -> Check {
    let attempt = async {
        let mut options = runner::options(config)?;
        options.store = None;
        options.connect_timeout = timeout;
        let server = options.server;
        let endpoint = transport::endpoint(&options)?;
        let started = Instant::now();
        let connecting = endpoint.connect(server, &options.server_name).context("starting the handshake")?;
        let conn = match tokio::time::timeout(timeout, connecting).await {
            Err(_) => anyhow::bail!(
                "no answer from {server} within {} ms: is the server running, and is UDP port {} open between here \
                 and there?",
                timeout.as_millis(),
                server.port()
            ),
            Ok(Err(e)) => return Err(refused(server, &e)),
            Ok(Ok(conn)) => conn,
        };
        let handshake = started.elapsed();
        // The server's verdict on our certificate follows our last handshake message.
        let grace = (conn.rtt() * 4).max(Duration::from_millis(300));
        if let Ok(e) = tokio::time::timeout(grace, conn.closed()).await {
            return Err(refused(server, &e));
        }
        let rtt = conn.rtt();
        conn.close(quinn::VarInt::from_u32(0), b"anchorage-client doctor");
        endpoint.wait_idle().await;
        Ok::<_, anyhow::Error>(format!(
            "{server} ({}) accepts this device's certificate: QUIC handshake in {:.1} ms, RTT {:.1} ms",
            options.server_name,
            handshake.as_secs_f64() * 1e3,
            rtt.as_secs_f64() * 1e3
        ))
    };
    match attempt.await {
        Ok(detail) => Check::new("server", Status::Ok, detail),
        Err(e) => Check::new("server", Status::Fail, format!("{e:#}")),
    }
}

fn refused(server: SocketAddr, e: &quinn::ConnectionError) -> anyhow::Error {
    if transport::tls_failure(e) {
        anyhow::anyhow!(
            "{server} refused the TLS handshake ({e}): a certificate that expired, was revoked, or comes from \
             another CA (this device's, or the server's against ca.der)"
        )
    } else {
        anyhow::anyhow!("{server} closed the connection: {e}")
    }
}

/// The clock skew to the server: its HTTP `Date` against this device's clock.
async fn check_clock(config: &ClientConfig, args: &DoctorArgs, timeout: Duration) -> Check {
    let (url, explicit) = match &args.health_url {
        Some(url) => (url.clone(), true),
        None => {
            let host = config.server.rsplit_once(':').map_or(config.server.as_str(), |(h, _)| h);
            (format!("http://{host}:{DEFAULT_METRICS_PORT}/healthz"), false)
        }
    };
    match server_date(&url, timeout).await {
        Ok(sample) => {
            let skew = sample.skew_seconds();
            let bound = sample.uncertainty_seconds();
            let behind_ahead = if skew >= 0.0 { "behind" } else { "ahead of" };
            let detail = format!(
                "this device's clock is {:.1} s {behind_ahead} the server's (±{bound:.1} s, from the Date header of {url})",
                skew.abs()
            );
            if skew.abs() - bound > args.max_skew as f64 {
                Check::new(
                    "clock",
                    Status::Fail,
                    format!("{detail}: more than --max-skew {} s; set the time (NTP: timedatectl)", args.max_skew),
                )
            } else {
                Check::new("clock", Status::Ok, detail)
            }
        }
        Err(e) if explicit => Check::new("clock", Status::Fail, format!("{url}: {e:#}")),
        Err(e) => Check::new(
            "clock",
            Status::Skip,
            format!(
                "not measured: {url} did not answer ({e:#}); the server's clock is read from its metrics port \
                 ([metrics] bind in server.toml): pass --health-url http://SERVER:PORT/healthz"
            ),
        ),
    }
}

/// One reading of the server's clock.
#[derive(Debug, Clone, Copy)]
struct DateSample {
    /// The server's `Date` (whole seconds, truncated).
    server: SystemTime,
    sent: SystemTime,
    received: SystemTime,
}

impl DateSample {
    /// Server minus local time, in seconds: the server's second (its middle) against the middle
    /// of the exchange.
    fn skew_seconds(&self) -> f64 {
        let secs = |t: SystemTime| t.duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        secs(self.server) + 0.5 - (secs(self.sent) + secs(self.received)) / 2.0
    }

    /// Half a second of `Date`'s resolution, and half the exchange.
    fn uncertainty_seconds(&self) -> f64 {
        0.5 + self.received.duration_since(self.sent).map_or(0.0, |d| d.as_secs_f64()) / 2.0
    }
}

/// GETs `url` (plain HTTP) and reads its `Date` header.
async fn server_date(url: &str, timeout: Duration) -> anyhow::Result<DateSample> {
    let uri: hyper::Uri = url.parse().with_context(|| format!("`{url}` is not a URL"))?;
    anyhow::ensure!(uri.scheme_str() == Some("http"), "only http:// URLs (the metrics port speaks plain HTTP)");
    let host = uri.host().context("the URL names no host")?.trim_start_matches('[').trim_end_matches(']').to_string();
    let port = uri.port_u16().unwrap_or(80);
    let exchange = async {
        let stream = tokio::net::TcpStream::connect((host.as_str(), port)).await.context("connecting")?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream)).await.context("HTTP")?;
        let driver = tokio::spawn(connection);
        let authority = uri.authority().map_or_else(|| host.clone(), |a| a.to_string());
        let request = hyper::Request::get(uri.path_and_query().map_or("/", |p| p.as_str()))
            .header(hyper::header::HOST, authority)
            .body(Empty::new())
            .context("building the request")?;
        let sent = SystemTime::now();
        let response = sender.send_request(request).await.context("HTTP request")?;
        let received = SystemTime::now();
        driver.abort();
        anyhow::ensure!(response.status().is_success(), "answered {}", response.status());
        let date = response.headers().get(hyper::header::DATE).context("the answer has no Date header")?;
        let server = httpdate::parse_http_date(date.to_str().unwrap_or_default())
            .map_err(|e| anyhow::anyhow!("Date header {date:?}: {e}"))?;
        Ok(DateSample { server, sent, received })
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| anyhow::anyhow!("no answer within {} ms", timeout.as_millis()))?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(not_before: i64, not_after: i64) -> CertInfo {
        CertInfo { id: Some("edge-1".into()), serial: "1".into(), not_before, not_after, not_after_text: "then".into() }
    }

    #[test]
    fn certificate_validity_in_words() {
        let now = 1_800_000_000;
        let (s, d) = validity("it", &info(now - 10, now + 100 * 86_400), now, 30);
        assert_eq!(s, Status::Ok, "{d}");
        assert!(d.contains("100 days left"), "{d}");
        let (s, d) = validity("it", &info(now - 10, now + 10 * 86_400 + 5), now, 30);
        assert_eq!((s, d.contains("10 days left")), (Status::Warn, true), "{d}");
        let (s, d) = validity("it", &info(now - 100 * 86_400, now - 2 * 86_400), now, 30);
        assert_eq!(s, Status::Fail);
        assert!(d.contains("EXPIRED") && d.contains("2 days ago"), "{d}");
        let (s, d) = validity("it", &info(now + 600, now + 86_400), now, 30);
        assert_eq!(s, Status::Fail);
        assert!(d.contains("not valid yet") && d.contains("clock"), "{d}");
    }

    #[test]
    fn clock_skew_from_a_date_header() {
        let at = |s: f64| UNIX_EPOCH + Duration::from_secs_f64(s);
        // The server's second 1000 covers [1000, 1001); the exchange's middle is 990.5: +10 s.
        let sample = DateSample { server: at(1000.0), sent: at(990.4), received: at(990.6) };
        assert!((sample.skew_seconds() - 10.0).abs() < 1e-6);
        assert!((sample.uncertainty_seconds() - 0.6).abs() < 1e-6);
        let behind = DateSample { server: at(1000.0), sent: at(1100.0), received: at(1100.0) };
        assert!((behind.skew_seconds() + 99.5).abs() < 1e-6);
    }

    #[test]
    fn the_report_says_what_failed() {
        let mut report = Report::new(verdict);
        report.checks = vec![
            Check::new("device", Status::Ok, "cpu"),
            Check::new("clock", Status::Skip, "not measured"),
            Check::new("server", Status::Fail, "no answer"),
        ];
        assert!(report.failed());
        let text = report.render();
        assert!(text.contains("  FAIL  server       no answer\n"), "{text}");
        assert!(text.ends_with("doctor: NOT ready: server failed\n"), "{text}");
        let mut fine = Report::new(verdict);
        fine.checks = report.checks[..2].to_vec();
        assert!(!fine.failed());
        assert!(fine.render().ends_with("doctor: ready (1 ok, 0 warnings, 1 skipped)\n"));
    }

    /// The doctor shows a laptop's readings and the decision, with the same code that
    /// decides, and the verdict's counts stay those of the checks.
    #[test]
    fn eligibility_readings_in_the_doctor_report() {
        let dir = tempfile::tempdir().unwrap();
        crate::eligibility::fake::laptop(dir.path());
        let readings = Readings::read(&SysRoot::new(dir.path()));
        let config: Eligibility = toml::from_str("min_battery_percent = 20\nwindow = \"22:00-06:00\"").unwrap();
        let mut report = Report::new(verdict);
        report.checks.push(Check::new("device", Status::Ok, "cpu"));
        report.checks.extend(check_readings(&config, &readings, 23 * 60));
        let text = report.render();
        let line = |name: &str| {
            text.lines().find(|l| l.split_whitespace().nth(1) == Some(name)).unwrap_or_else(|| panic!("{name}: {text}"))
        };
        assert_eq!(
            line("thermal"),
            "  ok    thermal      hottest x86_pkg_temp 58.0 °C; acpitz 41.0 °C, x86_pkg_temp 58.0 °C"
        );
        assert_eq!(
            line("power"),
            "  ok    power        on battery (15%): AC (Mains) offline, BAT0 (Battery) 15% Discharging, hidpp_battery_0 \
             (Battery, a peripheral's) 5% Discharging"
        );
        assert_eq!(line("load"), "  ok    load         1-minute load 0.40 on 8 CPUs (0.05 per CPU)");
        assert!(line("network").starts_with("  skip  network      no IPv4 default route"), "{text}");
        assert_eq!(
            line("eligibility"),
            "  warn  eligibility  would decline now (battery): battery at 15% and not on external power \
             (min_battery_percent = 20); criteria: min_battery_percent = 20, window = 22:00-06:00 UTC"
        );
        assert!(!text.contains("readings"), "no value was refused: {text}");
        assert!(text.ends_with("doctor: ready (1 ok, 0 warnings, 0 skipped)\n"), "{text}");
        // Plugged in, outside the window: the window declines; a bad value gets its own line.
        crate::eligibility::fake::write(
            dir.path(),
            &[("sys/class/power_supply/AC/online", "1\n"), ("sys/class/thermal/thermal_zone0/temp", "warm\n")],
        );
        let readings = Readings::read(&SysRoot::new(dir.path()));
        let checks = check_readings(&config, &readings, 12 * 60);
        let get = |name: &str| checks.iter().find(|c| c.name == name).unwrap();
        assert!(get("power").detail.starts_with("on external power: AC (Mains) online"), "{checks:?}");
        assert!(get("eligibility").detail.starts_with("would decline now (window)"), "{checks:?}");
        assert!(get("thermal").detail.contains("acpitz no reading"), "{checks:?}");
        let refused = get("readings");
        assert_eq!(refused.status, Status::Warn);
        assert!(refused.detail.starts_with("1 value refused: ") && refused.detail.contains("\"warm\""), "{refused:?}");
        assert!(checks.iter().all(|c| c.status != Status::Fail), "readings never fail the doctor");
        // No criteria: always trains.
        let off = check_readings(&Eligibility::default(), &readings, 12 * 60);
        assert_eq!(off.iter().find(|c| c.name == "eligibility").unwrap().status, Status::Skip);
    }

    #[tokio::test]
    async fn a_bad_config_is_one_clear_failure() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("client.toml");
        std::fs::write(&path, "server = \"nowhere\"\n").unwrap();
        let report = run(&path, &DoctorArgs::default()).await;
        assert!(report.failed());
        let config = report.get("config").unwrap();
        assert!(config.detail.contains("client.toml"), "{}", config.detail);
        let missing = run(&dir.path().join("absent.toml"), &DoctorArgs::default()).await;
        assert!(missing.get("config").unwrap().detail.contains("absent.toml"));
    }
}
