//! E2B's template API (`Template().build(...)` in the SDK): a build is
//! requested (`POST /v3/templates`), the files its `copy` steps name are
//! uploaded once by hash, the steps are sent (`POST
//! /v2/templates/{id}/builds/{build}`) and run in the background by
//! [`Engine::build_image`], and the SDK polls the status and log until the
//! build is ready or failed. A ready build is a Cairn image; its tags
//! (`name:tag`, `default` without one) are what `Sandbox.create(name)`
//! starts. Bases: `e2bdev/base` (Cairn's `base`), `debian:SUITE` (built
//! from Debian's packages on first use), a Cairn image, or another
//! template; registry images are refused naming these.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cairn_engine::build::{Base, BuildLog, ImageConfig, Plan, Step};
use cairn_engine::state::e2b_templates::{BuildFailure, BuildLogLine, BuildStatus, TemplateBuild, DEFAULT_TAG};
use cairn_engine::{Engine, Silent};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use super::control::rfc3339;
use super::template_book::E2bTemplateBook;
use super::{Gateway, RestError};
use crate::app::now_ms;

type G = State<Arc<Gateway>>;
type Rest<T> = Result<T, RestError>;

/// The most log lines one status answer carries (the SDK asks for 100).
const STATUS_LINES_MAX: usize = 100;
/// The most log lines a build keeps; later ones replace the oldest.
const LOG_LINES_MAX: usize = 10_000;
/// How long one build command may run.
const STEP_TIMEOUT: Duration = Duration::from_secs(3600);
/// Run on every template's base before its steps, as E2B provisions its
/// templates: E2B's user `user` (uid and gid 1000, home /home/user) where
/// the base has none, so `set_user("user")` (which `from_dockerfile` ends
/// with) holds on any base.
const E2B_USER: &str = "grep -q '^user:' /etc/passwd || { \
    grep -q '^user:' /etc/group || echo 'user:x:1000:' >> /etc/group; \
    shell=/bin/sh; [ -x /bin/bash ] && shell=/bin/bash; \
    echo \"user:x:1000:1000::/home/user:$shell\" >> /etc/passwd; \
    mkdir -p /home/user && chown 1000:1000 /home/user && chmod 755 /home/user; }";
/// How long a template's ready command may take once its start command ran.
pub(crate) const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Whether a ready command only waits (`sleep N`, what the SDK's
/// `wait_for_timeout` and `from_dockerfile`'s CMD give): it is awaited when
/// the template is built, not again by every create, where it would only
/// add its seconds.
pub(crate) fn only_waits(ready: &str) -> bool {
    ready
        .trim()
        .strip_prefix("sleep ")
        .is_some_and(|n| n.trim().parse::<f64>().is_ok_and(|s| s >= 0.0))
}

/// The logs of the builds running now (a finished build's are in its row).
#[derive(Default)]
pub(crate) struct Builds {
    running: Mutex<HashMap<String, Arc<Log>>>,
}

#[derive(Default)]
struct Log {
    lines: Mutex<Vec<BuildLogLine>>,
}

impl BuildLog for Log {
    fn log(&self, step: Option<usize>, level: &str, message: &str) {
        let mut lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        if lines.len() >= LOG_LINES_MAX {
            lines.remove(0);
        }
        lines.push(BuildLogLine {
            at: now_ms(),
            level: level.to_string(),
            message: message.to_string(),
            step,
        });
    }
}

/// A template name as the SDK sends it: `name` or `name:tag`.
fn split_name(full: &str) -> Rest<(String, Option<String>)> {
    let (name, tag) = match full.split_once(':') {
        Some((n, t)) => (n, Some(t)),
        None => (full, None),
    };
    check_name(name)?;
    if let Some(t) = tag {
        check_tag(t)?;
    }
    Ok((name.to_string(), tag.map(str::to_string)))
}

fn check_name(name: &str) -> Rest<()> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_./".contains(&b))
        && name.as_bytes()[0].is_ascii_alphanumeric();
    if ok {
        Ok(())
    } else {
        Err(RestError::bad_request(format!(
            "template name {name:?}: use 1 to 128 lowercase letters, digits, '-', '_', '.' or '/', starting with a \
             letter or digit"
        )))
    }
}

fn check_tag(tag: &str) -> Rest<()> {
    if !tag.is_empty() && tag.len() <= 64 && tag.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) {
        Ok(())
    } else {
        Err(RestError::bad_request(format!(
            "tag {tag:?}: use 1 to 64 letters, digits, '-', '_' or '.'"
        )))
    }
}

/// The Cairn image a build of template `id` makes.
fn image_name(template_id: &str, build_id: &str) -> String {
    format!("e2b-{template_id}-{}", &build_id[..8])
}

/// Where uploaded build files are kept, by the SDK's hash of them.
fn files_dir(gw: &Gateway) -> PathBuf {
    gw.app.home.root().join("e2b-template-files")
}

fn check_hash(hash: &str) -> Rest<()> {
    if hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err(RestError::bad_request(format!(
            "files hash {hash:?} is not 64 hex digits"
        )))
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildRequest {
    name: Option<String>,
    alias: Option<String>,
    tags: Option<Vec<String>>,
    #[serde(rename = "cpuCount")]
    cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    memory_mb: Option<u64>,
    #[serde(rename = "teamID")]
    _team_id: Option<String>,
    #[serde(rename = "minFreeDiskMb")]
    _min_free_disk_mb: Option<u64>,
}

/// `POST /v3/templates`: a new build of the template named (made if new).
pub async fn request_build(State(gw): G, body: Bytes) -> Rest<Response> {
    let req: BuildRequest = crate::routes::parse(&body).map_err(RestError::from)?;
    let full = req
        .name
        .or(req.alias)
        .ok_or_else(|| RestError::bad_request("a template build needs a name"))?;
    let (name, tag) = split_name(&full)?;
    if name == "base" {
        return Err(RestError::bad_request(
            "\"base\" is Cairn's default template and cannot be rebuilt; choose another name",
        ));
    }
    if req.cpu_count.is_some_and(|c| !(1..=64).contains(&c))
        || req.memory_mb.is_some_and(|m| !(128..=1 << 20).contains(&m))
    {
        return Err(RestError::bad_request(
            "cpuCount must be 1 to 64 and memoryMB 128 to 1048576",
        ));
    }
    let mut tags = vec![tag.unwrap_or_else(|| DEFAULT_TAG.to_string())];
    for t in req.tags.unwrap_or_default() {
        check_tag(&t)?;
        if !tags.contains(&t) {
            tags.push(t);
        }
    }
    if tags.len() > 32 {
        return Err(RestError::bad_request("at most 32 tags"));
    }
    let build_id = uuid();
    let new_id = cairn_engine::random_hex(10);
    let (b, t) = (build_id.clone(), tags.clone());
    let template = gw
        .app
        .engine(move |e| Ok(e.start_e2b_template_build(&name, &new_id, &b, &t)?))
        .await?;
    let out = json!({
        "templateID": template.id,
        "buildID": build_id,
        "public": false,
        "names": [template.name],
        "aliases": [template.name],
        "tags": tags,
    });
    Ok((StatusCode::ACCEPTED, Json(out)).into_response())
}

/// The template a path names, by id or name, to change it: a tenant
/// changes only its own (the administrator's it may only start sandboxes
/// from), and another's answers as an absent one.
async fn template_to_change(gw: &Arc<Gateway>, key: &str) -> Rest<cairn_engine::state::e2b_templates::E2bTemplate> {
    let t = template_of(gw, key).await?;
    match crate::tenancy::current() {
        Some(tenant) if t.tenant.as_deref() != Some(tenant.as_str()) => {
            let key = key.split_once(':').map_or(key, |(n, _)| n);
            Err(RestError::new(
                StatusCode::NOT_FOUND,
                format!("template {key:?} not found"),
            ))
        }
        _ => Ok(t),
    }
}

/// The template a path names, by id or name (one the caller's tenant may
/// see: its own and the administrator's).
async fn template_of(gw: &Arc<Gateway>, key: &str) -> Rest<cairn_engine::state::e2b_templates::E2bTemplate> {
    let key = key.split_once(':').map_or(key, |(n, _)| n).to_string();
    let k = key.clone();
    gw.app
        .engine(move |e| Ok(e.e2b_template(&k)?))
        .await?
        .ok_or_else(|| RestError::new(StatusCode::NOT_FOUND, format!("template {key:?} not found")))
}

/// `GET /templates/{id}/files/{hash}`: whether the files are here, else
/// where to upload them (this server, with the caller's own key).
pub async fn file_link(State(gw): G, Path((id, hash)): Path<(String, String)>, headers: HeaderMap) -> Rest<Response> {
    check_hash(&hash)?;
    template_to_change(&gw, &id).await?;
    if touch(&files_dir(&gw).join(&hash)) {
        return Ok((StatusCode::CREATED, Json(json!({ "present": true }))).into_response());
    }
    let host = headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .ok_or_else(|| RestError::bad_request("a Host header is needed to say where to upload"))?;
    let key = headers
        .get("x-api-key")
        .and_then(|h| h.to_str().ok())
        .unwrap_or_default();
    let out = json!({
        "present": false,
        "url": format!("http://{host}/templates/{id}/files/{hash}"),
        "headers": { "X-API-Key": key },
    });
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

/// `PUT /templates/{id}/files/{hash}`: the files (a tar archive) kept by
/// hash, written whole or not at all, at most `--max-upload` bytes.
pub async fn upload(State(gw): G, Path((id, hash)): Path<(String, String)>, body: Body) -> Rest<StatusCode> {
    check_hash(&hash)?;
    template_to_change(&gw, &id).await?;
    let dir = files_dir(&gw);
    let limit = gw.app.settings.max_upload;
    let mut stream = body.into_data_stream();
    let d = dir.clone();
    let mut tmp = tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&d)?;
        tempfile::NamedTempFile::new_in(&d)
    })
    .await
    .map_err(|e| RestError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
    .map_err(|e| {
        RestError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot keep the upload: {e}"),
        )
    })?;
    let mut size = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| RestError::bad_request(format!("the upload broke off: {e}")))?;
        size += chunk.len() as u64;
        if size > limit {
            return Err(RestError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the build files are larger than this server's --max-upload ({limit} bytes)"),
            ));
        }
        tmp.write_all(&chunk).map_err(|e| {
            RestError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("cannot keep the upload: {e}"),
            )
        })?;
    }
    let at = dir.join(&hash);
    tokio::task::spawn_blocking(move || {
        tmp.as_file().sync_all()?;
        tmp.persist(&at).map(|_| ()).map_err(|e| e.error)
    })
    .await
    .map_err(|e| RestError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
    .map_err(|e| {
        RestError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot keep the upload: {e}"),
        )
    })?;
    Ok(StatusCode::CREATED)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StepBody {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    args: Vec<String>,
    files_hash: Option<String>,
    #[serde(default)]
    _force: Option<bool>,
    #[serde(default)]
    _force_upload: Option<bool>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StartBody {
    from_image: Option<String>,
    from_template: Option<String>,
    from_image_registry: Option<Value>,
    #[serde(default)]
    _force: Option<bool>,
    #[serde(default)]
    steps: Vec<StepBody>,
    start_cmd: Option<String>,
    ready_cmd: Option<String>,
}

/// What a template base is in Cairn; an error naming what is supported.
async fn base_of(gw: &Arc<Gateway>, body: &StartBody) -> Rest<(Base, ImageConfig, Option<String>)> {
    if body.from_image_registry.is_some() {
        return Err(RestError::bad_request(
            "registry credentials: Cairn builds templates from e2bdev/base, debian:SUITE, a Cairn image or another \
             template, and pulls from no registry",
        ));
    }
    match (&body.from_image, &body.from_template) {
        (Some(_), Some(_)) | (None, None) => {
            Err(RestError::bad_request("give exactly one of fromImage and fromTemplate"))
        }
        (None, Some(t)) => {
            let t = t.clone();
            let resolved = resolve(gw, &t).await?;
            match resolved {
                Some((image, config)) => Ok((Base::Image(Some(image)), config, None)),
                None if t == "base" => Ok((Base::Image(super::base::image(gw).await?), ImageConfig::default(), None)),
                None => {
                    // A Cairn image, else a snapshot (of a native sandbox:
                    // its files; a build keeps no memory).
                    let key = t.clone();
                    let (image, snapshot) = gw
                        .app
                        .engine(move |e| {
                            Ok((
                                e.image(&key).is_ok(),
                                e.snapshot_record(&key).ok().map(|s| (s.id, s.driver)),
                            ))
                        })
                        .await?;
                    match (image, snapshot) {
                        (true, _) => Ok((Base::Image(Some(t)), ImageConfig::default(), None)),
                        (false, Some((id, driver))) if driver == "native" => {
                            Ok((Base::Snapshot(id), ImageConfig::default(), None))
                        }
                        (false, Some((id, driver))) => Err(RestError::bad_request(format!(
                            "snapshot {id} was taken on the {driver} driver; templates build from native snapshots,                              images and other templates"
                        ))),
                        (false, None) => Err(RestError::bad_request(format!(
                            "template {t:?} not found: build it first, or name a Cairn image (`cairn image ls`) or a                              snapshot"
                        ))),
                    }
                }
            }
        }
        (Some(image), None) => {
            let image = image.trim();
            if image == "e2bdev/base" || image.starts_with("e2bdev/base:") || image == "base" {
                return Ok((Base::Image(super::base::image(gw).await?), ImageConfig::default(), None));
            }
            let debian = image.strip_prefix("debian:").or((image == "debian").then_some(""));
            if let Some(tag) = debian {
                let suite = cairn_engine::images::debian_suite(tag)
                    .ok_or_else(|| RestError::bad_request(format!("{image:?}: not a Debian suite")))?;
                let name = format!("debian-{suite}");
                return Ok((
                    Base::Image(Some(name.clone())),
                    ImageConfig::default(),
                    Some(suite.to_string()),
                ));
            }
            let key = image.to_string();
            let exists = gw.app.engine(move |e| Ok(e.image(&key).is_ok())).await?;
            if exists {
                return Ok((Base::Image(Some(image.to_string())), ImageConfig::default(), None));
            }
            Err(RestError::bad_request(format!(
                "image {image:?} is not available: Cairn pulls from no registry; build from e2bdev/base \
                 (from_base_image), debian:SUITE (from_debian_image, built from Debian's packages), a Cairn image \
                 (`cairn image ls`) or another template (from_template)"
            )))
        }
    }
}

/// The steps the SDK sent, as Cairn's; an error naming the first bad one.
fn steps_of(gw: &Gateway, body: &[StepBody]) -> Rest<Vec<Step>> {
    let dir = files_dir(gw);
    let mut steps = Vec::new();
    for (i, s) in body.iter().enumerate() {
        let n = i + 1;
        let bad = |why: &str| RestError::bad_request(format!("step {n} ({} {:?}): {why}", s.kind, s.args));
        let arg = |k: usize| s.args.get(k).filter(|a| !a.is_empty()).cloned();
        let step = match s.kind.as_str() {
            "RUN" => Step::Run {
                command: arg(0).ok_or_else(|| bad("no command"))?,
                user: arg(1),
            },
            "COPY" | "ADD" => {
                let hash = s.files_hash.clone().ok_or_else(|| bad("no filesHash"))?;
                check_hash(&hash)?;
                let archive = dir.join(&hash);
                if !touch(&archive) {
                    return Err(bad("its files were not uploaded"));
                }
                let mode = match arg(3) {
                    None => None,
                    Some(m) => Some(
                        u32::from_str_radix(&m, 8)
                            .ok()
                            .filter(|m| *m <= 0o7777)
                            .ok_or_else(|| bad("the mode is not octal"))?,
                    ),
                };
                Step::Copy {
                    archive,
                    src: arg(0).ok_or_else(|| bad("no source"))?,
                    dest: arg(1).ok_or_else(|| bad("no destination"))?,
                    user: arg(2),
                    mode,
                }
            }
            "ENV" => {
                if s.args.len() % 2 != 0 {
                    return Err(bad("names and values come in pairs"));
                }
                Step::Env(s.args.chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect())
            }
            "WORKDIR" => Step::Workdir(arg(0).ok_or_else(|| bad("no directory"))?),
            "USER" => Step::User(arg(0).ok_or_else(|| bad("no user"))?),
            other => {
                return Err(RestError::bad_request(format!(
                    "step {n}: {other} is not supported; Cairn runs RUN, COPY, ENV, WORKDIR and USER"
                )))
            }
        };
        steps.push(step);
    }
    Ok(steps)
}

/// `POST /v2/templates/{id}/builds/{build}`: checks the steps and starts
/// the build in the background.
pub async fn start_build(State(gw): G, Path((id, build_id)): Path<(String, String)>, body: Bytes) -> Rest<StatusCode> {
    let body: StartBody = crate::routes::parse(&body).map_err(RestError::from)?;
    let template = template_to_change(&gw, &id).await?;
    let b = build_id.clone();
    let build = gw
        .app
        .engine(move |e| Ok(e.e2b_template_build(&b)?))
        .await?
        .filter(|b| b.template_id == template.id)
        .ok_or_else(|| RestError::new(StatusCode::NOT_FOUND, format!("build {build_id:?} of {id:?} not found")))?;
    if body.steps.len() > 1000 {
        return Err(RestError::bad_request("at most 1000 steps"));
    }
    for cmd in [&body.start_cmd, &body.ready_cmd].into_iter().flatten() {
        if cmd.len() > 64 << 10 || cmd.contains('\0') {
            return Err(RestError::bad_request(
                "a start or ready command is at most 64 KiB, without NUL",
            ));
        }
    }
    let steps = steps_of(&gw, &body.steps)?;
    let (base, mut config, debian) = base_of(&gw, &body).await?;
    if body.start_cmd.is_some() {
        config.start_cmd = body.start_cmd.clone();
        config.ready_cmd = body.ready_cmd.clone();
    } else if body.ready_cmd.is_some() {
        config.ready_cmd = body.ready_cmd.clone();
    }
    let network = if gw.egress {
        Some(
            cairn_sandbox::net::NetPolicy::parse(Some("egress"), &[], &[])
                .map_err(|e| RestError::bad_request(e.to_string()))?,
        )
    } else {
        None
    };
    let plan = Plan {
        base,
        config,
        steps,
        network,
        step_timeout: STEP_TIMEOUT,
        ready_timeout: READY_TIMEOUT,
        setup: Some(E2B_USER.to_string()),
    };
    let b = build.id.clone();
    if !gw.app.engine(move |e| Ok(e.claim_e2b_template_build(&b)?)).await? {
        return Err(RestError::new(
            StatusCode::CONFLICT,
            format!("build {} was started already; request a new build", build.id),
        ));
    }
    let log = Arc::new(Log::default());
    gw.builds
        .running
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(build.id.clone(), Arc::clone(&log));
    let name = template.name.clone();
    let key = build.id.clone();
    let gw2 = Arc::clone(&gw);
    // The build goes on after this answer, for the same tenant: its image
    // and sandbox are the template's owner's.
    let tenant = template.tenant.clone();
    tokio::spawn(crate::tenancy::acting(tenant, async move {
        let image = image_name(&build.template_id, &build.id);
        let source = format!("E2B template {name} (build {})", build.id);
        let sandbox_name = build_sandbox(&build.id);
        let l = Arc::clone(&log);
        let outcome = gw2
            .app
            .engine(move |e| {
                if let Some(suite) = &debian {
                    if let Err(f) = ensure_debian(e, suite, &*l) {
                        return Ok(Err(f));
                    }
                }
                Ok(e.build_image(&image, source, &sandbox_name, &plan, &*l))
            })
            .await
            .unwrap_or_else(|e| {
                Err(BuildFailure {
                    message: e.message,
                    step: Some(0),
                })
            });
        let lines = log.lines.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let finished = gw2
            .app
            .engine(move |e| {
                let result = match &outcome {
                    Ok((rec, config)) => Ok((rec.name.as_str(), config)),
                    Err(f) => Err(f),
                };
                Ok(e.finish_e2b_template_build(&build, result, &lines)?)
            })
            .await;
        if let Err(e) = finished {
            tracing::error!("e2b: cannot record the end of a template build: {}", e.message);
        }
        let idle = {
            let mut running = gw2.builds.running.lock().unwrap_or_else(|e| e.into_inner());
            running.remove(&key);
            running.is_empty()
        };
        // Only while no build runs: a long one may copy its files late.
        if idle {
            let dir = files_dir(&gw2);
            let _ = tokio::task::spawn_blocking(move || prune(&dir)).await;
        }
    }));
    Ok(StatusCode::ACCEPTED)
}

/// How long uploaded build files are kept unused: the SDK uploads again
/// what is gone.
const FILES_KEPT: Duration = Duration::from_secs(24 * 3600);

/// Marks a kept upload as used now; whether it is there.
fn touch(path: &std::path::Path) -> bool {
    std::fs::File::options()
        .append(true)
        .open(path)
        .and_then(|f| f.set_modified(std::time::SystemTime::now()))
        .is_ok()
}

/// Removes the uploads no build used for [`FILES_KEPT`].
fn prune(dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let stale = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > FILES_KEPT);
        if stale {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Debian `suite`'s image, built from Debian's packages unless it exists:
/// the first build from a Debian base takes minutes, later ones none.
fn ensure_debian(e: &mut Engine, suite: &str, log: &dyn BuildLog) -> Result<(), BuildFailure> {
    if e.image(&format!("debian-{suite}")).is_err() {
        log.log(
            Some(0),
            "info",
            &format!("building debian-{suite} from Debian's packages (once; later builds reuse it)"),
        );
    }
    e.debian_image(suite, &Silent).map(drop).map_err(|err| BuildFailure {
        message: format!("cannot build Debian {suite}: {err}"),
        step: Some(0),
    })
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusQuery {
    logs_offset: Option<usize>,
    limit: Option<usize>,
    level: Option<String>,
}

fn entry_json(l: &BuildLogLine) -> Value {
    let mut v = json!({ "timestamp": rfc3339(l.at), "level": l.level, "message": l.message });
    if let Some(s) = l.step {
        v["step"] = json!(s.to_string());
    }
    v
}

/// `GET /templates/{id}/builds/{build}/status`: where the build is, and
/// its log from `logsOffset` (at most 100 lines).
pub async fn status(
    State(gw): G,
    Path((id, build_id)): Path<(String, String)>,
    q: Result<Query<StatusQuery>, axum::extract::rejection::QueryRejection>,
) -> Rest<Response> {
    let Query(q) = q.map_err(|e| RestError::bad_request(e.body_text()))?;
    let template = template_of(&gw, &id).await?;
    let b = build_id.clone();
    let build: TemplateBuild = gw
        .app
        .engine(move |e| Ok(e.e2b_template_build(&b)?))
        .await?
        .filter(|b| b.template_id == template.id)
        .ok_or_else(|| RestError::new(StatusCode::NOT_FOUND, format!("build {build_id:?} of {id:?} not found")))?;
    let running = gw
        .builds
        .running
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&build.id)
        .cloned();
    // A running build's status is read before its log, so a build that
    // finishes in between answers "building" with its whole log, never
    // "ready" with lines missing.
    let (status, lines) = match (&running, build.status) {
        (Some(log), BuildStatus::Building | BuildStatus::Waiting) => (
            build.status,
            log.lines.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        ),
        _ => (build.status, build.logs.clone()),
    };
    let level = q.level.as_deref();
    let rank = |l: &str| {
        ["debug", "info", "warn", "error"]
            .iter()
            .position(|x| *x == l)
            .unwrap_or(1)
    };
    let wanted: Vec<&BuildLogLine> = lines
        .iter()
        .filter(|l| level.is_none_or(|min| rank(&l.level) >= rank(min)))
        .collect();
    let limit = q.limit.unwrap_or(STATUS_LINES_MAX).clamp(0, STATUS_LINES_MAX);
    let from = q.logs_offset.unwrap_or(0).min(wanted.len());
    let page: Vec<&BuildLogLine> = wanted[from..].iter().take(limit).copied().collect();
    let mut out = json!({
        "templateID": template.id,
        "buildID": build.id,
        "status": status.as_str(),
        "logs": page.iter().map(|l| format!("[{}] {}", rfc3339(l.at), l.message)).collect::<Vec<_>>(),
        "logEntries": page.iter().map(|l| entry_json(l)).collect::<Vec<_>>(),
    });
    if let Some(r) = &build.reason {
        let mut reason = json!({ "message": r.message });
        // The SDK's names: `base` for the base, else the step's number
        // (the start command's is one past the last step).
        if let Some(s) = r.step {
            reason["step"] = json!(if s == 0 { "base".to_string() } else { s.to_string() });
        }
        out["reason"] = reason;
    }
    Ok(Json(out).into_response())
}

/// The image and config of a ready template build `key` names (`name`,
/// `name:tag`, or a template id with either); `None` when it names none.
pub(crate) async fn resolve(gw: &Arc<Gateway>, key: &str) -> Rest<Option<(String, ImageConfig)>> {
    let (name, tag) = match key.split_once(':') {
        Some((n, t)) => (n.to_string(), t.to_string()),
        None => (key.to_string(), DEFAULT_TAG.to_string()),
    };
    gw.app
        .engine(move |e| {
            let Some(t) = e.e2b_template(&name)? else {
                return Ok(None);
            };
            let Some(tagged) = e.e2b_template_tags(&t.id)?.into_iter().find(|x| x.tag == tag) else {
                return Ok(None);
            };
            Ok(e.e2b_template_build(&tagged.build_id)?
                .and_then(|b| Some((b.image?, b.config.unwrap_or_default()))))
        })
        .await
        .map_err(RestError::from)
}

/// `GET /templates/aliases/{alias}`: 200 when a template has that name.
pub async fn alias(State(gw): G, Path(alias): Path<String>) -> Rest<Response> {
    let t = template_of(&gw, &alias).await?;
    Ok(Json(json!({ "templateID": t.id, "public": false })).into_response())
}

#[derive(Deserialize)]
pub struct AssignBody {
    target: String,
    tags: Vec<String>,
}

/// `POST /templates/tags`: tags `target` (`name:tag`)'s build with `tags`.
pub async fn assign_tags(State(gw): G, body: Bytes) -> Rest<Response> {
    let body: AssignBody = crate::routes::parse(&body).map_err(RestError::from)?;
    let (name, tag) = split_name(&body.target)?;
    if body.tags.is_empty() || body.tags.len() > 32 {
        return Err(RestError::bad_request("give 1 to 32 tags"));
    }
    for t in &body.tags {
        check_tag(t)?;
    }
    let template = template_to_change(&gw, &name).await?;
    let tag = tag.unwrap_or_else(|| DEFAULT_TAG.to_string());
    let tid = template.id.clone();
    let tags = body.tags.clone();
    let build = gw
        .app
        .engine(move |e| {
            let Some(found) = e.e2b_template_tags(&tid)?.into_iter().find(|x| x.tag == tag) else {
                return Ok(None);
            };
            e.tag_e2b_template_build(&tid, &found.build_id, &tags)?;
            Ok(Some(found.build_id))
        })
        .await?
        .ok_or_else(|| RestError::new(StatusCode::NOT_FOUND, format!("{:?} names no build", body.target)))?;
    Ok((
        StatusCode::CREATED,
        Json(json!({ "buildID": build, "tags": body.tags })),
    )
        .into_response())
}

#[derive(Deserialize)]
pub struct RemoveTagsBody {
    name: String,
    tags: Vec<String>,
}

/// `DELETE /templates/tags`: removes tags of a template.
pub async fn remove_tags(State(gw): G, body: Bytes) -> Rest<StatusCode> {
    let body: RemoveTagsBody = crate::routes::parse(&body).map_err(RestError::from)?;
    let (name, _) = split_name(&body.name)?;
    for t in &body.tags {
        check_tag(t)?;
    }
    let template = template_to_change(&gw, &name).await?;
    let tags = body.tags.clone();
    let removed = gw
        .app
        .engine(move |e| Ok(e.untag_e2b_template(&template.id, &tags)?))
        .await?;
    if removed == 0 {
        return Err(RestError::new(
            StatusCode::NOT_FOUND,
            format!("template {name:?} has none of the tags {:?}", body.tags),
        ));
    }
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /templates/{id}/tags`.
pub async fn tags(State(gw): G, Path(id): Path<String>) -> Rest<Response> {
    let template = template_of(&gw, &id).await?;
    let tags = gw.app.engine(move |e| Ok(e.e2b_template_tags(&template.id)?)).await?;
    Ok(Json(
        tags.iter()
            .map(|t| json!({ "tag": t.tag, "buildID": t.build_id, "createdAt": rfc3339(t.created_at) }))
            .collect::<Vec<_>>(),
    )
    .into_response())
}

/// Deletes the template `key` names, if one does: its builds' images go
/// (a running sandbox keeps its layers). `false` when none is named.
pub(crate) async fn delete(gw: &Arc<Gateway>, key: &str) -> Rest<bool> {
    let Ok(t) = template_to_change(gw, key).await else {
        return Ok(false);
    };
    gw.app.engine(move |e| Ok(e.delete_e2b_template(&t.id)?)).await?;
    Ok(true)
}

/// At start: builds that were running when the server stopped failed, and
/// their sandboxes go.
pub(crate) fn recover(e: &mut Engine) -> Result<(), cairn_engine::EngineError> {
    for build in e.unfinished_e2b_template_builds()? {
        let sandbox = build_sandbox(&build.id);
        if let Ok(rec) = e.sandbox(&sandbox) {
            let _ = e.remove_sandbox(&rec, true);
        }
        let failure = BuildFailure {
            message: "the server stopped during the build; build again".into(),
            step: None,
        };
        e.finish_e2b_template_build(&build, Err(&failure), &[])?;
    }
    Ok(())
}

/// The name of the sandbox build `id` runs in.
fn build_sandbox(id: &str) -> String {
    format!("e2b-build-{}", &id[..8.min(id.len())])
}

/// A random version-4 UUID, as the SDK expects build ids to be.
fn uuid() -> String {
    let h = cairn_engine::random_hex(16);
    let mut b: Vec<char> = h.chars().collect();
    b[12] = '4';
    b[16] = ['8', '9', 'a', 'b'][(b[16].to_digit(16).unwrap_or(0) % 4) as usize];
    let s: String = b.into_iter().collect();
    format!("{}-{}-{}-{}-{}", &s[..8], &s[8..12], &s[12..16], &s[16..20], &s[20..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_tags_and_ids_are_checked() {
        assert_eq!(split_name("my-env").unwrap(), ("my-env".into(), None));
        assert_eq!(
            split_name("my-env:v1.0").unwrap(),
            ("my-env".into(), Some("v1.0".into()))
        );
        assert!(split_name("My Env").is_err());
        assert!(split_name("x:bad tag").is_err());
        assert!(split_name("").is_err());
        let u = uuid();
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        assert!(only_waits("sleep 20") && only_waits(" sleep 0.5 ") && !only_waits("sleep 1 && curl x"));
        assert!(!only_waits("[ -f /tmp/ready ]"));
        assert!(check_hash(&"a".repeat(64)).is_ok());
        assert!(check_hash("../etc").is_err());
    }
}
