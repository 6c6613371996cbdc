//! Failpoints for the tests that pause a process at a chosen instant:
//! `CAIRN_FAILPOINTS=NAME[,NAME…]` makes the process stop itself (SIGSTOP,
//! every thread, as a pause from outside would) the first time it reaches
//! each named point; the test then resumes it with SIGCONT. Unset, as it
//! always is outside tests, a point costs one read of a parsed list.
//!
//! Points: `fenced-commit` — inside the transaction of a commit made under
//! a queue claim, just after the job's row was locked and the claim
//! checked (`Db::fenced`).

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

/// Stops this process the first time it reaches `name`, if armed.
pub fn hit(name: &str) {
    static ARMED: OnceLock<HashSet<String>> = OnceLock::new();
    static FIRED: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let armed = ARMED.get_or_init(|| {
        std::env::var("CAIRN_FAILPOINTS")
            .map(|v| {
                v.split(',')
                    .map(|p| p.trim().to_string())
                    .filter(|p| !p.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    });
    if !armed.contains(name) {
        return;
    }
    let mut fired = FIRED.lock().unwrap_or_else(|p| p.into_inner());
    if fired.iter().any(|f| f == name) {
        return;
    }
    fired.push(name.to_string());
    drop(fired);
    tracing::warn!("failpoint {name}: stopping this process (SIGSTOP) until it is continued");
    let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
}
