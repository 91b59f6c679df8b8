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
    /// Log lines as JSON, one object per line: the same as `--log-format json`.
    #[arg(long, global = true)]
    pub log_json: bool,
}

impl LogFormatArgs {
    /// The format to log in: JSON under `--log-json`, `--log-format` otherwise.
    pub fn format(&self) -> LogFormat {
        if self.log_json { LogFormat::Json } else { self.log_format }
    }
}

/// `completions <SHELL>`: the binary's shell completion script, on stdout.
#[derive(Debug, Clone, clap::Args)]
pub struct CompletionsArgs {
    /// The shell: bash, zsh, fish, elvish or powershell. E.g. `anchorage completions bash >
    /// /etc/bash_completion.d/anchorage`, or `source <(anchorage completions zsh)`.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// `man [--out DIR]`: the binary's manual pages (roff).
#[derive(Debug, Clone, clap::Args)]
pub struct ManArgs {
    /// Write NAME.1 and one page per subcommand (NAME-SUBCOMMAND.1) into this folder (made if
    /// missing); without it the main page goes to stdout (`anchorage man | man -l -`).
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

/// Prints `command`'s completion script for `args.shell` to stdout (a closed stdout ends it
/// quietly).
pub fn print_completions(mut command: clap::Command, args: &CompletionsArgs) {
    use std::io::Write;
    let name = command.get_name().to_string();
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut command, name, &mut script);
    let _ = std::io::stdout().lock().write_all(&script);
}

/// Writes `command`'s manual pages as [`ManArgs`] says; returns the files written (none when the
/// page went to stdout). Hidden subcommands (`completions`, `man`) get no page.
pub fn write_man(command: clap::Command, args: &ManArgs) -> std::io::Result<Vec<std::path::PathBuf>> {
    use std::io::Write;
    let Some(dir) = &args.out else {
        let mut page = Vec::new();
        clap_mangen::Man::new(command).render(&mut page)?;
        let _ = std::io::stdout().lock().write_all(&page);
        return Ok(Vec::new());
    };
    fn pages(command: clap::Command, dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) -> std::io::Result<()> {
        out.push(clap_mangen::Man::new(command.clone()).generate_to(dir)?);
        for sub in command.get_subcommands().filter(|s| !s.is_hide_set()).cloned() {
            pages(sub, dir, out)?;
        }
        Ok(())
    }
    let named =
        |e: std::io::Error| std::io::Error::new(e.kind(), format!("writing manual pages into {}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(named)?;
    // Built first, so that each subcommand's page is named after its path (`anchorage-ca-init.1`).
    let mut command = command.disable_help_subcommand(true);
    command.build();
    let mut written = Vec::new();
    pages(command, dir, &mut written).map_err(named)?;
    Ok(written)
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

    #[test]
    fn log_json_is_in_the_help() {
        use clap::CommandFactory;
        let help = Cli::command().render_long_help().to_string();
        assert!(help.contains("--log-json") && help.contains("--log-format json"), "{help}");
    }

    #[derive(Parser)]
    #[command(name = "tool")]
    struct Tool {
        #[command(subcommand)]
        command: ToolCommand,
    }

    #[derive(clap::Subcommand)]
    enum ToolCommand {
        /// Does the work.
        Work {
            #[arg(long)]
            fast: bool,
        },
        #[command(hide = true)]
        Completions(CompletionsArgs),
        #[command(hide = true)]
        Man(ManArgs),
    }

    #[test]
    fn manual_pages_for_the_command_and_each_visible_subcommand() {
        use clap::CommandFactory;
        let dir = std::env::temp_dir().join(format!("anchorage-man-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let written = write_man(Tool::command(), &ManArgs { out: Some(dir.join("man1")) }).unwrap();
        let names: Vec<String> =
            written.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(names, ["tool.1", "tool-work.1"]);
        let page = std::fs::read_to_string(&written[1]).unwrap();
        assert!(page.contains(".TH") && page.contains("fast") && page.contains("Does the work"), "{page}");
        std::fs::remove_dir_all(&dir).unwrap();
        // The subcommands parse.
        let shell = Tool::try_parse_from(["tool", "completions", "bash"]).unwrap();
        assert!(matches!(
            shell.command,
            ToolCommand::Completions(CompletionsArgs { shell: clap_complete::Shell::Bash })
        ));
        assert!(Tool::try_parse_from(["tool", "completions", "tcsh"]).is_err());
        let mut script = Vec::new();
        clap_complete::generate(clap_complete::Shell::Bash, &mut Tool::command(), "tool", &mut script);
        assert!(String::from_utf8(script).unwrap().contains("--fast"));
    }
}
