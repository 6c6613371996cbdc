//! Benchmarks of snapshots, forks, restores, pipeline stages and the gvisor
//! driver: the layer, store and orchestration side of `cairn bench`.

use std::io::{self, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use cairn_engine::{CreateOptions, Engine, Silent};
use cairn_pipeline::prelude::*;
use cairn_protocol::ExecRequest;

use super::{summarize, Bench, Measurement, Which};

/// A running sandbox and a snapshot of it, small or over a 2 GiB layer.
struct Scenario {
    name: &'static str,
    sandbox: cairn_engine::SandboxRecord,
    snapshot: cairn_engine::SnapshotRecord,
}

impl Bench {
    fn scenario(&self, engine: &mut Engine, big: bool) -> Result<Scenario> {
        let echo = |engine: &Engine, rec: &cairn_engine::SandboxRecord, cmd: &str| -> Result<()> {
            let req = ExecRequest {
                argv: vec!["sh".into(), "-c".into(), cmd.into()],
                ..ExecRequest::default()
            };
            let start = engine.exec(rec, req)?.map_err(|f| anyhow::anyhow!(f.message))?;
            match start.session.wait(&mut io::sink(), &mut io::sink())? {
                Some(s) if s.code == Some(0) => Ok(()),
                other => bail!("`{cmd}` failed in the sandbox: {other:?}"),
            }
        };
        // Both scenarios have the same shape (a file in a lower layer from a
        // snapshot, a running sandbox over it), so only the size differs.
        let mut rec = engine.create_sandbox(&CreateOptions::default(), &Silent)?;
        let count = if big { 2048 } else { 1 };
        if big {
            eprintln!("cairn bench: writing a 2 GiB file and snapshotting it (once)");
        }
        echo(
            engine,
            &rec,
            &format!("mkdir -p /work && dd if=/dev/urandom of=/work/lower bs=1M count={count} 2>/dev/null"),
        )?;
        let lower = engine.snapshot(&rec, None)?;
        let old = rec;
        rec = engine.restore(&lower, &CreateOptions::default())?;
        let old = engine.sandbox(&old.id)?;
        engine.remove_sandbox(&old, true)?;
        echo(engine, &rec, "seq 1 10000 > /work/small")?;
        let snapshot = engine.snapshot(&rec, None)?;
        Ok(Scenario {
            name: if big { "2 GiB lower layer" } else { "1 MiB lower layer" },
            sandbox: rec,
            snapshot,
        })
    }

    /// Time from asking to the first byte of `echo`'s output in `rec`.
    fn first_echo(engine: &Engine, rec: &cairn_engine::SandboxRecord) -> Result<()> {
        let req = ExecRequest {
            argv: vec!["echo".into(), "hi".into()],
            ..ExecRequest::default()
        };
        let start = engine.exec(rec, req)?.map_err(|f| anyhow::anyhow!(f.message))?;
        let mut first = FirstByte(false);
        start.session.wait(&mut first, &mut io::sink())?;
        if !first.0 {
            bail!("echo printed nothing");
        }
        Ok(())
    }

    pub(super) fn snapshots(&self, which: Which, runs: usize) -> Result<Vec<Measurement>> {
        let mut engine = self.engine()?;
        // Both scenarios first, then their samples in turn: the writeback of
        // the 2 GiB setup (gigabytes to the disk, the store and the layer
        // cache) and any other disk noise fall on both sizes alike, so the
        // ratio shows what size costs.
        let scenarios = [self.scenario(&mut engine, false)?, self.scenario(&mut engine, true)?];
        let mut samples = [Vec::with_capacity(runs), Vec::with_capacity(runs)];
        let mut stored = [Vec::new(), Vec::new()];
        // The first few rounds warm caches and are not kept.
        const WARM_UP: usize = 3;
        for round in 0..WARM_UP + runs {
            for (k, sc) in scenarios.iter().enumerate() {
                let (ms, bytes) = self.sample(&mut engine, which, sc)?;
                if round >= WARM_UP {
                    samples[k].push(ms);
                    stored[k].extend(bytes);
                }
            }
        }
        let (label, target) = match which {
            Which::Snapshot => ("snapshot after a 1 MB change", 20.0),
            Which::Fork => ("fork a live sandbox to first output", 15.0),
            _ => ("restore a snapshot to first output", 15.0),
        };
        let mut out = Vec::new();
        let mut medians = Vec::new();
        for (k, sc) in scenarios.iter().enumerate() {
            let m = summarize(
                &format!("{label} ({})", sc.name),
                "ms",
                std::mem::take(&mut samples[k]),
                Some(target),
                true,
            );
            medians.push((m.median, m.p95));
            out.push(m);
            if which == Which::Snapshot {
                out.push(summarize(
                    &format!("stored per 1 MB-change snapshot ({})", sc.name),
                    "MB",
                    std::mem::take(&mut stored[k]),
                    Some(1.05),
                    true,
                ));
            }
        }
        if which != Which::Snapshot {
            out.push(self.hundred_forks(&mut engine, &scenarios[1], which)?);
            // Flatness: the same operation over the 2 GiB layer as over the small one.
            out.push(Measurement {
                name: format!(
                    "{} time, 2 GiB lower layer / 1 MiB",
                    format!("{which:?}").to_lowercase()
                ),
                unit: "x",
                median: medians[1].0 / medians[0].0,
                p95: medians[1].1 / medians[0].1,
                runs,
                target: Some(1.2),
                lower_is_better: true,
                cairn_ratio: None,
            });
        }
        for sc in &scenarios {
            let rec = engine.sandbox(&sc.sandbox.id)?;
            engine.remove_sandbox(&rec, true)?;
        }
        Ok(out)
    }

    /// One timed operation on a scenario: milliseconds, and for a snapshot
    /// the megabytes it stored.
    fn sample(&self, engine: &mut Engine, which: Which, sc: &Scenario) -> Result<(f64, Option<f64>)> {
        match which {
            Which::Snapshot => {
                let req = ExecRequest {
                    argv: vec![
                        "sh".into(),
                        "-c".into(),
                        "dd if=/dev/urandom of=/work/change bs=1M count=1 2>/dev/null".into(),
                    ],
                    ..ExecRequest::default()
                };
                let start = engine.exec(&sc.sandbox, req)?.map_err(|f| anyhow::anyhow!(f.message))?;
                start.session.wait(&mut io::sink(), &mut io::sink())?;
                let t0 = Instant::now();
                let snap = engine.snapshot(&engine.sandbox(&sc.sandbox.id)?, None)?;
                Ok((t0.elapsed().as_secs_f64() * 1e3, Some(snap.stored_bytes as f64 / 1e6)))
            }
            Which::Fork => {
                let t0 = Instant::now();
                let (_, forks) = engine.fork(&sc.sandbox.id, 1, &CreateOptions::default())?;
                Self::first_echo(engine, &forks[0])?;
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                let f = engine.sandbox(&forks[0].id)?;
                engine.remove_sandbox(&f, true)?;
                Ok((ms, None))
            }
            _ => {
                let t0 = Instant::now();
                let rec = engine.restore(&sc.snapshot, &CreateOptions::default())?;
                Self::first_echo(engine, &rec)?;
                let ms = t0.elapsed().as_secs_f64() * 1e3;
                let rec = engine.sandbox(&rec.id)?;
                engine.remove_sandbox(&rec, true)?;
                Ok((ms, None))
            }
        }
    }

    /// Disk space 100 live forks of the 2 GiB snapshot take (`fork -n 100`
    /// of the snapshot, or 100 restores): the blocks newly allocated under
    /// the state directory, counted file by file (each inode once), so other
    /// writers on the same filesystem do not count.
    fn hundred_forks(&self, engine: &mut Engine, sc: &Scenario, which: Which) -> Result<Measurement> {
        let before = allocated_bytes(self.home.path())?;
        let forks = if which == Which::Fork {
            engine.fork(&sc.snapshot.id, 100, &CreateOptions::default())?.1
        } else {
            (0..100)
                .map(|_| engine.restore(&sc.snapshot, &CreateOptions::default()))
                .collect::<Result<Vec<_>, _>>()?
        };
        for f in &forks {
            Self::first_echo(engine, f)?;
        }
        let used = allocated_bytes(self.home.path())?.saturating_sub(before) as f64 / 1e6;
        for f in forks {
            let f = engine.sandbox(&f.id)?;
            engine.remove_sandbox(&f, true)?;
        }
        let how = if which == Which::Fork {
            "fork -n 100"
        } else {
            "100 restores"
        };
        Ok(summarize(
            &format!("disk added by 100 live forks of the 2 GiB snapshot ({how})"),
            "MB",
            vec![used],
            Some(50.0),
            true,
        ))
    }
}

/// Bytes allocated to the files under `dir` (each inode counted once).
fn allocated_bytes(dir: &std::path::Path) -> Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::HashSet::new();
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = match std::fs::read_dir(&d) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e.into()),
        };
        for e in entries {
            let e = e?;
            let meta = match e.path().symlink_metadata() {
                Ok(m) => m,
                Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
                Err(err) => return Err(err.into()),
            };
            if seen.insert((meta.dev(), meta.ino())) {
                total += meta.blocks() * 512;
            }
            if meta.is_dir() {
                stack.push(e.path());
            }
        }
    }
    Ok(total)
}

impl Bench {
    pub(super) fn stages(&self, runs: usize) -> Result<Vec<Measurement>> {
        use cairn_pipeline::run::Quiet;
        let dir = self.home.path().join("pipelines");
        std::fs::create_dir_all(&dir)?;
        let mut engine = self.engine()?;
        let (mut end_to_end, mut by_hand, mut overhead, mut cached) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let req = ExecRequest {
            argv: vec!["true".into()],
            ..ExecRequest::default()
        };
        for i in 0..runs {
            let file = dir.join(format!("noop-{i}.toml"));
            let text = format!(
                "[pipeline]\nname = \"noop\"\nimage = \"busybox\"\n\n[[stage]]\nname = \"noop\"\nkey = \"noop-{}-{i}\"\nrun = [\"true\"]\n",
                std::process::id()
            );
            std::fs::write(&file, text)?;
            // A fresh key: fork, run `true`, snapshot, remove.
            let run = engine.start_run(&file, &Default::default())?;
            let t0 = Instant::now();
            engine.execute_run(&run.id, &Quiet)?;
            let stage = t0.elapsed().as_secs_f64() * 1e3;
            end_to_end.push(stage);
            // The same work by hand: what the stage costs beyond it is
            // the orchestrator's (records, key lookup, logs, the job).
            let t0 = Instant::now();
            let rec = engine.create_sandbox(&CreateOptions::default(), &Silent)?;
            let start = engine
                .exec(&rec, req.clone())?
                .map_err(|f| anyhow::anyhow!(f.message))?;
            start.session.wait(&mut io::sink(), &mut io::sink())?;
            let rec = engine.sandbox(&rec.id)?;
            engine.snapshot(&rec, None)?;
            engine.remove_sandbox(&engine.sandbox(&rec.id)?, true)?;
            let hand = t0.elapsed().as_secs_f64() * 1e3;
            by_hand.push(hand);
            overhead.push(stage - hand);
            // The same key again: a cache hit, where nothing runs.
            let run = engine.start_run(&file, &Default::default())?;
            let t0 = Instant::now();
            engine.execute_run(&run.id, &Quiet)?;
            cached.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let (first, last) = engine.bench_stage_records(100_000, 1_000)?;
        Ok(vec![
            summarize(
                "stages: no-op stage, ready to done (fork, run, snapshot, rm)",
                "ms",
                end_to_end,
                None,
                true,
            ),
            summarize(
                "stages: the same create, exec, snapshot, rm by hand",
                "ms",
                by_hand,
                None,
                true,
            ),
            summarize(
                "stages: dispatch overhead of an executing stage (stage minus by hand)",
                "ms",
                overhead,
                Some(5.0),
                true,
            ),
            summarize(
                "stages: a cached stage (stage key hit: records only, nothing runs)",
                "ms",
                cached,
                None,
                true,
            ),
            summarize(
                "stages: 100,000 stage records, first 1,000",
                "ms/1000",
                vec![first],
                None,
                true,
            ),
            summarize(
                "stages: 100,000 stage records, last 1,000",
                "ms/1000",
                vec![last],
                None,
                true,
            ),
        ])
    }
}

impl Bench {
    pub(super) fn gvisor(&self, runs: usize) -> Result<Vec<Measurement>> {
        let mut engine = self.engine()?;
        let opts = CreateOptions {
            driver: Some("gvisor".into()),
            ..CreateOptions::default()
        };
        // A fresh sandbox, from nothing to the first output of `echo`,
        // removed after each run: what the runsc in use costs before any
        // snapshot.
        let mut starts = Vec::new();
        for _ in 0..runs {
            let t0 = Instant::now();
            let rec = engine.create_sandbox(&opts, &Silent)?;
            Self::first_echo(&engine, &rec)?;
            starts.push(t0.elapsed().as_secs_f64() * 1e3);
            engine.remove_sandbox(&engine.sandbox(&rec.id)?, true)?;
        }
        let mut out = vec![summarize("gvisor: start to first output", "ms", starts, None, true)];
        for (name, churn) in [("fresh", 0u64), ("after 30 s of churn", 30)] {
            let rec = engine.create_sandbox(&opts, &Silent)?;
            let detach = |engine: &Engine, cmd: &str| -> Result<()> {
                let req = ExecRequest {
                    argv: vec!["sh".into(), "-c".into(), cmd.into()],
                    detach: true,
                    ..ExecRequest::default()
                };
                engine
                    .exec(&engine.sandbox(&rec.id)?, req)?
                    .map_err(|f| anyhow::anyhow!(f.message))?;
                Ok(())
            };
            detach(
                &engine,
                "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 1; done",
            )?;
            if churn > 0 {
                eprintln!("cairn bench: {churn} s of a shell loop forking `sleep` ten times a second");
                detach(&engine, "while true; do sleep 0.1; done")?;
                std::thread::sleep(Duration::from_secs(churn));
            }
            let (mut snaps, mut restores, mut stored) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..runs {
                let t0 = Instant::now();
                let snap = engine.snapshot(&engine.sandbox(&rec.id)?, None)?;
                snaps.push(t0.elapsed().as_secs_f64() * 1e3);
                stored.push(snap.stored_bytes as f64 / 1e6);
                let t0 = Instant::now();
                let fork = engine.restore(&snap, &CreateOptions::default())?;
                Self::first_echo(&engine, &fork)?;
                restores.push(t0.elapsed().as_secs_f64() * 1e3);
                let fork = engine.sandbox(&fork.id)?;
                engine.remove_sandbox(&fork, true)?;
            }
            let first = stored.first().copied().unwrap_or(0.0);
            let snapshot = summarize(
                &format!("gvisor: memory snapshot, sandbox goes on ({name})"),
                "ms",
                snaps,
                Some(if churn > 0 { 1000.0 } else { 300.0 }),
                true,
            );
            let restore = summarize(
                &format!("gvisor: restore with memory to first output ({name})"),
                "ms",
                restores,
                Some(if churn > 0 { 1000.0 } else { 200.0 }),
                true,
            );
            let ours = [snapshot.median, restore.median];
            out.push(snapshot);
            out.push(restore);
            out.push(summarize(
                &format!("gvisor: first snapshot stored ({name})"),
                "MB",
                vec![first],
                None,
                true,
            ));
            out.push(summarize(
                &format!("gvisor: later snapshots stored ({name})"),
                "MB",
                stored[1..].to_vec(),
                None,
                true,
            ));
            let rec = engine.sandbox(&rec.id)?;
            engine.remove_sandbox(&rec, true)?;
            match self.plain_runsc(name, churn, if churn > 0 { runs.min(5) } else { runs }) {
                Ok(peer) => {
                    eprintln!(
                        "cairn bench: plain runsc / cairn ({name}): snapshot that goes on {:.1}x, restore to first output {:.1}x",
                        peer[0].median / ours[0],
                        peer[2].median / ours[1]
                    );
                    out.extend(peer);
                }
                Err(e) => eprintln!("cairn bench: no plain runsc figure ({name}): {e:#}"),
            }
        }
        Ok(out)
    }

    /// The same job with the plain runsc CLI, as a user of runsc alone would
    /// do it: `runsc run --detach` of the busybox root (read-only, /tmp in
    /// memory) running the same counter loop (and churn), then for each run
    /// `runsc checkpoint` and `runsc restore --detach` + `runsc exec echo`
    /// to first output. Each restore takes a new container id (a checkpoint
    /// leaves the old one stopped).
    fn plain_runsc(&self, name: &str, churn: u64, runs: usize) -> Result<Vec<Measurement>> {
        let runsc = cairn_sandbox::gvisor::Runsc::locate().ok_or_else(|| anyhow::anyhow!("runsc is not installed"))?;
        // The platform Cairn's driver picks for this runsc, so that the two
        // differ only in what Cairn adds.
        let platform = cairn_sandbox::gvisor::Runsc::find(&self.home.path().join("gvisor"))
            .map(|r| r.platform)
            .unwrap_or("ptrace");
        let work = self.home.path().join(format!("plain-runsc-{churn}"));
        let bundle = work.join("bundle");
        let root = work.join("root");
        std::fs::create_dir_all(&bundle)?;
        std::fs::create_dir_all(&root)?;
        let status = Command::new(&runsc).arg("spec").current_dir(&bundle).status()?;
        if !status.success() {
            bail!("runsc spec failed");
        }
        let path = bundle.join("config.json");
        let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)?;
        spec["root"] = serde_json::json!({ "path": self.layer, "readonly": true });
        spec["process"]["terminal"] = false.into();
        let mut script = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 1; done".to_string();
        if churn > 0 {
            script = format!("({script}) & while true; do sleep 0.1; done");
        }
        spec["process"]["args"] = serde_json::json!(["/bin/sh", "-c", script]);
        if let Some(mounts) = spec["mounts"].as_array_mut() {
            mounts.push(serde_json::json!({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"}));
        }
        std::fs::write(&path, serde_json::to_vec_pretty(&spec)?)?;
        let runsc_cmd = |args: &[&std::ffi::OsStr]| {
            let mut cmd = Command::new(&runsc);
            cmd.arg("--root")
                .arg(&root)
                .args(["--platform", platform, "--network", "none"])
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            cmd
        };
        // A detached sandbox inherits runsc's stdio: errors go to a file, so
        // waiting for runsc never waits for the sandbox.
        let errors = work.join("runsc-errors");
        let run_ok = |mut cmd: Command, what: &str| -> Result<()> {
            let log = std::fs::File::create(&errors)?;
            let status = cmd.stderr(log).status()?;
            if !status.success() {
                let text = std::fs::read_to_string(&errors).unwrap_or_default();
                bail!("runsc {what} failed: {}", text.trim());
            }
            Ok(())
        };
        let id = |i: usize| format!("cairn-bench-{}-{churn}-{i}", std::process::id());
        let mut ids = vec![id(0)];
        let result = (|| -> Result<Vec<Measurement>> {
            run_ok(
                runsc_cmd(&[
                    "run".as_ref(),
                    "--detach".as_ref(),
                    "--bundle".as_ref(),
                    bundle.as_os_str(),
                    id(0).as_ref(),
                ]),
                "run",
            )?;
            if churn > 0 {
                eprintln!("cairn bench: plain runsc: {churn} s of the same churn");
                std::thread::sleep(Duration::from_secs(churn));
            } else {
                std::thread::sleep(Duration::from_millis(500));
            }
            let (mut checkpoints, mut goes_on, mut restores) = (Vec::new(), Vec::new(), Vec::new());
            for i in 0..runs {
                let image = work.join(format!("image-{i}"));
                let t0 = Instant::now();
                run_ok(
                    runsc_cmd(&[
                        "checkpoint".as_ref(),
                        "--image-path".as_ref(),
                        image.as_os_str(),
                        id(i).as_ref(),
                    ]),
                    "checkpoint",
                )?;
                let checkpoint = t0.elapsed().as_secs_f64() * 1e3;
                checkpoints.push(checkpoint);
                ids.push(id(i + 1));
                let t0 = Instant::now();
                run_ok(
                    runsc_cmd(&[
                        "restore".as_ref(),
                        "--detach".as_ref(),
                        "--image-path".as_ref(),
                        image.as_os_str(),
                        "--bundle".as_ref(),
                        bundle.as_os_str(),
                        id(i + 1).as_ref(),
                    ]),
                    "restore",
                )?;
                goes_on.push(checkpoint + t0.elapsed().as_secs_f64() * 1e3);
                let mut exec = runsc_cmd(&["exec".as_ref(), id(i + 1).as_ref(), "/bin/echo".as_ref(), "hi".as_ref()]);
                exec.stdout(Stdio::piped()).stderr(Stdio::piped());
                let out = exec.output()?;
                if !out.status.success() || out.stdout.is_empty() {
                    bail!("runsc exec failed: {}", String::from_utf8_lossy(&out.stderr).trim());
                }
                restores.push(t0.elapsed().as_secs_f64() * 1e3);
            }
            Ok(vec![
                summarize(
                    &format!("gvisor: plain runsc checkpoint + restore, goes on (peer, {name})"),
                    "ms",
                    goes_on,
                    None,
                    true,
                ),
                summarize(
                    &format!("gvisor: plain runsc checkpoint alone (peer, {name})"),
                    "ms",
                    checkpoints,
                    None,
                    true,
                ),
                summarize(
                    &format!("gvisor: plain runsc restore + exec echo (peer, {name})"),
                    "ms",
                    restores,
                    None,
                    true,
                ),
            ])
        })();
        for id in &ids {
            let _ = runsc_cmd(&["delete".as_ref(), "--force".as_ref(), id.as_ref()]).output();
        }
        let _ = std::fs::remove_dir_all(&work);
        result
    }
}

/// Records whether anything was written.
struct FirstByte(bool);

impl Write for FirstByte {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0 |= !buf.is_empty();
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
