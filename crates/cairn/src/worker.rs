//! `cairn worker`: runs jobs from the shared stage queue until stopped, and
//! lists workers and jobs.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use cairn_engine::{Engine, Home};
use cairn_pipeline::prelude::*;
use cairn_pipeline::queue::{Job, Orphan};
use cairn_pipeline::run::RunWatcher;
use cairn_pipeline::worker::{run_worker, WorkerOptions, WorkerWatch};

use crate::cli::{WorkerArgs, WorkerCommand};

static STOPS: AtomicUsize = AtomicUsize::new(0);
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop(_: libc::c_int) {
    // The first stop drains; the second exits at once (leases then expire).
    if STOPS.fetch_add(1, Ordering::SeqCst) >= 1 {
        // SAFETY: _exit is async-signal-safe; nothing is unwound or flushed.
        unsafe { libc::_exit(130) };
    }
    STOP.store(true, Ordering::SeqCst);
}

/// Prints what the worker does on stderr (or JSON lines on stdout).
struct Printer {
    json: bool,
}

impl RunWatcher for Printer {
    fn stage(&self, stage: &str, branch: &str, status: &str, detail: &str) {
        if self.json {
            return;
        }
        let name = if branch.is_empty() {
            stage.to_string()
        } else {
            format!("{stage}[{branch}]")
        };
        eprintln!("cairn: {name:<24} {status:<10} {detail}");
    }
    fn output(&self, _: &str, _: &str, _: &[u8]) {}
}

impl WorkerWatch for Printer {
    fn job(&self, job: &Job, what: &str, detail: &str) {
        if self.json {
            let line = serde_json::json!({
                "job": job.id, "run": job.run_id, "kind": job.kind, "stage": job.stage,
                "branch": job.branch, "epoch": job.epoch, "event": what, "detail": detail,
            });
            println!("{line}");
        } else {
            eprintln!("cairn: job {} {what}: {detail}", job.id);
        }
    }

    fn orphan(&self, o: &Orphan) {
        if self.json {
            let line = serde_json::json!({
                "job": o.job, "run": o.run_id, "stage": o.stage, "branch": o.branch, "epoch": o.epoch,
                "sandbox": o.sandbox_id, "event": "orphan-reaped", "detail": o.reason,
            });
            println!("{line}");
        } else {
            eprintln!(
                "cairn: removed sandbox {} of run {} (claim {} of job {}): {}",
                o.sandbox_id, o.run_id, o.epoch, o.job, o.reason
            );
        }
    }

    fn unreachable(&self, error: &str) {
        if self.json {
            println!("{}", serde_json::json!({"event": "unreachable", "detail": error}));
        } else {
            eprintln!("cairn: the stage queue is unreachable ({error}); trying again");
        }
    }
}

fn secs(s: f64, what: &str) -> Result<Duration> {
    Duration::try_from_secs_f64(s).with_context(|| format!("--{what} takes a number of seconds, got {s}"))
}

pub fn worker(home: Home, opts: WorkerArgs, list: Option<WorkerCommand>) -> Result<i32> {
    match list {
        Some(WorkerCommand::Ls { json }) => return workers(&Engine::open(home)?, json).map(|()| 0),
        Some(WorkerCommand::Jobs { json }) => return jobs(&Engine::open(home)?, json).map(|()| 0),
        None => {}
    }
    let options = WorkerOptions {
        slots: opts.slots as usize,
        lease: secs(opts.lease, "lease")?,
        poll: secs(opts.poll, "poll")?,
        idle_exit: opts.idle_exit.map(|s| secs(s, "idle-exit")).transpose()?,
    };
    if options.lease < Duration::from_secs(1) {
        anyhow::bail!("--lease must be at least 1 second (heartbeats renew it a third of it apart)");
    }
    let handler = nix::sys::signal::SigAction::new(
        nix::sys::signal::SigHandler::Handler(on_stop),
        nix::sys::signal::SaFlags::empty(),
        nix::sys::signal::SigSet::empty(),
    );
    for sig in [nix::sys::signal::Signal::SIGTERM, nix::sys::signal::Signal::SIGINT] {
        // SAFETY: the handler only touches atomics and calls _exit, both
        // async-signal-safe.
        unsafe { nix::sys::signal::sigaction(sig, &handler) }.context("installing the stop handler")?;
    }
    let printer = Printer { json: opts.json };
    let me = run_worker(home, &options, &STOP, &printer)?;
    if !opts.json {
        eprintln!("cairn: worker {} stopped", me.id);
    }
    Ok(0)
}

fn workers(engine: &Engine, json: bool) -> Result<()> {
    let all = engine.workers()?;
    if json {
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    println!("{:<32} {:<6} {:<10} {:<8} HOME", "WORKER", "SLOTS", "SEEN", "STATE");
    let now = engine.clock_ms()?;
    for w in all {
        let state = if w.stopped_at.is_some() { "stopped" } else { "running" };
        println!(
            "{:<32} {:<6} {:<10} {:<8} {}",
            w.id,
            w.slots,
            format!("{}s ago", (now - w.seen_at).max(0) / 1000),
            state,
            w.home_path
        );
    }
    Ok(())
}

fn jobs(engine: &Engine, json: bool) -> Result<()> {
    let all = engine.jobs()?;
    if json {
        println!("{}", serde_json::to_string_pretty(&all)?);
        return Ok(());
    }
    println!(
        "{:<40} {:<7} {:<8} {:<6} {:<10} WORKER",
        "JOB", "KIND", "STATUS", "CLAIM", "LEASE"
    );
    for j in all {
        let lease = j
            .lease_left_ms
            .map(|l| {
                if l >= 0 {
                    format!("{}s", l / 1000)
                } else {
                    "expired".into()
                }
            })
            .unwrap_or_default();
        println!(
            "{:<40} {:<7} {:<8} {:<6} {:<10} {}",
            j.id,
            j.kind,
            j.status,
            j.epoch,
            lease,
            j.worker.unwrap_or_default()
        );
    }
    Ok(())
}
