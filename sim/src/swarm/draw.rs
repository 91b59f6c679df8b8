//! A federation and its faults drawn from one seed: the topology, the method and its settings,
//! the features (mode, SecAgg, DP, encoding, robust rule), the links, the devices' churn and
//! crashes, relay restarts, outages and failovers, hostile devices, the number of rounds.
//!
//! The draw is a config file's text, read by the same reader as `anchorage sim --config` (so a
//! drawn federation can be written out and run on its own), and then checked by the same setup
//! as every run: a cell the compatibility table refuses is refused before the run, with the
//! table's message.

use std::fmt::Write as _;

use anchorage_shared::rng::Rng;

use crate::config::SimConfig;

/// The methods a swarm draws from: every one that runs on the embedded data's task stream.
const METHODS: &[&str] = &["fedavg", "fedavgm", "fedprox", "fedrep", "gldp", "fedprok", "fedta"];
const LINKS: &[&str] = &["loopback", "ethernet", "wifi", "lte", "3g"];
const ENCODINGS: &[&str] = &["f32", "f16", "bf16", "int8"];

/// What a seed drew: the config's text and what its faults are, counted by kind.
#[derive(Debug, Clone)]
pub struct Drawn {
    pub toml: String,
    pub faults: Faults,
}

/// Faults a draw schedules (crashes and rejoins are drawn per broadcast, and counted as they
/// happen by the run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Faults {
    pub relay_restarts: u64,
    /// Relay restarts that stay down a while (`down_ms`) before the process starts again.
    pub relays_down: u64,
    pub relay_outages: u64,
    pub failovers: u64,
    pub hostile_devices: u64,
    /// Devices with a crash probability above zero, and devices on an on/off cycle.
    pub crashing_devices: u64,
    pub cycling_devices: u64,
}

/// One pick of `items`.
fn pick(rng: &mut Rng, items: &[&'static str]) -> &'static str {
    items[rng.below(items.len() as u64) as usize]
}

/// `lo..=hi`.
fn between(rng: &mut Rng, lo: u64, hi: u64) -> u64 {
    lo + rng.below(hi - lo + 1)
}

fn chance(rng: &mut Rng, p: f64) -> bool {
    rng.f64() < p
}

/// The federation of `seed`, as a config file's text.
pub fn draw(seed: u64) -> Drawn {
    let mut rng = Rng::derive(seed, 0x5_3A2A);
    let mut faults = Faults::default();
    let clients = between(&mut rng, 3, 12);
    let rounds = between(&mut rng, 2, 6);
    let deadline = between(&mut rng, 20, 90);
    let mut t = String::new();
    let _ = writeln!(t, "# anchorage swarm --seed {seed}\nclock = \"virtual\"\nseed = {seed}\nthreads = 1");
    let _ = writeln!(t, "clients = {clients}\nrounds = {rounds}");
    let _ = writeln!(t, "local_epochs = {}\nbatch_size = 16", between(&mut rng, 1, 2));
    let _ = writeln!(t, "train_per_class = {}\ntest_per_class = 4\neval_every = 1000", between(&mut rng, 8, 20));
    let fraction = if chance(&mut rng, 0.5) { 1.0 } else { 0.5 + 0.5 * rng.f64() };
    let _ = writeln!(t, "fraction = {fraction}\nover_selection = {}", [0.0, 0.0, 0.2, 0.5][rng.below(4) as usize]);
    let _ = writeln!(t, "min_available = {}", between(&mut rng, 1, clients));
    if chance(&mut rng, 0.2) {
        let buffer = between(&mut rng, 1, clients.min(4));
        let concurrency = between(&mut rng, buffer, clients);
        let _ = writeln!(
            t,
            "aggregation = {{ kind = \"buffered\", buffer = {buffer}, concurrency = {concurrency}, max_staleness = {} }}",
            between(&mut rng, 1, 4)
        );
    }
    let link = pick(&mut rng, LINKS);
    let _ = writeln!(t, "link = \"{link}\"\nencoding = \"{}\"", pick(&mut rng, ENCODINGS));
    if chance(&mut rng, 0.3) {
        let _ = writeln!(t, "top_k = {}", [0.1, 0.5, 1.0][rng.below(3) as usize]);
    }
    if chance(&mut rng, 0.3) {
        let _ = writeln!(t, "compress = \"zstd\"");
    }
    match rng.below(6) {
        0 => {
            let _ = writeln!(t, "robust = {{ aggregation = {{ rule = \"median\" }} }}");
        }
        1 => {
            let _ = writeln!(t, "robust = {{ aggregation = {{ rule = \"trimmed-mean\", trim = 0.2 }} }}");
        }
        2 => {
            let _ = writeln!(t, "robust = {{ max_norm_z = 3.5 }}");
        }
        _ => {}
    }
    if chance(&mut rng, 0.15) {
        let hostile = between(&mut rng, 1, (clients / 3).max(1));
        faults.hostile_devices = hostile;
        let who: Vec<String> = (0..hostile).map(|i| i.to_string()).collect();
        let claim = if chance(&mut rng, 0.5) { ", claim_samples = 100000" } else { "" };
        let _ = writeln!(t, "attack = {{ clients = [{}], scale = -10.0{claim} }}", who.join(", "));
    }
    devices(&mut rng, &mut t, &mut faults);
    let _ = writeln!(t, "\n[method]\nname = \"{}\"", pick(&mut rng, METHODS));
    if chance(&mut rng, 0.2) {
        let noise = if chance(&mut rng, 0.5) { "central" } else { "local" };
        let _ = writeln!(
            t,
            "\n[privacy]\nnoise = \"{noise}\"\nclip = 1.0\nnoise_multiplier = {}\ndelta = 1e-5\nprototype_clip = 1.0",
            [0.5, 1.1, 2.0][rng.below(3) as usize]
        );
    }
    if chance(&mut rng, 0.2) {
        // Each stage waits for answers as long as a round's broadcast needs over the link.
        let stage_ms = 30_000 * slowness(link);
        let _ = writeln!(t, "\n[secagg]\nenabled = true\nclip = 4.0\nstage_timeout = {stage_ms}");
    }
    let mut slowest = link;
    if chance(&mut rng, 0.4) {
        let mut downs = Rng::derive(seed, 0xD0_3A_5E);
        let relay_link = relays(&mut rng, &mut downs, &mut t, &mut faults, (clients, rounds, deadline));
        slowest = if slowness(relay_link) > slowness(link) { relay_link } else { link };
    }
    // A deadline a round can meet: a broadcast and an update of about a megabyte each way over
    // the slowest link drawn, and the slowest device's training, fit in it.
    let deadline = deadline * slowness(slowest);
    let header = t.find('\n').map_or(0, |i| i + 1);
    t.insert_str(header, &format!("round_deadline_secs = {deadline}.0\n"));
    Drawn { toml: t, faults }
}

/// How many times the base deadline a round needs over `link`.
fn slowness(link: &str) -> u64 {
    match link {
        "3g" => 5,
        "lte" => 2,
        _ => 1,
    }
}

/// The fleet's device kinds: fixed compute seconds (a run that does not depend on the host),
/// some that crash on a broadcast and rejoin, some on an on/off cycle.
fn devices(rng: &mut Rng, t: &mut String, faults: &mut Faults) {
    let kinds = between(rng, 1, 3);
    for k in 0..kinds {
        let _ = writeln!(t, "\n[[devices]]\nname = \"kind-{k}\"\nshare = 1.0");
        let _ = writeln!(t, "compute_seconds = {}", [0.5, 2.0, 8.0][rng.below(3) as usize]);
        if chance(rng, 0.3) {
            faults.crashing_devices += 1;
            let _ = writeln!(
                t,
                "crash_probability = {}\nrejoin_seconds = {}.0",
                [0.05, 0.2][rng.below(2) as usize],
                between(rng, 1, 30)
            );
        }
        if chance(rng, 0.15) {
            faults.cycling_devices += 1;
            let _ = writeln!(
                t,
                "on_off = {{ on_seconds = {}.0, off_seconds = {}.0 }}",
                between(rng, 60, 600),
                between(rng, 10, 120)
            );
        }
    }
}

/// A relay tier of 1 to 4 relays (no more than the clients), with restarts, outages and failovers.
/// How long a restarted relay stays down (up to three round deadlines, so that rounds go on
/// without it) comes from `downs`, a stream of its own: the rest of the draw does not depend on it.
fn relays(
    rng: &mut Rng,
    downs: &mut Rng,
    t: &mut String,
    faults: &mut Faults,
    (clients, rounds, deadline): (u64, u64, u64),
) -> &'static str {
    let count = between(rng, 1, clients.min(4));
    let link = pick(rng, LINKS);
    let _ = writeln!(t, "\n[relays]\ncount = {count}\nlink = \"{link}\"");
    let table = |rng: &mut Rng, n: u64, row: &dyn Fn(&mut Rng) -> String| -> String {
        (0..n).map(|_| row(rng)).collect::<Vec<_>>().join(", ")
    };
    faults.relay_restarts = rng.below(3);
    let mut rows = Vec::new();
    for _ in 0..faults.relay_restarts {
        let row = format!("{{ relay = {}, round = {}", rng.below(count), between(rng, 1, rounds));
        // With one relay, one that stays down cuts every device off: a root outage, not drawn.
        if count > 1 && chance(downs, 0.5) {
            faults.relays_down += 1;
            rows.push(format!("{row}, down_ms = {} }}", between(downs, 2_000, deadline * 3_000)));
        } else {
            rows.push(format!("{row} }}"));
        }
    }
    let restarts = rows.join(", ");
    faults.relay_outages = rng.below(2);
    let outages = table(rng, faults.relay_outages, &|rng| {
        format!(
            "{{ relay = {}, start_ms = {}, duration_ms = {} }}",
            rng.below(count),
            between(rng, 0, 60_000),
            between(rng, 1_000, 40_000)
        )
    });
    faults.failovers = if count > 1 { rng.below(3) } else { 0 };
    let failovers = table(rng, faults.failovers, &|rng| {
        format!("{{ client = {}, round = {} }}", rng.below(clients), between(rng, 1, rounds))
    });
    let _ = writeln!(t, "restarts = [{restarts}]\noutages = [{outages}]\nfailovers = [{failovers}]");
    link
}

/// The drawn text as a config ready to run; a key or value the reader refuses is named.
pub fn config_of(drawn: &Drawn) -> anyhow::Result<SimConfig> {
    let table: toml::Table = toml::from_str(&drawn.toml)?;
    SimConfig::from_table(table).map_err(|e| anyhow::anyhow!("{e}"))
}
