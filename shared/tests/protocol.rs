//! Protocol v1 on its own: every message round-trips through a frame, every malformed input gets
//! its typed error, and no byte string makes the decoder panic (property tests).

use anchorage_shared::frame::{DEFAULT_MAX_FRAME, FrameReader, HEADER_BYTES, LEN_BYTES, decode_frame, encode_frame};
use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::*;
use anchorage_shared::tensor::{Encoding, ParamBlock, TensorError};
use anchorage_shared::{Message, PROTOCOL_VERSION, Prototype};
use proptest::prelude::*;

fn capabilities() -> Capabilities {
    let mut methods = heapless::Vec::new();
    methods.push(heapless::String::try_from("fedavg").unwrap()).unwrap();
    methods.push(heapless::String::try_from("gldp").unwrap()).unwrap();
    Capabilities { backend: "flex".into(), memory_mb: 512, methods }
}

fn blocks() -> Vec<ParamBlock> {
    vec![
        ParamBlock::encode("head.weight", &[2, 3], &[0.5, -1.0, 2.0, 0.0, 1.5, -0.25], Encoding::F32),
        ParamBlock::encode("head.bias", &[2], &[0.5, -0.5], Encoding::F16),
        ParamBlock::encode("adapter.0.weight", &[3], &[1.0, 2.0, -4.0], Encoding::Bf16),
        ParamBlock::encode("prompt.pool", &[4], &[0.1, -0.2, 0.3, -0.4], Encoding::Int8 { scale: 0.0 }),
    ]
}

/// One of every message kind, with non-trivial contents.
fn every_message() -> Vec<Message> {
    let config = RoundConfig { local_epochs: 2, batch_size: 16, learning_rate: 1e-3, deadline_ms: 30_000 };
    let prototypes = vec![Prototype::encode(3, 17, &[0.25, -0.5, 1.0], Encoding::F32)];
    vec![
        Message::Hello(Box::new(Hello {
            client_id: "jetson-07".into(),
            capabilities: capabilities(),
            num_samples: 1234,
            last_round: Some(4),
        })),
        Message::Welcome(Welcome {
            server_id: "anchorage".into(),
            method: "fedavg".into(),
            max_frame_bytes: 1 << 20,
            heartbeat_ms: 5000,
            current_round: None,
        }),
        Message::Broadcast(Broadcast { round: 5, task: 1, config, blocks: blocks(), prototypes: prototypes.clone() }),
        Message::Update(Update {
            prototypes_are: Default::default(),
            round: 5,
            num_samples: 99,
            blocks: blocks(),
            prototypes,
            metrics: vec![Metric { name: "train_loss".into(), value: 0.75 }],
            compute_seconds: 1.5,
        }),
        Message::Ack(Ack { round: 5, aggregated: false }),
        Message::Heartbeat(Heartbeat { seq: u64::MAX }),
        Message::Refusal(Refusal::duplicates("round 5: counted already", vec!["jetson-07".into(), "jetson-08".into()])),
        Message::Goodbye(Goodbye { reason: "federation finished".into() }),
        Message::Cost(CostRecord {
            client: String::new(),
            round: 5,
            payload_up: 1_000_000,
            wire_up: 1_030_000,
            compute_seconds: 2.5,
            transfer_seconds: 8.1,
            rtt_seconds: 0.04,
            joules: 12.0,
            ..CostRecord::default()
        }),
        Message::Partial(partial()),
        Message::CostBatch(CostBatch {
            records: vec![CostRecord { client: "jetson-07".into(), round: 5, payload_up: 10, ..CostRecord::default() }],
        }),
    ]
}

/// A relay's partial aggregate of two devices.
fn partial() -> Partial {
    let member = |device: &str, num_samples| Member { device: device.into(), num_samples, hash: [7; 32] };
    Partial {
        update: Update {
            prototypes_are: Default::default(),
            round: 5,
            num_samples: 30,
            blocks: blocks(),
            prototypes: vec![Prototype::encode(3, 17, &[0.25, -0.5, 1.0], Encoding::F32)],
            metrics: vec![],
            compute_seconds: 3.0,
        },
        members: vec![member("jetson-07", 10), member("jetson-08", 20)],
    }
}

/// A partial aggregate whose samples are not its members' sum, that names a device twice or
/// none, or that holds a bad tensor, and a cost batch with an impossible record, are refused
/// at decode.
#[test]
fn a_partial_aggregate_must_add_up() {
    let refused = |msg: Message| {
        let frame = encode_frame(&msg, DEFAULT_MAX_FRAME).unwrap();
        decode_frame(&frame, DEFAULT_MAX_FRAME).expect_err("refused at decode")
    };
    let mut p = partial();
    p.update.num_samples = 31;
    assert!(refused(Message::Partial(p)).to_string().contains("members' sum"));
    let mut p = partial();
    p.members[1].device = "jetson-07".into();
    p.update.num_samples = 20;
    p.members[1].num_samples = 10;
    assert!(refused(Message::Partial(p)).to_string().contains("twice"));
    let mut p = partial();
    p.members.clear();
    p.update.num_samples = 0;
    assert!(refused(Message::Partial(p)).to_string().contains("members"));
    let mut p = partial();
    p.update.compute_seconds = f64::NAN;
    refused(Message::Partial(p));
    let bad = CostRecord { client: "x".into(), round: 1, compute_seconds: -1.0, ..CostRecord::default() };
    refused(Message::CostBatch(CostBatch { records: vec![bad] }));
}

#[test]
fn every_message_round_trips_through_a_frame() {
    let messages = every_message();
    let kinds: Vec<u8> = messages.iter().map(Message::kind).collect();
    assert_eq!(kinds, (1..=9).chain([KIND_PARTIAL, 17]).collect::<Vec<u8>>(), "one message of each kind");
    for msg in messages {
        let frame = encode_frame(&msg, DEFAULT_MAX_FRAME).unwrap();
        assert_eq!(frame[LEN_BYTES], PROTOCOL_VERSION);
        assert_eq!(frame[LEN_BYTES + 1], msg.kind());
        // Int8 with scale 0 decodes to zeros, so compare the re-decoded frame, not the input values.
        assert_eq!(decode_frame(&frame, DEFAULT_MAX_FRAME).unwrap(), msg, "{}", msg.kind_name());
    }
}

#[test]
fn frames_arriving_byte_by_byte_are_reassembled() {
    let messages = every_message();
    let stream: Vec<u8> = messages.iter().flat_map(|m| encode_frame(m, DEFAULT_MAX_FRAME).unwrap()).collect();
    let mut reader = FrameReader::new(DEFAULT_MAX_FRAME);
    let mut out = Vec::new();
    for byte in stream {
        reader.push(&[byte]);
        while let Some(m) = reader.next_frame().unwrap() {
            out.push(m);
        }
    }
    assert_eq!(out, messages);
    assert_eq!(reader.buffered(), 0);
}

#[test]
fn tensor_data_travels_as_raw_bytes() {
    let values: Vec<f32> = (0..250_000).map(|i| i as f32 * 1e-3).collect();
    let block = ParamBlock::encode("adapter.0.weight", &[500, 500], &values, Encoding::F32);
    let msg = Message::Update(Update {
        prototypes_are: Default::default(),
        round: 1,
        num_samples: 1,
        blocks: vec![block],
        prototypes: vec![],
        metrics: vec![],
        compute_seconds: 0.0,
    });
    let frame = encode_frame(&msg, DEFAULT_MAX_FRAME).unwrap();
    let payload = 4 * values.len();
    assert!(frame.len() >= payload && frame.len() < payload + 64, "frame {} for payload {payload}", frame.len());
}

fn header(len: u32, version: u8, kind: u8) -> Vec<u8> {
    let mut v = len.to_le_bytes().to_vec();
    v.push(version);
    v.push(kind);
    v
}

#[test]
fn malformed_frames_get_typed_errors() {
    let good = encode_frame(&every_message()[0], DEFAULT_MAX_FRAME).unwrap();
    // Truncated: the stream ends in the middle of a frame.
    assert!(matches!(decode_frame(&good[..good.len() - 3], DEFAULT_MAX_FRAME), Err(DecodeError::Truncated { .. })));
    assert!(matches!(decode_frame(&good[..2], DEFAULT_MAX_FRAME), Err(DecodeError::Truncated { .. })));
    // Oversized: refused from the length prefix alone, before buffering the body.
    let mut reader = FrameReader::new(1024);
    reader.push(&header(1 << 30, PROTOCOL_VERSION, 4));
    assert!(matches!(reader.next_frame(), Err(DecodeError::Oversized { len, max: 1024 }) if len == 1 << 30));
    assert!(matches!(encode_frame(&every_message()[2], 16), Err(DecodeError::Oversized { .. })));
    // Wrong version.
    let mut wrong = good.clone();
    wrong[LEN_BYTES] = PROTOCOL_VERSION + 1;
    assert!(
        matches!(decode_frame(&wrong, DEFAULT_MAX_FRAME), Err(DecodeError::WrongVersion { got, .. }) if got == PROTOCOL_VERSION + 1)
    );
    // Unknown kind.
    let mut unknown = good.clone();
    unknown[LEN_BYTES + 1] = 200;
    assert!(matches!(decode_frame(&unknown, DEFAULT_MAX_FRAME), Err(DecodeError::UnknownKind(200))));
    // A length shorter than the header.
    assert!(matches!(decode_frame(&[1, 0, 0, 0, 1], DEFAULT_MAX_FRAME), Err(DecodeError::Truncated { .. })));
    // Garbage body.
    let mut garbage = header((HEADER_BYTES + 3) as u32, PROTOCOL_VERSION, 1);
    garbage.extend_from_slice(&[0xff, 0xff, 0xff]);
    assert!(matches!(decode_frame(&garbage, DEFAULT_MAX_FRAME), Err(DecodeError::Body { kind: "hello", .. })));
    // Trailing bytes after one complete frame.
    let mut trailing = good.clone();
    trailing.push(0);
    assert!(matches!(decode_frame(&trailing, DEFAULT_MAX_FRAME), Err(DecodeError::Invalid(_))));
}

fn update_with(block: ParamBlock) -> Message {
    Message::Update(Update {
        prototypes_are: Default::default(),
        round: 1,
        num_samples: 1,
        blocks: vec![block],
        prototypes: vec![],
        metrics: vec![],
        compute_seconds: 0.0,
    })
}

#[test]
fn bad_tensors_are_refused_at_decode() {
    let encode = |m: &Message| encode_frame(m, DEFAULT_MAX_FRAME).unwrap();
    // Shape/length mismatch: a 2×3 block carrying 5 values.
    let mut short = ParamBlock::encode("head.weight", &[2, 3], &[0.0; 6], Encoding::F32);
    short.tensor.data.truncate(20);
    let err = decode_frame(&encode(&update_with(short)), DEFAULT_MAX_FRAME).unwrap_err();
    assert!(
        matches!(&err, DecodeError::Tensor(TensorError::InBlock { name, source })
        if name == "head.weight" && matches!(**source, TensorError::LengthMismatch { expected: 24, got: 20, .. })),
        "{err}"
    );
    // Non-finite values.
    let nan = ParamBlock::encode("head.bias", &[3], &[0.0, f32::NAN, 1.0], Encoding::F32);
    let err = decode_frame(&encode(&update_with(nan)), DEFAULT_MAX_FRAME).unwrap_err();
    assert!(
        matches!(&err, DecodeError::Tensor(TensorError::InBlock { source, .. }) if matches!(**source, TensorError::NonFinite { index: 1 }))
    );
    let inf = ParamBlock::encode("head.bias", &[1], &[f32::INFINITY], Encoding::F16);
    assert!(decode_frame(&encode(&update_with(inf)), DEFAULT_MAX_FRAME).is_err());
    // Bad int8 scale.
    let mut scaled = ParamBlock::encode("head.bias", &[2], &[1.0, 2.0], Encoding::Int8 { scale: 0.0 });
    scaled.tensor.encoding = Encoding::Int8 { scale: f32::NAN };
    assert!(decode_frame(&encode(&update_with(scaled)), DEFAULT_MAX_FRAME).is_err());
    // Shapes whose element count overflows, and ranks above the maximum.
    let mut huge = ParamBlock::encode("x", &[1], &[0.0], Encoding::F32);
    huge.tensor.shape = vec![u32::MAX, u32::MAX, u32::MAX];
    assert!(decode_frame(&encode(&update_with(huge)), DEFAULT_MAX_FRAME).is_err());
    let mut deep = ParamBlock::encode("x", &[1], &[0.0], Encoding::F32);
    deep.tensor.shape = vec![1; 9];
    assert!(decode_frame(&encode(&update_with(deep)), DEFAULT_MAX_FRAME).is_err());
    // Empty name, duplicate blocks, non-finite metrics, negative compute time, empty client id.
    assert!(
        decode_frame(&encode(&update_with(ParamBlock::encode("", &[1], &[0.0], Encoding::F32))), DEFAULT_MAX_FRAME)
            .is_err()
    );
    let b = ParamBlock::encode("head.bias", &[1], &[0.0], Encoding::F32);
    let dup = Message::Update(Update {
        prototypes_are: Default::default(),
        round: 1,
        num_samples: 1,
        blocks: vec![b.clone(), b],
        prototypes: vec![],
        metrics: vec![],
        compute_seconds: 0.0,
    });
    assert!(matches!(decode_frame(&encode(&dup), DEFAULT_MAX_FRAME), Err(DecodeError::Invalid(_))));
    let metric = Message::Update(Update {
        prototypes_are: Default::default(),
        round: 1,
        num_samples: 1,
        blocks: vec![],
        prototypes: vec![],
        metrics: vec![Metric { name: "loss".into(), value: f64::NAN }],
        compute_seconds: 0.0,
    });
    assert!(matches!(decode_frame(&encode(&metric), DEFAULT_MAX_FRAME), Err(DecodeError::Invalid(_))));
    let time = Message::Update(Update {
        prototypes_are: Default::default(),
        round: 1,
        num_samples: 1,
        blocks: vec![],
        prototypes: vec![],
        metrics: vec![],
        compute_seconds: -1.0,
    });
    assert!(matches!(decode_frame(&encode(&time), DEFAULT_MAX_FRAME), Err(DecodeError::Invalid(_))));
    let hello = Message::Hello(Box::new(Hello {
        client_id: String::new(),
        capabilities: capabilities(),
        num_samples: 0,
        last_round: None,
    }));
    assert!(matches!(decode_frame(&encode(&hello), DEFAULT_MAX_FRAME), Err(DecodeError::Invalid(_))));
    // A cost report with a negative or non-finite figure.
    let cost = Message::Cost(CostRecord { transfer_seconds: f64::NAN, ..CostRecord::default() });
    assert!(matches!(decode_frame(&encode(&cost), DEFAULT_MAX_FRAME), Err(DecodeError::Invalid(_))));
    let cost = Message::Cost(CostRecord { joules: -1.0, ..CostRecord::default() });
    assert!(matches!(decode_frame(&encode(&cost), DEFAULT_MAX_FRAME), Err(DecodeError::Invalid(_))));
    // A prototype that is not a vector.
    let mut proto = Prototype::encode(1, 1, &[1.0, 2.0], Encoding::F32);
    proto.vector.shape = vec![1, 2];
    let bad_proto = Message::Update(Update {
        prototypes_are: Default::default(),
        round: 1,
        num_samples: 1,
        blocks: vec![],
        prototypes: vec![proto],
        metrics: vec![],
        compute_seconds: 0.0,
    });
    assert!(decode_frame(&encode(&bad_proto), DEFAULT_MAX_FRAME).is_err());
}

#[test]
fn a_hostile_hello_cannot_announce_unbounded_methods() {
    // 17 method names: one more than MAX_METHODS. Hand-built with postcard's varint layout.
    let mut body = postcard::to_allocvec(&"c1").unwrap();
    body.extend(postcard::to_allocvec(&"flex").unwrap());
    body.push(0); // memory_mb = 0
    body.push((MAX_METHODS + 1) as u8);
    for _ in 0..=MAX_METHODS {
        body.extend(postcard::to_allocvec(&"m").unwrap());
    }
    body.push(0); // num_samples
    body.push(0); // last_round: None
    let mut frame = header((HEADER_BYTES + body.len()) as u32, PROTOCOL_VERSION, 1);
    frame.extend(body);
    assert!(matches!(decode_frame(&frame, DEFAULT_MAX_FRAME), Err(DecodeError::Body { kind: "hello", .. })));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Random bytes never panic the reader, and every outcome is a message or a typed error.
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512), max in 8usize..4096) {
        let mut reader = FrameReader::new(max);
        reader.push(&bytes);
        for _ in 0..8 {
            match reader.next_frame() {
                Ok(Some(_)) => continue,
                Ok(None) | Err(_) => break,
            }
        }
        let _ = decode_frame(&bytes, max);
    }

    /// Valid frames with bytes flipped, inserted, removed or cut never panic the decoder; an
    /// intact header with a mutated body either decodes to a valid message or is refused.
    #[test]
    fn mutated_frames_never_panic(
        which in 0usize..9,
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        insert in proptest::collection::vec(any::<u8>(), 0..6),
    ) {
        let msg = &every_message()[which];
        let mut frame = encode_frame(msg, DEFAULT_MAX_FRAME).unwrap();
        for (at, byte) in &flips {
            let i = at.index(frame.len());
            frame[i] ^= byte;
        }
        if let Ok(decoded) = decode_frame(&frame, DEFAULT_MAX_FRAME) {
            prop_assert!(decoded.validate().is_ok());
        }
        let mut cut_frame = frame.clone();
        cut_frame.truncate(cut.index(frame.len()));
        // A cut frame decodes only where its length field (which a flip may have changed) names
        // exactly the bytes left: the reader never takes a frame short of what it declares.
        let declared = LEN_BYTES + u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
        prop_assert!(decode_frame(&cut_frame, DEFAULT_MAX_FRAME).is_err() || cut_frame.len() == declared);
        let mut grown = frame.clone();
        let at = cut.index(grown.len());
        grown.splice(at..at, insert.iter().copied());
        let _ = decode_frame(&grown, DEFAULT_MAX_FRAME);
    }

    /// Encoded values come back within the encoding's precision.
    #[test]
    fn encodings_round_trip(values in proptest::collection::vec(-1000f32..1000f32, 1..64)) {
        let max = values.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (encoding, tolerance) in [(Encoding::F32, 0.0), (Encoding::F16, 1e-3 * max), (Encoding::Bf16, 8e-3 * max), (Encoding::Int8 { scale: 0.0 }, max / 127.0)] {
            let block = ParamBlock::encode("b", &[values.len() as u32], &values, encoding);
            let back = block.decode().unwrap();
            for (a, b) in values.iter().zip(&back) {
                prop_assert!((a - b).abs() <= tolerance + 1e-6, "{encoding:?}: {a} vs {b}");
            }
        }
    }
}

/// A decline (kind 14) travels with its reason; a detail beyond the bound is refused.
#[test]
fn a_decline_round_trips_and_its_detail_is_bounded() {
    let encode = |m: &Message| encode_frame(m, DEFAULT_MAX_FRAME).unwrap();
    use anchorage_shared::ledger::DeclineReason;
    use anchorage_shared::protocol::{Decline, MAX_DECLINE_DETAIL};
    for reason in DeclineReason::ALL {
        let msg = Message::Decline(Decline { round: 7, reason, detail: format!("{} check", reason.name()) });
        assert_eq!(msg.kind(), 14);
        assert_eq!(decode_frame(&encode(&msg), DEFAULT_MAX_FRAME).unwrap(), msg);
    }
    let long = Message::Decline(Decline {
        round: 7,
        reason: DeclineReason::Thermal,
        detail: "x".repeat(MAX_DECLINE_DETAIL + 1),
    });
    assert!(matches!(decode_frame(&encode(&long), DEFAULT_MAX_FRAME), Err(DecodeError::Invalid(_))));
}

/// A cost record from a client that predates the condition fields is read, with none of them;
/// a record with them keeps them; impossible readings are refused.
#[test]
fn cost_records_of_old_clients_are_read_and_conditions_are_checked() {
    let encode = |m: &Message| encode_frame(m, DEFAULT_MAX_FRAME).unwrap();
    // Without a decline or a condition, a record's stable encoding is the old clients' one.
    let body = CostRecord { round: 4, payload_up: 10, joules: 2.0, ..CostRecord::default() }.stable_encoding();
    let Message::Cost(read) = Message::decode_body(9, &body).unwrap() else { panic!("not a cost record") };
    assert_eq!(read, CostRecord { round: 4, payload_up: 10, joules: 2.0, ..CostRecord::default() });
    let with = CostRecord {
        round: 5,
        temperature_c: Some(71.5),
        throttled: Some(true),
        battery_percent: Some(40),
        external_power: Some(false),
        power_mode: Some("nvpmodel 2".into()),
        ..CostRecord::default()
    };
    let msg = Message::Cost(with);
    assert_eq!(decode_frame(&encode(&msg), DEFAULT_MAX_FRAME).unwrap(), msg);
    for bad in [
        CostRecord { temperature_c: Some(f32::NAN), ..CostRecord::default() },
        CostRecord { temperature_c: Some(900.0), ..CostRecord::default() },
        CostRecord { battery_percent: Some(101), ..CostRecord::default() },
        CostRecord { power_mode: Some("m".repeat(33)), ..CostRecord::default() },
        CostRecord { readings_refused: Some(u32::MAX), ..CostRecord::default() },
    ] {
        let frame = encode(&Message::Cost(bad.clone()));
        assert!(matches!(decode_frame(&frame, DEFAULT_MAX_FRAME), Err(DecodeError::Invalid(_))), "{bad:?}");
    }
}

/// The body of a v1 refusal, as a peer of protocol v1 encodes it: its reason and its detail,
/// nothing after them.
#[derive(serde::Serialize)]
struct RefusalOfV1<'a> {
    reason: RefusalReason,
    detail: &'a str,
}

/// A v1 peer's refusal decodes (no devices named), and a v1 peer's decoder reads a refusal
/// that names devices as its reason and detail: the typed devices follow v1's fields.
#[test]
fn a_v1_refusal_decodes_and_v1_reads_the_new_one() {
    let v1 = postcard::to_allocvec(&RefusalOfV1 { reason: RefusalReason::Duplicate, detail: "replaced" }).unwrap();
    let refusal = Message::decode_body(7, &v1).expect("a v1 body decodes");
    assert_eq!(refusal, Message::Refusal(Refusal::new(RefusalReason::Duplicate, "replaced")));

    let typed = Refusal::duplicates("counted already", vec!["edge-1".into(), "edge-2".into()]);
    let body = Message::Refusal(typed.clone()).encode_body();
    assert!(body.len() > v1.len(), "the devices follow the v1 fields");
    #[derive(serde::Deserialize, Debug, PartialEq)]
    struct AsV1Reads {
        reason: RefusalReason,
        detail: String,
    }
    let seen: AsV1Reads = postcard::from_bytes(&body).expect("a v1 decoder reads the v1 fields and stops");
    assert_eq!(seen, AsV1Reads { reason: RefusalReason::Duplicate, detail: "counted already".into() });
    assert_eq!(Message::decode_body(7, &body).unwrap(), Message::Refusal(typed));
    assert!(Message::decode_body(7, &[v1.as_slice(), &[0xff]].concat()).is_err(), "a broken tail is an error");
    let revoked = Message::Refusal(Refusal::new(RefusalReason::Revoked, "certificate revoked"));
    assert_eq!(Message::decode_body(7, &revoked.encode_body()).unwrap(), revoked, "revocation is its own reason");
}

/// The message table gives every kind one row: kinds are distinct, every row's name is what
/// `kind_name` says, and every message built here encodes under its row's kind.
#[test]
fn the_message_table_has_one_row_a_kind() {
    let kinds: std::collections::BTreeSet<u8> = KINDS.iter().map(|(k, _, _)| *k).collect();
    assert_eq!(kinds.len(), KINDS.len(), "no kind byte twice");
    for (kind, name, _) in KINDS {
        assert_eq!(kind_name(*kind), Some(*name));
    }
    for msg in every_message() {
        assert!(kinds.contains(&msg.kind()), "{} has a row", msg.kind_name());
    }
    assert_eq!(kind_name(KINDS.len() as u8 + 1), None);
}

/// Every message built here converts into `Upward` exactly when its row says `Up` or `Both`, into
/// `Downward` exactly when it says `Down` or `Both`, and back into the same message.
#[test]
fn each_message_takes_the_directions_its_row_names() {
    for msg in every_message() {
        let (_, name, dir) = KINDS.iter().find(|(k, _, _)| *k == msg.kind()).expect("a row");
        let up = Upward::try_from(msg.clone());
        let down = Downward::try_from(msg.clone());
        assert_eq!(up.is_ok(), matches!(dir, Direction::Up | Direction::Both), "{name} upward");
        assert_eq!(down.is_ok(), matches!(dir, Direction::Down | Direction::Both), "{name} downward");
        if let Ok(up) = up {
            assert_eq!(up.kind_name(), *name);
            assert_eq!(Message::from(up), msg);
        }
        if let Ok(down) = down {
            assert_eq!(down.kind_name(), *name);
            assert_eq!(Message::from(down), msg);
        }
    }
}

/// An update's prototypes' form is a field in memory and protocol v1's marker metric on the wire:
/// a v1 device's marked update decodes as sums without the metric, and a v1 server reads the
/// marker in what this build sends.
#[test]
fn prototype_sums_travel_as_v1_marker_and_arrive_as_a_field() {
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct UpdateOfV1 {
        round: u64,
        num_samples: u64,
        blocks: Vec<ParamBlock>,
        prototypes: Vec<anchorage_shared::Prototype>,
        metrics: Vec<Metric>,
        compute_seconds: f64,
    }
    let loss = Metric::new(anchorage_shared::MetricKey::TrainLoss, 0.5);
    let marker = Metric::new(anchorage_shared::MetricKey::PrototypeSums, 1.0);
    let v1 = UpdateOfV1 {
        round: 3,
        num_samples: 7,
        blocks: vec![],
        prototypes: vec![],
        metrics: vec![loss.clone(), marker.clone()],
        compute_seconds: 1.5,
    };
    let Message::Update(update) = Message::decode_body(KIND_UPDATE, &postcard::to_allocvec(&v1).unwrap()).unwrap()
    else {
        panic!("an update")
    };
    assert_eq!(update.prototypes_are, PrototypeForm::Sums);
    assert_eq!(update.metrics, vec![loss.clone()], "the marker is no metric in memory");
    let sent: UpdateOfV1 = postcard::from_bytes(&Message::Update(update.clone()).encode_body()).unwrap();
    assert_eq!(sent, v1, "the v1 bytes, marker last");
    let means = Update { prototypes_are: PrototypeForm::Means, ..update };
    let sent: UpdateOfV1 = postcard::from_bytes(&Message::Update(means).encode_body()).unwrap();
    assert_eq!(sent.metrics, vec![loss], "means carry no marker");
}
