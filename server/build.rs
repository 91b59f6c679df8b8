//! The git commit the server is built from, for `anchorage_build_info{git_commit}`: the
//! `ANCHORAGE_GIT_COMMIT` environment variable if set (a packaging or container build without
//! `.git`), else `git rev-parse`, else "unknown". Reruns when HEAD moves.

use std::path::Path;
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).current_dir(dir).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string()).filter(|s| !s.is_empty())
}

fn main() {
    println!("cargo:rerun-if-env-changed=ANCHORAGE_GIT_COMMIT");
    if std::env::var_os("ANCHORAGE_GIT_COMMIT").is_some() {
        return; // read by option_env! as it is
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let Some(commit) = git(dir, &["rev-parse", "--short=12", "HEAD"]) else { return };
    println!("cargo:rustc-env=ANCHORAGE_GIT_COMMIT={commit}");
    // HEAD and the branch it names (only files that exist: a missing one would rerun every build).
    let mut watch = vec!["HEAD".to_string()];
    watch.extend(git(dir, &["symbolic-ref", "-q", "HEAD"]));
    watch.push("packed-refs".into());
    for name in watch {
        if let Some(path) = git(dir, &["rev-parse", "--path-format=absolute", "--git-path", &name])
            && Path::new(&path).exists()
        {
            println!("cargo:rerun-if-changed={path}");
        }
    }
}
