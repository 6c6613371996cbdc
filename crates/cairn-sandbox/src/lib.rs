//! Sandbox drivers: one trait, one module per driver.
//!
//! A driver turns a [`SandboxSpec`] (a root made of read-only layers plus a
//! private upper directory, limits, a host name) into a running sandbox whose
//! PID 1 is `cairn-init`, and tears it down again. Everything above talks to
//! the sandbox through [`client::InitClient`], whatever the driver.

pub mod cgroup;
pub mod client;
pub mod disk;
pub mod gvisor;
pub mod init_binary;
pub mod init_socket;
pub mod limits;
pub mod native;
pub mod net;

use std::path::{Path, PathBuf};

pub use limits::{Limits, LimitsError};
// Process liveness by start time lives with the chunk store, whose
// temporaries name their writers the same way.
pub use cairn_store::process::{pid_start_time, process_alive};

/// What a driver can do; declared, never faked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// Snapshots include memory and running processes.
    pub memory_snapshots: bool,
    /// The sandbox's files are written through a user namespace whose ids
    /// are these host ids; captures record them as the sandbox's own.
    pub host_ids: Option<cairn_layers::archive::HostIds>,
}

/// The mode of a new sandbox's upper directory, which overlayfs shows as
/// its `/`: every user of the sandbox reaches the files under it, as on a
/// usual host, whatever the umask of the process starting it.
pub const ROOT_MODE: u32 = 0o755;

/// Everything a driver needs to start one sandbox.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    /// Sandbox id; names its cgroup.
    pub id: String,
    /// Host name inside the sandbox.
    pub hostname: String,
    /// The sandbox's private directory on the host: `upper/`, `work/` (or
    /// `disk.img` and `disk/` holding them: [`disk`]),
    /// `rootfs/`, `console.log` and init's socket (`init.sock`, or `uds/`
    /// for gVisor) live here.
    pub dir: PathBuf,
    /// Read-only layers, topmost first.
    pub layers: Vec<PathBuf>,
    pub limits: Limits,
    /// The static cairn-init executable on the host.
    pub init_binary: PathBuf,
    /// `--network egress`: the leased address the sandbox gets.
    pub network: Option<net::NetPlan>,
}

impl SandboxSpec {
    /// Where the native driver binds init's socket.
    pub fn socket_path(&self) -> PathBuf {
        self.dir.join("init.sock")
    }
    /// The upper directory: on the sandbox's disk when it has one
    /// ([`disk`]).
    pub fn upper_dir(&self) -> PathBuf {
        disk::writable_dir(&self.dir).join("upper")
    }
    pub fn console_log(&self) -> PathBuf {
        self.dir.join("console.log")
    }
}

/// A started sandbox: enough to find it again after the host process exits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SandboxProcess {
    /// Host pid of cairn-init.
    pub pid: i32,
    /// Its start time in clock ticks since boot, which tells a live sandbox
    /// from a recycled pid.
    pub start_time: u64,
}

impl SandboxProcess {
    pub fn alive(&self) -> bool {
        process_alive(self.pid, self.start_time)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("{0}")]
    Limits(#[from] LimitsError),
    #[error(transparent)]
    Cgroup(#[from] cgroup::CgroupError),
    #[error("cannot set up the sandbox: {what}: {source}")]
    Setup {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the sandbox failed to start: {0}")]
    Start(String),
    #[error("the sandbox directory path {0} is too long for a Unix socket (108 bytes); use a shorter CAIRN_HOME")]
    SocketPathTooLong(PathBuf),
    #[error("cannot stop the sandbox: {0}")]
    Stop(String),
    #[error(transparent)]
    Gvisor(#[from] gvisor::GvisorError),
    #[error(transparent)]
    Disk(#[from] disk::DiskError),
}

impl SandboxError {
    pub(crate) fn setup(what: impl Into<String>, source: impl Into<std::io::Error>) -> Self {
        SandboxError::Setup {
            what: what.into(),
            source: source.into(),
        }
    }
}

/// A sandbox's first command, sent while the sandbox started
/// ([`native::NativeDriver::start_begin`]).
#[derive(Debug)]
pub struct FirstExec {
    pub pending: client::PendingExec,
    /// The sandbox's OOM-kill count before the command was sent (a pooled
    /// cgroup keeps its count).
    pub oom_kills_before: u64,
}

/// A way of running sandboxes.
pub trait Driver: Send + Sync {
    /// The driver's name as users write it (`--driver native`).
    fn name(&self) -> &'static str;
    fn capabilities(&self) -> Capabilities;
    /// Starts a sandbox; on error nothing is left behind.
    fn start(&self, spec: &SandboxSpec) -> Result<SandboxProcess, SandboxError>;
    /// Kills every process of the sandbox and removes its cgroups. Idempotent:
    /// safe on a sandbox that is already dead or half cleaned.
    fn stop(&self, id: &str, process: Option<SandboxProcess>) -> Result<(), SandboxError>;
    /// Stops every process of the sandbox at once, so its files can be
    /// captured consistently; [`Driver::thaw`] lets them go on.
    fn freeze(&self, id: &str) -> Result<(), SandboxError>;
    fn thaw(&self, id: &str) -> Result<(), SandboxError>;
    /// Whether the sandbox is frozen now.
    fn frozen(&self, id: &str) -> bool;
    /// What the sandbox's processes use now (CPU time, memory).
    fn usage(&self, id: &str) -> cgroup::Usage;
    /// Processes killed by the OOM killer in this sandbox so far.
    fn oom_kills(&self, id: &str) -> u64;
    /// Sandbox ids that have resources on this host (for garbage collection).
    fn leftovers(&self) -> Vec<String>;
    /// A client for the init of the sandbox whose directory is `dir`.
    fn client(&self, dir: &Path) -> client::InitClient {
        client::InitClient::new(dir.join("init.sock"))
    }
}
