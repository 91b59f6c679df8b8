//! Secure aggregation of a synchronous round (SecAgg+, Bell et al. 2020, over
//! `anchorage-secagg`): the server learns the sum of the round's updates and nothing else.
//!
//! The round opens as always (invitations persisted, the broadcast); then each invited device
//! gets round 0's `Setup` with the round's [`Layout`] (its vector: the clipped delta, the
//! per-class prototype sums and counts). Keys and shares travel while the devices train; the
//! masked vectors come when they have trained, until the round's deadline; then the survivors
//! unmask. Each stage but the masked input closes when every live device answered or
//! `stage_timeout` after it opened. The sum, dequantised, is the method's only input: one
//! update holding the mean delta and every class's summed prototype and count. Its
//! contributors are acked `aggregated: true` only then: an ack still means "in this round's
//! aggregate".
//!
//! What the server keeps: [`anchorage_secagg::ServerState`] adds each masked vector into one
//! running sum and holds no device's vector; nothing of a device's reaches the store (no
//! `Persist::Accepted`). A server that restarts mid-round has lost the running sum and the
//! shares: the resumed round fails ([`failed_after_restart`]) and the next one opens.
//!
//! Screening works on sums only: each device clips its own delta to `clip` (the layout says
//! so), the server cannot check one update, and `check_config` refuses every rule that needs
//! individual updates.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anchorage_secagg::{
    Advance, Aggregate, ClientMessage, Layout, Params, RoundConfig, SecAggError, ServerFrame, ServerState, Stage,
};
use anchorage_shared::protocol::{Message, SecAggFrame, Update};
use anchorage_shared::rng::Rng;
use anchorage_shared::tensor::ParamBlock;
use serde::{Deserialize, Serialize};

use super::config::duration_ms;
use super::{ClientId, ConfigError};

/// `[engine.secagg]`: secure aggregation (off by default). The devices' `secure_aggregation`
/// (client.toml) must be on too: a device never sends its update in the clear when it is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecAggConfig {
    pub enabled: bool,
    /// L2 clip of each device's delta (all blocks as one vector), applied on the device.
    pub clip: f32,
    /// Prototype classes every vector holds (0: the method sends none) and their dimension.
    pub classes: u32,
    pub prototype_dim: u32,
    /// Norm bound of one sample's feature: a class's sum is clipped to count × this.
    pub prototype_clip: f32,
    /// The largest per-class count one device may contribute (larger counts are capped).
    pub max_count: u32,
    /// The share of invited devices expected to drop: sizes the graph and threshold
    /// (`Params::recommended`, Bell et al. 2020, §3).
    pub dropout: f64,
    /// How long the key and share stages, and the unmasking, wait for answers.
    #[serde(with = "duration_ms")]
    pub stage_timeout: Duration,
}

impl Default for SecAggConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            clip: 1.0,
            classes: 0,
            prototype_dim: 0,
            prototype_clip: 10.0,
            max_count: 100_000,
            dropout: 0.3,
            stage_timeout: Duration::from_secs(30),
        }
    }
}

impl SecAggConfig {
    /// The layout of round vectors for a model of `global`'s blocks, summed over at most
    /// `max_clients` devices.
    pub fn layout(&self, global: &[ParamBlock], max_clients: usize) -> Layout {
        Layout {
            blocks: global.iter().map(|b| (b.name.clone(), b.tensor.shape.clone())).collect(),
            classes: self.classes,
            dim: self.prototype_dim,
            clip: self.clip,
            prototype_clip: self.prototype_clip,
            max_count: self.max_count,
            max_clients: max_clients.max(1) as u32,
            weight_scale: 0.0,
        }
    }
}

/// The sample count of a full weight in a SecAgg round ([`Layout::weight`]): the invited
/// devices' claimed counts (their hellos'), capped at `max_samples`; the largest of them, or
/// with `weight_cap` that many times their lower median, so that no device's voice exceeds the
/// bound the plain path's `bound_round` gives it. Under differential privacy every weight is 1
/// (0: equal weights), as the noise is calibrated to equal weights.
pub(super) fn weight_scale(mut counts: Vec<u64>, robust: &crate::aggregate::RobustConfig, private: bool) -> f32 {
    counts.iter_mut().for_each(|c| *c = (*c).clamp(1, robust.max_samples.max(1)));
    counts.sort_unstable();
    if private || counts.is_empty() {
        return 0.0;
    }
    let largest = counts[counts.len() - 1] as f64;
    let capped = robust.weight_cap.map_or(largest, |cap| largest.min(cap * counts[(counts.len() - 1) / 2] as f64));
    capped as f32
}

/// Refuses an `[engine.secagg]` whose values cannot hold: a prototype method without the
/// prototypes' place in the vector, a dropout outside [0, 1), or a layout whose sums could
/// overflow. Which features it combines with is the compatibility table's ([`super::compat`]).
pub(super) fn check_config(
    engine: &super::EngineConfig,
    method: &anchorage_shared::method::MethodConfig,
) -> Result<(), ConfigError> {
    let config = &engine.secagg;
    if !config.enabled {
        return Ok(());
    }
    let sends_prototypes = super::privacy::sends_prototypes(method.name());
    if sends_prototypes && (config.classes == 0 || config.prototype_dim == 0) {
        return Err(ConfigError::SecAgg(format!(
            "[engine.secagg] with `{}`: its prototypes need a place in every device's vector: set classes \
             (the data's classes) and prototype_dim (the prototypes' dimension)",
            method.name()
        )));
    }
    if !(config.dropout.is_finite() && (0.0..1.0).contains(&config.dropout)) {
        return Err(ConfigError::SecAgg("[engine.secagg] dropout must be in [0, 1)".into()));
    }
    config.layout(&[], MAX_DEVICES).check().map_err(|e| ConfigError::SecAgg(format!("[engine.secagg]: {e}")))
}

/// The most devices one SecAgg round is checked for at start (each round's quantisers are
/// sized for its own invitations).
pub const MAX_DEVICES: usize = 10_000;

/// What screening means under secure aggregation, said once at start (`[engine.secagg]` on).
pub(super) fn log_screening(config: &super::EngineConfig) {
    if !config.secagg.enabled {
        return;
    }
    tracing::info!(
        clip = config.secagg.clip,
        max_abs_value = config.robust.max_abs_value,
        "secure aggregation: the server sees only each round's sum, so no update is screened on its own \
         (max_norm, max_norm_z, norm_cap, min_norm_ratio and max_sign_agreement do not run); each device clips \
         its delta to `clip` itself (a bound it does not prove), weights are capped by weight_cap × the \
         invited devices' lower median claimed count, and the sum is checked for finite values within max_abs_value"
    );
}

/// What a SecAgg round did (in its round report; `anchorage_secagg_*` on /metrics).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SecAggReport {
    /// Devices whose masked vector is in the sum.
    pub contributors: usize,
    /// Devices that shared keys but sent no masked vector: their masks were removed from shares.
    pub dropped_after_masking: usize,
    /// The share threshold t and graph degree k of the round.
    pub threshold: usize,
    /// Elements of each device's vector.
    pub vector_len: usize,
    /// Refused SecAgg messages by reason.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub refused: BTreeMap<String, u64>,
    /// Why the protocol failed, if it did (nothing was output).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

/// What a step of the round's protocol came to.
pub(super) enum Step {
    /// Waiting for answers (or the next stage opened and its messages are queued).
    Waiting,
    /// The sum, dequantised into one update, and the devices in it.
    Done { update: Box<Update>, contributors: Vec<ClientId> },
    /// The protocol failed; nothing was output.
    Failed(String),
}

/// One round's secure aggregation on the server.
pub(super) struct SecAggRound {
    state: ServerState,
    layout: Layout,
    /// Device ids by SecAgg id (the sorted invitations), and back.
    devices: Vec<ClientId>,
    ids: BTreeMap<ClientId, anchorage_secagg::ClientId>,
    /// When the current stage gives up waiting (`None`: the masked input, until the round's deadline).
    stage_deadline: Option<Duration>,
    stage_timeout: Duration,
    report: SecAggReport,
    /// Devices that shared keys (U2), for counting those that dropped after.
    shared: usize,
    /// The current stage's message to each device that has not answered it (sent again after
    /// a reconnect).
    unanswered: BTreeMap<ClientId, Message>,
}

impl std::fmt::Debug for SecAggRound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecAggRound").field("stage", &self.state.stage()).field("devices", &self.devices.len()).finish()
    }
}

impl SecAggRound {
    /// Round 0 for the `invited` devices: the Setup, with the layout, queued for each.
    pub(super) fn open(
        config: &SecAggConfig,
        (round, seed, weight_scale): (u64, u64, f32),
        invited: &BTreeSet<ClientId>,
        global: &[ParamBlock],
        now: Duration,
    ) -> Result<Self, anchorage_secagg::SecAggError> {
        let devices: Vec<ClientId> = invited.iter().cloned().collect();
        let layout = Layout { weight_scale, ..config.layout(global, devices.len()) };
        layout.check()?;
        let mut rng = Rng::derive(seed ^ 0x5EC_A66, round);
        let mut graph_seed = [0u8; 32];
        graph_seed.chunks_exact_mut(8).for_each(|c| c.copy_from_slice(&rng.next_u64().to_le_bytes()));
        let clients: Vec<_> = (0..devices.len() as u32).map(anchorage_secagg::ClientId).collect();
        let round_config = RoundConfig {
            round,
            params: Params::recommended(devices.len(), config.dropout),
            clients,
            graph_seed,
            vector_len: layout.vector_len() as u32,
        };
        let state = ServerState::new(round_config)?;
        let ids = devices.iter().enumerate().map(|(i, d)| (d.clone(), anchorage_secagg::ClientId(i as u32))).collect();
        let report =
            SecAggReport { threshold: state.threshold(), vector_len: layout.vector_len(), ..Default::default() };
        Ok(Self {
            state,
            layout,
            devices,
            ids,
            stage_deadline: Some(now + config.stage_timeout),
            stage_timeout: config.stage_timeout,
            report,
            shared: 0,
            unanswered: BTreeMap::new(),
        })
    }

    /// The protocol's messages to send, each as a `SecAgg` frame to its device (round 0's with
    /// the layout).
    pub(super) fn transmit(&mut self, round: u64) -> Vec<(ClientId, Message)> {
        let mut out = Vec::new();
        while let Some((to, message)) = self.state.poll_transmit() {
            let Some(device) = self.devices.get(to.0 as usize) else { continue };
            let setup = message.stage() == Stage::AdvertiseKeys;
            let (layout, you) = if setup { (Some(self.layout.clone()), Some(to)) } else { (None, None) };
            let body = ServerFrame { layout, you, message }.encode();
            let msg = Message::SecAgg(SecAggFrame { round, body });
            self.unanswered.insert(device.clone(), msg.clone());
            out.push((device.clone(), msg));
        }
        out
    }

    /// The current stage's message to `device` again, if it has not answered it.
    pub(super) fn resend(&self, device: &str) -> Option<Message> {
        self.unanswered.get(device).cloned()
    }

    /// A device's SecAgg message; a refusal (undecodable, wrong round or stage, a bad key,
    /// share or vector) is counted by reason and returned with its detail.
    pub(super) fn on_message(&mut self, device: &str, frame: &SecAggFrame) -> Result<(), (&'static str, String)> {
        let result = self.accept(device, frame);
        match &result {
            Ok(()) => drop(self.unanswered.remove(device)),
            Err((reason, _)) => *self.report.refused.entry((*reason).to_string()).or_default() += 1,
        }
        result
    }

    fn accept(&mut self, device: &str, frame: &SecAggFrame) -> Result<(), (&'static str, String)> {
        let refuse = |e: SecAggError| (e.reason(), e.to_string());
        let id =
            *self.ids.get(device).ok_or(("not_invited", "not invited to this round's secure aggregation".into()))?;
        let msg = ClientMessage::decode(&frame.body).map_err(refuse)?;
        if msg.round() != frame.round {
            return Err((
                "wrong_round",
                format!("a frame of round {} holds a message of round {}", frame.round, msg.round()),
            ));
        }
        self.state.handle_message(id, msg).map_err(refuse)
    }

    /// When the protocol next needs the clock: the stage's timeout, or the round's deadline
    /// during the masked input.
    pub(super) fn timeout(&self, round_deadline: Duration) -> Duration {
        self.stage_deadline.unwrap_or(round_deadline)
    }

    /// Moves the protocol on as far as `now` allows: a stage closes when every live device
    /// answered or its time is up.
    pub(super) fn step(&mut self, now: Duration, round_deadline: Duration, global: &[ParamBlock]) -> Step {
        loop {
            let due = self.state.awaiting() == 0 || now >= self.timeout(round_deadline);
            if !due {
                return Step::Waiting;
            }
            let closing = self.state.stage();
            let timed_out = self.state.awaiting() > 0 && self.stage_deadline.is_some();
            match self.state.advance() {
                Ok(Advance::Next(next)) => {
                    if closing == Stage::ShareKeys {
                        self.shared = self.state.contributors().len();
                    }
                    if next == Stage::Unmask {
                        self.report.dropped_after_masking = self.shared.saturating_sub(self.state.contributors().len());
                    }
                    self.stage_deadline = (next != Stage::MaskedInput).then(|| now + self.stage_timeout);
                    self.unanswered.clear();
                }
                Ok(Advance::Done(aggregate)) => return self.done(aggregate, global),
                Err(e) if timed_out => {
                    let waited = self.stage_timeout.as_secs_f64();
                    return self.fail(format!(
                        "{e} (the {closing:?} stage waited its stage_timeout, {waited} s: raise it for slow links)"
                    ));
                }
                Err(e) => return self.fail(e.to_string()),
            }
        }
    }

    /// The unmasked sum as one update for the method.
    fn done(&mut self, aggregate: Aggregate, global: &[ParamBlock]) -> Step {
        let contributors: Vec<ClientId> =
            self.state.contributors().iter().filter_map(|id| self.devices.get(id.0 as usize).cloned()).collect();
        self.report.contributors = contributors.len();
        match self.layout.decode(&aggregate.sum, aggregate.contributors, global, aggregate.round) {
            Ok(update) => Step::Done { update: Box::new(update), contributors },
            Err(e) => self.fail(format!("the sum does not decode: {e}")),
        }
    }

    fn fail(&mut self, why: String) -> Step {
        tracing::error!(reason = %why, "secure aggregation failed: nothing was output");
        self.report.failed = Some(why.clone());
        Step::Failed(why)
    }

    /// The report of the round so far.
    pub(super) fn report(&self) -> SecAggReport {
        self.report.clone()
    }

    /// How many vectors the server holds for this round: the running sum only, never a
    /// device's (audits and tests).
    pub(super) fn held_vectors(&self) -> usize {
        self.state.held_vectors().len()
    }
}

/// The report of a round that was open under secure aggregation when the server stopped.
pub(super) fn failed_after_restart() -> String {
    "the server restarted during secure aggregation: the running sum and the shares were in memory only".into()
}
