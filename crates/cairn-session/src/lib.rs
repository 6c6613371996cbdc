//! Agent sessions: an append-only, hash-chained context log (`log`, rows
//! in [`cairn_state::session_log`]) beside the sandbox's execution
//! snapshots, with suspend and resume, fork, rewind and recovery of a
//! sandbox that died (`ops`), over the engine's sandboxes and snapshots.
//!
//! The operations are methods of [`cairn_engine::Engine`] through this
//! crate's traits: `use cairn_session::prelude::*` brings them in.

pub mod bundle;
mod files;
pub use cairn_state::session_log as log;
pub(crate) mod ops;
mod recovery;
mod warm;

pub use bundle::{BundleError, ExportSummary, ImportSummary, BUNDLE_MAGIC, BUNDLE_VERSION};
pub use cairn_state::sessions::*;
pub use log::{Entry, EntryKind, Rewind, ENTRY_VERSION, GENESIS, INLINE_MAX};
pub use ops::{ExecOutcome, IdleSweep, LogRange, SessionOptions, Verified};
pub use recovery::{RecoverReport, Replayed};
pub use warm::WarmResumes;

use cairn_engine::EngineError;

/// The traits that make sessions' operations methods of [`cairn_engine::Engine`].
pub mod prelude {
    pub use crate::bundle::SessionBundles;
    pub use crate::files::SessionFiles;
    pub use crate::ops::SessionOps;
    pub use crate::recovery::SessionRecovery;
    pub use crate::warm::SessionResumes;
}

/// The steps the crate's modules share, methods of [`cairn_engine::Engine`] too.
mod steps {
    pub(crate) use crate::ops::OpsSteps;
    pub(crate) use crate::recovery::RecoverySteps;
    pub(crate) use crate::warm::WarmSteps;
}

impl From<SessionError> for EngineError {
    fn from(e: SessionError) -> EngineError {
        EngineError::Domain(Box::new(e))
    }
}

impl From<BundleError> for EngineError {
    fn from(e: BundleError) -> EngineError {
        EngineError::Domain(Box::new(e))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("no session matches {0:?}; `cairn session ls` lists them")]
    NotFound(String),
    #[error("{key:?} matches several sessions ({}); give more of the id", .ids.join(", "))]
    Ambiguous { key: String, ids: Vec<String> },
    #[error("a session named {0:?} already exists; pick another --name")]
    NameTaken(String),
    #[error("invalid session name {0:?}: use letters, digits, '-' and '_', at most 63, not starting with '-'")]
    BadName(String),
    #[error("session {id} cannot go from {from} to {to}")]
    InvalidTransition {
        id: String,
        from: SessionState,
        to: SessionState,
    },
    #[error("session {id} is {state}; {hint}")]
    WrongState {
        id: String,
        state: SessionState,
        hint: &'static str,
    },
    #[error("session {0} is busy: a command runs in it, or another suspend or resume; retry when it ends")]
    Busy(String),
    #[error("session {id}: {reason}")]
    Replay { id: String, reason: String },
    #[error("session {0} changed while this command ran; retry")]
    Conflict(String),
    #[error("session {id} has no entry {seq} on its live branch (its log ends at {head}); `cairn session log {id}` shows it")]
    NoSuchEntry { id: String, seq: u64, head: u64 },
    #[error("session {id}: nothing to rewind, entry {seq} is already the last")]
    NothingToRewind { id: String, seq: u64 },
    #[error("session {id} has forks ({}); remove them first, or close it without --purge", .children.join(", "))]
    HasForks { id: String, children: Vec<String> },
    #[error("{0}")]
    Unsupported(&'static str),
    #[error("invalid log entry: {0}")]
    BadEntry(String),
    #[error("the payload {hash} of session {id}'s entry {seq} cannot be read: {reason}")]
    Payload {
        id: String,
        seq: u64,
        hash: String,
        reason: String,
    },
}
