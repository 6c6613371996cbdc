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
    /// `systrap` where this runsc offers it, else `ptrace`.
    pub platform: &'static str,
    /// Global flags every invocation gets because this runsc has them
    /// ([`GLOBAL_FLAGS`]).
    pub global_flags: Vec<&'static str>,
    /// Flags `runsc checkpoint` gets because this runsc has them
    /// ([`CHECKPOINT_FLAGS`]); none on runsc releases before 2024.
    pub checkpoint_flags: Vec<&'static str>,
    /// Whether `runsc checkpoint` can leave the sandbox running: it lists
    /// `-leave-running` and `-compression` (the save path that writes raw
    /// pages resumes the same sentry; Debian 12's 2022 runsc lists
    /// `-leave-running` too, but implements it as a restore and hangs).
    pub leave_running: bool,
}

/// `runsc checkpoint` flags that make a memory snapshot cheaper, used where
/// `runsc checkpoint --help` lists them (newer runsc releases):
/// - `-compression=none`: the image's state stream is written raw instead
///   of flate-compressed, so runsc does not compress it, the restore does
///   not inflate it, and Cairn stores it as written (content-defined chunks
///   of raw memory pages find what two checkpoints share).
/// - `-exclude-committed-zero-pages`: pages that are all zeros are left out
///   of the image.
pub const CHECKPOINT_FLAGS: [(&str, &str); 2] = [
    ("compression", "--compression=none"),
    ("exclude-committed-zero-pages", "--exclude-committed-zero-pages"),
];

/// Global runsc flags given where `runsc flags` lists them:
/// - `-overlay2=none`: the root is served as the driver mounted it. runsc
///   releases since 2023 default to `root:self`, an overlay inside the
///   sentry whose upper layer is a file in the root itself: the sandbox's
///   writes would never reach its `upper/` directory on the host, so layer
///   capture, file snapshots and forks would not see them, and every
///   written byte would be in the memory image. Older releases default to
///   `none` and accept it too.
pub const GLOBAL_FLAGS: [(&str, &str); 1] = [("overlay2", "--overlay2=none")];

/// What `run` and `restore` need besides their arguments.
pub struct Launch<'a> {
    /// runsc's state directory for this sandbox (`--root`).
    pub root: &'a Path,
    /// Where the root overlay is mounted (in the private namespace).
    pub rootfs: &'a Path,
    /// `lowerdir=…,upperdir=…,workdir=…`.
    pub overlay_options: &'a str,
    /// The files that join the sandbox cgroup (`Cgroup::procs_files`).
    pub cgroup_procs: &'a [PathBuf],
    /// Receives the sandbox's stdout and stderr, and runsc's own errors.
    pub console: &'a Path,
    /// The sandbox's stdin: a file only the driver writes, one byte per
    /// restore, which a quiesced init watches (see `GvisorDriver::restore`).
    pub restore_mark: &'a Path,
    /// Told runsc's pid once it started (a checkpoint window records it).
    pub on_spawn: &'a dyn Fn(u32) -> Result<(), GvisorError>,
}

impl Runsc {
    /// Finds runsc: `$CAIRN_RUNSC`, else the first `runsc` on `PATH`. The
    /// platform and flags it offers are asked once per runsc binary and
    /// remembered in `cache_dir` (asking costs a runsc start-up, ~20 ms,
    /// which every command touching a gvisor sandbox would otherwise pay).
    pub fn find(cache_dir: &Path) -> Result<Runsc, GvisorError> {
        let binary = Runsc::locate().ok_or(GvisorError::RunscMissing)?;
        let (platform, global_flags) = cached_global(&binary, &cache_dir.join("runsc-global-flags"));
        let names = cached_answer(
            &binary,
            &cache_dir.join("runsc-checkpoint-flags-2"),
            checkpoint_flag_names,
        );
        let checkpoint_flags = flags_in(&CHECKPOINT_FLAGS, &names);
        Ok(Runsc {
            binary,
            platform,
            global_flags,
            checkpoint_flags,
            leave_running: leaves_running(&names),
        })
    }

    /// The runsc executable [`Runsc::find`] uses, without asking it
    /// anything: `$CAIRN_RUNSC`, else the first `runsc` on `PATH`.
    pub fn locate() -> Option<PathBuf> {
        match std::env::var_os("CAIRN_RUNSC") {
            Some(p) => Some(PathBuf::from(p)).filter(|p| p.is_file()),
            None => {
                let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
                std::env::split_paths(&path)
                    .map(|d| d.join("runsc"))
                    .find(|p| p.is_file())
            }
        }
    }

    /// `runsc` with the global flags for the sandbox whose state lives in `root`.
    ///
    /// - `systrap` where this runsc has it (faster system calls than
    ///   `ptrace`, no hardware virtualisation needed), else `ptrace`; runsc
    ///   releases before mid-2023 (Debian 12's) have only `ptrace` and `kvm`,
    ///   and `kvm` needs a usable /dev/kvm.
    /// - `--network none`: a loopback-only netstack; nothing to save or
    ///   restore but `lo`.
    /// - `--host-uds create`: lets init bind its socket in a gofer-served
    ///   directory, so the host connects to it.
    /// - `--ignore-cgroups`: runsc starts inside our cgroup already.
    /// - [`GLOBAL_FLAGS`] this runsc lists.
    pub fn command(&self, root: &Path) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--root")
            .arg(root)
            .args(["--platform", self.platform, "--network", "none"])
            .args(["--host-uds", "create", "--ignore-cgroups"])
            .args(&self.global_flags);
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

        let mark =
            File::open(l.restore_mark).map_err(|e| GvisorError::io(format!("open {}", l.restore_mark.display()), e))?;
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
        let mut child = cmd.spawn().map_err(|e| GvisorError::Exec(self.binary.clone(), e))?;
        if let Err(e) = (l.on_spawn)(child.id()) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        let status = child.wait().map_err(|e| GvisorError::Exec(self.binary.clone(), e))?;
        if status.success() {
            return Ok(());
        }
        Err(console_error(what, l.console, console_len))
    }

    /// Runs `cmd` (a `restore` into a sandbox made by `create`) to its end,
    /// its output appended to the sandbox's console log, where the
    /// sandbox's own goes; `console_len` is the log's size before.
    pub fn run_logged(
        &self,
        what: &str,
        mut cmd: Command,
        console: &Path,
        console_len: u64,
    ) -> Result<(), GvisorError> {
        let log = |stream: &str| {
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(console)
                .map_err(|e| GvisorError::io(format!("open {} for {stream}", console.display()), e))
        };
        let status = cmd
            .stdin(Stdio::null())
            .stdout(log("stdout")?)
            .stderr(log("stderr")?)
            .status()
            .map_err(|e| GvisorError::Exec(self.binary.clone(), e))?;
        if status.success() {
            return Ok(());
        }
        Err(console_error(what, console, console_len))
    }
}

/// runsc's errors went to the console log, behind what was there (the
/// sandbox's own output, of any size): its first lines are enough.
fn console_error(what: &str, console: &Path, console_len: u64) -> GvisorError {
    let mut fresh = Vec::new();
    if let Ok(mut log) = std::fs::File::open(console) {
        use std::io::{Read, Seek, SeekFrom};
        let _ = log.seek(SeekFrom::Start(console_len));
        let _ = log.take(64 << 10).read_to_end(&mut fresh);
    }
    GvisorError::Runsc {
        what: what.to_string(),
        message: first_lines(&String::from_utf8_lossy(&fresh)),
    }
}

fn cstring(s: &OsStr) -> Result<CString, GvisorError> {
    CString::new(s.as_bytes()).map_err(|_| GvisorError::Bundle(format!("{s:?} contains a NUL byte")))
}

/// runsc prints Go stack traces after its error line; keep the start.
pub(super) fn first_lines(s: &str) -> String {
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

/// The platform and the [`GLOBAL_FLAGS`] of `binary` ([`global_answer`]),
/// remembered in `cache` for this binary.
fn cached_global(binary: &Path, cache: &Path) -> (&'static str, Vec<&'static str>) {
    let answer = cached_answer(binary, cache, global_answer);
    let mut words = answer.split(',');
    let platform = words
        .next()
        .and_then(|w| ["systrap", "ptrace"].into_iter().find(|p| *p == w))
        .unwrap_or("ptrace");
    (platform, flags_in(&GLOBAL_FLAGS, &words.collect::<Vec<_>>().join(",")))
}

/// `runsc flags` of `binary` as one word: the platform to use, then the
/// names of the [`GLOBAL_FLAGS`] it lists, joined by commas.
fn global_answer(binary: &Path) -> String {
    let text = help_of(binary, &["flags"]);
    let mut words = vec![platform_in(&text)];
    words.extend(listed(&GLOBAL_FLAGS, &text));
    words.join(",")
}

/// `ask(binary)` (one word, no spaces), remembered in `cache` for this
/// binary (its path, size and modification time): asking costs a runsc
/// start-up, and a reinstalled runsc is asked again.
fn cached_answer(binary: &Path, cache: &Path, ask: fn(&Path) -> String) -> String {
    let identity = std::fs::metadata(binary).ok().map(|m| {
        use std::os::unix::fs::MetadataExt;
        format!(
            "{} {} {}",
            binary.display(),
            m.len(),
            m.mtime_nsec() + m.mtime() * 1_000_000_000
        )
    });
    if let (Some(id), Ok(text)) = (&identity, std::fs::read_to_string(cache)) {
        if let Some((answer, seen)) = text.trim_end().split_once(' ') {
            if seen == id {
                return answer.to_string();
            }
        }
    }
    let answer = ask(binary);
    if let Some(id) = identity {
        // Written whole, then renamed: a reader sees the old answer or the new.
        let tmp = cache.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, format!("{answer} {id}\n")).is_ok() {
            let _ = std::fs::rename(&tmp, cache);
        }
    }
    answer
}

/// What `binary args` prints, stdout and stderr (runsc prints help to
/// either, depending on the release).
fn help_of(binary: &Path, args: &[&str]) -> String {
    Command::new(binary)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map(|o| [o.stdout, o.stderr].concat())
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// The names in `table` that a runsc help text lists as flags (a line
/// `  -name …`).
fn listed<'a>(table: &[(&'a str, &str)], help: &str) -> Vec<&'a str> {
    table
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| {
            help.lines().any(|l| {
                let l = l.trim_start().trim_start_matches('-');
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '=', '\t']))
            })
        })
        .collect()
}

/// Whether the flag names [`checkpoint_flag_names`] found allow a
/// checkpoint that leaves the sandbox running ([`Runsc::leave_running`]).
fn leaves_running(names: &str) -> bool {
    let has = |flag: &str| names.split(',').any(|n| n == flag);
    has("leave-running") && has("compression")
}

/// The names of the [`CHECKPOINT_FLAGS`] that `runsc checkpoint --help`
/// lists, and `leave-running` if it does, joined by commas (`-` for none).
fn checkpoint_flag_names(binary: &Path) -> String {
    let asked: Vec<(&str, &str)> = CHECKPOINT_FLAGS
        .into_iter()
        .chain([("leave-running", "--leave-running")])
        .collect();
    let names = listed(&asked, &help_of(binary, &["checkpoint", "--help"]));
    if names.is_empty() {
        "-".into()
    } else {
        names.join(",")
    }
}

/// The flags of `table` whose names are in `names` (comma-separated).
fn flags_in(table: &[(&str, &'static str)], names: &str) -> Vec<&'static str> {
    table
        .iter()
        .filter(|(name, _)| names.split(',').any(|n| n == *name))
        .map(|(_, flag)| *flag)
        .collect()
}

fn platform_in(flags: &str) -> &'static str {
    let mut lines = flags.lines();
    while let Some(line) = lines.next() {
        if line.trim_start().starts_with("-platform ") {
            if lines.next().is_some_and(|d| d.contains("systrap")) {
                return "systrap";
            }
            break;
        }
    }
    "ptrace"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn systrap_is_chosen_only_where_runsc_lists_it() {
        let old = "  -pidfile string\n  -platform string\n    \tspecifies which platform to use: ptrace (default), kvm. (default \"ptrace\")\n";
        let new = "  -platform string\n    \tspecifies which platform to use: systrap (default), ptrace, kvm. (default \"systrap\")\n";
        assert_eq!(platform_in(old), "ptrace");
        assert_eq!(platform_in(new), "systrap");
        assert_eq!(platform_in(""), "ptrace");
    }

    #[test]
    fn checkpoint_flags_are_used_only_where_runsc_lists_them() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let binary = dir.path().join("runsc");
        let help = |text: &str| {
            std::fs::write(&binary, format!("#!/bin/sh\nprintf '{text}'\n")).unwrap();
            std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755)).unwrap();
            flags_in(&CHECKPOINT_FLAGS, &checkpoint_flag_names(&binary))
        };
        // This host's runsc (2022).
        let old = "checkpoint [flags] <container id>\\n  -image-path string\\n  -leave-running\\n";
        assert!(help(old).is_empty());
        assert!(
            !leaves_running(&checkpoint_flag_names(&binary)),
            "the 2022 runsc's -leave-running hangs"
        );
        let new = "  -compression value\\n    \\tcompression: none|flate-best-speed\\n  -direct\\n  -exclude-committed-zero-pages\\n  -leave-running\\n";
        assert_eq!(help(new), ["--compression=none", "--exclude-committed-zero-pages"]);
        assert!(leaves_running(&checkpoint_flag_names(&binary)));
        // A flag whose name only starts like one of them is not it.
        assert!(help("  -compression-level int\\n").is_empty());
    }

    #[test]
    fn the_platform_and_global_flags_are_asked_once_per_runsc_binary() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let binary = dir.path().join("runsc");
        let cache = dir.path().join("runsc-global-flags");
        let script = |text: &str| {
            std::fs::write(&binary, format!("#!/bin/sh\nprintf '{text}'\n")).unwrap();
            std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755)).unwrap();
        };
        // Debian 13's runsc (2024): systrap, and an overlay2 flag whose
        // default would keep the sandbox's writes inside the sentry.
        script("  -overlay2 value\\n    \\twrap mounts with overlayfs. (default root:self)\\n  -platform string\\n    \\tuse: systrap (default), ptrace, kvm\\n");
        assert_eq!(cached_global(&binary, &cache), ("systrap", vec!["--overlay2=none"]));
        // Not asked again: a binary that can no longer answer still gets the
        // remembered answer.
        std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(cached_global(&binary, &cache), ("systrap", vec!["--overlay2=none"]));
        // Another binary at that path is asked again; one without the flag
        // does not get it.
        script("  -platform string\\n    \\tuse: ptrace (default), kvm, and more\\n");
        assert_eq!(cached_global(&binary, &cache), ("ptrace", vec![]));
        // One that cannot answer gets ptrace and no flags.
        std::fs::write(&binary, "#!/bin/sh\nexit 1\n").unwrap();
        assert_eq!(cached_global(&binary, &cache), ("ptrace", vec![]));
    }
}
