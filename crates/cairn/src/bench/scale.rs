//! `cairn bench scale`: the shared stage queue under four workers (claim
//! latency, wake-up latency, dispatch throughput) on the state store given
//! (`--postgres`, else the scratch home's SQLite); a worker killed mid-stage
//! (kill -9 to the other worker's claim, and to the orphaned sandbox's
//! removal); and a snapshot restored on a cold host beside a warm one when a
//! remote store is given (`--store`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use cairn_engine::state::Db;
use cairn_engine::{CreateOptions, Engine, Home, Silent};
use cairn_pipeline::prelude::*;
use cairn_pipeline::queue::Fence;
use cairn_pipeline::records::{RunRecord, StageRecord};
use cairn_protocol::ExecRequest;

use super::{summarize, Bench, Measurement};

/// Where `bench scale` measures.
#[derive(Debug, Clone, Default)]
pub struct ScaleOptions {
    /// An empty PostgreSQL database for the queue figures.
    pub postgres: Option<String>,
    /// A remote chunk store (s3://…) for the cold-restore figure.
    pub store: Option<String>,
    /// The size of the restored snapshot's files.
    pub size: u64,
}

const WORKERS: usize = 4;
const LEASE: Duration = Duration::from_secs(60);

/// The lease and poll interval of the takeover's worker processes.
const TAKEOVER_LEASE_SECS: u64 = 2;
const TAKEOVER_POLL_SECS: f64 = 0.5;

impl Bench {
    pub(super) fn scale(&self, runs: usize, opts: &ScaleOptions) -> Result<Vec<Measurement>> {
        let mut out = self.queue_figures(runs, opts)?;
        out.extend(self.takeover(runs.min(5))?);
        match &opts.store {
            Some(store) => {
                out.extend(self.orphan_reaped(store, runs.min(5))?);
                out.extend(self.cold_restore(store, opts.size, runs.min(5))?);
            }
            None => eprintln!(
                "cairn bench: no --store s3://…: the cold-restore figures need a remote store (an S3-compatible server)"
            ),
        }
        Ok(out)
    }

    fn queue_figures(&self, runs: usize, opts: &ScaleOptions) -> Result<Vec<Measurement>> {
        let scratch = tempfile::Builder::new()
            .prefix("cairn-bench-scale")
            .tempdir_in("/tmp")?;
        let mut home = Home::at(scratch.path());
        let backend = match &opts.postgres {
            Some(url) => {
                home = home.with_state(url.as_str());
                "PostgreSQL"
            }
            None => {
                eprintln!(
                    "cairn bench: no --postgres URL: the queue figures are on SQLite (one host); give an empty \
                     PostgreSQL database to measure what many hosts share"
                );
                "SQLite"
            }
        };
        let db = Db::open_home(&home)
            .context("opening the state store for the queue figures (--postgres takes an empty database of its own: createdb NAME)")?;
        let run = RunRecord {
            id: cairn_engine::random_hex(6),
            pipeline: "bench-scale".into(),
            file: "bench".into(),
            spec: String::new(),
            params: String::new(),
            status: "running".into(),
            created_at: cairn_engine::now_ms(),
            ended_at: None,
            error: None,
        };
        db.insert_run(&run)?;
        let total = (runs * WORKERS).max(400);
        for i in 0..total {
            db.enqueue_branch(&run.id, "s", &format!("b{i}"), "{}")?;
        }
        // Each worker claims, commits a stage's outcome under its fence
        // (row and event in one transaction), and ends the job: a stage's
        // whole dispatch with nothing to run.
        let claims = Mutex::new(Vec::with_capacity(total));
        let dispatched = AtomicUsize::new(0);
        let t0 = Instant::now();
        std::thread::scope(|s| -> Result<()> {
            let handles: Vec<_> = (0..WORKERS)
                .map(|w| {
                    let (home, claims, dispatched, run) = (&home, &claims, &dispatched, &run.id);
                    s.spawn(move || -> Result<()> {
                        let mut db = Db::open_home(home)?;
                        let me = format!("bench-{w}");
                        loop {
                            let t = Instant::now();
                            let Some(job) = db.claim_job(&me, LEASE, &["branch"])? else {
                                return Ok(());
                            };
                            claims.lock().unwrap().push(t.elapsed().as_secs_f64() * 1e3);
                            let fence = Fence {
                                job: job.id.clone(),
                                epoch: job.epoch,
                            };
                            db.set_fence(Some(fence.clone()));
                            let mut rec = StageRecord::pending(run, "s", &job.branch, &job.id, None);
                            rec.status = "completed".into();
                            rec.ended_at = Some(cairn_engine::now_ms());
                            db.put_stage(&rec, Some(("completed", "bench", None)))?;
                            db.set_fence(None);
                            db.finish_job(&fence)?;
                            dispatched.fetch_add(1, Ordering::Relaxed);
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().map_err(|_| anyhow::anyhow!("a bench worker panicked"))??;
            }
            Ok(())
        })?;
        let rate = dispatched.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64();
        if dispatched.load(Ordering::Relaxed) != total {
            bail!("{} of {total} jobs dispatched", dispatched.load(Ordering::Relaxed));
        }
        let mut out = vec![summarize(
            &format!("queue: claim, {WORKERS} workers contending ({backend})"),
            "ms",
            claims.into_inner().unwrap(),
            Some(10.0),
            true,
        )];
        out.push(Measurement {
            name: format!("queue: stages dispatched, {WORKERS} workers ({backend}; claim, fenced commit, end)"),
            unit: "stages/s",
            median: rate,
            p95: rate,
            runs: total,
            target: Some(500.0),
            lower_is_better: false,
            cairn_ratio: None,
        });
        out.push(self.wake_up(&home, &db, &run.id, runs.min(50), backend)?);
        Ok(out)
    }

    /// Enqueue to claim by one of four idle workers waiting for a wake-up
    /// (PostgreSQL's NOTIFY; SQLite's workers poll every 200 ms).
    fn wake_up(&self, home: &Home, db: &Db, run: &str, runs: usize, backend: &str) -> Result<Measurement> {
        let enqueued: Arc<Mutex<Option<Instant>>> = Arc::default();
        let samples = Mutex::new(Vec::new());
        let done = std::sync::atomic::AtomicBool::new(false);
        let claimed = AtomicUsize::new(0);
        std::thread::scope(|s| -> Result<()> {
            let handles: Vec<_> = (0..WORKERS)
                .map(|w| {
                    let (enqueued, samples, done, claimed) = (&enqueued, &samples, &done, &claimed);
                    s.spawn(move || -> Result<()> {
                        let db = Db::open_home(home)?;
                        let mut listener = Db::listener(home)?;
                        let me = format!("wake-{w}");
                        while !done.load(Ordering::SeqCst) {
                            if let Some(job) = db.claim_job(&me, LEASE, &["branch"])? {
                                if let Some(t) = *enqueued.lock().unwrap() {
                                    samples.lock().unwrap().push(t.elapsed().as_secs_f64() * 1e3);
                                }
                                db.finish_job(&Fence {
                                    job: job.id,
                                    epoch: job.epoch,
                                })?;
                                claimed.fetch_add(1, Ordering::SeqCst);
                                continue;
                            }
                            match listener.as_mut() {
                                Some(l) => {
                                    let _ = l.wait(Duration::from_secs(1));
                                }
                                None => std::thread::sleep(Duration::from_millis(200)),
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(300));
            for i in 0..runs {
                *enqueued.lock().unwrap() = Some(Instant::now());
                db.enqueue_branch(run, "wake", &format!("w{i}"), "{}")?;
                let deadline = Instant::now() + Duration::from_secs(5);
                while claimed.load(Ordering::SeqCst) <= i && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_micros(200));
                }
                // Idle again before the next one.
                std::thread::sleep(Duration::from_millis(20));
            }
            done.store(true, Ordering::SeqCst);
            db.enqueue_branch(run, "wake", "last", "{}")?;
            for h in handles {
                h.join().map_err(|_| anyhow::anyhow!("a bench worker panicked"))??;
            }
            Ok(())
        })?;
        let samples = samples.into_inner().unwrap();
        if samples.len() < runs {
            bail!("{} of {runs} wake-ups were claimed within 5 s", samples.len());
        }
        Ok(summarize(
            &format!("queue: enqueue to claim by an idle worker ({backend})"),
            "ms",
            samples,
            None,
            true,
        ))
    }

    /// A snapshot of `size` bytes of files restored to first output on a
    /// home whose cache is empty (another host), beside the same restore on
    /// the home that wrote it.
    fn cold_restore(&self, store: &str, size: u64, runs: usize) -> Result<Vec<Measurement>> {
        let first_output = |engine: &Engine, rec: &cairn_engine::SandboxRecord, cmd: &str| -> Result<()> {
            let req = ExecRequest {
                argv: vec!["sh".into(), "-c".into(), cmd.into()],
                ..ExecRequest::default()
            };
            let start = engine.exec(rec, req)?.map_err(|f| anyhow::anyhow!(f.message))?;
            match start.session.wait(&mut std::io::sink(), &mut std::io::sink())? {
                Some(s) if s.code == Some(0) => Ok(()),
                other => bail!("`{cmd}` failed in the sandbox: {other:?}"),
            }
        };
        let state = tempfile::Builder::new()
            .prefix("cairn-bench-state")
            .tempdir_in("/tmp")?;
        let state_url = format!("sqlite:{}", state.path().join("state.db").display());
        let writer_dir = tempfile::Builder::new().prefix("cairn-bench-warm").tempdir_in("/tmp")?;
        let writer = Home::at(writer_dir.path())
            .with_state(state_url.as_str())
            .with_store(store);
        let mut engine = Engine::open(writer.clone())?;
        engine.import_image(&self.layer, "busybox", &Silent)?;
        let rec = engine.create_sandbox(&CreateOptions::default(), &Silent)?;
        let mib = size.div_ceil(1 << 20);
        eprintln!("cairn bench: writing {mib} MiB and uploading its snapshot to {store}");
        first_output(
            &engine,
            &rec,
            &format!("mkdir -p /work && dd if=/dev/urandom of=/work/data bs=1M count={mib} 2>/dev/null"),
        )?;
        let snap = engine.snapshot(&rec, None)?;
        engine.remove_sandbox(&engine.sandbox(&rec.id)?, true)?;
        engine.mark_remote_durable(Duration::from_secs(3600))?;
        if engine.remote_durable_at(&snap.id)?.is_none() {
            bail!("the snapshot did not reach {store}");
        }
        let restore = |engine: &mut Engine| -> Result<f64> {
            let t = Instant::now();
            let rec = engine.restore(&engine.snapshot_record(&snap.id)?, &CreateOptions::default())?;
            first_output(engine, &rec, "true")?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            engine.remove_sandbox(&engine.sandbox(&rec.id)?, true)?;
            Ok(ms)
        };
        let mut warm = Vec::new();
        for _ in 0..runs {
            warm.push(restore(&mut engine)?);
        }
        let mut cold = Vec::new();
        for _ in 0..runs {
            let dir = tempfile::Builder::new().prefix("cairn-bench-cold").tempdir_in("/tmp")?;
            let mut fresh = Engine::open(Home::at(dir.path()).with_state(state_url.as_str()).with_store(store))?;
            cold.push(restore(&mut fresh)?);
            // The state directory goes: so does its pool of emptied cgroups.
            fresh.drain_cgroup_pool();
        }
        // The store check a commit under a claim makes of its artifacts,
        // over objects of the same size as this snapshot's file.
        let mut checks = Vec::new();
        let mut objects = 0;
        for _ in 0..runs {
            let (n, missing, took) = engine.bench_remote_check(&snap.id)?;
            if missing > 0 {
                bail!("{missing} of {n} objects of the snapshot are not in {store}");
            }
            objects = n;
            checks.push(took.as_secs_f64() * 1e3);
        }
        // The peer: the same objects straight from the store, as many
        // requests at a time as the restore's read-ahead keeps running.
        let mut gets = Vec::new();
        for _ in 0..runs {
            let (bytes, took) = engine.bench_remote_read(&snap.id, 16)?;
            gets.push(bytes as f64 / (1 << 20) as f64 / took.as_secs_f64());
        }
        engine.drain_cgroup_pool();
        let bandwidth = |ms: &[f64]| -> Vec<f64> { ms.iter().map(|m| mib as f64 / (m / 1e3)).collect() };
        let cold_rate = summarize(
            &format!("restore {mib} MiB, cold cache"),
            "MiB/s",
            bandwidth(&cold),
            None,
            false,
        );
        let get_rate = summarize(
            "S3 GET of the same objects, 16 at a time (peer; target: cold >= 0.8 of it)",
            "MiB/s",
            gets,
            None,
            false,
        )
        .peer_of(&cold_rate);
        Ok(vec![
            summarize(
                &format!("restore {mib} MiB, cold cache (another host)"),
                "ms",
                cold.clone(),
                None,
                true,
            ),
            summarize(
                &format!("restore {mib} MiB, warm cache (the writing host)"),
                "ms",
                warm,
                None,
                true,
            ),
            // Warm, the layers are already on disk: no bytes move, so no rate.
            cold_rate,
            get_rate,
            summarize(
                &format!("commit's store check of a {mib} MiB artifact's {objects} objects"),
                "ms",
                checks,
                None,
                true,
            ),
        ])
    }
}

/// A host of the takeover figures: a state directory, and the state and
/// remote store it shares with the other host (none: one host alone).
struct Host {
    dir: std::path::PathBuf,
    state: Option<String>,
    store: Option<String>,
}

impl Host {
    fn home(&self) -> Home {
        let mut home = Home::at(&self.dir);
        if let Some(state) = &self.state {
            home = home.with_state(state.as_str());
        }
        if let Some(store) = &self.store {
            home = home.with_store(store.as_str());
        }
        home
    }

    /// A `cairn` command on this host, its output discarded.
    fn command(&self, exe: &std::path::Path, args: &[&str]) -> std::process::Command {
        use std::process::Stdio;
        let mut cmd = std::process::Command::new(exe);
        cmd.args(args)
            .env("CAIRN_HOME", &self.dir)
            .env("CAIRN_STATE", self.state.as_deref().unwrap_or(""))
            .env("CAIRN_STORE", self.store.as_deref().unwrap_or(""))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        cmd
    }

    fn worker(&self, exe: &std::path::Path) -> Result<std::process::Child> {
        let (lease, poll) = (TAKEOVER_LEASE_SECS.to_string(), TAKEOVER_POLL_SECS.to_string());
        Ok(self
            .command(
                exe,
                &["worker", "--json", "--slots", "1", "--lease", &lease, "--poll", &poll],
            )
            .spawn()?)
    }

    /// Removes what a takeover left on this host.
    fn clean(&self) {
        if let Ok(mut engine) = Engine::open(self.home()) {
            for rec in engine.list_sandboxes().unwrap_or_default() {
                let _ = engine.remove_sandbox(&rec, true);
            }
        }
    }
}

impl Bench {
    /// A worker process killed (SIGKILL) while its stage runs, a second one
    /// polling beside it: from the kill to the second's claim (its
    /// `lease-expired` event, written by the claim), then on one state
    /// directory to the attempt going on under the second (`reattached`:
    /// the stage's sandbox still runs there, so nothing is redone and
    /// nothing is orphaned). Each run in state directories of their own, so
    /// no job of an earlier run is left to claim.
    fn takeover(&self, runs: usize) -> Result<Vec<Measurement>> {
        let (mut claims, mut reattached) = (Vec::new(), Vec::new());
        for i in 0..runs {
            let host = Host {
                dir: self.home.path().join(format!("takeover-{i}")),
                state: None,
                store: None,
            };
            let result = self.one_takeover([&host, &host], i);
            host.clean();
            let (claim, on, _) = result?;
            eprintln!(
                "cairn bench: takeover {}: claimed {claim:.0} ms and the attempt reattached {on:.0} ms after the kill",
                i + 1
            );
            claims.push(claim);
            reattached.push(on);
        }
        Ok(vec![
            claim_figure("one host", claims),
            summarize(
                "takeover: kill -9 to the attempt going on in its sandbox under the other worker",
                "ms",
                reattached,
                None,
                true,
            ),
        ])
    }

    /// The same on two hosts (two state directories sharing an SQLite
    /// state file and the remote store `store`): the second worker claims
    /// and starts its own attempt on its host (a second `forked`); the
    /// killed host's sandbox is then an orphan, which that host's worker,
    /// started again at that moment, reaps (`orphan-reaped`): from the
    /// kill, and from that worker's start.
    fn orphan_reaped(&self, store: &str, runs: usize) -> Result<Vec<Measurement>> {
        let (mut claims, mut reaped, mut after_start) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..runs {
            let dir = self.home.path().join(format!("orphan-{i}"));
            let state = format!("sqlite:{}", dir.join("state.db").display());
            let host = |name: &str| Host {
                dir: dir.join(name),
                state: Some(state.clone()),
                store: Some(store.to_string()),
            };
            let (a, b) = (host("a"), host("b"));
            std::fs::create_dir_all(&dir)?;
            let result = self.one_takeover([&a, &b], i);
            a.clean();
            b.clean();
            let (claim, reap, started) = result?;
            eprintln!(
                "cairn bench: two hosts {}: claimed {claim:.0} ms, orphan reaped {reap:.0} ms after the kill ({started:.0} ms after its worker started again)",
                i + 1
            );
            claims.push(claim);
            reaped.push(reap);
            after_start.push(started);
        }
        Ok(vec![
            claim_figure("two hosts", claims),
            summarize(
                "takeover, two hosts: kill -9 to the orphan reaped (its worker started again at the takeover)",
                "ms",
                reaped,
                None,
                true,
            ),
            summarize(
                "takeover, two hosts: the killed host's worker started to the orphan reaped",
                "ms",
                after_start,
                Some(TAKEOVER_LEASE_SECS as f64 * 1e3),
                true,
            ),
        ])
    }

    /// One takeover: a run queued on `hosts[0]`, whose worker runs its
    /// stage and is killed while the worker of `hosts[1]` polls. Returns
    /// milliseconds from the kill to the claim, then, on one host, to the
    /// attempt reattached (and 0), or on two, to the orphan reaped on the
    /// first host by its worker started again once the new holder started
    /// its own attempt (and from that start).
    fn one_takeover(&self, hosts: [&Host; 2], i: usize) -> Result<(f64, f64, f64)> {
        let [a, b] = hosts;
        std::fs::create_dir_all(&a.dir)?;
        std::fs::create_dir_all(&b.dir)?;
        let layer = self.layer.to_string_lossy().into_owned();
        if !a
            .command(&self.exe, &["image", "import", &layer, "--name", "busybox"])
            .status()?
            .success()
        {
            bail!("cannot import busybox into {}", a.dir.display());
        }
        let file = a.dir.join("takeover.toml");
        std::fs::write(
            &file,
            format!(
                r#"[pipeline]
name = "takeover"
image = "busybox"

[[stage]]
name = "wait"
key = "takeover-{i}-{{{{params.nonce}}}}"
run = ["sleep 600"]

[params]
nonce = "0"
"#
            ),
        )?;
        let nonce = format!("nonce={}", cairn_engine::random_hex(4));
        let file_arg = file.to_string_lossy().into_owned();
        let out = a
            .command(
                &self.exe,
                &["pipeline", "run", "--queue", "--detach", &file_arg, "--param", &nonce],
            )
            .stdout(std::process::Stdio::piped())
            .output()?;
        if !out.status.success() {
            bail!("cannot queue the takeover's run");
        }
        let run = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let mut workers = vec![a.worker(&self.exe)?];
        let measured = (|| -> Result<(f64, f64, f64)> {
            let wait = |what: &str, done: &mut dyn FnMut() -> Result<bool>| -> Result<()> {
                let deadline = Instant::now() + Duration::from_secs(60);
                while !done()? {
                    if Instant::now() > deadline {
                        bail!("the takeover's run {run}: no {what} within 60 s");
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Ok(())
            };
            let mut engine = Engine::open(a.home())?;
            wait("stage sandbox of the first worker", &mut || {
                Ok(engine
                    .list_sandboxes()?
                    .iter()
                    .any(|s| s.state == cairn_engine::state::SandboxState::Running))
            })?;
            workers.push(b.worker(&self.exe)?);
            // The second polls before the kill.
            std::thread::sleep(Duration::from_secs_f64(2.0 * TAKEOVER_POLL_SECS));
            let killed_at = cairn_engine::now_ms();
            workers[0].kill()?;
            workers[0].wait()?;
            let at = |kind: &str| -> Result<Option<i64>> {
                Ok(engine
                    .run_events(&run)?
                    .iter()
                    .find(|e| e.kind == kind)
                    .map(|e| e.created_at))
            };
            let since = |t: Option<i64>, from: i64| (t.unwrap_or(from) - from) as f64;
            let mut claimed = None;
            wait("claim by the second worker", &mut || {
                claimed = at("lease-expired")?;
                Ok(claimed.is_some())
            })?;
            let one_host = std::ptr::eq(a, b);
            let kind = if one_host { "reattached" } else { "orphan-reaped" };
            if !one_host {
                // Once the new holder has started its own attempt (a second
                // `forked`), the killed one's sandbox is an orphan: until
                // then the stage's row names it.
                wait("the new holder's attempt", &mut || {
                    Ok(engine.run_events(&run)?.iter().filter(|e| e.kind == "forked").count() >= 2)
                })?;
            }
            let started = cairn_engine::now_ms();
            if !one_host {
                workers.push(a.worker(&self.exe)?);
            }
            let mut then = None;
            wait(kind, &mut || {
                then = at(kind)?;
                Ok(then.is_some())
            })?;
            let after_start = if one_host { 0.0 } else { since(then, started) };
            Ok((since(claimed, killed_at), since(then, killed_at), after_start))
        })();
        for w in &mut workers {
            let _ = w.kill();
            let _ = w.wait();
        }
        measured
    }
}

/// Kill to claim, against its target: a lease and one poll.
fn claim_figure(what: &str, claims: Vec<f64>) -> Measurement {
    summarize(
        &format!("takeover ({what}): kill -9 to the other worker's claim (lease {TAKEOVER_LEASE_SECS} s, poll {TAKEOVER_POLL_SECS} s)"),
        "ms",
        claims,
        Some(TAKEOVER_LEASE_SECS as f64 * 1e3 + TAKEOVER_POLL_SECS * 1e3),
        true,
    )
}
