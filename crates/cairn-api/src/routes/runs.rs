//! Pipeline runs, their artifacts and the dead-letter queue. A run started
//! here is executed by this server, on a thread of its own; a server that
//! stops leaves the stages' commands running in their sandboxes, and the
//! next one resumes every interrupted run.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::Response;
use axum::Json;
use cairn_engine::tenants::Owned;
use cairn_pipeline::approval::Verdict;
use cairn_pipeline::prelude::*;
use cairn_pipeline::run::RunWatcher;

use super::files::streamed;
use super::{idempotent, parse};
use crate::app::App;
use crate::error::{ApiError, ApiResult, ErrorBody};
use crate::model::*;

type QueryResult<T> = Result<Query<T>, axum::extract::rejection::QueryRejection>;

/// Stage transitions become events and metrics.
struct Watch {
    app: Arc<App>,
    run: String,
}

impl RunWatcher for Watch {
    fn stage(&self, stage: &str, branch: &str, status: &str, detail: &str) {
        if matches!(status, "completed" | "failed" | "dead" | "reused") {
            self.app.metrics.stage(status);
        }
        let name = if branch.is_empty() {
            stage.to_string()
        } else {
            format!("{stage}/{branch}")
        };
        self.app
            .emit("run.stage", &self.run, format!("{name} {status}: {detail}"));
    }
    fn output(&self, _: &str, _: &str, _: &[u8]) {}
}

/// Executes (or resumes) a run on a thread of its own, returning once
/// that thread holds the run's orchestrator lock (or has already ended),
/// so that a client reading the run next sees it orchestrated.
pub fn orchestrate(app: &Arc<App>, run: String, retry: Option<String>) {
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let watcher = app.take_engine();
    let id = run.clone();
    spawn_orchestrator(app, run, retry, done_tx);
    let Ok(engine) = watcher else { return };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while engine.run_orchestrator(&id).is_none()
        && done_rx.try_recv() == Err(std::sync::mpsc::TryRecvError::Empty)
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    app.give_back(engine);
}

fn spawn_orchestrator(app: &Arc<App>, run: String, retry: Option<String>, done: std::sync::mpsc::Sender<()>) {
    let app = Arc::clone(app);
    std::thread::spawn(move || {
        let _done = done;
        let mut engine = match app.take_engine() {
            Ok(e) => e,
            Err(e) => return tracing::error!(run, "cannot execute the run: {}", e.message),
        };
        let watch = Watch {
            app: Arc::clone(&app),
            run: run.clone(),
        };
        let result = match &retry {
            Some(dl) => engine.retry_dead_letter(dl, &watch),
            None => engine.execute_run(&run, &watch),
        };
        match result {
            Ok(r) => app.emit("run.ended", &r.id, r.status),
            Err(e) => {
                tracing::warn!(run, "run stopped: {e}");
                app.emit("run.ended", &run, format!("stopped: {e}"));
            }
        }
        app.give_back(engine);
    });
}

/// Resumes the runs an earlier server (or CLI) left interrupted.
pub fn resume_interrupted(app: &Arc<App>) -> Result<Vec<String>, ApiError> {
    let engine = app.take_engine()?;
    let runs = engine.runs()?;
    let interrupted: Vec<String> = runs
        .into_iter()
        // A run the queue's workers hold (docs/cluster.md) is theirs.
        .filter(|r| r.status == "running" && !engine.run_executed(&r.id))
        .map(|r| r.id)
        .collect();
    app.give_back(engine);
    for run in &interrupted {
        tracing::info!(run, "resuming an interrupted run");
        orchestrate(app, run.clone(), None);
    }
    Ok(interrupted)
}

/// Checks a pipeline and starts a run of it; the run goes on in the server.
#[utoipa::path(operation_id = "start_run", post, path = "/v1/runs", tag = "runs",
    params(("Idempotency-Key" = Option<String>, Header, description = "A retried request with this key answers what the first did")),
    request_body = StartRun,
    responses((status = 202, body = Run), (status = 400, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "A request with this Idempotency-Key is in progress"),
        (status = 422, body = ErrorBody, description = "The Idempotency-Key was used with another body")))]
pub async fn start(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> ApiResult<Response> {
    let req: StartRun = parse(&body)?;
    let a = Arc::clone(&app);
    idempotent(&app, &headers, "runs.start", &body, || async move {
        let file = req.file.clone().unwrap_or_else(|| "api".into());
        let queue = req.queue;
        let run = a
            .engine(move |e| {
                let run = e.start_run_text(&file, req.pipeline, &req.params)?;
                if queue {
                    e.enqueue_run(&run.id)?;
                }
                Ok(run)
            })
            .await?;
        a.emit("run.started", &run.id, run.pipeline.clone());
        if queue {
            return Ok((
                StatusCode::ACCEPTED,
                serde_json::to_value(Run::of(run, true)).expect("serialisable"),
            ));
        }
        let (a2, id) = (Arc::clone(&a), run.id.clone());
        tokio::task::spawn_blocking(move || orchestrate(&a2, id, None))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?;
        Ok((
            StatusCode::ACCEPTED,
            serde_json::to_value(Run::of(run, true)).expect("serialisable"),
        ))
    })
    .await
}

/// Lists runs, oldest first.
#[utoipa::path(operation_id = "list_runs", get, path = "/v1/runs", tag = "runs", params(PageQuery),
    responses((status = 200, body = RunPage), (status = 400, body = ErrorBody)))]
pub async fn list(State(app): State<Arc<App>>, q: QueryResult<PageQuery>) -> ApiResult<Json<RunPage>> {
    let Query(q) = q?;
    let mine = crate::tenancy::owned(&app, Owned::Run).await?;
    let mut runs = app
        .engine(move |e| {
            let runs = e.runs()?;
            let mut counts = e.stage_counts()?;
            Ok(runs
                .into_iter()
                .filter(|r| mine.as_ref().is_none_or(|m| m.contains(&r.id)))
                .map(|r| {
                    let live = e.run_executed(&r.id);
                    let stage_counts = counts.remove(&r.id).unwrap_or_default();
                    Run {
                        stage_counts,
                        ..Run::of(r, live)
                    }
                })
                .collect::<Vec<_>>())
        })
        .await?;
    runs.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
    let (items, next) = page(runs, |r| &r.id, q.after.as_deref(), q.limit);
    Ok(Json(RunPage { items, next }))
}

/// A run with its stages, lineage events and artifacts.
#[utoipa::path(operation_id = "get_run", get, path = "/v1/runs/{id}", tag = "runs",
    params(("id" = String, Path, description = "Run id or unique prefix")),
    responses((status = 200, body = RunDetail), (status = 404, body = ErrorBody)))]
pub async fn get(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Json<RunDetail>> {
    let detail = app
        .engine(move |e| {
            let run = e.run_record(&id)?;
            let live = e.run_executed(&run.id);
            let stages: Vec<Stage> = e.run_stages(&run.id)?.into_iter().map(Stage::from).collect();
            let mut stage_counts = std::collections::BTreeMap::new();
            for s in &stages {
                *stage_counts.entry(s.status.clone()).or_insert(0) += 1;
            }
            Ok(RunDetail {
                stages,
                events: e.run_events(&run.id)?.into_iter().map(RunEvent::from).collect(),
                artifacts: e.artifacts(Some(&run.id))?.into_iter().map(Artifact::from).collect(),
                decisions: e.run_decisions(&run.id)?.into_iter().map(Decision::from).collect(),
                graph: e.run_graph(&run).map(|g| g.into_iter().map(StageEdges::from).collect()),
                run: Run {
                    stage_counts,
                    ..Run::of(run, live)
                },
            })
        })
        .await?;
    Ok(Json(detail))
}

/// Where a run's time and bytes went, stage by stage, with the seed's
/// snapshot advice where it applies (`cairn audit`).
#[utoipa::path(operation_id = "audit_run", get, path = "/v1/runs/{id}/audit", tag = "runs",
    params(("id" = String, Path, description = "Run id or unique prefix")),
    responses((status = 200, body = RunAudit), (status = 404, body = ErrorBody)))]
pub async fn audit(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Json<RunAudit>> {
    let limits = cairn_pipeline::audit::AuditLimits::default();
    let audit = app.engine(move |e| Ok(e.audit_run(&id, &limits)?)).await?;
    Ok(Json(RunAudit::from(audit)))
}

/// Resumes an interrupted run in the server.
#[utoipa::path(operation_id = "resume_run", post, path = "/v1/runs/{id}/resume", tag = "runs",
    params(("id" = String, Path, description = "Run id")),
    responses((status = 202, body = Run), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn resume(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<(StatusCode, Json<Run>)> {
    let run = app
        .engine(move |e| {
            let run = e.run_record(&id)?;
            if run.status == "completed" {
                return Err(ApiError::conflict(format!("run {} already completed", run.id)));
            }
            if let Some(pid) = e.run_orchestrator(&run.id) {
                return Err(ApiError::conflict(format!(
                    "run {} is being executed by process {pid}",
                    run.id
                )));
            }
            if let Some(job) = e.queue_job(&run.id)?.filter(|j| j.status != "done") {
                return Err(ApiError::conflict(format!(
                    "run {} is queued for `cairn worker`s ({}); they execute it",
                    run.id,
                    job.worker
                        .map_or("no worker holds it yet".to_string(), |w| format!("held by {w}"))
                )));
            }
            Ok(run)
        })
        .await?;
    let (a, id) = (Arc::clone(&app), run.id.clone());
    tokio::task::spawn_blocking(move || orchestrate(&a, id, None))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok((StatusCode::ACCEPTED, Json(Run::of(run, true))))
}

/// Records a verdict on a stage waiting for approval; approved, the run
/// goes on in the server.
async fn verdict(
    app: Arc<App>,
    id: String,
    stage: String,
    body: Bytes,
    verdict: Verdict,
) -> ApiResult<(StatusCode, Json<Run>)> {
    let req: StageVerdict = if body.is_empty() {
        StageVerdict::default()
    } else {
        parse(&body)?
    };
    let by = req.by.unwrap_or_else(|| "api".into());
    if by.is_empty() || by.len() > 128 || !by.bytes().all(|c| c.is_ascii_alphanumeric() || b"-_.@ ".contains(&c)) {
        return Err(ApiError::bad_request(
            "by names who decides: 1 to 128 letters, digits, '-', '_', '.', '@' or spaces",
        ));
    }
    let run = app
        .engine(move |e| Ok(e.decide_approval(&id, &stage, verdict, &by, req.reason.as_deref())?))
        .await?;
    app.emit("run.verdict", &run.id, run.status.clone());
    if verdict == Verdict::Approve {
        let (a, id) = (Arc::clone(&app), run.id.clone());
        tokio::task::spawn_blocking(move || orchestrate(&a, id, None))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?;
        return Ok((StatusCode::ACCEPTED, Json(Run::of(run, true))));
    }
    Ok((StatusCode::OK, Json(Run::of(run, false))))
}

/// Approves a stage that waits for a person (`approve = true`): records who
/// and why, then the run goes on in the server.
#[utoipa::path(operation_id = "approve_stage", post, path = "/v1/runs/{id}/stages/{stage}/approve", tag = "runs",
    params(("id" = String, Path, description = "Run id"), ("stage" = String, Path, description = "Stage name")),
    request_body(content = Option<StageVerdict>, description = "Optional: the reason and who approves"),
    responses((status = 202, body = Run), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "The stage is not waiting for approval, or was already approved or rejected")))]
pub async fn approve(
    State(app): State<Arc<App>>,
    Path((id, stage)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<Run>)> {
    verdict(app, id, stage, body, Verdict::Approve).await
}

/// Rejects a stage that waits for a person: the run fails there, with who
/// and why; the stage does not run.
#[utoipa::path(operation_id = "reject_stage", post, path = "/v1/runs/{id}/stages/{stage}/reject", tag = "runs",
    params(("id" = String, Path, description = "Run id"), ("stage" = String, Path, description = "Stage name")),
    request_body(content = StageVerdict, description = "The reason (required) and who rejects"),
    responses((status = 200, body = Run), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "The stage is not waiting for approval, or was already approved or rejected")))]
pub async fn reject(
    State(app): State<Arc<App>>,
    Path((id, stage)): Path<(String, String)>,
    body: Bytes,
) -> ApiResult<(StatusCode, Json<Run>)> {
    verdict(app, id, stage, body, Verdict::Reject).await
}

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct LogQuery {
    /// The branch, for a stage in a branch group.
    pub branch: Option<String>,
    /// Only the last this many bytes (1 to 16 MiB), from the start of a line.
    #[param(minimum = 1, maximum = 16777216)]
    pub tail_bytes: Option<u64>,
}

/// The most a log tail returns.
const LOG_TAIL_MAX: u64 = 16 << 20;

/// A stage's output log (all attempts), as text.
#[utoipa::path(operation_id = "get_stage_log", get, path = "/v1/runs/{id}/logs/{stage}", tag = "runs",
    params(("id" = String, Path, description = "Run id"), ("stage" = String, Path, description = "Stage name"), LogQuery),
    responses((status = 200, content_type = "text/plain", body = String), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn log(
    State(app): State<Arc<App>>,
    Path((id, stage)): Path<(String, String)>,
    q: QueryResult<LogQuery>,
) -> ApiResult<Response> {
    let Query(q) = q?;
    let valid = |s: &str| {
        !s.is_empty() && s.len() <= 128 && s.bytes().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c))
    };
    if !valid(&stage) || q.branch.as_deref().is_some_and(|b| !valid(b)) || stage.starts_with('.') {
        return Err(ApiError::bad_request(
            "stage and branch are names: letters, digits, '-', '_', '.'",
        ));
    }
    let tail = q.tail_bytes;
    if tail.is_some_and(|t| t == 0 || t > LOG_TAIL_MAX) {
        return Err(ApiError::bad_request(format!(
            "tail_bytes is 1 to {LOG_TAIL_MAX} (16 MiB); leave it out for the whole log"
        )));
    }
    let path = app
        .engine(move |e| {
            let run = e.run_record(&id)?;
            let name = match &q.branch {
                Some(b) => format!("{stage}.{b}.log"),
                None => format!("{stage}.log"),
            };
            let path = e.run_dir(&run.id).join(name);
            if !path.is_file() {
                return Err(ApiError::not_found(format!(
                    "run {} has no log for stage {stage} (yet)",
                    run.id
                )));
            }
            Ok(path)
        })
        .await?;
    let mut file = tokio::fs::File::open(&path)
        .await
        .map_err(|e| ApiError::internal(format!("{}: {e}", path.display())))?;
    let body = match tail {
        None => axum::body::Body::from_stream(tokio_util::io::ReaderStream::new(file)),
        Some(n) => {
            use tokio::io::{AsyncReadExt, AsyncSeekExt};
            let len = file
                .metadata()
                .await
                .map_err(|e| ApiError::internal(format!("{}: {e}", path.display())))?
                .len();
            let from = len.saturating_sub(n);
            file.seek(std::io::SeekFrom::Start(from))
                .await
                .map_err(|e| ApiError::internal(format!("{}: {e}", path.display())))?;
            let mut bytes = Vec::with_capacity((len - from) as usize);
            file.take(n)
                .read_to_end(&mut bytes)
                .await
                .map_err(|e| ApiError::internal(format!("{}: {e}", path.display())))?;
            // From the first whole line, unless the tail is the whole log.
            if from > 0 {
                if let Some(nl) = bytes.iter().position(|&b| b == b'\n') {
                    bytes.drain(..=nl);
                }
            }
            axum::body::Body::from(bytes)
        }
    };
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    Ok(resp)
}

/// Downloads an artifact's content.
#[utoipa::path(operation_id = "get_artifact", get, path = "/v1/artifacts/{id}", tag = "runs",
    params(("id" = String, Path, description = "Artifact id or unique prefix")),
    responses((status = 200, content_type = "application/octet-stream", body = Binary), (status = 404, body = ErrorBody)))]
pub async fn artifact(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Response> {
    let key = id.clone();
    let mine = crate::tenancy::owned(&app, Owned::Run).await?;
    // The full id, so that the read below lands on this artifact alone.
    let id = app
        .engine(move |e| {
            let all = e.artifacts(None)?;
            let mut found: Vec<String> = all
                .into_iter()
                .filter(|a| mine.as_ref().is_none_or(|m| m.contains(&a.run_id)))
                .filter(|a| a.id == key || (key.len() >= 4 && a.id.starts_with(&key)))
                .map(|a| a.id)
                .collect();
            match found.len() {
                0 => Err(ApiError::not_found(format!(
                    "no artifact matches {key:?}; GET /v1/runs/RUN lists a run's artifacts"
                ))),
                1 => Ok(found.remove(0)),
                _ => Err(ApiError::bad_request(format!(
                    "{key:?} matches several artifacts; give more of the id"
                ))),
            }
        })
        .await?;
    let resp = streamed(&app, move |e, out| Ok(e.artifact_get(&id, out).map(drop)?));
    Ok(resp)
}

/// The dead-letter queue: stages whose retries ran out.
#[utoipa::path(operation_id = "list_dead_letters", get, path = "/v1/dlq", tag = "runs",
    responses((status = 200, body = Vec<DeadLetterView>)))]
pub async fn dlq(State(app): State<Arc<App>>) -> ApiResult<Json<Vec<DeadLetterView>>> {
    let mine = crate::tenancy::owned(&app, Owned::Run).await?;
    let all = app.engine(|e| Ok(e.dead_letters()?)).await?;
    Ok(Json(
        all.into_iter()
            .filter(|d| mine.as_ref().is_none_or(|m| m.contains(&d.run_id)))
            .map(DeadLetterView::from)
            .collect(),
    ))
}

async fn dead_letter(app: &Arc<App>, key: String) -> ApiResult<DeadLetterView> {
    let mine = crate::tenancy::owned(app, Owned::Run).await?;
    app.engine(move |e| {
        let all = e.dead_letters()?;
        let mut found: Vec<_> = all
            .into_iter()
            .filter(|d| mine.as_ref().is_none_or(|m| m.contains(&d.run_id)))
            .filter(|d| d.id == key || (key.len() >= 4 && d.id.starts_with(&key)))
            .collect();
        match found.len() {
            0 => Err(ApiError::not_found(format!(
                "no dead letter matches {key:?}; GET /v1/dlq lists them"
            ))),
            1 => Ok(found.remove(0).into()),
            _ => Err(ApiError::bad_request(format!(
                "{key:?} matches several dead letters; give more of the id"
            ))),
        }
    })
    .await
}

/// One dead letter.
#[utoipa::path(operation_id = "get_dead_letter", get, path = "/v1/dlq/{id}", tag = "runs",
    params(("id" = String, Path, description = "Dead letter id")),
    responses((status = 200, body = DeadLetterView), (status = 404, body = ErrorBody)))]
pub async fn dlq_get(State(app): State<Arc<App>>, Path(id): Path<String>) -> ApiResult<Json<DeadLetterView>> {
    Ok(Json(dead_letter(&app, id).await?))
}

/// Retries a dead letter: its stage runs again (from its newest
/// checkpoint), then the rest of its run, in the server.
#[utoipa::path(operation_id = "retry_dead_letter", post, path = "/v1/dlq/{id}/retry", tag = "runs",
    params(("id" = String, Path, description = "Dead letter id")),
    responses((status = 202, body = DeadLetterView), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn dlq_retry(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
) -> ApiResult<(StatusCode, Json<DeadLetterView>)> {
    let dl = dead_letter(&app, id).await?;
    if dl.retried_at.is_some() {
        return Err(ApiError::conflict(format!("dead letter {} was already retried", dl.id)));
    }
    let (a, run, id) = (Arc::clone(&app), dl.run_id.clone(), dl.id.clone());
    tokio::task::spawn_blocking(move || orchestrate(&a, run, Some(id)))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok((StatusCode::ACCEPTED, Json(dl)))
}
