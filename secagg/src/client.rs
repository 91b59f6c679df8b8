//! The client's state machine (Bonawitz et al. 2017, Fig. 4, the user's side of rounds 0, 1, 2 and
//! 4, on the neighbourhood of Bell et al. 2020, §3). No I/O: the shell hands in each server message
//! and sends back the one reply. The unmasked input lives only here and is wiped once masked.
//! It may arrive late: a device advertises and shares keys while it trains, and its input is
//! needed only for round 2 ([`ClientState::awaiting_input`], [`ClientState::provide_input`]).

use std::collections::BTreeMap;

use chacha20::ChaCha20Rng;
use chacha20::rand_core::SeedableRng;

use crate::error::SecAggError;
use crate::graph::Graph;
use crate::keys::{self, Secrets};
use crate::mask::{self, Op};
use crate::messages::{ClientId, ClientMessage, EncryptedShare, PublicKeys, RoundConfig, ServerMessage, Stage};
use crate::shares::{self, CIPHERTEXT_LEN, SharePair};

/// Which of a peer's two shares this client revealed in round 4.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Revealed {
    SelfMask,
    MaskKey,
}

/// What round 0 fixed.
struct RoundInfo {
    number: u64,
    neighbours: Vec<ClientId>,
    threshold: usize,
    vector_len: u32,
}

/// One client's side of one SecAgg+ round.
pub struct ClientState {
    id: ClientId,
    rng: ChaCha20Rng,
    stage: Stage,
    /// `None` until provided, and again once masked.
    input: Option<Vec<u32>>,
    round: Option<RoundInfo>,
    secrets: Option<Secrets>,
    peers: BTreeMap<ClientId, PublicKeys>,
    held: BTreeMap<ClientId, SharePair>,
    revealed: BTreeMap<ClientId, Revealed>,
}

impl ClientState {
    /// A client with its quantised input for this round. `entropy` must be 32 fresh random bytes
    /// (from the OS in production); every round needs a new `ClientState` and new entropy.
    pub fn new(id: ClientId, input: Vec<u32>, entropy: [u8; 32]) -> Self {
        let mut client = Self::awaiting_input(id, entropy);
        client.input = Some(input);
        client
    }

    /// A client whose input is not there yet (it is still training): rounds 0 and 1 run without
    /// it, and round 2 is refused with [`SecAggError::NoInput`] until [`Self::provide_input`].
    pub fn awaiting_input(id: ClientId, entropy: [u8; 32]) -> Self {
        Self {
            id,
            rng: ChaCha20Rng::from_seed(entropy),
            stage: Stage::AdvertiseKeys,
            input: None,
            round: None,
            secrets: None,
            peers: BTreeMap::new(),
            held: BTreeMap::new(),
            revealed: BTreeMap::new(),
        }
    }

    /// Sets (or replaces) the quantised input, any time before the masked vector is produced;
    /// after that the input is wiped unused. Its length is checked in round 2.
    pub fn provide_input(&mut self, mut input: Vec<u32>) {
        if let Some(old) = self.input.as_mut() {
            wipe(old);
        }
        if self.masked() {
            wipe(&mut input);
            self.input = None;
        } else {
            self.input = Some(input);
        }
    }

    /// True while the round still needs an input that was not provided.
    pub fn needs_input(&self) -> bool {
        self.input.is_none() && !self.masked()
    }

    /// The masked vector was produced (round 2 answered).
    fn masked(&self) -> bool {
        matches!(self.stage, Stage::Unmask | Stage::Done | Stage::Failed)
    }

    /// This client's id.
    pub fn id(&self) -> ClientId {
        self.id
    }

    /// The stage whose server message this client expects next (`Done` after round 4).
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// Handles one server message and returns the reply, or refuses it and stays as it was.
    pub fn handle_message(&mut self, msg: ServerMessage) -> Result<ClientMessage, SecAggError> {
        if let (Stage::Done, ServerMessage::Unmask { survivors, dropped, .. }) = (self.stage, &msg) {
            return Err(self.refuse_again(survivors, dropped));
        }
        if msg.stage() != self.stage {
            return Err(SecAggError::WrongStage { expected: self.stage, got: msg.stage() });
        }
        let reply = match msg {
            ServerMessage::Setup(config) => self.on_setup(config),
            ServerMessage::ShareKeys { round, keys } => self.on_share_keys(round, keys),
            ServerMessage::CollectMasked { round, shares } => self.on_collect(round, shares),
            ServerMessage::Unmask { round, survivors, dropped } => self.on_unmask(round, &survivors, &dropped),
        }?;
        self.stage = self.stage.next();
        Ok(reply)
    }

    /// The round's facts, once round 0 fixed them, after checking `round` against them.
    fn round(&self, round: u64) -> Result<(&RoundInfo, &Secrets), SecAggError> {
        checked(&self.round, &self.secrets, round)
    }

    /// Round 0: check the configuration, draw the secrets, advertise the public keys.
    fn on_setup(&mut self, config: RoundConfig) -> Result<ClientMessage, SecAggError> {
        let (k, t) = config.params.effective(config.clients.len())?;
        let graph = Graph::new(&config.clients, k, &config.graph_seed)?;
        if !graph.contains(self.id) {
            return Err(SecAggError::BadParams("this client is not in the round's sample"));
        }
        if let Some(input) = &self.input {
            check_len(config.vector_len, input)?;
        }
        let secrets = Secrets::generate(&mut self.rng);
        let keys = secrets.public();
        let neighbours = graph.neighbours(self.id);
        self.round = Some(RoundInfo { number: config.round, neighbours, threshold: t, vector_len: config.vector_len });
        self.secrets = Some(secrets);
        Ok(ClientMessage::Keys { round: config.round, keys })
    }

    /// Round 1: check the neighbours' keys, share b_u and s_u among them, encrypt each pair.
    fn on_share_keys(&mut self, round: u64, keys: Vec<(ClientId, PublicKeys)>) -> Result<ClientMessage, SecAggError> {
        let (info, secrets) = checked(&self.round, &self.secrets, round)?;
        let mut peers = BTreeMap::new();
        for (v, pk) in keys {
            if info.neighbours.binary_search(&v).is_err() {
                return Err(SecAggError::NotNeighbour(v));
            }
            if !keys::usable(&pk.mask) || !keys::usable(&pk.encrypt) {
                return Err(SecAggError::BadKey(v));
            }
            if peers.insert(v, pk).is_some() {
                return Err(SecAggError::Duplicate(v));
            }
        }
        if peers.len() < info.threshold {
            return Err(SecAggError::BelowThreshold {
                what: "neighbours with keys",
                have: peers.len(),
                need: info.threshold,
            });
        }
        let shares = seal_shares(self.id, round, info.threshold, secrets, &peers, &mut self.rng)?;
        self.peers = peers;
        Ok(ClientMessage::Shares { round, shares })
    }

    /// Round 2: open the shares addressed here, then mask the input with b_u and every sender.
    /// Without an input it is refused with [`SecAggError::NoInput`] and nothing changes.
    fn on_collect(
        &mut self,
        round: u64,
        shares: Vec<(ClientId, EncryptedShare)>,
    ) -> Result<ClientMessage, SecAggError> {
        let (info, _) = self.round(round)?;
        let threshold = info.threshold;
        check_len(info.vector_len, self.input.as_ref().ok_or(SecAggError::NoInput)?)?;
        let mut held = BTreeMap::new();
        for (v, ct) in shares {
            if held.contains_key(&v) {
                return Err(SecAggError::Duplicate(v));
            }
            held.insert(v, self.open_share(round, v, &ct)?);
        }
        if held.len() < threshold {
            return Err(SecAggError::BelowThreshold { what: "shares received", have: held.len(), need: threshold });
        }
        let vector = self.masked_input(round, &held)?;
        if let Some(mut input) = self.input.take() {
            wipe(&mut input);
        }
        self.held = held;
        Ok(ClientMessage::Masked { round, vector })
    }

    /// Decrypts and checks one share pair from `v`.
    fn open_share(&self, round: u64, v: ClientId, ct: &EncryptedShare) -> Result<SharePair, SecAggError> {
        let (_, secrets) = self.round(round)?;
        let pk = self.peers.get(&v).ok_or(SecAggError::NotNeighbour(v))?;
        if ct.0.len() != CIPHERTEXT_LEN {
            return Err(SecAggError::WrongLength {
                what: "encrypted share",
                expected: CIPHERTEXT_LEN,
                got: ct.0.len(),
            });
        }
        let shared = keys::agree(&secrets.encrypt_key, &pk.encrypt, v)?;
        let key = keys::share_key(&shared, round, v, self.id);
        let plain = keys::open(&key, &keys::share_aad(round, v, self.id), &ct.0).ok_or(SecAggError::BadTag(v))?;
        let pair = SharePair::from_bytes(&plain).ok_or(SecAggError::WrongPeer { from: v })?;
        if pair.owner != v || pair.holder != self.id || pair.round != round {
            return Err(SecAggError::WrongPeer { from: v });
        }
        shares::parse(&pair.self_mask, v)?;
        shares::parse(&pair.mask_key, v)?;
        Ok(pair)
    }

    /// y_u = x_u + PRG(b_u) + Σ_{v ∈ held} ±PRG(s_{u,v}) mod 2^32.
    fn masked_input(&self, round: u64, held: &BTreeMap<ClientId, SharePair>) -> Result<Vec<u32>, SecAggError> {
        let (_, secrets) = self.round(round)?;
        let mut y = self.input.clone().ok_or(SecAggError::NoInput)?;
        mask::apply(&mut y, &keys::self_mask_seed(&secrets.self_seed, round), Op::Add);
        for &v in held.keys() {
            let shared = keys::agree(&secrets.mask_key, &self.peers[&v].mask, v)?;
            mask::apply(&mut y, &keys::pairwise_seed(&shared, round, self.id, v), Op::pairwise(self.id, v));
        }
        Ok(y)
    }

    /// Round 4: reveal b_v shares of survivors and s_v shares of the dropped, never both of one v.
    fn on_unmask(
        &mut self,
        round: u64,
        survivors: &[ClientId],
        dropped: &[ClientId],
    ) -> Result<ClientMessage, SecAggError> {
        let (info, _) = self.round(round)?;
        let threshold = info.threshold;
        let mut asked = BTreeMap::new();
        for (list, kind) in [(survivors, Revealed::SelfMask), (dropped, Revealed::MaskKey)] {
            for &v in list {
                if !self.held.contains_key(&v) {
                    return Err(SecAggError::Inconsistent("a listed client sent this client no share"));
                }
                match asked.insert(v, kind) {
                    Some(k) if k != kind => return Err(SecAggError::BothShares(v)),
                    Some(_) => return Err(SecAggError::Duplicate(v)),
                    None => {}
                }
            }
        }
        if asked.len() != self.held.len() {
            return Err(SecAggError::Inconsistent("a neighbour is neither survivor nor dropped"));
        }
        if survivors.len() < threshold {
            return Err(SecAggError::BelowThreshold {
                what: "surviving neighbours",
                have: survivors.len(),
                need: threshold,
            });
        }
        let self_mask = survivors.iter().map(|v| (*v, self.held[v].self_mask)).collect();
        let mask_key = dropped.iter().map(|v| (*v, self.held[v].mask_key)).collect();
        self.revealed = asked;
        Ok(ClientMessage::Unmask { round, self_mask, mask_key })
    }

    /// A second round-4 request: refused, and named `BothShares` where it asks for the other share.
    fn refuse_again(&self, survivors: &[ClientId], dropped: &[ClientId]) -> SecAggError {
        let flips = |list: &[ClientId], other| list.iter().copied().find(|v| self.revealed.get(v) == Some(&other));
        match flips(survivors, Revealed::MaskKey).or_else(|| flips(dropped, Revealed::SelfMask)) {
            Some(v) => SecAggError::BothShares(v),
            None => SecAggError::WrongStage { expected: Stage::Done, got: Stage::Unmask },
        }
    }
}

/// Refuses an input whose length is not the round's.
fn check_len(vector_len: u32, input: &[u32]) -> Result<(), SecAggError> {
    if vector_len as usize != input.len() {
        return Err(SecAggError::WrongLength { what: "input vector", expected: vector_len as usize, got: input.len() });
    }
    Ok(())
}

/// Zeroes an input before it is dropped.
fn wipe(input: &mut [u32]) {
    input.iter_mut().for_each(|x| *x = 0);
}

/// The round's facts and secrets once round 0 fixed them, if `round` is that round.
fn checked<'a>(
    info: &'a Option<RoundInfo>,
    secrets: &'a Option<Secrets>,
    round: u64,
) -> Result<(&'a RoundInfo, &'a Secrets), SecAggError> {
    let (Some(info), Some(secrets)) = (info, secrets) else {
        return Err(SecAggError::WrongStage { expected: Stage::AdvertiseKeys, got: Stage::ShareKeys });
    };
    if info.number != round {
        return Err(SecAggError::WrongRound { expected: info.number, got: round });
    }
    Ok((info, secrets))
}

/// Splits b_u and s_u among `peers` (t of them reconstruct) and seals one pair to each.
fn seal_shares(
    id: ClientId,
    round: u64,
    threshold: usize,
    secrets: &Secrets,
    peers: &BTreeMap<ClientId, PublicKeys>,
    rng: &mut ChaCha20Rng,
) -> Result<Vec<(ClientId, EncryptedShare)>, SecAggError> {
    let holders: Vec<ClientId> = peers.keys().copied().collect();
    let b = shares::split(&secrets.self_seed, &holders, threshold, rng)?;
    let s = shares::split(&secrets.mask_scalar, &holders, threshold, rng)?;
    let mut out = Vec::with_capacity(holders.len());
    for (i, (&v, pk)) in peers.iter().enumerate() {
        let pair = SharePair { round, owner: id, holder: v, self_mask: b[i], mask_key: s[i] };
        let shared = keys::agree(&secrets.encrypt_key, &pk.encrypt, v)?;
        let key = keys::share_key(&shared, round, id, v);
        out.push((v, EncryptedShare(keys::seal(&key, &keys::share_aad(round, id, v), &pair.to_bytes()))));
    }
    Ok(out)
}

#[cfg(test)]
impl ClientState {
    /// This client's secrets, for tests that play a malicious peer.
    pub(crate) fn secrets(&self) -> Option<&Secrets> {
        self.secrets.as_ref()
    }
}
