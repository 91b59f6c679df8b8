//! The virtual clock's model of QUIC: the packet model of wire bytes, the probe timeouts that
//! follow an outage, and the timers of the real transport's shells (the server's read stall,
//! the devices' keep-alive and idle timeout, their reconnects), each named once here.

use std::time::Duration;

use anchorage_shared::frame::encode_frame;
use anchorage_shared::protocol::Message;
use anchorage_shared::transfer::CHUNK_BYTES;

use crate::network::{Link, LinkProfile};

/// Payload bytes a QUIC packet carries (quinn's initial MTU, which the simulator's paths keep).
pub(crate) const PACKET_PAYLOAD: u64 = 1200;
/// Bytes around each packet's payload: headers, frames and AEAD tag (about 3% on loopback).
pub(crate) const PACKET_OVERHEAD: u64 = 40;
/// quinn's maximum ACK delay, which a sender's probe timeout allows for (RFC 9000 `max_ack_delay`).
pub(crate) const MAX_ACK_DELAY: Duration = Duration::from_millis(25);
/// The server's default `read_stall`: a stream that brings no byte for this long is let go.
pub(crate) const STALL: Duration = Duration::from_secs(30);
/// The simulator's devices' QUIC keep-alive interval (`ClientOptions::keep_alive`).
pub(crate) const DEVICE_KEEP_ALIVE: Duration = Duration::from_secs(5);
/// The simulator's devices' QUIC idle timeout (`ClientOptions::idle_timeout`), as long as [`STALL`].
pub(crate) const DEVICE_IDLE_TIMEOUT: Duration = STALL;
/// A device's first reconnect backoff step, after which it reaches its next relay on a failover.
pub(crate) const FAILOVER_DELAY: Duration = Duration::from_millis(200);
/// How long a device takes to reconnect to a restarted relay: a stateless reset answers its next keep-alive.
pub(crate) const RESTART_RECONNECT: Duration = DEVICE_KEEP_ALIVE.saturating_add(FAILOVER_DELAY);
/// How long a device that failed over stays on the other relay after its ack there.
pub(crate) const HOME_AFTER: Duration = Duration::from_secs(1);
/// How long the clock follows one transfer through outages before it charges it as arriving.
pub(crate) const GIVE_UP: Duration = Duration::from_secs(24 * 3600);

/// Wire bytes of a frame of `bytes` under the packet model.
pub fn wire_bytes(bytes: u64) -> u64 {
    bytes + bytes.div_ceil(PACKET_PAYLOAD) * PACKET_OVERHEAD
}

/// Bytes of `msg` as one frame.
pub(crate) fn frame_len(msg: &Message) -> u64 {
    encode_frame(msg, usize::MAX).map(|f| f.len() as u64).unwrap_or(0)
}

/// The sender's probe timeout on a path of round-trip time `rtt` (RFC 9002, section 6.2: the
/// smoothed RTT, four times its variation, here taken as half the RTT, and [`MAX_ACK_DELAY`]);
/// it doubles at each unanswered probe.
pub(super) fn probe_timeout(rtt: Duration) -> Duration {
    rtt.mul_f64(1.5) + MAX_ACK_DELAY
}

/// When the sender's next probe after an outage `cut` .. `back` gets through: the first of
/// `cut + pto·(2^k − 1)` at or after `back`.
pub(super) fn first_probe_after(cut: Duration, back: Duration, pto: Duration) -> Duration {
    let mut probe = pto;
    let mut at = cut + probe;
    while at < back {
        probe *= 2;
        at += probe;
    }
    at
}

/// One direction of a client's path on the virtual clock: in-order, one message at a time.
pub(super) struct Path {
    link: Link,
    free_at: Duration,
}

impl Path {
    pub(super) fn new(profile: LinkProfile, seed: u64) -> Self {
        Self { link: Link::new(profile, seed), free_at: Duration::ZERO }
    }

    /// When a message of `bytes` sent at `now` arrives (after any outage and the messages ahead).
    pub(super) fn carry(&mut self, now: Duration, bytes: u64) -> Duration {
        let start = self.link.next_up(now.max(self.free_at));
        // `next_up` left every outage behind, so the transfer is possible.
        let d = self.link.transfer_time(start, wire_bytes(bytes)).unwrap_or_default();
        self.free_at = start + d;
        start + d
    }

    /// When a transfer of `bytes` (an upload, or a broadcast to one device) started at `now`
    /// arrives, and the bytes it put on the wire, when outages may break it off (`carry` lets
    /// one only delay the start). At an outage the transfer stops; it goes on two round trips
    /// after the sender's first probe after the outage ([`first_probe_after`]). If that is more
    /// than [`STALL`] after the cut, the receiver has let the stream go (the server's read
    /// stall; for a broadcast, the device's [`DEVICE_IDLE_TIMEOUT`]): a
    /// resumable transfer is offered again (one round trip) and goes on from the last whole
    /// chunk the receiver holds; a one-frame upload's or uni-stream broadcast's connection was
    /// closed, so the device reconnects (two round trips) and it is all sent again. Otherwise
    /// QUIC carries on and nothing is sent twice.
    pub(super) fn carry_transfer(&mut self, now: Duration, bytes: u64, resume: bool) -> (Duration, u64) {
        let rtt = self.link.base_rtt();
        let mut left = bytes;
        let mut wire = 0;
        let mut t = now.max(self.free_at);
        loop {
            // A restart may fall inside the next outage: it begins when the link is back.
            t = self.link.next_up(t);
            if t.saturating_sub(now) > GIVE_UP {
                // Repeating outages shorter-spaced than the upload: it never gets through whole.
                tracing::debug!(
                    bytes,
                    resume,
                    "an upload has not got through in a simulated day; charged as arriving now"
                );
                self.free_at = t;
                return (t, wire);
            }
            let d = self.link.transfer_time(t, wire_bytes(left)).unwrap_or_default();
            let Some(cut) = self.link.outage_starting_in(t, t + d) else {
                wire += wire_bytes(left);
                self.free_at = t + d;
                return (t + d, wire);
            };
            let done = (left as f64 * (cut - t).as_secs_f64() / d.as_secs_f64().max(1e-9)) as u64;
            wire += wire_bytes(done);
            // A bulk transfer keeps the bottleneck's buffer full: its RTT, and so its probe
            // timeout, include the queue. The probe's ACK reveals the loss (one round trip) and
            // the lost bytes are sent again (another): only then does the server read a new byte.
            let loaded = self.link.loaded_rtt();
            let probe = first_probe_after(cut, self.link.next_up(cut), probe_timeout(loaded));
            let next_byte = probe + 2 * loaded;
            if next_byte - cut <= STALL {
                (left, t) = (left - done, next_byte);
            } else if resume {
                let held = (bytes - left + done) / CHUNK_BYTES as u64 * CHUNK_BYTES as u64;
                (left, t) = (bytes - held, next_byte + rtt);
            } else {
                (left, t) = (bytes, next_byte + 2 * rtt);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SimConfig;
    use crate::network::{LinkPreset, Outage};
    use crate::virtual_clock::run_virtual;

    /// 3g's uplink, dark for 20 s every 60 s from 60 s.
    fn flaky_3g() -> LinkProfile {
        let outages =
            (0..40).map(|k| Outage { start_ms: 60_000 + 60_000 * k, duration_ms: 20_000, every_ms: None }).collect();
        LinkProfile { outages, ..LinkPreset::ThreeG.profile().up }
    }

    /// A 20 MB broadcast over 3g's downlink, dark 40 s every 80 s (`benches/outages`): the device
    /// that resumes broadcasts gets the round's model sooner and for fewer bytes than one that
    /// receives it again from the start after each connection the outages end. Before the
    /// virtual clock modelled it, an outage only delayed a broadcast's start, and both were alike.
    #[test]
    fn a_broadcast_broken_off_by_outages_resumes_or_is_received_again() {
        let run = |text: &str| {
            let config: SimConfig = toml::from_str(text).unwrap();
            let result = run_virtual(&config).unwrap();
            let record = result.ledger.iter().find(|r| !r.dropped).expect("the device's cost record").clone();
            (record.wire_down as f64 / record.payload_down as f64, result.reports[0].closed.as_secs_f64())
        };
        let (resumed, resumed_round) = run(include_str!("../../../benches/outages/broadcast-3g-resume.toml"));
        let (again, again_round) = run(include_str!("../../../benches/outages/broadcast-3g-restart.toml"));
        println!(
            "20 MB broadcast over 3g with outages: resumed {resumed:.3}x, round {resumed_round:.0} s; received again {again:.3}x, round {again_round:.0} s"
        );
        assert!(resumed <= 1.15, "resumed: {resumed:.3}x the payload down");
        assert!(again > 1.5 && again_round > resumed_round, "received again: {again:.3}x, {again_round:.0} s");
    }

    #[test]
    fn an_upload_broken_off_by_outages_resumes_or_starts_again() {
        let bytes = 20_000_000;
        let (resumed_at, resumed_wire) = Path::new(flaky_3g(), 7).carry_transfer(Duration::ZERO, bytes, true);
        let (restarted_at, restarted_wire) = Path::new(flaky_3g(), 7).carry_transfer(Duration::ZERO, bytes, false);
        let clean = Path::new(LinkPreset::ThreeG.profile().up, 7).carry(Duration::ZERO, bytes);
        println!(
            "20 MB over 3g, dark 20 s every 60 s: resumed {:.0} s, {:.3}x on the wire; started again {:.0} s, {:.3}x; no outage {:.0} s",
            resumed_at.as_secs_f64(),
            resumed_wire as f64 / bytes as f64,
            restarted_at.as_secs_f64(),
            restarted_wire as f64 / bytes as f64,
            clean.as_secs_f64()
        );
        assert!(resumed_wire as f64 <= 1.15 * bytes as f64, "resumed: {resumed_wire} B on the wire");
        assert!(restarted_wire as f64 > 2.0 * bytes as f64, "started again: {restarted_wire} B on the wire");
        assert!(clean < resumed_at && resumed_at < restarted_at);
        // A transfer that no outage breaks off costs what `carry` charges.
        let (at, wire) = Path::new(LinkPreset::ThreeG.profile().up, 7).carry_transfer(Duration::ZERO, bytes, true);
        assert_eq!((at, wire), (clean, wire_bytes(bytes)));
    }

    /// Repeating outages that leave no gap long enough for the whole frame: the one-frame upload
    /// never gets through, and the loop ends after a simulated day instead of running forever;
    /// the resumable one gets through.
    #[test]
    fn an_upload_that_never_fits_between_repeating_outages_is_given_up_on() {
        // 3g dark 20 s of every minute: the device reconnects about 30 s after each cut (past the
        // server's stall), which leaves about 30 s before the next; 2 MB takes 33 s at 0.5 Mbit/s.
        let outage = Outage { start_ms: 10_000, duration_ms: 20_000, every_ms: Some(60_000) };
        let profile = LinkProfile { outages: vec![outage], ..LinkPreset::ThreeG.profile().up };
        let bytes = 2_000_000;
        let (at, wire) = Path::new(profile.clone(), 7).carry_transfer(Duration::ZERO, bytes, false);
        assert!(at >= GIVE_UP && at < GIVE_UP + Duration::from_secs(60), "{at:?}");
        assert!(wire > 10 * bytes, "a day of attempts: {wire} B");
        let (at, wire) = Path::new(profile, 7).carry_transfer(Duration::ZERO, bytes, true);
        assert!(at < Duration::from_secs(3600) && (wire as f64) < 1.3 * bytes as f64, "{at:?} {wire}");
    }

    #[test]
    fn quic_probes_back_off_through_an_outage() {
        let s = Duration::from_secs;
        // With a 1 s probe timeout, probes go 1, 3, 7, 15, 31 s after the cut: a 20 s outage is
        // answered at 31 s, past the server's 30 s stall; a 10 s one at 15 s.
        assert_eq!(first_probe_after(s(100), s(120), s(1)), s(131));
        assert_eq!(first_probe_after(s(100), s(110), s(1)), s(115));
        assert_eq!(first_probe_after(s(100), s(100), s(1)), s(101));
        // A 190 ms round trip: 310 ms; probes at 310 ms × (2^k − 1), so a 20 s outage is answered
        // at 39.4 s (127 × 310 ms), past the stall.
        let pto = probe_timeout(Duration::from_millis(190));
        assert_eq!(pto, Duration::from_millis(310));
        assert_eq!(first_probe_after(s(0), s(20), pto), pto * 127);
    }
}
