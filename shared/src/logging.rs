//! How the three binaries (`anchorage`, `anchorage-server`, `anchorage-client`) log: tracing to
//! stderr, as text (ANSI colour only when stderr is a terminal and `NO_COLOR` is unset) or as
//! JSON lines (`--log-format json` or `ANCHORAGE_LOG_FORMAT=json`), one object per event with its
//! fields at the top level, for journald, Loki or Elasticsearch. Errors go into a field as text,
//! their causes included (`error = %format!("{e:#}")` for an `anyhow::Error`), never as a Rust
//! debug struct. One copy for all three.

use std::io::IsTerminal;
#[allow(unused_imports)]
use std::prelude::rust_2024::*;

/// `--log-format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// The log format flags every binary takes (its `--log` filter stays its own: defaults differ).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct LogFormatArgs {
    /// Log lines as `text` (colour only on a terminal) or `json` (one object per line).
    #[arg(long, global = true, env = "ANCHORAGE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// The same as `--log-format json` (kept for existing units and manifests).
    #[arg(long, global = true, hide = true)]
    pub log_json: bool,
}

impl LogFormatArgs {
    pub fn format(&self) -> LogFormat {
        if self.log_json { LogFormat::Json } else { self.log_format }
    }
}

/// Whether text logs get ANSI colours: only on a terminal, and not under `NO_COLOR`.
pub fn colour() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Installs the process's subscriber: `filter` in `EnvFilter` syntax (`info`,
/// `anchorage_server=debug`), events to stderr in `format`. A second call keeps the first.
pub fn init(filter: &str, format: LogFormat) -> Result<(), tracing_subscriber::filter::ParseError> {
    let filter = tracing_subscriber::EnvFilter::try_new(filter)?;
    let fmt = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => fmt.with_ansi(colour()).try_init(),
        LogFormat::Json => fmt.json().flatten_event(true).with_ansi(false).try_init(),
    };
    Ok(())
}

/// A binary's end: under JSON logs a fatal error is one more JSON line (its causes as text) and
/// the exit status 1; under text logs it is returned for `main` to print as usual.
pub fn exit_on_error<T, E: core::fmt::Display>(result: Result<T, E>, format: LogFormat) -> Result<T, E> {
    match (result, format) {
        (Err(e), LogFormat::Json) => {
            tracing::error!(error = %format_args!("{e:#}"), "stopped");
            std::process::exit(1)
        }
        (result, _) => result,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        log: LogFormatArgs,
    }

    #[test]
    fn the_format_is_a_flag_or_the_old_switch() {
        let parse = |args: &[&str]| Cli::try_parse_from([&["x"], args].concat()).map(|c| c.log.format());
        assert_eq!(parse(&[]).unwrap(), LogFormat::Text);
        assert_eq!(parse(&["--log-format", "json"]).unwrap(), LogFormat::Json);
        assert_eq!(parse(&["--log-json"]).unwrap(), LogFormat::Json);
        assert!(parse(&["--log-format", "xml"]).is_err());
        // Tests run with stderr captured or redirected: no colour codes there.
        if !std::io::stderr().is_terminal() {
            assert!(!colour());
        }
        assert!(init("not a [valid filter", LogFormat::Text).is_err());
    }
}
