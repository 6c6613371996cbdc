//! The sandbox service: create, exec, copy, list, remove, garbage-collect.

use std::collections::HashSet;
use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use cairn_protocol::{ExecRequest, PtySize};
use cairn_sandbox::client::{ExecSession, InitClient, SpawnFailure};
use cairn_sandbox::{pid_start_time, Driver, Limits, SandboxProcess, SandboxSpec};
use serde::Serialize;

use crate::state::{ImageConfig, SandboxRecord, SandboxState};
use crate::{now_ms, Engine, EngineError, Progress};

/// What `cairn create` and `cairn run` ask for.
#[derive(Debug, Clone, Default)]
pub struct CreateOptions {
    pub image: Option<String>,
    pub name: Option<String>,
    pub limits: Limits,
    /// Remove the sandbox once the creating process is gone (`cairn run`).
    pub auto_remove: bool,
    /// Commands to keep running in the background; restarted after every
    /// restore, fork and reset.
    pub services: Vec<String>,
    /// `native` (the default) or `gvisor`.
    pub driver: Option<String>,
    /// Loopback only or `egress`, with its allows and ports. Unset: a fork
    /// of a sandbox takes the sandbox's, anything else loopback only.
    pub network: Option<cairn_sandbox::net::NetPolicy>,
}

/// Where a new sandbox's root comes from.
pub(crate) struct Origin {
    pub image: String,
    /// Layer ids, topmost first.
    pub layers: Vec<String>,
    pub services: Vec<String>,
    /// The snapshot it starts from, if any (restore, fork).
    pub snapshot: Option<String>,
    /// A memory image to resume from (gvisor snapshots), materialised.
    pub memory: Option<PathBuf>,
    pub driver: String,
}

/// A process started in a sandbox, with what is needed to explain its end.
pub struct ExecStart {
    pub session: ExecSession,
    pub probe: OomProbe,
}

/// The sandbox's OOM-kill count when a process started.
#[derive(Debug, Clone)]
pub struct OomProbe {
    sandbox_id: String,
    driver: String,
    oom_kills_before: u64,
}

/// What `cairn gc` released.
#[derive(Debug, Default, Serialize)]
pub struct GcReport {
    pub sandboxes_removed: Vec<String>,
    pub cgroups_released: Vec<String>,
    /// Emptied cgroups kept for reuse (this state directory's, and stale
    /// ones of any on the host) that were removed.
    pub pooled_cgroups_removed: u64,
    pub directories_removed: Vec<String>,
    pub layers_removed: Vec<String>,
    pub chunks_removed: u64,
    pub bytes_freed: u64,
    pub partial_writes_removed: u64,
    /// Layer directories that builds, deletes and materialisations killed
    /// mid-way left behind.
    pub partial_layers_removed: u64,
    /// Network slots (host interfaces `cn-N`) whose sandbox was gone.
    pub networks_released: Vec<String>,
    /// Shifted copies of layers (`shifted/`, on kernels whose overlayfs
    /// takes no idmapped layers) whose layer was removed, and copies a
    /// killed start left half-made.
    pub shifted_copies_removed: u64,
    /// Copies set aside because they changed on the host: layers
    /// (`layers/.changed-*`, see `LayerStore::ensure`), shifted copies of
    /// layers (`shifted/.changed-*`) and local memory images
    /// (`memory/.changed-*`). Kept for a day after they were set aside, for
    /// inspection and for sandboxes started on them before.
    pub changed_copies_kept: Vec<String>,
    /// Those set aside more than a day ago, removed.
    pub changed_copies_removed: Vec<String>,
}

/// What layers above the engine collect within [`Engine::gc_with`], each at
/// the point it must come: sandboxes they remove themselves before exited
/// sandboxes go, and snapshots they let go before layers and chunks are
/// swept (for the pipelines: stage sandboxes whose queue claim moved on,
/// and losing branches past their run's retention). What they collected
/// they keep in their own report; sandboxes they removed are added to the
/// engine's.
pub trait CollectAbove {
    /// Sandboxes the layer removes itself, added to `report`'s
    /// `sandboxes_removed`.
    fn before_sandboxes(&mut self, engine: &mut Engine, report: &mut GcReport) -> Result<(), EngineError>;
    /// Snapshots the layer lets go (the chunks only they used are freed
    /// after).
    fn before_chunks(&mut self, engine: &mut Engine) -> Result<(), EngineError>;
}

/// How long `gc` keeps a copy set aside because it changed on the host.
pub const CHANGED_COPIES_KEPT_FOR: Duration = Duration::from_secs(24 * 60 * 60);

/// Copies set aside because they changed on the host (`.changed-<id>-<nanos>`
/// in `dirs`): those set aside more than `kept_for` ago are removed; returns
/// (kept, removed). The time of setting aside is the one in the name, as
/// a directory's own times are its content's.
fn sweep_changed_copies(dirs: &[PathBuf], kept_for: Duration) -> (Vec<String>, Vec<String>) {
    let now = crate::now_nanos();
    let (mut kept, mut removed) = (Vec::new(), Vec::new());
    for dir in dirs {
        let Ok(entries) = fs::read_dir(dir) else { continue };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix(".changed-") else {
                continue;
            };
            let set_aside = rest.rsplit_once('-').and_then(|(_, n)| n.parse::<u128>().ok());
            let path = e.path().display().to_string();
            match set_aside {
                Some(at) if now.saturating_sub(at) > kept_for.as_nanos() => match fs::remove_dir_all(e.path()) {
                    Ok(()) => removed.push(path),
                    Err(err) => {
                        tracing::warn!("cannot remove {path}: {err}");
                        kept.push(path);
                    }
                },
                _ => kept.push(path),
            }
        }
    }
    kept.sort();
    removed.sort();
    (kept, removed)
}

fn new_sandbox_id() -> String {
    crate::random_hex(6)
}

fn valid_hostname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && !name.starts_with('-')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// This process: its pid and start time, as rows that name an owner
/// (a sandbox's, a session's) record it.
pub fn me() -> (i32, u64) {
    let pid = std::process::id() as i32;
    (pid, pid_start_time(pid).unwrap_or(0))
}

/// What a running sandbox uses, at one moment ([`Engine::usage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SandboxUsage {
    /// CPU time, in nanoseconds from an arbitrary start: compare two.
    pub cpu_ns: u64,
    /// Memory charged to it, page cache included, in bytes.
    pub memory: u64,
    /// The page cache part of `memory`, in bytes.
    pub cache: u64,
    /// Bytes its files take (its upper directory, or its own disk's use).
    pub disk_used: u64,
    /// The size of the file system they are on (its own disk, or the host's).
    pub disk_total: u64,
}

impl Engine {
    pub(crate) fn driver_of(&self, rec: &SandboxRecord) -> Result<&dyn Driver, EngineError> {
        self.driver(&rec.driver)
    }

    pub(crate) fn driver(&self, name: &str) -> Result<&dyn Driver, EngineError> {
        match name {
            "native" => Ok(&self.native),
            "gvisor" => Ok(self.gvisor()?),
            other => Err(EngineError::UnknownDriver(other.to_string())),
        }
    }

    pub(crate) fn gvisor(&self) -> Result<&cairn_sandbox::gvisor::GvisorDriver, EngineError> {
        self.gvisor
            .get_or_init(|| {
                cairn_sandbox::gvisor::GvisorDriver::new(self.home.root().join("gvisor"), &self.home.scope())
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| EngineError::DriverUnavailable(e.clone()))
    }

    pub(crate) fn spec(&self, rec: &SandboxRecord) -> Result<SandboxSpec, EngineError> {
        let layers = rec
            .layers
            .iter()
            .map(|l| Ok(self.layers.ensure(&crate::layer_id(l)?, &self.store)?))
            .collect::<Result<Vec<PathBuf>, EngineError>>()?;
        Ok(SandboxSpec {
            id: rec.id.clone(),
            hostname: rec.name.clone(),
            dir: self.home.sandbox(&rec.id),
            layers,
            limits: Limits {
                memory_bytes: rec.memory_bytes,
                cpu_millis: rec.cpu_millis,
                pids: rec.pids_max,
                disk_bytes: rec.disk_bytes,
            },
            init_binary: self.init_binary.clone(),
            network: None,
        })
    }

    /// Creates and starts a sandbox. On any error nothing is left behind:
    /// no row, no directory, no cgroup, no process.
    pub fn create_sandbox(
        &mut self,
        opts: &CreateOptions,
        progress: &dyn Progress,
    ) -> Result<SandboxRecord, EngineError> {
        let origin = self.image_origin(opts, progress)?;
        self.create_from(origin, opts)
    }

    /// A new sandbox's origin: `opts`' image (the default one when unset,
    /// built on first use), its services and driver.
    fn image_origin(&mut self, opts: &CreateOptions, progress: &dyn Progress) -> Result<Origin, EngineError> {
        let image_name = opts
            .image
            .clone()
            .unwrap_or_else(|| crate::images::DEFAULT_IMAGE.to_string());
        let image = self.image_or_default(&image_name, progress)?;
        // A built image's start command runs with each of its sandboxes.
        let services = match (&image.config, opts.services.is_empty()) {
            (
                Some(ImageConfig {
                    start_cmd: Some(start), ..
                }),
                true,
            ) => vec![start.clone()],
            _ => opts.services.clone(),
        };
        Ok(Origin {
            image: image.name,
            layers: image.layers,
            services,
            snapshot: None,
            memory: None,
            driver: opts.driver.clone().unwrap_or_else(|| "native".into()),
        })
    }

    /// Creates and starts a sandbox and runs `req` in it (`cairn run`). The
    /// native driver sends the command while init builds the sandbox, so it
    /// starts the moment init serves; a sandbox with services runs it after
    /// them. On an error, nothing is left behind, as with
    /// [`Engine::create_sandbox`]; a command that init refuses to start
    /// (`SpawnFailure`) leaves the sandbox running, for the caller to remove.
    pub fn create_and_exec(
        &mut self,
        opts: &CreateOptions,
        req: ExecRequest,
        progress: &dyn Progress,
    ) -> Result<(SandboxRecord, Result<ExecStart, SpawnFailure>), EngineError> {
        let origin = self.image_origin(opts, progress)?;
        // A built image's environment, directory and user come from its
        // row, so its command waits for the sandbox like one behind services.
        let configured = self.db.image_config(&origin.image)?.is_some();
        let early = (origin.services.is_empty() && !configured).then_some(&req);
        let (rec, first) = self.create_started(origin, opts, early)?;
        let start = match first {
            Some(first) => {
                let probe = OomProbe {
                    sandbox_id: rec.id.clone(),
                    driver: rec.driver.clone(),
                    oom_kills_before: first.oom_kills_before,
                };
                first
                    .pending
                    .started()
                    .map(|started| started.map(|session| ExecStart { session, probe }))
                    .map_err(EngineError::from)
            }
            None => self.as_image_user(&rec, req).and_then(|req| self.exec(&rec, req)),
        };
        match start {
            Ok(start) => Ok((rec, start)),
            Err(e) => {
                if let Err(cleanup) = self.remove_sandbox(&rec, true) {
                    tracing::warn!(sandbox = %rec.id, "removing a sandbox whose command could not start: {cleanup}");
                }
                Err(e)
            }
        }
    }

    /// Creates and starts a sandbox on `origin`'s layers; see [`Engine::create_sandbox`].
    pub(crate) fn create_from(&mut self, origin: Origin, opts: &CreateOptions) -> Result<SandboxRecord, EngineError> {
        Ok(self.create_started(origin, opts, None)?.0)
    }

    /// The row of a sandbox about to be made from `origin` (state
    /// `creating`, owned by this process), once its name and driver are
    /// checked.
    fn new_record(&self, origin: &Origin, opts: &CreateOptions) -> Result<SandboxRecord, EngineError> {
        let id = new_sandbox_id();
        let name = opts
            .name
            .clone()
            .map(|n| self.qualified(n))
            .unwrap_or_else(|| id.clone());
        if !valid_hostname(&name) {
            return Err(EngineError::BadName(name));
        }
        let (owner_pid, owner_start) = me();
        let rec = SandboxRecord {
            id: id.clone(),
            name,
            image: origin.image.clone(),
            driver: origin.driver.clone(),
            state: SandboxState::Creating,
            pid: None,
            pid_start: None,
            owner_pid,
            owner_start,
            memory_bytes: opts.limits.memory_bytes,
            cpu_millis: opts.limits.cpu_millis,
            pids_max: opts.limits.pids,
            disk_bytes: match opts.limits.disk_bytes {
                Some(bytes) => Some(bytes),
                None => default_disk()?,
            },
            created_at: now_ms(),
            auto_remove: opts.auto_remove,
            ended_reason: None,
            layers: origin.layers.clone(),
            services: origin.services.clone(),
            last_snapshot: origin.snapshot.clone(),
            network: opts.network.as_ref().and_then(crate::network::SandboxNetwork::of),
            oom_kills: 0,
        };
        // The driver first: an unavailable one fails before anything exists.
        self.driver(&origin.driver)?;
        if origin.memory.is_some() && !self.driver(&origin.driver)?.capabilities().memory_snapshots {
            return Err(EngineError::NoMemorySnapshots {
                snapshot: origin.snapshot.clone().unwrap_or_default(),
                driver: origin.driver.clone(),
            });
        }
        Ok(rec)
    }

    /// [`Engine::create_from`], with `first` sent to init while the sandbox
    /// starts when the driver can (the native driver: see
    /// [`cairn_sandbox::native::NativeDriver::start_begin`]); `None` back:
    /// it was not sent.
    fn create_started(
        &mut self,
        origin: Origin,
        opts: &CreateOptions,
        first: Option<&ExecRequest>,
    ) -> Result<(SandboxRecord, Option<cairn_sandbox::FirstExec>), EngineError> {
        let mut rec = self.new_record(&origin, opts)?;
        let id = rec.id.clone();
        // The row comes first: from here on a crash leaves something the
        // garbage collector can find.
        // The address too, so the row records it: a crash before the row
        // exists leaves a slot whose owner (this process) is dead.
        let mut lease = self.lease_network(&mut rec)?;
        if let Err(e) = self.db.insert_sandbox(&rec) {
            let _ = self.release_network(&rec);
            return Err(e.into());
        }
        let started = self.spec(&rec).map(|mut spec| {
            spec.network = lease.as_ref().map(|l| l.plan.clone());
            spec
        });
        let started = started.and_then(|spec| self.start_driver(&rec.driver, &spec, origin.memory.as_deref(), first));
        let (process, first_exec) = match started {
            Ok(started) => started,
            Err(e) => {
                let _ = self.release_network(&rec);
                let _ = self.remove_sandbox_dir(&id);
                let _ = self.db.delete_sandbox(&id);
                return Err(e);
            }
        };
        if let Err(e) = self.network_started(&rec, lease.as_mut(), process) {
            let _ = self.driver(&rec.driver)?.stop(&rec.id, Some(process));
            let _ = self.release_network(&rec);
            let _ = self.remove_sandbox_dir(&id);
            let _ = self.db.delete_sandbox(&id);
            return Err(e);
        }
        self.db.set_running(&id, process.pid, process.start_time)?;
        rec.state = SandboxState::Running;
        rec.pid = Some(process.pid);
        rec.pid_start = Some(process.start_time);
        // A memory image's services run on in it: they are not started again.
        let services = origin.memory.is_none();
        if let Err(e) = self.after_start(&rec, origin.snapshot.is_some(), services) {
            // A sandbox whose services did not start is not handed out:
            // the error is the answer, and nothing stays running.
            if let Err(cleanup) = self.remove_sandbox(&rec, true) {
                tracing::warn!(sandbox = %rec.id, "removing a sandbox whose start failed: {cleanup}");
            }
            return Err(e);
        }
        Ok((rec, first_exec))
    }

    /// The first half of a restore from the gVisor memory image `image`,
    /// done ahead (see [`Engine::prepare_restore`]): the row (state
    /// `creating`, this process its owner, so it goes if this process dies
    /// first), the directory, and runsc's sandbox created and waiting.
    pub(crate) fn create_prepared(
        &mut self,
        origin: &Origin,
        opts: &CreateOptions,
        image: &std::path::Path,
    ) -> Result<SandboxRecord, EngineError> {
        let mut rec = self.new_record(origin, opts)?;
        // A gVisor sandbox has no network of its own: asking for one fails
        // here as at a create, and there is no lease to carry.
        let lease = self.lease_network(&mut rec)?;
        debug_assert!(lease.is_none(), "a gVisor sandbox got a network lease");
        self.db.insert_sandbox(&rec)?;
        let prepared = self.spec(&rec).and_then(|spec| {
            self.reconcile_deferred();
            Ok(self
                .gvisor()?
                .prepare_restore(&spec, image)
                .map_err(cairn_sandbox::SandboxError::from)?)
        });
        let process = match prepared {
            Ok(p) => p,
            Err(e) => {
                let _ = self.remove_sandbox_dir(&rec.id);
                let _ = self.db.delete_sandbox(&rec.id);
                return Err(e);
            }
        };
        if let Err(e) = self.db.set_process(&rec.id, process.pid, process.start_time) {
            let _ = self.remove_sandbox(&rec, true);
            return Err(e.into());
        }
        rec.pid = Some(process.pid);
        rec.pid_start = Some(process.start_time);
        Ok(rec)
    }

    /// The second half: `image` restored into the sandbox
    /// [`Self::create_prepared`] made, which then runs as any restored one.
    /// A failure removes it.
    pub(crate) fn finish_prepared(
        &mut self,
        mut rec: SandboxRecord,
        image: &std::path::Path,
    ) -> Result<SandboxRecord, EngineError> {
        let restored = self.spec(&rec).and_then(|spec| {
            Ok(self
                .gvisor()?
                .restore_prepared(&spec, image)
                .map_err(cairn_sandbox::SandboxError::from)?)
        });
        let running = restored.and_then(|process| {
            self.db.set_running(&rec.id, process.pid, process.start_time)?;
            Ok(process)
        });
        let process = match running {
            Ok(p) => p,
            Err(e) => {
                if let Err(cleanup) = self.remove_sandbox(&rec, true) {
                    tracing::warn!(sandbox = %rec.id, "removing a prepared sandbox whose restore failed: {cleanup}");
                    // Its row went another way (removed meanwhile): what runs
                    // of it must not stay.
                    if let Ok(driver) = self.driver(&rec.driver) {
                        let _ = driver.stop(&rec.id, None);
                    }
                }
                return Err(e);
            }
        };
        rec.state = SandboxState::Running;
        rec.pid = Some(process.pid);
        rec.pid_start = Some(process.start_time);
        // A memory image's services run on in it.
        if let Err(e) = self.after_start(&rec, true, false) {
            if let Err(cleanup) = self.remove_sandbox(&rec, true) {
                tracing::warn!(sandbox = %rec.id, "removing a sandbox whose start failed: {cleanup}");
            }
            return Err(e);
        }
        Ok(rec)
    }

    /// Starts `spec`'s sandbox on `driver`, from the gVisor memory image
    /// `memory` if given, and runs the reconciliation put off at open
    /// meanwhile. The native driver hands init its setup first (and
    /// `first`, which comes back pending), and the reconciliation runs while
    /// init builds the sandbox.
    fn start_driver(
        &mut self,
        driver: &str,
        spec: &cairn_sandbox::SandboxSpec,
        memory: Option<&std::path::Path>,
        first: Option<&ExecRequest>,
    ) -> Result<(SandboxProcess, Option<cairn_sandbox::FirstExec>), EngineError> {
        if driver == "native" && memory.is_none() {
            let starting = self.native.start_begin(spec, first)?;
            // Put off until the sandbox is ready: while init builds it, this
            // process makes the cgroups and init waits for them; once it is
            // ready, this process only waits for the first command's output.
            let started = starting.finish(&self.native);
            self.reconcile_deferred();
            return Ok(started?);
        }
        self.reconcile_deferred();
        let process = match memory {
            Some(image) => self
                .gvisor()?
                .restore(spec, image)
                .map_err(cairn_sandbox::SandboxError::from)?,
            None => self.driver(driver)?.start(spec)?,
        };
        Ok((process, None))
    }

    /// After a sandbox (re)started: a restored one gets the wall clock and
    /// fresh entropy, so forks of one snapshot never share random state;
    /// then its services start, where `services` says so (not after a
    /// memory restore, whose services run on).
    pub(crate) fn after_start(&self, rec: &SandboxRecord, restored: bool, services: bool) -> Result<(), EngineError> {
        let services: &[String] = if services { &rec.services } else { &[] };
        if !restored && services.is_empty() {
            return Ok(());
        }
        let client = self.client(rec)?;
        if restored {
            let mut entropy = vec![0u8; 64];
            getrandom::getrandom(&mut entropy).expect("the kernel RNG is available");
            let now = crate::now_nanos();
            client.restored(now, entropy)?;
        }
        for service in services {
            let req = ExecRequest {
                argv: vec!["/bin/sh".into(), "-c".into(), service.clone()],
                detach: true,
                ..ExecRequest::default()
            };
            if let Err(failure) = client.exec(req)? {
                return Err(EngineError::Service {
                    command: service.clone(),
                    reason: failure.message,
                });
            }
        }
        Ok(())
    }

    /// Finds a sandbox by name, id or unique id prefix.
    pub fn sandbox(&self, key: &str) -> Result<SandboxRecord, EngineError> {
        let mut found = self.db.find_sandboxes(key)?;
        match found.len() {
            0 => Err(EngineError::NoSuchSandbox(key.to_string())),
            1 => Ok(self.with_oom_kills(found.remove(0))),
            _ => Err(EngineError::AmbiguousSandbox {
                key: key.to_string(),
                ids: found.into_iter().map(|r| r.id).collect(),
            }),
        }
    }

    /// A client for a running sandbox's init.
    pub fn client(&self, rec: &SandboxRecord) -> Result<InitClient, EngineError> {
        if rec.state != SandboxState::Running {
            return Err(EngineError::NotRunning {
                id: rec.id.clone(),
                state: rec.state,
                reason: rec.ended_reason.clone(),
            });
        }
        Ok(self.driver_of(rec)?.client(&self.home.sandbox(&rec.id)))
    }

    /// Starts a process in a running sandbox.
    pub fn exec(&self, rec: &SandboxRecord, req: ExecRequest) -> Result<Result<ExecStart, SpawnFailure>, EngineError> {
        self.exec_on(rec, req, None)
    }

    /// Starts a process in a running sandbox, on a new terminal of size
    /// `pty` when given (its output all comes as stdout).
    pub fn exec_on(
        &self,
        rec: &SandboxRecord,
        req: ExecRequest,
        pty: Option<PtySize>,
    ) -> Result<Result<ExecStart, SpawnFailure>, EngineError> {
        let client = self.client(rec)?;
        let req = self.with_image_env(rec, req)?;
        let oom_kills_before = self.driver(&rec.driver)?.oom_kills(&rec.id);
        let probe = OomProbe {
            sandbox_id: rec.id.clone(),
            driver: rec.driver.clone(),
            oom_kills_before,
        };
        let started = match pty {
            Some(size) => client.exec_pty(req, size),
            None => client.exec(req),
        };
        match started {
            Ok(started) => Ok(started.map(|session| ExecStart { session, probe })),
            // Nothing answers: the row still says running, but init is gone.
            Err(e) => Err(self.init_gone(rec).unwrap_or_else(|| e.into())),
        }
    }

    /// `req` with what a built image says of its commands: its environment
    /// under the request's, and its working directory unless the request
    /// names one.
    fn with_image_env(&self, rec: &SandboxRecord, mut req: ExecRequest) -> Result<ExecRequest, EngineError> {
        if let Some(config) = self.db.image_config(&rec.image)? {
            let mut env: Vec<(String, String)> = config.env.into_iter().collect();
            env.append(&mut req.env);
            req.env = env;
            if req.cwd.is_none() {
                req.cwd = config.workdir;
            }
        }
        Ok(req)
    }

    /// `req` as `user` (a name from the sandbox's /etc/passwd, or
    /// `UID[:GID]`), else as [`Self::as_image_user`] says.
    pub fn with_user(
        &self,
        rec: &SandboxRecord,
        mut req: ExecRequest,
        user: Option<&str>,
    ) -> Result<ExecRequest, EngineError> {
        match user {
            None => self.as_image_user(rec, req),
            Some(user) => {
                req.user = self.ids_of(rec, Some(user)).map_err(|why| EngineError::NoSuchUser {
                    id: rec.id.clone(),
                    user: user.to_string(),
                    why,
                })?;
                Ok(req)
            }
        }
    }

    /// `req` as its image's user (`USER` of a built image) unless it names
    /// one: what `cairn exec`, `cairn run` and the API's exec run as.
    pub fn as_image_user(&self, rec: &SandboxRecord, mut req: ExecRequest) -> Result<ExecRequest, EngineError> {
        if req.user.is_none() {
            if let Some(user) = self.db.image_config(&rec.image)?.and_then(|c| c.user) {
                req.user = self.ids_of(rec, Some(&user)).map_err(|why| EngineError::NoSuchUser {
                    id: rec.id.clone(),
                    user: user.clone(),
                    why,
                })?;
            }
        }
        Ok(req)
    }

    /// Why a sandbox recorded as running stopped answering, if its init
    /// is gone: for a caller whose connection to it failed.
    pub fn init_gone(&self, rec: &SandboxRecord) -> Option<EngineError> {
        if process_of(rec).is_some_and(|p| p.alive()) {
            return None;
        }
        Some(EngineError::InitGone {
            id: rec.id.clone(),
            reason: self.why_init_ended(rec),
        })
    }

    /// Why a sandbox's init is gone, as its state will record it: the OOM
    /// killer (its cgroup counted a kill) or an exit.
    pub(crate) fn why_init_ended(&self, rec: &SandboxRecord) -> String {
        let oom = self.driver_of(rec).map(|d| d.oom_kills(&rec.id)).unwrap_or(0) > 0;
        // Under gVisor every process of the sandbox lives in runsc's.
        let who = if rec.driver == "gvisor" {
            "its gVisor sandbox"
        } else {
            "init"
        };
        if oom {
            format!(
                "{who} was killed by the OOM killer: the sandbox's memory limit is {}; raise --memory",
                cairn_sandbox::limits::MemorySize(rec.memory_bytes)
            )
        } else {
            "init exited".into()
        }
    }

    /// Whether the sandbox's OOM killer fired since the probe was taken: a
    /// process that died of SIGKILL then was killed for exceeding `--memory`.
    pub fn oom_killed_since(&self, probe: &OomProbe) -> bool {
        self.driver(&probe.driver)
            .map(|d| d.oom_kills(&probe.sandbox_id))
            .unwrap_or(0)
            > probe.oom_kills_before
    }

    /// Path of the sandbox's console log (init and background processes).
    pub fn log_path(&self, rec: &SandboxRecord) -> PathBuf {
        self.home.sandbox(&rec.id).join("console.log")
    }

    /// The sandboxes recorded as running, as the state holds them (a cheap
    /// look, for counting: no cgroup is read).
    pub fn running_sandboxes(&self) -> Result<Vec<SandboxRecord>, EngineError> {
        Ok(self
            .db
            .sandboxes()?
            .into_iter()
            .filter(|r| r.state == SandboxState::Running)
            .collect())
    }

    /// Lists sandboxes, after reconciling their states with the host.
    pub fn list_sandboxes(&mut self) -> Result<Vec<SandboxRecord>, EngineError> {
        let rows = self.db.sandboxes()?;
        Ok(rows.into_iter().map(|r| self.with_oom_kills(r)).collect())
    }

    /// What a running sandbox uses now: CPU time and memory from its
    /// cgroups, disk from its upper directory (or its own disk); `None`
    /// unless it runs.
    pub fn usage(&self, rec: &SandboxRecord) -> Result<Option<SandboxUsage>, EngineError> {
        if rec.state != SandboxState::Running {
            return Ok(None);
        }
        let cg = self.driver_of(rec)?.usage(&rec.id);
        let (disk_used, disk_total) = cairn_sandbox::disk::usage(&self.home.sandbox(&rec.id));
        Ok(Some(SandboxUsage {
            cpu_ns: cg.cpu_ns,
            memory: cg.memory,
            cache: cg.cache,
            disk_used,
            disk_total,
        }))
    }

    /// `rec` with its OOM-kill count read from its cgroup (while it runs).
    fn with_oom_kills(&self, mut rec: SandboxRecord) -> SandboxRecord {
        if rec.state == SandboxState::Running {
            rec.oom_kills = self.driver_of(&rec).map(|d| d.oom_kills(&rec.id)).unwrap_or(0);
        }
        rec
    }

    /// Removes a sandbox: its processes, cgroups, files and row. A running
    /// sandbox needs `force`.
    pub fn remove_sandbox(&mut self, rec: &SandboxRecord, force: bool) -> Result<(), EngineError> {
        match rec.state {
            SandboxState::Running if !force => return Err(EngineError::StillRunning(rec.id.clone())),
            SandboxState::Removing => {}
            from => self
                .db
                .transition(&rec.id, from, SandboxState::Removing, Some("removed"))?,
        }
        let (pid, start) = me();
        self.db.set_owner(&rec.id, pid, start)?;
        self.release(rec)
    }

    /// Releases the host resources of a sandbox in state `removing` and
    /// deletes its row last. Idempotent, so an interrupted removal is
    /// finished by whoever comes next.
    fn release(&self, rec: &SandboxRecord) -> Result<(), EngineError> {
        let process = process_of(rec);
        self.driver(&rec.driver)?.stop(&rec.id, process)?;
        self.release_network(rec)?;
        self.remove_sandbox_dir(&rec.id)?;
        self.db.delete_sandbox(&rec.id)?;
        Ok(())
    }

    /// Removes a sandbox's directory, its disk unmounted and deleted first
    /// (a removal must never descend into a mounted file system).
    /// Idempotent.
    pub(crate) fn remove_sandbox_dir(&self, id: &str) -> Result<(), EngineError> {
        let dir = self.home.sandbox(id);
        cairn_sandbox::disk::release(&dir).map_err(|source| EngineError::Disk { id: id.into(), source })?;
        match fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(EngineError::Home { path: dir, source }),
        }
    }

    /// Runs the reconciliation [`Engine::open_to_start`] put off, once.
    /// A failure is logged: the next command reconciles again.
    pub(crate) fn reconcile_deferred(&mut self) {
        if !std::mem::take(&mut self.reconcile_pending) {
            return;
        }
        match self.reconcile() {
            Ok(removed) => self.reconciled.extend(removed),
            Err(e) => tracing::warn!("reconciling the state with the host: {e}"),
        }
    }

    /// Brings the rows in line with the host after crashes: a running
    /// sandbox whose init died becomes exited (its cgroups released); a
    /// sandbox whose creator or remover died mid-way is finished off; a
    /// `cairn run` sandbox whose CLI is gone is removed.
    pub(crate) fn reconcile(&mut self) -> Result<Vec<String>, EngineError> {
        let mut removed = Vec::new();
        let (me_pid, me_start) = me();
        let rows = self.db.sandboxes()?;
        // A sandbox left frozen by a snapshot whose process died: nobody
        // holds the store lock, so no snapshot is in progress.
        if rows
            .iter()
            .any(|r| r.state == SandboxState::Running && self.driver_of(r).is_ok_and(|d| d.frozen(&r.id)))
        {
            if let Some(_lock) = self.try_lock_store() {
                for r in rows.iter().filter(|r| r.state == SandboxState::Running) {
                    if self.driver_of(r)?.frozen(&r.id) {
                        tracing::debug!(id = r.id, "thawing a sandbox an interrupted snapshot left frozen");
                        self.driver_of(r)?.thaw(&r.id)?;
                    }
                }
            }
        }
        for rec in rows {
            let owner_alive = cairn_sandbox::process_alive(rec.owner_pid, rec.owner_start);
            // Every action starts by winning a compare-and-set on the row, so
            // when several Cairn processes reconcile at once exactly one acts
            // and the others move on.
            match rec.state {
                SandboxState::Running if rec.auto_remove && !owner_alive => {
                    if !self.won(self.db.transition(
                        &rec.id,
                        rec.state,
                        SandboxState::Removing,
                        Some("its `cairn run` ended"),
                    ))? {
                        continue;
                    }
                    tracing::debug!(
                        id = rec.id,
                        owner = rec.owner_pid,
                        "removing a `cairn run` sandbox whose owner is gone"
                    );
                    self.db.set_owner(&rec.id, me_pid, me_start)?;
                    self.release(&rec)?;
                    removed.push(rec.id);
                }
                // A memory checkpoint whose process died in it.
                SandboxState::Running if self.window_open(&rec) => self.finish_window(&rec)?,
                SandboxState::Running if !process_of(&rec).is_some_and(|p| p.alive()) => {
                    // A memory snapshot replaces the process under its
                    // lifecycle lock; the row is read again once it is ours.
                    // (Without a sandbox directory or lock file nothing holds it.)
                    let _lifecycle = match self.lock_sandbox(&rec.id, false) {
                        Ok(None) => continue,
                        Ok(Some(lock)) => Some(lock),
                        Err(_) => None,
                    };
                    let now = self.db.find_sandboxes(&rec.id)?.into_iter().find(|r| r.id == rec.id);
                    if now.is_none_or(|r| r.state != SandboxState::Running || process_of(&r).is_some_and(|p| p.alive()))
                    {
                        continue;
                    }
                    let reason = self.why_init_ended(&rec);
                    if !self.won(self.db.transition(
                        &rec.id,
                        SandboxState::Running,
                        SandboxState::Exited,
                        Some(&reason),
                    ))? {
                        continue;
                    }
                    tracing::debug!(id = rec.id, pid = rec.pid, "sandbox init is gone");
                    self.driver(&rec.driver)?.stop(&rec.id, None)?;
                    self.release_network(&rec)?;
                }
                SandboxState::Creating | SandboxState::Removing if !owner_alive => {
                    if !self
                        .db
                        .take_over(&rec.id, (rec.owner_pid, rec.owner_start), (me_pid, me_start))?
                    {
                        continue;
                    }
                    if rec.state == SandboxState::Creating
                        && !self.won(self.db.transition(
                            &rec.id,
                            rec.state,
                            SandboxState::Removing,
                            Some("its creation was interrupted"),
                        ))?
                    {
                        continue;
                    }
                    tracing::debug!(id = rec.id, owner = rec.owner_pid, state = %rec.state, "finishing an interrupted create or remove");
                    self.release(&rec)?;
                    removed.push(rec.id);
                }
                _ => {}
            }
        }
        Ok(removed)
    }

    /// Whether a compare-and-set transition went through; losing the race
    /// to another process is not an error.
    pub(crate) fn won(&self, result: Result<(), crate::StateError>) -> Result<bool, EngineError> {
        match result {
            Ok(()) => Ok(true),
            Err(crate::StateError::Conflict(_)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Removes this state directory's pool of emptied cgroups (and stale
    /// pools of any on the host); returns how many went. `gc` does it too;
    /// alone, it is for a state directory about to be deleted.
    pub fn drain_cgroup_pool(&self) -> usize {
        self.native.cgroups().drain_pool()
    }

    /// Reconciles, then removes exited sandboxes, cgroups and directories no
    /// row accounts for, unreferenced layers and interrupted temporaries;
    /// what the layers above collect (`above`) comes at its points.
    pub fn gc_with(&mut self, above: &mut dyn CollectAbove) -> Result<GcReport, EngineError> {
        let mut removed = std::mem::take(&mut self.reconciled);
        removed.extend(self.reconcile()?);
        let mut report = GcReport {
            sandboxes_removed: removed,
            ..GcReport::default()
        };
        above.before_sandboxes(self, &mut report)?;
        let (me_pid, me_start) = me();
        for rec in self.db.sandboxes()?.iter().filter(|r| r.state == SandboxState::Exited) {
            let moved = self.db.transition(
                &rec.id,
                SandboxState::Exited,
                SandboxState::Removing,
                Some("garbage collected"),
            );
            if !self.won(moved)? {
                continue;
            }
            self.db.set_owner(&rec.id, me_pid, me_start)?;
            self.release(rec)?;
            report.sandboxes_removed.push(rec.id.clone());
        }
        let known: HashSet<String> = self.db.sandboxes()?.into_iter().map(|r| r.id).collect();
        // gVisor sandboxes no row accounts for: their runsc state goes too.
        if self.home.root().join("gvisor").is_dir() {
            if let Ok(gvisor) = self.gvisor() {
                for id in gvisor.leftovers() {
                    if !known.contains(&id) {
                        gvisor.stop(&id, None)?;
                        report.cgroups_released.push(id);
                    }
                }
            }
        }
        for id in self.native.leftovers() {
            if !known.contains(&id) && !report.cgroups_released.contains(&id) {
                self.native.stop(&id, None)?;
                report.cgroups_released.push(id);
            }
        }
        report.networks_released = self.release_dead_networks()?;
        // The pool of emptied cgroups drains: what gc leaves of a state
        // directory on the host is its running sandboxes' cgroups.
        report.pooled_cgroups_removed = self.drain_cgroup_pool() as u64;
        if let Ok(entries) = fs::read_dir(self.home.sandboxes()) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if !known.contains(&name) && self.remove_sandbox_dir(&name).is_ok() {
                    report.directories_removed.push(name);
                }
            }
        }
        // The layers above let their snapshots go first, so the chunks
        // only those used are freed below.
        above.before_chunks(self)?;
        // Layers and chunks: only while no snapshot or image build is
        // writing (they hold the store lock shared until their rows exist).
        let _lock = self.lock_store(true)?;
        let referenced = self.db.referenced_layers()?;
        for layer in self.layers.list()? {
            if !referenced.contains(&layer.to_string()) {
                self.layers.remove(&layer)?;
                report.layers_removed.push(layer.to_string());
            }
        }
        // Layer temporaries name their process: only those of dead processes
        // go. Imports fill theirs before they take the store lock, and
        // materialisations run outside it (a restore of a layer missing
        // locally).
        report.partial_layers_removed = self.layers.sweep_temporaries() as u64;
        report.partial_layers_removed += cairn_layers::archive::remove_abandoned_materialisations(self.layers.root())
            .map_err(cairn_layers::LayerError::from)?;
        // A layer's shifted copy goes with it: a layer in use is referenced,
        // so its copy stays.
        report.shifted_copies_removed =
            cairn_sandbox::native::layers::collect_shifted(self.home.root(), self.layers.root())
                .map_err(|e| EngineError::Sandbox(cairn_sandbox::SandboxError::Start(e)))?;
        (report.changed_copies_kept, report.changed_copies_removed) = sweep_changed_copies(
            &[
                self.layers.root().to_path_buf(),
                cairn_sandbox::native::layers::shifted_dir(self.home.root()),
                self.home.memory_images(),
            ],
            CHANGED_COPIES_KEPT_FOR,
        );
        self.sweep_memory_images()?;
        let store = self.collect_chunks(&referenced)?;
        report.chunks_removed = store.deleted;
        report.bytes_freed = store.bytes_freed;
        report.partial_writes_removed = store.incomplete_writes_removed;
        // Scratch directories name their process (`ScratchDir`): only those
        // of dead processes go.
        if let Ok(entries) = fs::read_dir(self.home.scratch()) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let Ok(modified) = e.metadata().and_then(|m| m.modified()) else {
                    continue;
                };
                if cairn_store::process::is_abandoned(&name, modified) {
                    let _ = fs::remove_dir_all(e.path());
                }
            }
        }
        Ok(report)
    }
}

/// The disk size of a sandbox created without `--disk`: `CAIRN_DISK`
/// (e.g. `10G`), or none.
fn default_disk() -> Result<Option<u64>, EngineError> {
    let Some(value) = std::env::var_os("CAIRN_DISK") else {
        return Ok(None);
    };
    let value = value.to_string_lossy().into_owned();
    if value.is_empty() {
        return Ok(None);
    }
    match value.parse::<cairn_sandbox::limits::DiskSize>() {
        Ok(size) => Ok(Some(size.0)),
        Err(error) => Err(EngineError::DiskDefault { value, error }),
    }
}

pub fn process_of(rec: &SandboxRecord) -> Option<SandboxProcess> {
    Some(SandboxProcess {
        pid: rec.pid?,
        start_time: rec.pid_start?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_are_checked() {
        assert!(valid_hostname("web-1"));
        assert!(!valid_hostname("-x"));
        assert!(!valid_hostname("a_b"));
        assert!(!valid_hostname(&"a".repeat(64)));
        assert!(!valid_hostname(""));
    }

    #[test]
    fn sandbox_ids_are_twelve_hex_digits() {
        let id = new_sandbox_id();
        assert_eq!(id.len(), 12);
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
    }
}
