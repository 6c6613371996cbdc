//! Cairn's engine core: sandboxes, snapshots, images, the layers' lifecycle
//! and garbage collection, over the state store (`cairn-state`, re-exported
//! as [`state`]) and the sandbox drivers.
//!
//! An [`Engine`] holds the state directory ([`home::Home`]), a connection to
//! the state store, the local layers, the chunk store and the drivers, and
//! exposes services: images ([`images`]), sandboxes ([`sandboxes`]),
//! snapshots ([`snapshots`]). The layers above (`cairn-pipeline`,
//! `cairn-session`, the API's E2B gateway) add their operations as traits
//! over it, keep their own per-engine state in its typed extensions
//! ([`Engine::extension`]), and hand their errors back whole
//! ([`EngineError::Domain`]); nothing here imports them.

pub mod access;
pub mod build;
mod checkpoint_window;
pub mod diff;
pub mod dockerfile;
mod durability;
pub mod images;
mod memory_cache;
pub mod memory_image;
pub mod names;
pub mod network;
pub mod objects;
pub mod sandboxes;
pub mod snapshot_view;
pub mod snapshots;
pub mod tenants;
pub mod verify;

use std::path::PathBuf;

use cairn_layers::{LayerError, LayerId, LayerStore};
use cairn_sandbox::client::ClientError;
use cairn_sandbox::native::NativeDriver;
use cairn_sandbox::SandboxError;
use cairn_store::{ChunkStore, StoreBackend, TieredOptions};

pub use cairn_state as state;
#[cfg(feature = "test-support")]
pub use cairn_state::testing;
pub use cairn_state::{home, now_ms, random_hex, Home};
pub use diff::{DiffError, DiffOptions, SnapshotDiff};
pub use images::ImageError;
pub use sandboxes::{CreateOptions, ExecStart, GcReport, OomProbe, SandboxUsage};
pub use snapshots::{MemoryPhases, PreparedRestore, SnapshotError, SnapshotManifest};
pub use state::{ImageRecord, SandboxRecord, SandboxState, SnapshotRecord, StateError, StateLocation};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    State(#[from] StateError),
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error(transparent)]
    Layer(#[from] LayerError),
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    View(#[from] snapshot_view::ViewError),
    #[error(transparent)]
    Access(#[from] access::AccessError),
    #[error(transparent)]
    Tenant(#[from] tenants::TenantError),
    #[error(transparent)]
    Network(#[from] cairn_sandbox::net::NetError),
    /// An error of a layer above the engine (a run's, a session's, a bundle's),
    /// kept whole: [`EngineError::domain`] finds it by its type.
    #[error(transparent)]
    Domain(Box<dyn std::error::Error + Send + Sync>),
    #[error(transparent)]
    Diff(#[from] diff::DiffError),
    #[error("the state database names layer {0:?}, which is not a layer id; the database is damaged")]
    BadLayerId(String),
    #[error("CAIRN_DISK={value:?}, the default --disk, is not a size: {error}")]
    DiskDefault {
        value: String,
        error: cairn_sandbox::LimitsError,
    },
    #[error("cannot use the disk of sandbox {id}: {source}")]
    Disk {
        id: String,
        #[source]
        source: cairn_sandbox::disk::DiskError,
    },
    #[error("cannot run as {user:?} in sandbox {id}: {why}")]
    NoSuchUser { id: String, user: String, why: String },
    #[error("no sandbox matches {0:?}; `cairn ps` lists them")]
    NoSuchSandbox(String),
    #[error("{key:?} matches several sandboxes ({}); give more of the id", .ids.join(", "))]
    AmbiguousSandbox { key: String, ids: Vec<String> },
    #[error("sandbox {id} is {state}{}, not running; `cairn rm {id}` removes it",
        .reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default())]
    NotRunning {
        id: String,
        state: SandboxState,
        /// Why it ended, when it did.
        reason: Option<String>,
    },
    #[error("sandbox {id} is not running: {reason}; `cairn rm {id}` removes it")]
    InitGone { id: String, reason: String },
    #[error("sandbox {0} is running; stop and remove it with `cairn rm -f {0}`")]
    StillRunning(String),
    #[error("invalid sandbox name {0:?}: use letters, digits and '-', at most 63, not starting with '-'")]
    BadName(String),
    #[error("cannot use the state directory {path}: {source}")]
    Home {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    DriverUnavailable(String),
    #[error("unknown driver {0:?}: use native or gvisor")]
    UnknownDriver(String),
    #[error("snapshot {snapshot} holds the memory of a gvisor sandbox; the {driver} driver cannot restore memory (use --driver gvisor, the default for it)")]
    NoMemorySnapshots { snapshot: String, driver: String },
    #[error("snapshot {snapshot} holds a gVisor memory image this host cannot resume: {differences}. Restore it on a host that matches (the same runsc release and platform, a CPU of the same vendor and family with every feature the image's record lists), or install here the runsc release it was taken with")]
    IncompatibleMemoryImage { snapshot: String, differences: String },
    #[error("service {command:?} did not start: {reason}")]
    Service { command: String, reason: String },
    #[error(
        "snapshot {snapshot} cannot be restored into a sandbox prepared ahead: {why}; restore it without preparing"
    )]
    CannotPrepare { snapshot: String, why: String },
    #[error("Cairn needs root to create sandboxes (namespaces, cgroups, mounts); run it as root")]
    NotRoot,
}

impl EngineError {
    /// The error of a layer above the engine this is, if it is one of type `E`.
    pub fn domain<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            EngineError::Domain(e) => e.downcast_ref::<E>(),
            _ => None,
        }
    }
}

/// What layers above the engine keep with one engine, one value per type
/// (a server's prepared session resumes, a worker's job slots, the model
/// decide stages ask).
#[derive(Default)]
struct Extensions(std::collections::HashMap<std::any::TypeId, Box<dyn std::any::Any + Send + Sync>>);

/// Reports progress of long operations (image builds) to whoever watches.
pub trait Progress {
    /// A new step began.
    fn step(&self, message: &str);
}

/// Progress for callers that do not show any.
pub struct Silent;

impl Progress for Silent {
    fn step(&self, _: &str) {}
}

pub struct Engine {
    home: Home,
    db: state::Db,
    layers: LayerStore,
    native: NativeDriver,
    /// The gVisor driver, or why it is not available here.
    /// Made on first use: most commands never need it.
    gvisor: std::sync::OnceLock<Result<cairn_sandbox::gvisor::GvisorDriver, String>>,
    host_net: std::sync::OnceLock<Result<cairn_sandbox::net::HostNet, String>>,
    init_binary: PathBuf,
    store: ChunkStore<StoreBackend>,
    /// Sandboxes the reconciliation at open removed (reported by `gc`).
    reconciled: Vec<String>,
    /// Whether the reconciliation at open was put off to the sandbox start
    /// ([`Engine::open_to_start`]).
    reconcile_pending: bool,
    /// Where the last memory snapshot's time went.
    memory_phases: std::sync::Mutex<Option<snapshots::MemoryPhases>>,
    /// What layers above keep with this engine ([`Engine::extension`]).
    extensions: Extensions,
}

impl Engine {
    /// Opens (creating if needed) the state directory, then reconciles it
    /// with the host: sandboxes whose processes died since the last command
    /// are marked exited and their cgroups released.
    pub fn open(home: Home) -> Result<Engine, EngineError> {
        Engine::open_with(home, false)
    }

    /// [`Engine::open`] for a command about to start one native sandbox:
    /// its `cairn-init` starts before the state store opens, and waits for
    /// its setup, so that its start and the store's overlap; and the
    /// reconciliation is put off until the sandbox is ready, and runs while
    /// its first command starts.
    pub fn open_to_start(home: Home) -> Result<Engine, EngineError> {
        Engine::open_with(home, true)
    }

    fn open_with(home: Home, start_init_ahead: bool) -> Result<Engine, EngineError> {
        if !nix::unistd::geteuid().is_root() {
            return Err(EngineError::NotRoot);
        }
        let mkdir = |p: PathBuf| std::fs::create_dir_all(&p).map_err(|source| EngineError::Home { path: p, source });
        mkdir(home.root().to_path_buf())?;
        private(home.root())?;
        mkdir(home.sandboxes())?;
        let init_binary = cairn_sandbox::init_binary::install(&home.lib()).map_err(|source| EngineError::Home {
            path: home.lib(),
            source,
        })?;
        let native = NativeDriver::new(&home.scope(), home.root())?;
        if start_init_ahead {
            native.start_init_ahead(&init_binary);
        }
        let db = state::Db::open_home(&home)?;
        let layers = LayerStore::open(home.layers())?;
        let store = ChunkStore::new(
            StoreBackend::open(&home.store(), home.store_url(), TieredOptions::default())
                .map_err(SnapshotError::from)?,
        );
        let mut engine = Engine {
            home,
            db,
            layers,
            native,
            gvisor: std::sync::OnceLock::new(),
            host_net: std::sync::OnceLock::new(),
            init_binary,
            store,
            reconciled: Vec::new(),
            reconcile_pending: start_init_ahead,
            memory_phases: std::sync::Mutex::new(None),
            extensions: Extensions::default(),
        };
        if !start_init_ahead {
            engine.reconciled = engine.reconcile()?;
        }
        Ok(engine)
    }

    /// Keeps a native sandbox's `cairn-init` started and waiting, so that
    /// each sandbox this engine starts skips init's own start (see
    /// [`NativeDriver::keep_init_waiting`]); for long-lived processes.
    pub fn keep_init_waiting(&self) {
        self.native.keep_init_waiting(&self.init_binary);
    }

    pub fn home(&self) -> &Home {
        &self.home
    }

    /// The state store.
    pub fn db(&self) -> &state::Db {
        &self.db
    }

    /// The state store, for the writes that take it whole (a stage's
    /// outcome, a sandbox's row).
    pub fn db_mut(&mut self) -> &mut state::Db {
        &mut self.db
    }

    /// The chunk store: snapshots' manifests and files, memory images,
    /// session payloads, artifacts.
    pub fn store(&self) -> &ChunkStore<StoreBackend> {
        &self.store
    }

    /// The local layers.
    pub fn layers(&self) -> &LayerStore {
        &self.layers
    }

    /// What a layer above the engine keeps with it, of type `T`.
    pub fn extension<T: Send + Sync + 'static>(&self) -> Option<&T> {
        self.extensions.0.get(&std::any::TypeId::of::<T>())?.downcast_ref::<T>()
    }

    /// Keeps `value` with this engine, replacing the `T` kept before.
    pub fn set_extension<T: Send + Sync + 'static>(&mut self, value: T) {
        self.extensions.0.insert(std::any::TypeId::of::<T>(), Box::new(value));
    }
}

/// Makes the state directory root's alone (mode 0700): sandboxes' files in
/// it carry whatever modes and owners the sandbox gave them (a setuid
/// program among them), and no other host user may reach them.
fn private(root: &std::path::Path) -> Result<(), EngineError> {
    use std::os::unix::fs::PermissionsExt;
    let home_err = |source| EngineError::Home {
        path: root.to_path_buf(),
        source,
    };
    let mode = std::fs::metadata(root).map_err(home_err)?.permissions().mode();
    if mode & 0o077 != 0 {
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o700)).map_err(home_err)?;
    }
    Ok(())
}

/// A layer id the state store names; one that is not is a damaged database.
pub fn layer_id(s: &str) -> Result<LayerId, EngineError> {
    s.parse().map_err(|_| EngineError::BadLayerId(s.to_string()))
}

/// `bytes` random bytes from the kernel, in hex: ids and secrets.
/// The pid of the process holding a `flock` on `path`, read from
/// `/proc/locks` so that looking takes no lock a starting holder could
/// collide with; `None` when nobody holds it (or the file is missing).
pub fn flock_holder(path: &std::path::Path) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    let dev = meta.dev();
    let id = format!(
        "{:02x}:{:02x}:{}",
        nix::sys::stat::major(dev),
        nix::sys::stat::minor(dev),
        meta.ino()
    );
    std::fs::read_to_string("/proc/locks").ok()?.lines().find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        // "1: FLOCK  ADVISORY  WRITE 10065 fe:00:10010771 0 EOF"
        (f.get(1) == Some(&"FLOCK") && f.get(5) == Some(&id.as_str()))
            .then(|| f.get(4)?.parse().ok())
            .flatten()
    })
}

/// Nanoseconds since the Unix epoch (0 before it): the time in the names
/// of copies set aside or retired.
pub(crate) fn now_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}
