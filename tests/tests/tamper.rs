//! A state folder rolled back under a running federation, over real QUIC on loopback.
//!
//! Two FedAvg devices train with a server whose folder is backed up at round 2 (`backup`: one
//! snapshot, the database at the moment of the call) and then runs on. The backup holds round
//! 2's model, and it is put back in place behind the server's back:
//! - with the folder's generation witness still there, the store refuses to open;
//! - with the witness gone too (the whole folder restored from an old snapshot), the server
//!   starts, but the devices' hellos name rounds it never announced: it opens no round, and
//!   `anchorage_rounds_halted` says why;
//! - after `accept-rollback` the federation resumes from the backup's model, and the next round
//!   is numbered above every round the devices saw: no number is used twice.

use std::net::SocketAddr;
use std::time::Duration;

use anchorage_client::methods::ClientMethod;
use anchorage_client::transport::{self as client, ClientOptions};
use anchorage_pki::Identity;
use anchorage_server::engine::EngineConfig;
use anchorage_server::methods::FedAvg;
use anchorage_server::store::{DB_FILE, SHM_FILE, ServerStore, StoreError, WAL_FILE, WITNESS_FILE};
use anchorage_server::tls;
use anchorage_server::transport::{self as server, Limits, ServerEvent, ServerHandle, ServerOptions};
use anchorage_shared::protocol::RoundConfig;
use anchorage_tests::fedavg_client;

async fn start(identity: &Identity, bind: SocketAddr, rounds: u64, store: &ServerStore) -> ServerHandle {
    start_for(identity, bind, rounds, 2, store).await
}

/// A FedAvg server that opens each round for `devices` devices and closes it when all have
/// sent their update.
async fn start_for(
    identity: &Identity,
    bind: SocketAddr,
    rounds: u64,
    devices: usize,
    store: &ServerStore,
) -> ServerHandle {
    server::start(ServerOptions {
        bind,
        identity: identity.clone(),
        trust: tls::Trust::InsecureDev,
        engine: EngineConfig {
            rounds,
            min_available: devices,
            min_fit: devices,
            round_deadline: Duration::from_secs(30),
            round: RoundConfig { local_epochs: 1, batch_size: 32, learning_rate: 1e-3, deadline_ms: 0 },
            ..EngineConfig::default()
        },
        method: Box::new(FedAvg::default()),
        initial: fedavg_client(0).initial_blocks().unwrap(),
        limits: Limits::default(),
        store: Some(store.clone()),
    })
    .await
    .expect("server starts")
}

/// Waits for the round `round` to close; returns the rounds that closed meanwhile.
async fn until_round(server: &mut ServerHandle, round: u64) -> Vec<u64> {
    let mut closed = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(60), server.events.recv()).await.expect("rounds close") {
            Some(ServerEvent::RoundClosed { report, .. }) => {
                closed.push(report.round);
                if report.round >= round {
                    return closed;
                }
            }
            Some(ServerEvent::Finished) | None => return closed,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_folder_is_refused_then_witnessed_by_the_devices_and_numbers_are_never_reused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    let backup = tmp.path().join("round-2.db");
    let identity = anchorage_pki::identity::self_signed(&["localhost"]).unwrap();

    let store = ServerStore::open(&dir).unwrap();
    let mut first = start(&identity, SocketAddr::from(([127, 0, 0, 1], 0)), 100, &store).await;
    let addr = first.local_addr;
    let devices: Vec<_> = (0..2)
        .map(|i| {
            tokio::spawn(client::run(
                ClientOptions::new(addr, identity.cert.clone(), format!("edge-{i}")),
                Box::new(fedavg_client(1 + i)),
                None,
            ))
        })
        .collect();
    until_round(&mut first, 2).await;
    // What the store had committed just before the call and when it returned. The backup's
    // snapshot lies in between, at the start of the call: round 3 may have opened and taken an
    // update by then, not closed (it waits for two trainings).
    let (asked_round, asked) = (store.newest_version().unwrap(), store.stored_witness().unwrap());
    let copy = ServerStore::backup(&dir, &backup).expect("an online backup");
    let returned = store.stored_witness().unwrap();
    println!("{copy}\nasked at round {asked_round:?} ({asked}); {returned} when it returned");
    assert!(copy.ok(), "{copy}");
    assert_eq!(asked_round, Some(2));
    assert_eq!(copy.round, Some(2), "the backup holds round 2's model: {copy}");
    assert!(asked <= copy.generation && copy.generation <= returned, "the generation asked for: {copy}");
    let closed = until_round(&mut first, 6).await;
    println!("first run closed rounds {closed:?}; backup taken at round 2");
    first.shutdown().await.unwrap();
    drop(store);

    // The backup file on its own opens as a store of round 2's model and generation.
    let alone = tmp.path().join("backup-alone");
    std::fs::create_dir(&alone).unwrap();
    std::fs::copy(&backup, alone.join(DB_FILE)).unwrap();
    let read = ServerStore::open(&alone).unwrap();
    assert_eq!(read.recover("fedavg").unwrap().unwrap().checkpoint.round, 2, "the backup's model");
    assert_eq!(read.stored_witness().unwrap(), copy.generation);
    drop(read);

    // The database file replaced by the round-2 copy: the folder's witness refuses it.
    std::fs::copy(&backup, dir.join(DB_FILE)).unwrap();
    for f in [WAL_FILE, SHM_FILE] {
        let _ = std::fs::remove_file(dir.join(f));
    }
    let err = ServerStore::open(&dir).expect_err("the witness is ahead");
    println!("{err}");
    assert!(matches!(err, StoreError::RolledBack { .. }), "{err:?}");

    // The whole folder restored (no witness either): the server starts, and the devices' hellos
    // tell it what it forgot.
    std::fs::remove_file(dir.join(WITNESS_FILE)).unwrap();
    let store = ServerStore::open(&dir).expect("no witness: the database is all the folder knows");
    let mut second = start(&identity, addr, 100, &store).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !second.metrics.rounds_halted() {
        assert!(tokio::time::Instant::now() < deadline, "the devices reconnect and name their rounds");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let quiet = tokio::time::timeout(Duration::from_secs(3), second.events.recv()).await;
    assert!(quiet.is_err(), "no round runs on a rolled-back store: {quiet:?}");
    println!("devices ahead: {}; rounds halted", second.metrics.devices_ahead());
    assert_eq!(second.metrics.devices_ahead(), 2);
    second.shutdown().await.unwrap();
    drop(store);

    // The operator decides to go on from round 2's model.
    let floor = ServerStore::accept_rollback(&dir, Some(7)).unwrap();
    assert!(floor >= 7, "above every round the devices saw: {floor}");
    let store = ServerStore::open(&dir).unwrap();
    assert_eq!(store.recover("fedavg").unwrap().unwrap().checkpoint.round, 2, "the backup's model");
    let mut third = start(&identity, addr, floor + 2, &store).await;
    let closed = until_round(&mut third, floor + 2).await;
    println!("after accept-rollback (floor {floor}) rounds {closed:?} closed");
    assert_eq!(closed, vec![floor + 1, floor + 2], "numbered above every announced round");
    for d in devices {
        let reason = tokio::time::timeout(Duration::from_secs(60), d).await.expect("devices finish").unwrap().unwrap();
        assert!(reason.contains("finished"), "{reason}");
    }
    third.shutdown().await.unwrap();
}

/// `backup` while rounds run as fast as the devices (4, or `ANCHORAGE_BACKUP_DEVICES`) train and
/// upload (real QUIC on loopback):
/// it returns while the rounds go on, and it holds the round closed when it was asked for, not
/// the one closed when it finished; then the same on the idle folder. It prints both backups'
/// time and size (benches/README.md, "Backups while rounds run"):
///
/// ```sh
/// cargo test --release -p anchorage-tests --test tamper -- --nocapture backup_while_rounds_run
/// ANCHORAGE_BACKUP_DEVICES=8 cargo test --release -p anchorage-tests --test tamper -- --nocapture backup_while_rounds_run
/// ```
///
/// Each device adds 16 updates of about 1 MiB to the database (the default retention keeps 16
/// rounds' blocks and versions): 4 devices (the default), about 80 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_while_rounds_run_holds_the_round_it_was_asked_at() {
    let fleet: usize =
        std::env::var("ANCHORAGE_BACKUP_DEVICES").ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(4);
    // The retention's 16 rounds are full by then.
    const ASK_AT: u64 = 20;
    // A bound on the run: the backup must return well before the last round.
    const ROUNDS: u64 = ASK_AT + 200;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state");
    let identity = anchorage_pki::identity::self_signed(&["localhost"]).unwrap();
    let store = ServerStore::open(&dir).unwrap();
    let mut server = start_for(&identity, SocketAddr::from(([127, 0, 0, 1], 0)), ROUNDS, fleet, &store).await;
    let devices: Vec<_> = (0..fleet as u64)
        .map(|i| {
            tokio::spawn(client::run(
                ClientOptions::new(server.local_addr, identity.cert.clone(), format!("edge-{i}")),
                Box::new(fedavg_client(1 + i)),
                None,
            ))
        })
        .collect();
    until_round(&mut server, ASK_AT).await;

    // The round closed last before the call and when it returned: the backup's snapshot is taken
    // in between, when its read transaction begins, at the start of the call.
    let busy_file = tmp.path().join("busy.db");
    let before = store.newest_version().unwrap().unwrap();
    let started = std::time::Instant::now();
    let task = tokio::task::spawn_blocking({
        let (dir, dest) = (dir.clone(), busy_file.clone());
        move || ServerStore::backup(&dir, &dest)
    });
    let busy = tokio::time::timeout(Duration::from_secs(120), task)
        .await
        .expect("the backup returns while rounds run")
        .unwrap()
        .expect("a backup while rounds run");
    let busy_took = started.elapsed();
    let after = store.newest_version().unwrap().unwrap();
    until_round(&mut server, after + 2).await;
    server.shutdown().await.unwrap();
    for d in devices {
        d.abort();
    }
    let last = store.newest_version().unwrap().unwrap();

    let idle_file = tmp.path().join("idle.db");
    let started = std::time::Instant::now();
    let idle = ServerStore::backup(&dir, &idle_file).expect("a backup of the idle folder");
    let idle_took = started.elapsed();
    drop(store);

    let mib = |bytes: u64| bytes as f64 / (1 << 20) as f64;
    println!("busy: {busy}\nidle: {idle}");
    println!(
        "backup figures: with {fleet} devices running rounds: {:.2} s, {:.1} MiB, asked at round {before}, holds \
         round {}, {after} when it returned ({} rounds closed meanwhile), the run stopped at {last}; idle: {:.2} s, \
         {:.1} MiB, holds round {}",
        busy_took.as_secs_f64(),
        mib(busy.bytes),
        busy.round.unwrap(),
        after - before,
        idle_took.as_secs_f64(),
        mib(idle.bytes),
        idle.round.unwrap(),
    );
    assert!(busy.ok(), "{busy}");
    assert!(idle.ok(), "{idle}");
    let held = busy.round.unwrap();
    assert!(before <= held && held <= after, "round {held} is not between {before} and {after}");
    assert!(after < ROUNDS, "the backup returned while the rounds still ran (round {after} of {ROUNDS})");
    assert!(held < last, "the rounds went on after the backup's moment");
    // Two rounds cannot close in the moment between the call and its snapshot: a copy that
    // spanned two closes holds neither (a copy restarted on every write would hold the last).
    if after >= before + 2 {
        assert!(held < after, "the backup holds round {held}, closed when it finished, not when it was asked");
    }
    assert_eq!(idle.round, Some(last), "idle, the backup holds the last round");
}

/// The operator's commands on the real server program: `backup` while it serves, `check` (exit
/// status 1 and the problem named when a stored version is damaged), `restore` with the server
/// stopped, and a server that starts again on the restored folder.
#[test]
fn the_operators_check_backup_and_restore_commands() {
    use anchorage_tests::process::{Ending, ServerProcess};
    use std::process::Command;
    let dir = tempfile::tempdir().unwrap();
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_server-process"));
    let mut server = ServerProcess::new(dir.path(), bin, 2);
    server.spawn();
    assert!(server.wait_listening(Duration::from_secs(30)), "{}", server.log_tail());
    let config = server.config.clone();
    let task = |args: &[&str]| {
        let out = Command::new(bin).args(args).arg("--config").arg(&config).output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        println!("$ anchorage-server {} --config server.toml\n{text}", args.join(" "));
        (out.status.code(), text)
    };
    let backup = dir.path().join("backup.db");
    let (code, text) = task(&["backup", backup.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("ok"), "{text}");
    assert!(text.contains("backup holds round 0, generation round 0"), "no device came, round 0: {text}");
    let (code, text) = task(&["check"]);
    assert_eq!(code, Some(0), "a running server's folder checks clean: {text}");
    server.stop(Ending::Term);

    rusqlite::Connection::open(server.db())
        .unwrap()
        .execute("UPDATE versions SET state = zeroblob(length(state)) WHERE version = 0", [])
        .unwrap();
    let (code, text) = task(&["check"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("global version 0 does not match its checksum"), "{text}");

    let (code, text) = task(&["restore", backup.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("put back round 0, generation round 0"), "{text}");
    let (code, text) = task(&["check"]);
    assert_eq!(code, Some(0), "{text}");
    server.spawn();
    assert!(server.wait_listening(Duration::from_secs(30)), "the restored folder serves: {}", server.log_tail());
    server.stop(Ending::Term);
}
