//! Loader tests on the real files in `ANCHORAGE_DATA` (CI: `/work/shared/data`). Without the
//! variable each test prints a loud SKIPPED line and passes.

mod common;

use std::time::Instant;

use anchorage_data::loaders::cifar::{self, CIFAR10_CLASSES, CifarKind};
use anchorage_data::loaders::image_folder::{self, ImageFolderOptions};
use anchorage_data::loaders::{Split, mnist, tiny_imagenet};

#[test]
fn mnist_counts_and_pixel_mean() {
    let Some(dir) = common::data_dir("mnist_counts_and_pixel_mean") else { return };
    let t = Instant::now();
    let train = mnist::load(&dir.join("mnist"), Split::Train).unwrap();
    let test = mnist::load(&dir.join("mnist"), Split::Test).unwrap();
    eprintln!("MNIST loaded in {:?}", t.elapsed());
    assert_eq!((train.len(), test.len()), (60_000, 10_000));
    assert_eq!(train.sample_shape(), vec![1, 28, 28]);
    assert_eq!(train.class_counts().iter().sum::<u64>(), 60_000);
    let mean = train.pixel_mean();
    let ds = train.to_dataset();
    let f32_mean = ds.features.iter().map(|&v| v as f64).sum::<f64>() / ds.features.len() as f64;
    let std =
        (ds.features.iter().map(|&v| (v as f64 - f32_mean).powi(2)).sum::<f64>() / ds.features.len() as f64).sqrt();
    eprintln!("MNIST train pixel mean {mean:.5} (f32 path {f32_mean:.5}), std {std:.5}");
    assert!((mean - 0.1307).abs() < 5e-4, "mean {mean}");
    assert!((f32_mean - mean).abs() < 1e-6);
    assert!((std - 0.3081).abs() < 5e-4, "std {std}");
    assert!(ds.features.iter().all(|v| (0.0..=1.0).contains(v)));
    // Labels alone agree with the full load.
    assert_eq!(mnist::load_labels(&dir.join("mnist"), Split::Test).unwrap(), test.labels);
}

/// Record i of `data_batch_1` is the JPEG `train/<class>/NNNN.jpg` where NNNN is the number of
/// earlier records of the same class (the JPEG tree numbers each class's images in the order of
/// the official batches). Checked two ways: the matched JPEG is within JPEG error for every record,
/// and it is the nearest JPEG of its class for a sample of records.
#[test]
fn cifar10_binary_records_match_the_jpegs() {
    let Some(dir) = common::data_dir("cifar10_binary_records_match_the_jpegs") else { return };
    let t = Instant::now();
    let bin = cifar::read_batch(&dir.join("cifar10/data_batch_1.first4000.bin.gz"), CifarKind::Cifar10).unwrap();
    assert_eq!(bin.len(), 4000);
    assert_eq!(bin.sample_shape(), vec![3, 32, 32]);
    let opts = ImageFolderOptions { max_per_class: Some(600), ..ImageFolderOptions::split("train") };
    let jpg = image_folder::load(&dir.join("cifar10/cifar10-jpg.tar.gz"), &opts).unwrap();
    eprintln!("CIFAR-10 binary + 6,000 JPEGs loaded in {:?}", t.elapsed());
    assert_eq!(jpg.class_names, CIFAR10_CLASSES.map(String::from).to_vec());
    let first_of_class: Vec<usize> = (0..10u32).map(|c| jpg.labels.iter().position(|&l| l == c).unwrap()).collect();
    let mae =
        |a: &[u8], b: &[u8]| a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).abs()).sum::<f64>() / a.len() as f64;
    let mut seen = [0usize; 10];
    let mut errors = Vec::with_capacity(bin.len());
    let mut matched = Vec::with_capacity(bin.len());
    for i in 0..bin.len() {
        let c = bin.labels[i] as usize;
        let k = seen[c];
        seen[c] += 1;
        assert!(k < 600, "class {c} has more than 600 records in the first 4000");
        let j = first_of_class[c] + k;
        errors.push(mae(bin.image(i), jpg.image(j)));
        matched.push(j);
    }
    let mut sorted = errors.clone();
    sorted.sort_by(f64::total_cmp);
    let (median, p99, max) = (sorted[sorted.len() / 2], sorted[sorted.len() * 99 / 100], sorted[sorted.len() - 1]);
    let mean = errors.iter().sum::<f64>() / errors.len() as f64;
    eprintln!(
        "CIFAR-10 binary vs JPEG, mean absolute error per image (0..255): mean {mean:.2}, median {median:.2}, p99 {p99:.2}, max {max:.2}"
    );
    assert!(median < 12.0 && max < 30.0, "median {median}, max {max}");
    // The matched JPEG is the nearest of its class (first 600 of the class) for a sample of records.
    for i in (0..bin.len()).step_by(97) {
        let c = bin.labels[i];
        let best = (0..jpg.len())
            .filter(|&j| jpg.labels[j] == c)
            .min_by(|&a, &b| mae(bin.image(i), jpg.image(a)).total_cmp(&mae(bin.image(i), jpg.image(b))))
            .unwrap();
        assert_eq!(best, matched[i], "record {i}: nearest JPEG is not the derived one");
    }
    // A different record is far: the correspondence is not an accident of smooth images.
    let off = mae(bin.image(0), jpg.image(matched[1]));
    assert!(off > 2.0 * median, "mismatched pair error {off}");
}

#[test]
fn tiny_imagenet_100_counts_and_decode() {
    let Some(dir) = common::data_dir("tiny_imagenet_100_counts_and_decode") else { return };
    let path = dir.join("tiny-imagenet-100.tar.gz");
    let t = Instant::now();
    let train = tiny_imagenet::list(&path, Split::Train).unwrap();
    let val = tiny_imagenet::list(&path, Split::Test).unwrap();
    eprintln!("Tiny-ImageNet-100 listed in {:?}", t.elapsed());
    assert_eq!((train.labels.len(), val.labels.len()), (50_000, 5_000));
    assert_eq!(train.class_names.len(), 100);
    assert_eq!(train.class_names, val.class_names);
    let mut sorted = train.class_names.clone();
    sorted.sort();
    assert_eq!(sorted, train.class_names, "wnids.txt is sorted");
    for (labels, per) in [(&train.labels, 500), (&val.labels, 50)] {
        let mut counts = vec![0; 100];
        labels.iter().for_each(|&l| counts[l as usize] += 1);
        assert!(counts.iter().all(|&c| c == per), "{counts:?}");
    }
    let t = Instant::now();
    let v = tiny_imagenet::load(&path, Split::Test).unwrap();
    eprintln!("Tiny-ImageNet-100 val: {} images decoded in {:?}", v.len(), t.elapsed());
    assert_eq!(v.len(), 5_000);
    assert_eq!(v.sample_shape(), vec![3, 64, 64]);
    assert_eq!(v.labels, val.labels);
    let mean = v.pixel_mean();
    assert!((0.3..0.6).contains(&mean), "val pixel mean {mean}");
    // All of train decodes (614 MB as u8).
    let t = Instant::now();
    let all = tiny_imagenet::load(&path, Split::Train).unwrap();
    eprintln!("Tiny-ImageNet-100 train: {} images decoded in {:?}", all.len(), t.elapsed());
    assert_eq!(all.len(), 50_000);
    assert_eq!(all.labels, train.labels);
    drop(all);
    // A sample of train, resized, to exercise the resize path on real JPEGs.
    let opts = anchorage_data::loaders::image_folder::ImageFolderOptions {
        max_per_class: Some(5),
        resize: Some((32, 32)),
        ..tiny_imagenet::options(Split::Train)
    };
    let s = image_folder::load(&path, &opts).unwrap();
    assert_eq!((s.len(), s.sample_shape()), (500, vec![3, 32, 32]));
}

/// `load_rows` keeps exactly the rows `load` would give, in the order asked, on a real image set
/// (MNIST at data scale 0.1) and on a generated one; a row beyond the pool is an error.
#[test]
fn load_rows_keeps_the_rows_load_gives() {
    let spec = |text: &str| -> anchorage_data::DataSpec { toml::from_str(text).unwrap() };
    let synthetic = spec("dataset = \"synthetic\"\nseed = 3\n[partition]\nkind = \"iid\"\nclients = 2\n");
    let check = |spec: &anchorage_data::DataSpec, dir: Option<&std::path::Path>| {
        let all = anchorage_data::load(spec, dir).unwrap();
        let (train_rows, test_rows) = (vec![7, 2, all.train.len() - 1], vec![0, all.test.len() - 1]);
        let some = anchorage_data::load_rows(spec, dir, &train_rows, &test_rows).unwrap();
        assert_eq!(some.train, all.train.subset(&train_rows));
        assert_eq!(some.test, all.test.subset(&test_rows));
        assert!(anchorage_data::load_rows(spec, dir, &[all.train.len()], &[]).is_err(), "a row beyond the pool");
    };
    check(&synthetic, None);
    let Some(dir) = common::data_dir("load_rows_keeps_the_rows_load_gives") else { return };
    let mnist = spec("dataset = \"mnist\"\nscale = 0.1\nseed = 3\n[partition]\nkind = \"iid\"\nclients = 2\n");
    check(&mnist, Some(&dir));
}
