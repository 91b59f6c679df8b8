//! From a `client.toml` to a running device: the compute device, the local data and the
//! method's client half, and the transport's options. `anchorage-client` is a thin shell around
//! [`run`]; tests run the very same path from a generated `client.toml`.

use std::sync::Arc;

use anchorage_data::{Dataset, SyntheticConfig, partition, synthetic};
use anchorage_shared::rng::Rng;
use anyhow::Context;

use crate::config::{ClientConfig, DataSource};
use crate::memory::{self, MemoryNeeds, MemoryPlan};
use crate::methods::protos::PrototypeRelease;
use crate::methods::{self, BatchCap, ClientMethod, MethodContext};
use crate::metrics::ClientMetrics;
use crate::privacy::DevicePrivacy;
use crate::share;
use crate::store::ClientStore;
use crate::transport::{self, Backoff, ClientCert, ClientOptions};
use anchorage_model::ModelSpec;
use anchorage_model::device;
use anchorage_model::train::OptimizerKind;
use burn::tensor::Device;

/// Runs the device of `config` until the server says goodbye or `stop` turns `true`; returns
/// the reason the session ended.
pub async fn run(config: ClientConfig, stop: Option<tokio::sync::watch::Receiver<bool>>) -> anyhow::Result<String> {
    run_configured(config, stop, |_| {}).await
}

/// [`run`], calling `configured` with the compute device's name once the device is configured
/// (compute device, local data, method, certificates read) and before it first dials the server:
/// `anchorage-client` tells systemd there that it is ready.
pub async fn run_configured(
    config: ClientConfig,
    stop: Option<tokio::sync::watch::Receiver<bool>>,
    configured: impl FnOnce(&str),
) -> anyhow::Result<String> {
    let (dev, picked) = device::select(&config.device)?;
    tracing::info!(device = picked, "compute device");
    let method = method(&config, &dev)?;
    let mut options = options(&config)?;
    options.backend = picked.into();
    options.stop = stop;
    configured(picked);
    let textfile = metrics_textfile(&config, &options.metrics);
    let result = transport::run(options, method, None).await;
    if let Some((path, writer, metrics)) = textfile {
        writer.abort();
        if let Err(e) = metrics.write_textfile(&path) {
            tracing::warn!(textfile = %path.display(), error = %e, "could not write the metrics textfile at exit");
        }
    }
    result
}

/// With `[metrics] textfile`: the task that writes `metrics` there every `every_s` (and the
/// path and metrics, to write them once more at exit).
fn metrics_textfile(
    config: &ClientConfig,
    metrics: &Arc<ClientMetrics>,
) -> Option<(std::path::PathBuf, tokio::task::JoinHandle<()>, Arc<ClientMetrics>)> {
    let path = config.metrics.textfile.clone()?;
    tracing::info!(textfile = %path.display(), every_s = config.metrics.every_s, "writing the device's metrics");
    let writer = tokio::spawn(crate::metrics::write_every(metrics.clone(), path.clone(), config.metrics.every()));
    Some((path, writer, metrics.clone()))
}

/// The method's client half on this device's local data.
pub fn method(config: &ClientConfig, dev: &Device) -> anyhow::Result<Box<dyn ClientMethod>> {
    let compression = config.update_compression()?;
    let privacy = config.device_privacy()?;
    let release = privacy.as_ref().map_or(PrototypeRelease::Means, DevicePrivacy::prototype_release);
    let enc = compression.method_encoding(config.encoding.encoding());
    let method = match &config.data {
        DataSource::Synthetic { seed, clients, index, alpha } => {
            let (train, test) = synthetic_share(*seed, *clients, *index, *alpha)?;
            tracing::info!(train = train.len(), test = test.len(), "local data (embedded synthetic set)");
            let mut plan = None;
            let (train, test) = match config.max_memory_mb {
                Some(mb) => {
                    let (_, p) = plan_memory(mb, &ModelSpec::embedded_default(), config.optimizer, &train, &test)?;
                    plan = Some(p);
                    fit_cache(&p, train, test)
                }
                None => (train, test),
            };
            let context = MethodContext::embedded(&train, &test, dev.clone().autodiff(), config.optimizer, enc, 0);
            let mut method = methods::build(&config.method, MethodContext { prototype_release: release, ..context })?;
            if let Some(p) = plan {
                method = Box::new(BatchCap { inner: method, max: u32::try_from(p.batch_size).unwrap_or(u32::MAX) });
            }
            method
        }
        DataSource::Scenario { .. } => {
            if config.max_memory_mb.is_some() {
                tracing::warn!("max_memory_mb plans the embedded model only; it is not applied to a scenario share");
            }
            let context = share::scenario_context(config, dev)?;
            methods::build(
                &config.method,
                methods::MethodContext { encoding: enc, prototype_release: release, ..context },
            )?
        }
    };
    // Privatize first, then compress (a top-k of a noised delta is post-processing).
    let method = match privacy {
        Some(p) => {
            tracing::info!(
                noise = ?p.noise,
                clip = p.clip,
                prototype_clip = p.prototype_clip,
                sigma = ?p.noise_multiplier,
                "differential privacy on: prototypes are uploaded as sums of clipped features"
            );
            crate::privacy::wrap(method, Some(p), crate::privacy::system_rng()?)
        }
        None => method,
    };
    Ok(crate::compress::wrap(method, compression))
}

/// This device's train and test share of the embedded synthetic set.
fn synthetic_share(seed: u64, clients: usize, index: usize, alpha: f64) -> anyhow::Result<(Dataset, Dataset)> {
    anyhow::ensure!(index < clients, "data.index {index} must be below data.clients {clients}");
    let (all, _) = synthetic::generate(&SyntheticConfig { seed, ..SyntheticConfig::default() });
    let parts = partition::dirichlet(&all.labels, all.num_classes, clients, alpha, 20, seed)?;
    Ok(all.subset(&parts[index]).split_per_class(0.8, seed ^ index as u64))
}

/// The memory plan `config` trains under (`anchorage-client doctor` shows it): `None` without
/// `max_memory_mb`, and for a scenario share (the budget plans the embedded model only).
pub fn memory_plan(config: &ClientConfig) -> anyhow::Result<Option<(MemoryNeeds, MemoryPlan)>> {
    let (Some(mb), DataSource::Synthetic { seed, clients, index, alpha }) = (config.max_memory_mb, &config.data) else {
        return Ok(None);
    };
    let (train, test) = synthetic_share(*seed, *clients, *index, *alpha)?;
    plan_memory(mb, &ModelSpec::embedded_default(), config.optimizer, &train, &test).map(Some)
}

/// The transport's options of `config`: the server's address, the trusted root, this device's
/// certificate and key, the durable store, backoff and timers. `backend` stays `cpu` and `stop`
/// unset; [`run`] fills them in.
pub fn options(config: &ClientConfig) -> anyhow::Result<ClientOptions> {
    let cert = std::fs::read(&config.server_cert)
        .with_context(|| format!("reading the pinned server certificate {}", config.server_cert.display()))?;
    let mut options = ClientOptions::new(config.server_addr()?, cert.into(), config.client_id.clone());
    options.fallbacks = config.fallback_addrs()?;
    options.home_after = std::time::Duration::from_secs(config.home_after_secs);
    options.client_cert = match (&config.cert, &config.key) {
        (Some(cert), Some(key)) => {
            let read = |p: &std::path::Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
            Some(Arc::new(ClientCert {
                chain: vec![read(cert)?.into()],
                key: rustls::pki_types::PrivateKeyDer::Pkcs8(read(key)?.into()),
            }))
        }
        (None, None) => None,
        _ => anyhow::bail!(
            "client.toml names `cert` or `key` without the other: give both, or neither for a development server"
        ),
    };
    options.server_name = config.server_name.clone();
    options.memory_mb = config.memory_mb;
    options.store = Some(ClientStore::new(&config.state_dir));
    options.backoff = Backoff {
        initial: std::time::Duration::from_millis(config.reconnect.initial_ms),
        max: std::time::Duration::from_millis(config.reconnect.max_ms),
        max_attempts: None,
    };
    options.keep_alive = config.connection.keep_alive();
    options.idle_timeout = config.connection.idle_timeout();
    options.connect_timeout = config.connection.connect_timeout();
    options.eligibility = config.eligibility.clone();
    options.secure_aggregation = config.secure_aggregation;
    options.sys_root = Some(crate::eligibility::SysRoot::default());
    Ok(options)
}

/// Fits the embedded model's training into `max_memory_mb` and logs the plan.
fn plan_memory(
    max_memory_mb: u32,
    spec: &ModelSpec,
    optimizer: OptimizerKind,
    train: &Dataset,
    test: &Dataset,
) -> anyhow::Result<(MemoryNeeds, MemoryPlan)> {
    // What runs now (runtime, the data already loaded) stays resident whatever the plan.
    let runtime = memory::current_rss_bytes().unwrap_or(0);
    let needs = memory::embedded_needs(spec, optimizer, (train.len() + test.len()) as u64, runtime);
    let plan = memory::plan(u64::from(max_memory_mb) << 20, &needs).context("max_memory_mb")?;
    let mib = |b: u64| (b as f64 / (1 << 20) as f64 * 10.0).round() / 10.0;
    tracing::info!(
        max_memory_mb,
        fixed_mib = mib(needs.fixed_bytes),
        batch_size = plan.batch_size,
        cache_mib = mib(plan.cache_bytes),
        cache_samples = plan.cache_samples,
        samples = needs.samples,
        "memory plan"
    );
    Ok((needs, plan))
}

/// The train and test sets cut to what the plan's cache holds (a seeded choice, in proportion).
fn fit_cache(plan: &MemoryPlan, train: Dataset, test: Dataset) -> (Dataset, Dataset) {
    let total = (train.len() + test.len()) as u64;
    if plan.cache_samples >= total {
        return (train, test);
    }
    let keep_train = (plan.cache_samples * train.len() as u64 / total.max(1)).max(1) as usize;
    let keep_test = (plan.cache_samples as usize).saturating_sub(keep_train);
    tracing::warn!(
        train = train.len(),
        test = test.len(),
        keep_train,
        keep_test,
        "the feature cache cannot hold every sample within max_memory_mb: training on a subset"
    );
    let pick = |set: &Dataset, keep: usize, stream: u64| {
        let mut idx: Vec<usize> = (0..set.len()).collect();
        Rng::derive(0x3E3, stream).shuffle(&mut idx);
        idx.truncate(keep.min(set.len()));
        idx.sort_unstable();
        set.subset(&idx)
    };
    (pick(&train, keep_train, 1), pick(&test, keep_test, 2))
}
