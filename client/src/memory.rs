//! Memory: the process's peak as the kernel counts it (`VmHWM` in `/proc/self/status`), reported
//! with every update (`None` where the kernel does not expose it), and the plan that fits batch
//! size and feature cache into a budget (`max_memory_mb` in `client.toml`).

/// The peak resident set size so far, in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_vm_hwm(&status)
}

/// The resident set size now, in bytes.
pub fn current_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    parse_kib(&status, "VmRSS:")
}

/// `VmHWM:   123456 kB` → bytes.
fn parse_vm_hwm(status: &str) -> Option<u64> {
    parse_kib(status, "VmHWM:")
}

fn parse_kib(status: &str, key: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

use anchorage_model::ModelSpec;
use anchorage_model::train::OptimizerKind;

const MIB: u64 = 1 << 20;

/// What training needs, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryNeeds {
    /// Resident whatever the batch: runtime, weights, gradients, optimizer state, raw samples.
    pub fixed_bytes: u64,
    /// Activations and their gradients for one training sample.
    pub activation_bytes_per_sample: u64,
    /// One sample's cached features and label.
    pub feature_bytes_per_sample: u64,
    /// Samples whose features the client would cache.
    pub samples: u64,
    /// The batch to keep room for before caching features.
    pub requested_batch: u64,
}

/// How a budget is spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryPlan {
    /// The largest batch that fits beside the model and the cache (1 ..= max(cache_samples, 1)).
    pub batch_size: u64,
    /// Bytes of cached features.
    pub cache_bytes: u64,
    /// Samples the cache holds (all of `samples` when it fits).
    pub cache_samples: u64,
}

/// The budget cannot hold the model and one training sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryError {
    pub budget_bytes: u64,
    pub fixed_bytes: u64,
    pub one_sample_bytes: u64,
}

impl std::fmt::Display for MemoryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "memory budget of {} MiB is too small: the model, optimizer state and data take {} MiB and one training \
             sample needs {} bytes more; raise max_memory_mb to at least {} MiB",
            self.budget_bytes / MIB,
            self.fixed_bytes.div_ceil(MIB),
            self.one_sample_bytes,
            self.fixed_bytes.saturating_add(self.one_sample_bytes).div_ceil(MIB)
        )
    }
}

impl std::error::Error for MemoryError {}

/// Fits training into `budget_bytes`: room for a batch of up to `requested_batch` first, then the
/// feature cache (up to every sample), then the batch grows into what is left.
pub fn plan(budget_bytes: u64, needs: &MemoryNeeds) -> Result<MemoryPlan, MemoryError> {
    let act = needs.activation_bytes_per_sample;
    let feat = needs.feature_bytes_per_sample;
    let one = act.saturating_add(feat);
    let too_small = MemoryError { budget_bytes, fixed_bytes: needs.fixed_bytes, one_sample_bytes: one };
    let avail = match budget_bytes.checked_sub(needs.fixed_bytes) {
        Some(avail) if avail >= one => avail,
        _ => return Err(too_small),
    };
    let max_batch = needs.samples.max(1);
    // Room for the requested batch (as much of it as fits with its own features cached).
    let reserved = needs.requested_batch.clamp(1, max_batch).min(avail / one.max(1)).max(1);
    let cache_bytes = needs.samples.saturating_mul(feat).min(avail - reserved * act);
    let cache_samples = cache_bytes.checked_div(feat).unwrap_or(needs.samples);
    let cache_bytes = cache_samples * feat;
    let left = avail - cache_bytes;
    // A batch is drawn from the cache.
    let max_batch = cache_samples.max(1);
    let batch_size = left.checked_div(act).map_or(max_batch, |b| b.clamp(1, max_batch));
    Ok(MemoryPlan { batch_size, cache_bytes, cache_samples })
}

/// Memory of `values` f32 values.
pub const fn f32_bytes(values: u64) -> u64 {
    values.saturating_mul(4)
}

/// The batch a plan keeps room for before caching features (the server's default batch).
pub const PLANNED_BATCH: u64 = 32;
/// Samples per backbone call while a feature cache is built (`TaskStream::build`).
const BACKBONE_CHUNK: u64 = 512;
/// What a client holds beyond its model and data while a round runs (QUIC, the round's messages,
/// allocator and thread overhead): measured peaks of the embedded client exceeded the rest of
/// this estimate by 18–21 MiB.
pub const ROUND_OVERHEAD_BYTES: u64 = 20 * MIB;

/// Estimated needs of training [`ModelSpec`]'s net with `optimizer` on cached features of
/// `samples` samples, beside its frozen backbone, in a process that holds `runtime_bytes` already.
pub fn embedded_needs(spec: &ModelSpec, optimizer: OptimizerKind, samples: u64, runtime_bytes: u64) -> MemoryNeeds {
    let net = spec.net();
    // Weights, gradients, the round's global model and the encoded update, plus optimizer state.
    let copies = 4 + match optimizer {
        OptimizerKind::Sgd => 1,
        OptimizerKind::Adam => 2,
    };
    let (input, features) = (spec.input_dim as u64, spec.feature_dim as u64);
    let backbone = (input + 1) * features;
    // One backbone call while the cache is built: its input and its output before and after ReLU.
    let backbone_pass = BACKBONE_CHUNK * (input + 2 * features);
    MemoryNeeds {
        fixed_bytes: runtime_bytes
            .saturating_add(ROUND_OVERHEAD_BYTES)
            .saturating_add(f32_bytes(backbone + copies * net.param_count() + backbone_pass)),
        activation_bytes_per_sample: f32_bytes(2 * net.activation_values()),
        // Features on the device, the label as i64 there and as u32 on the host.
        feature_bytes_per_sample: f32_bytes(features) + 8 + 4,
        samples,
        requested_batch: PLANNED_BATCH,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_high_water_mark() {
        assert_eq!(parse_vm_hwm("Name:\tx\nVmHWM:\t   2048 kB\nVmRSS:\t 1 kB\n"), Some(2048 * 1024));
        assert_eq!(parse_vm_hwm("Name:\tx\n"), None);
        assert_eq!(parse_vm_hwm("VmHWM:\tlots kB\n"), None);
        assert_eq!(parse_kib("VmRSS:\t 3 kB\n", "VmRSS:"), Some(3072));
        if cfg!(target_os = "linux") {
            assert!(current_rss_bytes().unwrap() > 0);
        }
    }

    fn needs(fixed_mib: u64, samples: u64) -> MemoryNeeds {
        // The embedded default's sizes: 512 features, a 512-wide adapter, 10 classes.
        MemoryNeeds {
            fixed_bytes: fixed_mib * MIB,
            activation_bytes_per_sample: 4 * 2 * (512 + 2 * 512 + 2 * 10),
            feature_bytes_per_sample: 4 * 512 + 12,
            samples,
            requested_batch: 32,
        }
    }

    #[test]
    fn a_roomy_budget_caches_everything() {
        let p = plan(256 * MIB, &needs(100, 10_000)).unwrap();
        assert_eq!(p.cache_samples, 10_000);
        assert_eq!(p.cache_bytes, 10_000 * (4 * 512 + 12));
        // The batch may grow to the whole set.
        assert_eq!(p.batch_size, 10_000);
    }

    #[test]
    fn a_tight_budget_keeps_the_batch_and_cuts_the_cache() {
        let n = needs(100, 10_000);
        let p = plan(110 * MIB, &n).unwrap();
        assert!(p.cache_samples < 10_000 && p.cache_samples > 4_000, "{p:?}");
        assert!(p.batch_size >= 32, "{p:?}");
        let used = n.fixed_bytes + p.cache_bytes + p.batch_size * n.activation_bytes_per_sample;
        assert!(used <= 110 * MIB, "{used}");
    }

    #[test]
    fn a_tiny_budget_shrinks_the_batch() {
        let n = needs(100, 10_000);
        let one = n.activation_bytes_per_sample + n.feature_bytes_per_sample;
        let p = plan(n.fixed_bytes + 10 * one, &n).unwrap();
        assert!(p.batch_size >= 10 && p.batch_size < 32, "{p:?}");
        assert!(p.cache_samples >= p.batch_size, "{p:?}");
        let p = plan(n.fixed_bytes + one, &n).unwrap();
        assert_eq!((p.batch_size, p.cache_samples), (1, 1));
    }

    #[test]
    fn too_small_is_a_clear_error() {
        let n = needs(100, 10_000);
        let one = n.activation_bytes_per_sample + n.feature_bytes_per_sample;
        let err = plan(n.fixed_bytes + one - 1, &n).unwrap_err();
        assert_eq!(err.fixed_bytes, 100 * MIB);
        let msg = err.to_string();
        assert!(msg.contains("too small") && msg.contains("at least 101 MiB"), "{msg}");
        assert!(plan(50 * MIB, &n).is_err());
        assert!(plan(0, &n).is_err());
    }

    #[test]
    fn plans_fit_their_budget() {
        for fixed in [0u64, 1, 30] {
            for samples in [0u64, 1, 7, 500, 100_000] {
                for requested in [0u64, 1, 32, 1_000_000] {
                    for budget_kib in [1u64, 64, 1_000, 40_000, 200_000] {
                        let n = MemoryNeeds { requested_batch: requested, ..needs(fixed, samples) };
                        let one = n.activation_bytes_per_sample + n.feature_bytes_per_sample;
                        let budget = budget_kib * 1024;
                        match plan(budget, &n) {
                            Ok(p) => {
                                let used = n.fixed_bytes + p.cache_bytes + p.batch_size * n.activation_bytes_per_sample;
                                assert!(used <= budget, "{n:?} {p:?}");
                                assert!(p.batch_size >= 1 && p.batch_size <= samples.max(1), "{n:?} {p:?}");
                                assert!(p.cache_samples <= samples, "{n:?} {p:?}");
                                assert!(p.cache_samples >= p.batch_size.min(samples), "{n:?} {p:?}");
                                let wanted = requested.clamp(1, samples.max(1));
                                if budget >= n.fixed_bytes + wanted * one {
                                    assert!(p.batch_size >= wanted, "{n:?} {p:?}");
                                }
                            }
                            Err(e) => assert!(budget < n.fixed_bytes + one, "{e}"),
                        }
                    }
                }
            }
        }
        // Nothing per sample: everything fits.
        let free = MemoryNeeds { activation_bytes_per_sample: 0, feature_bytes_per_sample: 0, ..needs(0, 5) };
        assert_eq!(plan(0, &free), Ok(MemoryPlan { batch_size: 5, cache_bytes: 0, cache_samples: 5 }));
    }

    #[test]
    fn embedded_client_plans() {
        // The embedded default (256 → 512 backbone, 512 adapter, 10 classes) with Adam.
        let spec = ModelSpec::embedded_default();
        let n = embedded_needs(&spec, OptimizerKind::Adam, 1_000, 40 * MIB);
        assert_eq!(spec.net().param_count(), 512 * 513 + 10 * 513);
        assert_eq!(n.activation_bytes_per_sample, 4 * 2 * (512 + 2 * 512 + 2 * 10));
        assert_eq!(n.feature_bytes_per_sample, 4 * 512 + 12);
        let fixed = 60 * MIB + 4 * (257 * 512 + 6 * (512 * 513 + 10 * 513) + 512 * (256 + 1024));
        assert_eq!(n.fixed_bytes, fixed);
        let roomy = plan(84 * MIB, &n).unwrap();
        assert_eq!((roomy.cache_samples, roomy.batch_size), (1_000, 1_000));
        // Every feature cached, the batch bounded by what is left.
        let tight = plan(fixed + 2_060 * 1_000 + 100 * 12_448, &n).unwrap();
        assert_eq!((tight.cache_samples, tight.batch_size), (1_000, 100));
        // Room for the planned batch of 32 comes before the cache.
        let tighter = plan(fixed + 2_060 * 500 + 32 * 12_448, &n).unwrap();
        assert_eq!((tighter.cache_samples, tighter.batch_size), (500, 32));
        let err = plan(68 * MIB, &n).unwrap_err().to_string();
        assert!(err.contains("at least 70 MiB"), "{err}");
    }

    #[test]
    fn this_process_has_a_peak() {
        if cfg!(target_os = "linux") {
            let before = peak_rss_bytes().expect("Linux exposes VmHWM");
            let big = vec![1u8; 64 << 20];
            std::hint::black_box(&big);
            let after = peak_rss_bytes().unwrap();
            // The high-water mark never falls and covers the 64 MiB held right now (other tests in
            // this process may have raised it further already).
            assert!(before > 1 << 20 && after >= before && after >= 64 << 20, "{before} → {after}");
        }
    }
}
