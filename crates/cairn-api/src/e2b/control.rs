//! The control plane: create, list, info, kill, timeouts, pause and
//! resume (connect), snapshots, fork. Each handler checks its input, calls
//! the engine, and records the E2B side in the state store.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use axum::Json;
use cairn_engine::{images, CreateOptions, Engine, EngineError, SandboxRecord, Silent, SnapshotRecord};
use cairn_sandbox::Limits;
use serde::Deserialize;
use serde_json::{json, Value};

use super::book::E2bBook;
use super::{
    base, network, page, templates, Entry, Gateway, Life, RestError, DEFAULT_TIMEOUT_SECS, ENVD_VERSION,
    MAX_TIMEOUT_SECS,
};
use crate::app::now_ms;
use cairn_engine::state::e2b::E2bSnapshot;

type G = State<Arc<Gateway>>;
type Rest<T> = Result<T, RestError>;

/// Where a new sandbox's home is: E2B runs commands as `user` in
/// `/home/user`.
pub(crate) const HOME: &str = "/home/user";
const MAX_MAP_ENTRIES: usize = 256;
const MAX_STRING: usize = 4096;

/// The API token (its id) a control-plane request came with: the grant of
/// the sandboxes it creates, connects, resumes, pauses or forks.
#[derive(Debug, Clone)]
pub(crate) struct ApiKey(pub String, pub Option<String>);

/// Refuses control-plane requests without a valid Cairn API token in
/// `X-API-KEY`.
pub async fn require_api_key(State(gw): G, req: Request, next: Next) -> Response {
    let key = req
        .headers()
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_string());
    let Some(key) = key.filter(|k| !k.is_empty() && k.len() <= 512) else {
        return RestError::new(
            StatusCode::UNAUTHORIZED,
            "X-API-KEY is missing: set E2B_API_KEY to a token from `cairn token create NAME`",
        )
        .into_response();
    };
    match gw.app.check_token(key).await {
        Ok(Some(token)) => {
            let mut req = req;
            let tenant = token.tenant.clone();
            req.extensions_mut()
                .insert(ApiKey(token.id.clone(), token.tenant.clone()));
            let (method, path) = (req.method().clone(), req.uri().path().to_string());
            let token = token.id;
            let resp = crate::tenancy::acting(tenant.clone(), async {
                match &tenant {
                    Some(t) => match others(&gw, t, &path) {
                        Some(id) => RestError::not_found(&id).into_response(),
                        None => next.run(req).await,
                    },
                    None => next.run(req).await,
                }
            })
            .await;
            let status = resp.status().as_u16();
            gw.app
                .audit
                .record(Some(&token), tenant.as_deref(), "e2b", method.as_str(), &path, status);
            resp
        }
        Ok(None) => RestError::new(
            StatusCode::UNAUTHORIZED,
            "the API key is not a valid Cairn token (revoked or mistyped); make one with `cairn token create NAME`",
        )
        .into_response(),
        Err(e) => RestError::from(e).into_response(),
    }
}

/// The sandbox id of a `/sandboxes/{id}/…` path (any API version) when
/// that sandbox is not tenant `tenant`'s: it answers as an absent one.
fn others(gw: &Gateway, tenant: &str, path: &str) -> Option<String> {
    let mut segments = path.split('/').skip(1).skip_while(|s| matches!(*s, "v1" | "v2" | "v3"));
    if segments.next() != Some("sandboxes") {
        return None;
    }
    let id = segments.next().filter(|id| !id.is_empty() && *id != "metrics")?;
    let id = percent_encoding::percent_decode_str(id)
        .decode_utf8_lossy()
        .into_owned();
    let theirs = gw.entry(&id).is_some_and(|e| e.tenant.as_deref() == Some(tenant));
    (!theirs).then_some(id)
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Rest<T> {
    crate::routes::parse(body).map_err(RestError::from)
}

/// An RFC 3339 time in UTC with milliseconds, as E2B's API writes them.
pub(crate) fn rfc3339(ms: i64) -> String {
    // The years RFC 3339 can write: 1970 to 9999.
    let ms = ms.clamp(0, 253_402_300_799_999) as u64;
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
    humantime::format_rfc3339_millis(at).to_string()
}

fn sandbox_json(gw: &Gateway, e: &Entry) -> Value {
    json!({
        "templateID": e.template, "sandboxID": e.id, "clientID": "cairn",
        "envdVersion": ENVD_VERSION, "envdAccessToken": gw.token(e), "domain": gw.domain,
        "trafficAccessToken": gw.traffic_token(e),
    })
}

fn listed_json(e: &Entry) -> Value {
    json!({
        "templateID": e.template, "sandboxID": e.id, "clientID": "cairn", "alias": e.template,
        "startedAt": rfc3339(e.started_at), "endAt": rfc3339(e.end_at),
        "cpuCount": e.cpu_count, "memoryMB": e.memory_mb, "diskSizeMB": 0,
        "state": if e.running().is_some() { "running" } else { "paused" },
        "envdVersion": ENVD_VERSION, "metadata": e.metadata,
    })
}

fn check_map(what: &str, m: &BTreeMap<String, String>, env: bool) -> Rest<()> {
    if m.len() > MAX_MAP_ENTRIES {
        return Err(RestError::bad_request(format!(
            "{what} has more than {MAX_MAP_ENTRIES} entries"
        )));
    }
    for (k, v) in m {
        if k.is_empty() || k.len() > MAX_STRING || v.len() > MAX_STRING || k.contains('\0') || v.contains('\0') {
            return Err(RestError::bad_request(format!(
                "{what}: keys must be non-empty, keys and values at most {MAX_STRING} bytes without NUL"
            )));
        }
        if env && k.contains('=') {
            return Err(RestError::bad_request(format!("{what}: {k:?} must not contain '='")));
        }
    }
    Ok(())
}

fn timeout_ms(t: Option<u64>) -> Rest<i64> {
    let t = t.unwrap_or(DEFAULT_TIMEOUT_SECS);
    if t > MAX_TIMEOUT_SECS {
        return Err(RestError::bad_request(format!(
            "timeout must be at most {MAX_TIMEOUT_SECS} seconds, got {t}"
        )));
    }
    Ok(t as i64 * 1000)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: String,
    timeout: Option<u64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(default)]
    auto_pause: Option<bool>,
    #[serde(default)]
    volume_mounts: Option<Vec<Value>>,
    #[serde(default)]
    mcp: Option<Value>,
    /// Sent by the SDK as written (not camelCase).
    #[serde(default, rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    #[serde(default)]
    network: Option<network::NetworkBody>,
}

/// The record of a new E2B sandbox, named by its first Cairn sandbox.
fn entry_for(rec: &SandboxRecord, template: String, life_ms: i64, key: &ApiKey) -> Entry {
    Entry {
        id: rec.id.clone(),
        template,
        life: Life::Running {
            sandbox: rec.id.clone(),
        },
        started_at: now_ms(),
        end_at: now_ms() + life_ms,
        auto_pause: false,
        metadata: BTreeMap::new(),
        env: BTreeMap::new(),
        cpu_count: (rec.cpu_millis / 1000).max(1),
        memory_mb: rec.memory_bytes >> 20,
        grant: Some(key.0.clone()),
        network: None,
        workdir: None,
        public_traffic: false,
        tenant: key.1.clone(),
    }
}

fn make_home(e: &cairn_engine::Engine, rec: &SandboxRecord) -> Result<(), crate::error::ApiError> {
    e.client(rec)?.make_dir(HOME, true)?;
    Ok(())
}

/// `POST /v2/sandboxes`: a template is `base` (Cairn's default image), a
/// Cairn image name, or a snapshot id (restored, on the driver it was
/// taken on). An image template runs on the driver `--e2b-driver` names.
pub async fn create(
    State(gw): G,
    Extension(key): Extension<ApiKey>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Rest<Response> {
    let req: NewSandbox = parse(&body)?;
    if req.template_id.is_empty() || req.template_id.len() > 256 || req.template_id.contains('\0') {
        return Err(RestError::bad_request("templateID must be 1 to 256 bytes"));
    }
    if req.volume_mounts.as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(RestError::bad_request(
            "volume mounts are not supported by Cairn's E2B gateway",
        ));
    }
    if req.mcp.is_some() {
        return Err(RestError::bad_request(
            "the MCP gateway template is not supported by Cairn's E2B gateway",
        ));
    }
    let metadata = req.metadata.unwrap_or_default();
    let env = req.env_vars.unwrap_or_default();
    check_map("metadata", &metadata, false)?;
    check_map("envVars", &env, true)?;
    let life = timeout_ms(req.timeout)?;
    let template = req.template_id.clone();
    // A template built through the template API: its image, run on the
    // native driver, and what its sandboxes start with.
    let built = if template == "base" {
        None
    } else {
        templates::resolve(&gw, &template).await?
    };
    let driver = if built.is_some() {
        "native"
    } else {
        gw.drivers.of(&template)
    };
    // A snapshot template is restored on the driver it was taken on.
    let snapshot_driver = if template == "base" || built.is_some() {
        None
    } else {
        let t = template.clone();
        gw.app
            .engine(move |e| {
                Ok(match e.image(&t) {
                    Ok(_) => None,
                    // A tenant's engine finds its own snapshots only.
                    Err(_) => e.snapshot_record(&t).ok().map(|s| s.driver),
                })
            })
            .await?
    };
    let public = network::public_traffic(req.network.as_ref());
    let net = network::requested(
        &gw,
        snapshot_driver.as_deref().unwrap_or(driver),
        req.allow_internet_access,
        req.network,
    )?;
    let policy = net.as_ref().map(network::policy).transpose()?;
    // Past the server's capacity the create waits its turn; its deadline
    // passing is E2B's 429.
    // `base`: E2B's Debian base (waited for while it is built), or busybox.
    let base_image = if template == "base" {
        base::image(&gw).await?
    } else {
        None
    };
    let ticket = gw
        .app
        .admission
        .admit_request(&gw.app, &key.0, &headers, 1, &Limits::default())
        .await?;
    let config = built.as_ref().map(|(_, c)| c.clone());
    let rec = gw
        .app
        .engine(move |e| {
            let on_driver = |image: Option<String>| CreateOptions {
                image,
                driver: Some(driver.to_string()),
                network: policy.clone(),
                ..CreateOptions::default()
            };
            // A 500, not the API's 503: the SDK words a 503 as "retry",
            // and nothing changes until runsc is installed.
            let created = |r: Result<SandboxRecord, EngineError>| {
                r.map_err(|err| match err {
                    EngineError::DriverUnavailable(why) => crate::error::ApiError::internal(format!(
                        "template {template:?} runs on the {driver} driver (cairn serve --e2b-driver): {why}"
                    )),
                    other => other.into(),
                })
            };
            // A code-interpreter image's sandboxes (`cairn image build
            // code-interpreter`, or an image whose top layer holds its
            // server, as an import of one does) serve E2B's code
            // interpreter on port 49999, started with the sandbox.
            let rec = if let Some((image, config)) = &built {
                let mut opts = on_driver(Some(image.clone()));
                opts.services = config.start_cmd.iter().cloned().collect();
                created(e.create_sandbox(&opts, &Silent))?
            } else if template == "base" {
                created(e.create_sandbox(&on_driver(base_image), &Silent))?
            } else if let Ok(image) = e.image(&template) {
                let mut opts = on_driver(Some(template.clone()));
                if image.source.split_whitespace().next() == Some(images::CODE_INTERPRETER_SOURCE)
                    || e.image_has_file(&image, images::CODE_INTERPRETER_PATH)
                {
                    opts.services = vec![images::CODE_INTERPRETER_COMMAND.to_string()];
                }
                created(e.create_sandbox(&opts, &Silent))?
            } else {
                match e.snapshot_record(&template) {
                    Ok(snap) => e.restore(
                        &snap,
                        &CreateOptions {
                            network: policy.clone(),
                            ..CreateOptions::default()
                        },
                    )?,
                    Err(_) => {
                        return Err(crate::error::ApiError::not_found(format!(
                            "template {template:?} not found: use base, a Cairn image name or a snapshot id"
                        )))
                    }
                }
            };
            let ready = make_home(e, &rec).and_then(|()| {
                if let Some((_, config)) = built.as_ref().filter(|(_, c)| c.start_cmd.is_some()) {
                    if let Some(ready) = config.ready_cmd.as_ref().filter(|r| !templates::only_waits(r)) {
                        let ids = e
                            .ids_of(&rec, config.user.as_deref())
                            .map_err(crate::error::ApiError::internal)?;
                        e.wait_ready(&rec, ready, config, ids, templates::READY_TIMEOUT)
                            .map_err(|why| {
                                crate::error::ApiError::internal(format!("{why}; the sandbox was removed"))
                            })?;
                    }
                }
                if serves_interpreter(&rec) {
                    wait_for_interpreter(e, &rec)
                        .map_err(|why| crate::error::ApiError::internal(format!("{why}; the sandbox was removed")))
                } else {
                    Ok(())
                }
            });
            if let Err(err) = ready {
                let _ = e.remove_sandbox(&rec, true);
                return Err(err);
            }
            Ok(rec)
        })
        .await?;
    ticket.made([&rec]);
    let mut entry = entry_for(&rec, req.template_id, life, &key);
    entry.metadata = metadata;
    if let Some(config) = config {
        // The template's variables, under the ones the create gave.
        let mut all = config.env;
        all.extend(env);
        entry.env = all;
        entry.workdir = config.workdir;
    } else {
        entry.env = env;
    }
    entry.auto_pause = req.auto_pause.unwrap_or(false);
    entry.network = net;
    entry.public_traffic = public;
    let out = sandbox_json(&gw, &entry);
    gw.put(entry).await?;
    gw.app.emit("sandbox.created", &rec.id, "through the E2B API");
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

#[derive(Deserialize)]
pub struct ListQuery {
    state: Option<String>,
    metadata: Option<String>,
    template: Option<String>,
    #[serde(rename = "startedAfter")]
    started_after: Option<String>,
    order: Option<String>,
    limit: Option<i64>,
    #[serde(rename = "nextToken")]
    next_token: Option<String>,
}

/// A page of a listing: the items, and `x-next-token` while more remain.
fn paged(items: Vec<Value>, next: Option<String>) -> Rest<Response> {
    let mut resp = Json(items).into_response();
    if let Some(next) = next {
        let v = axum::http::HeaderValue::from_str(&next)
            .map_err(|e| RestError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        resp.headers_mut().insert("x-next-token", v);
    }
    Ok(resp)
}

/// Percent-decodes once; `None` on malformed input.
fn unquote(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let h = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(h, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// `GET /v2/sandboxes`: running and paused sandboxes, filtered by state
/// and metadata.
pub async fn list(
    State(gw): G,
    q: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> Rest<Response> {
    let Query(q) = q.map_err(|e| RestError::bad_request(e.body_text()))?;
    let states: Vec<String> = q
        .state
        .as_deref()
        .map(|s| s.split(',').map(str::to_string).collect())
        .unwrap_or_default();
    if let Some(bad) = states.iter().find(|s| *s != "running" && *s != "paused") {
        return Err(RestError::bad_request(format!(
            "state must be \"running\" or \"paused\" (comma-separated), not {bad:?}"
        )));
    }
    let started_after = match q.started_after.as_deref() {
        None => None,
        Some(t) => Some(
            chrono::DateTime::parse_from_rfc3339(t)
                .map_err(|e| {
                    RestError::bad_request(format!(
                        "startedAfter must be an RFC 3339 time like 2026-01-02T03:04:05Z, not {t:?}: {e}"
                    ))
                })?
                .timestamp_millis(),
        ),
    };
    let order = page::Order::parse(q.order.as_deref())?;
    let limit = page::limit(q.limit)?;
    let after = page::Cursor::parse(q.next_token.as_deref())?;
    let mut wanted = Vec::new();
    if let Some(m) = &q.metadata {
        for pair in m.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let k = unquote(k).and_then(|k| unquote(&k));
            let v = unquote(v).and_then(|v| unquote(&v));
            match (k, v) {
                (Some(k), Some(v)) => wanted.push((k, v)),
                _ => return Err(RestError::bad_request("metadata is not a valid query")),
            }
        }
    }
    let tenant = crate::tenancy::current();
    let found: Vec<Entry> = gw
        .entries()
        .into_iter()
        .filter(|e| tenant.is_none() || e.tenant == tenant)
        .filter(|e| {
            let st = if e.running().is_some() { "running" } else { "paused" };
            states.is_empty() || states.iter().any(|s| s == st)
        })
        .filter(|e| wanted.iter().all(|(k, v)| e.metadata.get(k) == Some(v)))
        .filter(|e| q.template.as_ref().is_none_or(|t| &e.template == t))
        .filter(|e| started_after.is_none_or(|t| e.started_at >= t))
        .collect();
    let (found, next) = page::page(found, |e| (e.started_at, e.id.as_str()), order, limit, after.as_ref());
    paged(found.iter().map(listed_json).collect(), next)
}

fn known(gw: &Gateway, id: &str) -> Rest<Entry> {
    gw.entry(id).ok_or_else(|| RestError::not_found(id))
}

/// How long a sandbox's server may take to listen before create fails.
const PORT_READY_WITHIN: std::time::Duration = std::time::Duration::from_secs(60);

/// Whether `rec` serves E2B's code interpreter: its server is one of the
/// services it starts with (from an image, or a snapshot of such a sandbox).
fn serves_interpreter(rec: &SandboxRecord) -> bool {
    rec.services.iter().any(|s| s == images::CODE_INTERPRETER_COMMAND)
}

/// Waits until the code interpreter's server listens in `rec`, as E2B's
/// create waits for a template's ready check; else why not.
fn wait_for_interpreter(e: &Engine, rec: &SandboxRecord) -> Result<(), String> {
    let port = images::CODE_INTERPRETER_PORT;
    let client = e.client(rec).map_err(|err| err.to_string())?;
    let deadline = std::time::Instant::now() + PORT_READY_WITHIN;
    loop {
        let why = match client.connect_port(port) {
            Ok(Ok(_connected)) => return Ok(()),
            Ok(Err(why)) => why,
            Err(err) => err.to_string(),
        };
        if std::time::Instant::now() >= deadline {
            return Err(format!(
                "the code interpreter's server on port {port} did not start within {}s ({why})",
                PORT_READY_WITHIN.as_secs()
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
}

/// `GET /sandboxes/{id}`.
pub async fn info(State(gw): G, Path(id): Path<String>) -> Rest<Response> {
    let e = known(&gw, &id)?;
    let mut v = listed_json(&e);
    v["envdAccessToken"] = json!(gw.token(&e));
    v["trafficAccessToken"] = json!(gw.traffic_token(&e));
    if let Some(n) = network::json(&e.network, e.public_traffic) {
        v["network"] = n;
    }
    v["domain"] = json!(gw.domain);
    Ok(Json(v).into_response())
}

/// Removes the Cairn sandbox under an E2B one (if any) and forgets it.
pub(crate) async fn kill_entry(gw: &Arc<Gateway>, id: &str) -> Rest<()> {
    known(gw, id)?;
    let _busy = gw.app.claim(&format!("e2b:{id}"), "kill")?;
    let e = known(gw, id)?;
    gw.watchers().forget_sandbox(id);
    match e.life.clone() {
        Life::Running { sandbox } => {
            gw.app
                .engine(move |en| match en.sandbox(&sandbox) {
                    Ok(rec) => Ok(en.remove_sandbox(&rec, true)?),
                    Err(EngineError::NoSuchSandbox(_)) => Ok(()),
                    Err(err) => Err(err.into()),
                })
                .await?;
        }
        Life::Paused { snapshot } => {
            gw.warm.forget(&gw.app, id);
            // Nothing else starts from a pause's snapshot; `cairn gc`
            // then reclaims what only it held.
            let removed = gw
                .app
                .engine(move |en| {
                    let snap = en.snapshot_record(&snapshot)?;
                    Ok(en.remove_snapshot(&snap)?)
                })
                .await;
            if let Err(err) = removed {
                tracing::warn!(
                    sandbox = id,
                    "e2b: keeping the snapshot of a killed paused sandbox: {}",
                    err.message
                );
            }
        }
    }
    gw.drop_procs(id);
    gw.forget(id).await?;
    gw.app.emit("sandbox.removed", id, "through the E2B API");
    Ok(())
}

/// `DELETE /sandboxes/{id}`: 204, or 404 when unknown.
pub async fn kill(State(gw): G, Path(id): Path<String>) -> Rest<StatusCode> {
    kill_entry(&gw, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
pub struct TimeoutBody {
    timeout: u64,
}

/// `POST /sandboxes/{id}/timeout`: the sandbox ends that many seconds
/// from now.
pub async fn set_timeout(State(gw): G, Path(id): Path<String>, body: Bytes) -> Rest<StatusCode> {
    let req: TimeoutBody = parse(&body)?;
    let ms = timeout_ms(Some(req.timeout))?;
    known(&gw, &id)?;
    gw.modify(&id, |e| e.end_at = now_ms() + ms).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Snapshots a Cairn sandbox, then removes it: on gVisor the snapshot
/// holds memory and running processes (the sandbox stops at its
/// checkpoint, no restore), on native files only. The same engine calls as
/// a session's suspend.
fn snapshot_and_stop(en: &mut Engine, sandbox: &str) -> Result<SnapshotRecord, EngineError> {
    let rec = en.sandbox(sandbox)?;
    // As a session suspends: a gVisor sandbox stops at its checkpoint.
    let snap = en.snapshot_to_stop(&rec, None)?;
    let rec = en.sandbox(sandbox)?;
    en.remove_sandbox(&rec, true)?;
    Ok(snap)
}

/// Refuses a memory snapshot of a gVisor sandbox while a command started
/// with stdin or on a terminal runs: it holds a connection to init, which gVisor cannot
/// checkpoint (commands without stdin run as jobs and are kept).
async fn check_memory_snapshot(gw: &Arc<Gateway>, id: &str, sandbox: &str, what: &str) -> Rest<()> {
    let attached = gw.attached_pids(id);
    if attached.is_empty() {
        return Ok(());
    }
    let s = sandbox.to_string();
    let driver = gw.app.engine(move |en| Ok(en.sandbox(&s)?.driver)).await?;
    if driver != "gvisor" {
        return Ok(());
    }
    let pids: Vec<String> = attached.iter().map(i32::to_string).collect();
    // 400, Connect's failed_precondition: the SDK reads a 409 on pause as
    // "already paused" and says nothing.
    Err(RestError::new(
        StatusCode::BAD_REQUEST,
        format!(
            "cannot {what} sandbox {id} with its memory while commands started with stdin or on a terminal \
             run (pid {}): they hold a connection gVisor cannot checkpoint; close their stdin (exit the \
             terminal's shell) and wait for them, or kill them, then retry",
            pids.join(", ")
        ),
    ))
}

/// Snapshots a running E2B sandbox and removes the Cairn sandbox under it.
pub(crate) async fn pause_entry(gw: &Arc<Gateway>, id: &str) -> Rest<bool> {
    known(gw, id)?;
    let _busy = gw.app.claim(&format!("e2b:{id}"), "pause")?;
    let e = known(gw, id)?;
    let Some(sandbox) = e.running().map(str::to_string) else {
        return Ok(false);
    };
    check_memory_snapshot(gw, id, &sandbox, "pause").await?;
    // Watches are of the running sandbox; a resumed one starts new ones.
    gw.watchers().forget_sandbox(id);
    let _held = gw.hold_followers(id);
    let snap = gw.app.engine(move |en| Ok(snapshot_and_stop(en, &sandbox)?)).await?;
    let memory = snap.driver == "gvisor";
    if !memory {
        // Nothing ran on past a files-only pause.
        gw.drop_procs(id);
    }
    let paused = Life::Paused {
        snapshot: snap.id.clone(),
    };
    gw.modify(id, |e| e.life = paused).await?;
    if memory {
        super::warm::Warm::prepare(gw, id, &snap.id, e.tenant.clone());
    }
    let kept = if memory { "memory and processes" } else { "files" };
    gw.app.emit(
        "sandbox.removed",
        id,
        format!("paused as snapshot {} ({kept})", snap.id),
    );
    Ok(true)
}

/// `POST /sandboxes/{id}/pause`: 204, or 409 when already paused. The
/// sandbox is granted to the pausing key: access tokens issued before end.
pub async fn pause(
    State(gw): G,
    Extension(key): Extension<ApiKey>,
    Path(id): Path<String>,
    body: Bytes,
) -> Rest<StatusCode> {
    let _: Value = parse(&body)?;
    if pause_entry(&gw, &id).await? {
        gw.modify(&id, |e| e.grant = Some(key.0)).await?;
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(RestError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        ))
    }
}

#[derive(Deserialize)]
pub struct ConnectBody {
    timeout: Option<u64>,
}

/// `POST /v2/sandboxes/{id}/connect`: 200 for a running sandbox (its
/// timeout only ever extended), 201 after resuming a paused one under the
/// same id. The sandbox is granted to the connecting key: the access token
/// answered is derived from it, and one issued to another key ends.
pub async fn connect(
    State(gw): G,
    Extension(key): Extension<ApiKey>,
    Path(id): Path<String>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Rest<Response> {
    let req: ConnectBody = parse(&body)?;
    let ms = timeout_ms(req.timeout)?;
    let e = known(&gw, &id)?;
    let status = match &e.life {
        Life::Running { .. } => StatusCode::OK,
        Life::Paused { snapshot } => {
            let _busy = gw.app.claim(&format!("e2b:{id}"), "resume")?;
            // Another request may have resumed it meanwhile.
            let e = known(&gw, &id)?;
            if let Life::Paused { .. } = e.life {
                let snapshot = snapshot.clone();
                let policy = e.network.as_ref().map(network::policy).transpose()?;
                // A resume makes a sandbox: it waits its turn as a create does.
                let ticket = gw
                    .app
                    .admission
                    .admit_request(&gw.app, &key.0, &headers, 1, &Limits::default())
                    .await?;
                let prepared = gw.warm.take(&gw.app, &id, &snapshot);
                let rec = gw
                    .app
                    .engine(move |en| {
                        // Into the sandbox prepared at the pause where there
                        // is one; the ordinary way if not, or if it failed.
                        let warm = prepared.map(|p| en.finish_restore(p)).and_then(|r| {
                            r.inspect_err(|e| tracing::warn!("e2b: resuming into the prepared sandbox: {e}"))
                                .ok()
                        });
                        let rec = match warm {
                            Some(rec) => rec,
                            None => {
                                let snap = en.snapshot_record(&snapshot)?;
                                en.restore(
                                    &snap,
                                    &CreateOptions {
                                        network: policy,
                                        ..CreateOptions::default()
                                    },
                                )?
                            }
                        };
                        // After a files-only pause the server starts again;
                        // after a memory one it answers at once. Either way
                        // the first run_code finds it listening. A server
                        // that does not start is the sandbox's own affair:
                        // the resume stands, and run_code says what is wrong.
                        if serves_interpreter(&rec) {
                            if let Err(why) = wait_for_interpreter(en, &rec) {
                                tracing::warn!(sandbox = %rec.id, "resumed E2B sandbox: {why}");
                            }
                        }
                        Ok(rec)
                    })
                    .await?;
                ticket.made([&rec]);
                let running = Life::Running {
                    sandbox: rec.id.clone(),
                };
                gw.modify(&id, |e| e.life = running).await?;
                // Jobs that ran on in the memory image are followed again.
                gw.refollow(&id);
                gw.app
                    .emit("sandbox.created", &rec.id, format!("resumed E2B sandbox {id}"));
            }
            StatusCode::CREATED
        }
    };
    let entry = gw
        .modify(&id, |e| {
            e.end_at = e.end_at.max(now_ms() + ms);
            e.grant = Some(key.0);
        })
        .await?;
    let entry = entry.ok_or_else(|| RestError::not_found(&id))?;
    Ok((status, Json(sandbox_json(&gw, &entry))).into_response())
}

#[derive(Deserialize)]
pub struct SnapshotBody {
    name: Option<String>,
}

/// `POST /sandboxes/{id}/snapshots`: the sandbox keeps running; the
/// snapshot id works as a template.
pub async fn create_snapshot(State(gw): G, Path(id): Path<String>, body: Bytes) -> Rest<Response> {
    let req: SnapshotBody = parse(&body)?;
    if let Some(n) = &req.name {
        if n.is_empty() || n.len() > 128 || !n.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
            return Err(RestError::bad_request(
                "a snapshot name is 1 to 128 letters, digits, '-', '_' or '.'",
            ));
        }
    }
    let e = known(&gw, &id)?;
    let sandbox = e
        .running()
        .ok_or_else(|| {
            RestError::new(
                StatusCode::CONFLICT,
                format!("sandbox {id} is paused; connect to it first"),
            )
        })?
        .to_string();
    let _busy = gw.app.claim(&format!("e2b:{id}"), "snapshot")?;
    check_memory_snapshot(&gw, &id, &sandbox, "snapshot").await?;
    let held = gw.hold_followers(&id);
    let snap = gw
        .app
        .engine(move |en| {
            let rec = en.sandbox(&sandbox)?;
            Ok(en.snapshot(&rec, None)?)
        })
        .await;
    drop(held);
    let snap = snap?;
    let name = req.name.unwrap_or_else(|| snap.id.clone());
    let out = json!({ "snapshotID": snap.id, "names": [name] });
    let record = E2bSnapshot {
        id: snap.id.clone(),
        name,
        e2b_id: id.clone(),
        created_at: now_ms(),
    };
    gw.app.engine(move |en| Ok(en.insert_e2b_snapshot(&record)?)).await?;
    gw.app
        .emit("snapshot.created", &snap.id, format!("of E2B sandbox {id}"));
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

#[derive(Deserialize)]
pub struct SnapshotQuery {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
    name: Option<String>,
    limit: Option<i64>,
    #[serde(rename = "nextToken")]
    next_token: Option<String>,
}

/// `GET /snapshots`: the snapshots made through `create_snapshot`.
pub async fn snapshots(
    State(gw): G,
    q: Result<Query<SnapshotQuery>, axum::extract::rejection::QueryRejection>,
) -> Rest<Response> {
    let Query(q) = q.map_err(|e| RestError::bad_request(e.body_text()))?;
    let limit = page::limit(q.limit)?;
    let after = page::Cursor::parse(q.next_token.as_deref())?;
    let all = gw.app.engine(|en| Ok(en.e2b_snapshots()?)).await?;
    let mine = crate::tenancy::owned(&gw.app, cairn_engine::tenants::Owned::Snapshot).await?;
    let found: Vec<E2bSnapshot> = all
        .into_iter()
        .filter(|s| mine.as_ref().is_none_or(|m| m.contains(&s.id)))
        .filter(|s| q.sandbox_id.as_ref().is_none_or(|id| &s.e2b_id == id))
        .filter(|s| q.name.as_ref().is_none_or(|n| &s.name == n))
        .collect();
    let (found, next) = page::page(
        found,
        |s| (s.created_at, s.id.as_str()),
        page::Order::Desc,
        limit,
        after.as_ref(),
    );
    paged(
        found
            .iter()
            .map(|s| json!({ "snapshotID": s.id, "names": [s.name] }))
            .collect(),
        next,
    )
}

/// `DELETE /templates/{id}`: deletes a template built through the
/// template API (by id or name) or a snapshot made through
/// `create_snapshot`; 404 for anything else.
pub async fn delete_snapshot(State(gw): G, Path(id): Path<String>) -> Rest<StatusCode> {
    if templates::delete(&gw, &id).await? {
        return Ok(StatusCode::NO_CONTENT);
    }
    let key = id.clone();
    let mine = crate::tenancy::owned(&gw.app, cairn_engine::tenants::Owned::Snapshot).await?;
    let known = gw
        .app
        .engine(move |en| Ok(en.e2b_snapshots()?.iter().any(|s| s.id == key)))
        .await?
        && mine.is_none_or(|m| m.contains(&id));
    if !known {
        return Err(RestError::new(
            StatusCode::NOT_FOUND,
            format!("snapshot {id:?} not found"),
        ));
    }
    let key = id.clone();
    gw.app
        .engine(move |en| {
            let snap = en.snapshot_record(&key)?;
            Ok(en.remove_snapshot(&snap)?)
        })
        .await?;
    let key = id.clone();
    gw.app.engine(move |en| Ok(en.delete_e2b_snapshot(&key)?)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
pub struct ForkBody {
    timeout: Option<u64>,
    count: Option<usize>,
}

/// `POST /sandboxes/{id}/fork`: snapshots the sandbox (which keeps
/// running) and starts `count` sandboxes from it, each with its own id and
/// token and the parent's template, metadata and environment.
pub async fn fork(
    State(gw): G,
    Extension(key): Extension<ApiKey>,
    Path(id): Path<String>,
    body: Bytes,
) -> Rest<Response> {
    let req: ForkBody = parse(&body)?;
    let count = req.count.unwrap_or(1);
    if !(1..=20).contains(&count) {
        return Err(RestError::bad_request(format!("count must be 1 to 20, got {count}")));
    }
    let ms = timeout_ms(req.timeout)?;
    let parent = known(&gw, &id)?;
    let sandbox = parent
        .running()
        .ok_or_else(|| {
            RestError::new(
                StatusCode::CONFLICT,
                format!("sandbox {id} is paused; connect to it first"),
            )
        })?
        .to_string();
    let _busy = gw.app.claim(&format!("e2b:{id}"), "fork")?;
    check_memory_snapshot(&gw, &id, &sandbox, "fork").await?;
    let held = gw.hold_followers(&id);
    let forked = gw
        .app
        .engine(move |en| Ok(en.fork(&sandbox, count, &CreateOptions::default())?))
        .await;
    drop(held);
    let (_, forks) = forked?;
    let mut out = Vec::with_capacity(forks.len());
    let mut entries = Vec::with_capacity(forks.len());
    for rec in &forks {
        let mut e = entry_for(rec, parent.template.clone(), ms, &key);
        e.metadata = parent.metadata.clone();
        e.env = parent.env.clone();
        e.workdir = parent.workdir.clone();
        e.auto_pause = parent.auto_pause;
        // The engine's fork keeps the parent's network and rules.
        e.network = parent.network.clone();
        e.public_traffic = parent.public_traffic;
        e.tenant = parent.tenant.clone();
        out.push(json!({ "sandbox": sandbox_json(&gw, &e) }));
        entries.push(e);
        gw.app.emit("sandbox.created", &rec.id, format!("E2B fork of {id}"));
    }
    for e in entries {
        gw.put(e).await?;
    }
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

/// Ends sandboxes whose timeout passed, once a second: removed, or paused
/// when created with `autoPause`, as E2B does.
pub(crate) fn spawn_reaper(gw: Arc<Gateway>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
        loop {
            tick.tick().await;
            let now = now_ms();
            let due: Vec<(String, bool)> = {
                gw.entries()
                    .iter()
                    .filter(|e| e.running().is_some() && e.end_at <= now)
                    .map(|e| (e.id.clone(), e.auto_pause))
                    .collect()
            };
            for (id, auto_pause) in due {
                let r = if auto_pause {
                    pause_entry(&gw, &id).await.map(drop)
                } else {
                    kill_entry(&gw, &id).await
                };
                match r {
                    Ok(()) => tracing::info!(sandbox = id, auto_pause, "e2b: sandbox timed out"),
                    // Busy, or (gVisor) a command with stdin holds a
                    // connection: the next tick tries again.
                    Err(e)
                        if e.status == StatusCode::CONFLICT || (auto_pause && e.status == StatusCode::BAD_REQUEST) =>
                    {
                        tracing::debug!(sandbox = id, "e2b: timed out, not ended yet: {}", e.message)
                    }
                    Err(e) => tracing::warn!(sandbox = id, "e2b: ending a timed-out sandbox: {}", e.message),
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_796_060_312_048), "2026-11-30T17:38:32.048Z");
    }

    #[test]
    fn metadata_queries_are_decoded_twice() {
        assert_eq!(unquote("a%2520b").and_then(|s| unquote(&s)).as_deref(), Some("a b"));
        assert_eq!(unquote("%zz"), None);
        assert_eq!(unquote("%"), None);
    }
}
