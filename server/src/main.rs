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
pub static malloc_conf: Option<&u8> = Some(&b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0\0"[0]);

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

fn main() -> anyhow::Result<()> {
    anchorage_server::metrics::set_allocator_probe(jemalloc_stats);
    anchorage_server::service::main()
}
