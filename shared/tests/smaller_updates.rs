//! Issue 33, smaller updates on the wire: top-k deltas and zstd frames travel in protocol v1's
//! Update, appended to the encodings without changing the old ones, and a bad one is refused
//! when the frame is decoded.

use anchorage_shared::frame::{DEFAULT_MAX_FRAME, decode_frame, encode_frame};
use anchorage_shared::protocol::{DecodeError, Update};
use anchorage_shared::tensor::{Dense, EncodedTensor, Encoding, Packed, ParamBlock, TensorError};
use anchorage_shared::{Message, compress, sparse};

fn update(blocks: Vec<ParamBlock>) -> Message {
    Message::Update(Update {
        prototypes_are: Default::default(),
        round: 3,
        num_samples: 10,
        blocks,
        prototypes: Vec::new(),
        metrics: Vec::new(),
        compute_seconds: 0.0,
    })
}

fn delta(n: usize) -> Vec<f32> {
    (0..n).map(|i| if i % 50 == 0 { (i as f32).sin() } else { 1e-4 }).collect()
}

fn top_k_block() -> ParamBlock {
    let d = delta(1000);
    ParamBlock {
        name: "adapter.0.weight".into(),
        tensor: sparse::encode(&[1000], &d, &sparse::top_k(&d, 20), Dense::F16),
    }
}

fn zstd_block() -> ParamBlock {
    let values: Vec<f32> = (0..1000).map(|i| (i % 7) as f32).collect();
    let tensor = compress::pack(&EncodedTensor::encode(&[1000], &values, Encoding::F32)).expect("built with zstd");
    ParamBlock { name: "head.weight".into(), tensor }
}

fn decode(msg: &Message) -> Result<Message, DecodeError> {
    decode_frame(&encode_frame(msg, DEFAULT_MAX_FRAME).unwrap(), DEFAULT_MAX_FRAME)
}

fn refused_with(msg: &Message, expect: impl Fn(&TensorError) -> bool) {
    match decode(msg) {
        Err(DecodeError::Tensor(TensorError::InBlock { source, .. })) if expect(&source) => {}
        other => panic!("expected a tensor refusal, got {other:?}"),
    }
}

#[test]
fn the_v1_encodings_keep_their_bytes_and_the_new_ones_are_appended() {
    let bytes = |e: Encoding| postcard::to_allocvec(&e).unwrap();
    assert_eq!(bytes(Encoding::F32), [0]);
    assert_eq!(bytes(Encoding::F16), [1]);
    assert_eq!(bytes(Encoding::Bf16), [2]);
    assert_eq!(bytes(Encoding::Int8 { scale: 0.5 }), [3, 0, 0, 0, 63]);
    assert_eq!(bytes(Encoding::TopK { k: 5, values: Dense::F16 }), [4, 5, 1]);
    assert_eq!(bytes(Encoding::Zstd { inner: Packed::Dense(Dense::F32) }), [5, 0, 0]);
}

#[test]
fn top_k_and_zstd_blocks_round_trip_through_a_frame() {
    let msg = update(vec![top_k_block(), zstd_block()]);
    assert_eq!(decode(&msg).unwrap(), msg);
}

#[test]
fn an_index_past_the_end_is_refused_at_the_frame() {
    let mut b = top_k_block();
    b.tensor.edit_data(|d| d[..4].copy_from_slice(&1000u32.to_le_bytes()));
    refused_with(&update(vec![b]), |e| matches!(e, TensorError::IndexPastEnd { index: 1000, len: 1000 }));
}

#[test]
fn k_past_the_block_is_refused_at_the_frame() {
    let mut b = top_k_block();
    b.tensor.shape = vec![10];
    refused_with(&update(vec![b]), |e| matches!(e, TensorError::TopKTooLarge { k: 20, len: 10 }));
}

#[test]
fn a_zstd_bomb_is_refused_at_the_frame() {
    let mut b = zstd_block();
    b.tensor.data = zstd::bulk::compress(&vec![0u8; 16 << 20], 3).unwrap().into();
    refused_with(&update(vec![b]), |e| matches!(e, TensorError::Inflated { limit: 4000 }));
}

#[test]
fn a_truncated_zstd_stream_is_refused_at_the_frame() {
    let mut b = zstd_block();
    b.tensor.data.truncate(b.tensor.data.len() / 2);
    refused_with(&update(vec![b]), |e| matches!(e, TensorError::BadFrame { .. }));
}

#[test]
fn a_prototype_travels_dense() {
    let mut p = anchorage_shared::Prototype::encode(1, 1, &[1.0, 2.0], Encoding::F32);
    p.vector = sparse::encode(&[2], &[1.0, 2.0], &[1], Dense::F32);
    assert!(matches!(p.validate(), Err(TensorError::NotDense { encoding: "top-k" })));
}
