use std::sync::Arc;

use anchorage_data::Dataset;
use anchorage_shared::method::FedTaConfig;
use anchorage_shared::protocol::{Broadcast, RoundConfig};
use anchorage_shared::rng::Rng;
use burn::module::Module;
use burn::tensor::Device;

use super::*;
use crate::methods::stream::TaskStream;
use anchorage_model::backbone::{InputBackbone, weights_fingerprint};
use anchorage_model::input::InputTransform;
use anchorage_model::train::OptimizerKind;
use anchorage_model::{Frozen, FrozenBackbone, MobileNetV2Config, ModelSpec, NetSpec};

fn images(n: usize, shape: [usize; 3], classes: u32, seed: u64) -> Dataset {
    let mut rng = Rng::new(seed);
    let len: usize = shape.iter().product();
    let labels: Vec<u32> = (0..n as u32).map(|i| i % classes).collect();
    // A class-dependent brightness, so there is something to learn.
    let pixels = labels.iter().flat_map(|&l| (0..len).map(|_| 0.2 * l as f32 + 0.6 * rng.f32()).collect::<Vec<_>>());
    Dataset::new(shape.to_vec(), classes, pixels.collect(), labels).unwrap()
}

fn method() -> FedTaConfig {
    FedTaConfig {
        ie_pool: 3,
        ie_length: 2,
        ie_top_n: 2,
        anchors: 4,
        anchor_dim: 4,
        temperature: 0.2,
        ..FedTaConfig::default()
    }
}

fn context(backbone: SharedBackboneArc, shape: [usize; 3], classes: u32) -> MethodContext {
    let plain = Device::flex();
    let (train, test) = (images(24, shape, classes, 1), images(12, shape, classes, 2));
    let all: Vec<u32> = (0..classes).collect();
    let stream = TaskStream::build(backbone.as_ref(), &[(all, train, test)], &plain);
    MethodContext {
        net: NetSpec {
            input_dim: backbone.feature_dim(),
            hidden: vec![],
            num_classes: classes as usize,
            seed: 5,
            residual: false,
        },
        stream,
        device: plain.autodiff(),
        optimizer: OptimizerKind::Adam,
        encoding: Encoding::F32,
        seed: 3,
        backbone: Some(InputBackbone { net: backbone, sample_shape: shape.to_vec() }),
        prototype_release: Default::default(),
    }
}

type SharedBackboneArc = anchorage_model::prompts::SharedBackbone;

fn broadcast(client: &FedTaClient, round: u64) -> Broadcast {
    Broadcast {
        round,
        task: 0,
        config: RoundConfig { local_epochs: 2, batch_size: 8, learning_rate: 0.01, deadline_ms: 0 },
        blocks: client.initial_blocks().unwrap(),
        prototypes: vec![],
    }
}

#[test]
fn stage_two_never_changes_the_ie_or_the_backbone() {
    // A MobileNetV2 (random weights; BatchNorm running statistics are part of its hash) at 32×32.
    let plain = Device::flex();
    let net = Arc::new(Frozen::new(MobileNetV2Config { alpha: 0.35 }.init(&plain), InputTransform::SymmetricUnit));
    let backbone_hash = || weights_fingerprint(&net.net);
    let h0 = backbone_hash();
    let mut client = FedTaClient::new(context(net.clone(), [3, 32, 32], 2), method()).unwrap();
    let b = broadcast(&client, 1);
    let train = client.ctx.stream.tasks[0].train.clone();
    let ie0 = client.global_ie(&b, &client.ctx.device.clone()).unwrap();
    let ie0_hash = weights_fingerprint(&ie0.valid());
    let mut rng = Rng::new(9);
    let (ie, _) = client.stage_one(ie0, &train, &[0, 1], &b, &mut rng).unwrap();
    let ie = ie.valid();
    let ie1_hash = weights_fingerprint(&ie);
    assert_ne!(ie1_hash, ie0_hash, "stage 1 trains the IE");
    assert_eq!(backbone_hash(), h0, "stage 1 reaches the input only: the backbone (and its BatchNorm statistics) stay");
    let enhanced = enhanced_cache(&ie, client.enhancer.as_ref(), &train, 2, 16).unwrap();
    let before_tail = weights_fingerprint(&client.new_tail().valid());
    let (tail, _) = client.stage_two(&enhanced, &[0, 1], None, &b, &mut rng);
    assert_ne!(weights_fingerprint(&tail.valid()), before_tail, "stage 2 trains anchors and head");
    assert_eq!(weights_fingerprint(&ie), ie1_hash, "stage 2 leaves the IE");
    assert_eq!(backbone_hash(), h0, "stage 2 leaves the backbone");
}

#[test]
fn a_round_uploads_the_ie_and_prototypes_of_the_anchored_features() {
    let plain = Device::flex();
    let spec = ModelSpec { input_dim: 3 * 8 * 8, feature_dim: 24, ..ModelSpec::embedded_default() };
    let backbone: SharedBackboneArc = Arc::new(FrozenBackbone::new(&spec, &plain));
    let mut client = FedTaClient::new(context(backbone.clone(), [3, 8, 8], 3), method()).unwrap();
    let b = broadcast(&client, 1);
    let update = client.train(&b).unwrap();
    let names: Vec<&str> = update.blocks.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(
        names,
        vec![anchorage_model::prompts::pool::KEYS, anchorage_model::prompts::pool::SETS],
        "only the IE travels"
    );
    assert_eq!(update.prototypes.len(), 3);
    let width = update.prototypes[0].values().unwrap().len();
    assert_eq!(width, 24 + 4, "prototypes of F_TA = [feature, anchor value]");
    // Each class's prototype carries its own class's anchor value (class c owns anchor c mod 4).
    let tail = client.tail.as_ref().unwrap().valid();
    let values: Vec<f32> = tail.anchors.as_ref().unwrap().values.val().into_data().try_to_vec::<f32>().unwrap();
    for p in &update.prototypes {
        let v = p.values().unwrap();
        let c = p.class as usize % 4;
        assert_eq!(&v[24..], &values[c * 4..(c + 1) * 4], "class {}", p.class);
    }
    let key_match = update.metrics.iter().find(|m| m.name == "anchor_key_match").unwrap().value;
    assert!(key_match > 0.5, "keys seated at the class means find the class's anchor (chance 1/3): {key_match}");
    assert!(update.metrics.iter().any(|m| m.name == "acc.task.0"));
    // The global model predicts with the global IE and prototypes.
    let mut next = b.clone();
    next.blocks = update.blocks.clone();
    next.prototypes = update.prototypes.clone();
    let test = client.ctx.stream.tasks[0].test.clone();
    let acc = client.global_accuracy(&next, &test).unwrap().unwrap();
    assert!((0.0..=1.0).contains(&acc));
    assert_eq!(client.global_accuracy(&b, &test).unwrap(), None, "no prototypes, no global prediction");
    // A shared tail travels as `tail.*` blocks beside the IE, and the global model uses it.
    let mut shared =
        FedTaClient::new(context(backbone.clone(), [3, 8, 8], 3), FedTaConfig { share_tail: true, ..method() })
            .unwrap();
    let b = broadcast(&shared, 1);
    let names: Vec<String> = b.blocks.iter().map(|b| b.name.clone()).collect();
    assert_eq!(
        names,
        ["ie.keys", "ie.sets", "tail.keys", "tail.values", "tail.head.weight", "tail.head.bias", "tail.trained"]
    );
    let u = shared.train(&b).unwrap();
    assert_eq!(u.blocks.iter().map(|b| b.name.clone()).collect::<Vec<_>>(), names, "the broadcast's layout");
    let counts = u.blocks.last().unwrap().decode().unwrap();
    assert_eq!(counts.iter().sum::<f32>(), 24.0, "every training sample took its class's anchor");
    assert_eq!(counts.iter().filter(|&&c| c > 0.0).count(), 3, "three classes, three anchors of four");
    let mut next = b.clone();
    next.blocks = u.blocks.clone();
    next.prototypes = u.prototypes.clone();
    let test = shared.ctx.stream.tasks[0].test.clone();
    let acc = shared.global_accuracy(&next, &test).unwrap().unwrap();
    assert!((0.0..=1.0).contains(&acc));
    // A tail block of the wrong shape is an error, not a panic.
    let mut bad = next.clone();
    let i = bad.blocks.iter().position(|b| b.name == "tail.values").unwrap();
    bad.blocks[i] = ParamBlock::encode("tail.values", &[1], &[0.0], Encoding::F32);
    assert!(shared.global_accuracy(&bad, &test).is_err());
    // Without tail anchors the prototypes are the features alone.
    let mut plain_ta =
        FedTaClient::new(context(backbone, [3, 8, 8], 3), FedTaConfig { tail_anchors: false, ..method() }).unwrap();
    let u = plain_ta.train(&broadcast(&plain_ta, 1)).unwrap();
    assert_eq!(u.prototypes[0].values().unwrap().len(), 24);
}

#[test]
fn the_device_state_survives_a_restart() {
    let plain = Device::flex();
    let spec = ModelSpec { input_dim: 3 * 8 * 8, feature_dim: 24, ..ModelSpec::embedded_default() };
    let backbone: SharedBackboneArc = Arc::new(FrozenBackbone::new(&spec, &plain));
    let mut client = FedTaClient::new(context(backbone.clone(), [3, 8, 8], 3), method()).unwrap();
    let b = broadcast(&client, 1);
    client.train(&b).unwrap();
    let state = client.device_state().unwrap();
    let names: Vec<&str> = state.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(
        names,
        ["tail.keys", "tail.values", "tail.head.weight", "tail.head.bias", "ie_head.weight", "ie_head.bias", SEATED]
    );
    assert_eq!(state.last().unwrap().decode().unwrap(), vec![0.0, 1.0, 2.0], "the three classes' keys are seated");
    // A fresh client (the device after a restart) restored from it holds the same state and
    // trains the next round exactly as the one that never stopped.
    let mut restarted = FedTaClient::new(context(backbone.clone(), [3, 8, 8], 3), method()).unwrap();
    assert_ne!(restarted.device_state().unwrap(), state);
    restarted.restore_device_state(&state).unwrap();
    assert_eq!(restarted.device_state().unwrap(), state);
    let mut next = b.clone();
    next.round = 2;
    restarted.rng = client.rng.clone();
    let (a, r) = (client.train(&next).unwrap(), restarted.train(&next).unwrap());
    assert_eq!(a.prototypes, r.prototypes, "same tail, same prototypes");
    // A state of another model is refused and changes nothing.
    let mut other =
        FedTaClient::new(context(backbone, [3, 8, 8], 3), FedTaConfig { anchor_dim: 5, ..method() }).unwrap();
    let before = other.device_state().unwrap();
    assert!(other.restore_device_state(&state).is_err());
    let mut bad = state.clone();
    *bad.last_mut().unwrap() = ParamBlock::encode(SEATED, &[1], &[9.0], Encoding::F32);
    assert!(restarted.restore_device_state(&bad).is_err(), "class 9 of 3");
    assert_eq!(other.device_state().unwrap(), before);
}

#[test]
fn a_context_without_a_backbone_or_inputs_is_an_error() {
    let plain = Device::flex();
    let spec = ModelSpec { input_dim: 3 * 8 * 8, feature_dim: 24, ..ModelSpec::embedded_default() };
    let backbone: SharedBackboneArc = Arc::new(FrozenBackbone::new(&spec, &plain));
    let mut ctx = context(backbone, [3, 8, 8], 3);
    let no_backbone = MethodContext { backbone: None, ..ctx.clone() };
    assert!(matches!(FedTaClient::new(no_backbone, method()), Err(TrainError::Model(ModelError::NoInputs))));
    for t in &mut ctx.stream.tasks {
        t.train.inputs = None;
    }
    let mut client = FedTaClient::new(ctx, method()).unwrap();
    assert!(matches!(client.train(&broadcast(&client, 1)), Err(TrainError::Model(ModelError::NoInputs))));
    // A broadcast IE of the wrong shape is an error, not a panic.
    let mut bad = broadcast(&client, 1);
    bad.blocks[1] = ParamBlock::encode("ie.sets", &[1, 1], &[0.0], Encoding::F32);
    assert!(client.train(&bad).is_err());
}

/// Under `[privacy]` a round uploads per-class sums of the anchored features, each clipped to
/// the prototype clip, with the class counts.
#[test]
fn under_privacy_a_round_uploads_clipped_sums_of_the_anchored_features() {
    let plain = Device::flex();
    let spec = ModelSpec { input_dim: 3 * 8 * 8, feature_dim: 24, ..ModelSpec::embedded_default() };
    let backbone: SharedBackboneArc = Arc::new(FrozenBackbone::new(&spec, &plain));
    let clip = 0.05;
    let ctx = MethodContext {
        prototype_release: crate::methods::protos::PrototypeRelease::ClippedSums { clip },
        ..context(backbone, [3, 8, 8], 3)
    };
    let mut client = FedTaClient::new(ctx, method()).unwrap();
    let update = client.train(&broadcast(&client, 1)).unwrap();
    assert_eq!(update.prototypes.iter().map(|p| (p.class, p.count)).collect::<Vec<_>>(), [(0, 8), (1, 8), (2, 8)]);
    for p in &update.prototypes {
        let v = p.values().unwrap();
        assert_eq!(v.len(), 24 + 4);
        let norm = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        assert!(norm <= 8.0 * clip * (1.0 + 1e-5) && norm > 0.0, "class {}: {norm}", p.class);
    }
}

/// `prediction = "head"`: the IE head travels beside the IE, the global model predicts with the
/// broadcast's averaged head over the classes that have a global prototype, and a device trains
/// on with its own head, never the broadcast's.
#[test]
fn predicting_with_the_ie_head_uploads_it_and_never_loads_the_average() {
    use anchorage_shared::method::FedTaPrediction;
    let plain = Device::flex();
    let spec = ModelSpec { input_dim: 3 * 8 * 8, feature_dim: 24, ..ModelSpec::embedded_default() };
    let backbone: SharedBackboneArc = Arc::new(FrozenBackbone::new(&spec, &plain));
    let config = FedTaConfig { prediction: FedTaPrediction::Head, ..method() };
    let mut client = FedTaClient::new(context(backbone, [3, 8, 8], 3), config).unwrap();
    let b = broadcast(&client, 1);
    let names = |blocks: &[ParamBlock]| blocks.iter().map(|b| b.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&b.blocks), ["ie.keys", "ie.sets", IE_HEAD_WEIGHT, IE_HEAD_BIAS]);
    let u = client.train(&b).unwrap();
    assert_eq!(names(&u.blocks), names(&b.blocks), "the broadcast's layout: IE, then the IE head");
    let own = client.device_state().unwrap();
    let own_weight = own.iter().find(|b| b.name == IE_HEAD_WEIGHT).unwrap().decode().unwrap();
    assert_eq!(u.blocks[2].decode().unwrap(), own_weight, "the upload is the device's trained head");

    // A head that says class 2 whatever the input, and prototypes of classes 0 and 2: the global
    // model predicts 2 for every test sample.
    let test = client.ctx.stream.tasks[0].test.clone();
    let mut next = b.clone();
    next.blocks = u.blocks.clone();
    next.blocks[2] = ParamBlock::encode(IE_HEAD_WEIGHT, &[24, 3], &[0.0; 72], Encoding::F32);
    next.blocks[3] = ParamBlock::encode(IE_HEAD_BIAS, &[3], &[0.0, 0.0, 1.0], Encoding::F32);
    next.prototypes = u.prototypes.iter().filter(|p| p.class != 1).cloned().collect();
    let share_of_2 = test.labels_host.iter().filter(|&&l| l == 2).count() as f64 / test.len() as f64;
    let acc = client.global_accuracy(&next, &test).unwrap().unwrap();
    assert!((acc - share_of_2).abs() < 1e-9, "the head decides: {acc} vs {share_of_2}");
    // Only the classes with a global prototype compete: the head's favourite, class 2, is out.
    let mut masked = next.clone();
    masked.blocks[3] = ParamBlock::encode(IE_HEAD_BIAS, &[3], &[0.0, 0.5, 1.0], Encoding::F32);
    masked.prototypes.retain(|p| p.class != 2);
    let prototypes_of = masked.prototypes.iter().map(|p| p.class).collect::<Vec<_>>();
    assert_eq!(prototypes_of, [0]);
    let acc = client.global_accuracy(&masked, &test).unwrap().unwrap();
    let share_of_0 = test.labels_host.iter().filter(|&&l| l == 0).count() as f64 / test.len() as f64;
    assert!((acc - share_of_0).abs() < 1e-9, "class 0 alone is seen: {acc} vs {share_of_0}");
    assert_eq!(client.global_accuracy(&b, &test).unwrap(), None, "no prototypes, no seen class, no prediction");

    // The next round trains from the device's own head: the broadcast's does not replace it.
    let u2 = client.train(&next).unwrap();
    let trained = client.device_state().unwrap();
    let weight = trained.iter().find(|b| b.name == IE_HEAD_WEIGHT).unwrap().decode().unwrap();
    assert!(weight.iter().any(|&w| w != 0.0), "the zero head of the broadcast was not loaded");
    assert_eq!(u2.blocks[2].decode().unwrap(), weight);
    // A head of the wrong shape is an error, not a panic.
    let mut bad = next.clone();
    bad.blocks[2] = ParamBlock::encode(IE_HEAD_WEIGHT, &[2], &[0.0, 0.0], Encoding::F32);
    assert!(client.global_accuracy(&bad, &test).is_err());
}
