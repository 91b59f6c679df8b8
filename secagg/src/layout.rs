//! A federated update as one `u32` vector and back, so that SecAgg+ sums whole updates (Bonawitz
//! et al. 2017, §3: the inputs are vectors over Z_R; Bell et al. 2020 sum the same way).
//!
//! The vector is the quantised weighted delta from the global model, block by block, then the
//! quantised prototype sums (class-major, `classes × dim`), then the per-class sample counts as
//! raw integers, then the device's quantised weight w. With `weight_scale` > 0, w = min(n /
//! weight_scale, 1) for a device of n samples, so the sum gives FedAvg's sample-weighted mean
//! Σ w_u Δ_u / Σ w_u (McMahan et al. 2017) with each device's voice capped at weight_scale
//! samples; with 0, every w is 1 (equal weights, as differential privacy needs).
//! Each segment has its own bound, so no sum of up to `max_clients` vectors wraps: the delta is
//! L2-clipped to `clip` and each element lies in `[-clip, clip]`; a class sum is clipped to
//! `count · prototype_clip ≤ max_count · prototype_clip`; a count is at most `max_count`, and
//! `max_count · max_clients ≤ 2^32 − 1` ([`Layout::check`]).
//!
//! [`ServerFrame`] carries the layout to a device with round 0's Setup.

use std::collections::BTreeSet;

use anchorage_shared::protocol::Update;
use anchorage_shared::prototype::Prototype;
use anchorage_shared::tensor::{EncodedTensor, Encoding, ParamBlock, element_count};
use serde::{Deserialize, Serialize};

use crate::error::SecAggError;
use crate::messages::ServerMessage;
use crate::quantize::{Quantizer, Rounding};

/// What every device's vector holds, in order, fixed by the server for a round.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    /// The shared blocks, by name and shape, in the global model's order.
    pub blocks: Vec<(String, Vec<u32>)>,
    /// Prototype classes 0..classes, each `dim` values (0 classes: the method sends none).
    pub classes: u32,
    /// The length of each prototype (the feature dimension).
    pub dim: u32,
    /// L2 clip of the device's delta from the global model (all blocks as one vector).
    pub clip: f32,
    /// Norm bound of one sample's feature; a class sum is clipped to count · prototype_clip.
    pub prototype_clip: f32,
    /// The largest count a device may put on one class (larger counts are capped).
    pub max_count: u32,
    /// Most contributors a sum may hold (the quantisers' headroom).
    pub max_clients: u32,
    /// The sample count of a full weight (see the module doc); 0: equal weights.
    #[serde(default)]
    pub weight_scale: f32,
}

/// The two quantisers of a layout: the delta's, and the prototype sums' (none without classes).
struct Quantizers {
    delta: Quantizer,
    sums: Option<Quantizer>,
    /// The weight's, over [0, 1].
    weight: Quantizer,
}

impl Layout {
    /// Refuses a layout whose sums could wrap or whose vector could not be sent.
    pub fn check(&self) -> Result<(), SecAggError> {
        self.quantizers().map(|_| ())
    }

    /// Elements of every device's vector (`usize::MAX` where that overflows; `check` refuses it).
    pub fn vector_len(&self) -> usize {
        self.checked_len().and_then(|n| usize::try_from(n).ok()).unwrap_or(usize::MAX)
    }

    /// Elements of the delta segment, or `None` on overflow.
    fn delta_len(&self) -> Option<u64> {
        self.blocks.iter().try_fold(0u64, |acc, (_, shape)| acc.checked_add(element_count(shape)? as u64))
    }

    /// Elements of the whole vector, or `None` on overflow.
    fn checked_len(&self) -> Option<u64> {
        let classes = u64::from(self.classes);
        self.delta_len()?.checked_add(classes * u64::from(self.dim))?.checked_add(classes)?.checked_add(1)
    }

    /// A device's weight w in [0, 1] for `num_samples` (see the module doc).
    pub fn weight(&self, num_samples: u64) -> f64 {
        if self.weight_scale > 0.0 { (num_samples as f64 / f64::from(self.weight_scale)).min(1.0) } else { 1.0 }
    }

    /// Elements of the prototype-sum segment.
    fn sums_len(&self) -> usize {
        self.classes as usize * self.dim as usize
    }

    fn quantizers(&self) -> Result<Quantizers, SecAggError> {
        let delta = Quantizer::new(self.clip, self.max_clients)?;
        if self.checked_len().is_none_or(|n| n > u64::from(u32::MAX)) {
            return Err(SecAggError::BadParams("the layout's vector is longer than 2^32 - 1"));
        }
        let mut names = BTreeSet::new();
        if !self.blocks.iter().all(|(name, _)| names.insert(name)) {
            return Err(SecAggError::BadParams("a block name appears twice in the layout"));
        }
        if !(self.weight_scale.is_finite() && self.weight_scale >= 0.0) {
            return Err(SecAggError::BadParams("weight_scale must be finite and not negative"));
        }
        let weight = Quantizer::new(1.0, self.max_clients)?;
        if self.classes == 0 {
            return Ok(Quantizers { delta, sums: None, weight });
        }
        if !(self.prototype_clip.is_finite() && self.prototype_clip > 0.0) {
            return Err(SecAggError::BadParams("prototype_clip must be finite and positive"));
        }
        if self.max_count == 0 {
            return Err(SecAggError::BadParams("max_count must be at least 1 where there are classes"));
        }
        if u64::from(self.max_count) * u64::from(self.max_clients) > u64::from(u32::MAX) {
            return Err(SecAggError::BadParams("max_count · max_clients counts could wrap"));
        }
        let sums = Quantizer::new(self.max_count as f32 * self.prototype_clip, self.max_clients)?;
        Ok(Quantizers { delta, sums: Some(sums), weight })
    }

    /// One device's vector: its delta from `global` (clipped), its prototype sums (clipped) and
    /// counts (capped). A prototype holds a class mean unless `prototypes_are_sums`. Non-finite
    /// values count as 0; a block or prototype that does not fit the layout is refused.
    pub fn encode(
        &self,
        update: &Update,
        global: &[ParamBlock],
        prototypes_are_sums: bool,
    ) -> Result<Vec<u32>, SecAggError> {
        let q = self.quantizers()?;
        let weight = self.weight(update.num_samples);
        if update.blocks.len() != self.blocks.len() {
            let (expected, got) = (self.blocks.len(), update.blocks.len());
            return Err(SecAggError::WrongLength { what: "update blocks", expected, got });
        }
        let mut delta = Vec::with_capacity(self.vector_len());
        for (name, shape) in &self.blocks {
            let base = read(find(global, name, shape, "global model")?, &[])?;
            let mine = read(find(&update.blocks, name, shape, "update")?, &base)?;
            delta.extend(mine.iter().zip(&base).map(|(&u, &g)| finite(f64::from(u) - f64::from(g))));
        }
        clip_norm(&mut delta, f64::from(self.clip));
        delta.iter_mut().for_each(|d| *d *= weight);
        let mut vector = q.delta.quantize(&to_f32(&delta), Rounding::Nearest);
        if let Some(sums_q) = q.sums {
            let (sums, counts) = self.prototype_sums(&update.prototypes, prototypes_are_sums)?;
            vector.extend(sums_q.quantize(&to_f32(&sums), Rounding::Nearest));
            vector.extend(counts);
        }
        vector.extend(q.weight.quantize(&[weight as f32], Rounding::Nearest));
        Ok(vector)
    }

    /// Class sums (class-major) and capped counts from a device's prototypes.
    fn prototype_sums(&self, prototypes: &[Prototype], are_sums: bool) -> Result<(Vec<f64>, Vec<u32>), SecAggError> {
        let dim = self.dim as usize;
        let mut sums = vec![0f64; self.sums_len()];
        let mut counts = vec![0u32; self.classes as usize];
        let mut seen = BTreeSet::new();
        for p in prototypes {
            if p.class >= self.classes || !seen.insert(p.class) {
                return Err(bad(format!("prototype class {} is out of range or twice", p.class)));
            }
            let values = read(&p.vector, &[])?;
            if values.len() != dim {
                return Err(SecAggError::WrongLength { what: "prototype vector", expected: dim, got: values.len() });
            }
            let capped = p.count.min(u64::from(self.max_count));
            // Mean × count, scaled by capped / count when capped: mean × capped either way.
            let scale = match (are_sums, p.count) {
                (_, 0) => 0.0,
                (false, _) => capped as f64,
                (true, count) => capped as f64 / count as f64,
            };
            let sum = &mut sums[p.class as usize * dim..][..dim];
            sum.iter_mut().zip(&values).for_each(|(s, &v)| *s = finite(f64::from(v) * scale));
            clip_norm(sum, capped as f64 * f64::from(self.prototype_clip));
            counts[p.class as usize] = capped as u32;
        }
        Ok((sums, counts))
    }

    /// The round's result from the unmasked sum of `contributors` vectors: the global blocks plus
    /// the mean delta, and for each class with samples its mean over all of them (count = the
    /// summed count). `num_samples` is the number of contributors.
    pub fn decode(
        &self,
        sum: &[u32],
        contributors: u32,
        global: &[ParamBlock],
        round: u64,
    ) -> Result<Update, SecAggError> {
        let q = self.quantizers()?;
        if sum.len() != self.vector_len() {
            return Err(SecAggError::WrongLength {
                what: "summed vector",
                expected: self.vector_len(),
                got: sum.len(),
            });
        }
        if contributors == 0 {
            return Err(SecAggError::BadParams("a sum of no contributors"));
        }
        let (delta_part, rest) = sum.split_at(self.delta_len().unwrap_or(0) as usize);
        let (rest, weight_part) = rest.split_at(rest.len() - 1);
        let delta = q.delta.dequantize_sum(delta_part, contributors)?;
        let n = f64::from(q.weight.dequantize_sum(weight_part, contributors)?[0]);
        if n.is_nan() || n <= 0.0 {
            return Err(SecAggError::BadParams("the summed weight is not positive"));
        }
        let mut blocks = Vec::with_capacity(self.blocks.len());
        let mut offset = 0;
        for (name, shape) in &self.blocks {
            let base = read(find(global, name, shape, "global model")?, &[])?;
            let mean = &delta[offset..offset + base.len()];
            let values: Vec<f32> =
                base.iter().zip(mean).map(|(&g, &d)| (f64::from(g) + f64::from(d) / n) as f32).collect();
            blocks.push(ParamBlock::encode(name.clone(), shape, &values, Encoding::F32));
            offset += base.len();
        }
        let prototypes = match q.sums {
            Some(sums_q) => self.prototype_means(&sums_q, rest, contributors)?,
            None => Vec::new(),
        };
        let num_samples = if self.weight_scale > 0.0 {
            (n * f64::from(self.weight_scale)).round() as u64
        } else {
            u64::from(contributors)
        };
        Ok(Update {
            prototypes_are: Default::default(),
            round,
            num_samples,
            blocks,
            prototypes,
            metrics: Vec::new(),
            compute_seconds: 0.0,
        })
    }

    /// Each class with a positive summed count: its mean over every contributor's samples.
    fn prototype_means(&self, q: &Quantizer, rest: &[u32], contributors: u32) -> Result<Vec<Prototype>, SecAggError> {
        let (sums_part, counts) = rest.split_at(self.sums_len());
        let sums = q.dequantize_sum(sums_part, contributors)?;
        let dim = self.dim as usize;
        let classes = (0..self.classes).zip(counts).filter(|(_, count)| **count > 0);
        Ok(classes
            .map(|(class, &count)| {
                let sum = &sums[class as usize * dim..][..dim];
                let mean: Vec<f32> = sum.iter().map(|&s| (f64::from(s) / f64::from(count)) as f32).collect();
                Prototype::encode(class, u64::from(count), &mean, Encoding::F32)
            })
            .collect())
    }
}

/// The block `name` of `blocks`, refused unless it has `shape`.
fn find<'a>(
    blocks: &'a [ParamBlock],
    name: &str,
    shape: &[u32],
    whose: &str,
) -> Result<&'a EncodedTensor, SecAggError> {
    let block =
        blocks.iter().find(|b| b.name == name).ok_or_else(|| bad(format!("the {whose} has no block `{name}`")))?;
    if block.tensor.shape != shape {
        return Err(bad(format!("block `{name}` of the {whose} has shape {:?}, not {shape:?}", block.tensor.shape)));
    }
    Ok(&block.tensor)
}

/// A tensor's values (a top-k delta against `base`). Plain f32 is read as it is, so a
/// non-finite value becomes 0 later instead of refusing the update.
fn read(tensor: &EncodedTensor, base: &[f32]) -> Result<Vec<f32>, SecAggError> {
    let n = tensor.len().map_err(|e| bad(e.to_string()))?;
    if tensor.encoding == Encoding::F32 && tensor.data.len() == n.saturating_mul(4) {
        return Ok(tensor.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect());
    }
    tensor.decode_against(base).map_err(|e| bad(e.to_string()))
}

/// Scales `v` down to L2 norm `bound` where it is longer.
fn clip_norm(v: &mut [f64], bound: f64) {
    let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
    if norm > bound {
        let scale = bound / norm;
        v.iter_mut().for_each(|x| *x *= scale);
    }
}

fn finite(x: f64) -> f64 {
    if x.is_finite() { x } else { 0.0 }
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

fn bad(what: String) -> SecAggError {
    SecAggError::BadUpdate(what)
}

/// What the server sends a device in one SecAgg frame: the message, and with round 0's Setup the
/// layout and the device's id in the round (`you`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerFrame {
    /// The round's layout, with round 0's Setup; `None` with every other message.
    pub layout: Option<Layout>,
    /// The device's id in the round, with round 0's Setup; `None` with every other message.
    pub you: Option<crate::messages::ClientId>,
    /// The SecAgg message.
    pub message: ServerMessage,
}

impl ServerFrame {
    /// postcard bytes.
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).expect("in-memory encoding does not fail")
    }

    /// Decodes bytes from the wire; anything malformed is refused as [`SecAggError::Decode`].
    pub fn decode(bytes: &[u8]) -> Result<Self, SecAggError> {
        Ok(postcard::from_bytes(bytes)?)
    }
}
