//! Top-k sparsification of a block's delta: a device sends the k entries of
//! Δ = (trained − broadcast) + e of largest magnitude and keeps the rest, e' = Δ − C(Δ), for its
//! next round: error feedback as in Stich, Cordonnier, Jaggi 2018, "Sparsified SGD with Memory"
//! (memory update m_{t+1} = m_t + η g_t − comp_k(m_t + η g_t), their Algorithm 1), and Lin et
//! al. 2018, "Deep Gradient Compression" (local accumulation). The device half is in the client
//! crate (`anchorage_client::compress`); this module is the layout both sides share.
//!
//! Layout of [`Encoding::TopK`]: `k` strictly increasing little-endian `u32` indices, then the
//! `k` values in the dense layout `values` names. The receiver adds them to the block of the
//! model the round was broadcast from ([`EncodedTensor::decode_against`]).

use alloc::vec::Vec;

use crate::tensor::{Dense, EncodedTensor, Encoding, TensorError};

/// How many entries a fraction of `n` keeps: ⌈fraction · n⌉, at least 1 and at most `n`.
pub fn k_of(fraction: f64, n: usize) -> usize {
    let k = libm::ceil(fraction * n as f64);
    if k.is_nan() || k < 1.0 {
        1.min(n)
    } else if k >= n as f64 {
        n
    } else {
        k as usize
    }
}

/// The indices of the `k` entries of largest magnitude, in increasing order (ties: the
/// selection is deterministic for a given input).
pub fn top_k(delta: &[f32], k: usize) -> Vec<u32> {
    let k = k.min(delta.len());
    let mut order: Vec<u32> = (0..delta.len() as u32).collect();
    if k < delta.len() && k > 0 {
        order.select_nth_unstable_by(k - 1, |&a, &b| delta[b as usize].abs().total_cmp(&delta[a as usize].abs()));
    }
    order.truncate(k);
    order.sort_unstable();
    order
}

/// The top-k tensor of `shape` that carries `delta` at `indices` (increasing), its values in
/// the layout `values` (an int8 scale is computed over the values sent).
pub fn encode(shape: &[u32], delta: &[f32], indices: &[u32], values: Dense) -> EncodedTensor {
    let picked: Vec<f32> = indices.iter().map(|&i| delta[i as usize]).collect();
    let packed = EncodedTensor::encode(&[picked.len() as u32], &picked, values.into());
    let mut data = Vec::with_capacity(indices.len() * 4 + packed.data.len());
    indices.iter().for_each(|i| data.extend_from_slice(&i.to_le_bytes()));
    data.extend_from_slice(&packed.data);
    let values = packed.encoding.as_dense().unwrap_or(values);
    EncodedTensor {
        shape: shape.to_vec(),
        encoding: Encoding::TopK { k: indices.len() as u32, values },
        data: data.into(),
    }
}

/// The delta a top-k tensor carries, as (index, value) pairs, checked: `k` within the block,
/// the byte length, every index below `n` and above the one before it, finite values.
pub(crate) fn entries(n: usize, k: u32, values: Dense, data: &[u8]) -> Result<(Vec<u32>, Vec<f32>), TensorError> {
    let k_len = k as usize;
    if k_len > n {
        return Err(TensorError::TopKTooLarge { k, len: n });
    }
    let index_bytes = k_len * 4;
    let values = EncodedTensor {
        shape: alloc::vec![k],
        encoding: values.into(),
        data: bytes::Bytes::copy_from_slice(data.get(index_bytes..).unwrap_or_default()),
    };
    let expected = index_bytes + k_len * values.encoding.bytes_per_value();
    if data.len() != expected {
        return Err(TensorError::LengthMismatch {
            shape: alloc::vec![n as u32],
            encoding: "top-k",
            expected,
            got: data.len(),
        });
    }
    let mut indices = Vec::with_capacity(k_len);
    for (position, c) in data[..index_bytes].chunks_exact(4).enumerate() {
        let index = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        if index as usize >= n {
            return Err(TensorError::IndexPastEnd { index, len: n });
        }
        if indices.last().is_some_and(|&last| index <= last) {
            return Err(TensorError::IndexOrder { position, index });
        }
        indices.push(index);
    }
    Ok((indices, values.decode()?))
}

/// `base` with the delta added at its indices.
pub(crate) fn apply(base: &[f32], indices: &[u32], deltas: &[f32]) -> Vec<f32> {
    let mut out = base.to_vec();
    for (&i, &d) in indices.iter().zip(deltas) {
        out[i as usize] += d;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Packed;
    use alloc::vec;

    fn block(indices: &[u32], values: &[f32], n: u32) -> EncodedTensor {
        let mut delta = vec![0.0; n as usize];
        for (&i, &v) in indices.iter().zip(values) {
            delta[i as usize] = v;
        }
        encode(&[n], &delta, indices, Dense::F32)
    }

    #[test]
    fn the_largest_magnitudes_are_kept_in_index_order() {
        let delta = [0.1, -5.0, 0.2, 3.0, -0.3, 4.0];
        assert_eq!(top_k(&delta, 3), vec![1, 3, 5]);
        assert_eq!(top_k(&delta, 6), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(top_k(&delta, 0), Vec::<u32>::new());
        assert_eq!((k_of(0.01, 1000), k_of(0.001, 10), k_of(2.0, 10), k_of(0.5, 0)), (10, 1, 10, 0));
    }

    #[test]
    fn a_top_k_delta_decodes_against_its_base_only() {
        let t = block(&[1, 3], &[2.0, -1.0], 4);
        assert_eq!(t.encoding, Encoding::TopK { k: 2, values: Dense::F32 });
        assert_eq!(t.data.len(), 2 * 4 + 2 * 4);
        t.validate().unwrap();
        assert_eq!(t.decode_against(&[1.0, 1.0, 1.0, 1.0]).unwrap(), vec![1.0, 3.0, 1.0, 0.0]);
        assert_eq!(t.decode(), Err(TensorError::NeedsBase));
        assert_eq!(t.decode_against(&[1.0]), Err(TensorError::BaseMismatch { expected: 4, got: 1 }));
    }

    #[test]
    fn values_may_travel_in_half_precision_or_int8() {
        let delta = [0.0, 0.5, 0.0, -0.25];
        for values in [Dense::F16, Dense::Bf16, Dense::Int8 { scale: 0.0 }] {
            let t = encode(&[4], &delta, &[1, 3], values);
            let out = t.decode_against(&[0.0; 4]).unwrap();
            assert!(out.iter().zip(&delta).all(|(a, b)| (a - b).abs() < 0.01), "{values:?}: {out:?}");
        }
    }

    #[test]
    fn an_index_past_the_end_is_refused() {
        let mut t = block(&[1, 3], &[2.0, -1.0], 4);
        t.edit_data(|d| d[4..8].copy_from_slice(&4u32.to_le_bytes()));
        assert_eq!(t.validate(), Err(TensorError::IndexPastEnd { index: 4, len: 4 }));
        assert_eq!(t.decode_against(&[0.0; 4]), Err(TensorError::IndexPastEnd { index: 4, len: 4 }));
        t.edit_data(|d| d[4..8].copy_from_slice(&u32::MAX.to_le_bytes()));
        assert!(matches!(t.validate(), Err(TensorError::IndexPastEnd { .. })));
    }

    #[test]
    fn repeated_or_unordered_indices_are_refused() {
        let mut t = block(&[1, 3], &[2.0, -1.0], 4);
        t.edit_data(|d| d[4..8].copy_from_slice(&1u32.to_le_bytes()));
        assert_eq!(t.validate(), Err(TensorError::IndexOrder { position: 1, index: 1 }));
    }

    #[test]
    fn k_larger_than_the_block_is_refused() {
        let mut t = block(&[0, 1, 2, 3], &[1.0; 4], 4);
        t.shape = vec![3];
        assert_eq!(t.validate(), Err(TensorError::TopKTooLarge { k: 4, len: 3 }));
        t.encoding = Encoding::TopK { k: u32::MAX, values: Dense::F32 };
        assert!(matches!(t.validate(), Err(TensorError::TopKTooLarge { .. })));
    }

    #[test]
    fn a_short_or_non_finite_payload_is_refused() {
        let mut t = block(&[1, 3], &[2.0, -1.0], 4);
        t.data.truncate(12);
        assert!(matches!(t.validate(), Err(TensorError::LengthMismatch { expected: 16, got: 12, .. })));
        let t = block(&[1, 3], &[f32::NAN, -1.0], 4);
        assert!(matches!(t.validate(), Err(TensorError::NonFinite { .. })));
    }

    #[test]
    fn a_zstd_top_k_delta_round_trips() {
        let delta: Vec<f32> = (0..4096).map(|i| if i % 40 == 0 { i as f32 } else { 0.0 }).collect();
        let idx = top_k(&delta, 103);
        let t = encode(&[4096], &delta, &idx, Dense::F32);
        let Some(z) = crate::compress::pack(&t) else { return }; // a build without zstd
        assert_eq!(z.encoding, Encoding::Zstd { inner: Packed::TopK { k: 103, values: Dense::F32 } });
        z.validate().unwrap();
        assert_eq!(z.decode_against(&vec![0.0; 4096]).unwrap(), t.decode_against(&vec![0.0; 4096]).unwrap());
    }
}
