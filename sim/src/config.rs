//! What one simulated federation runs: [`SimConfig`] (a scenario file's tables, or the embedded
//! default) and its parts.

use std::path::PathBuf;

use anchorage_data::DataSpec;
use anchorage_server::aggregate::RobustConfig;
use anchorage_server::engine::AggregationMode;
use anchorage_shared::method::MethodConfig;
use serde::{Deserialize, Serialize};

use crate::device::{DeviceProfile, deal_by_share};
use crate::network::{DuplexProfile, LinkPreset};

/// A client to kill (abort, no goodbye) when the broadcast of `round` reaches it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KillAt {
    pub client: usize,
    pub round: u64,
}

/// Everything a simulated run needs; written to the run folder as `config.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SimConfig {
    pub clients: usize,
    pub rounds: u64,
    pub seed: u64,
    pub local_epochs: u32,
    pub batch_size: u32,
    /// Written as the shortest decimal that reads back as the same f32 (`0.001`, not the f32
    /// widened to f64, `0.0010000000474974513`).
    #[serde(serialize_with = "shortest_f32")]
    pub learning_rate: f32,
    /// The clients' local optimizer (`sgd`: momentum 0.9; `adam`).
    pub optimizer: anchorage_model::train::OptimizerKind,
    /// Fraction of connected clients each round waits for.
    pub fraction: f64,
    pub over_selection: f64,
    /// Clients required before a round opens (default: all of them).
    pub min_available: Option<usize>,
    /// Dirichlet α of the label skew over clients (smaller is more non-IID; `inf`: IID).
    pub alpha: f64,
    pub round_deadline_secs: f64,
    pub train_per_class: usize,
    pub test_per_class: usize,
    /// Pixel noise of the synthetic images (their templates have unit deviation). The default,
    /// 1.0, is harder than the data crate's, so the table shows the model learning over rounds.
    pub noise: f32,
    /// Upload encoding: f32, f16, bf16 or int8.
    pub encoding: anchorage_client::encoding::UploadEncoding,
    pub kill: Vec<KillAt>,
    /// Link of every client, by preset name (`ethernet`, `wifi`, `lte`, `3g`, `satellite`, `iot`);
    /// none: plain loopback.
    pub link: Option<LinkPreset>,
    /// A fleet of mixed links: presets dealt to clients by share (overrides `link`).
    pub link_mix: Vec<LinkShare>,
    /// Explicit links for single clients (override `link` and `link_mix`).
    pub client_links: Vec<ClientLink>,
    /// The fleet's device kinds, dealt by share (empty: every client computes at host speed).
    pub devices: Vec<DeviceProfile>,
    /// FedEvolve's straggler ratio p: with probability p a client runs a uniform random number of
    /// local epochs in 1..τ instead of τ.
    pub straggler_ratio: f64,
    /// Clients evaluate their local model in rounds that are multiples of this (1: every round;
    /// the global model is evaluated every round whatever this says).
    pub eval_every: u64,
    /// Fraction of each task's test rows clients evaluate their local model on (a seeded
    /// sample; 1: all). `metrics.json` records both under `local_eval`.
    pub eval_fraction: f64,
    /// Threads the virtual clock trains sampled clients on; 0: one per core. Results are the
    /// same for any count (a training sees only its own client's state and the broadcast). The
    /// default is 1: on the CPU backend trainings serialise on burn-autodiff's process-wide lock
    /// (see `device::ComputePool`), and the slowdown of each would enter the simulated time.
    pub threads: usize,
    /// Synchronous rounds (default) or FedBuff-style buffered aggregation:
    /// `aggregation = { kind = "buffered", buffer = 4, concurrency = 8, max_staleness = 4 }`.
    pub aggregation: AggregationMode,
    /// The server's screening and aggregation rule (`[robust]`, the server's `[engine.robust]`):
    /// `robust = { aggregation = { rule = "median" }, max_norm_z = 3.5 }`. Without the table the
    /// simulator runs the papers' plain rule ([`RobustConfig::unbounded`]); a `[robust]` table
    /// starts from the server's defaults (bounded influence) for the keys it does not name.
    pub robust: RobustConfig,
    /// Byzantine devices (`[attack]`): these clients send a scaled update instead of their own.
    pub attack: Option<Attack>,
    /// The method and its hyperparameters (`[method]` of a scenario file).
    pub method: MethodConfig,
    /// The frozen backbone and the trainable net on it (`[model]`).
    pub model: ModelConfig,
    /// The scenario's data (`[data]`); none: the embedded synthetic set (`alpha`, `noise`, ...).
    pub data: Option<DataSpec>,
    /// Where real datasets and weights are (`../shared/data`, `ANCHORAGE_DATA`).
    pub data_dir: Option<PathBuf>,
    /// Which clock `anchorage sim` runs on.
    pub clock: Clock,
    /// Rounds per task of the stream (FedProK's R); 0: a single task.
    pub rounds_per_task: u64,
    /// FedEvolve's protocol: the clients hold every source domain from the start and the last
    /// domain of the split is the unseen target the accuracy is measured on.
    pub evolving: bool,
    /// Also evaluate each client's local model on the global test data of its own classes (GLDP's
    /// A^sel). Off by default: under label skew every distinct class set holds its own copy of
    /// those test features.
    pub selected_accuracy: bool,
    /// Evolving shifts: how many of the last domains form the target (default 1: the next domain
    /// only; more holds out a stretch of far domains, as evolving-domain benchmarks often do).
    pub target_domains: usize,
}

/// `real`: QUIC on loopback in real time; `virtual`: the discrete-event clock (no sockets,
/// simulated time charged by the link and device models).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Clock {
    Real,
    Virtual,
}

impl std::fmt::Display for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if *self == Clock::Real { "real" } else { "virtual" })
    }
}

/// The frozen backbone and the trainable net on its features.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// `embedded` (random features, the default), `identity` (raw inputs), `resnet20`, `resnet56`,
    /// `mobilenet_v2` (pretrained, from the data directory).
    pub backbone: String,
    /// Widths of the trainable adapter's layers (the representation); the head follows.
    pub hidden: Vec<usize>,
    /// A residual adapter: the representation is features + adapter(features), the adapter's
    /// last layer starting at zero (see `anchorage_model::NetSpec::residual`).
    pub residual: bool,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self { backbone: "embedded".into(), hidden: vec![512], residual: false }
    }
}

/// Byzantine devices: each listed client trains as usual, then uploads
/// global + `scale`·(trained − global) — `scale` = −10 is the scaled sign-flip attack — claiming
/// `claim_samples` samples if set (a device that buys weight with a made-up count).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Attack {
    /// 0-based client indices.
    pub clients: Vec<usize>,
    pub scale: f32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim_samples: Option<u64>,
}

/// A preset and its share of the fleet.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkShare {
    pub preset: LinkPreset,
    pub share: f64,
}

/// One client's link, written out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientLink {
    pub client: usize,
    pub profile: DuplexProfile,
}

impl SimConfig {
    /// The link client `i` runs on, if shaped.
    /// Every client's link, in client order: an entry of `client_links` first, else a preset
    /// dealt from `link_mix` by share, else `link`, else none (plain loopback).
    pub fn links(&self) -> anyhow::Result<Vec<Option<DuplexProfile>>> {
        let mix: Vec<(DuplexProfile, f64)> = self.link_mix.iter().map(|m| (m.preset.profile(), m.share)).collect();
        let dealt = deal_by_share(&mix, self.clients, self.seed ^ 0x11AC);
        let default = self.link.map(LinkPreset::profile);
        Ok((0..self.clients)
            .map(|i| match self.client_links.iter().find(|l| l.client == i) {
                Some(l) => Some(l.profile.clone()),
                None => dealt.get(i).cloned().or_else(|| default.clone()),
            })
            .collect())
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            clients: 4,
            rounds: 5,
            seed: 7,
            local_epochs: 2,
            batch_size: 32,
            learning_rate: 1e-3,
            optimizer: anchorage_model::train::OptimizerKind::Adam,
            fraction: 1.0,
            over_selection: 0.0,
            min_available: None,
            alpha: 0.5,
            round_deadline_secs: 60.0,
            train_per_class: 300,
            test_per_class: 100,
            noise: 1.0,
            encoding: Default::default(),
            kill: Vec::new(),
            link: None,
            link_mix: Vec::new(),
            client_links: Vec::new(),
            devices: Vec::new(),
            straggler_ratio: 0.0,
            eval_every: 1,
            eval_fraction: 1.0,
            threads: 1,
            aggregation: AggregationMode::Synchronous,
            robust: RobustConfig::unbounded(),
            attack: None,
            method: MethodConfig::default(),
            model: ModelConfig::default(),
            data: None,
            data_dir: None,
            clock: Clock::Real,
            rounds_per_task: 0,
            evolving: false,
            selected_accuracy: false,
            target_domains: 1,
        }
    }
}

/// An f32 as the shortest decimal that reads back as the same f32 (what `f32`'s `Display`
/// writes), as an f64: TOML has only f64, and `v as f64` would write `0.0010000000474974513`.
fn shortest_f32<S: serde::Serializer>(v: &f32, s: S) -> Result<S::Ok, S::Error> {
    let shortest: f64 = v.to_string().parse().unwrap_or(*v as f64);
    s.serialize_f64(shortest)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The issue's `learning_rate = 0.0010000000474974513`: config.toml writes what was given,
    /// and reading it back gives the same f32.
    #[test]
    fn the_learning_rate_is_written_as_given() {
        for lr in [1e-3f32, 0.05, 0.1, 3e-4, 1.0, 0.007_5] {
            let config = SimConfig { learning_rate: lr, ..SimConfig::default() };
            let text = crate::scenario::effective_toml(&config).unwrap();
            let line = text.lines().find(|l| l.starts_with("learning_rate")).unwrap();
            let written: f64 = line.trim_start_matches("learning_rate = ").parse().unwrap();
            assert_eq!(written.to_string(), lr.to_string(), "{line}");
            let back: SimConfig = toml::from_str(&text).unwrap();
            assert_eq!(back.learning_rate.to_bits(), lr.to_bits());
            assert_eq!(back, config, "the run's config.toml reads back as the same configuration");
        }
        assert!(crate::scenario::effective_toml(&SimConfig::default()).unwrap().contains("learning_rate = 0.001\n"));
    }
}
