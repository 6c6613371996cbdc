//! Admission instead of 429: the server has a capacity (sandboxes, memory
//! and CPU, each summed over the sandboxes it runs), and a create, fork or
//! restore beyond it waits in a queue instead of failing. Waiting requests
//! start in order: the highest `Priority` first, then the token holding the
//! fewest sandboxes (so tokens under contention share alike), then the
//! oldest. A token may also hold at most `--token-max-sandboxes` at once;
//! its requests past that wait for its own sandboxes to go. Only a request
//! whose deadline (`Request-Timeout`, in seconds) passes is refused, before
//! anything is made.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;

use crate::error::{ApiError, ApiResult};
use crate::metrics::Metrics;

/// How long a request waits for capacity when it names no deadline.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(300);
/// The longest deadline a request may ask for.
const MAX_WAIT: Duration = Duration::from_secs(3600);
/// How often a waiting request looks at the sandboxes again (others may
/// have gone without this server's knowing: timeouts, the CLI).
const LOOK_AGAIN: Duration = Duration::from_millis(200);
/// How long counts that leave room are trusted without a look.
const TRUST_FOR: Duration = Duration::from_secs(5);

/// What the server may run at once; `None` is no bound.
#[derive(Debug, Clone, Default)]
pub struct Capacity {
    pub sandboxes: Option<u64>,
    pub memory_bytes: Option<u64>,
    pub cpu_millis: Option<u64>,
    /// Sandboxes one token may hold at once.
    pub per_token: Option<u64>,
}

impl Capacity {
    /// The default: memory and CPU from the host. Sandboxes' limits are
    /// ceilings that most do not reach, so the budgets are the host's four
    /// times over: the queue holds back a burst that would overcommit the
    /// host many times, not a normal load.
    pub fn from_host() -> Capacity {
        let memory = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|kb| kb * 1024)
        });
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
        Capacity {
            sandboxes: None,
            memory_bytes: memory.map(|m| m * 4),
            cpu_millis: Some(cpus * 1000 * 16),
            per_token: None,
        }
    }
}

impl Capacity {
    /// What of this capacity `need` alone is over, if any.
    fn exceeded_by(&self, need: Usage) -> Option<String> {
        if let Some(m) = self.sandboxes.filter(|m| need.sandboxes > *m) {
            return Some(format!("{} sandboxes of {m}", need.sandboxes));
        }
        if let Some(m) = self.memory_bytes.filter(|m| need.memory_bytes > *m) {
            return Some(format!("{} MiB of memory of {} MiB", need.memory_bytes >> 20, m >> 20));
        }
        if let Some(m) = self.cpu_millis.filter(|m| need.cpu_millis > *m) {
            return Some(format!("{} CPUs of {}", need.cpu_millis / 1000, m / 1000));
        }
        None
    }
}

/// What sandboxes hold, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub sandboxes: u64,
    pub memory_bytes: u64,
    pub cpu_millis: u64,
}

impl Usage {
    pub fn of(count: u64, memory_bytes: u64, cpu_millis: u64) -> Usage {
        Usage {
            sandboxes: count,
            memory_bytes: memory_bytes.saturating_mul(count),
            cpu_millis: cpu_millis.saturating_mul(count),
        }
    }

    /// What a made sandbox holds: its own limits.
    pub fn of_sandbox(rec: &cairn_engine::SandboxRecord) -> Usage {
        Usage::of(1, rec.memory_bytes, u64::from(rec.cpu_millis))
    }

    fn add(&mut self, o: Usage) {
        self.sandboxes += o.sandboxes;
        self.memory_bytes = self.memory_bytes.saturating_add(o.memory_bytes);
        self.cpu_millis = self.cpu_millis.saturating_add(o.cpu_millis);
    }
}

#[derive(Debug)]
struct Waiter {
    token: String,
    priority: i64,
    need: Usage,
}

/// A share of the capacity: whose, how much, since when.
#[derive(Debug, Clone)]
struct Hold {
    token: String,
    usage: Usage,
    since: Instant,
}

#[derive(Debug, Default)]
struct State {
    /// Sandboxes this server made and still counts, by id.
    held: HashMap<String, Hold>,
    /// Admitted requests still making their sandboxes, by ticket.
    making: HashMap<u64, Hold>,
    /// Running sandboxes this server did not make, at the last look.
    outside: Usage,
    waiting: BTreeMap<u64, Waiter>,
    next: u64,
    looked: Option<Instant>,
}

impl State {
    fn in_use(&self) -> Usage {
        let mut u = self.outside;
        for h in self.held.values().chain(self.making.values()) {
            u.add(h.usage);
        }
        u
    }

    fn held_by(&self, token: &str) -> u64 {
        self.held
            .values()
            .chain(self.making.values())
            .filter(|h| h.token == token)
            .map(|h| h.usage.sandboxes)
            .sum()
    }

    fn fits(&self, cap: &Capacity, need: Usage) -> bool {
        let mut u = self.in_use();
        // Nothing running: any one request fits, however large.
        if u.sandboxes == 0 {
            return true;
        }
        u.add(need);
        cap.sandboxes.is_none_or(|m| u.sandboxes <= m)
            && cap.memory_bytes.is_none_or(|m| u.memory_bytes <= m)
            && cap.cpu_millis.is_none_or(|m| u.cpu_millis <= m)
    }

    /// The waiting request whose turn it is: the highest priority, then
    /// the token holding least, then the oldest; a token at its own quota
    /// waits without holding up the others.
    fn turn(&self, cap: &Capacity) -> Option<u64> {
        self.waiting
            .iter()
            .filter(|(_, w)| {
                cap.per_token
                    .is_none_or(|q| self.held_by(&w.token) + w.need.sandboxes <= q.max(w.need.sandboxes))
            })
            .max_by_key(|(seq, w)| {
                (
                    w.priority,
                    std::cmp::Reverse(self.held_by(&w.token)),
                    std::cmp::Reverse(**seq),
                )
            })
            .map(|(seq, _)| *seq)
    }
}

/// A sandbox running now as admission counts it: id, memory limit, CPU millis.
pub type Running = (String, u64, u64);

/// The sandboxes running now, once read; `None` when they cannot be.
pub type RunningSoon<'a> = Pin<Box<dyn Future<Output = Option<Vec<Running>>> + Send + 'a>>;

/// What admission asks of the server it admits to.
pub trait Host: Send + Sync {
    /// The sandboxes running now.
    fn running(&self) -> RunningSoon<'_>;
    /// Where admission's counts go.
    fn metrics(&self) -> &Metrics;
}

/// The server's capacity and its queue (clones share them).
#[derive(Clone)]
pub struct Admission(Arc<Queue>);

/// The capacity, the queue and its wake-ups, shared by an [`Admission`]'s clones.
pub struct Queue {
    capacity: Capacity,
    state: Mutex<State>,
    changed: tokio::sync::Notify,
}

impl std::ops::Deref for Admission {
    type Target = Queue;

    fn deref(&self) -> &Queue {
        &self.0
    }
}

/// An admitted request, holding its share of the capacity while its
/// sandboxes are made: [`Ticket::made`] hands the share to them; dropped
/// without that (the request failed), the share goes back.
pub struct Ticket {
    admission: Admission,
    seq: u64,
    /// How long it waited.
    pub waited: Duration,
}

impl Ticket {
    /// The sandboxes are made: each holds its share until it is removed.
    pub fn made<'a>(self, sandboxes: impl IntoIterator<Item = &'a cairn_engine::SandboxRecord>) {
        let adm = &self.admission;
        let mut st = adm.lock();
        if let Some(hold) = st.making.remove(&self.seq) {
            let since = Instant::now();
            for rec in sandboxes {
                let usage = Usage::of_sandbox(rec);
                let token = hold.token.clone();
                st.held.insert(rec.id.clone(), Hold { token, usage, since });
            }
        }
        drop(st);
        adm.changed.notify_waiters();
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let adm = &self.admission;
        if adm.lock().making.remove(&self.seq).is_some() {
            adm.changed.notify_waiters();
        }
    }
}

/// What a request asks of the queue, from its headers.
#[derive(Debug, Clone)]
pub struct Ask {
    pub priority: i64,
    pub deadline: Duration,
}

impl Ask {
    /// `Priority` (an integer, higher first; default 0) and
    /// `Request-Timeout` (seconds to wait for capacity, up to 3600;
    /// default 300). A header that does not parse is a 400 naming it.
    pub fn from_headers(headers: &HeaderMap) -> ApiResult<Ask> {
        let text = |name: &str| {
            headers
                .get(name)
                .map(|v| v.to_str().unwrap_or("\u{fffd}").trim().to_string())
        };
        let priority = match text("priority") {
            None => 0,
            Some(p) => p
                .parse::<i64>()
                .ok()
                .filter(|p| (-1000..=1000).contains(p))
                .ok_or_else(|| {
                    ApiError::bad_request(format!("Priority: {p:?} is not an integer from -1000 to 1000"))
                })?,
        };
        let deadline = match text("request-timeout") {
            None => DEFAULT_WAIT,
            Some(t) => t
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s >= 0.0 && *s <= MAX_WAIT.as_secs_f64())
                .map(Duration::from_secs_f64)
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "Request-Timeout: {t:?} is not a number of seconds from 0 to {}",
                        MAX_WAIT.as_secs()
                    ))
                })?,
        };
        Ok(Ask { priority, deadline })
    }
}

/// Why a request was refused: its deadline passed in the queue, or it
/// asks for more than the whole capacity (`too_large` names what).
#[derive(Debug)]
pub struct Refused {
    pub waited: Duration,
    pub queued: usize,
    pub in_use: Usage,
    pub too_large: Option<String>,
}

impl Admission {
    pub fn new(capacity: Capacity) -> Admission {
        Admission(Arc::new(Queue {
            capacity,
            state: Mutex::new(State::default()),
            changed: tokio::sync::Notify::new(),
        }))
    }

    pub fn capacity(&self) -> &Capacity {
        &self.capacity
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Requests waiting now.
    pub fn queued(&self) -> usize {
        self.lock().waiting.len()
    }

    /// Sandbox `id` is gone: its share goes back.
    pub fn release(&self, id: &str) {
        if self.lock().held.remove(id).is_some() {
            self.changed.notify_waiters();
        }
    }

    /// [`Self::admit`] of `count` sandboxes with `limits` for `caller`, as
    /// the request's headers ask ([`Ask::from_headers`]): a bad header is a
    /// 400, a refusal a 429.
    pub async fn admit_request(
        &self,
        host: &dyn Host,
        caller: &str,
        headers: &HeaderMap,
        count: u64,
        limits: &cairn_sandbox::Limits,
    ) -> ApiResult<Ticket> {
        let ask = Ask::from_headers(headers)?;
        let need = Usage::of(count, limits.memory_bytes, u64::from(limits.cpu_millis));
        self.admit(host, caller, need, &ask).await.map_err(Refused::into_error)
    }

    /// Waits until `need` fits and it is this request's turn, or refuses it
    /// once `ask.deadline` has passed.
    pub async fn admit(&self, host: &dyn Host, token: &str, need: Usage, ask: &Ask) -> Result<Ticket, Refused> {
        let adm = self;
        let started = Instant::now();
        if let Some(what) = adm.capacity.exceeded_by(need) {
            host.metrics().refused();
            return Err(Refused {
                waited: Duration::ZERO,
                queued: adm.queued(),
                in_use: adm.lock().in_use(),
                too_large: Some(what),
            });
        }
        let seq = {
            let mut st = adm.lock();
            st.next += 1;
            let seq = st.next;
            st.waiting.insert(
                seq,
                Waiter {
                    token: token.to_string(),
                    priority: ask.priority,
                    need,
                },
            );
            seq
        };
        host.metrics().admission_queued(adm.queued());
        let deadline = tokio::time::Instant::from_std(started + ask.deadline);
        loop {
            let notified = adm.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            // Where the counts this server keeps leave room, the request
            // goes without a look (the uncontended path costs a lock); a
            // look comes first where they do not, or when they are old.
            let stale = {
                let st = adm.lock();
                let old = st.looked.is_none_or(|t| t.elapsed() >= LOOK_AGAIN);
                old && (!st.fits(&adm.capacity, need) || st.looked.is_none_or(|t| t.elapsed() >= TRUST_FOR))
            };
            if stale {
                self.look(host).await;
            }
            {
                let mut st = adm.lock();
                if st.turn(&adm.capacity) == Some(seq) && st.fits(&adm.capacity, need) {
                    st.waiting.remove(&seq);
                    let hold = Hold {
                        token: token.to_string(),
                        usage: need,
                        since: Instant::now(),
                    };
                    st.making.insert(seq, hold);
                    let queued = st.waiting.len();
                    drop(st);
                    // The next in turn may fit too.
                    adm.changed.notify_waiters();
                    host.metrics().admission_queued(queued);
                    host.metrics().admitted(started.elapsed());
                    return Ok(Ticket {
                        admission: self.clone(),
                        seq,
                        waited: started.elapsed(),
                    });
                }
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = tokio::time::sleep(LOOK_AGAIN) => {}
                _ = tokio::time::sleep_until(deadline) => {
                    let (queued, in_use) = {
                        let mut st = adm.lock();
                        st.waiting.remove(&seq);
                        (st.waiting.len(), st.in_use())
                    };
                    adm.changed.notify_waiters();
                    host.metrics().admission_queued(queued);
                    host.metrics().refused();
                    return Err(Refused { waited: started.elapsed(), queued, in_use, too_large: None });
                }
            }
        }
    }

    /// Looks at the running sandboxes: those this server made and still
    /// counts that are gone (timed out, removed elsewhere) are forgotten,
    /// and the rest count as `outside`. A sandbox made after the look began
    /// may be missing from it: it stays counted. One being made may be in
    /// it and counted by its ticket too: counted twice until the next look,
    /// which errs on the side of the capacity.
    async fn look(&self, host: &dyn Host) {
        let began = Instant::now();
        let Some(running) = host.running().await else { return };
        let adm = self;
        let mut st = adm.lock();
        let ids: HashSet<&str> = running.iter().map(|(id, _, _)| id.as_str()).collect();
        let before = st.held.len();
        st.held.retain(|id, h| ids.contains(id.as_str()) || h.since >= began);
        let mut outside = Usage::default();
        for (id, memory, cpu) in &running {
            if !st.held.contains_key(id) {
                outside.add(Usage::of(1, *memory, *cpu));
            }
        }
        let freed = st.held.len() < before || outside.sandboxes < st.outside.sandboxes;
        st.outside = outside;
        st.looked = Some(Instant::now());
        drop(st);
        if freed {
            adm.changed.notify_waiters();
        }
    }
}

impl Refused {
    /// The refusal as Cairn's API answers it: 429, what was waited for.
    pub fn into_error(self) -> ApiError {
        if let Some(what) = self.too_large {
            return ApiError::new(
                axum::http::StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "this request alone asks for more than the server's whole capacity ({what}), so it would \
                     never start: ask for less, or start the server with a larger --max-sandboxes, --max-memory \
                     or --max-cpus"
                ),
            );
        }
        ApiError::new(
            axum::http::StatusCode::TOO_MANY_REQUESTS,
            format!(
                "no capacity within the request's deadline: waited {:.1} s with {} sandboxes running and {} \
                 requests still queued; send a longer Request-Timeout (seconds), remove sandboxes, or start \
                 the server with a larger --max-sandboxes or --max-memory",
                self.waited.as_secs_f64(),
                self.in_use.sandboxes,
                self.queued
            ),
        )
    }
}

/// Who made a request over TCP: its token's id and the token's tenant
/// (`None`: an administrator). The Unix socket has none.
#[derive(Debug, Clone)]
pub struct Caller {
    pub token: String,
    pub tenant: Option<String>,
}

impl Caller {
    /// The name a request's sandboxes queue under: its token's id, or
    /// `local` on the Unix socket (no token there).
    pub fn of(ext: Option<axum::Extension<Caller>>) -> String {
        ext.map_or_else(|| "local".to_string(), |axum::Extension(c)| c.token)
    }
}
