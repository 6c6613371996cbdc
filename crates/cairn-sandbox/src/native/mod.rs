//! The native driver: our own runtime on Linux namespaces, cgroups,
//! seccomp and overlayfs.
//!
//! The driver decides the sandbox's shape (layers, limits, capabilities,
//! seccomp filter) and spawns `cairn-init --native-setup` with it, using
//! `posix_spawn` (a vfork: the host process's memory is never copied, which
//! matters on hosts where fork is expensive, and is safe from any thread).
//! Init creates the namespaces, forks PID 1 and builds the root while the
//! driver makes the sandbox's cgroups, which PID 1 joins once told they
//! exist (see cairn-init's `native` module). The overlay and every other
//! mount live only in the sandbox's mount namespace and vanish with its last
//! process; nothing is mounted on the host but a sandbox's disk (`--disk`:
//! [`crate::disk`]), which init's mount namespace copies from the host's.

mod caps;
pub mod layers;
pub mod seccomp;

use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use cairn_layers::archive::HostIds;
use cairn_protocol::{NativeSetup, PROTOCOL_VERSION};

use crate::cgroup::Hierarchy;
use crate::{pid_start_time, Capabilities, Driver, SandboxError, SandboxProcess, SandboxSpec};

/// The overlay mount options for `spec`'s root, for the gVisor driver,
/// which mounts the same root with a classic mount (its options must fit in
/// one page).
pub(crate) fn overlay_options(spec: &SandboxSpec) -> Result<String, String> {
    let lowers = lower_dirs(spec).map_err(|e| e.to_string())?;
    let writable = crate::disk::writable_dir(&spec.dir);
    let dir = writable.to_str().ok_or("the sandbox directory is not UTF-8")?;
    let options = format!("lowerdir={},upperdir={dir}/upper,workdir={dir}/work", lowers.join(":"));
    if options.len() >= 4000 {
        return Err(format!(
            "{} layers make overlay options longer than one page",
            lowers.len()
        ));
    }
    Ok(options)
}

/// The host ids a native sandbox's user namespace maps its ids to: sandbox
/// root is host uid and gid 1879048192 (0x7000_0000), an id no host
/// account has and outside the ranges systemd hands to its own containers
/// (524288..1879048191); 65536 ids, like a subordinate range in
/// `/etc/subuid`. Every native sandbox shares the range (as Podman's and
/// LXC's root containers do): a process that escaped one lands as an
/// unprivileged host id that owns nothing outside the state directory.
pub const HOST_IDS: HostIds = HostIds {
    base: 0x7000_0000,
    count: 65536,
};

pub struct NativeDriver {
    cgroups: Hierarchy,
    /// The state directory: the layer probe's cache and scratch, and the
    /// shifted copies of layers ([`layers`]).
    state_dir: PathBuf,
    /// How layers reach overlayfs on this kernel, once a start found out
    /// (a failed probe is tried again at the next start).
    layer_mount: Mutex<Option<layers::Mechanism>>,
    /// Sandboxes get [`seccomp::programs`] unless a test set another filter.
    seccomp: Option<Vec<Vec<cairn_protocol::BpfInstruction>>>,
    /// An init started ahead for the next sandbox ([`NativeDriver::start_init_ahead`]).
    waiting: Mutex<Option<Ahead>>,
    /// Whether each start leaves the next init waiting (long-lived processes).
    keep_waiting: std::sync::atomic::AtomicBool,
}

impl NativeDriver {
    /// `scope` keeps this driver's cgroups apart from other state
    /// directories' on the same host; `state_dir` is the state directory,
    /// on the filesystem its sandboxes' layers live on.
    pub fn new(scope: &str, state_dir: &Path) -> Result<NativeDriver, SandboxError> {
        Ok(NativeDriver {
            cgroups: Hierarchy::detect(scope)?,
            state_dir: state_dir.to_path_buf(),
            layer_mount: Mutex::new(None),
            seccomp: None,
            waiting: Mutex::new(None),
            keep_waiting: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Starts sandboxes with `programs` for a seccomp filter: for tests that
    /// show a refusal is what stops a call (see
    /// [`seccomp::programs_also_allowing`]).
    #[doc(hidden)]
    pub fn with_seccomp(self, programs: Vec<Vec<cairn_protocol::BpfInstruction>>) -> NativeDriver {
        NativeDriver {
            seccomp: Some(programs),
            ..self
        }
    }

    pub fn cgroups(&self) -> &Hierarchy {
        &self.cgroups
    }

    /// How this driver gives layers to overlayfs: `CAIRN_LAYER_MOUNT`'s
    /// way, or the best the kernel took in the probe ([`layers`]), found
    /// once per driver (and kept per kernel in the state directory).
    pub fn layer_mechanism(&self, init_binary: &Path) -> Result<layers::Mechanism, SandboxError> {
        let mut known = self.layer_mount.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(way) = *known {
            return Ok(way);
        }
        let way = layers::wanted()
            .and_then(|wanted| layers::cached_probe(&self.state_dir, init_binary)?.choose(wanted))
            .map_err(SandboxError::Start)?;
        *known = Some(way);
        Ok(way)
    }

    /// The lower layers as init mounts them: the layers themselves, or
    /// their shifted copies (made now where missing).
    fn mounted_layers(&self, spec: &SandboxSpec, way: layers::Mechanism) -> Result<Vec<String>, SandboxError> {
        let lowers = lower_dirs(spec)?;
        if way != layers::Mechanism::Shifted {
            return Ok(lowers);
        }
        lowers
            .iter()
            .map(|l| {
                let copy = layers::ensure_shifted(&self.state_dir, Path::new(l)).map_err(SandboxError::Start)?;
                copy.to_str()
                    .map(str::to_string)
                    .ok_or_else(|| SandboxError::Start(format!("{} is not UTF-8", copy.display())))
            })
            .collect()
    }

    fn setup(&self, spec: &SandboxSpec) -> Result<NativeSetup, SandboxError> {
        let way = self.layer_mechanism(&spec.init_binary)?;
        let seccomp = match &self.seccomp {
            Some(programs) => programs.clone(),
            None => seccomp::programs(),
        };
        let path = |p: &std::path::Path| {
            p.to_str()
                .map(str::to_string)
                .ok_or_else(|| SandboxError::Start(format!("{} is not UTF-8", p.display())))
        };
        Ok(NativeSetup {
            version: PROTOCOL_VERSION,
            cgroup_procs: self
                .cgroups
                .cgroup(&spec.id)
                .procs_files()
                .iter()
                .map(|p| path(p))
                .collect::<Result<_, _>>()?,
            rootfs: path(&spec.dir.join("rootfs"))?,
            lower_dirs: self.mounted_layers(spec, way)?,
            layer_mount: way.layer_mount(),
            upper_dir: path(&crate::disk::writable_dir(&spec.dir).join("upper"))?,
            work_dir: path(&crate::disk::writable_dir(&spec.dir).join("work"))?,
            shm_bytes: shm_bytes(&spec.limits),
            hostname: spec.hostname.clone(),
            host_id_base: HOST_IDS.base,
            id_count: HOST_IDS.count,
            keep_capabilities: caps::keep_mask(),
            seccomp,
            network: spec
                .network
                .as_ref()
                .map(|n| {
                    Ok::<_, SandboxError>(cairn_protocol::NetSetup {
                        address: n.address.octets(),
                        prefix_len: n.prefix_len,
                        gateway: n.gateway.octets(),
                        resolv_conf: path(&n.resolv_conf)?,
                        hosts: n.hosts.as_deref().map(path).transpose()?,
                    })
                })
                .transpose()?,
        })
    }

    /// Hands `spec`'s setup to an init (the one waiting, or a fresh one);
    /// `first`, when given, is sent to the sandbox's socket then, and comes
    /// back pending from [`Starting::finish`]. The sandbox's cgroups need
    /// not exist yet: init joins them once [`Launch::report`] says go.
    fn begin(&self, spec: &SandboxSpec, first: Option<&cairn_protocol::ExecRequest>) -> Result<Launch, SandboxError> {
        let socket = spec.socket_path();
        if socket.as_os_str().len() >= 100 {
            return Err(SandboxError::SocketPathTooLong(spec.dir.clone()));
        }
        // A sandbox with a disk has its upper and work directories on it,
        // mounted (and made, the first time) before init copies the host's
        // mount table.
        match spec.limits.disk_bytes {
            Some(bytes) => crate::disk::prepare(&spec.dir, bytes, HOST_IDS.base)?,
            None => drop(crate::disk::upper_dir(&spec.dir)?),
        }
        let writable = crate::disk::writable_dir(&spec.dir);
        for sub in ["upper", "work", "rootfs"] {
            let d = if sub == "rootfs" {
                spec.dir.join(sub)
            } else {
                writable.join(sub)
            };
            if d.is_dir() {
                continue;
            }
            fs::create_dir_all(&d).map_err(|e| SandboxError::setup(format!("create {}", d.display()), e))?;
            // The upper directory is the sandbox's `/`, owned by its root,
            // 0755 whatever the umask of the process starting it.
            if sub == "upper" {
                std::os::unix::fs::chown(&d, Some(HOST_IDS.base), Some(HOST_IDS.base))
                    .map_err(|e| SandboxError::setup(format!("chown {}", d.display()), e))?;
                fs::set_permissions(&d, fs::Permissions::from_mode(crate::ROOT_MODE))
                    .map_err(|e| SandboxError::setup(format!("chmod {}", d.display()), e))?;
            }
        }
        let setup = self.setup(spec)?;
        let _ = fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket)
            .map_err(|e| SandboxError::setup(format!("listen on {}", socket.display()), e))?;
        let console = OpenOptions::new()
            .create(true)
            .append(true)
            .open(spec.console_log())
            .map_err(|e| SandboxError::setup("open the console log", e))?;
        let (init, ahead) = match self.take_waiting().filter(|w| w.binary == spec.init_binary) {
            Some(init) => (init, true),
            None => (WaitingInit::spawn(&spec.init_binary)?, false),
        };
        let mut launch = Launch {
            init,
            ahead,
            handed: Ok(()),
            listener,
            console,
            setup,
            pending: None,
        };
        launch.handed = launch.hand();
        // The first command goes to the listening socket once, whichever
        // init serves it: it is accepted as soon as init serves. A failure
        // to send leaves it to the caller.
        if let Some(req) = first {
            launch.pending = crate::client::InitClient::new(&socket).send_exec(req.clone()).ok();
        }
        // The next sandbox's init starts while this one builds its root,
        // when this process has nothing else to do.
        if self.keep_waiting.load(std::sync::atomic::Ordering::Relaxed) {
            self.start_init_ahead(&spec.init_binary);
        }
        Ok(launch)
    }

    /// Reads init's report to its end (see [`Launch`]); an init started
    /// ahead that died before it reported anything (it never forked PID
    /// 1) is replaced by a fresh one.
    fn finish(
        &self,
        spec: &SandboxSpec,
        mut launch: Launch,
    ) -> Result<(SandboxProcess, Option<crate::client::PendingExec>), SandboxError> {
        let (mut read, mut text) = launch.report(spec);
        if launch.ahead && read.is_err() && text.is_empty() {
            launch.init = WaitingInit::spawn(&spec.init_binary)?;
            launch.ahead = false;
            launch.handed = launch.hand();
            (read, text) = launch.report(spec);
        }
        let Launch { pending, .. } = launch;
        read.map_err(|e| SandboxError::Start(format!("set up the sandbox: {e}")))?;
        Ok((parse_report(&text)?, pending))
    }

    /// Starts `spec`'s sandbox in two steps, so that the caller can work
    /// while init builds it: this one hands init its setup (and `first`
    /// then, if given, so that init starts it the moment it serves), and
    /// creates the cgroups while init builds the root; [`Starting::finish`]
    /// tells init to join them and waits for it. On error nothing is left
    /// behind: an init whose socket closes before it is told to go exits.
    pub fn start_begin(
        &self,
        spec: &SandboxSpec,
        first: Option<&cairn_protocol::ExecRequest>,
    ) -> Result<Starting, SandboxError> {
        let made = self.begin(spec, first).and_then(|launch| {
            self.cgroups.create(&spec.id, &spec.limits)?;
            Ok(launch)
        });
        match made {
            Ok(launch) => Ok(Starting {
                spec: spec.clone(),
                launch,
                oom_kills_before: self.oom_kills(&spec.id),
            }),
            Err(e) => {
                let _ = self.stop(&spec.id, None);
                Err(e)
            }
        }
    }

    /// The pid of the init waiting for the next sandbox, if one is.
    #[doc(hidden)]
    pub fn waiting_init(&self) -> Option<u32> {
        let init = self.take_waiting()?;
        let pid = init.child.id();
        *self.waiting.lock().unwrap_or_else(|p| p.into_inner()) = Some(Ahead::Waiting(Some(init)));
        Some(pid)
    }

    /// The init started ahead, once its spawn is done; `None` when there is
    /// none (or its spawn failed).
    fn take_waiting(&self) -> Option<WaitingInit> {
        let ahead = self.waiting.lock().unwrap_or_else(|p| p.into_inner()).take()?;
        ahead.into_init()
    }

    /// Keeps an init waiting for the next sandbox from now on: one now, and
    /// one more during each start (while the sandbox builds its root), so
    /// that a long-lived process (`cairn serve`) never waits for init's own
    /// start. It costs one sleeping process.
    pub fn keep_init_waiting(&self, init_binary: &Path) {
        self.keep_waiting.store(true, std::sync::atomic::Ordering::Relaxed);
        self.start_init_ahead(init_binary);
    }

    /// Starts `cairn-init` for the next sandbox now, so that its exec and its
    /// C library's start (half a millisecond of `cpuid` on some VMs) overlap
    /// with this process's own work until then. It waits for its setup; an
    /// unused one is killed when the driver is dropped.
    ///
    /// The spawn runs on a thread of its own, so that this one does not wait
    /// for init's exec; the start that takes the init waits for the spawn if
    /// need be.
    pub fn start_init_ahead(&self, init_binary: &Path) {
        let mut waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        if waiting.is_some() {
            return;
        }
        let first = {
            let mut first = FIRST.lock().unwrap_or_else(|p| p.into_inner());
            first.take_if(|init| init.binary == init_binary)
        };
        if let Some(init) = first {
            *waiting = Some(Ahead::Waiting(Some(init)));
            return;
        }
        let binary = init_binary.to_path_buf();
        let spawned = std::thread::Builder::new()
            .name("init-ahead".into())
            .spawn(move || WaitingInit::spawn(&binary));
        match spawned {
            Ok(thread) => *waiting = Some(Ahead::Spawning(Some(thread))),
            // No thread to spare: spawned here.
            Err(_) => match WaitingInit::spawn(init_binary) {
                Ok(init) => *waiting = Some(Ahead::Waiting(Some(init))),
                Err(e) => tracing::debug!("cannot start cairn-init ahead: {e}"),
            },
        }
    }
}

/// The init [`start_init_first`] started, until a driver takes it.
static FIRST: Mutex<Option<WaitingInit>> = Mutex::new(None);

/// Starts `cairn-init` now, before this process has a driver: a command
/// that is about to start a native sandbox calls it first thing, before
/// even parsing its command line, so that init's exec and its C library's
/// start, the namespaces it makes before its setup arrives and the fork of
/// PID 1 are done by the time the driver hands it the setup.
/// [`NativeDriver::start_init_ahead`] takes it when `init_binary` is the
/// driver's; one nothing takes exits with this process, whose end of its
/// socket then closes.
pub fn start_init_first(init_binary: &Path) {
    match WaitingInit::spawn(init_binary) {
        Ok(init) => *FIRST.lock().unwrap_or_else(|p| p.into_inner()) = Some(init),
        Err(e) => tracing::debug!("cannot start cairn-init first: {e}"),
    }
}

/// An init started ahead: spawning on its thread, or spawned and waiting.
/// Dropped unused (with its driver), it is killed, its spawn finished first
/// if it was still under way.
enum Ahead {
    Spawning(Option<std::thread::JoinHandle<Result<WaitingInit, SandboxError>>>),
    Waiting(Option<WaitingInit>),
}

impl Ahead {
    fn into_init(mut self) -> Option<WaitingInit> {
        match &mut self {
            Ahead::Waiting(init) => init.take(),
            Ahead::Spawning(thread) => match thread.take()?.join() {
                Ok(Ok(init)) => Some(init),
                Ok(Err(e)) => {
                    tracing::debug!("cannot start cairn-init ahead: {e}");
                    None
                }
                Err(_) => None,
            },
        }
    }
}

impl Drop for Ahead {
    fn drop(&mut self) {
        if let Ahead::Spawning(thread) = self {
            if let Some(thread) = thread.take() {
                drop(thread.join());
            }
        }
    }
}

/// A native sandbox whose init has its setup ([`NativeDriver::start_begin`]).
pub struct Starting {
    spec: SandboxSpec,
    launch: Launch,
    oom_kills_before: u64,
}

impl Starting {
    /// Waits for init to report the sandbox ready; on error the sandbox's
    /// processes and cgroups are gone.
    pub fn finish(self, driver: &NativeDriver) -> Result<(SandboxProcess, Option<crate::FirstExec>), SandboxError> {
        let Starting {
            spec,
            launch,
            oom_kills_before,
        } = self;
        match driver.finish(&spec, launch) {
            Ok((process, pending)) => Ok((
                process,
                pending.map(|pending| crate::FirstExec {
                    pending,
                    oom_kills_before,
                }),
            )),
            Err(e) => {
                let _ = driver.stop(&spec.id, None);
                Err(e)
            }
        }
    }
}

/// One start's init, with what it is handed: the listening socket, the
/// console log and the setup.
struct Launch {
    init: WaitingInit,
    /// Whether `init` was started ahead (and may have died waiting).
    ahead: bool,
    /// How handing `init` its setup went.
    handed: std::io::Result<()>,
    listener: UnixListener,
    console: fs::File,
    setup: NativeSetup,
    pending: Option<crate::client::PendingExec>,
}

impl Launch {
    /// Sends init its socket, console and setup.
    fn hand(&mut self) -> std::io::Result<()> {
        send_fds(&self.init.report, &self.listener, &self.console)?;
        cairn_protocol::write_frame(&mut self.init.report, &self.setup).map_err(std::io::Error::other)
    }

    /// Reads init's report to the end: `P<pid>`, then (with a network) the
    /// veth goes into the sandbox's namespace, and init is told `G` (its
    /// cgroups exist by now), then `R` or `E<message>`.
    fn report(&mut self, spec: &SandboxSpec) -> (std::io::Result<()>, String) {
        let mut text = String::new();
        if let Err(e) = std::mem::replace(&mut self.handed, Ok(())) {
            return (Err(e), text);
        }
        let report = &mut self.init.report;
        let read = read_pid(report, &mut text).and_then(|pid| {
            let Some(pid) = pid else {
                return report.read_to_string(&mut text).map(drop);
            };
            if let Some(plan) = &spec.network {
                crate::net::link::create(plan, pid).map_err(|e| std::io::Error::other(e.to_string()))?;
            }
            // A PID 1 that failed before it read `G` has reported why and
            // exited: the write may find it gone, and the read then ends
            // in a reset (the `G` it never read), after its message.
            let _ = report.write_all(b"G\n");
            match report.read_to_string(&mut text) {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(()),
                read => read.map(drop),
            }
        });
        let _ = self.init.child.wait();
        (read, text)
    }
}

/// A `cairn-init --native-setup` started, waiting for its setup on `report`.
struct WaitingInit {
    child: Child,
    report: UnixStream,
    binary: PathBuf,
}

impl WaitingInit {
    fn spawn(binary: &Path) -> Result<WaitingInit, SandboxError> {
        let (report, init_end) = UnixStream::pair().map_err(|e| SandboxError::setup("create a socket pair", e))?;
        let mut cmd = Command::new(binary);
        cmd.arg0("cairn-init")
            .arg("--native-setup")
            .arg(format!("{}:{}", HOST_IDS.base, HOST_IDS.count))
            .env_clear()
            .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(Stdio::null())
            .stdout(Stdio::from(OwnedFd::from(init_end)))
            .stderr(Stdio::null());
        let child =
            while_busy(|| cmd.spawn()).map_err(|e| SandboxError::setup(format!("start {}", binary.display()), e))?;
        // Our copy of the child's end must close, or the report never ends.
        drop(cmd);
        Ok(WaitingInit {
            child,
            report,
            binary: binary.to_path_buf(),
        })
    }
}

impl Drop for WaitingInit {
    /// An init that got no setup has nothing yet (no namespace, no cgroup):
    /// killing it is all.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends init its listening socket and console log (see
/// [`cairn_protocol::SETUP_FDS_MARKER`]).
fn send_fds(report: &UnixStream, listener: &UnixListener, console: &fs::File) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    use std::os::fd::AsRawFd;
    let fds = [listener.as_raw_fd(), console.as_raw_fd()];
    let iov = [std::io::IoSlice::new(&[cairn_protocol::SETUP_FDS_MARKER])];
    let sent = sendmsg::<()>(
        report.as_raw_fd(),
        &iov,
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?;
    if sent != 1 {
        return Err(std::io::Error::other("the descriptors' byte was not sent"));
    }
    Ok(())
}

/// Runs `spawn` (a spawn of an executable this process may just have
/// installed) again while it fails with ETXTBSY, up to half a second:
/// another thread of this process may be spawning while a third writes an
/// executable (another init install, a download); that child holds the
/// write descriptor until it execs, and the kernel refuses to run a file
/// open for writing. The window is one spawn long.
pub(crate) fn while_busy<T>(mut spawn: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    let mut busy = 0;
    loop {
        match spawn() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && busy < 100 => {
                busy += 1;
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            done => return done,
        }
    }
}

/// The size of a sandbox's `/dev/shm`: half its memory limit. Its pages are
/// charged to the sandbox's memory cgroup like any process's, so a tmpfs
/// the size of the limit could take all of it, and the OOM killer would
/// pick some process whose own memory is small (tmpfs pages belong to no
/// process); at half, a writer filling it gets ENOSPC and the processes
/// keep the other half.
fn shm_bytes(limits: &crate::Limits) -> u64 {
    (limits.memory_bytes / 2) & !4095
}

/// The lower layers as host paths, checked for what overlayfs refuses.
fn lower_dirs(spec: &SandboxSpec) -> Result<Vec<String>, SandboxError> {
    if spec.layers.is_empty() {
        return Err(SandboxError::Start("a sandbox needs at least one image layer".into()));
    }
    // overlayfs stacks at most 500 layers.
    if spec.layers.len() > 500 {
        return Err(SandboxError::Start(format!(
            "{} layers are more than overlayfs stacks (500); make a one-layer copy of the snapshot with `cairn snapshot flatten ID` and restore that",
            spec.layers.len()
        )));
    }
    spec.layers
        .iter()
        .map(|layer| {
            let s = layer
                .to_str()
                .ok_or_else(|| SandboxError::Start(format!("layer path {} is not UTF-8", layer.display())))?;
            if s.contains([':', ',', '\\']) {
                return Err(SandboxError::Start(format!(
                    "layer path {s} contains ':', ',' or '\\', which overlayfs cannot take"
                )));
            }
            Ok(s.to_string())
        })
        .collect()
}

/// Reads the report up to `P<pid>\n` (or its end, or an error), keeping
/// what it read in `text`.
fn read_pid(report: &mut UnixStream, text: &mut String) -> std::io::Result<Option<i32>> {
    let mut byte = [0u8; 1];
    loop {
        if report.read(&mut byte)? == 0 {
            return Ok(None);
        }
        text.push(byte[0] as char);
        if byte[0] == b'\n' {
            if let Some(pid) = text.lines().find_map(|l| l.strip_prefix('P')) {
                return Ok(pid.parse().ok());
            }
        }
        if text.len() > 65536 {
            return Ok(None);
        }
    }
}

/// `P<pid>\n` once PID 1 has its setup and `R\n` once it is ready;
/// `E<message>` (the rest of the text) on failure.
fn parse_report(report: &str) -> Result<SandboxProcess, SandboxError> {
    let (mut pid, mut ready) = (None, false);
    let mut rest = report;
    while !rest.is_empty() {
        if let Some(err) = rest.strip_prefix('E') {
            return Err(SandboxError::Start(err.to_string()));
        }
        let (line, tail) = rest.split_once('\n').unwrap_or((rest, ""));
        match line.split_at_checked(1) {
            Some(("P", p)) => pid = p.parse::<i32>().ok(),
            Some(("R", "")) => ready = true,
            _ => return Err(SandboxError::Start(format!("garbled start report {report:?}"))),
        }
        rest = tail;
    }
    let (Some(pid), true) = (pid, ready) else {
        return Err(SandboxError::Start(format!(
            "cairn-init died while setting up the sandbox (report {report:?})"
        )));
    };
    let start_time =
        pid_start_time(pid).ok_or_else(|| SandboxError::Start("cairn-init exited right after starting".into()))?;
    Ok(SandboxProcess { pid, start_time })
}

impl Driver for NativeDriver {
    fn name(&self) -> &'static str {
        "native"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            memory_snapshots: false,
            host_ids: Some(HOST_IDS),
        }
    }

    fn start(&self, spec: &SandboxSpec) -> Result<SandboxProcess, SandboxError> {
        Ok(self.start_begin(spec, None)?.finish(self)?.0)
    }

    fn stop(&self, id: &str, process: Option<SandboxProcess>) -> Result<(), SandboxError> {
        let cgroup = self.cgroups.cgroup(id);
        // Killing PID 1 takes the whole pid namespace with it; the cgroup
        // sweep catches anything that escaped the namespace.
        if let Some(p) = process.filter(|p| p.alive()) {
            let _ = cgroup.thaw();
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p.pid), nix::sys::signal::Signal::SIGKILL);
        }
        cgroup.kill_all()?;
        // PID 1 of a pid namespace finishes dying only after every process
        // in the namespace is gone; stop returns once it has.
        if let Some(p) = process {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while p.alive() {
                if std::time::Instant::now() > deadline {
                    return Err(SandboxError::Stop(format!(
                        "process {} outlived SIGKILL for 10 s",
                        p.pid
                    )));
                }
                std::thread::sleep(std::time::Duration::from_micros(500));
            }
        }
        cgroup.remove()?;
        Ok(())
    }

    fn freeze(&self, id: &str) -> Result<(), SandboxError> {
        Ok(self.cgroups.cgroup(id).freeze()?)
    }

    fn thaw(&self, id: &str) -> Result<(), SandboxError> {
        Ok(self.cgroups.cgroup(id).thaw()?)
    }

    fn frozen(&self, id: &str) -> bool {
        self.cgroups.cgroup(id).is_frozen()
    }

    fn usage(&self, id: &str) -> crate::cgroup::Usage {
        self.cgroups.cgroup(id).usage()
    }

    fn oom_kills(&self, id: &str) -> u64 {
        self.cgroups.cgroup(id).oom_kills()
    }

    fn leftovers(&self) -> Vec<String> {
        self.cgroups.sandbox_ids()
    }
}

#[cfg(test)]
mod tests {
    use super::parse_report;

    #[test]
    fn reports_parse_in_either_order_and_errors_win() {
        let me = std::process::id();
        assert_eq!(parse_report(&format!("P{me}\nR\n")).unwrap().pid as u32, me);
        assert_eq!(parse_report(&format!("R\nP{me}\n")).unwrap().pid as u32, me);
        let err = parse_report(&format!("P{me}\nEmount the overlay root: ENOENT")).unwrap_err();
        assert!(err.to_string().contains("mount the overlay root"), "{err}");
        assert!(parse_report(&format!("P{me}\n"))
            .unwrap_err()
            .to_string()
            .contains("died"));
        assert!(parse_report("garbage").is_err());
    }
}
