//! Errors of data loading and partitioning.

/// What is wrong with a dataset or a partition request.
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
}
