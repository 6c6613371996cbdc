//! The `cairn` binary: command-line parsing and wiring to the engine.

mod agent;
mod bench;
mod bundle;
mod caller;
mod cli;
mod commands;
mod doctor;
mod host_files;
mod lineage;
mod pipelines;
mod process;
mod progress;
mod sessions;
mod terminal;
mod worker;

use std::process::ExitCode;

use clap::Parser;

/// Exit status for Cairn's own failures (as opposed to the command's).
pub(crate) const CAIRN_FAILED: u8 = 125;

/// The umask Cairn was started with: files it writes for the user outside
/// the state directory (`cairn cp` out, `artifact get -o`) follow it.
pub(crate) fn user_umask() -> u32 {
    *USER_UMASK.get().unwrap_or(&0o022)
}

static USER_UMASK: std::sync::OnceLock<u32> = std::sync::OnceLock::new();

/// The init to start before the command line is parsed: this build's, when
/// it is installed in the state directory the environment names and the
/// command is `run` or `create` with neither `--home` nor `--driver` before
/// `--` (those are left to the parse; the engine then starts init as
/// usual). A sandbox's start waits for its init to make its namespaces and
/// fork PID 1, so init starts first.
fn first_init() -> Option<std::path::PathBuf> {
    let mut args = std::env::args_os().skip(1);
    let command = args.next()?;
    if (command != "run" && command != "create") || !nix::unistd::geteuid().is_root() {
        return None;
    }
    for arg in args.take_while(|a| a != "--") {
        let arg = arg.as_encoded_bytes();
        if arg.starts_with(b"--home") || arg.starts_with(b"--driver") {
            return None;
        }
    }
    cairn_sandbox::init_binary::installed(&cairn_engine::Home::from_env().lib())
}

fn main() -> ExitCode {
    // Everything Cairn itself creates (state, store, layers, logs) is
    // root's alone: 0600 files, 0700 directories.
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    let _ = USER_UMASK.set(old.bits());
    if let Some(init) = first_init() {
        cairn_sandbox::native::start_init_first(&init);
    }
    let cli = cli::Cli::parse();
    // The server logs each request; the CLI only what went wrong.
    let serving = matches!(cli.command, cli::Command::Serve { openapi: false, .. });
    let filter = match (cli.verbose, serving) {
        (true, _) => "debug",
        (false, true) => "info",
        (false, false) => "warn",
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("CAIRN_LOG").unwrap_or_else(|_| filter.into()))
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
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
