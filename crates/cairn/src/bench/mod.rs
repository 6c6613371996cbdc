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
use cairn_sandbox::client::InitClient;
use serde::Serialize;

mod api;
pub use api::flood_attacker;
mod diff;
mod drift;
mod gvisor_memory;
mod layers;
mod many_files;
mod scale;
mod sessions;
mod state;

pub use scale::ScaleOptions;
pub use sessions::SessionsOptions;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Which {
    /// Sandbox start to first output of `echo` (`cairn run`), beside bwrap and crun.
    Start,
    /// Start to first output on this host as it is, beside the same after
    /// --churn sandboxes that wrote files and were removed; the ratio, and
    /// the dying memory cgroups before and after.
    Drift,
    /// Round trip of `true` in a running sandbox, beside a ping and the
    /// same `true` started and reaped inside as init starts it.
    Exec,
    /// File copy throughput into and out of a sandbox.
    Cp,
    /// Sandbox starts per second with every core busy, removal included
    /// (a sustained rate, not a burst).
    Throughput,
    /// Snapshot after a 1 MB change; small sandbox and one over a 2 GiB lower layer.
    Snapshot,
    /// A full snapshot of a sandbox holding 1.2 million small files, beside
    /// `tar -cf - | cat` of the same tree; the snapshotting process's peak RSS.
    ManyFiles,
    /// Fork of a live sandbox to first command output; both sizes.
    Fork,
    /// Restore of a snapshot to first command output; both sizes; disk used by 100 forks.
    Restore,
    /// `cairn diff` of two branches over a 2 GiB image, ten files changed in
    /// each, beside `diff -rq` of the same two trees.
    Diff,
    /// `cairn verify` of a 2 GiB snapshot from the disk (the page cache
    /// emptied first), beside `cat` of the store's objects read the same way.
    Verify,
    /// Pipeline stages: a no-op stage end to end beside the same work by
    /// hand (their difference is the dispatch overhead), a cached stage,
    /// and 100,000 stage records (first vs last 1,000). docs/benchmarks.md
    /// says how each figure is taken.
    Stages,
    /// gvisor: start to first output; memory snapshot and restore to
    /// first output, fresh and after 30 s of process churn.
    Gvisor,
    /// gvisor: memory snapshots of a sandbox holding --memory of random
    /// bytes in tmpfs, the first and then after 8 MiB changes, each split
    /// into runsc's part and Cairn's, with the bytes stored.
    GvisorMemory,
    /// The HTTP API over its Unix socket: create to first output beside the
    /// engine, exec round trip, 1,000 concurrent streamed execs.
    Api,
    /// Agent sessions: log append and tail beside a raw SQLite insert, flat
    /// up to --entries; native suspend and resume over --size of files beside
    /// a plain snapshot and restore; a gVisor session's resume to first output.
    Sessions,
    /// Native layers: start by each way the kernel takes them (fd, path,
    /// shifted) beside bwrap; a shifted copy of a 1 GiB image: its first
    /// start, its disk, a later start.
    Layers,
    /// The shared stage queue with four workers: claim latency, enqueue to
    /// claim by an idle worker, stages dispatched per second (on --postgres,
    /// else SQLite); with --store s3://…, a snapshot of --size restored on a
    /// cold cache beside a warm one.
    Scale,
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
    /// For a peer's figure (bwrap, crun): Cairn's median for the same job
    /// divided by the peer's (below 1 means Cairn is faster, for times;
    /// above 1 means Cairn is faster, for rates).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cairn_ratio: Option<f64>,
}

impl Measurement {
    /// Whether the median meets the target, if there is one.
    fn met(&self) -> Option<bool> {
        self.target.map(|t| {
            if self.lower_is_better {
                self.median <= t
            } else {
                self.median >= t
            }
        })
    }

    /// This measurement as a peer's figure for the job `cairn` measured.
    fn peer_of(mut self, cairn: &Measurement) -> Measurement {
        self.cairn_ratio = Some(cairn.median / self.median);
        self
    }
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
        cairn_ratio: None,
    }
}

struct Bench {
    exe: PathBuf,
    home: tempfile_home::ScratchHome,
    layer: PathBuf,
    /// The layer of the user's `code-interpreter` image, if there is one
    /// (`api` imports it for its code interpreter figures).
    interpreter: Option<PathBuf>,
}

/// How much work the `drift` and `gvisor-memory` groups do, and what
/// `start` compares with.
#[derive(Debug, Clone)]
pub struct Sizes {
    /// Sandboxes made and removed between drift's two figures.
    pub churn: usize,
    /// Bytes the gVisor sandbox holds in tmpfs.
    pub gvisor_memory: u64,
    /// Another `cairn` binary `start` times in the same rounds.
    pub against: Option<PathBuf>,
}

pub fn run(
    user_home: Home,
    which: &[Which],
    runs: usize,
    sessions: &SessionsOptions,
    scale: &ScaleOptions,
    sizes: &Sizes,
    json: bool,
) -> Result<i32> {
    let Sizes {
        churn,
        gvisor_memory,
        ref against,
    } = *sizes;
    if runs < 5 {
        bail!("--runs must be at least 5 to give a median and a p95");
    }
    sessions.check()?;
    // The benchmark's scratch state directories keep their own embedded
    // stores; the `cairn` processes it starts must not inherit the user's.
    std::env::remove_var("CAIRN_STATE");
    let bench = Bench::prepare(user_home)?;
    let mut results = Vec::new();
    for w in which {
        eprintln!("cairn bench: measuring {w:?} ({runs} runs)");
        let r = match w {
            Which::Start => bench.start(runs, against.as_deref()),
            Which::Drift => bench.drift(runs, churn),
            Which::Exec => bench.exec(runs),
            Which::Cp => bench.copy(runs.min(20)),
            Which::Throughput => bench.throughput(),
            Which::Snapshot | Which::Fork | Which::Restore => bench.snapshots(*w, runs.min(30)),
            Which::ManyFiles => bench.many_files(runs.min(5)),
            Which::Diff => bench.diff(runs),
            Which::Verify => bench.verify(runs),
            Which::Stages => bench.stages(runs.min(50)),
            Which::Gvisor => bench.gvisor(runs.min(10)),
            Which::GvisorMemory => bench.gvisor_memory(runs.min(20), gvisor_memory),
            Which::Api => bench.api(runs),
            Which::Sessions => bench.sessions(runs, sessions),
            Which::Scale => bench.scale(runs, scale),
            Which::Layers => bench.layers(runs),
        };
        results.extend(r?);
    }
    if json {
        let rows = results
            .iter()
            .map(|m| {
                let mut row = serde_json::to_value(m)?;
                if let Some(met) = m.met() {
                    row["met"] = met.into();
                }
                Ok(row)
            })
            .collect::<Result<Vec<_>>>()?;
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print_table(&results);
    }
    Ok(0)
}

fn print_table(results: &[Measurement]) {
    let width = results.iter().map(|m| m.name.len()).max().unwrap_or(0).max(52);
    println!(
        "{:<width$} {:>10} {:>10} {:>6}  {:>10}  {:>4}  {:>10}  unit",
        "measurement", "median", "p95", "runs", "target", "met", "cairn/peer"
    );
    for m in results {
        // Targets derived from a peer's median print at the figures' precision.
        let shown = |t: f64| {
            let s = format!("{t:.3}");
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        };
        let target = match m.target {
            Some(t) if m.lower_is_better => format!("<= {}", shown(t)),
            Some(t) => format!(">= {}", shown(t)),
            None => "-".into(),
        };
        let met = match m.met() {
            Some(true) => "yes",
            Some(false) => "no",
            None => "-",
        };
        let ratio = m.cairn_ratio.map_or("-".into(), |r| format!("{r:.2}"));
        println!(
            "{:<width$} {:>10.3} {:>10.3} {:>6}  {:>10}  {:>4}  {:>10}  {}",
            m.name, m.median, m.p95, m.runs, target, met, ratio, m.unit
        );
    }
}

impl Bench {
    fn prepare(user_home: Home) -> Result<Bench> {
        let home = tempfile_home::ScratchHome::new()?;
        // A state directory written by another Cairn version (a newer
        // schema) cannot lend its image: the benchmark then builds its own.
        let user_root = user_home.root().to_path_buf();
        let borrowed = (|| -> Result<(PathBuf, Option<PathBuf>)> {
            let mut engine = Engine::open(user_home)?;
            let image = match engine.image("busybox") {
                Ok(i) => i,
                Err(_) => engine.build_busybox("busybox", &crate::progress::Steps::new())?,
            };
            let interpreter = engine
                .image(cairn_engine::images::CODE_INTERPRETER_SOURCE)
                .ok()
                .map(|i| engine.home().layers().join(&i.layers[0]))
                .filter(|l| l.is_dir());
            Ok((engine.home().layers().join(&image.layers[0]), interpreter))
        })();
        let (layer, interpreter) = match borrowed {
            Ok(found) => found,
            Err(e) => {
                eprintln!(
                    "cairn bench: cannot take the busybox image from {}: {e:#}; building it in the benchmark's own state directory",
                    user_root.display()
                );
                let mut engine = Engine::open(Home::at(home.path()))?;
                let image = engine.build_busybox("busybox", &crate::progress::Steps::new())?;
                let layer = engine.home().layers().join(&image.layers[0]);
                return Ok(Bench {
                    exe: std::env::current_exe()?,
                    home,
                    layer,
                    interpreter: None,
                });
            }
        };
        if !import_busybox(&std::env::current_exe()?, home.path(), &layer)?.success() {
            bail!("cannot seed the benchmark's state directory");
        }
        Ok(Bench {
            exe: std::env::current_exe()?,
            home,
            layer,
            interpreter,
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

    fn start(&self, runs: usize, against: Option<&Path>) -> Result<Vec<Measurement>> {
        let cairn = |network: Option<&str>| {
            let mut cmd = Command::new(&self.exe);
            cmd.arg("run");
            if let Some(network) = network {
                cmd.args(["--network", network]);
            }
            cmd.args(["--", "echo", "hi"]).env("CAIRN_HOME", self.home.path());
            cmd
        };
        let bwrap = peer("bwrap", "bubblewrap");
        let other = against.map(|exe| self.other_cairn(exe)).transpose()?;
        // Cairn and bwrap in turn, one run of each per round: the host's
        // speed drifts over a run of this length (by 0.5 ms within minutes
        // here), and a drift then reaches both figures alike.
        let mut makes: Vec<Box<dyn Fn() -> Command + '_>> = vec![Box::new(|| cairn(None))];
        if let Some(bwrap) = &bwrap {
            makes.push(Box::new(move || self.bwrap(bwrap, &["/bin/echo", "hi"])));
        }
        if let Some((exe, home)) = &other {
            makes.push(Box::new(move || {
                let mut cmd = Command::new(exe);
                cmd.args(["run", "--", "echo", "hi"]).env("CAIRN_HOME", home.path());
                cmd
            }));
        }
        let mut timed = interleaved(runs, &makes)?.into_iter();
        let (firsts, totals) = timed.next().context("no cairn figures")?;
        let mut first_output = summarize(
            "start: cairn run -- echo (to first output)",
            "ms",
            firsts.clone(),
            None,
            true,
        );
        let mut results = Vec::new();
        // With `--network egress`: a veth pair, an address slot and its
        // nftables element; the extra is each run's difference from the
        // loopback-only run of the same index. These run after the others:
        // the kernel's deferred teardown of a veth pair and its namespace
        // would slow whatever ran next.
        if which("nft").is_some() {
            let (egress, _) = repeat(runs, || cairn(Some("egress")))?;
            let extra = egress.iter().zip(&firsts).map(|(e, n)| e - n).collect();
            results.push(summarize(
                "start: cairn run --network egress -- echo (to first output)",
                "ms",
                egress,
                None,
                true,
            ));
            results.push(summarize(
                "start: egress's extra over loopback only",
                "ms",
                extra,
                Some(5.0),
                true,
            ));
        }
        results.push(summarize(
            "start: cairn run -- echo (whole command, with rm)",
            "ms",
            totals,
            None,
            true,
        ));
        if bwrap.is_some() {
            let (firsts, _) = timed.next().context("no bwrap figures")?;
            let bwrap = summarize("start: bwrap echo (peer)", "ms", firsts, None, true).peer_of(&first_output);
            // DESIGN.md's target: 1.5x bwrap measured in the same run.
            first_output.target = Some(1.5 * bwrap.median);
            results.push(bwrap);
        }
        if let Some((exe, _)) = &other {
            let (firsts, _) = timed.next().context("no figures for the other cairn")?;
            let name = format!("start: {} run -- echo (to first output)", exe.display());
            results.push(summarize(&name, "ms", firsts, None, true).peer_of(&first_output));
        }
        // crun needs a thread whose mount namespace hides the hybrid
        // cgroup v2 mount: its runs come after the others.
        if let Some(crun) = peer("crun", "crun") {
            let bundle = self.crun_bundle(&crun, &["/bin/echo", "hi"])?;
            let (firsts, _) = in_crun_namespace(|| repeat(runs, || crun_run(&crun, &bundle)))?;
            results.push(summarize("start: crun run echo (peer)", "ms", firsts, None, true).peer_of(&first_output));
        }
        results.insert(0, first_output);
        Ok(results)
    }

    /// `exe`, another `cairn` binary, with a state directory of its own
    /// holding the benchmark's busybox layer (imported by `exe`, which may
    /// keep another schema).
    fn other_cairn(&self, exe: &Path) -> Result<(PathBuf, tempfile_home::ScratchHome)> {
        let exe = exe
            .canonicalize()
            .with_context(|| format!("--against {}: no such binary", exe.display()))?;
        let version = Command::new(&exe)
            .arg("--version")
            .output()
            .with_context(|| format!("--against {}: cannot run it", exe.display()))?;
        if !version.stdout.starts_with(b"cairn ") {
            bail!(
                "--against {}: not a cairn binary (`--version` does not say cairn)",
                exe.display()
            );
        }
        let home = tempfile_home::ScratchHome::named("against")?;
        let status = import_busybox(&exe, home.path(), &self.layer)?;
        if !status.success() {
            bail!("--against {}: its `image import` failed ({status})", exe.display());
        }
        Ok((exe, home))
    }

    /// bwrap over the busybox layer (read-only), with fresh /proc, /dev, /tmp.
    fn bwrap(&self, bwrap: &Path, argv: &[&str]) -> Command {
        let mut cmd = Command::new(bwrap);
        cmd.args(["--unshare-all", "--die-with-parent", "--ro-bind"])
            .arg(&self.layer)
            .args(["/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"])
            .args(argv);
        cmd
    }

    /// An OCI bundle for crun over the busybox layer (read-only root, a
    /// tmpfs on /tmp) running `argv`.
    fn crun_bundle(&self, crun: &Path, argv: &[&str]) -> Result<PathBuf> {
        let bundle = self
            .home
            .path()
            .join(format!("crun-bundle-{}", argv.join("-").replace('/', "_")));
        if bundle.join("config.json").exists() {
            return Ok(bundle);
        }
        std::fs::create_dir_all(&bundle)?;
        let status = Command::new(crun).arg("spec").current_dir(&bundle).status()?;
        if !status.success() {
            bail!("crun spec failed");
        }
        let path = bundle.join("config.json");
        let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(&path)?)?;
        spec["root"] = serde_json::json!({ "path": self.layer, "readonly": true });
        spec["process"]["terminal"] = false.into();
        spec["process"]["args"] = serde_json::json!(argv);
        if let Some(mounts) = spec["mounts"].as_array_mut() {
            mounts.push(serde_json::json!({
                "destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"]
            }));
        }
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
        // The connection alone (a ping: connect, handshake, one frame each
        // way), so the exec figure splits into the protocol and the process.
        let mut pings = Vec::with_capacity(runs);
        for i in 0..runs + 10 {
            let t0 = Instant::now();
            client.ping(Duration::from_secs(5))?;
            if i >= 10 {
                pings.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        // The process alone, started the way init starts every command
        // (clone with CLONE_VM | CLONE_VFORK, exec, wait) by a copy of init
        // put into the sandbox (`cairn-init --time-spawn`): the round trip
        // less this is the protocol's, the serving loop's and the reaper's
        // share.
        let alone = spawn_alone(&client, runs)?;
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
        let cli = summarize("exec: cairn exec ID -- true (whole command)", "ms", cli, None, true);
        let mut out = vec![
            summarize(
                "exec: round trip of `true` (engine API)",
                "ms",
                samples,
                Some(0.5),
                true,
            ),
            summarize(
                "exec: a ping to init alone (connection and handshake)",
                "ms",
                pings,
                None,
                true,
            ),
            summarize(
                "exec: `true` started as init starts it, timed inside (process alone)",
                "ms",
                alone,
                None,
                true,
            ),
        ];
        if let Some(crun) = peer("crun", "crun") {
            let bundle = self.crun_bundle(&crun, &["/bin/sleep", "1000000"])?;
            let peer_samples = in_crun_namespace(|| {
                let container = CrunContainer::start(&crun, &bundle, "exec")?;
                (0..cli.runs)
                    .map(|_| {
                        let t0 = Instant::now();
                        let status = container.exec(&["/bin/true"]).stdin(Stdio::null()).status()?;
                        if !status.success() {
                            bail!("crun exec failed ({status})");
                        }
                        Ok(t0.elapsed().as_secs_f64() * 1e3)
                    })
                    .collect::<Result<Vec<f64>>>()
            })?;
            out.push(summarize("exec: crun exec ID true (peer)", "ms", peer_samples, None, true).peer_of(&cli));
        }
        eprintln!("cairn bench: bwrap has no running sandbox to exec into; no bwrap exec figure");
        out.insert(1, cli);
        Ok(out)
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
            into.push(rate(SIZE, t0));
            let t0 = Instant::now();
            let mut sink = CountingSink(0);
            client.get_file("/tmp/bench.bin", &mut sink)?;
            if sink.0 != SIZE as u64 {
                bail!("copied out {} bytes of {SIZE}", sink.0);
            }
            out.push(rate(SIZE, t0));
        }
        // The peer's way too, through a process: `cairn exec -i … cat`.
        let (mut cli_in, mut cli_out) = (Vec::new(), Vec::new());
        for _ in 0..runs.max(5) {
            let t0 = Instant::now();
            let mut child = Command::new(&self.exe)
                .args(["exec", "-i", &rec.id, "--", "sh", "-c", "cat > /tmp/bench.bin"])
                .env("CAIRN_HOME", self.home.path())
                .stdin(Stdio::piped())
                .spawn()?;
            child.stdin.take().context("no stdin")?.write_all(&data)?;
            if !child.wait()?.success() {
                bail!("cairn exec (copy in) failed");
            }
            cli_in.push(rate(SIZE, t0));
            let t0 = Instant::now();
            let mut child = Command::new(&self.exe)
                .args(["exec", &rec.id, "--", "cat", "/tmp/bench.bin"])
                .env("CAIRN_HOME", self.home.path())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .spawn()?;
            let mut sink = CountingSink(0);
            io::copy(&mut child.stdout.take().context("no stdout")?, &mut sink)?;
            if !child.wait()?.success() || sink.0 != SIZE as u64 {
                bail!("cairn exec (copy out) failed or copied {} bytes of {SIZE}", sink.0);
            }
            cli_out.push(rate(SIZE, t0));
        }
        let rec = engine.sandbox(&rec.id)?;
        engine.remove_sandbox(&rec, true)?;
        let into = summarize("cp: into a sandbox (256 MiB, API)", "MB/s", into, Some(200.0), false);
        let out = summarize("cp: out of a sandbox (256 MiB, API)", "MB/s", out, Some(200.0), false);
        let cli_in = summarize(
            "cp: into a sandbox via `cairn exec -i` cat",
            "MB/s",
            cli_in,
            None,
            false,
        );
        let cli_out = summarize(
            "cp: out of a sandbox via `cairn exec` cat",
            "MB/s",
            cli_out,
            None,
            false,
        );
        let mut results = Vec::new();
        if let Some(crun) = peer("crun", "crun") {
            // crun has no copy command: the same bytes through `crun exec`
            // into and out of a file in the container (its /tmp is tmpfs).
            let bundle = self.crun_bundle(&crun, &["/bin/sleep", "1000000"])?;
            let (peer_in, peer_out) = in_crun_namespace(|| {
                let container = CrunContainer::start(&crun, &bundle, "cp")?;
                let (mut peer_in, mut peer_out) = (Vec::new(), Vec::new());
                for _ in 0..into.runs {
                    let t0 = Instant::now();
                    let mut child = container
                        .exec(&["/bin/sh", "-c", "cat > /tmp/bench.bin"])
                        .stdin(Stdio::piped())
                        .spawn()?;
                    child.stdin.take().context("no stdin")?.write_all(&data)?;
                    if !child.wait()?.success() {
                        bail!("crun exec (copy in) failed");
                    }
                    peer_in.push(rate(SIZE, t0));
                    let t0 = Instant::now();
                    let mut child = container
                        .exec(&["/bin/cat", "/tmp/bench.bin"])
                        .stdin(Stdio::null())
                        .stdout(Stdio::piped())
                        .spawn()?;
                    let mut sink = CountingSink(0);
                    io::copy(&mut child.stdout.take().context("no stdout")?, &mut sink)?;
                    if !child.wait()?.success() || sink.0 != SIZE as u64 {
                        bail!("crun exec (copy out) failed or copied {} bytes of {SIZE}", sink.0);
                    }
                    peer_out.push(rate(SIZE, t0));
                }
                Ok((peer_in, peer_out))
            })?;
            // Compared with the same method: a process piping through cat.
            results.push(summarize("cp: into crun via exec cat (peer)", "MB/s", peer_in, None, false).peer_of(&cli_in));
            results.push(
                summarize("cp: out of crun via exec cat (peer)", "MB/s", peer_out, None, false).peer_of(&cli_out),
            );
        }
        eprintln!("cairn bench: bwrap has no running sandbox to copy into; no bwrap copy figure");
        results.insert(0, cli_out);
        results.insert(0, cli_in);
        results.insert(0, out);
        results.insert(0, into);
        Ok(results)
    }

    /// Sandbox starts per second with every core busy: starts alone, start +
    /// exec + remove through the engine, `cairn run`, and bwrap's loop.
    fn throughput(&self) -> Result<Vec<Measurement>> {
        let workers = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2) * 2;
        let home = self.home.path().to_path_buf();
        // Starts alone: each worker removes what it started after the window,
        // and the removal counts in the time (see `rounds`).
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
        let cairn_run = summarize(
            &format!("throughput: cairn run -- true, {workers} loops"),
            "starts/s",
            command_rounds(workers, || {
                let mut run = Command::new(&self.exe);
                run.args(["run", "--", "true"]).env("CAIRN_HOME", &home);
                Ok(run)
            })?,
            None,
            false,
        );
        let mut out = vec![
            summarize(
                &format!("throughput: sandbox starts, removal included (engine API), {workers} threads"),
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
        ];
        if let Some(bwrap) = peer("bwrap", "bubblewrap") {
            let rates = command_rounds(workers, || Ok(self.bwrap(&bwrap, &["/bin/true"])))?;
            out.push(
                summarize(
                    &format!("throughput: bwrap true (peer), {workers} loops"),
                    "starts/s",
                    rates,
                    None,
                    false,
                )
                .peer_of(&cairn_run),
            );
        }
        if let Some(crun) = peer("crun", "crun") {
            let bundle = self.crun_bundle(&crun, &["/bin/true"])?;
            let rates = command_rounds(workers, || {
                hide_hybrid_cgroup2()?;
                Ok(crun_run(&crun, &bundle))
            })?;
            out.push(
                summarize(
                    &format!("throughput: crun run true (peer), {workers} loops"),
                    "starts/s",
                    rates,
                    None,
                    false,
                )
                .peer_of(&cairn_run),
            );
        }
        out.insert(2, cairn_run);
        Ok(out)
    }
}

const ROUNDS: usize = 8;
/// How long each worker of a throughput round starts new work.
const WINDOW: Duration = Duration::from_secs(4);

/// [`ROUNDS`] rounds of `workers` threads each running `work` until a
/// deadline [`WINDOW`] away; `work` returns how many it completed, after
/// cleaning up what it made. The rate divides the completions by the time
/// until the last worker returned, its clean-up included: a sustained rate,
/// not a burst that leaves its teardown for later.
fn rounds(workers: usize, work: impl Fn(Instant) -> Result<usize> + Sync) -> Result<Vec<f64>> {
    let mut rates = Vec::new();
    for _ in 0..ROUNDS {
        let began = Instant::now();
        let deadline = began + WINDOW;
        let done: Vec<Result<usize>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..workers).map(|_| scope.spawn(|| work(deadline))).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("a worker panicked"))))
                .collect()
        });
        let total: usize = done.into_iter().sum::<Result<usize>>()?;
        rates.push(total as f64 / began.elapsed().as_secs_f64());
    }
    Ok(rates)
}

/// `exe image import layer --name busybox` into the state directory `home`.
fn import_busybox(exe: &Path, home: &Path, layer: &Path) -> Result<std::process::ExitStatus> {
    Ok(Command::new(exe)
        .args(["image", "import"])
        .arg(layer)
        .args(["--name", "busybox"])
        .env("CAIRN_HOME", home)
        .stdout(Stdio::null())
        .status()?)
}

/// Milliseconds to first output and to exit of `runs` commands `make`
/// gives, after a few unmeasured ones.
fn repeat(runs: usize, make: impl Fn() -> Command) -> Result<(Vec<f64>, Vec<f64>)> {
    let mut timed = interleaved(runs, &[Box::new(make)])?;
    Ok(timed.remove(0))
}

/// [`repeat`] for several commands at once: `runs` rounds, each running
/// every command `makes` gives once, in turn, the order reversed every
/// other round; each command's first-output and whole times, in the order
/// of `makes`.
fn interleaved(runs: usize, makes: &[Box<dyn Fn() -> Command + '_>]) -> Result<Vec<(Vec<f64>, Vec<f64>)>> {
    for make in makes {
        for _ in 0..runs.min(5) {
            Bench::first_output(&mut make())?;
        }
    }
    let mut timed = vec![(Vec::with_capacity(runs), Vec::with_capacity(runs)); makes.len()];
    for round in 0..runs {
        for k in 0..makes.len() {
            let i = if round % 2 == 0 { k } else { makes.len() - 1 - k };
            let (first, total) = Bench::first_output(&mut makes[i]())?;
            timed[i].0.push(first);
            timed[i].1.push(total);
        }
    }
    Ok(timed)
}

/// MiB per second for `bytes` moved since `t0`.
fn rate(bytes: usize, t0: Instant) -> f64 {
    bytes as f64 / 1048576.0 / t0.elapsed().as_secs_f64()
}

/// [`rounds`] of the commands `make` gives, run back to back.
fn command_rounds(workers: usize, make: impl Fn() -> Result<Command> + Sync) -> Result<Vec<f64>> {
    rounds(workers, |deadline| {
        let mut n = 0;
        while Instant::now() < deadline {
            let mut cmd = make()?;
            let out = cmd.stdin(Stdio::null()).stdout(Stdio::null()).output()?;
            if !out.status.success() {
                bail!(
                    "{:?} failed under load: {}",
                    cmd.get_program(),
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            n += 1;
        }
        Ok(n)
    })
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
/// Where the v2 tree carries no controllers Cairn uses, crun runs from a
/// thread that has detached it in a private mount namespace of its own (the
/// rest of the benchmark keeps the host's view), so crun runs on v1 as Cairn
/// does. Once per thread.
fn hide_hybrid_cgroup2() -> Result<()> {
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    thread_local!(static HIDDEN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    let unified = Path::new("/sys/fs/cgroup/unified");
    if HIDDEN.get() || !unified.join("cgroup.controllers").exists() {
        return Ok(());
    }
    // unshare(CLONE_NEWNS) from one thread of many gives that thread its own
    // filesystem context and mount namespace; its children inherit them.
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).context("unshare the mount namespace")?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )?;
    umount2(unified, MntFlags::MNT_DETACH).context("detach the hybrid cgroup v2 mount")?;
    HIDDEN.set(true);
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        eprintln!("cairn bench: crun runs with the hybrid cgroup v2 mount detached (crun refuses hybrid hosts)")
    });
    Ok(())
}

/// Runs `f` on a thread of its own where crun can run ([`hide_hybrid_cgroup2`]).
fn in_crun_namespace<T: Send>(f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                hide_hybrid_cgroup2()?;
                f()
            })
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the crun thread panicked")))
    })
}

/// `crun run` of `bundle` under a container name not used before.
fn crun_run(crun: &Path, bundle: &Path) -> Command {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let i = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut cmd = Command::new(crun);
    cmd.args(["run", "--bundle"])
        .arg(bundle)
        .arg(format!("cairn-bench-{}-{i}", std::process::id()));
    cmd
}

/// A detached crun container (`sleep`ing), deleted on drop. Made and used
/// on a thread where crun can run ([`in_crun_namespace`]).
struct CrunContainer {
    crun: PathBuf,
    name: String,
}

impl CrunContainer {
    fn start(crun: &Path, bundle: &Path, job: &str) -> Result<CrunContainer> {
        let name = format!("cairn-bench-{}-{job}", std::process::id());
        // The container inherits crun's stdio: no pipe may be left open to it.
        let status = Command::new(crun)
            .args(["run", "--detach", "--bundle"])
            .arg(bundle)
            .arg(&name)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?;
        if !status.success() {
            bail!("`crun run --detach --bundle {}` failed ({status})", bundle.display());
        }
        Ok(CrunContainer {
            crun: crun.to_owned(),
            name,
        })
    }

    fn exec(&self, argv: &[&str]) -> Command {
        let mut cmd = Command::new(&self.crun);
        cmd.arg("exec").arg(&self.name).args(argv);
        cmd
    }
}

impl Drop for CrunContainer {
    fn drop(&mut self) {
        let _ = Command::new(&self.crun)
            .args(["delete", "--force", &self.name])
            .stderr(Stdio::null())
            .status();
    }
}

/// `runs` start-to-reaped times of `true` in the sandbox behind
/// `client`, taken inside by a copy of this build's init run with
/// `--time-spawn` (its first 10 dropped, as the round trip's are).
fn spawn_alone(client: &InitClient, runs: usize) -> Result<Vec<f64>> {
    const PROBE: &str = "/tmp/.cairn-time-spawn";
    let init = cairn_sandbox::init_binary::bytes();
    let meta = FileMeta {
        path: PROBE.into(),
        kind: FileKind::File,
        mode: 0o755,
        uid: 0,
        gid: 0,
        size: init.len() as u64,
        mtime_ns: 0,
    };
    client.put_file(meta, &mut &init[..])?;
    let timed = ExecRequest {
        argv: [PROBE, "--time-spawn", &(runs + 10).to_string(), "true"]
            .map(String::from)
            .to_vec(),
        ..ExecRequest::default()
    };
    let session = client.exec(timed)?.map_err(|f| anyhow::anyhow!(f.message))?;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let status = session.wait(&mut out, &mut err)?;
    if status.map(|s| s.code) != Some(Some(0)) {
        bail!(
            "timing `true` inside the sandbox failed ({status:?}): {}",
            String::from_utf8_lossy(&err).trim()
        );
    }
    let samples = String::from_utf8_lossy(&out)
        .lines()
        .skip(10)
        .map(|l| {
            l.parse::<f64>()
                .with_context(|| format!("`cairn-init --time-spawn` printed {l:?}"))
        })
        .collect::<Result<Vec<f64>>>()?;
    client.remove(PROBE, false)?;
    if samples.len() != runs {
        bail!("`cairn-init --time-spawn` gave {} times of {runs}", samples.len());
    }
    Ok(samples)
}

/// A peer tool on PATH, or a loud note that its figures are left out.
fn peer(tool: &str, package: &str) -> Option<PathBuf> {
    let found = which(tool);
    if found.is_none() {
        eprintln!("cairn bench: {tool} is not installed (apt-get install {package}); no {tool} figures");
    }
    found
}

fn which(tool: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// The benchmark's own state directory, emptied (its cgroup pool drained)
/// and removed on drop.
mod tempfile_home {
    use std::path::{Path, PathBuf};

    pub struct ScratchHome(PathBuf);

    impl ScratchHome {
        pub fn new() -> std::io::Result<ScratchHome> {
            ScratchHome::at(std::env::temp_dir().join(format!("cairn-bench-{}", std::process::id())))
        }

        /// Another scratch directory of this benchmark, told apart by `what`.
        pub fn named(what: &str) -> std::io::Result<ScratchHome> {
            ScratchHome::at(std::env::temp_dir().join(format!("cairn-bench-{}-{what}", std::process::id())))
        }

        fn at(dir: PathBuf) -> std::io::Result<ScratchHome> {
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
                // The pool of emptied cgroups the removals filled goes too.
                engine.drain_cgroup_pool();
            }
            let _ = std::fs::remove_dir_all(&self.0);
            // Deleting gigabytes leaves the file system work to do; done
            // here, it does not slow the first figures of the next run.
            nix::unistd::sync();
        }
    }
}
