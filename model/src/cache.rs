//! Frozen-backbone features, computed once per sample and reused by every epoch and round.
//!
//! [`FeatureCache`] holds the features of one whole dataset as a device tensor (what the training
//! loop consumes). [`FeatureStore`] is the bounded, keyed cache behind it on a device with little
//! memory: features per (data id, sample index) within a byte budget, spilled to disk past it
//! when a spill directory is given, and dropped when the backbone's fingerprint (weights or input
//! transform) changes.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anchorage_data::Dataset;
use burn::tensor::{Device, Int, Tensor, TensorData};

use super::backbone::Backbone;

/// Features and labels of a dataset under a frozen backbone, kept on the training device.
///
/// A cache cut from another ([`FeatureCache::subset`]) holds row indices into the same feature
/// tensor, not a copy of its rows: a simulation's clients and its evaluator share one pool's
/// features (data held once). [`FeatureCache::features`] materialises the rows when a
/// caller needs them as one tensor; the training loop selects each batch from the pool directly.
#[derive(Debug, Clone)]
pub struct FeatureCache {
    /// The pool's features `[pool rows, dim]`, shared by reference by every cache cut from it.
    pool: Tensor<2>,
    /// This cache's rows of `pool` in order; `None`: all of them. Host indices: a simulation
    /// holds one cache per client and task, and a device tensor each (256 bytes inline, plus its
    /// allocation) would be most of a client's memory at 100,000 clients.
    rows: Option<Arc<[usize]>>,
    /// The label of each row (shared by clones: 100,000 clients of one test set hold one list).
    pub labels_host: Arc<[u32]>,
    /// Where the raw samples behind the rows are, for methods that change the backbone's input
    /// (FedTA's input enhancement); `None` when only the features were kept.
    pub inputs: Option<Inputs>,
}

/// The raw samples behind a cache's rows: row `i` is `data.sample(rows[i])`. The dataset is
/// shared, not copied, by every cache cut from the same pool.
#[derive(Debug, Clone)]
pub struct Inputs {
    pub data: Arc<Dataset>,
    pub rows: Vec<usize>,
}

impl Inputs {
    /// Every sample of `data`, in order.
    pub fn all(data: Arc<Dataset>) -> Self {
        let rows = (0..data.len()).collect();
        Self { data, rows }
    }

    /// Shape of one sample.
    pub fn sample_shape(&self) -> &[usize] {
        &self.data.sample_shape
    }

    /// The flat samples `[rows.len(), sample_len]` of the cache rows `rows` (rows out of range are
    /// skipped, so the batch may be shorter).
    pub fn batch(&self, rows: &[usize], device: &Device) -> Tensor<2> {
        let picked: Vec<usize> =
            rows.iter().filter_map(|&r| self.rows.get(r).copied()).filter(|&i| i < self.data.len()).collect();
        batch_of(&self.data, &picked, device)
    }
}

fn batch_of(data: &Dataset, indices: &[usize], device: &Device) -> Tensor<2> {
    let dim = data.sample_len();
    let mut values = Vec::with_capacity(indices.len() * dim);
    for &i in indices {
        values.extend_from_slice(data.sample(i));
    }
    Tensor::from_data(TensorData::new(values, [indices.len(), dim]), device)
}

impl FeatureCache {
    /// Runs the backbone over `data` in chunks of `chunk` samples.
    pub fn build<B: Backbone + ?Sized>(backbone: &B, data: &Dataset, chunk: usize, device: &Device) -> Self {
        Self::build_with_progress(backbone, data, chunk, device, &|_| {})
    }

    /// [`FeatureCache::build`], calling `done(samples)` after each chunk (a progress bar).
    pub fn build_with_progress<B: Backbone + ?Sized>(
        backbone: &B,
        data: &Dataset,
        chunk: usize,
        device: &Device,
        done: &dyn Fn(usize),
    ) -> Self {
        let chunk = chunk.max(1);
        let all: Vec<usize> = (0..data.len()).collect();
        let parts: Vec<Tensor<2>> = all
            .chunks(chunk)
            .map(|c| {
                let f = backbone.features(batch_of(data, c, device), &data.sample_shape);
                done(c.len());
                f
            })
            .collect();
        let features =
            if parts.is_empty() { Tensor::zeros([0, backbone.feature_dim()], device) } else { Tensor::cat(parts, 0) };
        Self::from_parts(features, &data.labels, device)
    }

    /// Features of all of `data` through a [`FeatureStore`] (computed only where not stored).
    pub fn build_stored<B: Backbone + ?Sized>(
        store: &mut FeatureStore,
        backbone: &B,
        data: &Dataset,
        data_id: u64,
        device: &Device,
    ) -> Result<Self, CacheError> {
        let all: Vec<usize> = (0..data.len()).collect();
        let features = store.features(backbone, data, data_id, &all, device)?;
        Ok(Self::from_parts(features, &data.labels, device))
    }

    /// The samples of `data` as their own features (the identity backbone), taking the dataset's
    /// buffer rather than copying it.
    pub fn of_samples(data: Dataset, device: &Device) -> Self {
        let shape = [data.len(), data.sample_len()];
        let features = Tensor::from_data(TensorData::new(data.features, shape), device);
        Self::from_parts(features, &data.labels, device)
    }

    /// A cache over `features` (one row per label), e.g. computed outside a backbone.
    pub fn from_parts(features: Tensor<2>, labels_host: &[u32], _device: &Device) -> Self {
        Self { pool: features, rows: None, labels_host: labels_host.into(), inputs: None }
    }

    /// The labels of this cache's rows `positions`, as a device tensor (a batch's targets).
    pub fn labels_of(&self, positions: &[usize]) -> Tensor<1, Int> {
        let labels: Vec<i64> = positions.iter().map(|&i| self.labels_host[i] as i64).collect();
        Tensor::from_data(TensorData::new(labels, [positions.len()]), &self.device())
    }

    /// The pool rows of this cache's rows `positions`.
    fn pool_rows(&self, positions: impl Iterator<Item = usize>) -> Tensor<1, Int> {
        let idx: Vec<i64> = match &self.rows {
            None => positions.map(|i| i as i64).collect(),
            Some(rows) => positions.map(|i| rows[i] as i64).collect(),
        };
        let n = idx.len();
        Tensor::from_data(TensorData::new(idx, [n]), &self.device())
    }

    /// The features of this cache's rows, `[len, dim]` (a copy when the cache is a subset).
    pub fn features(&self) -> Tensor<2> {
        match &self.rows {
            None => self.pool.clone(),
            Some(_) => self.pool.clone().select(0, self.pool_rows(0..self.len())),
        }
    }

    /// The features of this cache's rows `positions`, `[positions.len(), dim]`.
    pub fn select(&self, positions: &[usize]) -> Tensor<2> {
        self.pool.clone().select(0, self.pool_rows(positions.iter().copied()))
    }

    /// The features of this cache's rows `range`, `[range.len(), dim]`.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Tensor<2> {
        match &self.rows {
            None => self.pool.clone().slice(range),
            Some(_) => self.pool.clone().select(0, self.pool_rows(range)),
        }
    }

    /// Width of a feature row.
    pub fn dim(&self) -> usize {
        self.pool.dims()[1]
    }

    pub fn device(&self) -> Device {
        self.pool.device()
    }

    /// This cache with its raw samples: row `i` is `inputs.data.sample(inputs.rows[i])`.
    pub fn with_inputs(mut self, inputs: Inputs) -> Self {
        self.inputs = Some(inputs);
        self
    }

    /// A cache of other features for the same samples (e.g. the features of enhanced inputs),
    /// keeping the labels and raw inputs.
    pub fn with_features(&self, features: Tensor<2>) -> Self {
        Self { pool: features, rows: None, ..self.clone() }
    }

    pub fn len(&self) -> usize {
        self.labels_host.len()
    }

    /// The rows `indices` of this cache: indices into the same feature tensor, which is shared,
    /// not copied (nothing is recomputed).
    pub fn subset(&self, indices: &[usize]) -> Self {
        let rows: Arc<[usize]> = match &self.rows {
            None => indices.into(),
            Some(rows) => indices.iter().map(|&i| rows[i]).collect(),
        };
        let inputs = self.inputs.as_ref().map(|i| Inputs {
            data: i.data.clone(),
            rows: indices.iter().filter_map(|&r| i.rows.get(r).copied()).collect(),
        });
        Self {
            pool: self.pool.clone(),
            rows: Some(rows),
            labels_host: indices.iter().map(|&i| self.labels_host[i]).collect(),
            inputs,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.labels_host.is_empty()
    }

    /// The rows of every cache in `parts`, in order (`None` when `parts` is empty); raw inputs
    /// are not kept.
    pub fn concat(parts: &[FeatureCache]) -> Option<Self> {
        let first = parts.first()?;
        let device = first.device();
        let features = Tensor::cat(parts.iter().map(|p| p.features()).collect(), 0);
        let labels: Vec<u32> = parts.iter().flat_map(|p| p.labels_host.iter().copied()).collect();
        Some(Self::from_parts(features, &labels, &device))
    }
}

/// The spill file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("feature spill file {path}: {source}")]
    Spill { path: PathBuf, source: std::io::Error },
    #[error("backbone returned {got} values for {rows} samples of {dim} features")]
    Shape { rows: usize, dim: usize, got: usize },
}

/// What a [`FeatureStore`] did so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Samples served from memory or disk.
    pub hits: u64,
    /// Samples run through the backbone.
    pub misses: u64,
    /// Times the store was emptied because the backbone fingerprint changed.
    pub invalidations: u64,
    /// Computed samples neither memory nor disk had room for.
    pub rejected: u64,
    pub memory_bytes: u64,
    pub disk_bytes: u64,
}

#[derive(Debug, Clone, Copy)]
enum Slot {
    Memory(usize),
    Disk(u64),
}

/// Bytes one cached sample costs in memory besides its features (key, slot, map overhead).
const ENTRY_OVERHEAD: usize = 48;

/// Features per (data id, sample index) under one backbone fingerprint, within a memory budget
/// and an optional disk budget. Admission is first come (no eviction): with epoch-style access a
/// stable resident set beats LRU, which would miss on every sample once the set exceeds the budget.
#[derive(Debug)]
pub struct FeatureStore {
    memory_budget: usize,
    disk: Option<(PathBuf, u64)>,
    fingerprint: Option<u64>,
    dim: usize,
    rows: Vec<f32>,
    slots: HashMap<(u64, u32), Slot>,
    spill: Option<(PathBuf, File)>,
    /// Samples per backbone call.
    pub chunk: usize,
    stats: CacheStats,
}

impl FeatureStore {
    /// A store holding at most `memory_budget` bytes of features in memory.
    pub fn new(memory_budget: usize) -> Self {
        Self {
            memory_budget,
            disk: None,
            fingerprint: None,
            dim: 0,
            rows: Vec::new(),
            slots: HashMap::new(),
            spill: None,
            chunk: 256,
            stats: CacheStats::default(),
        }
    }

    /// Spill features past the memory budget to a file in `dir`, up to `disk_budget` bytes.
    pub fn with_disk(mut self, dir: impl Into<PathBuf>, disk_budget: u64) -> Self {
        self.disk = Some((dir.into(), disk_budget));
        self
    }

    pub fn stats(&self) -> &CacheStats {
        &self.stats
    }

    /// Samples cached (memory and disk).
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Forgets everything (and deletes the spill file).
    pub fn clear(&mut self) {
        self.rows = Vec::new();
        self.slots.clear();
        if let Some((path, file)) = self.spill.take() {
            drop(file);
            let _ = std::fs::remove_file(path);
        }
        self.stats.memory_bytes = 0;
        self.stats.disk_bytes = 0;
        self.fingerprint = None;
    }

    /// Features `[indices.len(), dim]` of `data[indices]` (`data_id` names the dataset), computed by
    /// `backbone` where not cached under its current fingerprint.
    pub fn features<B: Backbone + ?Sized>(
        &mut self,
        backbone: &B,
        data: &Dataset,
        data_id: u64,
        indices: &[usize],
        device: &Device,
    ) -> Result<Tensor<2>, CacheError> {
        let fp = backbone.fingerprint();
        if self.fingerprint != Some(fp) {
            if self.fingerprint.is_some() {
                self.stats.invalidations += 1;
            }
            self.clear();
            self.fingerprint = Some(fp);
            self.dim = backbone.feature_dim();
        }
        let dim = self.dim;
        let mut out = vec![0.0f32; indices.len() * dim];
        let mut missing = Vec::new();
        for (k, &i) in indices.iter().enumerate() {
            match self.slots.get(&(data_id, i as u32)).copied() {
                Some(slot) => {
                    self.read(slot, &mut out[k * dim..(k + 1) * dim])?;
                    self.stats.hits += 1;
                }
                None => missing.push(k),
            }
        }
        for part in missing.chunks(self.chunk.max(1)) {
            let idx: Vec<usize> = part.iter().map(|&k| indices[k]).collect();
            let f = backbone.features(batch_of(data, &idx, device), &data.sample_shape);
            let values: Vec<f32> = f.into_data().try_into_vec_as::<f32>().unwrap_or_default();
            if values.len() != part.len() * dim {
                return Err(CacheError::Shape { rows: part.len(), dim, got: values.len() });
            }
            for (j, &k) in part.iter().enumerate() {
                let row = &values[j * dim..(j + 1) * dim];
                out[k * dim..(k + 1) * dim].copy_from_slice(row);
                self.insert((data_id, indices[k] as u32), row)?;
                self.stats.misses += 1;
            }
        }
        Ok(Tensor::from_data(TensorData::new(out, [indices.len(), dim]), device))
    }

    fn insert(&mut self, key: (u64, u32), row: &[f32]) -> Result<(), CacheError> {
        if self.slots.contains_key(&key) {
            return Ok(());
        }
        let cost = row.len() * 4 + ENTRY_OVERHEAD;
        if self.stats.memory_bytes as usize + cost <= self.memory_budget {
            self.slots.insert(key, Slot::Memory(self.rows.len()));
            self.rows.extend_from_slice(row);
            self.stats.memory_bytes += cost as u64;
            return Ok(());
        }
        let Some((dir, disk_budget)) = self.disk.clone() else {
            self.stats.rejected += 1;
            return Ok(());
        };
        let bytes = (row.len() * 4) as u64;
        if self.stats.disk_bytes + bytes > disk_budget {
            self.stats.rejected += 1;
            return Ok(());
        }
        let offset = self.stats.disk_bytes;
        let (path, file) = self.spill_file(&dir)?;
        let buf: Vec<u8> = row.iter().flat_map(|v| v.to_le_bytes()).collect();
        let io = |source| CacheError::Spill { path: path.clone(), source };
        file.seek(SeekFrom::Start(offset)).map_err(io)?;
        file.write_all(&buf).map_err(io)?;
        self.stats.disk_bytes += bytes;
        self.slots.insert(key, Slot::Disk(offset));
        Ok(())
    }

    fn spill_file(&mut self, dir: &Path) -> Result<(PathBuf, &mut File), CacheError> {
        if self.spill.is_none() {
            let fp = self.fingerprint.unwrap_or(0);
            let path = dir.join(format!("features-{fp:016x}-{}.f32", std::process::id()));
            let open = std::fs::create_dir_all(dir)
                .and_then(|_| OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path));
            let file = open.map_err(|source| CacheError::Spill { path: path.clone(), source })?;
            self.spill = Some((path, file));
        }
        let (path, file) = self.spill.as_mut().expect("just set");
        Ok((path.clone(), file))
    }

    fn read(&mut self, slot: Slot, out: &mut [f32]) -> Result<(), CacheError> {
        match slot {
            Slot::Memory(at) => out.copy_from_slice(&self.rows[at..at + out.len()]),
            Slot::Disk(offset) => {
                let Some((path, file)) = self.spill.as_mut() else {
                    return Err(CacheError::Spill {
                        path: PathBuf::new(),
                        source: std::io::ErrorKind::NotFound.into(),
                    });
                };
                let mut buf = vec![0u8; out.len() * 4];
                let io = |source| CacheError::Spill { path: path.clone(), source };
                file.seek(SeekFrom::Start(offset)).map_err(io)?;
                file.read_exact(&mut buf).map_err(|source| CacheError::Spill { path: path.clone(), source })?;
                for (v, b) in out.iter_mut().zip(buf.chunks_exact(4)) {
                    *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        }
        Ok(())
    }
}

impl Drop for FeatureStore {
    fn drop(&mut self) {
        if let Some((path, _)) = self.spill.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}
