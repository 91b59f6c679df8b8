//! Every `scenarios/*.toml` at the repository root: its `[data]` table parses into a [`DataSpec`]
//! and `describe` runs on it — on the real files when `ANCHORAGE_DATA` is set and holds the
//! dataset, else on generated / stand-in labels (said loudly on stderr).

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};

use anchorage_data::{DataError, DataSpec, describe};

fn scenario_files() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scenarios");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    v.sort();
    v
}

fn data_spec(path: &PathBuf) -> DataSpec {
    let text = std::fs::read_to_string(path).unwrap();
    let doc: toml::Table = toml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let data = doc.get("data").unwrap_or_else(|| panic!("{}: no [data] table", path.display())).clone();
    data.try_into().unwrap_or_else(|e| panic!("{}: [data]: {e}", path.display()))
}

#[test]
fn every_scenario_parses_and_describes() {
    let files = scenario_files();
    let names: Vec<String> = files.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    for want in [
        "gldp_spatial.toml",
        "gldp_spatiotemporal.toml",
        "fedta_tiny_imagenet.toml",
        "fedprok_sync.toml",
        "fedprok_async.toml",
        "fedevolve_circle.toml",
        "fedevolve_rotated_mnist.toml",
    ] {
        assert!(names.iter().any(|n| n == want), "missing scenario {want}");
    }
    let data_dir = common::data_dir_or_stand_in("every_scenario_parses_and_describes");
    for path in &files {
        let spec = data_spec(path);
        let d = match describe(&spec, data_dir.as_deref()) {
            Err(DataError::NotFound { .. }) if data_dir.is_some() => {
                let line = format!(
                    "\n*** {}: {} not under ANCHORAGE_DATA — described on stand-in labels instead ***\n",
                    path.display(),
                    spec.dataset.name()
                );
                let _ = std::io::stderr().write_all(line.as_bytes());
                describe(&spec, None).unwrap()
            }
            other => other.unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        };
        eprintln!("== {} ==\n{d}", path.display());
        assert!(d.summary.clients > 0 && d.summary.train_samples > 0, "{}", path.display());
        let csv = d.to_csv();
        let mut reader = csv::Reader::from_reader(csv.as_bytes());
        assert_eq!(reader.headers().unwrap().len(), 11);
        let records: Vec<csv::StringRecord> = reader.records().map(Result::unwrap).collect();
        assert_eq!(records.len(), d.rows.len(), "{}", path.display());
        for (record, row) in records.iter().zip(&d.rows) {
            assert_eq!(record.len(), 11, "{}", path.display());
            assert_eq!(record[2].parse::<usize>().unwrap(), row.train);
            let classes: Vec<u32> = record[9].split_whitespace().map(|c| c.parse().unwrap()).collect();
            assert_eq!(classes, row.classes, "{}", path.display());
        }
        // The same spec describes to the same partition.
        let again = describe(&spec, None).unwrap();
        assert_eq!(again.fingerprint, describe(&spec, None).unwrap().fingerprint);
    }
}

#[test]
fn scaled_specs_and_bad_specs() {
    let spec: DataSpec = toml::from_str(
        r#"
        dataset = "cifar10"
        scale = 0.1
        seed = 3
        [partition]
        kind = "dirichlet"
        clients = 5
        alpha = 0.3
        tasks = 2
        "#,
    )
    .unwrap();
    let d = describe(&spec, None).unwrap();
    // `scale` is the training data's; the test set stays whole unless `test_scale` says otherwise.
    assert_eq!((d.train_pool, d.test_pool), (5000, 10000));
    let halved = DataSpec { test_scale: Some(0.5), ..spec.clone() };
    assert_eq!(describe(&halved, None).unwrap().test_pool, 5000);
    assert_eq!(d.summary.train_samples, 5000);
    assert_eq!(d.summary.tasks, 2);
    assert!(d.source.contains("stand-in"));
    // Unknown keys and bad values are errors, not silently ignored.
    assert!(
        toml::from_str::<DataSpec>("dataset = \"cifar10\"\nscael = 0.1\n[partition]\nkind = \"iid\"\nclients = 2")
            .is_err()
    );
    assert!(
        toml::from_str::<DataSpec>(
            "dataset = \"cifar10\"\n[partition]\nkind = \"gldp\"\nclients = 2\nclasses_per_clent = 2"
        )
        .is_err()
    );
    assert!(toml::from_str::<DataSpec>("dataset = \"imagenet\"\n[partition]\nkind = \"iid\"\nclients = 2").is_err());
    let bad: DataSpec =
        toml::from_str("dataset = \"mnist\"\nscale = 0\n[partition]\nkind = \"iid\"\nclients = 2").unwrap();
    assert!(matches!(describe(&bad, None), Err(DataError::Spec(_))));
}

#[test]
fn stand_in_labels_match_the_real_files() {
    let Some(dir) = common::data_dir("stand_in_labels_match_the_real_files") else { return };
    for dataset in ["mnist", "cifar10", "tiny-imagenet-100"] {
        let spec: DataSpec = toml::from_str(&format!(
            "dataset = \"{dataset}\"\n[partition]\nkind = \"dirichlet\"\nclients = 4\nalpha = 0.5\n"
        ))
        .unwrap();
        let real = anchorage_data::label_pools(&spec, Some(&dir)).unwrap();
        let stand = anchorage_data::label_pools(&spec, None).unwrap();
        let hist = |l: &[u32]| {
            let mut h = vec![0usize; real.num_classes as usize];
            l.iter().for_each(|&x| h[x as usize] += 1);
            h
        };
        assert_eq!(hist(&real.train), hist(&stand.train), "{dataset} train class counts");
        assert_eq!(hist(&real.test), hist(&stand.test), "{dataset} test class counts");
    }
}

#[test]
fn load_matches_the_label_pools() {
    // Synthetic, rotated domains: sample shapes kept, domain k rotated by 90°·k.
    let spec: DataSpec = toml::from_str(
        "dataset = \"synthetic\"\nscale = 0.5\n[partition]\nkind = \"domains\"\nclients = 2\ndomains = 3\nstep_degrees = 90.0\n",
    )
    .unwrap();
    let pools = anchorage_data::label_pools(&spec, None).unwrap();
    let data = anchorage_data::load(&spec, None).unwrap();
    assert_eq!(data.train.labels, pools.train);
    assert_eq!(data.test.labels, pools.test);
    let dom = data.domain_of.as_ref().unwrap();
    assert_eq!(dom.len(), data.train.len());
    let plain = anchorage_data::load(
        &DataSpec { partition: anchorage_data::PartitionSpec::Iid { clients: 2, tasks: 1 }, ..spec.clone() },
        None,
    )
    .unwrap();
    for (i, &d) in dom.iter().enumerate() {
        assert_eq!(data.train.sample(i) == plain.train.sample(i), d == 0, "sample {i} in domain {d}");
    }
    // A brightness drift: domain k scaled by 1 − 0.25·k, the same rows otherwise.
    let darkening = |step: f32| -> DataSpec {
        let partition = format!("kind = \"domains\"\nclients = 2\ndomains = 3\ndarken_step = {step}\n");
        toml::from_str(&format!("dataset = \"synthetic\"\nscale = 0.5\n[partition]\n{partition}")).unwrap()
    };
    let dark = darkening(0.25);
    let darkened = anchorage_data::load(&dark, None).unwrap();
    assert_eq!(darkened.domain_of, data.domain_of, "the same domains as the rotated spec");
    for (i, &d) in dom.iter().enumerate() {
        let factor = 1.0 - 0.25 * d as f32;
        let want: Vec<f32> = plain.train.sample(i).iter().map(|v| v * factor).collect();
        assert_eq!(darkened.train.sample(i), want.as_slice(), "sample {i} in domain {d}");
    }
    assert!(dom.contains(&2), "the last domain is darkened too");
    // A step that would black out (or invert) the last domain is refused, as is darkening points.
    assert!(
        matches!(anchorage_data::load(&darkening(0.5), None), Err(DataError::Spec(m)) if m.contains("darken_step"))
    );
    let points: DataSpec = toml::from_str(
        "dataset = \"circle\"\nscale = 0.1\n[partition]\nkind = \"domains\"\nclients = 3\ndarken_step = 0.01\n",
    )
    .unwrap();
    assert!(matches!(anchorage_data::load(&points, None), Err(DataError::Spec(m)) if m.contains("not images")));
    // Circle: 2-D points, 30 domains.
    let spec: DataSpec =
        toml::from_str("dataset = \"circle\"\nscale = 0.1\n[partition]\nkind = \"domains\"\nclients = 3\n").unwrap();
    let data = anchorage_data::load(&spec, None).unwrap();
    assert_eq!((data.train.len(), data.train.sample_shape.clone()), (3000, vec![2]));
    let split = anchorage_data::build_split(&spec, &anchorage_data::label_pools(&spec, None).unwrap()).unwrap();
    assert_eq!(split.num_tasks(), 30);
    // `circle = "kind"` takes a kind's defaults; a table's `kind` picks the defaults its keys override.
    let base = "dataset = \"circle\"\nscale = 0.1\n";
    let part = "[partition]\nkind = \"domains\"\nclients = 3\n";
    let spec: DataSpec = toml::from_str(&format!("{base}circle = \"concept\"\n{part}")).unwrap();
    let concept = spec.circle.clone().unwrap();
    assert_eq!(concept, anchorage_data::circle::CircleConfig::of_kind(anchorage_data::circle::CircleKind::Concept));
    let data = anchorage_data::load(&spec, None).unwrap();
    assert!(data.train.features.iter().all(|v| (0.0..1.0).contains(v)), "concept points lie in the unit square");
    let spec: DataSpec = toml::from_str(&format!("{base}{part}[circle]\nkind = \"cida\"\nper_domain = 100\n")).unwrap();
    let cida = spec.circle.unwrap();
    assert_eq!((cida.mean_radius, cida.std, cida.per_domain), (5.0, 0.5, 100));
    let bad = toml::from_str::<DataSpec>(&format!("{base}circle = \"spiral\"\n{part}"));
    assert!(bad.is_err(), "an unknown kind is refused");
    // Real MNIST at 1 % when the files are there.
    let Some(dir) = common::data_dir("load_matches_the_label_pools (MNIST part)") else { return };
    let spec: DataSpec =
        toml::from_str("dataset = \"mnist\"\nscale = 0.01\n[partition]\nkind = \"iid\"\nclients = 2\n").unwrap();
    let data = anchorage_data::load(&spec, Some(&dir)).unwrap();
    // round(1 % of each class): 599 of 60,000; the test set whole (10,000) as `test_scale` is unset.
    assert_eq!((data.train.len(), data.test.len()), (599, 10000));
    assert_eq!(data.train.sample_shape, vec![1, 28, 28]);
    assert_eq!(data.train.labels, anchorage_data::label_pools(&spec, Some(&dir)).unwrap().train);
}

/// A tiny MNIST in `dir/mnist/` (the data crate's fixture writer).
fn write_tiny_mnist(dir: &Path, n: u32) {
    anchorage_data::loaders::mnist::write_tiny(dir, n).unwrap();
}

#[test]
fn describe_reads_the_image_files_as_a_run_would() {
    let base = common::scratch("describe-files");
    write_tiny_mnist(&base, 40);
    let spec: DataSpec = toml::from_str("dataset = \"mnist\"\n[partition]\nkind = \"iid\"\nclients = 2\n").unwrap();
    let d = describe(&spec, Some(&base)).unwrap();
    assert_eq!(d.files, Some(anchorage_data::FilesChecked { train: 40, test: 40, sample_shape: vec![1, 4, 4] }));
    assert!(d.to_string().contains("files      40 train + 40 test images (1×4×4) read and decoded"), "{d}");
    // The labels alone are intact, so only reading the images finds a truncated image file.
    let images = base.join("mnist/train-images-idx3-ubyte");
    let bytes = std::fs::read(&images).unwrap();
    std::fs::write(&images, &bytes[..bytes.len() - 100]).unwrap();
    assert!(anchorage_data::label_pools(&spec, Some(&base)).is_ok());
    let e = describe(&spec, Some(&base)).unwrap_err();
    assert!(matches!(e, DataError::BadLength { ref path, expected: 656, found: 556, .. } if *path == images), "{e}");
    let shown = e.to_string();
    assert!(shown.contains(&images.display().to_string()) && shown.contains("556 bytes, expected 656"), "{shown}");
    // A test split with fewer images than labels.
    std::fs::write(&images, &bytes).unwrap();
    let test_images = base.join("mnist/t10k-images-idx3-ubyte");
    let pixels: Vec<u8> = vec![0; 39 * 16];
    std::fs::write(
        &test_images,
        anchorage_data::loaders::mnist::idx_file(anchorage_data::loaders::mnist::IMAGES_MAGIC, &[39, 4, 4], &pixels),
    )
    .unwrap();
    let e = describe(&spec, Some(&base)).unwrap_err();
    assert!(matches!(e, DataError::CountMismatch { images: 39, labels: 40, .. }), "{e}");
    assert!(e.to_string().contains(&test_images.display().to_string()), "{e}");
    // Without a data directory nothing is read (stand-in labels).
    assert_eq!(describe(&spec, None).unwrap().files, None);
    let _ = std::fs::remove_dir_all(&base);
}
