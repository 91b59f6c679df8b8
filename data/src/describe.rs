//! `anchorage data describe`: per client and task, the class histogram, sample counts, measured
//! imbalance factor and label-skew statistics of a spec's partition — as a table and as CSV.

use std::fmt;
use std::path::Path;

use serde::Serialize;

use crate::DataError;
use crate::partition::{FederatedSplit, imbalance_factor};
use crate::spec::{DataSpec, FilesChecked, build_split, check_files, label_pools};

/// One client's task.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskRow {
    pub client: usize,
    pub task: usize,
    /// The task's classes, in the order the client meets them.
    pub classes: Vec<u32>,
    /// Training samples per class (all classes).
    pub histogram: Vec<u64>,
    pub train: usize,
    pub local_test: usize,
    pub test: usize,
    /// Classes with at least one training sample.
    pub classes_present: usize,
    /// Largest over smallest non-zero class count of the training samples.
    pub imbalance_factor: f64,
    /// Largest class's share of the training samples.
    pub max_class_share: f64,
    /// Shannon entropy of the training label distribution, in bits.
    pub entropy_bits: f64,
}

/// Over all clients and tasks.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub clients: usize,
    pub tasks: usize,
    pub train_samples: usize,
    pub local_test_samples: usize,
    pub surrogate_samples: usize,
    /// Smallest and largest client (training samples over all its tasks).
    pub min_client: usize,
    pub max_client: usize,
    /// Imbalance factor of all clients' training samples pooled.
    pub pooled_imbalance_factor: f64,
    /// Means over client-tasks with samples.
    pub mean_max_class_share: f64,
    pub mean_entropy_bits: f64,
    pub mean_classes_present: f64,
}

/// The description of a spec's partition.
#[derive(Debug, Clone, PartialEq)]
pub struct Description {
    pub dataset: String,
    pub source: String,
    pub num_classes: u32,
    pub train_pool: usize,
    pub test_pool: usize,
    pub scale: f64,
    pub seed: u64,
    pub partition: String,
    pub fingerprint: u64,
    /// The image files read and decoded as `anchorage sim` loads them ([`check_files`]); `None`
    /// for generated sets and stand-in labels.
    pub files: Option<FilesChecked>,
    pub rows: Vec<TaskRow>,
    pub summary: Summary,
}

fn stats(hist: &[u64]) -> (usize, f64, f64, f64) {
    let n: u64 = hist.iter().sum();
    if n == 0 {
        return (0, 1.0, 0.0, 0.0);
    }
    let present = hist.iter().filter(|&&c| c > 0).count();
    let max_share = *hist.iter().max().unwrap_or(&0) as f64 / n as f64;
    let entropy = hist
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / n as f64;
            -p * p.log2()
        })
        .sum();
    (present, imbalance_factor(hist), max_share, entropy)
}

/// Describes a split over training labels `train_labels`.
pub fn describe_split(split: &FederatedSplit, train_labels: &[u32], num_classes: u32) -> (Vec<TaskRow>, Summary) {
    let mut rows = Vec::new();
    let mut pooled = vec![0u64; num_classes as usize];
    let mut client_sizes = Vec::new();
    for (ci, c) in split.clients.iter().enumerate() {
        let mut size = 0;
        for (ti, t) in c.tasks.iter().enumerate() {
            let mut histogram = vec![0u64; num_classes as usize];
            for &i in &t.train {
                if let Some(h) = train_labels.get(i).and_then(|&l| histogram.get_mut(l as usize)) {
                    *h += 1;
                }
            }
            pooled.iter_mut().zip(&histogram).for_each(|(p, h)| *p += h);
            let (classes_present, imbalance_factor, max_class_share, entropy_bits) = stats(&histogram);
            size += t.train.len();
            rows.push(TaskRow {
                client: ci,
                task: ti,
                classes: t.classes.clone(),
                histogram,
                train: t.train.len(),
                local_test: t.local_test.len(),
                test: t.test.len(),
                classes_present,
                imbalance_factor,
                max_class_share,
                entropy_bits,
            });
        }
        client_sizes.push(size);
    }
    let nonempty: Vec<&TaskRow> = rows.iter().filter(|r| r.train > 0).collect();
    let mean = |f: &dyn Fn(&TaskRow) -> f64| {
        if nonempty.is_empty() { 0.0 } else { nonempty.iter().map(|r| f(r)).sum::<f64>() / nonempty.len() as f64 }
    };
    let summary = Summary {
        clients: split.num_clients(),
        tasks: split.num_tasks(),
        train_samples: rows.iter().map(|r| r.train).sum(),
        local_test_samples: rows.iter().map(|r| r.local_test).sum(),
        surrogate_samples: split.surrogate.len(),
        min_client: client_sizes.iter().copied().min().unwrap_or(0),
        max_client: client_sizes.iter().copied().max().unwrap_or(0),
        pooled_imbalance_factor: imbalance_factor(&pooled),
        mean_max_class_share: mean(&|r| r.max_class_share),
        mean_entropy_bits: mean(&|r| r.entropy_bits),
        mean_classes_present: mean(&|r| r.classes_present as f64),
    };
    (rows, summary)
}

/// Builds the partition of `spec` (files under `data_dir`, or generated / stand-in labels when
/// `None`) and describes it. With files, every image is also read and decoded by the loader
/// `anchorage sim` uses ([`check_files`]), so a truncated or corrupt file is an error here
/// naming the file, not later in a run.
pub fn describe(spec: &DataSpec, data_dir: Option<&Path>) -> Result<Description, DataError> {
    let pools = label_pools(spec, data_dir)?;
    let files = check_files(spec, &pools, data_dir)?;
    let split = build_split(spec, &pools)?;
    let (rows, summary) = describe_split(&split, &pools.train, pools.num_classes);
    let partition = serde_kind(&spec.partition);
    Ok(Description {
        dataset: spec.dataset.name().to_string(),
        source: pools.source,
        num_classes: pools.num_classes,
        train_pool: pools.train.len(),
        test_pool: pools.test.len(),
        scale: spec.scale,
        seed: spec.seed,
        partition,
        fingerprint: split.fingerprint(),
        files,
        rows,
        summary,
    })
}

fn serde_kind(p: &crate::spec::PartitionSpec) -> String {
    use crate::spec::PartitionSpec::*;
    match p {
        Iid { .. } => "iid",
        Dirichlet { .. } => "dirichlet",
        QuantitySkew { .. } => "quantity-skew",
        LongTail { .. } => "long-tail",
        Gldp(_) => "gldp",
        Fedta(_) => "fedta",
        FedprokSync(_) => "fedprok-sync",
        FedprokAsync(_) => "fedprok-async",
        Domains { .. } => "domains",
    }
    .to_string()
}

fn join<T: fmt::Display>(v: impl IntoIterator<Item = T>) -> String {
    v.into_iter().map(|x| x.to_string()).collect::<Vec<_>>().join(" ")
}

fn hist_pairs(h: &[u64]) -> String {
    join(h.iter().enumerate().filter(|(_, n)| **n > 0).map(|(c, n)| format!("{c}:{n}")))
}

/// A row of the CSV: the header is the field names.
#[derive(Serialize)]
struct CsvRow {
    client: usize,
    task: usize,
    train: usize,
    local_test: usize,
    test: usize,
    classes_present: usize,
    imbalance_factor: f64,
    max_class_share: f64,
    entropy_bits: f64,
    classes: String,
    histogram: String,
}

/// Four decimals, as the table shows.
fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

impl Description {
    /// Writes one row per client-task under the header `client,task,train,local_test,test,
    /// classes_present,imbalance_factor,max_class_share,entropy_bits,classes,histogram` (ratios to
    /// four decimals, classes space-separated, histogram as space-separated `class:count` of the
    /// non-zero classes), quoted as RFC 4180 wants.
    pub fn write_csv<W: std::io::Write>(&self, out: W) -> Result<(), csv::Error> {
        let mut w = csv::Writer::from_writer(out);
        for r in &self.rows {
            w.serialize(CsvRow {
                client: r.client,
                task: r.task,
                train: r.train,
                local_test: r.local_test,
                test: r.test,
                classes_present: r.classes_present,
                imbalance_factor: round4(r.imbalance_factor),
                max_class_share: round4(r.max_class_share),
                entropy_bits: round4(r.entropy_bits),
                classes: join(&r.classes),
                histogram: hist_pairs(&r.histogram),
            })?;
        }
        w.flush()?;
        Ok(())
    }

    /// [`Description::write_csv`] into a string.
    pub fn to_csv(&self) -> String {
        let mut out = Vec::new();
        self.write_csv(&mut out).expect("writing CSV to memory");
        String::from_utf8(out).expect("the CSV of numbers is UTF-8")
    }
}

impl fmt::Display for Description {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.summary;
        writeln!(
            f,
            "dataset    {} ({} classes), scale {}, seed {}",
            self.dataset, self.num_classes, self.scale, self.seed
        )?;
        writeln!(f, "source     {}", self.source)?;
        writeln!(f, "pools      {} train, {} test", self.train_pool, self.test_pool)?;
        if let Some(c) = &self.files {
            let shape = c.sample_shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("×");
            writeln!(
                f,
                "files      {} train + {} test images ({shape}) read and decoded; labels match",
                c.train, c.test
            )?;
        }
        writeln!(
            f,
            "partition  {} — {} clients × {} tasks, fingerprint {:016x}",
            self.partition, s.clients, s.tasks, self.fingerprint
        )?;
        writeln!(
            f,
            "samples    {} train, {} local test, {} surrogate; client sizes {}..{}",
            s.train_samples, s.local_test_samples, s.surrogate_samples, s.min_client, s.max_client
        )?;
        writeln!(
            f,
            "skew       pooled IF {:.2}, mean max class share {:.3}, mean entropy {:.3} bits, mean classes present {:.1}",
            s.pooled_imbalance_factor, s.mean_max_class_share, s.mean_entropy_bits, s.mean_classes_present
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "{:>6} {:>4} {:>7} {:>6} {:>6} {:>4} {:>8} {:>6} {:>6}  histogram (class:count)",
            "client", "task", "train", "l.test", "test", "cls", "IF", "max", "H bits"
        )?;
        for r in &self.rows {
            let mut h = hist_pairs(&r.histogram);
            if h.len() > 72 {
                let cut = h[..72].rfind(' ').unwrap_or(72);
                h.truncate(cut);
                h.push_str(" …");
            }
            writeln!(
                f,
                "{:>6} {:>4} {:>7} {:>6} {:>6} {:>4} {:>8.2} {:>6.3} {:>6.3}  {}",
                r.client,
                r.task,
                r.train,
                r.local_test,
                r.test,
                r.classes_present,
                r.imbalance_factor,
                r.max_class_share,
                r.entropy_bits,
                h
            )?;
        }
        Ok(())
    }
}
