//! Loader throughput in images/s on the real files of `ANCHORAGE_DATA`, plus the f32 conversion
//! and the seeded augmentation. Plain std timing (best of a few runs):
//!
//! ```sh
//! ANCHORAGE_DATA=/work/shared/data cargo bench -p anchorage-data --bench loaders
//! ```

use std::path::Path;
use std::time::{Duration, Instant};

use anchorage_data::loaders::cifar::{self, CifarKind};
use anchorage_data::loaders::image_folder::{self, ImageFolderOptions};
use anchorage_data::loaders::{Split, mnist, tiny_imagenet};
use anchorage_data::transform::{Augment, Normalization};
use anchorage_data::{DataError, ImageSet};

fn bench(name: &str, runs: usize, f: impl Fn() -> Result<usize, DataError>) {
    let mut best = Duration::MAX;
    let mut n = 0;
    for _ in 0..runs {
        let t = Instant::now();
        match f() {
            Ok(k) => n = k,
            Err(e) => {
                println!("{name:<48} FAILED: {e}");
                return;
            }
        }
        best = best.min(t.elapsed());
    }
    println!(
        "{name:<48} {n:>7} images in {:>8.3} s  {:>10.0} images/s",
        best.as_secs_f64(),
        n as f64 / best.as_secs_f64()
    );
}

fn main() {
    let threads = std::thread::available_parallelism().map(|t| t.get()).unwrap_or(1);
    println!("anchorage-data loader benchmark ({threads} decoding threads available; best of runs)");
    let Some(dir) = std::env::var_os("ANCHORAGE_DATA").map(std::path::PathBuf::from) else {
        eprintln!("\n*** SKIPPED: ANCHORAGE_DATA not set — the loader benchmark needs the real data files ***\n");
        return;
    };
    let d: &Path = &dir;
    bench("MNIST train (idx.gz)", 3, || Ok(mnist::load(&d.join("mnist"), Split::Train)?.len()));
    bench("MNIST test (idx.gz)", 3, || Ok(mnist::load(&d.join("mnist"), Split::Test)?.len()));
    let c10 = d.join("cifar10/data_batch_1.first4000.bin.gz");
    bench("CIFAR-10 binary (4,000 records, .gz)", 3, || Ok(cifar::read_batch(&c10, CifarKind::Cifar10)?.len()));
    let jpg = d.join("cifar10/cifar10-jpg.tar.gz");
    bench("CIFAR-10 JPEG tar.gz, train (50,000)", 2, || {
        Ok(image_folder::load(&jpg, &ImageFolderOptions::split("train"))?.len())
    });
    bench("CIFAR-10 JPEG tar.gz, test (10,000)", 2, || {
        Ok(image_folder::load(&jpg, &ImageFolderOptions::split("test"))?.len())
    });
    bench("CIFAR-10 JPEG tar.gz, list only (50,000)", 2, || {
        Ok(image_folder::list(&jpg, &ImageFolderOptions::split("train"))?.labels.len())
    });
    bench("CIFAR-10 JPEG tar.gz, test, 1 thread", 1, || {
        Ok(image_folder::load(&jpg, &ImageFolderOptions { threads: 1, ..ImageFolderOptions::split("test") })?.len())
    });
    let tiny = d.join("tiny-imagenet-100.tar.gz");
    bench("Tiny-ImageNet-100 tar.gz, val (5,000)", 2, || Ok(tiny_imagenet::load(&tiny, Split::Test)?.len()));
    bench("Tiny-ImageNet-100 tar.gz, train (50,000)", 1, || Ok(tiny_imagenet::load(&tiny, Split::Train)?.len()));
    bench("Tiny-ImageNet-100 val resized to 32x32", 1, || {
        let opts = ImageFolderOptions { resize: Some((32, 32)), ..tiny_imagenet::options(Split::Test) };
        Ok(image_folder::load(&tiny, &opts)?.len())
    });
    // Conversion and augmentation on CIFAR-sized images.
    let Ok(set) = cifar::read_batch(&c10, CifarKind::Cifar10) else { return };
    let set: ImageSet = set;
    bench("u8 -> f32 [0,1] (CIFAR 4,000)", 5, || Ok(set.to_dataset().len()));
    let ds = set.to_dataset();
    bench("normalise CIFAR-10 mean/std (4,000)", 5, || {
        let mut x = ds.clone();
        Normalization::cifar10().apply(&mut x)?;
        Ok(x.len())
    });
    bench("augment crop 4 + flip (4,000)", 5, || Ok(Augment::default().apply(&ds, 1)?.len()));
}
