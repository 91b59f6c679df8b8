//! The link model under real QUIC on loopback: bandwidth, latency, loss and outages shape what
//! quinn's congestion control and loss recovery face, and the federation copes.

use anchorage_sim::network::{DuplexProfile, LinkProfile, Outage};
use anchorage_sim::{ClientLink, DataConfig, FederationConfig, SimConfig, run};

fn small(clients: usize, rounds: u64, seed: u64) -> SimConfig {
    SimConfig {
        federation: FederationConfig { clients, rounds, seed, local_epochs: 1, ..Default::default() },
        data: DataConfig { train_per_class: 40, test_per_class: 10, ..Default::default() },
        ..SimConfig::default()
    }
}

fn uplink(client: usize, up: LinkProfile) -> ClientLink {
    ClientLink { client, profile: DuplexProfile::new(up, LinkProfile::default()) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_megabit_uplink_carries_a_megabyte_in_eight_seconds() {
    let link = LinkProfile { bandwidth_bps: 1e6, latency_ms: 10.0, buffer_bytes: 64 * 1024, ..LinkProfile::default() };
    let mut config = small(1, 1, 21);
    config.systems.client_links = vec![uplink(0, link)];
    let result = run(config).await.expect("simulation runs");
    let cost = &result.ledger[0];
    let megabits = cost.payload_up as f64 * 8.0 / 1e6;
    let expected = megabits; // seconds at 1 Mbit/s
    println!(
        "1 Mbit/s uplink: payload {} B ({megabits:.2} Mbit), wire {} B, upload took {:.2} s (expected {expected:.2} s ± 10%); link {:?}",
        cost.payload_up, cost.wire_up, cost.transfer_seconds, result.link_stats[0]
    );
    assert!(cost.payload_up > 1_000_000);
    assert!(
        (cost.transfer_seconds - expected).abs() <= 0.1 * expected,
        "upload took {:.2} s, expected {expected:.2} s ± 10%",
        cost.transfer_seconds
    );
    assert_eq!(result.summary.rounds[0].outcome, "aggregated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn added_latency_shows_in_the_measured_rtt() {
    let plain = run(small(1, 1, 22)).await.expect("plain run");
    let slow = LinkProfile { latency_ms: 60.0, ..LinkProfile::default() };
    let mut shaped = small(1, 1, 22);
    shaped.systems.client_links = vec![ClientLink { client: 0, profile: DuplexProfile::new(slow.clone(), slow) }];
    let delayed = run(shaped).await.expect("shaped run");
    let (rtt0, rtt1) = (plain.ledger[0].rtt_seconds, delayed.ledger[0].rtt_seconds);
    println!("RTT on plain loopback {:.1} ms, with 60 ms each way {:.1} ms", rtt0 * 1e3, rtt1 * 1e3);
    assert!(rtt0 < 0.05, "loopback RTT {rtt0}");
    assert!((0.12..0.3).contains(&rtt1), "RTT with 2 × 60 ms latency: {rtt1}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_percent_loss_still_completes_the_rounds() {
    let lossy = LinkProfile { loss: 0.1, latency_ms: 5.0, ..LinkProfile::default() };
    let both = DuplexProfile::new(lossy.clone(), lossy);
    let mut config = small(2, 2, 23);
    config.systems.client_links = (0..2).map(|client| ClientLink { client, profile: both.clone() }).collect();
    let result = run(config).await.expect("simulation runs");
    for r in &result.summary.rounds {
        assert_eq!((r.outcome.as_str(), r.aggregated), ("aggregated", 2), "round {}", r.round);
    }
    let stats: Vec<_> = result.link_stats.iter().flatten().collect();
    let lost: u64 = stats.iter().map(|s| s.up.lost_random + s.down.lost_random).sum();
    let sent: u64 = stats.iter().map(|s| s.up.datagrams + s.down.datagrams).sum();
    println!("10% loss: {lost} of {sent} datagrams dropped; wire/payload {:?}", result.summary.upload_wire_ratio);
    assert!(lost as f64 > 0.05 * sent as f64, "the link really dropped datagrams: {lost} of {sent}");
    assert!(result.summary.upload_wire_ratio.unwrap() > 1.05, "retransmissions show in the wire bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_longer_than_the_deadline_drops_the_client_which_rejoins_later() {
    // Client 1 loses its link from 0.3 s to 2.3 s after it starts; rounds wait 1.5 s, so at least
    // one round closes at its deadline without it. QUIC's probe backoff after the outage can cost
    // the client a few more rounds before it is back, so the run has eight.
    let outage = vec![Outage { start_ms: 300, duration_ms: 2000, every_ms: None }];
    let dark = LinkProfile { outages: outage, ..LinkProfile::default() };
    let mut config = small(2, 8, 24);
    config.systems.client_links = vec![ClientLink { client: 1, profile: DuplexProfile::new(dark.clone(), dark) }];
    config.federation.round_deadline_secs = 1.5;
    let result = run(config).await.expect("simulation runs");
    for r in &result.reports {
        println!(
            "round {}: aggregated {:?}, missing {:?}",
            r.round,
            r.updates.iter().map(|u| &u.client).collect::<Vec<_>>(),
            r.missing
        );
    }
    let dark = "client-001".to_string();
    let missed = result
        .reports
        .iter()
        .position(|r| r.missing.contains(&dark))
        .expect("the dark client misses a round at its deadline");
    let r = &result.reports[missed];
    assert_eq!(
        r.outcome,
        anchorage_server::engine::RoundOutcome::Aggregated,
        "the round closes at its deadline without it"
    );
    assert!(r.updates.iter().any(|u| u.client == "client-000"), "the round still aggregates the other client");
    let rejoined = result.reports[missed + 1..].iter().any(|r| r.updates.iter().any(|u| u.client == dark));
    assert!(rejoined, "after the outage the client is aggregated again in a later round");
    // What the outage dropped depends on what was in flight (an upload, a broadcast, acks).
    let stats = result.link_stats[1].as_ref().unwrap();
    assert!(stats.up.lost_outage + stats.down.lost_outage > 0, "the outage dropped packets: {stats:?}");
}

/// A 2 MB update over a 1 Mbit/s uplink that goes dark for 35 s from 12 s: after 35 s dark,
/// QUIC's doubling probe timeout next fires about a minute after the cut, past the server's
/// 30 s read stall and the 30 s idle timeout. Returns the update's payload and the bytes sent up
/// in all (every datagram, whatever became of it).
async fn upload_through_an_outage(resume_uploads: bool) -> (u64, u64) {
    let outage = vec![Outage { start_ms: 12_000, duration_ms: 35_000, every_ms: None }];
    let up = LinkProfile {
        bandwidth_bps: 1e6,
        latency_ms: 40.0,
        // Deep enough that congestion control's overshoot costs few retransmissions: what is
        // measured is what the outage makes the device send again.
        buffer_bytes: 1 << 20,
        outages: outage.clone(),
        ..LinkProfile::default()
    };
    let down = LinkProfile { latency_ms: 40.0, outages: outage, ..LinkProfile::default() };
    let mut config = small(1, 1, 25);
    config.model.hidden = vec![1000]; // a 2 MB update: about 17 s at 1 Mbit/s
    config.federation.round_deadline_secs = 600.0;
    config.systems.client_links = vec![ClientLink { client: 0, profile: DuplexProfile::new(up, down) }];
    config.systems.resume_uploads = resume_uploads;
    let result = run(config).await.expect("simulation runs");
    let cost = &result.ledger[0];
    let stats = result.link_stats[0].as_ref().unwrap();
    println!(
        "resume_uploads = {resume_uploads}: a {} B update through a 35 s outage: {} B sent up in all ({:.3}x); {:?}",
        cost.payload_up,
        stats.up.bytes,
        stats.up.bytes as f64 / cost.payload_up as f64,
        stats.up
    );
    assert_eq!(result.summary.rounds[0].outcome, "aggregated", "the update arrived");
    assert!(stats.up.lost_outage > 0, "the outage fell inside the upload: {:?}", stats.up);
    (cost.payload_up, stats.up.bytes)
}

/// An outage that outlasts the server's patience breaks an upload off; the device
/// offers the update again and sends only what the server does not hold (measured 1.09x the
/// payload on the wire).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_broken_off_by_an_outage_resumes_instead_of_starting_again() {
    let (payload, sent) = upload_through_an_outage(true).await;
    assert!(sent as f64 <= 1.15 * payload as f64, "{sent} B sent up for {payload} B");
}

/// The baseline, one frame sent again from the start: it costs more, and the update still
/// arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_resume_the_update_is_sent_again_and_still_arrives() {
    let (payload, sent) = upload_through_an_outage(false).await;
    assert!(sent as f64 > 1.3 * payload as f64, "{sent} B sent up for {payload} B: not sent again?");
}

/// Through the link model: the device's address changes in the middle of its
/// 2 MB upload over a 1 Mbit/s uplink (a NAT rebinding: its datagrams leave from a new port, and
/// the old one hears nothing more). The server migrates the connection: no new handshake, and
/// the upload is not sent again: it puts about 15 % more bytes on the uplink than the same run
/// without the address change (retransmissions around the path change; not pinned down further).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_whose_address_changes_mid_upload_carries_on_through_the_link_model() {
    let (payload, steady) = upload_with_address_changes(vec![]).await;
    let (_, moved) = upload_with_address_changes(vec![12_000]).await;
    println!(
        "a {payload} B update: {} B sent up without an address change, {} B with one at 12 s ({} datagrams after it, {} of them handshake)",
        steady.up.bytes, moved.up.bytes, moved.datagrams_after_rebind, moved.handshake_datagrams_after_rebind
    );
    assert_eq!(moved.rebinds, 1);
    assert_eq!(moved.handshake_datagrams_after_rebind, 0, "no new handshake after the address changed");
    // About 1,700 datagrams carry the update; a good share of them left from the new address.
    assert!(moved.datagrams_after_rebind > 300, "the upload was under way when the address changed: {moved:?}");
    // Sending it again from zero would add what went up in the first 12 s, about 60 % of the
    // update, on top of the migration's own retransmissions. The migration itself cost 15 %
    // on a quiet machine (2.49 MB against 2.17 MB without it) and 36 % once in CI on a loaded
    // one (the link model runs on wall time, so a slow machine loses more around the change).
    let extra = moved.up.bytes as f64 - steady.up.bytes as f64;
    assert!(extra < 0.55 * payload as f64, "{extra} B more sent up: the upload started again?");
}

/// One device's 2 MB upload over a 1 Mbit/s uplink whose address changes at `rebind_ms`: the
/// update's payload and the link's counters.
async fn upload_with_address_changes(rebind_ms: Vec<u64>) -> (u64, anchorage_sim::network::DuplexStats) {
    let up = LinkProfile { bandwidth_bps: 1e6, latency_ms: 40.0, buffer_bytes: 1 << 20, ..LinkProfile::default() };
    let down = LinkProfile { latency_ms: 40.0, ..LinkProfile::default() };
    let mut profile = DuplexProfile::new(up, down);
    profile.rebind_ms = rebind_ms;
    let mut config = small(1, 1, 25);
    config.model.hidden = vec![1000]; // a 2 MB update: about 17 s at 1 Mbit/s
    config.federation.round_deadline_secs = 600.0;
    config.systems.client_links = vec![ClientLink { client: 0, profile }];
    let result = run(config).await.expect("simulation runs");
    assert_eq!(result.summary.rounds[0].outcome, "aggregated", "the update arrived");
    (result.ledger[0].payload_up, result.link_stats[0].clone().unwrap())
}
