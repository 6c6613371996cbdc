//! Sandboxes and snapshots: create, list, get, remove; snapshot, fork,
//! restore, reset.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::Json;
use cairn_engine::{CreateOptions, Engine, Silent};
use cairn_sandbox::limits::{CpuCount, DiskSize, MemorySize, PidCount};

use super::{idempotent, json, parse};
use crate::admission::Caller;
use crate::app::App;
use crate::error::{ApiError, ApiResult, ErrorBody};
use crate::model::*;
use cairn_engine::tenants::Owned;

fn options(
    limits: &Limits,
    driver: Option<String>,
    name: Option<String>,
    network: Option<&NetworkRequest>,
) -> ApiResult<CreateOptions> {
    let mut opts = CreateOptions {
        driver,
        name,
        network: network.map(|n| n.policy()).transpose().map_err(ApiError::bad_request)?,
        ..CreateOptions::default()
    };
    if let Some(m) = &limits.memory {
        opts.limits.memory_bytes = m
            .parse::<MemorySize>()
            .map_err(|e| ApiError::bad_request(format!("limits.memory: {e}")))?
            .0;
    }
    if let Some(c) = &limits.cpus {
        opts.limits.cpu_millis = c
            .parse::<CpuCount>()
            .map_err(|e| ApiError::bad_request(format!("limits.cpus: {e}")))?
            .0;
    }
    if let Some(d) = &limits.disk {
        opts.limits.disk_bytes = Some(
            d.parse::<DiskSize>()
                .map_err(|e| ApiError::bad_request(format!("limits.disk: {e}")))?
                .0,
        );
    }
    if let Some(p) = limits.pids {
        opts.limits.pids = p
            .to_string()
            .parse::<PidCount>()
            .map_err(|e| ApiError::bad_request(format!("limits.pids: {e}")))?
            .0;
    }
    Ok(opts)
}

/// Creates a sandbox from an image, or from a snapshot.
#[utoipa::path(operation_id = "create_sandbox", post, path = "/v1/sandboxes", tag = "sandboxes",
    request_body = CreateSandbox,
    params(("Idempotency-Key" = Option<String>, Header, description = "A retried request with this key answers what the first did"),
        AdmissionHeaders),
    responses((status = 201, body = Sandbox), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "A request with this Idempotency-Key is in progress"),
        (status = 422, body = ErrorBody, description = "The Idempotency-Key was used with another body"),
        (status = 429, body = ErrorBody, description = "No capacity within Request-Timeout; nothing was made")))]
pub async fn create(
    State(app): State<Arc<App>>,
    caller: Option<axum::Extension<Caller>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    let req: CreateSandbox = parse(&body)?;
    let mut opts = options(&req.limits, req.driver.clone(), req.name.clone(), req.network.as_ref())?;
    opts.image = req.image.clone();
    opts.services = req.services.clone();
    if req.snapshot.is_some() && req.image.is_some() {
        return Err(ApiError::bad_request(
            "give image or snapshot, not both: a snapshot carries its image",
        ));
    }
    let a = Arc::clone(&app);
    let caller = Caller::of(caller);
    let h = headers.clone();
    idempotent(&app, &headers, "sandboxes.create", &body, || async move {
        let ticket = a.admission.admit_request(&a, &caller, &h, 1, &opts.limits).await?;
        let t = Instant::now();
        let snapshot = req.snapshot.clone();
        let rec = a
            .engine(move |e| match &snapshot {
                Some(s) => {
                    let snap = e.snapshot_record(s)?;
                    Ok(e.restore(&snap, &opts)?)
                }
                None => Ok(e.create_sandbox(&opts, &Silent)?),
            })
            .await?;
        ticket.made([&rec]);
        a.metrics
            .observe(if req.snapshot.is_some() { "restore" } else { "create" }, t.elapsed());
        a.emit(
            "sandbox.created",
            &rec.id,
            format!("from {}", req.snapshot.as_deref().unwrap_or(&rec.image)),
        );
        Ok((
            StatusCode::CREATED,
            serde_json::to_value(Sandbox::from(rec)).expect("serialisable"),
        ))
    })
    .await
}

/// Lists sandboxes, oldest first, a page at a time.
#[utoipa::path(operation_id = "list_sandboxes", get, path = "/v1/sandboxes", tag = "sandboxes", params(SandboxQuery),
    responses((status = 200, body = SandboxPage), (status = 400, body = ErrorBody)))]
pub async fn list(
    State(app): State<Arc<App>>,
    q: Result<Query<SandboxQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<SandboxPage>> {
    let Query(q) = q?;
    if let Some(s) = &q.state {
        if !["creating", "running", "exited", "removing"].contains(&s.as_str()) {
            return Err(ApiError::bad_request(format!(
                "state must be creating, running, exited or removing, got {s:?}"
            )));
        }
    }
    let mut all = app.engine(|e| Ok(e.list_sandboxes()?)).await?;
    if let Some(mine) = crate::tenancy::owned(&app, Owned::Sandbox).await? {
        all.retain(|r| mine.contains(&r.id));
    }
    all.retain(|r| q.state.as_ref().is_none_or(|s| r.state.to_string() == *s));
    all.retain(|r| q.image.as_ref().is_none_or(|i| r.image == *i));
    all.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
    let items: Vec<Sandbox> = all.into_iter().map(Sandbox::from).collect();
    let (items, next) = super::super::model::page(items, |s| &s.id, q.after.as_deref(), q.limit);
    Ok(Json(SandboxPage { items, next }))
}

/// One sandbox, by id, unique id prefix or name.
#[utoipa::path(operation_id = "get_sandbox", get, path = "/v1/sandboxes/{id}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id, unique prefix or name")),
    responses((status = 200, body = Sandbox), (status = 404, body = ErrorBody)))]
pub async fn get(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Json<Sandbox>> {
    Ok(Json(app.engine(move |e| Ok(e.sandbox(&id)?)).await?.into()))
}

/// Where one of a sandbox's ports is reached from this host: its address
/// (a sandbox with a network) and the host ports published to it.
#[utoipa::path(operation_id = "get_sandbox_port", get, path = "/v1/sandboxes/{id}/ports/{port}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id, unique prefix or name"),
        ("port" = u16, Path, description = "A TCP port in the sandbox, 1-65535")),
    responses((status = 200, body = PortHost), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "The sandbox has no network, or is not running")))]
pub async fn port(State(app): State<Arc<App>>, Path((id, port)): Path<(String, String)>) -> ApiResult<Json<PortHost>> {
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::bad_request(format!("port {port:?} is not a TCP port (1-65535)")))?;
    let rec = app.engine(move |e| Ok(e.sandbox(&id)?)).await?;
    let Some(net) = &rec.network else {
        return Err(ApiError::conflict(format!(
            "sandbox {} has no network (loopback only); create it with network.mode = \"egress\"",
            rec.id
        )));
    };
    let Some(held) = &net.held else {
        return Err(ApiError::conflict(format!(
            "sandbox {} is {}; its address exists only while it runs",
            rec.id, rec.state
        )));
    };
    Ok(Json(PortHost {
        host: format!("{}:{port}", held.address),
        port,
        url: format!("http://{}:{port}", held.address),
        published: net
            .policy
            .publish
            .iter()
            .filter(|p| p.port == port)
            .map(|p| p.host_port)
            .collect(),
    }))
}

/// Removes a sandbox: processes, cgroups, files. A running one needs `force`.
#[utoipa::path(operation_id = "remove_sandbox", delete, path = "/v1/sandboxes/{id}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id"), RemoveQuery),
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn remove(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    q: Result<Query<RemoveQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<StatusCode> {
    let Query(q) = q?;
    let rec = app.engine(move |e| Ok(e.sandbox(&id)?)).await?;
    let _busy = app.claim(&rec.id, "removal")?;
    let id = rec.id.clone();
    app.engine(move |e| Ok(e.remove_sandbox(&rec, q.force)?)).await?;
    app.admission.release(&id);
    app.emit("sandbox.removed", &id, "");
    Ok(StatusCode::NO_CONTENT)
}

/// Snapshots a sandbox's files (and memory, with the gvisor driver).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshots", tag = "snapshots",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = CreateSnapshot,
    responses((status = 201, body = Snapshot), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn snapshot(State(app): State<Arc<App>>, Path(id): Path<String>, body: Bytes) -> ApiResult<Response> {
    let req: CreateSnapshot = parse(&body)?;
    let rec = app.engine(move |e| Ok(e.sandbox(&id)?)).await?;
    let _busy = app.claim(&rec.id, "snapshot")?;
    let t = Instant::now();
    let snap = app
        .engine(move |e| {
            let snap = e.snapshot(&rec, req.label.as_deref())?;
            let durable = e.remote_durability()?;
            Ok(Snapshot::with_durability(snap, durable.as_ref()))
        })
        .await?;
    app.metrics.observe("snapshot", t.elapsed());
    app.emit("snapshot.created", &snap.id, format!("of sandbox {}", snap.sandbox_id));
    Ok(json(StatusCode::CREATED, &snap))
}

fn fork_count(req: &ForkBody) -> ApiResult<usize> {
    match req.count.unwrap_or(1) {
        n @ 1..=64 => Ok(n),
        n => Err(ApiError::bad_request(format!("count must be 1 to 64, got {n}"))),
    }
}

async fn fork_of(
    app: &Arc<App>,
    caller: &str,
    headers: &HeaderMap,
    key: String,
    req: ForkBody,
) -> ApiResult<(StatusCode, serde_json::Value)> {
    let count = fork_count(&req)?;
    let opts = options(&req.limits, req.driver.clone(), None, req.network.as_ref())?;
    let ticket = app
        .admission
        .admit_request(app, caller, headers, count as u64, &opts.limits)
        .await?;
    let t = Instant::now();
    let (snap, forks) = app.engine(move |e| Ok(e.fork(&key, count, &opts)?)).await?;
    ticket.made(&forks);
    app.metrics.observe("fork", t.elapsed());
    for f in &forks {
        app.emit("sandbox.created", &f.id, format!("fork of snapshot {}", snap.id));
    }
    let out = ForkResult {
        snapshot: snap.into(),
        sandboxes: forks.into_iter().map(Sandbox::from).collect(),
    };
    Ok((StatusCode::CREATED, serde_json::to_value(out).expect("serialisable")))
}

/// Snapshots a sandbox, then starts `count` sandboxes from that snapshot.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork", tag = "snapshots",
    params(("id" = String, Path, description = "Sandbox id"),
        ("Idempotency-Key" = Option<String>, Header, description = "A retried request with this key answers what the first did"),
        AdmissionHeaders),
    request_body = ForkBody,
    responses((status = 201, body = ForkResult), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "The sandbox is busy, or a request with this Idempotency-Key is in progress"),
        (status = 422, body = ErrorBody, description = "The Idempotency-Key was used with another body"),
        (status = 429, body = ErrorBody, description = "No capacity within Request-Timeout; nothing was made")))]
pub async fn fork_sandbox(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    caller: Option<axum::Extension<Caller>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    let req: ForkBody = parse(&body)?;
    fork_count(&req)?;
    let rec = app.engine(move |e| Ok(e.sandbox(&id)?)).await?;
    let _busy = app.claim(&rec.id, "fork")?;
    let a = Arc::clone(&app);
    let scope = format!("fork:{}", rec.id);
    let caller = Caller::of(caller);
    idempotent(&app, &headers, &scope, &body, || {
        fork_of(&a, &caller, &headers, rec.id.clone(), req)
    })
    .await
}

/// Starts `count` sandboxes from a snapshot.
#[utoipa::path(post, path = "/v1/snapshots/{id}/fork", tag = "snapshots",
    params(("id" = String, Path, description = "Snapshot id"),
        ("Idempotency-Key" = Option<String>, Header, description = "A retried request with this key answers what the first did"),
        AdmissionHeaders),
    request_body = ForkBody,
    responses((status = 201, body = ForkResult), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "A request with this Idempotency-Key is in progress"),
        (status = 422, body = ErrorBody, description = "The Idempotency-Key was used with another body"),
        (status = 429, body = ErrorBody, description = "No capacity within Request-Timeout; nothing was made")))]
pub async fn fork_snapshot(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    caller: Option<axum::Extension<Caller>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    let req: ForkBody = parse(&body)?;
    fork_count(&req)?;
    let snap = app.engine(move |e| Ok(e.snapshot_record(&id)?)).await?;
    let a = Arc::clone(&app);
    let scope = format!("fork:{}", snap.id);
    let caller = Caller::of(caller);
    idempotent(&app, &headers, &scope, &body, || {
        fork_of(&a, &caller, &headers, snap.id.clone(), req)
    })
    .await
}

/// Starts one sandbox from a snapshot.
#[utoipa::path(post, path = "/v1/snapshots/{id}/restore", tag = "snapshots",
    params(("id" = String, Path, description = "Snapshot id"),
        AdmissionHeaders),
    request_body = RestoreBody,
    responses((status = 201, body = Sandbox), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 429, body = ErrorBody, description = "No capacity within Request-Timeout; nothing was made")))]
pub async fn restore(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    caller: Option<axum::Extension<Caller>>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    let req: RestoreBody = parse(&body)?;
    let opts = options(&req.limits, req.driver.clone(), req.name.clone(), req.network.as_ref())?;
    let ticket = app
        .admission
        .admit_request(&app, &Caller::of(caller), &headers, 1, &opts.limits)
        .await?;
    let t = Instant::now();
    let rec = app
        .engine(move |e| {
            let snap = e.snapshot_record(&id)?;
            Ok(e.restore(&snap, &opts)?)
        })
        .await?;
    ticket.made([&rec]);
    app.metrics.observe("restore", t.elapsed());
    app.emit("sandbox.created", &rec.id, "restored");
    Ok(json(StatusCode::CREATED, &Sandbox::from(rec)))
}

/// Rewinds a sandbox to a snapshot in place (its processes restart).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/reset", tag = "snapshots",
    params(("id" = String, Path, description = "Sandbox id")),
    request_body = ResetBody,
    responses((status = 200, body = Sandbox), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn reset(State(app): State<Arc<App>>, Path(id): Path<String>, body: Bytes) -> ApiResult<Json<Sandbox>> {
    let req: ResetBody = parse(&body)?;
    let rec = app.engine(move |e| Ok(e.sandbox(&id)?)).await?;
    let _busy = app.claim(&rec.id, "reset")?;
    let t = Instant::now();
    let rec = app
        .engine(move |e| {
            let snap = e.snapshot_record(&req.snapshot)?;
            Ok(e.reset(&rec, &snap)?)
        })
        .await?;
    app.metrics.observe("reset", t.elapsed());
    app.emit("sandbox.reset", &rec.id, "");
    Ok(Json(rec.into()))
}

/// Lists snapshots, oldest first, a page at a time.
#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots", params(PageQuery),
    responses((status = 200, body = SnapshotPage), (status = 400, body = ErrorBody)))]
pub async fn snapshots(
    State(app): State<Arc<App>>,
    q: Result<Query<PageQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<SnapshotPage>> {
    let Query(q) = q?;
    let (mut all, durable) = app.engine(|e| Ok((e.snapshots()?, e.remote_durability()?))).await?;
    if let Some(mine) = crate::tenancy::owned(&app, Owned::Snapshot).await? {
        all.retain(|s| mine.contains(&s.id));
    }
    all.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
    let items: Vec<Snapshot> = all
        .into_iter()
        .map(|s| Snapshot::with_durability(s, durable.as_ref()))
        .collect();
    let (items, next) = crate::model::page(items, |s| &s.id, q.after.as_deref(), q.limit);
    Ok(Json(SnapshotPage { items, next }))
}

/// What differs between two snapshots, sandboxes or a run's stage outputs:
/// files added, removed and changed, with unified diffs of text files.
/// Computed from layer indexes (`cairn diff`).
#[utoipa::path(get, path = "/v1/diff", tag = "snapshots", params(DiffQuery),
    responses((status = 200, body = SnapshotDiff), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub async fn diff(
    State(app): State<Arc<App>>,
    q: Result<Query<DiffQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<SnapshotDiff>> {
    let Query(q) = q?;
    let defaults = cairn_engine::DiffOptions::default();
    let opts = cairn_engine::DiffOptions {
        text_max: q.text_max.unwrap_or(defaults.text_max).min(4 << 20),
        max_changes: q.max_changes.unwrap_or(defaults.max_changes).clamp(1, 100_000),
        ..defaults
    };
    let d = app.engine(move |e| Ok(e.diff(&q.a, &q.b, &opts)?)).await?;
    Ok(Json(d.into()))
}

/// Checks that a snapshot is whole: every object it reaches read back from
/// each copy and hashed again (`cairn verify`); with `repair`, damaged
/// copies are replaced with intact ones (a store in S3).
#[utoipa::path(post, path = "/v1/snapshots/{id}/verify", tag = "snapshots",
    params(("id" = String, Path, description = "Snapshot id, unique prefix or label")),
    request_body = VerifyBody,
    responses((status = 200, body = SnapshotVerification, description = "The report; `ok` says whether it is whole"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn verify(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult<Json<SnapshotVerification>> {
    let req: VerifyBody = if body.is_empty() {
        VerifyBody::default()
    } else {
        parse(&body)?
    };
    let mut reports = app
        .engine(move |e| Ok(e.verify_snapshots(&[id], req.repair, &|_, _, _| {})?))
        .await?;
    let report = reports
        .pop()
        .ok_or_else(|| ApiError::internal("verify returned no report"))?;
    Ok(Json(report.into()))
}

fn detail(e: &Engine, key: &str) -> ApiResult<SnapshotDetail> {
    let snap = e.snapshot_record(key)?;
    let all = e.snapshots()?;
    let durable = e.remote_durability()?;
    let mut lineage = Vec::new();
    let mut parent = snap.parent_id.clone();
    while let Some(p) = parent {
        match all.iter().find(|s| s.id == p) {
            Some(s) if lineage.len() < 10_000 => {
                parent = s.parent_id.clone();
                lineage.push(Snapshot::with_durability(s.clone(), durable.as_ref()));
            }
            _ => break,
        }
    }
    let children = all
        .iter()
        .filter(|s| s.parent_id.as_deref() == Some(snap.id.as_str()))
        .map(|s| s.id.clone())
        .collect();
    Ok(SnapshotDetail {
        snapshot: Snapshot::with_durability(snap, durable.as_ref()),
        lineage,
        children,
    })
}

/// One snapshot with its lineage.
#[utoipa::path(get, path = "/v1/snapshots/{id}", tag = "snapshots",
    params(("id" = String, Path, description = "Snapshot id or unique prefix")),
    responses((status = 200, body = SnapshotDetail), (status = 404, body = ErrorBody)))]
pub async fn get_snapshot(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Json<SnapshotDetail>> {
    Ok(Json(app.engine(move |e| detail(e, &id)).await?))
}

/// Forgets a snapshot (`gc` then reclaims its storage).
#[utoipa::path(delete, path = "/v1/snapshots/{id}", tag = "snapshots",
    params(("id" = String, Path, description = "Snapshot id")),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn remove_snapshot(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<StatusCode> {
    let id = app
        .engine(move |e| {
            let snap = e.snapshot_record(&id)?;
            e.remove_snapshot(&snap)?;
            Ok(snap.id)
        })
        .await?;
    app.emit("snapshot.removed", &id, "");
    Ok(StatusCode::NO_CONTENT)
}
