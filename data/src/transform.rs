//! Transforms of [`Dataset`]s of CHW images: normalisation, rotation, random crop with padding and
//! horizontal flip. The random ones are seeded: the same seed gives the same output byte for byte.

use anchorage_shared::rng::Rng;
use serde::{Deserialize, Serialize};

use crate::{DataError, Dataset};

/// Per-channel normalisation `(x − mean) / std` of values in [0, 1].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Normalization {
    /// Leave the values in [0, 1].
    None,
    /// Explicit per-channel mean and std (one value is used for every channel).
    MeanStd { mean: Vec<f32>, std: Vec<f32> },
    /// `x·255/127.5 − 1`, i.e. [-1, 1] (Keras MobileNetV2 and similar backbones).
    Symmetric,
}

/// MNIST training-set pixel mean and std.
pub const MNIST_MEAN_STD: ([f32; 1], [f32; 1]) = ([0.1307], [0.3081]);
/// CIFAR-10 training-set per-channel mean and std.
pub const CIFAR10_MEAN_STD: ([f32; 3], [f32; 3]) = ([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]);
/// CIFAR-100 training-set per-channel mean and std.
pub const CIFAR100_MEAN_STD: ([f32; 3], [f32; 3]) = ([0.5071, 0.4865, 0.4409], [0.2673, 0.2564, 0.2762]);
/// ImageNet per-channel mean and std (torchvision / timm pretrained backbones).
pub const IMAGENET_MEAN_STD: ([f32; 3], [f32; 3]) = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]);

impl Normalization {
    pub fn mean_std(mean: &[f32], std: &[f32]) -> Self {
        Normalization::MeanStd { mean: mean.to_vec(), std: std.to_vec() }
    }

    pub fn mnist() -> Self {
        Self::mean_std(&MNIST_MEAN_STD.0, &MNIST_MEAN_STD.1)
    }

    pub fn cifar10() -> Self {
        Self::mean_std(&CIFAR10_MEAN_STD.0, &CIFAR10_MEAN_STD.1)
    }

    pub fn cifar100() -> Self {
        Self::mean_std(&CIFAR100_MEAN_STD.0, &CIFAR100_MEAN_STD.1)
    }

    pub fn imagenet() -> Self {
        Self::mean_std(&IMAGENET_MEAN_STD.0, &IMAGENET_MEAN_STD.1)
    }

    /// Per-channel mean and (population) std measured on `ds`.
    pub fn fit(ds: &Dataset) -> Result<Self, DataError> {
        let (c, plane) = chw(ds)?;
        let mut mean = vec![0f64; c];
        let mut sq = vec![0f64; c];
        for i in 0..ds.len() {
            let s = ds.sample(i);
            for ch in 0..c {
                for &v in &s[ch * plane..(ch + 1) * plane] {
                    mean[ch] += v as f64;
                    sq[ch] += (v as f64) * (v as f64);
                }
            }
        }
        let n = (ds.len() * plane).max(1) as f64;
        let mean: Vec<f32> = mean.iter().map(|m| (m / n) as f32).collect();
        let std: Vec<f32> = sq
            .iter()
            .zip(&mean)
            .map(|(s, m)| ((s / n - (*m as f64).powi(2)).max(0.0).sqrt().max(1e-8)) as f32)
            .collect();
        Ok(Normalization::MeanStd { mean, std })
    }

    /// Normalises `ds` in place.
    pub fn apply(&self, ds: &mut Dataset) -> Result<(), DataError> {
        match self {
            Normalization::None => Ok(()),
            Normalization::Symmetric => {
                ds.features.iter_mut().for_each(|v| *v = *v * (255.0 / 127.5) - 1.0);
                Ok(())
            }
            Normalization::MeanStd { mean, std } => {
                let (c, plane) = chw(ds)?;
                let pick = |v: &[f32], ch: usize, what: &str| -> Result<f32, DataError> {
                    match v.len() {
                        1 => Ok(v[0]),
                        n if n == c => Ok(v[ch]),
                        n => Err(DataError::Invalid(format!("{n} {what} values for {c} channels"))),
                    }
                };
                let per: Vec<(f32, f32)> = (0..c)
                    .map(|ch| Ok((pick(mean, ch, "mean")?, pick(std, ch, "std")?)))
                    .collect::<Result<_, DataError>>()?;
                if per.iter().any(|(_, s)| !(s.is_finite() && *s > 0.0)) {
                    return Err(DataError::Invalid(format!("std must be positive, got {std:?}")));
                }
                let len = ds.sample_len();
                for sample in ds.features.chunks_mut(len) {
                    for (ch, &(m, s)) in per.iter().enumerate() {
                        sample[ch * plane..(ch + 1) * plane].iter_mut().for_each(|v| *v = (*v - m) / s);
                    }
                }
                Ok(())
            }
        }
    }
}

/// (channels, height × width) of a `[c, h, w]` or `[h, w]` sample shape.
fn chw(ds: &Dataset) -> Result<(usize, usize), DataError> {
    let (c, h, w) = dims(&ds.sample_shape).ok_or_else(|| {
        DataError::Invalid(format!("expected [c, h, w] or [h, w] samples, got {:?}", ds.sample_shape))
    })?;
    Ok((c, h * w))
}

fn dims(shape: &[usize]) -> Option<(usize, usize, usize)> {
    match shape {
        [c, h, w] => Some((*c, *h, *w)),
        [h, w] => Some((1, *h, *w)),
        _ => None,
    }
}

/// Rotates every image (`[c, h, w]` or `[h, w]` samples) by `degrees` counter-clockwise around its
/// centre, bilinear with zero fill: the domain-shift hook of rotated-MNIST style domains. Samples
/// of another shape (e.g. 2-D points) are returned unchanged.
pub fn rotate(ds: &Dataset, degrees: f32) -> Dataset {
    let Some((c, h, w)) = dims(&ds.sample_shape) else { return ds.clone() };
    let (sin, cos) = degrees.to_radians().sin_cos();
    let (cx, cy) = ((w as f32 - 1.0) / 2.0, (h as f32 - 1.0) / 2.0);
    let mut out = Vec::with_capacity(ds.features.len());
    for i in 0..ds.len() {
        let s = ds.sample(i);
        for ch in 0..c {
            let plane = &s[ch * h * w..(ch + 1) * h * w];
            let at = |x: isize, y: isize| {
                if x >= 0 && y >= 0 && (x as usize) < w && (y as usize) < h {
                    plane[y as usize * w + x as usize]
                } else {
                    0.0
                }
            };
            for y in 0..h {
                for x in 0..w {
                    // Inverse mapping: where in the source does this output pixel come from?
                    let (dx, dy) = (x as f32 - cx, y as f32 - cy);
                    let sx = cos * dx + sin * dy + cx;
                    let sy = -sin * dx + cos * dy + cy;
                    let (x0, y0) = (sx.floor(), sy.floor());
                    let (fx, fy) = (sx - x0, sy - y0);
                    let (x0, y0) = (x0 as isize, y0 as isize);
                    let v = at(x0, y0) * (1.0 - fx) * (1.0 - fy)
                        + at(x0 + 1, y0) * fx * (1.0 - fy)
                        + at(x0, y0 + 1) * (1.0 - fx) * fy
                        + at(x0 + 1, y0 + 1) * fx * fy;
                    out.push(v);
                }
            }
        }
    }
    Dataset {
        sample_shape: ds.sample_shape.clone(),
        num_classes: ds.num_classes,
        features: out,
        labels: ds.labels.clone(),
    }
}

/// Training augmentation: random crop after zero padding, and random horizontal flip.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Augment {
    /// Pad each side by this many zero pixels, then crop back to the original size at a random offset.
    pub crop_padding: usize,
    /// Flip left–right with probability 1/2.
    pub hflip: bool,
}

impl Default for Augment {
    /// The CIFAR standard: pad 4, crop 32, flip.
    fn default() -> Self {
        Self { crop_padding: 4, hflip: true }
    }
}

impl Augment {
    /// An augmented copy of `ds`; each sample draws its offset and flip from the seed's stream.
    pub fn apply(&self, ds: &Dataset, seed: u64) -> Result<Dataset, DataError> {
        let mut rng = Rng::new(seed);
        let mut out = ds.clone();
        let len = ds.sample_len();
        for i in 0..ds.len() {
            let p = self.crop_padding as u64;
            let (dx, dy) = if p > 0 { (rng.below(2 * p + 1) as usize, rng.below(2 * p + 1) as usize) } else { (0, 0) };
            let flip = self.hflip && rng.below(2) == 1;
            let dst = &mut out.features[i * len..(i + 1) * len];
            crop_flip(ds.sample(i), dst, &ds.sample_shape, self.crop_padding, dx, dy, flip)?;
        }
        Ok(out)
    }
}

/// Writes into `dst` the crop at offset `(dx, dy)` of `src` zero-padded by `pad`, flipped left–right
/// if `flip`. `(dx, dy) = (pad, pad)` without flip is the identity.
pub fn crop_flip(
    src: &[f32],
    dst: &mut [f32],
    shape: &[usize],
    pad: usize,
    dx: usize,
    dy: usize,
    flip: bool,
) -> Result<(), DataError> {
    let (c, h, w) = dims(shape)
        .ok_or_else(|| DataError::Invalid(format!("expected [c, h, w] or [h, w] samples, got {shape:?}")))?;
    if dx > 2 * pad || dy > 2 * pad || src.len() != c * h * w || dst.len() != src.len() {
        return Err(DataError::Invalid(format!("crop offset ({dx}, {dy}) beyond padding {pad} or wrong buffer sizes")));
    }
    for ch in 0..c {
        for y in 0..h {
            let sy = (y + dy) as isize - pad as isize;
            for x in 0..w {
                let ox = if flip { w - 1 - x } else { x };
                let sx = (ox + dx) as isize - pad as isize;
                dst[ch * h * w + y * w + x] = if sy >= 0 && sx >= 0 && (sy as usize) < h && (sx as usize) < w {
                    src[ch * h * w + sy as usize * w + sx as usize]
                } else {
                    0.0
                };
            }
        }
    }
    Ok(())
}

/// Flips every image left–right (deterministic).
pub fn hflip(ds: &Dataset) -> Result<Dataset, DataError> {
    let mut out = ds.clone();
    let len = ds.sample_len();
    for i in 0..ds.len() {
        crop_flip(ds.sample(i), &mut out.features[i * len..(i + 1) * len], &ds.sample_shape, 0, 0, 0, true)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp() -> Dataset {
        // Two 2×3×4 images.
        Dataset::new(vec![2, 3, 4], 2, (0..48).map(|v| v as f32 / 47.0).collect(), vec![0, 1]).unwrap()
    }

    #[test]
    fn normalisations() {
        let mut d = ramp();
        Normalization::Symmetric.apply(&mut d).unwrap();
        assert!((d.features[0] + 1.0).abs() < 1e-6 && (d.features[47] - 1.0).abs() < 1e-5);
        let mut d = ramp();
        let fitted = Normalization::fit(&d).unwrap();
        fitted.apply(&mut d).unwrap();
        let again = Normalization::fit(&d).unwrap();
        let Normalization::MeanStd { mean, std } = again else { panic!() };
        assert!(mean.iter().all(|m| m.abs() < 1e-5), "{mean:?}");
        assert!(std.iter().all(|s| (s - 1.0).abs() < 1e-4), "{std:?}");
        let mut d = ramp();
        assert!(Normalization::imagenet().apply(&mut d).is_err(), "3 channel stats on 2 channels");
        Normalization::mean_std(&[0.5], &[0.25]).apply(&mut d).unwrap();
        assert!((d.features[0] + 2.0).abs() < 1e-6);
    }

    #[test]
    fn crop_flip_identity_and_shift() {
        let d = ramp();
        let id = Augment { crop_padding: 0, hflip: false }.apply(&d, 1).unwrap();
        assert_eq!(id, d);
        let mut dst = vec![0.0; 24];
        crop_flip(d.sample(0), &mut dst, &d.sample_shape, 2, 2, 2, false).unwrap();
        assert_eq!(dst, d.sample(0));
        crop_flip(d.sample(0), &mut dst, &d.sample_shape, 1, 2, 1, false).unwrap();
        // Shifted left by one: column x holds source column x+1, the last column is padding.
        assert_eq!(dst[0], d.sample(0)[1]);
        assert_eq!(dst[3], 0.0);
        let f = hflip(&d).unwrap();
        assert_eq!(f.sample(1)[0], d.sample(1)[3]);
        assert_eq!(hflip(&f).unwrap(), d);
        let a = Augment::default().apply(&d, 5).unwrap();
        assert_eq!(a, Augment::default().apply(&d, 5).unwrap());
        assert!(crop_flip(d.sample(0), &mut dst, &d.sample_shape, 1, 3, 0, false).is_err());
    }
}
