//! `anchorage`'s operator tools as a user meets them: the CA commands run from the wrong folder
//! say where the CA is expected, a revoked id is not renewed silently, an empty config file is an
//! error rather than the embedded default, and the command line has what a Rust CLI's users
//! expect (`--log-json` in the help, shell completions, man pages).

use std::path::Path;
use std::process::{Command, Output};

fn anchorage(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_anchorage"))
        .args(args)
        .current_dir(dir)
        .env_remove("ANCHORAGE_LOG")
        .env_remove("ANCHORAGE_DATA")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn ca_commands_outside_the_project_point_at_dir_not_at_init() {
    let dir = tempfile::tempdir().unwrap();
    let project = dir.path().join("project");
    assert!(anchorage(dir.path(), &["ca", "init", "--dir", "project/ca"]).status.success());
    std::fs::create_dir_all(project.join("sites")).unwrap();
    // From the sites folder: no ./ca here.
    let wrong = project.join("sites");
    for args in [&["ca", "list"][..], &["ca", "revoke", "edge-001"], &["ca", "renew", "edge-001"]] {
        let out = anchorage(&wrong, args);
        assert!(!out.status.success(), "{args:?}");
        let err = stderr(&out);
        assert!(err.contains("the project CA is not here") && err.contains("--dir <project>/ca"), "{args:?}: {err}");
        assert!(!err.contains("run `anchorage ca init` first"), "{err}");
    }
    assert!(!wrong.join("ca").exists(), "nothing made");
    // With --dir it works from there, and from the project folder without it.
    assert!(anchorage(&wrong, &["ca", "list", "--dir", "../ca"]).status.success());
    let list = anchorage(&project, &["ca", "list"]);
    assert!(list.status.success() && stdout(&list).starts_with("id"), "{}", stderr(&list));
}

#[test]
fn renewing_a_revoked_id_is_refused_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    let ok = |args: &[&str]| {
        let out = anchorage(dir.path(), args);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        out
    };
    ok(&["ca", "init"]);
    ok(&["ca", "issue", "client", "edge-001"]);
    ok(&["ca", "issue", "client", "edge-002"]);
    ok(&["ca", "revoke", "edge-001"]);
    let cert = std::fs::read(dir.path().join("edge-001/cert.der")).unwrap();

    let refused = anchorage(dir.path(), &["ca", "renew", "edge-001"]);
    assert!(!refused.status.success());
    let err = stderr(&refused);
    let today = anchorage_pki::site::date(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64,
    );
    assert!(err.contains("`edge-001` was revoked on") && err.contains(&today), "{err}");
    assert!(err.contains("--force") && err.contains("un-revoke"), "{err}");
    assert_eq!(std::fs::read(dir.path().join("edge-001/cert.der")).unwrap(), cert, "nothing issued");
    let ca = anchorage_pki::ProjectCa::open(&dir.path().join("ca")).unwrap();
    assert_eq!(ca.issued().iter().filter(|i| i.id == "edge-001").count(), 1);

    // A live id renews as before; --force renews a revoked one, and says so.
    ok(&["ca", "renew", "edge-002"]);
    let forced = ok(&["ca", "renew", "edge-001", "--force"]);
    assert!(stderr(&forced).contains("was revoked on"), "{}", stderr(&forced));
    let ca = anchorage_pki::ProjectCa::open(&dir.path().join("ca")).unwrap();
    let edge: Vec<_> = ca.issued().iter().filter(|i| i.id == "edge-001").collect();
    assert_eq!(edge.len(), 2);
    assert!(edge[0].revoked_at.is_some() && edge[1].revoked_at.is_none(), "the old one stays revoked");
    // After a renewal and the old certificate's revocation by serial, the id is live: no --force.
    let old = ca.issued().iter().find(|i| i.id == "edge-002").unwrap().serial.clone();
    ok(&["ca", "revoke", "edge-002", "--serial", &old]);
    ok(&["ca", "renew", "edge-002"]);
}

#[test]
fn an_empty_config_file_is_refused_not_the_default() {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in [("empty.toml", ""), ("blank.toml", "\n  \n"), ("comments.toml", "# a scenario, some day\n")] {
        std::fs::write(dir.path().join(name), text).unwrap();
        let out = anchorage(dir.path(), &["sim", name, "--rounds", "1"]);
        assert!(!out.status.success(), "{name}: {}", stdout(&out));
        assert!(stderr(&out).contains(&format!("{name} is empty")), "{name}: {}", stderr(&out));
        let fleet = anchorage(dir.path(), &["fleet", "--scenario", name, "--local", "1"]);
        assert!(!fleet.status.success() && stderr(&fleet).contains("is empty"), "{}", stderr(&fleet));
    }
    assert!(!dir.path().join("runs").exists(), "no run folder");
}

#[test]
fn help_completions_and_man_pages() {
    let dir = tempfile::tempdir().unwrap();
    let help = stdout(&anchorage(dir.path(), &["sim", "--help"]));
    assert!(help.contains("--log-json") && help.contains("--log-format"), "{help}");
    let top = stdout(&anchorage(dir.path(), &["--help"]));
    assert!(top.contains("--log-json") && top.contains("anchorage completions"), "{top}");

    let bash = anchorage(dir.path(), &["completions", "bash"]);
    assert!(bash.status.success());
    let script = stdout(&bash);
    assert!(script.contains("_anchorage() {") && script.contains("provision"), "{script}");
    let fish = stdout(&anchorage(dir.path(), &["completions", "fish"]));
    assert!(fish.contains("complete -c anchorage"), "{fish}");
    assert!(!anchorage(dir.path(), &["completions", "cmd.exe"]).status.success());

    let man = anchorage(dir.path(), &["man", "--out", "man1"]);
    assert!(man.status.success(), "{}", stderr(&man));
    let listed = stdout(&man);
    for page in
        ["anchorage.1", "anchorage-sim.1", "anchorage-ca.1", "anchorage-ca-renew.1", "anchorage-data-describe.1"]
    {
        let roff =
            std::fs::read_to_string(dir.path().join("man1").join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(roff.contains(".TH") && listed.contains(page), "{page}");
    }
    let renew = std::fs::read_to_string(dir.path().join("man1/anchorage-ca-renew.1")).unwrap();
    assert!(renew.contains("force"), "{renew}");
    assert!(!dir.path().join("man1/anchorage-man.1").exists(), "hidden commands get no page");
    assert!(stdout(&anchorage(dir.path(), &["man"])).contains(".TH anchorage 1"));
}
