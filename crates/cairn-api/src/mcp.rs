//! The MCP server: Cairn's tools ([`cairn_tools`]) over the Model Context
//! Protocol with rmcp, on stdio (`cairn mcp`) and Streamable HTTP (`/mcp`
//! on `cairn serve`). rmcp speaks both protocol eras: 2026-07-28
//! (stateless, every request's `_meta` names the version and the client)
//! and 2025-11-25 and before (the `initialize` handshake, a session).

use std::sync::Arc;

use cairn_engine::Home;
use cairn_tools::{ToolError, ToolProgress, Tools};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation, JsonObject, ListToolsResult,
    PaginatedRequestParams, ProgressNotificationParam, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use tokio_util::sync::CancellationToken;

/// One MCP server over the shared tools; rmcp makes one per session or
/// stateless request, all sharing the [`Tools`].
#[derive(Clone)]
pub struct CairnMcp {
    tools: Arc<Tools>,
    /// The transport, for the caller recorded with each call.
    transport: &'static str,
    /// On stdio, the token `cairn mcp` was given, if any: whose objects
    /// every call sees, and where each call is recorded.
    stdio: Option<Arc<StdioCaller>>,
}

impl CairnMcp {
    pub fn new(tools: Arc<Tools>, transport: &'static str) -> CairnMcp {
        CairnMcp {
            tools,
            transport,
            stdio: None,
        }
    }
}

/// The holder of the token `cairn mcp` was started with (`--token`,
/// `CAIRN_TOKEN`): every tool call acts for its tenant and is recorded in
/// the request log (surface `mcp`, method `CALL`, the tool's name; status
/// 200, 400 for a call refused as invalid, 422 for a tool that failed).
pub struct StdioCaller {
    /// The token's id.
    pub token: String,
    pub tenant: Option<String>,
    log: std::sync::Mutex<cairn_engine::Engine>,
}

impl StdioCaller {
    pub fn new(home: Home, token: String, tenant: Option<String>) -> Result<StdioCaller, String> {
        let engine = cairn_engine::Engine::open(home).map_err(|e| e.to_string())?;
        Ok(StdioCaller {
            token,
            tenant,
            log: std::sync::Mutex::new(engine),
        })
    }

    fn record(&self, tool: &str, status: u16) {
        let row = cairn_engine::tenants::AuditEntry::now(
            Some(&self.token),
            self.tenant.as_deref(),
            "mcp",
            "CALL",
            tool,
            i64::from(status),
        );
        let engine = self.log.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = engine.record_audit(&[row]) {
            tracing::warn!("the request log could not record a call of {tool}: {e}");
        }
    }
}

/// The tool list as rmcp's records, from the one schema.
fn listed_tools() -> Vec<Tool> {
    cairn_tools::tools()
        .into_iter()
        .map(|t| {
            let object = |v: serde_json::Value| -> Arc<JsonObject> {
                match v {
                    serde_json::Value::Object(o) => Arc::new(o),
                    _ => unreachable!("the schema test checks every schema is an object"),
                }
            };
            let mut tool = Tool::new(t.name, t.description, object(t.input));
            tool.output_schema = Some(object(t.output));
            tool
        })
        .collect()
}

/// Sends a waiting tool's progress to the client as MCP progress
/// notifications, from the blocking thread the tool runs on.
struct Notifier {
    tx: tokio::sync::mpsc::UnboundedSender<(f64, Option<f64>, String)>,
}

impl ToolProgress for Notifier {
    fn progress(&self, done: f64, total: Option<f64>, message: &str) {
        let _ = self.tx.send((done, total, message.to_string()));
    }
}

impl ServerHandler for CairnMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("cairn", env!("CARGO_PKG_VERSION")))
            .with_instructions(format!(
                "Cairn's durable sandboxes (tool schema version {}): plan_stage to see snapshots, run_stage \
                 and fork_from to run commands forked from one, stage_status to poll, select to choose a \
                 branch, inspect_logs and inspect to look. Every call's reason is recorded.",
                cairn_tools::TOOLS_VERSION
            ))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(listed_tools()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        listed_tools().into_iter().find(|t| t.name == name)
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let client = context
            .client_info()
            .map(|c| format!("{} {}", c.name, c.version))
            .unwrap_or_else(|| "an unnamed client".into());
        let era = context.protocol_version().map(|v| v.to_string()).unwrap_or_default();
        let caller = format!("{client} over MCP {era} ({})", self.transport);
        let arguments = serde_json::Value::Object(request.arguments.unwrap_or_default());
        let name = request.name.to_string();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let forwarder = context.meta.get_progress_token().map(|token| {
            let peer = context.peer.clone();
            tokio::spawn(async move {
                while let Some((done, total, message)) = rx.recv().await {
                    let mut p = ProgressNotificationParam::new(token.clone(), done).with_message(message);
                    if let Some(t) = total {
                        p = p.with_total(t);
                    }
                    let _ = peer.notify_progress(p).await;
                }
            })
        });
        // Over HTTP, the request's token says whose objects the call sees;
        // on stdio, the token `cairn mcp` was given.
        let tenant = match &self.stdio {
            Some(s) => s.tenant.clone(),
            None => context
                .extensions
                .get::<axum::http::request::Parts>()
                .and_then(|p| p.extensions.get::<crate::admission::Caller>())
                .and_then(|c| c.tenant.clone()),
        };
        let tools = Arc::clone(&self.tools);
        let tool = name.clone();
        let stdio = self.stdio.clone();
        let outcome = tokio::task::spawn_blocking(move || {
            let notifier = Notifier { tx };
            let outcome = tools.call_for(tenant.as_deref(), &tool, arguments, &caller, &notifier);
            if let Some(s) = stdio {
                s.record(
                    &tool,
                    match &outcome {
                        Ok(_) => 200,
                        Err(ToolError::UnknownTool(_) | ToolError::InvalidArguments { .. }) => 400,
                        Err(ToolError::Failed(_)) => 422,
                    },
                );
            }
            outcome
        })
        .await
        .map_err(|e| ErrorData::internal_error(format!("the tool's thread failed: {e}"), None))?;
        if let Some(f) = forwarder {
            // The sender is gone with the tool's thread: the forwarder ends
            // once it has sent what was queued, before the result goes out.
            let _ = f.await;
        }
        match outcome {
            Ok(value) => Ok(CallToolResult::structured(value).into()),
            Err(e @ (ToolError::UnknownTool(_) | ToolError::InvalidArguments { .. })) => {
                Err(ErrorData::invalid_params(e.to_string(), None))
            }
            Err(ToolError::Failed(message)) => {
                tracing::info!(tool = %name, "tool call failed: {message}");
                Ok(CallToolResult::error(vec![ContentBlock::text(message)]).into())
            }
        }
    }
}

/// The largest `/mcp` request body (413 above it): a stage's edits may
/// hold 4 MiB, and JSON escaping makes them larger on the wire.
const MCP_BODY_MAX: usize = 8 << 20;

/// `/mcp`: Streamable HTTP for both eras. Host checks are off because
/// the routes sit behind the Unix socket's mode or the TCP listener's
/// bearer token, which a rebinding page cannot present.
pub fn http_service(home: Home, stop: CancellationToken) -> StreamableHttpService<CairnMcp, LocalSessionManager> {
    let tools = Arc::new(Tools::new(home));
    StreamableHttpService::new(
        move || Ok(CairnMcp::new(Arc::clone(&tools), "streamable-http")),
        Arc::new(LocalSessionManager::default()),
        StreamableHttpServerConfig::default()
            .with_cancellation_token(stop)
            .with_max_request_body_bytes(MCP_BODY_MAX)
            .disable_allowed_hosts(),
    )
}

/// `cairn mcp`: serves on stdin and stdout until the client closes them;
/// with a `caller` (the token it was given), as that token's holder.
pub async fn serve_stdio(home: Home, caller: Option<StdioCaller>) -> Result<(), String> {
    let mut server = CairnMcp::new(Arc::new(Tools::new(home)), "stdio");
    server.stdio = caller.map(Arc::new);
    let running = server
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| format!("the MCP session did not start: {e}"))?;
    running
        .waiting()
        .await
        .map_err(|e| format!("the MCP session ended with an error: {e}"))?;
    Ok(())
}

/// The tool schema document (`cairn mcp --schema`, docs/tools.md).
pub fn tool_document() -> serde_json::Value {
    cairn_tools::document()
}
