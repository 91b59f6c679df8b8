//! Provisioning end to end, the way an operator does it: `anchorage provision project.toml`
//! writes the site folders; the server process starts from its folder's `server.toml`, each
//! device from its folder's `client.toml`, and they federate over real QUIC with mutual TLS.
//! Nothing is configured by hand in between.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anchorage_client::config::ClientConfig;

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Copies the site folder `from` to `to` (what the operator does with scp or a USB stick).
fn copy_site(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// Kills the server if the test fails before it exits on its own.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_provisioned_project_runs_from_its_folders() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_udp_port();
    let project = dir.path().join("project.toml");
    std::fs::write(
        &project,
        format!(
            r#"
name = "provision-e2e"
days = 30
method = "fedavg"

[server]
address = "127.0.0.1:{port}"
bind = "127.0.0.1:{port}"
names = ["localhost"]

[engine]
rounds = 2
min_available = 2
min_fit = 2
fraction = 1.0
over_selection = 0.0
round_deadline = 60000

[engine.round]
local_epochs = 1
batch_size = 32
learning_rate = 0.001
deadline_ms = 0

[client.connection]
keep_alive_ms = 500

[[devices]]
id = "edge-001"

[[devices]]
id = "edge-002"
"#
        ),
    )
    .unwrap();
    let done = anchorage::provision::provision(&project, None).unwrap();
    let sites = dir.path().join("sites");
    assert_eq!(done.out, sites);

    // Each folder goes to "its machine": a different place than where it was written.
    let field = dir.path().join("field");
    for site in ["server", "edge-001", "edge-002"] {
        copy_site(&sites.join(site), &field.join(site));
    }

    // The server, started from another working directory: its paths come from server.toml's folder.
    let log_path = dir.path().join("server.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_server-process"))
        .arg("--config")
        .arg(field.join("server/server.toml"))
        .current_dir("/")
        .env("ANCHORAGE_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("the server process starts");
    let mut server = Running(child);
    let log_text = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let cap = Instant::now() + Duration::from_secs(30);
    while !log_text().contains("listening") {
        assert!(server.0.try_wait().unwrap().is_none(), "the server exited: {}", log_text());
        assert!(Instant::now() < cap, "the server listens within 30 s: {}", log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!log_text().contains("insecure_dev"), "mutual TLS, not the development mode");

    // The devices, each from its client.toml, through the same code path as `anchorage-client`.
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let reasons = runtime.block_on(async {
        let mut handles = Vec::new();
        for device in ["edge-001", "edge-002"] {
            let config = ClientConfig::load(&field.join(device).join("client.toml")).unwrap();
            assert_eq!(config.client_id, device);
            handles.push(tokio::spawn(anchorage_client::runner::run(config, None)));
        }
        let mut reasons = Vec::new();
        for h in handles {
            let reason = tokio::time::timeout(Duration::from_secs(240), h)
                .await
                .unwrap_or_else(|_| panic!("the devices finish 2 rounds within 240 s: {}", log_text()))
                .unwrap()
                .unwrap();
            reasons.push(reason);
        }
        reasons
    });
    println!("devices finished: {reasons:?}");

    // The server stops by itself after its last round.
    let cap = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = server.0.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < cap, "the server exits after its last round: {}", log_text());
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}: {}", log_text());

    // What the server stored, read-only, from the state folder next to its server.toml.
    let db_path: PathBuf = field.join("server/state").join(anchorage_server::store::DB_FILE);
    let db = rusqlite::Connection::open_with_flags(&db_path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let aggregated: i64 =
        db.query_row("SELECT COUNT(*) FROM rounds WHERE status = 'aggregated'", [], |r| r.get(0)).unwrap();
    assert_eq!(aggregated, 2, "both rounds closed: {}", log_text());
    let mut per_round = db
        .prepare("SELECT round, group_concat(client) FROM (SELECT round, client FROM updates ORDER BY client) GROUP BY round ORDER BY round")
        .unwrap();
    let rows: Vec<(i64, String)> =
        per_round.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap().map(Result::unwrap).collect();
    assert_eq!(rows, [(1, "edge-001,edge-002".to_string()), (2, "edge-001,edge-002".to_string())]);

    // The ids the server knows are the ones in the devices' certificates.
    let mut clients = db.prepare("SELECT id FROM clients ORDER BY id").unwrap();
    let clients: Vec<String> = clients.query_map([], |r| r.get(0)).unwrap().map(Result::unwrap).collect();
    let from_certs: Vec<String> = ["edge-001", "edge-002"]
        .iter()
        .map(|site| {
            let cert = std::fs::read(field.join(site).join("cert.der")).unwrap();
            anchorage_pki::peer_id(&cert.into()).unwrap().0
        })
        .collect();
    assert_eq!(clients, from_certs, "the stored ids are the certificates'");
}
