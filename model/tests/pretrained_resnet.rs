//! Pretrained CIFAR ResNet-20/56 (akamaster checkpoints in `$ANCHORAGE_DATA/weights`) on the
//! lossless CIFAR-10 records and the CIFAR-10 JPEG test set. Skipped loudly without `ANCHORAGE_DATA`.

use std::path::PathBuf;
use std::time::Instant;

use anchorage_data::ImageSet;
use anchorage_data::loaders::cifar::{self, CifarKind};
use anchorage_data::loaders::image_folder::{self, ImageFolderOptions};
use anchorage_model::input::image_batch;
use anchorage_model::{ResNetCifar, ResNetCifarConfig, WeightError};
use burn::tensor::Device;

const BATCH: usize = 250;
/// JPEG test images used per model: all 10,000 for ResNet-20; a per-class-balanced 2,000 for
/// ResNet-56 (three times the compute per image).
const JPEG_SAMPLE_56: usize = 2_000;

fn data_dir() -> Option<PathBuf> {
    match std::env::var_os("ANCHORAGE_DATA") {
        Some(d) => Some(PathBuf::from(d)),
        None => {
            anchorage_shared::skip::skipped(&format!(
                "{}: ANCHORAGE_DATA not set (ANCHORAGE_DATA=../shared/data)",
                module_path!()
            ));
            None
        }
    }
}

fn accuracy(model: &ResNetCifar, set: &ImageSet, device: &Device) -> f64 {
    let transform = ResNetCifar::input_transform();
    let mut correct = 0usize;
    for start in (0..set.len()).step_by(BATCH) {
        let end = (start + BATCH).min(set.len());
        let x = transform.apply(image_batch(set, start, end, device));
        let pred: Vec<i64> = model.forward(x).argmax(1).into_data().try_into_vec_as::<i64>().unwrap();
        correct += pred.iter().zip(&set.labels[start..end]).filter(|(p, l)| **p == **l as i64).count();
    }
    correct as f64 / set.len() as f64
}

/// Every `len / n`-th image, so all classes are represented (the set is ordered by label).
fn spread(set: &ImageSet, n: usize) -> ImageSet {
    if n >= set.len() {
        return set.clone();
    }
    let idx: Vec<usize> = (0..n).map(|i| i * set.len() / n).collect();
    set.subset(&idx)
}

fn check(depth: usize, file: &str, jpeg_sample: usize, lossless_min: f64, jpeg_min: f64) {
    let Some(dir) = data_dir() else { return };
    let device = Device::flex();
    let config = ResNetCifarConfig { depth, num_classes: 10 };
    let model = ResNetCifar::load(config, &dir.join("weights").join(file), &device).unwrap();

    let t = Instant::now();
    let lossless = cifar::read_batch(&dir.join("cifar10/data_batch_1.first4000.bin.gz"), CifarKind::Cifar10).unwrap();
    assert_eq!(lossless.len(), 4000);
    let acc = accuracy(&model, &lossless, &device);
    eprintln!("ResNet-{depth}: lossless CIFAR-10 train records 4000: {:.2}% ({:.1?})", acc * 100.0, t.elapsed());
    assert!(acc >= lossless_min, "ResNet-{depth} lossless accuracy {acc}");

    let t = Instant::now();
    let jpeg = image_folder::load(&dir.join("cifar10/cifar10-jpg.tar.gz"), &ImageFolderOptions::split("test")).unwrap();
    assert_eq!(jpeg.len(), 10_000);
    let jpeg = spread(&jpeg, jpeg_sample);
    let acc = accuracy(&model, &jpeg, &device);
    eprintln!("ResNet-{depth}: CIFAR-10 JPEG test {} images: {:.2}% ({:.1?})", jpeg.len(), acc * 100.0, t.elapsed());
    assert!(acc >= jpeg_min, "ResNet-{depth} JPEG accuracy {acc}");
}

#[test]
fn resnet20_classifies_cifar10() {
    check(20, "resnet20-12fca82f.safetensors", 10_000, 0.99, 0.78);
}

#[test]
fn resnet56_classifies_cifar10() {
    check(56, "resnet56-4bfd9763.safetensors", JPEG_SAMPLE_56, 0.99, 0.78);
}

#[test]
fn wrong_weights_file_lists_mismatches() {
    let Some(dir) = data_dir() else { return };
    let device = Device::flex();
    // ResNet-56 weights into a ResNet-20: blocks 3.. of each stage are not in the model.
    let err =
        ResNetCifar::load(ResNetCifarConfig::resnet20(), &dir.join("weights/resnet56-4bfd9763.safetensors"), &device)
            .unwrap_err();
    let WeightError::Mismatch { unused, .. } = &err else { panic!("{err}") };
    assert!(unused.iter().any(|k| k.starts_with("layer1.3.")), "{err}");
    eprintln!("{err}");
    // A different architecture entirely.
    let err = ResNetCifar::load(
        ResNetCifarConfig::resnet20(),
        &dir.join("weights/mobilenetv2_035_224_imagenet_backbone.safetensors"),
        &device,
    )
    .unwrap_err();
    let WeightError::Mismatch { missing, unused, .. } = &err else { panic!("{err}") };
    assert!(missing.iter().any(|k| k == "conv1.weight") && !unused.is_empty(), "{err}");
}

#[test]
fn bad_files_are_errors_not_panics() {
    let tmp = std::env::temp_dir().join(format!("anchorage-weights-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let device = Device::flex();
    let missing = ResNetCifar::load(ResNetCifarConfig::resnet20(), &tmp.join("absent.safetensors"), &device);
    assert!(matches!(missing, Err(WeightError::Read { .. })));
    let garbage = tmp.join("garbage.safetensors");
    std::fs::write(&garbage, b"\x10\0\0\0\0\0\0\0{not json at all").unwrap();
    let err = ResNetCifar::load(ResNetCifarConfig::resnet20(), &garbage, &device).unwrap_err();
    assert!(err.to_string().contains("garbage.safetensors"), "{err}");
    // Right names, wrong shape: a tiny hand-written file with conv1.weight of the wrong size.
    let header = br#"{"conv1.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0u8; 16]);
    let shaped = tmp.join("shape.safetensors");
    std::fs::write(&shaped, bytes).unwrap();
    let err = ResNetCifar::load(ResNetCifarConfig::resnet20(), &shaped, &device).unwrap_err();
    let WeightError::Mismatch { shapes, missing, .. } = &err else { panic!("{err}") };
    assert!(shapes.iter().any(|s| s.contains("conv1.weight")), "{err}");
    assert!(!missing.is_empty());
    std::fs::remove_dir_all(&tmp).ok();
}
