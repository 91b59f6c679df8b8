//! ViT: a timm-named safetensors file written here (by hand, `[out, in]` Linear weights) loads
//! and reproduces the model it was taken from; mismatching files are errors; prompt tokens.
//!
//! Reading of "prompts change the output only through attention": every layer but attention
//! works per token, so with each block's attention output projection zeroed (attention adds
//! nothing to the residual stream) the cls and patch outputs are the same with and without a
//! prompt; with attention on, a prompt changes the cls output.

use std::path::{Path, PathBuf};

use anchorage_model::WeightError;
use anchorage_model::vit::{Vit, VitConfig};
use burn::module::Param;
use burn::nn::{LayerNorm, Linear};
use burn::tensor::{Device, Distribution, Tensor};

fn config() -> VitConfig {
    VitConfig {
        image_size: 8,
        patch_size: 4,
        in_channels: 3,
        width: 16,
        depth: 2,
        heads: 2,
        mlp_ratio: 2,
        num_classes: 3,
    }
}

/// One tensor of a safetensors file: name, shape, f32 values.
type Entry = (String, Vec<usize>, Vec<f32>);

fn values<const D: usize>(t: Tensor<D>) -> (Vec<usize>, Vec<f32>) {
    (t.dims().to_vec(), t.into_data().try_into_vec_as::<f32>().unwrap())
}

fn put<const D: usize>(out: &mut Vec<Entry>, name: &str, t: Tensor<D>) {
    let (shape, v) = values(t);
    out.push((name.to_string(), shape, v));
}

fn put_linear(out: &mut Vec<Entry>, name: &str, l: &Linear) {
    put(out, &format!("{name}.weight"), l.weight.val().transpose());
    put(out, &format!("{name}.bias"), l.bias.as_ref().unwrap().val());
}

fn put_norm(out: &mut Vec<Entry>, name: &str, n: &LayerNorm) {
    put(out, &format!("{name}.weight"), n.gamma.val());
    put(out, &format!("{name}.bias"), n.beta.as_ref().unwrap().val());
}

/// The model's parameters under timm names and layouts.
fn timm_entries(m: &Vit) -> Vec<Entry> {
    let mut out = Vec::new();
    put(&mut out, "patch_embed.proj.weight", m.patch_embed.proj.weight.val());
    put(&mut out, "patch_embed.proj.bias", m.patch_embed.proj.bias.as_ref().unwrap().val());
    put(&mut out, "cls_token", m.cls_token.val());
    put(&mut out, "pos_embed", m.pos_embed.val());
    for (i, b) in m.blocks.iter().enumerate() {
        put_norm(&mut out, &format!("blocks.{i}.norm1"), &b.norm1);
        put_linear(&mut out, &format!("blocks.{i}.attn.qkv"), &b.attn.qkv);
        put_linear(&mut out, &format!("blocks.{i}.attn.proj"), &b.attn.proj);
        put_norm(&mut out, &format!("blocks.{i}.norm2"), &b.norm2);
        put_linear(&mut out, &format!("blocks.{i}.mlp.fc1"), &b.mlp.fc1);
        put_linear(&mut out, &format!("blocks.{i}.mlp.fc2"), &b.mlp.fc2);
    }
    put_norm(&mut out, "norm", &m.norm);
    put_linear(&mut out, "head", m.head.as_ref().unwrap());
    out
}

/// A safetensors file: u64 LE header length, JSON header (padded to 8 bytes), raw F32 data.
fn write_safetensors(path: &Path, entries: &[Entry]) {
    let mut header = Vec::new();
    let mut data = Vec::new();
    for (name, shape, v) in entries {
        let start = data.len();
        data.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        let shape: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        header.push(format!(
            "\"{name}\":{{\"dtype\":\"F32\",\"shape\":[{}],\"data_offsets\":[{start},{}]}}",
            shape.join(","),
            data.len()
        ));
    }
    let mut json = format!("{{{}}}", header.join(",")).into_bytes();
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend(json);
    bytes.extend(data);
    std::fs::write(path, bytes).unwrap();
}

fn temp_file(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("anchorage-vit-{}-{tag}.safetensors", std::process::id()))
}

fn images(n: usize, device: &Device) -> Tensor<4> {
    Tensor::random([n, 3, 8, 8], Distribution::Uniform(0.0, 1.0), device)
}

fn max_diff<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> f32 {
    (a - b).abs().max().into_scalar::<f32>()
}

#[test]
fn timm_file_loads_and_reproduces_the_model() {
    let device = Device::flex();
    let original = config().init(&device);
    let path = temp_file("roundtrip");
    write_safetensors(&path, &timm_entries(&original));
    let loaded = Vit::load(config(), &path, &device).unwrap();
    std::fs::remove_file(&path).ok();
    let x = images(2, &device);
    let prompt = Tensor::<2>::random([3, 16], Distribution::Normal(0.0, 1.0), &device);
    assert_eq!(original.forward(x.clone(), None).dims(), [2, 3]);
    assert_eq!(max_diff(original.forward(x.clone(), None), loaded.forward(x.clone(), None)), 0.0);
    let (a, b) = (original.forward(x.clone(), Some(prompt.clone())), loaded.forward(x.clone(), Some(prompt)));
    assert_eq!(max_diff(a, b), 0.0);
    // A fresh random model is not the original: the comparison above is not vacuous.
    assert!(max_diff(original.forward(x.clone(), None), config().init(&device).forward(x, None)) > 1e-4);
}

#[test]
fn mismatching_files_are_errors() {
    let device = Device::flex();
    let mut entries = timm_entries(&config().init(&device));
    // Drop one tensor, rename another, and give a third the wrong shape.
    entries.retain(|(name, _, _)| name != "blocks.1.mlp.fc2.bias");
    entries.iter_mut().find(|(name, _, _)| name == "norm.weight").unwrap().0 = "fc_norm.weight".into();
    let pos = entries.iter_mut().find(|(name, _, _)| name == "pos_embed").unwrap();
    pos.1 = vec![1, 4, 16];
    pos.2.truncate(4 * 16);
    let path = temp_file("mismatch");
    write_safetensors(&path, &entries);
    let err = Vit::load(config(), &path, &device).unwrap_err();
    std::fs::remove_file(&path).ok();
    let WeightError::Mismatch { missing, unused, shapes, .. } = &err else { panic!("expected a mismatch: {err}") };
    assert!(missing.iter().any(|m| m.contains("blocks.1.mlp.fc2.bias")), "{err}");
    assert!(missing.iter().any(|m| m.contains("norm.gamma")), "{err}");
    assert!(unused.iter().any(|m| m.contains("fc_norm.weight")), "{err}");
    assert!(shapes.iter().any(|m| m.contains("pos_embed")), "{err}");

    let garbage = temp_file("garbage");
    std::fs::write(&garbage, b"not a safetensors file").unwrap();
    let err = Vit::load(config(), &garbage, &device).unwrap_err();
    std::fs::remove_file(&garbage).ok();
    assert!(matches!(err, WeightError::Read { .. }), "{err}");
    let bad = VitConfig { patch_size: 3, ..config() };
    assert!(matches!(Vit::load(bad, &garbage, &device), Err(WeightError::Read { .. })));
}

#[test]
fn zero_length_prompt_is_the_plain_model() {
    let device = Device::flex();
    let model = config().init(&device);
    let x = images(2, &device);
    let empty = Tensor::<2>::zeros([0, 16], &device);
    assert_eq!(max_diff(model.forward_tokens(x.clone(), None), model.forward_tokens(x, Some(empty))), 0.0);
}

#[test]
fn prompts_act_only_through_attention() {
    let device = Device::flex();
    let mut model = config().init(&device);
    let x = images(2, &device);
    let p = 4;
    let prompt = Tensor::<2>::random([p, 16], Distribution::Normal(0.0, 1.0), &device);
    let plain = model.forward_tokens(x.clone(), None);
    let prompted = model.forward_tokens(x.clone(), Some(prompt.clone()));
    assert_eq!(prompted.dims(), [2, p + 1 + 4, 16]);
    let cls_change = max_diff(model.forward(x.clone(), None), model.forward(x.clone(), Some(prompt.clone())));
    assert!(cls_change > 1e-3, "a prompt left the cls output unchanged ({cls_change})");
    assert!(max_diff(plain, prompted.narrow(1, p, 5)) > 1e-3);

    // Attention off: the prompt cannot reach the cls and patch tokens any more.
    for block in &mut model.blocks {
        let proj = &mut block.attn.proj;
        proj.weight = Param::from_tensor(proj.weight.val().zeros_like());
        proj.bias = Some(Param::from_tensor(proj.bias.as_ref().unwrap().val().zeros_like()));
    }
    let plain = model.forward_tokens(x.clone(), None);
    let prompted = model.forward_tokens(x, Some(prompt));
    let diff = max_diff(plain, prompted.narrow(1, p, 5));
    assert!(diff < 1e-6, "without attention a prompt still changed other tokens by {diff}");
}
