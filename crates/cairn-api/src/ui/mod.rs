//! The lineage page at `/ui/`: runs and sessions, a run's stages as a
//! graph, each stage's log, artifacts and snapshots, kept live by
//! `/v1/events`. Plain files compiled into the binary (no build step, no
//! request leaves this server); they hold no data, so they are served
//! without a token, and the page sends the token it is given
//! (`/ui/#token=SECRET`) with each API request.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};

use crate::error::ApiError;

/// The page's files: name, content type, content.
const FILES: &[(&str, &str, &str)] = &[
    ("index.html", "text/html; charset=utf-8", include_str!("index.html")),
    ("app.js", "text/javascript; charset=utf-8", include_str!("app.js")),
    ("style.css", "text/css; charset=utf-8", include_str!("style.css")),
];

/// Only this server's own files and API; no inline script.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
     img-src 'self' data: blob:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

/// Whether a request path is the page's (served without a token).
pub fn is_page(path: &str) -> bool {
    path == "/ui" || path.starts_with("/ui/")
}

pub async fn root() -> Redirect {
    Redirect::permanent("/ui/")
}

pub async fn index() -> Response {
    file("index.html")
}

pub async fn asset(axum::extract::Path(name): axum::extract::Path<String>) -> Response {
    file(&name)
}

fn file(name: &str) -> Response {
    let Some((_, kind, body)) = FILES.iter().find(|(n, _, _)| *n == name) else {
        return ApiError::not_found(format!("the page has no file {name:?}; open /ui/")).into_response();
    };
    let mut resp = (StatusCode::OK, *body).into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(POLICY));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_names_only_files_it_ships() {
        let index = FILES[0].2;
        for name in ["/ui/app.js", "/ui/style.css"] {
            assert!(index.contains(name), "{name}");
        }
        // Nothing from elsewhere: the page works offline (the SVG
        // namespace is a name, not a place it fetches).
        for (name, _, body) in FILES {
            let body = body.replace("\"http://www.w3.org/2000/svg\"", "");
            assert!(
                !body.contains("http://") && !body.contains("https://"),
                "{name} reaches out"
            );
        }
        assert!(is_page("/ui") && is_page("/ui/app.js") && !is_page("/uix") && !is_page("/v1/runs"));
    }
}
