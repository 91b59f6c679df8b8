//! The methods: each one's typed config ([`configs`]) and the one registry ([`REGISTRY`]) that
//! the client halves, the server halves and the simulator all read; beside them, the update
//! encodings any method can use ([`ENCODINGS`]).
//!
//! A `[method]` table (of a scenario file, `server.toml` or `client.toml`) names its method and
//! sets that method's keys only: `name = "gldp"` deserialises into
//! [`MethodConfig::Gldp`], and a key GLDP does not have is an error naming the key and the method.
//! Adding a method: CONTRIBUTING.md, "Add a method".

pub mod configs;
pub mod encodings;

use core::fmt;

use serde::{Deserialize, Deserializer, Serialize};

pub use configs::*;
pub use encodings::{ENCODINGS, EncodingInfo, EncodingNames};

/// One method and its hyperparameters, tagged by `name`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "name")]
pub enum MethodConfig {
    #[serde(rename = "fedavg", deserialize_with = "checked")]
    /// FedAvg (McMahan et al. 2017).
    FedAvg(FedAvgConfig),
    #[serde(rename = "fedavgm", deserialize_with = "checked")]
    /// FedAvgM (Hsu et al. 2019).
    FedAvgM(FedAvgMConfig),
    #[serde(rename = "fedprox", deserialize_with = "checked")]
    /// FedProx (Li et al. 2020).
    FedProx(FedProxConfig),
    #[serde(rename = "fedrep", deserialize_with = "checked")]
    /// FedRep (Collins et al. 2021).
    FedRep(FedRepConfig),
    #[serde(rename = "local", deserialize_with = "checked")]
    /// Local training only.
    Local(LocalConfig),
    #[serde(rename = "gldp", deserialize_with = "checked")]
    /// GLDP / STHFL (Guo et al.).
    Gldp(GldpConfig),
    #[serde(rename = "fedprok", deserialize_with = "checked")]
    /// FedProK (Gao et al.).
    FedProK(FedProKConfig),
    #[serde(rename = "fedevolve", deserialize_with = "checked")]
    /// FedEvolve (evolving shifts).
    FedEvolve(FedEvolveConfig),
    #[serde(rename = "fedevp", deserialize_with = "checked")]
    /// FedEvp (evolving shifts).
    FedEvp(FedEvpConfig),
    #[serde(rename = "fedta", deserialize_with = "checked")]
    /// FedTA (Yu et al.).
    FedTa(FedTaConfig),
}

/// A method's config with serde's error prefixed by the method, so that `ie_pool` in a GLDP
/// table reads "method `gldp`: unknown field `ie_pool`, expected one of ...".
fn checked<'de, D: Deserializer<'de>, T: Deserialize<'de> + MethodParams>(d: D) -> Result<T, D::Error> {
    T::deserialize(d).map_err(|e| serde::de::Error::custom(format_args!("method `{}`: {e}", T::NAME)))
}

/// Ties a config struct to its registry name (for error messages).
pub trait MethodParams {
    /// The method's registry name (`name = ...` of a `[method]` table).
    const NAME: &'static str;
}

macro_rules! params {
    ($($ty:ty => $name:literal),* $(,)?) => {
        $(impl MethodParams for $ty { const NAME: &'static str = $name; })*
    };
}

params!(
    FedAvgConfig => "fedavg",
    FedAvgMConfig => "fedavgm",
    FedProxConfig => "fedprox",
    FedRepConfig => "fedrep",
    LocalConfig => "local",
    GldpConfig => "gldp",
    FedProKConfig => "fedprok",
    FedEvolveConfig => "fedevolve",
    FedEvpConfig => "fedevp",
    FedTaConfig => "fedta",
);

/// What a method shares with the server each round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shared {
    /// Every block of the trainable net (adapter and head).
    Net,
    /// The adapter (the representation), not the head.
    Body,
    /// The adapter and class prototypes.
    BodyAndPrototypes,
    /// Every block of the trainable net and class prototypes.
    NetAndPrototypes,
    /// The input-enhancement pool (`ie.*`) and class prototypes.
    PromptsAndPrototypes,
    /// Nothing: every client trains alone.
    Nothing,
}

impl Shared {
    /// Whether class prototypes are among what is shared.
    pub fn has_prototypes(self) -> bool {
        matches!(self, Self::BodyAndPrototypes | Self::NetAndPrototypes | Self::PromptsAndPrototypes)
    }
}

/// How the method's global model predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prediction {
    /// The global net's head.
    Head,
    /// The nearest global prototype in the representation.
    NearestPrototype,
    /// No global predictor: only the clients' own models are evaluated.
    None,
}

/// One registry entry: what both halves and the simulator know of a method.
#[derive(Debug, Clone, Copy)]
pub struct MethodInfo {
    /// The registry name (`name = ...` of a `[method]` table).
    pub name: &'static str,
    /// Its paper, for reports (`report.md` names it beside the method).
    pub paper: &'static str,
    /// What it uploads (everything else of its trainable net stays on the device; the
    /// cross-crate methods test checks every method's uploads against this).
    pub shared: Shared,
    /// How its global model predicts.
    pub predicts_with: Prediction,
    /// Whether its client half reads the raw samples behind the cached features (FedTA's input
    /// enhancement runs the frozen backbone on them); a simulator may drop them otherwise.
    pub reads_raw_samples: bool,
    /// Whether its paper measures a run's efficiency as E = (τ1 + τ2) / R, compute and transfer
    /// seconds per round (FedProK); reports add that row for it.
    pub reports_efficiency: bool,
    /// Whether it can run under differential privacy (`[privacy]`): its server half
    /// must aggregate sums (of clipped deltas, of prototype sums and counts), so that the noise
    /// on a sum protects every device. `Err` says why not.
    pub privacy: fn(&MethodConfig) -> Result<(), &'static str>,
    /// Whether relays can carry it: a relay folds its devices' updates into one
    /// partial aggregate of sums and counts, so the server half must aggregate sums (as under
    /// `privacy`) and need no single device's update. `Err` says why not.
    pub relays: fn(&MethodConfig) -> Result<(), &'static str>,
    /// The method with its defaults.
    pub defaults: fn() -> MethodConfig,
}

/// A method whose server half aggregates sums: it runs under differential privacy.
fn sums(_: &MethodConfig) -> Result<(), &'static str> {
    Ok(())
}

/// FedTA runs under differential privacy only with BGPS off: Best Global Prototype Selection
/// picks one device's uploaded prototype as the class's global one (FedTA Eq. 9–10), which no
/// noise on a sum protects.
fn fedta_privacy(config: &MethodConfig) -> Result<(), &'static str> {
    match config {
        MethodConfig::FedTa(c) if c.bgps => {
            Err("FedTA's Best Global Prototype Selection sends one device's prototype on as the global one; \
             set bgps = false (the count-weighted mean of the uploads, a sum) to run it with [privacy]")
        }
        _ => Ok(()),
    }
}

/// FedTA behind relays needs both of its selections off: BGPS picks one device's prototype
/// (Eq. 9–10) and SIKF distils each device's IE into one student (Eq. 8); a partial aggregate
/// holds neither, only sums.
fn fedta_relays(config: &MethodConfig) -> Result<(), &'static str> {
    match config {
        MethodConfig::FedTa(c) if c.bgps || c.sikf => {
            Err("FedTA's BGPS and SIKF each need every device's own upload, \
             which a relay's partial aggregate (a sum) does not carry; set bgps = false and sikf = false to run \
             it behind relays")
        }
        _ => Ok(()),
    }
}

/// The registry: every method, in the order reports list them.
pub const REGISTRY: &[MethodInfo] = &[
    MethodInfo {
        name: "fedavg",
        paper: "McMahan et al. 2017",
        shared: Shared::Net,
        predicts_with: Prediction::Head,
        reads_raw_samples: false,
        reports_efficiency: false,
        privacy: sums,
        relays: sums,
        defaults: || MethodConfig::FedAvg(FedAvgConfig::default()),
    },
    MethodInfo {
        name: "fedavgm",
        paper: "Hsu et al. 2019",
        shared: Shared::Net,
        predicts_with: Prediction::Head,
        reads_raw_samples: false,
        reports_efficiency: false,
        privacy: sums,
        relays: sums,
        defaults: || MethodConfig::FedAvgM(FedAvgMConfig::default()),
    },
    MethodInfo {
        name: "fedprox",
        paper: "Li et al. 2020",
        shared: Shared::Net,
        predicts_with: Prediction::Head,
        reads_raw_samples: false,
        reports_efficiency: false,
        privacy: sums,
        relays: sums,
        defaults: || MethodConfig::FedProx(FedProxConfig::default()),
    },
    MethodInfo {
        name: "fedrep",
        paper: "Collins et al. 2021",
        shared: Shared::Body,
        predicts_with: Prediction::None,
        reads_raw_samples: false,
        reports_efficiency: false,
        privacy: sums,
        relays: sums,
        defaults: || MethodConfig::FedRep(FedRepConfig::default()),
    },
    MethodInfo {
        name: "local",
        paper: "local training only",
        shared: Shared::Nothing,
        predicts_with: Prediction::None,
        reads_raw_samples: false,
        reports_efficiency: false,
        privacy: sums,
        relays: sums,
        defaults: || MethodConfig::Local(LocalConfig::default()),
    },
    MethodInfo {
        name: "gldp",
        paper: "GLDP / STHFL (Guo et al.)",
        shared: Shared::BodyAndPrototypes,
        predicts_with: Prediction::NearestPrototype,
        reads_raw_samples: false,
        reports_efficiency: false,
        privacy: sums,
        relays: sums,
        defaults: || MethodConfig::Gldp(GldpConfig::default()),
    },
    MethodInfo {
        name: "fedprok",
        paper: "FedProK (Gao et al.)",
        shared: Shared::NetAndPrototypes,
        predicts_with: Prediction::Head,
        reads_raw_samples: false,
        reports_efficiency: true,
        privacy: sums,
        relays: sums,
        defaults: || MethodConfig::FedProK(FedProKConfig::default()),
    },
    MethodInfo {
        name: "fedevolve",
        paper: "FedEvolve (evolving shifts)",
        shared: Shared::NetAndPrototypes,
        predicts_with: Prediction::NearestPrototype,
        reads_raw_samples: false,
        reports_efficiency: false,
        privacy: sums,
        relays: sums,
        defaults: || MethodConfig::FedEvolve(FedEvolveConfig::default()),
    },
    MethodInfo {
        name: "fedevp",
        paper: "FedEvp (evolving shifts)",
        shared: Shared::NetAndPrototypes,
        predicts_with: Prediction::Head,
        reads_raw_samples: false,
        reports_efficiency: false,
        privacy: sums,
        relays: sums,
        defaults: || MethodConfig::FedEvp(FedEvpConfig::default()),
    },
    MethodInfo {
        name: "fedta",
        paper: "FedTA (Yu et al.)",
        shared: Shared::PromptsAndPrototypes,
        predicts_with: Prediction::NearestPrototype,
        reads_raw_samples: true,
        reports_efficiency: false,
        privacy: fedta_privacy,
        relays: fedta_relays,
        defaults: || MethodConfig::FedTa(FedTaConfig::default()),
    },
];

/// The registry entry of `name`.
pub fn info(name: &str) -> Option<&'static MethodInfo> {
    REGISTRY.iter().find(|m| m.name == name)
}

/// Every registered method's name, in registry order.
pub fn names() -> impl Iterator<Item = &'static str> {
    REGISTRY.iter().map(|m| m.name)
}

/// The registered names joined by ", " (for error messages and help texts).
pub struct Names;

impl fmt::Display for Names {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, name) in names().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(name)?;
        }
        Ok(())
    }
}

impl Default for MethodConfig {
    fn default() -> Self {
        Self::FedAvg(FedAvgConfig::default())
    }
}

impl MethodConfig {
    /// The defaults of the method `name` (`None`: no such method).
    pub fn named(name: &str) -> Option<Self> {
        info(name).map(|m| (m.defaults)())
    }

    /// The method's registry name.
    pub fn name(&self) -> &'static str {
        match self {
            Self::FedAvg(_) => FedAvgConfig::NAME,
            Self::FedAvgM(_) => FedAvgMConfig::NAME,
            Self::FedProx(_) => FedProxConfig::NAME,
            Self::FedRep(_) => FedRepConfig::NAME,
            Self::Local(_) => LocalConfig::NAME,
            Self::Gldp(_) => GldpConfig::NAME,
            Self::FedProK(_) => FedProKConfig::NAME,
            Self::FedEvolve(_) => FedEvolveConfig::NAME,
            Self::FedEvp(_) => FedEvpConfig::NAME,
            Self::FedTa(_) => FedTaConfig::NAME,
        }
    }

    /// The method's registry entry.
    pub fn info(&self) -> &'static MethodInfo {
        info(self.name()).expect("every config variant is registered (checked by a test)")
    }
}

/// FedTA's block names on the wire, for both halves.
pub mod fedta_blocks {
    /// The input-enhancement pool: keys `[M, D]` and sets `[M, set_len]`.
    pub const IE_PREFIX: &str = "ie.";
    /// The keys of the input-enhancement pool, `[M, D]`.
    pub const IE_KEYS: &str = "ie.keys";
    /// The sets of the input-enhancement pool, `[M, set_len]`.
    pub const IE_SETS: &str = "ie.sets";
    /// A shared tail (`share_tail`): anchor keys `[A, D]` and values `[A, V]`, and the head.
    pub const TAIL_PREFIX: &str = "tail.";
    /// The shared tail's anchor keys, `[A, D]`.
    pub const TAIL_KEYS: &str = "tail.keys";
    /// The shared tail's anchor values, `[A, V]`.
    pub const TAIL_VALUES: &str = "tail.values";
    /// The shared tail's head weight.
    pub const TAIL_HEAD_WEIGHT: &str = "tail.head.weight";
    /// The shared tail's head bias.
    pub const TAIL_HEAD_BIAS: &str = "tail.head.bias";
    /// Beside a shared tail: how many of the client's samples took each anchor in the round `[A]`
    /// (the server averages each anchor over the clients that trained it, and drops this block).
    pub const TAIL_TRAINED: &str = "tail.trained";
    /// The stage-1 IE head `[classes, D]` and `[classes]`: kept on the device, and uploaded for
    /// the global model's head under `prediction = "head"` (the devices never load the average).
    pub const IE_HEAD_WEIGHT: &str = "ie_head.weight";
    /// The stage-1 IE head's bias, `[classes]`.
    pub const IE_HEAD_BIAS: &str = "ie_head.bias";
    /// The prefix of the stage-1 IE head's blocks.
    pub const IE_HEAD_PREFIX: &str = "ie_head.";
}

#[cfg(test)]
mod tests {
    use alloc::string::ToString;

    use super::*;

    fn parse(text: &str) -> Result<MethodConfig, toml::de::Error> {
        toml::from_str(text)
    }

    #[test]
    fn every_method_is_registered_once_and_round_trips() {
        for (i, m) in REGISTRY.iter().enumerate() {
            assert!(REGISTRY[..i].iter().all(|o| o.name != m.name), "{} registered twice", m.name);
            let config = (m.defaults)();
            assert_eq!(config.name(), m.name);
            assert_eq!(config.info().name, m.name);
            let text = toml::to_string(&config).unwrap();
            assert!(text.starts_with(&alloc::format!("name = \"{}\"", m.name)), "{text}");
            assert_eq!(parse(&text).unwrap(), config);
        }
        assert_eq!(MethodConfig::named("nope"), None);
    }

    #[test]
    fn a_table_sets_its_methods_keys_only() {
        let gldp = parse("name = \"gldp\"\nbeta = 0.9\nprediction = \"local\"").unwrap();
        let MethodConfig::Gldp(c) = &gldp else { panic!("{gldp:?}") };
        assert_eq!((c.beta, c.lambda, c.prediction), (0.9, 0.5, GldpPrediction::Local));

        let error = parse("name = \"gldp\"\nie_pool = 4").unwrap_err().to_string();
        assert!(error.contains("method `gldp`") && error.contains("unknown field `ie_pool`"), "{error}");
        let error = parse("name = \"fedavgx\"").unwrap_err().to_string();
        assert!(error.contains("unknown variant `fedavgx`") && error.contains("fedta"), "{error}");
        let error = parse("name = \"fedprox\"\nmu = \"high\"").unwrap_err().to_string();
        assert!(error.contains("method `fedprox`"), "{error}");
    }
}
