//! Pretrained weights through burn-store: a safetensors file applied to a module, with key
//! remapping and a layout adapter, checked name by name and shape by shape.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn_store::{ApplyResult, KeyRemapper, ModuleAdapter, ModuleSnapshot, SafetensorsStore};

/// How many mismatches an error lists.
const FIRST: usize = 8;

/// A weights file cannot be read or does not fit the model.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("reading weights {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error("weights {path} do not fit the model: {}", summary(.missing, .unused, .shapes))]
    Mismatch {
        path: PathBuf,
        /// Model parameters the file does not provide (first few).
        missing: Vec<String>,
        /// File tensors the model has no place for (first few).
        unused: Vec<String>,
        /// Shape, dtype or load errors (first few).
        shapes: Vec<String>,
    },
}

fn summary(missing: &[String], unused: &[String], shapes: &[String]) -> String {
    let mut parts = Vec::new();
    for (what, list) in [("missing in file", missing), ("not in model", unused), ("mismatched", shapes)] {
        if !list.is_empty() {
            parts.push(format!("{what}: {}", list.join(", ")));
        }
    }
    parts.join("; ")
}

/// How file keys and layouts map to the module.
pub struct Import {
    /// Regex `(from, to)` pairs applied to file keys, in order.
    pub remap: Vec<(&'static str, &'static str)>,
    pub adapter: Box<dyn ModuleAdapter>,
}

/// Loads `path` into `module`: every module parameter must be in the file with the right shape,
/// and every file tensor must be used. Never panics on file input.
pub fn load_safetensors<M: Module + ModuleSnapshot>(
    mut module: M,
    path: &Path,
    import: Import,
) -> Result<M, WeightError> {
    let read_err = |message: String| WeightError::Read { path: path.to_path_buf(), message };
    let bytes = std::fs::read(path).map_err(|e| read_err(e.to_string()))?;
    let remapper = KeyRemapper::from_patterns(import.remap).map_err(|e| read_err(format!("key remapping: {e}")))?;
    let mut store = SafetensorsStore::from_bytes(Some(bytes))
        .remap(remapper)
        .with_from_adapter(AdapterBox(import.adapter))
        .validate(false)
        .allow_partial(true);
    let result = module.load_from(&mut store).map_err(|e| read_err(e.to_string()))?;
    check(result, path)?;
    Ok(module)
}

fn check(result: ApplyResult, path: &Path) -> Result<(), WeightError> {
    let missing: Vec<String> = result.missing.iter().take(FIRST).map(|(p, _)| p.clone()).collect();
    // PyTorch's BatchNorm step counter is state, not a parameter.
    let unused: Vec<String> =
        result.unused.iter().filter(|k| !k.ends_with("num_batches_tracked")).take(FIRST).cloned().collect();
    let shapes: Vec<String> = result.errors.iter().take(FIRST).map(|e| e.to_string()).collect();
    if missing.is_empty() && unused.is_empty() && shapes.is_empty() {
        return Ok(());
    }
    Err(WeightError::Mismatch { path: path.to_path_buf(), missing, unused, shapes })
}

/// A boxed adapter as an adapter (the store takes `impl ModuleAdapter`).
struct AdapterBox(Box<dyn ModuleAdapter>);

impl ModuleAdapter for AdapterBox {
    fn adapt(
        &self,
        tensor: burn_store::burn_pack::Tensor,
        ctx: burn_store::ModuleContext<'_>,
    ) -> burn_store::burn_pack::Tensor {
        self.0.adapt(tensor, ctx)
    }

    fn get_alternative_param_name(&self, param_name: &str, module_type: &str) -> Option<String> {
        self.0.get_alternative_param_name(param_name, module_type)
    }

    fn clone_box(&self) -> Box<dyn ModuleAdapter> {
        Box::new(AdapterBox(self.0.clone_box()))
    }
}
