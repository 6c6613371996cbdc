//! `/v1/sandboxes/{id}/ports/{port}/http/{path}`: HTTP to a sandbox's port
//! through `cairn serve`, for clients that reach the server but not this
//! host's sandbox addresses (a dev server inside, opened in a browser).
//!
//! One HTTP/1.1 connection per request to the sandbox's address, bodies
//! streamed both ways; an upgrade the sandbox accepts (a WebSocket, 101)
//! joins the two connections byte for byte until either side closes. The caller's `Authorization` (Cairn's token) and the
//! hop-by-hop headers stay here; what the sandbox answers is passed back as
//! it is, being the sandbox's own page to serve.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode, Uri};
use axum::response::Response;
use hyper_util::rt::TokioIo;

use crate::app::App;
use crate::error::{ApiError, ApiResult};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Headers that belong to one connection, not to the request.
const HOP_BY_HOP: &[HeaderName] = &[
    header::CONNECTION,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

fn strip(headers: &mut HeaderMap) {
    // Names a `Connection` header lists are hop-by-hop as well.
    let listed: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::try_from(n.trim()).ok())
        .collect();
    for name in HOP_BY_HOP.iter().chain(&listed) {
        headers.remove(name);
    }
    headers.remove("keep-alive");
}

pub async fn root(
    State(app): State<Arc<App>>,
    Path((id, port)): Path<(String, String)>,
    req: Request,
) -> ApiResult<Response> {
    forward(app, id, port, String::new(), req).await
}

pub async fn path(
    State(app): State<Arc<App>>,
    Path((id, port, rest)): Path<(String, String, String)>,
    req: Request,
) -> ApiResult<Response> {
    forward(app, id, port, rest, req).await
}

async fn forward(app: Arc<App>, id: String, port: String, rest: String, req: Request) -> ApiResult<Response> {
    let port: u16 = port
        .parse()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::bad_request(format!("port {port:?} is not a TCP port (1-65535)")))?;
    let rec = app.engine(move |e| Ok(e.sandbox(&id)?)).await?;
    let address = rec
        .network
        .as_ref()
        .and_then(|n| n.held.as_ref())
        .map(|h| h.address)
        .ok_or_else(|| {
            ApiError::conflict(format!(
                "sandbox {} has no network address (loopback only, or not running); create it with network.mode = \"egress\"",
                rec.id
            ))
        })?;
    let target = format!("{address}:{port}");
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(&target))
        .await
        .map_err(|_| bad_gateway(format!("sandbox {} did not answer on port {port} within 10 s", rec.id)))?
        .map_err(|e| bad_gateway(format!("nothing answers on port {port} of sandbox {}: {e}", rec.id)))?;
    let mut req = req;
    req.headers_mut().remove(header::AUTHORIZATION);
    relay(
        stream,
        &target,
        &format!("/{rest}"),
        req,
        &format!("port {port} of sandbox {}", rec.id),
    )
    .await
}

/// Sends `req` as HTTP/1.1 over `stream` (a connection to a sandbox's
/// port) with path `path` (its query kept) and `Host: host`, and answers
/// with what comes back, bodies streamed both ways. Hop-by-hop headers
/// stay on each side; `what` names the port in errors.
pub(crate) async fn relay<S>(stream: S, host: &str, path: &str, req: Request, what: &str) -> ApiResult<Response>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| bad_gateway(format!("connect to {what}: {e}")))?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!("a proxied connection ended: {e}");
        }
    });
    let mut req = req;
    // An upgrade (a WebSocket) keeps its `Connection` and `Upgrade`
    // headers, and once the sandbox agrees (101) the two connections are
    // joined byte for byte.
    let upgrade = upgrade_asked(req.headers());
    let client_side = upgrade.clone().map(|_| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    let query = parts.uri.query().map(|q| format!("?{q}")).unwrap_or_default();
    parts.uri = format!("{path}{query}")
        .parse::<Uri>()
        .map_err(|e| ApiError::bad_request(format!("the path to proxy is not a URI: {e}")))?;
    strip(&mut parts.headers);
    if let Some(protocol) = &upgrade {
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        parts.headers.insert(header::UPGRADE, protocol.clone());
    }
    parts.headers.insert(
        header::HOST,
        HeaderValue::from_str(host).map_err(|_| ApiError::bad_request(format!("{host:?} is not a host name")))?,
    );
    parts.version = axum::http::Version::HTTP_11;
    let mut answer = sender
        .send_request(Request::from_parts(parts, body))
        .await
        .map_err(|e| bad_gateway(format!("{what} broke off: {e}")))?;
    if let (Some(client_side), StatusCode::SWITCHING_PROTOCOLS) = (client_side, answer.status()) {
        let sandbox_side = hyper::upgrade::on(&mut answer);
        let what = what.to_string();
        tokio::spawn(async move {
            match tokio::try_join!(client_side, sandbox_side) {
                Ok((client, sandbox)) => {
                    let (mut client, mut sandbox) = (TokioIo::new(client), TokioIo::new(sandbox));
                    if let Err(e) = tokio::io::copy_bidirectional(&mut client, &mut sandbox).await {
                        tracing::debug!("an upgraded connection to {what} ended: {e}");
                    }
                }
                Err(e) => tracing::debug!("an upgrade to {what} failed: {e}"),
            }
        });
        let (mut parts, _) = answer.into_parts();
        let protocol = parts.headers.get(header::UPGRADE).cloned();
        strip(&mut parts.headers);
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        if let Some(p) = protocol {
            parts.headers.insert(header::UPGRADE, p);
        }
        return Ok(Response::from_parts(parts, Body::empty()));
    }
    let (mut parts, body) = answer.into_parts();
    strip(&mut parts.headers);
    Ok(Response::from_parts(parts, Body::new(body)))
}

/// The protocol a request asks to upgrade to (`Connection: upgrade` with
/// an `Upgrade` header), if it does.
fn upgrade_asked(headers: &HeaderMap) -> Option<HeaderValue> {
    let connection_upgrade = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    connection_upgrade
        .then(|| headers.get(header::UPGRADE).cloned())
        .flatten()
}

fn bad_gateway(message: String) -> ApiError {
    ApiError::new(StatusCode::BAD_GATEWAY, message)
}
