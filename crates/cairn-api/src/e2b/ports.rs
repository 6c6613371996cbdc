//! A sandbox's own servers through the gateway: a request that names a
//! port other than envd's, by the `E2b-Sandbox-Port` header (what the SDKs
//! send when `E2B_SANDBOX_URL` points here, the code interpreter's
//! `run_code` among them) or by a `PORT-SANDBOXID.DOMAIN` host name (what
//! `get_host(port)` gives), goes to that port on the sandbox's own
//! loopback, through init ([`cairn_protocol::ToInit::ConnectPort`]): no
//! network is needed, on native and on gVisor alike. The request must
//! carry the sandbox's access token (`X-Access-Token`, as envd's do) or
//! its traffic token (`E2B-Traffic-Access-Token`, which create answers
//! with), unless it was made with `allow_public_traffic=True`; the tokens,
//! the user and the hop-by-hop headers stay here.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::envd::{same, sandbox_of, Denied};
use super::{Gateway, RestError};

/// envd's port, which the gateway serves itself.
pub const ENVD_PORT: u16 = 49983;

/// The port (other than envd's) and, when the host name gives it, the
/// sandbox a request is for.
fn target(headers: &HeaderMap) -> Option<(u16, Option<String>)> {
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).map(str::trim);
    if let Some(port) = header("e2b-sandbox-port") {
        let port = port.parse::<u16>().ok().filter(|p| *p != 0)?;
        return (port != ENVD_PORT).then_some((port, None));
    }
    let host = header("host")?;
    let (label, _) = host.split_once('.')?;
    let (port, id) = label.split_once('-')?;
    let port = port.parse::<u16>().ok().filter(|p| *p != 0 && *p != ENVD_PORT)?;
    let id_ok = !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    id_ok.then(|| (port, Some(id.to_string())))
}

/// The middleware in front of envd's routes: relays requests for other
/// ports, passes the rest on.
pub async fn route(State(gw): State<Arc<Gateway>>, req: Request, next: Next) -> Response {
    let Some((port, id)) = target(req.headers()) else {
        return next.run(req).await;
    };
    match relay(&gw, port, id, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn relay(gw: &Arc<Gateway>, port: u16, id: Option<String>, mut req: Request) -> Result<Response, RestError> {
    if let Some(id) = id.filter(|_| !req.headers().contains_key("e2b-sandbox-id")) {
        let value =
            HeaderValue::from_str(&id).map_err(|_| RestError::new(StatusCode::BAD_REQUEST, "bad sandbox id"))?;
        req.headers_mut().insert("e2b-sandbox-id", value);
    }
    // The traffic token stands for the access token on port requests.
    let traffic = req
        .headers()
        .get("e2b-traffic-access-token")
        .and_then(|v| v.to_str().ok());
    if let (Some(traffic), false) = (traffic, req.headers().contains_key("x-access-token")) {
        let id = req
            .headers()
            .get("e2b-sandbox-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if let Some(e) = gw.entry(id).filter(|e| same(&gw.traffic_token(e), traffic.trim())) {
            let token = HeaderValue::from_str(&gw.token(&e)).expect("a hex token is a valid header");
            req.headers_mut().insert("x-access-token", token);
        }
    }
    // A sandbox made with allow_public_traffic=True needs neither token.
    if !req.headers().contains_key("x-access-token") {
        let id = req
            .headers()
            .get("e2b-sandbox-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if let Some(e) = gw.entry(id).filter(|e| e.public_traffic) {
            let token = HeaderValue::from_str(&gw.token(&e)).expect("a hex token is a valid header");
            req.headers_mut().insert("x-access-token", token);
        }
    }
    let (entry, sandbox) = sandbox_of(gw, req.headers()).await.map_err(|d| match d {
        Denied::Token(m) => RestError::new(StatusCode::UNAUTHORIZED, m),
        Denied::NotRunning(m) => RestError::new(StatusCode::BAD_GATEWAY, m),
    })?;
    let s = sandbox.clone();
    let connected = gw
        .app
        .init(&sandbox, move |e| {
            let rec = e.sandbox(&s)?;
            Ok(e.client(&rec)?.connect_port(port)?)
        })
        .await
        .map_err(|e| RestError::new(e.status, e.message))?;
    let stream = connected.map_err(|m| {
        RestError::new(
            StatusCode::BAD_GATEWAY,
            format!(
                "port {port} of sandbox {}: {m}; start a server listening there first",
                entry.id
            ),
        )
    })?;
    let stream = stream
        .set_nonblocking(true)
        .and_then(|()| tokio::net::UnixStream::from_std(stream))
        .map_err(|e| RestError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("cannot relay: {e}")))?;
    for private in ["x-access-token", "authorization", "e2b-traffic-access-token"] {
        req.headers_mut().remove(private);
    }
    let path = req.uri().path().to_string();
    let what = format!("port {port} of sandbox {}", entry.id);
    crate::routes::proxy::relay(stream, &format!("localhost:{port}"), &path, req, &what)
        .await
        .map_err(|e| RestError::new(e.status, e.message))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn a_port_is_named_by_header_or_by_host_and_envds_stays_here() {
        assert_eq!(target(&headers(&[("e2b-sandbox-port", "49999")])), Some((49999, None)));
        assert_eq!(target(&headers(&[("e2b-sandbox-port", "49983")])), None);
        assert_eq!(
            target(&headers(&[("e2b-sandbox-port", "x"), ("host", "8000-ab.h")])),
            None
        );
        assert_eq!(
            target(&headers(&[("host", "8000-abc123.localhost:3000")])),
            Some((8000, Some("abc123".into())))
        );
        assert_eq!(target(&headers(&[("host", "49983-abc.localhost")])), None);
        assert_eq!(target(&headers(&[("host", "127.0.0.1:3000")])), None);
        assert_eq!(target(&headers(&[("host", "localhost")])), None);
        assert_eq!(target(&headers(&[("host", "0-abc.localhost")])), None);
        assert_eq!(target(&headers(&[("host", "80-a_b.localhost")])), None);
    }
}
