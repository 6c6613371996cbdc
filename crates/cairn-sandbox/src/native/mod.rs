//! The native driver: our own runtime on Linux namespaces, cgroups,
//! seccomp and overlayfs.
//!
//! Starting a sandbox forks twice. The first child joins the sandbox's
//! cgroups and unshares the mount, pid, network, ipc, uts and cgroup
//! namespaces; its child is PID 1 of the new pid namespace, sets up the root
//! ([`setup`]) and executes `cairn-init`. The first child exits at once, so
//! init is re-parented away from the caller: the sandbox outlives the CLI.
//! The overlay and every other mount live only in the sandbox's mount
//! namespace and vanish with its last process; nothing is mounted on the
//! host.

mod caps;
pub mod seccomp;
mod setup;

use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;

use nix::sched::{unshare, CloneFlags};
use nix::sys::wait::waitpid;
use nix::unistd::{fork, pipe2, ForkResult};

use crate::cgroup::Hierarchy;
use crate::{pid_start_time, Capabilities, Driver, SandboxError, SandboxProcess, SandboxSpec};

/// The overlay mount options for `spec`'s root (shared with the gVisor
/// driver, which mounts the same root).
pub(crate) fn overlay_options(spec: &SandboxSpec) -> Result<String, String> {
    setup::Plan::overlay_options(spec)
}

pub struct NativeDriver {
    cgroups: Hierarchy,
    seccomp: Vec<seccompiler::BpfProgram>,
}

impl NativeDriver {
    pub fn new() -> Result<NativeDriver, SandboxError> {
        let cgroups = Hierarchy::detect()?;
        let seccomp =
            seccomp::filters().map_err(|e| SandboxError::Start(format!("seccomp filter: {e}")))?;
        Ok(NativeDriver { cgroups, seccomp })
    }

    pub fn cgroups(&self) -> &Hierarchy {
        &self.cgroups
    }

    fn launch(&self, spec: &SandboxSpec) -> Result<SandboxProcess, SandboxError> {
        let socket = spec.socket_path();
        if socket.as_os_str().len() >= 100 {
            return Err(SandboxError::SocketPathTooLong(spec.dir.clone()));
        }
        for sub in ["upper", "work", "rootfs"] {
            let d = spec.dir.join(sub);
            fs::create_dir_all(&d)
                .map_err(|e| SandboxError::setup(format!("create {}", d.display()), e))?;
        }
        let overlay_options = setup::Plan::overlay_options(spec).map_err(SandboxError::Start)?;
        let _ = fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket)
            .map_err(|e| SandboxError::setup(format!("listen on {}", socket.display()), e))?;
        let console = OpenOptions::new()
            .create(true)
            .append(true)
            .open(spec.console_log())
            .map_err(|e| SandboxError::setup("open the console log", e))?;
        let init = File::open(&spec.init_binary)
            .map_err(|e| SandboxError::setup(format!("open {}", spec.init_binary.display()), e))?;
        let procs: Vec<File> = self
            .cgroups
            .cgroup(&spec.id)
            .procs_files()
            .iter()
            .map(|p| {
                OpenOptions::new()
                    .write(true)
                    .open(p)
                    .map_err(|e| SandboxError::setup(format!("open {}", p.display()), e))
            })
            .collect::<Result<_, _>>()?;
        let plan = setup::Plan {
            rootfs: spec.dir.join("rootfs"),
            overlay_options,
            hostname: spec.hostname.clone(),
            seccomp: self.seccomp.clone(),
            init_fd: init.as_raw_fd(),
            listen_fd: listener.as_raw_fd(),
            console_fd: console.as_raw_fd(),
            argv: vec![CString::from(c"cairn-init")],
            envp: vec![CString::from(
                c"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )],
        };
        let (report_r, report_w) = pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| SandboxError::setup("create a pipe", e))?;

        // SAFETY: the child only performs system calls and small allocations
        // (glibc's fork keeps malloc usable) before it execs or exits; it
        // never returns into the caller's code.
        match unsafe { fork() }.map_err(|e| SandboxError::setup("fork", e))? {
            ForkResult::Child => {
                drop(report_r);
                let code = intermediate(&plan, &procs, report_w);
                // SAFETY: _exit skips atexit handlers and destructors that
                // belong to the parent's copy of this process.
                unsafe { libc::_exit(code) }
            }
            ForkResult::Parent { child } => {
                drop(report_w);
                drop(listener);
                let _ = waitpid(child, None);
                let mut report = String::new();
                File::from(report_r)
                    .read_to_string(&mut report)
                    .map_err(|e| SandboxError::setup("read the start report", e))?;
                parse_report(&report)
            }
        }
    }
}

/// The first child: join the cgroups, unshare, fork PID 1, report its pid.
fn intermediate(plan: &setup::Plan, procs: &[File], report: OwnedFd) -> i32 {
    let mut report = File::from(report);
    let fail = |report: &mut File, msg: String| {
        let _ = report.write_all(format!("E{msg}").as_bytes());
        1
    };
    for mut f in procs {
        if let Err(e) = f.write_all(b"0") {
            return fail(&mut report, format!("join the sandbox cgroup: {e}"));
        }
    }
    let flags = CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWNET
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWCGROUP;
    if let Err(e) = unshare(flags) {
        return fail(&mut report, format!("create namespaces: {e}"));
    }
    // SAFETY: as for the first fork; the grandchild execs or _exits.
    match unsafe { fork() } {
        Err(e) => fail(&mut report, format!("fork PID 1: {e}")),
        Ok(ForkResult::Child) => {
            let msg = setup::setup_and_exec(plan);
            let _ = report.write_all(format!("E{msg}").as_bytes());
            // SAFETY: see above.
            unsafe { libc::_exit(1) }
        }
        Ok(ForkResult::Parent { child }) => {
            let _ = report.write_all(format!("P{}\n", child.as_raw()).as_bytes());
            0
        }
    }
}

/// The report is `P<pid>\n` from the first child, followed by `E<message>`
/// if PID 1 failed before executing init. End of file after the pid means
/// init is running (the pipe is close-on-exec).
fn parse_report(report: &str) -> Result<SandboxProcess, SandboxError> {
    let (pid_line, rest) = report.split_once('\n').unwrap_or((report, ""));
    if let Some(err) = pid_line.strip_prefix('E') {
        return Err(SandboxError::Start(err.to_string()));
    }
    let pid: i32 = pid_line
        .strip_prefix('P')
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| SandboxError::Start(format!("garbled start report {report:?}")))?;
    if let Some(err) = rest.strip_prefix('E') {
        return Err(SandboxError::Start(err.to_string()));
    }
    let start_time = pid_start_time(pid)
        .ok_or_else(|| SandboxError::Start("cairn-init exited right after starting".into()))?;
    Ok(SandboxProcess { pid, start_time })
}

impl Driver for NativeDriver {
    fn name(&self) -> &'static str {
        "native"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            memory_snapshots: false,
        }
    }

    fn start(&self, spec: &SandboxSpec) -> Result<SandboxProcess, SandboxError> {
        self.cgroups.create(&spec.id, &spec.limits)?;
        self.launch(spec).inspect_err(|_| {
            let _ = self.stop(&spec.id, None);
        })
    }

    fn stop(&self, id: &str, process: Option<SandboxProcess>) -> Result<(), SandboxError> {
        let cgroup = self.cgroups.cgroup(id);
        // Killing PID 1 takes the whole pid namespace with it; the cgroup
        // sweep catches anything that escaped the namespace.
        if let Some(p) = process.filter(|p| p.alive()) {
            let _ = cgroup.thaw();
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(p.pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        cgroup.kill_all()?;
        cgroup.remove()?;
        Ok(())
    }

    fn oom_kills(&self, id: &str) -> u64 {
        self.cgroups.cgroup(id).oom_kills()
    }

    fn leftovers(&self) -> Vec<String> {
        self.cgroups.sandbox_ids()
    }
}
