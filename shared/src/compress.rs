//! zstd over an encoded block's bytes: [`Encoding::Zstd`] wraps a dense or top-k
//! layout in one zstd frame (RFC 8878) that declares its content size.
//!
//! Why zstd: its entropy stage (Huffman-coded literals, FSE-coded sequences) shrinks float bytes
//! whose exponents repeat and top-k indices whose high bytes repeat, where an LZ-only codec such
//! as lz4 finds few repeated strings in float noise; and libzstd is a well-kept C library that
//! zstd-sys builds from source with the C compiler the TLS stack (ring) already needs.
//!
//! A frame from outside is bounded before anything is inflated: exactly one complete frame, a
//! declared content size equal to the inner layout's size (the block's shape says it), and a
//! one-shot decompression into a buffer of that size, so a frame that inflates further fails
//! instead of allocating ([`TensorError::Inflated`]).

#[cfg(feature = "zstd")]
use alloc::string::ToString;
use alloc::vec::Vec;

use crate::tensor::{EncodedTensor, Encoding, Packed, TensorError};

/// zstd's default level: about 300 MB/s on one core, most of the ratio of the higher levels on
/// float data.
pub const LEVEL: i32 = 3;

/// `tensor` in one zstd frame ([`Encoding::Zstd`] of its layout), or `None` when the frame is no
/// smaller than the bytes (the block then travels as it was) or the layout cannot be wrapped.
pub fn pack(tensor: &EncodedTensor) -> Option<EncodedTensor> {
    let inner = tensor.encoding.packed()?;
    let data = pack_bytes(&tensor.data)?;
    (data.len() < tensor.data.len()).then(|| EncodedTensor {
        shape: tensor.shape.clone(),
        encoding: Encoding::Zstd { inner },
        data: data.into(),
    })
}

#[cfg(feature = "zstd")]
fn pack_bytes(data: &[u8]) -> Option<Vec<u8>> {
    zstd::bulk::compress(data, LEVEL).ok()
}

#[cfg(not(feature = "zstd"))]
fn pack_bytes(_: &[u8]) -> Option<Vec<u8>> {
    None
}

/// Checks the frame without inflating it: one complete frame, nothing after it, and a declared
/// content size of exactly `expected` bytes.
#[cfg(feature = "zstd")]
pub(crate) fn check_frame(src: &[u8], expected: usize) -> Result<(), TensorError> {
    use zstd::zstd_safe;
    let frame = zstd_safe::find_frame_compressed_size(src).map_err(bad_frame)?;
    if frame != src.len() {
        return Err(TensorError::BadFrame { detail: "bytes after the zstd frame".to_string() });
    }
    match zstd_safe::get_frame_content_size(src) {
        Ok(Some(size)) if size > expected as u64 => Err(TensorError::Inflated { limit: expected }),
        Ok(Some(size)) if size < expected as u64 => {
            Err(TensorError::BadFrame { detail: alloc::format!("declares {size} bytes, the block needs {expected}") })
        }
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(TensorError::BadFrame { detail: "the frame does not declare its content size".to_string() }),
        Err(_) => Err(TensorError::BadFrame { detail: "unreadable frame header".to_string() }),
    }
}

/// The `expected` bytes a checked frame holds; more is [`TensorError::Inflated`], a frame that
/// stops short or is corrupt is [`TensorError::BadFrame`].
#[cfg(feature = "zstd")]
pub(crate) fn unpack(src: &[u8], expected: usize) -> Result<Vec<u8>, TensorError> {
    use zstd::zstd_safe;
    check_frame(src, expected)?;
    // The capacity bounds the output: zstd never grows the buffer.
    let mut out = Vec::with_capacity(expected);
    let written = zstd_safe::decompress(&mut out, src).map_err(|code| {
        if zstd_safe::get_error_name(code).contains("too small") {
            TensorError::Inflated { limit: expected }
        } else {
            bad_frame(code)
        }
    })?;
    if written != expected {
        return Err(TensorError::BadFrame { detail: alloc::format!("inflates to {written} bytes, not {expected}") });
    }
    Ok(out)
}

#[cfg(feature = "zstd")]
fn bad_frame(code: usize) -> TensorError {
    TensorError::BadFrame { detail: zstd::zstd_safe::get_error_name(code).to_string() }
}

#[cfg(not(feature = "zstd"))]
pub(crate) fn check_frame(_: &[u8], _: usize) -> Result<(), TensorError> {
    Err(TensorError::Unsupported { encoding: "zstd" })
}

#[cfg(not(feature = "zstd"))]
pub(crate) fn unpack(_: &[u8], _: usize) -> Result<Vec<u8>, TensorError> {
    Err(TensorError::Unsupported { encoding: "zstd" })
}

/// The layout a zstd frame of `inner` holds, as a tensor of `shape`.
pub(crate) fn unpacked(shape: &[u32], inner: Packed, src: &[u8]) -> Result<EncodedTensor, TensorError> {
    let encoding = inner.encoding();
    let expected = crate::tensor::data_len(shape, encoding)?;
    Ok(EncodedTensor { shape: shape.to_vec(), encoding, data: unpack(src, expected)?.into() })
}

#[cfg(all(test, feature = "zstd"))]
mod tests {
    use super::*;
    use crate::tensor::Dense;
    use alloc::vec;

    fn packed(values: &[f32]) -> EncodedTensor {
        let t = EncodedTensor::encode(&[values.len() as u32], values, Encoding::F32);
        pack(&t).expect("repetitive values compress")
    }

    fn wave(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i % 17) as f32) * 0.125).collect()
    }

    #[test]
    fn a_packed_block_decodes_to_its_values() {
        let values = wave(4096);
        let t = packed(&values);
        assert_eq!(t.encoding, Encoding::Zstd { inner: Packed::Dense(Dense::F32) });
        assert!(t.data.len() < 4096 * 4 / 4, "{} bytes", t.data.len());
        t.validate().unwrap();
        assert_eq!(t.decode().unwrap(), values);
    }

    #[test]
    fn a_block_that_does_not_shrink_travels_as_it_was() {
        // Eight bytes of noise: a frame's header and checksum alone are larger.
        let mut rng = crate::rng::Rng::new(7);
        let values: Vec<f32> = (0..2).map(|_| rng.f32()).collect();
        assert!(pack(&EncodedTensor::encode(&[2], &values, Encoding::F32)).is_none());
    }

    #[test]
    fn a_truncated_frame_is_refused() {
        let mut t = packed(&wave(4096));
        t.data.truncate(t.data.len() - 3);
        assert!(matches!(t.validate(), Err(TensorError::BadFrame { .. })), "{:?}", t.validate());
        assert!(matches!(t.decode(), Err(TensorError::BadFrame { .. })));
    }

    #[test]
    fn bytes_after_the_frame_are_refused() {
        let mut t = packed(&wave(4096));
        t.edit_data(|d| d.extend_from_slice(&[0, 1, 2]));
        assert!(matches!(t.validate(), Err(TensorError::BadFrame { .. })));
    }

    #[test]
    fn a_bomb_past_the_declared_size_is_refused_before_inflating() {
        // 64 MiB of zeros in a few kB, under a block that declares 16 values.
        let zeros = vec![0u8; 64 << 20];
        let bomb = zstd::bulk::compress(&zeros, LEVEL).unwrap();
        assert!(bomb.len() < 64 << 10);
        let t = EncodedTensor {
            shape: vec![16],
            encoding: Encoding::Zstd { inner: Packed::Dense(Dense::F32) },
            data: bomb.into(),
        };
        assert_eq!(t.validate(), Err(TensorError::Inflated { limit: 64 }));
        assert_eq!(t.decode(), Err(TensorError::Inflated { limit: 64 }));
    }

    #[test]
    fn a_frame_that_lies_about_its_size_is_refused() {
        // A frame whose header says 64 bytes but whose content is longer: the one-shot
        // decompression into 64 bytes fails instead of growing the buffer.
        let long = zstd::bulk::compress(&[1u8; 200], LEVEL).unwrap();
        // Rewrite the 1-byte content size field (single-segment frame, FCS flag 0): 200 → 64.
        let pos = long.iter().position(|&b| b == 200).expect("content size byte");
        let mut lying = long.clone();
        lying[pos] = 64;
        let t = EncodedTensor {
            shape: vec![16],
            encoding: Encoding::Zstd { inner: Packed::Dense(Dense::F32) },
            data: lying.into(),
        };
        let err = t.decode().unwrap_err();
        assert!(matches!(err, TensorError::Inflated { .. } | TensorError::BadFrame { .. }), "{err:?}");
    }

    #[test]
    fn a_frame_short_of_the_declared_size_is_refused() {
        let short = zstd::bulk::compress(&[0u8; 32], LEVEL).unwrap();
        let t = EncodedTensor {
            shape: vec![16],
            encoding: Encoding::Zstd { inner: Packed::Dense(Dense::F32) },
            data: short.into(),
        };
        assert!(matches!(t.validate(), Err(TensorError::BadFrame { .. })));
    }
}
