//! Memory checkpoints that leave the sandbox running, read as runsc writes
//! them.
//!
//! Where runsc's `checkpoint` can write raw pages (`--compression=none`, so
//! a separate `pages.img`) it can also leave the sandbox running
//! (`--leave-running` resumes the same sentry; Debian 12's 2022 runsc
//! implements it as checkpoint plus restore, and hangs). Then a snapshot
//! needs no restore at all:
//!
//! 1. init quiesces (gVisor cannot save a host socket), then `runsc pause`
//!    stops every task of the sandbox;
//! 2. `runsc checkpoint --leave-running` saves it; the sentry resumes its
//!    own pause afterwards, the sandbox stays stopped by ours, so the files
//!    in `upper/` still match the image;
//! 3. the caller captures those files, then [`GvisorDriver::resume_live`]
//!    resumes the sandbox and lets init listen (the restore mark grows by a
//!    byte, which init notices within a millisecond).
//!
//! While runsc writes `pages.img`, the caller reads it behind the writer
//! ([`Behind`]): the sentry appends it with `write(2)` from start to end, so
//! every byte below the file's size is final, and the bytes of a pages file
//! are hashed while the rest is still being written.
//!
//! The window record (see [`super::window`]) covers all of it: the
//! checkpoint is recorded there as before, and `paused` marks that the
//! sandbox may be left stopped by our pause, which a recovery resumes.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::window::Window;
use super::{client_in, image_size, runsc, GvisorDriver, GvisorError, QUIESCE_TIMEOUT};

/// How [`Behind`] learns that the writer is done.
const WRITING: u8 = 0;
const WRITTEN: u8 = 1;
const FAILED: u8 = 2;

/// Why a reader behind a failed checkpoint stops.
const CHECKPOINT_FAILED: &str = "runsc checkpoint failed before it finished writing the image";

/// A `runsc checkpoint --leave-running` in progress: the sandbox is
/// quiesced and paused; [`GvisorDriver::finish_live`] waits for it.
pub struct LiveSave {
    child: Child,
    log: PathBuf,
    image_dir: PathBuf,
    state: Arc<AtomicU8>,
    started: Instant,
    /// Init ending its connections.
    pub quiesce: Duration,
    /// `runsc pause`.
    pub pause: Duration,
}

/// A finished live checkpoint: the sandbox is still paused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveCheckpoint {
    pub image_bytes: u64,
    pub quiesce: Duration,
    pub pause: Duration,
    /// `runsc checkpoint --leave-running`.
    pub save: Duration,
}

impl LiveSave {
    /// A reader of image file `name` behind runsc writing it.
    pub fn behind(&self, name: &str) -> Behind {
        Behind {
            path: self.image_dir.join(name),
            file: None,
            state: self.state.clone(),
            appeared: false,
        }
    }
}

impl GvisorDriver {
    /// Whether this runsc can checkpoint a sandbox and leave it running
    /// (see the module's documentation); `CAIRN_GVISOR_LEAVE_RUNNING=0`
    /// turns it off, for comparison with checkpoint-and-restore.
    pub fn can_leave_running(&self) -> bool {
        self.runsc.leave_running && std::env::var("CAIRN_GVISOR_LEAVE_RUNNING").as_deref() != Ok("0")
    }

    /// Quiesces and pauses sandbox `id`, then starts `runsc checkpoint
    /// --leave-running` into the window's image, recorded in the window.
    /// Returns at once; read the image with [`LiveSave::behind`], then call
    /// [`Self::finish_live`]. A failure here leaves the sandbox running.
    pub fn start_live(&self, id: &str, window: &Window) -> Result<LiveSave, GvisorError> {
        let dir = self
            .sandbox_dir(id)
            .ok_or_else(|| GvisorError::Unknown(id.to_string()))?;
        let root = self.runsc_root(id);
        let image_dir = window.image_dir();
        self.prepare_image(&dir, &image_dir)?;
        let t = Instant::now();
        client_in(&dir).quiesce(QUIESCE_TIMEOUT).map_err(GvisorError::Quiesce)?;
        let quiesce = t.elapsed();
        let t = Instant::now();
        let paused = window.mark_paused().map_err(GvisorError::from).and_then(|()| {
            let mut cmd = self.runsc.command(&root);
            cmd.args(["pause", id]);
            self.runsc.run_to_end("pause", cmd)
        });
        if let Err(e) = paused {
            self.resume_after_failed_checkpoint(&root, id, &dir);
            return Err(e);
        }
        let pause = t.elapsed();
        let cmd = self.leave_running_command(&root, id, &image_dir);
        let started = Instant::now();
        let child = match self.spawn_recorded_checkpoint(cmd, window) {
            Ok(c) => c,
            Err(e) => {
                self.resume_paused(&root, id, &dir);
                return Err(e);
            }
        };
        Ok(LiveSave {
            child,
            log: window.checkpoint_log(),
            image_dir,
            state: Arc::new(AtomicU8::new(WRITING)),
            started,
            quiesce,
            pause,
        })
    }

    /// Waits for the checkpoint [`Self::start_live`] started. On success
    /// the sandbox stays paused (its files match the image) until
    /// [`Self::resume_live`]; on failure it runs again before this returns.
    pub fn finish_live(&self, id: &str, mut save: LiveSave) -> Result<LiveCheckpoint, GvisorError> {
        let status = save.child.wait();
        let ok = matches!(&status, Ok(s) if s.success());
        save.state.store(if ok { WRITTEN } else { FAILED }, Ordering::Release);
        let saved = save.started.elapsed();
        if !ok {
            if let Some(dir) = self.sandbox_dir(id) {
                self.resume_paused(&self.runsc_root(id), id, &dir);
            }
            return Err(match status {
                Err(e) => GvisorError::Exec("/bin/sh".into(), e),
                Ok(_) => GvisorError::Runsc {
                    what: "checkpoint --leave-running".into(),
                    message: runsc::first_lines(&std::fs::read_to_string(&save.log).unwrap_or_default()),
                },
            });
        }
        Ok(LiveCheckpoint {
            image_bytes: image_size(&save.image_dir),
            quiesce: save.quiesce,
            pause: save.pause,
            save: saved,
        })
    }

    /// Resumes a sandbox paused by [`Self::start_live`] and waits until its
    /// init listens again. Returns the time `runsc resume` took.
    pub fn resume_live(&self, id: &str) -> Result<Duration, GvisorError> {
        let dir = self
            .sandbox_dir(id)
            .ok_or_else(|| GvisorError::Unknown(id.to_string()))?;
        let root = self.runsc_root(id);
        let t = Instant::now();
        self.runsc_resume(&root, id)?;
        let resumed = t.elapsed();
        grow_mark(&dir)?;
        self.relisten_and_wait(&root, id, &dir, "a checkpoint that left the sandbox running", true)?;
        Ok(resumed)
    }

    /// runsc's own checkpoint of sandbox `spec`, as the plain command line
    /// takes it, for benchmarks that set Cairn's snapshot beside it: with
    /// `--leave-running` where this runsc can, else checkpoint then restore
    /// (the sandbox's new process is returned). The image goes into
    /// `image_dir`; the sandbox runs on. Returns runsc's time alone.
    pub fn plain_checkpoint(
        &self,
        spec: &crate::SandboxSpec,
        image_dir: &Path,
    ) -> Result<(Duration, Option<crate::SandboxProcess>), GvisorError> {
        if !self.can_leave_running() {
            let c = self.checkpoint(&spec.id, image_dir)?;
            let t = Instant::now();
            let process = self.restore(spec, image_dir)?;
            return Ok((c.save + c.cleanup + t.elapsed(), Some(process)));
        }
        let root = self.runsc_root(&spec.id);
        self.prepare_image(&spec.dir, image_dir)?;
        client_in(&spec.dir)
            .quiesce(QUIESCE_TIMEOUT)
            .map_err(GvisorError::Quiesce)?;
        let t = Instant::now();
        let cmd = self.leave_running_command(&root, &spec.id, image_dir);
        let saved = self.runsc.run_to_end("checkpoint --leave-running", cmd);
        let took = t.elapsed();
        grow_mark(&spec.dir)?;
        self.relisten_and_wait(&root, &spec.id, &spec.dir, "a plain checkpoint", true)?;
        saved.map(|()| (took, None))
    }

    /// `runsc checkpoint` with this runsc's flags, leaving sandbox `id`
    /// running, its image into `image_dir`.
    fn leave_running_command(&self, root: &Path, id: &str, image_dir: &Path) -> std::process::Command {
        let mut cmd = self.runsc.command(root);
        cmd.arg("checkpoint")
            .args(&self.runsc.checkpoint_flags)
            .arg("--leave-running")
            .arg("--image-path")
            .arg(image_dir)
            .arg(id);
        cmd
    }

    /// `runsc resume`: a paused sandbox runs again.
    fn runsc_resume(&self, root: &Path, id: &str) -> Result<(), GvisorError> {
        let mut cmd = self.runsc.command(root);
        cmd.args(["resume", id]);
        self.runsc.run_to_end("resume", cmd)
    }

    /// After a failed live checkpoint: the sandbox runs and listens again.
    fn resume_paused(&self, root: &Path, id: &str, dir: &Path) {
        if let Err(e) = self.runsc_resume(root, id) {
            tracing::debug!(sandbox = id, "resume after a failed checkpoint: {e}");
        }
        self.resume_after_failed_checkpoint(root, id, dir);
    }

    /// A recovery's first step for a window that paused its sandbox: the
    /// sandbox runs again (a sandbox that is not paused is left alone).
    pub(super) fn unpause_for_recovery(&self, id: &str, window: &Window) {
        if window.was_paused() {
            if let Err(e) = self.runsc_resume(&self.runsc_root(id), id) {
                tracing::debug!(sandbox = id, "resume during recovery: {e}");
            }
        }
    }
}

/// Makes a quiesced init that was not restored listen again: its stdin, the
/// restore mark, gets one byte longer (see `GvisorDriver::launch`).
pub(super) fn grow_mark(dir: &Path) -> Result<(), GvisorError> {
    let path = dir.join("restore-mark");
    OpenOptions::new()
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(b"l"))
        .map_err(|e| GvisorError::io(format!("write {}", path.display()), e))
}

/// Reads a file of a checkpoint image while runsc writes it: what is below
/// the file's size is read at once; at the end of what is written so far
/// it waits (half a millisecond at a time) until more is written or runsc
/// has exited. The end of the file is the end only once runsc succeeded;
/// if it failed, the read fails. The file is opened without following a
/// link, once it exists.
pub struct Behind {
    path: PathBuf,
    file: Option<File>,
    state: Arc<AtomicU8>,
    appeared: bool,
}

impl Behind {
    /// Whether runsc wrote the file at all (known once the read ended).
    pub fn appeared(&self) -> bool {
        self.appeared
    }

    fn pause() {
        std::thread::sleep(Duration::from_micros(500));
    }
}

impl Read for Behind {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            // Read before looking: a success seen now means every byte was
            // written before the read that follows.
            let state = self.state.load(Ordering::Acquire);
            let file = match &mut self.file {
                Some(f) => f,
                None => {
                    use std::os::unix::fs::OpenOptionsExt;
                    match OpenOptions::new()
                        .read(true)
                        .custom_flags(libc::O_NOFOLLOW)
                        .open(&self.path)
                    {
                        Ok(f) => {
                            self.appeared = true;
                            self.file.insert(f)
                        }
                        Err(e) if e.kind() == io::ErrorKind::NotFound => match state {
                            WRITING => {
                                Behind::pause();
                                continue;
                            }
                            WRITTEN => return Ok(0),
                            _ => return Err(io::Error::other(CHECKPOINT_FAILED)),
                        },
                        Err(e) => return Err(e),
                    }
                }
            };
            let n = file.read(buf)?;
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
            match state {
                WRITING => Behind::pause(),
                WRITTEN => return Ok(0),
                _ => return Err(io::Error::other(CHECKPOINT_FAILED)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_behind_the_writer_gets_every_byte_and_ends_only_when_the_writer_succeeded() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(AtomicU8::new(WRITING));
        let path = dir.path().join("pages.img");
        let mut reader = Behind {
            path: path.clone(),
            file: None,
            state: state.clone(),
            appeared: false,
        };
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let read = std::thread::scope(|s| {
            let r = s.spawn(|| {
                let mut out = Vec::new();
                reader.read_to_end(&mut out).map(|_| out)
            });
            std::thread::sleep(Duration::from_millis(20));
            let mut f = File::create(&path).unwrap();
            for part in data.chunks(100_003) {
                f.write_all(part).unwrap();
                std::thread::sleep(Duration::from_millis(1));
            }
            state.store(WRITTEN, Ordering::Release);
            r.join().unwrap()
        });
        assert!(read.unwrap() == data);
        assert!(reader.appeared());

        // A writer that fails fails the read; one that wrote nothing ends it.
        let state = Arc::new(AtomicU8::new(FAILED));
        let mut failed = Behind {
            path: path.clone(),
            file: None,
            state,
            appeared: false,
        };
        let err = failed.read_to_end(&mut Vec::new()).unwrap_err();
        assert!(err.to_string().contains("checkpoint failed"), "{err}");
        let mut none = Behind {
            path: dir.path().join("absent"),
            file: None,
            state: Arc::new(AtomicU8::new(WRITTEN)),
            appeared: false,
        };
        assert_eq!(none.read_to_end(&mut Vec::new()).unwrap(), 0);
        assert!(!none.appeared());
        // A link planted in place of the file is not followed.
        std::os::unix::fs::symlink(&path, dir.path().join("link")).unwrap();
        let mut link = Behind {
            path: dir.path().join("link"),
            file: None,
            state: Arc::new(AtomicU8::new(WRITTEN)),
            appeared: false,
        };
        assert!(link.read_to_end(&mut Vec::new()).is_err());
    }
}
