//! Protection against DNS rebinding on TCP listeners bound to a loopback
//! address: a web page whose host name an attacker points at 127.0.0.1
//! reaches such a listener through the visitor's browser, with its own
//! name in `Host` and `Origin`. Requests naming any host but a loopback
//! one (`localhost`, `127.0.0.0/8`, `[::1]`) or one the operator allowed
//! (`--allowed-host`, for a proxy that passes the public name on) are
//! refused with 403 before anything else reads them. A listener on any
//! other address is reached by name on purpose, and checks nothing here;
//! its bearer tokens (and E2B's keys) are what no page can present.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;

/// Which host names a loopback listener answers to.
#[derive(Debug, Clone)]
pub struct HostGuard {
    /// Names allowed besides loopback ones, lowercase, without ports.
    allowed: Arc<Vec<String>>,
}

impl HostGuard {
    /// The guard of a listener on `addr`: `None` when it is not bound to a
    /// loopback address (nothing to check).
    pub fn for_listener(addr: SocketAddr, allowed: &[String]) -> Option<HostGuard> {
        addr.ip().is_loopback().then(|| HostGuard {
            allowed: Arc::new(allowed.iter().map(|h| h.trim().to_ascii_lowercase()).collect()),
        })
    }

    /// Whether `host` (a `Host` value or an origin's authority, with or
    /// without a port) names this server.
    fn accepts(&self, authority: &str) -> bool {
        let name = host_of(authority).to_ascii_lowercase();
        name == "localhost"
            || name.ends_with(".localhost")
            || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
            || self.allowed.iter().any(|a| match a.strip_prefix("*.") {
                // `*.NAME`: any name under NAME.
                Some(suffix) => name.len() > suffix.len() + 1 && name.ends_with(&format!(".{suffix}")),
                None => *a == name,
            })
    }
}

/// The host part of an authority: `[::1]:7070` → `::1`, `a:80` → `a`.
fn host_of(authority: &str) -> &str {
    let authority = authority.trim();
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match authority.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => authority,
    }
}

/// The authority of an `Origin` value (`scheme://authority`), or `None`
/// for what is not one (`null`, a page without an origin).
fn origin_authority(origin: &str) -> Option<&str> {
    let (_, rest) = origin.split_once("://")?;
    Some(rest.split('/').next().unwrap_or(rest))
}

fn refused(what: &str, value: &str) -> Response {
    ApiError::new(
        StatusCode::FORBIDDEN,
        format!(
            "{what} {value:?} does not name this server: a listener on a loopback address answers only to \
             localhost, 127.0.0.1 and [::1] (protection against DNS rebinding); behind a proxy that passes \
             another name on, allow it with `cairn serve --allowed-host NAME`"
        ),
    )
    .into_response()
}

/// The middleware: checks `Host` (or the request's authority) and
/// `Origin` when present.
pub async fn check(State(guard): State<HostGuard>, req: Request, next: Next) -> Response {
    let host = req
        .headers()
        .get(header::HOST)
        .map(|v| v.to_str().unwrap_or("\u{fffd}").to_string())
        .or_else(|| req.uri().authority().map(|a| a.to_string()));
    if let Some(host) = host {
        if !guard.accepts(&host) {
            return refused("Host", &host);
        }
    }
    if let Some(origin) = req.headers().get(header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("\u{fffd}");
        if !origin_authority(origin).is_some_and(|a| guard.accepts(a)) {
            return refused("Origin", origin);
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(allowed: &[&str]) -> HostGuard {
        let allowed: Vec<String> = allowed.iter().map(|s| s.to_string()).collect();
        HostGuard::for_listener("127.0.0.1:7070".parse().unwrap(), &allowed).unwrap()
    }

    #[test]
    fn a_wildcard_allows_the_names_under_it_only() {
        let g = guard(&["*.sbx.example"]);
        assert!(g.accepts("8000-abc.sbx.example"));
        assert!(g.accepts("8000-abc.SBX.example:443"));
        for refused in [
            "sbx.example",
            "evilsbx.example",
            "a.sbx.example.evil.com",
            ".sbx.example",
        ] {
            assert!(!g.accepts(refused), "{refused}");
        }
    }

    #[test]
    fn loopback_names_pass_and_others_do_not() {
        let g = guard(&["cairn.example.org"]);
        for ok in [
            "localhost",
            "localhost:7070",
            "LOCALHOST:1",
            "127.0.0.1",
            "127.8.9.10:80",
            "[::1]:7070",
            "[::1]",
            "app.localhost",
            "cairn.example.org",
            "Cairn.Example.Org:443",
        ] {
            assert!(g.accepts(ok), "{ok}");
        }
        for bad in [
            "evil.example.com",
            "evil.example.com:7070",
            "localhost.evil.com",
            "127.0.0.1.evil.com",
            "10.0.0.1",
            "[::2]:7070",
            "",
            "example.org",
        ] {
            assert!(!g.accepts(bad), "{bad}");
        }
        assert_eq!(origin_authority("http://localhost:7070"), Some("localhost:7070"));
        assert_eq!(origin_authority("https://a.b/x"), Some("a.b"));
        assert_eq!(origin_authority("null"), None);
    }

    #[test]
    fn only_loopback_listeners_are_guarded() {
        assert!(HostGuard::for_listener("127.0.0.1:1".parse().unwrap(), &[]).is_some());
        assert!(HostGuard::for_listener("[::1]:1".parse().unwrap(), &[]).is_some());
        assert!(HostGuard::for_listener("0.0.0.0:1".parse().unwrap(), &[]).is_none());
        assert!(HostGuard::for_listener("192.0.2.1:1".parse().unwrap(), &[]).is_none());
    }
}
