//! `cairn bench drift`: start time on a fresh host beside the same after
//! `--churn` sandboxes that wrote files and were removed, with the ratio,
//! and the dying memory cgroups the kernel holds before and after (the
//! cause of drift this figure watches for).

use std::io;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{bail, Result};
use cairn_engine::{CreateOptions, Engine, Home, Silent};
use cairn_protocol::ExecRequest;

use super::{peer, repeat, summarize, Bench, Measurement};

/// What each churned sandbox writes before it is removed: a file's data
/// and a few directory entries, so page cache and file system metadata
/// are charged to its memory cgroup.
const WRITE: &str = "dd if=/dev/zero of=/tmp/data bs=64k count=4 2>/dev/null && mkdir -p /tmp/d && echo x > /tmp/d/a";

/// Memory cgroups the kernel holds beyond those visible in the tree: the
/// removed ones it keeps while pages are still charged to them. On cgroup
/// v2 the root's `cgroup.stat` counts them (`nr_dying_subsys_memory`,
/// Linux 6.11+); elsewhere `/proc/cgroups`' memory count less the
/// directories in the tree. None on a host with neither.
pub fn dying_memory_cgroups() -> Option<i64> {
    let stat = std::fs::read_to_string("/sys/fs/cgroup/cgroup.stat").unwrap_or_default();
    if let Some(n) = stat.lines().find_map(|l| l.strip_prefix("nr_dying_subsys_memory ")) {
        return n.trim().parse().ok();
    }
    let table = std::fs::read_to_string("/proc/cgroups").ok()?;
    let line = table.lines().find(|l| l.split_whitespace().next() == Some("memory"))?;
    let counted: i64 = line.split_whitespace().nth(2)?.parse().ok()?;
    let root = ["/sys/fs/cgroup/memory", "/sys/fs/cgroup"]
        .into_iter()
        .map(std::path::Path::new)
        .find(|p| p.join("memory.stat").exists() || p.join("cgroup.controllers").exists())?;
    let visible = count_dirs(root) as i64;
    Some(counted - visible)
}

fn count_dirs(dir: &std::path::Path) -> usize {
    1 + std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| count_dirs(&e.path()))
                .sum()
        })
        .unwrap_or(0)
}

impl Bench {
    pub(super) fn drift(&self, runs: usize, churn: usize) -> Result<Vec<Measurement>> {
        let start = || {
            let mut cmd = Command::new(&self.exe);
            cmd.args(["run", "--", "echo", "hi"])
                .env("CAIRN_HOME", self.home.path());
            cmd
        };
        // bwrap beside each figure is the control: it makes no cgroup, so
        // what the host's load does to both shows in its figures too.
        let bwrap = peer("bwrap", "bubblewrap");
        let control = |turn: &str| -> Result<Option<Measurement>> {
            let Some(bwrap) = &bwrap else { return Ok(None) };
            let (firsts, _) = repeat(runs, || self.bwrap(bwrap, &["/bin/echo", "hi"]))?;
            Ok(Some(summarize(
                &format!("drift: bwrap echo (control), {turn}"),
                "ms",
                firsts,
                None,
                true,
            )))
        };
        let dying_before = dying_memory_cgroups();
        let (fresh, _) = repeat(runs, start)?;
        let control_fresh = control("fresh")?;
        self.churn(churn)?;
        let dying_after = dying_memory_cgroups();
        let (after, _) = repeat(runs, start)?;
        let control_after = control("after the churn")?;
        let fresh = summarize("drift: cairn run -- echo, fresh host", "ms", fresh, None, true);
        let after = summarize(
            &format!("drift: cairn run -- echo, after {churn} sandboxes that wrote files"),
            "ms",
            after,
            None,
            true,
        );
        let mut ratio = summarize(
            "drift: after churn / fresh (medians; p95 column: p95s)",
            "x",
            vec![after.median / fresh.median],
            Some(1.1),
            true,
        );
        ratio.p95 = after.p95 / fresh.p95;
        ratio.runs = runs;
        let mut out = vec![fresh, after, ratio];
        if let (Some(before), Some(later)) = (control_fresh, control_after) {
            // Cairn's drift with the host's own drift (bwrap's) divided out.
            let mut normalised = summarize(
                "drift: after / fresh, each over bwrap in its turn",
                "x",
                vec![(out[1].median / later.median) / (out[0].median / before.median)],
                Some(1.1),
                true,
            );
            normalised.p95 = (out[1].p95 / later.p95) / (out[0].p95 / before.p95);
            normalised.runs = runs;
            out.push(before.peer_of(&out[0]));
            out.push(later.peer_of(&out[1]));
            out.push(normalised);
        }
        if let (Some(before), Some(after)) = (dying_before, dying_after) {
            for (name, n) in [("before", before), ("after", after)] {
                out.push(summarize(
                    &format!("drift: dying memory cgroups on the host, {name} the churn"),
                    "cgroups",
                    vec![n as f64],
                    None,
                    true,
                ));
            }
        }
        Ok(out)
    }

    /// `n` sandboxes, each writing files and removed, on as many threads
    /// as the host has cores.
    fn churn(&self, n: usize) -> Result<()> {
        let workers = std::thread::available_parallelism().map(|c| c.get()).unwrap_or(2);
        let left = AtomicUsize::new(n);
        let home = self.home.path().to_path_buf();
        let req = ExecRequest {
            argv: vec!["sh".into(), "-c".into(), WRITE.into()],
            ..ExecRequest::default()
        };
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..workers)
                .map(|_| {
                    scope.spawn(|| -> Result<()> {
                        let mut engine = Engine::open(Home::at(&home))?;
                        while left
                            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |l| l.checked_sub(1))
                            .is_ok()
                        {
                            let rec = engine.create_sandbox(&CreateOptions::default(), &Silent)?;
                            let started = engine
                                .exec(&rec, req.clone())?
                                .map_err(|f| anyhow::anyhow!(f.message))?;
                            let status = started.session.wait(&mut io::sink(), &mut io::sink())?;
                            let rec = engine.sandbox(&rec.id)?;
                            engine.remove_sandbox(&rec, true)?;
                            if status.and_then(|s| s.code) != Some(0) {
                                bail!("a churned sandbox's write failed: {status:?}");
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            handles.into_iter().try_for_each(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a churn thread panicked")))
            })
        })
    }
}
