//! Choosing the compute device at run time from the backends compiled in.
//!
//! Names (config key `device`, flag `--device`): `cpu` / `flex` (the pure-Rust default),
//! `ndarray`, `wgpu` (WGSL; Mesa lavapipe in CI), `vulkan` (SPIR-V), `cuda` / `cuda:N`, and
//! `auto`, which probes what is compiled in and present in the order cuda, vulkan, wgpu, cpu,
//! ndarray and logs what it picked and why. Cargo features `wgpu`, `vulkan`, `cuda` and
//! `ndarray` compile the backends in (all off by default); asking for one that is not compiled
//! in, or not present, is a clear error, never a panic.

use std::fmt;
use std::str::FromStr;

use burn::tensor::{Device, Tensor};

/// The requested device cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DeviceError {
    #[error("device `{0}` is not compiled into this build (compiled: {1}); rebuild with `--features {2}`")]
    NotCompiled(String, String, &'static str),
    #[error("unknown device `{0}`; use cpu, flex, ndarray, wgpu, vulkan, cuda[:N] or auto")]
    Unknown(String),
    #[error("device `{0}` is compiled in but does not work here: {1}")]
    Unavailable(String, String),
    #[error("no compiled backend works here (tried: {0})")]
    NoneWorks(String),
}

/// A parsed device name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The flex CPU backend.
    Cpu,
    NdArray,
    Wgpu,
    Vulkan,
    Cuda(usize),
    Auto,
}

impl FromStr for DeviceSpec {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, DeviceError> {
        let name = s.trim().to_ascii_lowercase();
        Ok(match name.as_str() {
            "cpu" | "flex" => DeviceSpec::Cpu,
            "ndarray" => DeviceSpec::NdArray,
            "wgpu" => DeviceSpec::Wgpu,
            "vulkan" => DeviceSpec::Vulkan,
            "cuda" => DeviceSpec::Cuda(0),
            "auto" => DeviceSpec::Auto,
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(i)) => DeviceSpec::Cuda(i),
                _ => return Err(DeviceError::Unknown(s.to_string())),
            },
        })
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::NdArray => f.write_str("ndarray"),
            DeviceSpec::Wgpu => f.write_str("wgpu"),
            DeviceSpec::Vulkan => f.write_str("vulkan"),
            DeviceSpec::Cuda(i) => write!(f, "cuda:{i}"),
            DeviceSpec::Auto => f.write_str("auto"),
        }
    }
}

impl DeviceSpec {
    /// The cargo feature that compiles this backend in.
    pub fn feature(self) -> &'static str {
        match self {
            DeviceSpec::Cpu | DeviceSpec::Auto => "flex",
            DeviceSpec::NdArray => "ndarray",
            DeviceSpec::Wgpu => "wgpu",
            DeviceSpec::Vulkan => "vulkan",
            DeviceSpec::Cuda(_) => "cuda",
        }
    }

    pub fn is_compiled(self) -> bool {
        match self {
            DeviceSpec::Cpu => cfg!(feature = "flex"),
            DeviceSpec::NdArray => cfg!(feature = "ndarray"),
            DeviceSpec::Wgpu => cfg!(feature = "wgpu"),
            DeviceSpec::Vulkan => cfg!(feature = "vulkan"),
            DeviceSpec::Cuda(_) => cfg!(feature = "cuda"),
            DeviceSpec::Auto => !compiled().is_empty(),
        }
    }

    /// The device, without checking that it works (construction is lazy in burn).
    fn construct(self) -> Option<Device> {
        match self {
            #[cfg(feature = "flex")]
            DeviceSpec::Cpu => Some(Device::flex()),
            #[cfg(feature = "ndarray")]
            #[allow(deprecated)]
            DeviceSpec::NdArray => Some(Device::ndarray()),
            #[cfg(feature = "wgpu")]
            DeviceSpec::Wgpu => Some(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
            #[cfg(feature = "vulkan")]
            DeviceSpec::Vulkan => Some(Device::vulkan(burn::tensor::DeviceKind::DefaultDevice)),
            #[cfg(feature = "cuda")]
            DeviceSpec::Cuda(i) => Some(Device::cuda(i)),
            _ => None,
        }
    }
}

/// Backends compiled into this build, in `auto` probing order.
pub fn compiled() -> Vec<&'static str> {
    let mut v = Vec::new();
    for (on, name) in [
        (cfg!(feature = "cuda"), "cuda"),
        (cfg!(feature = "vulkan"), "vulkan"),
        (cfg!(feature = "wgpu"), "wgpu"),
        (cfg!(feature = "flex"), "cpu"),
        (cfg!(feature = "ndarray"), "ndarray"),
    ] {
        if on {
            v.push(name);
        }
    }
    v
}

/// Runs one tiny operation on `device`; a backend that panics (no adapter, no driver) is an error.
fn probe(device: &Device) -> Result<(), String> {
    let device = device.clone();
    std::panic::catch_unwind(move || {
        let x = Tensor::<1>::from_floats([1.0, 2.0], &device);
        (x * 2.0).sum().into_scalar::<f32>()
    })
    .map_err(|e| {
        e.downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
    .and_then(|v| if v == 6.0 { Ok(()) } else { Err(format!("probe computed {v}, expected 6")) })
}

/// The device named `name` and the name of what was picked. GPU devices are probed with one tiny
/// operation so that an absent GPU is an error here rather than a panic later.
pub fn select(name: &str) -> Result<(Device, &'static str), DeviceError> {
    choose(name).map(|c| (c.device, c.label))
}

/// A device picked, and why.
#[derive(Debug, Clone)]
pub struct Choice {
    pub device: Device,
    /// `cpu`, `ndarray`, `wgpu`, `vulkan` or `cuda`.
    pub label: &'static str,
    /// Under `auto`: the backends tried before it, each with why it was skipped.
    pub skipped: Vec<String>,
}

/// What a picked backend is, in words.
pub fn describe(label: &str) -> &'static str {
    match label {
        "cpu" => "flex, the pure-Rust CPU backend",
        "ndarray" => "ndarray, a CPU backend",
        "wgpu" => "WGSL shaders through wgpu",
        "vulkan" => "SPIR-V through Vulkan",
        "cuda" => "CUDA",
        _ => "unknown backend",
    }
}

/// The GPU adapters wgpu finds on this machine through Vulkan, one line each (name, type,
/// driver), the one a `wgpu`/`vulkan` device uses marked: the first, or with
/// `CUBECL_WGPU_DEFAULT_DEVICE=Cpu` the first software one (cubecl-wgpu's rule).
#[cfg(any(feature = "wgpu", feature = "vulkan"))]
pub async fn gpu_adapters() -> Vec<String> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN,
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let infos: Vec<wgpu::AdapterInfo> =
        instance.enumerate_adapters(wgpu::Backends::VULKAN).await.iter().map(wgpu::Adapter::get_info).collect();
    let want_cpu = std::env::var("CUBECL_WGPU_DEFAULT_DEVICE").is_ok_and(|v| v == "Cpu");
    let used = infos.iter().position(|i| !want_cpu || i.device_type == wgpu::DeviceType::Cpu);
    infos
        .iter()
        .enumerate()
        .map(|(n, i)| {
            let mark = if Some(n) == used { " (used)" } else { "" };
            format!("{} [{:?}, {} {}]{mark}", i.name, i.device_type, i.driver, i.driver_info)
        })
        .collect()
}

/// [`select`], telling what `auto` skipped.
pub fn choose(name: &str) -> Result<Choice, DeviceError> {
    let spec: DeviceSpec = name.parse()?;
    let compiled_list = || compiled().join(", ");
    if spec == DeviceSpec::Auto {
        let mut tried = Vec::new();
        for candidate in compiled() {
            match select(candidate) {
                Ok((device, label)) => {
                    tracing::info!(device = label, tried = %tried.join("; "), "auto picked the first compiled backend that works");
                    return Ok(Choice { device, label, skipped: tried });
                }
                Err(e) => {
                    tracing::info!(device = candidate, error = %e, "auto: backend skipped");
                    tried.push(format!("{candidate} ({e})"));
                }
            }
        }
        return Err(DeviceError::NoneWorks(tried.join("; ")));
    }
    let device =
        spec.construct().ok_or_else(|| DeviceError::NotCompiled(name.to_string(), compiled_list(), spec.feature()))?;
    let label = match spec {
        DeviceSpec::Cpu => "cpu",
        DeviceSpec::NdArray => "ndarray",
        DeviceSpec::Wgpu => "wgpu",
        DeviceSpec::Vulkan => "vulkan",
        DeviceSpec::Cuda(_) => "cuda",
        DeviceSpec::Auto => unreachable!("handled above"),
    };
    if matches!(spec, DeviceSpec::Wgpu | DeviceSpec::Vulkan | DeviceSpec::Cuda(_)) {
        probe(&device).map_err(|e| DeviceError::Unavailable(spec.to_string(), e))?;
    }
    Ok(Choice { device, label, skipped: Vec::new() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse() {
        assert_eq!("cpu".parse(), Ok(DeviceSpec::Cpu));
        assert_eq!("FLEX".parse(), Ok(DeviceSpec::Cpu));
        assert_eq!("cuda".parse(), Ok(DeviceSpec::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(DeviceSpec::Cuda(3)));
        assert_eq!("vulkan".parse(), Ok(DeviceSpec::Vulkan));
        assert_eq!("wgpu".parse(), Ok(DeviceSpec::Wgpu));
        assert_eq!("ndarray".parse(), Ok(DeviceSpec::NdArray));
        assert!(matches!("cuda:x".parse::<DeviceSpec>(), Err(DeviceError::Unknown(_))));
        assert!(matches!("tpu".parse::<DeviceSpec>(), Err(DeviceError::Unknown(_))));
        assert_eq!(DeviceSpec::Cuda(2).to_string(), "cuda:2");
    }

    #[test]
    fn absent_and_unknown_devices_are_errors() {
        for name in ["cuda:0", "wgpu", "vulkan", "ndarray"] {
            let spec: DeviceSpec = name.parse().unwrap();
            if !spec.is_compiled() {
                let err = select(name).unwrap_err();
                assert!(matches!(err, DeviceError::NotCompiled(..)), "{err}");
                assert!(err.to_string().contains(spec.feature()), "{err}");
            }
        }
        assert!(matches!(select("tpu"), Err(DeviceError::Unknown(_))));
        let (_, picked) = select("auto").unwrap();
        assert!(compiled().contains(&picked));
    }

    #[test]
    fn cpu_works() {
        if cfg!(feature = "flex") {
            let (device, name) = select("cpu").unwrap();
            assert_eq!(name, "cpu");
            probe(&device).unwrap();
        }
    }
}
