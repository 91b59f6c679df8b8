//! The trainable parts on frozen features: a representation [`Body`] (Linear + ReLU layers: the
//! adapter, GLDP's shared µ, FedEvolve's φ and ψ) and a linear head (the classifier, GLDP's
//! personal ν, FedRep's personal head).

use std::sync::{Arc, Mutex};

use anchorage_shared::rng::Rng;
use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::activation::relu;
use burn::tensor::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::linear::{init_linear, linear_from};

/// Sizes and seed of a [`Net`]. Every client and the server derive identical initial weights from it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NetSpec {
    /// Width of the features the net reads (the frozen backbone's output, or raw inputs).
    pub input_dim: usize,
    /// Widths of the body's layers; empty: the head reads the features directly.
    pub hidden: Vec<usize>,
    pub num_classes: usize,
    pub seed: u64,
    /// A residual adapter (Houlsby et al. 2019): the representation is `x + embed(x)` with the
    /// body's last layer zero-initialised, so training starts from the backbone's features and
    /// moves away from them only as far as the loss asks. Needs `hidden.last == input_dim`.
    #[serde(default)]
    pub residual: bool,
}

impl NetSpec {
    /// Width of the representation (the body's output).
    pub fn representation_dim(&self) -> usize {
        self.hidden.last().copied().unwrap_or(self.input_dim)
    }

    /// Why these sizes cannot build a net, if they cannot (a residual adapter whose output width
    /// differs from its input's).
    pub fn check(&self) -> Result<(), String> {
        match self.hidden.last() {
            _ if !self.residual => Ok(()),
            Some(&w) if w == self.input_dim => Ok(()),
            last => Err(format!(
                "a residual adapter adds its output to the features, so its last width must be the features' {} \
                 (hidden = {:?}, ends at {})",
                self.input_dim,
                self.hidden,
                last.map_or("no layer".to_string(), |w| w.to_string())
            )),
        }
    }

    /// Parameter values (weights and biases of every layer).
    pub fn param_count(&self) -> u64 {
        let mut fan_in = self.input_dim as u64;
        let mut n = 0u64;
        for &w in self.hidden.iter().chain(std::iter::once(&self.num_classes)) {
            n = n.saturating_add((fan_in + 1).saturating_mul(w as u64));
            fan_in = w as u64;
        }
        n
    }

    /// Values one training sample keeps for the backward pass (input, each layer before and
    /// after ReLU, logits and log-probabilities); their gradients double it.
    pub fn activation_values(&self) -> u64 {
        let hidden: usize = self.hidden.iter().sum();
        (self.input_dim + 2 * hidden + 2 * self.num_classes) as u64
    }
}

/// Linear + ReLU layers, or a residual adapter around them (see [`NetSpec::residual`]).
#[derive(Module, Debug)]
pub struct Body {
    pub layers: Vec<Linear>,
    /// `forward` is `x + embed(x)`.
    pub residual: bool,
}

impl Body {
    /// Layers of the given `(fan_in, fan_out)` shapes and `(weight, bias)` values (see
    /// [`seeded_layers`]).
    pub fn from_layers(values: &[(Vec<f32>, Vec<f32>)], shapes: &[(usize, usize)], device: &Device) -> Self {
        let layers = values
            .iter()
            .zip(shapes)
            .map(|((w, b), &(fan_in, fan_out))| linear_from(w.clone(), b.clone(), fan_in, fan_out, device))
            .collect();
        Self { layers, residual: false }
    }

    /// Representation `[n, input_dim]` → `[n, hidden.last]`.
    pub fn forward(&self, mut x: Tensor<2>) -> Tensor<2> {
        if self.residual {
            return x.clone() + self.embed(x);
        }
        for layer in &self.layers {
            x = relu(layer.forward(x));
        }
        x
    }

    /// Like [`Body::forward`] without the ReLU after the last layer: a linear embedding on top
    /// of the hidden layers, whose output can take any sign (prototype methods measure
    /// distances there; a ReLU output can die into one constant point where every distance is
    /// equal).
    pub fn embed(&self, mut x: Tensor<2>) -> Tensor<2> {
        let last = self.layers.len().saturating_sub(1);
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.forward(x);
            if i < last {
                x = relu(x);
            }
        }
        x
    }
}

/// `(fan_in, fan_out)` of the layers `input → widths[0] → widths[1] → …`.
pub fn layer_shapes(input: usize, widths: impl IntoIterator<Item = usize>) -> Vec<(usize, usize)> {
    let mut fan_in = input;
    widths
        .into_iter()
        .map(|w| {
            let shape = (fan_in, w);
            fan_in = w;
            shape
        })
        .collect()
}

/// He-normal `(weight, bias)` of layers of `shapes`, drawn in order from `Rng::derive(seed,
/// stream)`. Every client derives the same ones, so they are drawn once per process and shared:
/// a simulated fleet builds its trainable parts per client per round, and drawing 1 MB of
/// normals each time would be two thirds of a 10,000-client simulation.
pub fn seeded_layers(seed: u64, stream: u64, shapes: &[(usize, usize)]) -> Arc<Vec<(Vec<f32>, Vec<f32>)>> {
    type Key = (u64, u64, Vec<(usize, usize)>);
    type Layers = Arc<Vec<(Vec<f32>, Vec<f32>)>>;
    static DRAWN: Mutex<Vec<(Key, Layers)>> = Mutex::new(Vec::new());
    let key = (seed, stream, shapes.to_vec());
    let mut drawn = DRAWN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, layers)) = drawn.iter().find(|(k, _)| *k == key) {
        return layers.clone();
    }
    let mut rng = Rng::derive(seed, stream);
    let layers = Arc::new(shapes.iter().map(|&(fan_in, fan_out)| init_linear(&mut rng, fan_in, fan_out)).collect());
    // A handful of models per process; the oldest goes past eight.
    if drawn.len() >= 8 {
        drawn.remove(0);
    }
    drawn.push((key, Arc::clone(&layers)));
    layers
}

/// A body and a linear head.
#[derive(Module, Debug)]
pub struct Net {
    pub adapter: Body,
    pub head: Linear,
}

impl Net {
    /// Seeded initial weights (identical on every client).
    pub fn new(spec: &NetSpec, device: &Device) -> Self {
        let shapes = layer_shapes(spec.input_dim, spec.hidden.iter().copied().chain([spec.num_classes]));
        let drawn = seeded_layers(spec.seed, 0xADA7, &shapes);
        // Residual only where the sizes allow it; the callers report `spec.check()`'s error.
        let residual = spec.residual && spec.check().is_ok();
        let mut adapter = if residual {
            // The residual branch starts at zero: the representation starts as the features.
            let mut layers = drawn.as_ref().clone();
            let (w, b) = &mut layers[spec.hidden.len() - 1];
            w.fill(0.0);
            b.fill(0.0);
            Body { residual: true, ..Body::from_layers(&layers, &shapes, device) }
        } else {
            Body::from_layers(&drawn, &shapes, device)
        };
        let head = adapter.layers.pop().expect("a head layer");
        Self { adapter, head }
    }

    /// The representation of features `[n, input_dim]`.
    pub fn represent(&self, features: Tensor<2>) -> Tensor<2> {
        self.adapter.forward(features)
    }

    /// Logits `[n, num_classes]`.
    pub fn forward(&self, features: Tensor<2>) -> Tensor<2> {
        self.head.forward(self.represent(features))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(hidden: Vec<usize>, residual: bool) -> NetSpec {
        NetSpec { input_dim: 6, hidden, num_classes: 3, seed: 11, residual }
    }

    #[test]
    fn a_residual_adapter_starts_as_the_features_and_then_learns_a_correction() {
        let device = Device::flex();
        let x = Tensor::<2>::from_floats([[0.5, -1.0, 2.0, 0.0, 3.0, -0.25], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], &device);
        let net = Net::new(&spec(vec![4, 6], true), &device);
        let z: Vec<f32> = net.represent(x.clone()).into_data().try_to_vec().unwrap();
        assert_eq!(z, x.clone().into_data().try_to_vec::<f32>().unwrap());
        // The plain adapter of the same sizes is not the identity (ReLU and He-normal weights).
        let plain: Vec<f32> =
            Net::new(&spec(vec![4, 6], false), &device).represent(x.clone()).into_data().try_to_vec().unwrap();
        assert_ne!(plain, z);
        // Moving the last layer off zero moves the representation off the features.
        let mut moved = net;
        let last = moved.adapter.layers.last_mut().unwrap();
        last.bias = last.bias.take().map(|b| b.map(|t| t + 1.0));
        let z: Vec<f32> = moved.represent(x.clone()).into_data().try_to_vec().unwrap();
        let x: Vec<f32> = x.into_data().try_to_vec().unwrap();
        assert!(z.iter().zip(&x).all(|(a, b)| (a - b - 1.0).abs() < 1e-6), "{z:?}");
    }

    #[test]
    fn a_residual_adapter_must_end_at_the_features_width() {
        assert!(spec(vec![6], true).check().is_ok());
        assert!(spec(vec![4], false).check().is_ok());
        let err = spec(vec![4], true).check().unwrap_err();
        assert!(err.contains("must be the features' 6") && err.contains("ends at 4"), "{err}");
        assert!(spec(vec![], true).check().unwrap_err().contains("no layer"));
    }
}
