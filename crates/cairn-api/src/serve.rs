//! `cairn serve`: the listeners, graceful shutdown, and picking up what a
//! previous server left.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;

use cairn_engine::Home;
use cairn_session::prelude::*;
use tokio::net::{TcpListener, UnixListener};

use crate::app::{App, Settings};
use crate::listen::{Admission, Limits, Listener};

#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The Unix socket (default `$CAIRN_HOME/cairn.sock`).
    pub socket: Option<PathBuf>,
    /// A TCP address as well (bearer tokens required there).
    pub listen: Option<SocketAddr>,
    /// A TCP address for the E2B-compatible API (its own API keys and
    /// access tokens).
    pub e2b: Option<SocketAddr>,
    /// Which driver runs each E2B template's sandboxes.
    /// How the E2B gateway runs sandboxes (drivers, network, domain).
    pub e2b_options: crate::e2b::E2bOptions,
    pub settings: Settings,
    /// Timeouts and connection caps of every listener.
    pub limits: Limits,
    /// Host names a TCP listener on a loopback address answers to besides
    /// loopback ones (`crate::hosts`).
    pub allowed_hosts: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Engine(#[from] cairn_engine::EngineError),
    #[error("cannot listen on {what}: {source}; {hint}")]
    Listen {
        what: String,
        source: std::io::Error,
        hint: &'static str,
    },
    #[error("{0}")]
    Other(String),
}

/// The default socket path.
pub fn socket_path(home: &Home) -> PathBuf {
    home.root().join("cairn.sock")
}

/// Serves until SIGINT or SIGTERM; in-flight requests finish first.
/// Sandboxes and runs outlive the server; runs it finds interrupted at
/// start are resumed.
pub async fn serve(home: Home, opts: ServeOptions) -> Result<(), ServeError> {
    raise_open_files();
    let app = App::open(home.clone(), opts.settings.clone())?;
    let socket = opts.socket.clone().unwrap_or_else(|| socket_path(&home));
    let unix = bind_unix(&socket)?;
    let resumed = crate::routes::runs::resume_interrupted(&app).map_err(|e| ServeError::Other(e.message))?;
    let router = crate::router(Arc::clone(&app));
    let tcp_listeners = usize::from(opts.listen.is_some()) + usize::from(opts.e2b.is_some());
    let caps = crate::listen::caps(&opts.limits, open_files(), tcp_listeners).map_err(ServeError::Other)?;
    let limits = opts.limits.clone();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    let mut start = |listener: Listener, admission: Admission, router: axum::Router| {
        tasks.spawn(crate::listen::run(
            listener,
            admission,
            router,
            Arc::clone(&app),
            limits.clone(),
            stop_rx.clone(),
        ));
    };
    let tcp_admission = |name| Admission {
        name,
        cap: caps.tcp,
        per_peer: caps.per_peer,
    };
    start(
        Listener::Unix(unix),
        Admission {
            name: "unix",
            cap: caps.unix,
            per_peer: caps.unix,
        },
        router.clone(),
    );
    eprintln!("cairn: serving on {} (unix)", socket.display());
    if let Some(addr) = opts.listen {
        let (tcp, shown) = bind_tcp(addr, "pick a free address with --listen HOST:PORT").await?;
        let authed = router.layer(axum::middleware::from_fn_with_state(
            Arc::clone(&app),
            crate::require_token,
        ));
        let authed = guard_hosts(authed, addr, &opts.allowed_hosts);
        start(Listener::Tcp(tcp), tcp_admission("api"), authed);
        eprintln!("cairn: serving on http://{shown} (bearer tokens: `cairn token create NAME`)");
    }
    if let Some(addr) = opts.e2b {
        let (tcp, shown) = bind_tcp(addr, "pick a free address with --e2b HOST:PORT").await?;
        if opts.e2b_options.drivers.uses_gvisor() && cairn_sandbox::gvisor::Runsc::locate().is_none() {
            eprintln!(
                "cairn: warning: --e2b-driver names gvisor but runsc is not installed \
                 (apt-get install runsc, or set CAIRN_RUNSC): creating those E2B sandboxes will fail"
            );
        }
        let e2b = crate::e2b::router(Arc::clone(&app), opts.e2b_options.clone());
        // Port names under --e2b-domain (`PORT-ID.DOMAIN`) are this server's.
        let mut allowed = opts.allowed_hosts.clone();
        allowed.extend(opts.e2b_options.domain.iter().map(|d| format!("*.{d}")));
        let e2b = guard_hosts(e2b, addr, &allowed);
        start(Listener::Tcp(tcp), tcp_admission("e2b"), e2b);
        eprintln!("cairn: serving the E2B API on http://{shown} (E2B_API_KEY: `cairn token create NAME`)");
    }
    if tcp_listeners > 0 {
        eprintln!(
            "cairn: limits: {} connections per TCP listener, {} per address; headers within {}, idle {}, \
             unread answers {}; {} of {} descriptors reserved; {} threads for sandbox init requests \
             (docs/security.md)",
            caps.tcp,
            caps.per_peer,
            humantime::format_duration(limits.header_timeout),
            humantime::format_duration(limits.idle_timeout),
            humantime::format_duration(limits.write_timeout),
            caps.reserve,
            caps.nofile,
            opts.settings.init_threads.max(1),
        );
    }
    let idle = tokio::spawn(idle_timer(Arc::clone(&app)));
    if !resumed.is_empty() {
        eprintln!(
            "cairn: resuming {} interrupted run(s): {}",
            resumed.len(),
            resumed.join(", ")
        );
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| ServeError::Other(format!("cannot watch SIGTERM: {e}")))?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        Some(r) = tasks.join_next() => {
            return Err(ServeError::Other(format!("a listener stopped: {r:?}")));
        }
    }
    eprintln!("cairn: stopping: finishing requests in flight; sandboxes and runs keep running");
    let _ = stop_tx.send(true);
    app.stop_streams();
    idle.abort();
    while tasks.join_next().await.is_some() {}
    let _ = std::fs::remove_file(&socket);
    Ok(())
}

/// Suspends sessions idle past their idle timeout (`cairn session create
/// --idle`), checking once a second; the next exec, file call or user
/// message resumes them. A session running a command is never idle.
async fn idle_timer(app: Arc<App>) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let swept = app
            .engine(|e| {
                // Resumes prepared for sessions that moved on go first.
                if let Err(error) = e.prune_warm_resumes() {
                    tracing::warn!(%error, "removing prepared session resumes no longer wanted failed");
                }
                Ok(e.suspend_idle_sessions(cairn_engine::now_ms())?)
            })
            .await;
        match swept {
            Ok(sweep) => {
                for id in &sweep.suspended {
                    tracing::info!(session = %id, "suspended: idle");
                    app.emit("session.suspended", id, "idle timeout");
                    app.warm_session(id.clone());
                }
                for (id, error) in &sweep.failed {
                    tracing::warn!(session = %id, %error, "suspending an idle session failed");
                }
            }
            Err(e) => tracing::warn!(error = %e.message, "the idle timer could not look at sessions"),
        }
    }
}

/// Binds a TCP listener at `addr`; also the address it got, as shown.
/// `router` behind the DNS rebinding check when `addr` is a loopback
/// address (the check runs before anything else).
fn guard_hosts(router: axum::Router, addr: SocketAddr, allowed: &[String]) -> axum::Router {
    match crate::hosts::HostGuard::for_listener(addr, allowed) {
        Some(guard) => router.layer(axum::middleware::from_fn_with_state(guard, crate::hosts::check)),
        None => router,
    }
}

async fn bind_tcp(addr: SocketAddr, hint: &'static str) -> Result<(TcpListener, String), ServeError> {
    let tcp = TcpListener::bind(addr).await.map_err(|source| ServeError::Listen {
        what: addr.to_string(),
        source,
        hint,
    })?;
    let shown = tcp
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| addr.to_string());
    Ok((tcp, shown))
}

/// Binds the Unix socket, mode 0600, replacing a stale one (a socket
/// nothing answers on); refuses while another server answers there.
fn bind_unix(path: &std::path::Path) -> Result<UnixListener, ServeError> {
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(ServeError::Listen {
            what: path.display().to_string(),
            source: std::io::Error::from(std::io::ErrorKind::AddrInUse),
            hint: "another `cairn serve` answers there; stop it, or give --socket PATH",
        });
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
            let _ = std::fs::remove_file(path);
        }
        Ok(_) => {
            return Err(ServeError::Listen {
                what: path.display().to_string(),
                source: std::io::Error::from(std::io::ErrorKind::AlreadyExists),
                hint: "something that is not a socket is there; move it, or give --socket PATH",
            })
        }
        Err(_) => {}
    }
    // The process's umask (077, see cairn's main) keeps the socket the
    // owner's from the start; it is not changed here, for a umask is the
    // whole process's, and an init started meanwhile on another thread
    // would take the change with it.
    let listener = UnixListener::bind(path).map_err(|source| ServeError::Listen {
        what: path.display().to_string(),
        source,
        hint: "check the state directory, or give --socket PATH",
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(|source| ServeError::Listen {
        what: path.display().to_string(),
        source,
        hint: "check the state directory",
    })?;
    Ok(listener)
}

/// Each streamed exec holds a client connection and one to the sandbox's
/// init: a thousand at once need more than the usual 1,024 descriptors.
fn raise_open_files() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
        }
    }
}

/// The process's descriptor limit (after [`raise_open_files`]).
fn open_files() -> u64 {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(soft, _)| soft)
        .unwrap_or(1024)
}
