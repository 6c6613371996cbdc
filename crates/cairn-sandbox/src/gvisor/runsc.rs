//! Running the `runsc` command line.
//!
//! `run` and `restore` start the sandbox's gofer and sentry, which outlive
//! runsc itself. They are started inside the sandbox's cgroup (runsc gets
//! `--ignore-cgroups`, so the limits and the kill-everything sweep are the
//! same code as the native driver's) and inside a private mount namespace in
//! which the root overlay is mounted: the gofer serves files from that
//! mount, nothing is mounted on the host, and the mount vanishes with the
//! sandbox's last process, however it dies.

use std::ffi::{CString, OsStr};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::mount::{mount, MsFlags};
use nix::sched::{unshare, CloneFlags};

use super::GvisorError;

/// The runsc executable and the flags every invocation for one sandbox
/// shares.
#[derive(Debug, Clone)]
pub struct Runsc {
    pub binary: PathBuf,
}

/// What `run` and `restore` need besides their arguments.
pub struct Launch<'a> {
    /// runsc's state directory for this sandbox (`--root`).
    pub root: &'a Path,
    /// Where the root overlay is mounted (in the private namespace).
    pub rootfs: &'a Path,
    /// `lowerdir=…,upperdir=…,workdir=…`.
    pub overlay_options: &'a str,
    /// The sandbox cgroup's `cgroup.procs` files.
    pub cgroup_procs: &'a [PathBuf],
    /// Receives the sandbox's stdout and stderr, and runsc's own errors.
    pub console: &'a Path,
    /// The sandbox's stdin: a file only the driver writes, one byte per
    /// restore, which a quiesced init watches (see `GvisorDriver::restore`).
    pub restore_mark: &'a Path,
}

impl Runsc {
    /// Finds runsc: `$CAIRN_RUNSC`, else the first `runsc` on `PATH`.
    pub fn find() -> Result<Runsc, GvisorError> {
        if let Some(p) = std::env::var_os("CAIRN_RUNSC") {
            let p = PathBuf::from(p);
            return if p.is_file() {
                Ok(Runsc { binary: p })
            } else {
                Err(GvisorError::RunscMissing)
            };
        }
        let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
        std::env::split_paths(&path)
            .map(|d| d.join("runsc"))
            .find(|p| p.is_file())
            .map(|binary| Runsc { binary })
            .ok_or(GvisorError::RunscMissing)
    }

    /// `runsc` with the global flags for the sandbox whose state lives in `root`.
    ///
    /// - `ptrace`: the only platform this kind of host has (no KVM, and this
    ///   runsc predates `systrap`).
    /// - `--network none`: a loopback-only netstack; nothing to save or
    ///   restore but `lo`.
    /// - `--host-uds create`: lets init bind its socket in a gofer-served
    ///   directory, so the host connects to it.
    /// - `--ignore-cgroups`: runsc starts inside our cgroup already.
    pub fn command(&self, root: &Path) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--root")
            .arg(root)
            .args(["--platform", "ptrace", "--network", "none"])
            .args(["--host-uds", "create", "--ignore-cgroups"]);
        if let Some(dir) = std::env::var_os("CAIRN_RUNSC_DEBUG_LOG") {
            let mut d = dir.clone();
            d.push("/");
            cmd.arg("--debug").arg("--debug-log").arg(d);
        }
        cmd
    }

    /// Runs a short runsc command (checkpoint, kill, state) to completion.
    pub fn run_to_end(&self, what: &str, mut cmd: Command) -> Result<(), GvisorError> {
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .map_err(|e| GvisorError::Exec(self.binary.clone(), e))?;
        if out.status.success() {
            return Ok(());
        }
        Err(GvisorError::Runsc {
            what: what.to_string(),
            message: first_lines(&String::from_utf8_lossy(&out.stderr)),
        })
    }

    /// `runsc run --detach` or `runsc restore --detach`, with `args` after
    /// the subcommand; returns once the sandbox runs (or failed to).
    pub fn launch(&self, what: &str, l: &Launch<'_>, args: &[&OsStr]) -> Result<(), GvisorError> {
        let console_for = |what: &str| {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(l.console)
                .map_err(|e| GvisorError::io(format!("open {} for {what}", l.console.display()), e))
        };
        let procs: Vec<File> = l
            .cgroup_procs
            .iter()
            .map(|p| {
                OpenOptions::new()
                    .write(true)
                    .open(p)
                    .map_err(|e| GvisorError::io(format!("open {}", p.display()), e))
            })
            .collect::<Result<_, _>>()?;
        let rootfs = cstring(l.rootfs.as_os_str())?;
        let options = cstring(OsStr::new(l.overlay_options))?;
        let console_len = std::fs::metadata(l.console).map(|m| m.len()).unwrap_or(0);

        let mark = File::open(l.restore_mark)
            .map_err(|e| GvisorError::io(format!("open {}", l.restore_mark.display()), e))?;
        let mut cmd = self.command(l.root);
        cmd.args(args)
            .stdin(mark)
            .stdout(console_for("stdout")?)
            .stderr(console_for("stderr")?);
        // SAFETY: the closure runs between fork and exec; it only makes
        // system calls (write, unshare, mount) on values prepared above and
        // allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                for mut f in &procs {
                    f.write_all(b"0")?;
                }
                unshare(CloneFlags::CLONE_NEWNS)?;
                // Nothing mounted from here on may propagate to the host.
                mount(
                    None::<&OsStr>,
                    "/",
                    None::<&OsStr>,
                    MsFlags::MS_REC | MsFlags::MS_PRIVATE,
                    None::<&OsStr>,
                )?;
                mount(
                    Some(c"overlay"),
                    rootfs.as_c_str(),
                    Some(c"overlay"),
                    MsFlags::empty(),
                    Some(options.as_c_str()),
                )?;
                Ok(())
            });
        }
        let status = cmd.status().map_err(|e| GvisorError::Exec(self.binary.clone(), e))?;
        if status.success() {
            return Ok(());
        }
        // runsc's errors went to the console log, behind what was there.
        let log = std::fs::read(l.console).unwrap_or_default();
        let fresh = log.get(console_len as usize..).unwrap_or_default();
        Err(GvisorError::Runsc {
            what: what.to_string(),
            message: first_lines(&String::from_utf8_lossy(fresh)),
        })
    }
}

fn cstring(s: &OsStr) -> Result<CString, GvisorError> {
    CString::new(s.as_bytes()).map_err(|_| GvisorError::Bundle(format!("{s:?} contains a NUL byte")))
}

/// runsc prints Go stack traces after its error line; keep the start.
fn first_lines(s: &str) -> String {
    let s = s.trim();
    let mut out: String = s.lines().take(6).collect::<Vec<_>>().join("\n");
    if out.len() > 2000 {
        out.truncate(2000);
    }
    if out.is_empty() {
        "runsc failed without a message".into()
    } else {
        out
    }
}
