//! FedEvolve's Circle MLP: `representation` 2 → 256 → 256 → 256 (ReLU after each layer) and
//! `classifier` 256 → 64 → 2 (ReLU between), so a method can share or personalize each part.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};

/// Widths of the Circle MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CircleMlpConfig {
    pub input_dim: usize,
    /// Width of the three representation layers.
    pub width: usize,
    /// Hidden size of the classifier.
    pub hidden: usize,
    pub num_classes: usize,
}

impl CircleMlpConfig {
    /// FedEvolve's Circle: 2 → 256 → 256 → 256, then 256 → 64 → 2.
    pub fn circle() -> Self {
        Self { input_dim: 2, width: 256, hidden: 64, num_classes: 2 }
    }

    /// A randomly initialised network.
    pub fn init(&self, device: &Device) -> CircleMlp {
        let layers = [self.input_dim, self.width, self.width]
            .iter()
            .map(|&d_in| LinearConfig::new(d_in, self.width).init(device))
            .collect();
        CircleMlp {
            representation: MlpRepresentation { layers },
            classifier: MlpClassifier {
                fc1: LinearConfig::new(self.width, self.hidden).init(device),
                fc2: LinearConfig::new(self.hidden, self.num_classes).init(device),
            },
        }
    }
}

/// Linear + ReLU layers: points `[n, input_dim]` → `[n, width]`.
#[derive(Module, Debug)]
pub struct MlpRepresentation {
    pub layers: Vec<Linear>,
}

impl MlpRepresentation {
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.layers.iter().fold(x, |x, layer| relu(layer.forward(x)))
    }
}

/// Linear, ReLU, linear: features `[n, width]` → logits `[n, classes]`.
#[derive(Module, Debug)]
pub struct MlpClassifier {
    pub fc1: Linear,
    pub fc2: Linear,
}

impl MlpClassifier {
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc2.forward(relu(self.fc1.forward(x)))
    }
}

/// The Circle MLP.
#[derive(Module, Debug)]
pub struct CircleMlp {
    pub representation: MlpRepresentation,
    pub classifier: MlpClassifier,
}

impl CircleMlp {
    /// Features `[n, width]` of points `[n, input_dim]`.
    pub fn forward_features(&self, x: Tensor<2>) -> Tensor<2> {
        self.representation.forward(x)
    }

    /// Logits `[n, classes]` of points `[n, input_dim]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.classifier.forward(self.forward_features(x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anchorage_shared::rng::Rng;
    use burn::nn::loss::CrossEntropyLossConfig;
    use burn::optim::{AdamConfig, GradientsParams};
    use burn::tensor::{Int, TensorData};

    #[test]
    fn shapes() {
        let device = Device::flex();
        let model = CircleMlpConfig::circle().init(&device);
        let x = Tensor::<2>::zeros([5, 2], &device);
        assert_eq!(model.forward_features(x.clone()).dims(), [5, 256]);
        assert_eq!(model.forward(x).dims(), [5, 2]);
        let params = (2 * 256 + 256) + 2 * (256 * 256 + 256) + (256 * 64 + 64) + (64 * 2 + 2);
        assert_eq!(model.num_params(), params);
    }

    /// Two Gaussian blobs (σ = 0.5) around (−1, −1) and (1, 1), labels 0 and 1.
    fn blobs(n: usize, seed: u64) -> (Vec<f32>, Vec<i64>) {
        let mut rng = Rng::derive(seed, 0xB10B);
        let mut x = Vec::with_capacity(2 * n);
        let mut y = Vec::with_capacity(n);
        for i in 0..n {
            let label = (i % 2) as i64;
            let centre = if label == 0 { -1.0 } else { 1.0 };
            x.push((centre + 0.5 * rng.normal()) as f32);
            x.push((centre + 0.5 * rng.normal()) as f32);
            y.push(label);
        }
        (x, y)
    }

    #[test]
    fn adam_separates_two_blobs() {
        let device = Device::flex().autodiff();
        let mut model = CircleMlpConfig::circle().init(&device);
        let n = 64;
        let (x, y) = blobs(n, 3);
        let x = Tensor::<2>::from_data(TensorData::new(x, [n, 2]), &device);
        let y = Tensor::<1, Int>::from_data(TensorData::new(y.clone(), [n]), &device);
        let loss_fn = CrossEntropyLossConfig::new().init(&device);
        let mut optim = AdamConfig::new().init();
        let mut first = f32::NAN;
        for step in 0..20 {
            let loss = loss_fn.forward(model.forward(x.clone()), y.clone());
            if step == 0 {
                first = loss.clone().into_scalar::<f32>();
            }
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-3, model, grads);
        }
        let last: f32 = loss_fn.forward(model.forward(x.clone()), y.clone()).into_scalar::<f32>();
        assert!(last < first, "loss {first} → {last}");
        let pred = model.forward(x).argmax(1).reshape([n]);
        let correct: i64 = pred.equal(y).int().sum().into_scalar::<i64>();
        // The blobs overlap a little (σ = 0.5 at distance 2√2): ≥ 95% is separation.
        assert!(correct as f64 >= 0.95 * n as f64, "{correct}/{n} correct");
    }
}
