//! `anchorage data describe` as a user runs it: with a data folder it reads the image files a run
//! would load, so a truncated file is an error naming the file; the CSV goes to `runs/`.

use std::path::Path;
use std::process::{Command, Output};

/// Runs `anchorage` in `dir`, without the environment's data folder or log filter.
fn anchorage(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_anchorage"))
        .args(args)
        .current_dir(dir)
        .env_remove("ANCHORAGE_DATA")
        .env_remove("ANCHORAGE_LOG")
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A tiny MNIST in `dir/mnist/` (the data crate's fixture writer).
fn write_tiny_mnist(dir: &Path, n: u32) {
    anchorage_data::loaders::mnist::write_tiny(dir, n).unwrap();
}

#[test]
fn describe_reads_the_images_and_names_a_truncated_file() {
    let work = tempfile::tempdir().unwrap();
    let data = tempfile::tempdir().unwrap();
    write_tiny_mnist(data.path(), 20);
    std::fs::write(
        work.path().join("tiny-mnist.toml"),
        "[data]\ndataset = \"mnist\"\n[data.partition]\nkind = \"iid\"\nclients = 2\n",
    )
    .unwrap();
    let data_dir = data.path().to_str().unwrap();
    let args = ["data", "describe", "tiny-mnist.toml", "--data-dir", data_dir];

    // Intact: described, the images read, the CSV under runs/ (quoted fields parse back).
    let run = anchorage(work.path(), &args);
    let (stdout, stderr) = (text(&run.stdout), text(&run.stderr));
    assert!(run.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("files      20 train + 20 test images (1×4×4) read and decoded"), "{stdout}");
    assert!(stdout.contains("csv: runs/tiny-mnist.describe.csv"), "{stdout}");
    let mut csv = csv::Reader::from_path(work.path().join("runs/tiny-mnist.describe.csv")).unwrap();
    assert_eq!(csv.headers().unwrap().iter().take(3).collect::<Vec<_>>(), ["client", "task", "train"]);
    let rows: Vec<csv::StringRecord> = csv.records().map(Result::unwrap).collect();
    assert_eq!(rows.len(), 2, "2 clients × 1 task");
    let train: usize = rows.iter().map(|r| r[2].parse::<usize>().unwrap()).sum();
    assert_eq!(train, 20);
    assert_eq!(rows[0][9].split_whitespace().count(), 10, "all 10 classes in the task");
    assert!(!work.path().join("tiny-mnist.describe.csv").exists(), "nothing in the current folder itself");

    // Truncated image file: the labels are intact, so only reading the images finds it.
    let images = data.path().join("mnist/train-images-idx3-ubyte");
    let bytes = std::fs::read(&images).unwrap();
    std::fs::write(&images, &bytes[..bytes.len() - 50]).unwrap();
    let run = anchorage(work.path(), &args);
    let stderr = text(&run.stderr);
    assert!(!run.status.success(), "a truncated image file passed describe: {}", text(&run.stdout));
    assert!(stderr.contains(&images.display().to_string()), "{stderr}");
    assert!(stderr.contains("286 bytes, expected 336 bytes"), "{stderr}");

    // An explicit --csv path is used as given.
    std::fs::write(&images, &bytes).unwrap();
    let run = anchorage(work.path(), &[&args[..], &["--csv", "mine.csv"]].concat());
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert!(text(&run.stdout).contains("csv: mine.csv"));
    assert!(work.path().join("mine.csv").is_file());
}
