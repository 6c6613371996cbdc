//! A snapshot of a sandbox holding 1.2 million small files: its time beside
//! `tar -cf - DIR | cat >/dev/null` of the same tree, and the peak memory of
//! the `cairn snapshot` process that takes it.

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use cairn_engine::{CreateOptions, Silent};

use super::{summarize, Bench, Measurement};

const DIRS: usize = 1_200;
const FILES_PER_DIR: usize = 1_000;

/// Writes `DIRS` × `FILES_PER_DIR` files of a dozen bytes each under `root`.
fn make_tree(root: &Path) -> Result<()> {
    fs::create_dir(root)?;
    for d in 0..DIRS {
        let dir = root.join(format!("d{d:04}"));
        fs::create_dir(&dir)?;
        for f in 0..FILES_PER_DIR {
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o644)
                .open(dir.join(format!("file-{f:04}.txt")))?;
            writeln!(file, "file {d} {f}")?;
        }
    }
    Ok(())
}

/// Runs `cmd` to its end: seconds, and its peak resident memory in MB.
fn timed(cmd: &mut Command) -> Result<(f64, f64)> {
    let t0 = Instant::now();
    let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).spawn()?;
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: the pid is our own unwaited child; both pointers are valid.
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    let secs = t0.elapsed().as_secs_f64();
    if pid < 0 {
        bail!("waiting for {cmd:?}: {}", std::io::Error::last_os_error());
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!("{cmd:?} failed (wait status {status})");
    }
    Ok((secs, usage.ru_maxrss as f64 / 1024.0))
}

impl Bench {
    pub(super) fn many_files(&self, runs: usize) -> Result<Vec<Measurement>> {
        let mut engine = self.engine()?;
        let rec = engine.create_sandbox(&CreateOptions::default(), &Silent)?;
        let dir = engine.home().sandbox(&rec.id);
        let upper = cairn_sandbox::disk::writable_dir(&dir).join("upper");
        eprintln!(
            "cairn bench: writing {} files into a sandbox (once)",
            DIRS * FILES_PER_DIR
        );
        make_tree(&upper.join("many")).context("writing the tree")?;
        let tar = || {
            let mut c = Command::new("sh");
            c.arg("-c")
                .arg("tar -cf - -C \"$1\" . | cat >/dev/null")
                .arg("sh")
                .arg(&upper);
            c
        };
        let snapshot = || {
            // A full capture each time: without the baseline of the previous
            // snapshot, every file is read and recorded again.
            for e in fs::read_dir(&dir).into_iter().flatten().flatten() {
                if e.file_name().to_string_lossy().starts_with("baseline-") {
                    let _ = fs::remove_file(e.path());
                }
            }
            let mut c = Command::new(&self.exe);
            c.env("CAIRN_HOME", self.home.path())
                .args(["snapshot", &rec.id])
                .stderr(Stdio::null());
            // Its own process group, so a ^C of the benchmark reaches it too.
            c.process_group(0);
            c
        };
        // One of each first, to warm the page cache for both alike.
        timed(&mut tar())?;
        timed(&mut snapshot())?;
        let (mut tar_s, mut snap_s, mut snap_mb) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..runs {
            tar_s.push(timed(&mut tar())?.0);
            let (s, mb) = timed(&mut snapshot())?;
            snap_s.push(s);
            snap_mb.push(mb);
        }
        let name = format!("{}M small files", (DIRS * FILES_PER_DIR) as f64 / 1e6);
        let tar_m = summarize(
            &format!("tar -cf - | cat of {name} (peer)"),
            "s",
            tar_s.clone(),
            None,
            true,
        );
        let snap_m = summarize(&format!("snapshot of {name}"), "s", snap_s.clone(), None, true);
        let ratios: Vec<f64> = snap_s.iter().zip(&tar_s).map(|(s, t)| s / t).collect();
        let out = vec![
            summarize(&format!("snapshot / tar of {name}"), "x", ratios, Some(2.0), true),
            snap_m,
            tar_m,
            summarize(
                &format!("snapshot of {name}: peak RSS"),
                "MB",
                snap_mb,
                Some(128.0),
                true,
            ),
        ];
        let rec = engine.sandbox(&rec.id)?;
        engine.remove_sandbox(&rec, true)?;
        Ok(out)
    }
}
