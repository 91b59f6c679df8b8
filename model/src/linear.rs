//! Seeded linear layers, identical wherever the seed is (the frozen random-feature backbone, the
//! trainable net, FedTA's heads).

use anchorage_shared::rng::Rng;
use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{Device, Tensor, TensorData};

/// He-normal weights `[fan_in, fan_out]` and zero bias from a named stream of the seed.
pub(crate) fn init_linear(rng: &mut Rng, fan_in: usize, fan_out: usize) -> (Vec<f32>, Vec<f32>) {
    let std = (2.0 / fan_in as f64).sqrt();
    let w = (0..fan_in * fan_out).map(|_| (rng.normal() * std) as f32).collect();
    (w, vec![0.0; fan_out])
}

/// A linear layer holding `weight` `[fan_in, fan_out]` and `bias` `[fan_out]`.
pub(crate) fn linear_from(weight: Vec<f32>, bias: Vec<f32>, fan_in: usize, fan_out: usize, device: &Device) -> Linear {
    Linear {
        weight: Param::from_tensor(Tensor::from_data(TensorData::new(weight, [fan_in, fan_out]), device)),
        bias: Some(Param::from_tensor(Tensor::from_data(TensorData::new(bias, [fan_out]), device))),
    }
}
