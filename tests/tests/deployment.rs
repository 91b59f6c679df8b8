//! A FedTA deployment from its config files, over real QUIC on loopback: `server.toml` with a
//! `[method]` table and a `[sikf]` section, and two devices' `client.toml` with their shares of
//! the scenario's FedTA split of Tiny-ImageNet-100, on the real frozen MobileNetV2 0.35 from
//! `$ANCHORAGE_DATA/weights`. Skipped loudly without `ANCHORAGE_DATA`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anchorage_client::config::ClientConfig;
use anchorage_client::methods::{self, ClientMethod};
use anchorage_client::share::scenario_context;
use anchorage_client::transport::{self as client, ClientOptions};
use anchorage_server::config::ServerConfig;
use anchorage_server::methods::{Distilled, FedTaServer, InputDistiller};
use anchorage_server::transport::{self as server, ServerEvent, ServerOptions};
use anchorage_shared::tensor::ParamBlock;
use anchorage_tests::{data_dir, fedta_data_table};
use burn::tensor::Device;

/// The real distiller, counted (the test has no other window into the server's method).
struct Counted {
    inner: anchorage_model::prompts::fusion::Sikf,
    calls: Arc<AtomicUsize>,
}

impl InputDistiller for Counted {
    fn distill(
        &mut self,
        student: &[ParamBlock],
        teachers: &[&[ParamBlock]],
        epochs: u32,
        learning_rate: f32,
    ) -> Result<Distilled, String> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        InputDistiller::distill(&mut self.inner, student, teachers, epochs, learning_rate)
    }
}

const METHOD: &str = "[method]\nname = \"fedta\"\nie_pool = 4\nie_top_n = 2\nanchors = 100\nanchor_dim = 16\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fedta_deployment_runs_from_its_config_files() {
    let Some(dir) = data_dir() else { return };
    let state = std::env::temp_dir().join(format!("anchorage-deploy-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state);
    let server_toml = format!(
        "bind = \"127.0.0.1:0\"\nstate_dir = {:?}\ntls_dir = {:?}\n\
         [engine]\nrounds = 2\nrounds_per_task = 2\nmin_available = 2\nmin_fit = 2\n\
         [engine.round]\nlocal_epochs = 1\nbatch_size = 16\nlearning_rate = 0.001\ndeadline_ms = 0\n\
         {METHOD}[sikf]\nbackbone = \"mobilenet_v2\"\ndata_dir = {dir:?}\n{}",
        state.join("server"),
        state.join("tls"),
        fedta_data_table("sikf.data"),
    );
    let config = ServerConfig::parse(&server_toml).unwrap();
    let anchorage_shared::method::MethodConfig::FedTa(method) = config.method.config().unwrap() else {
        panic!("fedta")
    };
    let calls = Arc::new(AtomicUsize::new(0));
    let sikf = anchorage_server::sikf::distiller(config.sikf.as_ref().unwrap(), &method).unwrap();
    // The devices first: their method's own model is the server's initial model (its layout is
    // the operator's, never an update's).
    let mut devices = Vec::new();
    for device in 0..2usize {
        let client_toml = format!(
            "server = \"127.0.0.1:1\"\nserver_cert = \"unused\"\nclient_id = \"jetson-{device}\"\nstate_dir = {:?}\n\
             {METHOD}[data]\nsource = \"scenario\"\ndata_dir = {dir:?}\nclient = {device}\nbackbone = \"mobilenet_v2\"\n{}",
            state.join(format!("client-{device}")),
            fedta_data_table("data.spec"),
        );
        let config: ClientConfig = toml::from_str(&client_toml).unwrap();
        let context = scenario_context(&config, &Device::flex()).unwrap();
        assert_eq!(context.stream.tasks.len(), 5, "five tasks on each device");
        assert!(context.stream.tasks.iter().all(|t| t.classes.len() == 8), "eight classes a task");
        assert_eq!(context.net.input_dim, 1280, "MobileNetV2 0.35 features");
        let method = methods::build(&config.method, context).unwrap();
        devices.push((config, method));
    }
    let initial = devices[0].1.initial_blocks().unwrap();
    let identity = anchorage_pki::identity::self_signed(&["localhost"]).unwrap();
    let mut srv = server::start(ServerOptions {
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        identity: identity.clone(),
        trust: anchorage_server::tls::Trust::InsecureDev,
        engine: config.engine.clone(),
        method: Box::new(FedTaServer::new(method, Some(Box::new(Counted { inner: sikf, calls: calls.clone() })))),
        initial,
        limits: config.limits.clone(),
        store: None,
    })
    .await
    .unwrap();

    let mut handles = Vec::new();
    for (config, method) in devices {
        let mut options = ClientOptions::new(srv.local_addr, identity.cert.clone(), config.client_id.clone());
        options.store = Some(anchorage_client::store::ClientStore::new(&config.state_dir));
        handles.push(tokio::spawn(client::run(options, method, None)));
    }

    let mut reports = Vec::new();
    while let Some(ServerEvent::RoundClosed { report, .. }) =
        tokio::time::timeout(Duration::from_secs(300), srv.events.recv()).await.expect("the federation progresses")
    {
        reports.push((*report).clone());
    }
    for h in handles {
        h.await.unwrap().unwrap();
    }
    srv.shutdown().await.unwrap();

    assert_eq!(reports.len(), 2);
    for r in &reports {
        assert_eq!(r.updates.len(), 2, "round {}: both devices aggregated", r.round);
        for u in &r.updates {
            assert!(
                u.prototypes > 0 && u.prototypes <= 8,
                "{}: prototypes of its task's classes: {}",
                u.client,
                u.prototypes
            );
            assert!(u.payload_up > 0);
        }
    }
    // Round 1 distils (SIKF); round 2 is the task's last round, which averages.
    assert_eq!(calls.load(Ordering::SeqCst), 1, "SIKF ran once, in round 1");
    // Each device kept its anchors and heads on disk.
    for device in 0..2 {
        let store = anchorage_client::store::ClientStore::new(state.join(format!("client-{device}")));
        let kept = store.load_device_state().unwrap().expect("device state saved");
        assert!(kept.iter().any(|b| b.name == "tail.values"));
    }
    let _ = std::fs::remove_dir_all(&state);
}
