//! The E2B-compatible gateway (`cairn serve --e2b ADDR`): code written
//! against the `e2b` Python SDK runs against Cairn by pointing
//! `E2B_API_URL` and `E2B_SANDBOX_URL` at this listener. One listener
//! serves both the control plane (`/v2/sandboxes`, `/sandboxes/...`,
//! `/snapshots`; `X-API-KEY` is a Cairn API token) and envd (`/health`,
//! `/files`, `/process.Process/*`, `/filesystem.Filesystem/*`; the sandbox
//! is named by `E2b-Sandbox-Id` and proven by the `X-Access-Token` this
//! gateway issued). See `docs/e2b.md`.
//!
//! An E2B sandbox keeps its id across pause and resume while the Cairn
//! sandbox under it changes: the state store keeps that mapping
//! ([`book`]), and the gateway a copy in memory. Which driver
//! runs a template's sandboxes is the server's choice ([`Drivers`]): on
//! gVisor a pause keeps memory and running processes.

mod base;
mod book;
mod control;
mod drivers;
mod envd;
mod files;
mod form;
mod gzip;
mod jobs;
mod metrics;
mod network;
mod page;
mod ports;
mod rpc;
mod template_book;
mod templates;
mod warm;
mod watch;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{Read, Write};
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;
use cairn_engine::state::e2b::E2bSandbox;
use cairn_engine::Home;
use cairn_sandbox::client::ExecControl;
use tokio::sync::broadcast;

use crate::app::App;
use crate::error::{ApiError, ApiResult};
use book::E2bBook;

pub use base::BaseKind;
pub use cairn_engine::state::e2b::{E2bLife as Life, E2bSandbox as Entry};
pub use drivers::{parse_driver_choice, DriverChoice, Drivers};

/// The envd version reported: ≥ 0.5.2 so the SDK allows `close_stdin`,
/// ≥ 0.4.0 so it sends no user unless asked.
pub const ENVD_VERSION: &str = "0.6.2";
/// A sandbox's lifetime when create names none (E2B's default).
pub const DEFAULT_TIMEOUT_SECS: u64 = 300;
/// The longest lifetime accepted (E2B's limit is 24 hours).
pub const MAX_TIMEOUT_SECS: u64 = 86_400;

/// A process started through `Process/Start`, for `Connect`, `List`,
/// `SendInput`, `SendSignal` and `CloseStdin`.
pub(crate) struct Proc {
    pub handle: Handle,
    /// The `ProcessInfo` JSON `Process/List` answers.
    pub info: serde_json::Value,
    /// Every event after `start`, framed, for reattached streams.
    pub events: broadcast::Sender<bytes::Bytes>,
    /// Started on a terminal (`pty.create`): input comes as `pty`, and
    /// `Process/Update` resizes it.
    pub terminal: bool,
}

/// How the gateway reaches a process it started.
#[derive(Clone)]
pub(crate) enum Handle {
    /// Over the connection to init that started it (its stdin, its
    /// signals): a native sandbox's commands, and commands started with
    /// stdin. Such a connection keeps a gVisor sandbox from a memory
    /// snapshot.
    Attached(ExecControl),
    /// As one of init's named jobs (gVisor, without stdin): it runs on
    /// through memory snapshots, pauses and resumes, and the gateway
    /// follows it again by name afterwards.
    Job(Arc<jobs::Job>),
}

/// The ids of a user in a sandbox (none: root, or no such user), and when
/// they were read.
type UserIds = (Option<cairn_protocol::Ids>, std::time::Instant);

/// The gateway's shared state.
pub struct Gateway {
    pub(crate) app: Arc<App>,
    /// The state store's E2B sandboxes, by id; written through.
    book: Mutex<BTreeMap<String, Entry>>,
    /// Serialises changes to the book, so none is lost to another.
    writing: tokio::sync::Mutex<()>,
    /// Derives each sandbox's envd access token from its id and grant.
    token_key: [u8; 32],
    /// The ids of the API tokens that exist, read again once a second:
    /// open streams of a sandbox whose grant is gone end.
    live_tokens: tokio::sync::watch::Sender<Option<Arc<HashSet<String>>>>,
    /// Running processes by (E2B sandbox id, pid).
    pub(crate) procs: Mutex<HashMap<(String, i32), Proc>>,
    /// Whether a Cairn sandbox has `/bin/bash` (the SDK runs every
    /// command through it).
    pub(crate) bash: Mutex<HashMap<String, bool>>,
    /// The ids of E2B users in Cairn sandboxes, from their /etc/passwd:
    /// found ones for good, missing ones for a second (a command may add
    /// the user).
    users: Mutex<HashMap<(String, String), UserIds>>,
    /// Which driver runs each template's sandboxes.
    drivers: Drivers,
    /// Sandboxes being snapshotted, whose jobs' followers stay off.
    held: Mutex<HashSet<String>>,
    /// Directory watchers (envd's `CreateWatcher`).
    watchers: watch::Watchers,
    /// Each running sandbox's CPU, memory and disk over the last hour.
    metrics: metrics::Metrics,
    /// Whether native sandboxes get a route out (`--e2b-network egress`).
    egress: bool,
    /// What create and info answer as `domain` (`--e2b-domain`).
    domain: Option<String>,
    /// The template builds running now.
    pub(crate) builds: templates::Builds,
    /// What the `base` template is, and its build.
    pub(crate) base: base::Base,
    /// Paused gVisor sandboxes whose resume is prepared ahead.
    pub(crate) warm: warm::Warm,
}

/// Keeps the followers of a sandbox's jobs off while it lives
/// ([`Gateway::hold_followers`]).
pub(crate) struct FollowersHeld {
    gw: Arc<Gateway>,
    id: String,
}

impl Drop for FollowersHeld {
    fn drop(&mut self) {
        self.gw.held.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
    }
}

/// The key access tokens are derived with, `$CAIRN_HOME/e2b-token.key`
/// (mode 0600), made on first use: the state store holds no secret, and
/// tokens stay valid across server restarts.
fn token_key(home: &Home) -> std::io::Result<[u8; 32]> {
    let path = home.root().join("e2b-token.key");
    match read_key(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        other => return other,
    }
    let mut key = [0u8; 32];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut key)?;
    // Written whole to a temporary (0600), then linked into place: a
    // concurrent first start keeps whichever key landed first.
    let mut tmp = tempfile::NamedTempFile::new_in(home.root())?;
    tmp.write_all(&key)?;
    tmp.as_file().sync_all()?;
    match tmp.persist_noclobber(&path) {
        Ok(_) => Ok(key),
        Err(e) if e.error.kind() == std::io::ErrorKind::AlreadyExists => read_key(&path),
        Err(e) => Err(e.error),
    }
}

/// A key file holds exactly 32 bytes; anything else is refused.
fn read_key(path: &std::path::Path) -> std::io::Result<[u8; 32]> {
    let bytes = std::fs::read(path)?;
    <[u8; 32]>::try_from(bytes.as_slice()).map_err(|_| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{} holds {} bytes, not 32; remove it to make a new key (every E2B access token then changes)",
                path.display(),
                bytes.len()
            ),
        )
    })
}

/// A key for this server only, when none can be kept: from the kernel's
/// generator, else (never seen) from the time and the process.
fn ephemeral_key() -> [u8; 32] {
    let mut k = [0u8; 32];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut k))
        .is_err()
    {
        let seed = format!("{:?} {}", std::time::SystemTime::now(), std::process::id());
        k = *blake3::hash(seed.as_bytes()).as_bytes();
    }
    k
}

impl Gateway {
    /// The ids E2B user `user` has in Cairn sandbox `sandbox`: `None` for
    /// root, and for a user its image does not have (whose commands and
    /// files are then root's, as on images without users).
    pub(crate) async fn user_ids(
        self: &Arc<Self>,
        sandbox: &str,
        user: &str,
    ) -> ApiResult<Option<cairn_protocol::Ids>> {
        if user == "root" {
            return Ok(None);
        }
        let key = (sandbox.to_string(), user.to_string());
        if let Some((ids, at)) = self.users.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            if ids.is_some() || at.elapsed() < std::time::Duration::from_secs(1) {
                return Ok(*ids);
            }
        }
        let (s, u) = key.clone();
        let ids = self
            .app
            .init(sandbox, move |e| {
                let rec = e.sandbox(&s)?;
                Ok(e.ids_of(&rec, Some(&u)).ok().flatten())
            })
            .await?;
        let mut users = self.users.lock().unwrap_or_else(|e| e.into_inner());
        // A cache: past 4096 sandbox-user pairs (removed sandboxes' among
        // them) it starts afresh.
        if users.len() > 4096 {
            users.clear();
        }
        users.insert(key, (ids, std::time::Instant::now()));
        Ok(ids)
    }

    pub(crate) fn entry(&self, id: &str) -> Option<Entry> {
        self.book.lock().unwrap_or_else(|e| e.into_inner()).get(id).cloned()
    }

    pub(crate) fn entries(&self) -> Vec<Entry> {
        self.book
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// The envd access token of a sandbox: from its id and the API token
    /// it was granted to, so that a new grant issues a new one.
    pub(crate) fn token(&self, e: &Entry) -> String {
        self.derive(b"", e)
    }

    /// The token that lets requests reach a sandbox's own ports
    /// (`E2B-Traffic-Access-Token`, which the SDKs send on every call to
    /// a sandbox port when create gave one, the code interpreter's
    /// included): derived as the access token is, for another purpose.
    pub(crate) fn traffic_token(&self, e: &Entry) -> String {
        self.derive(b"traffic\0", e)
    }

    /// A token for `purpose` (empty: the access token), from the sandbox's
    /// id and grant with the key.
    fn derive(&self, purpose: &[u8], e: &Entry) -> String {
        let mut h = blake3::Hasher::new_keyed(&self.token_key);
        h.update(purpose);
        h.update(e.id.as_bytes());
        if let Some(grant) = &e.grant {
            h.update(b"\0");
            h.update(grant.as_bytes());
        }
        h.finalize().to_hex()[..48].to_string()
    }

    /// Resolves once the API token `grant` is known to be gone (never for
    /// `None`, a sandbox recorded before grants).
    pub(crate) async fn revoked(&self, grant: Option<String>) {
        let Some(grant) = grant else {
            return std::future::pending().await;
        };
        let mut live = self.live_tokens.subscribe();
        loop {
            let missing = live
                .borrow_and_update()
                .as_ref()
                .is_some_and(|ids| !ids.contains(&grant));
            // The set may predate a token made since: ask the store.
            if missing && matches!(self.app.token_exists(grant.clone()).await, Ok(false)) {
                return;
            }
            if live.changed().await.is_err() {
                // The gateway, which holds the sender, is gone.
                return std::future::pending().await;
            }
        }
    }

    /// Records a sandbox (new or changed) in the state store, then here.
    pub(crate) async fn put(&self, e: Entry) -> ApiResult<()> {
        let _w = self.writing.lock().await;
        self.store(e).await
    }

    async fn store(&self, e: Entry) -> ApiResult<()> {
        let rec = e.clone();
        self.app.engine(move |en| Ok(en.put_e2b_sandbox(&rec)?)).await?;
        self.book
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(e.id.clone(), e);
        Ok(())
    }

    /// Changes a recorded sandbox; `None` when it is not (or no longer)
    /// known.
    pub(crate) async fn modify(&self, id: &str, f: impl FnOnce(&mut Entry)) -> ApiResult<Option<Entry>> {
        let _w = self.writing.lock().await;
        let Some(mut e) = self.entry(id) else {
            return Ok(None);
        };
        f(&mut e);
        self.store(e.clone()).await?;
        Ok(Some(e))
    }

    /// Forgets a sandbox, in the state store and here.
    pub(crate) async fn forget(&self, id: &str) -> ApiResult<()> {
        let _w = self.writing.lock().await;
        let key = id.to_string();
        self.app.engine(move |en| Ok(en.delete_e2b_sandbox(&key)?)).await?;
        self.book.lock().unwrap_or_else(|e| e.into_inner()).remove(id);
        Ok(())
    }

    /// Whether a sandbox here belongs to a tenant not in `tenants`.
    fn has_orphans(&self, tenants: &HashSet<String>) -> bool {
        let book = self.book.lock().unwrap_or_else(|e| e.into_inner());
        book.values()
            .any(|e| e.tenant.as_ref().is_some_and(|t| !tenants.contains(t)))
    }

    /// Reads the book's owners again from the state store, once a sandbox's
    /// tenant is gone: `cairn tenant rm` took its running sandboxes' rows
    /// with it and gave its paused ones to the administrator.
    async fn reread_book(&self) {
        let _w = self.writing.lock().await;
        let stored = match self.app.engine(|en| Ok(en.e2b_sandboxes()?)).await {
            Ok(all) => all,
            Err(e) => return tracing::warn!("e2b: cannot read the E2B sandboxes: {}", e.message),
        };
        let stored: BTreeMap<String, Entry> = stored.into_iter().map(|e| (e.id.clone(), e)).collect();
        let (gone, moved): (Vec<String>, Vec<String>) = {
            let mut book = self.book.lock().unwrap_or_else(|e| e.into_inner());
            let gone = book.keys().filter(|id| !stored.contains_key(*id)).cloned().collect();
            book.retain(|id, _| stored.contains_key(id));
            let mut moved = Vec::new();
            for (id, e) in book.iter_mut() {
                if e.tenant != stored[id].tenant {
                    moved.push(id.clone());
                }
                e.tenant = stored[id].tenant.clone();
            }
            (gone, moved)
        };
        // A resume prepared for the removed tenant went with its sandboxes.
        for id in gone.iter().chain(&moved) {
            self.warm.forget(&self.app, id);
        }
        for id in gone {
            tracing::info!(sandbox = id, "e2b: its tenant was removed");
            self.drop_procs(&id);
        }
    }

    /// Forgets the processes of a sandbox that stopped or paused.
    pub(crate) fn drop_procs(&self, id: &str) {
        let mut p = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        p.retain(|(sid, _), _| sid != id);
    }

    /// The pids of a sandbox's processes attached to a connection to init
    /// (see [`Handle::Attached`]), lowest first.
    pub(crate) fn attached_pids(&self, id: &str) -> Vec<i32> {
        let p = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        let mut pids: Vec<i32> = p
            .iter()
            .filter(|((sid, _), proc)| sid == id && matches!(proc.handle, Handle::Attached(_)))
            .map(|((_, pid), _)| *pid)
            .collect();
        pids.sort_unstable();
        pids
    }

    /// Lets go of every attachment following sandbox `id`'s jobs and keeps
    /// their followers off until the guard is dropped: gVisor cannot
    /// checkpoint while a connection to init is open, and init ends an
    /// attachment on quiesce only once its job writes something.
    pub(crate) fn hold_followers(self: &Arc<Self>, id: &str) -> FollowersHeld {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.to_string());
        let jobs: Vec<Arc<jobs::Job>> = {
            let p = self.procs.lock().unwrap_or_else(|e| e.into_inner());
            p.iter()
                .filter(|((sid, _), _)| sid == id)
                .filter_map(|(_, proc)| match &proc.handle {
                    Handle::Job(job) => Some(Arc::clone(job)),
                    Handle::Attached(_) => None,
                })
                .collect()
        };
        for job in jobs {
            job.let_go();
        }
        FollowersHeld {
            gw: Arc::clone(self),
            id: id.to_string(),
        }
    }

    pub(crate) fn followers_held(&self, id: &str) -> bool {
        self.held.lock().unwrap_or_else(|e| e.into_inner()).contains(id)
    }

    /// Follows again the jobs of sandbox `id` that nothing follows (after
    /// a resume, or a follower that gave up), so their output reaches
    /// reattached streams and their end is noticed.
    pub(crate) fn refollow(self: &Arc<Self>, id: &str) {
        let idle: Vec<(i32, Arc<jobs::Job>, broadcast::Sender<bytes::Bytes>)> = {
            let p = self.procs.lock().unwrap_or_else(|e| e.into_inner());
            p.iter()
                .filter(|((sid, _), _)| sid == id)
                .filter_map(|((_, pid), proc)| match &proc.handle {
                    Handle::Job(job) if job.claim_following() => Some((*pid, Arc::clone(job), proc.events.clone())),
                    _ => None,
                })
                .collect()
        };
        for (pid, job, events) in idle {
            let gw = Arc::clone(self);
            let id = id.to_string();
            tokio::task::spawn_blocking(move || jobs::follow_again(gw, id, pid, job, events));
        }
    }
}

/// A control-plane error: `{"code": <status>, "message"}`, as the SDK
/// parses it.
#[derive(Debug)]
pub struct RestError {
    pub status: StatusCode,
    pub message: String,
}

impl RestError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> RestError {
        RestError {
            status,
            message: message.into(),
        }
    }
    pub fn bad_request(message: impl Into<String>) -> RestError {
        RestError::new(StatusCode::BAD_REQUEST, message)
    }
    pub fn not_found(id: &str) -> RestError {
        RestError::new(
            StatusCode::NOT_FOUND,
            format!("sandbox {id:?} doesn't exist or you don't have access to it"),
        )
    }
}

impl From<ApiError> for RestError {
    fn from(e: ApiError) -> RestError {
        RestError::new(e.status, e.message)
    }
}

impl IntoResponse for RestError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(status = %self.status, "e2b: {}", self.message);
        }
        let body = serde_json::json!({ "code": self.status.as_u16(), "message": self.message });
        let mut resp = (self.status, axum::Json(body)).into_response();
        // Nothing here gets better by retrying at once.
        resp.headers_mut()
            .insert("should-retry", axum::http::HeaderValue::from_static("false"));
        crate::error::close_after_refused_body(&mut resp);
        resp
    }
}

/// Reads the ids of the API tokens that exist once a second, for
/// [`Gateway::revoked`], and the tenants, for [`Gateway::reread_book`].
fn spawn_token_watch(gw: Arc<Gateway>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let read = gw.app.engine(|e| Ok((e.token_ids()?, e.tenant_names()?)));
            match read.await {
                Ok((ids, tenants)) => {
                    gw.live_tokens.send_if_modified(|now| {
                        let changed = now.as_deref() != Some(&ids);
                        if changed {
                            *now = Some(Arc::new(ids));
                        }
                        changed
                    });
                    // A sandbox of a tenant that is gone: `cairn tenant rm`
                    // removed its sandbox or gave it to the administrator.
                    if gw.has_orphans(&tenants) {
                        gw.reread_book().await;
                    }
                }
                Err(e) => tracing::warn!("e2b: cannot read the API tokens: {}", e.message),
            }
        }
    });
}

/// Every route the E2B SDK calls: the control plane and envd, run as
/// `options` say.
/// How the gateway runs sandboxes: `cairn serve --e2b-driver`,
/// `--e2b-network`, `--e2b-domain`.
#[derive(Debug, Clone, Default)]
pub struct E2bOptions {
    /// Which driver runs each template's sandboxes.
    pub drivers: Drivers,
    /// What the `base` template is (`--e2b-base`).
    pub base: BaseKind,
    /// Whether native sandboxes get a route out.
    pub egress: bool,
    /// The domain `get_host(port)` names ports under (`PORT-ID.DOMAIN`),
    /// a wildcard name pointing at this gateway; `None`: the SDK's own
    /// (`E2B_DOMAIN`, else E2B's).
    pub domain: Option<String>,
    /// How many paused gVisor sandboxes are kept ready to resume
    /// (`--e2b-warm`); 0: none.
    pub warm: usize,
}

/// Marks the template builds a stopped server left unfinished as failed.
fn app_recover(app: &Arc<App>) -> Result<(), ApiError> {
    let mut e = app.take_engine()?;
    let out = templates::recover(&mut e).map_err(ApiError::from);
    app.give_back(e);
    out
}

pub fn router(app: Arc<App>, options: E2bOptions) -> Router {
    let E2bOptions {
        drivers,
        egress,
        domain,
        base: base_kind,
        warm,
    } = options;
    let book: BTreeMap<String, Entry> = match app.take_engine().and_then(|e| {
        let all = e.e2b_sandboxes().map_err(ApiError::from);
        app.give_back(e);
        all
    }) {
        Ok(all) => all.into_iter().map(|e: E2bSandbox| (e.id.clone(), e)).collect(),
        Err(e) => {
            tracing::error!("e2b: cannot read the E2B sandboxes, starting with none: {}", e.message);
            BTreeMap::new()
        }
    };
    let token_key = token_key(&app.home).unwrap_or_else(|e| {
        // Without the file, tokens last as long as this server.
        tracing::error!("e2b: cannot keep the access token key in the state directory: {e}");
        ephemeral_key()
    });
    let gw = Arc::new(Gateway {
        app,
        book: Mutex::new(book),
        writing: tokio::sync::Mutex::new(()),
        token_key,
        procs: Mutex::new(HashMap::new()),
        bash: Mutex::new(HashMap::new()),
        users: Mutex::new(HashMap::new()),
        drivers,
        held: Mutex::new(HashSet::new()),
        watchers: watch::Watchers::default(),
        live_tokens: tokio::sync::watch::Sender::new(None),
        metrics: metrics::Metrics::default(),
        egress,
        domain,
        builds: templates::Builds::default(),
        base: base::Base::new(base_kind),
        warm: warm::Warm::new(warm),
    });
    base::build_if_missing(&gw);
    if let Err(e) = app_recover(&gw.app) {
        tracing::error!(
            "e2b: cannot mark the template builds the last server left unfinished: {}",
            e.message
        );
    }
    control::spawn_reaper(Arc::clone(&gw));
    spawn_token_watch(Arc::clone(&gw));
    metrics::spawn_sampler(Arc::clone(&gw));
    let api = Router::new()
        .route("/v2/sandboxes", post(control::create).get(control::list))
        .route("/sandboxes", get(control::list))
        .route("/sandboxes/{id}", get(control::info).delete(control::kill))
        .route("/sandboxes/metrics", get(metrics::many))
        .route("/sandboxes/{id}/metrics", get(metrics::sandbox))
        .route("/sandboxes/{id}/timeout", post(control::set_timeout))
        .route("/sandboxes/{id}/network", axum::routing::put(network::update))
        .route("/sandboxes/{id}/pause", post(control::pause))
        .route("/v2/sandboxes/{id}/connect", post(control::connect))
        .route("/sandboxes/{id}/snapshots", post(control::create_snapshot))
        .route("/sandboxes/{id}/fork", post(control::fork))
        .route("/snapshots", get(control::snapshots))
        .route("/templates/{id}", delete(control::delete_snapshot))
        .route("/v3/templates", post(templates::request_build))
        // Build files are streamed to disk, up to --max-upload.
        .route(
            "/templates/{id}/files/{hash}",
            get(templates::file_link)
                .put(templates::upload)
                .layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/v2/templates/{id}/builds/{build}", post(templates::start_build))
        .route("/templates/{id}/builds/{build}/status", get(templates::status))
        .route("/templates/aliases/{alias}", get(templates::alias))
        .route(
            "/templates/tags",
            post(templates::assign_tags).delete(templates::remove_tags),
        )
        .route("/templates/{id}/tags", get(templates::tags))
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&gw),
            control::require_api_key,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(1 << 20));

    let envd = Router::new()
        .route("/health", get(envd::health))
        .route(
            "/files",
            get(files::read)
                .post(files::write)
                .layer(axum::extract::DefaultBodyLimit::disable()),
        )
        .route("/process.Process/{method}", post(rpc::process))
        .route("/filesystem.Filesystem/{method}", post(rpc::filesystem))
        .route_layer(axum::middleware::from_fn_with_state(Arc::clone(&gw), envd::record));
    api.merge(envd)
        .fallback(|req: axum::extract::Request| async move {
            RestError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "{} {} is not part of the E2B API Cairn serves; see docs/e2b.md",
                    req.method(),
                    req.uri().path()
                ),
            )
        })
        // Requests for a sandbox's own ports go there, whatever their path.
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&gw), ports::route))
        .with_state(gw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_key_is_made_once_and_a_damaged_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let home = Home::at(dir.path().to_path_buf());
        let first = token_key(&home).unwrap();
        assert_eq!(token_key(&home).unwrap(), first, "the key is kept");
        std::fs::write(dir.path().join("e2b-token.key"), [1u8; 33]).unwrap();
        let err = token_key(&home).unwrap_err();
        assert!(err.to_string().contains("33 bytes, not 32"), "{err}");
        assert_ne!(ephemeral_key(), [0u8; 32]);
    }
}
