//! The crate's protocol tests: a harness that carries messages between one [`ServerState`] and
//! its [`ClientState`]s through their postcard encodings, as a shell would.

mod input;
mod layout;
mod malformed;
mod privacy;
mod rounds;

use std::collections::{BTreeMap, BTreeSet};

use chacha20::ChaCha20Rng;
use chacha20::rand_core::{Rng, SeedableRng};

use crate::{
    Advance, Aggregate, ClientId, ClientMessage, ClientState, Params, RoundConfig, SecAggError, ServerMessage,
    ServerState,
};

/// One round in progress: the server, the clients, and every client's true input.
pub(crate) struct Harness {
    pub server: ServerState,
    pub clients: BTreeMap<ClientId, ClientState>,
    pub inputs: BTreeMap<ClientId, Vec<u32>>,
    pub round: u64,
}

/// Ids that are neither contiguous nor from 0, to catch index/id mix-ups.
pub(crate) fn ids(n: u32) -> Vec<ClientId> {
    (0..n).map(|i| ClientId(1000 + 7 * i)).collect()
}

impl Harness {
    /// `n` clients with random inputs of `len` elements (each below 2^32 / n).
    pub(crate) fn new(n: u32, params: Params, len: usize, seed: u64) -> Self {
        let inputs: BTreeMap<ClientId, Vec<u32>> = ids(n)
            .into_iter()
            .map(|c| {
                let mut rng = ChaCha20Rng::seed_from_u64(seed ^ (u64::from(c.0) << 20));
                (c, (0..len).map(|_| rng.next_u32() % (u32::MAX / n)).collect())
            })
            .collect();
        Self::with_inputs(inputs, params, seed)
    }

    /// A round over these inputs.
    pub(crate) fn with_inputs(inputs: BTreeMap<ClientId, Vec<u32>>, params: Params, seed: u64) -> Self {
        let clients_ids: Vec<ClientId> = inputs.keys().copied().collect();
        let len = inputs.values().next().map_or(0, Vec::len) as u32;
        let round = 7;
        let mut graph_seed = [0u8; 32];
        graph_seed[..8].copy_from_slice(&seed.to_le_bytes());
        let config = RoundConfig { round, clients: clients_ids, params, graph_seed, vector_len: len };
        let server = ServerState::new(config).expect("valid config");
        let clients = inputs.iter().map(|(&c, x)| (c, ClientState::new(c, x.clone(), entropy(seed, c)))).collect();
        Self { server, clients, inputs, round }
    }

    /// The same round with clients that have no input yet (they get theirs with `provide_input`).
    pub(crate) fn awaiting_inputs(mut self, seed: u64) -> Self {
        self.clients = self.inputs.keys().map(|&c| (c, ClientState::awaiting_input(c, entropy(seed, c)))).collect();
        self
    }

    /// Every queued server message, through the wire encoding.
    pub(crate) fn outgoing(&mut self) -> Vec<(ClientId, ServerMessage)> {
        std::iter::from_fn(|| self.server.poll_transmit())
            .map(|(c, m)| (c, ServerMessage::decode(&m.encode()).expect("server messages decode")))
            .collect()
    }

    /// The clients' replies to `msgs` (each must be accepted).
    pub(crate) fn answer(&mut self, msgs: Vec<(ClientId, ServerMessage)>) -> Vec<(ClientId, ClientMessage)> {
        msgs.into_iter()
            .map(|(c, m)| {
                let reply = self.clients.get_mut(&c).expect("a sampled client").handle_message(m).expect("accepted");
                (c, ClientMessage::decode(&reply.encode()).expect("client messages decode"))
            })
            .collect()
    }

    /// Hands replies to the server, each of which must be accepted.
    pub(crate) fn deliver(&mut self, replies: Vec<(ClientId, ClientMessage)>) {
        for (c, m) in replies {
            self.server.handle_message(c, m).expect("accepted by the server");
        }
    }

    /// One stage: the clients in `silent` never answer; the others' replies reach the server.
    pub(crate) fn stage(&mut self, silent: &BTreeSet<ClientId>) -> Vec<(ClientId, ClientMessage)> {
        let msgs = self.outgoing().into_iter().filter(|(c, _)| !silent.contains(c)).collect();
        let replies = self.answer(msgs);
        self.deliver(replies.clone());
        replies
    }

    /// Runs the round to its end; `drop_masked` never send their masked vector (they drop after
    /// masking) and `drop_unmask` never answer round 4.
    pub(crate) fn run(
        &mut self,
        drop_masked: &BTreeSet<ClientId>,
        drop_unmask: &BTreeSet<ClientId>,
    ) -> Result<Aggregate, SecAggError> {
        let none = BTreeSet::new();
        for silent in [&none, &none, drop_masked, drop_unmask] {
            self.stage(silent);
            if let Advance::Done(aggregate) = self.server.advance()? {
                return Ok(aggregate);
            }
        }
        unreachable!("four stages end the round")
    }

    /// Σ x_u mod 2^32 over all clients but `absent`.
    pub(crate) fn plain_sum(&self, absent: &BTreeSet<ClientId>) -> Vec<u32> {
        let len = self.inputs.values().next().map_or(0, Vec::len);
        let mut sum = vec![0u32; len];
        self.inputs.iter().filter(|(c, _)| !absent.contains(c)).for_each(|(_, x)| crate::mask::add_into(&mut sum, x));
        sum
    }
}

/// A client's 32 bytes of entropy, seeded.
fn entropy(seed: u64, c: ClientId) -> [u8; 32] {
    let mut entropy = [0u8; 32];
    ChaCha20Rng::seed_from_u64(seed.wrapping_add(u64::from(c.0))).fill_bytes(&mut entropy);
    entropy
}

/// `count` clients picked by a seeded shuffle.
pub(crate) fn pick(n: u32, count: usize, seed: u64) -> BTreeSet<ClientId> {
    let mut all = ids(n);
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    for i in (1..all.len()).rev() {
        all.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    all.into_iter().take(count).collect()
}
