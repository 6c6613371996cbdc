//! Selective recovery: a session whose sandbox died is restored from its
//! newest snapshot (a `recovered` entry names what was lost), and its lost
//! exec calls can be replayed.

use std::io::Write;

use cairn_protocol::ExecRequest;
use serde::{Deserialize, Serialize};

use crate::ops::LogRange;
use crate::prelude::*;
use crate::steps::*;
use crate::{Entry, EntryKind, SessionError, SessionRecord, SessionState};
use cairn_engine::{Engine, EngineError, SandboxRecord};

/// One tool call run again by `recover --replay`.
#[derive(Debug, Clone, Serialize)]
pub struct Replayed {
    /// The original call's entry.
    pub call: u64,
    /// Its status as the log recorded it (none if it never finished).
    pub expected: Option<i32>,
    pub status: i32,
    /// The replay's own call entry.
    pub call_seq: u64,
}

/// What `recover` did.
#[derive(Debug, Clone, Serialize)]
pub struct RecoverReport {
    /// The `recovered` entry, when the sandbox had died.
    pub recovered: Option<Entry>,
    pub replayed: Vec<Replayed>,
    /// Why replay stopped before the last lost call.
    pub stopped: Option<String>,
}

/// The result entry of `call` among `entries`: the one naming it, or for
/// entries written without that link (appended by a caller), the first
/// result of the same tool after it.
fn result_of<'a>(entries: &'a [Entry], call: &Entry) -> Option<&'a Entry> {
    let names = |e: &Entry| -> Option<u64> {
        let body: serde_json::Value = serde_json::from_str(e.result.as_deref()?).ok()?;
        body["call"].as_u64()
    };
    let results = || {
        entries
            .iter()
            .filter(|e| e.seq > call.seq && e.kind == EntryKind::ToolResult)
    };
    results()
        .find(|e| names(e) == Some(call.seq))
        .or_else(|| results().find(|e| e.tool == call.tool && names(e).is_none()))
}

/// An exec call's arguments as the log records them.
#[derive(Deserialize)]
struct RecordedExec {
    argv: Vec<String>,
    #[serde(default)]
    env: Vec<(String, String)>,
    #[serde(default)]
    cwd: Option<String>,
    #[serde(default)]
    timeout_ms: Option<u64>,
}

/// A session's sandbox that died, recovered: restored from its newest\nsnapshot and the log's calls since replayed.
pub trait SessionRecovery {
    /// Restores a session whose sandbox died (as the next call would) and,
    /// with `replay`, runs again the tool calls whose effects the restore
    /// lost, in order, each recorded anew with `replay_of` naming the
    /// original, stopping at the first whose exit status differs from the
    /// one the log recorded. Replay only follows a recovery directly: once
    /// other calls have run on the restored machine, it refuses.
    fn recover_session(
        &mut self,
        key: &str,
        replay: bool,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<RecoverReport, EngineError>;
}

impl SessionRecovery for Engine {
    fn recover_session(
        &mut self,
        key: &str,
        replay: bool,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<RecoverReport, EngineError> {
        let live = self.live_session(key)?;
        let mut report = RecoverReport {
            recovered: live.recovered.clone(),
            replayed: Vec::new(),
            stopped: None,
        };
        if !replay {
            return Ok(report);
        }
        let s = live.session.clone();
        let Some(rec) = self.newest_recovery(&s)? else {
            return Err(SessionError::Replay {
                id: s.id.clone(),
                reason: format!(
                    "nothing to replay: its sandbox {} runs and the log records no recovery",
                    live.sandbox.id
                ),
            }
            .into());
        };
        let detail: serde_json::Value = rec
            .result
            .as_deref()
            .and_then(|r| serde_json::from_str(r).ok())
            .unwrap_or_default();
        let since = detail["snapshot_seq"].as_u64().unwrap_or(0);
        let lost: Vec<u64> = detail["lost_calls"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
            .unwrap_or_default();
        let after = self.session_log(
            &s,
            LogRange::From {
                from: rec.seq + 1,
                count: usize::MAX >> 1,
            },
        )?;
        if let Some(call) = after.iter().find(|e| e.kind == EntryKind::ToolCall) {
            return Err(SessionError::Replay {
                id: s.id.clone(),
                reason: format!(
                    "entry {} ran a call on the restored machine after the recovery at entry {}; replay only follows a recovery directly (fork at entry {} to replay from there)",
                    call.seq, rec.seq, rec.seq
                ),
            }
            .into());
        }
        let before = self.session_log(
            &s,
            LogRange::From {
                from: since + 1,
                count: (rec.seq - since) as usize,
            },
        )?;
        for seq in lost {
            let Some(call) = before.iter().find(|e| e.seq == seq && e.kind == EntryKind::ToolCall) else {
                report.stopped = Some(format!("entry {seq} is not a tool call on the live log"));
                break;
            };
            let expected = result_of(&before, call).and_then(|r| r.exit_status);
            let args: serde_json::Value = call
                .arguments
                .as_deref()
                .and_then(|a| serde_json::from_str(a).ok())
                .unwrap_or_default();
            let req = serde_json::from_value::<RecordedExec>(args).ok().map(|r| ExecRequest {
                argv: r.argv,
                env: r.env,
                cwd: r.cwd,
                stdin: false,
                timeout_ms: r.timeout_ms,
                detach: false,
                user: None,
            });
            let (Some("exec"), Some(req)) = (call.tool.as_deref(), req.filter(|r| !r.argv.is_empty())) else {
                report.stopped = Some(format!(
                    "entry {seq} is a {} call, which cannot be replayed (only exec calls are; the log keeps a written file's hash, not its bytes)",
                    call.tool.as_deref().unwrap_or("tool")
                ));
                break;
            };
            let mut extra = serde_json::Map::new();
            extra.insert("replay_of".into(), seq.into());
            let done = self.exec_live(&live, req, extra, stdout, stderr)?;
            let diverged = expected.is_some_and(|x| x != done.status);
            report.replayed.push(Replayed {
                call: seq,
                expected,
                status: done.status,
                call_seq: done.call_seq,
            });
            if diverged {
                report.stopped = Some(format!(
                    "entry {seq} exited {} on replay, the log says {}",
                    done.status,
                    expected.unwrap_or_default()
                ));
                break;
            }
        }
        Ok(report)
    }
}

pub(crate) trait RecoverySteps {
    /// The newest `recovered` entry on the live log.
    fn newest_recovery(&self, s: &SessionRecord) -> Result<Option<Entry>, EngineError>;

    /// Replaces a dead sandbox with a restore of the newest snapshot and
    /// records what was lost.
    fn recover(&mut self, s: &SessionRecord) -> Result<(SandboxRecord, Entry), EngineError>;
}

impl RecoverySteps for Engine {
    fn newest_recovery(&self, s: &SessionRecord) -> Result<Option<Entry>, EngineError> {
        let mut n = 256;
        loop {
            let tail = self.session_log(s, LogRange::Tail(n))?;
            if let Some(e) = tail.iter().rev().find(|e| e.kind == EntryKind::Recovered) {
                return Ok(Some(e.clone()));
            }
            if tail.len() < n {
                return Ok(None);
            }
            n *= 8;
        }
    }

    fn recover(&mut self, s: &SessionRecord) -> Result<(SandboxRecord, Entry), EngineError> {
        let snap = self.snapshot_at(s, s.head_seq)?;
        let since = snap.as_ref().map_or(0, |e| e.seq);
        let lost: Vec<u64> = self
            .session_log(
                s,
                LogRange::From {
                    from: since + 1,
                    count: usize::MAX >> 1,
                },
            )?
            .iter()
            .filter(|e| e.kind == EntryKind::ToolCall)
            .map(|e| e.seq)
            .collect();
        let dead = s.sandbox_id.clone();
        if let Some(old) = self.session_sandbox(s) {
            self.remove_sandbox(&old, true)?;
        }
        let snapshot = snap.as_ref().and_then(|e| e.snapshot_id.clone());
        let fresh = self.sandbox_from(s, &s.id, snapshot.as_deref())?;
        let won = self.db().set_session_sandbox(
            &s.id,
            SessionState::Active,
            (s.owner_pid, s.owner_start),
            Some(&fresh.id),
        )?;
        if !won {
            let _ = self.remove_sandbox(&fresh, true);
            return Err(SessionError::Conflict(s.id.clone()).into());
        }
        let mut e = Entry::new(EntryKind::Recovered);
        e.content = Some(format!(
            "sandbox {} died; restored {} into sandbox {}; lost the effects of tool calls {:?}",
            dead.as_deref().unwrap_or("-"),
            snapshot
                .as_deref()
                .map_or("the image".to_string(), |id| format!("snapshot {id}")),
            fresh.id,
            lost
        ));
        e.result = Some(
            serde_json::json!({ "dead_sandbox": dead, "snapshot": snapshot, "snapshot_seq": since, "lost_calls": lost })
                .to_string(),
        );
        e.snapshot_id = snapshot;
        let e = self.session_append(s, e)?;
        Ok((fresh, e))
    }
}
