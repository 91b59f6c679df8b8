//! Loaders on generated fixtures: a tar.gz and its unpacked directory load identically; missing,
//! truncated and corrupt files are errors that name the file and what was expected, never panics.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};

use anchorage_data::loaders::cifar::{self, CifarKind};
use anchorage_data::loaders::image_folder::{self, ClassOrder, ImageFolderOptions};
use anchorage_data::loaders::{Split, mnist, tiny_imagenet};
use anchorage_data::{DataError, ImageSet};

fn png_bytes(w: u32, h: u32, color: png::ColorType, seed: u32) -> Vec<u8> {
    let ch = match color {
        png::ColorType::Grayscale => 1,
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        _ => unreachable!(),
    };
    let data: Vec<u8> =
        (0..w * h * ch).map(|i| (i.wrapping_mul(2654435761u32.wrapping_add(seed)) >> 13) as u8).collect();
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, w, h);
    enc.set_color(color);
    enc.set_depth(png::BitDepth::Eight);
    let mut writer = enc.write_header().unwrap();
    writer.write_image_data(&data).unwrap();
    writer.finish().unwrap();
    out
}

/// `root/<split>/<class>/<i>.png` for 3 classes and 2 splits, mixed RGB / gray / RGBA, plus `classes.txt`.
fn make_tree(root: &Path, size: (u32, u32), mixed_sizes: bool) {
    let classes = ["cat", "dog", "emu"];
    for (s, split) in ["train", "test"].iter().enumerate() {
        for (c, class) in classes.iter().enumerate() {
            let d = root.join(split).join(class);
            std::fs::create_dir_all(&d).unwrap();
            for i in 0..(4 + c) {
                let color = [png::ColorType::Rgb, png::ColorType::Grayscale, png::ColorType::Rgba][i % 3];
                let (w, h) = if mixed_sizes && i == 1 { (size.0 * 2, size.1 + 3) } else { size };
                let bytes = png_bytes(w, h, color, (s * 100 + c * 10 + i) as u32);
                std::fs::write(d.join(format!("{i:03}.png")), bytes).unwrap();
            }
        }
    }
    std::fs::write(root.join("classes.txt"), "emu\ncat\ndog\n").unwrap();
    // Noise the loader must ignore.
    std::fs::write(root.join("train/README.txt"), "not an image").unwrap();
}

fn tar_of(dir: &Path, out: &Path, gz: bool, prefix: &str) {
    let file = std::fs::File::create(out).unwrap();
    let w: Box<dyn Write> =
        if gz { Box::new(flate2::write::GzEncoder::new(file, flate2::Compression::fast())) } else { Box::new(file) };
    let mut b = tar::Builder::new(w);
    b.append_dir_all(prefix, dir).unwrap();
    b.into_inner().unwrap().flush().unwrap();
}

fn expect_err<T: std::fmt::Debug>(r: Result<T, DataError>) -> DataError {
    let e = r.expect_err("expected an error");
    eprintln!("error as shown: {e}");
    e
}

#[test]
fn tar_gz_tar_and_directory_load_identically() {
    let base = common::scratch("tar-vs-dir");
    let tree = base.join("tree");
    make_tree(&tree, (6, 5), false);
    let tgz = base.join("set.tar.gz");
    let plain = base.join("set.tar");
    tar_of(&tree, &tgz, true, "myset");
    tar_of(&tree, &plain, false, ".");
    for split in ["train", "test"] {
        let opts = ImageFolderOptions::split(split);
        let a = image_folder::load(&tree, &opts).unwrap();
        let b = image_folder::load(&tgz, &opts).unwrap();
        let c = image_folder::load(&plain, &opts).unwrap();
        assert_eq!(a, b, "{split}: directory vs tar.gz");
        assert_eq!(a, c, "{split}: directory vs tar");
        assert_eq!(a.class_names, vec!["cat", "dog", "emu"]);
        assert_eq!(a.class_counts(), vec![4, 5, 6]);
        assert_eq!(a.sample_shape(), vec![3, 5, 6]);
        let listed = image_folder::list(&tgz, &opts).unwrap();
        assert_eq!(listed.labels, a.labels);
        assert_eq!(listed.names[0], "cat/000.png");
    }
    // Explicit class order from a file, read from the archive.
    let opts =
        ImageFolderOptions { classes: ClassOrder::File("classes.txt".into()), ..ImageFolderOptions::split("train") };
    let a = image_folder::load(&tree, &opts).unwrap();
    let b = image_folder::load(&tgz, &opts).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.class_names, vec!["emu", "cat", "dog"]);
    assert_eq!(a.class_counts(), vec![6, 4, 5]);
    // The same layout through the Tiny-ImageNet entry point (wnids.txt).
    std::fs::copy(tree.join("classes.txt"), tree.join("wnids.txt")).unwrap();
    std::fs::rename(tree.join("test"), tree.join("val")).unwrap();
    let t = tiny_imagenet::load(&tree, Split::Test).unwrap();
    assert_eq!(t.class_names, vec!["emu", "cat", "dog"]);
    assert_eq!(t.len(), 15);
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn grayscale_becomes_rgb_and_resize_unifies_sizes() {
    let base = common::scratch("gray-resize");
    let tree = base.join("tree");
    make_tree(&tree, (8, 8), true);
    // Mixed sizes without a resize are an error naming the entry.
    let e = expect_err(image_folder::load(&tree, &ImageFolderOptions::split("train")));
    assert!(matches!(e, DataError::ShapeMismatch { ref entry, .. } if entry == "train/cat/001.png"), "{e}");
    let opts = ImageFolderOptions { resize: Some((4, 4)), ..ImageFolderOptions::split("train") };
    let s = image_folder::load(&tree, &opts).unwrap();
    assert_eq!(s.sample_shape(), vec![3, 4, 4]);
    // Image cat/001 is grayscale: its three planes are equal.
    let img = s.image(1);
    assert_eq!(&img[0..16], &img[16..32]);
    assert_eq!(&img[0..16], &img[32..48]);
    // Resizing a constant image keeps it constant.
    let flat = vec![77u8; 3 * 10 * 7];
    assert!(anchorage_data::loaders::resize_bilinear(&flat, 3, 10, 7, 4, 5).iter().all(|&v| v == 77));
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn max_per_class_and_ordering() {
    let base = common::scratch("max-per-class");
    let tree = base.join("tree");
    make_tree(&tree, (3, 3), false);
    let opts = ImageFolderOptions { max_per_class: Some(2), threads: 1, ..ImageFolderOptions::split("train") };
    let s = image_folder::load(&tree, &opts).unwrap();
    assert_eq!(s.labels, vec![0, 0, 1, 1, 2, 2]);
    let all =
        image_folder::load(&tree, &ImageFolderOptions { threads: 3, ..ImageFolderOptions::split("train") }).unwrap();
    assert_eq!(all.image(0), s.image(0));
    assert_eq!(all.image(4), s.image(2));
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn image_folder_errors_name_the_file() {
    let base = common::scratch("folder-errors");
    let tree = base.join("tree");
    make_tree(&tree, (4, 4), false);
    // A listed class without a folder.
    let opts = ImageFolderOptions {
        classes: ClassOrder::List(vec!["cat".into(), "dog".into(), "emu".into(), "fox".into()]),
        ..ImageFolderOptions::split("train")
    };
    let e = expect_err(image_folder::load(&tree, &opts));
    assert!(matches!(e, DataError::MissingClassFolder { ref class, .. } if class == "fox"), "{e}");
    assert!(e.to_string().contains("fox") && e.to_string().contains(&tree.display().to_string()));
    // A folder that is not listed.
    let opts =
        ImageFolderOptions { classes: ClassOrder::List(vec!["cat".into()]), ..ImageFolderOptions::split("train") };
    assert!(matches!(expect_err(image_folder::load(&tree, &opts)), DataError::UnknownClassFolder { .. }));
    // A missing class-list file.
    let opts =
        ImageFolderOptions { classes: ClassOrder::File("wnids.txt".into()), ..ImageFolderOptions::split("train") };
    assert!(matches!(expect_err(image_folder::load(&tree, &opts)), DataError::NotFound { .. }));
    // No such split.
    assert!(matches!(
        expect_err(image_folder::load(&tree, &ImageFolderOptions::split("val"))),
        DataError::NoImages { .. }
    ));
    // No such path.
    assert!(matches!(
        expect_err(image_folder::load(&base.join("nope"), &ImageFolderOptions::split("train"))),
        DataError::Io { .. }
    ));
    // A corrupt JPEG and a truncated PNG are decode errors naming the entry.
    std::fs::write(tree.join("train/dog/bad.jpg"), [0xff, 0xd8, 0xff, 0xe0, 1, 2, 3]).unwrap();
    let e = expect_err(image_folder::load(&tree, &ImageFolderOptions::split("train")));
    assert!(matches!(e, DataError::Decode { ref entry, .. } if entry == "train/dog/bad.jpg"), "{e}");
    std::fs::remove_file(tree.join("train/dog/bad.jpg")).unwrap();
    let good = std::fs::read(tree.join("train/emu/000.png")).unwrap();
    std::fs::write(tree.join("train/emu/000.png"), &good[..good.len() / 2]).unwrap();
    let e = expect_err(image_folder::load(&tree, &ImageFolderOptions::split("train")));
    assert!(matches!(e, DataError::Decode { ref entry, .. } if entry == "train/emu/000.png"), "{e}");
    std::fs::write(tree.join("train/emu/000.png"), b"GIF89a").unwrap();
    assert!(matches!(
        expect_err(image_folder::load(&tree, &ImageFolderOptions::split("train"))),
        DataError::Decode { .. }
    ));
    std::fs::write(tree.join("train/emu/000.png"), &good).unwrap();
    // A truncated tar.gz and a file that is not an archive.
    let tgz = base.join("set.tar.gz");
    tar_of(&tree, &tgz, true, "x");
    let bytes = std::fs::read(&tgz).unwrap();
    for cut in [bytes.len() / 3, bytes.len() - 10] {
        std::fs::write(&tgz, &bytes[..cut]).unwrap();
        let e = expect_err(image_folder::load(&tgz, &ImageFolderOptions::split("train")));
        assert!(matches!(e, DataError::Tar { .. } | DataError::Decode { .. }), "cut {cut}: {e}");
    }
    let junk = base.join("junk.tar");
    std::fs::write(&junk, vec![7u8; 3000]).unwrap();
    let e = expect_err(image_folder::load(&junk, &ImageFolderOptions::split("train")));
    assert!(matches!(e, DataError::Tar { .. } | DataError::NoImages { .. }), "{e}");
    let _ = std::fs::remove_dir_all(&base);
}

fn idx(magic: u32, dims: &[u32], body: &[u8]) -> Vec<u8> {
    let mut v = magic.to_be_bytes().to_vec();
    dims.iter().for_each(|d| v.extend_from_slice(&d.to_be_bytes()));
    v.extend_from_slice(body);
    v
}

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn write_mnist(dir: &Path, n: u32, images: Vec<u8>, labels: Vec<u8>, gzip: bool) -> (PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let (mut ip, mut lp) = (dir.join("t10k-images-idx3-ubyte"), dir.join("t10k-labels-idx1-ubyte"));
    let mut ib = idx(mnist::IMAGES_MAGIC, &[n, 2, 3], &images);
    let mut lb = idx(mnist::LABELS_MAGIC, &[n], &labels);
    if gzip {
        (ib, lb) = (gz(&ib), gz(&lb));
        ip.set_extension("gz");
        ip = dir.join("t10k-images-idx3-ubyte.gz");
        lp = dir.join("t10k-labels-idx1-ubyte.gz");
    }
    std::fs::write(&ip, ib).unwrap();
    std::fs::write(&lp, lb).unwrap();
    (ip, lp)
}

#[test]
fn mnist_plain_and_gz_and_corrupt() {
    let base = common::scratch("mnist");
    let pixels: Vec<u8> = (0..12).collect();
    for gzip in [false, true] {
        let d = base.join(format!("gz{gzip}"));
        write_mnist(&d, 2, pixels.clone(), vec![3, 9], gzip);
        let s: ImageSet = mnist::load(&d, Split::Test).unwrap();
        assert_eq!((s.len(), s.sample_shape(), s.labels.clone()), (2, vec![1, 2, 3], vec![3, 9]));
        assert_eq!(s.pixels, pixels);
        assert_eq!(s.to_dataset().features[11], 11.0 / 255.0);
    }
    // Missing files.
    let e = expect_err(mnist::load(&base.join("empty"), Split::Train));
    assert!(matches!(e, DataError::NotFound { .. }) && e.to_string().contains("train-images-idx3-ubyte"), "{e}");
    // Wrong magic (labels file given as images).
    let d = base.join("magic");
    let (ip, _) = write_mnist(&d, 2, pixels.clone(), vec![1, 2], false);
    std::fs::write(&ip, idx(mnist::LABELS_MAGIC, &[2, 2, 3], &pixels)).unwrap();
    let e = expect_err(mnist::load(&d, Split::Test));
    assert!(matches!(e, DataError::BadMagic { ref path, expected: 0x803, found: 0x801, .. } if *path == ip), "{e}");
    // Truncated body and truncated header.
    let d = base.join("trunc");
    let (ip, lp) = write_mnist(&d, 2, pixels[..10].to_vec(), vec![1, 2], false);
    let e = expect_err(mnist::load(&d, Split::Test));
    assert!(matches!(e, DataError::BadLength { expected: 28, found: 26, .. }), "{e}");
    std::fs::write(&ip, [0, 0, 8]).unwrap();
    assert!(matches!(expect_err(mnist::read_images(&ip)), DataError::BadLength { .. }));
    std::fs::write(&ip, []).unwrap();
    assert!(matches!(expect_err(mnist::read_images(&ip)), DataError::BadLength { .. }));
    // Count mismatch and a bad label.
    write_mnist(&d, 2, pixels.clone(), vec![1, 2], false);
    std::fs::write(&lp, idx(mnist::LABELS_MAGIC, &[3], &[1, 2, 3])).unwrap();
    assert!(matches!(expect_err(mnist::load(&d, Split::Test)), DataError::CountMismatch { images: 2, labels: 3, .. }));
    std::fs::write(&lp, idx(mnist::LABELS_MAGIC, &[2], &[1, 12])).unwrap();
    assert!(matches!(expect_err(mnist::load(&d, Split::Test)), DataError::BadLabel { record: 1, label: 12, .. }));
    // A truncated and a corrupt gzip.
    let d = base.join("badgz");
    let (ip, _) = write_mnist(&d, 2, pixels.clone(), vec![1, 2], true);
    let g = std::fs::read(&ip).unwrap();
    std::fs::write(&ip, &g[..g.len() - 6]).unwrap();
    let e = expect_err(mnist::load(&d, Split::Test));
    assert!(matches!(e, DataError::Gzip { .. } | DataError::BadLength { .. }), "{e}");
    let mut bad = g.clone();
    for b in bad.iter_mut().skip(10).take(8) {
        *b ^= 0x5a;
    }
    std::fs::write(&ip, &bad).unwrap();
    let e = expect_err(mnist::load(&d, Split::Test));
    assert!(matches!(e, DataError::Gzip { .. } | DataError::BadLength { .. }), "{e}");
    let _ = std::fs::remove_dir_all(&base);
}

fn cifar_record(label: &[u8], fill: u8) -> Vec<u8> {
    let mut r = label.to_vec();
    r.extend((0..3072).map(|i| (i as u8).wrapping_add(fill)));
    r
}

#[test]
fn cifar_binary_layouts_and_corrupt_files() {
    let base = common::scratch("cifar");
    // CIFAR-10: batches in the official folder, one gzipped.
    let d10 = base.join("c10/cifar-10-batches-bin");
    std::fs::create_dir_all(&d10).unwrap();
    for i in 1..=5u8 {
        let bytes: Vec<u8> = [cifar_record(&[i], i), cifar_record(&[9], 0)].concat();
        let name = format!("data_batch_{i}.bin");
        if i == 3 {
            std::fs::write(d10.join(format!("{name}.gz")), gz(&bytes))
        } else {
            std::fs::write(d10.join(name), bytes)
        }
        .unwrap();
    }
    std::fs::write(d10.join("test_batch.bin"), cifar_record(&[4], 1)).unwrap();
    let train = cifar::load(&base.join("c10"), CifarKind::Cifar10, Split::Train).unwrap();
    assert_eq!(train.len(), 10);
    assert_eq!(train.labels, vec![1, 9, 2, 9, 3, 9, 4, 9, 5, 9]);
    assert_eq!(train.image(2)[..3], [2, 3, 4]);
    assert_eq!(train.sample_shape(), vec![3, 32, 32]);
    assert_eq!(cifar::load_labels(&base.join("c10"), CifarKind::Cifar10, Split::Test).unwrap(), vec![4]);
    // CIFAR-100: fine and coarse labels.
    let d100 = base.join("c100");
    std::fs::create_dir_all(&d100).unwrap();
    std::fs::write(d100.join("train.bin"), [cifar_record(&[3, 77], 0), cifar_record(&[19, 99], 5)].concat()).unwrap();
    let fine = cifar::load(&d100, CifarKind::Cifar100Fine, Split::Train).unwrap();
    assert_eq!((fine.labels.clone(), fine.num_classes), (vec![77, 99], 100));
    assert_eq!(fine.image(1)[0], 5);
    let coarse = cifar::load(&d100, CifarKind::Cifar100Coarse, Split::Train).unwrap();
    assert_eq!((coarse.labels, coarse.num_classes), (vec![3, 19], 20));
    // Record size wrong: CIFAR-100 file read as CIFAR-10, and a truncated file.
    let e = expect_err(cifar::read_batch(&d100.join("train.bin"), CifarKind::Cifar10));
    assert!(matches!(e, DataError::BadRecordSize { record_size: 3073, len: 6148, .. }), "{e}");
    assert!(e.to_string().contains("train.bin"));
    std::fs::write(d100.join("test.bin"), &cifar_record(&[1, 2], 0)[..3000]).unwrap();
    assert!(matches!(
        expect_err(cifar::load(&d100, CifarKind::Cifar100Fine, Split::Test)),
        DataError::BadRecordSize { .. }
    ));
    std::fs::write(d100.join("test.bin"), []).unwrap();
    assert!(matches!(
        expect_err(cifar::load(&d100, CifarKind::Cifar100Fine, Split::Test)),
        DataError::BadRecordSize { .. }
    ));
    // Label out of range.
    std::fs::write(d100.join("test.bin"), cifar_record(&[1, 100], 0)).unwrap();
    assert!(matches!(
        expect_err(cifar::load(&d100, CifarKind::Cifar100Fine, Split::Test)),
        DataError::BadLabel { label: 100, .. }
    ));
    // Missing batch.
    std::fs::remove_file(d10.join("data_batch_5.bin")).unwrap();
    let e = expect_err(cifar::load(&base.join("c10"), CifarKind::Cifar10, Split::Train));
    assert!(matches!(e, DataError::NotFound { .. }) && e.to_string().contains("data_batch_5.bin"), "{e}");
    let _ = std::fs::remove_dir_all(&base);
}
