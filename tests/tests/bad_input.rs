//! Bad input over real QUIC: garbage, oversized frames, a wrong protocol version and a shape that
//! does not match the broadcast are refused with a reason; the server counts them, logs them and
//! keeps serving everyone else.

use std::net::SocketAddr;
use std::time::Duration;

use anchorage_server::engine::EngineConfig;
use anchorage_server::methods::FedAvg;
use anchorage_server::transport::{self, Limits, ServerEvent, ServerOptions};
use anchorage_shared::frame::{DEFAULT_MAX_FRAME, LEN_BYTES};
use anchorage_shared::io::read_frame;
use anchorage_shared::protocol::{Message, RefusalReason, RoundConfig, Update};
use anchorage_shared::tensor::{Encoding, ParamBlock};
use anchorage_tests::{frame, hello, raw_connect, send_raw_and_read_reply, write};

fn refusal_reason(msg: Option<Message>) -> RefusalReason {
    match msg {
        Some(Message::Refusal(r)) => {
            println!("refused as expected: {:?}: {}", r.reason, r.detail);
            r.reason
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_refuses_bad_input_and_keeps_serving() {
    let identity = anchorage_pki::identity::self_signed(&["localhost"]).unwrap();
    let cert = identity.cert.clone();
    let global = vec![ParamBlock::encode("head.weight", &[2, 2], &[0.0; 4], Encoding::F32)];
    let max_frame = 1 << 20;
    let mut server = transport::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity,
        trust: anchorage_server::tls::Trust::InsecureDev,
        engine: EngineConfig {
            rounds: 1,
            min_available: 2,
            min_fit: 2,
            round_deadline: Duration::from_secs(30),
            // The plain mean, so that the result below is FedAvg's arithmetic (the influence
            // bounds have their own tests in insider.rs).
            robust: anchorage_server::aggregate::RobustConfig::unbounded(),
            max_frame_bytes: max_frame as u32,
            round: RoundConfig { local_epochs: 1, batch_size: 8, learning_rate: 0.1, deadline_ms: 0 },
            ..EngineConfig::default()
        },
        method: Box::new(FedAvg::default()),
        initial: global,
        limits: Limits::default(),
        store: None,
    })
    .await
    .unwrap();
    let addr = server.local_addr;

    // 1. Garbage instead of a hello (its fifth byte, read as the version, is 0xde).
    let (_e1, c1) = raw_connect(addr, &cert).await.unwrap();
    let garbage = [7u8, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef, 1, 2, 3];
    assert_eq!(refusal_reason(send_raw_and_read_reply(&c1, &garbage).await.unwrap()), RefusalReason::VersionMismatch);
    let (_e1b, c1b) = raw_connect(addr, &cert).await.unwrap();
    let mut bad_body = frame(&hello("garbage"));
    bad_body.truncate(LEN_BYTES + 2);
    bad_body[..LEN_BYTES].copy_from_slice(&2u32.to_le_bytes()); // a hello with an empty body
    assert_eq!(refusal_reason(send_raw_and_read_reply(&c1b, &bad_body).await.unwrap()), RefusalReason::Malformed);

    // 2. A frame that declares more than the limit: refused before its body is read.
    let (_e2, c2) = raw_connect(addr, &cert).await.unwrap();
    let mut huge = ((max_frame + 1) as u32).to_le_bytes().to_vec();
    huge.extend_from_slice(&[1, 1, 0, 0]);
    assert_eq!(refusal_reason(send_raw_and_read_reply(&c2, &huge).await.unwrap()), RefusalReason::TooLarge);

    // 3. A well-formed hello of another protocol version.
    let (_e3, c3) = raw_connect(addr, &cert).await.unwrap();
    let mut v2 = frame(&hello("from-the-future"));
    v2[LEN_BYTES] = 2;
    assert_eq!(refusal_reason(send_raw_and_read_reply(&c3, &v2).await.unwrap()), RefusalReason::VersionMismatch);
    for c in [&c1, &c2, &c3] {
        tokio::time::timeout(Duration::from_secs(5), c.closed()).await.expect("refused connections are closed");
    }

    // 4. Two enrolled clients; one sends an update of the wrong shape, then a right one.
    let (_e4, good) = raw_connect(addr, &cert).await.unwrap();
    let (_e5, sloppy) = raw_connect(addr, &cert).await.unwrap();
    let (mut good_ctl, mut good_rx) = good.open_bi().await.unwrap();
    let (mut sloppy_ctl, mut sloppy_rx) = sloppy.open_bi().await.unwrap();
    write(&mut good_ctl, &hello("good")).await.unwrap();
    write(&mut sloppy_ctl, &hello("sloppy")).await.unwrap();
    for rx in [&mut good_rx, &mut sloppy_rx] {
        let (welcome, _) = read_frame(rx, DEFAULT_MAX_FRAME).await.unwrap().unwrap();
        assert!(matches!(welcome, Message::Welcome(_)));
    }
    let round = {
        let mut b = good.accept_uni().await.unwrap();
        match read_frame(&mut b, DEFAULT_MAX_FRAME).await.unwrap().unwrap().0 {
            Message::Broadcast(b) => b.round,
            other => panic!("expected a broadcast, got {other:?}"),
        }
    };
    let update = |shape: &[u32], values: &[f32]| {
        Message::Update(Update {
            prototypes_are: Default::default(),
            round,
            num_samples: 5,
            blocks: vec![ParamBlock::encode("head.weight", shape, values, Encoding::F32)],
            prototypes: vec![],
            metrics: vec![],
            compute_seconds: 0.1,
        })
    };
    let upload = |conn: quinn::Connection, msg: Message| async move {
        let mut s = conn.open_uni().await.unwrap();
        write(&mut s, &msg).await.unwrap();
        s.finish().unwrap();
        s.stopped().await.unwrap();
    };
    upload(sloppy.clone(), update(&[4], &[1.0; 4])).await;
    let (reply, _) = read_frame(&mut sloppy_rx, DEFAULT_MAX_FRAME).await.unwrap().unwrap();
    assert_eq!(refusal_reason(Some(reply)), RefusalReason::ShapeMismatch);
    // NaN in a block is a decode error: refused, and that connection is closed.
    let (_e6, nan) = raw_connect(addr, &cert).await.unwrap();
    let (mut nan_ctl, mut nan_rx) = nan.open_bi().await.unwrap();
    write(&mut nan_ctl, &hello("nan")).await.unwrap();
    let _welcome = read_frame(&mut nan_rx, DEFAULT_MAX_FRAME).await.unwrap();
    let mut s = nan.open_uni().await.unwrap();
    write(&mut s, &update(&[2, 2], &[f32::NAN; 4])).await.unwrap();
    s.finish().unwrap();
    let (reply, _) = read_frame(&mut nan_rx, DEFAULT_MAX_FRAME).await.unwrap().unwrap();
    assert_eq!(refusal_reason(Some(reply)), RefusalReason::BadTensor);

    // The round still completes with the well-behaved updates.
    upload(sloppy.clone(), update(&[2, 2], &[3.0; 4])).await;
    upload(good.clone(), update(&[2, 2], &[1.0; 4])).await;
    let report = loop {
        match tokio::time::timeout(Duration::from_secs(20), server.events.recv()).await.expect("round closes") {
            Some(ServerEvent::RoundClosed { report, checkpoint }) => {
                assert_eq!(checkpoint.global[0].decode().unwrap(), vec![2.0; 4], "FedAvg of the two good updates");
                break report;
            }
            Some(_) => continue,
            None => panic!("server stopped"),
        }
    };
    assert_eq!(report.updates.len(), 2);
    let m = &server.metrics;
    println!("decode errors {}, refusals {}", m.decode_errors_total(), m.refusals_total());
    assert!(m.decode_errors_total() >= 5, "every malformed frame is counted");
    assert!(m.refusals_total() >= 6, "every refusal is counted");
    // … by reason, in the exposition Prometheus reads.
    let text = m.render();
    let by_reason: f64 = text
        .lines()
        .filter(|l| l.starts_with("anchorage_refusals_total{reason="))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(by_reason, m.refusals_total() as f64, "{text}");
    assert!(m.refusals_of("malformed") >= 1, "{text}");
    server.shutdown().await.unwrap();
}
