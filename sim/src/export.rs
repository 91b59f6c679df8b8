//! `anchorage export`: a scenario's federation as NumPy files, so that another framework (Flower,
//! in `benches/peers/`) can run exactly the same job: the same features, the same rows per
//! client, the same clients per round, the same batch order and the same initial weights.
//!
//! Written into the folder:
//! - `x_train.npy` (f32 `[n, d]`), `y_train.npy` (i64 `[n]`): the training pool as the trainable
//!   net reads it (the frozen backbone's features; with `backbone = "identity"` the raw samples);
//! - `x_test.npy`, `y_test.npy`: the global test set the server evaluates the global model on;
//! - `train_rows.npy` (i64 `[clients, n_max]`, −1 padded): each client's training rows, in the
//!   order of its feature cache;
//! - `batch_order.npy` (i64 `[clients, rounds, epochs · n_max]`, −1 padded): the rows of
//!   `x_train` in the order client i visits them in its k-th training (its k-th participation),
//!   epoch after epoch; batches are consecutive chunks of `batch_size`, the last one short;
//! - `selection.npy` (i64 `[rounds, k]`): the clients the engine invites in each round when every
//!   client is connected (the real and virtual clocks both open round 1 with all of them);
//! - `init/<block>.npy`: the initial global model, one array per parameter block (a linear
//!   layer's weight is `[fan_in, fan_out]`: y = x·W + b, ReLU between layers);
//! - `meta.json`: the job (clients, rounds, fraction, epochs, batch, learning rate, optimizer
//!   constants) and the block list.
//!
//! The batch order and the selection repeat what the FedAvg client (`client/src/methods/
//! baselines.rs`: one `Rng::derive(seed + i, 0xBA5E)` per client, a Fisher–Yates shuffle per
//! epoch) and the engine (`Rng::derive(seed, r − 1).sample_indices` over the sorted client ids)
//! draw; the peer benchmark checks the selection against the run's ledger.
//!
//! The .npy files are written here (format 1.0: magic, a little-endian header length, a Python
//! dict literal padded with spaces to a 64-byte boundary as NumPy does, then the raw
//! little-endian values): a dozen lines, against a dependency for two dtypes.

use std::io::Write;
use std::path::{Path, PathBuf};

use anchorage_data::partition::FederatedSplit;
use anchorage_data::{DataSpec, LoadedData};
use anchorage_model::{Backbone, FeatureCache, zoo};
use anchorage_shared::method::MethodConfig;
use anchorage_shared::rng::Rng;
use anyhow::Context;
use burn::tensor::Device;
use serde_json::json;

use crate::config::SimConfig;
use crate::device::Charge;
use crate::setup::{Setup, client_id};

/// What [`export`] wrote.
#[derive(Debug, Clone)]
pub struct Exported {
    pub dir: PathBuf,
    pub files: Vec<PathBuf>,
    pub clients: usize,
    pub train_rows: usize,
    pub test_rows: usize,
    pub feature_dim: usize,
}

/// A little-endian element type of a .npy file.
pub trait NpyElement: Copy {
    const DESCR: &'static str;
    fn put(self, out: &mut Vec<u8>);
}

impl NpyElement for f32 {
    const DESCR: &'static str = "<f4";
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

impl NpyElement for i64 {
    const DESCR: &'static str = "<i8";
    fn put(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

/// The bytes of a C-ordered .npy file (format 1.0) holding `values` of `shape`.
pub fn npy_bytes<T: NpyElement>(shape: &[usize], values: &[T]) -> anyhow::Result<Vec<u8>> {
    let count: usize = shape.iter().product();
    anyhow::ensure!(count == values.len(), "npy: shape {shape:?} holds {count} values, got {}", values.len());
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_text = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '{}', 'fortran_order': False, 'shape': {shape_text}, }}", T::DESCR);
    // magic (6) + version (2) + header length (2) + header, a multiple of 64, ending in '\n'.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let len = u16::try_from(header.len()).context("npy header too long")?;
    let mut out = Vec::with_capacity(10 + header.len() + std::mem::size_of_val(values));
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for &v in values {
        v.put(&mut out);
    }
    Ok(out)
}

fn write_npy<T: NpyElement>(path: &Path, shape: &[usize], values: &[T]) -> anyhow::Result<PathBuf> {
    let bytes = npy_bytes(shape, values)?;
    let mut file = std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    file.write_all(&bytes).with_context(|| format!("writing {}", path.display()))?;
    Ok(path.to_path_buf())
}

/// Row-major f32 values of a cache's features.
fn feature_values(cache: &FeatureCache) -> anyhow::Result<Vec<f32>> {
    cache.features().to_data().try_to_vec_as::<f32>().map_err(|e| anyhow::anyhow!("reading features: {e:?}"))
}

/// Writes the federation of `config` (a scenario with a `[data]` table, one task, FedAvg or
/// FedProx) into `dir`; see the module documentation for the files.
pub fn export(config: &SimConfig, dir: &Path) -> anyhow::Result<Exported> {
    let spec = exportable(config)?;
    std::fs::create_dir_all(dir.join("init")).with_context(|| format!("creating {}", dir.display()))?;
    let mut out = Export { config, dir, files: Vec::new() };
    let split = out.split(spec)?;
    let (feature_dim, test_rows) = out.features(spec, &split)?;

    // Rows per client and the order of each training.
    let rows: Vec<&Vec<usize>> = split.clients.iter().map(|c| &c.tasks[0].train).collect();
    out.rows_and_order(&rows)?;

    // The initial model and the engine's sampling, from the simulator's own set-up.
    let setup = Setup::new(config, Charge::Report)?;
    let invited = out.selection(&setup)?;
    let blocks = out.initial_model(&setup)?;
    let job = Job {
        feature_dim,
        num_classes: setup.num_classes,
        invited,
        train_samples: rows.iter().map(|r| r.len()).collect(),
        test_rows,
    };
    out.meta(spec, &job, blocks)?;
    Ok(Exported {
        dir: dir.to_path_buf(),
        files: out.files,
        clients: config.federation.clients,
        train_rows: rows.iter().map(|r| r.len()).sum(),
        test_rows,
        feature_dim,
    })
}

/// The scenario's `[data]` table, once `config` is one that [`export`] covers (FedAvg or FedProx,
/// no evolving shift).
fn exportable(config: &SimConfig) -> anyhow::Result<&DataSpec> {
    let spec = config.data.spec.as_ref().context("export needs a scenario with a [data] table")?;
    anyhow::ensure!(
        matches!(config.method, MethodConfig::FedAvg(_) | MethodConfig::FedProx(_)),
        "export repeats FedAvg's batch order; the method is `{}`",
        config.method.name()
    );
    anyhow::ensure!(!config.data.evolving, "export covers class-incremental streams, not evolving shifts");
    Ok(spec)
}

/// Labels as NumPy's int64.
fn labels(l: &[u32]) -> Vec<i64> {
    l.iter().map(|&v| v as i64).collect()
}

/// What `meta.json` says of the job besides the configuration.
struct Job {
    feature_dim: usize,
    num_classes: usize,
    /// Clients invited each round.
    invited: usize,
    /// Each client's training rows.
    train_samples: Vec<usize>,
    test_rows: usize,
}

/// An export under way: the job, its folder, and the files written so far.
struct Export<'a> {
    config: &'a SimConfig,
    dir: &'a Path,
    files: Vec<PathBuf>,
}

impl Export<'_> {
    /// Writes `name` (a path in the folder) as a .npy file of `shape`.
    fn npy<T: NpyElement>(&mut self, name: &str, shape: &[usize], values: &[T]) -> anyhow::Result<()> {
        self.files.push(write_npy(&self.dir.join(name), shape, values)?);
        Ok(())
    }

    /// The same split as the simulator's set-up (`setup.rs`), checked to have the federation's
    /// clients and one task.
    fn split(&self, spec: &DataSpec) -> anyhow::Result<FederatedSplit> {
        let data_dir = self.config.data.data_dir.as_deref();
        let pools = anchorage_data::label_pools(spec, data_dir).context("reading the scenario's labels")?;
        let split = anchorage_data::build_split(spec, &pools).context("partitioning the scenario's data")?;
        anyhow::ensure!(
            split.num_clients() == self.config.federation.clients,
            "the data split has {} clients, the federation {}",
            split.num_clients(),
            self.config.federation.clients
        );
        let tasks = split.clients.iter().map(|c| c.tasks.len()).max().unwrap_or(0);
        anyhow::ensure!(tasks == 1, "export covers one-task scenarios (this one has {tasks})");
        Ok(split)
    }

    /// Loads the data and the frozen backbone, and writes the features and labels of the
    /// training pool and of the global test set; returns the feature width and the test rows.
    fn features(&mut self, spec: &DataSpec, split: &FederatedSplit) -> anyhow::Result<(usize, usize)> {
        let data_dir = self.config.data.data_dir.as_deref();
        let loaded = anchorage_data::load(spec, data_dir).context("loading the scenario's data")?;
        let device = Device::flex();
        let backbone = zoo::load(&self.config.model.backbone, loaded.train.sample_len(), data_dir, &device)
            .context("building the frozen backbone")?;
        let train = FeatureCache::build(backbone.as_ref(), &loaded.train, 256, &device);
        let feature_dim = backbone.feature_dim();
        self.npy("x_train.npy", &[train.len(), feature_dim], &feature_values(&train)?)?;
        self.npy("y_train.npy", &[train.len()], &labels(&train.labels_host))?;
        drop(train);
        let test_rows = self.test_set(backbone.as_ref(), split, loaded, &device)?;
        Ok((feature_dim, test_rows))
    }

    /// Writes the global test set, the union of the clients' test rows of the task (as in
    /// setup.rs), through `backbone`; returns its rows.
    fn test_set(
        &mut self,
        backbone: &(dyn Backbone + Send + Sync),
        split: &FederatedSplit,
        loaded: LoadedData,
        device: &Device,
    ) -> anyhow::Result<usize> {
        let in_train = split.clients.iter().any(|c| c.tasks[0].test.is_empty());
        let mut test_rows: Vec<usize> = split
            .clients
            .iter()
            .flat_map(|c| if in_train { c.tasks[0].local_test.clone() } else { c.tasks[0].test.to_vec() })
            .collect();
        test_rows.sort_unstable();
        test_rows.dedup();
        let test_pool = if in_train { loaded.train.subset(&test_rows) } else { loaded.test.subset(&test_rows) };
        let test = FeatureCache::build(backbone, &test_pool, 256, device);
        let feature_dim = backbone.feature_dim();
        self.npy("x_test.npy", &[test.len(), feature_dim], &feature_values(&test)?)?;
        self.npy("y_test.npy", &[test.len()], &labels(&test.labels_host))?;
        let test_len = test.len();
        drop((test, test_pool, loaded));
        Ok(test_len)
    }

    /// Writes each client's training rows and the order its trainings visit them in (the FedAvg
    /// client's shuffles).
    fn rows_and_order(&mut self, rows: &[&Vec<usize>]) -> anyhow::Result<()> {
        let config = self.config;
        let clients = config.federation.clients;
        let n_max = rows.iter().map(|r| r.len()).max().unwrap_or(0);
        let rounds = config.federation.rounds as usize;
        let epochs = config.federation.local_epochs as usize;
        let mut train_rows = vec![-1i64; clients * n_max];
        let mut order = vec![-1i64; clients * rounds * epochs * n_max];
        for (i, r) in rows.iter().enumerate() {
            for (j, &row) in r.iter().enumerate() {
                train_rows[i * n_max + j] = row as i64;
            }
            let mut rng = Rng::derive(config.federation.seed.wrapping_add(i as u64), 0xBA5E);
            for k in 0..rounds {
                for e in 0..epochs {
                    let mut perm: Vec<i64> = (0..r.len() as i64).collect();
                    rng.shuffle(&mut perm);
                    let at = ((i * rounds + k) * epochs + e) * n_max;
                    for (j, &p) in perm.iter().enumerate() {
                        order[at + j] = r[p as usize] as i64;
                    }
                }
            }
        }
        self.npy("train_rows.npy", &[clients, n_max], &train_rows)?;
        self.npy("batch_order.npy", &[clients, rounds, epochs * n_max], &order)
    }

    /// Writes the clients the engine invites in each round; returns how many a round.
    fn selection(&mut self, setup: &Setup) -> anyhow::Result<usize> {
        let config = self.config;
        let (clients, rounds) = (config.federation.clients, config.federation.rounds as usize);
        let mut ids: Vec<(String, usize)> = (0..clients).map(|i| (client_id(i), i)).collect();
        ids.sort();
        let target = setup.engine.sample_size(clients);
        let invited = setup.engine.invited(target, clients);
        let mut selection = Vec::with_capacity(rounds * invited);
        for r in 1..=rounds as u64 {
            let mut picked: Vec<i64> = Rng::derive(config.federation.seed, r - 1)
                .sample_indices(clients, invited)
                .into_iter()
                .map(|k| ids[k].1 as i64)
                .collect();
            picked.sort_unstable();
            selection.extend(picked);
        }
        self.npy("selection.npy", &[rounds, invited], &selection)?;
        Ok(invited)
    }

    /// Writes the initial global model, a file per block in `init/`; returns the block list for
    /// `meta.json`.
    fn initial_model(&mut self, setup: &Setup) -> anyhow::Result<Vec<serde_json::Value>> {
        let mut blocks = Vec::new();
        for block in &setup.initial {
            let values = block.decode().with_context(|| format!("decoding block {}", block.name))?;
            let shape: Vec<usize> = block.tensor.shape.iter().map(|&d| d as usize).collect();
            let file = format!("init/{}.npy", block.name);
            self.npy(&file, &shape, &values)?;
            blocks.push(json!({ "name": block.name, "shape": shape, "file": file }));
        }
        Ok(blocks)
    }

    /// Writes `meta.json`: the job, the optimizer's constants, the model and the block list.
    fn meta(&mut self, spec: &DataSpec, job: &Job, blocks: Vec<serde_json::Value>) -> anyhow::Result<()> {
        let config = self.config;
        let meta = json!({
            "clients": config.federation.clients,
            "rounds": config.federation.rounds as usize,
            "fraction": config.federation.fraction,
            "sampled_per_round": job.invited,
            "local_epochs": config.federation.local_epochs as usize,
            "batch_size": config.federation.batch_size,
            "learning_rate": config.federation.learning_rate,
            "optimizer": { "name": "adam", "beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-5, "weight_decay": 0.0 },
            "loss": "cross-entropy, mean over the batch",
            "model": {
                "backbone": config.model.backbone,
                "hidden": config.model.hidden,
                "activation": if config.model.residual { "relu after every hidden layer but the last; representation = features + adapter(features)" } else { "relu after every hidden layer" },
                "layout": "a linear layer's weight is [fan_in, fan_out]: y = x W + b",
            },
            "feature_dim": job.feature_dim,
            "num_classes": job.num_classes,
            "train_samples": job.train_samples,
            "test_samples": job.test_rows,
            "seed": config.federation.seed,
            "blocks": blocks,
            "data": spec,
        });
        let meta_path = self.dir.join("meta.json");
        std::fs::write(&meta_path, serde_json::to_string_pretty(&meta)?)
            .with_context(|| format!("writing {}", meta_path.display()))?;
        self.files.push(meta_path);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_header_is_aligned_and_numpy_shaped() {
        let bytes = npy_bytes(&[2, 3], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
        let len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!((10 + len) % 64, 0);
        let header = std::str::from_utf8(&bytes[10..10 + len]).unwrap();
        assert!(header.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }"), "{header}");
        assert!(header.ends_with('\n'));
        assert_eq!(bytes.len(), 10 + len + 24);
        assert_eq!(&bytes[10 + len..10 + len + 4], &1.0f32.to_le_bytes());
        let one = npy_bytes(&[3], &[7i64, 8, 9]).unwrap();
        let len = u16::from_le_bytes([one[8], one[9]]) as usize;
        assert!(std::str::from_utf8(&one[10..10 + len]).unwrap().contains("'shape': (3,)"));
        assert!(npy_bytes(&[2, 2], &[1i64]).is_err());
    }

    /// The header's shape and the values of an i64 .npy file written by [`npy_bytes`].
    fn read_i64(path: &Path) -> (String, Vec<i64>) {
        let bytes = std::fs::read(path).unwrap();
        let len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        let header = std::str::from_utf8(&bytes[10..10 + len]).unwrap();
        let shape = header.split("'shape': ").nth(1).unwrap().split(')').next().unwrap().to_string() + ")";
        let values = bytes[10 + len..].chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
        (shape, values)
    }

    #[test]
    fn a_synthetic_job_exports_rows_orders_selection_and_weights() {
        let config: SimConfig = toml::from_str(
            r#"
            clients = 3
            rounds = 2
            fraction = 0.5
            local_epochs = 1
            [method]
            name = "fedavg"
            [model]
            backbone = "identity"
            hidden = [16]
            [data]
            dataset = "synthetic"
            seed = 1
            [data.partition]
            kind = "iid"
            clients = 3
            [data.synthetic]
            classes = 10
            side = 4
            train_per_class = 6
            test_per_class = 2
            "#,
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let done = export(&config, dir.path()).unwrap();
        assert_eq!((done.clients, done.train_rows, done.test_rows, done.feature_dim), (3, 60, 20, 16));
        let (shape, rows) = read_i64(&dir.path().join("train_rows.npy"));
        assert_eq!(shape, "(3, 20)");
        let (shape, order) = read_i64(&dir.path().join("batch_order.npy"));
        assert_eq!(shape, "(3, 2, 20)");
        for c in 0..3 {
            let mine: Vec<i64> = rows[c * 20..(c + 1) * 20].to_vec();
            for k in 0..2 {
                let mut visit = order[(c * 2 + k) * 20..(c * 2 + k + 1) * 20].to_vec();
                visit.sort_unstable();
                assert_eq!(visit, mine, "client {c}, training {k}: a permutation of its rows");
            }
        }
        // ⌈0.5 · 3⌉ = 2 distinct clients a round.
        let (shape, selection) = read_i64(&dir.path().join("selection.npy"));
        assert_eq!(shape, "(2, 2)");
        assert!(selection.chunks(2).all(|r| r[0] < r[1] && r[1] < 3));
        for block in ["adapter.0.weight", "adapter.0.bias", "head.weight", "head.bias"] {
            assert!(dir.path().join(format!("init/{block}.npy")).is_file(), "{block}");
        }
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join("meta.json")).unwrap()).unwrap();
        assert_eq!(meta["sampled_per_round"], 2);
        assert_eq!(meta["blocks"][0]["shape"], json!([16, 16]));
    }
}
