//! Every method over real QUIC on loopback: 3 clients, 2 class-incremental tasks of a synthetic
//! set, 2 rounds per task. Each run must end above chance, and what reached the server must be
//! what the method shares: prototypes for the prototype methods and none for the others, no head
//! blocks from GLDP and FedRep (their personal layers never leave the device; GLDP's head ablation
//! shares an averaged head on purpose), no blocks at all
//! from Local-only, and from FedTA its input enhancement (IE) and prototypes only (its anchors and
//! heads stay on the device). What each method uploads and whether its global model is
//! evaluated come from the method registry (`shared`, `predicts_with`), so every method is held to
//! its entry.

use anchorage_shared::method::{Prediction, Shared};
use anchorage_sim::{SimConfig, SimResult};

const ROUNDS: u64 = 4;

fn config(method: &str) -> SimConfig {
    config_with(method, IID)
}

const IID: &str = r#"
[data.partition]
kind = "iid"
clients = 3
tasks = 2
"#;

/// FedTA's own split on the 4 synthetic classes: 3 clients × 2 tasks × 2 classes, all public, and
/// a server surrogate set of 5 test images per class (so SIKF runs).
const FEDTA: &str = r#"
[data.partition]
kind = "fedta"
clients = 3
tasks = 2
classes_per_task = 2
public_classes = 4
surrogate_per_class = 5
"#;

fn config_with(method: &str, partition: &str) -> SimConfig {
    let text = format!(
        r#"
clients = 3
rounds = {ROUNDS}
rounds_per_task = 2
local_epochs = 3
batch_size = 32
learning_rate = 0.003
seed = 11
[method]
name = "{method}"
[model]
backbone = "embedded"
hidden = [64]
[data]
dataset = "synthetic"
seed = 5
[data.synthetic]
classes = 4
side = 16
train_per_class = 120
test_per_class = 40
{partition}"#
    );
    toml::from_str(&text).expect("a valid SimConfig")
}

fn run(config: SimConfig) -> SimResult {
    let method = config.method.name();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(anchorage_sim::run(config)).unwrap_or_else(|e| panic!("{method}: {e:#}"))
}

/// Upload payload bytes of the adapter alone (64 × 512 + 64 f32) and of adapter + head (64 × 4 + 4).
const ADAPTER_BYTES: u64 = (64 * 512 + 64) * 4;
const HEAD_BYTES: u64 = (64 * 4 + 4) * 4;

/// What the registry says `method` uploads each round (block bytes on this test's net, and
/// whether prototypes travel): every method is held to its registry entry.
fn registered_upload(method: &str) -> (u64, bool) {
    let info = anchorage_shared::method::info(method).expect("a registered method");
    match info.shared {
        Shared::Net => (ADAPTER_BYTES + HEAD_BYTES, false),
        Shared::NetAndPrototypes => (ADAPTER_BYTES + HEAD_BYTES, true),
        Shared::Body => (ADAPTER_BYTES, false),
        Shared::BodyAndPrototypes => (ADAPTER_BYTES, true),
        Shared::PromptsAndPrototypes => (FEDTA_IE_BYTES, true),
        Shared::Nothing => (0, false),
    }
}

fn check(method: &str) {
    let (upload, prototypes) = registered_upload(method);
    check_config(config(method), prototypes, upload);
}

fn check_config(config: SimConfig, prototypes: bool, upload: u64) -> SimResult {
    let method = config.method.name();
    let selected = config.output.selected_accuracy;
    let result = run(config);
    assert_predicts_as_registered(method, &result);
    let s = &result.summary;
    assert_eq!(s.rounds.len() as u64, ROUNDS, "{method}: every round closed");
    // Chance on the two tasks' classes: the final row averages tasks of 2 classes each out of 4.
    let last = s.rounds.last().unwrap();
    assert!(last.accuracy > 0.4, "{method}: final accuracy {:.3} is not above chance (0.25)", last.accuracy);
    for r in &result.reports {
        assert_eq!(r.updates.len(), 3, "{method}: round {} aggregated all three clients", r.round);
        for u in &r.updates {
            assert_eq!(u.payload_up, upload, "{method}: {} uploaded {} block bytes", u.client, u.payload_up);
            assert_eq!(u.prototypes > 0, prototypes, "{method}: {} sent {} prototypes", u.client, u.prototypes);
            let has_acc = u.metrics.iter().any(|(n, _)| n.starts_with("acc.task."));
            assert!(has_acc, "{method}: {} reports its local accuracy per task", u.client);
        }
    }
    // The accuracy record covers both tasks after the second one.
    let seen: Vec<usize> = result.accuracy.iter().filter(|r| r.round == ROUNDS).map(|r| r.test_task).collect();
    assert!(seen.contains(&0) && seen.contains(&1), "{method}: accuracy on both tasks at the end: {seen:?}");
    // A^sel: every client's local model on the global test data of its own classes, both tasks.
    let sel: Vec<&anchorage_sim::report::AccuracyRow> =
        result.accuracy.iter().filter(|r| r.round == ROUNDS && r.model.starts_with("selected:")).collect();
    if selected {
        assert_eq!(sel.len(), 3 * 2, "{method}: A^sel rows of 3 clients × 2 tasks: {sel:?}");
        let newest = sel.iter().filter(|r| r.test_task == 1);
        assert!(newest.clone().all(|r| r.accuracy > 0.5), "{method}: A^sel on the newest task: {sel:?}");
    } else {
        assert!(sel.is_empty(), "{method}: A^sel only when asked");
    }
    result
}

/// The registry's `predicts_with`: a method with a global predictor has its global model
/// evaluated every round; one without has only its clients' models in the accuracy record.
fn assert_predicts_as_registered(method: &str, result: &SimResult) {
    let info = anchorage_shared::method::info(method).expect("a registered method");
    let global = result.accuracy.iter().filter(|r| r.model == "global").count();
    let predicts = info.predicts_with != Prediction::None;
    assert_eq!(global > 0, predicts, "{method}: {global} global accuracy rows, registry: {:?}", info.predicts_with);
    // A global net that predicts with its head is probed: the head probe is its accuracy.
    let probes = result.summary.probes;
    if info.predicts_with == Prediction::Head {
        let head = probes.head_accuracy.unwrap_or_else(|| panic!("{method}: no head probe: {probes:?}"));
        assert!((head - result.summary.final_accuracy).abs() < 1e-9, "{method}: {probes:?}");
        assert!(probes.separability.is_some_and(|s| s > 0.0), "{method}: {probes:?}");
    }
}

#[test]
fn fedavg() {
    check("fedavg");
}

#[test]
fn fedavgm() {
    check("fedavgm");
}

#[test]
fn fedprox() {
    check("fedprox");
}

#[test]
fn fedrep_keeps_its_head() {
    assert_eq!(registered_upload("fedrep"), (ADAPTER_BYTES, false));
    check("fedrep");
}

#[test]
fn local_only_shares_nothing() {
    assert_eq!(registered_upload("local"), (0, false));
    check("local");
}

#[test]
fn gldp_keeps_its_personal_layer_and_shares_prototypes() {
    assert_eq!(registered_upload("gldp"), (ADAPTER_BYTES, true));
    let mut config = config("gldp");
    config.output.selected_accuracy = true;
    let (upload, prototypes) = registered_upload("gldp");
    let result = check_config(config, prototypes, upload);
    // The global model is probed apart from its prototypes: µ's separability, and no global head.
    let probes = result.summary.probes;
    assert!(probes.separability.is_some_and(|s| s > 0.0), "{probes:?}");
    assert_eq!(probes.head_accuracy, None, "ν is personal: the global model has no head");
}

/// The head ablation: with `prediction = "head"` ν travels up too, the server averages it
/// into the global head, and the global model predicts with it (the head probe reads the same).
#[test]
fn gldp_predicting_with_its_head_shares_an_averaged_head() {
    use anchorage_shared::method::{GldpConfig, GldpPrediction, MethodConfig};
    let mut config = config("gldp");
    config.method = MethodConfig::Gldp(GldpConfig { prediction: GldpPrediction::Head, ..GldpConfig::default() });
    let result = check_config(config, true, ADAPTER_BYTES + HEAD_BYTES);
    let s = &result.summary;
    let head = s.probes.head_accuracy.expect("the global head is probed");
    assert!(
        (head - s.final_accuracy).abs() < 1e-9,
        "the global model predicts with its head: {head} vs {}",
        s.final_accuracy
    );
}

#[test]
fn fedprok_shares_weights_and_prototypes() {
    check("fedprok");
}

/// Evolving domains (FedEvolve's protocol): the synthetic set in 3 rotated domains (0°, 15°,
/// 30°), the first two the sources every round, the last the unseen target.
const DOMAINS: &str = r#"
[data.partition]
kind = "domains"
clients = 3
domains = 3
step_degrees = 15.0
train_fraction = 0.8
"#;

/// FedEvolve and FedEvp on evolving domains: every round aggregates the three clients, each
/// uploads the shared maps and its prototypes, reports its own target accuracy, and the global
/// model ends above chance on the target.
fn check_evolving(method: &str, upload: u64) {
    let mut config = config_with(method, DOMAINS);
    config.data.evolving = true;
    let result = run(config);
    assert_predicts_as_registered(method, &result);
    assert!(registered_upload(method).1, "{method}: the registry says prototypes travel");
    let s = &result.summary;
    assert_eq!(s.rounds.len() as u64, ROUNDS, "{method}: every round closed");
    let last = s.rounds.last().unwrap();
    eprintln!("{method}: target {:.3}", last.accuracy);
    assert!(last.accuracy > 0.4, "{method}: target accuracy {:.3} is not above chance (0.25)", last.accuracy);
    for r in &result.reports {
        assert_eq!(r.updates.len(), 3, "{method}: round {} aggregated all three clients", r.round);
        for u in &r.updates {
            assert_eq!(u.payload_up, upload, "{method}: {} uploaded {} block bytes", u.client, u.payload_up);
            assert_eq!(u.prototypes, 4, "{method}: {} sent one prototype per class", u.client);
            assert!(
                u.metrics.iter().any(|(n, _)| n == "acc.target"),
                "{method}: {} reports its target accuracy",
                u.client
            );
        }
    }
}

/// `target_domains = 2` of 4 rotated domains: the clients train on the first two only and the
/// target is the last two together (twice the samples of one domain).
#[test]
fn an_evolving_target_can_hold_out_several_domains() {
    let samples = |domains: usize, targets: usize| {
        let mut config = config_with("fedavg", &DOMAINS.replace("domains = 3", &format!("domains = {domains}")));
        config.data.evolving = true;
        config.data.target_domains = targets;
        config.federation.rounds = 1;
        let result = run(config);
        let u = &result.reports[0].updates;
        let tasks: Vec<usize> = result.accuracy.iter().map(|r| r.test_task).collect();
        assert!(tasks.iter().all(|&k| k == domains - 1), "the target is named by the last domain: {tasks:?}");
        u.iter().map(|u| u.num_samples).sum::<u64>()
    };
    let (one, two) = (samples(4, 1), samples(4, 2));
    assert!(one > 0 && two > 0);
    // 3 source domains against 2, each about a quarter of the data.
    let ratio = one as f64 / two as f64;
    assert!((ratio - 1.5).abs() < 0.1, "source samples {one} (1 target) vs {two} (2 targets)");
}

#[test]
fn fedevolve_shares_both_maps_and_the_last_domains_prototypes() {
    check_evolving("fedevolve", 2 * ADAPTER_BYTES);
}

#[test]
fn fedevp_shares_weights_and_prototypes() {
    check("fedevp");
    check_evolving("fedevp", registered_upload("fedevp").0);
}

/// FedTA's IE with the defaults on the embedded backbone (512 features) and 1×16×16 images:
/// 10 keys of 512 and 10 pixel prompts (a 10-pixel frame, capped at half the side: the whole
/// 256-pixel image).
const FEDTA_IE_BYTES: u64 = (10 * 512 + 10 * 256) * 4;

#[test]
fn fedta_shares_its_input_enhancement_and_prototypes_only() {
    let (upload, prototypes) = registered_upload("fedta");
    check_config(config_with("fedta", FEDTA), prototypes, upload);
}

/// With `prediction = "head"` the stage-1 IE head (512 features → 4 classes) travels beside the
/// IE, and the global model predicts with the average (the authors' global evaluation).
#[test]
fn fedta_predicting_with_its_ie_head_uploads_it() {
    let mut config = config_with("fedta", FEDTA);
    let anchorage_shared::method::MethodConfig::FedTa(fedta) = &mut config.method else { panic!("fedta") };
    fedta.prediction = anchorage_shared::method::FedTaPrediction::Head;
    check_config(config, true, FEDTA_IE_BYTES + (512 * 4 + 4) * 4);
}

/// With `share_tail` the anchors and head travel beside the IE: 100 anchors (keys of 512, values
/// of 64), the head on F_TA (512 + 64 → 4 classes), and the 100 anchors' training counts.
const FEDTA_TAIL_BYTES: u64 = (100 * 512 + 100 * 64 + (512 + 64) * 4 + 4 + 100) * 4;

#[test]
fn fedta_with_a_shared_tail_uploads_it_beside_the_ie() {
    let mut config = config_with("fedta", FEDTA);
    let anchorage_shared::method::MethodConfig::FedTa(fedta) = &mut config.method else { panic!("fedta") };
    fedta.share_tail = true;
    check_config(config, true, FEDTA_IE_BYTES + FEDTA_TAIL_BYTES);
}
