//! `cairn bench gvisor`, large memory: a gVisor sandbox holding `--memory`
//! of random bytes in its tmpfs, its first memory snapshot, then snapshots
//! after an 8 MiB change each, every one split into runsc's part and
//! Cairn's, with the bytes stored.

use std::io;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use cairn_engine::{CreateOptions, Engine, MemoryPhases, Silent};
use cairn_protocol::ExecRequest;

use super::{summarize, Bench, Measurement};

/// The change between two snapshots, in MiB.
const CHANGE_MIB: u64 = 8;

/// The targets docs/gvisor.md sets for the sizes it names (medians, in
/// the rows' units): first snapshot, snapshot after the change, bytes
/// stored for it, and restore to first output (512 MiB only).
struct Targets {
    first_ms: f64,
    after_change_ms: f64,
    stored_mb: f64,
    restore_ms: Option<f64>,
}

fn targets(mib: u64) -> Option<Targets> {
    match mib {
        512 => Some(Targets {
            first_ms: 1000.0,
            after_change_ms: 400.0,
            stored_mb: 12.0,
            restore_ms: Some(300.0),
        }),
        2048 => Some(Targets {
            first_ms: 4000.0,
            after_change_ms: 1000.0,
            stored_mb: 12.0,
            restore_ms: None,
        }),
        _ => None,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One snapshot's figures.
struct Sample {
    total: f64,
    /// `runsc checkpoint`, the stopped sandbox's cleanup and `runsc
    /// restore`: what the plain CLI pays for the same sandbox to go on.
    runsc: f64,
    /// The rest: quiescing, capturing files, storing the image past the
    /// restore's end, the manifest and the database.
    cairn: f64,
    store: f64,
    stored_mb: f64,
    phases: MemoryPhases,
}

impl Bench {
    pub(super) fn gvisor_memory(&self, runs: usize, bytes: u64) -> Result<Vec<Measurement>> {
        let mib = bytes >> 20;
        if mib < 2 * CHANGE_MIB {
            bail!("--memory must be at least {} MiB", 2 * CHANGE_MIB);
        }
        let mut engine = self.engine()?;
        let mut opts = CreateOptions {
            driver: Some("gvisor".into()),
            ..CreateOptions::default()
        };
        // The tmpfs lives in the sentry's memory, inside the sandbox's limit.
        opts.limits.memory_bytes = opts.limits.memory_bytes.max(2 * bytes + (256 << 20));
        let rec = engine.create_sandbox(&opts, &Silent)?;
        let result = (|| -> Result<Vec<Measurement>> {
            eprintln!("cairn bench: filling {mib} MiB of a gVisor sandbox's tmpfs with random bytes");
            run(
                &engine,
                &rec,
                &format!("dd if=/dev/urandom of=/tmp/fill bs=1M count={mib} 2>/dev/null"),
            )?;
            let first = snapshot(&mut engine, &rec.id)?;
            report(&format!("first, {mib} MiB"), &first);
            let mut later = Vec::new();
            for i in 0..runs {
                // A different 8 MiB each time, inside the file.
                let seek = (i as u64 * 2 * CHANGE_MIB) % (mib - CHANGE_MIB);
                run(
                    &engine,
                    &rec,
                    &format!(
                        "dd if=/dev/urandom of=/tmp/fill bs=1M count={CHANGE_MIB} seek={seek} conv=notrunc 2>/dev/null"
                    ),
                )?;
                let s = snapshot(&mut engine, &rec.id)?;
                report(&format!("after an {CHANGE_MIB} MiB change, run {}", i + 1), &s);
                later.push(s);
            }
            // runsc alone on the same sandbox: what the plain command line
            // pays for the same image with the sandbox going on.
            let mut plain = Vec::new();
            for _ in 0..runs.min(5) {
                let rec = engine.sandbox(&rec.id)?;
                plain.push(ms(engine.plain_runsc_checkpoint(&rec)?));
            }
            eprintln!("cairn bench: plain runsc checkpoint of the same sandbox, going on: {plain:.0?} ms");
            // Restores of the newest snapshot to the first output of a
            // command: the ordinary way, and into a sandbox prepared ahead
            // (as a paused E2B sandbox's resume is), timed from the
            // restore's start. The two alternate, so that both meet the
            // host as it is.
            let newest = engine.snapshot_record(&engine.sandbox(&rec.id)?.last_snapshot.unwrap_or_default())?;
            // Each restore's time, and runsc's `restore` command's part of it.
            let mut restores = Vec::new();
            let mut prepared_restores = Vec::new();
            let mut restores_runsc = Vec::new();
            let mut prepared_runsc = Vec::new();
            let runsc_part = |engine: &Engine| {
                engine
                    .last_runsc_restore()
                    .map(ms)
                    .ok_or_else(|| anyhow::anyhow!("the restore recorded no runsc restore"))
            };
            let mut can_prepare = true;
            for _ in 0..runs.min(10) {
                let t = Instant::now();
                let r = engine.restore(&newest, &opts)?;
                let first = run(&engine, &r, "echo ok");
                restores.push(ms(t.elapsed()));
                restores_runsc.push(runsc_part(&engine)?);
                engine.remove_sandbox(&engine.sandbox(&r.id)?, true)?;
                first?;
                if !can_prepare {
                    continue;
                }
                let prepared = match engine.prepare_restore(&newest, &opts) {
                    Ok(p) => p,
                    Err(e @ cairn_engine::EngineError::CannotPrepare { .. }) => {
                        eprintln!("cairn bench: no restore prepared ahead: {e}");
                        can_prepare = false;
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                };
                // Prepared at a pause, used at a later resume.
                std::thread::sleep(Duration::from_millis(200));
                let t = Instant::now();
                let r = engine.finish_restore(prepared)?;
                let first = run(&engine, &r, "echo ok");
                prepared_restores.push(ms(t.elapsed()));
                prepared_runsc.push(runsc_part(&engine)?);
                engine.remove_sandbox(&engine.sandbox(&r.id)?, true)?;
                first?;
            }
            eprintln!(
                "cairn bench: restore of the {mib} MiB snapshot to first output: {restores:.0?} ms (runsc restore \
                 {restores_runsc:.0?})"
            );
            if !prepared_restores.is_empty() {
                eprintln!(
                    "cairn bench: restore of the {mib} MiB snapshot into a sandbox prepared ahead, to first output: \
                     {prepared_restores:.0?} ms (runsc restore {prepared_runsc:.0?})"
                );
            }
            // runsc's own restore of the same sandbox's image, to the first
            // output of the same command.
            let mut plain_restores = Vec::new();
            let mut plain_runsc = Vec::new();
            for _ in 0..runs.min(10) {
                let took = engine.plain_runsc_restore(&engine.sandbox(&rec.id)?)?;
                let t = Instant::now();
                run(&engine, &engine.sandbox(&rec.id)?, "echo ok")?;
                plain_restores.push(ms(took + t.elapsed()));
                plain_runsc.push(runsc_part(&engine)?);
            }
            eprintln!(
                "cairn bench: plain runsc restore of the same sandbox to first output: {plain_restores:.0?} ms \
                 (runsc restore alone {plain_runsc:.0?})"
            );
            let name = |what: &str| format!("gvisor: {mib} MiB in tmpfs, {what}");
            let goal = targets(mib);
            let goal = goal.as_ref();
            let column = |f: fn(&Sample) -> f64| later.iter().map(f).collect::<Vec<_>>();
            let mut quoted = summarize(
                &name(&format!("snapshot after an {CHANGE_MIB} MiB change")),
                "ms",
                column(|s| s.total),
                goal.map(|t| t.after_change_ms),
                true,
            );
            let plain_median = summarize("", "ms", plain.clone(), None, true).median;
            quoted.cairn_ratio = Some(quoted.median / plain_median);
            let mut out = vec![
                summarize(
                    &name("first memory snapshot"),
                    "ms",
                    vec![first.total],
                    goal.map(|t| t.first_ms),
                    true,
                ),
                summarize(
                    &name("first snapshot, runsc's part"),
                    "ms",
                    vec![first.runsc],
                    None,
                    true,
                ),
                summarize(
                    &name("first snapshot, Cairn's part"),
                    "ms",
                    vec![first.cairn],
                    None,
                    true,
                ),
                summarize(&name("first snapshot stored"), "MB", vec![first.stored_mb], None, true),
                quoted,
                summarize(&name("  of which runsc's part"), "ms", column(|s| s.runsc), None, true),
                summarize(&name("  of which Cairn's part"), "ms", column(|s| s.cairn), None, true),
                summarize(&name("  storing the image"), "ms", column(|s| s.store), None, true),
                summarize(
                    &name(&format!("stored after an {CHANGE_MIB} MiB change")),
                    "MB",
                    column(|s| s.stored_mb),
                    goal.map(|t| t.stored_mb),
                    true,
                ),
                summarize(&name("plain runsc checkpoint, going on"), "ms", plain, None, true),
            ];
            let restore_goal = goal.and_then(|t| t.restore_ms);
            out.extend(restore_rows(
                &name("restore to first output"),
                &restores,
                &restores_runsc,
                restore_goal,
            ));
            if !prepared_restores.is_empty() {
                out.extend(restore_rows(
                    &name("restore into a sandbox prepared ahead, to first output"),
                    &prepared_restores,
                    &prepared_runsc,
                    restore_goal,
                ));
            }
            out.extend(restore_rows(
                &name("plain runsc restore to first output"),
                &plain_restores,
                &plain_runsc,
                None,
            ));
            Ok(out)
        })();
        let _ = engine.sandbox(&rec.id).and_then(|r| engine.remove_sandbox(&r, true));
        result
    }
}

/// A restore's rows: its time to first output, and runsc's `restore`
/// command's part and the rest (Cairn's, or for plain runsc its own
/// `exec`), run by run; `target` for the time to first output.
fn restore_rows(what: &str, totals: &[f64], runsc: &[f64], target: Option<f64>) -> Vec<Measurement> {
    let rest = totals.iter().zip(runsc).map(|(t, r)| t - r).collect();
    vec![
        summarize(what, "ms", totals.to_vec(), target, true),
        summarize(&format!("{what}: runsc restore"), "ms", runsc.to_vec(), None, true),
        summarize(&format!("{what}: the rest"), "ms", rest, None, true),
    ]
}

/// Runs `cmd` with `sh -c` in `rec` to its end; an error unless it exits 0.
pub(super) fn run(engine: &Engine, rec: &cairn_engine::SandboxRecord, cmd: &str) -> Result<()> {
    let req = ExecRequest {
        argv: vec!["sh".into(), "-c".into(), cmd.into()],
        ..ExecRequest::default()
    };
    let start = engine.exec(rec, req)?.map_err(|f| anyhow::anyhow!(f.message))?;
    let mut err = Vec::new();
    match start.session.wait(&mut io::sink(), &mut err)? {
        Some(s) if s.code == Some(0) => Ok(()),
        other => bail!(
            "`{cmd}` failed in the sandbox ({other:?}): {}",
            String::from_utf8_lossy(&err).trim()
        ),
    }
}

fn snapshot(engine: &mut Engine, id: &str) -> Result<Sample> {
    let t0 = Instant::now();
    let snap = engine.snapshot(&engine.sandbox(id)?, None)?;
    let total = ms(t0.elapsed());
    let Some(phases) = engine.last_memory_phases() else {
        bail!("the snapshot of a gVisor sandbox recorded no memory image");
    };
    let runsc =
        ms(phases.runsc_pause + phases.runsc_checkpoint + phases.runsc_resume + phases.cleanup + phases.runsc_restore);
    Ok(Sample {
        total,
        runsc,
        cairn: total - runsc,
        store: ms(phases.store_image),
        stored_mb: snap.stored_bytes as f64 / 1e6,
        phases,
    })
}

fn report(what: &str, s: &Sample) {
    let p = &s.phases;
    let runsc = if p.left_running {
        format!(
            "pause {:.0}, checkpoint --leave-running {:.0}, resume {:.0}",
            ms(p.runsc_pause),
            ms(p.runsc_checkpoint),
            ms(p.runsc_resume)
        )
    } else {
        format!(
            "checkpoint {:.0}, cleanup {:.0}, restore {:.0}",
            ms(p.runsc_checkpoint),
            ms(p.cleanup),
            ms(p.runsc_restore)
        )
    };
    eprintln!(
        "cairn bench: gvisor memory snapshot ({what}): {:.0} ms = runsc {:.0} ({runsc}) + Cairn {:.0} (quiesce \
         {:.0}, file capture {:.0}, the rest after runsc); storing the image {:.0} ms from runsc's start (read \
         {:.0}, chunking {:.0}; on the pool: hashing {:.0}, lookups {:.0}, compression {:.0}; writes {:.0}); \
         image {:.1} MB, {} of {} chunks new, stored {:.1} MB",
        s.total,
        s.runsc,
        s.cairn,
        ms(p.quiesce),
        ms(p.file_capture),
        s.store,
        ms(p.store.read),
        ms(p.store.chunking),
        ms(p.store.hash),
        ms(p.store.lookup),
        ms(p.store.compress),
        ms(p.store.write),
        p.image_bytes as f64 / 1e6,
        p.store.new_chunks,
        p.store.chunks,
        s.stored_mb,
    );
}
