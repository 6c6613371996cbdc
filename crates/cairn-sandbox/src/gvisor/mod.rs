//! The gVisor driver: sandboxes run under `runsc` (ptrace platform), so a
//! checkpoint captures memory and every process, and a restore continues
//! them. See `docs/gvisor.md` for the measurements behind the choices.
//!
//! Layout: the bundle is the sandbox directory itself (`config.json` next to
//! `upper/`, `work/`, `rootfs/`); init creates its socket in `uds/`, which is
//! bind-mounted read-write into the sandbox, so the host reaches it only
//! through [`sockets`], which follows nothing the sandbox put there
//! ([`GvisorDriver::client`]). runsc's own state for sandbox `id` lives in
//! `<state_dir>/<id>/runsc`, found again by id alone (for `stop`, after the
//! process that started the sandbox has exited).

mod bundle;
pub mod image_host;
mod live;
mod runsc;
pub mod statefile;
pub mod window;

use std::ffi::OsStr;
use std::fs;
use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::cgroup::Hierarchy;
use crate::client::{ClientError, InitClient};
use crate::{pid_start_time, Capabilities, Driver, SandboxError, SandboxProcess, SandboxSpec};
pub use live::{Behind, LiveCheckpoint, LiveSave};
use runsc::Launch;
pub use runsc::{Runsc, CHECKPOINT_FLAGS};
use window::Window;

/// How long a started or restored sandbox may take to answer on its socket.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long init may take to end its connections before a checkpoint.
const QUIESCE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a restore waits for init to notice the restore mark before it
/// signals init instead.
const MARK_NOTICE: Duration = Duration::from_millis(100);

/// How long a recovery waits for the runsc commands a dead Cairn process
/// left running in a checkpoint window before it kills them.
const OP_PATIENCE: Duration = Duration::from_secs(120);

/// In a checkpoint image: the size of init's restore mark when it was taken.
const MARK_SIZE_FILE: &str = "restore-mark.size";

#[derive(Debug, thiserror::Error)]
pub enum GvisorError {
    #[error("runsc (gVisor) is not installed; install it with `apt-get install runsc`")]
    RunscMissing,
    #[error("cannot run {0}: {1}; check that runsc is executable or set CAIRN_RUNSC")]
    Exec(PathBuf, #[source] io::Error),
    #[error("runsc {what} failed: {message}")]
    Runsc { what: String, message: String },
    #[error("cannot write the sandbox bundle: {0}")]
    Bundle(String),
    #[error(transparent)]
    Disk(#[from] crate::disk::DiskError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("no gVisor sandbox {0} runs on this host (`cairn ps` lists sandboxes)")]
    Unknown(String),
    #[error("the sandbox's init did not answer within {timeout:?} after {what}: {last}; its console log is {console}")]
    NotReady {
        what: &'static str,
        timeout: Duration,
        last: String,
        console: PathBuf,
    },
    #[error("cannot quiesce the sandbox's init before the checkpoint: {0}")]
    Quiesce(#[source] ClientError),
    #[error("the checkpoint image {0} does not exist or is empty; checkpoint the sandbox first")]
    NoImage(PathBuf),
    #[error(transparent)]
    Cgroup(#[from] crate::cgroup::CgroupError),
    #[error("the sandbox's checkpoint window: {0}")]
    Window(#[from] window::WindowError),
}

impl GvisorError {
    fn io(what: impl Into<String>, source: io::Error) -> GvisorError {
        GvisorError::Io {
            what: what.into(),
            source,
        }
    }
}

/// A checkpoint written by [`GvisorDriver::checkpoint`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// The directory holding runsc's image (`checkpoint.img`).
    pub image_dir: PathBuf,
    /// Size of the image in bytes (runsc compresses it with flate).
    pub image_bytes: u64,
    /// Time init took to end its connections and trim its kernel state.
    pub quiesce: Duration,
    /// Time `runsc checkpoint` took (saving the sentry).
    pub save: Duration,
    /// Time removing the stopped sandbox's processes, cgroup and state took.
    pub cleanup: Duration,
}

/// What [`GvisorDriver::recover`] found in a sandbox's checkpoint window, and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Recovery {
    /// No window was open.
    NoWindow,
    /// The checkpoint never stopped the sandbox: it runs on, its init
    /// listens again.
    NotTaken,
    /// Checkpoint and restore had both finished and the restored process
    /// was recorded; only the window's record was left.
    Finished,
    /// A restore the dead process started had brought the sandbox back; its
    /// init listens again. The process is to be recorded.
    Adopted(SandboxProcess),
    /// The sandbox was restored from the window's complete image. The
    /// process is to be recorded.
    Restored(SandboxProcess),
    /// No sandbox runs and none could be restored (the reason says why):
    /// the sandbox is gone, and what it ran must resume from an earlier
    /// snapshot.
    Lost(String),
}

pub struct GvisorDriver {
    runsc: Runsc,
    cgroups: Hierarchy,
    state_dir: PathBuf,
    /// How long the last `runsc restore` took, from its start until it
    /// returned with the sandbox running ([`Self::last_runsc_restore`]).
    last_restore: std::sync::Mutex<Option<Duration>>,
}

impl GvisorDriver {
    /// This host as a memory image records it (see [`image_host`]).
    pub fn image_host(&self) -> Result<image_host::ImageHost, GvisorError> {
        image_host::ImageHost::here(&self.runsc)
    }

    /// A driver keeping runsc's per-sandbox state under `state_dir`; `scope`
    /// keeps its cgroups apart from other state directories' (as for the
    /// native driver).
    pub fn new(state_dir: impl Into<PathBuf>, scope: &str) -> Result<GvisorDriver, SandboxError> {
        let state_dir = state_dir.into();
        let runsc = Runsc::find(&state_dir)?;
        let cgroups = Hierarchy::detect(scope)?;
        fs::create_dir_all(&state_dir)
            .map_err(|e| SandboxError::setup(format!("create {}", state_dir.display()), e))?;
        Ok(GvisorDriver {
            runsc,
            cgroups,
            state_dir,
            last_restore: std::sync::Mutex::new(None),
        })
    }

    pub fn runsc_binary(&self) -> &Path {
        &self.runsc.binary
    }

    fn sandbox_state(&self, id: &str) -> PathBuf {
        self.state_dir.join(id)
    }

    fn runsc_root(&self, id: &str) -> PathBuf {
        self.sandbox_state(id).join("runsc")
    }

    /// The sandbox directory recorded at start.
    fn sandbox_dir(&self, id: &str) -> Option<PathBuf> {
        fs::read_link(self.sandbox_state(id).join("sandbox")).ok()
    }

    /// Writes a memory checkpoint of sandbox `id` into `image_dir` and stops
    /// the sandbox (runsc ends a sandbox it checkpointed); [`Self::restore`]
    /// continues it, as often as wanted, each restore from the same image.
    ///
    /// The files of the root are not in the image: they are in the sandbox's
    /// upper directory, which must be captured (as a layer) before anything
    /// else writes to it; a restore mounts that same file state. Commands
    /// attached to a connection must have finished: gVisor cannot save a
    /// host socket, so init ends every connection first (detached processes
    /// keep running and are in the image).
    pub fn checkpoint(&self, id: &str, image_dir: &Path) -> Result<Checkpoint, GvisorError> {
        self.save(id, image_dir, None)
    }

    /// [`Self::checkpoint`] inside a recorded checkpoint window (see
    /// [`window`]): the image goes into the window, `runsc checkpoint` is
    /// recorded there and marks the image complete itself, so a Cairn
    /// process that dies before the sandbox is restored and recorded leaves
    /// what [`Self::recover`] needs to bring it back.
    pub fn checkpoint_in(&self, id: &str, window: &Window) -> Result<Checkpoint, GvisorError> {
        self.save(id, &window.image_dir(), Some(window))
    }

    fn save(&self, id: &str, image_dir: &Path, window: Option<&Window>) -> Result<Checkpoint, GvisorError> {
        let dir = self
            .sandbox_dir(id)
            .ok_or_else(|| GvisorError::Unknown(id.to_string()))?;
        let client = client_in(&dir);
        let root = self.runsc_root(id);
        self.prepare_image(&dir, image_dir)?;
        let t = Instant::now();
        // A refused quiesce leaves init listening as before.
        client.quiesce(QUIESCE_TIMEOUT).map_err(GvisorError::Quiesce)?;
        let quiesce = t.elapsed();
        let t = Instant::now();
        let mut cmd = self.runsc.command(&root);
        cmd.arg("checkpoint")
            .args(&self.runsc.checkpoint_flags)
            .arg("--image-path")
            .arg(image_dir)
            .arg(id);
        let saved = match window {
            None => self.runsc.run_to_end("checkpoint", cmd),
            Some(w) => self.checkpoint_recorded(cmd, w),
        };
        if let Err(e) = saved {
            self.resume_after_failed_checkpoint(&root, id, &dir);
            return Err(e);
        }
        let save = t.elapsed();
        let image_bytes = image_size(image_dir);
        let t = Instant::now();
        self.teardown(id).map_err(|e| GvisorError::Runsc {
            what: "checkpoint (cleaning up the stopped sandbox)".into(),
            message: e.to_string(),
        })?;
        Ok(Checkpoint {
            image_dir: image_dir.to_path_buf(),
            image_bytes,
            quiesce,
            save,
            cleanup: t.elapsed(),
        })
    }

    /// Creates the image directory of sandbox `dir`'s checkpoint. The image
    /// remembers how big init's restore mark was, so that a restore from it
    /// makes the mark bigger still (see `launch`); the mark changes only
    /// after the image, so it is written before.
    fn prepare_image(&self, dir: &Path, image_dir: &Path) -> Result<(), GvisorError> {
        fs::create_dir_all(image_dir).map_err(|e| GvisorError::io(format!("create {}", image_dir.display()), e))?;
        let mark = fs::metadata(dir.join("restore-mark")).map(|m| m.len()).unwrap_or(0);
        let mark_file = image_dir.join(MARK_SIZE_FILE);
        fs::write(&mark_file, mark.to_string())
            .map_err(|e| GvisorError::io(format!("write {}", mark_file.display()), e))
    }

    /// Runs `runsc checkpoint` (`cmd`) through [`window::CHECKPOINT_SCRIPT`]
    /// and waits for it (see [`Self::spawn_recorded_checkpoint`]).
    fn checkpoint_recorded(&self, cmd: std::process::Command, w: &Window) -> Result<(), GvisorError> {
        let mut child = self.spawn_recorded_checkpoint(cmd, w)?;
        let status = child.wait().map_err(|e| GvisorError::Exec("/bin/sh".into(), e))?;
        if status.success() {
            return Ok(());
        }
        Err(GvisorError::Runsc {
            what: "checkpoint".into(),
            message: runsc::first_lines(&fs::read_to_string(w.checkpoint_log()).unwrap_or_default()),
        })
    }

    /// Starts `runsc checkpoint` (`cmd`) through [`window::CHECKPOINT_SCRIPT`]:
    /// in a process group of its own (an interrupt of the terminal does not
    /// cut it short), its output in a file (it never writes to a pipe whose
    /// reader died), its pid in the window's record.
    fn spawn_recorded_checkpoint(
        &self,
        cmd: std::process::Command,
        w: &Window,
    ) -> Result<std::process::Child, GvisorError> {
        use std::os::unix::process::CommandExt;
        let log_path = w.checkpoint_log();
        let log =
            fs::File::create(&log_path).map_err(|e| GvisorError::io(format!("create {}", log_path.display()), e))?;
        let log2 = log
            .try_clone()
            .map_err(|e| GvisorError::io(format!("open {}", log_path.display()), e))?;
        let mut sh = std::process::Command::new("/bin/sh");
        sh.arg("-c")
            .arg(window::CHECKPOINT_SCRIPT)
            .arg("cairn-checkpoint")
            .arg(cmd.get_program())
            .args(cmd.get_args())
            .env("CAIRN_COMPLETE", w.complete_marker())
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log2)
            .process_group(0);
        let mut child = sh.spawn().map_err(|e| GvisorError::Exec("/bin/sh".into(), e))?;
        if let Err(e) = w.add_op("checkpoint", child.id()) {
            // Unrecorded, it must not outlive this process unnoticed.
            let _ = child.kill();
            let _ = child.wait();
            return Err(e.into());
        }
        Ok(child)
    }

    /// Starts sandbox `spec` from a checkpoint image: every process continues
    /// where it was. `spec.layers` plus `spec.upper_dir()` must hold the
    /// files as they were at the checkpoint. Call
    /// [`InitClient::restored`] next, so the clock and the RNG move on.
    pub fn restore(&self, spec: &SandboxSpec, image_dir: &Path) -> Result<SandboxProcess, GvisorError> {
        if image_size(image_dir) == 0 {
            return Err(GvisorError::NoImage(image_dir.to_path_buf()));
        }
        let process = self.launch(spec, Start::Restore(image_dir), None).inspect_err(|_| {
            let _ = self.teardown(&spec.id);
        })?;
        Ok(process)
    }

    /// How long runsc's own `restore` command took in the last restore of
    /// this driver (of any sandbox): the part of a restore that is runsc's,
    /// for benchmarks that set it beside the whole.
    pub fn last_runsc_restore(&self) -> Option<Duration> {
        *self.last_restore.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn note_restore(&self, took: Duration) {
        *self.last_restore.lock().unwrap_or_else(|e| e.into_inner()) = Some(took);
    }

    /// Whether this runsc restores into a sandbox created ahead
    /// ([`Self::prepare_restore`]). The builds whose checkpoint writes raw
    /// pages and leaves the sandbox running (2024 and later) do; Debian
    /// 12's 2022 build refuses (`container already exists`: its `restore`
    /// always creates the sandbox itself).
    pub fn restores_into_created(&self) -> bool {
        self.runsc.leave_running
    }

    /// Makes sandbox `spec` ready to be restored from `image_dir` later
    /// (`runsc create`): its gofer and sentry start, its root is mounted,
    /// its cgroup holds them, and they wait. What a restore costs before it
    /// reads the image (creating the sandbox, about 100-140 ms here) is paid
    /// now; [`Self::restore_prepared`] then only loads the image. The
    /// sandbox runs nothing and uses no memory of its own beyond runsc's
    /// processes (about 40 MB) until then. Remove it with
    /// [`crate::Driver::stop`] if it is not wanted after all.
    pub fn prepare_restore(&self, spec: &SandboxSpec, image_dir: &Path) -> Result<SandboxProcess, GvisorError> {
        if !self.restores_into_created() {
            return Err(GvisorError::Runsc {
                what: "create (ahead of a restore)".into(),
                message: format!(
                    "{} cannot restore into a created sandbox; restore without preparing",
                    self.runsc.binary.display()
                ),
            });
        }
        if image_size(image_dir) == 0 {
            return Err(GvisorError::NoImage(image_dir.to_path_buf()));
        }
        self.launch(spec, Start::Prepare(image_dir), None).inspect_err(|_| {
            let _ = self.teardown(&spec.id);
        })
    }

    /// Restores `image_dir` into the sandbox [`Self::prepare_restore`] made
    /// for `spec` (the same image): every process continues where it was.
    /// Call [`InitClient::restored`] next, as after [`Self::restore`]. A
    /// failure removes the prepared sandbox.
    pub fn restore_prepared(&self, spec: &SandboxSpec, image_dir: &Path) -> Result<SandboxProcess, GvisorError> {
        let restored = self.restore_into_created(spec, image_dir);
        if restored.is_err() {
            let _ = self.teardown(&spec.id);
        }
        restored
    }

    fn restore_into_created(&self, spec: &SandboxSpec, image_dir: &Path) -> Result<SandboxProcess, GvisorError> {
        if image_size(image_dir) == 0 {
            return Err(GvisorError::NoImage(image_dir.to_path_buf()));
        }
        let state = self.sandbox_state(&spec.id);
        let root = self.runsc_root(&spec.id);
        let process = read_process(&state.join("sandbox.pid"), "restore")?;
        let console = spec.console_log();
        let console_len = fs::metadata(&console).map(|m| m.len()).unwrap_or(0);
        let mut cmd = self.runsc.command(&root);
        cmd.args(["restore", "--detach", "--image-path"])
            .arg(image_dir)
            .arg("--bundle")
            .arg(&spec.dir)
            .arg(&spec.id);
        let t = Instant::now();
        self.runsc.run_logged("restore", cmd, &console, console_len)?;
        self.note_restore(t.elapsed());
        // The image's init is quiesced (it was when checkpointed); the
        // restore mark grew when the sandbox was prepared.
        self.relisten_and_wait(&root, &spec.id, &spec.dir, "restore", true)?;
        if pid_start_time(process.pid) != Some(process.start_time) {
            return Err(GvisorError::Runsc {
                what: "restore".into(),
                message: "the prepared sandbox exited during its restore".into(),
            });
        }
        Ok(process)
    }

    /// [`Self::restore`] from the image of a checkpoint window, the
    /// `runsc restore` recorded in the window.
    pub fn restore_in(&self, spec: &SandboxSpec, window: &Window) -> Result<SandboxProcess, GvisorError> {
        let image_dir = window.image_dir();
        if image_size(&image_dir) == 0 {
            return Err(GvisorError::NoImage(image_dir));
        }
        let process = self
            .launch(spec, Start::Restore(&image_dir), Some(window))
            .inspect_err(|_| {
                let _ = self.teardown(&spec.id);
            })?;
        Ok(process)
    }

    /// Finishes the checkpoint window a Cairn process that died left open in
    /// sandbox `spec` (see [`window`]); `recorded` is the sandbox's process
    /// as recorded now. Waits for the runsc commands still running in the
    /// window, then: a sandbox still running (never stopped, or restored
    /// and recorded) goes on with its init listening; a sandbox a restore
    /// brought back is adopted (one that died is lost); else a complete
    /// image is restored; else the sandbox is lost. The window stays open: the caller records the
    /// outcome, then removes it ([`Window::remove`]), so a recovery that dies
    /// half-way is done again.
    pub fn recover(&self, spec: &SandboxSpec, recorded: Option<SandboxProcess>) -> Result<Recovery, GvisorError> {
        let w = Window::of(&spec.dir);
        let Some(record) = w.read()? else {
            return Ok(Recovery::NoWindow);
        };
        // The runsc commands outlived the process that started them: their
        // results decide what is left.
        let deadline = Instant::now() + OP_PATIENCE;
        loop {
            let live = w.live_ops()?;
            if live.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                tracing::warn!(
                    sandbox = spec.id,
                    "runsc {} did not end within {OP_PATIENCE:?}; killing it",
                    live[0].what
                );
                kill_ops(&w);
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // A checkpoint that leaves the sandbox running paused it first.
        self.unpause_for_recovery(&spec.id, &w);
        let opened_with = record.process.map(SandboxProcess::from);
        let root = self.runsc_root(&spec.id);
        if let Some(p) = recorded.filter(SandboxProcess::alive) {
            // Restored and recorded, or never stopped: it runs on, once its
            // init listens (it may have been left quiesced: a longer restore
            // mark makes a quiesced init listen without runsc's help).
            let finished = opened_with != Some(p);
            if let Err(e) = live::grow_mark(&spec.dir) {
                tracing::debug!(sandbox = spec.id, "{e}");
            }
            // A checkpoint that leaves the sandbox running never stopped it,
            // complete image or not.
            if finished || w.was_paused() || !w.is_complete() {
                return Ok(
                    match self.relisten_and_wait(&root, &spec.id, &spec.dir, "an interrupted checkpoint", true) {
                        Ok(()) if finished => Recovery::Finished,
                        Ok(()) => Recovery::NotTaken,
                        Err(e) => {
                            let _ = self.teardown(&spec.id);
                            Recovery::Lost(format!(
                                "its init did not listen again after an interrupted checkpoint: {e}"
                            ))
                        }
                    },
                );
            }
        }
        // A restore that got as far as starting the sandbox: adopted if it
        // runs. One that ran and died may have written files since the
        // image, which a restore from the image would not match: lost.
        if let Some(pid) = self
            .runsc_pid(&spec.id)
            .filter(|pid| Some(*pid) != opened_with.map(|p| p.pid))
        {
            let running = pid_start_time(pid)
                .map(|start_time| SandboxProcess { pid, start_time })
                .filter(SandboxProcess::alive);
            let why = match running {
                Some(p) => match self.relisten_and_wait(&root, &spec.id, &spec.dir, "an interrupted restore", true) {
                    Ok(()) => return Ok(Recovery::Adopted(p)),
                    Err(e) => format!("the sandbox its interrupted restore started does not answer: {e}"),
                },
                None => "the sandbox its interrupted restore started has died; its files may have changed since \
                         the image, so the image is not restored again"
                    .to_string(),
            };
            let _ = self.teardown(&spec.id);
            return Ok(Recovery::Lost(why));
        }
        let _ = self.teardown(&spec.id);
        if !w.is_complete() {
            return Ok(Recovery::Lost("its checkpoint image was not complete".into()));
        }
        Ok(match self.restore_in(spec, &w) {
            Ok(p) => Recovery::Restored(p),
            Err(e) => Recovery::Lost(format!("restoring it from its complete checkpoint image failed: {e}")),
        })
    }

    /// The pid runsc recorded for sandbox `id`'s last start or restore.
    fn runsc_pid(&self, id: &str) -> Option<i32> {
        fs::read_to_string(self.sandbox_state(id).join("sandbox.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Sends init the signal that makes a quiesced init listen again.
    fn relisten(&self, root: &Path, id: &str) -> Result<(), GvisorError> {
        let mut cmd = self.runsc.command(root);
        cmd.args(["kill", id, "USR2"]);
        self.runsc.run_to_end("kill (relisten)", cmd)
    }

    fn launch(
        &self,
        spec: &SandboxSpec,
        start: Start<'_>,
        window: Option<&Window>,
    ) -> Result<SandboxProcess, GvisorError> {
        let image = match start {
            Start::Fresh => None,
            Start::Restore(image) | Start::Prepare(image) => Some(image),
        };
        let uds = spec.dir.join("uds");
        let socket = uds.join("init.sock");
        if socket.as_os_str().len() >= 100 {
            return Err(GvisorError::Bundle(format!(
                "the sandbox directory path {} is too long for a Unix socket (108 bytes); use a shorter CAIRN_HOME",
                spec.dir.display()
            )));
        }
        // The root's upper and work directories on the sandbox's disk, when
        // it has one (the same as a native sandbox's: see `disk`).
        match spec.limits.disk_bytes {
            Some(bytes) => crate::disk::prepare(&spec.dir, bytes, 0)?,
            None => drop(crate::disk::upper_dir(&spec.dir)?),
        }
        let writable = crate::disk::writable_dir(&spec.dir);
        for sub in ["upper", "work", "rootfs", "uds"] {
            let d = match sub {
                "upper" | "work" => writable.join(sub),
                _ => spec.dir.join(sub),
            };
            let made = !d.is_dir();
            fs::create_dir_all(&d).map_err(|e| GvisorError::io(format!("create {}", d.display()), e))?;
            // The upper directory is the sandbox's `/`: 0755 whatever the
            // umask of the process starting it.
            if made && sub == "upper" {
                fs::set_permissions(&d, fs::Permissions::from_mode(crate::ROOT_MODE))
                    .map_err(|e| GvisorError::io(format!("chmod {}", d.display()), e))?;
            }
        }
        let _ = fs::remove_file(&socket);

        let state = self.sandbox_state(&spec.id);
        let root = self.runsc_root(&spec.id);
        // A leftover runsc state (a crashed host) would make runsc refuse the id.
        let _ = fs::remove_dir_all(&state);
        fs::create_dir_all(&root).map_err(|e| GvisorError::io(format!("create {}", root.display()), e))?;
        std::os::unix::fs::symlink(&spec.dir, state.join("sandbox"))
            .map_err(|e| GvisorError::io(format!("record the sandbox directory in {}", state.display()), e))?;

        let rootfs = spec.dir.join("rootfs");
        let config = bundle::config(spec, &rootfs, &uds)?;
        let config_path = spec.dir.join("config.json");
        let text = serde_json::to_vec_pretty(&config).map_err(|e| GvisorError::Bundle(e.to_string()))?;
        fs::write(&config_path, text).map_err(|e| GvisorError::io(format!("write {}", config_path.display()), e))?;
        let overlay_options = crate::native::overlay_options(spec).map_err(GvisorError::Bundle)?;

        // A restored init that was quiesced listens again as soon as its
        // stdin (this file) has another size than when it was checkpointed:
        // one byte more than the image's mark. (gVisor gives a host file
        // the same inode number in the sandbox across restores, so a new
        // file of the same size would go unnoticed, and the restore would
        // wait for the relisten signal instead.)
        let restore_mark = spec.dir.join("restore-mark");
        let mut mark = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&restore_mark)
            .map_err(|e| GvisorError::io(format!("open {}", restore_mark.display()), e))?;
        if let Some(image) = image {
            let before: u64 = fs::read_to_string(image.join(MARK_SIZE_FILE))
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .filter(|n| *n < 1 << 20)
                .unwrap_or(0);
            let have = mark.metadata().map(|m| m.len()).unwrap_or(0);
            let grow = (before + 1).saturating_sub(have).max(1);
            mark.write_all(&vec![b'r'; grow as usize])
                .map_err(|e| GvisorError::io(format!("write {}", restore_mark.display()), e))?;
        }
        drop(mark);

        let cgroup = self.cgroups.create(&spec.id, &spec.limits)?;
        let pid_file = state.join("sandbox.pid");
        let record_op = |pid: u32| window.map_or(Ok(()), |w| w.add_op("restore", pid).map_err(GvisorError::from));
        let launch = Launch {
            on_spawn: &record_op,
            root: &root,
            rootfs: &rootfs,
            overlay_options: &overlay_options,
            cgroup_procs: &cgroup.procs_files(),
            console: &spec.console_log(),
            restore_mark: &restore_mark,
        };
        let (what, image_path): (&str, Option<&Path>) = match start {
            Start::Fresh => ("run", None),
            Start::Prepare(_) => ("create", None),
            Start::Restore(image) => ("restore", Some(image)),
        };
        let mut args: Vec<&OsStr> = vec![what.as_ref()];
        // `create` leaves the sandbox waiting; the others return once it runs.
        if !matches!(start, Start::Prepare(_)) {
            args.push("--detach".as_ref());
        }
        if let Some(image) = image_path {
            args.extend(["--image-path".as_ref(), image.as_os_str()]);
        }
        args.extend([
            "--pid-file".as_ref(),
            pid_file.as_os_str(),
            "--bundle".as_ref(),
            spec.dir.as_os_str(),
            spec.id.as_ref(),
        ]);
        let t = Instant::now();
        self.runsc.launch(what, &launch, &args)?;
        if image_path.is_some() {
            self.note_restore(t.elapsed());
            // The image's init is quiesced (it was when checkpointed).
            self.relisten_and_wait(&root, &spec.id, &spec.dir, "restore", true)?;
        }
        let process = read_process(&pid_file, "run")?;
        match start {
            // Nothing runs in a prepared sandbox yet.
            Start::Prepare(_) => {}
            Start::Restore(_) => self.wait_ready(&spec.dir, "restore")?,
            Start::Fresh => self.wait_ready(&spec.dir, "start")?,
        }
        Ok(process)
    }

    /// Waits until init answers a ping on the sandbox's socket in `dir`.
    fn wait_ready(&self, dir: &Path, what: &'static str) -> Result<(), GvisorError> {
        self.wait_ready_for(dir, what, READY_TIMEOUT)
    }

    fn wait_ready_for(&self, dir: &Path, what: &'static str, timeout: Duration) -> Result<(), GvisorError> {
        let client = client_in(dir);
        let deadline = Instant::now() + timeout;
        let mut delay = Duration::from_micros(200);
        loop {
            let last = match client.ping(Duration::from_millis(500).min(timeout)) {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            if Instant::now() >= deadline {
                return Err(GvisorError::NotReady {
                    what,
                    timeout,
                    last: last.to_string(),
                    console: dir.join("console.log"),
                });
            }
            std::thread::sleep(delay);
            // A refused connect costs microseconds: poll often, so a ready
            // init is noticed within a millisecond.
            delay = (delay * 2).min(Duration::from_millis(1));
        }
    }

    /// After a failed checkpoint: init listens again, the sandbox runs on.
    fn resume_after_failed_checkpoint(&self, root: &Path, id: &str, dir: &Path) {
        if let Err(e) = self.relisten_and_wait(root, id, dir, "a failed checkpoint", false) {
            tracing::warn!(sandbox = id, "init did not listen again after a failed checkpoint: {e}");
        }
    }

    /// Signals a quiesced init to listen again until it answers. The signal
    /// is repeated because a delivery to a busy init was seen to be lost
    /// now and then; init discards repeats that arrive after it listens.
    fn relisten_and_wait(
        &self,
        root: &Path,
        id: &str,
        dir: &Path,
        what: &'static str,
        marked: bool,
    ) -> Result<(), GvisorError> {
        let deadline = Instant::now() + READY_TIMEOUT;
        // After a restore, init notices the restore mark itself within a few
        // milliseconds; the signal (a runsc start-up, 25-40 ms) is the
        // fallback.
        if marked && self.wait_ready_for(dir, what, MARK_NOTICE).is_ok() {
            return Ok(());
        }
        loop {
            // runsc's control server refused a connection now and then under
            // load: asked again until the deadline.
            if let Err(e) = self.relisten(root, id) {
                if Instant::now() >= deadline {
                    return Err(e);
                }
                tracing::debug!(sandbox = id, "relisten signal: {e}; trying again");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
            let wait = Duration::from_secs(1).min(deadline.saturating_duration_since(Instant::now()));
            match self.wait_ready_for(dir, what, wait) {
                Ok(()) => return Ok(()),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => continue,
            }
        }
    }

    /// Kills every process of the sandbox (runsc, gofer, sentry and its
    /// ptrace stubs all live in its cgroup), removes the cgroup and runsc's
    /// state. `runsc delete` would do the same but waits about 1.7 s for a
    /// sandbox that is already gone. The root overlay lives in the sandbox's
    /// own mount namespace and goes with its last process.
    fn teardown(&self, id: &str) -> Result<(), SandboxError> {
        let cgroup = self.cgroups.cgroup(id);
        if cgroup.exists() {
            let _ = cgroup.thaw();
            cgroup.kill_all()?;
            cgroup.remove()?;
        }
        if let Some(dir) = self.sandbox_dir(id) {
            let _ = fs::remove_file(dir.join("uds").join("init.sock"));
            // A checkpoint left running by a Cairn process that died.
            kill_ops(&Window::of(&dir));
        }
        let state = self.sandbox_state(id);
        match fs::remove_dir_all(&state) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(SandboxError::setup(format!("remove {}", state.display()), e)),
        }
    }
}

/// How [`GvisorDriver::launch`] starts a sandbox.
#[derive(Clone, Copy)]
enum Start<'a> {
    /// `runsc run`: init starts.
    Fresh,
    /// `runsc restore` of this image into a new sandbox.
    Restore(&'a Path),
    /// `runsc create`, for this image to be restored into later.
    Prepare(&'a Path),
}

/// The sandbox process runsc wrote to `pid_file`, as it runs now.
fn read_process(pid_file: &Path, what: &str) -> Result<SandboxProcess, GvisorError> {
    let pid: i32 = fs::read_to_string(pid_file)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or_else(|| GvisorError::Runsc {
            what: what.into(),
            message: format!("no sandbox pid in {}", pid_file.display()),
        })?;
    let start_time = pid_start_time(pid).ok_or_else(|| GvisorError::Runsc {
        what: what.into(),
        message: "the sandbox exited right after starting".into(),
    })?;
    Ok(SandboxProcess { pid, start_time })
}

/// Kills the runsc commands of a checkpoint window that still run, with
/// their process groups (the checkpoint's shell leads its own).
fn kill_ops(w: &Window) {
    use nix::sys::signal::{kill, killpg, Signal};
    use nix::unistd::Pid;
    for op in w.live_ops().unwrap_or_default() {
        let pid = Pid::from_raw(op.process.pid);
        if op.what == "checkpoint" {
            let _ = killpg(pid, Signal::SIGKILL);
        }
        let _ = kill(pid, Signal::SIGKILL);
    }
}

/// A client for the init of the sandbox whose directory is `dir`.
fn client_in(dir: &Path) -> InitClient {
    InitClient::in_shared_directory(dir.join("uds"))
}

/// Total size of the files in `dir` (0 when missing).
fn image_size(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

impl Driver for GvisorDriver {
    // The sentry and its processes live in the sandbox's cgroup, so the
    // cgroup freezer stops them all at once, as for native sandboxes.
    fn freeze(&self, id: &str) -> Result<(), SandboxError> {
        Ok(self.cgroups.cgroup(id).freeze()?)
    }

    fn thaw(&self, id: &str) -> Result<(), SandboxError> {
        Ok(self.cgroups.cgroup(id).thaw()?)
    }

    fn frozen(&self, id: &str) -> bool {
        self.cgroups.cgroup(id).is_frozen()
    }

    fn name(&self) -> &'static str {
        "gvisor"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            memory_snapshots: true,
            host_ids: None,
        }
    }

    /// Init binds its socket in `uds/`, which the sandbox can write: the
    /// client uses only init's sockets there and follows no link.
    fn client(&self, dir: &Path) -> InitClient {
        client_in(dir)
    }

    fn start(&self, spec: &SandboxSpec) -> Result<SandboxProcess, SandboxError> {
        self.launch(spec, Start::Fresh, None).map_err(|e| {
            let _ = self.teardown(&spec.id);
            SandboxError::from(e)
        })
    }

    fn stop(&self, id: &str, _process: Option<SandboxProcess>) -> Result<(), SandboxError> {
        // The sentry, gofer and stubs are all in the cgroup, whatever the
        // recorded pid says.
        self.teardown(id)
    }

    fn usage(&self, id: &str) -> crate::cgroup::Usage {
        self.cgroups.cgroup(id).usage()
    }

    fn oom_kills(&self, id: &str) -> u64 {
        self.cgroups.cgroup(id).oom_kills()
    }

    fn leftovers(&self) -> Vec<String> {
        fs::read_dir(&self.state_dir)
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .filter(|e| e.path().is_dir())
                    .filter_map(|e| e.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default()
    }
}
