//! Progress bars for the slow parts before and during a run (loading data, computing frozen
//! features, rounds), on stderr and only when the command line asked for them.
//!
//! One process-wide switch rather than a handle threaded through every constructor: the
//! library's callers (tests, fleet workers, benches) get no bars by default, and only
//! `anchorage sim` in its human console mode turns them on. indicatif hides a bar by itself when
//! stderr is not a terminal.

use std::sync::atomic::{AtomicBool, Ordering};

use indicatif::{ProgressBar, ProgressStyle};

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Turns the bars on or off for this process.
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// A bar counting `len` items of `what` (hidden when bars are off).
pub fn bar(len: u64, what: &str) -> ProgressBar {
    if !ENABLED.load(Ordering::Relaxed) {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    let template = format!("{{spinner}} {what} {{pos}}/{{len}} [{{bar:30}}] {{elapsed_precise}} eta {{eta}} {{msg}}");
    if let Ok(style) = ProgressStyle::with_template(&template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// A spinner with a message, for work whose size is not known ahead (reading files).
pub fn spinner(message: String) -> ProgressBar {
    if !ENABLED.load(Ordering::Relaxed) {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new_spinner();
    if let Ok(style) = ProgressStyle::with_template("{spinner} {msg} {elapsed_precise}") {
        bar.set_style(style);
    }
    bar.set_message(message);
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    bar
}
