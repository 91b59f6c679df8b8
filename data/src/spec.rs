//! The `[data]` table of a scenario: which dataset, how much of it (`scale`), which partition, which
//! seed — and how to turn it into label pools, a [`FederatedSplit`] and loaded data.
//!
//! ```toml
//! [data]
//! dataset = "cifar10"        # synthetic | mnist | cifar10 | cifar100 | tiny-imagenet-100 | circle
//! scale = 0.1                # fraction of the samples of every class (train and test), seeded
//! seed = 1
//! [data.partition]
//! kind = "gldp"              # iid | dirichlet | quantity-skew | long-tail | gldp | fedta
//! clients = 20               #   | fedprok-sync | fedprok-async | domains
//! classes_per_client = 4
//! stages = 2
//! imbalance = 10.0
//! ```
//!
//! Real files are looked up under a data directory (`--data-dir` / `ANCHORAGE_DATA`): MNIST idx in
//! `<dir>/mnist/`, CIFAR-10 binaries in `<dir>/cifar10/cifar-10-batches-bin/` or else the JPEG tree
//! `<dir>/cifar10/cifar10-jpg.tar.gz`, CIFAR-100 binaries in `<dir>/cifar100/cifar-100-binary/`,
//! Tiny-ImageNet-100 as `<dir>/tiny-imagenet-100.tar.gz` or `<dir>/tiny-imagenet-100/`. Without a
//! data directory, [`label_pools`] uses stand-in labels with the official per-class counts (and
//! says so in [`LabelPools::source`]), so a partition can be described without the files.

use std::path::{Path, PathBuf};

use anchorage_shared::rng::Rng;
use serde::{Deserialize, Serialize};

use crate::circle::{CircleConfig, CircleKind};
use crate::loaders::cifar::{self, CifarKind};
use crate::loaders::image_folder::{self, ImageFolderOptions};
use crate::loaders::{Split, mnist, tiny_imagenet};
use crate::partition::{
    self, FederatedSplit, FedprokAsyncConfig, FedprokSyncConfig, FedtaConfig, GldpConfig, class_incremental,
    domain_incremental,
};
use crate::{DataError, Dataset, ImageSet, SyntheticConfig, domain, synthetic};

/// Which dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DatasetKind {
    #[serde(rename = "synthetic")]
    Synthetic,
    #[serde(rename = "mnist")]
    Mnist,
    #[serde(rename = "cifar10")]
    Cifar10,
    #[serde(rename = "cifar100")]
    Cifar100,
    #[serde(rename = "tiny-imagenet-100")]
    TinyImagenet100,
    #[serde(rename = "circle")]
    Circle,
}

impl DatasetKind {
    pub fn name(self) -> &'static str {
        match self {
            DatasetKind::Synthetic => "synthetic",
            DatasetKind::Mnist => "mnist",
            DatasetKind::Cifar10 => "cifar10",
            DatasetKind::Cifar100 => "cifar100",
            DatasetKind::TinyImagenet100 => "tiny-imagenet-100",
            DatasetKind::Circle => "circle",
        }
    }
}

/// How the data is split over clients and tasks (`kind = "…"` in TOML).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum PartitionSpec {
    /// IID shares, optionally cut into class-incremental tasks.
    Iid {
        clients: usize,
        #[serde(default = "one")]
        tasks: usize,
    },
    /// Dirichlet(α) label skew, optionally cut into class-incremental tasks.
    Dirichlet {
        clients: usize,
        alpha: f64,
        #[serde(default = "one")]
        tasks: usize,
        #[serde(default)]
        min_per_client: usize,
    },
    /// Dirichlet(β) amounts of IID samples.
    QuantitySkew {
        clients: usize,
        beta: f64,
        #[serde(default = "one")]
        tasks: usize,
        #[serde(default)]
        min_per_client: usize,
    },
    /// Long tail with imbalance factor IF, then IID (or Dirichlet(α) if given) over clients.
    LongTail {
        clients: usize,
        imbalance: f64,
        #[serde(default)]
        alpha: Option<f64>,
        #[serde(default = "one")]
        tasks: usize,
    },
    /// GLDP's [N, S, M] on a long tail.
    Gldp(GldpConfig),
    /// FedTA's private + public classes.
    Fedta(FedtaConfig),
    /// FedProK synchronous FCIL.
    FedprokSync(FedprokSyncConfig),
    /// FedProK asynchronous FCIL with consensus rate γ.
    FedprokAsync(FedprokAsyncConfig),
    /// Domain-incremental: one task per domain (Circle's domains, or drifts of the base set on
    /// disjoint parts of it: domain k rotated by `k · step_degrees` and darkened by
    /// `k · darken_step`).
    Domains {
        clients: usize,
        /// Number of domains (Circle: its own count, 30 by default).
        #[serde(default)]
        domains: Option<usize>,
        #[serde(default)]
        step_degrees: f32,
        /// A brightness drift: domain k's pixels are scaled by `1 − k · darken_step`,
        /// so `darken_step · (domains − 1)` must stay below 1.
        #[serde(default)]
        darken_step: f32,
        #[serde(default = "one_f")]
        train_fraction: f64,
    },
}

fn one() -> usize {
    1
}

fn one_f() -> f64 {
    1.0
}

/// The synthetic set's size knobs (the rest is [`SyntheticConfig::default`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyntheticSpec {
    pub classes: u32,
    pub side: usize,
    pub train_per_class: usize,
    pub test_per_class: usize,
}

impl Default for SyntheticSpec {
    fn default() -> Self {
        let d = SyntheticConfig::default();
        Self {
            classes: d.num_classes,
            side: d.side,
            train_per_class: d.train_per_class,
            test_per_class: d.test_per_class,
        }
    }
}

/// The `[data]` table of a scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSpec {
    pub dataset: DatasetKind,
    /// Fraction of every class's training samples kept, seeded; 1 = full scale.
    #[serde(default = "one_f")]
    pub scale: f64,
    /// Fraction of every class's test samples kept, seeded; none = the whole test set, whatever
    /// `scale` is (a quick run at a small training scale is still measured on the full test set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub test_scale: Option<f64>,
    #[serde(default)]
    pub seed: u64,
    pub partition: PartitionSpec,
    /// Sizes of the synthetic set (dataset = "synthetic").
    #[serde(default)]
    pub synthetic: Option<SyntheticSpec>,
    /// Circle knobs (dataset = "circle"): `circle = "fixed" | "cida" | "concept"` for a kind's
    /// defaults, or a `[data.circle]` table (its `kind` picks the defaults it overrides); the seed
    /// is the spec's.
    #[serde(default, deserialize_with = "crate::circle::deserialize_circle")]
    pub circle: Option<CircleConfig>,
    /// The task advances every this many rounds (FedProK's R); informative for the simulator.
    #[serde(default)]
    pub rounds_per_task: Option<u64>,
    /// Fraction of every class's (scaled) training samples held out as the validation split,
    /// seeded: no client trains on them, whichever split the run is evaluated on. 0:
    /// none. Evolving shifts (a `domains` partition) validate on the last source domain's
    /// held-out rows instead and take no fraction.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub validation: f64,
    /// What the run is evaluated on: the test split (the default) or the validation split, where
    /// choices (a hyperparameter, a variant) are made; never on the test or target data.
    #[serde(default, skip_serializing_if = "EvaluateOn::is_test")]
    pub evaluate_on: EvaluateOn,
}

/// Which held-out data a run is evaluated on ([`DataSpec::evaluate_on`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvaluateOn {
    #[default]
    Test,
    /// The validation split: held-out training samples (class-incremental), or the last source
    /// domain's held-out rows (evolving shifts).
    Validation,
}

impl EvaluateOn {
    fn is_test(&self) -> bool {
        *self == EvaluateOn::Test
    }
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

/// Labels of the training and test pools (after `scale`), and where they came from.
#[derive(Debug, Clone, PartialEq)]
pub struct LabelPools {
    pub dataset: DatasetKind,
    pub num_classes: u32,
    pub train: Vec<u32>,
    pub test: Vec<u32>,
    /// Domain of every training sample (Circle; rotation domains are assigned by the partition).
    pub domain_of: Option<Vec<u32>>,
    /// Indices kept by `scale` in the full training / test pools (ascending).
    pub train_kept: Vec<usize>,
    pub test_kept: Vec<usize>,
    /// The "test" pool is the validation split, rows of the training files (`test_kept` indexes
    /// the full training pool): [`EvaluateOn::Validation`].
    pub test_in_train: bool,
    /// Human-readable origin: which files, or which stand-in.
    pub source: String,
}

/// MNIST per-class counts (train, test) of the official files.
pub const MNIST_CLASS_COUNTS: ([usize; 10], [usize; 10]) = (
    [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949],
    [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009],
);

fn stand_in(counts: &[usize]) -> Vec<u32> {
    let mut v = Vec::with_capacity(counts.iter().sum());
    for (c, &n) in counts.iter().enumerate() {
        v.extend(std::iter::repeat_n(c as u32, n));
    }
    v
}

/// Keeps `round(scale · n_c)` (at least 1 of a non-empty class) of every class, seeded; sorted.
pub fn scale_indices(labels: &[u32], num_classes: u32, scale: f64, seed: u64) -> Result<Vec<usize>, DataError> {
    if !(scale.is_finite() && scale > 0.0 && scale <= 1.0) {
        return Err(DataError::Spec(format!("scale must be in (0, 1], got {scale}")));
    }
    if scale == 1.0 {
        return Ok((0..labels.len()).collect());
    }
    let mut by = vec![Vec::new(); num_classes as usize];
    for (i, &l) in labels.iter().enumerate() {
        by.get_mut(l as usize).ok_or(DataError::LabelOutOfRange { index: i, label: l, num_classes })?.push(i);
    }
    let mut rng = Rng::derive(seed, 0x5CA1E);
    let mut out = Vec::new();
    for mut idx in by {
        if idx.is_empty() {
            continue;
        }
        rng.shuffle(&mut idx);
        let k = ((idx.len() as f64 * scale).round() as usize).clamp(1, idx.len());
        out.extend_from_slice(&idx[..k]);
    }
    out.sort_unstable();
    Ok(out)
}

fn first_dir(candidates: &[PathBuf]) -> Option<PathBuf> {
    candidates.iter().find(|p| p.is_dir()).cloned()
}

/// Where a dataset's files are under `dir`.
enum Files {
    Mnist(PathBuf),
    CifarBin(PathBuf, CifarKind),
    Folder(PathBuf),
    Tiny(PathBuf),
}

fn locate(kind: DatasetKind, dir: &Path) -> Result<Files, DataError> {
    let not_found = |what: &str, candidates: Vec<String>| DataError::NotFound {
        dir: dir.to_path_buf(),
        what: what.to_string(),
        candidates,
    };
    match kind {
        DatasetKind::Mnist => {
            let d = first_dir(&[dir.join("mnist")]).unwrap_or_else(|| dir.to_path_buf());
            Ok(Files::Mnist(d))
        }
        DatasetKind::Cifar10 => {
            for d in [dir.join("cifar10"), dir.to_path_buf()] {
                if d.join("cifar-10-batches-bin").is_dir() {
                    return Ok(Files::CifarBin(d, CifarKind::Cifar10));
                }
                if d.join("cifar10-jpg.tar.gz").is_file() {
                    return Ok(Files::Folder(d.join("cifar10-jpg.tar.gz")));
                }
            }
            Err(not_found(
                "CIFAR-10",
                vec!["cifar10/cifar-10-batches-bin/".into(), "cifar10/cifar10-jpg.tar.gz".into()],
            ))
        }
        DatasetKind::Cifar100 => {
            for d in [dir.join("cifar100"), dir.to_path_buf()] {
                if d.join("cifar-100-binary").is_dir() || d.join("train.bin").is_file() {
                    return Ok(Files::CifarBin(d, CifarKind::Cifar100Fine));
                }
            }
            Err(not_found("CIFAR-100", vec!["cifar100/cifar-100-binary/".into(), "cifar100/train.bin".into()]))
        }
        DatasetKind::TinyImagenet100 => {
            for p in [dir.join("tiny-imagenet-100.tar.gz"), dir.join("tiny-imagenet-100")] {
                if p.exists() {
                    return Ok(Files::Tiny(p));
                }
            }
            Err(not_found("Tiny-ImageNet-100", vec!["tiny-imagenet-100.tar.gz".into(), "tiny-imagenet-100/".into()]))
        }
        DatasetKind::Synthetic | DatasetKind::Circle => Err(DataError::Spec("generated sets have no files".into())),
    }
}

fn split_name(split: Split) -> &'static str {
    match split {
        Split::Train => "train",
        Split::Test => "test",
    }
}

fn file_labels(kind: DatasetKind, dir: &Path, split: Split) -> Result<(Vec<u32>, String), DataError> {
    Ok(match locate(kind, dir)? {
        Files::Mnist(d) => (mnist::load_labels(&d, split)?, format!("MNIST idx in {}", d.display())),
        Files::CifarBin(d, k) => (cifar::load_labels(&d, k, split)?, format!("CIFAR binaries in {}", d.display())),
        Files::Folder(p) => {
            let l = image_folder::list(&p, &ImageFolderOptions::split(split_name(split)))?;
            (l.labels, format!("image folder {}", p.display()))
        }
        Files::Tiny(p) => (tiny_imagenet::list(&p, split)?.labels, format!("Tiny-ImageNet-100 {}", p.display())),
    })
}

/// Every image of a split, read and decoded by its loader (the one [`load`] uses).
fn file_images(kind: DatasetKind, dir: &Path, split: Split) -> Result<ImageSet, DataError> {
    match locate(kind, dir)? {
        Files::Mnist(d) => mnist::load(&d, split),
        Files::CifarBin(d, k) => cifar::load(&d, k, split),
        Files::Folder(p) => image_folder::load(&p, &ImageFolderOptions::split(split_name(split))),
        Files::Tiny(p) => tiny_imagenet::load(&p, split),
    }
}

/// What [`check_files`] read: every image of both splits, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilesChecked {
    /// Images in the whole training and test splits (before `scale`).
    pub train: usize,
    pub test: usize,
    /// `[channels, height, width]` of the training images.
    pub sample_shape: Vec<usize>,
}

/// Reads and decodes every image of both splits of a file-backed spec with the loaders [`load`]
/// uses, so a file that `load` would refuse is refused here, with the same error naming the file
/// (a truncated or corrupt idx, record file, gzip or tar stream, an image that does not decode or
/// differs in size, images and labels of different counts). Then checks that every sample of
/// `pools` (from [`label_pools`] on the same spec and folder) is among the images, with the same
/// label. `Ok(None)` when there are no files to read: a generated set, or no data directory.
/// Costs what loading costs (about a second per split of CIFAR-10 or Tiny-ImageNet-100 on two
/// cores); the pixels are dropped split by split.
pub fn check_files(
    spec: &DataSpec,
    pools: &LabelPools,
    data_dir: Option<&Path>,
) -> Result<Option<FilesChecked>, DataError> {
    let Some(dir) = data_dir else { return Ok(None) };
    let kind = spec.dataset;
    if matches!(kind, DatasetKind::Synthetic | DatasetKind::Circle) {
        return Ok(None);
    }
    let read = |split: Split, kept: &[usize], labels: &[u32]| -> Result<(usize, Vec<usize>), DataError> {
        let images = file_images(kind, dir, split)?;
        for (&i, &label) in kept.iter().zip(labels) {
            match images.labels.get(i) {
                Some(&l) if l == label => {}
                found => {
                    return Err(DataError::Invalid(format!(
                        "{}: {} split: the labels read alone give sample {i} label {label}, the images {}",
                        pools.source,
                        split_name(split),
                        match found {
                            Some(l) => format!("label {l}"),
                            None => format!("only {} samples", images.len()),
                        }
                    )));
                }
            }
        }
        Ok((images.len(), images.sample_shape()))
    };
    let (train, sample_shape) = read(Split::Train, &pools.train_kept, &pools.train)?;
    let (test, _) = read(test_split(pools), &pools.test_kept, &pools.test)?;
    Ok(Some(FilesChecked { train, test, sample_shape }))
}

/// The files the pools' "test" rows come from: the test split, or the training split for a
/// validation run.
fn test_split(pools: &LabelPools) -> Split {
    if pools.test_in_train { Split::Train } else { Split::Test }
}

fn circle_config(spec: &DataSpec) -> CircleConfig {
    CircleConfig { seed: spec.seed, ..spec.circle.clone().unwrap_or_default() }
}

fn synthetic_config(spec: &DataSpec) -> SyntheticConfig {
    let s = spec.synthetic.clone().unwrap_or_default();
    SyntheticConfig {
        num_classes: s.classes,
        side: s.side,
        train_per_class: s.train_per_class,
        test_per_class: s.test_per_class,
        seed: spec.seed,
        ..SyntheticConfig::default()
    }
}

/// The label pools of a spec: from the files under `data_dir`, or — when it is `None` — from the
/// generated set (synthetic, circle) or stand-in labels with the official class counts.
pub fn label_pools(spec: &DataSpec, data_dir: Option<&Path>) -> Result<LabelPools, DataError> {
    let (num_classes, train, test, domain_of, source) = match (spec.dataset, data_dir) {
        (DatasetKind::Synthetic, _) => {
            let c = synthetic_config(spec);
            let train = (0..c.train_per_class).flat_map(|_| 0..c.num_classes).collect();
            let test = (0..c.test_per_class).flat_map(|_| 0..c.num_classes).collect();
            (c.num_classes, train, test, None, "generated synthetic set".to_string())
        }
        (DatasetKind::Circle, _) => {
            let c = circle_config(spec);
            let domains = crate::circle::generate(&c);
            let train: Vec<u32> = domains.iter().flat_map(|d| d.labels.iter().copied()).collect();
            let dom: Vec<u32> =
                domains.iter().enumerate().flat_map(|(k, d)| std::iter::repeat_n(k as u32, d.len())).collect();
            (
                2,
                train,
                Vec::new(),
                Some(dom),
                match c.kind {
                    CircleKind::Fixed => format!("generated Circle set, r = {}", c.boundary_radius),
                    CircleKind::Concept => "generated Circle set (concept drift, Pesaranghader & Viktor)".to_string(),
                    kind => format!("generated Circle set ({}), r = {}", kind.name(), c.boundary_radius),
                },
            )
        }
        (kind, Some(dir)) => {
            let (train, src) = file_labels(kind, dir, Split::Train)?;
            let (test, _) = file_labels(kind, dir, Split::Test)?;
            let classes = match kind {
                DatasetKind::Cifar100 | DatasetKind::TinyImagenet100 => 100,
                _ => 10,
            };
            (classes, train, test, None, src)
        }
        (kind, None) => {
            let (classes, train, test): (u32, Vec<usize>, Vec<usize>) = match kind {
                DatasetKind::Mnist => (10, MNIST_CLASS_COUNTS.0.to_vec(), MNIST_CLASS_COUNTS.1.to_vec()),
                DatasetKind::Cifar10 => (10, vec![5000; 10], vec![1000; 10]),
                DatasetKind::Cifar100 => (100, vec![500; 100], vec![100; 100]),
                _ => (100, vec![500; 100], vec![50; 100]),
            };
            let src = format!("stand-in labels with the official {} class counts (no data directory)", kind.name());
            (classes, stand_in(&train), stand_in(&test), None, src)
        }
    };
    let train_kept = scale_indices(&train, num_classes, spec.scale, spec.seed)?;
    let (train_kept, validation_kept) = hold_out(&train, train_kept, num_classes, spec)?;
    let evolving = matches!(spec.partition, PartitionSpec::Domains { .. });
    let test_in_train = spec.evaluate_on == EvaluateOn::Validation && !evolving;
    let (test, test_kept) = if test_in_train {
        (train.clone(), validation_kept)
    } else {
        let kept = scale_indices(&test, num_classes, spec.test_scale.unwrap_or(1.0), spec.seed ^ 0x7E57)?;
        (test, kept)
    };
    Ok(LabelPools {
        dataset: spec.dataset,
        num_classes,
        train: train_kept.iter().map(|&i| train[i]).collect(),
        test: test_kept.iter().map(|&i| test[i]).collect(),
        domain_of: domain_of.map(|d| train_kept.iter().map(|&i| d[i]).collect()),
        train_kept,
        test_kept,
        test_in_train,
        source,
    })
}

/// Splits the kept training rows into those clients train on and the validation split
/// ([`DataSpec::validation`] of every class, seeded, at least one of a class).
fn hold_out(
    train: &[u32],
    kept: Vec<usize>,
    num_classes: u32,
    spec: &DataSpec,
) -> Result<(Vec<usize>, Vec<usize>), DataError> {
    let evolving = matches!(spec.partition, PartitionSpec::Domains { .. });
    if spec.validation == 0.0 {
        if spec.evaluate_on == EvaluateOn::Validation && !evolving {
            return Err(DataError::Spec(
                "evaluate_on = \"validation\" needs a validation split: set [data] validation (e.g. 0.1)".into(),
            ));
        }
        return Ok((kept, Vec::new()));
    }
    if evolving {
        return Err(DataError::Spec(
            "a domains partition validates on the last source domain's held-out rows: leave [data] validation \
             out and set evaluate_on = \"validation\""
                .into(),
        ));
    }
    if !(spec.validation > 0.0 && spec.validation < 1.0) {
        return Err(DataError::Spec(format!("validation must be in [0, 1), got {}", spec.validation)));
    }
    let labels: Vec<u32> = kept.iter().map(|&i| train[i]).collect();
    let picked = scale_indices(&labels, num_classes, spec.validation, spec.seed ^ 0x7A11)?;
    let mut is_validation = vec![false; kept.len()];
    picked.iter().for_each(|&p| is_validation[p] = true);
    let validation = kept.iter().zip(&is_validation).filter(|(_, v)| **v).map(|(k, _)| *k).collect();
    let rest = kept.iter().zip(&is_validation).filter(|(_, v)| !**v).map(|(k, _)| *k).collect();
    Ok((rest, validation))
}

/// The number of domains of a `domains` partition on these pools.
fn domain_count(spec: &DataSpec, domains: Option<usize>) -> usize {
    match spec.dataset {
        DatasetKind::Circle => circle_config(spec).domains,
        _ => domains.unwrap_or(1),
    }
}

/// The domain of every training sample: Circle's own, or disjoint seeded parts of the pool.
fn domain_of(spec: &DataSpec, pools: &LabelPools, domains: Option<usize>) -> Vec<u32> {
    if let Some(d) = &pools.domain_of {
        return d.clone();
    }
    let mut out = vec![0u32; pools.train.len()];
    for (k, part) in
        domain::disjoint_parts(pools.train.len(), domain_count(spec, domains), spec.seed).iter().enumerate()
    {
        part.iter().for_each(|&i| out[i] = k as u32);
    }
    out
}

/// Builds the partition of a spec over its label pools (indices into the scaled pools).
pub fn build_split(spec: &DataSpec, pools: &LabelPools) -> Result<FederatedSplit, DataError> {
    let (train, test, c, seed) = (&pools.train, &pools.test, pools.num_classes, spec.seed);
    match &spec.partition {
        PartitionSpec::Iid { clients, tasks } => {
            class_incremental(&partition::iid(train.len(), *clients, seed), train, test, c, *tasks, seed)
        }
        PartitionSpec::Dirichlet { clients, alpha, tasks, min_per_client } => {
            let parts = partition::dirichlet(train, c, *clients, *alpha, *min_per_client, seed)?;
            class_incremental(&parts, train, test, c, *tasks, seed)
        }
        PartitionSpec::QuantitySkew { clients, beta, tasks, min_per_client } => {
            let parts = partition::quantity_skew(train.len(), *clients, *beta, *min_per_client, seed)?;
            class_incremental(&parts, train, test, c, *tasks, seed)
        }
        PartitionSpec::LongTail { clients, imbalance, alpha, tasks } => {
            let kept = partition::long_tail(train, c, *imbalance, seed)?;
            let sub: Vec<u32> = kept.iter().map(|&i| train[i]).collect();
            let parts = match alpha {
                Some(a) => partition::dirichlet(&sub, c, *clients, *a, 0, seed)?,
                None => partition::iid(sub.len(), *clients, seed),
            };
            let parts: Vec<Vec<usize>> = parts.iter().map(|p| p.iter().map(|&j| kept[j]).collect()).collect();
            class_incremental(&parts, train, test, c, *tasks, seed)
        }
        PartitionSpec::Gldp(cfg) => partition::gldp(train, test, c, cfg, seed),
        PartitionSpec::Fedta(cfg) => partition::fedta(train, test, c, cfg, seed),
        PartitionSpec::FedprokSync(cfg) => partition::fedprok_sync(train, test, c, cfg, seed),
        PartitionSpec::FedprokAsync(cfg) => partition::fedprok_async(train, test, c, cfg, seed),
        PartitionSpec::Domains { clients, domains, train_fraction, .. } => {
            let dom = domain_of(spec, pools, *domains);
            domain_incremental(&dom, train, domain_count(spec, *domains), c, *clients, *train_fraction, seed)
        }
    }
}

/// Loaded (scaled) data of a spec: f32 CHW in [0, 1] for images, 2-D points for Circle.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedData {
    pub train: Dataset,
    pub test: Dataset,
    /// Per-domain transform already applied to `train` (rotations), and each sample's domain.
    pub domain_of: Option<Vec<u32>>,
    pub source: String,
}

/// Loads the data of a spec (the same scaled pools as [`label_pools`]): real files need `data_dir`.
/// For a `domains` partition with `step_degrees`, sample i of domain k is rotated by `k · step`.
pub fn load(spec: &DataSpec, data_dir: Option<&Path>) -> Result<LoadedData, DataError> {
    load_inner(spec, data_dir, None)
}

/// [`load`], keeping only `train_rows` and `test_rows` of the scaled pools (in that order): row i
/// of the result's `train` is row `train_rows[i]` of [`load`]'s. A device that trains on its own
/// share of a split needs its rows only; image files are decoded whole, but only the kept rows
/// are converted to f32 samples. A row beyond its pool is an error.
pub fn load_rows(
    spec: &DataSpec,
    data_dir: Option<&Path>,
    train_rows: &[usize],
    test_rows: &[usize],
) -> Result<LoadedData, DataError> {
    load_inner(spec, data_dir, Some((train_rows, test_rows)))
}

/// The pools' rows (all, or `rows` of them) as samples, decoded from the dataset's files; the
/// "test" rows from the training files for a validation run.
fn read_files(
    kind: DatasetKind,
    data_dir: Option<&Path>,
    pools: &LabelPools,
    rows: Option<(&[usize], &[usize])>,
) -> Result<(Dataset, Dataset), DataError> {
    let dir = data_dir.ok_or_else(|| DataError::Spec(format!("{} needs a data directory", kind.name())))?;
    let tr = file_images(kind, dir, Split::Train)?;
    let test_files;
    let te = match pools.test_in_train {
        true => &tr,
        false => {
            test_files = file_images(kind, dir, Split::Test)?;
            &test_files
        }
    };
    let keep = |kept: &[usize], rows: Option<&[usize]>| -> Vec<usize> {
        match rows {
            Some(rows) => rows.iter().map(|&r| kept[r]).collect(),
            None => kept.to_vec(),
        }
    };
    Ok((
        tr.subset(&keep(&pools.train_kept, rows.map(|r| r.0))).to_dataset(),
        te.subset(&keep(&pools.test_kept, rows.map(|r| r.1))).to_dataset(),
    ))
}

fn load_inner(
    spec: &DataSpec,
    data_dir: Option<&Path>,
    rows: Option<(&[usize], &[usize])>,
) -> Result<LoadedData, DataError> {
    let pools = label_pools(spec, data_dir)?;
    if let Some((train_rows, test_rows)) = rows {
        let beyond = |rows: &[usize], n: usize| rows.iter().find(|&&r| r >= n).copied();
        if let Some(r) = beyond(train_rows, pools.train.len()).or(beyond(test_rows, pools.test.len())) {
            return Err(DataError::Spec(format!(
                "row {r} is beyond the scaled pools ({} / {} samples)",
                pools.train.len(),
                pools.test.len()
            )));
        }
        // Rotated domains and generated sets: load everything, then keep the rows.
        let generated = matches!(spec.dataset, DatasetKind::Synthetic | DatasetKind::Circle);
        if generated || matches!(spec.partition, PartitionSpec::Domains { .. }) {
            let all = load_inner(spec, data_dir, None)?;
            let domain_of = all.domain_of.map(|d| train_rows.iter().map(|&r| d[r]).collect());
            return Ok(LoadedData {
                train: all.train.subset(train_rows),
                test: all.test.subset(test_rows),
                domain_of,
                source: all.source,
            });
        }
    }
    let (train, test) = match spec.dataset {
        DatasetKind::Synthetic => synthetic::generate(&synthetic_config(spec)),
        DatasetKind::Circle => {
            let d = crate::circle::generate(&circle_config(spec));
            let mut all = Dataset { sample_shape: vec![2], num_classes: 2, features: Vec::new(), labels: Vec::new() };
            for x in d {
                all.features.extend(x.features);
                all.labels.extend(x.labels);
            }
            let empty = Dataset { features: Vec::new(), labels: Vec::new(), ..all.clone() };
            (all, empty)
        }
        kind => read_files(kind, data_dir, &pools, rows)?,
    };
    let (mut train, test) = match spec.dataset {
        DatasetKind::Synthetic | DatasetKind::Circle if pools.test_in_train => {
            let validation = train.subset(&pools.test_kept);
            (train.into_subset(&pools.train_kept), validation)
        }
        DatasetKind::Synthetic | DatasetKind::Circle => {
            (train.into_subset(&pools.train_kept), test.into_subset(&pools.test_kept))
        }
        _ => (train, test),
    };
    let mut domains = pools.domain_of.clone();
    if let PartitionSpec::Domains { domains: n, step_degrees, darken_step, .. } = &spec.partition {
        domains = Some(drift_domains(spec, &pools, *n, *step_degrees, *darken_step, &mut train)?);
    }
    Ok(LoadedData { train, test, domain_of: domains, source: pools.source })
}

/// The domain of every training sample of a `domains` partition, each domain drifted in place:
/// domain k rotated by `k · step_degrees`, then darkened to `1 − k · darken_step`.
fn drift_domains(
    spec: &DataSpec,
    pools: &LabelPools,
    n: Option<usize>,
    step_degrees: f32,
    darken_step: f32,
    train: &mut Dataset,
) -> Result<Vec<u32>, DataError> {
    let dom = domain_of(spec, pools, n);
    let count = domain_count(spec, n);
    if darken_step != 0.0 && train.sample_shape.len() < 2 {
        return Err(DataError::Spec(format!(
            "darken_step = {darken_step} darkens images; {} samples are not images",
            spec.dataset.name()
        )));
    }
    let darkest = darken_step * (count.max(1) - 1) as f32;
    if darken_step != 0.0 && !(darken_step > 0.0 && darkest <= 1.0 - 1e-6) {
        return Err(DataError::Spec(format!(
            "darken_step = {darken_step}: domain k is scaled by 1 − k·step, so step × (domains − 1) = {darkest} must \
             be in [0, 1)"
        )));
    }
    if step_degrees != 0.0 && train.sample_shape.len() >= 2 {
        let len = train.sample_len();
        for k in 0..count {
            let idx: Vec<usize> = (0..train.len()).filter(|&i| dom[i] == k as u32).collect();
            let rotated = crate::transform::rotate(&train.subset(&idx), k as f32 * step_degrees);
            for (j, &i) in idx.iter().enumerate() {
                train.features[i * len..(i + 1) * len].copy_from_slice(rotated.sample(j));
            }
        }
    }
    if darken_step != 0.0 {
        let len = train.sample_len();
        for (i, &k) in dom.iter().enumerate() {
            let factor = 1.0 - k as f32 * darken_step;
            train.features[i * len..(i + 1) * len].iter_mut().for_each(|v| *v *= factor);
        }
    }
    Ok(dom)
}
