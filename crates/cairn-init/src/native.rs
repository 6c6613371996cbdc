//! `cairn-init --native-setup`: building a native sandbox around init.
//!
//! The host spawns init (cheaply: vfork and exec of a small static binary)
//! with a [`NativeSetup`]. Init joins the sandbox's cgroups, unshares the
//! mount, pid, network, ipc, uts and cgroup namespaces and forks; the parent
//! reports the child's pid to the host and exits, so the child, PID 1 of the
//! new pid namespace, is re-parented away from the host process and
//! outlives it. The child mounts the overlay root with a fresh /proc, a
//! minimal /dev and a read-only /sys, pivots into it, names the host, brings
//! up loopback, drops capabilities, sets `no_new_privs`, installs the
//! seccomp filters and goes on to serve.
//!
//! fd 1 is a socket to the host. The host sends the [`NativeSetup`] as one
//! frame (so nothing of it shows on init's command line); init answers with
//! `P<pid>\n` from the parent and `R\n` from PID 1 once it is ready (in
//! either order), or `E<message>` on failure.

use std::fs;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use cairn_protocol::{NativeSetup, LISTEN_FD};
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::stat::{makedev, mknod, Mode, SFlag};
use nix::unistd::{chdir, fork, pivot_root, sethostname, ForkResult};

/// Builds the sandbox. Returns (in PID 1 only) the listening socket's fd;
/// the setup parent and any failure end the process here.
pub fn build() -> RawFd {
    // SAFETY: fd 1 is the socket the host gave us; we own it until PID 1
    // replaces it with the console.
    let mut report = std::mem::ManuallyDrop::new(unsafe { std::os::unix::net::UnixStream::from_raw_fd(1) });
    let fail = |report: &mut std::os::unix::net::UnixStream, msg: String| -> ! {
        let _ = report.write_all(format!("E{msg}").as_bytes());
        std::process::exit(1)
    };
    // Whatever the host process leaked to us beyond stdio stays outside.
    // SAFETY: close_range takes plain integers; fds 0-2 are kept.
    unsafe {
        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
    }
    let setup: NativeSetup = match cairn_protocol::read_frame(&mut *report) {
        Ok(s) => s,
        Err(e) => fail(&mut report, format!("read the sandbox setup: {e}")),
    };
    if setup.version != cairn_protocol::PROTOCOL_VERSION {
        fail(
            &mut report,
            format!("setup version {} from a different Cairn build", setup.version),
        );
    }
    let setup = &setup;
    for procs in &setup.cgroup_procs {
        if let Err(e) = fs::write(procs, "0") {
            fail(&mut report, format!("join the sandbox cgroup {procs}: {e}"));
        }
    }
    let flags = CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWNET
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWCGROUP;
    if let Err(e) = unshare(flags) {
        fail(&mut report, format!("create namespaces: {e}"));
    }
    // SAFETY: this process is single-threaded (setup runs before any thread
    // starts), so the child may do anything the parent could.
    match unsafe { fork() } {
        Err(e) => fail(&mut report, format!("fork PID 1: {e}")),
        Ok(ForkResult::Parent { child }) => {
            let _ = report.write_all(format!("P{}\n", child.as_raw()).as_bytes());
            std::process::exit(0)
        }
        Ok(ForkResult::Child) => {}
    }
    if let Err(e) = setup_root(setup) {
        fail(&mut report, e);
    }
    if let Err(e) = report.write_all(b"R\n") {
        fail(&mut report, format!("report readiness: {e}"));
    }
    // stdout joins stderr on the console log; the report pipe closes.
    if let Err(e) = nix::unistd::dup2(2, 1) {
        fail(&mut report, format!("wire stdout: {e}"));
    }
    LISTEN_FD
}

type Step<T> = Result<T, String>;

fn ctx<T, E: std::fmt::Display>(r: Result<T, E>, what: impl FnOnce() -> String) -> Step<T> {
    r.map_err(|e| format!("{}: {e}", what()))
}

fn setup_root(plan: &NativeSetup) -> Step<()> {
    let root = Path::new(&plan.rootfs);
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
    mount_overlay(plan, root)?;
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
    wire_fds()?;
    drop_capabilities(plan.keep_capabilities)?;
    ctx(nix::sys::prctl::set_no_new_privs(), || "set no_new_privs".into())?;
    for filter in &plan.seccomp {
        install_seccomp(filter)?;
    }
    Ok(())
}

/// Mounts the overlay root. The new mount API takes the layers one by one
/// (`lowerdir+`, Linux 6.8), so a chain of any depth up to overlayfs' own
/// limit fits; older kernels get the classic mount, whose options must fit
/// in one page.
fn mount_overlay(plan: &NativeSetup, root: &Path) -> Step<()> {
    match mount_overlay_fsconfig(plan, root) {
        Ok(()) => return Ok(()),
        // No new mount API, or no `lowerdir+`: fall back.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS) | Some(libc::EINVAL)) => {}
        Err(e) => {
            return Err(format!(
                "mount the overlay root ({} layers): {e}",
                plan.lower_dirs.len()
            ))
        }
    }
    let options = format!(
        "lowerdir={},upperdir={},workdir={}",
        plan.lower_dirs.join(":"),
        plan.upper_dir,
        plan.work_dir
    );
    if options.len() >= 4000 {
        return Err(format!(
            "{} layers make overlay options longer than this kernel accepts; Linux 6.8 or newer takes up to 500",
            plan.lower_dirs.len()
        ));
    }
    ctx(
        mount(
            Some("overlay"),
            root,
            Some("overlay"),
            MsFlags::empty(),
            Some(options.as_str()),
        ),
        || format!("mount the overlay root ({options})"),
    )
}

fn mount_overlay_fsconfig(plan: &NativeSetup, root: &Path) -> std::io::Result<()> {
    use std::ffi::CString;
    use std::os::fd::{FromRawFd, OwnedFd};
    const FSCONFIG_SET_STRING: libc::c_uint = 1;
    const FSCONFIG_CMD_CREATE: libc::c_uint = 6;
    const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
    let cstr = |s: &str| CString::new(s).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL));
    let check = |rc: libc::c_long| {
        if rc < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(rc)
        }
    };
    let name = cstr("overlay")?;
    // SAFETY: fsopen takes a NUL-terminated name and flags; the returned fd
    // is owned below.
    let fs = unsafe { OwnedFd::from_raw_fd(check(libc::syscall(libc::SYS_fsopen, name.as_ptr(), 1))? as i32) };
    let set = |key: &str, value: &str| -> std::io::Result<()> {
        let (k, v) = (cstr(key)?, cstr(value)?);
        // SAFETY: key and value are NUL-terminated strings alive for the call.
        check(unsafe {
            libc::syscall(
                libc::SYS_fsconfig,
                fs.as_raw_fd(),
                FSCONFIG_SET_STRING,
                k.as_ptr(),
                v.as_ptr(),
                0,
            )
        })
        .map(|_| ())
    };
    for lower in &plan.lower_dirs {
        set("lowerdir+", lower)?;
    }
    set("upperdir", &plan.upper_dir)?;
    set("workdir", &plan.work_dir)?;
    // SAFETY: a command with no key or value.
    check(unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fs.as_raw_fd(),
            FSCONFIG_CMD_CREATE,
            std::ptr::null::<u8>(),
            std::ptr::null::<u8>(),
            0,
        )
    })?;
    // SAFETY: fsmount takes the configured fs fd and flags (FSMOUNT_CLOEXEC).
    let mnt = unsafe { OwnedFd::from_raw_fd(check(libc::syscall(libc::SYS_fsmount, fs.as_raw_fd(), 1, 0))? as i32) };
    let target = cstr(
        root.to_str()
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL))?,
    )?;
    let empty = cstr("")?;
    // SAFETY: moves the detached mount `mnt` onto the NUL-terminated target path.
    check(unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            mnt.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            target.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    })?;
    Ok(())
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

/// The listening socket arrives on fd 0; it moves to fd 3 and stdin
/// becomes /dev/null. stderr already is the console log.
fn wire_fds() -> Step<()> {
    use nix::fcntl::OFlag;
    ctx(nix::unistd::dup2(0, LISTEN_FD), || "move the listening socket".into())?;
    let null = ctx(nix::fcntl::open("/dev/null", OFlag::O_RDWR, Mode::empty()), || {
        "open /dev/null".into()
    })?;
    ctx(nix::unistd::dup2(null, 0), || "wire stdin".into())?;
    let _ = nix::unistd::close(null);
    Ok(())
}

/// Drops every capability outside `keep` from the bounding, ambient,
/// inheritable, permitted and effective sets.
fn drop_capabilities(keep: u64) -> Step<()> {
    let last: u32 = fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40);
    for cap in 0..=last {
        if keep & (1 << cap) == 0 {
            // SAFETY: prctl with integer arguments only.
            let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) };
            if rc != 0 {
                return Err(format!("drop capability {cap}: {}", std::io::Error::last_os_error()));
            }
        }
    }
    // SAFETY: prctl with integer arguments only.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
            0,
            0,
            0,
        );
    }
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let header = Header {
        version: 0x2008_0522,
        pid: 0,
    };
    let low = Data {
        effective: keep as u32,
        permitted: keep as u32,
        inheritable: 0,
    };
    let high = Data {
        effective: (keep >> 32) as u32,
        permitted: (keep >> 32) as u32,
        inheritable: 0,
    };
    let data = [low, high];
    // SAFETY: capset reads one header and two data structs (version 3),
    // both laid out as the kernel expects and alive for the call.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &header as *const Header, data.as_ptr()) };
    if rc != 0 {
        return Err(format!("set capabilities: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

fn install_seccomp(program: &[cairn_protocol::BpfInstruction]) -> Step<()> {
    let mut filter: Vec<libc::sock_filter> = program
        .iter()
        .map(|&(code, jt, jf, k)| libc::sock_filter { code, jt, jf, k })
        .collect();
    let prog = libc::sock_fprog {
        len: filter.len() as u16,
        filter: filter.as_mut_ptr(),
    };
    // SAFETY: `prog` points at `filter`, which outlives the call; the
    // kernel copies the program.
    let rc = unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER as libc::c_ulong,
            &prog as *const libc::sock_fprog,
        )
    };
    if rc != 0 {
        return Err(format!(
            "install the seccomp filter: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}
