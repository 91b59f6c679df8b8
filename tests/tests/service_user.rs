//! The operator's path as written, under unprivileged service users: README.md's "Running it for
//! real" makes and edits the project (its own `P=` and `sed` lines, run by sh), `anchorage
//! provision` writes the site folders, and deploy/README.md's copy steps of sections 2 and 3 (its
//! own `cp`, `chown`, `chmod`, `sed` and `install` lines, with /etc and /var/lib moved into a
//! folder per machine) install the server and two devices. Then the server and both clients run
//! as users that are not root (`setpriv --reuid --regid --clear-groups`, with the units' `UMask=0077`),
//! the doctor passes as the device's user, and three rounds close.
//!
//! Needs root (to change users and owners) and setpriv or runuser (util-linux); without them it
//! prints a loud SKIPPED line and passes.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anchorage_tests::process::{free_udp_port, http_get};

/// The server's user (nobody:nogroup where setpriv is used).
const SERVER_UID: u32 = 65534;
/// The devices' user: one no account names, as a fresh system user would be.
const CLIENT_UID: u32 = 64_999;

fn skip(reason: &str) {
    anchorage_shared::skip::skipped(&format!("service_user: {reason}"));
}

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().unwrap()
}

/// A program on PATH or in the usual system folders.
fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .map(PathBuf::from)
        .chain(["/usr/bin", "/usr/sbin", "/bin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// How a command is run as another user.
#[derive(Clone)]
enum Switch {
    /// `setpriv --reuid U --regid G --clear-groups`: any uid, no account needed.
    Setpriv(PathBuf),
    /// `runuser -u nobody`: an account's name only, so every site runs as nobody.
    Runuser(PathBuf),
}

/// A service's user.
#[derive(Clone)]
struct ServiceUser {
    uid: u32,
    gid: u32,
    switch: Switch,
}

impl ServiceUser {
    /// `program args…` as this user, with the systemd units' `UMask=0077`, an empty environment
    /// but PATH and the log filter, in `/`.
    fn command(&self, program: &Path) -> Command {
        let mut cmd = match &self.switch {
            Switch::Setpriv(setpriv) => {
                let mut cmd = Command::new(setpriv);
                cmd.arg(format!("--reuid={}", self.uid))
                    .arg(format!("--regid={}", self.gid))
                    .arg("--clear-groups")
                    .arg("--");
                cmd
            }
            Switch::Runuser(runuser) => {
                let mut cmd = Command::new(runuser);
                cmd.args(["-u", "nobody", "--"]);
                cmd
            }
        };
        cmd.args(["sh", "-c", "umask 0077 && exec \"$0\" \"$@\""])
            .arg(program)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")
            .env("ANCHORAGE_LOG", "info")
            .current_dir("/")
            .stdin(Stdio::null());
        cmd
    }
}

/// Kills a process the test started if the test fails before it ends.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The first ```sh block after the heading `heading` of the Markdown file `file`.
fn sh_block(file: &str, heading: &str) -> String {
    let text = std::fs::read_to_string(repo().join(file)).unwrap();
    let (_, section) = text.split_once(&format!("\n{heading}\n")).unwrap_or_else(|| panic!("{file}: {heading}"));
    let (_, block) = section.split_once("```sh\n").unwrap_or_else(|| panic!("{file}: a sh block under {heading}"));
    block.split_once("```").unwrap().0.to_string()
}

/// A line of a block without its trailing comment.
fn uncommented(line: &str) -> String {
    match line.find("  #") {
        Some(at) => line[..at].trim_end().to_string(),
        None => line.trim_end().to_string(),
    }
}

/// Runs `script` with sh as root in `cwd`, HOME set to `home`; returns its stdout.
fn sh(script: &str, cwd: &Path, home: &Path) -> String {
    let out = Command::new("sh").arg("-c").arg(script).current_dir(cwd).env("HOME", home).output().expect("sh runs");
    assert!(out.status.success(), "{script}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// Copies the folder `from` into `to` file by file (scp -r and cp: the modes come along).
fn copy_folder(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

fn set_mode(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn chown(path: &Path, user: &ServiceUser) {
    std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid)).unwrap();
}

/// deploy/README.md's installation lines of one section (`sudo cp`, `chown`, `chmod`, `sed`,
/// `install -d`), as root on the machine `machine` (its /etc and /var/lib are folders in it),
/// for the site `site` (the section's own example is edge-002) and its service's user.
fn install_as_documented(block: &str, machine: &Path, site: &str, user: &ServiceUser) -> Vec<String> {
    let etc = machine.join("etc");
    let var_lib = machine.join("var/lib");
    let mut ran = Vec::new();
    for line in block.lines().map(uncommented) {
        let Some(command) = ["sudo cp ", "sudo chown ", "sudo chmod ", "sudo sed -i ", "sudo install -d "]
            .iter()
            .find(|start| line.starts_with(**start))
        else {
            continue;
        };
        let ours = line
            .replace("sudo ", "")
            .replace("/etc/anchorage", &format!("{}/anchorage", etc.display()))
            .replace("/var/lib/anchorage-", &format!("{}/anchorage-", var_lib.display()))
            .replace("edge-002/", &format!("{site}/"))
            .replace("anchorage-server:", &format!("{}:{}", user.uid, user.gid))
            .replace("anchorage-client:", &format!("{}:{}", user.uid, user.gid))
            .replace("-o anchorage-client -g anchorage-client", &format!("-o {} -g {}", user.uid, user.gid))
            .replace("-o anchorage-server -g anchorage-server", &format!("-o {} -g {}", user.uid, user.gid));
        sh(&ours, &machine.join("home"), &machine.join("home"));
        ran.push(command.trim().to_string());
    }
    for needed in ["sudo cp", "sudo chown", "sudo sed -i"] {
        assert!(ran.iter().any(|r| r == needed), "deploy/README.md's block has a `{needed}` line:\n{block}");
    }
    ran
}

fn owner_and_mode(path: &Path) -> (u32, u32) {
    let meta = std::fs::metadata(path).unwrap();
    (meta.uid(), meta.permissions().mode() & 0o777)
}

fn text(out: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

#[test]
fn the_documented_copy_runs_three_rounds_as_service_users() {
    let started = Instant::now();
    let root = Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if root.ok() != Some(true) {
        skip("not root: run the tests as root (e.g. in the CI container) to change users and owners");
        return;
    }
    let switch = match (find_tool("setpriv"), find_tool("runuser")) {
        (Some(setpriv), _) => Switch::Setpriv(setpriv),
        (None, Some(runuser)) => Switch::Runuser(runuser),
        (None, None) => {
            skip("neither setpriv nor runuser found: apt-get install util-linux");
            return;
        }
    };
    let (server_user, client_user) = match &switch {
        Switch::Setpriv(_) => (
            ServiceUser { uid: SERVER_UID, gid: SERVER_UID, switch: switch.clone() },
            ServiceUser { uid: CLIENT_UID, gid: CLIENT_UID, switch: switch.clone() },
        ),
        Switch::Runuser(_) => {
            let id = |flag: &str| -> u32 {
                let out = Command::new("id").args([flag, "nobody"]).output().unwrap();
                String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
            };
            let nobody = ServiceUser { uid: id("-u"), gid: id("-g"), switch: switch.clone() };
            (nobody.clone(), nobody)
        }
    };

    // Every folder on the way must be traversable by the services' users (a tempdir is 0700).
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().canonicalize().unwrap();
    set_mode(&t, 0o755);
    // The programs where those users may run them (the target folder under /root is not).
    let bin = t.join("bin");
    std::fs::create_dir(&bin).unwrap();
    for (name, from) in [
        ("anchorage-server", env!("CARGO_BIN_EXE_server-process")),
        ("anchorage-client", env!("CARGO_BIN_EXE_client-process")),
    ] {
        let to = bin.join(name);
        if std::fs::hard_link(from, &to).is_err() {
            std::fs::copy(from, &to).unwrap();
        }
        set_mode(&to, 0o755);
    }

    // README.md, "Running it for real": the project folder and the edits, as written.
    let operator = t.join("operator");
    std::fs::create_dir(&operator).unwrap();
    let walkthrough = sh_block("README.md", "## Running it for real");
    let lines: Vec<String> =
        walkthrough.lines().map(uncommented).filter(|l| l.starts_with("P=") || l.starts_with("sed -i")).collect();
    assert_eq!(lines.len(), 2, "README.md's walkthrough makes $P and edits its project.toml:\n{walkthrough}");
    let p = PathBuf::from(sh(&format!("{}\nprintf %s \"$P\"", lines.join("\n")), &repo(), &operator));
    assert!(p.starts_with(&operator) && !p.starts_with(repo()), "the project is outside the checkout: {}", p.display());
    let project = p.join("project.toml");
    let edited = std::fs::read_to_string(&project).unwrap();
    assert!(edited.contains("bind = \"127.0.0.1:4433\""), "the walkthrough's server listens on loopback:\n{edited}");
    assert!(edited.contains("\nmetrics_bind = \"127.0.0.1:9464\""), "and serves /metrics:\n{edited}");
    // This test's own edits: free ports, three rounds.
    let port = free_udp_port().port();
    let metrics = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let edited = edited
        .replace("127.0.0.1:4433", &format!("127.0.0.1:{port}"))
        .replace("127.0.0.1:9464", &metrics.to_string())
        .replace("\nrounds = 100 ", "\nrounds = 3 ");
    assert!(edited.contains("\nrounds = 3 "), "deploy/project.toml's rounds line:\n{edited}");
    std::fs::write(&project, edited).unwrap();
    let done = anchorage::provision::provision(&project, None).unwrap();
    let sites = done.out;

    // deploy/README.md sections 2 and 3 on three "machines": scp -r, the package's /etc/anchorage
    // (0755) and the unit's StateDirectory (made by systemd for the service's user), the copy steps.
    let server_block = sh_block("deploy/README.md", "## 2. The server");
    let device_block = sh_block("deploy/README.md", "## 3. Two devices");
    let machine = |site: &str| -> PathBuf {
        let m = t.join(format!("{site}-machine"));
        copy_folder(&sites.join(site), &m.join("home").join(site));
        std::fs::create_dir_all(m.join("etc/anchorage")).unwrap();
        std::fs::create_dir_all(m.join("var/lib")).unwrap();
        for d in [m.clone(), m.join("etc"), m.join("etc/anchorage"), m.join("var"), m.join("var/lib")] {
            set_mode(&d, 0o755);
        }
        m
    };
    let server_machine = machine("server");
    let server_state = server_machine.join("var/lib/anchorage-server");
    std::fs::create_dir(&server_state).unwrap();
    chown(&server_state, &server_user);
    set_mode(&server_state, 0o700);
    let ran = install_as_documented(&server_block, &server_machine, "server", &server_user);
    println!("server: ran deploy/README.md's {ran:?}");
    let etc = server_machine.join("etc/anchorage");
    assert_eq!(owner_and_mode(&etc.join("key.der")), (server_user.uid, 0o600), "the key is the service's alone");
    for public in ["server.toml", "cert.der", "ca.der", "revoked.crl", "initial-model.bin"] {
        assert_eq!(owner_and_mode(&etc.join(public)), (0, 0o644), "{public}: root's, readable by the service");
    }
    let devices = ["edge-001", "edge-002"];
    let device_machines: Vec<PathBuf> = devices
        .iter()
        .map(|site| {
            let m = machine(site);
            let ran = install_as_documented(&device_block, &m, site, &client_user);
            println!("{site}: ran deploy/README.md's {ran:?}");
            assert_eq!(owner_and_mode(&m.join("etc/anchorage/key.der")), (client_user.uid, 0o600));
            let config = std::fs::read_to_string(m.join("etc/anchorage/client.toml")).unwrap();
            assert!(config.contains("max_memory_mb = 384"), "a training budget within the unit's MemoryMax:\n{config}");
            m
        })
        .collect();

    // The server, as its user, from its copied folder.
    let server_log = t.join("server.log");
    let log = std::fs::File::create(&server_log).unwrap();
    let mut server = Running(
        server_user
            .command(&bin.join("anchorage-server"))
            .arg("--config")
            .arg(etc.join("server.toml"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("the server starts"),
    );
    let server_text = || std::fs::read_to_string(&server_log).unwrap_or_default();
    let cap = Instant::now() + Duration::from_secs(20);
    while !server_text().contains("listening") {
        assert!(server.0.try_wait().unwrap().is_none(), "the server exited as its user:\n{}", server_text());
        assert!(Instant::now() < cap, "the server listens within 20 s:\n{}", server_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, _) = http_get(metrics, "/healthz").unwrap();
    assert_eq!(status, 200, "/healthz on the walkthrough's metrics_bind");

    // `sudo -u anchorage-client anchorage-client doctor --config /etc/anchorage/client.toml`.
    let doctor = |m: &Path| -> Output {
        client_user
            .command(&bin.join("anchorage-client"))
            .arg("doctor")
            .arg("--config")
            .arg(m.join("etc/anchorage/client.toml"))
            .args(["--health-url", &format!("http://{metrics}/healthz"), "--timeout-ms", "3000"])
            .output()
            .expect("the doctor runs")
    };
    assert!(device_block.contains("anchorage-client doctor --config /etc/anchorage/client.toml"));
    let checked = doctor(&device_machines[0]);
    println!("{}", text(&checked));
    assert!(checked.status.success(), "the doctor passes as the device's user:\n{}", text(&checked));

    // Both devices, as their user, from their copied folders.
    let client_logs: Vec<PathBuf> = devices.iter().map(|site| t.join(format!("{site}.log"))).collect();
    let mut clients = Vec::new();
    for (m, log_path) in device_machines.iter().zip(&client_logs) {
        let log = std::fs::File::create(log_path).unwrap();
        let child = client_user
            .command(&bin.join("anchorage-client"))
            .arg("--config")
            .arg(m.join("etc/anchorage/client.toml"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("a client starts");
        clients.push(Running(child));
    }
    let client_text = |i: usize| std::fs::read_to_string(&client_logs[i]).unwrap_or_default();

    // Three rounds, then the server stops by itself.
    let cap = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = server.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < cap,
            "three rounds within 120 s:\n{}\n--- edge-001:\n{}\n--- edge-002:\n{}",
            server_text(),
            client_text(0),
            client_text(1)
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}:\n{}\n--- edge-001:\n{}", server_text(), client_text(0));
    let db_path = server_state.join(anchorage_server::store::DB_FILE);
    assert_eq!(owner_and_mode(&db_path).0, server_user.uid, "the state is the service's");
    let db = rusqlite::Connection::open_with_flags(&db_path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let closed: i64 =
        db.query_row("SELECT COUNT(*) FROM rounds WHERE status = 'aggregated'", [], |r| r.get(0)).unwrap();
    assert_eq!(closed, 3, "three rounds closed:\n{}", server_text());
    let cap = Instant::now() + Duration::from_secs(15);
    while clients.iter_mut().any(|c| c.0.try_wait().unwrap().is_none()) && Instant::now() < cap {
        std::thread::sleep(Duration::from_millis(50));
    }
    for (i, site) in devices.iter().enumerate() {
        let log = client_text(i);
        assert!(!log.contains("Permission denied"), "{site}:\n{log}");
        let exited = clients[i].0.try_wait().unwrap();
        assert!(exited.is_some_and(|s| s.success()), "{site} ends with the run, status 0: {exited:?}\n{log}");
        assert!(std::fs::read_dir(device_machines[i].join("var/lib/anchorage-client")).is_ok());
    }
    drop(clients);

    // What the service's user is told about a file it cannot read: the doctor names it.
    let cert = device_machines[1].join("etc/anchorage/cert.der");
    set_mode(&cert, 0o600);
    let refused = doctor(&device_machines[1]);
    let said = text(&refused);
    println!("{said}");
    assert!(!refused.status.success(), "{said}");
    let line = said.lines().find(|l| l.split_whitespace().nth(1) == Some("certificate")).unwrap_or_default();
    assert!(
        line.trim_start().to_lowercase().starts_with("fail")
            && line.contains(&cert.display().to_string())
            && line.contains("Permission denied"),
        "the doctor says which file the device's user cannot read:\n{said}"
    );
    println!("service_user: done in {:.1} s", started.elapsed().as_secs_f64());
}
