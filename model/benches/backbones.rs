//! Backbone throughput on the flex CPU backend (ResNet-20/56/18, MobileNetV2 0.35), head-training epochs with and without the
//! feature cache, and the peak memory of a client holding MobileNetV2. Plain std timing.
//!
//! `ANCHORAGE_DATA=../shared/data cargo bench -p anchorage-model --bench backbones --profile dev`
//! (pretrained weights and real images when `ANCHORAGE_DATA` is set; random weights and
//! synthetic images otherwise — the timings are the same).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anchorage_data::{Dataset, ImageSet};
use anchorage_model::input::image_batch;
use anchorage_model::train::{OptimizerKind, fit};
use anchorage_model::{
    Backbone, FeatureCache, Frozen, MobileNetV2, MobileNetV2Config, ModelSpec, ResNet18, ResNet18Config, ResNetCifar,
    ResNetCifarConfig, Trainable, zoo,
};
use anchorage_shared::rng::Rng;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};

fn data_dir() -> Option<PathBuf> {
    std::env::var_os("ANCHORAGE_DATA").map(PathBuf::from)
}

fn synthetic(n: usize, side: usize, classes: u32) -> ImageSet {
    let mut state = 1u64;
    let pixels = (0..n * 3 * side * side)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 56) as u8
        })
        .collect();
    ImageSet {
        channels: 3,
        height: side,
        width: side,
        num_classes: classes,
        pixels,
        labels: (0..n as u32).map(|i| i % classes).collect(),
        class_names: (0..classes).map(|c| c.to_string()).collect(),
    }
}

/// Best of `reps` timings of `f`.
fn best(reps: usize, mut f: impl FnMut()) -> Duration {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .unwrap()
}

fn forward_rate<B: Backbone>(name: &str, backbone: &B, side: usize, batch: usize, batches: usize, device: &Device) {
    let set = synthetic(batch, side, 10);
    let x = image_batch(&set, 0, batch, device).reshape([batch, 3 * side * side]);
    let shape = [3, side, side];
    // Warm-up (allocations, autotune).
    let _ = backbone.features(x.clone(), &shape).into_data();
    let t = best(3, || {
        for _ in 0..batches {
            let _ = backbone.features(x.clone(), &shape).into_data();
        }
    });
    let rate = (batch * batches) as f64 / t.as_secs_f64();
    println!("| {name} | {side}×{side} | {batch} | {rate:.0} |");
}

fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

fn main() {
    let device = Device::flex();
    let dir = data_dir();
    println!("threads: {}", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    println!(
        "weights: {}",
        if dir.is_some() { "pretrained ($ANCHORAGE_DATA)" } else { "random (ANCHORAGE_DATA not set)" }
    );
    let rss0 = peak_rss_mb();

    let resnet20 = match &dir {
        Some(d) => {
            ResNetCifar::load(ResNetCifarConfig::resnet20(), &d.join("weights/resnet20-12fca82f.safetensors"), &device)
                .expect("resnet20 weights")
        }
        None => ResNetCifarConfig::resnet20().init(&device),
    };
    let resnet56 = match &dir {
        Some(d) => {
            ResNetCifar::load(ResNetCifarConfig::resnet56(), &d.join("weights/resnet56-4bfd9763.safetensors"), &device)
                .expect("resnet56 weights")
        }
        None => ResNetCifarConfig::resnet56().init(&device),
    };
    let mobilenet = match &dir {
        Some(d) => MobileNetV2::load(
            MobileNetV2Config { alpha: 0.35 },
            &d.join("weights/mobilenetv2_035_224_imagenet_backbone.safetensors"),
            &device,
        )
        .expect("mobilenet weights"),
        None => MobileNetV2Config { alpha: 0.35 }.init(&device),
    };
    // No ResNet-18 weights ship in the data folder; random weights unless you put some there.
    let resnet18 = match dir.as_ref().map(|d| d.join(zoo::RESNET18_WEIGHTS)).filter(|p| p.exists()) {
        Some(path) => ResNet18::load(ResNet18Config::default(), &path, &device).expect("resnet18 weights"),
        None => ResNet18Config::default().init(&device),
    };
    let resnet20 = Frozen::new(resnet20, ResNetCifar::input_transform());
    let resnet18 = Frozen::new(resnet18, ResNet18::input_transform());
    let resnet56 = Frozen::new(resnet56, ResNetCifar::input_transform());
    let mobilenet = Frozen::new(mobilenet, MobileNetV2::input_transform());

    println!("\n| backbone | input | batch | images/s |\n|---|---|---:|---:|");
    forward_rate("ResNet-20", &resnet20, 32, 250, 4, &device);
    forward_rate("ResNet-56", &resnet56, 32, 250, 2, &device);
    forward_rate("ResNet-18 (CIFAR stem)", &resnet18, 32, 50, 2, &device);
    forward_rate("MobileNetV2 0.35", &mobilenet, 64, 100, 5, &device);
    forward_rate("MobileNetV2 0.35", &mobilenet, 128, 100, 2, &device);
    forward_rate("MobileNetV2 0.35", &mobilenet, 224, 50, 2, &device);

    head_epochs(&mobilenet, "MobileNetV2 0.35, 64×64", &device);
    head_epochs(&resnet20, "ResNet-20, 32×32", &device);
    head_epochs(&resnet18, "ResNet-18, 32×32", &device);

    if let (Some(before), Some(after)) = (rss0, peak_rss_mb()) {
        println!(
            "\npeak RSS: {after:.0} MB (at start {before:.0} MB), holding ResNet-20/56/18 and MobileNetV2 after the runs above"
        );
    }
}

/// One epoch of head training (adapter + linear head, Adam, batch 50) on 1,000 images: through
/// the frozen backbone every step, or on features cached once.
fn head_epochs<M: anchorage_model::FeatureNet>(backbone: &Frozen<M>, name: &str, device: &Device) {
    let side = if name.contains("32×32") { 32 } else { 64 };
    let n = 1000;
    let batch = 50;
    let data: Dataset = synthetic(n, side, 10).to_dataset();
    let spec = ModelSpec {
        input_dim: data.sample_len(),
        feature_dim: backbone.feature_dim(),
        adapter_dim: 64,
        num_classes: 10,
        seed: 1,
    };
    let train_device = device.clone().autodiff();

    // Without the cache: backbone forward (no grad) + head step per batch.
    let mut model = Trainable::new(&spec.net(), &train_device);
    let mut optim = AdamConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&train_device);
    let t = Instant::now();
    for start in (0..n).step_by(batch) {
        let idx: Vec<usize> = (start..start + batch).collect();
        let x = {
            let mut v = Vec::with_capacity(batch * data.sample_len());
            idx.iter().for_each(|&i| v.extend_from_slice(data.sample(i)));
            Tensor::<2>::from_data(TensorData::new(v, [batch, data.sample_len()]), device)
        };
        let f = backbone.features(x, &data.sample_shape).to_device(&train_device);
        let y: Vec<i64> = idx.iter().map(|&i| data.labels[i] as i64).collect();
        let y = Tensor::<1, Int>::from_data(TensorData::new(y, [batch]), &train_device);
        let loss = loss_fn.forward(model.forward(f), y);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(1e-3, model, grads);
    }
    let uncached = t.elapsed();

    // With the cache: build once, then epochs on cached features.
    let t = Instant::now();
    let cache = FeatureCache::build(backbone, &data, 250, device);
    let cache = cache.with_features(cache.features().to_device(&train_device));
    let build = t.elapsed();
    let model = Trainable::new(&spec.net(), &train_device);
    let mut rng = Rng::new(1);
    let _ = fit(model.clone(), &cache, 1, batch, 1e-3, OptimizerKind::Adam, &mut rng, &train_device);
    let epoch = best(3, || {
        let _ = fit(model.clone(), &cache, 1, batch, 1e-3, OptimizerKind::Adam, &mut rng, &train_device);
    });
    println!(
        "\nhead epoch, {name}, {n} images, batch {batch}: without cache {:.2} s; with cache {:.3} s ({:.0}× faster; cache built once in {:.2} s)",
        uncached.as_secs_f64(),
        epoch.as_secs_f64(),
        uncached.as_secs_f64() / epoch.as_secs_f64(),
        build.as_secs_f64()
    );
}
