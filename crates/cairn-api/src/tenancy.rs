//! Tenants at the API (`cairn_engine::tenants`): which tenant a request
//! acts for, and one check, before any handler, that the object its path
//! names is that tenant's.
//!
//! A tenant's token reaches its own objects only, and another tenant's
//! answers exactly as an absent one does: [`own`] resolves the `{id}` of
//! `/v1/sandboxes/{id}/…`, `/v1/snapshots/{id}/…`, `/v1/sessions/{id}/…`,
//! `/v1/runs/{id}/…` and `/v1/images/{name}` among the tenant's objects
//! (id, name or label, unique prefix: the administrator's rules) and hands
//! the handler the full id, so no handler's own lookup can land on anyone
//! else's; lists are filtered by [`owned`] in their handlers. The engines a
//! request uses act for its tenant ([`crate::App::engine`]), so whatever it
//! creates is stamped with its owner in the row's own insert.

use std::collections::HashSet;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{StatusCode, Uri};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use cairn_engine::tenants::Owned;
use cairn_engine::{DiffError, EngineError, ImageError, SnapshotError};
use cairn_pipeline::run::RunError;
use cairn_session::SessionError;

use crate::app::App;
use crate::error::{ApiError, ApiResult};

pub use crate::acting::{acting, current, qualify};

/// The ids of the current tenant's `kind` objects, for filtering a list;
/// `None` for an administrator (everything).
pub async fn owned(app: &Arc<App>, kind: Owned) -> ApiResult<Option<HashSet<String>>> {
    let Some(tenant) = current() else { return Ok(None) };
    Ok(Some(app.engine(move |e| Ok(e.owned(kind, &tenant)?)).await?))
}

/// Refuses an administrator's route to a tenant.
fn administrators_only(what: &str) -> Response {
    ApiError::new(
        StatusCode::FORBIDDEN,
        format!("{what} is the administrator's; this token belongs to a tenant"),
    )
    .into_response()
}

/// The answer an absent object gets from its handler, word for word.
fn absent(kind: Owned, key: &str) -> ApiError {
    let key = key.to_string();
    ApiError::from(match kind {
        Owned::Sandbox => EngineError::NoSuchSandbox(key),
        Owned::Snapshot => SnapshotError::NotFound(key).into(),
        Owned::Session => SessionError::NotFound(key).into(),
        Owned::Run => RunError::NoSuchRun(key).into(),
        Owned::Image | Owned::E2bSandbox | Owned::E2bTemplate => ImageError::NotFound(key).into(),
    })
}

fn ambiguous(kind: Owned, key: &str, ids: Vec<String>) -> ApiError {
    let key = key.to_string();
    ApiError::from(match kind {
        Owned::Sandbox => EngineError::AmbiguousSandbox { key, ids },
        Owned::Snapshot => SnapshotError::Ambiguous { key, ids }.into(),
        Owned::Session => SessionError::Ambiguous { key, ids }.into(),
        _ => RunError::NoSuchRun(key).into(),
    })
}

/// The full id of the tenant's `kind` object `key`, or the answer an
/// absent one gets.
async fn resolve(app: &Arc<App>, tenant: &str, kind: Owned, key: &str) -> ApiResult<String> {
    let (t, k) = (tenant.to_string(), key.to_string());
    let mut ids = app.engine(move |e| Ok(e.resolve_owned(kind, &t, &k)?)).await?;
    match ids.len() {
        0 => Err(absent(kind, key)),
        1 => Ok(ids.remove(0)),
        _ => Err(ambiguous(kind, key, ids)),
    }
}

/// A diff side (`cairn diff`'s forms) with its object resolved among the
/// tenant's; anything else is answered as an unknown side.
async fn resolve_side(app: &Arc<App>, tenant: &str, side: &str) -> ApiResult<String> {
    let unknown = || ApiError::from(EngineError::from(DiffError::Unknown(side.to_string())));
    if let Some((run, rest)) = side.split_once('/') {
        return match resolve(app, tenant, Owned::Run, run).await {
            Ok(id) => Ok(format!("{id}/{rest}")),
            Err(_) => Err(unknown()),
        };
    }
    for kind in [Owned::Snapshot, Owned::Sandbox] {
        match resolve(app, tenant, kind, side).await {
            Ok(id) => return Ok(id),
            Err(e) if e.status == StatusCode::NOT_FOUND => continue,
            Err(e) => return Err(e),
        }
    }
    Err(unknown())
}

fn decode(segment: &str) -> Option<String> {
    percent_encoding::percent_decode_str(segment)
        .decode_utf8()
        .ok()
        .map(|s| s.into_owned())
}

/// Replaces the path's segment `at` with `with` (an id: nothing to encode).
fn rewrite(uri: &Uri, at: usize, with: &str) -> Option<Uri> {
    let mut segments: Vec<&str> = uri.path().split('/').collect();
    *segments.get_mut(at)? = with;
    let path = segments.join("/");
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path,
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(pq.parse().ok()?);
    Uri::from_parts(parts).ok()
}

/// For a tenant's request: the object its path names must be the
/// tenant's (404 as if absent otherwise), and reaches the handler by its
/// full id; routes that are the administrator's alone are refused.
pub async fn own(State(app): State<Arc<App>>, mut req: Request, next: Next) -> Response {
    let Some(tenant) = current() else {
        return next.run(req).await;
    };
    let path = req.uri().path().to_string();
    let segments: Vec<&str> = path.split('/').collect();
    let route = (
        segments.get(1).copied(),
        segments.get(2).copied(),
        segments.get(3).copied(),
    );
    let kind = match route {
        (Some("metrics"), None, None) => return administrators_only("GET /metrics (the whole server's figures)"),
        (Some("v1"), Some("diff"), None) => {
            return match diff_query(&app, &tenant, req.uri()).await {
                Ok(uri) => {
                    *req.uri_mut() = uri;
                    next.run(req).await
                }
                Err(e) => e.into_response(),
            }
        }
        (Some("v1"), Some("sandboxes"), Some(k)) if !k.is_empty() => Owned::Sandbox,
        (Some("v1"), Some("snapshots"), Some(k)) if !k.is_empty() => Owned::Snapshot,
        (Some("v1"), Some("sessions"), Some(k)) if !k.is_empty() && k != "import" => Owned::Session,
        (Some("v1"), Some("runs"), Some(k)) if !k.is_empty() => Owned::Run,
        (Some("v1"), Some("images"), Some(k)) if !k.is_empty() && k != "import" => Owned::Image,
        _ => return next.run(req).await,
    };
    let Some(key) = segments.get(3).and_then(|k| decode(k)) else {
        return ApiError::bad_request("the path's id is not UTF-8").into_response();
    };
    match resolve(&app, &tenant, kind, &key).await {
        Ok(id) => match rewrite(req.uri(), 3, &id) {
            Some(uri) => {
                *req.uri_mut() = uri;
                next.run(req).await
            }
            None => ApiError::internal("cannot rewrite the request's path").into_response(),
        },
        Err(e) => e.into_response(),
    }
}

/// `/v1/diff?a=…&b=…` with both sides the tenant's.
async fn diff_query(app: &Arc<App>, tenant: &str, uri: &Uri) -> ApiResult<Uri> {
    let query = uri.query().unwrap_or("");
    let mut pairs: Vec<(String, String)> = form_urlencoded::parse(query.as_bytes()).into_owned().collect();
    for (k, v) in pairs.iter_mut() {
        if k == "a" || k == "b" {
            *v = resolve_side(app, tenant, v).await?;
        }
    }
    let query = form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish();
    format!("{}?{query}", uri.path())
        .parse()
        .map_err(|_| ApiError::internal("cannot rewrite the request's query"))
}
