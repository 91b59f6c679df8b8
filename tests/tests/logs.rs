//! The server program's logs as an operator's tools read them: off a terminal, text logs carry
//! no ANSI colour codes; `--log-format json` gives one JSON object per line; a fatal error's
//! causes are printed as text (the `{:#}` chain), never as Rust debug structures.

use std::path::Path;
use std::process::{Command, Output, Stdio};

/// A server.toml whose state folder cannot be made (its path is a file): the server stops at
/// start with an error that has a cause. Development TLS, so that the certificates (checked
/// before the state folder) are not what stops it.
fn broken_config(dir: &Path) -> std::path::PathBuf {
    let blocker = dir.join("not-a-folder");
    std::fs::write(&blocker, b"a file").unwrap();
    let config = dir.join("server.toml");
    std::fs::write(
        &config,
        format!(
            "method = \"fedavg\"\nbind = \"127.0.0.1:0\"\ninsecure_dev = true\nstate_dir = \"{}\"\ntls_dir = \"{}\"\n",
            blocker.join("state").display(),
            dir.join("tls").display()
        ),
    )
    .unwrap();
    config
}

fn server(config: &Path, format: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_server-process"))
        .arg("--config")
        .arg(config)
        .args(["--log-format", format])
        .env("ANCHORAGE_LOG", "info")
        .env_remove("NO_COLOR")
        .stdin(Stdio::null())
        .output()
        .expect("the server program runs")
}

#[test]
fn logs_off_a_terminal_are_plain_text_or_json_lines_with_causes_as_text() {
    let dir = tempfile::tempdir().unwrap();
    let config = broken_config(dir.path());

    let text = server(&config, "text");
    let stderr = String::from_utf8_lossy(&text.stderr);
    println!("text:\n{stderr}");
    assert!(!text.status.success(), "{stderr}");
    assert!(!stderr.contains('\u{1b}'), "no ANSI escape codes when stderr is a file or pipe: {stderr:?}");
    assert!(stderr.contains("opening the state folder"), "{stderr}");
    assert!(!stderr.contains("Os {") && !stderr.contains("kind: "), "causes as text, not debug structs: {stderr}");

    let json = server(&config, "json");
    let stderr = String::from_utf8_lossy(&json.stderr);
    println!("json:\n{stderr}");
    assert_eq!(json.status.code(), Some(1), "{stderr}");
    let lines: Vec<serde_json::Value> = stderr
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}")))
        .collect();
    assert!(!lines.is_empty(), "at least the fatal error is logged");
    assert!(!stderr.contains('\u{1b}'), "{stderr:?}");
    let fatal = lines.last().unwrap();
    assert_eq!(fatal["level"], "ERROR", "{fatal}");
    let error = fatal["error"].as_str().unwrap_or_else(|| panic!("an error field: {fatal}"));
    assert!(error.contains("opening the state folder") && error.contains(": "), "the cause chain as text: {error}");
    assert!(!error.contains("Os {"), "{error}");
    assert_eq!(error.matches("Not a directory").count(), 1, "each cause once: {error}");
}
