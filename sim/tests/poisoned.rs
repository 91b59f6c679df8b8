//! The poisoned-updates scenario of RESULTS.md on the virtual clock: 2 of 10 devices of the
//! embedded default (Dirichlet α = 0.5) send scaled updates, global + 10·(trained − global). The
//! sample-weighted mean collapses; the coordinate-wise median and the trimmed mean stay within 3
//! points of the clean mean, and multi-Krum (f = 2, select n − f = 8) within 3 points of its own
//! clean run.

use anchorage_server::aggregate::{AggregationRule, RobustConfig};
use anchorage_sim::FederationConfig;
use anchorage_sim::SimConfig;
use anchorage_sim::virtual_clock::run_virtual;

fn final_accuracy(aggregation: AggregationRule, attacked: bool) -> f64 {
    let config = SimConfig {
        federation: FederationConfig {
            clients: 10,
            rounds: 10,
            robust: RobustConfig { aggregation, ..RobustConfig::unbounded() },
            attack: attacked.then(|| anchorage_sim::Attack { clients: vec![0, 1], scale: 10.0, claim_samples: None }),
            ..Default::default()
        },
        ..SimConfig::default()
    };
    let accuracy = run_virtual(&config).expect("virtual run").summary.final_accuracy;
    println!("{:<13} {:<8} {:.1}%", aggregation.name(), if attacked { "attacked" } else { "clean" }, 100.0 * accuracy);
    accuracy
}

#[test]
fn scaled_updates_break_the_mean_not_the_robust_rules() {
    let krum = AggregationRule::Krum { byzantine: 2, select: 8 };
    let clean = final_accuracy(AggregationRule::Mean, false);
    let clean_krum = final_accuracy(krum, false);
    let mean = final_accuracy(AggregationRule::Mean, true);
    assert!(mean < clean - 0.3, "the mean collapses: {mean} vs clean {clean}");
    for rule in [AggregationRule::Median, AggregationRule::TrimmedMean { trim: 0.2 }] {
        let attacked = final_accuracy(rule, true);
        assert!(attacked >= clean - 0.03, "{}: {attacked} vs the clean mean's {clean}", rule.name());
    }
    let attacked = final_accuracy(krum, true);
    assert!(attacked >= clean_krum - 0.03, "krum: {attacked} vs its clean run's {clean_krum}");
}
