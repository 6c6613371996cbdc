//! `cairn-init --native-setup`: building a native sandbox around init.
//!
//! The host spawns init (cheaply: vfork and exec of a small static binary)
//! with the sandbox's host id range on its command line (`BASE:COUNT`), and
//! may do so before it knows which sandbox it is for. Init makes what needs
//! nothing more at once, while the host prepares the rest: the user
//! namespace with that range, and the pid, network, ipc and uts
//! namespaces (a network namespace alone costs about 0.4 ms to make) with
//! its loopback up, and forks PID 1 of the new pid namespace. PID 1 makes
//! the sandbox's /proc, read-only /sys and a populated /dev as detached
//! mounts, with what goes on them (masks, read-only knobs, devpts, shared
//! memory) where the kernel allows mounts onto a detached tree, and waits
//! for the [`NativeSetup`]; once it has it, it reports its pid to the host
//! and the parent exits, so PID 1 is re-parented away from the host process
//! and outlives it. PID 1 unshares the mount namespace (the mount table is
//! copied as it is then), mounts the overlay root and attaches /proc, /sys
//! and /dev to it, while the host makes the sandbox's cgroups. Once the
//! host says they exist, PID 1 joins them and unshares the cgroup namespace
//! (rooted at the cgroups just joined), before anything of the sandbox's
//! runs; it then pivots into the root, names the host,
//! drops capabilities, sets `no_new_privs`, installs the seccomp filters and
//! goes on to serve.
//!
//! fd 1 is a socket to the host. The host sends the [`NativeSetup`] as one
//! frame (so nothing of it shows on init's command line); init answers with
//! `P<pid>\n` (PID 1's host pid) once PID 1 has the setup, waits for the
//! host's `G\n` (the cgroups exist; with a network, `eth0` is in the
//! namespace too), and answers `R\n` once it is ready, or `E<message>` on
//! failure.

use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use cairn_protocol::{LayerMount, NativeSetup, LISTEN_FD};
use nix::fcntl::{AtFlags, OFlag};
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::stat::{makedev, mknodat, FchmodatFlags, Mode, SFlag};
use nix::unistd::{chdir, fork, pivot_root, sethostname, ForkResult};

use crate::mount_api;

/// Builds the sandbox. Returns (in PID 1 only) the listening socket's fd;
/// the setup parent and any failure end the process here.
pub fn build() -> RawFd {
    // SAFETY: fd 1 is the socket the host gave us; we own it until PID 1
    // replaces it with the console.
    let mut report = std::mem::ManuallyDrop::new(unsafe { std::os::unix::net::UnixStream::from_raw_fd(1) });
    // Whatever the host process leaked to us beyond stdio stays outside.
    // SAFETY: close_range takes plain integers; fds 0-2 are kept.
    unsafe {
        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
    }
    let ids = std::env::args().nth(2);
    let ahead = ids
        .as_deref()
        .and_then(|ids| ids.split_once(':'))
        .and_then(|(base, count)| Some((base.parse::<u32>().ok()?, count.parse::<u32>().ok()?)))
        .ok_or_else(|| format!("cairn-init --native-setup takes the host id range as BASE:COUNT, not {ids:?}"))
        .and_then(|(base, count)| Ok(((base, count), namespaces_ahead(base, count)?)));
    let ((base, count), (userns, holder)) = match ahead {
        Ok(made) => made,
        // Reported once the setup is read, when the host listens for it.
        Err(e) => fail_once_read(&mut report, e),
    };
    // PID 1 is forked now too, and takes the setup itself: a waiting init
    // the host drops (or a host that dies) closes the host's end of the
    // socket, and PID 1, waiting on it, exits; one killed without that
    // leaves PID 1 to take the setup. Once PID 1 has it, it names itself to
    // the host and this process exits, so that PID 1 is re-parented away
    // from the host process and outlives it.
    let (taken, took) = match nix::unistd::pipe2(OFlag::O_CLOEXEC) {
        Ok(pipe) => pipe,
        Err(e) => fail_once_read(&mut report, format!("create a pipe: {e}")),
    };
    // SAFETY: this process is single-threaded (setup runs before any thread
    // starts), so the child may do anything the parent could.
    match unsafe { fork() } {
        Err(e) => fail_once_read(&mut report, format!("fork PID 1: {e}")),
        Ok(ForkResult::Parent { .. }) => {
            drop(took);
            // Returns once PID 1 has the setup (or is gone).
            let mut byte = [0u8; 1];
            let _ = nix::unistd::read(taken.as_raw_fd(), &mut byte);
            // The namespace's first holder exited once its pipe closed;
            // reaped here, off the path to PID 1's readiness.
            let _ = nix::sys::wait::waitpid(holder, None);
            std::process::exit(0)
        }
        Ok(ForkResult::Child) => {}
    }
    drop(taken);
    // PID 1 is never the OOM killer's pick: -1000 while it is host root,
    // before it has a child (see `spawn::protect_from_oom_killer`).
    if let Err(e) = crate::spawn::protect_from_oom_killer() {
        fail_once_read(&mut report, format!("set PID 1's oom_score_adj: {e}"));
    }
    // PID 1 makes the sandbox's /proc, /sys and /dev as detached mounts
    // while it waits: none needs the setup (/proc is this pid namespace's,
    // /sys this network namespace's, /dev belongs to the sandbox's root,
    // host id `base`).
    let premade = match premade(base) {
        Ok(made) => made,
        Err(e) => fail_once_read(&mut report, e),
    };
    // So is what the first command's spawn would otherwise ask the kernel.
    crate::spawn::reset_signals();
    let setup = read_setup(&mut report);
    // PID 1 names itself: its host pid is what the host's /proc (still
    // this process's) calls `self`.
    match fs::read_link("/proc/self") {
        Ok(pid) => {
            let _ = report.write_all(format!("P{}\n", pid.display()).as_bytes());
        }
        Err(e) => fail(&mut report, format!("read PID 1's host pid: {e}")),
    }
    let _ = nix::unistd::write(&took, b"1");
    drop(took);
    if (base, count) != (setup.host_id_base, setup.id_count) {
        fail(
            &mut report,
            format!(
                "the setup maps ids to {}+{}, but init was started for {base}+{count}",
                setup.host_id_base, setup.id_count
            ),
        );
    }
    let setup = &setup;
    if let Err(e) = unshare(CloneFlags::CLONE_NEWNS) {
        fail(&mut report, format!("create the mount namespace: {e}"));
    }
    if let Err(e) = setup_root(setup, userns, premade, &mut report) {
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

pub(crate) type Step<T> = Result<T, String>;

/// Reports a failure to the host and ends the process.
fn fail(report: &mut std::os::unix::net::UnixStream, msg: String) -> ! {
    let _ = report.write_all(format!("E{msg}").as_bytes());
    std::process::exit(1)
}

/// [`fail`] once the setup is read: before that, the host is not yet
/// listening for the report.
fn fail_once_read(report: &mut std::os::unix::net::UnixStream, msg: String) -> ! {
    read_setup(report);
    fail(report, msg)
}

/// Takes the listening socket, the console log and the setup from the
/// host (see the driver's `WaitingInit`: the host may start init before
/// its sandbox exists); the descriptors become fds 0 and 2. A failure is
/// reported and ends the process.
fn read_setup(report: &mut std::os::unix::net::UnixStream) -> NativeSetup {
    if let Err(e) = receive_fds(report) {
        fail(report, e);
    }
    let setup: NativeSetup = match cairn_protocol::read_frame(&mut *report) {
        Ok(s) => s,
        Err(e) => fail(report, format!("read the sandbox setup: {e}")),
    };
    if setup.version != cairn_protocol::PROTOCOL_VERSION {
        fail(
            report,
            format!("setup version {} from a different Cairn build", setup.version),
        );
    }
    setup
}

/// The namespaces that need nothing from the setup: the user namespace
/// mapping `0..count` to host ids `base..` (held by a descriptor, with the
/// child that made it, for the caller to reap), and the pid, network, ipc
/// and uts namespaces of this process's next child. The mount namespace
/// waits for the setup, so that its copy of the host's mount table is
/// current; the cgroup namespace waits for the cgroups it is rooted at.
fn namespaces_ahead(base: u32, count: u32) -> Step<(OwnedFd, nix::unistd::Pid)> {
    let made = user_namespace(base, count)?;
    let flags =
        CloneFlags::CLONE_NEWPID | CloneFlags::CLONE_NEWNET | CloneFlags::CLONE_NEWIPC | CloneFlags::CLONE_NEWUTS;
    ctx(unshare(flags), || "create namespaces".into())?;
    // This process is in the new network namespace already (only the pid
    // namespace waits for a child): its loopback comes up, and its knobs
    // are set, through the host's /proc, whose `sys/net` is the opener's
    // namespace. The sandbox's root holds no capability over the namespace
    // (it belongs to the host's user namespace), so what root could do
    // there by capability is opened to every process of the sandbox: bind
    // any port, send pings.
    loopback_up()?;
    for (knob, value) in [
        ("net/ipv4/ip_unprivileged_port_start", "0"),
        ("net/ipv4/ping_group_range", "0 2147483647"),
    ] {
        ctx(fs::write(Path::new("/proc/sys").join(knob), value), || {
            format!("set {knob}")
        })?;
    }
    Ok(made)
}

/// Receives the listening socket and the console log: one byte,
/// [`cairn_protocol::SETUP_FDS_MARKER`], carrying exactly those two
/// descriptors; they become fds 0 and 2.
fn receive_fds(report: &std::os::unix::net::UnixStream) -> Step<()> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut byte = [0u8; 1];
    let mut space = nix::cmsg_space!([RawFd; 2]);
    let mut iov = [std::io::IoSliceMut::new(&mut byte)];
    let msg = ctx(
        recvmsg::<()>(
            report.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ),
        || "receive the sandbox's socket and console".into(),
    )?;
    let mut fds = Vec::new();
    for cmsg in ctx(msg.cmsgs(), || "read the descriptors sent".into())? {
        if let ControlMessageOwned::ScmRights(got) = cmsg {
            fds.extend(got);
        }
    }
    let truncated = msg.flags.contains(MsgFlags::MSG_CTRUNC);
    let marker = msg.bytes == 1 && byte[0] == cairn_protocol::SETUP_FDS_MARKER;
    if !marker || truncated || fds.len() != 2 {
        for fd in fds {
            let _ = nix::unistd::close(fd);
        }
        return Err("the host sent no listening socket and console with the setup".into());
    }
    for (fd, to) in fds.into_iter().zip([0, 2]) {
        ctx(nix::unistd::dup2(fd, to), || {
            format!("move a received descriptor to fd {to}")
        })?;
        let _ = nix::unistd::close(fd);
    }
    Ok(())
}

pub(crate) fn ctx<T, E: std::fmt::Display>(r: Result<T, E>, what: impl FnOnce() -> String) -> Step<T> {
    r.map_err(|e| format!("{}: {e}", what()))
}

/// The sandbox's /proc, /sys and /dev, made as detached mounts before the
/// setup arrived.
struct Premade {
    proc: OwnedFd,
    sys: OwnedFd,
    dev: OwnedFd,
    /// Whether what goes on them ([`fill`]) is on already: the kernel takes
    /// mounts onto a detached tree (Linux 6.15). Otherwise it goes on once
    /// they are attached.
    filled: bool,
}

/// Makes [`Premade`]'s mounts, and fills them where the kernel allows.
fn premade(base: u32) -> Step<Premade> {
    let proc = mount_proc_detached()?;
    let sys = mount_sys_detached()?;
    let dev = make_dev(base)?;
    // The first mount onto the detached /proc says whether the kernel takes
    // them; a kernel that refuses it has changed nothing.
    let filled = match read_only_at(&proc, "sys") {
        Ok(()) => {
            fill_rest(&proc, &sys, &dev)?;
            true
        }
        Err(_) => false,
    };
    Ok(Premade { proc, sys, dev, filled })
}

fn setup_root(
    plan: &NativeSetup,
    userns: OwnedFd,
    premade: Premade,
    report: &mut std::os::unix::net::UnixStream,
) -> Step<()> {
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
    let layers = Layers {
        lower: &plan.lower_dirs,
        upper: &plan.upper_dir,
        work: &plan.work_dir,
    };
    mount_overlay(&layers, root, &userns, plan.layer_mount)?;
    // Mount points and /tmp are made as the sandbox's root, whose files
    // they are (a host id outside the namespace's map would show as nobody).
    // Relative to the root's descriptor: the host path leading to it is
    // not the sandbox root's to traverse.
    let top = ctx(
        nix::fcntl::open(
            root,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        ),
        || "open the root".into(),
    )?;
    // SAFETY: open just returned this descriptor to us alone.
    let top = unsafe { OwnedFd::from_raw_fd(top) };
    as_sandbox_root(plan.host_id_base, || {
        for (dir, mode) in [("proc", 0o555), ("dev", 0o755), ("sys", 0o555), ("tmp", 0o1777)] {
            // Mounts go on these paths while the host's root is still `/`:
            // an image's symlink there would point them at host paths.
            if let Ok(st) = nix::sys::stat::fstatat(Some(top.as_raw_fd()), dir, AtFlags::AT_SYMLINK_NOFOLLOW) {
                if SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) != SFlag::S_IFDIR {
                    return Err(format!(
                        "the image's /{dir} is not a directory; a sandbox mounts its own there"
                    ));
                }
                continue;
            }
            ctx(
                nix::sys::stat::mkdirat(Some(top.as_raw_fd()), dir, Mode::from_bits_truncate(mode)),
                || format!("create /{dir}"),
            )?;
            // mkdir applies the umask and drops the sticky bit.
            ctx(
                nix::sys::stat::fchmodat(
                    Some(top.as_raw_fd()),
                    dir,
                    Mode::from_bits_truncate(mode),
                    FchmodatFlags::NoFollowSymlink,
                ),
                || format!("chmod /{dir}"),
            )?;
        }
        Ok(())
    })?;
    let net_files = plan.network.as_ref().map(crate::net::clone_files).transpose()?;
    let Premade { proc, sys, dev, filled } = premade;
    for (name, mnt) in [("proc", proc), ("sys", sys), ("dev", dev)] {
        ctx(mount_api::attach(&mnt, &root.join(name)), || format!("attach /{name}"))?;
    }
    let open = |name: &str| ctx(mount_api::open_dir_at(&top, name), || format!("open /{name}"));
    if !filled {
        let (proc, sys, dev) = (open("proc")?, open("sys")?, open("dev")?);
        fill(&proc, &sys, &dev)?;
    }
    attach_shm(&open("dev")?, plan.host_id_base, plan.shm_bytes)?;
    // Closed before fd 3 is taken for the listening socket (`wire_fds`).
    drop(top);
    // The host made the cgroups while the root was built; they are joined
    // before the pivot, while their host paths can still be reached.
    wait_for_host(report)?;
    join_cgroups(&plan.cgroup_procs)?;

    ctx(chdir(root), || "enter the root".into())?;
    ctx(pivot_root(".", "."), || "pivot_root".into())?;
    ctx(umount2(".", MntFlags::MNT_DETACH), || "detach the host root".into())?;
    ctx(chdir("/"), || "chdir /".into())?;

    ctx(sethostname(&plan.hostname), || {
        format!("set host name {}", plan.hostname)
    })?;
    if let (Some(net), Some(files)) = (&plan.network, net_files) {
        crate::net::configure(net, files, plan.host_id_base)?;
    }
    ctx(nix::unistd::setsid(), || "setsid".into())?;
    // Closes `userns` before fd 3 is taken for the listening socket: the
    // namespace's descriptor may be fd 3.
    enter_user_namespace(userns)?;
    wire_fds()?;
    drop_capabilities(plan.keep_capabilities)?;
    ctx(nix::sys::prctl::set_no_new_privs(), || "set no_new_privs".into())?;
    for filter in &plan.seccomp {
        install_seccomp(filter)?;
    }
    Ok(())
}

/// Waits for the host's `G\n` on the report socket: the sandbox's cgroups
/// exist and, with a network, `eth0` is in the namespace. The host closing
/// the socket instead means it gave up on the start.
fn wait_for_host(report: &mut std::os::unix::net::UnixStream) -> Step<()> {
    let mut buf = [0u8; 2];
    match report.read_exact(&mut buf) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err("the host gave up before the sandbox's cgroups were ready".into())
        }
        Err(e) => return Err(format!("wait for the host: {e}")),
    }
    if &buf != b"G\n" {
        return Err(format!("unexpected go-ahead from the host {buf:?}"));
    }
    Ok(())
}

/// Joins the sandbox's cgroups (writing `0` moves this thread, the only
/// one) and unshares the cgroup namespace, rooted at them.
fn join_cgroups(procs: &[String]) -> Step<()> {
    for file in procs {
        ctx(fs::write(file, "0"), || format!("join the sandbox cgroup {file}"))?;
    }
    ctx(unshare(CloneFlags::CLONE_NEWCGROUP), || {
        "create the cgroup namespace".into()
    })
}

/// What an overlay root is made of: read-only layers (host paths, topmost
/// first) and the upper and work directories, which share one directory.
pub(crate) struct Layers<'a> {
    pub lower: &'a [String],
    pub upper: &'a str,
    pub work: &'a str,
}

/// Mounts the overlay root at `root`, nosuid and nodev, its layers given
/// to overlayfs as `how` says (the host probed which way this kernel takes:
/// see `cairn-init --probe-layers`). On every way, the lower layers show
/// the ids they are stored with (the sandbox's) as the host ids of the
/// sandbox's user namespace, and the sandbox's mount table names no host
/// path.
pub(crate) fn mount_overlay(layers: &Layers, root: &Path, userns: &OwnedFd, how: LayerMount) -> Step<()> {
    let sandbox_dir = Path::new(layers.upper)
        .parent()
        .filter(|d| Path::new(layers.work).parent() == Some(*d))
        .ok_or_else(|| "the upper and work directories must share one sandbox directory".to_string())?;
    match how {
        LayerMount::Descriptors => mount_overlay_fds(layers, sandbox_dir, root, userns),
        LayerMount::IdmappedPaths => mount_overlay_paths(layers, sandbox_dir, root, Some(userns)),
        LayerMount::ShiftedPaths => mount_overlay_paths(layers, sandbox_dir, root, None),
    }
}

/// A failed overlay step, with what the kernel lacks when that is the
/// likely cause.
fn overlay_error(layers: usize, how: LayerMount, step: &str, e: std::io::Error) -> String {
    let refused = matches!(
        e.raw_os_error(),
        Some(libc::ENOSYS) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) | Some(libc::EPERM)
    );
    let feature = match how {
        LayerMount::Descriptors => "overlayfs taking idmapped layers as file descriptors (Linux 6.13)",
        LayerMount::IdmappedPaths => "overlayfs taking idmapped lower layers (Linux 5.19)",
        LayerMount::ShiftedPaths => "overlayfs",
    };
    let release = kernel_release().unwrap_or_else(|| "unknown".into());
    if refused {
        format!(
            "mount the overlay root ({layers} layers): {step}: {e}; this kernel (Linux {release}) refused {feature}: \
             run `cairn doctor` to see what it lacks, unset CAIRN_LAYER_MOUNT if it is set, or use --driver gvisor"
        )
    } else {
        format!("mount the overlay root ({layers} layers): {step}: {e}")
    }
}

/// The new mount API, every layer a file descriptor (Linux 6.13): each
/// lower layer is an idmapped clone; the upper and work directories come
/// from a clone of the sandbox directory. Since every layer is a detached
/// mount, the sandbox's mount table shows `lowerdir+=/`.
fn mount_overlay_fds(layers: &Layers, sandbox_dir: &Path, root: &Path, userns: &OwnedFd) -> Step<()> {
    let count = layers.lower.len();
    let how = LayerMount::Descriptors;
    let fs = ctx(mount_api::fsopen("overlay"), || "open an overlay context".into())?;
    // A detached mount lives while its descriptor is open: every clone is
    // kept until the overlay has taken its own private copies.
    let mut clones = Vec::with_capacity(count + 1);
    for lower in layers.lower {
        let clone = mount_api::layer_clone(lower, Some(userns))
            .map_err(|e| overlay_error(count, how, &format!("make an idmapped mount of layer {lower}"), e))?;
        let dir = ctx(mount_api::open_dir_at(&clone, "."), || format!("open layer {lower}"))?;
        mount_api::set_fd(&fs, "lowerdir+", &dir).map_err(|e| overlay_error(count, how, "lowerdir+", e))?;
        clones.push(clone);
    }
    let dir = ctx(mount_api::clone(sandbox_dir), || {
        format!("clone {}", sandbox_dir.display())
    })?;
    for (key, path) in [("upperdir", layers.upper), ("workdir", layers.work)] {
        let name = Path::new(path).file_name().unwrap_or_default();
        let fd = ctx(mount_api::open_dir_at(&dir, name), || format!("open {path}"))?;
        mount_api::set_fd(&fs, key, &fd).map_err(|e| overlay_error(count, how, key, e))?;
    }
    let mnt = mount_api::create(&fs, mount_api::MOUNT_ATTR_NOSUID | mount_api::MOUNT_ATTR_NODEV)
        .map_err(|e| overlay_error(count, how, "create", e))?;
    ctx(mount_api::attach(&mnt, root), || "attach the overlay root".into())?;
    // The overlay holds its own copies now. The clones are attached over
    // paths nothing reads again rather than closed detached, which tears a
    // mount down at once and waits for an RCU grace period (~0.1 ms each
    // on a busy host); attached, they go with the host's root, detached
    // lazily after the pivot. One that cannot be attached is closed.
    for (clone, lower) in clones.iter().zip(layers.lower) {
        let _ = mount_api::attach(clone, Path::new(lower));
    }
    let _ = mount_api::attach(&dir, Path::new(layers.work));
    Ok(())
}

/// A classic overlay mount whose options name every layer by a path
/// relative to a staging directory: a tmpfs of init's own mount namespace
/// attached over the root's mount point, under which lower layer `i` is
/// attached as `i` (an idmapped clone when `userns` is given, a plain
/// read-only one for layers whose ids are already shifted) and the
/// sandbox directory as `s`. overlayfs resolves the names from the working
/// directory and shows them as given (`lowerdir=0:1,upperdir=s/upper,
/// workdir=s/work`), so no host path reaches the sandbox's mount table.
/// The overlay goes on top of the staging tmpfs; the pivot takes the
/// tmpfs, and the clones under it, away with the host's root.
fn mount_overlay_paths(layers: &Layers, sandbox_dir: &Path, root: &Path, userns: Option<&OwnedFd>) -> Step<()> {
    let count = layers.lower.len();
    let how = if userns.is_some() {
        LayerMount::IdmappedPaths
    } else {
        LayerMount::ShiftedPaths
    };
    let staging = ctx(mount_api::fsopen("tmpfs"), || "open a tmpfs context".into())?;
    ctx(mount_api::set_str(&staging, "mode", "0700"), || {
        "set the staging tmpfs's mode".into()
    })?;
    let staging = ctx(
        mount_api::create(
            &staging,
            mount_api::MOUNT_ATTR_NOSUID | mount_api::MOUNT_ATTR_NODEV | mount_api::MOUNT_ATTR_NOEXEC,
        ),
        || "make the staging tmpfs".into(),
    )?;
    ctx(mount_api::attach(&staging, root), || "attach the staging tmpfs".into())?;
    let top = ctx(mount_api::open_path(root), || "open the staging tmpfs".into())?;
    let attach_dir = |mnt: &OwnedFd, name: &str| -> Step<()> {
        ctx(
            nix::sys::stat::mkdirat(Some(top.as_raw_fd()), name, Mode::from_bits_truncate(0o700)),
            || format!("create the staging directory {name}"),
        )?;
        ctx(mount_api::attach_at(mnt, &top, name), || {
            format!("attach {name} in the staging tmpfs")
        })
    };
    let mut names = String::with_capacity(count * 4);
    for (i, lower) in layers.lower.iter().enumerate() {
        let clone = mount_api::layer_clone(lower, userns)
            .map_err(|e| overlay_error(count, how, &format!("make a read-only mount of layer {lower}"), e))?;
        attach_dir(&clone, &i.to_string())?;
        if i > 0 {
            names.push(':');
        }
        names.push_str(&i.to_string());
    }
    let dir = ctx(mount_api::clone(sandbox_dir), || {
        format!("clone {}", sandbox_dir.display())
    })?;
    attach_dir(&dir, "s")?;
    let name = |path: &str| {
        Path::new(path)
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned()
    };
    let options = format!(
        "lowerdir={names},upperdir=s/{},workdir=s/{}",
        name(layers.upper),
        name(layers.work)
    );
    // The kernel copies one page of options.
    if options.len() >= 4000 {
        return Err(format!("{count} layers make overlay options longer than one page"));
    }
    ctx(nix::unistd::fchdir(top.as_raw_fd()), || {
        "enter the staging tmpfs".into()
    })?;
    let mounted = mount(
        Some("overlay"),
        root,
        Some("overlay"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(options.as_str()),
    );
    ctx(chdir("/"), || "leave the staging tmpfs".into())?;
    mounted.map_err(|e| overlay_error(count, how, "mount", e.into()))
}

/// The running kernel's release.
pub(crate) fn kernel_release() -> Option<String> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    Some(release.trim().to_string())
}

/// A user namespace mapping ids `0..count` to host ids `base..base +
/// count`, held by a descriptor: a short-lived child creates it, this
/// process (root on the host) writes its maps, and the child exits. Returns
/// the descriptor and the child, for the caller to reap.
pub(crate) fn user_namespace(base: u32, count: u32) -> Step<(OwnedFd, nix::unistd::Pid)> {
    if count == 0 || base.checked_add(count).is_none() || base == 0 {
        return Err(format!("host id range {base}+{count} is not one a sandbox can use"));
    }
    let (hold, release) = ctx(nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC), || {
        "create a pipe".into()
    })?;
    // SAFETY: this process is single-threaded; like fork, clone without
    // CLONE_VM gives the child its own copy of the stack, and the child
    // only makes async-signal-safe calls (close, read, _exit).
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
        // SAFETY: plain descriptor calls; the read returns when the parent
        // closes its end (or dies).
        unsafe {
            libc::close(release.as_raw_fd());
            let mut byte = 0u8;
            libc::read(hold.as_raw_fd(), (&mut byte as *mut u8).cast(), 1);
            libc::_exit(0);
        }
    }
    if pid < 0 {
        return Err(format!("create a user namespace: {}", std::io::Error::last_os_error()));
    }
    drop(hold);
    let map = format!("0 {base} {count}\n");
    let made = (|| -> Step<OwnedFd> {
        for file in ["uid_map", "gid_map"] {
            ctx(fs::write(format!("/proc/{pid}/{file}"), &map), || {
                format!("write the user namespace's {file} ({map:?})")
            })?;
        }
        let ns = ctx(fs::File::open(format!("/proc/{pid}/ns/user")), || {
            "open the user namespace".into()
        })?;
        Ok(OwnedFd::from(ns))
    })();
    drop(release);
    let child = nix::unistd::Pid::from_raw(pid as i32);
    match made {
        Ok(fd) => Ok((fd, child)),
        Err(e) => {
            let _ = nix::sys::wait::waitpid(child, None);
            Err(e)
        }
    }
}

/// Runs `f` with file system ids of the sandbox's root (host id `base`),
/// so that what it creates on the overlay belongs to the sandbox.
fn as_sandbox_root<T>(base: u32, f: impl FnOnce() -> Step<T>) -> Step<T> {
    nix::unistd::setfsgid(nix::unistd::Gid::from_raw(base));
    nix::unistd::setfsuid(nix::unistd::Uid::from_raw(base));
    let result = f();
    nix::unistd::setfsuid(nix::unistd::Uid::from_raw(0));
    nix::unistd::setfsgid(nix::unistd::Gid::from_raw(0));
    result
}

/// Moves PID 1 into the sandbox's user namespace as its root: from here on
/// it holds capabilities only over the sandbox's own files and processes,
/// none over its namespaces (mounts, network, host name stay as set up),
/// and none on the host. It stays non-dumpable, so no process of the
/// sandbox can trace it, read its memory or take its descriptors, even
/// with the same ids.
fn enter_user_namespace(userns: OwnedFd) -> Step<()> {
    ctx(nix::sched::setns(&userns, CloneFlags::CLONE_NEWUSER), || {
        "enter the user namespace".into()
    })?;
    drop(userns);
    ctx(nix::unistd::setgroups(&[]), || "clear supplementary groups".into())?;
    let root_gid = nix::unistd::Gid::from_raw(0);
    ctx(nix::unistd::setresgid(root_gid, root_gid, root_gid), || {
        "become the sandbox's root group".into()
    })?;
    let root = nix::unistd::Uid::from_raw(0);
    ctx(nix::unistd::setresuid(root, root, root), || {
        "become the sandbox's root".into()
    })?;
    ctx(nix::sys::prctl::set_dumpable(false), || "make init non-dumpable".into())?;
    Ok(())
}

/// A detached procfs of this process's pid namespace, `nosuid,nodev,noexec`.
fn mount_proc_detached() -> Step<OwnedFd> {
    new_mount(
        "proc",
        &[("source", "proc")],
        mount_api::MOUNT_ATTR_NOSUID | mount_api::MOUNT_ATTR_NODEV | mount_api::MOUNT_ATTR_NOEXEC,
    )
}

/// A detached, read-only sysfs of this network namespace,
/// `nosuid,nodev,noexec`.
fn mount_sys_detached() -> Step<OwnedFd> {
    new_mount(
        "sysfs",
        &[("source", "sysfs")],
        mount_api::MOUNT_ATTR_RDONLY
            | mount_api::MOUNT_ATTR_NOSUID
            | mount_api::MOUNT_ATTR_NODEV
            | mount_api::MOUNT_ATTR_NOEXEC,
    )
}

/// What goes on the sandbox's /proc, /sys and /dev (each given as its
/// mount's root): /proc's host-wide knobs read-only and what it shows of
/// the host masked, /sys without the host's firmware tables (ACPI, EFI,
/// DMI) or power-capping counters (which time other tenants' work), and
/// /dev's devpts (its shared memory waits for the setup's size:
/// [`attach_shm`]).
fn fill(proc: &OwnedFd, sys: &OwnedFd, dev: &OwnedFd) -> Step<()> {
    read_only_at(proc, "sys")?;
    fill_rest(proc, sys, dev)
}

/// [`fill`] after its first mount.
fn fill_rest(proc: &OwnedFd, sys: &OwnedFd, dev: &OwnedFd) -> Step<()> {
    for sub in ["sysrq-trigger", "irq", "bus", "fs"] {
        read_only_at(proc, sub)?;
    }
    // Kernel memory, keys and timers read as empty.
    for sub in ["kcore", "keys", "timer_list", "sched_debug", "latency_stats"] {
        if exists_at(proc, sub, None) {
            let null = ctx(mount_api::clone(Path::new("/dev/null")), || "clone /dev/null".into())?;
            ctx(mount_api::attach_at(&null, proc, sub), || format!("mask /proc/{sub}"))?;
        }
    }
    // The host's hardware stays out of sight: one empty read-only tmpfs,
    // a clone of it over each directory (a clone is a quarter of a new
    // tmpfs's cost, and sandbox start pays for every mask), the tmpfs
    // itself over the last (closed detached, it would be torn down at once,
    // waiting for an RCU grace period).
    let empty = empty_tmpfs()?;
    let hidden: Vec<(&OwnedFd, &str)> = [
        (proc, "acpi"),
        (proc, "scsi"),
        (proc, "asound"),
        (sys, "firmware"),
        (sys, "devices/virtual/powercap"),
    ]
    .into_iter()
    .filter(|(dir, sub)| exists_at(dir, sub, Some(SFlag::S_IFDIR)))
    .collect();
    if let Some(((last_dir, last), rest)) = hidden.split_last() {
        for (dir, sub) in rest {
            // Kernels before 6.15 clone no detached mount: a tmpfs each.
            let mask = match mount_api::clone_at(&empty, "") {
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => empty_tmpfs()?,
                made => ctx(made, || "clone the empty tmpfs".into())?,
            };
            ctx(mount_api::attach_at(&mask, dir, sub), || format!("mask {sub}"))?;
        }
        ctx(mount_api::attach_at(&empty, last_dir, last), || format!("mask {last}"))?;
    }
    let pts = new_mount(
        "devpts",
        &[("source", "devpts"), ("ptmxmode", "0666"), ("mode", "0620")],
        mount_api::MOUNT_ATTR_NOSUID | mount_api::MOUNT_ATTR_NOEXEC,
    )?;
    ctx(mount_api::attach_at(&pts, dev, "pts"), || "attach /dev/pts".into())
}

/// The sandbox's `/dev/shm` on `dev`: a tmpfs of `bytes` (the host gives
/// half the memory limit; 0 means 64 MiB), so that filling it ends in
/// ENOSPC for the writer, not in the OOM killer.
fn attach_shm(dev: &OwnedFd, base: u32, bytes: u64) -> Step<()> {
    let id = base.to_string();
    let size = match bytes {
        0 => 64 << 20,
        b => b.max(1 << 20),
    }
    .to_string();
    let shm = new_mount(
        "tmpfs",
        &[
            ("source", "shm"),
            ("mode", "1777"),
            ("size", &size),
            ("uid", &id),
            ("gid", &id),
        ],
        mount_api::MOUNT_ATTR_NOSUID | mount_api::MOUNT_ATTR_NODEV | mount_api::MOUNT_ATTR_NOEXEC,
    )?;
    ctx(mount_api::attach_at(&shm, dev, "shm"), || "attach /dev/shm".into())
}

/// A read-only clone of `dir`'s `sub` mounted over it, when there is one.
fn read_only_at(dir: &OwnedFd, sub: &str) -> Step<()> {
    if !exists_at(dir, sub, None) {
        return Ok(());
    }
    let tree = ctx(mount_api::readonly_clone_at(dir, sub), || format!("clone /proc/{sub}"))?;
    ctx(mount_api::attach_at(&tree, dir, sub), || {
        format!("make /proc/{sub} read-only")
    })
}

/// Whether `dir` holds `name` (of type `kind`, if given), not following a
/// final symlink.
fn exists_at(dir: &OwnedFd, name: &str, kind: Option<SFlag>) -> bool {
    nix::sys::stat::fstatat(Some(dir.as_raw_fd()), name, AtFlags::AT_SYMLINK_NOFOLLOW)
        .is_ok_and(|st| kind.is_none_or(|k| SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == k))
}

/// An empty, read-only tmpfs, `nosuid,nodev,noexec`, detached.
fn empty_tmpfs() -> Step<OwnedFd> {
    new_mount(
        "tmpfs",
        &[("source", "tmpfs"), ("size", "0"), ("mode", "555")],
        mount_api::MOUNT_ATTR_RDONLY
            | mount_api::MOUNT_ATTR_NOSUID
            | mount_api::MOUNT_ATTR_NODEV
            | mount_api::MOUNT_ATTR_NOEXEC,
    )
}

/// A detached mount of a new `fs_type` with string `options`; one with
/// `MOUNT_ATTR_RDONLY` is read-only in its superblock too.
fn new_mount(fs_type: &str, options: &[(&str, &str)], attrs: u64) -> Step<OwnedFd> {
    let fs = ctx(mount_api::fsopen(fs_type), || format!("open a {fs_type} context"))?;
    for (key, value) in options {
        ctx(mount_api::set_str(&fs, key, value), || {
            format!("{fs_type} option {key}={value}")
        })?;
    }
    if attrs & mount_api::MOUNT_ATTR_RDONLY != 0 {
        ctx(mount_api::set_flag(&fs, "ro"), || format!("{fs_type} option ro"))?;
    }
    ctx(mount_api::create(&fs, attrs), || format!("mount a {fs_type}"))
}

/// A minimal `/dev` owned by the sandbox's root (host id `base`), as a
/// detached tmpfs: its nodes, links and directories are made relative to
/// the mount, which `setup_root` attaches.
fn make_dev(base: u32) -> Step<OwnedFd> {
    let id = base.to_string();
    let dev = new_mount(
        "tmpfs",
        &[
            ("source", "tmpfs"),
            ("mode", "755"),
            // Device nodes, links and directories hold no data: a little
            // room for a socket or lock file a program makes there, not
            // for the sandbox's memory.
            ("size", "1m"),
            ("uid", &id),
            ("gid", &id),
        ],
        mount_api::MOUNT_ATTR_NOSUID | mount_api::MOUNT_ATTR_STRICTATIME,
    )?;
    let at = Some(dev.as_raw_fd());
    let owner = (
        Some(nix::unistd::Uid::from_raw(base)),
        Some(nix::unistd::Gid::from_raw(base)),
    );
    let chown = |name: &str| {
        ctx(
            nix::unistd::fchownat(at, name, owner.0, owner.1, AtFlags::AT_SYMLINK_NOFOLLOW),
            || format!("chown /dev/{name}"),
        )
    };
    let nodes: [(&str, u64, u64); 6] = [
        ("null", 1, 3),
        ("zero", 1, 5),
        ("full", 1, 7),
        ("random", 1, 8),
        ("urandom", 1, 9),
        ("tty", 5, 0),
    ];
    for (name, major, minor) in nodes {
        ctx(
            mknodat(
                at,
                name,
                SFlag::S_IFCHR,
                Mode::from_bits_truncate(0o666),
                makedev(major, minor),
            ),
            || format!("create /dev/{name}"),
        )?;
        // mknod applies the umask.
        ctx(
            nix::sys::stat::fchmodat(at, name, Mode::from_bits_truncate(0o666), FchmodatFlags::FollowSymlink),
            || format!("chmod /dev/{name}"),
        )?;
        chown(name)?;
    }
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        ctx(nix::unistd::symlinkat(target, at, link), || format!("link /dev/{link}"))?;
        chown(link)?;
    }
    for dir in ["pts", "shm"] {
        ctx(
            nix::sys::stat::mkdirat(at, dir, Mode::from_bits_truncate(0o755)),
            || format!("create /dev/{dir}"),
        )?;
        chown(dir)?;
    }
    Ok(dev)
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
