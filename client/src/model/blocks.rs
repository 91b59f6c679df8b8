//! Moving trainable parts in and out of named parameter blocks.

use anchorage_shared::tensor::{Encoding, ParamBlock, TensorError};
use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{Device, Tensor, TensorData};

use super::Trainable;

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
}

/// How a module's parameters map to block names.
pub trait BlockLayout: Sized {
    /// The named blocks of this module, encoded with `encoding`.
    fn to_blocks(&self, encoding: Encoding) -> Result<Vec<ParamBlock>, ModelError>;
    /// This module with the given blocks loaded (others unchanged); every block must exist and fit.
    fn load_blocks(self, blocks: &[ParamBlock], device: &Device) -> Result<Self, ModelError>;
}

fn tensor_block<const D: usize>(name: &str, t: &Tensor<D>, encoding: Encoding) -> Result<ParamBlock, ModelError> {
    let shape: Vec<u32> = t.dims().iter().map(|&d| d as u32).collect();
    let values: Vec<f32> = t.to_data().try_to_vec_as::<f32>().map_err(|e| ModelError::Data(format!("{e:?}")))?;
    Ok(ParamBlock::encode(name, &shape, &values, encoding))
}

fn load_tensor<const D: usize>(
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

const ADAPTER: &str = "adapter.0";
const HEAD: &str = "head";

impl BlockLayout for Trainable {
    fn to_blocks(&self, encoding: Encoding) -> Result<Vec<ParamBlock>, ModelError> {
        let mut out = Vec::with_capacity(4);
        linear_blocks(ADAPTER, &self.adapter, encoding, &mut out)?;
        linear_blocks(HEAD, &self.head, encoding, &mut out)?;
        Ok(out)
    }

    fn load_blocks(mut self, blocks: &[ParamBlock], device: &Device) -> Result<Self, ModelError> {
        for block in blocks {
            let found = load_linear(ADAPTER, &mut self.adapter, block, device)?
                || load_linear(HEAD, &mut self.head, block, device)?;
            if !found {
                return Err(ModelError::UnknownBlock(block.name.clone()));
            }
        }
        Ok(self)
    }
}
