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
}

impl NetSpec {
    /// Width of the representation (the body's output).
    pub fn representation_dim(&self) -> usize {
        self.hidden.last().copied().unwrap_or(self.input_dim)
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

/// Linear + ReLU layers.
#[derive(Module, Debug)]
pub struct Body {
    pub layers: Vec<Linear>,
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
        Self { layers }
    }

    /// Representation `[n, input_dim]` → `[n, hidden.last]`.
    pub fn forward(&self, mut x: Tensor<2>) -> Tensor<2> {
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
/// normals each time was two thirds of a 10,000-client simulation.
pub fn seeded_layers(seed: u64, stream: u64, shapes: &[(usize, usize)]) -> Arc<Vec<(Vec<f32>, Vec<f32>)>> {
    type Key = (u64, u64, Vec<(usize, usize)>);
    static DRAWN: Mutex<Vec<(Key, Arc<Vec<(Vec<f32>, Vec<f32>)>>)>> = Mutex::new(Vec::new());
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
        let mut adapter = Body::from_layers(&seeded_layers(spec.seed, 0xADA7, &shapes), &shapes, device);
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
