//! `anchorage-client doctor`, built inside the tests package so that its integration test can
//! run it as a process and read its exit status (Cargo gives a test the path of its own
//! package's binaries only). The checks are the client library's own, not a copy; the arguments
//! are the subcommand's (`--config client.toml` and [`DoctorArgs`]).

use std::path::PathBuf;
use std::process::ExitCode;

use anchorage_client::doctor::{self, DoctorArgs};
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[arg(long, short)]
    config: PathBuf,
    #[command(flatten)]
    args: DoctorArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    doctor::main(&cli.config, &cli.args)
}
