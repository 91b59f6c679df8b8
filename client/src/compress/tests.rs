use anchorage_shared::Packed;
use anchorage_shared::protocol::RoundConfig;

use super::*;

/// A method that uploads the given values of one block `w` and keeps `state` on the device.
struct Fixed {
    values: Vec<Vec<f32>>,
    state: Vec<ParamBlock>,
}

impl ClientMethod for Fixed {
    fn name(&self) -> &'static str {
        "fixed"
    }
    fn num_samples(&self) -> u64 {
        1
    }
    fn train(&mut self, _: &Broadcast) -> Result<Trained, TrainError> {
        let values = self.values.remove(0);
        Ok(Trained {
            prototypes_are: Default::default(),
            num_samples: 1,
            blocks: vec![ParamBlock::encode("w", &[values.len() as u32], &values, Encoding::F32)],
            prototypes: Vec::new(),
            metrics: Vec::new(),
        })
    }
    fn global_accuracy(&self, _: &Broadcast, _: &FeatureCache) -> Result<Option<f64>, TrainError> {
        Ok(None)
    }
    fn initial_blocks(&self) -> Result<Vec<ParamBlock>, TrainError> {
        Ok(Vec::new())
    }
    fn device_state(&self) -> Result<Vec<ParamBlock>, TrainError> {
        Ok(self.state.clone())
    }
    fn restore_device_state(&mut self, blocks: &[ParamBlock]) -> Result<(), TrainError> {
        self.state = blocks.to_vec();
        Ok(())
    }
}

fn broadcast(round: u64, global: &[f32]) -> Broadcast {
    Broadcast {
        round,
        task: 0,
        config: RoundConfig { local_epochs: 1, batch_size: 1, learning_rate: 0.1, deadline_ms: 1000 },
        blocks: vec![ParamBlock::encode("w", &[global.len() as u32], global, Encoding::F32)],
        prototypes: Vec::new(),
    }
}

fn top_k(fraction: f64, values: Encoding) -> UpdateCompression {
    UpdateCompression::new(Some(fraction), None, values).unwrap()
}

/// What the server decodes: the update's block against the broadcast's.
fn received(update: &Trained, b: &Broadcast) -> Vec<f32> {
    update.blocks[0].decode_against(&b.blocks[0].decode().unwrap()).unwrap()
}

#[test]
fn top_k_sends_the_largest_entries_and_keeps_the_rest() {
    let global = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0];
    let trained = vec![1.5, 1.0, 0.0, 1.1, 1.0, 1.0, 1.0, 1.2];
    let mut m = Compressed::new(Fixed { values: vec![trained], state: Vec::new() }, top_k(0.25, Encoding::F32));
    let b = broadcast(1, &global);
    let u = m.train(&b).unwrap();
    assert_eq!(u.blocks[0].tensor.encoding, Encoding::TopK { k: 2, values: Dense::F32 });
    assert_eq!(received(&u, &b), vec![1.5, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
    let e = m.residual("w").unwrap();
    assert!((e[3] - 0.1).abs() < 1e-6 && (e[7] - 0.2).abs() < 1e-6 && e[0] == 0.0 && e[2] == 0.0, "{e:?}");
}

/// Stich et al.'s memory: what was sent over the rounds plus the residual is the sum of the
/// deltas trained, so nothing selected out is lost.
#[test]
fn error_feedback_loses_nothing_over_rounds() {
    let global = vec![0.0; 16];
    let rounds: Vec<Vec<f32>> =
        (0..5).map(|r| (0..16).map(|i| ((i * 7 + r * 3) % 11) as f32 * 0.01).collect()).collect();
    let mut m = Compressed::new(
        Fixed { values: rounds.clone(), state: Vec::new() },
        top_k(0.125, Encoding::Int8 { scale: 0.0 }),
    );
    let mut sent = vec![0.0f32; 16];
    for r in 0..5 {
        let b = broadcast(r + 1, &global);
        let u = m.train(&b).unwrap();
        assert!(matches!(u.blocks[0].tensor.encoding, Encoding::TopK { k: 2, values: Dense::Int8 { .. } }));
        received(&u, &b).iter().zip(&mut sent).for_each(|(v, s)| *s += v);
    }
    let e = m.residual("w").unwrap();
    for i in 0..16 {
        let trained: f32 = rounds.iter().map(|r| r[i]).sum();
        assert!((sent[i] + e[i] - trained).abs() < 1e-5, "entry {i}: sent {} + e {} vs {trained}", sent[i], e[i]);
    }
}

#[test]
fn the_residual_survives_a_restart() {
    let global = vec![0.0; 8];
    let rounds = vec![vec![0.5, 0.1, 0.2, 0.0, 0.3, 0.0, 0.0, 0.0], vec![0.0; 8]];
    let config = top_k(0.125, Encoding::F32);
    let mut before = Compressed::new(Fixed { values: rounds.clone(), state: Vec::new() }, config);
    before.train(&broadcast(1, &global)).unwrap();
    let saved = before.device_state().unwrap();
    assert_eq!(saved.len(), 1);
    assert_eq!(saved[0].name, "ef/w");
    // Through the store's file, as the client saves it after every round.
    let dir = tempfile::tempdir().unwrap();
    let store = crate::store::ClientStore::new(dir.path());
    store.save_device_state(&saved).unwrap();
    let mut after = Compressed::new(Fixed { values: rounds[1..].to_vec(), state: Vec::new() }, config);
    after.restore_device_state(&store.load_device_state().unwrap().unwrap()).unwrap();
    assert_eq!(after.residual("w"), before.residual("w"));
    // Round 2 trains no change: the largest remembered entry (0.3 at index 4) goes out now.
    let b = broadcast(2, &global);
    let (u_after, u_before) = (after.train(&b).unwrap(), before.train(&b).unwrap());
    assert_eq!(u_after, u_before);
    assert_eq!(received(&u_after, &b), vec![0.0, 0.0, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0]);
}

#[test]
fn the_inner_state_passes_through_and_an_old_residual_is_dropped_when_top_k_is_off() {
    let own = ParamBlock::encode("tail.values", &[1], &[2.0], Encoding::F32);
    let residual = ParamBlock::encode("ef/w", &[2], &[0.5, 0.5], Encoding::F32);
    let off = UpdateCompression::new(None, None, Encoding::F32).unwrap();
    let mut m = Compressed::new(Fixed { values: Vec::new(), state: Vec::new() }, off);
    m.restore_device_state(&[own.clone(), residual]).unwrap();
    assert_eq!(m.inner.state, vec![own.clone()]);
    assert_eq!(m.residual("w"), None);
    assert_eq!(m.device_state().unwrap(), vec![own]);
}

#[test]
fn zstd_packs_the_blocks_and_the_server_reads_the_same_values() {
    let global = vec![0.25; 2048];
    let trained: Vec<f32> = (0..2048).map(|i| 0.25 + ((i % 9) as f32) * 0.5).collect();
    let zstd = UpdateCompression::new(None, Some(Compressor::Zstd), Encoding::F16).unwrap();
    let mut m = Compressed::new(Fixed { values: vec![trained.clone()], state: Vec::new() }, zstd);
    let b = broadcast(1, &global);
    let u = m.train(&b).unwrap();
    assert_eq!(u.blocks[0].tensor.encoding, Encoding::Zstd { inner: Packed::Dense(Dense::F32) });
    assert!(u.blocks[0].payload_bytes() < 2048 * 4 / 10);
    assert_eq!(received(&u, &b), trained);
    assert!(m.residual("w").is_none(), "no top-k, no residual");
}

#[test]
fn top_k_and_zstd_combine() {
    let global = vec![0.0; 4096];
    let trained: Vec<f32> = (0..4096).map(|i| if i % 64 == 0 { 1.0 + i as f32 } else { 1e-4 }).collect();
    let both = UpdateCompression::new(Some(1.0 / 64.0), Some(Compressor::Zstd), Encoding::F32).unwrap();
    let mut m = Compressed::new(Fixed { values: vec![trained.clone()], state: Vec::new() }, both);
    let b = broadcast(1, &global);
    let u = m.train(&b).unwrap();
    assert_eq!(u.blocks[0].tensor.encoding, Encoding::Zstd { inner: Packed::TopK { k: 64, values: Dense::F32 } });
    assert!(u.blocks[0].payload_bytes() < 64 * 8);
    let got = received(&u, &b);
    assert!((0..4096).all(|i| if i % 64 == 0 { got[i] == trained[i] } else { got[i] == 0.0 }));
}

#[test]
fn a_fraction_outside_zero_to_one_is_refused() {
    for bad in [0.0, -0.1, 1.5, f64::NAN] {
        assert!(UpdateCompression::new(Some(bad), None, Encoding::F32).is_err(), "{bad}");
    }
    assert!(UpdateCompression::new(None, None, Encoding::F16).unwrap().is_off());
}

#[test]
fn the_registry_lists_every_option_and_none_is_on_by_default() {
    use crate::encoding::UploadEncoding;
    use anchorage_shared::method::encodings::{ENCODINGS, names_of};
    for name in names_of("compress") {
        assert_eq!(<Compressor as clap::ValueEnum>::from_str(name, false).unwrap().name(), name);
    }
    for e in [UploadEncoding::F32, UploadEncoding::F16, UploadEncoding::Bf16, UploadEncoding::Int8] {
        assert!(names_of("encoding").any(|n| n == e.name()), "{e}");
    }
    assert_eq!(names_of("top_k").collect::<Vec<_>>(), ["top-k"]);
    assert!(ENCODINGS.iter().filter(|e| e.key != "encoding").all(|e| !e.default));
}

#[test]
fn client_toml_sets_them_and_a_default_config_writes_neither() {
    let base = "server = \"127.0.0.1:4433\"\nserver_cert = \"ca.der\"\nclient_id = \"d\"\nstate_dir = \"s\"\n\
                [data]\nsource = \"synthetic\"\nseed = 1\nclients = 2\nindex = 0\nalpha = 1.0\n";
    let plain: crate::config::ClientConfig = toml::from_str(base).unwrap();
    assert!(plain.update_compression().unwrap().is_off());
    let text = toml::to_string(&plain).unwrap();
    assert!(!text.contains("top_k") && !text.contains("compress"), "{text}");
    let on: crate::config::ClientConfig =
        toml::from_str(&format!("top_k = 0.01\ncompress = \"zstd\"\n{base}")).unwrap();
    let c = on.update_compression().unwrap();
    assert_eq!((c.top_k, c.compress), (Some(0.01), Some(Compressor::Zstd)));
    let bad: crate::config::ClientConfig = toml::from_str(&format!("top_k = 2.0\n{base}")).unwrap();
    assert!(bad.validate().is_err());
}
