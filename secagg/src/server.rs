//! The server's state machine (Bonawitz et al. 2017, Fig. 4, the server's side of rounds 0, 1, 2
//! and 4, over the graph of Bell et al. 2020, §3). No I/O, no clock: the shell delivers client
//! messages, drains [`ServerState::poll_transmit`], and calls [`ServerState::advance`] when a
//! stage's deadline passes (or when [`ServerState::awaiting`] reaches 0).
//!
//! Masked vectors are added into one running sum as they arrive; no single client's vector,
//! masked or not, is kept. The unmasking itself is in `recover.rs`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use curve25519_dalek::scalar::Scalar;

use crate::error::SecAggError;
use crate::graph::Graph;
use crate::keys;
use crate::mask;
use crate::messages::{
    ClientId, ClientMessage, EncryptedShare, PublicKeys, RoundConfig, ServerMessage, ShareValue, Stage,
};
use crate::shares::{self, CIPHERTEXT_LEN};

/// What [`ServerState::advance`] moved to.
#[derive(Debug, PartialEq, Eq)]
pub enum Advance {
    /// The next stage opened; its messages are queued.
    Next(Stage),
    /// The round finished.
    Done(Aggregate),
}

/// The only output of a round: the sum of the contributors' vectors mod 2^32, and how many.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Aggregate {
    /// The round.
    pub round: u64,
    /// Σ x_u mod 2^32 over the contributors.
    pub sum: Vec<u32>,
    /// How many inputs the sum holds (for the dequantisation and the mean).
    pub contributors: u32,
}

/// The server's side of one SecAgg+ round.
pub struct ServerState {
    pub(crate) config: RoundConfig,
    pub(crate) graph: Graph,
    pub(crate) threshold: usize,
    pub(crate) stage: Stage,
    /// Who may answer the current stage (U0, U1, U2, U3 in turn).
    pub(crate) live: BTreeSet<ClientId>,
    /// Who answered it.
    pub(crate) replied: BTreeSet<ClientId>,
    pub(crate) keys: BTreeMap<ClientId, PublicKeys>,
    /// Round 1's ciphertexts, by sender, until they are forwarded.
    sealed: BTreeMap<ClientId, Vec<(ClientId, EncryptedShare)>>,
    /// The running sum of masked vectors.
    pub(crate) sum: Vec<u32>,
    /// U2 \ U3: shared keys but sent no masked vector.
    pub(crate) dropped: BTreeSet<ClientId>,
    /// Round 4's question to each survivor: (survivors, dropped) among its neighbours.
    asked: BTreeMap<ClientId, (Vec<ClientId>, Vec<ClientId>)>,
    /// Collected shares by owner: (holder, y).
    pub(crate) self_mask_shares: BTreeMap<ClientId, Vec<(ClientId, Scalar)>>,
    pub(crate) mask_key_shares: BTreeMap<ClientId, Vec<(ClientId, Scalar)>>,
    outbox: VecDeque<(ClientId, ServerMessage)>,
}

impl ServerState {
    /// Opens round 0: checks the configuration and queues it for every sampled client.
    pub fn new(config: RoundConfig) -> Result<Self, SecAggError> {
        let (k, threshold) = config.params.effective(config.clients.len())?;
        let graph = Graph::new(&config.clients, k, &config.graph_seed)?;
        let outbox = config.clients.iter().map(|&c| (c, ServerMessage::Setup(config.clone()))).collect();
        Ok(Self {
            live: config.clients.iter().copied().collect(),
            config,
            graph,
            threshold,
            stage: Stage::AdvertiseKeys,
            replied: BTreeSet::new(),
            keys: BTreeMap::new(),
            sealed: BTreeMap::new(),
            sum: Vec::new(),
            dropped: BTreeSet::new(),
            asked: BTreeMap::new(),
            self_mask_shares: BTreeMap::new(),
            mask_key_shares: BTreeMap::new(),
            outbox,
        })
    }

    /// The current stage.
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// The threshold t in force.
    pub fn threshold(&self) -> usize {
        self.threshold
    }

    /// The next message to send, in order.
    pub fn poll_transmit(&mut self) -> Option<(ClientId, ServerMessage)> {
        self.outbox.pop_front()
    }

    /// How many clients the current stage still waits for.
    pub fn awaiting(&self) -> usize {
        self.live.len() - self.replied.len()
    }

    /// Every `u32` vector this state holds: only the running sum of masked vectors, never one
    /// client's (for audits and tests; empty once the sum is output or the round failed).
    pub fn held_vectors(&self) -> Vec<&[u32]> {
        if self.sum.is_empty() { Vec::new() } else { vec![&self.sum[..]] }
    }

    /// The clients whose masked vector is in the sum: those still live once the masked-input
    /// stage closed (before that, those who may still answer).
    pub fn contributors(&self) -> Vec<ClientId> {
        self.live.iter().copied().collect()
    }

    /// Accepts one client message, or refuses it and stays as it was.
    pub fn handle_message(&mut self, from: ClientId, msg: ClientMessage) -> Result<(), SecAggError> {
        if !self.graph.contains(from) {
            return Err(SecAggError::UnknownSender(from));
        }
        if msg.stage() != self.stage {
            return Err(SecAggError::WrongStage { expected: self.stage, got: msg.stage() });
        }
        if msg.round() != self.config.round {
            return Err(SecAggError::WrongRound { expected: self.config.round, got: msg.round() });
        }
        if !self.live.contains(&from) {
            return Err(SecAggError::Excluded(from));
        }
        if self.replied.contains(&from) {
            return Err(SecAggError::Duplicate(from));
        }
        match msg {
            ClientMessage::Keys { keys, .. } => self.on_keys(from, keys),
            ClientMessage::Shares { shares, .. } => self.on_shares(from, shares),
            ClientMessage::Masked { vector, .. } => self.on_masked(&vector),
            ClientMessage::Unmask { self_mask, mask_key, .. } => self.on_unmask(from, &self_mask, &mask_key),
        }?;
        self.replied.insert(from);
        Ok(())
    }

    /// Closes the current stage and opens the next, or outputs the sum. On an error the round
    /// has failed: the running sum is wiped, nothing more is sent and nothing is output.
    pub fn advance(&mut self) -> Result<Advance, SecAggError> {
        let result = match self.stage {
            Stage::AdvertiseKeys => self.close_keys(),
            Stage::ShareKeys => self.close_shares(),
            Stage::MaskedInput => self.close_masked(),
            Stage::Unmask => self.close_unmask().map(Advance::Done),
            Stage::Done | Stage::Failed => {
                return Err(SecAggError::WrongStage { expected: self.stage, got: self.stage });
            }
        };
        match &result {
            Ok(Advance::Next(next)) => self.stage = *next,
            Ok(Advance::Done(_)) => self.stage = Stage::Done,
            Err(_) => self.fail(),
        }
        result
    }

    fn fail(&mut self) {
        self.stage = Stage::Failed;
        self.sum.iter_mut().for_each(|x| *x = 0);
        self.sum = Vec::new();
        self.outbox.clear();
        self.self_mask_shares.clear();
        self.mask_key_shares.clear();
    }

    /// The neighbours of `u` within `set`.
    pub(crate) fn neighbours_in(&self, u: ClientId, set: &BTreeSet<ClientId>) -> Vec<ClientId> {
        self.graph.neighbours(u).into_iter().filter(|v| set.contains(v)).collect()
    }

    /// Drops clients with fewer than t neighbours in `set` until none is left (their shares
    /// could not reach t holders).
    fn prune(&self, mut set: BTreeSet<ClientId>) -> BTreeSet<ClientId> {
        loop {
            let short: Vec<ClientId> =
                set.iter().copied().filter(|&u| self.neighbours_in(u, &set).len() < self.threshold).collect();
            if short.is_empty() {
                return set;
            }
            short.iter().for_each(|u| {
                set.remove(u);
            });
        }
    }

    fn on_keys(&mut self, from: ClientId, keys: PublicKeys) -> Result<(), SecAggError> {
        if !keys::usable(&keys.mask) || !keys::usable(&keys.encrypt) {
            return Err(SecAggError::BadKey(from));
        }
        self.keys.insert(from, keys);
        Ok(())
    }

    fn on_shares(&mut self, from: ClientId, shares: Vec<(ClientId, EncryptedShare)>) -> Result<(), SecAggError> {
        let expected = self.neighbours_in(from, &self.live);
        let mut seen = BTreeSet::new();
        for (to, ct) in &shares {
            if expected.binary_search(to).is_err() {
                return Err(SecAggError::NotNeighbour(*to));
            }
            if ct.0.len() != CIPHERTEXT_LEN {
                return Err(SecAggError::WrongLength {
                    what: "encrypted share",
                    expected: CIPHERTEXT_LEN,
                    got: ct.0.len(),
                });
            }
            if !seen.insert(*to) {
                return Err(SecAggError::Duplicate(*to));
            }
        }
        if shares.len() != expected.len() {
            return Err(SecAggError::WrongLength { what: "share list", expected: expected.len(), got: shares.len() });
        }
        self.sealed.insert(from, shares);
        Ok(())
    }

    fn on_masked(&mut self, vector: &[u32]) -> Result<(), SecAggError> {
        if vector.len() != self.sum.len() {
            return Err(SecAggError::WrongLength {
                what: "masked vector",
                expected: self.sum.len(),
                got: vector.len(),
            });
        }
        mask::add_into(&mut self.sum, vector);
        Ok(())
    }

    fn on_unmask(
        &mut self,
        from: ClientId,
        self_mask: &[(ClientId, ShareValue)],
        mask_key: &[(ClientId, ShareValue)],
    ) -> Result<(), SecAggError> {
        let (survivors, dropped) = self.asked.get(&from).ok_or(SecAggError::Excluded(from))?;
        let b = answer(from, survivors, self_mask)?;
        let s = answer(from, dropped, mask_key)?;
        for (owner, y) in b {
            self.self_mask_shares.entry(owner).or_default().push((from, y));
        }
        for (owner, y) in s {
            self.mask_key_shares.entry(owner).or_default().push((from, y));
        }
        Ok(())
    }

    /// Round 0 closes: U1 = who advertised usable keys (pruned); each gets its neighbours' keys.
    fn close_keys(&mut self) -> Result<Advance, SecAggError> {
        let replied = std::mem::take(&mut self.replied);
        let live = self.prune(replied);
        if live.is_empty() {
            return Err(SecAggError::BelowThreshold {
                what: "clients that advertised keys",
                have: 0,
                need: self.threshold + 1,
            });
        }
        self.keys.retain(|c, _| live.contains(c));
        for &u in &live {
            let keys = self.neighbours_in(u, &live).into_iter().map(|v| (v, self.keys[&v])).collect();
            self.outbox.push_back((u, ServerMessage::ShareKeys { round: self.config.round, keys }));
        }
        self.live = live;
        Ok(Advance::Next(Stage::ShareKeys))
    }

    /// Round 1 closes: U2 = who sent shares (pruned); each gets the ciphertexts addressed to it.
    fn close_shares(&mut self) -> Result<Advance, SecAggError> {
        let replied = std::mem::take(&mut self.replied);
        let live = self.prune(replied);
        if live.is_empty() {
            return Err(SecAggError::BelowThreshold {
                what: "clients that shared keys",
                have: 0,
                need: self.threshold + 1,
            });
        }
        let mut inbox: BTreeMap<ClientId, Vec<(ClientId, EncryptedShare)>> =
            live.iter().map(|&u| (u, Vec::new())).collect();
        for (from, sealed) in std::mem::take(&mut self.sealed).into_iter().filter(|(f, _)| live.contains(f)) {
            for (to, ct) in sealed {
                if let Some(list) = inbox.get_mut(&to) {
                    list.push((from, ct));
                }
            }
        }
        for (u, shares) in inbox {
            self.outbox.push_back((u, ServerMessage::CollectMasked { round: self.config.round, shares }));
        }
        self.live = live;
        self.sum = vec![0; self.config.vector_len as usize];
        Ok(Advance::Next(Stage::MaskedInput))
    }

    /// Round 2 closes: U3 = who sent a masked vector. Every client of U2 must keep t surviving
    /// neighbours (or its b_u or s_u could not be rebuilt); then each survivor is asked.
    fn close_masked(&mut self) -> Result<Advance, SecAggError> {
        let survivors = std::mem::take(&mut self.replied);
        for &u in &self.live {
            let have = self.neighbours_in(u, &survivors).len();
            if have < self.threshold {
                return Err(SecAggError::BelowThreshold { what: "surviving neighbours", have, need: self.threshold });
            }
        }
        self.dropped = self.live.difference(&survivors).copied().collect();
        for &u in &survivors {
            let s = self.neighbours_in(u, &survivors);
            let d = self.neighbours_in(u, &self.dropped);
            self.outbox.push_back((
                u,
                ServerMessage::Unmask { round: self.config.round, survivors: s.clone(), dropped: d.clone() },
            ));
            self.asked.insert(u, (s, d));
        }
        self.live = survivors;
        Ok(Advance::Next(Stage::Unmask))
    }
}

/// Checks one round-4 answer covers exactly the owners asked about, once each, with field elements.
fn answer(
    from: ClientId,
    asked: &[ClientId],
    given: &[(ClientId, ShareValue)],
) -> Result<Vec<(ClientId, Scalar)>, SecAggError> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::with_capacity(given.len());
    for (owner, y) in given {
        if asked.binary_search(owner).is_err() {
            return Err(SecAggError::WrongPeer { from });
        }
        if !seen.insert(*owner) {
            return Err(SecAggError::Duplicate(*owner));
        }
        out.push((*owner, shares::parse(y, from)?));
    }
    if out.len() != asked.len() {
        return Err(SecAggError::WrongLength { what: "share answer", expected: asked.len(), got: out.len() });
    }
    Ok(out)
}
