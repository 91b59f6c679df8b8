//! Plain summing vs SecAgg+ side by side: 10, 50 and 100 clients, 0, 10 and 30 % dropping after
//! masking, 100,000-element f32 updates; time and bytes per client.
//!
//!     cargo run --release -p anchorage-secagg --example overhead
//!
//! "plain" is the server adding the survivors' f32 vectors (each client uploads 4 bytes an
//! element). Bytes are the mean over the clients that stayed to the end. For SecAgg+ every message goes through its postcard encoding; client time is the
//! mean per client (quantise + its four handlers), server time is all its handlers, stage closes,
//! unmasking and dequantisation. Parameters are `Params::recommended(n, dropout)`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anchorage_secagg::{
    Advance, ClientId, ClientMessage, ClientState, Params, Quantizer, RoundConfig, Rounding, ServerMessage, ServerState,
};
use chacha20::ChaCha20Rng;
use chacha20::rand_core::{Rng, SeedableRng};

const LEN: usize = 100_000;
const CLIP: f32 = 1.0;

fn main() {
    println!(
        "| clients | dropped | k | t | plain server ms | plain B/client | SecAgg+ client ms | SecAgg+ server ms | SecAgg+ B/client (up + down) | max abs error |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for n in [10u32, 50, 100] {
        let updates = updates(n);
        for dropout in [0.0, 0.1, 0.3] {
            let dropped = dropped(n, dropout);
            let (plain, plain_ms) = plain_sum(&updates, &dropped);
            let r = secagg(&updates, &dropped, dropout);
            let survivors = n as usize - dropped.len();
            let per = |b: &BTreeMap<ClientId, usize>| {
                b.iter().filter(|(c, _)| !dropped.contains(c)).map(|(_, v)| v).sum::<usize>() / survivors
            };
            let err = r.sum.iter().zip(&plain).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            println!(
                "| {n} | {:.0} % | {} | {} | {plain_ms:.2} | {} | {:.1} | {:.1} | {} + {} | {err:.2e} |",
                dropout * 100.0,
                r.params.degree,
                r.params.threshold,
                LEN * 4,
                ms(r.client_time) / f64::from(n),
                ms(r.server_time),
                per(&r.up),
                per(&r.down),
            );
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn updates(n: u32) -> BTreeMap<ClientId, Vec<f32>> {
    (0..n)
        .map(|i| {
            let mut rng = ChaCha20Rng::seed_from_u64(u64::from(i));
            (ClientId(i), (0..LEN).map(|_| (rng.next_u32() as f32 / u32::MAX as f32 - 0.5) * 1.6).collect())
        })
        .collect()
}

fn dropped(n: u32, dropout: f64) -> BTreeSet<ClientId> {
    let count = (f64::from(n) * dropout).round() as u32;
    (0..n).filter(|i| i % (n / count.max(1)).max(1) == 0).take(count as usize).map(ClientId).collect()
}

fn plain_sum(updates: &BTreeMap<ClientId, Vec<f32>>, dropped: &BTreeSet<ClientId>) -> (Vec<f32>, f64) {
    let start = Instant::now();
    let mut sum = vec![0f32; LEN];
    for (_, x) in updates.iter().filter(|(c, _)| !dropped.contains(c)) {
        sum.iter_mut().zip(x).for_each(|(s, v)| *s += v);
    }
    (sum, ms(start.elapsed()))
}

struct Measured {
    params: Params,
    sum: Vec<f32>,
    client_time: Duration,
    server_time: Duration,
    up: BTreeMap<ClientId, usize>,
    down: BTreeMap<ClientId, usize>,
}

fn secagg(updates: &BTreeMap<ClientId, Vec<f32>>, dropped: &BTreeSet<ClientId>, dropout: f64) -> Measured {
    let n = updates.len();
    let params = Params::recommended(n, dropout);
    let quantizer = Quantizer::new(CLIP, n as u32).unwrap();
    let mut m = Measured {
        params,
        sum: Vec::new(),
        client_time: Duration::ZERO,
        server_time: Duration::ZERO,
        up: BTreeMap::new(),
        down: BTreeMap::new(),
    };
    let mut clients = BTreeMap::new();
    for (&c, x) in updates {
        let start = Instant::now();
        let input = quantizer.quantize(x, Rounding::Stochastic { seed: u64::from(c.0) });
        clients.insert(c, ClientState::new(c, input, [c.0 as u8; 32]));
        m.client_time += start.elapsed();
    }
    let config = RoundConfig {
        round: 1,
        clients: updates.keys().copied().collect(),
        params,
        graph_seed: [9; 32],
        vector_len: LEN as u32,
    };
    let start = Instant::now();
    let mut server = ServerState::new(config).unwrap();
    m.server_time += start.elapsed();
    for stage in 0.. {
        exchange(&mut server, &mut clients, |c| stage == 2 && dropped.contains(&c), &mut m);
        let start = Instant::now();
        let advanced = server.advance().unwrap();
        if let Advance::Done(aggregate) = advanced {
            m.sum = quantizer.dequantize_sum(&aggregate.sum, aggregate.contributors).unwrap();
            m.server_time += start.elapsed();
            return m;
        }
        m.server_time += start.elapsed();
    }
    unreachable!()
}

/// Delivers the server's queued messages and the replies, timing each side; `silent` clients
/// compute their reply but it never arrives (a drop after masking).
fn exchange(
    server: &mut ServerState,
    clients: &mut BTreeMap<ClientId, ClientState>,
    silent: impl Fn(ClientId) -> bool,
    m: &mut Measured,
) {
    let mut outgoing = Vec::new();
    while let Some((c, msg)) = server.poll_transmit() {
        outgoing.push((c, msg.encode()));
    }
    for (c, bytes) in outgoing {
        *m.down.entry(c).or_default() += bytes.len();
        let start = Instant::now();
        let reply = clients.get_mut(&c).unwrap().handle_message(ServerMessage::decode(&bytes).unwrap()).unwrap();
        let reply = reply.encode();
        m.client_time += start.elapsed();
        if silent(c) {
            continue;
        }
        *m.up.entry(c).or_default() += reply.len();
        let start = Instant::now();
        server.handle_message(c, ClientMessage::decode(&reply).unwrap()).unwrap();
        m.server_time += start.elapsed();
    }
}
