//! Requests to sandboxes' init (files, signals) on a bounded pool of
//! threads of their own. Each waits on init for up to a minute (the
//! client's deadline); a sandbox whose init stalls would otherwise hold
//! threads of the blocking pool that every other request uses. Here it
//! holds at most a quarter of the pool's threads, and a full pool answers
//! 503 at once instead of queueing without end.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use crate::error::{ApiError, ApiResult};
use crate::metrics::{InitPoolMetrics, Reason};
use axum::http::StatusCode;

type Job = Box<dyn FnOnce() + Send>;

pub struct InitPool {
    jobs: SyncSender<Job>,
    /// Requests running or waiting, by sandbox.
    per_sandbox: Arc<Mutex<HashMap<String, usize>>>,
    per_sandbox_max: usize,
    threads: usize,
    metrics: InitPoolMetrics,
}

impl InitPool {
    /// Starts `threads` threads (at least 1); as many requests again may
    /// wait for one, and one sandbox may have a quarter of the threads'
    /// worth running or waiting.
    pub fn start(threads: usize, metrics: InitPoolMetrics) -> InitPool {
        let threads = threads.max(1);
        let (jobs, rx) = sync_channel::<Job>(threads);
        let rx = Arc::new(Mutex::new(rx));
        let busy = Arc::new(AtomicUsize::new(0));
        for n in 0..threads {
            let (rx, busy, metrics) = (Arc::clone(&rx), Arc::clone(&busy), metrics.clone());
            let started = std::thread::Builder::new()
                .name("cairn-init-req".into())
                .spawn(move || serve(&rx, &busy, &metrics));
            if let Err(e) = started {
                tracing::warn!("cannot start sandbox-request thread {n} of {threads}: {e}");
            }
        }
        InitPool {
            jobs,
            per_sandbox: Arc::new(Mutex::new(HashMap::new())),
            per_sandbox_max: (threads / 4).max(1),
            threads,
            metrics,
        }
    }

    /// Runs `job` on a thread of the pool, counted against `sandbox` until
    /// it drops the [`Release`] it is handed (a job that answers a client
    /// drops it first, so the client's next request finds its place free);
    /// 503 when that sandbox has its share of the pool already, or when
    /// every thread is busy and the queue is full.
    pub fn submit(&self, sandbox: &str, job: impl FnOnce(Release) + Send + 'static) -> ApiResult<()> {
        {
            let mut per = self.per_sandbox.lock().unwrap_or_else(|e| e.into_inner());
            let n = per.entry(sandbox.to_string()).or_insert(0);
            if *n >= self.per_sandbox_max {
                drop(per);
                self.refuse("sandbox_limit");
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "sandbox {sandbox} already has {} requests running or waiting for its init \
                         (a quarter of `cairn serve --init-threads` {}); retry when they are answered",
                        self.per_sandbox_max, self.threads
                    ),
                ));
            }
            *n += 1;
        }
        let release = Release {
            per_sandbox: Arc::clone(&self.per_sandbox),
            sandbox: sandbox.to_string(),
        };
        let queued = self.metrics.queued.clone();
        queued.inc();
        let job: Job = Box::new(move || {
            queued.dec();
            job(release);
        });
        match self.jobs.try_send(job) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(job)) | Err(TrySendError::Disconnected(job)) => {
                // Dropped unrun: its sandbox's count goes back with it.
                drop(job);
                self.metrics.queued.dec();
                self.refuse("pool_full");
                Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "the server is busy with sandbox file and control requests ({} threads busy and \
                         as many waiting); retry shortly, or raise `cairn serve --init-threads`",
                        self.threads
                    ),
                ))
            }
        }
    }

    fn refuse(&self, reason: &str) {
        self.metrics
            .refused
            .get_or_create(&Reason { reason: reason.into() })
            .inc();
    }
}

fn serve(rx: &Mutex<Receiver<Job>>, busy: &AtomicUsize, metrics: &InitPoolMetrics) {
    loop {
        let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok(job) = job else { return };
        metrics.busy.set(busy.fetch_add(1, Ordering::SeqCst) as i64 + 1);
        // A panicking request must not take its thread with it.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
        metrics.busy.set(busy.fetch_sub(1, Ordering::SeqCst) as i64 - 1);
    }
}

/// A sandbox's place in the pool, given back when dropped: when its
/// request is done with init, or dropped unrun.
pub struct Release {
    per_sandbox: Arc<Mutex<HashMap<String, usize>>>,
    sandbox: String,
}

impl Drop for Release {
    fn drop(&mut self) {
        let mut per = self.per_sandbox.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = per.get_mut(&self.sandbox) {
            *n -= 1;
            if *n == 0 {
                per.remove(&self.sandbox);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;
    use std::time::Duration;

    fn refused(pool: &InitPool, reason: &str) -> u64 {
        pool.metrics
            .refused
            .get_or_create(&Reason { reason: reason.into() })
            .get()
    }

    #[test]
    fn a_full_pool_refuses_at_once_and_takes_requests_again_once_free() {
        // Four threads: one sandbox may hold one; four may wait.
        let pool = InitPool::start(4, InitPoolMetrics::default());
        let (release, held) = channel::<()>();
        let held = Arc::new(Mutex::new(held));
        let (done, finished) = channel::<usize>();
        let stall = |n: usize| {
            let (held, done) = (Arc::clone(&held), done.clone());
            move |place: Release| {
                let _ = held.lock().unwrap().recv();
                drop(place);
                done.send(n).unwrap();
            }
        };
        // A stalled sandbox gets its quarter and no more.
        pool.submit("a", stall(0)).unwrap();
        let err = pool.submit("a", stall(99)).unwrap_err();
        assert_eq!(err.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            err.message.contains("sandbox a") && err.message.contains("retry"),
            "{}",
            err.message
        );
        assert_eq!(refused(&pool, "sandbox_limit"), 1);
        // Seven more sandboxes: three take the other threads (one waits
        // behind the lock the first holds), four wait in the queue; the
        // next is refused at once.
        let settle = |busy: i64| {
            for _ in 0..500 {
                if pool.metrics.busy.get() == busy {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            panic!("{busy} threads did not take their requests");
        };
        settle(1);
        for n in 1..8 {
            pool.submit(&format!("s{n}"), stall(n)).unwrap();
            if n < 4 {
                settle(n as i64 + 1);
            }
        }
        assert_eq!(pool.metrics.busy.get(), 4);
        assert_eq!(pool.metrics.queued.get(), 4);
        let err = pool.submit("s8", stall(8)).unwrap_err();
        assert_eq!(err.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            err.message.contains("busy with sandbox") && err.message.contains("retry"),
            "{}",
            err.message
        );
        assert_eq!(refused(&pool, "pool_full"), 1);
        // Once they are answered, the pool and sandbox a take requests again.
        for _ in 0..8 {
            release.send(()).unwrap();
        }
        let mut ran: Vec<usize> = (0..8)
            .map(|_| finished.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        ran.sort();
        assert_eq!(ran, (0..8).collect::<Vec<_>>(), "a refused request ran");
        pool.submit("a", stall(0)).unwrap();
        release.send(()).unwrap();
        assert_eq!(finished.recv_timeout(Duration::from_secs(5)).unwrap(), 0);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!((pool.metrics.busy.get(), pool.metrics.queued.get()), (0, 0));
        assert!(pool.per_sandbox.lock().unwrap().is_empty());
    }
}
