//! Helpers shared by the integration tests: the real-data directory and scratch directories.
#![allow(dead_code)]

use std::path::PathBuf;

/// The real-data directory from `ANCHORAGE_DATA`, or `None` after a loud skip line on stderr.
pub(crate) fn data_dir(test: &str) -> Option<PathBuf> {
    match std::env::var_os("ANCHORAGE_DATA") {
        Some(d) if !d.is_empty() => {
            let d = PathBuf::from(d);
            eprintln!("{test}: using real data in {}", d.display());
            Some(d)
        }
        _ => {
            anchorage_shared::skip::skipped(&format!(
                "{test}: ANCHORAGE_DATA not set, and it needs the real data files (ANCHORAGE_DATA=../shared/data)"
            ));
            None
        }
    }
}

/// A fresh, empty scratch directory for one test.
pub(crate) fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("anchorage-data-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Like [`data_dir`], for tests that still run without the files (on generated or stand-in labels).
pub(crate) fn data_dir_or_stand_in(test: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("ANCHORAGE_DATA").filter(|d| !d.is_empty()).map(PathBuf::from);
    if dir.is_none() {
        use std::io::Write;
        let line = format!(
            "\n*** ANCHORAGE_DATA not set — {test} runs on generated / stand-in labels, not the real files ***\n"
        );
        let _ = std::io::stderr().write_all(line.as_bytes());
    }
    dir
}
