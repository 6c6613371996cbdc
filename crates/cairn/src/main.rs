//! The `cairn` binary: command-line parsing and wiring to the engine.

mod bench;
mod cli;
mod commands;
mod lineage;
mod pipelines;
mod progress;

use std::process::ExitCode;

use clap::Parser;

/// Exit status for Cairn's own failures (as opposed to the command's).
pub(crate) const CAIRN_FAILED: u8 = 125;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    let filter = if cli.verbose { "debug" } else { "warn" };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("CAIRN_LOG").unwrap_or_else(|_| filter.into()))
        .without_time()
        .init();
    match commands::dispatch(cli) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("cairn: error: {e:#}");
            ExitCode::from(CAIRN_FAILED)
        }
    }
}
