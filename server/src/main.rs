//! `anchorage-server --config server.toml`: see [`anchorage_server::service`].

/// jemalloc, not the C library's malloc: a thousand departed connections leave glibc's arenas
/// fragmented (measured: 79 MiB held 12 s after 1,000 invited devices left, against 21 MiB at
/// start, even with `malloc_trim`), and musl's (the container build) is slow. jemalloc's
/// background thread returns freed pages after `dirty_decay_ms` (measured: 36 MiB).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options (its `malloc_conf`, read at the first allocation): purge freed pages on a
/// background thread within a second, so an idle server gives memory back.
#[allow(non_upper_case_globals)]
#[unsafe(export_name = "_rjem_malloc_conf")]
pub(crate) static malloc_conf: Option<&u8> = Some(&b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0\0"[0]);

/// jemalloc's own counts, for /metrics (`anchorage_allocator_*_bytes`).
fn jemalloc_stats() -> Option<anchorage_server::metrics::AllocatorStats> {
    use tikv_jemalloc_ctl::{epoch, stats};
    epoch::advance().ok()?;
    let allocated = stats::allocated::read().ok()? as u64;
    let active = stats::active::read().ok()? as u64;
    let metadata = stats::metadata::read().ok()? as u64;
    let resident = stats::resident::read().ok()? as u64;
    Some(anchorage_server::metrics::AllocatorStats { allocated, active, metadata, resident })
}

unsafe extern "C" {
    /// jemalloc's `mallctl` (the `_rjem_` prefix of tikv-jemalloc-sys).
    #[link_name = "_rjem_mallctl"]
    fn jemalloc_mallctl(
        name: *const std::ffi::c_char,
        oldp: *mut std::ffi::c_void,
        oldlenp: *mut usize,
        newp: *mut std::ffi::c_void,
        newlen: usize,
    ) -> std::ffi::c_int;
}

/// Returns the calling thread's cached free objects to their arena (`thread.tcache.flush`), so
/// that the pages they pin can be purged (see `metrics::request_allocator_flush`).
fn flush_thread_cache() {
    // SAFETY: a NUL-terminated name; `thread.tcache.flush` reads and writes nothing (all null).
    unsafe {
        jemalloc_mallctl(
            c"thread.tcache.flush".as_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        );
    }
}

/// The C library's malloc, which SQLite (bundled) and zstd use: one arena, and a fixed mmap
/// threshold. glibc gives each thread that calls malloc an arena of its own (each blocking
/// thread that commits to the store), and after a large block is freed it raises the mmap and
/// trim thresholds up to 32 MiB, keeping what it freed. Measured with 10,000 invited silent
/// devices: the C heap held 6.4 MB in 7 arenas against 2.0 MB at start a minute after they left.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn bound_c_heap() {
    // Declared here, not taken from the libc crate: tests/ builds this file as its own server
    // binary, without libc among its dependencies.
    unsafe extern "C" {
        fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
    }
    // glibc's malloc.h; a fixed M_MMAP_THRESHOLD also fixes M_TRIM_THRESHOLD (128 KiB).
    const M_MMAP_THRESHOLD: std::ffi::c_int = -3;
    const M_ARENA_MAX: std::ffi::c_int = -8;
    // SAFETY: mallopt only sets glibc's malloc parameters; nothing has called malloc on another thread yet.
    unsafe {
        mallopt(M_ARENA_MAX, 1);
        mallopt(M_MMAP_THRESHOLD, 128 << 10);
    }
}

fn main() -> anyhow::Result<()> {
    run(anchorage_server::service::Program::Server)
}

/// The program with this file's allocator set up (`anchorage-relay` runs it too).
pub(crate) fn run(program: anchorage_server::service::Program) -> anyhow::Result<()> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    bound_c_heap();
    anchorage_server::metrics::set_allocator_probe(jemalloc_stats);
    anchorage_server::metrics::set_allocator_flush(flush_thread_cache);
    anchorage_server::service::main(program)
}
