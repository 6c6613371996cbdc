//! The stage queue that workers on many hosts share (`cairn worker`).
//!
//! One table, `stage_jobs`: a row per run to orchestrate and per branch of
//! a group spread over workers. A worker claims the oldest claimable row
//! (queued, or claimed under a lease that expired) in one statement —
//! `FOR UPDATE SKIP LOCKED` on PostgreSQL, so workers never wait on each
//! other's claims; SQLite's single writer serialises the same statement.
//! Each claim increments the row's `epoch`: the fencing token. The holder
//! renews its lease by heartbeats, all on the database's clock, and every
//! commit of a stage's outcome checks, inside its transaction, that the job
//! is still at the epoch it claimed. A worker presumed dead (paused past its
//! lease, cut off) that wakes up finds the epoch moved and writes nothing:
//! a stage runs at least once and commits exactly once.
use std::time::Duration;

use crate::{params, Backend, BackendKind, Db, StateError};

pub use crate::Fence;

/// One row of the queue.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Job {
    pub id: String,
    pub run_id: String,
    /// `run` (orchestrate the run) or `branch` (one branch of a group).
    pub kind: String,
    pub stage: String,
    pub branch: String,
    /// A branch's hypothesis and the params it runs with (JSON; empty for a run).
    #[serde(skip)]
    pub payload: String,
    /// `queued`, `claimed` or `done`.
    pub status: String,
    pub epoch: i64,
    pub worker: Option<String>,
    /// Milliseconds left on the lease by the database's clock (negative:
    /// expired), for a claimed job.
    pub lease_left_ms: Option<i64>,
    pub enqueued_at: i64,
    pub claimed_at: Option<i64>,
    pub ended_at: Option<i64>,
}

/// A registered worker.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct WorkerRecord {
    pub id: String,
    pub home_path: String,
    pub hostname: String,
    pub pid: i64,
    pub slots: i64,
    pub started_at: i64,
    pub seen_at: i64,
    pub stopped_at: Option<i64>,
}

/// The id of a branch job.
pub fn branch_job_id(run: &str, stage: &str, branch: &str) -> String {
    format!("{run}/{stage}/{branch}")
}

/// A remote store's identity as hosts sharing a state store compare it:
/// `s3://BUCKET/PREFIX`, without the endpoint (hosts may reach one store
/// by different addresses) and never with credentials.
pub fn shown_store(url: &str) -> String {
    let base = url.split(['?', '#']).next().unwrap_or(url);
    let base = match base.split_once("://") {
        Some((scheme, rest)) => format!("{scheme}://{}", rest.rsplit_once('@').map_or(rest, |(_, r)| r)),
        None => base.to_string(),
    };
    base.trim_end_matches('/').to_string()
}

/// The database's clock in milliseconds since the epoch, as SQL: leases
/// are compared on one clock, never on the hosts'.
fn now_sql(kind: BackendKind) -> &'static str {
    match kind {
        BackendKind::Postgres => "CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
        BackendKind::Sqlite => "CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
    }
}

const JOB_COLUMNS: &str =
    "id, run_id, kind, stage, branch, status, epoch, worker, lease_until, enqueued_at, claimed_at, ended_at, payload";

fn job_from_row(r: &crate::Row, now: i64) -> Result<Job, StateError> {
    let lease: Option<i64> = r.get(8)?;
    let status: String = r.get(5)?;
    Ok(Job {
        id: r.get(0)?,
        run_id: r.get(1)?,
        kind: r.get(2)?,
        stage: r.get(3)?,
        branch: r.get(4)?,
        epoch: r.get(6)?,
        worker: r.get(7)?,
        lease_left_ms: lease.filter(|_| status == "claimed").map(|l| l - now),
        status,
        enqueued_at: r.get(9)?,
        claimed_at: r.get(10)?,
        ended_at: r.get(11)?,
        payload: r.get(12)?,
    })
}

fn db_now(b: &mut dyn Backend) -> Result<i64, StateError> {
    let sql = format!("SELECT {}", now_sql(b.kind()));
    let row = b.query_opt(&sql, &[])?.ok_or(crate::BackendError::RowCount(0))?;
    Ok(row.get(0)?)
}

/// Wakes listening workers (PostgreSQL's NOTIFY; SQLite workers poll).
fn notify(b: &mut dyn Backend) -> Result<(), StateError> {
    if b.kind() == BackendKind::Postgres {
        b.execute("SELECT pg_notify('cairn_jobs', '')", &[])?;
    }
    Ok(())
}

/// Records on `j`'s run that its claim's lease expired, and what became of
/// the job (`then`).
fn expired_event(b: &mut dyn Backend, j: &Job, then: &str) -> Result<(), StateError> {
    let what = if j.kind == "run" {
        "the run".to_string()
    } else {
        format!("branch {} of {}", j.branch, j.stage)
    };
    crate::runs::insert_event(
        b,
        &j.run_id,
        (!j.stage.is_empty()).then_some(j.stage.as_str()),
        (!j.branch.is_empty()).then_some(j.branch.as_str()),
        "lease-expired",
        &format!(
            "worker {} stopped renewing its lease on {what} (claim {}); {then}",
            j.worker.as_deref().unwrap_or("?"),
            j.epoch
        ),
        None,
    )
}

impl Db {
    /// From now on, every commit of a stage's outcome on this connection
    /// checks that `fence` still holds (or none, with `None`).
    pub fn set_fence(&self, fence: Option<Fence>) {
        *self.fence.lock().unwrap_or_else(|p| p.into_inner()) = fence;
    }

    pub fn fence(&self) -> Option<Fence> {
        self.fence.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Runs `f` in one transaction that first checks this connection's
    /// fence: the job still at the epoch claimed, and still claimed. The
    /// job's row is locked for the transaction (PostgreSQL), so a claim by
    /// another worker waits for this commit or comes after it: never both.
    pub fn fenced<T>(&self, f: impl FnOnce(&mut dyn Backend) -> Result<T, StateError>) -> Result<T, StateError> {
        let fence = self.fence();
        self.transaction(|b| {
            if let Some(fence) = &fence {
                let lock = if b.kind() == BackendKind::Postgres {
                    " FOR UPDATE"
                } else {
                    ""
                };
                let row = b.query_opt(
                    &format!("SELECT epoch, status FROM stage_jobs WHERE id = $1{lock}"),
                    params![&fence.job],
                )?;
                let held = match row {
                    Some(r) => r.get::<i64>(0)? == fence.epoch && r.get::<String>(1)? == "claimed",
                    None => false,
                };
                if !held {
                    return Err(StateError::Fenced {
                        job: fence.job.clone(),
                        epoch: fence.epoch,
                    });
                }
                crate::failpoint::hit("fenced-commit");
            }
            f(b)
        })
    }

    /// Queues a run for a worker to orchestrate; queuing it again (a
    /// resume) makes a finished job claimable again and leaves a live one.
    pub fn enqueue_run(&self, run: &str) -> Result<(), StateError> {
        self.enqueue(run, run, "run", "", "", "")
    }

    /// Queues one branch of a group for any worker, with what it runs
    /// (`payload`: its hypothesis and params, as JSON).
    pub fn enqueue_branch(&self, run: &str, stage: &str, branch: &str, payload: &str) -> Result<(), StateError> {
        self.enqueue(
            &branch_job_id(run, stage, branch),
            run,
            "branch",
            stage,
            branch,
            payload,
        )
    }

    fn enqueue(
        &self,
        id: &str,
        run: &str,
        kind: &str,
        stage: &str,
        branch: &str,
        payload: &str,
    ) -> Result<(), StateError> {
        self.transaction(|b| {
            let now = db_now(b)?;
            b.execute(
                "INSERT INTO stage_jobs (id, run_id, kind, stage, branch, payload, status, epoch, enqueued_at)
                 VALUES ($1, $2, $3, $4, $5, $6, 'queued', 0, $7)
                 ON CONFLICT (id) DO UPDATE SET status = 'queued', worker = NULL, lease_until = NULL,
                 ended_at = NULL, enqueued_at = $7, payload = $6 WHERE stage_jobs.status = 'done'",
                params![id, run, kind, stage, branch, payload, now],
            )?;
            notify(b)
        })
    }

    /// Claims the oldest claimable job for `worker` with a lease of
    /// `lease`: a queued job, or a claimed one whose lease expired (its
    /// holder is presumed dead). `kinds` limits what is taken. Taking over
    /// an expired claim records `lease-expired` on its run in the same
    /// transaction, so no expiry goes unrecorded whoever notices it first
    /// (this claim or the reaper).
    pub fn claim_job(&self, worker: &str, lease: Duration, kinds: &[&str]) -> Result<Option<Job>, StateError> {
        self.transaction(|b| {
            let kind = b.kind();
            let now = now_sql(kind);
            let skip = if kind == BackendKind::Postgres {
                " FOR UPDATE SKIP LOCKED"
            } else {
                ""
            };
            let kinds_sql = kinds
                .iter()
                .map(|k| format!("'{}'", k.replace('\'', "")))
                .collect::<Vec<_>>()
                .join(", ");
            let found = b.query(
                &format!(
                    "SELECT {JOB_COLUMNS} FROM stage_jobs
                     WHERE kind IN ({kinds_sql})
                       AND (status = 'queued' OR (status = 'claimed' AND lease_until < {now}))
                     ORDER BY enqueued_at, id LIMIT 1{skip}"
                ),
                &[],
            )?;
            let Some(row) = found.first() else {
                return Ok(None);
            };
            let before = job_from_row(row, 0)?;
            let rows = b.query(
                &format!(
                    "UPDATE stage_jobs SET status = 'claimed', epoch = epoch + 1, worker = $1,
                     lease_until = {now} + $2, claimed_at = {now}
                     WHERE id = $3 AND epoch = $4
                     RETURNING {JOB_COLUMNS}, {now}"
                ),
                params![worker, lease.as_millis() as i64, &before.id, before.epoch],
            )?;
            let Some(r) = rows.first() else {
                return Ok(None);
            };
            let job = job_from_row(r, r.get(13)?)?;
            if before.status == "claimed" {
                expired_event(b, &before, &format!("taken over by worker {worker}"))?;
            }
            Ok(Some(job))
        })
    }

    /// Extends a held lease; `false` when the job moved on (another claim,
    /// or it ended): the holder must stop committing.
    pub fn renew_lease(&self, fence: &Fence, worker: &str, lease: Duration) -> Result<bool, StateError> {
        self.with(|b| {
            let now = now_sql(b.kind());
            let n = b.execute(
                &format!(
                    "UPDATE stage_jobs SET lease_until = {now} + $4
                     WHERE id = $1 AND epoch = $2 AND worker = $3 AND status = 'claimed'"
                ),
                params![&fence.job, fence.epoch, worker, lease.as_millis() as i64],
            )?;
            Ok(n == 1)
        })
    }

    /// Ends a held job (its run or branch reached an end this worker
    /// recorded); a stale claim ends nothing.
    pub fn finish_job(&self, fence: &Fence) -> Result<bool, StateError> {
        self.with(|b| {
            let now = now_sql(b.kind());
            let n = b.execute(
                &format!(
                    "UPDATE stage_jobs SET status = 'done', ended_at = {now}, lease_until = NULL
                     WHERE id = $1 AND epoch = $2 AND status = 'claimed'"
                ),
                params![&fence.job, fence.epoch],
            )?;
            Ok(n == 1)
        })
    }

    /// Gives a held job back to the queue (a worker stopping cleanly).
    pub fn release_job(&self, fence: &Fence) -> Result<(), StateError> {
        self.transaction(|b| {
            b.execute(
                "UPDATE stage_jobs SET status = 'queued', worker = NULL, lease_until = NULL
                 WHERE id = $1 AND epoch = $2 AND status = 'claimed'",
                params![&fence.job, fence.epoch],
            )?;
            notify(b)
        })
    }

    /// Returns jobs whose lease expired to the queue, with an event on
    /// their run naming the worker presumed dead; returns them.
    pub fn reap_expired(&self) -> Result<Vec<Job>, StateError> {
        self.transaction(|b| {
            let now = now_sql(b.kind());
            let skip = if b.kind() == BackendKind::Postgres {
                " FOR UPDATE SKIP LOCKED"
            } else {
                ""
            };
            let expired = b.query(
                &format!(
                    "SELECT {JOB_COLUMNS} FROM stage_jobs WHERE status = 'claimed' AND lease_until < {now}
                     ORDER BY enqueued_at{skip}"
                ),
                &[],
            )?;
            let at = db_now(b)?;
            let jobs = expired
                .iter()
                .map(|r| job_from_row(r, at))
                .collect::<Result<Vec<_>, _>>()?;
            for j in &jobs {
                b.execute(
                    "UPDATE stage_jobs SET status = 'queued', worker = NULL, lease_until = NULL
                     WHERE id = $1 AND epoch = $2",
                    params![&j.id, j.epoch],
                )?;
                expired_event(b, j, "returned to the queue")?;
            }
            if !jobs.is_empty() {
                notify(b)?;
            }
            Ok(jobs)
        })
    }

    /// Every job, oldest first.
    pub fn jobs(&self) -> Result<Vec<Job>, StateError> {
        self.with(|b| {
            let at = db_now(b)?;
            b.query(
                &format!("SELECT {JOB_COLUMNS} FROM stage_jobs ORDER BY enqueued_at, id"),
                &[],
            )?
            .iter()
            .map(|r| job_from_row(r, at))
            .collect()
        })
    }

    pub fn job(&self, id: &str) -> Result<Option<Job>, StateError> {
        self.with(|b| {
            let at = db_now(b)?;
            b.query_opt(
                &format!("SELECT {JOB_COLUMNS} FROM stage_jobs WHERE id = $1"),
                params![id],
            )?
            .map(|r| job_from_row(&r, at))
            .transpose()
        })
    }

    pub fn register_worker(&self, w: &WorkerRecord) -> Result<(), StateError> {
        self.with(|b| {
            b.execute(
                "INSERT INTO workers (id, home_path, hostname, pid, slots, started_at, seen_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)",
                params![
                    &w.id,
                    &w.home_path,
                    &w.hostname,
                    w.pid,
                    w.slots,
                    w.started_at,
                    w.seen_at
                ],
            )?;
            Ok(())
        })
    }

    pub fn worker_seen(&self, id: &str, stopped: bool) -> Result<(), StateError> {
        self.with(|b| {
            let now = db_now(b)?;
            b.execute(
                "UPDATE workers SET seen_at = $2, stopped_at = CASE WHEN $3 = 1 THEN $2 ELSE stopped_at END
                 WHERE id = $1",
                params![id, now, i64::from(stopped)],
            )?;
            Ok(())
        })
    }

    pub fn workers(&self) -> Result<Vec<WorkerRecord>, StateError> {
        self.with(|b| {
            b.query(
                "SELECT id, home_path, hostname, pid, slots, started_at, seen_at, stopped_at FROM workers
                 ORDER BY started_at, id",
                &[],
            )?
            .iter()
            .map(|r| {
                Ok(WorkerRecord {
                    id: r.get(0)?,
                    home_path: r.get(1)?,
                    hostname: r.get(2)?,
                    pid: r.get(3)?,
                    slots: r.get(4)?,
                    started_at: r.get(5)?,
                    seen_at: r.get(6)?,
                    stopped_at: r.get(7)?,
                })
            })
            .collect()
        })
    }

    /// The database's clock, ms since the epoch.
    pub fn clock_ms(&self) -> Result<i64, StateError> {
        self.with(db_now)
    }
}

/// A stage's sandbox on this home whose queue claim has moved on: the
/// attempt it ran was taken over, fenced off or ended without it
/// ([`Db::orphans`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Orphan {
    pub sandbox_id: String,
    pub job: String,
    /// The claim it was made under.
    pub epoch: i64,
    pub run_id: String,
    pub stage: String,
    pub branch: String,
    /// What became of that claim.
    pub reason: String,
}

impl Db {
    /// Records that `sandbox` was made under `fence`'s claim, for a stage
    /// (`branch` empty outside branch groups) of `run`.
    pub fn record_claimed_sandbox(
        &self,
        sandbox: &str,
        fence: &Fence,
        run: &str,
        stage: &str,
        branch: &str,
    ) -> Result<(), StateError> {
        self.with(|b| {
            b.execute(
                "INSERT INTO sandbox_claims (sandbox_id, job_id, epoch, run_id, stage, branch)
                 VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (sandbox_id) DO UPDATE SET job_id = excluded.job_id, epoch = excluded.epoch",
                params![sandbox, &fence.job, fence.epoch, run, stage, branch],
            )?;
            Ok(())
        })
    }

    /// This home's sandboxes made under a claim that has moved on (its job
    /// claimed again, ended, or gone) that no stage row names: what a dead
    /// or fenced-off attempt left running. A sandbox of a claim still held,
    /// or one a stage row names (a resume re-attaches to it), is never one.
    pub fn orphans(&self) -> Result<Vec<Orphan>, StateError> {
        let home = self.home_id().to_string();
        self.with(|b| {
            let rows = b.query(
                "SELECT c.sandbox_id, c.job_id, c.epoch, c.run_id, c.stage, c.branch, j.status, j.epoch, j.worker
                 FROM sandbox_claims c
                 JOIN sandboxes s ON s.id = c.sandbox_id
                 LEFT JOIN stage_jobs j ON j.id = c.job_id
                 WHERE s.home_id = $1
                   AND (j.id IS NULL OR j.status = 'done' OR j.epoch <> c.epoch)
                   AND NOT EXISTS (SELECT 1 FROM stages st WHERE st.sandbox_id = c.sandbox_id)
                 ORDER BY c.sandbox_id",
                params![&home],
            )?;
            rows.iter()
                .map(|r| {
                    let status: Option<String> = r.get(6)?;
                    let now_epoch: Option<i64> = r.get(7)?;
                    let worker: Option<String> = r.get(8)?;
                    let epoch: i64 = r.get(2)?;
                    let reason = match (status.as_deref(), now_epoch) {
                        (None, _) => "its job is gone".to_string(),
                        (Some("done"), _) => "its job has ended".to_string(),
                        (Some(status), Some(now)) => format!(
                            "its job is {status} under claim {now}{}",
                            worker.map(|w| format!(" (worker {w})")).unwrap_or_default()
                        ),
                        (Some(status), None) => format!("its job is {status}"),
                    };
                    Ok(Orphan {
                        sandbox_id: r.get(0)?,
                        job: r.get(1)?,
                        epoch,
                        run_id: r.get(3)?,
                        stage: r.get(4)?,
                        branch: r.get(5)?,
                        reason,
                    })
                })
                .collect()
        })
    }
}
