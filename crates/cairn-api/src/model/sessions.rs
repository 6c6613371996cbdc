//! Wire types of the session routes, mapped from the engine's session
//! records and log entries.

use cairn_session::{Entry, Rewind, SessionRecord, Verified};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct Session {
    /// 12 hex digits.
    pub id: String,
    pub name: String,
    /// `active`, `suspending`, `suspended`, `resuming`, `failed` or `closed`.
    pub state: String,
    pub image: String,
    /// `native` or `gvisor`.
    pub driver: String,
    /// The sandbox running it; none while suspended or closed.
    pub sandbox_id: Option<String>,
    /// The newest snapshot its log records, and the entry recording it.
    pub snapshot_id: Option<String>,
    pub snapshot_seq: Option<u64>,
    /// Stored; the server's idle timer that acts on it is not built yet.
    pub idle_timeout_ms: Option<u64>,
    /// For a fork: its parent, the entry it forked at, and why.
    pub parent_id: Option<String>,
    pub fork_seq: Option<u64>,
    pub fork_reason: Option<String>,
    /// The number of the newest entry (abandoned ones included) and its hash.
    pub head_seq: u64,
    pub head_hash: String,
    pub rewinds: u64,
    /// Why the last resume failed (state `failed`).
    pub error: Option<String>,
    /// Milliseconds since the epoch.
    pub created_at: i64,
    pub updated_at: i64,
}

impl From<SessionRecord> for Session {
    fn from(s: SessionRecord) -> Session {
        Session {
            id: s.id,
            name: s.name,
            state: s.state.to_string(),
            image: s.image,
            driver: s.driver,
            sandbox_id: s.sandbox_id,
            snapshot_id: s.snapshot_id,
            snapshot_seq: s.snapshot_seq,
            idle_timeout_ms: s.idle_timeout_ms,
            parent_id: s.parent_id,
            fork_seq: s.fork_seq,
            fork_reason: s.fork_reason,
            head_seq: s.head_seq,
            head_hash: s.head_hash,
            rewinds: s.rewinds,
            error: s.error,
            created_at: s.created_at,
            updated_at: s.updated_at,
        }
    }
}

#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSession {
    /// Letters, digits, '-' and '_', at most 63 (default `session-<id>`).
    pub name: Option<String>,
    /// Image of its sandbox (default `busybox`).
    pub image: Option<String>,
    /// `native` (default) or `gvisor`.
    pub driver: Option<String>,
    /// Idle timeout in milliseconds, 1000 to 2592000000 (30 days); stored
    /// for the idle timer.
    #[schema(minimum = 1000, maximum = 2592000000u64)]
    pub idle_timeout_ms: Option<u64>,
    /// The network of its sandboxes, across suspends (absent: loopback only).
    pub network: Option<crate::model::NetworkRequest>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct SessionPage {
    pub items: Vec<Session>,
    /// Pass as `after` for the next page; absent on the last one.
    pub next: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct SessionQuery {
    /// Only sessions in this state.
    pub state: Option<String>,
    /// Only sessions on this image.
    pub image: Option<String>,
    /// At most this many (default 100, at most 1000).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<usize>,
    /// The `next` of the previous page.
    pub after: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct CloseQuery {
    /// Also delete the log (refused while the session has forks).
    #[serde(default)]
    pub purge: bool,
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct LogQuery {
    /// The first entry to read (default 1); not with `tail` or `before`.
    #[param(minimum = 1)]
    pub from: Option<u64>,
    /// At most this many from `from`, or before `before` (default 100, at
    /// most 1000).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<usize>,
    /// The last this many entries instead (at most 1000).
    #[param(minimum = 1, maximum = 1000)]
    pub tail: Option<usize>,
    /// The last `limit` entries before this one instead (a page's `prev`):
    /// paging back from a `tail`.
    #[param(minimum = 1)]
    pub before: Option<u64>,
}

/// One entry of a session's context log.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct LogEntry {
    /// 1, 2, 3, … along the session's lineage, with no gap.
    pub seq: u64,
    /// BLAKE3 of the previous entry's hash and this entry (hex).
    pub hash: String,
    /// The version of the encoding the hash covers.
    pub version: u32,
    /// `system`, `user`, `assistant`, `tool_call`, `tool_result`, `note` or `recovered`.
    pub kind: String,
    pub role: Option<String>,
    pub content: Option<String>,
    pub tool: Option<String>,
    /// The tool call's arguments (JSON).
    pub arguments: Option<serde_json::Value>,
    /// A tool's result; for `exec`, JSON with `stdout` and `stderr` (each
    /// the last 32 KiB) and `error` when it did not run.
    pub result: Option<String>,
    pub exit_status: Option<i32>,
    pub tokens_in: Option<u64>,
    pub tokens_out: Option<u64>,
    /// The snapshot holding the machine after this entry, if one was taken.
    pub snapshot_id: Option<String>,
    /// Milliseconds since the epoch.
    pub created_at: i64,
}

impl From<Entry> for LogEntry {
    fn from(e: Entry) -> LogEntry {
        LogEntry {
            seq: e.seq,
            hash: e.hash,
            version: e.version,
            kind: e.kind.to_string(),
            role: e.role,
            content: e.content,
            tool: e.tool,
            // The engine refuses arguments that are not JSON; text that
            // somehow is not goes out as a string rather than failing the read.
            arguments: e
                .arguments
                .map(|a| serde_json::from_str(&a).unwrap_or(serde_json::Value::String(a))),
            result: e.result,
            exit_status: e.exit_status,
            tokens_in: e.tokens_in,
            tokens_out: e.tokens_out,
            snapshot_id: e.snapshot_id,
            created_at: e.created_at,
        }
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct LogPage {
    pub entries: Vec<LogEntry>,
    /// Pass as `from` for the entries after these; absent when there are none yet.
    pub next: Option<u64>,
    /// Of a `tail` or `before` read: pass as `before` for the entries
    /// before these; absent when these begin the log.
    pub prev: Option<u64>,
}

/// A new entry. `seq`, `hash`, `version`, `created_at`, `snapshot_id` and
/// payload references are Cairn's to assign and are refused.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AppendEntry {
    /// `system`, `user`, `assistant`, `tool_call`, `tool_result` or `note`
    /// (`recovered` entries are Cairn's).
    pub kind: String,
    /// `system`, `user`, `assistant` or `tool`.
    pub role: Option<String>,
    pub content: Option<String>,
    /// 1 to 128 characters.
    pub tool: Option<String>,
    /// Any JSON.
    pub arguments: Option<serde_json::Value>,
    pub result: Option<String>,
    pub exit_status: Option<i32>,
    #[schema(maximum = 9007199254740991u64)]
    pub tokens_in: Option<u64>,
    #[schema(maximum = 9007199254740991u64)]
    pub tokens_out: Option<u64>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionExecBody {
    /// The program and its arguments, e.g. `["sh", "-c", "echo hi"]`.
    #[schema(min_items = 1)]
    pub argv: Vec<String>,
    /// Added to the default environment (PATH, HOME, TERM); recorded with
    /// the call.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// Working directory (default `/`).
    pub cwd: Option<String>,
    /// Kill the command after this many seconds (exit code 124).
    pub timeout_secs: Option<f64>,
}

/// What `POST /v1/sessions/{id}/recover` does beyond restoring a dead sandbox.
#[derive(Debug, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RecoverBody {
    /// Run again the exec calls the restore lost, in order, stopping at the
    /// first whose exit status differs from the log's.
    #[serde(default)]
    pub replay: bool,
}

/// One call run again by a replay.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ReplayedCall {
    /// The original call's entry.
    pub call: u64,
    /// Its status as the log recorded it (none if it never finished).
    pub expected: Option<i32>,
    pub status: i32,
    /// The replay's own call entry.
    pub call_seq: u64,
}

/// What a recovery did.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RecoverResult {
    /// The `recovered` entry, when the sandbox had died.
    pub recovered: Option<LogEntry>,
    pub replayed: Vec<ReplayedCall>,
    /// Why replay stopped before the last lost call.
    pub stopped: Option<String>,
    /// The replayed commands' output, as UTF-8 (invalid sequences
    /// replaced), at most 16 MiB each.
    pub stdout: String,
    pub stderr: String,
}

/// How a command run in a session ended, and the entries recording it.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct SessionExecResult {
    /// The shell convention: the exit code, or 128 + the signal; 127 when
    /// the program does not exist, 137 when the sandbox died under it.
    pub exit_code: i32,
    /// Output as UTF-8 (invalid sequences replaced); empty in a stream's
    /// `exit` event, which sent it as it came.
    pub stdout: String,
    pub stderr: String,
    /// Output beyond 16 MiB per stream is not kept here (the log keeps the
    /// last 32 KiB of each).
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    /// Why the command did not run or was cut short, as the log records it.
    pub error: Option<String>,
    /// The `tool_call` and `tool_result` entries.
    pub call_seq: u64,
    pub result_seq: u64,
    /// The `recovered` entry, when the session's sandbox had died and was
    /// restored from its newest snapshot first.
    pub recovered: Option<LogEntry>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionForkBody {
    /// The entry to fork at: the fork's log is the parent's up to it (0: none).
    pub at: u64,
    /// Why, kept with the fork (1 to 1024 characters).
    pub reason: String,
    /// The fork's name (default `session-<id>`).
    pub name: Option<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RewindBody {
    /// The entry the live log goes back to; later ones are abandoned (kept and chained).
    pub to: u64,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct RewindResult {
    /// Entries `to_seq + 1 ..= head_seq` left the live log.
    pub to_seq: u64,
    pub head_seq: u64,
    /// The session's rewinds so far, this one included.
    pub n: u64,
    pub created_at: i64,
}

impl From<Rewind> for RewindResult {
    fn from(r: Rewind) -> RewindResult {
        RewindResult {
            to_seq: r.to_seq,
            head_seq: r.head_seq,
            n: r.n,
            created_at: r.created_at,
        }
    }
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct VerifyResult {
    /// True when every entry is what its chain says.
    pub ok: bool,
    /// The intact entries before the first bad one (all of them when ok).
    pub entries: u64,
    pub head_hash: String,
    /// The first entry that is tampered with or missing.
    pub first_bad: Option<BadEntry>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct BadEntry {
    pub seq: u64,
    /// `tampered (…)` or `missing`.
    pub reason: String,
}

impl From<Verified> for VerifyResult {
    fn from(v: Verified) -> VerifyResult {
        VerifyResult {
            ok: v.first_bad.is_none(),
            entries: v.entries,
            head_hash: v.head_hash,
            first_bad: v.first_bad.map(|(seq, reason)| BadEntry { seq, reason }),
        }
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct SessionImportQuery {
    /// The imported session's name (default: the name it was exported with).
    pub name: Option<String>,
}

/// What an import recorded.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ImportResult {
    /// The new session, suspended.
    pub session: Session,
    /// The session's id where it was exported.
    pub source_id: String,
    pub entries: u64,
    pub snapshots: usize,
    pub objects: usize,
    /// Objects this store did not hold yet.
    pub objects_new: usize,
    /// Why the bundle's image was not recorded, if it was not.
    pub image_note: Option<String>,
}
