//! Named parameter blocks and their wire encodings.
//!
//! Tensor data travels as raw little-endian bytes (`serde_bytes`), never as postcard varints,
//! so a 1 MB block costs 1 MB on the wire plus a few bytes of header.

use alloc::string::String;
use alloc::vec::Vec;
use bytes::Bytes;
use half::{bf16, f16};
use serde::{Deserialize, Serialize};

/// Longest accepted block name, in bytes.
pub const MAX_NAME_LEN: usize = 256;
/// Highest accepted tensor rank.
pub const MAX_RANK: usize = 8;

/// How the values of a tensor are laid out on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Encoding {
    /// IEEE 754 single precision, 4 bytes per value.
    F32,
    /// IEEE 754 half precision, 2 bytes per value.
    F16,
    /// bfloat16, 2 bytes per value.
    Bf16,
    /// Symmetric int8 quantisation: value = q · scale, 1 byte per value.
    Int8 {
        /// The value of one quantisation step.
        scale: f32,
    },
    /// Top-k sparse delta (appended): `k` increasing `u32` indices, then `k` values in
    /// the layout `values`, added to the block of the model the round was broadcast from
    /// ([`crate::sparse`]).
    TopK {
        /// Number of entries sent.
        k: u32,
        /// The layout of the values.
        values: Dense,
    },
    /// One zstd frame of the bytes `inner` lays out (appended; [`crate::compress`]).
    Zstd {
        /// The layout of the bytes inside the frame.
        inner: Packed,
    },
}

/// A dense layout, one value per element: the encodings of protocol v1, as the values of a
/// top-k delta or the contents of a zstd frame.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Dense {
    /// IEEE 754 single precision, 4 bytes per value.
    F32,
    /// IEEE 754 half precision, 2 bytes per value.
    F16,
    /// bfloat16, 2 bytes per value.
    Bf16,
    /// Symmetric int8 quantisation: value = q · scale, 1 byte per value.
    Int8 {
        /// The value of one quantisation step.
        scale: f32,
    },
}

/// What a zstd frame holds: a dense layout or a top-k delta.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Packed {
    /// Values one per element, in this layout.
    Dense(Dense),
    /// A top-k sparse delta.
    TopK {
        /// Number of entries.
        k: u32,
        /// The layout of the values.
        values: Dense,
    },
}

impl From<Dense> for Encoding {
    fn from(d: Dense) -> Self {
        match d {
            Dense::F32 => Encoding::F32,
            Dense::F16 => Encoding::F16,
            Dense::Bf16 => Encoding::Bf16,
            Dense::Int8 { scale } => Encoding::Int8 { scale },
        }
    }
}

impl Packed {
    /// The encoding of the frame's contents.
    pub fn encoding(self) -> Encoding {
        match self {
            Packed::Dense(d) => d.into(),
            Packed::TopK { k, values } => Encoding::TopK { k, values },
        }
    }
}

impl Encoding {
    /// Bytes one sent value takes before any compression: 4 for an index plus the value's bytes
    /// in a top-k delta; the contents' for zstd.
    pub fn bytes_per_value(self) -> usize {
        match self {
            Encoding::F32 => 4,
            Encoding::F16 | Encoding::Bf16 => 2,
            Encoding::Int8 { .. } => 1,
            Encoding::TopK { values, .. } => 4 + Encoding::from(values).bytes_per_value(),
            Encoding::Zstd { inner } => inner.encoding().bytes_per_value(),
        }
    }

    /// A short lowercase name (`f32`, `f16`, `bf16`, `int8`, `top-k`, `zstd`).
    pub fn name(self) -> &'static str {
        match self {
            Encoding::F32 => "f32",
            Encoding::F16 => "f16",
            Encoding::Bf16 => "bf16",
            Encoding::Int8 { .. } => "int8",
            Encoding::TopK { .. } => "top-k",
            Encoding::Zstd { .. } => "zstd",
        }
    }

    /// The dense layout, if this is one.
    pub fn as_dense(self) -> Option<Dense> {
        match self {
            Encoding::F32 => Some(Dense::F32),
            Encoding::F16 => Some(Dense::F16),
            Encoding::Bf16 => Some(Dense::Bf16),
            Encoding::Int8 { scale } => Some(Dense::Int8 { scale }),
            Encoding::TopK { .. } | Encoding::Zstd { .. } => None,
        }
    }

    /// What a zstd frame of this layout would hold (`None` for zstd itself).
    pub fn packed(self) -> Option<Packed> {
        match self {
            Encoding::TopK { k, values } => Some(Packed::TopK { k, values }),
            Encoding::Zstd { .. } => None,
            dense => dense.as_dense().map(Packed::Dense),
        }
    }
}

/// What is wrong with a tensor or block that arrived from outside.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TensorError {
    /// A shape of more than [`MAX_RANK`] dimensions.
    #[error("tensor rank {rank} exceeds the maximum of {MAX_RANK}")]
    RankTooHigh {
        /// The shape's rank.
        rank: usize,
    },
    /// A shape whose element count overflows `usize`.
    #[error("tensor shape {shape:?} has too many elements")]
    ShapeOverflow {
        /// The shape.
        shape: Vec<u32>,
    },
    /// Data of another length than the shape and encoding need.
    #[error("tensor of shape {shape:?} in {encoding} needs {expected} bytes, got {got}")]
    LengthMismatch {
        /// The tensor's shape.
        shape: Vec<u32>,
        /// The encoding's name ([`Encoding::name`]).
        encoding: &'static str,
        /// Bytes the shape and encoding need.
        expected: usize,
        /// Bytes the data has.
        got: usize,
    },
    /// A NaN or infinite value.
    #[error("tensor holds a non-finite value at index {index}")]
    NonFinite {
        /// Index of the first such value.
        index: usize,
    },
    /// An int8 scale that is negative, NaN or infinite.
    #[error("int8 scale {scale} is not a finite non-negative number")]
    BadScale {
        /// The scale.
        scale: f32,
    },
    /// A block name that is empty or longer than [`MAX_NAME_LEN`] bytes.
    #[error("block name is empty or longer than {MAX_NAME_LEN} bytes")]
    BadName,
    /// A tensor error inside a named block.
    #[error("block `{name}`: {source}")]
    InBlock {
        /// The block's name.
        name: String,
        /// What is wrong with its tensor.
        source: alloc::boxed::Box<TensorError>,
    },
    /// A top-k delta decoded without the model the round was broadcast from.
    #[error("a top-k delta decodes only against the model the round was broadcast from")]
    NeedsBase,
    /// A delta base whose length is not the block's.
    #[error("the delta's base has {got} values, the block {expected}")]
    BaseMismatch {
        /// The block's element count.
        expected: usize,
        /// Values in the base.
        got: usize,
    },
    /// A top-k delta with more entries than the block has elements.
    #[error("top-k of {k} entries exceeds the block's {len} elements")]
    TopKTooLarge {
        /// Entries of the delta.
        k: u32,
        /// Elements of the block.
        len: usize,
    },
    /// A top-k index at or past the block's end.
    #[error("top-k index {index} is past the block's end ({len} elements)")]
    IndexPastEnd {
        /// The index.
        index: u32,
        /// Elements of the block.
        len: usize,
    },
    /// A top-k index not strictly above the one before it.
    #[error("top-k index {index} at position {position} is not above the index before it")]
    IndexOrder {
        /// Position of the index in the delta's index list.
        position: usize,
        /// The index.
        index: u32,
    },
    /// A zstd frame that declares or inflates to more bytes than the block needs.
    #[error("zstd frame inflates past the block's declared {limit} bytes")]
    Inflated {
        /// Bytes the block's shape and encoding need.
        limit: usize,
    },
    /// A zstd frame that is truncated, corrupt, or not the block's size.
    #[error("zstd frame is truncated or corrupt: {detail}")]
    BadFrame {
        /// What is wrong with the frame.
        detail: String,
    },
    /// An encoding this build cannot decode.
    #[error("encoding {encoding} is not supported by this build")]
    Unsupported {
        /// The encoding's name ([`Encoding::name`]).
        encoding: &'static str,
    },
    /// A prototype in an encoding that is not dense.
    #[error("a {encoding} tensor cannot carry a prototype (prototypes travel dense)")]
    NotDense {
        /// The encoding's name ([`Encoding::name`]).
        encoding: &'static str,
    },
}

/// A tensor encoded for the wire: shape, encoding and raw little-endian bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EncodedTensor {
    /// Dimensions, outermost first.
    pub shape: Vec<u32>,
    /// How the data lays out the values.
    pub encoding: Encoding,
    /// Shared, not copied: a cloned block (a broadcast to every connection, an update kept for
    /// resending) points at the same bytes. Serialized as `serde_bytes` did, so the wire and
    /// every stable hash are unchanged.
    pub data: Bytes,
}

/// Number of elements of a shape, or `None` on overflow.
pub fn element_count(shape: &[u32]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d as usize))
}

/// Number of elements of a shape, checked against [`MAX_RANK`] and overflow.
fn checked_len(shape: &[u32]) -> Result<usize, TensorError> {
    if shape.len() > MAX_RANK {
        return Err(TensorError::RankTooHigh { rank: shape.len() });
    }
    element_count(shape).ok_or_else(|| TensorError::ShapeOverflow { shape: shape.to_vec() })
}

/// Bytes the data of a tensor of `shape` in `encoding` (not zstd) takes.
pub(crate) fn data_len(shape: &[u32], encoding: Encoding) -> Result<usize, TensorError> {
    let n = checked_len(shape)?;
    let count = match encoding {
        Encoding::TopK { k, .. } if k as usize > n => return Err(TensorError::TopKTooLarge { k, len: n }),
        Encoding::TopK { k, .. } => k as usize,
        _ => n,
    };
    count.checked_mul(encoding.bytes_per_value()).ok_or_else(|| TensorError::ShapeOverflow { shape: shape.to_vec() })
}

impl EncodedTensor {
    /// Encodes `values` (row-major, of `shape`) with `encoding`. For `Int8` the scale given is
    /// ignored and recomputed as max|x| / 127. A top-k delta needs the broadcast's block
    /// ([`crate::sparse::encode`]): here every value goes in its value layout; `Zstd` packs the
    /// result where that makes it smaller ([`crate::compress::pack`]).
    pub fn encode(shape: &[u32], values: &[f32], encoding: Encoding) -> Self {
        match encoding {
            Encoding::TopK { values: dense, .. } => Self::encode(shape, values, dense.into()),
            Encoding::Zstd { inner } => {
                let plain = Self::encode(shape, values, inner.encoding());
                crate::compress::pack(&plain).unwrap_or(plain)
            }
            dense => Self::encode_dense(shape, values, dense),
        }
    }

    fn encode_dense(shape: &[u32], values: &[f32], encoding: Encoding) -> Self {
        debug_assert_eq!(element_count(shape), Some(values.len()));
        let mut data = Vec::with_capacity(values.len() * encoding.bytes_per_value());
        let encoding = match encoding {
            Encoding::F32 => {
                values.iter().for_each(|v| data.extend_from_slice(&v.to_le_bytes()));
                Encoding::F32
            }
            Encoding::F16 => {
                values.iter().for_each(|v| data.extend_from_slice(&f16::from_f32(*v).to_le_bytes()));
                Encoding::F16
            }
            Encoding::Bf16 => {
                values.iter().for_each(|v| data.extend_from_slice(&bf16::from_f32(*v).to_le_bytes()));
                Encoding::Bf16
            }
            Encoding::Int8 { .. } => {
                let max = values.iter().fold(0f32, |m, v| m.max(v.abs()));
                let scale = if max > 0.0 { max / 127.0 } else { 0.0 };
                for v in values {
                    let q = if scale > 0.0 { libm_round(v / scale).clamp(-127.0, 127.0) } else { 0.0 };
                    data.push(q as i8 as u8);
                }
                Encoding::Int8 { scale }
            }
            sparse_or_packed => sparse_or_packed,
        };
        Self { shape: shape.to_vec(), encoding, data: data.into() }
    }

    /// Edits the bytes (copy on write: whoever else holds them keeps theirs).
    pub fn edit_data(&mut self, edit: impl FnOnce(&mut Vec<u8>)) {
        let mut data = self.data.to_vec();
        edit(&mut data);
        self.data = data.into();
    }

    /// Number of elements the shape declares (checked).
    pub fn len(&self) -> Result<usize, TensorError> {
        checked_len(&self.shape)
    }

    /// True when the tensor holds no element.
    pub fn is_empty(&self) -> bool {
        self.len().map(|n| n == 0).unwrap_or(true)
    }

    /// Checks that the byte length matches the shape and that every value is finite. A top-k
    /// delta's indices are checked too; a zstd frame's header only (one whole frame declaring
    /// its layout's size): what it holds is checked when it is decoded.
    pub fn validate(&self) -> Result<(), TensorError> {
        match self.encoding {
            Encoding::TopK { k, values } => crate::sparse::entries(self.len()?, k, values, &self.data).map(|_| ()),
            Encoding::Zstd { inner } => {
                crate::compress::check_frame(&self.data, data_len(&self.shape, inner.encoding())?)
            }
            _ => self.decode().map(|_| ()),
        }
    }

    /// Decodes to f32 values, checking length, scale and finiteness. A top-k delta has no
    /// values of its own ([`TensorError::NeedsBase`]): see [`EncodedTensor::decode_against`].
    pub fn decode(&self) -> Result<Vec<f32>, TensorError> {
        match self.encoding {
            Encoding::TopK { .. } => Err(TensorError::NeedsBase),
            Encoding::Zstd { inner } => crate::compress::unpacked(&self.shape, inner, &self.data)?.decode(),
            _ => self.decode_dense(),
        }
    }

    /// Decodes to f32 values, a top-k delta added to `base` (the values of the block the round
    /// was broadcast with); a dense tensor ignores `base`.
    pub fn decode_against(&self, base: &[f32]) -> Result<Vec<f32>, TensorError> {
        match self.encoding {
            Encoding::TopK { k, values } => {
                let n = self.len()?;
                let (indices, deltas) = crate::sparse::entries(n, k, values, &self.data)?;
                if base.len() != n {
                    return Err(TensorError::BaseMismatch { expected: n, got: base.len() });
                }
                let out = crate::sparse::apply(base, &indices, &deltas);
                match out.iter().position(|v| !v.is_finite()) {
                    Some(index) => Err(TensorError::NonFinite { index }),
                    None => Ok(out),
                }
            }
            Encoding::Zstd { inner } => crate::compress::unpacked(&self.shape, inner, &self.data)?.decode_against(base),
            _ => self.decode_dense(),
        }
    }

    fn decode_dense(&self) -> Result<Vec<f32>, TensorError> {
        let n = self.len()?;
        let expected = n
            .checked_mul(self.encoding.bytes_per_value())
            .ok_or_else(|| TensorError::ShapeOverflow { shape: self.shape.clone() })?;
        if self.data.len() != expected {
            return Err(TensorError::LengthMismatch {
                shape: self.shape.clone(),
                encoding: self.encoding.name(),
                expected,
                got: self.data.len(),
            });
        }
        let values: Vec<f32> = match self.encoding {
            Encoding::F32 => self.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Encoding::F16 => self.data.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Encoding::Bf16 => self.data.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Encoding::Int8 { scale } => {
                if !scale.is_finite() || scale < 0.0 {
                    return Err(TensorError::BadScale { scale });
                }
                self.data.iter().map(|&b| (b as i8) as f32 * scale).collect()
            }
            Encoding::TopK { .. } | Encoding::Zstd { .. } => return Err(TensorError::NeedsBase),
        };
        if let Some(index) = values.iter().position(|v| !v.is_finite()) {
            return Err(TensorError::NonFinite { index });
        }
        Ok(values)
    }
}

/// Round half away from zero without `std` (`f32::round` needs std).
fn libm_round(x: f32) -> f32 {
    let t = x as i64 as f32; // truncation toward zero; |x| ≤ 127 here
    let frac = x - t;
    if frac >= 0.5 {
        t + 1.0
    } else if frac <= -0.5 {
        t - 1.0
    } else {
        t
    }
}

/// A named parameter block (`adapter.0.weight`, `head.bias`, `prompt.pool`, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ParamBlock {
    /// The block's name.
    pub name: String,
    /// The block's values.
    pub tensor: EncodedTensor,
}

impl ParamBlock {
    /// Encodes f32 `values` of `shape` under `name`.
    pub fn encode(name: impl Into<String>, shape: &[u32], values: &[f32], encoding: Encoding) -> Self {
        Self { name: name.into(), tensor: EncodedTensor::encode(shape, values, encoding) }
    }

    /// Checks the name, the length and finiteness of the values.
    pub fn validate(&self) -> Result<(), TensorError> {
        if self.name.is_empty() || self.name.len() > MAX_NAME_LEN {
            return Err(TensorError::BadName);
        }
        self.tensor.validate().map_err(|e| self.wrap(e))
    }

    /// Decodes to f32 values (checked), naming the block in any error.
    pub fn decode(&self) -> Result<Vec<f32>, TensorError> {
        self.tensor.decode().map_err(|e| self.wrap(e))
    }

    /// Decodes to f32 values against `base`, the values of the block the round was broadcast
    /// with (a top-k delta is added to it), naming the block in any error.
    pub fn decode_against(&self, base: &[f32]) -> Result<Vec<f32>, TensorError> {
        self.tensor.decode_against(base).map_err(|e| self.wrap(e))
    }

    fn wrap(&self, e: TensorError) -> TensorError {
        TensorError::InBlock { name: self.name.clone(), source: alloc::boxed::Box::new(e) }
    }

    /// Payload size of the values in bytes.
    pub fn payload_bytes(&self) -> usize {
        self.tensor.data.len()
    }
}

/// Total payload bytes of a set of blocks.
pub fn payload_bytes(blocks: &[ParamBlock]) -> usize {
    blocks.iter().map(ParamBlock::payload_bytes).sum()
}
