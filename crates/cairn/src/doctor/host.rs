//! The kernel features the native driver uses: user namespaces, seccomp,
//! overlayfs, the new mount API, idmapped mounts on the state directory's
//! file system, cgroups, and loop devices for `--disk`.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use cairn_engine::Home;
use cairn_sandbox::cgroup::{Hierarchy, Layout};

use super::Line;

/// The host's lines, in the order a reader fixes them.
pub fn lines(home: &Home) -> Vec<Line> {
    let mut lines = vec![root(), kernel()];
    let userns = ChildNamespace::new();
    lines.push(user_namespaces(&userns));
    lines.push(seccomp());
    lines.push(overlayfs());
    lines.push(mount_api());
    lines.push(idmapped_mounts(&existing_ancestor(home.root()), &userns));
    drop(userns);
    lines.push(cgroups(home));
    lines.push(disk());
    lines
}

/// What `--disk` needs; a host without it runs sandboxes without disks.
fn disk() -> Line {
    match cairn_sandbox::disk::available() {
        Ok(detail) => Line::ok("disk-limits", detail),
        Err(missing) => Line::warn(
            "disk-limits",
            missing,
            "--disk and CAIRN_DISK need loop devices (/dev/loop-control; modprobe loop, or a container given \
             the loop devices) and e2fsprogs (apt-get install e2fsprogs)",
        ),
    }
}

/// `path`, or the nearest directory above it that exists (the state
/// directory may not be made yet; it will be made on that file system).
pub fn existing_ancestor(path: &Path) -> PathBuf {
    path.ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"))
        .to_path_buf()
}

fn root() -> Line {
    let uid = nix::unistd::geteuid();
    if uid.is_root() {
        Line::ok("root", "running as root")
    } else {
        Line::fail(
            "root",
            format!("running as uid {uid}"),
            "the native driver needs root for namespaces, cgroups and mounts: run cairn as root (sudo)",
        )
    }
}

fn kernel() -> Line {
    match nix::sys::utsname::uname() {
        Ok(u) => Line::ok("kernel", u.release().to_string_lossy()),
        Err(e) => Line::fail(
            "kernel",
            format!("uname failed: {e}"),
            "run on Linux; a host filter that refuses uname refuses Cairn too",
        ),
    }
}

/// `/proc/sys/...` as a number, if it is one.
fn sysctl(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// A user namespace made the way the native driver makes one (a child
/// cloned into it, its maps written from here), held for the idmapped
/// mount check; the child exits and is reaped on drop.
struct ChildNamespace {
    made: Result<OwnedFd, String>,
    child: Option<(nix::unistd::Pid, OwnedFd)>,
}

impl ChildNamespace {
    fn new() -> ChildNamespace {
        let (hold, release) = match nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) {
            Ok(p) => p,
            Err(e) => {
                return ChildNamespace {
                    made: Err(format!("cannot create a pipe: {e}")),
                    child: None,
                }
            }
        };
        // SAFETY: clone without CLONE_VM gives the child its own copy of
        // the address space, like fork; the child makes only raw system
        // calls (close, read, _exit), which need no lock another thread of
        // this process could have held.
        let pid = unsafe {
            libc::syscall(
                libc::SYS_clone,
                (libc::CLONE_NEWUSER | libc::SIGCHLD) as libc::c_ulong,
                0usize,
                0usize,
                0usize,
                0usize,
            )
        };
        if pid == 0 {
            // SAFETY: plain descriptor calls; the read returns when the
            // parent closes its end or dies.
            unsafe {
                libc::close(release.as_raw_fd());
                let mut byte = 0u8;
                libc::read(hold.as_raw_fd(), (&mut byte as *mut u8).cast(), 1);
                libc::_exit(0);
            }
        }
        if pid < 0 {
            return ChildNamespace {
                made: Err(format!("cannot create one: {}", io::Error::last_os_error())),
                child: None,
            };
        }
        drop(hold);
        let child = nix::unistd::Pid::from_raw(pid as i32);
        let ids = cairn_sandbox::native::HOST_IDS;
        let map = format!("0 {} {}\n", ids.base, ids.count);
        let made = (|| {
            for file in ["uid_map", "gid_map"] {
                std::fs::write(format!("/proc/{pid}/{file}"), &map)
                    .map_err(|e| format!("made one, but cannot write its {file}: {e}"))?;
            }
            std::fs::File::open(format!("/proc/{pid}/ns/user"))
                .map(OwnedFd::from)
                .map_err(|e| format!("made one, but cannot open it: {e}"))
        })();
        ChildNamespace {
            made,
            child: Some((child, release)),
        }
    }
}

impl Drop for ChildNamespace {
    fn drop(&mut self) {
        if let Some((child, release)) = self.child.take() {
            drop(release);
            let _ = nix::sys::wait::waitpid(child, None);
        }
    }
}

fn user_namespaces(ns: &ChildNamespace) -> Line {
    let max = sysctl("/proc/sys/user/max_user_namespaces");
    let limit = match max {
        Some(n) => format!("max_user_namespaces {n}"),
        None => "max_user_namespaces unreadable".to_string(),
    };
    let unprivileged = match sysctl("/proc/sys/kernel/unprivileged_userns_clone") {
        Some(0) => "; unprivileged ones refused (Cairn runs as root, so it does not need them)",
        _ => "",
    };
    if max == Some(0) {
        return Line::fail(
            "userns",
            limit,
            "user namespaces are switched off: sysctl -w user.max_user_namespaces=15000",
        );
    }
    match &ns.made {
        Ok(_) => {
            let ids = cairn_sandbox::native::HOST_IDS;
            Line::ok(
                "userns",
                format!(
                    "made one mapping {} ids from {} ({limit}){unprivileged}",
                    ids.count, ids.base
                ),
            )
        }
        Err(e) => Line::fail(
            "userns",
            format!("{e} ({limit})"),
            "run as root on a host that allows user namespaces: a container needs --privileged or a \
             seccomp profile allowing clone(CLONE_NEWUSER); set user.max_user_namespaces above 0",
        ),
    }
}

/// `seccomp(2)` operation asking whether the kernel knows a filter action.
const SECCOMP_GET_ACTION_AVAIL: libc::c_ulong = 2;

fn seccomp() -> Line {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let Some(mode) = status
        .lines()
        .find_map(|l| l.strip_prefix("Seccomp:"))
        .map(|m| m.trim().to_string())
    else {
        return Line::fail(
            "seccomp",
            "the kernel has no seccomp (no Seccomp field in /proc/self/status)",
            "use a kernel built with CONFIG_SECCOMP and CONFIG_SECCOMP_FILTER",
        );
    };
    let mut missing = Vec::new();
    for (name, action) in [
        ("kill-process", libc::SECCOMP_RET_KILL_PROCESS),
        ("errno", libc::SECCOMP_RET_ERRNO),
    ] {
        // SAFETY: the kernel only reads the u32 the pointer names, which
        // lives until the call returns.
        let rc = unsafe { libc::syscall(libc::SYS_seccomp, SECCOMP_GET_ACTION_AVAIL, 0, &action as *const u32) };
        if rc != 0 {
            missing.push(format!("{name} ({})", io::Error::last_os_error()));
        }
    }
    let own = match mode.as_str() {
        "0" => String::new(),
        m => format!("; cairn itself runs under seccomp mode {m} (a container's filter may refuse some checks)"),
    };
    if missing.is_empty() {
        Line::ok(
            "seccomp",
            format!("filters with the kill-process and errno actions{own}"),
        )
    } else {
        Line::fail(
            "seccomp",
            format!("filter actions unavailable: {}{own}", missing.join(", ")),
            "use a kernel with CONFIG_SECCOMP_FILTER (4.14 or later)",
        )
    }
}

/// The new mount API's calls, which libc wraps only as numbers.
mod mount_api {
    use super::*;

    pub const FSOPEN_CLOEXEC: libc::c_uint = 1;
    pub const OPEN_TREE_CLONE: libc::c_uint = 1;
    pub const OPEN_TREE_CLOEXEC: libc::c_uint = libc::O_CLOEXEC as libc::c_uint;
    pub const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

    /// `struct mount_attr` from `<linux/mount.h>`.
    #[repr(C)]
    pub struct MountAttr {
        pub attr_set: u64,
        pub attr_clr: u64,
        pub propagation: u64,
        pub userns_fd: u64,
    }

    fn fd(rc: libc::c_long) -> io::Result<OwnedFd> {
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned this descriptor to us alone.
        Ok(unsafe { OwnedFd::from_raw_fd(rc as i32) })
    }

    pub fn fsopen(fs_type: &str) -> io::Result<OwnedFd> {
        let name = CString::new(fs_type).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: `name` is a NUL-terminated string that outlives the call.
        fd(unsafe { libc::syscall(libc::SYS_fsopen, name.as_ptr(), FSOPEN_CLOEXEC) })
    }

    pub fn open_tree(path: &Path, flags: libc::c_uint) -> io::Result<OwnedFd> {
        let path = CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: `path` is a NUL-terminated string that outlives the call.
        fd(unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, path.as_ptr(), flags) })
    }

    /// `mount_setattr` on the detached mount `tree` itself.
    pub fn set_attr(tree: &OwnedFd, attr: &MountAttr) -> io::Result<()> {
        // SAFETY: the empty path and `attr` outlive the call; the kernel
        // reads `size_of::<MountAttr>()` bytes of `attr`.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_EMPTY_PATH,
                attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Whether the kernel has `mount_setattr`: asked with a size too small
    /// to be valid, it answers EINVAL where it exists, ENOSYS where not.
    pub fn has_mount_setattr() -> io::Result<()> {
        // SAFETY: a zero size means the kernel reads nothing through the
        // null pointers.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                -1,
                std::ptr::null::<libc::c_char>(),
                0,
                std::ptr::null::<MountAttr>(),
                0usize,
            )
        };
        match io::Error::last_os_error() {
            e if rc < 0 && e.raw_os_error() == Some(libc::ENOSYS) => Err(e),
            _ => Ok(()),
        }
    }
}

fn overlayfs() -> Line {
    let listed = std::fs::read_to_string("/proc/filesystems")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split_whitespace().last() == Some("overlay"));
    if listed {
        return Line::ok("overlayfs", "overlay is in /proc/filesystems");
    }
    match mount_api::fsopen("overlay") {
        Ok(_) => Line::ok("overlayfs", "overlay loads on first use"),
        Err(e) => Line::fail(
            "overlayfs",
            format!("overlay is not in /proc/filesystems and cannot be opened ({e})"),
            "modprobe overlay, or use a kernel built with CONFIG_OVERLAY_FS",
        ),
    }
}

fn mount_api() -> Line {
    let remedy = "the native driver needs Linux 5.12 or later (open_tree, fsopen, mount_setattr); \
                  a container's seccomp profile must allow them";
    if let Err(e) = mount_api::open_tree(Path::new("/"), mount_api::OPEN_TREE_CLOEXEC) {
        return Line::fail("mount-api", format!("open_tree: {e}"), remedy);
    }
    if let Err(e) = mount_api::fsopen("tmpfs") {
        return Line::fail("mount-api", format!("fsopen: {e}"), remedy);
    }
    if let Err(e) = mount_api::has_mount_setattr() {
        return Line::fail("mount-api", format!("mount_setattr: {e}"), remedy);
    }
    Line::ok("mount-api", "open_tree, fsopen and mount_setattr work")
}

/// The file system type of the mount holding `path` (the longest mount
/// point above it in `/proc/self/mountinfo`; the last such, which is on
/// top), and its source.
fn filesystem_of(path: &Path) -> Option<(String, String)> {
    let path = std::fs::canonicalize(path).ok()?;
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut best: Option<(usize, String, String)> = None;
    for line in info.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let Some(point) = left.split(' ').nth(4) else {
            continue;
        };
        let point = point.replace("\\040", " ");
        let mut right = right.split(' ');
        let (fstype, source) = (right.next().unwrap_or("?"), right.next().unwrap_or(""));
        if path.starts_with(&point) && best.as_ref().is_none_or(|(len, ..)| point.len() >= *len) {
            best = Some((point.len(), fstype.to_string(), source.to_string()));
        }
    }
    best.map(|(_, fstype, source)| (fstype, source))
}

fn idmapped_mounts(dir: &Path, ns: &ChildNamespace) -> Line {
    let fs = match filesystem_of(dir) {
        Some((fstype, source)) => format!("{fstype} ({source})"),
        None => "a file system not in /proc/self/mountinfo".to_string(),
    };
    let remedy = "without them native sandboxes use copies of their layers with shifted ids (disk, and a \
                  first start that copies); to avoid that, put the state directory (--home, CAIRN_HOME) on a \
                  file system that supports idmapped mounts (ext4, xfs, btrfs; tmpfs from Linux 6.3)";
    let userns = match &ns.made {
        Ok(fd) => fd,
        Err(_) => {
            return Line::warn(
                "idmapped-mounts",
                format!(
                    "{} is on {fs}; not checked: no user namespace to map with (see userns)",
                    dir.display()
                ),
                remedy,
            )
        }
    };
    // A detached copy of the mount: it is never attached anywhere, and it
    // goes away when the descriptor closes.
    let tree = match mount_api::open_tree(dir, mount_api::OPEN_TREE_CLONE | mount_api::OPEN_TREE_CLOEXEC) {
        Ok(t) => t,
        Err(e) => {
            return Line::warn(
                "idmapped-mounts",
                format!("{} is on {fs}; cannot clone its mount: {e}", dir.display()),
                remedy,
            )
        }
    };
    let attr = mount_api::MountAttr {
        attr_set: mount_api::MOUNT_ATTR_IDMAP,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    match mount_api::set_attr(&tree, &attr) {
        Ok(()) => Line::ok("idmapped-mounts", format!("{} is on {fs}, which idmaps", dir.display())),
        Err(e) => Line::warn(
            "idmapped-mounts",
            format!("{} is on {fs}, which cannot be idmapped: {e}", dir.display()),
            remedy,
        ),
    }
}

fn cgroups(home: &Home) -> Line {
    let cgroup_root = Path::new("/sys/fs/cgroup");
    let layout = Layout::at(cgroup_root).map_or("no cgroup file system", Layout::name);
    let hierarchy = match Hierarchy::detect(&home.scope()) {
        Ok(h) => h,
        Err(e) => {
            return Line::fail(
                "cgroups",
                format!("{layout}: {e}"),
                "mount cgroup2 on /sys/fs/cgroup (systemd.unified_cgroup_hierarchy=1), or the v1 memory, \
                 pids, cpu and freezer controllers under it",
            )
        }
    };
    let controllers = hierarchy.controllers();
    let present: Vec<&str> = controllers.iter().filter(|(_, p)| *p).map(|(c, _)| *c).collect();
    let absent: Vec<&str> = controllers.iter().filter(|(_, p)| !*p).map(|(c, _)| *c).collect();
    let uses = format!("{layout}, Cairn uses v{} ({})", hierarchy.version(), present.join(", "));
    if !absent.is_empty() {
        return Line::fail(
            "cgroups",
            format!("{uses}; missing {}", absent.join(", ")),
            "enable the missing controllers (cgroup_enable= on the kernel command line, or delegate them \
             to this cgroup)",
        );
    }
    match hierarchy.delegation() {
        None => Line::ok("cgroups", uses),
        Some(Ok(how)) => Line::ok("cgroups", format!("{uses}; {how}")),
        Some(Err(why)) => Line::fail(
            "cgroups",
            format!("{uses}; {why}"),
            "move this cgroup's processes into a child (mkdir /sys/fs/cgroup/init; echo each pid > \
             /sys/fs/cgroup/init/cgroup.procs) or run Cairn in a cgroup delegated to it",
        ),
    }
}
