//! The validation split (`[data] validation` and `evaluate_on`): held-out training
//! samples no client trains on, which a run is evaluated on instead of the test split when
//! choices are made. On generated data always; on MNIST's files when `ANCHORAGE_DATA` is set.

mod common;

use anchorage_data::{DataSpec, EvaluateOn, build_split, label_pools, load};

fn spec(extra: &str) -> DataSpec {
    toml::from_str(&format!(
        "dataset = \"synthetic\"\nseed = 3\n{extra}\n[synthetic]\nclasses = 4\nside = 8\ntrain_per_class = 50\ntest_per_class = 10\n\
         [partition]\nkind = \"iid\"\nclients = 2\n"
    ))
    .unwrap()
}

#[test]
fn the_validation_split_is_held_out_of_training_per_class() {
    let plain = label_pools(&spec(""), None).unwrap();
    let held = label_pools(&spec("validation = 0.2"), None).unwrap();
    let on_validation = label_pools(&spec("validation = 0.2\nevaluate_on = \"validation\""), None).unwrap();
    // Clients train on the same rows whichever split the run is evaluated on.
    assert_eq!(held.train_kept, on_validation.train_kept);
    assert_eq!(held.test_kept, plain.test_kept, "evaluated on the test split, the test pool is unchanged");
    assert!(!held.test_in_train && on_validation.test_in_train);
    // Validation: 20 % of each class, out of the training rows, and together they are all of them.
    let validation = &on_validation.test_kept;
    assert_eq!(validation.len(), 4 * 10);
    for c in 0..4 {
        assert_eq!(on_validation.test.iter().filter(|l| **l == c).count(), 10, "class {c}");
    }
    assert!(validation.iter().all(|v| !held.train_kept.contains(v)), "no validation row is trained on");
    let mut all: Vec<usize> = held.train_kept.iter().chain(validation).copied().collect();
    all.sort_unstable();
    assert_eq!(all, plain.train_kept);
    // The split's clients hold training rows only; its global test rows are the validation rows.
    let split = build_split(&spec("validation = 0.2\nevaluate_on = \"validation\""), &on_validation).unwrap();
    let trained: usize = split.clients.iter().flat_map(|c| &c.tasks).map(|t| t.train.len()).sum();
    assert_eq!(trained, held.train_kept.len());
    // The loaded "test" samples are the generated training samples at those rows.
    let everything = load(&spec(""), None).unwrap();
    let loaded = load(&spec("validation = 0.2\nevaluate_on = \"validation\""), None).unwrap();
    assert_eq!(loaded.test, everything.train.subset(validation));
    assert_eq!(loaded.train, everything.train.subset(&held.train_kept));
}

#[test]
fn a_validation_run_needs_a_split_and_evolving_shifts_take_no_fraction() {
    let error = label_pools(&spec("evaluate_on = \"validation\""), None).unwrap_err().to_string();
    assert!(error.contains("validation"), "{error}");
    let error = label_pools(&spec("validation = 1.0"), None).unwrap_err().to_string();
    assert!(error.contains("[0, 1)"), "{error}");
    let domains: DataSpec = toml::from_str(
        "dataset = \"synthetic\"\nvalidation = 0.1\n[partition]\nkind = \"domains\"\nclients = 2\ndomains = 3\n",
    )
    .unwrap();
    let error = label_pools(&domains, None).unwrap_err().to_string();
    assert!(error.contains("last source domain"), "{error}");
    assert_eq!(spec("").evaluate_on, EvaluateOn::Test);
    // A spec without the keys writes none (run folders of earlier configurations read the same).
    let text = toml::to_string(&spec("")).unwrap();
    assert!(!text.contains("validation") && !text.contains("evaluate_on"), "{text}");
}

#[test]
fn mnist_validation_images_are_training_images() {
    let Some(dir) = common::data_dir("mnist_validation_images_are_training_images") else { return };
    let spec = |extra: &str| -> DataSpec {
        toml::from_str(&format!(
            "dataset = \"mnist\"\nscale = 0.02\nseed = 1\n{extra}\n[partition]\nkind = \"iid\"\nclients = 2\n"
        ))
        .unwrap()
    };
    let pools = label_pools(&spec("validation = 0.1\nevaluate_on = \"validation\""), Some(&dir)).unwrap();
    let everything = load(&spec(""), Some(&dir)).unwrap();
    let plain = label_pools(&spec(""), Some(&dir)).unwrap();
    let loaded = load(&spec("validation = 0.1\nevaluate_on = \"validation\""), Some(&dir)).unwrap();
    // Row i of the scaled training pool is full-pool index plain.train_kept[i].
    let position = |full: usize| plain.train_kept.iter().position(|k| *k == full).unwrap();
    let rows: Vec<usize> = pools.test_kept.iter().map(|&v| position(v)).collect();
    assert_eq!(loaded.test, everything.train.subset(&rows));
    assert_eq!(loaded.test.len(), pools.test_kept.len());
    assert!(loaded.test.len() >= 100, "10 % of 2 % of MNIST's 60,000: {}", loaded.test.len());
}
