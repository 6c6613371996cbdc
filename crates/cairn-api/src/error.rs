//! One error shape, `{"error": {"code", "message"}}`, and the one mapping
//! from engine errors to HTTP statuses.

use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use cairn_engine::access::AccessError;
use cairn_engine::tenants::TenantError;
use cairn_engine::{EngineError, ImageError, SnapshotError, StateError};
use cairn_pipeline::run::RunError;
use cairn_sandbox::client::ClientError;
use cairn_session::{BundleError, SessionError};
use serde::Serialize;
use utoipa::ToSchema;

/// What every failed request answers.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable, machine-readable: `bad_request` (400, and 422 for an
    /// idempotency key reused with another body), `unauthorized` (401),
    /// `forbidden` (403), `not_found` (404), `conflict` (409), `too_large`
    /// (413), `unavailable` (503), `internal` (500).
    pub code: String,
    /// What went wrong and what to do, for a person.
    pub message: String,
}

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, message)
    }
    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, message)
    }
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    pub fn code(&self) -> &'static str {
        code_of(self.status)
    }
}

pub fn code_of(status: StatusCode) -> &'static str {
    match status {
        StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY => "bad_request",
        StatusCode::UNAUTHORIZED => "unauthorized",
        StatusCode::FORBIDDEN => "forbidden",
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::CONFLICT => "conflict",
        StatusCode::PAYLOAD_TOO_LARGE => "too_large",
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        StatusCode::NOT_IMPLEMENTED => "not_supported",
        StatusCode::TOO_MANY_REQUESTS => "no_capacity",
        StatusCode::SERVICE_UNAVAILABLE => "unavailable",
        _ => "internal",
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(status = %self.status, "{}", self.message);
        }
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code().into(),
                message: self.message,
            },
        };
        let mut resp = (self.status, Json(body)).into_response();
        close_after_refused_body(&mut resp);
        resp
    }
}

/// A body refused for its size is left unread, so the connection cannot
/// carry another request: say so, or a client that pools connections sends
/// its next request into one the server is closing.
pub(crate) fn close_after_refused_body(resp: &mut Response) {
    if resp.status() == StatusCode::PAYLOAD_TOO_LARGE {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
}

/// The status an error of a layer above the engine (a run's, a
/// session's, a bundle's) answers with.
fn domain_status(e: &EngineError) -> StatusCode {
    use StatusCode as S;
    if let Some(r) = e.domain::<RunError>() {
        return match r {
            RunError::NoSuchRun(_)
            | RunError::NoSuchDeadLetter(_)
            | RunError::NoSuchArtifact(_)
            | RunError::NoSuchStage(_) => S::NOT_FOUND,
            RunError::Spec(_)
            | RunError::BadParam(_)
            | RunError::BadRunId(_)
            | RunError::BadReason(_)
            | RunError::NoModel(_) => S::BAD_REQUEST,
            RunError::Completed(_)
            | RunError::AlreadyRetried(_)
            | RunError::Busy { .. }
            | RunError::Queued { .. }
            | RunError::NotAwaitingApproval(_) => S::CONFLICT,
            RunError::Model(_) => S::SERVICE_UNAVAILABLE,
            _ => S::INTERNAL_SERVER_ERROR,
        };
    }
    if let Some(b) = e.domain::<BundleError>() {
        return match b {
            BundleError::Io { .. } => S::INTERNAL_SERVER_ERROR,
            BundleError::OverCap(_) => S::PAYLOAD_TOO_LARGE,
            BundleError::SourceLog { .. } | BundleError::SourceSnapshot { .. } => S::CONFLICT,
            _ => S::BAD_REQUEST,
        };
    }
    if let Some(s) = e.domain::<SessionError>() {
        use SessionError as E;
        return match s {
            E::NotFound(_) | E::NoSuchEntry { .. } => S::NOT_FOUND,
            E::Ambiguous { .. } | E::BadName(_) | E::BadEntry(_) | E::Unsupported(_) => S::BAD_REQUEST,
            E::NameTaken(_)
            | E::InvalidTransition { .. }
            | E::WrongState { .. }
            | E::Conflict(_)
            | E::Busy(_)
            | E::Replay { .. }
            | E::NothingToRewind { .. }
            | E::HasForks { .. } => S::CONFLICT,
            _ => S::INTERNAL_SERVER_ERROR,
        };
    }
    S::INTERNAL_SERVER_ERROR
}

/// The status an engine error answers with.
fn status_of(e: &EngineError) -> StatusCode {
    use StatusCode as S;
    match e {
        EngineError::NoSuchSandbox(_) => S::NOT_FOUND,
        EngineError::NoSuchUser { .. } => S::BAD_REQUEST,
        EngineError::AmbiguousSandbox { .. } | EngineError::BadName(_) | EngineError::UnknownDriver(_) => {
            S::BAD_REQUEST
        }
        EngineError::NotRunning { .. } | EngineError::InitGone { .. } | EngineError::StillRunning(_) => S::CONFLICT,
        EngineError::DiskDefault { .. } => S::INTERNAL_SERVER_ERROR,
        EngineError::NoMemorySnapshots { .. } | EngineError::CannotPrepare { .. } => S::BAD_REQUEST,
        // This host cannot do it; another one can.
        EngineError::IncompatibleMemoryImage { .. } => S::CONFLICT,
        EngineError::DriverUnavailable(_) => S::SERVICE_UNAVAILABLE,
        EngineError::Network(n) => {
            use cairn_sandbox::net::NetError as N;
            match n {
                N::Invalid(_) | N::Resolve { .. } => S::BAD_REQUEST,
                N::MissingTool { .. } | N::Exhausted { .. } => S::SERVICE_UNAVAILABLE,
                N::Host { .. } => S::INTERNAL_SERVER_ERROR,
            }
        }
        EngineError::Service { .. } => S::BAD_REQUEST,
        EngineError::Snapshot(s) => match s {
            SnapshotError::NotFound(_) => S::NOT_FOUND,
            SnapshotError::Ambiguous { .. } | SnapshotError::BadLabel(_) | SnapshotError::BadCount(_) => S::BAD_REQUEST,
            SnapshotError::NotSnapshottable { .. }
            | SnapshotError::NeededByPipeline(_)
            | SnapshotError::NeededBySession(_) => S::CONFLICT,
            _ => S::INTERNAL_SERVER_ERROR,
        },
        EngineError::View(v) => {
            use cairn_engine::snapshot_view::ViewError as V;
            match v {
                V::BadPath(_) => S::BAD_REQUEST,
                V::Missing { .. } | V::BelowSymlink { .. } | V::BelowNonDirectory { .. } => S::NOT_FOUND,
                V::TooLarge { .. } => S::PAYLOAD_TOO_LARGE,
            }
        }
        EngineError::Image(i) => match i {
            ImageError::NotFound(_) => S::NOT_FOUND,
            ImageError::Shared(_) => S::FORBIDDEN,
            ImageError::BadName(_) | ImageError::Import { .. } => S::BAD_REQUEST,
            ImageError::MissingTool { .. } => S::SERVICE_UNAVAILABLE,
            _ => S::INTERNAL_SERVER_ERROR,
        },
        EngineError::Domain(_) => domain_status(e),
        EngineError::Access(a) => match a {
            AccessError::NoSuchToken(_) => S::NOT_FOUND,
            AccessError::BadTokenName(_) => S::BAD_REQUEST,
        },
        EngineError::Tenant(t) => match t {
            TenantError::NoSuchTenant(_) => S::NOT_FOUND,
            TenantError::Exists(_) | TenantError::StillOwns { .. } => S::CONFLICT,
            TenantError::BadName(_) => S::BAD_REQUEST,
        },
        EngineError::State(s) => match s {
            StateError::NameTaken(_) | StateError::NameOfAnother(_) => S::CONFLICT,
            StateError::TenantLimit { .. } => S::TOO_MANY_REQUESTS,
            StateError::TenantGone(_) => S::UNAUTHORIZED,
            StateError::InvalidTransition { .. } | StateError::Conflict(_) | StateError::Fenced { .. } => S::CONFLICT,
            _ => S::INTERNAL_SERVER_ERROR,
        },
        EngineError::Client(c) => client_status(c),
        EngineError::Diff(d) => match d {
            cairn_engine::DiffError::Unknown(_) => S::NOT_FOUND,
            cairn_engine::DiffError::NoSnapshot { .. } => S::CONFLICT,
        },
        _ => S::INTERNAL_SERVER_ERROR,
    }
}

/// Init's answers about files name the errno's text; those are the
/// client's mistakes, not the server's.
pub fn client_status(c: &ClientError) -> StatusCode {
    use cairn_protocol::FsErrorKind as K;
    match c {
        ClientError::Fs(f) => match f.kind {
            K::NotFound => StatusCode::NOT_FOUND,
            K::Exists | K::NotEmpty => StatusCode::CONFLICT,
            K::PermissionDenied => StatusCode::FORBIDDEN,
            K::NotADirectory | K::IsADirectory | K::Invalid => StatusCode::BAD_REQUEST,
            _ => StatusCode::BAD_GATEWAY,
        },
        ClientError::NotRunning(_) => StatusCode::CONFLICT,
        ClientError::TimedOut => StatusCode::GATEWAY_TIMEOUT,
        ClientError::Refused(m) if m.contains("No such file") || m.contains("not found") => StatusCode::NOT_FOUND,
        ClientError::Refused(_) => StatusCode::BAD_REQUEST,
        _ => StatusCode::BAD_GATEWAY,
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> ApiError {
        ApiError::new(status_of(&e), e.to_string())
    }
}

impl From<ClientError> for ApiError {
    fn from(e: ClientError) -> ApiError {
        ApiError::new(client_status(&e), e.to_string())
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> ApiError {
        let status = match r {
            JsonRejection::MissingJsonContentType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            JsonRejection::BytesRejection(_) => StatusCode::PAYLOAD_TOO_LARGE,
            _ => StatusCode::BAD_REQUEST,
        };
        ApiError::new(status, format!("invalid JSON body: {}", r.body_text()))
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> ApiError {
        ApiError::bad_request(format!("invalid query: {}", r.body_text()))
    }
}

pub type ApiResult<T> = Result<T, ApiError>;
