//! `cairn bench diff`: two branches forked from one snapshot over a 2 GiB
//! image (2,048 files of 1 MiB of random bytes and 200 small text files),
//! each changing its own 10 files (edits, new files, removals), compared
//! with `cairn diff` from their layer indexes; beside `diff -rq` of the same
//! two trees as the sandboxes see them, which reads every byte.

use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use cairn_engine::{CreateOptions, DiffOptions, Silent};

use super::gvisor_memory::run;
use super::{summarize, Bench, Measurement};

/// `cairn diff` of two branches over a 2 GiB shared image, in milliseconds.
const TARGET_MS: f64 = 50.0;

impl Bench {
    pub(super) fn diff(&self, runs: usize) -> Result<Vec<Measurement>> {
        let mut engine = self.engine()?;
        let base = engine.create_sandbox(&CreateOptions::default(), &Silent)?;
        let mut made = vec![base.id.clone()];
        let result = (|| -> Result<Vec<Measurement>> {
            eprintln!("cairn bench: writing a 2 GiB image of 2,048 files and 200 text files, and snapshotting it");
            run(
                &engine,
                &base,
                "mkdir -p /work/data /work/text && cd /work/data && \
                 for i in $(seq 1 2048); do dd if=/dev/urandom of=f$i bs=1M count=1 2>/dev/null; done && \
                 cd /work/text && for i in $(seq 1 200); do seq $i $((i+300)) > t$i.txt; done",
            )?;
            let shared = engine.snapshot(&base, Some("bench-diff-base"))?;
            // Two branches, each changing its own ten files.
            let mut tips = Vec::new();
            for (k, change) in [
                "echo edit >> /work/text/t1.txt; sed -i s/150/one-fifty/ /work/text/t2.txt; \
                 dd if=/dev/urandom of=/work/data/f7 bs=4k count=1 conv=notrunc 2>/dev/null; \
                 dd if=/dev/urandom of=/work/data/f8 bs=1M count=1 2>/dev/null; \
                 seq 5 > /work/text/new-a.txt; mkdir /work/out-a; seq 9 > /work/out-a/r.txt; \
                 rm /work/data/f9 /work/text/t3.txt; chmod 600 /work/text/t4.txt",
                "echo other >> /work/text/t1.txt; sed -i s/160/one-sixty/ /work/text/t5.txt; \
                 dd if=/dev/urandom of=/work/data/f10 bs=4k count=1 conv=notrunc 2>/dev/null; \
                 dd if=/dev/urandom of=/work/data/f11 bs=1M count=1 2>/dev/null; \
                 seq 6 > /work/text/new-b.txt; mkdir /work/out-b; seq 7 > /work/out-b/r.txt; \
                 rm /work/data/f12 /work/text/t6.txt; chmod 700 /work/text/t7.txt",
            ]
            .iter()
            .enumerate()
            {
                let rec = engine.restore(&shared, &CreateOptions::default())?;
                made.push(rec.id.clone());
                run(&engine, &rec, change)?;
                tips.push((engine.snapshot(&rec, None)?, rec));
                eprintln!("cairn bench: branch {} changed its ten files", k + 1);
            }
            let (a, b) = (&tips[0].0.id, &tips[1].0.id);
            let opts = DiffOptions::default();
            let mut samples = Vec::with_capacity(runs);
            let mut last = None;
            for _ in 0..runs.max(1) {
                let t = Instant::now();
                let d = engine.diff(a, b, &opts)?;
                samples.push(t.elapsed().as_secs_f64() * 1e3);
                last = Some(d);
            }
            let d = last.expect("at least one run");
            eprintln!(
                "cairn bench: cairn diff: {} added, {} removed, {} changed, {} text diffs, {} shared layers",
                d.added,
                d.removed,
                d.changed,
                d.changes.iter().filter(|c| c.diff.is_some()).count(),
                d.shared_layers
            );
            if d.added + d.removed + d.changed < 10 {
                bail!(
                    "the branches' diff found {} changes, fewer than they made",
                    d.changes.len()
                );
            }
            // The peer: the same two trees compared by reading them, once
            // (it reads 4 GiB), through the sandboxes' own roots.
            let roots: Vec<String> = tips
                .iter()
                .map(|(_, rec)| {
                    let pid = engine
                        .sandbox(&rec.id)?
                        .pid
                        .context("a branch sandbox has no process")?;
                    Ok(format!("/proc/{pid}/root/work"))
                })
                .collect::<Result<_>>()?;
            let t = Instant::now();
            let peer = Command::new("diff").args(["-rq", &roots[0], &roots[1]]).output()?;
            let peer_ms = t.elapsed().as_secs_f64() * 1e3;
            if peer.status.code() != Some(1) {
                bail!(
                    "diff -rq answered {:?}: {}",
                    peer.status,
                    String::from_utf8_lossy(&peer.stderr)
                );
            }
            eprintln!("cairn bench: diff -rq of the two trees: {peer_ms:.0} ms");
            let mut ours = summarize(
                "diff: two branches over a 2 GiB image, 10 files each",
                "ms",
                samples,
                Some(TARGET_MS),
                true,
            );
            ours.cairn_ratio = Some(ours.median / peer_ms);
            Ok(vec![
                ours,
                summarize(
                    "diff: `diff -rq` of the same two trees (peer)",
                    "ms",
                    vec![peer_ms],
                    None,
                    true,
                ),
            ])
        })();
        for id in made {
            let _ = engine.sandbox(&id).and_then(|r| engine.remove_sandbox(&r, true));
        }
        result
    }
}

/// Empties the page cache, so the next reads come from the disk.
fn drop_caches() -> Result<()> {
    // Dirty pages first: written back, they can be dropped.
    nix::unistd::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3").context("dropping the page cache needs root")
}

impl Bench {
    /// `cairn verify` of a 2 GiB snapshot with the page cache emptied before
    /// each run, beside `cat` of every object file of the store the same way:
    /// each one's bytes read per second from the disk.
    pub(super) fn verify(&self, runs: usize) -> Result<Vec<Measurement>> {
        let mut engine = self.engine()?;
        let rec = engine.create_sandbox(&CreateOptions::default(), &Silent)?;
        let made = (|| -> Result<cairn_engine::SnapshotRecord> {
            eprintln!("cairn bench: writing 2 GiB in 2,048 files and snapshotting it");
            run(
                &engine,
                &rec,
                "mkdir -p /work/data && cd /work/data && \
                 for i in $(seq 1 2048); do dd if=/dev/urandom of=f$i bs=1M count=1 2>/dev/null; done",
            )?;
            Ok(engine.snapshot(&rec, Some("bench-verify"))?)
        })();
        let _ = engine.sandbox(&rec.id).and_then(|r| engine.remove_sandbox(&r, true));
        let snap = made?;
        let objects = self.home.path().join("store/objects");
        let mut ours = Vec::new();
        let mut peer = Vec::new();
        for i in 0..runs.clamp(1, 5) {
            drop_caches()?;
            let t = Instant::now();
            let v = engine.verify_snapshots(std::slice::from_ref(&snap.id), false, &|_, _, _| {})?;
            let secs = t.elapsed().as_secs_f64();
            if !v[0].ok {
                bail!("the benchmark's snapshot is damaged: {:?}", v[0].damaged);
            }
            ours.push(v[0].bytes_read as f64 / 1e6 / secs);
            drop_caches()?;
            let t = Instant::now();
            let out = Command::new("sh")
                .arg("-c")
                .arg(format!(
                    "find {} -type f -print0 | xargs -0 cat | wc -c",
                    objects.display()
                ))
                .output()?;
            let secs = t.elapsed().as_secs_f64();
            let bytes: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().context("wc -c")?;
            peer.push(bytes / 1e6 / secs);
            eprintln!(
                "cairn bench: verify run {}: {:.0} MB/s ({} objects, {:.0} MB); cat {:.0} MB/s ({:.0} MB)",
                i + 1,
                ours[i],
                v[0].objects,
                v[0].bytes_read as f64 / 1e6,
                peer[i],
                bytes / 1e6
            );
        }
        let ratios: Vec<f64> = ours.iter().zip(&peer).map(|(o, p)| o / p).collect();
        let mut m = summarize("verify: 2 GiB snapshot read from the disk", "MB/s", ours, None, false);
        let cat = summarize("verify: `cat` of the store's objects (peer)", "MB/s", peer, None, false);
        m.cairn_ratio = Some(m.median / cat.median);
        Ok(vec![
            m,
            cat,
            summarize("verify: its rate / cat's, per run", "x", ratios, Some(0.8), false),
        ])
    }
}
