//! What one simulated federation runs: [`SimConfig`] (a scenario file's tables, or the embedded
//! default) and its parts.

use std::path::PathBuf;

use anchorage_data::DataSpec;
use anchorage_server::aggregate::RobustConfig;
use anchorage_server::engine::AggregationMode;
use anchorage_server::engine::secagg::SecAggConfig;
use anchorage_shared::method::MethodConfig;
use anchorage_shared::privacy::PrivacyConfig;
use serde::{Deserialize, Serialize};

use crate::device::{DeviceProfile, deal_by_share};
use crate::network::{DuplexProfile, LinkPreset};

/// A client to kill (abort, no goodbye) when the broadcast of `round` reaches it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KillAt {
    pub client: usize,
    pub round: u64,
}

/// Everything a simulated run needs, in sections; written to the run folder as `config.toml`.
///
/// The file keeps one flat table of keys (the sections' fields), beside the `[method]`, `[model]`
/// and `[data]` tables, so every scenario, sweep and run folder written before the sections still
/// reads. Reading checks each key against its section: an unknown key or a wrong value names the
/// key ([`SimConfig::from_table`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SimConfig {
    /// Who takes part, how often, how they train locally and how the server aggregates.
    #[serde(flatten)]
    pub federation: FederationConfig,
    /// The data and its task stream.
    #[serde(flatten)]
    pub data: DataConfig,
    /// The frozen backbone and the trainable net on it (`[model]`).
    pub model: ModelConfig,
    /// The method and its hyperparameters (`[method]`).
    pub method: MethodConfig,
    /// Differential privacy of what the devices send (`[privacy]`): the server and
    /// every device get the same table.
    #[serde(skip_serializing_if = "PrivacyConfig::is_off")]
    pub privacy: PrivacyConfig,
    /// Secure aggregation (`[secagg]`: the server's `[engine.secagg]`; every device
    /// masks its update). `classes` and `prototype_dim` left at 0 are sized from the data and
    /// the method.
    #[serde(skip_serializing_if = "is_off")]
    pub secagg: SecAggConfig,
    /// The devices and links the clients run on, the clock, failures.
    #[serde(flatten)]
    pub systems: SystemsConfig,
    /// What the run measures.
    #[serde(flatten)]
    pub output: OutputConfig,
}

/// Who takes part, how often, how they train locally, and how the server screens and aggregates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FederationConfig {
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
    pub round_deadline_secs: f64,
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
    /// How each round's devices are chosen and its learning rate scheduled (the server's
    /// `[engine.policy]`): `policy = { selection = "least_recent", schedule = { kind = "cosine", min_lr = 1e-4 } }`.
    #[serde(skip_serializing_if = "anchorage_server::engine::RoundPolicy::is_default")]
    pub policy: anchorage_server::engine::RoundPolicy,
}

/// The data: the embedded synthetic set's knobs or a real dataset's `[data]` table, and the task
/// stream cut from it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// Dirichlet α of the label skew over clients (smaller is more non-IID; `inf`: IID).
    pub alpha: f64,
    pub train_per_class: usize,
    pub test_per_class: usize,
    /// Pixel noise of the synthetic images (their templates have unit deviation). The default,
    /// 1.0, is harder than the data crate's, so the table shows the model learning over rounds.
    pub noise: f32,
    /// The scenario's data (the `[data]` table); none: the embedded synthetic set (`alpha`,
    /// `noise`, ...).
    #[serde(rename = "data")]
    pub spec: Option<DataSpec>,
    /// Where real datasets and weights are (`../shared/data`, `ANCHORAGE_DATA`).
    pub data_dir: Option<PathBuf>,
    /// Rounds per task of the stream (FedProK's R); 0: a single task.
    pub rounds_per_task: u64,
    /// FedEvolve's protocol: the clients hold every source domain from the start and the last
    /// domain of the split is the unseen target the accuracy is measured on.
    pub evolving: bool,
    /// Evolving shifts: how many of the last domains form the target (default 1: the next domain
    /// only; more holds out a stretch of far domains, as evolving-domain benchmarks often do).
    pub target_domains: usize,
}

/// The systems the clients run on (FedScale's system heterogeneity): devices, links, upload
/// encoding, stragglers and kills, and the clock that charges them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SystemsConfig {
    /// Which clock `anchorage sim` runs on.
    pub clock: Clock,
    /// Upload encoding: f32, f16, bf16 or int8.
    pub encoding: anchorage_client::encoding::UploadEncoding,
    /// Top-k sparsification with error feedback: the fraction of each block's delta
    /// a client uploads, in (0, 1]; unset: every value.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<f64>,
    /// A compressor over the encoded blocks (`zstd`); unset: none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compress: Option<anchorage_client::compress::Compressor>,
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
    pub kill: Vec<KillAt>,
    /// Trainings that run at once: the virtual clock's threads, and on the real clock the slots
    /// of the devices' `device::ComputePool`; 0 (the default): one per core. Results are the same
    /// for any count (a training sees only its own client's state and the broadcast). burn
    /// 0.22.1's autodiff keeps one graph per training, so independent trainings scale: 2.0× the
    /// steps per second on 2 threads (`anchorage microbench`, `parallel_speedup`).
    pub threads: usize,
    /// Uploads resume after an interruption from what the server holds (the runtime's
    /// resumable transfers); `false`: sent again from the start (the baseline). On the
    /// virtual clock, how an outage in the middle of an upload is charged.
    pub resume_uploads: bool,
    /// Broadcasts larger than a chunk resume after an interruption from what the device holds
    /// (`anchorage/1+resumable-broadcasts`); `false`: received again from the start. On the
    /// virtual clock, how an outage in the middle of a broadcast is charged.
    pub resume_broadcasts: bool,
    /// Virtual clock: the run ends after the round in flight once the simulated clock passes
    /// this many hours (168: a week of a fleet), even if `rounds` are left.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_after_hours: Option<f64>,
    /// `[relays]`: a relay tier between the devices and the server, modelled on the
    /// virtual clock only; none: the devices reach the server.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub relays: Option<RelayTier>,
}

/// What the run measures beyond the global model's accuracy, which it evaluates every round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OutputConfig {
    /// Clients evaluate their local model in rounds that are multiples of this (1: every round;
    /// the global model is evaluated every round whatever this says).
    pub eval_every: u64,
    /// Fraction of each task's test rows clients evaluate their local model on (a seeded
    /// sample; 1: all). `metrics.json` records both under `local_eval`.
    pub eval_fraction: f64,
    /// Also evaluate each client's local model on the global test data of its own classes (GLDP's
    /// A^sel). Off by default: under label skew every distinct class set holds its own copy of
    /// those test features.
    pub selected_accuracy: bool,
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
    /// Outages of these devices' links, both directions (`every_ms` repeats one): the share's
    /// devices go dark together, as behind one tower or one backhaul.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outages: Vec<crate::network::Outage>,
}

impl LinkShare {
    /// The preset's links with the share's outages.
    pub fn profile(&self) -> DuplexProfile {
        let mut p = self.preset.profile();
        p.up.outages.extend(self.outages.iter().copied());
        p.down.outages.extend(self.outages.iter().copied());
        p
    }
}

/// One client's link, written out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientLink {
    pub client: usize,
    pub profile: DuplexProfile,
}

impl SimConfig {
    /// Whether each client's link is metered (cellular), in client order, dealt as
    /// [`SimConfig::links`] deals the presets: a written `client_links` entry is not.
    pub fn metered_links(&self) -> Vec<bool> {
        let systems = &self.systems;
        let mix: Vec<(bool, f64)> = systems.link_mix.iter().map(|m| (m.preset.metered(), m.share)).collect();
        let clients = self.federation.clients;
        let dealt = deal_by_share(&mix, clients, self.federation.seed ^ 0x11AC);
        let default = systems.link.is_some_and(LinkPreset::metered);
        (0..clients)
            .map(|i| match systems.client_links.iter().any(|l| l.client == i) {
                true => false,
                false => dealt.get(i).copied().unwrap_or(default),
            })
            .collect()
    }

    /// Every client's link, in client order: an entry of `client_links` first, else a preset
    /// dealt from `link_mix` by share, else `link`, else none (plain loopback).
    pub fn links(&self) -> anyhow::Result<Vec<Option<DuplexProfile>>> {
        let systems = &self.systems;
        let mix: Vec<(DuplexProfile, f64)> = systems.link_mix.iter().map(|m| (m.profile(), m.share)).collect();
        let clients = self.federation.clients;
        let dealt = deal_by_share(&mix, clients, self.federation.seed ^ 0x11AC);
        let default = systems.link.map(LinkPreset::profile);
        let written = systems.client_links.iter().map(|l| &l.profile);
        for profile in mix.iter().map(|(p, _)| p).chain(written) {
            for o in profile.up.outages.iter().chain(&profile.down.outages) {
                o.check()?;
            }
        }
        Ok((0..clients)
            .map(|i| match systems.client_links.iter().find(|l| l.client == i) {
                Some(l) => Some(l.profile.clone()),
                None => dealt.get(i).cloned().or_else(|| default.clone()),
            })
            .collect())
    }
}

impl SystemsConfig {
    /// How many trainings run at once: `threads`, or one per core for 0.
    pub fn training_threads(&self) -> usize {
        match self.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
    }
}

/// Whether `[secagg]` is off (then the run folder's config does not list it).
fn is_off(secagg: &SecAggConfig) -> bool {
    !secagg.enabled
}

impl SimConfig {
    /// A config file's table: the flat keys dealt to the section that declares them, and the
    /// `[model]`, `[method]` and `[data]` tables. An unknown key, or a value of the wrong type,
    /// is refused with its name.
    pub fn from_table(mut table: toml::Table) -> Result<Self, KeyError> {
        let model = table.remove("model").map(|v| section("model", v)).transpose()?.unwrap_or_default();
        let method = table.remove("method").map(|v| section("method", v)).transpose()?.unwrap_or_default();
        let privacy: PrivacyConfig =
            table.remove("privacy").map(|v| section("privacy", v)).transpose()?.unwrap_or_default();
        privacy.check().map_err(|e| KeyError { key: "privacy".into(), message: e.to_string() })?;
        let secagg = table.remove("secagg").map(|v| section("secagg", v)).transpose()?.unwrap_or_default();
        let declared = [
            field_names::<FederationConfig>(),
            field_names::<DataConfig>(),
            field_names::<SystemsConfig>(),
            field_names::<OutputConfig>(),
        ];
        let mut dealt: [toml::Table; 4] = Default::default();
        for (key, value) in table {
            let Some(i) = declared.iter().position(|names| names.contains(&key.as_str())) else {
                let mut known: Vec<&str> = declared.concat();
                known.extend(["model", "method", "privacy", "secagg"]);
                known.sort_unstable();
                let message = format!("unknown key `{key}`: a simulation's keys are `{}`", known.join("`, `"));
                return Err(KeyError { key, message });
            };
            dealt[i].insert(key, value);
        }
        let [federation, data, systems, output] = dealt;
        Ok(Self {
            federation: fields(federation)?,
            data: fields(data)?,
            model,
            method,
            privacy,
            secagg,
            systems: fields(systems)?,
            output: fields(output)?,
        })
    }
}

/// A key of a config file that is unknown or holds a bad value, and why.
#[derive(Debug)]
pub struct KeyError {
    /// The top-level key (`clients`), or the table (`model`) whose key is wrong.
    pub key: String,
    pub message: String,
}

impl std::fmt::Display for KeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for KeyError {}

/// Reads through [`SimConfig::from_table`], from TOML or any format that holds a table.
impl<'de> Deserialize<'de> for SimConfig {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let table = toml::Table::deserialize(deserializer)?;
        Self::from_table(table).map_err(serde::de::Error::custom)
    }
}

/// One table of a config file (`model`, `method`).
fn section<T: serde::de::DeserializeOwned>(key: &str, value: toml::Value) -> Result<T, KeyError> {
    value.try_into().map_err(|e: toml::de::Error| KeyError { key: key.into(), message: format!("[{key}]: {e}") })
}

/// One section's keys: its errors end with the key's path (toml writes "in `clients`").
fn fields<T: serde::de::DeserializeOwned>(keys: toml::Table) -> Result<T, KeyError> {
    toml::Value::Table(keys).try_into().map_err(|e: toml::de::Error| {
        let message = e.to_string().trim_end().to_string();
        let path = message.lines().last().and_then(|l| l.strip_prefix("in `")).unwrap_or_default();
        let key = path.split(['`', '.', '[']).next().unwrap_or_default().to_string();
        KeyError { key, message: message.replace('\n', " ") }
    })
}

/// The keys a section declares: the field names serde's derive hands to `deserialize_struct`,
/// caught by a deserializer that reads nothing. Written here because the sections share one flat
/// table in the file, so each key must be dealt to the section that owns it (serde's `flatten`
/// would deal them, but it cannot refuse unknown keys and loses the key from its errors).
fn field_names<T: serde::de::DeserializeOwned>() -> &'static [&'static str] {
    use serde::de::{Error, Visitor, value};
    struct Probe<'a>(&'a mut &'static [&'static str]);
    impl<'de> serde::Deserializer<'de> for Probe<'_> {
        type Error = value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, value::Error> {
            Err(value::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, value::Error> {
            *self.0 = fields;
            Err(value::Error::custom("fields read"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf option
            unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(Probe(&mut fields));
    fields
}

impl Default for FederationConfig {
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
            round_deadline_secs: 60.0,
            aggregation: AggregationMode::Synchronous,
            robust: RobustConfig::unbounded(),
            attack: None,
            policy: Default::default(),
        }
    }
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            alpha: 0.5,
            train_per_class: 300,
            test_per_class: 100,
            noise: 1.0,
            spec: None,
            data_dir: None,
            rounds_per_task: 0,
            evolving: false,
            target_domains: 1,
        }
    }
}

impl Default for SystemsConfig {
    fn default() -> Self {
        Self {
            clock: Clock::Real,
            encoding: Default::default(),
            top_k: None,
            compress: None,
            link: None,
            link_mix: Vec::new(),
            client_links: Vec::new(),
            devices: Vec::new(),
            straggler_ratio: 0.0,
            kill: Vec::new(),
            threads: 0,
            resume_uploads: true,
            resume_broadcasts: true,
            stop_after_hours: None,
            relays: None,
        }
    }
}

/// `[relays]`: a model of what a relay tier does to round time and bytes. Client i joins relay
/// i mod `count`; each relay runs the server's rounds for its clients (sampling `fraction` of
/// them) and sends one partial aggregate up over its own link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayTier {
    pub count: usize,
    /// Each relay's link to the server (both directions), by preset.
    #[serde(default = "relay_link")]
    pub link: LinkPreset,
    /// Windows in which one relay's link to the server is down (the relay keeps its devices;
    /// what it sends up, and what the server sends it, waits for the link).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outages: Vec<RelayOutage>,
    /// Devices that fail over: in `round`, the relay's ack of the device's update is lost with
    /// its connection, and the device resends the update to the next relay (relay + 1, mod the
    /// count); once that relay acks it, the device goes back to its own. Its update may then be
    /// held by two relays' partials: the root counts it once and the later relay folds its
    /// round again without it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failovers: Vec<RelayFailover>,
    /// Relay processes that restart: in `round`, once the relay has committed its first update
    /// of the round and before that update's ack goes out. The relay resumes from its store (the
    /// server's own, in a temporary folder) as `anchorage-relay` does; its devices' connections
    /// end with the process. They reconnect shortly after, or, while it stays down
    /// (`down_ms`), fail over to the next relay that is up and go back once it is up again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restarts: Vec<RelayRestart>,
}

/// One relay's process restart (`[relays] restarts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayRestart {
    pub relay: usize,
    pub round: u64,
    /// How long the process stays down before it starts again, in ms of simulated time (0: it
    /// starts again at once). A tier with such a restart lets the root go on without that relay.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub down_ms: u64,
}

fn is_zero(ms: &u64) -> bool {
    *ms == 0
}

/// One device's failover (`[relays] failovers`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayFailover {
    pub client: usize,
    pub round: u64,
}

impl SimConfig {
    /// `[relays]` is modelled on the virtual clock only: refused on the others, saying what to use.
    pub fn relays_on_virtual_clock_only(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.systems.relays.is_none(),
            "[relays] is modelled on the virtual clock only (--clock virtual); to run real relays over QUIC start \
             anchorage-relay (deploy/README.md, \"Relays\"), or benches/relays/tier.py on one machine"
        );
        Ok(())
    }
}

fn relay_link() -> LinkPreset {
    LinkPreset::Ethernet
}

/// One relay's link outage, in ms of simulated time from the run's start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayOutage {
    pub relay: usize,
    pub start_ms: u64,
    pub duration_ms: u64,
}

impl SystemsConfig {
    /// How the clients shrink their updates (`top_k`, `compress`, `encoding`).
    pub fn update_compression(&self) -> anyhow::Result<anchorage_client::compress::UpdateCompression> {
        anchorage_client::compress::UpdateCompression::new(self.top_k, self.compress, self.encoding.encoding())
    }
}

impl Default for OutputConfig {
    fn default() -> Self {
        Self { eval_every: 1, eval_fraction: 1.0, selected_accuracy: false }
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

    /// config.toml writes a learning rate as given (0.001, never `0.0010000000474974513`), and
    /// reading it back gives the same f32.
    #[test]
    fn the_learning_rate_is_written_as_given() {
        for lr in [1e-3f32, 0.05, 0.1, 3e-4, 1.0, 0.007_5] {
            let config = SimConfig {
                federation: FederationConfig { learning_rate: lr, ..Default::default() },
                ..SimConfig::default()
            };
            let text = crate::scenario::effective_toml(&config).unwrap();
            let line = text.lines().find(|l| l.starts_with("learning_rate")).unwrap();
            let written: f64 = line.trim_start_matches("learning_rate = ").parse().unwrap();
            assert_eq!(written.to_string(), lr.to_string(), "{line}");
            let back: SimConfig = toml::from_str(&text).unwrap();
            assert_eq!(back.federation.learning_rate.to_bits(), lr.to_bits());
            assert_eq!(back, config, "the run's config.toml reads back as the same configuration");
        }
        assert!(crate::scenario::effective_toml(&SimConfig::default()).unwrap().contains("learning_rate = 0.001\n"));
    }

    /// Every flat key belongs to exactly one section, and none is called like a table.
    #[test]
    fn each_key_has_one_section() {
        let sections = [
            field_names::<FederationConfig>(),
            field_names::<DataConfig>(),
            field_names::<SystemsConfig>(),
            field_names::<OutputConfig>(),
        ];
        let mut keys: Vec<&str> = sections.concat();
        assert_eq!(keys.len(), 42, "{keys:?}");
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), 42, "a key in two sections");
        assert!(!keys.contains(&"model") && !keys.contains(&"method"));
        assert!(keys.contains(&"data"), "the [data] table is the data section's");
    }

    /// A file written before the sections (flat keys, tables) reads into them; a typo or a wrong
    /// value is refused with the key's name.
    #[test]
    fn a_flat_file_reads_into_sections_and_bad_keys_are_named() {
        let text = "clients = 3\nclock = \"virtual\"\neval_every = 2\nalpha = 0.1\n[model]\nhidden = [8]\n";
        let config: SimConfig = toml::from_str(text).unwrap();
        assert_eq!(config.federation.clients, 3);
        assert_eq!(config.systems.clock, Clock::Virtual);
        assert_eq!(config.output.eval_every, 2);
        assert_eq!(config.data.alpha, 0.1);
        assert_eq!(config.model.hidden, vec![8]);
        assert_eq!(config.federation.rounds, FederationConfig::default().rounds);
        let typo = toml::from_str::<SimConfig>("clients = 3\neval_evry = 2\n").unwrap_err().to_string();
        assert!(typo.contains("unknown key `eval_evry`") && typo.contains("`eval_every`"), "{typo}");
        let wrong = toml::from_str::<SimConfig>("clients = -3\n").unwrap_err().to_string();
        assert!(wrong.contains("clients") && wrong.contains("expected usize"), "{wrong}");
        let deep = toml::from_str::<SimConfig>("[model]\nhiden = [3]\n").unwrap_err().to_string();
        assert!(deep.contains("hiden"), "{deep}");
    }
}
