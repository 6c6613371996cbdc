//! What the sandbox's first process does before it becomes `cairn-init`:
//! mounts the overlay root with a fresh /proc, a minimal /dev and a
//! read-only /sys, pivots into it, names the host, brings up loopback,
//! drops capabilities, sets `no_new_privs`, loads the seccomp filter and
//! executes init. Runs in a freshly forked child, as PID 1 of its new pid
//! namespace; any error is reported to the host through a pipe.

use std::ffi::CString;
use std::fs;
use std::os::fd::RawFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use nix::unistd::{chdir, pivot_root, sethostname};
use seccompiler::BpfProgram;

use crate::SandboxSpec;

/// Everything the child needs, prepared by the parent before forking.
pub struct Plan {
    pub rootfs: PathBuf,
    pub overlay_options: String,
    pub hostname: String,
    pub seccomp: Vec<BpfProgram>,
    pub init_fd: RawFd,
    pub listen_fd: RawFd,
    pub console_fd: RawFd,
    pub argv: Vec<CString>,
    pub envp: Vec<CString>,
}

impl Plan {
    pub fn overlay_options(spec: &SandboxSpec) -> Result<String, String> {
        let mut lowers = Vec::with_capacity(spec.layers.len());
        for layer in &spec.layers {
            let s = layer
                .to_str()
                .ok_or_else(|| format!("layer path {} is not UTF-8", layer.display()))?;
            if s.contains([':', ',', '\\']) {
                return Err(format!(
                    "layer path {s} contains ':', ',' or '\\', which overlayfs cannot take"
                ));
            }
            lowers.push(s.to_string());
        }
        if lowers.is_empty() {
            return Err("a sandbox needs at least one image layer".into());
        }
        let dir = spec.dir.to_str().ok_or("the sandbox directory is not UTF-8")?;
        let options = format!("lowerdir={},upperdir={dir}/upper,workdir={dir}/work", lowers.join(":"));
        // The kernel takes mount options in one page.
        if options.len() >= 4000 {
            return Err(format!(
                "{} layers make overlay options longer than one page",
                lowers.len()
            ));
        }
        Ok(options)
    }
}

type Step<T> = Result<T, String>;

fn ctx<T, E: std::fmt::Display>(r: Result<T, E>, what: impl FnOnce() -> String) -> Step<T> {
    r.map_err(|e| format!("{}: {e}", what()))
}

/// Runs in the child; returns only on error (with the message to report).
pub fn setup_and_exec(plan: &Plan) -> String {
    match setup(plan) {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

enum Never {}

fn setup(plan: &Plan) -> Step<Never> {
    let root = &plan.rootfs;
    ctx(
        mount(
            None::<&str>,
            "/",
            None::<&str>,
            MsFlags::MS_REC | MsFlags::MS_PRIVATE,
            None::<&str>,
        ),
        || "make mounts private".into(),
    )?;
    ctx(
        mount(
            Some("overlay"),
            root,
            Some("overlay"),
            MsFlags::empty(),
            Some(plan.overlay_options.as_str()),
        ),
        || format!("mount the overlay root ({})", plan.overlay_options),
    )?;
    mount_proc(root)?;
    mount_dev(root)?;
    let sys = root.join("sys");
    if sys.is_dir() {
        let flags = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        ctx(mount(Some("sysfs"), &sys, Some("sysfs"), flags, None::<&str>), || {
            "mount /sys".into()
        })?;
    }
    let tmp = root.join("tmp");
    if !tmp.exists() {
        ctx(fs::create_dir(&tmp), || "create /tmp".into())?;
        ctx(fs::set_permissions(&tmp, fs::Permissions::from_mode(0o1777)), || {
            "chmod /tmp".into()
        })?;
    }

    ctx(chdir(root), || "enter the root".into())?;
    ctx(pivot_root(".", "."), || "pivot_root".into())?;
    ctx(umount2(".", MntFlags::MNT_DETACH), || "detach the host root".into())?;
    ctx(chdir("/"), || "chdir /".into())?;

    ctx(sethostname(&plan.hostname), || {
        format!("set host name {}", plan.hostname)
    })?;
    loopback_up()?;
    ctx(nix::unistd::setsid(), || "setsid".into())?;
    // Init must survive the OOM killer; the processes it starts reset this.
    let _ = fs::write("/proc/self/oom_score_adj", "-999");
    wire_fds(plan)?;

    super::caps::drop_to_safe_set()?;
    ctx(nix::sys::prctl::set_no_new_privs(), || "set no_new_privs".into())?;
    for filter in &plan.seccomp {
        ctx(seccompiler::apply_filter(filter), || "load the seccomp filter".into())?;
    }

    let mut argv: Vec<*const libc::c_char> = plan.argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = plan.envp.iter().map(|a| a.as_ptr()).collect();
    envp.push(std::ptr::null());
    // SAFETY: argv and envp are NUL-terminated arrays of pointers to live
    // CStrings; the empty path with AT_EMPTY_PATH executes `init_fd` itself.
    unsafe {
        libc::syscall(
            libc::SYS_execveat,
            plan.init_fd,
            c"".as_ptr(),
            argv.as_ptr(),
            envp.as_ptr(),
            libc::AT_EMPTY_PATH,
        );
    }
    Err(format!("execute cairn-init: {}", std::io::Error::last_os_error()))
}

fn mount_proc(root: &Path) -> Step<()> {
    let proc = root.join("proc");
    if !proc.exists() {
        ctx(fs::create_dir(&proc), || "create /proc".into())?;
    }
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    ctx(mount(Some("proc"), &proc, Some("proc"), flags, None::<&str>), || {
        "mount /proc".into()
    })?;
    // Host-wide knobs stay read-only; kernel memory and keys stay hidden.
    for sub in ["sys", "sysrq-trigger", "irq", "bus", "fs"] {
        let p = proc.join(sub);
        if p.exists() {
            ctx(
                mount(
                    Some(&p),
                    &p,
                    None::<&str>,
                    MsFlags::MS_BIND | MsFlags::MS_REC,
                    None::<&str>,
                ),
                || format!("bind /proc/{sub}"),
            )?;
            let ro = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
            ctx(mount(None::<&str>, &p, None::<&str>, ro, None::<&str>), || {
                format!("make /proc/{sub} read-only")
            })?;
        }
    }
    for sub in ["kcore", "keys", "timer_list", "sched_debug", "latency_stats"] {
        let p = proc.join(sub);
        if p.exists() {
            ctx(
                mount(Some("/dev/null"), &p, None::<&str>, MsFlags::MS_BIND, None::<&str>),
                || format!("mask /proc/{sub}"),
            )?;
        }
    }
    Ok(())
}

fn mount_dev(root: &Path) -> Step<()> {
    let dev = root.join("dev");
    if !dev.exists() {
        ctx(fs::create_dir(&dev), || "create /dev".into())?;
    }
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_STRICTATIME;
    ctx(
        mount(Some("tmpfs"), &dev, Some("tmpfs"), flags, Some("mode=755,size=65536k")),
        || "mount /dev".into(),
    )?;
    let nodes: [(&str, u64, u64); 6] = [
        ("null", 1, 3),
        ("zero", 1, 5),
        ("full", 1, 7),
        ("random", 1, 8),
        ("urandom", 1, 9),
        ("tty", 5, 0),
    ];
    for (name, major, minor) in nodes {
        let path = dev.join(name);
        ctx(
            mknod(
                &path,
                SFlag::S_IFCHR,
                Mode::from_bits_truncate(0o666),
                makedev(major, minor),
            ),
            || format!("create /dev/{name}"),
        )?;
        // mknod applies the umask.
        ctx(fs::set_permissions(&path, fs::Permissions::from_mode(0o666)), || {
            format!("chmod /dev/{name}")
        })?;
    }
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        ctx(std::os::unix::fs::symlink(target, dev.join(link)), || {
            format!("link /dev/{link}")
        })?;
    }
    let pts = dev.join("pts");
    ctx(fs::create_dir(&pts), || "create /dev/pts".into())?;
    ctx(
        mount(
            Some("devpts"),
            &pts,
            Some("devpts"),
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
            Some("newinstance,ptmxmode=0666,mode=0620"),
        ),
        || "mount /dev/pts".into(),
    )?;
    let shm = dev.join("shm");
    ctx(fs::create_dir(&shm), || "create /dev/shm".into())?;
    ctx(
        mount(
            Some("shm"),
            &shm,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            Some("mode=1777,size=65536k"),
        ),
        || "mount /dev/shm".into(),
    )?;
    Ok(())
}

/// A new network namespace starts with `lo` down.
fn loopback_up() -> Step<()> {
    // SAFETY: plain socket/ioctl calls on a zeroed, correctly sized ifreq
    // whose name is NUL-terminated; the socket is closed before returning.
    unsafe {
        let sock = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if sock < 0 {
            return Err(format!(
                "bring up loopback: socket: {}",
                std::io::Error::last_os_error()
            ));
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        for (i, b) in b"lo\0".iter().enumerate() {
            req.ifr_name[i] = *b as libc::c_char;
        }
        let mut rc = libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut req);
        if rc == 0 {
            req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
            rc = libc::ioctl(sock, libc::SIOCSIFFLAGS, &req);
        }
        let err = std::io::Error::last_os_error();
        libc::close(sock);
        if rc != 0 {
            return Err(format!("bring up loopback: {err}"));
        }
    }
    Ok(())
}

/// stdin from /dev/null, stdout and stderr to the console log, the
/// listening socket on fd 3. Sources move above the targets first so no
/// dup2 overwrites a source that is still needed.
fn wire_fds(plan: &Plan) -> Step<()> {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag, OFlag};
    let null = ctx(nix::fcntl::open("/dev/null", OFlag::O_RDWR, Mode::empty()), || {
        "open /dev/null".into()
    })?;
    let high = |fd: RawFd| ctx(fcntl(fd, FcntlArg::F_DUPFD_CLOEXEC(64)), || "duplicate fds".into());
    let (null, console, listen) = (high(null)?, high(plan.console_fd)?, high(plan.listen_fd)?);
    for (src, dst) in [
        (null, 0),
        (console, 1),
        (console, 2),
        (listen, cairn_protocol::LISTEN_FD),
    ] {
        ctx(nix::unistd::dup2(src, dst), || format!("wire fd {dst}"))?;
        ctx(fcntl(dst, FcntlArg::F_SETFD(FdFlag::empty())), || {
            format!("wire fd {dst}")
        })?;
    }
    Ok(())
}
