//! Choosing the compute device at run time from the backends compiled in.
//!
//! `cpu` is the pure-Rust `flex` backend (the default feature); `ndarray` is kept behind its
//! feature for users who ask for it. GPU backends (`wgpu`, `vulkan`, `cuda:N`) arrive with the
//! backbone issue; asking for one that is not compiled in is a clear error, never a panic.

use burn::tensor::Device;

/// The requested device cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DeviceError {
    #[error("device `{0}` is not compiled into this build (compiled: {1})")]
    NotCompiled(String, String),
    #[error("unknown device `{0}`; use cpu, ndarray or auto")]
    Unknown(String),
}

/// Backends compiled into this build, in `auto` probing order.
pub fn compiled() -> Vec<&'static str> {
    let mut v = Vec::new();
    if cfg!(feature = "flex") {
        v.push("cpu");
    }
    if cfg!(feature = "ndarray") {
        v.push("ndarray");
    }
    v
}

/// The device named `name` (`cpu`, `ndarray`, `auto`) and the name of what was picked.
pub fn select(name: &str) -> Result<(Device, &'static str), DeviceError> {
    let compiled = compiled();
    let not_compiled = || DeviceError::NotCompiled(name.to_string(), compiled.join(", "));
    match name {
        "auto" => {
            let first = *compiled.first().ok_or_else(not_compiled)?;
            let picked = select(first)?;
            tracing::info!(device = picked.1, "auto picked the first compiled backend");
            Ok(picked)
        }
        "cpu" | "flex" => {
            #[cfg(feature = "flex")]
            return Ok((Device::flex(), "cpu"));
            #[allow(unreachable_code)]
            Err(not_compiled())
        }
        "ndarray" => {
            #[cfg(feature = "ndarray")]
            #[allow(deprecated)]
            return Ok((Device::ndarray(), "ndarray"));
            #[allow(unreachable_code)]
            Err(not_compiled())
        }
        "wgpu" | "vulkan" => Err(not_compiled()),
        other if other.starts_with("cuda") => Err(not_compiled()),
        other => Err(DeviceError::Unknown(other.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absent_and_unknown_devices_are_errors() {
        assert!(matches!(select("cuda:0"), Err(DeviceError::NotCompiled(..))));
        assert!(matches!(select("tpu"), Err(DeviceError::Unknown(_))));
        assert_eq!(select("auto").unwrap().1, compiled()[0]);
    }
}
