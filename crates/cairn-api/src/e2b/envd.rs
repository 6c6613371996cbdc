//! What every envd route shares: finding the sandbox from the
//! `E2b-Sandbox-Id` header and checking its `X-Access-Token`, the user a
//! request acts as, paths, and the `EntryInfo` shape; `GET /health`.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use cairn_protocol::{FileKind, FileMeta};
use serde_json::{json, Value};

use super::control::HOME;
use super::{Entry, Gateway};

/// Why an envd request cannot reach a sandbox.
pub(crate) enum Denied {
    /// No token, or not the one issued for this sandbox.
    Token(String),
    /// Unknown, paused or gone: E2B's "not running".
    NotRunning(String),
}

pub(crate) fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

/// Sandbox `id`'s entry, if `token` is the access token issued for it.
fn issued(gw: &Gateway, id: &str, token: &str) -> Option<Entry> {
    gw.entry(id).filter(|e| same(&gw.token(e), token))
}

/// The E2B sandbox a request is for, and the Cairn sandbox running it.
/// An unknown sandbox and an access token not its own answer alike (the
/// answer says nothing of which sandboxes exist); a token whose API key
/// was removed is refused as revoked.
pub(crate) async fn sandbox_of(gw: &Gateway, headers: &HeaderMap) -> Result<(Entry, String), Denied> {
    let header = |n: &str| header(headers, n);
    let Some(id) = header("e2b-sandbox-id").filter(|s| !s.is_empty() && s.len() <= 128) else {
        return Err(Denied::Token(
            "E2b-Sandbox-Id is missing: set E2B_SANDBOX_URL to this gateway and use a sandbox the SDK created".into(),
        ));
    };
    let Some(token) = header("x-access-token").filter(|t| !t.is_empty()) else {
        return Err(Denied::Token(format!(
            "X-Access-Token is missing: send the access token the SDK got when it created or connected sandbox {id}"
        )));
    };
    let Some(e) = issued(gw, id, token) else {
        return Err(Denied::NotRunning(format!(
            "sandbox {id} was not found, or X-Access-Token is not the one issued for it"
        )));
    };
    if let Some(grant) = &e.grant {
        match gw.app.token_exists(grant.clone()).await {
            Ok(true) => {}
            Ok(false) => {
                return Err(Denied::Token(format!(
                    "the access token of sandbox {id} was revoked: the API key it was issued to was removed; \
                     connect with a valid key for a new one"
                )))
            }
            Err(err) => {
                return Err(Denied::NotRunning(format!(
                    "cannot check the access token of sandbox {id} now: {}",
                    err.message
                )))
            }
        }
    }
    match e.running() {
        Some(sandbox) => {
            let sandbox = sandbox.to_string();
            Ok((e, sandbox))
        }
        None => Err(Denied::NotRunning(format!(
            "sandbox {id} was not found: it is paused; connect to it to resume"
        ))),
    }
}

/// Records each envd request made with a sandbox's access token in the
/// request log (`cairn token log`, surface `envd`): the API key the token
/// was issued to and the sandbox's tenant. A request without a sandbox's
/// valid access token was made by no token and is not recorded.
pub(crate) async fn record(State(gw): State<Arc<Gateway>>, req: Request, next: Next) -> Response {
    let made_by = match (
        header(req.headers(), "e2b-sandbox-id"),
        header(req.headers(), "x-access-token"),
    ) {
        (Some(id), Some(token)) if !token.is_empty() => issued(&gw, id, token).map(|e| (e.grant, e.tenant)),
        _ => None,
    };
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let resp = next.run(req).await;
    if let Some((grant, tenant)) = made_by {
        gw.app.audit.record(
            grant.as_deref(),
            tenant.as_deref(),
            "envd",
            method.as_str(),
            &path,
            resp.status().as_u16(),
        );
    }
    resp
}

/// The user from `Authorization: Basic base64(user:)` (what the SDK sends
/// with `user=`), else E2B's default `user`.
pub(crate) fn user_of(headers: &HeaderMap) -> String {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b.trim()).ok())
        .and_then(|b| String::from_utf8(b).ok())
        .map(|s| s.split(':').next().unwrap_or("").to_string())
        .filter(|u| !u.is_empty() && u.len() <= 64)
        .unwrap_or_else(|| "user".into())
}

/// A user's home: `/root` for root, `/home/user` for anyone else.
pub(crate) fn home_of(user: &str) -> &'static str {
    if user == "root" {
        "/root"
    } else {
        HOME
    }
}

/// An absolute path: relative ones are under the user's home. Refuses
/// empty, NUL-bearing and overlong paths.
pub(crate) fn resolve(path: &str, home: &str) -> Result<String, String> {
    if path.is_empty() || path.contains('\0') || path.len() > 4096 {
        return Err(format!(
            "path must be 1 to 4096 bytes without NUL, got {:?}",
            truncate(path)
        ));
    }
    Ok(if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{home}/{path}")
    })
}

fn truncate(s: &str) -> &str {
    let mut end = s.len().min(200);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn permissions(kind: FileKind, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'l',
        _ => '-',
    });
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// The names of a sandbox's users and groups by id, from its /etc/passwd
/// and /etc/group (each read only if at most 1 MiB; an id without a name
/// is shown as its number, 0 as root).
#[derive(Default)]
pub(crate) struct Names {
    users: std::collections::HashMap<u32, String>,
    groups: std::collections::HashMap<u32, String>,
}

impl Names {
    /// Read for `metas` when one is not root's; else root alone needs none.
    pub(crate) fn for_entries<'a>(
        client: &cairn_sandbox::client::InitClient,
        mut metas: impl Iterator<Item = &'a FileMeta>,
    ) -> Names {
        if !metas.any(|m| m.uid != 0 || m.gid != 0) {
            return Names::default();
        }
        let table = |path: &str| -> std::collections::HashMap<u32, String> {
            cairn_engine::build::small_file(client, path)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| {
                    let f: Vec<&str> = l.split(':').collect();
                    Some((f.get(2)?.parse().ok()?, f.first()?.chars().take(64).collect()))
                })
                .collect()
        };
        Names {
            users: table("/etc/passwd"),
            groups: table("/etc/group"),
        }
    }

    fn name(map: &std::collections::HashMap<u32, String>, id: u32) -> String {
        match map.get(&id) {
            Some(n) => n.clone(),
            None if id == 0 => "root".into(),
            None => id.to_string(),
        }
    }
}

/// envd's `EntryInfo` for a file's metadata, its owner and group named,
/// with its E2B metadata (`user.e2b.*` attributes) when it has any.
pub(crate) fn entry_info(
    meta: &FileMeta,
    symlink_target: Option<&str>,
    names: &Names,
    attrs: &[(String, String)],
) -> Value {
    let name = meta.path.rsplit('/').find(|s| !s.is_empty()).unwrap_or("/");
    let kind = match meta.kind {
        FileKind::File => "FILE_TYPE_FILE",
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::Symlink => "FILE_TYPE_SYMLINK",
        // The SDK drops UNSPECIFIED entries; devices and sockets are files to it.
        FileKind::Other => "FILE_TYPE_FILE",
    };
    let ms = i64::try_from(meta.mtime_ns / 1_000_000).unwrap_or(0);
    let mut v = json!({
        "name": name, "type": kind, "path": meta.path, "size": meta.size.to_string(),
        "mode": meta.mode & 0o7777, "permissions": permissions(meta.kind, meta.mode),
        "owner": Names::name(&names.users, meta.uid), "group": Names::name(&names.groups, meta.gid),
        "modifiedTime": super::control::rfc3339(ms),
    });
    if !attrs.is_empty() {
        v["metadata"] = attrs
            .iter()
            .map(|(k, val)| (k.clone(), json!(val)))
            .collect::<serde_json::Map<_, _>>()
            .into();
    }
    if meta.kind == FileKind::Symlink {
        v["isSymlink"] = json!(true);
        if let Some(t) = symlink_target {
            v["symlinkTarget"] = json!(t);
        }
    }
    v
}

/// `GET /health`: 204 while the sandbox runs, 502 when it does not.
pub async fn health(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Response {
    if headers.get("e2b-sandbox-id").is_none() {
        return StatusCode::NO_CONTENT.into_response();
    }
    match sandbox_of(&gw, &headers).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(Denied::Token(m)) => super::RestError::new(StatusCode::UNAUTHORIZED, m).into_response(),
        Err(Denied::NotRunning(m)) => super::RestError::new(StatusCode::BAD_GATEWAY, m).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_are_under_the_home_and_hostile_ones_are_refused() {
        assert_eq!(resolve("a.txt", HOME).unwrap(), "/home/user/a.txt");
        assert_eq!(resolve("/etc/x", HOME).unwrap(), "/etc/x");
        assert!(resolve("", HOME).is_err());
        assert!(resolve("a\0b", HOME).is_err());
        assert!(resolve(&"é".repeat(3000), HOME).is_err());
    }

    #[test]
    fn the_user_comes_from_a_basic_header() {
        let mut h = HeaderMap::new();
        assert_eq!(user_of(&h), "user");
        h.insert("authorization", "Basic cm9vdDo=".parse().unwrap());
        assert_eq!(user_of(&h), "root");
        h.insert("authorization", "Basic !!!".parse().unwrap());
        assert_eq!(user_of(&h), "user");
    }

    #[test]
    fn permissions_read_like_ls() {
        assert_eq!(permissions(FileKind::File, 0o644), "-rw-r--r--");
        assert_eq!(permissions(FileKind::Dir, 0o755), "drwxr-xr-x");
    }
}
