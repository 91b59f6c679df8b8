//! Updates in any encoding become dense here, once, as they arrive: a top-k delta is
//! added to the block of the model its round was broadcast from, a zstd frame is inflated into
//! at most that block's size, and everything after (the layout check, the screens, the store,
//! the aggregation) sees f32 values only.

use anchorage_shared::protocol::Update;
use anchorage_shared::tensor::{Encoding, ParamBlock, TensorError};

/// `update` with each block that is not dense decoded against the same-named, same-shaped
/// block of `base` (the broadcast's model) and re-encoded as f32. A block with no such block
/// in `base` stays as it came: the layout check refuses it before anything inflates it.
pub(super) fn densify(mut update: Update, base: &[ParamBlock]) -> Result<Update, TensorError> {
    for block in &mut update.blocks {
        if block.tensor.encoding.as_dense().is_some() {
            continue;
        }
        let Some(reference) = base.iter().find(|b| b.name == block.name && b.tensor.shape == block.tensor.shape) else {
            continue;
        };
        let values = block.decode_against(&reference.decode()?)?;
        *block = ParamBlock::encode(block.name.clone(), &block.tensor.shape, &values, Encoding::F32);
    }
    Ok(update)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use anchorage_shared::tensor::{Dense, EncodedTensor};
    use anchorage_shared::{compress, sparse};

    fn update(blocks: Vec<ParamBlock>) -> Update {
        Update {
            prototypes_are: Default::default(),
            round: 1,
            num_samples: 1,
            blocks,
            prototypes: Vec::new(),
            metrics: Vec::new(),
            compute_seconds: 0.0,
        }
    }

    fn dense(values: &[f32]) -> ParamBlock {
        ParamBlock::encode("w", &[values.len() as u32], values, Encoding::F32)
    }

    #[test]
    fn a_top_k_delta_lands_on_the_broadcast_model() {
        let base = [dense(&[1.0, 2.0, 3.0, 4.0])];
        let delta = [0.0, 0.5, 0.0, -1.0];
        let sent = ParamBlock { name: "w".into(), tensor: sparse::encode(&[4], &delta, &[1, 3], Dense::F32) };
        let out = densify(update(vec![sent]), &base).unwrap();
        assert_eq!(out.blocks[0], dense(&[1.0, 2.5, 3.0, 3.0]));
    }

    #[test]
    fn a_zstd_block_inflates_and_a_dense_one_is_untouched() {
        let values: Vec<f32> = (0..1024).map(|i| (i % 5) as f32).collect();
        let packed = compress::pack(&EncodedTensor::encode(&[1024], &values, Encoding::F16)).unwrap();
        let base = [dense(&[0.0; 1024]), ParamBlock::encode("b", &[1], &[9.0], Encoding::F32)];
        let b16 = ParamBlock::encode("b", &[1], &[1.0], Encoding::F16);
        let out = densify(update(vec![ParamBlock { name: "w".into(), tensor: packed }, b16.clone()]), &base).unwrap();
        assert_eq!(out.blocks[0], dense(&values));
        assert_eq!(out.blocks[1], b16);
    }

    #[test]
    fn a_block_the_model_does_not_have_is_left_to_the_layout_check() {
        let base = [dense(&[0.0; 2])];
        let other = ParamBlock { name: "w".into(), tensor: sparse::encode(&[3], &[1.0, 0.0, 0.0], &[0], Dense::F32) };
        let out = densify(update(vec![other.clone()]), &base).unwrap();
        assert_eq!(out.blocks[0], other);
    }

    #[test]
    fn a_bad_index_is_an_error_not_a_panic() {
        let base = [dense(&[0.0; 4])];
        let mut bad =
            ParamBlock { name: "w".into(), tensor: sparse::encode(&[4], &[1.0, 0.0, 0.0, 0.0], &[0], Dense::F32) };
        bad.tensor.edit_data(|d| d[..4].copy_from_slice(&9u32.to_le_bytes()));
        let err = densify(update(vec![bad]), &base).unwrap_err();
        assert!(
            matches!(&err, TensorError::InBlock { source, .. } if matches!(**source, TensorError::IndexPastEnd { index: 9, len: 4 })),
            "{err}"
        );
    }

    /// Through the engine: a top-k update is aggregated as the values it stands for, and one
    /// with an index past its block's end is refused with `BadTensor`, before any ack.
    #[test]
    fn the_engine_aggregates_a_top_k_update_and_refuses_a_bad_one() {
        use super::super::{Action, Engine, EngineConfig};
        use anchorage_shared::Message;
        use anchorage_shared::protocol::{Capabilities, Hello, RefusalReason};
        let config = EngineConfig {
            rounds: 2,
            min_available: 3,
            fraction: 0.5,
            min_fit: 2,
            over_selection: 0.5,
            robust: crate::aggregate::RobustConfig::unbounded(),
            ..EngineConfig::default()
        };
        let mut e = Engine::new(config, Box::new(crate::methods::FedAvg::default()), vec![dense(&[1.0; 4])]);
        for id in ["a", "b", "c"] {
            let mut methods = heapless::Vec::new();
            methods.push(heapless::String::try_from("fedavg").unwrap()).unwrap();
            let caps = Capabilities { backend: "flex".into(), memory_mb: 256, methods };
            let hello = Hello { client_id: id.into(), capabilities: caps, num_samples: 10, last_round: None };
            e.handle_message(Duration::ZERO, id, Message::Hello(Box::new(hello)));
        }
        while e.poll_action().is_some() {}
        let sparse_block = |index: u32| {
            let mut t = sparse::encode(&[4], &[2.0, 0.0, 0.0, 0.0], &[0], Dense::F32);
            t.edit_data(|d| d[..4].copy_from_slice(&index.to_le_bytes()));
            ParamBlock { name: "w".into(), tensor: t }
        };
        let send = |e: &mut Engine, id: &str, b: ParamBlock| {
            let u = Update { round: 1, num_samples: 10, blocks: vec![b], ..update(Vec::new()) };
            e.handle_message(Duration::from_secs(1), id, Message::Update(u));
            std::iter::from_fn(|| e.poll_action()).collect::<Vec<Action>>()
        };
        let refused = send(&mut e, "c", sparse_block(4));
        assert!(
            refused.iter().any(
                |a| matches!(a, Action::Send { msg: Message::Refusal(r), .. } if r.reason == RefusalReason::BadTensor)
            ),
            "{refused:?}"
        );
        send(&mut e, "a", sparse_block(0));
        send(&mut e, "b", dense(&[1.0, 1.0, 1.0, 3.0]));
        assert_eq!(e.global()[0].decode().unwrap(), vec![2.0, 1.0, 1.0, 2.0]);
    }
}
