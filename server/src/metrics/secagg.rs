//! What secure aggregation did (`[engine.secagg]`), from the round reports: the last
//! round's sum, and totals of refused messages by reason and of rounds whose protocol failed.
//! Counted at each round's close (the engine has no metrics of its own; its reports carry them).

use std::collections::BTreeMap;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use crate::engine::secagg::SecAggReport;

/// The totals since the server started, and the last round's figures.
#[derive(Debug, Default, Clone)]
pub struct SecAggTotals {
    contributors: usize,
    dropped_after_masking: usize,
    refused: BTreeMap<String, u64>,
    failed_rounds: u64,
}

impl SecAggTotals {
    /// Adds a closed round's report.
    pub fn add(&mut self, report: &SecAggReport) {
        self.contributors = report.contributors;
        self.dropped_after_masking = report.dropped_after_masking;
        for (reason, n) in &report.refused {
            *self.refused.entry(reason.clone()).or_default() += n;
        }
        self.failed_rounds += u64::from(report.failed.is_some());
    }

    /// The `anchorage_secagg_*` series.
    pub fn encode(&self, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
        let gauges = [
            ("secagg_contributors", "Devices whose masked update is in the last secure round's sum", self.contributors),
            (
                "secagg_dropped_after_masking",
                "Devices of the last secure round that shared keys but sent no masked update (unmasked from shares)",
                self.dropped_after_masking,
            ),
        ];
        for (name, help, v) in gauges {
            ConstGauge::new(v as i64).encode(encoder.encode_descriptor(name, help, None, MetricType::Gauge)?)?;
        }
        let failed = ConstCounter::new(self.failed_rounds);
        failed.encode(encoder.encode_descriptor(
            "secagg_failed_rounds",
            "Secure rounds whose protocol failed (too few shares or devices): nothing was output",
            None,
            MetricType::Counter,
        )?)?;
        let mut refused = encoder.encode_descriptor(
            "secagg_refused",
            "Secure aggregation messages refused (undecodable, a bad key, share or vector, a wrong stage), by reason",
            None,
            MetricType::Counter,
        )?;
        for (reason, n) in &self.refused {
            ConstCounter::new(*n).encode(refused.encode_family(&[("reason", reason.as_str())])?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Render(SecAggTotals);

    impl std::fmt::Debug for Render {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Render")
        }
    }

    impl prometheus_client::collector::Collector for Render {
        fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
            self.0.encode(&mut encoder)
        }
    }

    #[test]
    fn refusals_add_up_by_reason_and_failed_rounds_count() {
        let mut totals = SecAggTotals::default();
        let refused = |r: &[(&str, u64)]| r.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        totals.add(&SecAggReport { contributors: 9, refused: refused(&[("bad_key", 1)]), ..Default::default() });
        totals.add(&SecAggReport {
            contributors: 7,
            dropped_after_masking: 2,
            refused: refused(&[("bad_key", 2), ("decode", 1)]),
            failed: Some("below threshold".into()),
            ..Default::default()
        });
        let mut registry = prometheus_client::registry::Registry::with_prefix("anchorage");
        registry.register_collector(Box::new(Render(totals)));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "anchorage_secagg_contributors 7",
            "anchorage_secagg_dropped_after_masking 2",
            "anchorage_secagg_failed_rounds_total 1",
            "anchorage_secagg_refused_total{reason=\"bad_key\"} 3",
            "anchorage_secagg_refused_total{reason=\"decode\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }
}
