//! The listeners' accept loops, built so that connections without a token
//! cannot use up what authenticated ones need.
//!
//! A connection is admitted while its listener and its peer address are
//! under their caps. When either is full, the connection that has waited
//! longest without sending a whole request makes room (then the one idle
//! longest between requests); a connection with a request in progress is
//! never pushed out, and a new one is refused only when every admitted one
//! is busy. A connection that has not sent a whole request within the
//! header timeout, or has sat idle between requests past the idle timeout,
//! is closed; so is one whose client stops reading an answer for the write
//! timeout. Accept errors (descriptors exhausted) back off instead of
//! spinning, and the caps are sized under the process's descriptor limit
//! with a reserve kept back for the Unix socket, init connections and the
//! state store.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::Router;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio_util::sync::CancellationToken;

use crate::app::App;

/// What `cairn serve` allows each connection (docs/security.md).
#[derive(Debug, Clone)]
pub struct Limits {
    /// A request's headers must arrive whole within this, from the moment
    /// the server waits for them.
    pub header_timeout: Duration,
    /// A connection with no request in progress is closed after this.
    pub idle_timeout: Duration,
    /// A client that reads nothing of an answer for this loses its
    /// connection.
    pub write_timeout: Duration,
    /// Connections at once on each listener (lowered to fit the
    /// descriptor limit).
    pub max_connections: usize,
    /// Connections at once from one address on each TCP listener.
    pub max_per_peer: usize,
    /// Descriptors never given to TCP connections: they stay for the Unix
    /// socket, init connections, files and the state store.
    pub fd_reserve: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            write_timeout: Duration::from_secs(60),
            max_connections: 4096,
            max_per_peer: 256,
            fd_reserve: 1024,
        }
    }
}

/// Connection caps sized under the descriptor limit `nofile`: each TCP
/// connection may hold an init connection too, so TCP listeners share
/// half of what the reserve leaves. Errors when nothing would be left.
pub fn caps(limits: &Limits, nofile: u64, tcp_listeners: usize) -> Result<Caps, String> {
    let reserve = limits.fd_reserve.min(nofile / 2);
    let per_listener = (nofile - reserve) / 2 / tcp_listeners.max(1) as u64;
    if per_listener < 8 {
        return Err(format!(
            "the descriptor limit ({nofile}) leaves {per_listener} connections per TCP listener after a \
             reserve of {reserve}; raise it (ulimit -n) or lower --fd-reserve"
        ));
    }
    let tcp = limits.max_connections.min(per_listener as usize);
    Ok(Caps {
        tcp,
        per_peer: limits.max_per_peer.min(tcp),
        unix: limits.max_connections,
        reserve,
        nofile,
    })
}

/// The caps [`caps`] settled on.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    pub tcp: usize,
    pub per_peer: usize,
    pub unix: usize,
    pub reserve: u64,
    pub nofile: u64,
}

/// Why a connection was closed by the server, for `/metrics`.
#[derive(Debug, Clone, Copy)]
pub enum Closed {
    /// Refused at accept: the listener (or the peer's share) was full of
    /// busy connections.
    Refused,
    /// Pushed out to make room for a new connection.
    Evicted,
    /// Headers not whole within the header timeout.
    HeaderTimeout,
    /// Idle past the idle timeout.
    IdleTimeout,
}

impl Closed {
    pub fn as_str(self) -> &'static str {
        match self {
            Closed::Refused => "refused",
            Closed::Evicted => "evicted",
            Closed::HeaderTimeout => "header_timeout",
            Closed::IdleTimeout => "idle_timeout",
        }
    }
}

/// One admitted connection.
struct Conn {
    peer: Option<IpAddr>,
    opened: Instant,
    /// Requests whose answer has not been sent whole.
    in_flight: AtomicUsize,
    /// Requests whose headers arrived.
    requests: AtomicU64,
    /// When `in_flight` last fell to 0, in ms since `opened`.
    idle_since_ms: AtomicU64,
    /// When the first byte of the next request's headers arrived, in ms
    /// since `opened`; [`NOT_YET`] until it does.
    head_started_ms: AtomicU64,
    close: CancellationToken,
}

const NOT_YET: u64 = u64::MAX;

impl Conn {
    fn new(peer: Option<IpAddr>) -> Conn {
        Conn {
            peer,
            opened: Instant::now(),
            in_flight: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            idle_since_ms: AtomicU64::new(0),
            head_started_ms: AtomicU64::new(NOT_YET),
            close: CancellationToken::new(),
        }
    }

    fn ms(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.opened).as_millis() as u64
    }

    /// Why the connection is past a timeout at `now`, if it is: its
    /// headers not whole within the header timeout (from the connection's
    /// start for the first request, from their first byte for the next),
    /// or no request in progress for the idle timeout.
    fn overdue(&self, now: Instant, limits: &Limits) -> Option<Closed> {
        let idle = self.idle_for(now)?;
        let head = if self.requests.load(Ordering::Acquire) == 0 {
            Some(now.saturating_duration_since(self.opened))
        } else {
            match self.head_started_ms.load(Ordering::Acquire) {
                NOT_YET => None,
                ms => Some(now.saturating_duration_since(self.opened + Duration::from_millis(ms))),
            }
        };
        if head.is_some_and(|h| h > limits.header_timeout) {
            Some(Closed::HeaderTimeout)
        } else if idle > limits.idle_timeout {
            Some(Closed::IdleTimeout)
        } else {
            None
        }
    }

    /// Notes bytes read: the first between requests start the next one's
    /// headers.
    fn read_some(&self) {
        if self.idle() && self.head_started_ms.load(Ordering::Acquire) == NOT_YET {
            self.head_started_ms.store(self.ms(Instant::now()), Ordering::Release);
        }
    }

    fn idle(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) == 0
    }

    /// Time without a request in progress, if it has none.
    fn idle_for(&self, now: Instant) -> Option<Duration> {
        if !self.idle() {
            return None;
        }
        let since = self.opened + Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire));
        Some(now.saturating_duration_since(since))
    }
}

/// Counts a request in progress on its connection until dropped (with the
/// answer's body).
struct InFlight(Arc<Conn>);

impl InFlight {
    fn begin(conn: &Arc<Conn>) -> InFlight {
        conn.head_started_ms.store(NOT_YET, Ordering::Release);
        conn.requests.fetch_add(1, Ordering::AcqRel);
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(Arc::clone(conn))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let ms = self.0.opened.elapsed().as_millis() as u64;
        self.0.idle_since_ms.store(ms, Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The connections admitted on one listener.
struct Table {
    name: &'static str,
    cap: usize,
    per_peer: usize,
    limits: Limits,
    app: Arc<App>,
    state: Mutex<TableState>,
}

#[derive(Default)]
struct TableState {
    next: u64,
    open: BTreeMap<u64, Arc<Conn>>,
    peers: HashMap<IpAddr, usize>,
}

impl TableState {
    fn remove(&mut self, id: u64) -> Option<Arc<Conn>> {
        let conn = self.open.remove(&id)?;
        if let Some(ip) = conn.peer {
            if let Some(n) = self.peers.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    self.peers.remove(&ip);
                }
            }
        }
        Some(conn)
    }

    /// The connection to push out among those `within` picks: the oldest
    /// that never sent a whole request, else the one idle longest.
    fn victim(&self, within: impl Fn(&Conn) -> bool) -> Option<u64> {
        let waiting = self
            .open
            .iter()
            .find(|(_, c)| within(c) && c.idle() && c.requests.load(Ordering::Acquire) == 0);
        if let Some((id, _)) = waiting {
            return Some(*id);
        }
        let now = Instant::now();
        self.open
            .iter()
            .filter(|(_, c)| within(c))
            .filter_map(|(id, c)| c.idle_for(now).map(|d| (d, *id)))
            .max()
            .map(|(_, id)| id)
    }
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, TableState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn closed(&self, why: Closed) {
        self.app.metrics.connection_closed(self.name, why.as_str());
    }

    /// Admits a connection from `peer`, pushing out an idle one where a
    /// cap is reached; `None` when every connection in the way is busy.
    fn admit(&self, peer: Option<IpAddr>) -> Option<(u64, Arc<Conn>)> {
        let mut s = self.lock();
        let mut evicted = Vec::new();
        if let Some(ip) = peer {
            if s.peers.get(&ip).copied().unwrap_or(0) >= self.per_peer {
                match s.victim(|c| c.peer == Some(ip)) {
                    Some(id) => evicted.extend(s.remove(id)),
                    None => {
                        drop(s);
                        self.closed(Closed::Refused);
                        return None;
                    }
                }
            }
        }
        if s.open.len() >= self.cap {
            match s.victim(|_| true) {
                Some(id) => evicted.extend(s.remove(id)),
                None => {
                    drop(s);
                    for c in evicted {
                        c.close.cancel();
                        self.closed(Closed::Evicted);
                    }
                    self.closed(Closed::Refused);
                    return None;
                }
            }
        }
        let conn = Arc::new(Conn::new(peer));
        let id = s.next;
        s.next += 1;
        s.open.insert(id, Arc::clone(&conn));
        if let Some(ip) = peer {
            *s.peers.entry(ip).or_default() += 1;
        }
        let open = s.open.len();
        drop(s);
        for c in evicted {
            c.close.cancel();
            self.closed(Closed::Evicted);
        }
        self.app.metrics.connections_open(self.name, open);
        Some((id, conn))
    }

    /// Forgets connection `id` when its task ends.
    fn forget(&self, id: u64) {
        let mut s = self.lock();
        s.remove(id);
        let open = s.open.len();
        drop(s);
        self.app.metrics.connections_open(self.name, open);
    }

    /// Closes connections past the header or idle timeout, once a tick.
    async fn watch_timeouts(self: Arc<Self>) {
        let tick = (self.limits.header_timeout.min(self.limits.idle_timeout) / 4)
            .clamp(Duration::from_millis(50), Duration::from_secs(1));
        let mut every = tokio::time::interval(tick);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let now = Instant::now();
            let mut late = Vec::new();
            let mut s = self.lock();
            for (id, c) in &s.open {
                if let Some(why) = c.overdue(now, &self.limits) {
                    late.push((*id, why));
                }
            }
            let late: Vec<_> = late
                .into_iter()
                .filter_map(|(id, why)| s.remove(id).map(|c| (c, why)))
                .collect();
            let open = s.open.len();
            drop(s);
            if late.is_empty() {
                continue;
            }
            for (c, why) in late {
                c.close.cancel();
                self.closed(why);
            }
            self.app.metrics.connections_open(self.name, open);
        }
    }
}

/// A listener `cairn serve` accepts on.
pub enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

/// A listener's name (for `/metrics`) and caps.
#[derive(Debug, Clone, Copy)]
pub struct Admission {
    pub name: &'static str,
    /// Connections at once.
    pub cap: usize,
    /// Connections at once from one address.
    pub per_peer: usize,
}

/// Accepts on `listener` until `stop` turns true, serving `router` on each
/// connection `admission` lets in; then lets requests in flight finish.
pub async fn run(
    listener: Listener,
    admission: Admission,
    router: Router,
    app: Arc<App>,
    limits: Limits,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let Admission { name, cap, per_peer } = admission;
    let table = Arc::new(Table {
        name,
        cap,
        per_peer,
        limits,
        app,
        state: Mutex::new(TableState::default()),
    });
    let graceful = GracefulShutdown::new();
    let timeouts = tokio::spawn(Arc::clone(&table).watch_timeouts());
    let mut backoff: Option<Duration> = None;
    let mut warned: Option<Instant> = None;
    loop {
        let accepted = tokio::select! {
            a = accept(&listener) => a,
            _ = stop.wait_for(|s| *s) => break,
        };
        match accepted {
            Ok(Accepted::Tcp(stream, peer)) => {
                backoff = None;
                // Streamed answers go out as many small writes; with
                // Nagle's algorithm each waits for the client's delayed
                // ACK (40 ms).
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::debug!("cannot set TCP_NODELAY: {e}");
                }
                if let Some((id, conn)) = table.admit(Some(peer.ip().to_canonical())) {
                    spawn(&table, &graceful, &router, stream, id, conn);
                }
            }
            Ok(Accepted::Unix(stream)) => {
                backoff = None;
                if let Some((id, conn)) = table.admit(None) {
                    spawn(&table, &graceful, &router, stream, id, conn);
                }
            }
            Err(e) if transient(&e) => {}
            Err(e) => {
                // Out of descriptors or memory: wait for connections to
                // end rather than spin on the same error.
                let wait = backoff.map_or(Duration::from_millis(10), |b| (b * 2).min(Duration::from_secs(1)));
                backoff = Some(wait);
                if warned.is_none_or(|w| w.elapsed() > Duration::from_secs(10)) {
                    warned = Some(Instant::now());
                    tracing::warn!(listener = name, error = %e, "accept failed; backing off");
                    eprintln!("cairn: {name}: accept failed ({e}); backing off");
                }
                tokio::time::sleep(wait).await;
            }
        }
    }
    timeouts.abort();
    drop(listener);
    graceful.shutdown().await;
}

enum Accepted {
    Tcp(TcpStream, std::net::SocketAddr),
    Unix(tokio::net::UnixStream),
}

async fn accept(listener: &Listener) -> io::Result<Accepted> {
    match listener {
        Listener::Tcp(l) => l.accept().await.map(|(s, a)| Accepted::Tcp(s, a)),
        Listener::Unix(l) => l.accept().await.map(|(s, _)| Accepted::Unix(s)),
    }
}

/// Errors about one connection, not the listener: accept the next.
fn transient(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::Interrupted
    )
}

/// Serves one admitted connection on a task of its own, until it ends, the
/// table closes it, or the server stops.
fn spawn<S>(table: &Arc<Table>, graceful: &GracefulShutdown, router: &Router, io: S, id: u64, conn: Arc<Conn>)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let io = TokioIo::new(Watched::new(io, Arc::clone(&conn), table.limits.write_timeout));
    let on = Arc::clone(&conn);
    let router = router.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let busy = InFlight::begin(&on);
        let mut router = router.clone();
        async move {
            let answer = match tower_service::Service::call(&mut router, req).await {
                Ok(a) => a,
                Err(never) => match never {},
            };
            // The request counts as in progress until its answer's body
            // is sent whole (or dropped).
            Ok::<_, std::convert::Infallible>(answer.map(|body| {
                Body::new(body.map_frame(move |frame| {
                    let _ = &busy;
                    frame
                }))
            }))
        }
    });
    // Header and idle timeouts are the table's (hyper's own header timeout
    // would also close a keep-alive connection idle past it).
    let builder = auto::Builder::new(TokioExecutor::new());
    let served = graceful.watch(builder.serve_connection_with_upgrades(io, service).into_owned());
    let table = Arc::clone(table);
    tokio::spawn(async move {
        tokio::select! {
            r = served => {
                if let Err(e) = r {
                    tracing::debug!(listener = table.name, "connection ended: {e}");
                }
            }
            _ = conn.close.cancelled() => {}
        }
        table.forget(id);
    });
}

/// A connection as the table watches it: reads mark the start of a
/// request's headers, and writes fail once the client has read nothing for
/// `limit` (an answer nobody reads cannot hold its buffers and task for
/// ever).
struct Watched<S> {
    io: S,
    conn: Arc<Conn>,
    limit: Duration,
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> Watched<S> {
    fn new(io: S, conn: Arc<Conn>, limit: Duration) -> Self {
        Watched {
            io,
            conn,
            limit,
            stalled: None,
        }
    }

    /// Called while a write cannot proceed: ready with an error once it has
    /// not for `limit`.
    fn poll_stalled(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let limit = self.limit;
        let sleep = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client read nothing for {limit:?}"),
            )),
            Poll::Pending => Poll::Pending,
        }
    }

    fn progress<T>(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match polled {
            Poll::Pending => self.poll_stalled(cx).map(Err),
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.conn.read_some();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.progress(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.progress(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.progress(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
