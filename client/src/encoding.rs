//! Parsing an upload encoding name from configs and flags.

use anchorage_shared::tensor::Encoding;

/// `f32`, `f16`, `bf16` or `int8` (the scale is computed per block when encoding).
pub fn parse(name: &str) -> anyhow::Result<Encoding> {
    Ok(match name {
        "f32" => Encoding::F32,
        "f16" => Encoding::F16,
        "bf16" => Encoding::Bf16,
        "int8" => Encoding::Int8 { scale: 0.0 },
        other => anyhow::bail!("unknown encoding `{other}` (use f32, f16, bf16 or int8)"),
    })
}
