//! ResNet-18 (CIFAR stem) from hand-written PyTorch-named safetensors files: every tensor lands
//! where its name says (kuangliu `shortcut.{0,1}`/`linear` and torchvision `downsample.{0,1}`/`fc`),
//! and files that do not fit are errors listing what is wrong.

use std::path::{Path, PathBuf};

use anchorage_model::zoo::{self, ZooError};
use anchorage_model::{ResNet18, ResNet18Config, WeightError};
use anchorage_shared::rng::Rng;
use burn::tensor::{Device, Tensor, TensorData};

/// `(name, shape)` of every tensor of a kuangliu ResNet-18 of `width` and `classes`.
fn kuangliu_names(width: usize, classes: usize) -> Vec<(String, Vec<usize>)> {
    let mut out = Vec::new();
    let bn = |out: &mut Vec<(String, Vec<usize>)>, prefix: &str, c: usize| {
        for field in ["weight", "bias", "running_mean", "running_var"] {
            out.push((format!("{prefix}.{field}"), vec![c]));
        }
    };
    out.push(("conv1.weight".into(), vec![width, 3, 3, 3]));
    bn(&mut out, "bn1", width);
    let mut c_in = width;
    for stage in 0..4 {
        let c = width << stage;
        for block in 0..2 {
            let p = format!("layer{}.{block}", stage + 1);
            let block_in = if block == 0 { c_in } else { c };
            out.push((format!("{p}.conv1.weight"), vec![c, block_in, 3, 3]));
            bn(&mut out, &format!("{p}.bn1"), c);
            out.push((format!("{p}.conv2.weight"), vec![c, c, 3, 3]));
            bn(&mut out, &format!("{p}.bn2"), c);
            if block == 0 && stage > 0 {
                out.push((format!("{p}.shortcut.0.weight"), vec![c, block_in, 1, 1]));
                bn(&mut out, &format!("{p}.shortcut.1"), c);
            }
        }
        c_in = c;
    }
    out.push(("linear.weight".into(), vec![classes, 8 * width]));
    out.push(("linear.bias".into(), vec![classes]));
    out
}

/// Seeded values for every tensor (running variances positive).
fn values(names: &[(String, Vec<usize>)], seed: u64) -> Vec<Vec<f32>> {
    let mut rng = Rng::new(seed);
    names
        .iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            (0..n)
                .map(|_| if name.ends_with("running_var") { 0.5 + rng.f32() } else { 0.2 * rng.f32() - 0.1 })
                .collect()
        })
        .collect()
}

/// A safetensors file of F32 tensors (and optional extra raw entries `(name, dtype, shape, bytes)`).
fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let mut header = Vec::new();
    let mut data = Vec::new();
    for (name, shape, v) in tensors {
        let start = data.len();
        data.reserve(4 * v.len());
        for x in v {
            data.extend_from_slice(&x.to_le_bytes());
        }
        let shape: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        header.push(format!(
            r#""{name}":{{"dtype":"F32","shape":[{}],"data_offsets":[{start},{}]}}"#,
            shape.join(","),
            data.len()
        ));
    }
    let header = format!("{{{}}}", header.join(","));
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&data);
    std::fs::write(path, bytes).unwrap();
}

fn tmp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("anchorage-resnet18-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn flat<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap()
}

fn file_tensors(width: usize, classes: usize, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let names = kuangliu_names(width, classes);
    let vals = values(&names, seed);
    names.into_iter().zip(vals).map(|((n, s), v)| (n, s, v)).collect()
}

fn get<'a>(tensors: &'a [(String, Vec<usize>, Vec<f32>)], name: &str) -> &'a [f32] {
    &tensors.iter().find(|t| t.0 == name).unwrap().2
}

fn check_loaded(model: &ResNet18, tensors: &[(String, Vec<usize>, Vec<f32>)], width: usize, classes: usize) {
    assert_eq!(flat(model.conv1.weight.val()), get(tensors, "conv1.weight"));
    assert_eq!(flat(model.bn1.gamma.val()), get(tensors, "bn1.weight"));
    assert_eq!(flat(model.bn1.running_var.value()), get(tensors, "bn1.running_var"));
    assert_eq!(flat(model.layer3[1].conv2.weight.val()), get(tensors, "layer3.1.conv2.weight"));
    let p = model.layer2[0].shortcut.as_ref().expect("projection in layer2.0");
    assert_eq!(flat(p.conv.weight.val()), get(tensors, "layer2.0.shortcut.0.weight"));
    assert_eq!(flat(p.bn.beta.val()), get(tensors, "layer2.0.shortcut.1.bias"));
    assert!(model.layer1[0].shortcut.is_none() && model.layer2[1].shortcut.is_none());
    // PyTorch's linear weight is [out, in]; burn's is [in, out].
    let w = get(tensors, "linear.weight");
    let loaded = flat(model.linear.weight.val());
    let d = 8 * width;
    for o in 0..classes {
        for i in 0..d {
            assert_eq!(loaded[i * classes + o], w[o * d + i]);
        }
    }
}

#[test]
fn loads_pytorch_names_and_computes_features() {
    let dir = tmp_dir("ok");
    let device = Device::flex();
    let (width, classes) = (4, 7);
    let config = ResNet18Config { num_classes: classes, width };
    let tensors = file_tensors(width, classes, 1);
    let path = dir.join("kuangliu.safetensors");
    write_safetensors(&path, &tensors);
    let model = ResNet18::load(config, &path, &device).unwrap();
    check_loaded(&model, &tensors, width, classes);

    let x = Tensor::<4>::from_data(TensorData::new(vec![0.25f32; 2 * 3 * 32 * 32], [2, 3, 32, 32]), &device);
    let f = model.forward_features(ResNet18::input_transform().apply(x.clone()));
    assert_eq!(f.dims(), [2, 8 * width]);
    assert!(flat(f).iter().all(|v| v.is_finite()));
    assert_eq!(model.forward(x).dims(), [2, classes]);

    // torchvision's names for the same tensors, plus PyTorch's BatchNorm counters, load the same.
    let renamed: Vec<_> = tensors
        .iter()
        .map(|(n, s, v)| {
            let n = n.replace("shortcut.", "downsample.").replace("linear.", "fc.");
            (n, s.clone(), v.clone())
        })
        .chain([("bn1.num_batches_tracked".to_string(), vec![1], vec![0.0])])
        .collect();
    let path = dir.join("torchvision.safetensors");
    write_safetensors(&path, &renamed);
    let model = ResNet18::load(config, &path, &device).unwrap();
    check_loaded(&model, &tensors, width, classes);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn full_width_has_512_features() {
    let dir = tmp_dir("full");
    let device = Device::flex();
    let tensors = file_tensors(64, 10, 2);
    let n: usize = tensors.iter().map(|t| t.2.len()).sum();
    assert!((11_100_000..11_250_000).contains(&n), "ResNet-18 (CIFAR) has about 11.17 M values, got {n}");
    // The zoo reads the same file from a data folder.
    assert!(matches!(zoo::load("resnet18", 3072, None, &device), Err(ZooError::NoDataDir(..))));
    let absent = zoo::load("resnet18", 3072, Some(&dir), &device).err().expect("no weights file yet");
    assert!(absent.to_string().contains("resnet18_cifar.safetensors"), "{absent}");
    let path = dir.join(zoo::RESNET18_WEIGHTS);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    write_safetensors(&path, &tensors);
    let model = ResNet18::load(ResNet18Config::default(), &path, &device).unwrap();
    check_loaded(&model, &tensors, 64, 10);
    let x = Tensor::<4>::zeros([1, 3, 32, 32], &device);
    assert_eq!(model.forward_features(x).dims(), [1, ResNet18::FEATURE_DIM]);
    let backbone = zoo::load("resnet18", 3072, Some(&dir), &device).unwrap();
    assert_eq!(backbone.feature_dim(), 512);
    let pixels = Tensor::<2>::from_data(TensorData::new(vec![0.5f32; 2 * 3072], [2, 3072]), &device);
    assert_eq!(backbone.features(pixels, &[3, 32, 32]).dims(), [2, 512]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn mismatched_files_are_errors() {
    let dir = tmp_dir("bad");
    let device = Device::flex();
    let config = ResNet18Config { num_classes: 10, width: 4 };
    let good = file_tensors(4, 10, 3);

    // A missing tensor and a foreign one.
    let mut tensors: Vec<_> = good.iter().filter(|t| t.0 != "layer4.0.shortcut.0.weight").cloned().collect();
    tensors.push(("layer5.0.conv1.weight".into(), vec![2], vec![0.0, 0.0]));
    let path = dir.join("missing.safetensors");
    write_safetensors(&path, &tensors);
    let err = ResNet18::load(config, &path, &device).unwrap_err();
    let WeightError::Mismatch { missing, unused, .. } = &err else { panic!("{err}") };
    assert!(missing.iter().any(|k| k == "layer4.0.shortcut.conv.weight"), "{err}");
    assert!(unused.iter().any(|k| k == "layer5.0.conv1.weight"), "{err}");
    assert!(err.to_string().contains("missing.safetensors"), "{err}");

    // Right names, wrong width.
    let path = dir.join("wide.safetensors");
    write_safetensors(&path, &file_tensors(8, 10, 3));
    let err = ResNet18::load(config, &path, &device).unwrap_err();
    let WeightError::Mismatch { shapes, .. } = &err else { panic!("{err}") };
    assert!(shapes.iter().any(|s| s.contains("conv1.weight")), "{err}");

    // The CIFAR ResNet-20 layout (no layer4, 16 channels) is not a ResNet-18.
    let path = dir.join("other.safetensors");
    write_safetensors(&path, &[("conv1.weight".into(), vec![16, 3, 3, 3], vec![0.0; 16 * 27])]);
    assert!(matches!(ResNet18::load(config, &path, &device), Err(WeightError::Mismatch { .. })));

    // Not a file, not safetensors.
    assert!(matches!(ResNet18::load(config, &dir.join("absent"), &device), Err(WeightError::Read { .. })));
    let path = dir.join("garbage.safetensors");
    std::fs::write(&path, b"\xff\xff\xff\xff\xff\xff\xff\x7fnope").unwrap();
    assert!(ResNet18::load(config, &path, &device).is_err());
    std::fs::remove_dir_all(&dir).ok();
}
