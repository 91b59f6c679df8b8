//! The standalone server's SIKF (FedTA Eq. 8): `server.toml`'s `[sikf]` section, the frozen
//! MobileNetV2 0.35 from `$ANCHORAGE_DATA/weights` and the surrogate set of the FedTA split of
//! Tiny-ImageNet-100 from `$ANCHORAGE_DATA`. Skipped loudly without `ANCHORAGE_DATA`.

use anchorage_model::prompts::enhancer_for;
use anchorage_model::prompts::pool::{IeShape, InputEnhancement};
use anchorage_model::{InputBackbone, zoo};
use anchorage_server::config::ServerConfig;
use anchorage_server::methods::InputDistiller;
use anchorage_shared::tensor::Encoding;
use anchorage_tests::{data_dir, fedta_data_table};
use burn::tensor::Device;

#[test]
fn the_server_distils_on_the_surrogate_set_its_config_names() {
    let Some(dir) = data_dir() else { return };
    // The scenario's own [data] table at a small scale, one surrogate image per class.
    let data = fedta_data_table("sikf.data");
    let text = format!(
        "bind = \"127.0.0.1:0\"\nstate_dir = \"s\"\ntls_dir = \"t\"\n\
         [method]\nname = \"fedta\"\nie_pool = 4\nie_top_n = 2\n\
         [sikf]\nbackbone = \"mobilenet_v2\"\ndata_dir = {dir:?}\nbatch_size = 16\n{data}"
    );
    let config = ServerConfig::parse(&text).unwrap();
    let anchorage_shared::method::MethodConfig::FedTa(method) = config.method.config().unwrap() else {
        panic!("fedta")
    };
    let mut sikf = anchorage_server::sikf::distiller(config.sikf.as_ref().unwrap(), &method).unwrap();
    eprintln!("surrogate set: {} images", sikf.len());
    assert!(sikf.len() >= 50, "about one test image per class of 100: {}", sikf.len());

    // Three clients' IE pools of this backbone: the student and two teachers whose sets differ.
    let plain = Device::flex();
    let backbone = InputBackbone {
        net: zoo::load("mobilenet_v2", 3 * 64 * 64, Some(&dir), &plain).unwrap().into(),
        sample_shape: vec![3, 64, 64],
    };
    let enhancer = enhancer_for(&method, &backbone);
    let shape = IeShape::for_method(&method, enhancer.as_ref());
    let pool = |std: f64, seed: u64| InputEnhancement::new(&shape, std, seed, &plain).to_blocks(Encoding::F32).unwrap();
    let (student, t1, t2) = (pool(0.0, 1), pool(0.5, 2), pool(0.5, 3));
    let before = sikf.loss(&student, &[&t1, &t2]).unwrap();
    let out = InputDistiller::distill(&mut sikf, &student, &[&t1, &t2], 3, 1e-2).unwrap();
    let after = sikf.loss(&out.blocks, &[&t1, &t2]).unwrap();
    eprintln!("SIKF loss {before:.5} → {after:.5}; per epoch {:?}", out.losses);
    assert_eq!(out.losses.len(), 3);
    assert!(after < before, "distillation lowers Eq. 8 on the surrogate set: {before} → {after}");
    let names = |b: &[anchorage_shared::tensor::ParamBlock]| b.iter().map(|b| b.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&out.blocks), names(&student), "the student's blocks, same names");
}
