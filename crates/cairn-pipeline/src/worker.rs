//! `cairn worker`: claims jobs from the shared stage queue (see `queue`)
//! and runs them on this host, each in a thread with its own engine and
//! its claim as the fence on every commit.
//!
//! One heartbeat thread renews the leases of every job held; a job whose
//! renewal is refused (its lease expired and another worker claimed it)
//! is renewed no more, and its next commit is refused by the fence. Each
//! loop also returns expired leases to the queue (the reaper), so a dead
//! worker's jobs are taken within a lease. PostgreSQL wakes idle workers
//! with NOTIFY; they poll as well, so a lost notification costs one poll.
//!
//! A worker also reaps orphans on its home, when it starts and then once a
//! lease: sandboxes of attempts whose claim moved on (a takeover after this
//! host died or stalled, a fenced-off commit), recorded on their run
//! (`orphan-reaped`) and removed ([`Workers::reap_orphans`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::attempts::{attempt_runs_in, stop_attempts};
use crate::prelude::*;
use crate::queue::{Fence, Job, Orphan, WorkerRecord};
use crate::watch::RunWatcher;
use cairn_engine::state::{Db, StateError};
use cairn_engine::{now_ms, Engine, EngineError, Home};

/// How a worker runs.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Jobs run at once; a run waiting for its branches lends its slot.
    pub slots: usize,
    /// How long a claim holds without a heartbeat.
    pub lease: Duration,
    /// How often an idle worker looks at the queue without a wake-up.
    pub poll: Duration,
    /// Stop once the queue has been empty and nothing ran for this long
    /// (for scripts and tests); `None`: run until stopped.
    pub idle_exit: Option<Duration>,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        WorkerOptions {
            slots: 2,
            lease: Duration::from_secs(30),
            poll: Duration::from_secs(1),
            idle_exit: None,
        }
    }
}

/// What a worker tells whoever watches it.
pub trait WorkerWatch: RunWatcher {
    /// A job was claimed, ended, lost or failed.
    fn job(&self, job: &Job, what: &str, detail: &str);
    /// An orphaned sandbox on this home was recorded and removed.
    fn orphan(&self, orphan: &Orphan);
    /// The state store did not answer; the worker tries again.
    fn unreachable(&self, error: &str);
}

/// Slots for jobs: a counting semaphore a waiting run lends back.
pub struct Slots {
    free: Mutex<usize>,
    changed: Condvar,
}

impl Slots {
    fn new(n: usize) -> Slots {
        Slots {
            free: Mutex::new(n),
            changed: Condvar::new(),
        }
    }

    fn try_take(&self) -> bool {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if *free == 0 {
            return false;
        }
        *free -= 1;
        true
    }

    fn take(&self) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        while *free == 0 {
            free = self.changed.wait(free).unwrap_or_else(|p| p.into_inner());
        }
        *free -= 1;
    }

    fn give(&self) {
        *self.free.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.changed.notify_all();
    }

    /// Gives the caller's slot back until the guard drops, which takes one
    /// again (waiting for it): a run waiting for its branches holds none.
    pub fn lend(self: &Arc<Self>) -> Lent {
        self.give();
        Lent(self.clone())
    }
}

pub struct Lent(Arc<Slots>);

impl Drop for Lent {
    fn drop(&mut self) {
        self.0.take();
    }
}

/// The claims this worker holds, by job, each with when it was last
/// claimed or renewed: the heartbeat renews them, the watchdog gives up
/// on those not renewed for a lease.
type Held = Arc<Mutex<HashMap<String, (Fence, Instant)>>>;

/// Forgets `fence` if it is still the claim held on its job (the worker
/// may hold the job again under a newer one).
fn forget(held: &Held, fence: &Fence) {
    let mut held = held.lock().unwrap_or_else(|p| p.into_inner());
    if held.get(&fence.job).is_some_and(|(f, _)| f == fence) {
        held.remove(&fence.job);
    }
}

/// Runs a worker until `stop` is set (then waits for the jobs running to
/// end) or, with `idle_exit`, until the queue stays empty that long.
pub fn run_worker(
    home: Home,
    opts: &WorkerOptions,
    stop: &AtomicBool,
    watch: &(dyn WorkerWatch + Send + Sync),
) -> Result<WorkerRecord, EngineError> {
    let engine = Engine::open(home.clone())?;
    let hostname = nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown".into());
    let me = WorkerRecord {
        id: format!("{hostname}-{}-{}", std::process::id(), cairn_engine::random_hex(2)),
        home_path: home.root().display().to_string(),
        hostname,
        pid: std::process::id().into(),
        slots: opts.slots as i64,
        started_at: now_ms(),
        seen_at: now_ms(),
        stopped_at: None,
    };
    engine.db().register_worker(&me)?;
    let mut listener = Db::listener(&home)?;
    let slots = Arc::new(Slots::new(opts.slots.max(1)));
    let held: Held = Arc::default();
    let running = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let beating = Arc::new(AtomicBool::new(true));
    let heartbeat = {
        let (home, held, beating, lease, id) = (home.clone(), held.clone(), beating.clone(), opts.lease, me.id.clone());
        std::thread::spawn(move || heartbeat(&home, &held, &beating, lease, &id))
    };
    let watchdog = {
        let (held, beating, lease) = (held.clone(), beating.clone(), opts.lease);
        std::thread::spawn(move || watchdog(&held, &beating, lease))
    };
    let mut idle_since = Instant::now();
    let mut engine = engine;
    let mut reaped_at: Option<Instant> = None;
    let result = std::thread::scope(|scope| -> Result<(), EngineError> {
        while !stop.load(Ordering::SeqCst) {
            if reaped_at.is_none_or(|at| at.elapsed() >= opts.lease) {
                reaped_at = Some(Instant::now());
                match engine.reap_orphans() {
                    Ok(reaped) => {
                        for o in &reaped {
                            watch.orphan(o);
                        }
                    }
                    Err(e) => tracing::warn!("cannot reap orphaned sandboxes: {e}"),
                }
            }
            // The state store away (a restart, a partition) stops nothing:
            // the worker says so and tries again a poll later; its leases
            // run down meanwhile and the fence settles who commits.
            let claimed = match claim_round(&engine, &me, opts, stop, &slots, &held, &running, scope, &home, watch) {
                Ok(claimed) => claimed,
                Err(e) => {
                    tracing::warn!("the stage queue is unreachable: {e}");
                    watch.unreachable(&e.to_string());
                    std::thread::sleep(opts.poll);
                    continue;
                }
            };
            if claimed || running.load(Ordering::SeqCst) > 0 {
                idle_since = Instant::now();
            } else if opts.idle_exit.is_some_and(|d| idle_since.elapsed() >= d) {
                break;
            }
            if !claimed {
                let woke = match listener.as_mut() {
                    Some(l) => l.wait(opts.poll).map_err(|e| e.to_string()),
                    None => {
                        std::thread::sleep(opts.poll.min(Duration::from_millis(200)));
                        Ok(false)
                    }
                };
                if woke.is_err() {
                    // A broken listening connection: poll until another opens.
                    std::thread::sleep(opts.poll);
                    listener = Db::listener(&home).ok().flatten();
                }
            }
        }
        Ok(())
    });
    beating.store(false, Ordering::SeqCst);
    let _ = heartbeat.join();
    let _ = watchdog.join();
    engine.db().worker_seen(&me.id, true)?;
    result.map(|()| me)
}

/// Returns expired leases to the queue, then claims jobs while slots are
/// free, each run on a thread of `scope`; whether any was claimed.
#[allow(clippy::too_many_arguments)]
fn claim_round<'scope, 'env>(
    engine: &Engine,
    me: &WorkerRecord,
    opts: &WorkerOptions,
    stop: &AtomicBool,
    slots: &Arc<Slots>,
    held: &Held,
    running: &Arc<std::sync::atomic::AtomicUsize>,
    scope: &'scope std::thread::Scope<'scope, 'env>,
    home: &Home,
    watch: &'env (dyn WorkerWatch + Send + Sync),
) -> Result<bool, EngineError> {
    engine.db().reap_expired()?;
    let mut claimed = false;
    while !stop.load(Ordering::SeqCst) && slots.try_take() {
        let job = match engine.db().claim_job(&me.id, opts.lease, &["run", "branch"]) {
            Ok(Some(job)) => job,
            Ok(None) => {
                slots.give();
                break;
            }
            Err(e) => {
                slots.give();
                return Err(e.into());
            }
        };
        claimed = true;
        let fence = Fence {
            job: job.id.clone(),
            epoch: job.epoch,
        };
        held.lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(job.id.clone(), (fence.clone(), Instant::now()));
        watch.job(&job, "claimed", &format!("claim {} by {}", job.epoch, me.id));
        running.fetch_add(1, Ordering::SeqCst);
        let (home, slots, held, running) = (home.clone(), slots.clone(), held.clone(), running.clone());
        scope.spawn(move || {
            let outcome = run_job(&home, &job, &fence, &slots, watch);
            held.lock().unwrap_or_else(|p| p.into_inner()).remove(&job.id);
            match outcome {
                Ok(detail) => watch.job(&job, "ended", &detail),
                Err(EngineError::State(StateError::Fenced { .. })) => watch.job(
                    &job,
                    "lost",
                    "its lease moved to another worker; this worker's result was discarded",
                ),
                Err(e) => watch.job(&job, "failed", &e.to_string()),
            }
            running.fetch_sub(1, Ordering::SeqCst);
            slots.give();
        });
    }
    Ok(claimed)
}

/// Renews every held lease a third of a lease apart; a job whose renewal
/// is refused has moved on and is renewed no more.
fn heartbeat(home: &Home, held: &Held, beating: &AtomicBool, lease: Duration, worker: &str) {
    let mut db = None;
    while beating.load(Ordering::SeqCst) {
        let pause = Instant::now() + lease / 3;
        if db.is_none() {
            db = Db::open_home(home).ok();
        }
        if let Some(d) = &db {
            let jobs: Vec<_> = held
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .map(|(f, _)| f.clone())
                .collect();
            for fence in jobs {
                match d.renew_lease(&fence, worker, lease) {
                    Ok(true) => {
                        let mut held = held.lock().unwrap_or_else(|p| p.into_inner());
                        if let Some((f, at)) = held.get_mut(&fence.job) {
                            if *f == fence {
                                *at = Instant::now();
                            }
                        }
                    }
                    Ok(false) => forget(held, &fence),
                    // The store is away: the lease runs down, and the fence
                    // decides if it expired before the next commit.
                    Err(e) => tracing::warn!(job = fence.job, "cannot renew the lease: {e}"),
                }
            }
            let _ = d.worker_seen(worker, false);
        }
        while beating.load(Ordering::SeqCst) && Instant::now() < pause {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Watches the renewals apart from the heartbeat (whose calls may wait a
/// minute on a store that is away): a claim not renewed for a whole lease
/// (this host cut off from the store) is presumed taken over, renewed no
/// more, and its attempts are stopped, so a cut-off host stops computing
/// about a lease after its last renewal.
fn watchdog(held: &Held, beating: &AtomicBool, lease: Duration) {
    while beating.load(Ordering::SeqCst) {
        std::thread::sleep((lease / 6).max(Duration::from_millis(50)));
        let lost: Vec<Fence> = held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .filter(|(_, at)| at.elapsed() >= lease)
            .map(|(f, _)| f.clone())
            .collect();
        for fence in lost {
            presume_lost(held, &fence);
        }
    }
}

/// A claim not renewed for a whole lease: renewed no more, and its
/// attempts stopped.
fn presume_lost(held: &Held, fence: &Fence) {
    forget(held, fence);
    let stopped = stop_attempts(fence);
    tracing::warn!(
        job = fence.job,
        epoch = fence.epoch,
        "the lease ran out without a renewal (the state store is unreachable): stopped the sandboxes {stopped:?} \
         of this claim; another worker takes the job over"
    );
}

/// One claimed job in an engine of its own, fenced by its claim.
fn run_job(
    home: &Home,
    job: &Job,
    fence: &Fence,
    slots: &Arc<Slots>,
    watch: &(dyn WorkerWatch + Send + Sync),
) -> Result<String, EngineError> {
    let mut engine = Engine::open(home.clone())?;
    engine.db().set_fence(Some(fence.clone()));
    engine.set_extension(slots.clone());
    let detail = match job.kind.as_str() {
        "run" => engine
            .execute_queued_run(&job.run_id, watch)
            .map(|rec| format!("run {} {}", rec.id, rec.status)),
        _ => engine.run_branch_job(job, watch).map(|out| match out {
            Some(snap) => format!(
                "branch {} of {} completed: {}",
                job.branch,
                job.stage,
                &snap[..12.min(snap.len())]
            ),
            None => format!("branch {} of {} went to the dead letters", job.branch, job.stage),
        }),
    };
    match detail {
        Ok(detail) => {
            engine.db().finish_job(fence)?;
            Ok(detail)
        }
        Err(e) => {
            // The claim is left to expire: another worker (perhaps on a
            // host without this one's trouble) takes the job a lease later.
            if !matches!(e, EngineError::State(StateError::Fenced { .. })) {
                let (stage, branch) = (
                    (!job.stage.is_empty()).then_some(job.stage.as_str()),
                    (!job.branch.is_empty()).then_some(job.branch.as_str()),
                );
                let _ = engine.db().event(
                    &job.run_id,
                    stage,
                    branch,
                    "worker-error",
                    &format!(
                        "claim {} failed: {e}; another worker retries it when the lease expires",
                        job.epoch
                    ),
                    None,
                );
            }
            Err(e)
        }
    }
}

/// A worker's leftovers: stage sandboxes whose queue claim moved on.
pub trait Workers {
    /// Removes this home's orphaned stage sandboxes ([`Db::orphans`]) whose
    /// maker is gone (a live one, stalled past its lease, cleans up its
    /// own attempt when it wakes): each is first recorded on its run (`orphan-reaped`, saying which claim
    /// made it and what became of that claim), then removed with its
    /// processes. What was removed; one another process removed first is
    /// left out.
    fn reap_orphans(&mut self) -> Result<Vec<Orphan>, EngineError>;
}

impl Workers for Engine {
    fn reap_orphans(&mut self) -> Result<Vec<Orphan>, EngineError> {
        let mut reaped = Vec::new();
        for o in self.db().orphans()? {
            let Ok(rec) = self.sandbox(&o.sandbox_id) else {
                continue;
            };
            // An attempt of this process runs in it, or it runs and the
            // process that made it still runs (a worker stalled past its
            // lease): the attempt ends itself, removing the sandbox once
            // its commit is refused.
            let runs = cairn_engine::sandboxes::process_of(&rec).is_some_and(|p| p.alive());
            if attempt_runs_in(&rec.id) || (runs && cairn_sandbox::process_alive(rec.owner_pid, rec.owner_start)) {
                continue;
            }
            let what = if o.branch.is_empty() {
                format!("stage {}", o.stage)
            } else {
                format!("branch {} of {}", o.branch, o.stage)
            };
            self.db().event(
                &o.run_id,
                (!o.stage.is_empty()).then_some(o.stage.as_str()),
                (!o.branch.is_empty()).then_some(o.branch.as_str()),
                "orphan-reaped",
                &format!(
                    "sandbox {} ({} driver, on {}) ran {what} under claim {}; {}: removed",
                    o.sandbox_id,
                    rec.driver,
                    self.home().root().display(),
                    o.epoch,
                    o.reason
                ),
                None,
            )?;
            match self.remove_sandbox(&rec, true) {
                Ok(()) => reaped.push(o),
                Err(EngineError::NoSuchSandbox(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(reaped)
    }
}
