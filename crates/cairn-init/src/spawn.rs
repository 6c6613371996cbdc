//! Starting processes: `clone(CLONE_VM | CLONE_VFORK)` and exec, as glibc's
//! `posix_spawn` does, with only the signals init changed reset in the
//! child (see [`start`]) and the umask set to [`COMMAND_UMASK`].

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Every command's umask.
const COMMAND_UMASK: libc::mode_t = 0o022;

/// What the child's stdio is.
pub enum Stdio {
    /// Pipes back to init (foreground exec); stdin piped only when asked.
    Piped { stdin: bool },
    /// stdin from /dev/null, stdout and stderr to init's own (the console
    /// log): background processes.
    Console,
    /// The terminal side of a pseudo-terminal on 0, 1 and 2, as the
    /// controlling terminal of a new session the child leads.
    Terminal(RawFd),
}

pub struct Child {
    pub pid: i32,
    pub stdin: Option<File>,
    pub stdout: Option<File>,
    pub stderr: Option<File>,
}

fn cstring(s: impl AsRef<[u8]>) -> io::Result<CString> {
    CString::new(s.as_ref().to_vec()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL byte in argument"))
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    Ok(nix::unistd::pipe2(OFlag::O_CLOEXEC)?)
}

/// Finds `program` on `path` the way a shell does.
fn resolve(program: &str, path: &str) -> io::Result<PathBuf> {
    if program.contains('/') {
        return Ok(PathBuf::from(program));
    }
    let mut denied = false;
    for dir in path.split(':').filter(|d| !d.is_empty()) {
        let candidate = Path::new(dir).join(program);
        let Ok(md) = candidate.metadata() else { continue };
        if md.is_file() {
            if nix::unistd::access(&candidate, nix::unistd::AccessFlags::X_OK).is_ok() {
                return Ok(candidate);
            }
            denied = true;
        }
    }
    Err(if denied {
        io::ErrorKind::PermissionDenied.into()
    } else {
        io::ErrorKind::NotFound.into()
    })
}

/// Starts `argv` in its own process group with `env` on top of the default
/// environment, in `cwd`, as `user` (else as the sandbox's root).
pub fn spawn(
    argv: &[String],
    env: &[(String, String)],
    cwd: &str,
    user: Option<cairn_protocol::Ids>,
    stdio: Stdio,
) -> io::Result<Child> {
    let mut vars: Vec<(String, String)> = vec![
        ("PATH".into(), DEFAULT_PATH.into()),
        ("HOME".into(), "/root".into()),
        ("TERM".into(), "xterm".into()),
    ];
    for (k, v) in env {
        vars.retain(|(key, _)| key != k);
        vars.push((k.clone(), v.clone()));
    }
    let path = vars
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_str())
        .unwrap_or(DEFAULT_PATH);
    let program = cstring(resolve(&argv[0], path)?.as_os_str().as_bytes())?;
    let argv_c: Vec<CString> = argv.iter().map(cstring).collect::<io::Result<_>>()?;
    let env_c: Vec<CString> = vars
        .iter()
        .map(|(k, v)| cstring(format!("{k}={v}")))
        .collect::<io::Result<_>>()?;
    let mut argv_p: Vec<*mut libc::c_char> = argv_c.iter().map(|c| c.as_ptr() as *mut _).collect();
    argv_p.push(std::ptr::null_mut());
    let mut env_p: Vec<*mut libc::c_char> = env_c.iter().map(|c| c.as_ptr() as *mut _).collect();
    env_p.push(std::ptr::null_mut());
    let cwd_c = cstring(cwd)?;

    let mut ours = (None, None, None);
    // Kept open until the child has exec'd: its stdio is dup'd from these.
    let mut child_ends: Vec<OwnedFd> = Vec::new();
    let mut plan = ChildPlan {
        program: program.as_ptr(),
        argv: argv_p.as_ptr(),
        envp: env_p.as_ptr(),
        cwd: cwd_c.as_ptr(),
        dups: [-1; 3],
        terminal: false,
        reset_signals: reset_signals(),
        user: user.map(|ids| (ids.uid, ids.gid)),
        error: 0,
    };
    match stdio {
        Stdio::Piped { stdin } => {
            if stdin {
                let (r, w) = pipe()?;
                plan.dups[0] = r.as_raw_fd();
                child_ends.push(r);
                ours.0 = Some(File::from(w));
            } else {
                plan.dups[0] = dev_null()?;
            }
            let (r, w) = pipe()?;
            plan.dups[1] = w.as_raw_fd();
            child_ends.push(w);
            ours.1 = Some(File::from(r));
            let (r, w) = pipe()?;
            plan.dups[2] = w.as_raw_fd();
            child_ends.push(w);
            ours.2 = Some(File::from(r));
        }
        Stdio::Console => plan.dups[0] = dev_null()?,
        Stdio::Terminal(fd) => {
            plan.dups = [fd; 3];
            plan.terminal = true;
        }
    }
    let pid = start(&mut plan)?;
    drop(child_ends);
    Ok(Child {
        pid,
        stdin: ours.0,
        stdout: ours.1,
        stderr: ours.2,
    })
}

/// A new pseudo-terminal of `size`: its controlling side (non-blocking,
/// for init) and its terminal side (for [`Stdio::Terminal`]), both
/// close-on-exec from the start, so no other command inherits either.
pub fn open_terminal(size: cairn_protocol::PtySize) -> io::Result<(File, OwnedFd)> {
    // SAFETY: plain system calls on descriptors this function owns; the
    // name buffer is local and its length is passed.
    unsafe {
        let master = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC | libc::O_NONBLOCK);
        if master < 0 {
            return Err(io::Error::last_os_error());
        }
        let master = OwnedFd::from_raw_fd(master);
        if libc::grantpt(master.as_raw_fd()) != 0 || libc::unlockpt(master.as_raw_fd()) != 0 {
            return Err(io::Error::last_os_error());
        }
        let mut name = [0 as libc::c_char; 128];
        let rc = libc::ptsname_r(master.as_raw_fd(), name.as_mut_ptr(), name.len());
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        let terminal = libc::open(name.as_ptr(), libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC);
        if terminal < 0 {
            return Err(io::Error::last_os_error());
        }
        let terminal = OwnedFd::from_raw_fd(terminal);
        resize_terminal(master.as_raw_fd(), size)?;
        Ok((File::from(master), terminal))
    }
}

/// Sets the size of the terminal whose controlling side is `master`; the
/// kernel sends SIGWINCH to its foreground process group.
pub fn resize_terminal(master: RawFd, size: cairn_protocol::PtySize) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: size.rows,
        ws_col: size.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize from the pointer, which is valid.
    if unsafe { libc::ioctl(master, libc::TIOCSWINSZ, &ws) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `--time-spawn N COMMAND...`: starts COMMAND N times as a foreground
/// exec starts it ([`spawn`] with piped output, the default environment,
/// in `/`), waits for each, and prints each start-to-reaped time in
/// milliseconds, one a line, to `out`: what the process costs without the
/// protocol, the serving loop and the reaper. Its output is not read, so
/// the command must write less than a pipe holds. Returns the exit code for
/// the caller.
pub fn time(args: &[String], out: &mut impl std::io::Write) -> i32 {
    let (Some(Ok(n)), Some(_)) = (args.first().map(|a| a.parse::<u32>()), args.get(1)) else {
        eprintln!("usage: cairn-init --time-spawn N COMMAND [ARG...]");
        return 2;
    };
    let argv = &args[1..];
    for _ in 0..n {
        let t0 = std::time::Instant::now();
        let child = match spawn(argv, &[], "/", None, Stdio::Piped { stdin: false }) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("cairn-init --time-spawn: {}: cannot start: {e}", argv[0]);
                return 1;
            }
        };
        let status = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(child.pid), None);
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        if !matches!(status, Ok(nix::sys::wait::WaitStatus::Exited(_, 0))) {
            eprintln!("cairn-init --time-spawn: {} did not exit 0: {status:?}", argv[0]);
            return 1;
        }
        if writeln!(out, "{ms:.4}").is_err() {
            return 1;
        }
    }
    0
}

/// `/dev/null`, opened once (close-on-exec) and dup'd as the stdin of
/// every command that gets none.
fn dev_null() -> io::Result<RawFd> {
    static NULL: std::sync::OnceLock<OwnedFd> = std::sync::OnceLock::new();
    if NULL.get().is_none() {
        let fd = nix::fcntl::open(
            "/dev/null",
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )?;
        // SAFETY: `open` just returned this descriptor; nothing else owns it.
        let _ = NULL.set(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    NULL.get()
        .map(AsRawFd::as_raw_fd)
        .ok_or_else(|| io::ErrorKind::NotFound.into())
}

/// Everything the child needs, prepared by the parent: between clone and
/// exec the child shares init's memory and only reads this (and writes
/// `error`), making raw system calls and nothing else.
#[repr(C)]
struct ChildPlan {
    program: *const libc::c_char,
    argv: *const *mut libc::c_char,
    envp: *const *mut libc::c_char,
    cwd: *const libc::c_char,
    /// The fd to put on 0, 1 and 2 (-1: leave as is).
    dups: [RawFd; 3],
    /// Lead a new session whose controlling terminal is fd 0 (instead of
    /// a new process group in init's session).
    terminal: bool,
    /// See [`reset_signals`].
    reset_signals: &'static [libc::c_int],
    /// The uid and gid to run as (else init's own).
    user: Option<(libc::uid_t, libc::gid_t)>,
    /// Set by the child when it could not exec: the errno.
    error: libc::c_int,
}

/// The signals the child sets back to their default action before it runs
/// anything: every one that is not at its default in init when it first
/// spawns (it ignores SIGPIPE, std handles SIGSEGV and SIGBUS, and whatever
/// init inherited ignored, such as glibc's own 32 and 33 from a parent
/// started by `posix_spawn`), and glibc's 32 and 33 always, whose handlers
/// glibc installs lazily. An ignored signal would stay ignored across exec,
/// and a handler must not run in a child that shares init's memory. Init
/// installs no handler of its own later (its threads take SIGCHLD and
/// SIGUSR2 by sigwait), so the list holds; glibc's `posix_spawn` instead
/// asks about all 64 signals in every child, two system calls each.
/// Found once, by asking the kernel (62 system calls); PID 1 asks while it
/// waits for its setup, so that the sandbox's first command does not wait.
pub(crate) fn reset_signals() -> &'static [libc::c_int] {
    static RESET: std::sync::OnceLock<Vec<libc::c_int>> = std::sync::OnceLock::new();
    RESET.get_or_init(|| {
        (1..=64)
            .filter(|&sig| sig != libc::SIGKILL && sig != libc::SIGSTOP)
            .filter(|&sig| {
                let mut old = KernelSigaction::default();
                // SAFETY: a query only: no new action, `old` is writable.
                let rc = unsafe { rt_sigaction(sig, std::ptr::null(), &mut old) };
                sig == 32 || sig == 33 || (rc == 0 && old.handler != libc::SIG_DFL)
            })
            .collect()
    })
}

/// The kernel's `struct sigaction`, whose handler comes first on every
/// architecture; all zeroes is SIG_DFL with no flags and an empty mask.
#[derive(Default)]
#[repr(C)]
struct KernelSigaction {
    handler: libc::sighandler_t,
    rest: [u64; 3],
}

/// `rt_sigaction` itself: glibc's wrapper refuses its internal signals 32
/// and 33, which the child must reset too.
///
/// # Safety
/// `new` is null or valid to read, `old` null or valid to write.
unsafe fn rt_sigaction(sig: libc::c_int, new: *const KernelSigaction, old: *mut KernelSigaction) -> libc::c_long {
    // SAFETY: the caller's pointers; the size is the kernel's sigset_t.
    unsafe { libc::syscall(libc::SYS_rt_sigaction, sig, new, old, 8usize) }
}

/// Init's own `oom_score_adj`, opened by PID 1 of a native sandbox while it
/// is still host root ([`protect_from_oom_killer`]): once in the sandbox's
/// user namespace it could not open the file again (a non-dumpable
/// process's /proc files belong to the host's root).
struct OomScores {
    file: OwnedFd,
    /// Init's score between spawns.
    init: &'static [u8],
    /// The score each command starts with.
    command: &'static [u8],
}

static OOM_SCORES: std::sync::OnceLock<OomScores> = std::sync::OnceLock::new();

/// Serialises [`start`]s while init's score is the command's.
static SCORING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Makes this process (PID 1, still host root) the OOM killer's last pick
/// in its sandbox. Where Cairn holds `CAP_SYS_RESOURCE` (a root service),
/// init's `oom_score_adj` is -1000, which the OOM killer never picks, and
/// commands start at the usual 0. Where it does not (a container that
/// dropped it), init cannot go below the score it inherited; commands then
/// start at 1000, so any of them goes before init. A child inherits its
/// parent's score, so each command is cloned while init holds the
/// command's score, and init takes its own back once the command has
/// exec'd ([`start`]). The kernel lets a process go back down to the
/// lowest score of its ancestry, so a command may lower its own score to
/// init's: it then shields itself at its sandbox's other processes' cost
/// (and may make init the largest at that score); the memory limit holds
/// either way.
pub(crate) fn protect_from_oom_killer() -> io::Result<()> {
    let fd = nix::fcntl::open(
        "/proc/self/oom_score_adj",
        OFlag::O_WRONLY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )?;
    // SAFETY: `open` just returned this descriptor; nothing else owns it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // Above the descriptors init moves into place (0-3) as it builds the
    // sandbox, which would otherwise close it.
    let high = nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(64))?;
    // SAFETY: `fcntl` just returned this descriptor; nothing else owns it.
    let file = unsafe { OwnedFd::from_raw_fd(high) };
    drop(fd);
    let scores = match set_oom_score_adj(&file, b"-1000") {
        Ok(()) => OomScores {
            file,
            init: b"-1000",
            command: b"0",
        },
        // No CAP_SYS_RESOURCE: init keeps the score it inherited.
        Err(e) if e.raw_os_error() == Some(libc::EACCES) => {
            let inherited = std::fs::read_to_string("/proc/self/oom_score_adj")?;
            let init: &'static str = Box::leak(inherited.trim().to_string().into_boxed_str());
            OomScores {
                file,
                init: init.as_bytes(),
                command: b"1000",
            }
        }
        Err(e) => return Err(e),
    };
    let _ = OOM_SCORES.set(scores);
    Ok(())
}

fn set_oom_score_adj(fd: &OwnedFd, value: &[u8]) -> io::Result<()> {
    nix::sys::uio::pwrite(fd, value, 0)?;
    Ok(())
}

/// The child's stack: it runs a few system calls, then exec. The kernel
/// stops using it at exec, and `CLONE_VFORK` holds the parent until then.
const CHILD_STACK: usize = 32 << 10;

/// Starts the child with `clone(CLONE_VM | CLONE_VFORK)`, as glibc's
/// `posix_spawn` does (no copy of init's page tables, so an exec costs the
/// same however much init has mapped), but resetting only
/// [`reset_signals`]. Returns its pid once it has exec'd; an exec that
/// failed is reaped here and returned as its errno.
fn start(plan: &mut ChildPlan) -> io::Result<i32> {
    // The child inherits init's OOM score: the command's for the clone,
    // init's own again once it exec'd (a few hundred microseconds).
    let _scoring = OOM_SCORES.get().map(|scores| {
        let held = SCORING.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = set_oom_score_adj(&scores.file, scores.command) {
            eprintln!("cairn-init: cannot give a command its OOM score: {e}");
        }
        (held, ProtectAgain(scores))
    });
    // Memory only, never read as a Vec: no need to zero it.
    let mut stack: Vec<u8> = Vec::with_capacity(CHILD_STACK);
    // SAFETY: one past the end of the allocation, which the stack grows
    // down from; 16-byte aligned below as the ABI wants. It outlives the
    // child's use of it (the parent waits in clone).
    let top = unsafe { stack.as_mut_ptr().add(CHILD_STACK) };
    let top = (top as usize & !15) as *mut libc::c_void;
    // Every signal is blocked across the clone, so no handler can run in the
    // child while it shares init's memory; it unblocks them once the
    // handled ones are back to their defaults.
    // SAFETY: sigfillset and pthread_sigmask on local, valid sigset_t values.
    let old = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        old
    };
    // SAFETY: `child` only makes async-signal-safe system calls on what
    // `plan` points to, which outlives the call: CLONE_VFORK suspends this
    // thread until the child exec'd or exited, so nothing it reads changes
    // and its write to `plan.error` is seen once clone returns.
    let pid = unsafe {
        libc::clone(
            child,
            top,
            libc::CLONE_VM | libc::CLONE_VFORK | libc::SIGCHLD,
            plan as *mut ChildPlan as *mut libc::c_void,
        )
    };
    let cloned = io::Error::last_os_error();
    // SAFETY: restores this thread's own mask saved above.
    unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    drop(stack);
    if pid < 0 {
        return Err(cloned);
    }
    // SAFETY: volatile read of a field the child wrote before this thread resumed.
    let error = unsafe { std::ptr::read_volatile(&plan.error) };
    if error != 0 {
        // The child exited without exec; the reaper cannot take it first, as
        // every spawn runs under the reaper's lock.
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
        return Err(io::Error::from_raw_os_error(error));
    }
    Ok(pid)
}

/// Sets init's `oom_score_adj` back to its own when dropped.
struct ProtectAgain(&'static OomScores);

impl Drop for ProtectAgain {
    fn drop(&mut self) {
        if let Err(e) = set_oom_score_adj(&self.0.file, self.0.init) {
            eprintln!("cairn-init: cannot protect init from the OOM killer again: {e}");
        }
    }
}

/// The child between clone and exec.
extern "C" fn child(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the parent's ChildPlan, alive and unchanged while the
    // parent is suspended (CLONE_VFORK). Only raw system calls follow: no
    // allocation, no lock, nothing a suspended parent thread could hold.
    unsafe {
        let plan = &mut *(arg as *mut ChildPlan);
        let fail = |plan: &mut ChildPlan| -> libc::c_int {
            std::ptr::write_volatile(&mut plan.error, *libc::__errno_location());
            libc::_exit(127)
        };
        let default = KernelSigaction::default();
        for &sig in plan.reset_signals {
            rt_sigaction(sig, &default, std::ptr::null_mut());
        }
        // Either way the child leads a process group of its own (its pid),
        // which signals and timeouts reach with killpg.
        let grouped = if plan.terminal {
            libc::setsid()
        } else {
            libc::setpgid(0, 0)
        };
        if grouped < 0 {
            return fail(plan);
        }
        for (target, &fd) in plan.dups.iter().enumerate() {
            let target = target as RawFd;
            if fd < 0 {
                continue;
            }
            // dup2 onto itself would keep close-on-exec; clear it instead.
            let rc = if fd == target {
                libc::fcntl(fd, libc::F_SETFD, 0)
            } else {
                libc::dup2(fd, target)
            };
            if rc < 0 {
                return fail(plan);
            }
        }
        if plan.terminal && libc::ioctl(0, libc::TIOCSCTTY, 0) != 0 {
            return fail(plan);
        }
        // Raw system calls: libc's wrappers would signal every thread of
        // init to change its ids too. Dropping root's uid clears the
        // capabilities; the groups go first, while the child may still.
        if let Some((uid, gid)) = plan.user {
            let groups = [gid];
            if libc::syscall(libc::SYS_setgroups, 1usize, groups.as_ptr()) != 0
                || libc::syscall(libc::SYS_setresgid, gid, gid, gid) != 0
                || libc::syscall(libc::SYS_setresuid, uid, uid, uid) != 0
            {
                return fail(plan);
            }
        }
        if libc::chdir(plan.cwd) != 0 {
            return fail(plan);
        }
        // Commands create files as on a usual host (0644, 0755), whatever
        // umask init inherited from the Cairn process that started it
        // (which keeps its own files private with 077).
        libc::umask(COMMAND_UMASK);
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        libc::execve(
            plan.program,
            plan.argv as *const *const libc::c_char,
            plan.envp as *const *const libc::c_char,
        );
        fail(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    fn wait(pid: i32) -> nix::sys::wait::WaitStatus {
        nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None).unwrap()
    }

    fn read_all(f: Option<File>) -> String {
        let mut s = String::new();
        f.unwrap().read_to_string(&mut s).unwrap();
        s
    }

    #[test]
    fn time_spawn_prints_each_start_to_reaped_time_and_refuses_what_it_cannot_time() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let mut out = Vec::new();
        assert_eq!(time(&args(&["3", "true"]), &mut out), 0);
        let times: Vec<f64> = String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        assert_eq!(times.len(), 3, "{times:?}");
        assert!(times.iter().all(|&ms| ms > 0.0), "{times:?}");
        // A command that fails or is missing gives no timing; bad arguments
        // are a usage error.
        for (argv, code) in [
            (&["3", "false"][..], 1),
            (&["3", "no-such-command-anywhere"], 1),
            (&["three", "true"], 2),
            (&["3"], 2),
        ] {
            let mut out = Vec::new();
            assert_eq!(time(&args(argv), &mut out), code, "{argv:?}");
            assert!(out.len() <= 10, "{argv:?} printed {out:?}");
        }
    }

    #[test]
    fn a_child_runs_in_its_own_group_and_directory_with_default_signals_no_mask_and_umask_022() {
        // Init ignores SIGPIPE (so does the test harness) and blocks signals
        // in its threads; none of that may reach the command.
        let mut blocked = nix::sys::signal::SigSet::empty();
        blocked.add(nix::sys::signal::Signal::SIGUSR2);
        blocked.thread_block().unwrap();
        let script =
            "pwd; grep -E '^Sig(Blk|Ign)' /proc/self/status; echo $$ $(cut -d' ' -f5 /proc/$$/stat); umask; echo oops >&2";
        let argv = ["sh".to_string(), "-c".into(), script.into()];
        let child = spawn(
            &argv,
            &[("X".into(), "1".into())],
            "/tmp",
            None,
            Stdio::Piped { stdin: false },
        )
        .unwrap();
        assert!(child.stdin.is_none());
        let out = read_all(child.stdout);
        let err = read_all(child.stderr);
        assert!(matches!(wait(child.pid), nix::sys::wait::WaitStatus::Exited(_, 0)));
        blocked.thread_unblock().unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines[0], "/tmp");
        assert_eq!(lines[1].split_whitespace().nth(1), Some("0000000000000000"), "{out}");
        assert_eq!(lines[2].split_whitespace().nth(1), Some("0000000000000000"), "{out}");
        let ids: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!(ids[0], child.pid.to_string());
        assert_eq!(ids[1], ids[0], "not the leader of its own process group");
        assert_eq!(lines[4], "0022", "the command's umask");
        assert_eq!(err, "oops\n");
    }

    #[test]
    fn a_command_has_umask_022_whatever_init_has() {
        // A umask is the whole process's: this runs in a test process of
        // its own, which takes a private one first, as init does from the
        // Cairn process that starts it.
        const INNER: &str = "CAIRN_SPAWN_TEST_INNER";
        if std::env::var_os(INNER).is_none() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "spawn::tests::a_command_has_umask_022_whatever_init_has"])
                .env(INNER, "1")
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success() && text.contains("1 passed"), "{text}");
            return;
        }
        nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
        let argv = ["sh".to_string(), "-c".into(), "umask".into()];
        let child = spawn(&argv, &[], "/", None, Stdio::Piped { stdin: false }).unwrap();
        let out = read_all(child.stdout);
        assert!(matches!(wait(child.pid), nix::sys::wait::WaitStatus::Exited(_, 0)));
        assert_eq!(out.trim(), "0022");
    }

    #[test]
    fn stdin_is_piped_when_asked_and_empty_otherwise() {
        let cat = ["cat".to_string()];
        let child = spawn(&cat, &[], "/", None, Stdio::Piped { stdin: true }).unwrap();
        let mut stdin = child.stdin.unwrap();
        stdin.write_all(b"through\n").unwrap();
        drop(stdin);
        assert_eq!(read_all(child.stdout), "through\n");
        wait(child.pid);
        let child = spawn(&cat, &[], "/", None, Stdio::Piped { stdin: false }).unwrap();
        assert_eq!(read_all(child.stdout), "");
        wait(child.pid);
    }

    #[test]
    fn a_command_that_cannot_start_is_an_error_and_leaves_no_child() {
        let missing = spawn(&["no-such-command".to_string()], &[], "/", None, Stdio::Console);
        assert_eq!(missing.err().map(|e| e.kind()), Some(io::ErrorKind::NotFound));
        // Found on the path but failing in the child (exec of a directory,
        // a missing working directory): the child is reaped here.
        for (argv, cwd) in [("/tmp", "/"), ("true", "/no/such/dir")] {
            let failed = spawn(&[argv.to_string()], &[], cwd, None, Stdio::Piped { stdin: false });
            assert!(failed.is_err(), "{argv} in {cwd} started");
        }
        let left = nix::sys::wait::waitpid(
            nix::unistd::Pid::from_raw(-1),
            Some(nix::sys::wait::WaitPidFlag::WNOHANG),
        );
        assert!(!matches!(left, Ok(nix::sys::wait::WaitStatus::Exited(..))), "{left:?}");
    }
}
