//! `get_metrics()`: each running E2B sandbox's CPU, memory and disk,
//! sampled every [`INTERVAL`] (E2B's five seconds) from its cgroups and
//! its upper directory, the newest [`KEEP`] samples (an hour) kept per
//! sandbox in the server's memory. A sample's CPU is the share of the
//! sandbox's CPUs its processes used since the sample before; memory is
//! what its cgroup is charged, page cache apart; disk is what its files
//! take and the size of the file system they are on. A request that finds
//! no sample newer than [`INTERVAL`] takes one then (the first one of a
//! sandbox over a short measuring window), so a sandbox created a moment
//! ago has metrics at once.
//!
//! `GET /sandboxes/{id}/metrics?start=&end=` (Unix seconds; from the
//! sandbox's start to now by default) answers the samples between, oldest
//! first; `GET /sandboxes/metrics?sandbox_ids=a,b` the newest of each.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cairn_engine::SandboxUsage;
use serde::Deserialize;
use serde_json::{json, Value};

use super::control::rfc3339;
use super::{Entry, Gateway, RestError};
use crate::app::now_ms;

/// How often every running sandbox is sampled.
pub const INTERVAL: Duration = Duration::from_secs(5);
/// Samples kept per sandbox: an hour's.
pub const KEEP: usize = 720;
/// The window a first sample measures CPU over, taken on request.
const FIRST_WINDOW: Duration = Duration::from_millis(250);
/// The most sandboxes one `GET /sandboxes/metrics` names.
const MAX_IDS: usize = 100;

/// One moment of a sandbox.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at_ms: i64,
    cpu_count: u32,
    cpu_pct: f64,
    mem_used: u64,
    mem_total: u64,
    mem_cache: u64,
    disk_used: u64,
    disk_total: u64,
}

impl Sample {
    fn json(&self) -> Value {
        json!({
            "timestamp": rfc3339(self.at_ms), "timestampUnix": self.at_ms.div_euclid(1000),
            "cpuCount": self.cpu_count, "cpuUsedPct": self.cpu_pct,
            "memUsed": self.mem_used, "memTotal": self.mem_total, "memCache": self.mem_cache,
            "diskUsed": self.disk_used, "diskTotal": self.disk_total,
        })
    }
}

/// An E2B sandbox's samples, and the reading the next one's CPU share is
/// counted from (of the Cairn sandbox it was read on: a pause and resume
/// starts a new count).
#[derive(Default)]
struct Series {
    base: Option<(String, i64, u64)>,
    samples: VecDeque<Sample>,
}

/// Every E2B sandbox's samples, by id.
#[derive(Default)]
pub struct Metrics {
    series: Mutex<HashMap<String, Series>>,
}

impl Metrics {
    /// Records a reading of `e` (running as `sandbox`) taken at `at_ms`:
    /// the first only sets where CPU is counted from.
    fn record(&self, e: &Entry, sandbox: &str, at_ms: i64, u: &SandboxUsage) {
        let mut all = self.series.lock().unwrap_or_else(|p| p.into_inner());
        let series = all.entry(e.id.clone()).or_default();
        let cpus = e.cpu_count.max(1);
        if let Some((was, then, cpu_then)) = &series.base {
            if was == sandbox && at_ms > *then {
                let wall_ns = (at_ms - then) as f64 * 1e6 * cpus as f64;
                let used = u.cpu_ns.saturating_sub(*cpu_then) as f64;
                let pct = (used / wall_ns * 100.0).clamp(0.0, 100.0);
                series.samples.push_back(Sample {
                    at_ms,
                    cpu_count: cpus,
                    cpu_pct: (pct * 100.0).round() / 100.0,
                    mem_used: u.memory.saturating_sub(u.cache),
                    mem_total: e.memory_mb.saturating_mul(1 << 20),
                    mem_cache: u.cache,
                    disk_used: u.disk_used,
                    disk_total: u.disk_total,
                });
                while series.samples.len() > KEEP {
                    series.samples.pop_front();
                }
            }
        }
        series.base = Some((sandbox.to_string(), at_ms, u.cpu_ns));
    }

    /// Forgets sandboxes that are gone.
    fn keep_only(&self, ids: &std::collections::HashSet<&str>) {
        self.series
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|id, _| ids.contains(id.as_str()));
    }

    /// When `id` was last read, if it was.
    fn last_read(&self, id: &str) -> Option<i64> {
        let all = self.series.lock().unwrap_or_else(|p| p.into_inner());
        all.get(id).and_then(|s| s.base.as_ref().map(|b| b.1))
    }

    fn samples(&self, id: &str, from_ms: i64, to_ms: i64) -> Vec<Sample> {
        let all = self.series.lock().unwrap_or_else(|p| p.into_inner());
        all.get(id)
            .map(|s| {
                s.samples
                    .iter()
                    .filter(|x| x.at_ms >= from_ms && x.at_ms <= to_ms)
                    .copied()
                    .collect()
            })
            .unwrap_or_default()
    }

    fn newest(&self, id: &str) -> Option<Sample> {
        let all = self.series.lock().unwrap_or_else(|p| p.into_inner());
        all.get(id).and_then(|s| s.samples.back().copied())
    }
}

/// Reads every running sandbox of `entries` once, and records each.
async fn read_all(gw: &Arc<Gateway>, entries: Vec<Entry>) {
    let running: Vec<(Entry, String)> = entries
        .into_iter()
        .filter_map(|e| e.running().map(str::to_string).map(|s| (e, s)))
        .collect();
    if running.is_empty() {
        return;
    }
    let ids: Vec<String> = running.iter().map(|(_, s)| s.clone()).collect();
    let read = gw
        .app
        .engine(move |en| {
            Ok(ids
                .iter()
                .map(|id| {
                    let usage = en.sandbox(id).ok().and_then(|rec| en.usage(&rec).ok().flatten());
                    (usage, now_ms())
                })
                .collect::<Vec<_>>())
        })
        .await;
    let Ok(read) = read else { return };
    for ((e, sandbox), (usage, at)) in running.iter().zip(read) {
        if let Some(u) = usage {
            gw.metrics.record(e, sandbox, at, &u);
        }
    }
}

/// Samples every running sandbox each [`INTERVAL`] while the server runs.
pub(crate) fn spawn_sampler(gw: Arc<Gateway>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let entries = gw.entries();
            let ids = entries.iter().map(|e| e.id.as_str()).collect();
            gw.metrics.keep_only(&ids);
            read_all(&gw, entries).await;
        }
    });
}

/// Takes a sample of each of `entries` now unless one is newer than
/// [`INTERVAL`]; sandboxes never read are read twice, [`FIRST_WINDOW`]
/// apart (all of them in the same window).
async fn fresh(gw: &Arc<Gateway>, entries: Vec<Entry>) {
    let interval = INTERVAL.as_millis() as i64;
    let stale: Vec<Entry> = entries
        .into_iter()
        .filter(|e| e.running().is_some())
        .filter(|e| gw.metrics.last_read(&e.id).is_none_or(|at| now_ms() - at >= interval))
        .collect();
    let unread: Vec<Entry> = stale
        .iter()
        .filter(|e| gw.metrics.last_read(&e.id).is_none())
        .cloned()
        .collect();
    if !unread.is_empty() {
        read_all(gw, unread).await;
        tokio::time::sleep(FIRST_WINDOW).await;
    }
    read_all(gw, stale).await;
}

#[derive(Deserialize)]
pub struct RangeQuery {
    start: Option<i64>,
    end: Option<i64>,
}

/// `GET /sandboxes/{id}/metrics`.
pub async fn sandbox(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
    q: Result<Query<RangeQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, RestError> {
    let Query(q) = q.map_err(|e| RestError::bad_request(e.body_text()))?;
    let e = gw.entry(&id).ok_or_else(|| RestError::not_found(&id))?;
    let from = q.start.map(|s| s.saturating_mul(1000)).unwrap_or(e.started_at);
    let to = q
        .end
        .map(|s| s.saturating_mul(1000).saturating_add(999))
        .unwrap_or(i64::MAX);
    if from > to {
        return Err(RestError::bad_request(format!(
            "start ({}) is after end ({}): both are Unix seconds",
            q.start.unwrap_or(0),
            q.end.unwrap_or(0)
        )));
    }
    fresh(&gw, vec![e]).await;
    let samples: Vec<Value> = gw.metrics.samples(&id, from, to).iter().map(Sample::json).collect();
    Ok(Json(samples).into_response())
}

#[derive(Deserialize)]
pub struct IdsQuery {
    sandbox_ids: Option<String>,
}

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: the newest sample of each
/// (sandboxes that are unknown or have none are left out).
pub async fn many(
    State(gw): State<Arc<Gateway>>,
    q: Result<Query<IdsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, RestError> {
    let Query(q) = q.map_err(|e| RestError::bad_request(e.body_text()))?;
    let ids: Vec<&str> = q
        .sandbox_ids
        .as_deref()
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if ids.is_empty() || ids.len() > MAX_IDS {
        return Err(RestError::bad_request(format!(
            "give 1 to {MAX_IDS} sandbox ids as sandbox_ids=a,b"
        )));
    }
    // Another tenant's sandboxes are left out, as unknown ones are.
    let tenant = crate::tenancy::current();
    let known: Vec<Entry> = ids
        .iter()
        .filter_map(|id| gw.entry(id))
        .filter(|e| tenant.is_none() || e.tenant == tenant)
        .collect();
    let known_ids: Vec<String> = known.iter().map(|e| e.id.clone()).collect();
    fresh(&gw, known).await;
    let mut out = BTreeMap::new();
    for id in known_ids {
        if let Some(s) = gw.metrics.newest(&id) {
            out.insert(id, s.json());
        }
    }
    Ok(Json(json!({ "sandboxes": out })).into_response())
}
