//! The process's own metrics under the names every Prometheus client library uses
//! (`process_cpu_seconds_total`, `process_resident_memory_bytes`, …), read from `/proc/self` at
//! each scrape. Elsewhere than Linux the collector reports nothing.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

/// What `/proc/self` says about this process.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ProcessStats {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub threads: u64,
    /// Unix seconds.
    pub start_time_seconds: f64,
    pub open_fds: Option<u64>,
    pub max_fds: Option<u64>,
}

/// Parses `/proc/self/stat` (after the command name, which may hold spaces and parentheses),
/// with the clock's ticks per second, the page size and the boot time (`btime` of `/proc/stat`).
pub fn parse_stat(stat: &str, ticks: f64, page: u64, boot_time: u64) -> Option<ProcessStats> {
    // Fields after ") ": state (3), …, utime (14), stime (15), …, num_threads (20), …,
    // starttime (22), vsize (23), rss (24); index 0 here is field 3.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| f.get(i)?.parse::<u64>().ok();
    let (utime, stime, threads, start, vsize, rss) = (num(11)?, num(12)?, num(17)?, num(19)?, num(20)?, num(21)?);
    Some(ProcessStats {
        cpu_seconds: (utime + stime) as f64 / ticks,
        resident_bytes: rss.saturating_mul(page),
        virtual_bytes: vsize,
        threads,
        start_time_seconds: boot_time as f64 + start as f64 / ticks,
        open_fds: None,
        max_fds: None,
    })
}

/// `Max open files  1024  524288  files` of `/proc/self/limits`: the soft limit.
fn parse_max_fds(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..].split_whitespace().next()?.parse().ok()
}

/// This process now; `None` where `/proc` is not Linux's.
#[cfg(target_os = "linux")]
pub fn read() -> Option<ProcessStats> {
    // SAFETY: sysconf only reads a system constant.
    let (ticks, page) = unsafe { (libc::sysconf(libc::_SC_CLK_TCK), libc::sysconf(libc::_SC_PAGESIZE)) };
    let boot = std::fs::read_to_string("/proc/stat").ok()?;
    let boot: u64 = boot.lines().find_map(|l| l.strip_prefix("btime "))?.trim().parse().ok()?;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let mut stats = parse_stat(&stat, ticks.max(1) as f64, page.max(1) as u64, boot)?;
    stats.open_fds = std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count() as u64);
    stats.max_fds = std::fs::read_to_string("/proc/self/limits").ok().as_deref().and_then(parse_max_fds);
    Some(stats)
}

#[cfg(not(target_os = "linux"))]
pub fn read() -> Option<ProcessStats> {
    None
}

/// What the memory allocator holds, where the program can ask it (the server binary's jemalloc).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct AllocatorStats {
    /// Bytes in live objects.
    pub allocated: u64,
    /// Bytes in the pages that hold live objects: active well above allocated is fragmentation
    /// (pages each kept for a few objects that outlived their neighbours).
    pub active: u64,
    /// The allocator's own bookkeeping.
    pub metadata: u64,
    /// Bytes the allocator keeps in RAM: active, metadata and freed pages not yet returned.
    pub resident: u64,
}

static ALLOCATOR_PROBE: std::sync::OnceLock<fn() -> Option<AllocatorStats>> = std::sync::OnceLock::new();

/// Lets the binary that chose the global allocator report it (`anchorage_allocator_*_bytes`);
/// the library does not know which allocator it runs on. Set once; later calls are ignored.
pub fn set_allocator_probe(probe: fn() -> Option<AllocatorStats>) {
    let _ = ALLOCATOR_PROBE.set(probe);
}

/// The allocator's figures now, if the binary set a probe.
pub fn allocator() -> Option<AllocatorStats> {
    ALLOCATOR_PROBE.get().and_then(|probe| probe())
}

static ALLOCATOR_FLUSH: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();
/// Bumped by [`request_allocator_flush`]; each runtime worker flushes once per bump.
static FLUSH_REQUESTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

thread_local! {
    /// The last of [`FLUSH_REQUESTS`] this thread acted on.
    static FLUSHED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Lets the binary that chose the global allocator give the calling thread's cache of freed
/// objects back to it (jemalloc's tcache), for [`flush_allocator_if_requested`].
pub fn set_allocator_flush(flush: fn()) {
    let _ = ALLOCATOR_FLUSH.set(flush);
}

/// Asks every runtime worker to give its allocator cache back the next time it goes idle (after
/// a large fleet has left). An idle thread's cache is never trimmed otherwise, and the objects
/// in it keep their pages: measured with 10,000 invited silent devices, 1.1 MB of RSS a minute
/// after they left (tests/tests/silent_fleet.rs).
pub fn request_allocator_flush() {
    FLUSH_REQUESTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Runs on each runtime worker as it parks (`on_thread_park`): flushes its allocator cache
/// once per [`request_allocator_flush`], and costs one atomic load otherwise.
pub fn flush_allocator_if_requested() {
    let requested = FLUSH_REQUESTS.load(std::sync::atomic::Ordering::Relaxed);
    if FLUSHED.get() != requested {
        FLUSHED.set(requested);
        if let Some(flush) = ALLOCATOR_FLUSH.get() {
            flush();
        }
    }
}

/// The process metrics, collected at each scrape.
#[derive(Debug, Default)]
pub struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(s) = read() else { return Ok(()) };
        let cpu = ConstCounter::new(s.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu",
            "Total user and system CPU time spent in seconds.",
            Some(&Unit::Seconds),
            cpu.metric_type(),
        )?)?;
        let mut gauge = |name: &str, help: &str, unit: Option<&Unit>, v: f64| {
            let g = ConstGauge::new(v);
            g.encode(encoder.encode_descriptor(name, help, unit, g.metric_type())?)
        };
        gauge(
            "process_resident_memory",
            "Resident memory size in bytes.",
            Some(&Unit::Bytes),
            s.resident_bytes as f64,
        )?;
        gauge("process_virtual_memory", "Virtual memory size in bytes.", Some(&Unit::Bytes), s.virtual_bytes as f64)?;
        gauge(
            "process_start_time",
            "Start time of the process since unix epoch in seconds.",
            Some(&Unit::Seconds),
            s.start_time_seconds,
        )?;
        gauge("process_threads", "Number of OS threads in the process.", None, s.threads as f64)?;
        if let Some(fds) = s.open_fds {
            gauge("process_open_fds", "Number of open file descriptors.", None, fds as f64)?;
        }
        if let Some(fds) = s.max_fds {
            gauge("process_max_fds", "Maximum number of open file descriptors.", None, fds as f64)?;
        }
        if let Some(a) = allocator() {
            for (name, help, bytes) in [
                (
                    "anchorage_allocator_allocated",
                    "Bytes in live objects, as the memory allocator counts them.",
                    a.allocated,
                ),
                ("anchorage_allocator_active", "Bytes in the allocator's pages that hold live objects.", a.active),
                ("anchorage_allocator_metadata", "Bytes of the memory allocator's own bookkeeping.", a.metadata),
                ("anchorage_allocator_resident", "Bytes the memory allocator keeps in RAM.", a.resident),
            ] {
                gauge(name, help, Some(&Unit::Bytes), bytes as f64)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_parse_whatever_the_command_name() {
        // A command name with spaces and a parenthesis; fields as in proc(5).
        let stat = "4242 (anch (or) age) S 1 4242 4242 0 -1 4194560 900 0 0 0 250 50 0 0 20 0 7 0 1000 \
                    123456789 300 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        let s = parse_stat(stat, 100.0, 4096, 1_700_000_000).unwrap();
        assert_eq!(s.cpu_seconds, 3.0);
        assert_eq!(s.threads, 7);
        assert_eq!(s.start_time_seconds, 1_700_000_010.0);
        assert_eq!(s.virtual_bytes, 123_456_789);
        assert_eq!(s.resident_bytes, 300 * 4096);
        assert_eq!(parse_stat("4242 (x) S 1 2", 100.0, 4096, 0), None);
        assert_eq!(parse_stat("no parenthesis", 100.0, 4096, 0), None);
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1024                 524288               files\n";
        assert_eq!(parse_max_fds(limits), Some(1024));
    }

    #[test]
    fn this_process_reads() {
        if cfg!(target_os = "linux") {
            let s = read().expect("Linux has /proc/self");
            assert!(s.resident_bytes > 0 && s.threads >= 1 && s.open_fds.unwrap() > 0, "{s:?}");
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
            assert!(s.start_time_seconds <= now + 1.0 && s.start_time_seconds > now - 86_400.0, "{s:?}");
        }
    }
}
