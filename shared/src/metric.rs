//! The names of the metrics a device reports with its update ([`Metric`]), typed. Protocol v1
//! carries them as strings; every crate writes them with [`MetricKey::name`] and reads them back
//! with [`MetricKey::parse`], so the client's methods, the server's round report and the
//! simulator's records agree by construction, not by a string written twice.

use alloc::format;
use alloc::string::{String, ToString};

use crate::protocol::Metric;

/// What a reported value measures.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MetricKey {
    /// Mean training loss of the round's local epochs (`train_loss`).
    TrainLoss,
    /// The local model's mean accuracy over what it evaluated (`local_accuracy`).
    LocalAccuracy,
    /// The local model's accuracy on task K's test data (`acc.task.K`).
    TaskAccuracy(u32),
    /// The local model's accuracy on task K's global test data of its own classes, GLDP's A^sel
    /// (`acc.sel.K`).
    SelectedAccuracy(u32),
    /// The local model's accuracy on the evolving shifts' target (`acc.target`).
    TargetAccuracy,
    /// Peak resident memory of the device's process, MiB (`peak_rss_mb`).
    PeakRssMb,
    /// Local epochs the device ran (FedEvolve's stragglers run fewer; `local_epochs`).
    LocalEpochs,
    /// 1 when the device straggled this round, else 0 (`straggler`).
    Straggler,
    /// FedTA: the input enhancement's stage-1 loss (`ie_loss`).
    IeLoss,
    /// FedTA: how often the tail anchors' keys matched (`anchor_key_match`).
    AnchorKeyMatch,
    /// FedProK: classes the device holds pseudo features of (`pseudo_classes`).
    PseudoClasses,
    /// FedProK: how far the device's prototypes moved (`prototype_drift`).
    PrototypeDrift,
    /// Protocol v1's spelling of `Update::prototypes_are` = sums on the wire (`prototype_sums` =
    /// 1); `Update`'s serde impls alone read and write it, so no update in memory holds it.
    PrototypeSums,
    /// A name this build does not know (a newer device's metric): kept as it came.
    Other(String),
}

const TASK: &str = "acc.task.";
const SELECTED: &str = "acc.sel.";

impl MetricKey {
    /// The name on the wire.
    pub fn name(&self) -> String {
        match self {
            Self::TaskAccuracy(k) => format!("{TASK}{k}"),
            Self::SelectedAccuracy(k) => format!("{SELECTED}{k}"),
            Self::Other(name) => name.clone(),
            fixed => fixed.fixed_name().unwrap_or_default().to_string(),
        }
    }

    fn fixed_name(&self) -> Option<&'static str> {
        Some(match self {
            Self::TrainLoss => "train_loss",
            Self::LocalAccuracy => "local_accuracy",
            Self::TargetAccuracy => "acc.target",
            Self::PeakRssMb => "peak_rss_mb",
            Self::LocalEpochs => "local_epochs",
            Self::Straggler => "straggler",
            Self::IeLoss => "ie_loss",
            Self::AnchorKeyMatch => "anchor_key_match",
            Self::PseudoClasses => "pseudo_classes",
            Self::PrototypeDrift => "prototype_drift",
            Self::PrototypeSums => "prototype_sums",
            Self::TaskAccuracy(_) | Self::SelectedAccuracy(_) | Self::Other(_) => return None,
        })
    }

    const FIXED: [MetricKey; 11] = [
        Self::TrainLoss,
        Self::LocalAccuracy,
        Self::TargetAccuracy,
        Self::PeakRssMb,
        Self::LocalEpochs,
        Self::Straggler,
        Self::IeLoss,
        Self::AnchorKeyMatch,
        Self::PseudoClasses,
        Self::PrototypeDrift,
        Self::PrototypeSums,
    ];

    /// The key a wire name stands for ([`MetricKey::Other`] for one this build does not know).
    pub fn parse(name: &str) -> Self {
        let task = |prefix: &str| name.strip_prefix(prefix).and_then(|k| k.parse::<u32>().ok());
        if let Some(k) = task(TASK) {
            return Self::TaskAccuracy(k);
        }
        if let Some(k) = task(SELECTED) {
            return Self::SelectedAccuracy(k);
        }
        Self::FIXED.into_iter().find(|key| key.fixed_name() == Some(name)).unwrap_or_else(|| Self::Other(name.into()))
    }
}

impl Metric {
    /// A value under a typed key.
    pub fn new(key: MetricKey, value: f64) -> Self {
        Self { name: key.name(), value }
    }

    /// The key this metric's name stands for.
    pub fn key(&self) -> MetricKey {
        MetricKey::parse(&self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_reads_back_from_its_wire_name() {
        let mut keys = MetricKey::FIXED.to_vec();
        keys.extend([MetricKey::TaskAccuracy(0), MetricKey::TaskAccuracy(12), MetricKey::SelectedAccuracy(3)]);
        keys.push(MetricKey::Other("gpu_temperature".into()));
        for key in keys {
            assert_eq!(MetricKey::parse(&key.name()), key, "{}", key.name());
        }
        assert_eq!(MetricKey::TaskAccuracy(4).name(), "acc.task.4");
        assert_eq!(MetricKey::parse("acc.task.x"), MetricKey::Other("acc.task.x".into()), "not a task number");
        assert_eq!(Metric::new(MetricKey::TrainLoss, 0.5).name, "train_loss");
    }
}
