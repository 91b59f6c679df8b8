//! Errors of data loading and partitioning.
//!
//! File errors always carry the path (and, inside an archive, the entry) and say what was expected,
//! so that a missing or corrupt file is diagnosed from the message alone. Underlying I/O and codec
//! errors are kept as text so that the enum stays `Clone + PartialEq`.

use std::path::PathBuf;

/// What is wrong with a dataset, a data file or a partition request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DataError {
    #[error("dataset has {features} feature values for {labels} labels of {sample_len} values each")]
    LengthMismatch { features: usize, labels: usize, sample_len: usize },
    #[error("label {label} at index {index} is not below the class count {num_classes}")]
    LabelOutOfRange { index: usize, label: u32, num_classes: u32 },
    #[error("feature value at index {0} is not finite")]
    NonFinite(usize),
    #[error("cannot give {num_clients} clients at least {min_per_client} samples each from {len} samples")]
    TooFewSamples { len: usize, num_clients: usize, min_per_client: usize },
    #[error(
        "no Dirichlet(α = {alpha}) draw in {attempts} attempts gave each of {num_clients} clients at least {min_per_client} samples; raise α or lower the minimum"
    )]
    MinPerClientUnmet { num_clients: usize, min_per_client: usize, alpha: f64, attempts: usize },
    #[error("invalid partition request: {0}")]
    Invalid(String),

    /// The file (or directory) could not be opened or read.
    #[error("{}: {message}", path.display())]
    Io { path: PathBuf, message: String },
    /// None of the candidate file names exists.
    #[error("{}: no {what} found (looked for {})", dir.display(), candidates.join(", "))]
    NotFound { dir: PathBuf, what: String, candidates: Vec<String> },
    /// A gzip stream is corrupt or truncated.
    #[error("{}: corrupt or truncated gzip stream: {message}", path.display())]
    Gzip { path: PathBuf, message: String },
    /// A tar archive is corrupt or truncated.
    #[error("{}: corrupt or truncated tar archive: {message}", path.display())]
    Tar { path: PathBuf, message: String },
    /// A header's magic number is not the expected one (MNIST idx).
    #[error("{}: magic number {found:#010x}, expected {expected:#010x} ({what})", path.display())]
    BadMagic { path: PathBuf, expected: u32, found: u32, what: &'static str },
    /// The file is shorter (or longer) than its header says.
    #[error("{}: {found} bytes, expected {expected} bytes ({what})", path.display())]
    BadLength { path: PathBuf, expected: u64, found: u64, what: String },
    /// A file of fixed-size records has a length that is not a whole number of records.
    #[error("{}: {len} bytes is not a whole number of {record_size}-byte records ({what})", path.display())]
    BadRecordSize { path: PathBuf, record_size: usize, len: u64, what: &'static str },
    /// A label in a file is not below the class count.
    #[error("{}: record {record} has label {label}, expected a label below {num_classes}", path.display())]
    BadLabel { path: PathBuf, record: usize, label: u32, num_classes: u32 },
    /// Images and labels disagree in count.
    #[error("{} has {images} images but {} has {labels} labels", images_path.display(), labels_path.display())]
    CountMismatch { images_path: PathBuf, images: usize, labels_path: PathBuf, labels: usize },
    /// An image inside a file or archive could not be decoded.
    #[error("{}: entry {entry}: cannot decode image: {message}", path.display())]
    Decode { path: PathBuf, entry: String, message: String },
    /// Images of one set differ in size and no resize was asked for.
    #[error("{}: entry {entry} is {found:?} (h, w), expected {expected:?} like the first image; set a resize", path.display())]
    ShapeMismatch { path: PathBuf, entry: String, expected: (usize, usize), found: (usize, usize) },
    /// An expected class folder is absent or empty.
    #[error("{}: class folder {class:?} is missing or has no images (expected {split}/<class>/*.jpg|png)", path.display())]
    MissingClassFolder { path: PathBuf, split: String, class: String },
    /// A class folder that the class list does not name.
    #[error("{}: class folder {class:?} is not in the class list", path.display())]
    UnknownClassFolder { path: PathBuf, class: String },
    /// No image at all under the expected split folder.
    #[error("{}: no images under {split}/<class>/ (expected {split}/<class>/*.jpg|jpeg|png)", path.display())]
    NoImages { path: PathBuf, split: String },
    /// A data spec that cannot be built.
    #[error("invalid data spec: {0}")]
    Spec(String),
}

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>, e: impl std::fmt::Display) -> Self {
        DataError::Io { path: path.into(), message: e.to_string() }
    }
}
