//! E2B's network rules on Cairn's nftables fence (docs/network.md): with
//! `cairn serve --e2b-network egress`, a sandbox of a native template has a
//! route out, `allow_out` and `deny_out` as E2B reads them (an allow wins
//! over a deny; `0.0.0.0/0`, or `allow_internet_access=False`, denies all
//! traffic but the allows), and `update_network` replaces them while it
//! runs (`PUT /sandboxes/{id}/network`, one nftables transaction; omitted
//! fields are cleared) or for its resume while paused. Names in
//! `allow_out` are resolved by the server and pinned in the sandbox's
//! `/etc/hosts`. Without the flag (the default), and on gVisor templates,
//! sandboxes reach nothing outside: `allow_out` is then refused, denials
//! hold already.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use cairn_engine::state::e2b::E2bNetwork;
use cairn_sandbox::net::{Allow, Deny, NetPolicy};
use serde::Deserialize;
use serde_json::{json, Value};

use super::{Gateway, Life, RestError};

/// What `ALL_TRAFFIC` is in E2B's SDKs.
pub const ALL_TRAFFIC: &str = "0.0.0.0/0";

/// The `network` object of a create, and the body of an update.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkBody {
    allow_out: Option<Vec<String>>,
    deny_out: Option<Vec<String>>,
    allow_public_traffic: Option<bool>,
    dns_servers: Option<Vec<String>>,
    egress_proxy: Option<Value>,
    rules: Option<Value>,
    mask_request_host: Option<String>,
    https_ports: Option<Vec<Value>>,
    /// The update's own spelling of `allow_internet_access`.
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
}

/// The rules a create (or an update) asks for, checked; `None` when the
/// sandbox gets no network (the server's or the driver's choice) and the
/// request asks for nothing that needs one.
pub fn requested(
    gw: &Gateway,
    driver: &str,
    allow_internet_access: Option<bool>,
    body: Option<NetworkBody>,
) -> Result<Option<E2bNetwork>, RestError> {
    let body = body.unwrap_or_default();
    let unsupported = [
        (
            "rules",
            body.rules.as_ref().is_some_and(|r| !r.is_null() && r != &json!({})),
        ),
        ("egressProxy", body.egress_proxy.as_ref().is_some_and(|p| !p.is_null())),
        ("dnsServers", body.dns_servers.is_some()),
        ("maskRequestHost", body.mask_request_host.is_some()),
        ("httpsPorts", body.https_ports.as_ref().is_some_and(|p| !p.is_empty())),
    ];
    if let Some((field, _)) = unsupported.iter().find(|(_, given)| *given) {
        return Err(RestError::bad_request(format!(
            "network.{field} is not supported by Cairn's E2B gateway: give allowOut and denyOut (docs/e2b.md)"
        )));
    }
    let mut net = E2bNetwork {
        allow_out: body.allow_out.unwrap_or_default(),
        deny_out: body.deny_out.unwrap_or_default(),
    };
    if allow_internet_access.or(body.allow_internet_access) == Some(false)
        && !net.deny_out.iter().any(|d| d == ALL_TRAFFIC)
    {
        net.deny_out.push(ALL_TRAFFIC.to_string());
    }
    // Checked whether or not it is applied: a rule that does not parse is
    // a 400 naming it everywhere.
    policy(&net)?;
    if !gw.egress || driver != "native" {
        if !net.allow_out.is_empty() {
            let why = if gw.egress {
                format!("its template runs on the {driver} driver, which has no network in Cairn")
            } else {
                "this server gives E2B sandboxes no network (start it with --e2b-network egress)".to_string()
            };
            return Err(RestError::bad_request(format!(
                "allowOut {:?} cannot be honoured: {why}",
                net.allow_out
            )));
        }
        return Ok(None);
    }
    Ok(Some(net))
}

/// Cairn's policy for E2B's rules: the allows are exceptions to the
/// denies; with no deny nothing is refused (but what no sandbox reaches:
/// docs/network.md), so allows alone change nothing.
pub fn policy(net: &E2bNetwork) -> Result<NetPolicy, RestError> {
    let bad = |field: &str, rule: &str, e: cairn_sandbox::net::NetError| {
        RestError::bad_request(format!("{field} rule {rule:?} does not parse: {e}"))
    };
    let deny = net
        .deny_out
        .iter()
        .map(|d| {
            Deny::parse(d).map_err(|e| {
                if d.parse::<std::net::Ipv4Addr>().is_err() && !d.contains('/') {
                    RestError::bad_request(format!(
                        "denyOut rule {d:?}: a name can only be allowed; deny its addresses, or deny {ALL_TRAFFIC} \
                         and allow the names you want"
                    ))
                } else {
                    bad("denyOut", d, e)
                }
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut allow = net
        .allow_out
        .iter()
        .map(|a| Allow::parse(a).map_err(|e| bad("allowOut", a, e)))
        .collect::<Result<Vec<_>, _>>()?;
    // Checked, but without a deny there is nothing to be an exception to.
    if deny.is_empty() {
        allow.clear();
    }
    let p = NetPolicy {
        egress: true,
        allow,
        deny,
        publish: Vec::new(),
    };
    p.check().map_err(|e| RestError::bad_request(e.to_string()))?;
    Ok(p)
}

/// Whether a create's `network` asks for ports reached without the
/// traffic access token (`allowPublicTraffic`; off unless asked for).
pub fn public_traffic(body: Option<&NetworkBody>) -> bool {
    body.and_then(|b| b.allow_public_traffic).unwrap_or(false)
}

/// How `GET /sandboxes/{id}` shows the rules and whether its ports are
/// public (left out without either).
pub fn json(net: &Option<E2bNetwork>, public: bool) -> Option<Value> {
    match net {
        Some(n) => Some(json!({ "allowOut": n.allow_out, "denyOut": n.deny_out, "allowPublicTraffic": public })),
        None if public => Some(json!({ "allowPublicTraffic": true })),
        None => None,
    }
}

/// `PUT /sandboxes/{id}/network`: the rules replaced, live.
pub async fn update(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<StatusCode, RestError> {
    let body: NetworkBody = crate::routes::parse(&body).map_err(RestError::from)?;
    let e = gw.entry(&id).ok_or_else(|| RestError::not_found(&id))?;
    let public = body.allow_public_traffic;
    let only_public = public.is_some() && body.allow_out.is_none() && body.deny_out.is_none();
    if only_public {
        // Whether its ports need the traffic token: no egress involved.
        let _busy = gw.app.claim(&format!("e2b:{id}"), "update its network")?;
        gw.modify(&id, |e| e.public_traffic = public.unwrap_or(false)).await?;
        return Ok(StatusCode::NO_CONTENT);
    }
    if e.network.is_none() {
        return Err(RestError::new(
            StatusCode::CONFLICT,
            if gw.egress {
                format!("sandbox {id} has no network (its template runs on gVisor), so it has no rules to change")
            } else {
                format!("sandbox {id} has no network: this server gives E2B sandboxes none (--e2b-network egress)")
            },
        ));
    }
    let _busy = gw.app.claim(&format!("e2b:{id}"), "update its network")?;
    let net = requested(&gw, "native", None, Some(body))?.unwrap_or_default();
    let e = gw.entry(&id).ok_or_else(|| RestError::not_found(&id))?;
    if let Life::Running { sandbox } = &e.life {
        let p = policy(&net)?;
        let sandbox = sandbox.clone();
        gw.app
            .engine(move |en| {
                let rec = en.sandbox(&sandbox)?;
                en.update_network(&rec, &p)?;
                Ok(())
            })
            .await?;
    }
    gw.modify(&id, |e| {
        e.network = Some(net);
        if let Some(p) = public {
            e.public_traffic = p;
        }
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}
