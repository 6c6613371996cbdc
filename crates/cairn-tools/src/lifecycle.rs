//! The session lifecycle tools (session_create, session_suspend,
//! session_resume, session_fork, session_close): thin over the engine's
//! session service. Each records who asked and why in the session's
//! context log, as a note (a fork's reason is the fork's own record).

use cairn_engine::Engine;
use cairn_session::prelude::*;
use cairn_session::{Entry, EntryKind, SessionOptions, SessionRecord};
use serde_json::{json, Value};

use crate::args::Lifecycle;
use crate::{ToolError, Tools};

fn described(s: &SessionRecord) -> Value {
    json!({"session": s.id, "name": s.name, "state": s.state.as_str(), "sandbox_id": s.sandbox_id,
           "snapshot_id": s.snapshot_id, "head_seq": s.head_seq})
}

/// Appends "`tool` asked by `caller`: `reason`" to the session's log.
fn note(e: &mut Engine, session: &str, tool: &str, caller: &str, reason: &str) -> Result<(), ToolError> {
    let mut entry = Entry::new(EntryKind::Note);
    entry.content = Some(format!("{tool} asked by {caller}: {reason}"));
    e.append_entry(session, entry)?;
    Ok(())
}

impl Tools {
    pub(crate) fn session_create(
        &self,
        image: Option<String>,
        snapshot_id: Option<&str>,
        name: Option<String>,
        reason: &str,
        caller: &str,
    ) -> Result<Value, ToolError> {
        self.with_engine(|e| {
            let opts = SessionOptions {
                name,
                image,
                driver: None,
                idle_timeout_ms: None,
                network: None,
            };
            let s = match snapshot_id {
                Some(id) => {
                    let snap = e.snapshot_record(id)?;
                    let content = format!("session_create asked by {caller}: {reason}");
                    e.create_session_from(&opts, &snap, &content)?
                }
                None => {
                    let s = e.create_session(&opts, &cairn_engine::Silent)?;
                    if let Err(err) = note(e, &s.id, "session_create", caller, reason) {
                        // No session without its reason: nothing is left.
                        let _ = e.close_session(&s.id, true);
                        return Err(err);
                    }
                    e.session(&s.id)?
                }
            };
            Ok(described(&s))
        })
    }

    /// Suspend, resume or close, the note recorded first (a closed session
    /// takes no more entries; a failed suspend or resume keeps the reason
    /// it was asked for beside its error).
    pub(crate) fn session_lifecycle(
        &self,
        action: Lifecycle,
        session: &str,
        reason: &str,
        caller: &str,
    ) -> Result<Value, ToolError> {
        self.with_engine(|e| {
            let tool = match action {
                Lifecycle::Suspend => "session_suspend",
                Lifecycle::Resume => "session_resume",
                Lifecycle::Close { .. } => "session_close",
            };
            let id = e.session(session)?.id;
            note(e, &id, tool, caller, reason)?;
            let s = match action {
                Lifecycle::Suspend => e.suspend_session(&id)?,
                Lifecycle::Resume => e.resume_session(&id)?,
                Lifecycle::Close { purge } => e.close_session(&id, purge)?,
            };
            Ok(described(&s))
        })
    }

    /// A new session from the parent's whole log so far and its newest
    /// snapshot; the reason is the fork's.
    pub(crate) fn session_fork(
        &self,
        session: &str,
        name: Option<String>,
        reason: &str,
        caller: &str,
    ) -> Result<Value, ToolError> {
        self.with_engine(|e| {
            let parent = e.session(session)?;
            let why = format!("session_fork asked by {caller}: {reason}");
            let child = e.fork_session(&parent.id, parent.head_seq, &why, name)?;
            let mut out = described(&child);
            out["parent"] = parent.id.into();
            out["forked_at"] = parent.head_seq.into();
            Ok(out)
        })
    }
}
