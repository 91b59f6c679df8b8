//! The examples in `examples/`, run for real from their own files, and what a user of the two
//! service programs expects of their command lines (`check-config`, `--help`, completions, man
//! pages, an empty config refused).
//!
//! - `examples/field`: its project.toml (on a free port) is provisioned, both `check-config`s pass,
//!   the server program and two client programs federate over QUIC on loopback until the server's
//!   last round, and the server's state folder is reported on;
//! - `examples/research`: its sweep.toml runs as `anchorage sim sweep.toml --seeds 2` does
//!   (the simulator's library: the `anchorage` binary belongs to another package), two seeds and
//!   the sweep's summary.
//!
//! `.ci/run` also runs the scripts themselves (`examples/run.sh`) with the built programs.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const SERVER: &str = env!("CARGO_BIN_EXE_server-process");
const CLIENT: &str = env!("CARGO_BIN_EXE_client-process");

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

fn run(bin: &str, args: &[&str]) -> Output {
    Command::new(bin).args(args).env_remove("ANCHORAGE_LOG").env("RUST_BACKTRACE", "0").output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Kills a program the test leaves running when it fails.
struct Running(Child, &'static str);

impl Running {
    fn spawn(bin: &str, config: &Path, log: &Path, name: &'static str) -> Self {
        let log = std::fs::File::create(log).unwrap();
        let child = Command::new(bin)
            .arg("--config")
            .arg(config)
            .env("ANCHORAGE_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        Self(child, name)
    }

    /// Waits for the program to exit by itself; its exit status.
    fn wait(&mut self, until: Instant) -> std::process::ExitStatus {
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < until, "{} still running after the deadline", self.1);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_field_example_provisions_checks_federates_and_reports() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    // The example's own file, on a free port (what run.sh's $PORT does).
    let example = std::fs::read_to_string(examples().join("field/project.toml")).unwrap();
    assert_eq!(example.matches(":47433\"").count(), 2, "the address and the bind carry run.sh's port");
    let project = dir.path().join("project.toml");
    std::fs::write(&project, example.replace(":47433\"", &format!(":{port}\""))).unwrap();
    let done = anchorage::provision::provision(&project, None).unwrap();
    let sites = dir.path().join("sites");
    assert_eq!(done.out, sites);
    let server_toml = sites.join("server/server.toml");

    // Every site's check-config passes, one line per check, off the network.
    let check = run(SERVER, &["check-config", "--config", server_toml.to_str().unwrap()]);
    let out = text(&check.stdout);
    assert!(check.status.success(), "{out}{}", text(&check.stderr));
    for name in ["config", "bind", "ca", "certificate", "key", "crl", "model", "state"] {
        assert!(out.lines().any(|l| l.split_whitespace().nth(1) == Some(name)), "no `{name}` line: {out}");
    }
    assert!(out.contains("check-config: the server can start"), "{out}");
    assert!(!sites.join("server/state").exists(), "check-config makes nothing");
    for device in ["edge-001", "edge-002"] {
        let config = sites.join(device).join("client.toml");
        let check = run(CLIENT, &["check-config", "--config", config.to_str().unwrap()]);
        let out = text(&check.stdout);
        assert!(check.status.success(), "{out}{}", text(&check.stderr));
        assert!(out.contains("chains to") && out.contains("check-config: the device can start"), "{out}");
    }

    // The server and the two devices, until the server's last round.
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut server = Running::spawn(SERVER, &server_toml, &dir.path().join("server.log"), "the server");
    let mut devices: Vec<Running> = ["edge-001", "edge-002"]
        .iter()
        .map(|d| {
            Running::spawn(CLIENT, &sites.join(d).join("client.toml"), &dir.path().join(format!("{d}.log")), "a device")
        })
        .collect();
    let status = server.wait(deadline);
    let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap();
    assert!(status.success(), "{log}");
    for round in [1, 2] {
        assert!(log.contains(&format!("round closed round={round}")), "{log}");
    }
    for device in &mut devices {
        assert!(device.wait(deadline).success());
    }

    // `anchorage report <state_dir> --out report`.
    let options = anchorage_sim::report::ReportOptions {
        out: Some(dir.path().join("report")),
        force: false,
        server_config: None,
    };
    let written = anchorage_sim::report::write_report_with(&sites.join("server/state"), &options).unwrap();
    assert!(written.files.iter().any(|f| f.ends_with("report.md")), "{:?}", written.files);
    let report = std::fs::read_to_string(dir.path().join("report/report.md")).unwrap();
    assert!(report.contains("**Status:** finished (2 of 2 rounds)"), "{report}");
    let accuracy = report.lines().find(|l| l.starts_with("| device accuracy (their own evaluation) |")).unwrap();
    assert!(accuracy.contains("% (round 2, 2 devices"), "the devices' own accuracy of the last round: {accuracy}");
    let rounds = report.lines().filter(|l| l.starts_with("| ") && l.contains("| aggregated |")).count();
    assert_eq!(rounds, 2, "both rounds in the table: {report}");
}

#[test]
fn the_research_example_sweeps_two_seeds() {
    use anchorage_sim::recorder::{Console, StopFlag};
    let dir = tempfile::tempdir().unwrap();
    let path = examples().join("research/sweep.toml");
    // What `anchorage sim sweep.toml --seeds 2 --out DIR --quiet` runs.
    let file = anchorage_sim::scenario::ConfigFile::read(&path).unwrap();
    let config = file.config().unwrap();
    anchorage_sim::scenario::check(&config, Some(&file)).unwrap();
    assert_eq!((config.federation.clients, config.federation.rounds, config.method.name()), (3, 5, "fedprox"));
    let plan = anchorage_sim::sweep::Plan { runs: 2, vary_data_seed: true };
    let out = dir.path().join("sweep");
    let done = anchorage_sim::sweep::run(&config, plan, &out, Console::Quiet, StopFlag::default()).unwrap();
    assert!(done.stopped.is_none());
    for seed in ["seed-7", "seed-8"] {
        assert!(out.join(seed).join("metrics.json").exists(), "{seed}");
    }
    let summary = std::fs::read_to_string(out.join("sweep.md")).unwrap();
    assert!(summary.contains("2 of 2 seeds finished") && summary.contains("final accuracy"), "{summary}");
    // The script runs the same file with the same flags.
    let script = std::fs::read_to_string(examples().join("research/run.sh")).unwrap();
    assert!(script.contains("sim \"$here/sweep.toml\" --seeds 2"), "{script}");
}

#[test]
fn the_service_programs_check_configs_and_have_help_completions_and_man_pages() {
    let dir = tempfile::tempdir().unwrap();
    for (bin, name, subcommand) in [(SERVER, "anchorage-server", "check"), (CLIENT, "anchorage-client", "doctor")] {
        // --log-json is in the help, and so is check-config.
        let help = text(&run(bin, &["--help"]).stdout);
        assert!(help.contains("--log-json") && help.contains("check-config"), "{help}");
        assert!(!help.contains("\n  completions"), "completions is not in the list: {help}");
        // Completions for a shell, on stdout.
        let bash = run(bin, &["completions", "bash"]);
        let function = format!("_{}() {{", name.replace('-', "__"));
        assert!(bash.status.success() && text(&bash.stdout).contains(&function), "{}", text(&bash.stderr));
        assert!(text(&bash.stdout).contains("check-config"));
        assert!(text(&run(bin, &["completions", "zsh"]).stdout).contains(&format!("#compdef {name}")));
        // Man pages: the program's, and one per visible subcommand.
        let man = dir.path().join(name);
        let made = run(bin, &["man", "--out", man.to_str().unwrap()]);
        assert!(made.status.success(), "{}", text(&made.stderr));
        for page in [format!("{name}.1"), format!("{name}-check-config.1"), format!("{name}-{subcommand}.1")] {
            let roff = std::fs::read_to_string(man.join(&page)).unwrap_or_else(|e| panic!("{page}: {e}"));
            assert!(roff.starts_with(".ie") || roff.contains(".TH"), "{page}: {roff}");
        }
        assert!(!man.join(format!("{name}-completions.1")).exists());
        // The packages ship deploy/man's copies (usr/share/man/man1): they must be what the
        // program makes today.
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/man");
        for entry in std::fs::read_dir(&man).unwrap() {
            let page = entry.unwrap().file_name();
            let made = std::fs::read(man.join(&page)).unwrap();
            let copy = std::fs::read(shipped.join(&page)).unwrap_or_default();
            assert!(made == copy, "deploy/man/{page:?} is stale: run `{name} man --out deploy/man`");
        }
        let stdout = run(bin, &["man"]);
        assert!(text(&stdout.stdout).contains(".TH"));
        // An empty config is an error that names the file, not a default.
        let empty = dir.path().join(format!("{name}-empty.toml"));
        std::fs::write(&empty, "# nothing but a comment\n\n").unwrap();
        let started = run(bin, &["--config", empty.to_str().unwrap()]);
        assert!(!started.status.success());
        assert!(text(&started.stderr).contains(&format!("{} is empty", empty.display())), "{}", text(&started.stderr));
        let checked = run(bin, &["check-config", "--config", empty.to_str().unwrap()]);
        assert_eq!(checked.status.code(), Some(1));
        assert!(text(&checked.stdout).contains("is empty"), "{}", text(&checked.stdout));
    }
}
