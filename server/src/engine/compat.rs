//! Which features combine: one table. A federation is one cell of method × mode × role ×
//! SecAgg × DP × robust rule (the device's encoding, top-k or compression, is decoded into a
//! dense update before anything below sees it, so it combines with every cell). Each rule of
//! [`RULES`] refuses the cells it names, with one message that says why; a cell no rule refuses
//! runs. The server's start, `check-config`, `anchorage provision` and the simulator all ask
//! [`check`], and nothing else. A new feature adds a field to [`Cell`] and its rules here.

use anchorage_shared::method::MethodConfig;
use anchorage_shared::privacy::NoiseSite;

use super::{AggregationMode, ConfigError, EngineConfig, Role};
use crate::aggregate::AggregationRule;

/// One federation's features: a cell of the table.
#[derive(Debug, Clone, Copy)]
pub struct Cell<'a> {
    pub method: &'a MethodConfig,
    /// Buffered (FedBuff-style) versions instead of synchronous rounds.
    pub buffered: bool,
    pub role: Role,
    pub secagg: bool,
    /// Where differential privacy's noise is added (`Off`: no DP).
    pub noise: NoiseSite,
    pub rule: AggregationRule,
    /// `[engine.robust]` sets a screen or bound that reads each update on its own.
    pub per_update_screens: bool,
}

impl<'a> Cell<'a> {
    /// The cell a server's `[engine]` and `[method]` make.
    pub fn of(engine: &EngineConfig, method: &'a MethodConfig) -> Self {
        Self {
            method,
            buffered: engine.mode != AggregationMode::Synchronous,
            role: engine.role,
            secagg: engine.secagg.enabled,
            noise: engine.privacy.noise,
            rule: engine.robust.aggregation,
            per_update_screens: engine.robust.per_update_screens().iter().any(|(set, _)| *set),
        }
    }

    fn dp(&self) -> bool {
        self.noise != NoiseSite::Off
    }

    fn relay(&self) -> bool {
        self.role == Role::Relay
    }
}

/// A rule of the table: the cells it refuses, and why (`None`: this rule lets the cell run).
pub type Rule = fn(&Cell) -> Option<String>;

const NEEDS_EACH: &str = "needs each device's update, and under secure aggregation the server sees only their sum";

/// Every rule, in the order [`check`] asks them: the first that refuses a cell gives its message.
pub const RULES: &[(&str, Rule)] = &[
    ("dp × method", |c| {
        c.dp()
            .then(|| (c.method.info().privacy)(c.method).err())
            .flatten()
            .map(|why| format!("[privacy] with `{}`: {why}", c.method.name()))
    }),
    ("dp × rule", |c| {
        (c.dp() && c.rule != AggregationRule::Mean).then(|| {
            format!(
                "[privacy] needs the mean rule: its noise is calibrated to the sum of clipped deltas, and {:?} is not a sum",
                c.rule
            )
        })
    }),
    ("secagg × rule", |c| {
        (c.secagg && c.rule != AggregationRule::Mean)
            .then(|| format!("[engine.secagg] with the {:?} rule: it {NEEDS_EACH}", c.rule))
    }),
    ("secagg × screens", |c| {
        (c.secagg && c.per_update_screens).then(|| {
            format!(
                "[engine.secagg] with a per-update screen of [engine.robust] (max_norm, max_norm_z, weight_cap, \
                 norm_cap, min_norm_ratio, max_sign_agreement): this screen {NEEDS_EACH}; each device clips its own \
                 delta to [engine.secagg] clip instead"
            )
        })
    }),
    ("secagg × mode", |c| {
        (c.secagg && c.buffered).then(|| {
            "[engine.secagg] needs synchronous rounds: a SecAgg round sums one fixed cohort, and buffered mode \
             aggregates updates one by one as they arrive"
                .into()
        })
    }),
    ("secagg × dp", |c| {
        (c.secagg && c.noise == NoiseSite::Central).then(|| {
            "[engine.secagg] with central noise: the server would clip and noise each update, which it never sees; \
             use noise = \"local\" (the devices noise what they mask)"
                .into()
        })
    }),
    ("secagg × method", |c| {
        c.secagg.then(|| (c.method.info().privacy)(c.method).err()).flatten().map(|why| {
            format!("[engine.secagg] with `{}`: the server half must aggregate sums: {why}", c.method.name())
        })
    }),
    ("relay × method", |c| c.relay().then(|| (c.method.info().relays)(c.method).err()).flatten().map(String::from)),
    ("relay × rule", |c| {
        (c.relay() && c.rule != AggregationRule::Mean).then(|| {
            format!(
                "[engine.robust] aggregation = {}: a relay's partial aggregate is a weighted sum, and only the \
                 sample-weighted mean of partial sums is the mean over the devices",
                c.rule.name()
            )
        })
    }),
    ("relay × mode", |c| {
        (c.relay() && c.buffered).then(|| "a relay runs synchronous rounds: its parent opens them".into())
    }),
    ("relay × secagg, dp", |c| {
        (c.relay() && (c.secagg || c.dp())).then(|| {
            "secure aggregation and differential privacy run between the devices and the root, not behind a relay \
             (not supported yet)"
                .into()
        })
    }),
];

/// Why `cell` cannot run (the first rule that refuses it); `None` when it runs.
pub fn refusal(cell: &Cell) -> Option<String> {
    RULES.iter().find_map(|(_, rule)| rule(cell))
}

/// Whether a federation of `engine` running `method` can run: its cell of the table, then the
/// values of the features it turns on ([`super::privacy::check_config`],
/// [`super::secagg::check_config`]). `Err` says why not, in one message.
pub fn check(engine: &EngineConfig, method: &MethodConfig) -> Result<(), ConfigError> {
    if let Some(why) = refusal(&Cell::of(engine, method)) {
        return Err(ConfigError::Combination(why));
    }
    engine.policy.schedule.check()?;
    super::secagg::check_config(engine, method)?;
    super::privacy::check_config(engine, method)
}

#[cfg(test)]
mod tests {
    use anchorage_shared::method::{FedTaConfig, MethodConfig, REGISTRY};
    use anchorage_shared::privacy::NoiseSite;

    use super::{Cell, RULES, check, refusal};
    use crate::aggregate::AggregationRule;
    use crate::engine::{AggregationMode, EngineConfig, Role};

    /// Every method of the registry with its defaults, and FedTA with its selections off (the
    /// form DP, SecAgg and relays take).
    fn methods() -> Vec<MethodConfig> {
        let mut all: Vec<MethodConfig> = REGISTRY.iter().map(|m| (m.defaults)()).collect();
        all.push(MethodConfig::FedTa(FedTaConfig { bgps: false, sikf: false, ..FedTaConfig::default() }));
        all
    }

    const RULE_VALUES: [AggregationRule; 4] = [
        AggregationRule::Mean,
        AggregationRule::Median,
        AggregationRule::TrimmedMean { trim: 0.1 },
        AggregationRule::Krum { byzantine: 1, select: 1 },
    ];
    const NOISES: [NoiseSite; 3] = [NoiseSite::Off, NoiseSite::Central, NoiseSite::Local];

    /// Every cell, once.
    fn every_cell(methods: &[MethodConfig]) -> Vec<Cell<'_>> {
        let mut cells = Vec::new();
        for method in methods {
            for buffered in [false, true] {
                for role in [Role::Root, Role::Relay] {
                    for secagg in [false, true] {
                        for noise in NOISES {
                            for rule in RULE_VALUES {
                                for per_update_screens in [false, true] {
                                    cells.push(Cell {
                                        method,
                                        buffered,
                                        role,
                                        secagg,
                                        noise,
                                        rule,
                                        per_update_screens,
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
        cells
    }

    /// What runs, said once more from the features' own constraints: DP and SecAgg need sums
    /// under the mean; SecAgg sees no single update (no per-update screen, no central noise)
    /// and sums one cohort (synchronous); a relay folds sums of synchronous rounds, and neither
    /// DP nor SecAgg crosses it.
    fn runs(c: &Cell) -> bool {
        let info = c.method.info();
        let sums = (info.privacy)(c.method).is_ok();
        let mean = c.rule == AggregationRule::Mean;
        let dp = c.noise != NoiseSite::Off;
        let dp_ok = !dp || (sums && mean);
        let secagg_ok =
            !c.secagg || (sums && mean && !c.per_update_screens && !c.buffered && c.noise != NoiseSite::Central);
        let relay_ok =
            c.role == Role::Root || ((info.relays)(c.method).is_ok() && mean && !c.buffered && !c.secagg && !dp);
        dp_ok && secagg_ok && relay_ok
    }

    #[test]
    fn every_cell_runs_or_is_refused_with_one_message_naming_its_features() {
        let methods = methods();
        let cells = every_cell(&methods);
        assert_eq!(cells.len(), methods.len() * 2 * 2 * 2 * 3 * 4 * 2, "every cell once");
        let (mut running, mut refused) = (0, 0);
        for cell in &cells {
            let verdict = refusal(cell);
            assert_eq!(verdict.is_none(), runs(cell), "{cell:?}: {verdict:?}");
            let Some(why) = verdict else {
                running += 1;
                continue;
            };
            refused += 1;
            // The rule that refused names a feature the cell turns on.
            let (name, _) = RULES.iter().find(|(_, rule)| rule(cell).is_some()).expect("a rule refused");
            let on = |feature: &str| match feature {
                "dp" => cell.noise != NoiseSite::Off,
                "secagg" => cell.secagg,
                "relay" => cell.role == Role::Relay,
                _ => false,
            };
            assert!(on(name.split(' ').next().unwrap()), "{name} refused {cell:?}");
            assert!(!why.is_empty() && !why.contains('\n'), "one message: {why}");
        }
        assert!(running > 0 && refused > 0, "{running} cells run, {refused} are refused");
        // Plain federations always run, whatever the method, mode or rule.
        for cell in cells.iter().filter(|c| c.role == Role::Root && !c.secagg && c.noise == NoiseSite::Off) {
            assert_eq!(refusal(cell), None, "{cell:?}");
        }
    }

    /// A server's `[engine]` makes the cell it says: `check` on an engine config built for each
    /// cell (with values its features accept) agrees with the cell's verdict.
    #[test]
    fn a_servers_config_is_judged_by_its_cell() {
        let methods = methods();
        for cell in every_cell(&methods).iter().filter(|c| !c.per_update_screens) {
            let mut engine = EngineConfig { role: cell.role, ..EngineConfig::default() };
            if cell.buffered {
                engine.mode = AggregationMode::Buffered { buffer: 2, concurrency: 4, max_staleness: 4 };
            }
            engine.robust.aggregation = cell.rule;
            engine.secagg.enabled = cell.secagg;
            engine.secagg.classes = 10;
            engine.secagg.prototype_dim = 8;
            engine.privacy.noise = cell.noise;
            engine.privacy.noise_multiplier = Some(1.0);
            let judged = Cell::of(&engine, cell.method);
            assert_eq!(refusal(&judged), refusal(cell), "{cell:?}");
            assert_eq!(check(&engine, cell.method).is_ok(), refusal(cell).is_none(), "{cell:?}");
        }
    }
}
