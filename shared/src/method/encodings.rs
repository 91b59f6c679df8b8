//! The update encodings any method can use, listed beside the methods ([`super::REGISTRY`]):
//! what each is set with, its paper, and whether it is on by default. The client crate applies
//! them (`encoding` in each method's client half, `top_k` and `compress` in
//! `anchorage_client::compress`), the server decodes every one of them when an update arrives.

use core::fmt;

/// One update encoding.
#[derive(Debug, Clone, Copy)]
pub struct EncodingInfo {
    /// The name configs and flags use (`encoding = "f16"`, `compress = "zstd"`; top-k is set by
    /// its fraction, `top_k = 0.01`).
    pub name: &'static str,
    /// The config key (and, with dashes, the `anchorage sim` flag) that turns it on.
    pub key: &'static str,
    /// Where it comes from, for reports.
    pub paper: &'static str,
    /// Whether a config that names none gets it.
    pub default: bool,
}

/// Every update encoding: the value layouts (one of them), then what may be added to any.
pub const ENCODINGS: &[EncodingInfo] = &[
    EncodingInfo { name: "f32", key: "encoding", paper: "IEEE 754 single precision", default: true },
    EncodingInfo { name: "f16", key: "encoding", paper: "IEEE 754 half precision", default: false },
    EncodingInfo { name: "bf16", key: "encoding", paper: "bfloat16", default: false },
    EncodingInfo { name: "int8", key: "encoding", paper: "symmetric int8 + scale", default: false },
    EncodingInfo {
        name: "top-k",
        key: "top_k",
        paper: "top-k with error feedback (Stich et al. 2018; Lin et al. 2018)",
        default: false,
    },
    EncodingInfo { name: "zstd", key: "compress", paper: "Zstandard (RFC 8878)", default: false },
];

/// The encodings set with `key`, by name.
pub fn names_of(key: &'static str) -> impl Iterator<Item = &'static str> {
    ENCODINGS.iter().filter(move |e| e.key == key).map(|e| e.name)
}

/// Every encoding's name joined by ", " (for error messages and help texts).
pub struct EncodingNames;

impl fmt::Display for EncodingNames {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in ENCODINGS.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(e.name)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;

    #[test]
    fn only_f32_is_on_by_default_and_every_name_is_listed_once() {
        let on: alloc::vec::Vec<&str> = ENCODINGS.iter().filter(|e| e.default).map(|e| e.name).collect();
        assert_eq!(on, ["f32"]);
        for (i, e) in ENCODINGS.iter().enumerate() {
            assert!(ENCODINGS[..i].iter().all(|o| o.name != e.name), "{} listed twice", e.name);
        }
        assert_eq!(names_of("compress").collect::<alloc::vec::Vec<_>>(), ["zstd"]);
        assert_eq!(EncodingNames.to_string(), "f32, f16, bf16, int8, top-k, zstd");
    }

    #[test]
    fn the_wire_names_match_the_registry() {
        use crate::tensor::{Dense, Encoding, Packed};
        let wire = [
            Encoding::F32,
            Encoding::F16,
            Encoding::Bf16,
            Encoding::Int8 { scale: 0.0 },
            Encoding::TopK { k: 1, values: Dense::F32 },
            Encoding::Zstd { inner: Packed::Dense(Dense::F32) },
        ];
        let names: alloc::vec::Vec<&str> = wire.iter().map(|e| e.name()).collect();
        assert_eq!(names, ENCODINGS.iter().map(|e| e.name).collect::<alloc::vec::Vec<_>>());
    }
}
