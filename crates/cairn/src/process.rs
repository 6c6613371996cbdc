//! A command run in a sandbox from the terminal: its request from the
//! flags, then followed to its end with stdin, signals and the exit status
//! passed through.

use std::io::{self, Read};

use anyhow::{bail, Result};
use cairn_engine::{Engine, ExecStart, SandboxRecord};
use cairn_protocol::ExecRequest;
use cairn_sandbox::client::SpawnFailure;
use cairn_sandbox::limits::MemorySize;
use nix::sys::signal::{SigSet, Signal};

use crate::cli::ProcessArgs;

pub(crate) fn request(process: &ProcessArgs, argv: Vec<String>, detach: bool) -> Result<ExecRequest> {
    let env = process
        .env
        .iter()
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => bail!("--env takes KEY=VALUE, got {kv:?}"),
        })
        .collect::<Result<Vec<_>>>()?;
    let timeout_ms = match process.timeout {
        Some(t) if t.is_finite() && t > 0.0 => Some((t * 1000.0) as u64),
        Some(t) => bail!("--timeout takes a positive number of seconds, got {t}"),
        None => None,
    };
    Ok(ExecRequest {
        argv,
        env,
        cwd: process.workdir.clone(),
        stdin: process.interactive,
        timeout_ms,
        detach,
        user: None,
    })
}

/// Follows a started process to its end (or prints its pid, detached) and
/// returns the exit status to pass on.
pub(crate) fn follow(
    engine: &Engine,
    rec: &SandboxRecord,
    process: &ProcessArgs,
    start: Result<ExecStart, SpawnFailure>,
    detach: bool,
) -> Result<i32> {
    let start = match start {
        Ok(start) => start,
        Err(failure) => {
            eprintln!("cairn: {}", failure.message);
            return Ok(failure.kind.shell_code());
        }
    };
    if detach {
        println!("{}", start.session.pid);
        return Ok(0);
    }
    let control = start.session.control();
    forward_signals(control.clone());
    if process.interactive {
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 << 10];
            let mut stdin = io::stdin().lock();
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if control.stdin(&buf[..n]).is_err() {
                            return;
                        }
                    }
                }
            }
            let _ = control.close_stdin();
        });
    }
    let status = match start.session.wait(&mut io::stdout().lock(), &mut io::stderr().lock()) {
        Ok(status) => status,
        // The connection ended with the sandbox: say why, when it is known.
        Err(e) => return Err(engine.init_gone(rec).map_or_else(|| e.into(), anyhow::Error::from)),
    };
    let Some(status) = status else { return Ok(0) };
    if status.timed_out {
        eprintln!(
            "cairn: the command timed out after {}s and was killed",
            process.timeout.unwrap_or_default()
        );
        return Ok(124);
    }
    if engine.oom_killed_since(&start.probe) {
        let limit = MemorySize(rec.memory_bytes);
        if status.signal == Some(libc::SIGKILL) {
            eprintln!(
                "cairn: the command was killed by the OOM killer (out of memory): the sandbox's memory limit is {limit}; raise --memory"
            );
        } else if status.code != Some(0) {
            // Another process of the sandbox took the kill (under gVisor, a
            // process of the sentry's; the command saw its memory refused).
            eprintln!(
                "cairn: the sandbox reached its memory limit ({limit}) while the command ran, and the OOM killer killed a process; raise --memory"
            );
        }
    }
    Ok(status.shell_code())
}

/// Ctrl-C and friends go to the process in the sandbox, not to Cairn.
fn forward_signals(control: cairn_sandbox::client::ExecControl) {
    let mut set = SigSet::empty();
    for s in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP, Signal::SIGQUIT] {
        set.add(s);
    }
    if set.thread_block().is_err() {
        return;
    }
    std::thread::spawn(move || loop {
        match set.wait() {
            Ok(sig) => {
                if control.signal(sig as i32).is_err() {
                    return;
                }
            }
            Err(_) => return,
        }
    });
}
