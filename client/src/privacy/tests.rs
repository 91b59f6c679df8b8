use anchorage_data::Dataset;
use anchorage_model::{Identity, NetSpec};
use anchorage_shared::MetricKey;
use anchorage_shared::method::MethodConfig;
use anchorage_shared::privacy::mechanism::l2_norm;
use anchorage_shared::privacy::{default_orders, noise_multiplier_for};
use anchorage_shared::protocol::{Metric, RoundConfig};
use burn::tensor::Device;

use super::*;
use crate::methods::protos::from_wire;
use crate::methods::{MethodContext, Reveal, TaskStream};

/// A method that uploads the given blocks and prototypes, with one metric.
#[derive(Clone)]
struct Fixed {
    blocks: Vec<ParamBlock>,
    prototypes: Vec<Prototype>,
}

impl ClientMethod for Fixed {
    fn name(&self) -> &'static str {
        "fixed"
    }
    fn num_samples(&self) -> u64 {
        7
    }
    fn train(&mut self, _: &Broadcast) -> Result<Trained, TrainError> {
        Ok(Trained {
            prototypes_are: Default::default(),
            num_samples: 7,
            blocks: self.blocks.clone(),
            prototypes: self.prototypes.clone(),
            metrics: vec![Metric::new(MetricKey::TrainLoss, 0.5)],
        })
    }
    fn global_accuracy(&self, _: &Broadcast, _: &FeatureCache) -> Result<Option<f64>, TrainError> {
        Ok(None)
    }
    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
        Ok(Vec::new())
    }
}

fn broadcast(blocks: Vec<ParamBlock>) -> Broadcast {
    Broadcast {
        round: 1,
        task: 0,
        config: RoundConfig { local_epochs: 1, batch_size: 16, learning_rate: 0.01, deadline_ms: 0 },
        blocks,
        prototypes: Vec::new(),
    }
}

fn device(noise: NoiseSite, sigma: Option<f64>, clip: f64, prototype_clip: f64) -> DevicePrivacy {
    DevicePrivacy { noise, clip, prototype_clip, noise_multiplier: sigma }
}

fn marker(update: &Trained) -> Option<f64> {
    (update.prototypes_are == PrototypeForm::Sums).then_some(1.0)
}

fn bytes(update: &Trained) -> Vec<u8> {
    postcard::to_allocvec(&update.clone().into_update(1, std::time::Duration::ZERO)).unwrap()
}

/// Three classes around 3·e_c in 4 dimensions, `domains` domains each shifted a little.
fn tasks(domains: usize) -> Vec<(Vec<u32>, Dataset, Dataset)> {
    let mut rng = Rng::new(11);
    let mut make = |n: usize, shift: f32| {
        let labels: Vec<u32> = (0..n as u32).map(|i| i % 3).collect();
        let features = labels
            .iter()
            .flat_map(|&l| {
                (0..4)
                    .map(|j| if j == l as usize { 3.0 } else { 0.0 } + shift + rng.normal() as f32)
                    .collect::<Vec<_>>()
            })
            .collect();
        Dataset::new(vec![4], 3, features, labels).unwrap()
    };
    (0..domains).map(|m| (vec![0, 1, 2], make(30, 0.5 * m as f32), make(9, 0.5 * m as f32))).collect()
}

fn context(release: PrototypeRelease, domains: usize) -> MethodContext {
    let plain = Device::flex();
    let mut stream = TaskStream::build(&Identity { dim: 4 }, &tasks(domains), &plain);
    stream.reveal = Reveal::All;
    let net = NetSpec { input_dim: 4, hidden: vec![8], num_classes: 3, seed: 5, residual: false };
    MethodContext { prototype_release: release, ..MethodContext::for_tests(net, stream) }
}

fn prototype_methods() -> Vec<MethodConfig> {
    vec![
        MethodConfig::Gldp(Default::default()),
        MethodConfig::FedProK(Default::default()),
        MethodConfig::FedEvolve(Default::default()),
        MethodConfig::FedEvp(Default::default()),
    ]
}

/// One round of `method` on two domains under `release`.
fn one_round(method: &MethodConfig, release: PrototypeRelease) -> Trained {
    let mut client = crate::methods::build(method, context(release, 2)).unwrap();
    let b = broadcast(client.initial_blocks().unwrap());
    client.train(&b).unwrap()
}

/// Off: no wrapper, and a method's update is byte for byte the method's own.
#[test]
fn off_leaves_the_update_byte_identical() {
    let blocks = vec![ParamBlock::encode("w", &[3], &[0.5, -1.0, 2.0], Encoding::F16)];
    let prototypes = vec![Prototype::encode(1, 4, &[0.25, 0.75], Encoding::F32)];
    let fixed = Fixed { blocks: blocks.clone(), prototypes };
    let b = broadcast(blocks);
    let mut plain = fixed.clone();
    let mut wrapped = wrap(Box::new(fixed), DevicePrivacy::for_device(&PrivacyConfig::default()).unwrap(), Rng::new(1));
    let (u, w) = (plain.train(&b).unwrap(), wrapped.train(&b).unwrap());
    assert_eq!(bytes(&u), bytes(&w));
    assert_eq!(marker(&w), None, "no marker when off");
    // A real method built twice, once through `wrap` with privacy off: the same blocks and
    // prototypes, byte for byte (the process's peak memory may differ between the two runs).
    let gldp = MethodConfig::Gldp(Default::default());
    let a = one_round(&gldp, PrototypeRelease::Means);
    let mut client =
        wrap(crate::methods::build(&gldp, context(PrototypeRelease::Means, 2)).unwrap(), None, Rng::new(2));
    let c = client.train(&broadcast(client.initial_blocks().unwrap())).unwrap();
    assert_eq!(postcard::to_allocvec(&a.blocks).unwrap(), postcard::to_allocvec(&c.blocks).unwrap());
    assert_eq!(postcard::to_allocvec(&a.prototypes).unwrap(), postcard::to_allocvec(&c.prototypes).unwrap());
    assert_eq!(marker(&c), None);
}

/// The marker is there iff privacy is on; central noise changes nothing else the device sends.
#[test]
fn the_marker_is_present_iff_privacy_is_on() {
    let blocks = vec![ParamBlock::encode("w", &[2], &[1.0, 2.0], Encoding::F32)];
    let fixed = Fixed { blocks: blocks.clone(), prototypes: vec![Prototype::encode(0, 3, &[0.1, 0.2], Encoding::F32)] };
    let b = broadcast(vec![ParamBlock::encode("w", &[2], &[0.0, 0.0], Encoding::F32)]);
    let plain = Fixed::clone(&fixed).train(&b).unwrap();
    let mut central = Privatized::new(fixed.clone(), device(NoiseSite::Central, None, 0.1, 1.0), Rng::new(1));
    let u = central.train(&b).unwrap();
    assert_eq!(marker(&u), Some(1.0));
    assert_eq!((&u.blocks, &u.prototypes), (&plain.blocks, &plain.prototypes), "the server clips and noises");
    assert_eq!(u.metrics, plain.metrics, "the form is a field, not a metric");
    let mut local = Privatized::new(fixed, device(NoiseSite::Local, Some(1.0), 0.1, 1.0), Rng::new(1));
    let u = local.train(&b).unwrap();
    assert_eq!(marker(&u), Some(1.0));
    assert!(u.metrics.iter().all(|m| m.key() != MetricKey::PrototypeSums));
    assert_eq!(MetricKey::PrototypeSums.name(), "prototype_sums");
}

/// Local noise: N(0, (σ·clip)²) on every delta value, N(0, (σ·prototype_clip)²) on every sum
/// coordinate and N(0, σ²) on every count (rounded), measured over many values.
#[test]
fn local_noise_has_the_configured_spread() {
    let n = 20_000;
    let base: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.1).collect();
    let half = n / 2;
    let blocks = vec![
        ParamBlock::encode("a", &[half as u32], &base[..half], Encoding::F32),
        ParamBlock::encode("b", &[half as u32], &base[half..], Encoding::F32),
    ];
    let prototypes: Vec<Prototype> = (0..2000).map(|c| Prototype::encode(c, 100, &[0.0; 10], Encoding::F32)).collect();
    let b = broadcast(blocks.clone());
    let (sigma, clip, prototype_clip) = (2.0, 0.5, 0.25);
    let mut m = Privatized::new(
        Fixed { blocks, prototypes },
        device(NoiseSite::Local, Some(sigma), clip, prototype_clip),
        Rng::new(7),
    );
    let u = m.train(&b).unwrap();
    let std = |values: &[f64]| (values.iter().map(|v| v * v).sum::<f64>() / values.len() as f64).sqrt();
    let delta: Vec<f64> =
        u.blocks.iter().flat_map(|b| b.decode().unwrap()).zip(&base).map(|(t, b)| (t - b) as f64).collect();
    assert!((std(&delta) - sigma * clip).abs() < 0.03, "delta std {}", std(&delta));
    let sums: Vec<f64> = u.prototypes.iter().flat_map(|p| p.values().unwrap()).map(f64::from).collect();
    assert!((std(&sums) - sigma * prototype_clip).abs() < 0.02, "sum std {}", std(&sums));
    let counts: Vec<f64> = u.prototypes.iter().map(|p| p.count as f64 - 100.0).collect();
    assert!((std(&counts) - sigma).abs() < 0.15, "count std {}", std(&counts));
    assert!(counts.iter().all(|c| c.fract() == 0.0), "counts stay whole");
    // The same seed gives the same noise (a simulated device), another seed other noise.
    let again = |seed| {
        let fixed =
            Fixed { blocks: b.blocks.clone(), prototypes: vec![Prototype::encode(0, 5, &[0.0; 4], Encoding::F32)] };
        Privatized::new(fixed, device(NoiseSite::Local, Some(1.0), 1.0, 1.0), Rng::new(seed)).train(&b).unwrap()
    };
    assert_eq!(bytes(&again(3)), bytes(&again(3)));
    assert_ne!(bytes(&again(3)), bytes(&again(4)));
}

/// Local noise clips the delta of all blocks together to `clip` before the noise, keeps each
/// block's dense layout, and noises FedTA's `tail.trained` counts as counts.
#[test]
fn the_local_delta_is_clipped_as_one_vector() {
    let broadcast_blocks = vec![
        ParamBlock::encode("a", &[2], &[1.0, 1.0], Encoding::F32),
        ParamBlock::encode("b", &[1], &[-1.0], Encoding::F32),
        ParamBlock::encode(TAIL_TRAINED, &[3], &[50.0, 0.0, 9.0], Encoding::F32),
    ];
    let trained = vec![
        ParamBlock::encode("a", &[2], &[4.0, 1.0], Encoding::F16),
        ParamBlock::encode("b", &[1], &[3.0], Encoding::F32),
        ParamBlock::encode(TAIL_TRAINED, &[3], &[4.0, 0.0, 2.0], Encoding::F32),
    ];
    let b = broadcast(broadcast_blocks);
    let fixed = Fixed { blocks: trained, prototypes: Vec::new() };
    let u = Privatized::new(fixed, device(NoiseSite::Local, Some(1e-9), 1.0, 1.0), Rng::new(1)).train(&b).unwrap();
    assert_eq!(u.blocks[0].tensor.encoding, Encoding::F16, "the layout stays");
    let a = u.blocks[0].decode().unwrap();
    let bb = u.blocks[1].decode().unwrap();
    // Δ = (3, 0, 4), norm 5, clipped to 1: (0.6, 0, 0.8).
    let delta = [a[0] - 1.0, a[1] - 1.0, bb[0] + 1.0];
    assert!((l2_norm([&delta[..]]) - 1.0).abs() < 2e-3, "{delta:?}");
    assert!((delta[0] - 0.6).abs() < 2e-3 && delta[1].abs() < 2e-3 && (delta[2] - 0.8).abs() < 1e-6, "{delta:?}");
    assert_eq!(u.blocks[2].decode().unwrap(), vec![4.0, 0.0, 2.0], "counts, not a delta from the global total");
    let loud = Fixed { blocks: b.blocks.clone(), prototypes: Vec::new() };
    let u = Privatized::new(loud, device(NoiseSite::Local, Some(3.0), 1.0, 1.0), Rng::new(1)).train(&b).unwrap();
    assert!(u.blocks[2].decode().unwrap().iter().all(|c| *c >= 0.0 && c.fract() == 0.0));
}

/// Every prototype method uploads sums of clipped features under privacy: each class's sum has
/// norm at most count · prototype_clip, and with a clip nothing reaches, sum / count is the mean
/// it uploads with privacy off (FedEvp: its evolving prototype, equal here as every domain holds
/// each class equally often).
#[test]
fn every_prototype_method_uploads_clipped_sums() {
    for method in prototype_methods() {
        let name = method.name();
        let means = from_wire(&one_round(&method, PrototypeRelease::Means).prototypes).unwrap();
        let wide = from_wire(&one_round(&method, PrototypeRelease::ClippedSums { clip: 1e9 }).prototypes).unwrap();
        assert_eq!(means.len(), 3, "{name}");
        assert_eq!(wide.iter().map(|s| s.class).collect::<Vec<_>>(), [0, 1, 2], "{name}");
        for (s, m) in wide.iter().zip(&means) {
            assert!(s.count >= m.count, "{name}");
            for (x, y) in s.vector.iter().zip(&m.vector) {
                assert!(
                    (x / s.count as f32 - y).abs() < 1e-3 * (1.0 + y.abs()),
                    "{name} class {}: {x} / {} against {y}",
                    s.class,
                    s.count
                );
            }
        }
        let clip = 0.05;
        let tight = from_wire(&one_round(&method, PrototypeRelease::ClippedSums { clip }).prototypes).unwrap();
        for s in &tight {
            let norm = l2_norm([s.vector.as_slice()]);
            assert!(
                norm <= s.count as f64 * clip * (1.0 + 1e-5),
                "{name} class {}: {norm} > {} · {clip}",
                s.class,
                s.count
            );
        }
    }
}

/// client.toml: local noise without noise_multiplier is refused, naming it; the simulator
/// derives σ from its rounds (q = 1); central noise gives the device no σ.
#[test]
fn a_device_needs_sigma_for_local_noise() {
    let local = PrivacyConfig { noise: NoiseSite::Local, target_epsilon: Some(4.0), ..PrivacyConfig::default() };
    let e = format!("{:#}", DevicePrivacy::for_device(&local).unwrap_err());
    assert!(e.contains("noise_multiplier") && e.contains("local"), "{e}");
    let sim = DevicePrivacy::for_simulation(&local, 20, false).unwrap().unwrap();
    let expected = noise_multiplier_for(4.0, 1e-5, 1.0, 20, &default_orders()).unwrap();
    assert_eq!(sim.noise_multiplier, Some(expected));
    assert!(expected > 1.0, "20 full releases at ε = 4 need σ above 1: {expected}");
    let with_prototypes = DevicePrivacy::for_simulation(&local, 20, true).unwrap().unwrap().noise_multiplier.unwrap();
    assert!(
        with_prototypes > expected,
        "prototype sums are a second release each round: {with_prototypes} > {expected}"
    );
    let given = PrivacyConfig { noise_multiplier: Some(1.5), ..local.clone() };
    assert_eq!(DevicePrivacy::for_device(&given).unwrap().unwrap().noise_multiplier, Some(1.5));
    assert_eq!(DevicePrivacy::for_simulation(&given, 20, false).unwrap().unwrap().noise_multiplier, Some(1.5));
    let central = PrivacyConfig { noise: NoiseSite::Central, ..local };
    let c = DevicePrivacy::for_device(&central).unwrap().unwrap();
    assert_eq!((c.noise_multiplier, c.prototype_release()), (None, PrototypeRelease::ClippedSums { clip: 1.0 }));
    assert!(DevicePrivacy::for_device(&PrivacyConfig::default()).unwrap().is_none());
    let bad = PrivacyConfig { prototype_clip: -1.0, ..central };
    assert!(format!("{:#}", DevicePrivacy::for_device(&bad).unwrap_err()).contains("prototype_clip"));
    // A device in the field seeds its noise from the operating system.
    assert_ne!(system_rng().unwrap().next_u64(), system_rng().unwrap().next_u64());
}
