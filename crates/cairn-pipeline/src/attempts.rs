//! The attempts this process runs under queue claims, by sandbox: what a
//! worker's watchdog stops when its claim lapses, and what its reaper of
//! orphaned stage sandboxes leaves to the attempts themselves.

use std::sync::Mutex;

use crate::queue::Fence;

/// The sandboxes of the attempts this process runs under a claim, with
/// their init's pid and start time: what the watchdog stops when the claim
/// was not renewed for a whole lease (the state store unreachable), without
/// needing the store to find them; and what this process's reaper leaves to
/// the attempts themselves.
static ATTEMPTS: Mutex<Vec<(Fence, String, i32, u64)>> = Mutex::new(Vec::new());

/// An attempt of this process running in a sandbox under a claim, from
/// its sandbox's creation until it is dropped (the attempt's end).
pub(crate) struct Attempt {
    sandbox: String,
}

impl Attempt {
    pub(crate) fn start(fence: &Fence, sandbox: &cairn_engine::SandboxRecord) -> Attempt {
        let (pid, start) = (sandbox.pid.unwrap_or(0), sandbox.pid_start.unwrap_or(0));
        ATTEMPTS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((fence.clone(), sandbox.id.clone(), pid, start));
        Attempt {
            sandbox: sandbox.id.clone(),
        }
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        ATTEMPTS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(_, sandbox, _, _)| *sandbox != self.sandbox);
    }
}

/// Whether an attempt of this process runs in `sandbox`.
pub(crate) fn attempt_runs_in(sandbox: &str) -> bool {
    ATTEMPTS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .any(|(_, s, _, _)| s == sandbox)
}

/// Stops the attempts of `fence` this process runs: their sandboxes' init
/// is killed, and every process of the sandbox with it. Each attempt then
/// loses its sandbox, its outcome is refused by the fence, and it removes
/// the sandbox.
pub(crate) fn stop_attempts(fence: &Fence) -> Vec<String> {
    let all = ATTEMPTS.lock().unwrap_or_else(|p| p.into_inner());
    let mut stopped = Vec::new();
    for (f, sandbox, pid, start) in all.iter() {
        if f == fence && *pid > 0 && cairn_sandbox::process_alive(*pid, *start) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid), nix::sys::signal::Signal::SIGKILL);
            stopped.push(sandbox.clone());
        }
    }
    stopped
}
