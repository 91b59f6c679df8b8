//! The store against a real SQLite file in a temporary folder: round trips, recovery of an open
//! round, and every way a database can be damaged or misused.

use std::sync::Arc;
use std::time::Duration;

use anchorage_shared::ledger::CostRecord;
use anchorage_shared::protocol::Update;
use anchorage_shared::tensor::{Encoding, ParamBlock};

use super::*;
use crate::engine::{AcceptedUpdate, Checkpoint, EngineStats, OpenedRound, Persist, RoundOutcome, RoundReport};

/// A value that is easy to find in the database file (for the bit-flip test).
const MARK: f32 = 1234.5;

fn checkpoint(round: u64) -> Checkpoint {
    Checkpoint {
        round,
        method: "fedavg".into(),
        global: vec![ParamBlock::encode("head.bias", &[4], &[MARK, MARK, MARK, round as f32], Encoding::F32)],
        stats: EngineStats::default(),
        method_state: vec![],
        prototypes: vec![],
    }
}

fn update(round: u64, v: f32) -> Update {
    Update {
        prototypes_are: Default::default(),
        round,
        num_samples: 10,
        blocks: vec![ParamBlock::encode("head.bias", &[4], &[v; 4], Encoding::F32)],
        prototypes: vec![],
        metrics: vec![],
        compute_seconds: 0.1,
    }
}

fn accepted(client: &str, round: u64) -> Persist {
    Persist::Accepted(Arc::new(AcceptedUpdate {
        client: client.into(),
        update: update(round, 0.5),
        staleness: 0,
        arrived_after: Duration::from_millis(30),
    }))
}

fn report(round: u64) -> Arc<RoundReport> {
    Arc::new(RoundReport {
        round,
        outcome: RoundOutcome::Aggregated,
        sampled: 2,
        target: 2,
        updates: vec![],
        missing: vec![],
        declined: Vec::new(),
        duplicates: 0,
        refused: 0,
        late_total: 0,
        payload_down: 0,
        started: Duration::ZERO,
        closed: Duration::from_secs(1),
        influence: Default::default(),
        held_out_accuracy: None,
        privacy: None,
        secagg: None,
    })
}

/// Opens round `round`, accepts `a` and `b`, closes it.
fn run_round(store: &ServerStore, round: u64) {
    let opened = OpenedRound { round, task: 0, target: 2, sampled: vec!["a".into(), "b".into()] };
    store.commit(&Persist::Opened(opened)).unwrap();
    store.commit(&accepted("a", round)).unwrap();
    store.commit(&accepted("b", round)).unwrap();
    store.commit(&Persist::Closed { checkpoint: Arc::new(checkpoint(round)), report: report(round) }).unwrap();
}

fn corrupt(result: Result<impl std::fmt::Debug, StoreError>) -> String {
    match result {
        Err(e @ StoreError::Corrupt { .. }) => e.to_string(),
        other => panic!("expected a corrupt-database error, got {other:?}"),
    }
}

#[test]
fn an_open_round_and_its_accepted_updates_survive_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let store = ServerStore::open(dir.path()).unwrap();
    assert_eq!(store.recover("fedavg").unwrap(), None, "a new database holds no federation");
    store.save_initial(&checkpoint(0)).unwrap();
    run_round(&store, 1);
    let opened = OpenedRound { round: 2, task: 0, target: 3, sampled: vec!["a".into(), "b".into(), "c".into()] };
    store.commit(&Persist::Opened(opened.clone())).unwrap();
    store.commit(&accepted("b", 2)).unwrap();
    store.commit(&accepted("b", 2)).unwrap(); // a resend: stored once
    store.commit(&Persist::Seen { client: "b".into(), fingerprint: Some("ab12".into()) }).unwrap();
    drop(store);

    let store = ServerStore::open(dir.path()).unwrap();
    let r = store.recover("fedavg").unwrap().expect("a federation");
    assert_eq!(r.checkpoint, checkpoint(1));
    assert_eq!(r.open, Some(opened));
    assert_eq!(r.pending.len(), 1);
    assert_eq!((r.pending[0].client.as_str(), r.pending[0].update.clone()), ("b", update(2, 0.5)));
    assert_eq!(r.pending[0].arrived_after, Duration::from_millis(30));
    assert_eq!(r.last_accepted, vec!["a".to_string(), "b".to_string()]);
    // The wrong method is refused, not resumed.
    assert!(corrupt(store.recover("gldp")).contains("runs `fedavg`"));
}

#[test]
fn the_ledger_keeps_one_row_per_client_round_and_kind() {
    let dir = tempfile::tempdir().unwrap();
    let store = ServerStore::open(dir.path()).unwrap();
    let a = CostRecord { client: "a".into(), round: 1, wire_up: 10, joules: 1.5, ..Default::default() };
    let dropped = CostRecord { client: "a".into(), round: 1, dropped: true, ..Default::default() };
    assert_eq!(store.append_ledger(&[a.clone(), dropped.clone()]).unwrap().len(), 2);
    assert_eq!(store.append_ledger(std::slice::from_ref(&a)).unwrap(), vec![], "a resent report is not new");
    drop(store);
    let store = ServerStore::open(dir.path()).unwrap();
    assert_eq!(store.load_ledger().unwrap(), vec![dropped, a]);
    let csv = dir.path().join("ledger.csv");
    assert_eq!(store.export_ledger_csv(&csv).unwrap(), 2);
    let text = std::fs::read_to_string(&csv).unwrap();
    assert!(text.starts_with(anchorage_shared::ledger::CSV_HEADER) && text.lines().count() == 3, "{text}");
}

/// A schema-2 database migrates: its ledger rows keep their checksums, and
/// the ledger then takes declines and device conditions.
#[test]
fn a_schema_2_ledger_migrates_and_keeps_its_checksums() {
    use anchorage_shared::ledger::DeclineReason;
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path()).unwrap();
    let old = CostRecord { client: "a".into(), round: 1, wire_up: 10, joules: 1.5, ..Default::default() };
    {
        let conn = rusqlite::Connection::open(dir.path().join(DB_FILE)).unwrap();
        conn.execute_batch(schema::MIGRATIONS[0]).unwrap();
        conn.execute_batch(schema::MIGRATIONS[1]).unwrap();
        conn.pragma_update(None, "user_version", 2).unwrap();
        // Schema 2's checksum: over the record's V1 encoding.
        let sum = checksum(&[b"ledger", &old.stable_encoding()]);
        conn.execute(
            "INSERT INTO ledger (client, round, kind, payload_down, payload_up, wire_down, wire_up, compute_seconds,
               transfer_seconds, wait_seconds, wall_seconds, rtt_seconds, joules, straggler, recorded_at, checksum)
             VALUES ('a', 1, 'reported', 0, 0, 0, 10, 0, 0, 0, 0, 0, 1.5, 0, 0, ?1)",
            [sum],
        )
        .unwrap();
    }
    let store = ServerStore::open(dir.path()).unwrap();
    assert_eq!(store.load_ledger().unwrap(), vec![old], "the old row reads back, checksum intact");
    let declined = CostRecord {
        client: "b".into(),
        round: 1,
        declined: Some(DeclineReason::Battery),
        battery_percent: Some(12),
        external_power: Some(false),
        ..Default::default()
    };
    let hot = CostRecord {
        client: "c".into(),
        round: 1,
        temperature_c: Some(81.0),
        throttled: Some(true),
        power_mode: Some("nvpmodel 0".into()),
        readings_refused: Some(2),
        ..Default::default()
    };
    assert_eq!(store.append_ledger(&[declined.clone(), hot.clone()]).unwrap().len(), 2);
    drop(store);
    let store = ServerStore::open(dir.path()).unwrap();
    let ledger = store.load_ledger().unwrap();
    assert!(ledger.contains(&declined) && ledger.contains(&hot), "{ledger:?}");
    let report = ServerStore::check(dir.path()).unwrap();
    assert!(report.problems.is_empty(), "{:?}", report.problems);
}

#[test]
fn a_second_server_on_the_same_folder_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let _first = ServerStore::open(dir.path()).unwrap();
    match ServerStore::open(dir.path()) {
        Err(e @ StoreError::Locked { .. }) => {
            let text = e.to_string();
            assert!(text.contains(LOCK_FILE) && text.contains(&format!("pid {}", std::process::id())), "{text}");
        }
        other => panic!("expected the lock to refuse a second store, got {other:?}"),
    }
}

#[test]
fn a_state_folder_that_cannot_be_written_stops_the_store_with_its_name() {
    let dir = tempfile::tempdir().unwrap();
    // A regular file where the folder should be: fails for root too (permissions would not).
    let blocker = dir.path().join("not-a-folder");
    std::fs::write(&blocker, b"x").unwrap();
    let err = ServerStore::open(blocker.join("state")).unwrap_err();
    assert!(matches!(err, StoreError::Io { .. }) && err.to_string().contains("not-a-folder"), "{err}");
}

#[test]
fn a_database_from_a_newer_server_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    drop(ServerStore::open(dir.path()).unwrap());
    let conn = rusqlite::Connection::open(dir.path().join(DB_FILE)).unwrap();
    conn.pragma_update(None, "user_version", SCHEMA_VERSION + 1).unwrap();
    drop(conn);
    let err = ServerStore::open(dir.path()).unwrap_err();
    assert!(matches!(err, StoreError::NewerSchema { .. }) && err.to_string().contains(DB_FILE), "{err}");
}

#[test]
fn a_flipped_bit_in_a_stored_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let store = ServerStore::open(dir.path()).unwrap();
    store.save_initial(&checkpoint(0)).unwrap();
    run_round(&store, 1);
    drop(store); // the last connection closing folds the WAL into the database file
    let path = dir.path().join(DB_FILE);
    let mut bytes = std::fs::read(&path).unwrap();
    let mark = [MARK.to_le_bytes(), MARK.to_le_bytes()].concat();
    // Every copy of the model in the file (the newest version's among them) gets one bit flipped.
    let copies: Vec<usize> =
        bytes.windows(mark.len()).enumerate().filter(|(_, w)| *w == mark.as_slice()).map(|(i, _)| i).collect();
    assert!(!copies.is_empty(), "the model's bytes are in the file");
    copies.iter().for_each(|&at| bytes[at] ^= 0x04);
    std::fs::write(&path, &bytes).unwrap();
    let store = ServerStore::open(dir.path()).expect("SQLite's own structure is intact");
    let detail = corrupt(store.recover("fedavg"));
    assert!(detail.contains("checksum") && detail.contains(DB_FILE), "{detail}");
}

#[test]
fn a_rolled_back_or_renumbered_round_is_refused() {
    for (edit, expect) in [
        // The newest versions deleted: the model would silently go back two rounds.
        ("DELETE FROM versions WHERE version > 1", "rounds are closed up to 3"),
        // A version's number edited (41 → 5 in the field): its checksum no longer matches.
        ("UPDATE versions SET version = 9 WHERE version = 3; UPDATE rounds SET round = 9 WHERE round = 3", "checksum"),
        // A round reopened behind the newest version.
        ("UPDATE rounds SET status = 'open' WHERE round = 2", "round"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let store = ServerStore::open(dir.path()).unwrap();
        store.save_initial(&checkpoint(0)).unwrap();
        (1..=3).for_each(|r| run_round(&store, r));
        drop(store);
        rusqlite::Connection::open(dir.path().join(DB_FILE)).unwrap().execute_batch(edit).unwrap();
        let detail = match ServerStore::open(dir.path()) {
            Ok(store) => corrupt(store.recover("fedavg")),
            Err(e) => corrupt(Err::<(), _>(e)),
        };
        assert!(detail.contains(expect), "{edit}: {detail}");
    }
}

#[test]
fn a_truncated_database_stops_the_store_with_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let store = ServerStore::open(dir.path()).unwrap();
    store.save_initial(&checkpoint(0)).unwrap();
    (1..=20).for_each(|r| run_round(&store, r));
    drop(store);
    let path = dir.path().join(DB_FILE);
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len / 2).unwrap();
    let err = match ServerStore::open(dir.path()) {
        Err(e) => e,
        Ok(store) => store.recover("fedavg").expect_err("half a database cannot be resumed"),
    };
    assert!(err.to_string().contains(DB_FILE), "{err}");
    assert!(matches!(err, StoreError::Corrupt { .. }), "{err:?}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), len / 2, "a corrupt database is left as it was");
}

#[test]
fn retention_bounds_versions_update_blocks_and_ledger_rows() {
    let dir = tempfile::tempdir().unwrap();
    let retention = Retention { keep_versions: 2, keep_update_blocks: 2, keep_ledger_rounds: 3 };
    let store = ServerStore::open_with(dir.path(), retention).unwrap();
    store.save_initial(&checkpoint(0)).unwrap();
    for r in 1..=6 {
        run_round(&store, r);
        store.append_ledger(&[CostRecord { client: "a".into(), round: r, ..Default::default() }]).unwrap();
    }
    let conn = store.conn();
    let count = |sql: &str| conn.query_row(sql, [], |r| r.get::<_, i64>(0)).unwrap();
    assert_eq!(count("SELECT COUNT(*) FROM versions"), 2);
    assert_eq!(count("SELECT MIN(version) FROM versions"), 5);
    assert_eq!(count("SELECT COUNT(*) FROM updates"), 12, "every accepted update keeps its row");
    assert_eq!(count("SELECT COUNT(*) FROM updates WHERE body IS NOT NULL"), 4, "rounds 5 and 6 keep their blocks");
    assert_eq!(count("SELECT MIN(round) FROM ledger"), 4);
    drop(conn);
    assert_eq!(store.recover("fedavg").unwrap().unwrap().checkpoint, checkpoint(6));
}

#[test]
fn the_stateless_reset_key_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let key = ServerStore::open(dir.path()).unwrap().stateless_reset_key().unwrap();
    assert_eq!(ServerStore::open(dir.path()).unwrap().stateless_reset_key().unwrap(), key);
    assert_ne!(key, [0; 32]);
}

#[test]
fn the_state_folder_is_0700_and_its_files_0600_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())).permissions().mode();
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    // The loosest umask: without explicit modes the folder would be 0777 and the files 0666.
    // SAFETY: umask cannot fail; other tests of this process only see a looser umask briefly.
    let old = unsafe { libc::umask(0) };
    let opened = ServerStore::open(&state);
    unsafe { libc::umask(old) };
    let store = opened.unwrap();
    store.save_initial(&checkpoint(0)).unwrap();
    run_round(&store, 1);
    let check = |when: &str| {
        assert_eq!(mode(&state) & 0o777, 0o700, "the state folder {when}");
        for name in [DB_FILE, WAL_FILE, SHM_FILE, LOCK_FILE] {
            assert_eq!(mode(&state.join(name)) & 0o777, 0o600, "{name} {when}");
        }
    };
    check("when new");
    drop(store);
    // An older install's loose modes are tightened at the next open.
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
    for name in [DB_FILE, LOCK_FILE] {
        std::fs::set_permissions(state.join(name), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let store = ServerStore::open(&state).unwrap();
    run_round(&store, 2);
    check("after reopening a 0755 folder with 0644 files");
}

/// `anchorage.db` replaced by a copy 24 rounds older is refused until the operator accepts it.
#[test]
fn a_database_replaced_by_an_older_copy_is_refused_until_the_operator_accepts_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = ServerStore::open(dir.path()).unwrap();
    store.save_initial(&checkpoint(0)).unwrap();
    (1..=2).for_each(|r| run_round(&store, r));
    drop(store);
    let backup = dir.path().join("backup.db");
    std::fs::copy(dir.path().join(DB_FILE), &backup).unwrap();
    let store = ServerStore::open(dir.path()).unwrap();
    (3..=26).for_each(|r| run_round(&store, r));
    drop(store);
    std::fs::copy(&backup, dir.path().join(DB_FILE)).unwrap();
    let _ = std::fs::remove_file(dir.path().join(WAL_FILE));
    let _ = std::fs::remove_file(dir.path().join(SHM_FILE));

    let err = ServerStore::open(dir.path()).expect_err("a rolled-back database is refused");
    println!("{err}");
    let StoreError::RolledBack { stored, witness, .. } = &err else { panic!("{err:?}") };
    assert_eq!((stored.round, witness.round), (2, 26));
    assert!(err.to_string().contains("accept-rollback"), "{err}");

    assert_eq!(ServerStore::accept_rollback(dir.path(), None).unwrap(), 26, "numbers continue above 26");
    let store = ServerStore::open(dir.path()).expect("the operator decided");
    let recovered = store.recover("fedavg").unwrap().unwrap();
    assert_eq!((recovered.checkpoint.round, recovered.round_floor), (2, 26), "the model of round 2, rounds above 26");
    run_round(&store, 27);
    drop(store);
    let store = ServerStore::open(dir.path()).expect("round 27 after the floor is consistent");
    assert_eq!(store.recover("fedavg").unwrap().unwrap().checkpoint.round, 27);
}

/// A bit flip in the WAL after a kill -9 would lose committed rows silently (SQLite stops
/// replaying at the bad frame). A crash image of the folder (database, WAL, witness copied while
/// the store is open) with one byte of the WAL flipped is refused, not resumed a round early.
#[test]
fn a_damaged_wal_tail_that_sqlite_drops_is_caught_by_the_witness() {
    let dir = tempfile::tempdir().unwrap();
    let store = ServerStore::open(dir.path()).unwrap();
    store.save_initial(&checkpoint(0)).unwrap();
    (1..=3).for_each(|r| run_round(&store, r));
    let image = tempfile::tempdir().unwrap();
    for name in [DB_FILE, WAL_FILE, WITNESS_FILE] {
        std::fs::copy(dir.path().join(name), image.path().join(name)).unwrap();
    }
    drop(store);
    let wal = image.path().join(WAL_FILE);
    let mut bytes = std::fs::read(&wal).unwrap();
    assert!(bytes.len() > 4096, "the crash image has committed frames in its WAL: {} bytes", bytes.len());
    let at = bytes.len() / 2;
    bytes[at] ^= 0x10;
    std::fs::write(&wal, &bytes).unwrap();
    // SQLite itself opens the image without a word and shows fewer rounds...
    let conn = rusqlite::Connection::open(image.path().join(DB_FILE)).unwrap();
    let closed: i64 = conn.query_row("SELECT COUNT(*) FROM rounds WHERE status != 'open'", [], |r| r.get(0)).unwrap();
    drop(conn);
    println!("SQLite replays {closed} of 3 closed rounds from the damaged WAL");
    assert!(closed < 3, "the flipped frame and every frame after it are gone");
    // ...the store does not.
    let err = ServerStore::open(image.path()).expect_err("the witness is ahead of the database");
    println!("{err}");
    assert!(matches!(err, StoreError::RolledBack { .. }), "{err:?}");
}

/// Bit flips in old update or version blobs, ledger rows and round reports, where start-up
/// does not look: `check` finds each; the readers leave a damaged row out instead of using it.
#[test]
fn check_finds_damage_in_old_blobs_ledger_rows_and_reports_and_readers_skip_them() {
    let dir = tempfile::tempdir().unwrap();
    let store = ServerStore::open(dir.path()).unwrap();
    store.save_initial(&checkpoint(0)).unwrap();
    (1..=3).for_each(|r| run_round(&store, r));
    let records: Vec<CostRecord> = (1..=3)
        .map(|round| CostRecord { client: "a".into(), round, joules: 2.5, wire_up: 1000, ..CostRecord::default() })
        .collect();
    store.append_ledger(&records).unwrap();
    drop(store);
    let clean = ServerStore::check(dir.path()).unwrap();
    println!("{clean}");
    assert!(clean.ok(), "{clean}");
    assert_eq!((clean.versions, clean.ledger_rows, clean.reports), (4, 3, 3));

    let db = dir.path().join(DB_FILE);
    rusqlite::Connection::open(&db)
        .unwrap()
        .execute_batch(
            "UPDATE ledger SET joules = 3.5 WHERE round = 1;
             UPDATE rounds SET report = replace(report, '\"sampled\":2', '\"sampled\":3') WHERE round = 2;
             UPDATE updates SET body = zeroblob(length(body)) WHERE round = 1 AND client = 'a';
             UPDATE versions SET state = zeroblob(length(state)) WHERE version = 1;",
        )
        .unwrap();
    let damaged = ServerStore::check(dir.path()).unwrap();
    println!("{damaged}");
    let text = damaged.problems.join("\n");
    for expect in ["ledger row (a, round 1)", "round 2's report", "a's update for round 1", "global version 1"] {
        assert!(text.contains(expect), "{expect}: {text}");
    }
    let ledger = read_ledger(&db).unwrap();
    assert_eq!(ledger.iter().map(|r| r.round).collect::<Vec<_>>(), vec![2, 3], "the damaged row is left out");
    let reports = read_round_reports(&db).unwrap();
    assert_eq!(reports.iter().map(|r| r.round).collect::<Vec<_>>(), vec![1, 3], "the damaged report is left out");
}

/// `backup` copies a live database (0600, its staging folder gone, holding round 2 and the
/// generation the store had); `restore` puts it back with the rollback accepted, so the witness
/// does not refuse a deliberate restore, says what it put back, and round numbers go on above
/// the ones announced.
#[test]
fn a_backup_taken_while_running_restores_and_numbers_go_on() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let store = ServerStore::open(dir.path()).unwrap();
    store.save_initial(&checkpoint(0)).unwrap();
    (1..=2).for_each(|r| run_round(&store, r));
    let backup = tempfile::tempdir().unwrap();
    let copy = backup.path().join("anchorage-backup.db");
    let report = ServerStore::backup(dir.path(), &copy).expect("a backup while the store is open");
    assert!(report.ok() && report.check.versions == 3, "{report}");
    assert_eq!((report.round, report.generation), (Some(2), store.stored_witness().unwrap()), "{report}");
    assert_eq!(std::fs::metadata(&copy).unwrap().permissions().mode() & 0o777, 0o600);
    let left: Vec<_> = std::fs::read_dir(backup.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, [copy.file_name().unwrap()], "the staging folder is gone");
    (3..=5).for_each(|r| run_round(&store, r));
    drop(store);
    let restored = ServerStore::restore(dir.path(), &copy).unwrap();
    assert_eq!((restored.round, restored.generation, restored.floor), (Some(2), report.generation, 5));
    let store = ServerStore::open(dir.path()).expect("a restored folder opens");
    let recovered = store.recover("fedavg").unwrap().unwrap();
    assert_eq!((recovered.checkpoint.round, recovered.round_floor), (2, 5));
    assert!(
        std::fs::read_dir(dir.path()).unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .contains("before-restore")),
        "the replaced database is kept"
    );
}

/// A backup taken while another connection commits rounds as fast as it can is the database at
/// the moment of the call: it holds a round between the last one closed before the call and the
/// last one closed when it returned, and it returns while the writes go on (a copy that starts
/// over on every write would finish only once they stop, holding the last round).
#[test]
fn a_backup_under_constant_writes_holds_the_moment_it_was_asked_for() {
    use std::sync::atomic::{AtomicBool, Ordering};
    const PADDING_ROUNDS: u64 = 40;
    const WRITER_ROUNDS: u64 = 1000;
    let dir = tempfile::tempdir().unwrap();
    let keep_all = Retention { keep_versions: 0, keep_update_blocks: 0, keep_ledger_rounds: 0 };
    let store = ServerStore::open_with(dir.path(), keep_all).unwrap();
    store.save_initial(&checkpoint(0)).unwrap();
    // A history of 40 rounds of two 256 KiB updates: a database of about 20 MiB, many steps of
    // SQLite's backup API.
    for round in 1..=PADDING_ROUNDS {
        let opened = OpenedRound { round, task: 0, target: 2, sampled: vec!["a".into(), "b".into()] };
        store.commit(&Persist::Opened(opened)).unwrap();
        for client in ["a", "b"] {
            let mut update = update(round, 0.5);
            update.blocks = vec![ParamBlock::encode("w", &[65536], &vec![round as f32; 65536], Encoding::F32)];
            let accepted =
                AcceptedUpdate { client: client.into(), update, staleness: 0, arrived_after: Duration::ZERO };
            store.commit(&Persist::Accepted(Arc::new(accepted))).unwrap();
        }
        store.commit(&Persist::Closed { checkpoint: Arc::new(checkpoint(round)), report: report(round) }).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (store, stop) = (store.clone(), stop.clone());
        std::thread::spawn(move || {
            for round in PADDING_ROUNDS + 1..=PADDING_ROUNDS + WRITER_ROUNDS {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                run_round(&store, round);
            }
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while store.newest_version().unwrap() < Some(PADDING_ROUNDS + 3) {
        assert!(std::time::Instant::now() < deadline, "the writer runs rounds");
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = tempfile::tempdir().unwrap();
    let before = store.newest_version().unwrap().unwrap();
    let started = std::time::Instant::now();
    let copy = ServerStore::backup(dir.path(), &out.path().join("busy.db")).expect("a backup under writes");
    let took = started.elapsed();
    let after = store.newest_version().unwrap().unwrap();
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let last = store.newest_version().unwrap().unwrap();
    let held = copy.round.unwrap();
    println!("{copy}\nasked at round {before}, returned at {after} after {took:?}, the writer stopped at {last}");
    assert!(copy.ok(), "{copy}");
    assert!(before <= held && held <= after, "round {held} is not between {before} and {after}");
    assert!(after < PADDING_ROUNDS + WRITER_ROUNDS, "the backup returned while rounds were still written");
    // The writer was between two commits of its round: `held` closed, or the next one open.
    let g = copy.generation;
    assert!((g.round, g.closed) == (held, true) || (g.round, g.closed) == (held + 1, false), "{copy}");
}

/// A relay whose parent ran rounds 2 to 4 without it opens round 5 next: the rounds it passed
/// over raise its floor in the store, so the database tells one story (round 5 open after
/// version 1) and a restart resumes round 5. Without the floor the same rows are refused as
/// corrupt at the next start (seed 1385 of the swarm).
#[test]
fn rounds_a_relay_passed_over_keep_its_database_consistent() {
    for passed_over in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let store = ServerStore::open(dir.path()).unwrap();
        store.save_initial(&checkpoint(0)).unwrap();
        run_round(&store, 1);
        if passed_over {
            store.commit(&Persist::PassedOver { through: 4 }).unwrap();
            store.commit(&Persist::PassedOver { through: 3 }).unwrap(); // a lower floor changes nothing
        }
        let opened = OpenedRound { round: 5, task: 0, target: 2, sampled: vec!["a".into(), "b".into()] };
        store.commit(&Persist::Opened(opened.clone())).unwrap();
        drop(store);
        let reopened = ServerStore::open(dir.path());
        if passed_over {
            let recovered = reopened.unwrap().recover("fedavg").unwrap().expect("the relay's state");
            assert_eq!((recovered.round_floor, recovered.open), (4, Some(opened)));
        } else {
            assert!(corrupt(reopened).contains("round 5 is open"));
        }
    }
}
