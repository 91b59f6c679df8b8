//! flex and wgpu compute the same thing: forward passes of ResNet-20, MobileNetV2 0.35 and the
//! trainable [`Net`](anchorage_model::Net), and one SGD and one Adam step of the Net.
//!
//! Measure: relative max difference, max |flex − wgpu| / max |flex|. Tolerances: 1e-3 for
//! forward passes and the SGD step, 1e-2 for the Adam step (its first update divides by √v̂,
//! which amplifies rounding differences in small gradients).
//!
//! `CUBECL_WGPU_DEFAULT_DEVICE=Cpu cargo test -p anchorage-model --features wgpu --test device_agreement`
//! (Mesa lavapipe, `apt-get install mesa-vulkan-drivers`). Pretrained weights from
//! `$ANCHORAGE_DATA/weights` when set, seeded random weights otherwise.

#[cfg(not(feature = "wgpu"))]
#[test]
fn skipped_without_wgpu() {
    // Straight to the stderr handle: libtest captures eprintln!, not this.
    anchorage_shared::skip::skipped(
        "device_agreement: built without the wgpu feature (run: CUBECL_WGPU_DEFAULT_DEVICE=Cpu cargo test -p \
         anchorage-model --features wgpu --test device_agreement)",
    );
}

#[cfg(feature = "wgpu")]
mod agreement {
    use std::io::Write;
    use std::path::PathBuf;

    use anchorage_model::device;
    use anchorage_model::train::{OptimizerKind, fit};
    use anchorage_model::{
        BlockLayout, FeatureCache, MobileNetV2, MobileNetV2Config, ModelSpec, ResNetCifar, ResNetCifarConfig, Trainable,
    };
    use anchorage_shared::rng::Rng;
    use anchorage_shared::tensor::Encoding;
    use burn::module::Module;
    use burn::tensor::{Device, Tensor, TensorData};

    const FORWARD_TOL: f64 = 1e-3;
    const SGD_TOL: f64 = 1e-3;
    const ADAM_TOL: f64 = 1e-2;

    fn say(line: &str) {
        // Straight to the stderr handle: libtest captures eprintln!, not this.
        let _ = writeln!(std::io::stderr(), "{line}");
    }

    /// max |a − b| / max |a| (0 when both are all zero).
    fn rel_max_diff(a: &[f32], b: &[f32]) -> f64 {
        assert_eq!(a.len(), b.len(), "outputs differ in size");
        let diff = a.iter().zip(b).map(|(x, y)| (x - y).abs() as f64).fold(0.0, f64::max);
        let scale = a.iter().map(|x| x.abs() as f64).fold(0.0, f64::max);
        if diff == 0.0 { 0.0 } else { diff / scale.max(f64::MIN_POSITIVE) }
    }

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data().try_into_vec_as::<f32>().expect("f32 tensor")
    }

    fn uniform(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..n).map(|_| rng.f32()).collect()
    }

    /// The wgpu device on the software adapter (unless the caller chose another one).
    fn wgpu() -> Device {
        if std::env::var_os("CUBECL_WGPU_DEFAULT_DEVICE").is_none() {
            // SAFETY: the only test in this binary, set before any backend thread starts.
            unsafe { std::env::set_var("CUBECL_WGPU_DEFAULT_DEVICE", "Cpu") };
        }
        match device::select("wgpu") {
            Ok((d, _)) => d,
            Err(e) => panic!("wgpu does not work here ({e}); install mesa-vulkan-drivers (lavapipe)"),
        }
    }

    fn weights(file: &str) -> Option<PathBuf> {
        let path = PathBuf::from(std::env::var_os("ANCHORAGE_DATA")?).join("weights").join(file);
        path.exists().then_some(path)
    }

    struct Row {
        what: String,
        diff: f64,
        tol: f64,
    }

    fn images(n: usize, side: usize, seed: u64, device: &Device) -> Tensor<4> {
        Tensor::from_data(TensorData::new(uniform(n * 3 * side * side, seed), [n, 3, side, side]), device)
    }

    fn resnet20(flex: &Device, gpu: &Device) -> Row {
        let (a, b, source) = match weights("resnet20-12fca82f.safetensors") {
            Some(path) => {
                let c = ResNetCifarConfig::resnet20();
                let load = |d: &Device| ResNetCifar::load(c, &path, d).expect("resnet20 weights");
                (load(flex), load(gpu), "pretrained")
            }
            None => {
                let a = ResNetCifarConfig::resnet20().init(flex);
                let b = a.clone().to_device(gpu);
                (a, b, "random init")
            }
        };
        let t = ResNetCifar::input_transform();
        let fa = values(a.forward(t.apply(images(8, 32, 1, flex))));
        let fb = values(b.forward(t.apply(images(8, 32, 1, gpu))));
        Row {
            what: format!("ResNet-20 logits, 8×3×32×32 ({source})"), diff: rel_max_diff(&fa, &fb), tol: FORWARD_TOL
        }
    }

    fn mobilenet(flex: &Device, gpu: &Device) -> Row {
        let c = MobileNetV2Config { alpha: 0.35 };
        let (a, b, source) = match weights("mobilenetv2_035_224_imagenet_backbone.safetensors") {
            Some(path) => {
                let load = |d: &Device| MobileNetV2::load(c, &path, d).expect("mobilenet weights");
                (load(flex), load(gpu), "pretrained")
            }
            None => {
                let a = c.init(flex);
                let b = a.clone().to_device(gpu);
                (a, b, "random init")
            }
        };
        let t = MobileNetV2::input_transform();
        let fa = values(a.forward_features(t.apply(images(4, 64, 2, flex))));
        let fb = values(b.forward_features(t.apply(images(4, 64, 2, gpu))));
        Row {
            what: format!("MobileNetV2 0.35 features, 4×3×64×64 ({source})"),
            diff: rel_max_diff(&fa, &fb),
            tol: FORWARD_TOL,
        }
    }

    fn spec() -> ModelSpec {
        ModelSpec { input_dim: 64, feature_dim: 64, adapter_dim: 128, num_classes: 10, seed: 5 }
    }

    const N: usize = 32;

    fn features(device: &Device) -> Tensor<2> {
        let f: Vec<f32> = uniform(N * 64, 3).into_iter().map(|v| 2.0 * v - 1.0).collect();
        Tensor::from_data(TensorData::new(f, [N, 64]), device)
    }

    fn net_forward(flex: &Device, gpu: &Device) -> Row {
        let fa = values(Trainable::new(&spec().net(), flex).forward(features(flex)));
        let fb = values(Trainable::new(&spec().net(), gpu).forward(features(gpu)));
        Row {
            what: "Net (MLP 64→128→10) logits, 32 samples".into(), diff: rel_max_diff(&fa, &fb), tol: FORWARD_TOL
        }
    }

    fn params(net: &Trainable) -> Vec<f32> {
        let blocks = net.to_blocks(Encoding::F32).expect("blocks");
        blocks.iter().flat_map(|b| b.decode().expect("f32 block")).collect()
    }

    /// One full-batch step; returns (parameter update, loss).
    fn step(device: &Device, optimizer: OptimizerKind) -> (Vec<f32>, f64) {
        let train = device.clone().autodiff();
        let labels: Vec<u32> = (0..N as u32).map(|i| i % 10).collect();
        let cache = FeatureCache::from_parts(features(&train), &labels, &train);
        let net = Trainable::new(&spec().net(), &train);
        let before = params(&net);
        let (net, report) = fit(net, &cache, 1, N, 0.05, optimizer, &mut Rng::new(9), &train);
        assert_eq!(report.steps, 1);
        let update = params(&net).iter().zip(&before).map(|(a, b)| a - b).collect();
        (update, report.last_epoch_loss)
    }

    fn train_step(flex: &Device, gpu: &Device, optimizer: OptimizerKind, tol: f64) -> Vec<Row> {
        let (ua, la) = step(flex, optimizer);
        let (ub, lb) = step(gpu, optimizer);
        vec![
            Row { what: format!("{optimizer:?} step: loss"), diff: ((la - lb) / la).abs(), tol: FORWARD_TOL },
            Row { what: format!("{optimizer:?} step: parameter update"), diff: rel_max_diff(&ua, &ub), tol },
        ]
    }

    #[test]
    fn flex_and_wgpu_agree() {
        let gpu = wgpu();
        let flex = Device::flex();
        let mut rows = vec![resnet20(&flex, &gpu), mobilenet(&flex, &gpu), net_forward(&flex, &gpu)];
        rows.extend(train_step(&flex, &gpu, OptimizerKind::Sgd, SGD_TOL));
        rows.extend(train_step(&flex, &gpu, OptimizerKind::Adam, ADAM_TOL));
        let adapter = std::env::var("CUBECL_WGPU_DEFAULT_DEVICE").unwrap_or_default();
        say(&format!(
            "flex vs wgpu (CUBECL_WGPU_DEFAULT_DEVICE={adapter}), relative max diff = max|flex−wgpu| / max|flex|:"
        ));
        for r in &rows {
            let ok = if r.diff <= r.tol { "ok" } else { "FAIL" };
            say(&format!("  {:<55} {:>9.2e}  (tolerance {:.0e}) {ok}", r.what, r.diff, r.tol));
        }
        let failed: Vec<&str> = rows.iter().filter(|r| !(r.diff <= r.tol)).map(|r| r.what.as_str()).collect();
        assert!(failed.is_empty(), "flex and wgpu disagree beyond tolerance: {failed:?}");
    }

    /// What `anchorage-client doctor` says of a wgpu device: the adapters Vulkan has here, the
    /// used one marked (under `CUBECL_WGPU_DEFAULT_DEVICE=Cpu`, Mesa's software lavapipe).
    #[tokio::test(flavor = "current_thread")]
    async fn doctor_names_the_adapter_a_wgpu_device_uses() {
        let _ = wgpu();
        let adapters = device::gpu_adapters().await;
        say(&format!("Vulkan adapters: {adapters:?}"));
        let used: Vec<&String> = adapters.iter().filter(|a| a.ends_with("(used)")).collect();
        assert_eq!(used.len(), 1, "exactly one adapter is the one used: {adapters:?}");
        if std::env::var("CUBECL_WGPU_DEFAULT_DEVICE").is_ok_and(|v| v == "Cpu") {
            assert!(used[0].contains("[Cpu,"), "the software adapter under CUBECL_WGPU_DEFAULT_DEVICE=Cpu: {used:?}");
        }
    }
}
