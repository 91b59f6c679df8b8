//! What the binary tests of `anchorage sim` share: running the binary in a folder and reading a
//! run folder back.
#![allow(dead_code)] // each test file uses its own part

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// `anchorage ARGS` in `dir`, with no data folder or log filter from the environment.
pub(crate) fn anchorage(dir: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_anchorage"));
    command.args(args).current_dir(dir).env_remove("ANCHORAGE_DATA").env_remove("ANCHORAGE_LOG");
    command
}

/// Waits for `child` (killed and a panic after two minutes); its exit code.
pub(crate) fn wait(child: &mut Child) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status.code().unwrap_or(-1);
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("anchorage still running after 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A JSON file, parsed (a panic naming the file otherwise).
pub(crate) fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} does not parse: {e}\n{text}", path.display()))
}

/// A run folder's metrics.json.
pub(crate) fn metrics(run: &Path) -> serde_json::Value {
    json(&run.join("metrics.json"))
}

/// A run folder's config.toml.
pub(crate) fn config(run: &Path) -> toml::Table {
    toml::from_str(&std::fs::read_to_string(run.join("config.toml")).unwrap()).unwrap()
}

/// Everything in metrics.json that does not measure the host's time.
pub(crate) fn deterministic(mut m: serde_json::Value) -> serde_json::Value {
    let o = m.as_object_mut().unwrap();
    for key in ["wall_seconds", "efficiency"] {
        o.remove(key);
    }
    for row in o["rounds"].as_array_mut().unwrap() {
        row.as_object_mut().unwrap().remove("seconds");
    }
    m
}
