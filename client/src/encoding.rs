//! The upload encoding as configs and flags name it.

use anchorage_shared::tensor::Encoding;
use serde::{Deserialize, Serialize};

/// `f32`, `f16`, `bf16` or `int8` (int8's scale is computed per block when encoding): the
/// `encoding` of client.toml, of a simulation's config and of `--encoding`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum UploadEncoding {
    #[default]
    F32,
    F16,
    Bf16,
    Int8,
}

impl UploadEncoding {
    /// The wire encoding.
    pub fn encoding(self) -> Encoding {
        match self {
            Self::F32 => Encoding::F32,
            Self::F16 => Encoding::F16,
            Self::Bf16 => Encoding::Bf16,
            Self::Int8 => Encoding::Int8 { scale: 0.0 },
        }
    }

    /// The name configs use.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::Int8 => "int8",
        }
    }
}

impl std::fmt::Display for UploadEncoding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_read_back_and_map_to_the_wire_encoding() {
        for e in [UploadEncoding::F32, UploadEncoding::F16, UploadEncoding::Bf16, UploadEncoding::Int8] {
            let text = format!("encoding = \"{e}\"");
            #[derive(Deserialize)]
            struct T {
                encoding: UploadEncoding,
            }
            assert_eq!(toml::from_str::<T>(&text).unwrap().encoding, e);
        }
        assert!(matches!(UploadEncoding::Int8.encoding(), Encoding::Int8 { .. }));
        assert!(toml::from_str::<std::collections::BTreeMap<String, UploadEncoding>>("e = \"f64\"").is_err());
    }
}
