//! Cgroup limits, freezing and cleanup, on cgroup v2 where the host has it
//! and on v1 controllers where it does not.
//!
//! Every sandbox gets `cairn/<scope>/<id>` in each hierarchy it uses, where
//! the scope names one state directory, so two Cairn homes on a host never
//! touch each other's sandboxes. On v1 that is one directory per controller
//! (memory, pids, cpu, freezer); on v2 one directory in the unified tree.
//! On v1 the memory cgroup of a removed sandbox goes into its scope's
//! [`pool`] rather than away, so that removals leave no dying memory
//! cgroups behind. v2 has no pool: its kernel refuses to rename a cgroup.

mod pool;

use std::fs;
use std::io::{self, ErrorKind};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::Limits;

const V1_CONTROLLERS: [&str; 4] = ["memory", "pids", "cpu", "freezer"];
/// The v2 controllers enabled for sandboxes (freezing is in every v2 cgroup).
const V2_CONTROLLERS: [&str; 3] = ["memory", "pids", "cpu"];
const CFS_PERIOD_US: u64 = 100_000;

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error(
        "no usable cgroup hierarchy under {0}: mount cgroup v2, or the v1 memory, pids, cpu and freezer controllers"
    )]
    NoHierarchy(PathBuf),
    #[error("cannot {what} {path}: {source} (Cairn needs root to manage cgroups)")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("processes of sandbox {0} did not exit within 10 s after SIGKILL")]
    StillBusy(String),
    #[error("cgroup {cgroup} did not become {want} within 10 s; a process may be stuck in the kernel (uninterruptible I/O), so retry once it has finished")]
    NotSettled { cgroup: PathBuf, want: &'static str },
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CgroupError + 'a {
    move |source| CgroupError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// How the host mounts cgroups, whichever of them Cairn uses ([`Hierarchy`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Only per-controller v1 mounts.
    V1,
    /// One unified v2 tree at the root.
    V2,
    /// v1 controllers with a v2 tree beside them (`unified/`), as systemd's
    /// hybrid mode mounts them.
    Hybrid,
}

impl Layout {
    /// The layout under `root` (`/sys/fs/cgroup`), from the file system
    /// types mounted there; None when no cgroup file system is.
    pub fn at(root: &Path) -> Option<Layout> {
        use nix::sys::statfs::{statfs, CGROUP2_SUPER_MAGIC, CGROUP_SUPER_MAGIC};
        let is = |path: &Path, magic| statfs(path).is_ok_and(|s| s.filesystem_type() == magic);
        if is(root, CGROUP2_SUPER_MAGIC) {
            return Some(Layout::V2);
        }
        let v1 = fs::read_dir(root)
            .map(|d| d.flatten().any(|e| is(&e.path(), CGROUP_SUPER_MAGIC)))
            .unwrap_or(false);
        match (v1, is(&root.join("unified"), CGROUP2_SUPER_MAGIC)) {
            (true, true) => Some(Layout::Hybrid),
            (true, false) => Some(Layout::V1),
            (false, _) => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Layout::V1 => "v1",
            Layout::V2 => "v2",
            Layout::Hybrid => "hybrid",
        }
    }
}

/// Which cgroup layout the host uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// One unified tree (`/sys/fs/cgroup`).
    V2 { root: PathBuf, scope: String },
    /// Separate per-controller mounts (`/sys/fs/cgroup/<controller>`).
    V1 { root: PathBuf, scope: String },
}

impl Hierarchy {
    /// Finds the hierarchy under `/sys/fs/cgroup`. Hosts with a hybrid
    /// layout whose v2 tree lacks the controllers use v1.
    pub fn detect(scope: &str) -> Result<Hierarchy, CgroupError> {
        Self::detect_at(Path::new("/sys/fs/cgroup"), scope)
    }

    pub fn detect_at(root: &Path, scope: &str) -> Result<Hierarchy, CgroupError> {
        let scope = scope.to_string();
        let v2_controllers = fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
        let has = |c: &str| v2_controllers.split_whitespace().any(|x| x == c);
        if has("memory") && has("pids") {
            return Ok(Hierarchy::V2 {
                root: root.to_path_buf(),
                scope,
            });
        }
        if V1_CONTROLLERS
            .iter()
            .all(|c| root.join(c).join("cgroup.procs").exists())
        {
            return Ok(Hierarchy::V1 {
                root: root.to_path_buf(),
                scope,
            });
        }
        Err(CgroupError::NoHierarchy(root.to_path_buf()))
    }

    pub fn version(&self) -> u8 {
        match self {
            Hierarchy::V2 { .. } => 2,
            Hierarchy::V1 { .. } => 1,
        }
    }

    /// The controllers sandboxes' limits and freezing use, each with
    /// whether this hierarchy offers it: mounted, on v1; listed in the
    /// root's `cgroup.controllers` on v2 (where freezing is the core's).
    pub fn controllers(&self) -> Vec<(&'static str, bool)> {
        match self {
            Hierarchy::V1 { root, .. } => V1_CONTROLLERS
                .iter()
                .map(|c| (*c, root.join(c).join("cgroup.procs").exists()))
                .collect(),
            Hierarchy::V2 { root, .. } => {
                let listed = fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
                V2_CONTROLLERS
                    .iter()
                    .map(|c| (*c, listed.split_whitespace().any(|x| x == *c)))
                    .collect()
            }
        }
    }

    /// On v2, whether the controllers can be enabled for this scope's
    /// sandboxes: each level above them (the root, `cairn`, the scope)
    /// either has them in its `cgroup.subtree_control` already or can take
    /// them. A level that is not the host's root (a container's cgroup
    /// namespace, say) and holds processes cannot (the kernel's rule that a
    /// cgroup with controllers below it has no processes of its own). Says
    /// how, or why not; None on v1, which has nothing to delegate.
    pub fn delegation(&self) -> Option<Result<String, String>> {
        let Hierarchy::V2 { root, .. } = self else {
            return None;
        };
        let mut enabled_at = Vec::new();
        for level in [root.clone(), root.join("cairn"), self.parent("")] {
            if !level.exists() {
                break;
            }
            let control = fs::read_to_string(level.join("cgroup.subtree_control")).unwrap_or_default();
            let missing: Vec<&str> = V2_CONTROLLERS
                .iter()
                .copied()
                .filter(|c| !control.split_whitespace().any(|x| x == *c))
                .collect();
            if missing.is_empty() {
                enabled_at.push(level.display().to_string());
                continue;
            }
            // Only the host's root cgroup has no `cgroup.type`.
            let is_host_root = !level.join("cgroup.type").exists();
            let procs = fs::read_to_string(level.join("cgroup.procs")).unwrap_or_default();
            if !is_host_root && !procs.trim().is_empty() {
                return Some(Err(format!(
                    "{} holds processes, so {} cannot be enabled below it",
                    level.display(),
                    missing.join(", ")
                )));
            }
            if nix::unistd::access(&level.join("cgroup.subtree_control"), nix::unistd::AccessFlags::W_OK).is_err() {
                return Some(Err(format!(
                    "{} lacks {} and cannot be written here",
                    level.join("cgroup.subtree_control").display(),
                    missing.join(", ")
                )));
            }
        }
        Some(Ok(if enabled_at.is_empty() {
            format!(
                "Cairn enables them in {} at first use",
                root.join("cgroup.subtree_control").display()
            )
        } else {
            format!("enabled in {}", enabled_at.join(", "))
        }))
    }

    /// The directory holding this scope's sandboxes in `controller`'s tree
    /// (the controller is ignored on v2).
    fn parent(&self, controller: &str) -> PathBuf {
        match self {
            Hierarchy::V2 { root, scope } => root.join("cairn").join(scope),
            Hierarchy::V1 { root, scope } => root.join(controller).join("cairn").join(scope),
        }
    }

    /// The sandbox's cgroup directories.
    pub fn dirs(&self, id: &str) -> Vec<PathBuf> {
        match self {
            Hierarchy::V2 { .. } => vec![self.parent("").join(id)],
            Hierarchy::V1 { .. } => V1_CONTROLLERS.iter().map(|c| self.parent(c).join(id)).collect(),
        }
    }

    /// Creates the sandbox's cgroups with `limits` applied. On error, what was
    /// created is removed again.
    pub fn create(&self, id: &str, limits: &Limits) -> Result<Cgroup, CgroupError> {
        let cgroup = Cgroup {
            hierarchy: self.clone(),
            id: id.to_string(),
        };
        // A scope directory is removed with its last sandbox (see
        // `Cgroup::remove`); one removed under this create is made again.
        let mut result = self.create_dirs(id, true);
        for _ in 0..5 {
            match &result {
                Err(CgroupError::Io { source, .. }) if source.kind() == ErrorKind::NotFound => {
                    result = self.create_dirs(id, true);
                }
                _ => break,
            }
        }
        let result = result.and_then(|reused| match cgroup.apply(limits) {
            // A pooled cgroup that cannot take the limits (its leftover
            // charges do not fit under a lower one, say) is dropped for a
            // fresh one.
            Err(_) if reused => {
                cgroup.remove_dirs(false)?;
                self.create_dirs(id, false)?;
                cgroup.apply(limits)
            }
            applied => applied,
        });
        if let Err(e) = result {
            let _ = cgroup.remove_dirs(false);
            return Err(e);
        }
        Ok(cgroup)
    }

    /// The controller whose cgroups are pooled: memory on v1 (the others
    /// leave nothing behind when removed). None on v2, whose kernel
    /// refuses to rename a cgroup (EPERM), so a pooled one could never
    /// take a sandbox's name.
    fn pooled_controller(&self) -> Option<&'static str> {
        match self {
            Hierarchy::V2 { .. } => None,
            Hierarchy::V1 { .. } => Some("memory"),
        }
    }

    /// Whether removed sandboxes' memory cgroups are kept for reuse here.
    pub fn pools(&self) -> bool {
        self.pooled_controller().is_some()
    }

    /// Makes the sandbox's directories, taking the pooled one from the
    /// pool when `reuse` and it has one; returns whether it did.
    fn create_dirs(&self, id: &str, reuse: bool) -> Result<bool, CgroupError> {
        if let Hierarchy::V2 { root, .. } = self {
            // Controllers must be enabled on every level above the leaf.
            enable_v2_controllers(root)?;
            for level in [root.join("cairn"), self.parent("")] {
                if !level.exists() {
                    mkdir(&level)?;
                }
                enable_v2_controllers(&level)?;
            }
        }
        let pooled = self.pooled_controller().map(|c| self.parent(c).join(id));
        let mut reused = false;
        for dir in self.dirs(id) {
            if let Some(parent) = dir.parent() {
                if !parent.exists() {
                    fs::create_dir_all(parent).map_err(io_err("create cgroup", parent))?;
                }
            }
            if reuse && pooled.as_ref() == Some(&dir) && pool::take(&dir) {
                reused = true;
                continue;
            }
            mkdir(&dir)?;
        }
        Ok(reused)
    }

    /// Removes this scope's pooled cgroups (and the scope, once empty), and
    /// stale pooled cgroups of every scope on the host (state directories
    /// that are gone cannot drain their own). Returns how many went.
    pub fn drain_pool(&self) -> usize {
        let Some(controller) = self.pooled_controller() else {
            return 0;
        };
        let parent = self.parent(controller);
        let mut removed = pool::drain(&parent);
        for c in V1_CONTROLLERS {
            let _ = fs::remove_dir(self.parent(c));
        }
        if let Some(top) = parent.parent() {
            removed += pool::sweep_stale(top);
        }
        removed
    }

    /// How many cgroups wait in this scope's pool.
    pub fn pooled(&self) -> usize {
        let Some(controller) = self.pooled_controller() else {
            return 0;
        };
        fs::read_dir(self.parent(controller))
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_str().is_some_and(pool::is_entry))
                    .count()
            })
            .unwrap_or(0)
    }

    /// Opens the sandbox's cgroup handle (it need not exist).
    pub fn cgroup(&self, id: &str) -> Cgroup {
        Cgroup {
            hierarchy: self.clone(),
            id: id.to_string(),
        }
    }

    /// Ids of this scope's sandboxes that have cgroups on this host.
    pub fn sandbox_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = V1_CONTROLLERS
            .iter()
            .filter_map(|c| fs::read_dir(self.parent(c)).ok())
            .flat_map(|entries| entries.flatten())
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|name| !pool::is_entry(name))
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }
}

fn mkdir(path: &Path) -> Result<(), CgroupError> {
    match fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io_err("create cgroup", path)(e)),
    }
}

fn enable_v2_controllers(dir: &Path) -> Result<(), CgroupError> {
    let path = dir.join("cgroup.subtree_control");
    let current = fs::read_to_string(&path).unwrap_or_default();
    for c in V2_CONTROLLERS {
        if !current.split_whitespace().any(|x| x == c) {
            fs::write(&path, format!("+{c}")).map_err(io_err("enable controllers in", &path))?;
        }
    }
    Ok(())
}

/// What a sandbox's processes use, from its cgroups.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// CPU time used, in nanoseconds, from an arbitrary start (a cgroup
    /// reused from the pool counts on): only the difference of two means
    /// anything.
    pub cpu_ns: u64,
    /// Memory charged now, page cache included, in bytes.
    pub memory: u64,
    /// The page cache part of `memory`, in bytes.
    pub cache: u64,
}

/// `key`'s number in a `key value` per line file (`cpu.stat`, `memory.stat`).
fn stat_value(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.trim().parse().ok())
}

/// CPU time of `pids` and of the children each has waited for, in
/// nanoseconds (`/proc/PID/stat`): a process that ended counts once it was
/// reaped, which a sandbox's init does for every orphan.
fn proc_cpu_ns(pids: &[i32]) -> u64 {
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|t| *t > 0)
        .unwrap_or(100) as u64;
    let ticks: u64 = pids
        .iter()
        .filter_map(|pid| fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .map(|stat| {
            // Fields after the command name, which may hold anything but
            // ends at the last ')': state, then utime is the 12th.
            let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
            rest.split_whitespace()
                .skip(11)
                .take(4)
                .filter_map(|f| f.parse::<u64>().ok())
                .sum::<u64>()
        })
        .sum();
    ticks.saturating_mul(1_000_000_000 / hz)
}

/// One sandbox's cgroups.
#[derive(Debug, Clone)]
pub struct Cgroup {
    hierarchy: Hierarchy,
    id: String,
}

impl Cgroup {
    fn dir(&self, controller: &str) -> PathBuf {
        self.hierarchy.parent(controller).join(&self.id)
    }

    fn write(&self, controller: &str, file: &str, value: &str) -> Result<(), CgroupError> {
        let path = self.dir(controller).join(file);
        fs::write(&path, value).map_err(io_err("write", &path))
    }

    fn apply(&self, limits: &Limits) -> Result<(), CgroupError> {
        let quota = limits.cpu_millis as u64 * CFS_PERIOD_US / 1000;
        match &self.hierarchy {
            Hierarchy::V2 { .. } => {
                self.write("", "memory.max", &limits.memory_bytes.to_string())?;
                if self.dir("").join("memory.swap.max").exists() {
                    self.write("", "memory.swap.max", "0")?;
                }
                self.write("", "pids.max", &limits.pids.to_string())?;
                self.write("", "cpu.max", &format!("{quota} {CFS_PERIOD_US}"))?;
            }
            Hierarchy::V1 { .. } => {
                self.write("memory", "memory.limit_in_bytes", &limits.memory_bytes.to_string())?;
                if self.dir("memory").join("memory.memsw.limit_in_bytes").exists() {
                    self.write(
                        "memory",
                        "memory.memsw.limit_in_bytes",
                        &limits.memory_bytes.to_string(),
                    )?;
                }
                let _ = self.write("memory", "memory.swappiness", "0");
                self.write("pids", "pids.max", &limits.pids.to_string())?;
                self.write("cpu", "cpu.cfs_period_us", &CFS_PERIOD_US.to_string())?;
                self.write("cpu", "cpu.cfs_quota_us", &quota.to_string())?;
            }
        }
        Ok(())
    }

    /// The files a new, single-threaded process writes `0` to in order to
    /// join. On v1 these are the `tasks` files: moving the calling thread
    /// alone skips the kernel's global threadgroup lock, whose first writer
    /// after a quiet spell waits out an RCU grace period (5-15 ms measured
    /// here, on every sandbox start not right after another); `cgroup.procs`
    /// on v2, where there is no such file.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        let file = match self.hierarchy {
            Hierarchy::V1 { .. } => "tasks",
            Hierarchy::V2 { .. } => "cgroup.procs",
        };
        self.hierarchy
            .dirs(&self.id)
            .into_iter()
            .map(|d| d.join(file))
            .collect()
    }

    /// Host pids of every process in the sandbox.
    pub fn pids(&self) -> Vec<i32> {
        let path = self.dir("pids").join("cgroup.procs");
        fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    pub fn exists(&self) -> bool {
        self.hierarchy.dirs(&self.id).iter().any(|d| d.exists())
    }

    /// Stops every process at once (for a consistent snapshot).
    pub fn freeze(&self) -> Result<(), CgroupError> {
        self.set_frozen(true)
    }

    pub fn thaw(&self) -> Result<(), CgroupError> {
        self.set_frozen(false)
    }

    fn set_frozen(&self, frozen: bool) -> Result<(), CgroupError> {
        let (file, value, done) = match &self.hierarchy {
            Hierarchy::V2 { .. } => ("cgroup.freeze", if frozen { "1" } else { "0" }, None),
            Hierarchy::V1 { .. } => (
                "freezer.state",
                if frozen { "FROZEN" } else { "THAWED" },
                Some(if frozen { "FROZEN" } else { "THAWED" }),
            ),
        };
        self.write("freezer", file, value)?;
        // Freezing settles asynchronously (v1 thawing too): wait until it
        // has, or fail, since a caller that goes on would act on a cgroup
        // whose processes still run.
        let (path, want) = match done {
            Some(want) => (self.dir("freezer").join("freezer.state"), want),
            None if frozen => (self.dir("").join("cgroup.events"), "frozen 1"),
            None => return Ok(()),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let state = fs::read_to_string(&path).map_err(io_err("read", &path))?;
            if state.lines().any(|l| l.trim() == want) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(CgroupError::NotSettled {
                    cgroup: path.parent().unwrap_or(&path).to_path_buf(),
                    want: if frozen { "frozen" } else { "thawed" },
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Whether the cgroup is frozen (or freezing).
    pub fn is_frozen(&self) -> bool {
        match &self.hierarchy {
            Hierarchy::V2 { .. } => {
                fs::read_to_string(self.dir("").join("cgroup.freeze")).is_ok_and(|s| s.trim() == "1")
            }
            Hierarchy::V1 { .. } => {
                fs::read_to_string(self.dir("freezer").join("freezer.state")).is_ok_and(|s| s.trim() != "THAWED")
            }
        }
    }

    /// What the sandbox's processes use now: CPU time, memory and page
    /// cache. Whatever cannot be read counts as 0.
    pub fn usage(&self) -> Usage {
        let read =
            |controller: &str, file: &str| fs::read_to_string(self.dir(controller).join(file)).unwrap_or_default();
        let number = |text: String| text.trim().parse::<u64>().ok();
        match &self.hierarchy {
            Hierarchy::V2 { .. } => {
                let memory_stat = read("", "memory.stat");
                Usage {
                    cpu_ns: stat_value(&read("", "cpu.stat"), "usage_usec").unwrap_or(0) * 1000,
                    memory: number(read("", "memory.current")).unwrap_or(0),
                    cache: stat_value(&memory_stat, "file").unwrap_or(0),
                }
            }
            Hierarchy::V1 { .. } => {
                let memory_stat = read("memory", "memory.stat");
                Usage {
                    // cpuacct is mounted with cpu on most hosts; where it
                    // is not, the processes' own counts.
                    cpu_ns: number(read("cpu", "cpuacct.usage")).unwrap_or_else(|| proc_cpu_ns(&self.pids())),
                    memory: number(read("memory", "memory.usage_in_bytes")).unwrap_or(0),
                    cache: stat_value(&memory_stat, "total_cache")
                        .or_else(|| stat_value(&memory_stat, "cache"))
                        .unwrap_or(0),
                }
            }
        }
    }

    /// How many processes the OOM killer killed in this cgroup.
    pub fn oom_kills(&self) -> u64 {
        let (file, key) = match &self.hierarchy {
            Hierarchy::V2 { .. } => ("memory.events", "oom_kill"),
            Hierarchy::V1 { .. } => ("memory.oom_control", "oom_kill"),
        };
        let text = fs::read_to_string(self.dir("memory").join(file)).unwrap_or_default();
        text.lines()
            .filter_map(|l| l.split_once(' '))
            .find(|(k, _)| *k == key)
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Kills every process in the sandbox and waits until they are gone.
    pub fn kill_all(&self) -> Result<(), CgroupError> {
        if !self.exists() {
            return Ok(());
        }
        // A frozen task cannot die; thaw first (harmless when not frozen).
        let _ = self.thaw();
        if let Hierarchy::V2 { .. } = self.hierarchy {
            let kill = self.dir("").join("cgroup.kill");
            if kill.exists() {
                let _ = fs::write(&kill, "1");
            }
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let pids = self.pids();
            if pids.is_empty() {
                return Ok(());
            }
            for pid in pids {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
            }
            if Instant::now() > deadline {
                return Err(CgroupError::StillBusy(self.id.clone()));
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    }

    /// Removes the cgroup directories (after [`Cgroup::kill_all`]); the
    /// pooled one goes into its scope's pool when it can.
    pub fn remove(&self) -> Result<(), CgroupError> {
        self.remove_dirs(true)
    }

    fn remove_dirs(&self, to_pool: bool) -> Result<(), CgroupError> {
        let pooled = self.hierarchy.pooled_controller().map(|c| self.dir(c));
        for dir in self.hierarchy.dirs(&self.id) {
            if to_pool && pooled.as_ref() == Some(&dir) && dir.exists() && self.reset_for_pool(&dir) && pool::put(&dir)
            {
                continue;
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match fs::remove_dir(&dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == ErrorKind::NotFound => break,
                    // Exiting tasks may still be accounted for a moment.
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    Err(e) => return Err(io_err("remove cgroup", &dir)(e)),
                }
            }
            // The scope goes with its last sandbox (a busy scope stays), so
            // state directories that are gone leave no cgroups behind.
            if let Some(scope) = dir.parent() {
                let _ = fs::remove_dir(scope);
            }
        }
        Ok(())
    }

    /// Readies the memory cgroup `dir` (v1) for another sandbox: no
    /// process left in it, limits back to unlimited, peak and failure
    /// counters zeroed. False when it cannot be (an OOM kill in its
    /// history, a process that will not leave, a file that refuses the
    /// reset): it is removed then.
    fn reset_for_pool(&self, dir: &Path) -> bool {
        let procs = dir.join("cgroup.procs");
        let deadline = Instant::now() + Duration::from_secs(10);
        // Exiting tasks may still be listed for a moment.
        while !fs::read_to_string(&procs).is_ok_and(|p| p.trim().is_empty()) {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if self.oom_kills() > 0 {
            return false;
        }
        // The swap limit may not be below the memory limit: raised first.
        [
            ("memory.memsw.limit_in_bytes", "-1"),
            ("memory.limit_in_bytes", "-1"),
            ("memory.max_usage_in_bytes", "0"),
            ("memory.memsw.max_usage_in_bytes", "0"),
            ("memory.failcnt", "0"),
            ("memory.memsw.failcnt", "0"),
        ]
        .iter()
        .all(|(file, value)| !dir.join(file).exists() || fs::write(dir.join(file), value).is_ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_read_from_each_layouts_own_files() {
        let v2 = tempfile::tempdir().unwrap();
        let h = Hierarchy::V2 {
            root: v2.path().to_path_buf(),
            scope: "s".into(),
        };
        let dir = h.parent("").join("box");
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("cpu.stat"),
            "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n",
        )
        .unwrap();
        fs::write(dir.join("memory.current"), "4096000\n").unwrap();
        fs::write(dir.join("memory.stat"), "anon 100\nfile 2048000\nfile_mapped 7\n").unwrap();
        let want = Usage {
            cpu_ns: 1_500_000,
            memory: 4_096_000,
            cache: 2_048_000,
        };
        assert_eq!(h.cgroup("box").usage(), want);

        let v1 = tempfile::tempdir().unwrap();
        let h = Hierarchy::V1 {
            root: v1.path().to_path_buf(),
            scope: "s".into(),
        };
        for c in V1_CONTROLLERS {
            fs::create_dir_all(h.parent(c).join("box")).unwrap();
        }
        let mem = h.parent("memory").join("box");
        fs::write(h.parent("cpu").join("box/cpuacct.usage"), "1500000\n").unwrap();
        fs::write(mem.join("memory.usage_in_bytes"), "4096000\n").unwrap();
        fs::write(mem.join("memory.stat"), "cache 5\nrss 9\ntotal_cache 2048000\n").unwrap();
        assert_eq!(h.cgroup("box").usage(), want);
        // cpuacct mounted apart: the processes' own counts (none here).
        fs::remove_file(h.parent("cpu").join("box/cpuacct.usage")).unwrap();
        assert_eq!(h.cgroup("box").usage().cpu_ns, 0);
        // This process's counts as /proc gives them, children included.
        let me = std::process::id() as i32;
        let used = || {
            let r = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF).unwrap();
            let t = |v: nix::sys::time::TimeVal| v.tv_sec() as u64 * 1_000_000_000 + v.tv_usec() as u64 * 1000;
            t(r.user_time()) + t(r.system_time())
        };
        while used() < 50_000_000 {
            std::hint::black_box(used());
        }
        // The kernel counts in clock ticks (10 ms at 100 Hz).
        assert!(proc_cpu_ns(&[me]) >= 30_000_000, "{}", proc_cpu_ns(&[me]));
    }

    #[test]
    fn detects_v2_when_the_unified_tree_has_the_controllers() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("cgroup.controllers"), "cpuset cpu io memory pids\n").unwrap();
        assert_eq!(Hierarchy::detect_at(dir.path(), "test").unwrap().version(), 2);
    }

    #[test]
    fn detects_v1_when_the_controllers_are_mounted_apart() {
        let dir = tempfile::tempdir().unwrap();
        // A hybrid host: the unified tree carries only hugetlb.
        fs::write(dir.path().join("cgroup.controllers"), "hugetlb\n").unwrap();
        for c in V1_CONTROLLERS {
            fs::create_dir(dir.path().join(c)).unwrap();
            fs::write(dir.path().join(c).join("cgroup.procs"), "").unwrap();
        }
        assert_eq!(Hierarchy::detect_at(dir.path(), "test").unwrap().version(), 1);
    }

    /// A v2 root in `dir` offering `controllers`, with `enabled` in its
    /// subtree_control.
    fn v2_root(dir: &Path, controllers: &str, enabled: &str) -> Hierarchy {
        fs::write(dir.join("cgroup.controllers"), controllers).unwrap();
        fs::write(dir.join("cgroup.subtree_control"), enabled).unwrap();
        Hierarchy::detect_at(dir, "test").unwrap()
    }

    #[test]
    fn v2_controllers_missing_from_the_root_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let h = v2_root(dir.path(), "memory pids io\n", "");
        assert_eq!(h.controllers(), vec![("memory", true), ("pids", true), ("cpu", false)]);
    }

    #[test]
    fn v2_delegation_is_refused_below_a_cgroup_holding_processes() {
        let dir = tempfile::tempdir().unwrap();
        let h = v2_root(dir.path(), "memory pids cpu\n", "memory\n");
        // The host's root cgroup has no cgroup.type and may hold processes.
        fs::write(dir.path().join("cgroup.procs"), "1\n").unwrap();
        assert!(h.delegation().unwrap().unwrap().contains("enables them"));
        // A container's namespace root is not the host's: processes in it
        // keep controllers from being enabled below.
        fs::write(dir.path().join("cgroup.type"), "domain\n").unwrap();
        let why = h.delegation().unwrap().unwrap_err();
        assert!(why.contains("holds processes") && why.contains("pids, cpu"), "{why}");
        fs::write(dir.path().join("cgroup.procs"), "").unwrap();
        fs::write(dir.path().join("cgroup.subtree_control"), "memory pids cpu\n").unwrap();
        assert!(h.delegation().unwrap().unwrap().starts_with("enabled in"));
    }

    #[test]
    fn a_directory_without_cgroup_mounts_has_no_layout() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("memory")).unwrap();
        assert_eq!(Layout::at(dir.path()), None);
    }

    #[test]
    fn no_controllers_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = Hierarchy::detect_at(dir.path(), "test").unwrap_err();
        assert!(err.to_string().contains("cgroup v2"), "{err}");
    }
}
