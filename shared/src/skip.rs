//! A check that a test cannot run on this machine, said loudly: straight to the process's stderr
//! (the test harness captures `print!` and `eprint!` of a passing test, not the handle), and
//! appended to the file `ANCHORAGE_SKIP_LOG` names, which `.ci/run` prints after the suite.

use std::format;
use std::io::Write;

/// Says that `what` was skipped and how to run it (`what` names the check and the install hint).
pub fn skipped(what: &str) {
    let line = format!("*** SKIPPED {what} ***");
    let _ = writeln!(std::io::stderr(), "\n{line}\n");
    if let Some(path) = std::env::var_os("ANCHORAGE_SKIP_LOG")
        && let Ok(mut log) = std::fs::OpenOptions::new().create(true).append(true).open(path)
    {
        let _ = writeln!(log, "{line}");
    }
}
