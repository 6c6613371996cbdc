//! `GET /metrics`: Prometheus text format.

use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Op {
    pub op: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct State {
    pub state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Request {
    pub method: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Listener {
    pub listener: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Closed {
    pub listener: String,
    pub reason: String,
}

/// The figures of the pool of sandbox init requests (`crate::init_pool`).
#[derive(Clone, Default)]
pub struct InitPoolMetrics {
    /// Threads running a request.
    pub busy: Gauge,
    /// Requests waiting for a thread.
    pub queued: Gauge,
    /// Requests answered 503, by reason (`pool_full`, `sandbox_limit`).
    pub refused: Family<Reason, Counter>,
}

pub struct Metrics {
    registry: Mutex<Registry>,
    connections: Family<Listener, Gauge>,
    closed: Family<Closed, Counter>,
    latency: Family<Op, Histogram>,
    stages: Family<Outcome, Counter>,
    sandboxes: Family<State, Gauge>,
    store_bytes: Gauge,
    requests: Family<Request, Counter>,
    /// The pool of sandbox init requests (see `crate::init_pool`).
    pub init_pool: InitPoolMetrics,
    /// The admission queue (see `crate::admission`).
    admission_depth: Gauge,
    admission_wait: Histogram,
    admission_refused: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        let latency = Family::<Op, Histogram>::new_with_constructor(|| {
            // 1 ms to ~65 s.
            Histogram::new(exponential_buckets(0.001, 2.0, 17))
        });
        let stages = Family::<Outcome, Counter>::default();
        let sandboxes = Family::<State, Gauge>::default();
        let store_bytes = Gauge::default();
        let requests = Family::<Request, Counter>::default();
        let connections = Family::<Listener, Gauge>::default();
        let closed = Family::<Closed, Counter>::default();
        let mut registry = Registry::with_prefix("cairn");
        registry.register(
            "operation_seconds",
            "Latency of sandbox operations (create, snapshot, fork, restore, reset) through the API",
            latency.clone(),
        );
        registry.register(
            "stage_outcomes",
            "Pipeline stage outcomes seen by this server",
            stages.clone(),
        );
        registry.register("sandboxes", "Sandboxes by state", sandboxes.clone());
        registry.register("store_bytes", "Bytes in the chunk store on disk", store_bytes.clone());
        registry.register(
            "http_requests",
            "HTTP requests answered, by method and status",
            requests.clone(),
        );
        registry.register(
            "connections",
            "Connections open, by listener (unix, api, e2b)",
            connections.clone(),
        );
        registry.register(
            "connections_closed_by_server",
            "Connections the server refused or closed, by listener and reason \
             (refused, evicted, header_timeout, idle_timeout)",
            closed.clone(),
        );
        let init_pool = InitPoolMetrics::default();
        registry.register(
            "init_request_threads_busy",
            "Threads of the sandbox init request pool (files, signals) running a request",
            init_pool.busy.clone(),
        );
        registry.register(
            "init_request_queue_depth",
            "Sandbox init requests waiting for a thread of their pool",
            init_pool.queued.clone(),
        );
        registry.register(
            "init_requests_refused",
            "Sandbox init requests answered 503, by reason (pool_full: every thread busy and the queue \
             full; sandbox_limit: that sandbox had a quarter of the threads already)",
            init_pool.refused.clone(),
        );
        let admission_depth = Gauge::default();
        let admission_wait = Histogram::new(exponential_buckets(0.0001, 2.0, 24));
        let admission_refused = Counter::default();
        registry.register(
            "admission_queue_depth",
            "Creates, forks and restores waiting for capacity",
            admission_depth.clone(),
        );
        registry.register(
            "admission_wait_seconds",
            "How long admitted creates, forks and restores waited for capacity",
            admission_wait.clone(),
        );
        registry.register(
            "admission_refused",
            "Creates, forks and restores refused because their deadline passed in the queue",
            admission_refused.clone(),
        );
        Metrics {
            admission_depth,
            admission_wait,
            admission_refused,
            init_pool,
            registry: Mutex::new(registry),
            connections,
            closed,
            latency,
            stages,
            sandboxes,
            store_bytes,
            requests,
        }
    }
}

impl Metrics {
    pub fn admission_queued(&self, depth: usize) {
        self.admission_depth.set(depth as i64);
    }

    pub fn admitted(&self, waited: Duration) {
        self.admission_wait.observe(waited.as_secs_f64());
    }

    pub fn refused(&self) {
        self.admission_refused.inc();
    }

    pub fn observe(&self, op: &str, took: Duration) {
        self.latency
            .get_or_create(&Op { op: op.into() })
            .observe(took.as_secs_f64());
    }

    pub fn stage(&self, outcome: &str) {
        self.stages
            .get_or_create(&Outcome {
                outcome: outcome.into(),
            })
            .inc();
    }

    pub fn request(&self, method: &str, status: u16) {
        self.requests
            .get_or_create(&Request {
                method: method.into(),
                status,
            })
            .inc();
    }

    pub fn connections_open(&self, listener: &str, open: usize) {
        self.connections
            .get_or_create(&Listener {
                listener: listener.into(),
            })
            .set(open as i64);
    }

    pub fn connection_closed(&self, listener: &str, reason: &str) {
        self.closed
            .get_or_create(&Closed {
                listener: listener.into(),
                reason: reason.into(),
            })
            .inc();
    }

    /// The text exposition, with the gauges set from `states` and `store_bytes`.
    pub fn render(&self, states: &[(&str, i64)], store_bytes: u64) -> String {
        for (state, n) in states {
            self.sandboxes.get_or_create(&State { state: (*state).into() }).set(*n);
        }
        self.store_bytes.set(store_bytes.min(i64::MAX as u64) as i64);
        let mut out = String::new();
        let registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        encode(&mut out, &registry).expect("writing to a String does not fail");
        out
    }
}

/// Bytes of the files under `dir` (the chunk store: two levels of
/// fan-out directories), without following symlinks.
pub fn dir_bytes(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let Ok(meta) = e.metadata() else { continue };
            if meta.is_dir() {
                stack.push(e.path());
            } else if meta.is_file() {
                total += meta.len();
            }
        }
    }
    total
}
