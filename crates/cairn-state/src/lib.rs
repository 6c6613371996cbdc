//! The state store: sandboxes, images, snapshots (here) and every other
//! table's typed rows (runs and stages in [`runs`], the queue in [`queue`],
//! sessions and their logs in [`sessions`] and [`session_log`], tenants,
//! tokens, E2B's tables), written once as SQL over a [`Backend`], on SQLite
//! (embedded, the default) or PostgreSQL (`--state postgres://…`). Plain
//! rows: nothing here knows the engine, pipelines or sessions above it.
//!
//! Every change that touches several rows is one transaction; every
//! lifecycle move is a compare-and-set (`UPDATE … WHERE state = $from`), so
//! of two processes racing for one transition exactly one wins and the
//! other gets [`StateError::Conflict`].

pub mod access;
pub mod backend;
pub mod e2b;
pub mod e2b_templates;
pub mod failpoint;
pub mod home;
pub mod lineage;
pub mod network;
pub mod postgresql;
pub mod queue;
pub mod runs;
pub mod session_log;
pub mod sessions;
pub mod sqlite;
pub mod tenants;
#[cfg(feature = "test-support")]
pub mod testing;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Mutex, MutexGuard};

use serde::Serialize;

pub use backend::{Backend, BackendError, BackendKind, Row, Value};
use postgresql::{Claimant, PostgresBackend, PostgresTarget};
use sqlite::SqliteBackend;

pub use home::Home;

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state database: {0}")]
    Backend(#[from] BackendError),
    #[error(
        "the state store URL {shown} is not valid: {reason}; give --state/CAIRN_STATE as \
         postgres://USER@HOST:PORT/DATABASE or sqlite:PATH, or unset it to use the embedded SQLite store"
    )]
    BadLocation { shown: String, reason: String },
    #[error(
        "cannot connect to the PostgreSQL state store at {target}: {reason}; check --state/CAIRN_STATE, \
         or unset it to use the embedded SQLite store"
    )]
    Connect { target: String, reason: String },
    #[error(
        "the PostgreSQL state store at {target} belongs to the Cairn state directory {owner}, not {home}; {}",
        match store {
            Some(s) => format!("hosts share it through the remote chunk store {s}: give this one `--store {s}` \
                                (or CAIRN_STORE), or use a database of its own"),
            None => format!("its snapshots are in that directory's local chunk store, so no other host can use \
                             them; use --home {owner}, a database of its own, or put {owner} on a remote \
                             store (--store s3://…) that every host gives"),
        }
    )]
    ForeignHome {
        target: String,
        owner: String,
        home: String,
        store: Option<String>,
    },
    #[error("cannot read or create the state directory's identity {path}: {source}")]
    HomeIdentity {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the state database was written by a newer Cairn (schema {found}, this build knows {known}); upgrade Cairn"
    )]
    FutureSchema { found: i64, known: i64 },
    #[error("a sandbox named {0:?} already exists; pick another --name or remove it with `cairn rm -f {0}`")]
    NameTaken(String),
    /// A sandbox would take its tenant past one of its limits: nothing was made.
    #[error(
        "tenant {tenant:?} may hold at most {what}; remove some of its sandboxes first, or have the administrator \
         raise the limit (`cairn tenant set {tenant} --max-…`)"
    )]
    TenantLimit { tenant: String, what: String },
    /// A tenant named an image or template that is not its own.
    #[error("the name {0:?} is taken; pick another")]
    NameOfAnother(String),
    /// The tenant a connection acts for was removed.
    #[error("tenant {0:?} was removed")]
    TenantGone(String),
    #[error("sandbox {id} cannot go from {from} to {to}")]
    InvalidTransition {
        id: String,
        from: SandboxState,
        to: SandboxState,
    },
    /// A worker's commit found its queue job claimed again since (its
    /// lease expired: it was paused, cut off or slow): nothing was written.
    #[error(
        "job {job} moved to another worker after this one's lease expired (claim {epoch} is stale); \
         this worker's result is discarded and the stage's new holder commits it"
    )]
    Fenced { job: String, epoch: i64 },
    #[error("sandbox {0} changed state while this command ran; retry")]
    Conflict(String),
    #[error("the state database holds {0}; it is damaged")]
    Damaged(String),
    /// A run event's typed fields that this build cannot read.
    #[error("event {seq} of run {run}: {reason}")]
    EventData { run: String, seq: i64, reason: String },
}

/// The lifecycle of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// The row exists; the host resources are being made.
    Creating,
    /// cairn-init is running.
    Running,
    /// cairn-init is gone (killed, crashed, host rebooted); files remain.
    Exited,
    /// Host resources are being released; the row goes last.
    Removing,
}

impl SandboxState {
    /// The one place that says which transitions are valid.
    pub fn valid_transition(self, to: SandboxState) -> bool {
        use SandboxState::*;
        matches!(
            (self, to),
            (Creating, Running)
                | (Creating, Exited)
                | (Creating, Removing)
                | (Running, Exited)
                | (Running, Removing)
                | (Exited, Removing)
                // A reset restarts an exited sandbox on a new layer chain.
                | (Exited, Creating)
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Running => "running",
            SandboxState::Exited => "exited",
            SandboxState::Removing => "removing",
        }
    }
}

impl fmt::Display for SandboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SandboxState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "creating" => SandboxState::Creating,
            "running" => SandboxState::Running,
            "exited" => SandboxState::Exited,
            "removing" => SandboxState::Removing,
            other => return Err(format!("unknown sandbox state {other:?}")),
        })
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ImageRecord {
    pub name: String,
    pub source: String,
    pub size_bytes: u64,
    pub created_at: i64,
    /// Layer ids, topmost first.
    pub layers: Vec<String>,
    /// What its sandboxes start with, for an image built from steps
    /// (`cairn image build --file`, E2B templates); `None` for the rest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<ImageConfig>,
}

/// What a built image's sandboxes start with: the environment, working
/// directory and user of their commands, and a command started with each
/// sandbox (`start_cmd`), ready once `ready_cmd` exits 0.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct ImageConfig {
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_cmd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
}

impl ImageConfig {
    /// Whether it says nothing (an image that needs no config).
    pub fn is_empty(&self) -> bool {
        *self == ImageConfig::default()
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SandboxRecord {
    pub id: String,
    pub name: String,
    pub image: String,
    pub driver: String,
    pub state: SandboxState,
    pub pid: Option<i32>,
    #[serde(skip)]
    pub pid_start: Option<u64>,
    #[serde(skip)]
    pub owner_pid: i32,
    #[serde(skip)]
    pub owner_start: u64,
    pub memory_bytes: u64,
    pub cpu_millis: u32,
    pub pids_max: u32,
    /// `--disk`: the size of the file system its upper directory is on;
    /// `None`: the state directory's.
    pub disk_bytes: Option<u64>,
    pub created_at: i64,
    #[serde(skip)]
    pub auto_remove: bool,
    pub ended_reason: Option<String>,
    /// Layer ids, topmost first.
    pub layers: Vec<String>,
    /// Background commands started after every start, restore and reset.
    pub services: Vec<String>,
    /// The snapshot its next snapshot stacks on.
    pub last_snapshot: Option<String>,
    /// `--network egress`: what was asked for and the address it holds.
    pub network: Option<crate::network::SandboxNetwork>,
    /// Processes its memory limit had the OOM killer kill while it ran, as
    /// its cgroup counts them; not stored: filled in when the engine hands
    /// the record out (0 once its cgroups are gone).
    pub oom_kills: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct SnapshotRecord {
    pub id: String,
    pub parent_id: Option<String>,
    pub sandbox_id: String,
    pub image: String,
    pub driver: String,
    pub label: Option<String>,
    pub created_at: i64,
    pub new_bytes: u64,
    pub stored_bytes: u64,
    /// Layer ids, topmost first.
    pub layers: Vec<String>,
}

/// Where the state lives, from `--state`/`CAIRN_STATE`.
#[derive(Debug, Clone)]
pub enum StateLocation {
    /// An SQLite file (by default `$CAIRN_HOME/state.db`).
    Sqlite(PathBuf),
    /// A PostgreSQL database.
    Postgres(Box<PostgresTarget>),
}

impl StateLocation {
    /// `postgres://…` or `postgresql://…` for PostgreSQL, `sqlite:PATH` or
    /// nothing for SQLite (nothing: the home's `state.db`).
    pub fn parse(url: Option<&str>, home: &Home) -> Result<StateLocation, StateError> {
        let Some(url) = url.filter(|u| !u.is_empty()) else {
            return Ok(StateLocation::Sqlite(home.db()));
        };
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return Ok(StateLocation::Postgres(Box::new(PostgresTarget::parse(url)?)));
        }
        if let Some(path) = url.strip_prefix("sqlite:") {
            let path = path.strip_prefix("//").unwrap_or(path);
            if path.is_empty() {
                return Err(StateError::BadLocation {
                    shown: url.to_string(),
                    reason: "sqlite: needs a file path".into(),
                });
            }
            return Ok(StateLocation::Sqlite(PathBuf::from(path)));
        }
        Err(StateError::BadLocation {
            shown: postgresql::redact(url),
            reason: "it is neither postgres://, postgresql:// nor sqlite:".into(),
        })
    }
}

/// The queue job a connection's commits belong to, and the claim they
/// hold ([`queue`]: every commit of a stage's outcome checks it).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fence {
    pub job: String,
    pub epoch: i64,
}

/// The state store: one connection, used by one engine at a time.
pub struct Db {
    backend: Mutex<Box<dyn Backend>>,
    /// The state directory this connection serves (`Home::identity`): the
    /// sandboxes it lists and finds are those running on it. Empty for a
    /// store opened outside a home.
    home_id: String,
    /// The queue job this connection's stage outcomes commit under, if a
    /// worker runs them: each commit checks it (see `queue`).
    pub(crate) fence: Mutex<Option<Fence>>,
    /// The tenant this connection acts for (see `tenants`): rows it
    /// inserts are that tenant's. `None`: the administrator.
    pub(crate) tenant: Mutex<Option<String>>,
}

impl Db {
    /// Opens (creating and migrating if needed) the SQLite store at `path`.
    pub fn open(path: &Path) -> Result<Db, StateError> {
        Ok(Db::from_backend(Box::new(SqliteBackend::open(path)?)))
    }

    /// Opens the store the home's `--state` names (its `state.db` by default).
    pub fn open_home(home: &Home) -> Result<Db, StateError> {
        let id = home.identity().map_err(|source| StateError::HomeIdentity {
            path: home.identity_file(),
            source,
        })?;
        let mut db = match StateLocation::parse(home.state_url(), home)? {
            StateLocation::Sqlite(path) => Db::open(&path)?,
            StateLocation::Postgres(target) => {
                let path = home.root().to_string_lossy();
                let store = home.store_url().map(crate::queue::shown_store);
                let backend = PostgresBackend::open(
                    &target,
                    &Claimant {
                        id: &id,
                        path: &path,
                        store: store.as_deref(),
                    },
                )?;
                Db::from_backend(Box::new(backend))
            }
        };
        // Rows from before sandboxes named their home belong to the first
        // home that opens the store (until then there was only one). Looked
        // for first: an UPDATE would take the store's write lock at every
        // command, for rows that are adopted once.
        db.with(|b| {
            if b.query_opt("SELECT 1 FROM sandboxes WHERE home_id = '' LIMIT 1", &[])?
                .is_some()
            {
                b.execute("UPDATE sandboxes SET home_id = $1 WHERE home_id = ''", params![&id])?;
            }
            Ok(())
        })?;
        db.home_id = id;
        Ok(db)
    }

    pub fn from_backend(backend: Box<dyn Backend>) -> Db {
        Db {
            backend: Mutex::new(backend),
            home_id: String::new(),
            fence: Mutex::new(None),
            tenant: Mutex::new(None),
        }
    }

    /// A listener for queue wake-ups, where the store has them (PostgreSQL's
    /// LISTEN/NOTIFY); `None`: poll.
    pub fn listener(home: &Home) -> Result<Option<postgresql::Listener>, StateError> {
        match StateLocation::parse(home.state_url(), home)? {
            StateLocation::Postgres(target) => Ok(Some(postgresql::Listener::open(&target)?)),
            StateLocation::Sqlite(_) => Ok(None),
        }
    }

    /// The state directory this connection serves.
    pub fn home_id(&self) -> &str {
        &self.home_id
    }

    fn lock(&self) -> MutexGuard<'_, Box<dyn Backend>> {
        // A panic while holding the lock cannot leave a statement half run
        // (each is atomic); an open transaction is rolled back by the
        // next `transaction` at worst, so the connection stays usable.
        self.backend.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn kind(&self) -> BackendKind {
        self.lock().kind()
    }

    /// Runs `f` on the connection.
    pub fn with<T>(&self, f: impl FnOnce(&mut dyn Backend) -> Result<T, StateError>) -> Result<T, StateError> {
        let mut backend = self.lock();
        f(&mut **backend)
    }

    /// Runs `f` in one transaction: all of it is committed, or none.
    pub fn transaction<T>(&self, f: impl FnOnce(&mut dyn Backend) -> Result<T, StateError>) -> Result<T, StateError> {
        let mut backend = self.lock();
        (**backend).transaction(f)
    }

    /// Image `name`, if this connection's tenant may use it (the
    /// administrator's images are shared with every tenant).
    pub fn image(&self, name: &str) -> Result<Option<ImageRecord>, StateError> {
        let tenant = self.acting_for();
        self.with(|b| {
            if let Some(t) = &tenant {
                // Its own first, by the name it gave (stored qualified).
                let own = crate::tenants::qualify(t, name);
                let mine = b.query_opt("SELECT tenant FROM images WHERE name = $1", params![&own])?;
                if let Some(r) = mine {
                    if r.get::<Option<String>>(0)?.as_deref() == Some(t) {
                        return image(b, &own);
                    }
                }
                let owner = b.query_opt("SELECT tenant FROM images WHERE name = $1", params![name])?;
                match owner {
                    Some(r) if r.get::<Option<String>>(0)?.is_none_or(|o| o == *t) => {}
                    _ => return Ok(None),
                }
            }
            image(b, name)
        })
    }

    /// The config of image `name`, if it has one (one row read).
    pub fn image_config(&self, name: &str) -> Result<Option<ImageConfig>, StateError> {
        self.with(|b| {
            let Some(r) = b.query_opt("SELECT config FROM images WHERE name = $1", params![name])? else {
                return Ok(None);
            };
            match r.get::<Option<String>>(0)? {
                None => Ok(None),
                Some(text) => serde_json::from_str(&text)
                    .map(Some)
                    .map_err(|e| StateError::Damaged(format!("image {name}'s config is unreadable: {e}"))),
            }
        })
    }

    pub fn images(&self) -> Result<Vec<ImageRecord>, StateError> {
        self.with(|b| {
            let mut out = Vec::new();
            let (sql, tenant) = match self.acting_for() {
                Some(t) => (
                    "SELECT name FROM images WHERE tenant IS NULL OR tenant = $1 ORDER BY name",
                    vec![t.into()],
                ),
                None => ("SELECT name FROM images ORDER BY name", vec![]),
            };
            for r in b.query(sql, &tenant)? {
                out.extend(image(b, &r.get::<String>(0)?)?);
            }
            Ok(out)
        })
    }

    /// Inserts or replaces an image, atomically.
    pub fn put_image(&mut self, rec: &ImageRecord) -> Result<(), StateError> {
        let tenant = self.acting_for();
        self.transaction(|b| {
            if let Some(t) = &tenant {
                // A tenant replaces only its own images, never a shared one.
                let owner = b.query_opt("SELECT tenant FROM images WHERE name = $1", params![&rec.name])?;
                if let Some(owner) = owner {
                    if owner.get::<Option<String>>(0)?.as_deref() != Some(t) {
                        return Err(StateError::NameOfAnother(rec.name.clone()));
                    }
                }
            }
            b.execute("DELETE FROM images WHERE name = $1", params![&rec.name])?;
            insert_image_rows(b, rec)?;
            self.stamp(b, crate::tenants::Owned::Image, &rec.name)
        })
    }

    pub fn delete_image(&self, name: &str) -> Result<bool, StateError> {
        self.with(|b| Ok(b.execute("DELETE FROM images WHERE name = $1", params![name])? > 0))
    }

    pub fn insert_sandbox(&mut self, rec: &SandboxRecord) -> Result<(), StateError> {
        let tenant = self.acting_for();
        self.transaction(|b| {
            if let Some(t) = &tenant {
                crate::tenants::admit_sandbox(b, t, rec.memory_bytes as i64, rec.disk_bytes.map(|d| d as i64))?;
            }
            let inserted = b.execute(
                "INSERT INTO sandboxes (id, name, image, driver, state, pid, pid_start, owner_pid, owner_start,
                 memory_bytes, cpu_millis, pids_max, created_at, ended_reason, auto_remove, last_snapshot, home_id, network,
                 disk_bytes)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19)",
                params![
                    &rec.id,
                    &rec.name,
                    &rec.image,
                    &rec.driver,
                    rec.state.as_str(),
                    rec.pid,
                    rec.pid_start,
                    rec.owner_pid,
                    rec.owner_start,
                    rec.memory_bytes,
                    rec.cpu_millis,
                    rec.pids_max,
                    rec.created_at,
                    &rec.ended_reason,
                    rec.auto_remove,
                    &rec.last_snapshot,
                    &self.home_id,
                    rec.network.as_ref().map(|n| n.to_json()),
                    rec.disk_bytes,
                ],
            );
            match inserted {
                Err(BackendError::Unique { target }) if target == "sandboxes.name" => {
                    return Err(StateError::NameTaken(rec.name.clone()))
                }
                other => other?,
            };
            if let Some(t) = &tenant {
                b.execute("UPDATE sandboxes SET tenant = $2 WHERE id = $1", params![&rec.id, t])?;
            }
            write_sandbox_layers(b, &rec.id, &rec.layers, &rec.services)
        })
    }

    /// Points a sandbox at a new layer chain (reset), atomically.
    pub fn set_sandbox_layers(
        &mut self,
        id: &str,
        layers: &[String],
        services: &[String],
        last_snapshot: Option<&str>,
    ) -> Result<(), StateError> {
        self.transaction(|b| {
            b.execute("DELETE FROM sandbox_layers WHERE sandbox_id = $1", params![id])?;
            b.execute("DELETE FROM sandbox_services WHERE sandbox_id = $1", params![id])?;
            write_sandbox_layers(b, id, layers, services)?;
            b.execute(
                "UPDATE sandboxes SET last_snapshot = $2 WHERE id = $1",
                params![id, last_snapshot],
            )?;
            Ok(())
        })
    }

    /// Records a snapshot and makes it the sandbox's last, in one transaction.
    pub fn insert_snapshot(&mut self, rec: &SnapshotRecord) -> Result<(), StateError> {
        self.transaction(|b| {
            insert_snapshot_rows(b, rec)?;
            self.stamp(b, crate::tenants::Owned::Snapshot, &rec.id)?;
            b.execute(
                "UPDATE sandboxes SET last_snapshot = $2 WHERE id = $1",
                params![&rec.sandbox_id, &rec.id],
            )?;
            Ok(())
        })
    }

    pub fn snapshots(&self) -> Result<Vec<SnapshotRecord>, StateError> {
        let sql = format!("SELECT {SNAPSHOT_COLUMNS} FROM snapshots ORDER BY created_at, id");
        self.with(|b| snapshots_of(b, &sql, &[]))
    }

    /// Snapshots whose id starts with `key` (at least 4 digits) or whose label is `key`.
    pub fn find_snapshots(&self, key: &str) -> Result<Vec<SnapshotRecord>, StateError> {
        // A connection acting for a tenant finds that tenant's only.
        let sql = format!(
            "SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE (id = $1 OR label = $1
             OR (length($1) >= 4 AND substr(id, 1, length($1)) = $1)) AND (CAST($2 AS TEXT) IS NULL OR tenant = $2)
             ORDER BY created_at DESC"
        );
        self.with(|b| snapshots_of(b, &sql, params![key, self.acting_for()]))
    }

    /// Ids of the snapshots not yet marked durable in the remote store.
    pub fn snapshots_not_remote_durable(&self) -> Result<HashSet<String>, StateError> {
        self.strings(&["SELECT id FROM snapshots WHERE remote_durable_at IS NULL"])
    }

    /// Records that every object of snapshot `id` is in the remote store.
    pub fn mark_snapshot_remote_durable(&self, id: &str, at_ms: i64) -> Result<(), StateError> {
        self.with(|b| {
            b.execute(
                "UPDATE snapshots SET remote_durable_at = $2 WHERE id = $1 AND remote_durable_at IS NULL",
                params![id, at_ms],
            )?;
            Ok(())
        })
    }

    /// When snapshot `id` became durable in the remote store, if it did.
    pub fn snapshot_remote_durable_at(&self, id: &str) -> Result<Option<i64>, StateError> {
        self.with(|b| {
            let row = b.query_opt("SELECT remote_durable_at FROM snapshots WHERE id = $1", params![id])?;
            Ok(match row {
                Some(r) => r.get::<Option<i64>>(0)?,
                None => None,
            })
        })
    }

    /// When each snapshot marked durable in the remote store became so
    /// (ms since the epoch), by snapshot id.
    pub fn snapshots_remote_durable_at(&self) -> Result<HashMap<String, i64>, StateError> {
        self.with(|b| {
            let mut out = HashMap::new();
            for r in b.query(
                "SELECT id, remote_durable_at FROM snapshots WHERE remote_durable_at IS NOT NULL",
                &[],
            )? {
                out.insert(r.get::<String>(0)?, r.get::<i64>(1)?);
            }
            Ok(out)
        })
    }

    /// Deletes a snapshot row; its children keep their own layer lists.
    pub fn delete_snapshot(&self, id: &str) -> Result<(), StateError> {
        self.with(|b| {
            b.execute("DELETE FROM snapshots WHERE id = $1", params![id])?;
            Ok(())
        })
    }

    pub fn sandboxes(&self) -> Result<Vec<SandboxRecord>, StateError> {
        let sql = format!("SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE home_id = $1 ORDER BY created_at, id");
        self.with(|b| {
            let mut rows = b
                .query(&sql, params![&self.home_id])?
                .iter()
                .map(sandbox_from_row)
                .collect::<Result<Vec<_>, _>>()?;
            for r in &mut rows {
                complete(b, r)?;
            }
            Ok(rows)
        })
    }

    /// Finds sandboxes whose id starts with `key` or whose name is `key`.
    pub fn find_sandboxes(&self, key: &str) -> Result<Vec<SandboxRecord>, StateError> {
        let sql = format!(
            "SELECT {SANDBOX_COLUMNS} FROM sandboxes WHERE home_id = $2 AND (name = $1 OR name = $4 OR id = $1
             OR (length($1) >= 3 AND substr(id, 1, length($1)) = $1)) AND (CAST($3 AS TEXT) IS NULL OR tenant = $3)"
        );
        // A connection acting for a tenant finds that tenant's only, by
        // the names it gave too (stored qualified: `tenants::qualify`).
        let tenant = self.acting_for();
        let qualified = tenant
            .as_deref()
            .map_or_else(|| key.to_string(), |t| crate::tenants::qualify(t, key));
        self.with(|b| {
            let mut rows = b
                .query(&sql, params![key, &self.home_id, tenant, &qualified])?
                .iter()
                .map(sandbox_from_row)
                .collect::<Result<Vec<_>, _>>()?;
            // An exact name or id beats prefixes.
            if let Some(exact) = rows
                .iter()
                .position(|r| r.name == key || r.name == qualified || r.id == key)
            {
                rows = vec![rows.swap_remove(exact)];
            }
            for r in &mut rows {
                complete(b, r)?;
            }
            Ok(rows)
        })
    }

    /// Moves a sandbox from `from` to `to`, refusing invalid transitions and
    /// lost races (another process moved it first).
    pub fn transition(
        &self,
        id: &str,
        from: SandboxState,
        to: SandboxState,
        reason: Option<&str>,
    ) -> Result<(), StateError> {
        if !from.valid_transition(to) {
            return Err(StateError::InvalidTransition {
                id: id.to_string(),
                from,
                to,
            });
        }
        let n = self.with(|b| {
            Ok(b.execute(
                "UPDATE sandboxes SET state = $3, ended_reason = COALESCE($4, ended_reason)
                 WHERE id = $1 AND state = $2",
                params![id, from.as_str(), to.as_str(), reason],
            )?)
        })?;
        if n == 0 {
            return Err(StateError::Conflict(id.to_string()));
        }
        Ok(())
    }

    pub fn set_running(&self, id: &str, pid: i32, pid_start: u64) -> Result<(), StateError> {
        let n = self.with(|b| {
            Ok(b.execute(
                "UPDATE sandboxes SET state = 'running', pid = $2, pid_start = $3 WHERE id = $1 AND state = 'creating'",
                params![id, pid, pid_start],
            )?)
        })?;
        if n == 0 {
            return Err(StateError::Conflict(id.to_string()));
        }
        Ok(())
    }

    /// Records a sandbox's network (the address it holds while it runs).
    pub fn set_network(&self, id: &str, network: Option<&crate::network::SandboxNetwork>) -> Result<(), StateError> {
        self.with(|b| {
            b.execute(
                "UPDATE sandboxes SET network = $2 WHERE id = $1",
                params![id, network.map(|n| n.to_json())],
            )?;
            Ok(())
        })
    }

    /// Records a running sandbox's new init process (after a driver
    /// restarted it from a checkpoint).
    pub fn set_process(&self, id: &str, pid: i32, pid_start: u64) -> Result<(), StateError> {
        self.with(|b| {
            b.execute(
                "UPDATE sandboxes SET pid = $2, pid_start = $3 WHERE id = $1",
                params![id, pid, pid_start],
            )?;
            Ok(())
        })
    }

    /// Records which process now owns an operation on the sandbox.
    /// Whether the sandbox goes when its owner process dies.
    pub fn set_auto_remove(&self, id: &str, auto_remove: bool) -> Result<(), StateError> {
        self.with(|b| {
            b.execute(
                "UPDATE sandboxes SET auto_remove = $2 WHERE id = $1",
                params![id, auto_remove],
            )?;
            Ok(())
        })
    }

    pub fn set_owner(&self, id: &str, pid: i32, start: u64) -> Result<(), StateError> {
        self.with(|b| {
            b.execute(
                "UPDATE sandboxes SET owner_pid = $2, owner_start = $3 WHERE id = $1",
                params![id, pid, start],
            )?;
            Ok(())
        })
    }

    /// Makes `new` the owner of a sandbox if `old` still is (a
    /// compare-and-set); false when another process took it first.
    pub fn take_over(&self, id: &str, old: (i32, u64), new: (i32, u64)) -> Result<bool, StateError> {
        let n = self.with(|b| {
            Ok(b.execute(
                "UPDATE sandboxes SET owner_pid = $4, owner_start = $5
                 WHERE id = $1 AND owner_pid = $2 AND owner_start = $3",
                params![id, old.0, old.1, new.0, new.1],
            )?)
        })?;
        Ok(n == 1)
    }

    pub fn delete_sandbox(&self, id: &str) -> Result<(), StateError> {
        self.with(|b| {
            b.execute("DELETE FROM sandboxes WHERE id = $1", params![id])?;
            Ok(())
        })
    }

    /// Every layer id an image, a sandbox or a snapshot refers to.
    pub fn referenced_layers(&self) -> Result<HashSet<String>, StateError> {
        self.strings(&[
            "SELECT layer_id FROM image_layers",
            "SELECT layer_id FROM sandbox_layers",
            "SELECT layer_id FROM snapshot_layers",
        ])
    }

    /// The union of the single text column each query selects.
    pub fn strings(&self, queries: &[&str]) -> Result<HashSet<String>, StateError> {
        self.with(|b| {
            let mut out = HashSet::new();
            for sql in queries {
                for r in b.query(sql, &[])? {
                    out.insert(r.get::<String>(0)?);
                }
            }
            Ok(out)
        })
    }
}

/// Inserts an image and its layer list (the name must be free).
pub fn insert_image_rows(b: &mut dyn Backend, rec: &ImageRecord) -> Result<(), StateError> {
    let config = rec
        .config
        .as_ref()
        .filter(|c| !c.is_empty())
        .map(|c| serde_json::to_string(c).expect("an image config serialises"));
    b.execute(
        "INSERT INTO images (name, source, size_bytes, created_at, config) VALUES ($1, $2, $3, $4, $5)",
        params![&rec.name, &rec.source, rec.size_bytes, rec.created_at, config],
    )?;
    for (i, l) in rec.layers.iter().enumerate() {
        b.execute(
            "INSERT INTO image_layers (image, position, layer_id) VALUES ($1, $2, $3)",
            params![&rec.name, i, l],
        )?;
    }
    Ok(())
}

/// Inserts a snapshot unless one with its id (its manifest's hash, so the
/// same snapshot) is recorded, and writes its layer list.
pub fn insert_snapshot_rows(b: &mut dyn Backend, rec: &SnapshotRecord) -> Result<(), StateError> {
    b.execute(
        "INSERT INTO snapshots (id, parent_id, sandbox_id, image, driver, label, created_at, new_bytes,
         stored_bytes) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (id) DO NOTHING",
        params![
            &rec.id,
            &rec.parent_id,
            &rec.sandbox_id,
            &rec.image,
            &rec.driver,
            &rec.label,
            rec.created_at,
            rec.new_bytes,
            rec.stored_bytes
        ],
    )?;
    b.execute("DELETE FROM snapshot_layers WHERE snapshot_id = $1", params![&rec.id])?;
    for (i, l) in rec.layers.iter().enumerate() {
        b.execute(
            "INSERT INTO snapshot_layers (snapshot_id, position, layer_id) VALUES ($1, $2, $3)",
            params![&rec.id, i, l],
        )?;
    }
    Ok(())
}

fn layers_of(b: &mut dyn Backend, table: &str, key: &str, value: &str) -> Result<Vec<String>, StateError> {
    let sql = format!("SELECT layer_id FROM {table} WHERE {key} = $1 ORDER BY position");
    b.query(&sql, params![value])?.iter().map(|r| Ok(r.get(0)?)).collect()
}

fn image(b: &mut dyn Backend, name: &str) -> Result<Option<ImageRecord>, StateError> {
    let Some(r) = b.query_opt(
        "SELECT name, source, size_bytes, created_at, config FROM images WHERE name = $1",
        params![name],
    )?
    else {
        return Ok(None);
    };
    let config = match r.get::<Option<String>>(4)? {
        None => None,
        Some(text) => Some(
            serde_json::from_str(&text)
                .map_err(|e| StateError::Damaged(format!("image {name}'s config is unreadable: {e}")))?,
        ),
    };
    Ok(Some(ImageRecord {
        name: r.get(0)?,
        source: r.get(1)?,
        size_bytes: r.get(2)?,
        created_at: r.get(3)?,
        layers: layers_of(b, "image_layers", "image", name)?,
        config,
    }))
}

fn write_sandbox_layers(
    b: &mut dyn Backend,
    id: &str,
    layers: &[String],
    services: &[String],
) -> Result<(), StateError> {
    for (i, l) in layers.iter().enumerate() {
        b.execute(
            "INSERT INTO sandbox_layers (sandbox_id, position, layer_id) VALUES ($1, $2, $3)",
            params![id, i, l],
        )?;
    }
    for (i, c) in services.iter().enumerate() {
        b.execute(
            "INSERT INTO sandbox_services (sandbox_id, position, command) VALUES ($1, $2, $3)",
            params![id, i, c],
        )?;
    }
    Ok(())
}

const SNAPSHOT_COLUMNS: &str = "id, parent_id, sandbox_id, image, driver, label, created_at, new_bytes, stored_bytes";

fn snapshots_of(b: &mut dyn Backend, sql: &str, params: &[Value]) -> Result<Vec<SnapshotRecord>, StateError> {
    let mut out = Vec::new();
    for r in b.query(sql, params)? {
        let id: String = r.get(0)?;
        out.push(SnapshotRecord {
            layers: layers_of(b, "snapshot_layers", "snapshot_id", &id)?,
            id,
            parent_id: r.get(1)?,
            sandbox_id: r.get(2)?,
            image: r.get(3)?,
            driver: r.get(4)?,
            label: r.get(5)?,
            created_at: r.get(6)?,
            new_bytes: r.get(7)?,
            stored_bytes: r.get(8)?,
        });
    }
    Ok(out)
}

const SANDBOX_COLUMNS: &str = "id, name, image, driver, state, pid, pid_start, owner_pid, owner_start,
    memory_bytes, cpu_millis, pids_max, created_at, ended_reason, auto_remove, last_snapshot, network, disk_bytes";

fn sandbox_from_row(r: &Row) -> Result<SandboxRecord, StateError> {
    let state: String = r.get(4)?;
    Ok(SandboxRecord {
        id: r.get(0)?,
        name: r.get(1)?,
        image: r.get(2)?,
        driver: r.get(3)?,
        state: state.parse().map_err(StateError::Damaged)?,
        pid: r.get(5)?,
        pid_start: r.get(6)?,
        owner_pid: r.get(7)?,
        owner_start: r.get(8)?,
        memory_bytes: r.get(9)?,
        cpu_millis: r.get(10)?,
        pids_max: r.get(11)?,
        disk_bytes: r.get(17)?,
        created_at: r.get(12)?,
        ended_reason: r.get(13)?,
        auto_remove: r.get(14)?,
        last_snapshot: r.get(15)?,
        network: r
            .get::<Option<String>>(16)?
            .map(|text| crate::network::SandboxNetwork::from_json(&text))
            .transpose()
            .map_err(StateError::Damaged)?,
        layers: Vec::new(),
        services: Vec::new(),
        oom_kills: 0,
    })
}

/// Fills in the sandbox's layers and services.
fn complete(b: &mut dyn Backend, r: &mut SandboxRecord) -> Result<(), StateError> {
    r.layers = layers_of(b, "sandbox_layers", "sandbox_id", &r.id)?;
    r.services = b
        .query(
            "SELECT command FROM sandbox_services WHERE sandbox_id = $1 ORDER BY position",
            params![&r.id],
        )?
        .iter()
        .map(|row| Ok(row.get(0)?))
        .collect::<Result<_, StateError>>()?;
    Ok(())
}

/// `bytes` random bytes from the kernel, as lowercase hex.
pub fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    getrandom::getrandom(&mut b).expect("the kernel RNG is available");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Milliseconds since the epoch, the unit of every time Cairn records.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
