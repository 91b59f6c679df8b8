//! Moving trainable parts in and out of named parameter blocks.

use anchorage_shared::tensor::{Encoding, ParamBlock, TensorError};
use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{Device, Tensor, TensorData};

use super::{Body, Net};

/// A block does not fit the model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("block `{name}` has shape {got:?}, the model expects {expected:?}")]
    Shape { name: String, expected: Vec<u32>, got: Vec<u32> },
    #[error("the model has no block `{0}`")]
    UnknownBlock(String),
    #[error(transparent)]
    Tensor(#[from] TensorError),
    #[error("reading tensor data: {0}")]
    Data(String),
    #[error(
        "this model changes the backbone's input: it needs the frozen backbone and the raw samples beside the features"
    )]
    NoInputs,
}

/// Whether `name` is a block of the body (`adapter.*`) or the head (`head.*`).
pub fn is_head_block(name: &str) -> bool {
    name.starts_with("head.")
}

/// How a module's parameters map to block names.
pub trait BlockLayout: Sized {
    /// The named blocks of this module, encoded with `encoding`.
    fn to_blocks(&self, encoding: Encoding) -> Result<Vec<ParamBlock>, ModelError>;
    /// This module with the given blocks loaded (others unchanged); every block must exist and fit.
    fn load_blocks(self, blocks: &[ParamBlock], device: &Device) -> Result<Self, ModelError>;
}

/// `t` as the named block `name`.
pub fn tensor_block<const D: usize>(name: &str, t: &Tensor<D>, encoding: Encoding) -> Result<ParamBlock, ModelError> {
    let shape: Vec<u32> = t.dims().iter().map(|&d| d as u32).collect();
    let values: Vec<f32> = t.to_data().try_to_vec_as::<f32>().map_err(|e| ModelError::Data(format!("{e:?}")))?;
    Ok(ParamBlock::encode(name, &shape, &values, encoding))
}

/// Loads `block` into `param`; the shapes must match.
pub fn load_tensor<const D: usize>(
    param: &mut Param<Tensor<D>>,
    block: &ParamBlock,
    device: &Device,
) -> Result<(), ModelError> {
    let expected: Vec<u32> = param.val().dims().iter().map(|&d| d as u32).collect();
    if block.tensor.shape != expected {
        return Err(ModelError::Shape { name: block.name.clone(), expected, got: block.tensor.shape.clone() });
    }
    let shape: Vec<usize> = expected.iter().map(|&d| d as usize).collect();
    let values = block.decode()?;
    *param = Param::from_tensor(Tensor::from_data(TensorData::new(values, shape), device));
    Ok(())
}

fn linear_blocks(prefix: &str, l: &Linear, encoding: Encoding, out: &mut Vec<ParamBlock>) -> Result<(), ModelError> {
    out.push(tensor_block(&format!("{prefix}.weight"), &l.weight.val(), encoding)?);
    if let Some(b) = &l.bias {
        out.push(tensor_block(&format!("{prefix}.bias"), &b.val(), encoding)?);
    }
    Ok(())
}

fn load_linear(prefix: &str, l: &mut Linear, block: &ParamBlock, device: &Device) -> Result<bool, ModelError> {
    let Some(field) = block.name.strip_prefix(prefix).and_then(|r| r.strip_prefix('.')) else { return Ok(false) };
    match (field, l.bias.as_mut()) {
        ("weight", _) => load_tensor(&mut l.weight, block, device)?,
        ("bias", Some(b)) => load_tensor(b, block, device)?,
        _ => return Err(ModelError::UnknownBlock(block.name.clone())),
    }
    Ok(true)
}

/// Blocks `{prefix}.{i}.weight` / `.bias` of every layer of `body`.
pub fn body_blocks(prefix: &str, body: &Body, encoding: Encoding, out: &mut Vec<ParamBlock>) -> Result<(), ModelError> {
    for (i, layer) in body.layers.iter().enumerate() {
        linear_blocks(&format!("{prefix}.{i}"), layer, encoding, out)?;
    }
    Ok(())
}

/// Loads `block` into `body` if its name is one of `{prefix}.{i}.*`; `Ok(false)` if it is not.
pub fn load_body_block(prefix: &str, body: &mut Body, block: &ParamBlock, device: &Device) -> Result<bool, ModelError> {
    let Some(rest) = block.name.strip_prefix(prefix).and_then(|r| r.strip_prefix('.')) else { return Ok(false) };
    let Some((index, _)) = rest.split_once('.') else { return Ok(false) };
    let Some(layer) = index.parse::<usize>().ok().and_then(|i| body.layers.get_mut(i)) else {
        return Err(ModelError::UnknownBlock(block.name.clone()));
    };
    load_linear(&format!("{prefix}.{index}"), layer, block, device)
}

const ADAPTER: &str = "adapter";
const HEAD: &str = "head";

impl BlockLayout for Net {
    fn to_blocks(&self, encoding: Encoding) -> Result<Vec<ParamBlock>, ModelError> {
        let mut out = Vec::with_capacity(2 * self.adapter.layers.len() + 2);
        body_blocks(ADAPTER, &self.adapter, encoding, &mut out)?;
        linear_blocks(HEAD, &self.head, encoding, &mut out)?;
        Ok(out)
    }

    fn load_blocks(mut self, blocks: &[ParamBlock], device: &Device) -> Result<Self, ModelError> {
        for block in blocks {
            let found = load_body_block(ADAPTER, &mut self.adapter, block, device)?
                || load_linear(HEAD, &mut self.head, block, device)?;
            if !found {
                return Err(ModelError::UnknownBlock(block.name.clone()));
            }
        }
        Ok(self)
    }
}
