//! What every handler shares: the state directory, a pool of engines
//! (each with its own state store connection), operations in progress per
//! sandbox, metrics and the event stream.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use cairn_engine::{Engine, EngineError, Home};
use cairn_sandbox::client::ExecControl;
use cairn_session::prelude::*;
use serde::Serialize;
use tokio::sync::broadcast;
use utoipa::ToSchema;

use crate::error::{ApiError, ApiResult};
use crate::metrics::Metrics;

/// Settings of a running server.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The largest file upload accepted, in bytes (413 above it).
    pub max_upload: u64,
    /// Threads for requests to sandboxes' init (see [`crate::init_pool`]).
    pub init_threads: usize,
    /// What may run at once before creates, forks and restores queue.
    pub capacity: crate::admission::Capacity,
    /// How many suspended gVisor sessions are kept ready to resume
    /// (`cairn serve --session-warm`); 0: none.
    pub session_warm: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            max_upload: 1 << 30,
            init_threads: 256,
            capacity: crate::admission::Capacity::from_host(),
            session_warm: 8,
        }
    }
}

/// Something that happened, for `GET /v1/events`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Event {
    /// `sandbox.created`, `sandbox.removed`, `snapshot.created`,
    /// `snapshot.removed`, `sandbox.reset`, `run.started`, `run.stage`,
    /// `run.verdict` (a stage approved or rejected), `run.ended`,
    /// `image.built`, `session.created`, `session.exec`,
    /// `session.suspended`, `session.resumed`, `session.forked`,
    /// `session.rewound`, `session.closed`.
    pub kind: String,
    /// The sandbox, snapshot, run, image or session it is about.
    pub id: String,
    pub detail: String,
    /// Milliseconds since the epoch.
    pub at: i64,
    /// The tenant whose request caused it, when one did (a tenant's event
    /// stream shows its own only).
    #[serde(skip)]
    pub tenant: Option<String>,
}

impl Event {
    /// The kind of object it is about, for a tenant's stream to check.
    pub fn object(&self) -> Option<cairn_engine::tenants::Owned> {
        use cairn_engine::tenants::Owned;
        Some(match self.kind.split('.').next()? {
            "sandbox" => Owned::Sandbox,
            "snapshot" => Owned::Snapshot,
            "run" => Owned::Run,
            "image" => Owned::Image,
            "session" => Owned::Session,
            _ => return None,
        })
    }
}

pub struct App {
    pub home: Home,
    pub settings: Settings,
    /// When this server started (ms): idempotency claims older than this
    /// belonged to a server that is gone.
    pub started_ms: i64,
    pool: Mutex<Vec<Engine>>,
    /// Session resumes prepared ahead, shared by the pool's engines.
    pub warm_sessions: cairn_session::WarmResumes,
    busy: Mutex<HashSet<String>>,
    /// Processes started by streamed execs, for their stdin.
    processes: Mutex<HashMap<(String, i32), ExecControl>>,
    pub metrics: Metrics,
    /// The capacity and the queue before it.
    pub admission: crate::admission::Admission,
    pub events: broadcast::Sender<Event>,
    /// Set when the server stops: open streams end so that it can.
    stopping: tokio::sync::watch::Sender<bool>,
    /// Token checks, on threads of their own.
    auth: Auth,
    /// Requests to sandboxes' init, on threads of their own.
    init_pool: crate::init_pool::InitPool,
    /// Who did what (`cairn audit`).
    pub audit: crate::audit::Audit,
}

/// Threads that check bearer tokens and nothing else: work that blocks
/// (a sandbox that does not answer, a slow store) holds threads of the
/// general pool, never the check that lets a request in.
struct Auth {
    jobs: std::sync::mpsc::SyncSender<AuthJob>,
}

type Checked = Result<Option<cairn_engine::access::TokenRecord>, EngineError>;

enum AuthJob {
    /// The token whose secret this is, if it is valid.
    Check {
        secret: String,
        reply: tokio::sync::oneshot::Sender<Checked>,
    },
    /// Whether the token with this id still exists.
    Exists {
        id: String,
        reply: tokio::sync::oneshot::Sender<Result<bool, EngineError>>,
    },
}

impl Auth {
    const THREADS: usize = 2;
    /// Checks waiting beyond this are answered 503 at once.
    const QUEUE: usize = 1024;

    fn start(home: Home) -> Auth {
        let (jobs, rx) = std::sync::mpsc::sync_channel::<AuthJob>(Self::QUEUE);
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..Self::THREADS {
            let rx = Arc::clone(&rx);
            let home = home.clone();
            let started = std::thread::Builder::new().name("cairn-auth".into()).spawn(move || {
                let mut engine: Option<Engine> = None;
                loop {
                    let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                    let Ok(job) = job else { return };
                    if engine.is_none() {
                        match Engine::open(home.clone()) {
                            Ok(e) => engine = Some(e),
                            Err(e) => {
                                match job {
                                    AuthJob::Check { reply, .. } => drop(reply.send(Err(e))),
                                    AuthJob::Exists { reply, .. } => drop(reply.send(Err(e))),
                                }
                                continue;
                            }
                        }
                    }
                    let Some(e) = &engine else { continue };
                    match job {
                        AuthJob::Check { secret, reply } => drop(reply.send(e.check_token(&secret))),
                        AuthJob::Exists { id, reply } => drop(reply.send(e.token_exists(&id))),
                    }
                }
            });
            if let Err(e) = started {
                tracing::warn!("cannot start a token-checking thread: {e}");
            }
        }
        Auth { jobs }
    }
}

/// A sandbox claimed for one operation; released when dropped.
pub struct Busy {
    app: Arc<App>,
    id: String,
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.app.busy.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.id);
    }
}

pub use cairn_engine::now_ms;

impl App {
    /// Opens the state directory once (migrating and reconciling it).
    pub fn open(home: Home, settings: Settings) -> Result<Arc<App>, EngineError> {
        let mut engine = Engine::open(home.clone())?;
        engine.keep_init_waiting();
        let warm_sessions = cairn_session::WarmResumes::new(settings.session_warm);
        engine.share_warm_resumes(warm_sessions.clone());
        let (events, _) = broadcast::channel(1024);
        let auth = Auth::start(home.clone());
        let home_for_audit = home.clone();
        let metrics = Metrics::default();
        let init_pool = crate::init_pool::InitPool::start(settings.init_threads, metrics.init_pool.clone());
        let admission = crate::admission::Admission::new(settings.capacity.clone());
        Ok(Arc::new(App {
            admission,
            home,
            settings,
            started_ms: now_ms(),
            pool: Mutex::new(vec![engine]),
            warm_sessions,
            busy: Mutex::new(HashSet::new()),
            processes: Mutex::new(HashMap::new()),
            metrics,
            events,
            stopping: tokio::sync::watch::Sender::new(false),
            auth,
            init_pool,
            audit: crate::audit::Audit::start(home_for_audit),
        }))
    }

    /// Prepares the resume of session `id`, just suspended, in the
    /// background (see `cairn_session::WarmResumes`): a gVisor
    /// session's next resume then only loads its image. A failure only
    /// means that resume is not faster.
    pub fn warm_session(self: &Arc<Self>, id: String) {
        if self.settings.session_warm == 0 {
            return;
        }
        let app = Arc::clone(self);
        tokio::spawn(async move {
            let session = id.clone();
            // As the administrator: the engine acts for the session's owner.
            let made = crate::acting::acting(None, app.engine(move |e| Ok(e.prepare_session_resume(&session)?))).await;
            if let Err(e) = made {
                tracing::warn!(session = %id, "cannot prepare a suspended session's resume: {}", e.message);
            }
        });
    }

    /// Runs `f` on an engine from the pool, on a blocking thread.
    pub async fn engine<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&mut Engine) -> Result<T, ApiError> + Send + 'static,
    ) -> ApiResult<T> {
        let app = Arc::clone(self);
        let tenant = crate::acting::current();
        tokio::task::spawn_blocking(move || {
            let mut engine = app.take_engine_for(tenant)?;
            let out = f(&mut engine);
            app.give_back(engine);
            out
        })
        .await
        .map_err(|e| ApiError::internal(format!("a worker thread failed: {e}")))?
    }

    /// Runs `f`, a request to the init of sandbox `sandbox`, on an engine
    /// from the pool, on a thread of the init request pool: 503 when that
    /// sandbox has its share of the pool already or the pool is full.
    pub async fn init<T: Send + 'static>(
        self: &Arc<Self>,
        sandbox: &str,
        f: impl FnOnce(&mut Engine) -> Result<T, ApiError> + Send + 'static,
    ) -> ApiResult<T> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let tenant = crate::acting::current();
        self.on_init_pool(sandbox, move |app, place| {
            let out = app.take_engine_for(tenant).and_then(|mut engine| {
                let out = f(&mut engine);
                app.give_back(engine);
                out
            });
            // Its place goes back before the answer, so that the client's
            // next request to the sandbox finds it free.
            drop(place);
            let _ = reply.send(out);
        })?;
        answer
            .await
            .map_err(|_| ApiError::internal("a sandbox request thread failed"))?
    }

    /// Runs `job` on a thread of the init request pool, counted against
    /// sandbox `sandbox` until it drops its place (see [`Self::init`]).
    pub fn on_init_pool(
        self: &Arc<Self>,
        sandbox: &str,
        job: impl FnOnce(&Arc<App>, crate::init_pool::Release) + Send + 'static,
    ) -> ApiResult<()> {
        let app = Arc::clone(self);
        self.init_pool.submit(sandbox, move |place| job(&app, place))
    }

    /// Checks a bearer token on the token-checking threads: `None` when it
    /// is not valid; 503 when more checks wait than those threads keep.
    pub async fn check_token(&self, secret: String) -> ApiResult<Option<cairn_engine::access::TokenRecord>> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.send_auth(AuthJob::Check { secret, reply })?;
        match answer.await {
            Ok(checked) => Ok(checked?),
            Err(_) => Err(ApiError::internal("a token-checking thread failed")),
        }
    }

    /// Whether the API token with this id still exists (on the
    /// token-checking threads).
    pub async fn token_exists(&self, id: String) -> ApiResult<bool> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.send_auth(AuthJob::Exists { id, reply })?;
        match answer.await {
            Ok(exists) => Ok(exists?),
            Err(_) => Err(ApiError::internal("a token-checking thread failed")),
        }
    }

    fn send_auth(&self, job: AuthJob) -> ApiResult<()> {
        match self.auth.jobs.try_send(job) {
            Ok(()) => {}
            Err(std::sync::mpsc::TrySendError::Full(_)) => {
                return Err(ApiError::new(
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    "too many requests are waiting for their token to be checked; retry shortly",
                ))
            }
            Err(std::sync::mpsc::TrySendError::Disconnected(_)) => {
                return Err(ApiError::internal("the token-checking threads are gone"))
            }
        }
        Ok(())
    }

    /// An engine for a blocking thread of the caller's own (pipeline
    /// runs), acting for the current request's tenant.
    pub fn take_engine(&self) -> ApiResult<Engine> {
        self.take_engine_for(crate::acting::current())
    }

    /// An engine acting for `tenant` (see `cairn_engine::tenants`).
    pub fn take_engine_for(&self, tenant: Option<String>) -> ApiResult<Engine> {
        let pooled = self.pool.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let engine = match pooled {
            Some(e) => e,
            None => {
                let mut e = Engine::open(self.home.clone())?;
                e.share_warm_resumes(self.warm_sessions.clone());
                e
            }
        };
        engine.act_for(tenant);
        Ok(engine)
    }

    pub fn give_back(&self, engine: Engine) {
        engine.act_for(None);
        let mut pool = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < 16 {
            pool.push(engine);
        }
    }

    /// Claims sandbox `id` for an operation that must not overlap another
    /// on it (snapshot, reset, fork, remove); 409 while one is in progress.
    pub fn claim(self: &Arc<Self>, id: &str, what: &str) -> ApiResult<Busy> {
        self.claim_key(id.to_string(), || {
            format!("sandbox {id} is busy with another operation; retry the {what} when it is done")
        })
    }

    /// Claims session `id` for an operation that must not overlap another
    /// on it (exec, suspend, resume, rewind, close); 409 while one is in
    /// progress.
    pub fn claim_session(self: &Arc<Self>, id: &str, what: &str) -> ApiResult<Busy> {
        self.claim_key(format!("session:{id}"), || {
            format!(
                "session {id} is busy with another exec, suspend, resume, rewind or removal; \
                 retry the {what} when it is done"
            )
        })
    }

    fn claim_key(self: &Arc<Self>, key: String, busy_message: impl FnOnce() -> String) -> ApiResult<Busy> {
        let mut busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        if !busy.insert(key.clone()) {
            return Err(ApiError::conflict(busy_message()));
        }
        Ok(Busy {
            app: Arc::clone(self),
            id: key,
        })
    }

    pub fn register(&self, sandbox: &str, pid: i32, control: ExecControl) {
        let mut p = self.processes.lock().unwrap_or_else(|e| e.into_inner());
        p.insert((sandbox.to_string(), pid), control);
    }

    pub fn unregister(&self, sandbox: &str, pid: i32) {
        let mut p = self.processes.lock().unwrap_or_else(|e| e.into_inner());
        p.remove(&(sandbox.to_string(), pid));
    }

    pub fn control(&self, sandbox: &str, pid: i32) -> Option<ExecControl> {
        let p = self.processes.lock().unwrap_or_else(|e| e.into_inner());
        p.get(&(sandbox.to_string(), pid)).cloned()
    }

    /// Ends every open stream (exec output, events): the server is stopping.
    pub fn stop_streams(&self) {
        self.stopping.send_replace(true);
    }

    /// Resolves once the server is stopping.
    pub fn stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.stopping.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }

    pub fn emit(&self, kind: &str, id: &str, detail: impl Into<String>) {
        let _ = self.events.send(Event {
            kind: kind.into(),
            id: id.into(),
            detail: detail.into(),
            at: now_ms(),
            tenant: crate::acting::current(),
        });
    }
}

impl crate::admission::Host for Arc<App> {
    fn running(&self) -> crate::admission::RunningSoon<'_> {
        Box::pin(async move {
            self.engine(|e| {
                Ok(e.running_sandboxes()?
                    .into_iter()
                    .map(|r| (r.id, r.memory_bytes, u64::from(r.cpu_millis)))
                    .collect::<Vec<_>>())
            })
            .await
            .ok()
        })
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}
