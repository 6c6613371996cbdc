//! `cairn bench`: medians and p95 of the operations DESIGN.md sets targets
//! for, each beside the peers installed on this host (bwrap, crun) doing the
//! same job in the same run.
//!
//! The benchmark works in a scratch state directory of its own, seeded with
//! the busybox image from the user's state directory (built if missing), and
//! removes it afterwards.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use cairn_engine::{CreateOptions, Engine, Home, Silent};
use cairn_protocol::{ExecRequest, FileKind, FileMeta};
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Which {
    /// Sandbox start to first output of `echo` (`cairn run`), beside bwrap and crun.
    Start,
    /// Round trip of `true` in a running sandbox.
    Exec,
    /// File copy throughput into and out of a sandbox.
    Cp,
    /// Sandbox starts per second with every core busy.
    Throughput,
    /// Snapshot after a 1 MB change; small sandbox and one over a 2 GiB lower layer.
    Snapshot,
    /// Fork of a live sandbox to first command output; both sizes.
    Fork,
    /// Restore of a snapshot to first command output; both sizes; disk used by 100 forks.
    Restore,
    /// Pipeline stages: a no-op stage end to end, the orchestrator's own
    /// bookkeeping per stage, and 100,000 stage records (first vs last 1,000).
    Stages,
    /// gvisor: memory snapshot and restore to first output, fresh and after
    /// 30 s of process churn.
    Gvisor,
}

#[derive(Debug, Serialize)]
pub struct Measurement {
    pub name: String,
    pub unit: &'static str,
    pub median: f64,
    pub p95: f64,
    pub runs: usize,
    /// The DESIGN.md target, in `unit`, and whether lower is better.
    pub target: Option<f64>,
    pub lower_is_better: bool,
}

fn summarize(name: &str, unit: &'static str, mut samples: Vec<f64>, target: Option<f64>, lower: bool) -> Measurement {
    samples.sort_by(|a, b| a.total_cmp(b));
    let pick = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    Measurement {
        name: name.into(),
        unit,
        median: pick(0.5),
        p95: if lower { pick(0.95) } else { pick(0.05) },
        runs: samples.len(),
        target,
        lower_is_better: lower,
    }
}

struct Bench {
    exe: PathBuf,
    home: tempfile_home::ScratchHome,
    layer: PathBuf,
}

pub fn run(user_home: Home, which: &[Which], runs: usize, json: bool) -> Result<i32> {
    if runs < 5 {
        bail!("--runs must be at least 5 to give a median and a p95");
    }
    let bench = Bench::prepare(user_home)?;
    let mut results = Vec::new();
    for w in which {
        eprintln!("cairn bench: measuring {w:?} ({runs} runs)");
        let r = match w {
            Which::Start => bench.start(runs),
            Which::Exec => bench.exec(runs),
            Which::Cp => bench.copy(runs.min(20)),
            Which::Throughput => bench.throughput(),
            Which::Snapshot | Which::Fork | Which::Restore => bench.snapshots(*w, runs.min(30)),
            Which::Stages => bench.stages(runs.min(50)),
            Which::Gvisor => bench.gvisor(runs.min(10)),
        };
        results.extend(r?);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        print_table(&results);
    }
    Ok(0)
}

fn print_table(results: &[Measurement]) {
    println!(
        "{:<44} {:>10} {:>10} {:>6}  {:>10}  unit",
        "measurement", "median", "p95", "runs", "target"
    );
    for m in results {
        let target = match m.target {
            Some(t) if m.lower_is_better => format!("<= {t}"),
            Some(t) => format!(">= {t}"),
            None => "-".into(),
        };
        println!(
            "{:<44} {:>10.3} {:>10.3} {:>6}  {:>10}  {}",
            m.name, m.median, m.p95, m.runs, target, m.unit
        );
    }
}

impl Bench {
    fn prepare(user_home: Home) -> Result<Bench> {
        let mut engine = Engine::open(user_home)?;
        let image = match engine.image("busybox") {
            Ok(i) => i,
            Err(_) => engine.build_busybox("busybox", &crate::progress::Steps::new())?,
        };
        let layer = engine.home().layers().join(&image.layers[0]);
        drop(engine);
        let home = tempfile_home::ScratchHome::new()?;
        let status = Command::new(std::env::current_exe()?)
            .args(["image", "import"])
            .arg(&layer)
            .args(["--name", "busybox"])
            .env("CAIRN_HOME", home.path())
            .stdout(Stdio::null())
            .status()?;
        if !status.success() {
            bail!("cannot seed the benchmark's state directory");
        }
        Ok(Bench {
            exe: std::env::current_exe()?,
            home,
            layer,
        })
    }

    fn engine(&self) -> Result<Engine> {
        Ok(Engine::open(Home::at(self.home.path()))?)
    }

    /// Milliseconds from spawning `cmd` to its first byte of stdout, and to its exit.
    fn first_output(cmd: &mut Command) -> Result<(f64, f64)> {
        let t0 = Instant::now();
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .stdin(Stdio::null())
            .spawn()?;
        let mut out = child.stdout.take().context("no stdout")?;
        let mut byte = [0u8; 1];
        let n = out.read(&mut byte)?;
        let first = t0.elapsed().as_secs_f64() * 1e3;
        let mut rest = Vec::new();
        out.read_to_end(&mut rest)?;
        let status = child.wait()?;
        if n == 0 || !status.success() {
            bail!("{cmd:?} failed ({status}) or printed nothing");
        }
        Ok((first, t0.elapsed().as_secs_f64() * 1e3))
    }

    fn start(&self, runs: usize) -> Result<Vec<Measurement>> {
        let mut results = Vec::new();
        let mut cmd = Command::new(&self.exe);
        cmd.args(["run", "--", "echo", "hi"])
            .env("CAIRN_HOME", self.home.path());
        let (firsts, totals) = self.repeat(runs, &mut cmd)?;
        let cairn = summarize(
            "start: cairn run -- echo (to first output)",
            "ms",
            firsts,
            Some(10.0),
            true,
        );
        let cairn_median = cairn.median;
        results.push(cairn);
        results.push(summarize(
            "start: cairn run -- echo (whole command, with rm)",
            "ms",
            totals,
            None,
            true,
        ));
        if let Some(bwrap) = which("bwrap") {
            let mut cmd = Command::new(bwrap);
            cmd.args(["--unshare-all", "--die-with-parent", "--ro-bind"])
                .arg(&self.layer)
                .args([
                    "/",
                    "--proc",
                    "/proc",
                    "--dev",
                    "/dev",
                    "--tmpfs",
                    "/tmp",
                    "/bin/echo",
                    "hi",
                ]);
            let (firsts, _) = self.repeat(runs, &mut cmd)?;
            let m = summarize("start: bwrap echo (peer)", "ms", firsts, None, true);
            eprintln!("cairn bench: cairn/bwrap start ratio {:.2}", cairn_median / m.median);
            results.push(m);
        } else {
            eprintln!("cairn bench: bwrap is not installed (apt-get install bubblewrap); no bwrap figure");
        }
        if let Some(crun) = which("crun") {
            let bundle = self.crun_bundle(&crun)?;
            hide_hybrid_cgroup2()?;
            let mut i = 0u64;
            let mut firsts = Vec::new();
            for _ in 0..runs {
                i += 1;
                let mut cmd = Command::new(&crun);
                cmd.args(["run", "--bundle"])
                    .arg(&bundle)
                    .arg(format!("cairn-bench-{}-{i}", std::process::id()));
                firsts.push(Self::first_output(&mut cmd)?.0);
            }
            let m = summarize("start: crun run echo (peer)", "ms", firsts, None, true);
            eprintln!("cairn bench: cairn/crun start ratio {:.2}", cairn_median / m.median);
            results.push(m);
        } else {
            eprintln!("cairn bench: crun is not installed (apt-get install crun); no crun figure");
        }
        Ok(results)
    }

    fn repeat(&self, runs: usize, cmd: &mut Command) -> Result<(Vec<f64>, Vec<f64>)> {
        for _ in 0..runs.min(5) {
            Self::first_output(cmd)?;
        }
        let mut firsts = Vec::with_capacity(runs);
        let mut totals = Vec::with_capacity(runs);
        for _ in 0..runs {
            let (f, t) = Self::first_output(cmd)?;
            firsts.push(f);
            totals.push(t);
        }
        Ok((firsts, totals))
    }

    /// An OCI bundle for crun over the busybox layer, read-only root.
    fn crun_bundle(&self, crun: &Path) -> Result<PathBuf> {
        let bundle = self.home.path().join("crun-bundle");
        std::fs::create_dir_all(&bundle)?;
        let status = Command::new(crun).arg("spec").current_dir(&bundle).status()?;
        if !status.success() {
            bail!("crun spec failed");
        }
        let path = bundle.join("config.json");
        let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)?;
        spec["root"] = serde_json::json!({ "path": self.layer, "readonly": true });
        spec["process"]["terminal"] = false.into();
        spec["process"]["args"] = serde_json::json!(["/bin/echo", "hi"]);
        std::fs::write(&path, serde_json::to_vec_pretty(&spec)?)?;
        Ok(bundle)
    }

    fn exec(&self, runs: usize) -> Result<Vec<Measurement>> {
        let mut engine = self.engine()?;
        let rec = engine.create_sandbox(&CreateOptions::default(), &Silent)?;
        let client = engine.client(&rec)?;
        let req = ExecRequest {
            argv: vec!["true".into()],
            ..ExecRequest::default()
        };
        let mut samples = Vec::with_capacity(runs);
        for i in 0..runs + 10 {
            let t0 = Instant::now();
            let session = client.exec(req.clone())?.map_err(|f| anyhow::anyhow!(f.message))?;
            let status = session.wait(&mut io::sink(), &mut io::sink())?;
            let dt = t0.elapsed().as_secs_f64() * 1e3;
            if status.map(|s| s.code) != Some(Some(0)) {
                bail!("`true` failed in the sandbox: {status:?}");
            }
            if i >= 10 {
                samples.push(dt);
            }
        }
        let mut cli = Vec::with_capacity(runs / 4);
        for _ in 0..(runs / 4).max(5) {
            let t0 = Instant::now();
            let status = Command::new(&self.exe)
                .args(["exec", &rec.id, "--", "true"])
                .env("CAIRN_HOME", self.home.path())
                .status()?;
            if !status.success() {
                bail!("cairn exec failed");
            }
            cli.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let rec = engine.sandbox(&rec.id)?;
        engine.remove_sandbox(&rec, true)?;
        Ok(vec![
            summarize(
                "exec: round trip of `true` (engine API)",
                "ms",
                samples,
                Some(1.0),
                true,
            ),
            summarize("exec: cairn exec ID -- true (whole command)", "ms", cli, None, true),
        ])
    }

    fn copy(&self, runs: usize) -> Result<Vec<Measurement>> {
        const SIZE: usize = 256 << 20;
        let mut engine = self.engine()?;
        let rec = engine.create_sandbox(&CreateOptions::default(), &Silent)?;
        let client = engine.client(&rec)?;
        let data: Vec<u8> = (0..SIZE as u64)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let meta = FileMeta {
            path: "/tmp/bench.bin".into(),
            kind: FileKind::File,
            mode: 0o644,
            uid: 0,
            gid: 0,
            size: SIZE as u64,
            mtime_ns: 0,
        };
        let (mut into, mut out) = (Vec::new(), Vec::new());
        for _ in 0..runs.max(5) {
            let t0 = Instant::now();
            client.put_file(meta.clone(), &mut &data[..])?;
            into.push(SIZE as f64 / 1048576.0 / t0.elapsed().as_secs_f64());
            let t0 = Instant::now();
            let mut sink = CountingSink(0);
            client.get_file("/tmp/bench.bin", &mut sink)?;
            if sink.0 != SIZE as u64 {
                bail!("copied out {} bytes of {SIZE}", sink.0);
            }
            out.push(SIZE as f64 / 1048576.0 / t0.elapsed().as_secs_f64());
        }
        let rec = engine.sandbox(&rec.id)?;
        engine.remove_sandbox(&rec, true)?;
        Ok(vec![
            summarize("cp: into a sandbox (256 MiB)", "MB/s", into, Some(200.0), false),
            summarize("cp: out of a sandbox (256 MiB)", "MB/s", out, Some(200.0), false),
        ])
    }

    /// Sandbox starts per second with every core busy: starts alone, start +
    /// exec + remove through the engine, `cairn run`, and bwrap's loop.
    fn throughput(&self) -> Result<Vec<Measurement>> {
        let workers = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2) * 2;
        let home = self.home.path().to_path_buf();
        // Starts alone: each worker removes what it started after the window.
        let starts = rounds(workers, |deadline| {
            let mut engine = Engine::open(Home::at(&home))?;
            let mut ids = Vec::new();
            while Instant::now() < deadline {
                ids.push(engine.create_sandbox(&CreateOptions::default(), &Silent)?.id);
            }
            for id in &ids {
                let rec = engine.sandbox(id)?;
                engine.remove_sandbox(&rec, true)?;
            }
            Ok(ids.len())
        })?;
        let cycles = rounds(workers, |deadline| {
            let mut engine = Engine::open(Home::at(&home))?;
            let opts = CreateOptions {
                auto_remove: true,
                ..CreateOptions::default()
            };
            let req = ExecRequest {
                argv: vec!["true".into()],
                ..ExecRequest::default()
            };
            let mut n = 0;
            while Instant::now() < deadline {
                let rec = engine.create_sandbox(&opts, &Silent)?;
                let start = engine
                    .exec(&rec, req.clone())?
                    .map_err(|f| anyhow::anyhow!(f.message))?;
                start.session.wait(&mut io::sink(), &mut io::sink())?;
                let rec = engine.sandbox(&rec.id)?;
                engine.remove_sandbox(&rec, true)?;
                n += 1;
            }
            Ok(n)
        })?;
        let mut run = Command::new(&self.exe);
        run.args(["run", "--", "true"]).env("CAIRN_HOME", &home);
        let mut out = vec![
            summarize(
                &format!("throughput: sandbox starts (engine API), {workers} threads"),
                "starts/s",
                starts,
                Some(250.0),
                false,
            ),
            summarize(
                &format!("throughput: start+exec+rm (engine API), {workers} threads"),
                "starts/s",
                cycles,
                None,
                false,
            ),
            summarize(
                &format!("throughput: cairn run -- true, {workers} loops"),
                "starts/s",
                command_rounds(workers, &run)?,
                None,
                false,
            ),
        ];
        if let Some(bwrap) = which("bwrap") {
            let mut cmd = Command::new(bwrap);
            cmd.args(["--unshare-all", "--die-with-parent", "--ro-bind"])
                .arg(&self.layer)
                .args(["/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "/bin/true"]);
            out.push(summarize(
                &format!("throughput: bwrap true (peer), {workers} loops"),
                "starts/s",
                command_rounds(workers, &cmd)?,
                None,
                false,
            ));
        }
        Ok(out)
    }
}

/// Five rounds of `workers` threads each running `work` until a deadline 2 s
/// away; `work` returns how many it completed by then. Completions per second.
fn rounds(workers: usize, work: impl Fn(Instant) -> Result<usize> + Sync) -> Result<Vec<f64>> {
    let window = Duration::from_secs(2);
    let mut rates = Vec::new();
    for _ in 0..5 {
        let deadline = Instant::now() + window;
        let done: Vec<Result<usize>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..workers).map(|_| scope.spawn(|| work(deadline))).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a worker panicked"))))
                .collect()
        });
        let total: usize = done.into_iter().sum::<Result<usize>>()?;
        rates.push(total as f64 / window.as_secs_f64());
    }
    Ok(rates)
}

/// [`rounds`] of `cmd` run back to back.
fn command_rounds(workers: usize, cmd: &Command) -> Result<Vec<f64>> {
    let envs: Vec<_> = cmd
        .get_envs()
        .filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned())))
        .collect();
    rounds(workers, |deadline| {
        let mut n = 0;
        while Instant::now() < deadline {
            let status = Command::new(cmd.get_program())
                .args(cmd.get_args())
                .envs(envs.clone())
                .stdin(Stdio::null())
                .status()?;
            if !status.success() {
                bail!("{:?} failed under load", cmd.get_program());
            }
            n += 1;
        }
        Ok(n)
    })
}

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

    fn snapshots(&self, which: Which, runs: usize) -> Result<Vec<Measurement>> {
        let mut engine = self.engine()?;
        let mut out = Vec::new();
        let mut medians = Vec::new();
        for big in [false, true] {
            let sc = self.scenario(&mut engine, big)?;
            let mut samples = Vec::with_capacity(runs);
            let mut stored = Vec::new();
            for _ in 0..runs {
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
                        samples.push(t0.elapsed().as_secs_f64() * 1e3);
                        stored.push(snap.stored_bytes as f64 / 1e6);
                    }
                    Which::Fork => {
                        let t0 = Instant::now();
                        let (_, forks) = engine.fork(&sc.sandbox.id, 1, &CreateOptions::default())?;
                        Self::first_echo(&engine, &forks[0])?;
                        samples.push(t0.elapsed().as_secs_f64() * 1e3);
                        let f = engine.sandbox(&forks[0].id)?;
                        engine.remove_sandbox(&f, true)?;
                    }
                    _ => {
                        let t0 = Instant::now();
                        let rec = engine.restore(&sc.snapshot, &CreateOptions::default())?;
                        Self::first_echo(&engine, &rec)?;
                        samples.push(t0.elapsed().as_secs_f64() * 1e3);
                        let rec = engine.sandbox(&rec.id)?;
                        engine.remove_sandbox(&rec, true)?;
                    }
                }
            }
            let (label, target) = match which {
                Which::Snapshot => ("snapshot after a 1 MB change", 20.0),
                Which::Fork => ("fork a live sandbox to first output", 15.0),
                _ => ("restore a snapshot to first output", 15.0),
            };
            let m = summarize(&format!("{label} ({})", sc.name), "ms", samples, Some(target), true);
            medians.push(m.median);
            out.push(m);
            if which == Which::Snapshot {
                out.push(summarize(
                    &format!("stored per 1 MB-change snapshot ({})", sc.name),
                    "MB",
                    stored,
                    Some(1.05),
                    true,
                ));
            }
            if which == Which::Restore && big {
                out.push(self.hundred_forks(&mut engine, &sc)?);
            }
            let rec = engine.sandbox(&sc.sandbox.id)?;
            engine.remove_sandbox(&rec, true)?;
        }
        eprintln!(
            "cairn bench: {which:?} 2 GiB / small median ratio {:.2} (target <= 1.2)",
            medians[1] / medians[0]
        );
        Ok(out)
    }

    /// Disk space 100 live forks of the 2 GiB snapshot take.
    fn hundred_forks(&self, engine: &mut Engine, sc: &Scenario) -> Result<Measurement> {
        let free = || -> Result<u64> {
            let st = nix::sys::statvfs::statvfs(self.home.path())?;
            Ok(st.blocks_available() as u64 * st.fragment_size() as u64)
        };
        let before = free()?;
        let mut forks = Vec::new();
        for _ in 0..100 {
            forks.push(engine.restore(&sc.snapshot, &CreateOptions::default())?);
        }
        let used = before.saturating_sub(free()?) as f64 / 1e6;
        for f in forks {
            let f = engine.sandbox(&f.id)?;
            engine.remove_sandbox(&f, true)?;
        }
        Ok(summarize(
            "disk added by 100 forks of the 2 GiB snapshot",
            "MB",
            vec![used],
            Some(50.0),
            true,
        ))
    }
}

impl Bench {
    fn stages(&self, runs: usize) -> Result<Vec<Measurement>> {
        use cairn_engine::pipeline::run::Quiet;
        let dir = self.home.path().join("pipelines");
        std::fs::create_dir_all(&dir)?;
        let mut engine = self.engine()?;
        let (mut end_to_end, mut bookkeeping) = (Vec::new(), Vec::new());
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
            end_to_end.push(t0.elapsed().as_secs_f64() * 1e3);
            // The same key again: only the orchestrator's records.
            let run = engine.start_run(&file, &Default::default())?;
            let t0 = Instant::now();
            engine.execute_run(&run.id, &Quiet)?;
            bookkeeping.push(t0.elapsed().as_secs_f64() * 1e3);
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
                "stages: dispatch overhead (records and key lookup per stage)",
                "ms",
                bookkeeping,
                Some(5.0),
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
    fn gvisor(&self, runs: usize) -> Result<Vec<Measurement>> {
        let mut engine = self.engine()?;
        let opts = CreateOptions {
            driver: Some("gvisor".into()),
            ..CreateOptions::default()
        };
        let mut out = Vec::new();
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
            out.push(summarize(
                &format!("gvisor: memory snapshot, sandbox goes on ({name})"),
                "ms",
                snaps,
                Some(if churn > 0 { 1000.0 } else { 300.0 }),
                true,
            ));
            out.push(summarize(
                &format!("gvisor: restore with memory to first output ({name})"),
                "ms",
                restores,
                Some(if churn > 0 { 1000.0 } else { 200.0 }),
                true,
            ));
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
        }
        Ok(out)
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

struct CountingSink(u64);

impl Write for CountingSink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// crun (1.8) refuses hosts that mount cgroup v2 beside v1 controllers.
/// Where the v2 tree carries no controllers Cairn uses, the benchmark
/// detaches it in a private mount namespace of its own, so crun runs on v1
/// as Cairn does.
fn hide_hybrid_cgroup2() -> Result<()> {
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    let unified = Path::new("/sys/fs/cgroup/unified");
    if !unified.join("cgroup.controllers").exists() {
        return Ok(());
    }
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).context("unshare the mount namespace")?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )?;
    umount2(unified, MntFlags::MNT_DETACH).context("detach the hybrid cgroup v2 mount")?;
    eprintln!("cairn bench: crun runs with the hybrid cgroup v2 mount detached (crun refuses hybrid hosts)");
    Ok(())
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// The benchmark's own state directory, garbage-collected and removed on drop.
mod tempfile_home {
    use std::path::{Path, PathBuf};

    pub struct ScratchHome(PathBuf);

    impl ScratchHome {
        pub fn new() -> std::io::Result<ScratchHome> {
            let dir = std::env::temp_dir().join(format!("cairn-bench-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            Ok(ScratchHome(dir))
        }
        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for ScratchHome {
        fn drop(&mut self) {
            if let Ok(mut engine) = cairn_engine::Engine::open(cairn_engine::Home::at(&self.0)) {
                if let Ok(list) = engine.list_sandboxes() {
                    for rec in list {
                        let _ = engine.remove_sandbox(&rec, true);
                    }
                }
            }
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
