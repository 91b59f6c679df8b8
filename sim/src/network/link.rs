//! The link model: one direction of one client's network path, as a sans-IO state machine.
//!
//! A datagram of `n` bytes that enters the link at `now` leaves the bottleneck after the bytes
//! queued before it and its own serialisation time (a token bucket of rate `bandwidth`, so bursts
//! wait in a drop-tail buffer of `buffer_bytes`), then arrives `latency ± jitter` later. It may be
//! lost instead: at random (`loss`), in bursts (a Gilbert–Elliott two-state channel), when the
//! buffer is full, or during an outage. Deliveries stay in order (jitter never reorders).
//!
//! The same model drives the virtual clock (no sockets, [`Link::transfer_time`]) and the real clock
//! (a UDP socket under quinn that asks [`Link::transmit`] about every datagram), so real QUIC
//! congestion control, retransmission and pacing face exactly the modelled limits.

use std::time::Duration;

use anchorage_shared::rng::Rng;
use serde::{Deserialize, Serialize};

/// QUIC payload bytes per packet, the segment size of the congestion-control bound in
/// [`Link::transfer_time`]: the virtual clock's packet model's.
const MSS: f64 = crate::virtual_clock::quic::PACKET_PAYLOAD as f64;
/// quinn's initial congestion window (bytes): min(10·MSS, max(2·MSS, 14720)).
const INITIAL_WINDOW: f64 = 12_000.0;
/// Cubic's multiplicative decrease (RFC 9438, §4.6).
const CUBIC_BETA: f64 = 0.7;

/// Bursty loss (Gilbert–Elliott): a good and a bad state with their own loss probabilities.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BurstLoss {
    /// Probability per datagram of moving from good to bad.
    pub p_good_to_bad: f64,
    /// Probability per datagram of moving from bad to good (mean burst length 1/p).
    pub p_bad_to_good: f64,
    /// Loss probability in the bad state (the good state uses the link's `loss`).
    pub loss_in_bad: f64,
}

/// An interval of simulated time, from the link's start, during which nothing gets through;
/// with `every_ms`, it comes back every `every_ms` after `start_ms` (a link dark 20 s of every
/// minute, a tower down an hour a day).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Outage {
    pub start_ms: u64,
    pub duration_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every_ms: Option<u64>,
}

impl Outage {
    /// The repeat period, if it is one: longer than the outage (configs with a shorter one are
    /// refused: `Outage::check`).
    fn period(&self) -> Option<u64> {
        self.every_ms.filter(|e| *e > self.duration_ms)
    }

    /// Refuses a period that would leave the link dark for good.
    pub fn check(&self) -> anyhow::Result<()> {
        if let Some(every) = self.every_ms {
            anyhow::ensure!(
                every > self.duration_ms,
                "an outage of {} ms every {every} ms never ends: every_ms must exceed duration_ms",
                self.duration_ms
            );
        }
        Ok(())
    }

    /// The start of the occurrence that covers or precedes `t` (none before the first).
    fn last_start(&self, t: Duration) -> Option<Duration> {
        let t = t.as_millis() as u64;
        let since = t.checked_sub(self.start_ms)?;
        let k = match self.period() {
            Some(every) => since / every * every,
            None => 0,
        };
        Some(Duration::from_millis(self.start_ms + k))
    }

    fn covers(&self, t: Duration) -> bool {
        self.last_start(t).is_some_and(|s| t < s + Duration::from_millis(self.duration_ms))
    }

    /// The end of the occurrence that covers `t`.
    fn end_covering(&self, t: Duration) -> Option<Duration> {
        let s = self.last_start(t)?;
        let end = s + Duration::from_millis(self.duration_ms);
        (t < end).then_some(end)
    }

    /// The first start strictly after `from`.
    fn next_start_after(&self, from: Duration) -> Option<Duration> {
        let first = Duration::from_millis(self.start_ms);
        if first > from {
            return Some(first);
        }
        let every = Duration::from_millis(self.period()?);
        self.last_start(from).map(|s| s + every)
    }
}

/// One direction of a link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LinkProfile {
    /// Bottleneck rate in bits per second; 0 means unlimited.
    pub bandwidth_bps: f64,
    /// One-way propagation delay.
    pub latency_ms: f64,
    /// Uniform jitter added to the latency, in [0, jitter_ms].
    pub jitter_ms: f64,
    /// Independent loss probability per datagram.
    pub loss: f64,
    pub burst_loss: Option<BurstLoss>,
    /// Bytes the bottleneck may queue before it drops (drop-tail).
    pub buffer_bytes: u64,
    pub outages: Vec<Outage>,
}

impl Default for LinkProfile {
    fn default() -> Self {
        Self {
            bandwidth_bps: 0.0,
            latency_ms: 0.0,
            jitter_ms: 0.0,
            loss: 0.0,
            burst_loss: None,
            buffer_bytes: 256 * 1024,
            outages: Vec::new(),
        }
    }
}

/// Both directions of a client's link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[derive(Default)]
pub struct DuplexProfile {
    pub up: LinkProfile,
    pub down: LinkProfile,
    /// Times (ms from the link's start) at which the device's address changes, as when a NAT
    /// rebinds or a phone moves from Wi-Fi to LTE: from then on its datagrams leave from a new
    /// port, and what the server sends to the old one is lost. Real clock
    /// only: a QUIC path migration costs the virtual clock nothing.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub rebind_ms: Vec<u64>,
}

impl DuplexProfile {
    /// `up` and `down`, with no address change.
    pub fn new(up: LinkProfile, down: LinkProfile) -> Self {
        Self { up, down, rebind_ms: Vec::new() }
    }
}

/// A named link (typical figures, not measurements), as configs (`link = "lte"`, a `link_mix`
/// share's `preset`) and `--link` name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LinkPreset {
    Loopback,
    Ethernet,
    Wifi,
    Lte,
    #[serde(rename = "3g")]
    #[value(name = "3g")]
    ThreeG,
    Satellite,
    /// A constrained LPWAN-class uplink.
    Iot,
}

impl LinkPreset {
    /// Every preset, in the order help texts list them.
    pub const ALL: [LinkPreset; 7] =
        [Self::Loopback, Self::Ethernet, Self::Wifi, Self::Lte, Self::ThreeG, Self::Satellite, Self::Iot];

    /// A cellular (metered) link: what a device's `unmetered_only` eligibility refuses on the
    /// virtual clock (`lte`, `3g`, `iot`; satellite plans are metered too).
    pub fn metered(self) -> bool {
        matches!(self, Self::Lte | Self::ThreeG | Self::Iot | Self::Satellite)
    }

    /// The name configs use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Loopback => "loopback",
            Self::Ethernet => "ethernet",
            Self::Wifi => "wifi",
            Self::Lte => "lte",
            Self::ThreeG => "3g",
            Self::Satellite => "satellite",
            Self::Iot => "iot",
        }
    }

    /// Its two directions.
    pub fn profile(self) -> DuplexProfile {
        let side = |mbps: f64, latency_ms: f64, jitter_ms: f64, loss: f64, buffer_kib: u64| LinkProfile {
            bandwidth_bps: mbps * 1e6,
            latency_ms,
            jitter_ms,
            loss,
            buffer_bytes: buffer_kib * 1024,
            ..LinkProfile::default()
        };
        type D = DuplexProfile;
        match self {
            Self::Loopback => D::default(),
            Self::Ethernet => D::new(side(100.0, 1.0, 0.1, 0.0, 512), side(100.0, 1.0, 0.1, 0.0, 512)),
            Self::Wifi => D::new(side(20.0, 5.0, 2.0, 0.001, 256), side(50.0, 5.0, 2.0, 0.001, 256)),
            Self::Lte => D::new(side(5.0, 25.0, 8.0, 0.002, 256), side(20.0, 25.0, 8.0, 0.002, 512)),
            Self::ThreeG => D::new(side(0.5, 75.0, 20.0, 0.01, 64), side(2.0, 75.0, 20.0, 0.01, 128)),
            Self::Satellite => D::new(side(3.0, 300.0, 10.0, 0.005, 512), side(25.0, 300.0, 10.0, 0.005, 1024)),
            Self::Iot => D::new(side(0.25, 100.0, 30.0, 0.02, 32), side(0.25, 100.0, 30.0, 0.02, 32)),
        }
    }
}

impl std::fmt::Display for LinkPreset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a datagram did not get through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drop {
    RandomLoss,
    BurstLoss,
    BufferFull,
    Outage,
}

/// Counters of one link direction.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LinkStats {
    pub datagrams: u64,
    pub bytes: u64,
    pub delivered: u64,
    /// Bytes of the datagrams that got through (what the far end received).
    pub delivered_bytes: u64,
    pub lost_random: u64,
    pub lost_burst: u64,
    pub lost_buffer: u64,
    pub lost_outage: u64,
}

/// One direction of a link in motion. Time is a `Duration` since the link started.
#[derive(Debug, Clone)]
pub struct Link {
    profile: LinkProfile,
    rng: Rng,
    /// When the bottleneck finishes sending what is queued.
    busy_until: Duration,
    /// The latest arrival handed out (arrivals stay in order).
    last_arrival: Duration,
    bad_state: bool,
    stats: LinkStats,
    /// The virtual clock's congestion window and slow-start threshold (bytes), kept across
    /// transfers as a connection keeps them across rounds ([`Link::transfer_time`]).
    cwnd: f64,
    ssthresh: f64,
}

impl Link {
    pub fn new(profile: LinkProfile, seed: u64) -> Self {
        Self {
            profile,
            rng: Rng::new(seed),
            busy_until: Duration::ZERO,
            last_arrival: Duration::ZERO,
            bad_state: false,
            stats: LinkStats::default(),
            cwnd: INITIAL_WINDOW,
            ssthresh: f64::INFINITY,
        }
    }

    pub fn profile(&self) -> &LinkProfile {
        &self.profile
    }

    pub fn stats(&self) -> &LinkStats {
        &self.stats
    }

    /// Seconds the bottleneck needs to send `bytes`.
    fn serialisation(&self, bytes: u64) -> Duration {
        if self.profile.bandwidth_bps > 0.0 {
            Duration::from_secs_f64(bytes as f64 * 8.0 / self.profile.bandwidth_bps)
        } else {
            Duration::ZERO
        }
    }

    fn delay(&mut self) -> Duration {
        let jitter = self.profile.jitter_ms.max(0.0) * self.rng.f64();
        Duration::from_secs_f64((self.profile.latency_ms.max(0.0) + jitter) / 1000.0)
    }

    /// A datagram of `bytes` enters the link at `now`: when it arrives at the far end, or why it
    /// was dropped.
    pub fn transmit(&mut self, now: Duration, bytes: u64) -> Result<Duration, Drop> {
        self.stats.datagrams += 1;
        self.stats.bytes += bytes;
        if self.profile.outages.iter().any(|o| o.covers(now)) {
            self.stats.lost_outage += 1;
            return Err(Drop::Outage);
        }
        if let Some(burst) = &self.profile.burst_loss {
            let flip = if self.bad_state { burst.p_bad_to_good } else { burst.p_good_to_bad };
            if self.rng.f64() < flip {
                self.bad_state = !self.bad_state;
            }
            if self.bad_state && self.rng.f64() < burst.loss_in_bad {
                self.stats.lost_burst += 1;
                return Err(Drop::BurstLoss);
            }
        }
        if self.profile.loss > 0.0 && self.rng.f64() < self.profile.loss {
            self.stats.lost_random += 1;
            return Err(Drop::RandomLoss);
        }
        let start = self.busy_until.max(now);
        if self.profile.bandwidth_bps > 0.0 {
            let queued = self.serialisation_bytes(start - now);
            if queued + bytes > self.profile.buffer_bytes.max(bytes) {
                self.stats.lost_buffer += 1;
                return Err(Drop::BufferFull);
            }
        }
        self.busy_until = start + self.serialisation(bytes);
        let arrival = (self.busy_until + self.delay()).max(self.last_arrival);
        self.last_arrival = arrival;
        self.stats.delivered += 1;
        self.stats.delivered_bytes += bytes;
        Ok(arrival)
    }

    /// Bytes the bottleneck sends in `d` (the backlog a queueing delay `d` stands for).
    fn serialisation_bytes(&self, d: Duration) -> u64 {
        (d.as_secs_f64() * self.profile.bandwidth_bps / 8.0) as u64
    }

    /// The round-trip time without queueing: twice the latency and half the jitter.
    pub fn base_rtt(&self) -> Duration {
        let one_way = self.profile.latency_ms.max(0.0) + self.profile.jitter_ms.max(0.0) / 2.0;
        Duration::from_secs_f64(2.0 * one_way / 1000.0)
    }

    /// The round-trip time during a bulk transfer: [`base_rtt`](Self::base_rtt) plus the time
    /// to drain a full bottleneck buffer (congestion control keeps it full).
    pub fn loaded_rtt(&self) -> Duration {
        let queue = if self.profile.bandwidth_bps > 0.0 {
            self.profile.buffer_bytes as f64 * 8.0 / self.profile.bandwidth_bps
        } else {
            0.0
        };
        self.base_rtt() + Duration::from_secs_f64(queue)
    }

    /// The earliest start of an outage strictly between `from` and `to`.
    pub fn outage_starting_in(&self, from: Duration, to: Duration) -> Option<Duration> {
        let starts = self.profile.outages.iter().filter_map(|o| o.next_start_after(from));
        starts.filter(|s| *s < to).min()
    }

    /// The first moment at or after `t` that no outage covers.
    pub fn next_up(&self, t: Duration) -> Duration {
        let mut t = t;
        while let Some(end) = self.profile.outages.iter().find_map(|o| o.end_covering(t)) {
            t = end;
        }
        t
    }

    /// Virtual clock: time to move `bytes` as one bulk transfer starting at `start`, under a
    /// fluid model of the sender's congestion control, stepped one round trip at a time: the
    /// window starts at quinn's initial window and persists across transfers (as a connection's
    /// does across rounds), doubles per round trip in slow start and grows by one segment per
    /// round trip after, and shrinks by Cubic's β = 0.7 (RFC 9438) when a step loses a packet
    /// (each with the link's loss probability) or overflows the bottleneck's buffer. A step
    /// sends one window in one round trip, or at the link's rate once the window exceeds the
    /// bandwidth-delay product. Then one latency for the last packet. Without a bandwidth or a
    /// latency: serialisation only, stretched by the expected retransmissions 1/(1−p). `None`
    /// when an outage covers the start.
    ///
    /// Why a window model and not bytes/rate: on the 3g preset (2 Mbit/s down, 1% loss) QUIC
    /// through the shaped socket moves a 1 MB broadcast at about 0.7 Mbit/s, and on a clean
    /// 10 Mbit/s link a 260 KB one spends most of its time in slow start.
    pub fn transfer_time(&mut self, start: Duration, bytes: u64) -> Option<Duration> {
        if self.profile.outages.iter().any(|o| o.covers(start)) {
            return None;
        }
        let loss = self.profile.loss.clamp(0.0, 0.99);
        let rate = self.profile.bandwidth_bps / 8.0;
        let base_rtt = 2.0 * (self.profile.latency_ms.max(0.0) + self.profile.jitter_ms.max(0.0) / 2.0) / 1000.0;
        if rate <= 0.0 || base_rtt <= 0.0 {
            return Some(self.serialisation(bytes).mul_f64(1.0 / (1.0 - loss)) + self.delay());
        }
        // More in flight than the path holds plus the buffer overflows the drop-tail queue.
        let ceiling = rate * base_rtt + self.profile.buffer_bytes as f64;
        let (mut left, mut seconds) = (bytes as f64, 0.0);
        while left > 0.0 {
            let window = self.cwnd.min(ceiling);
            let step = (window / rate).max(base_rtt);
            let sent = window.min(left / (1.0 - loss));
            seconds += step * sent / window;
            left -= sent * (1.0 - loss);
            let packets = (sent / MSS).ceil();
            let lost = self.cwnd >= ceiling || self.rng.f64() < 1.0 - (1.0 - loss).powf(packets);
            if lost {
                self.ssthresh = (self.cwnd * CUBIC_BETA).max(2.0 * MSS);
                self.cwnd = self.ssthresh;
            } else if self.cwnd < self.ssthresh {
                self.cwnd *= 2.0;
            } else {
                self.cwnd += MSS;
            }
        }
        Some(Duration::from_secs_f64(seconds) + self.delay())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn bandwidth_serialises_and_latency_delays() {
        // 1 Mbit/s: a 1250-byte datagram takes 10 ms; 20 ms latency on top.
        let mut link = Link::new(LinkProfile { bandwidth_bps: 1e6, latency_ms: 20.0, ..LinkProfile::default() }, 1);
        assert_eq!(link.transmit(ms(0), 1250), Ok(ms(30)));
        // The second queues behind the first.
        assert_eq!(link.transmit(ms(0), 1250), Ok(ms(40)));
        // After the queue drained, no waiting.
        assert_eq!(link.transmit(ms(100), 1250), Ok(ms(130)));
    }

    #[test]
    fn a_full_buffer_drops_the_tail() {
        let mut link = Link::new(LinkProfile { bandwidth_bps: 1e6, buffer_bytes: 5000, ..LinkProfile::default() }, 1);
        let results: Vec<_> = (0..10).map(|_| link.transmit(ms(0), 1250)).collect();
        // The buffer counts every byte not yet sent: four 1250-byte datagrams fill 5000 bytes.
        assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 4);
        assert_eq!(results[9], Err(Drop::BufferFull));
        assert_eq!(link.stats().lost_buffer, 6);
        // Once the queue drained, the link accepts again.
        assert!(link.transmit(ms(40), 1250).is_ok());
    }

    #[test]
    fn a_periodic_outage_comes_back_every_period() {
        let o = Outage { start_ms: 60_000, duration_ms: 20_000, every_ms: Some(60_000) };
        let link = Link::new(LinkProfile { outages: vec![o], ..LinkProfile::default() }, 1);
        let covered = |t: u64| o.covers(ms(t));
        assert!(!covered(59_999) && covered(60_000) && covered(79_999) && !covered(80_000));
        assert!(covered(7 * 60_000 + 5_000) && !covered(7 * 60_000 + 25_000), "the eighth occurrence too");
        assert_eq!(link.next_up(ms(425_000)), ms(440_000));
        assert_eq!(link.outage_starting_in(ms(61_000), ms(200_000)), Some(ms(120_000)));
        assert_eq!(link.outage_starting_in(ms(0), ms(50_000)), None);
        let never_ends = Outage { start_ms: 0, duration_ms: 500, every_ms: Some(500) };
        assert!(never_ends.check().is_err());
        assert!(o.check().is_ok());
    }

    #[test]
    fn random_loss_matches_its_rate() {
        let mut link = Link::new(LinkProfile { loss: 0.1, ..LinkProfile::default() }, 7);
        let lost = (0..20_000).filter(|_| link.transmit(ms(0), 100).is_err()).count();
        assert!((1800..2200).contains(&lost), "lost {lost} of 20000 at 10%");
    }

    #[test]
    fn bursts_cluster_losses() {
        let burst = BurstLoss { p_good_to_bad: 0.01, p_bad_to_good: 0.2, loss_in_bad: 1.0 };
        let mut link = Link::new(LinkProfile { burst_loss: Some(burst), ..LinkProfile::default() }, 3);
        let lost: Vec<bool> = (0..50_000).map(|_| link.transmit(ms(0), 100).is_err()).collect();
        let rate = lost.iter().filter(|l| **l).count() as f64 / lost.len() as f64;
        let after_loss = lost.windows(2).filter(|w| w[0]).count();
        let loss_after_loss = lost.windows(2).filter(|w| w[0] && w[1]).count() as f64 / after_loss as f64;
        assert!(rate > 0.02 && rate < 0.08, "stationary loss {rate}");
        assert!(loss_after_loss > 0.6, "losses cluster: P(loss | loss) = {loss_after_loss}");
    }

    #[test]
    fn outages_drop_everything_inside_them() {
        let profile = LinkProfile {
            outages: vec![Outage { start_ms: 1000, duration_ms: 500, every_ms: None }],
            ..LinkProfile::default()
        };
        let mut link = Link::new(profile, 1);
        assert!(link.transmit(ms(999), 10).is_ok());
        assert_eq!(link.transmit(ms(1000), 10), Err(Drop::Outage));
        assert_eq!(link.transmit(ms(1499), 10), Err(Drop::Outage));
        assert!(link.transmit(ms(1500), 10).is_ok());
        assert_eq!(link.transfer_time(ms(1200), 10), None);
    }

    #[test]
    fn jitter_never_reorders() {
        let mut link = Link::new(LinkProfile { latency_ms: 50.0, jitter_ms: 40.0, ..LinkProfile::default() }, 9);
        let arrivals: Vec<Duration> = (0..1000).map(|i| link.transmit(ms(i), 100).unwrap()).collect();
        assert!(arrivals.windows(2).all(|w| w[0] <= w[1]));
        assert!(arrivals.iter().enumerate().all(|(i, a)| *a >= ms(i as u64 + 50) && *a <= ms(i as u64 + 91)));
    }

    #[test]
    fn virtual_transfer_time_of_a_megabyte_at_one_megabit() {
        let mut link = Link::new(LinkProfile { bandwidth_bps: 1e6, latency_ms: 10.0, ..LinkProfile::default() }, 1);
        let t = link.transfer_time(Duration::ZERO, 1_000_000).unwrap();
        assert!((t.as_secs_f64() - 8.01).abs() < 1e-9, "{t:?}");
    }

    #[test]
    fn presets_exist_and_parse_from_toml() {
        for preset in LinkPreset::ALL {
            let text = format!("link = \"{preset}\"");
            let read: std::collections::BTreeMap<String, LinkPreset> = toml::from_str(&text).unwrap();
            assert_eq!(read["link"], preset, "{text}");
        }
        assert!(toml::from_str::<std::collections::BTreeMap<String, LinkPreset>>("link = \"carrier-pigeon\"").is_err());
        assert!(LinkPreset::ThreeG.profile().up.bandwidth_bps < LinkPreset::Lte.profile().up.bandwidth_bps);
        let p: DuplexProfile =
            toml::from_str("[up]\nbandwidth_bps = 1e6\nlatency_ms = 20\n[down]\nloss = 0.1\n").unwrap();
        assert_eq!(p.up.bandwidth_bps, 1e6);
        assert_eq!(p.down.loss, 0.1);
        assert!(toml::from_str::<DuplexProfile>("[up]\nbandwith = 1\n").is_err(), "typos are errors");
    }
}
