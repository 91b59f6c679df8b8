//! Decoded 8-bit images with labels: what the loaders produce before conversion to [`Dataset`].
//!
//! Pixels stay `u8` (a quarter of the memory of f32) until [`ImageSet::to_dataset`] maps them to
//! f32 in [0, 1], so a large set (Tiny-ImageNet train is 614 MB as u8) can be subset first.

use crate::Dataset;

/// `len` images of `channels × height × width` (CHW, row-major), one label each.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ImageSet {
    pub channels: usize,
    pub height: usize,
    pub width: usize,
    pub num_classes: u32,
    /// `len × channels × height × width` bytes, CHW per image.
    pub pixels: Vec<u8>,
    pub labels: Vec<u32>,
    /// Class names in label order (folder names, wnids, or `"0"`, `"1"`, … for numeric formats).
    pub class_names: Vec<String>,
}

impl ImageSet {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Bytes per image.
    pub fn image_len(&self) -> usize {
        self.channels * self.height * self.width
    }

    /// Image `i`, CHW.
    pub fn image(&self, i: usize) -> &[u8] {
        let n = self.image_len();
        &self.pixels[i * n..(i + 1) * n]
    }

    /// `[channels, height, width]`.
    pub fn sample_shape(&self) -> Vec<usize> {
        vec![self.channels, self.height, self.width]
    }

    /// Images per class.
    pub fn class_counts(&self) -> Vec<u64> {
        let mut counts = vec![0u64; self.num_classes as usize];
        for &l in &self.labels {
            if let Some(c) = counts.get_mut(l as usize) {
                *c += 1;
            }
        }
        counts
    }

    /// A copy of the images at `indices`, in that order.
    pub fn subset(&self, indices: &[usize]) -> ImageSet {
        let mut pixels = Vec::with_capacity(indices.len() * self.image_len());
        for &i in indices {
            pixels.extend_from_slice(self.image(i));
        }
        ImageSet { pixels, labels: indices.iter().map(|&i| self.labels[i]).collect(), ..self.empty_like() }
    }

    fn empty_like(&self) -> ImageSet {
        ImageSet {
            channels: self.channels,
            height: self.height,
            width: self.width,
            num_classes: self.num_classes,
            pixels: Vec::new(),
            labels: Vec::new(),
            class_names: self.class_names.clone(),
        }
    }

    /// The images as f32 in [0, 1] (`x / 255`), CHW, same labels.
    pub fn to_dataset(&self) -> Dataset {
        let lut: [f32; 256] = std::array::from_fn(|v| v as f32 / 255.0);
        Dataset {
            sample_shape: self.sample_shape(),
            num_classes: self.num_classes,
            features: self.pixels.iter().map(|&v| lut[v as usize]).collect(),
            labels: self.labels.clone(),
        }
    }

    /// Mean pixel value in [0, 1] over all images and channels.
    pub fn pixel_mean(&self) -> f64 {
        if self.pixels.is_empty() {
            return 0.0;
        }
        let mut hist = [0u64; 256];
        self.pixels.iter().for_each(|&v| hist[v as usize] += 1);
        let sum: f64 = hist.iter().enumerate().map(|(v, &n)| v as f64 * n as f64).sum();
        sum / self.pixels.len() as f64 / 255.0
    }
}
