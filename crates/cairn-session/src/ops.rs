//! The session service: create, append, read, exec, suspend, resume,
//! fork, rewind, verify, close.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;

use nix::fcntl::{Flock, FlockArg};

use cairn_engine::objects::PayloadObject;
use cairn_protocol::ExecRequest;
use cairn_store::{ChunkHash, ReadContext};
use serde::Serialize;

use crate::log::{Order, Segment};
use crate::steps::*;
use crate::{Entry, EntryKind, SessionError, SessionRecord, SessionState, GENESIS, INLINE_MAX};
use cairn_engine::sandboxes::me;
use cairn_engine::state::{SandboxState, StateError};
use cairn_engine::{CreateOptions, Engine, EngineError, Progress, SandboxRecord};

/// What `cairn session create` asks for.
#[derive(Debug, Clone, Default)]
pub struct SessionOptions {
    pub name: Option<String>,
    pub image: Option<String>,
    pub driver: Option<String>,
    pub idle_timeout_ms: Option<u64>,
    /// The network of the session's sandboxes, kept across suspends.
    pub network: Option<cairn_sandbox::net::NetPolicy>,
}

/// Which entries of the live log to read.
#[derive(Debug, Clone, Copy)]
pub enum LogRange {
    /// `count` entries from seq `from` on.
    From { from: u64, count: usize },
    /// The last `n` entries.
    Tail(usize),
    /// The last `count` entries before seq `before` (paging back).
    Before { before: u64, count: usize },
}

/// What an exec in a session did.
#[derive(Debug, Clone, Serialize)]
pub struct ExecOutcome {
    /// The command's status as a shell gives it.
    pub status: i32,
    pub call_seq: u64,
    pub result_seq: u64,
    /// The `recovered` entry, when the sandbox had died and was restored.
    pub recovered: Option<Entry>,
}

/// What one round of the idle timer did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct IdleSweep {
    pub suspended: Vec<String>,
    /// Sessions whose suspend failed, and why.
    pub failed: Vec<(String, String)>,
}

/// A session held for calls on its running sandbox (the session's lock,
/// shared): it is not suspended or closed while this lives.
pub(crate) struct Live {
    pub session: SessionRecord,
    pub sandbox: SandboxRecord,
    /// The `recovered` entry, when taking hold restored a dead sandbox.
    pub recovered: Option<Entry>,
    _lock: Flock<File>,
}

/// The outcome of walking a session's hash chain.
#[derive(Debug, Clone, Serialize)]
pub struct Verified {
    pub entries: u64,
    pub head_hash: String,
    /// The first entry that is not what its chain says, and why.
    pub first_bad: Option<(u64, String)>,
}

/// The newest bytes of a stream, at most `cap`.
struct Tail {
    bytes: VecDeque<u8>,
    cap: usize,
}

impl Tail {
    fn new(cap: usize) -> Tail {
        Tail {
            bytes: VecDeque::new(),
            cap,
        }
    }
    fn text(mut self) -> String {
        String::from_utf8_lossy(self.bytes.make_contiguous()).into_owned()
    }
}

/// Output to the caller and into a bounded tail.
struct Tee<'a> {
    out: &'a mut dyn Write,
    tail: &'a mut Tail,
}

impl Write for Tee<'_> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let n = data.len();
        self.out.write_all(data)?;
        let data = &data[data.len().saturating_sub(self.tail.cap)..];
        let excess = (self.tail.bytes.len() + data.len()).saturating_sub(self.tail.cap);
        self.tail.bytes.drain(..excess);
        self.tail.bytes.extend(data);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// Seq ranges `(lo, hi]` a rewind took off the live branch.
pub(crate) type Hidden = Vec<(u64, u64)>;

pub(crate) fn new_session_id() -> String {
    cairn_engine::random_hex(6)
}

/// Whether a sandbox runs: its row says so and its init is there (a
/// long-lived server sees an init die without a command reconciling rows).
fn alive(r: &SandboxRecord) -> bool {
    r.state == SandboxState::Running && cairn_engine::sandboxes::process_of(r).is_some_and(|p| p.alive())
}

/// The name of a session's sandbox (one at a time).
fn sandbox_name(session: &str) -> String {
    format!("session-{session}")
}

/// How a sandbox for session `id` is made: `s`'s image, driver and
/// network (`s` is the parent's record, changed, for a fork), named for
/// the session.
pub(super) fn session_sandbox_options(s: &SessionRecord, id: &str) -> CreateOptions {
    CreateOptions {
        image: Some(s.image.clone()),
        driver: Some(s.driver.clone()),
        name: Some(sandbox_name(id)),
        network: Some(s.network.clone().unwrap_or_default()),
        ..CreateOptions::default()
    }
}

pub(crate) fn valid_name(name: &str) -> bool {
    cairn_engine::names::valid(name)
}

fn conflict(e: StateError, id: &str) -> EngineError {
    match e {
        StateError::Conflict(_) => SessionError::Conflict(id.to_string()).into(),
        other => other.into(),
    }
}

/// Sessions: create, exec, suspend and resume, fork, rewind, close; the\nlog read back and verified.
pub trait SessionOps {
    /// Finds a session by name, id or unique id prefix.
    fn session(&self, key: &str) -> Result<SessionRecord, EngineError>;

    fn sessions(&self) -> Result<Vec<SessionRecord>, EngineError>;

    /// Creates a session and its sandbox. On error nothing is left.
    fn create_session(&mut self, opts: &SessionOptions, progress: &dyn Progress) -> Result<SessionRecord, EngineError>;

    /// Creates a session whose sandbox is restored from `snap` (files;
    /// memory too for a gVisor memory snapshot); its log starts with a
    /// `note` naming the snapshot, with `content`, so that suspend, resume
    /// and recovery start from it rather than from the image.
    fn create_session_from(
        &mut self,
        opts: &SessionOptions,
        snap: &cairn_engine::SnapshotRecord,
        content: &str,
    ) -> Result<SessionRecord, EngineError>;

    /// Appends one entry (large payloads go to the chunk store).
    fn session_append(&self, s: &SessionRecord, entry: Entry) -> Result<Entry, EngineError>;

    /// Appends many entries in one transaction (a bulk load). Each must
    /// fit its row: a payload above 64 KiB is refused, not stored aside.
    fn session_append_batch(&self, s: &SessionRecord, entries: &[Entry]) -> Result<Vec<Entry>, EngineError>;

    /// Reads the live log (abandoned entries are skipped), with payloads.
    fn session_log(&self, s: &SessionRecord, range: LogRange) -> Result<Vec<Entry>, EngineError>;

    /// Walks the whole chain (abandoned entries included, they are linked
    /// too) and names the first entry that is tampered with or missing.
    fn verify_session(&self, s: &SessionRecord) -> Result<Verified, EngineError>;

    /// Runs a command in the session's sandbox and records a `tool_call`
    /// and a `tool_result` entry. A suspended session is resumed first; a
    /// sandbox that died is restored from the newest snapshot with a
    /// `recovered` entry naming the calls whose effects were lost.
    fn session_exec(
        &mut self,
        key: &str,
        argv: Vec<String>,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<ExecOutcome, EngineError>;

    /// [`Self::session_exec`] with an environment, a working directory
    /// and a timeout; all of them go into the call's arguments, so a
    /// replay runs the same command the same way. Stdin and detached
    /// commands are refused: the log could not record what they did.
    fn session_exec_request(
        &mut self,
        key: &str,
        req: ExecRequest,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<ExecOutcome, EngineError>;

    /// [`Self::session_exec_request`] with `notes` (who asked, the reason
    /// a model gave) recorded among the call's arguments; a replay runs the
    /// command alone.
    fn session_exec_noted(
        &mut self,
        key: &str,
        req: ExecRequest,
        notes: serde_json::Map<String, serde_json::Value>,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<ExecOutcome, EngineError>;

    /// Appends an entry given by a caller (the CLI, the API). A `user`
    /// message to a suspended session also resumes it, so the machine is
    /// ready when the agent acts on the message: the entry is recorded
    /// first, and a resume that fails leaves the session `failed` with its
    /// error (the next call reports it) without losing the message.
    fn append_entry(&mut self, key: &str, entry: Entry) -> Result<Entry, EngineError>;

    /// Snapshots a session's sandbox while it keeps running (resuming a
    /// suspended session first) and records the snapshot in its log as a
    /// note with `content`: a point a stage can fork and the session can be
    /// forked or rewound to.
    fn snapshot_session(
        &mut self,
        key: &str,
        label: Option<&str>,
        content: &str,
    ) -> Result<cairn_engine::SnapshotRecord, EngineError>;

    /// Snapshots the sandbox, records the snapshot in the log, removes the
    /// sandbox. The snapshot is recorded before the sandbox goes, so a kill
    /// at any instant leaves the sandbox or the snapshot to resume from.
    /// A session busy with a command (or another suspend or resume) is
    /// [`SessionError::Busy`]: suspend does not wait for a command that may
    /// run for hours.
    fn suspend_session(&mut self, key: &str) -> Result<SessionRecord, EngineError>;

    /// Suspends every active session idle for its idle timeout (no change
    /// to it for that long, and no command running in it), as of `now`
    /// (milliseconds since the epoch). A session that is busy is left for
    /// the next round. Returns the ids suspended and the failures.
    fn suspend_idle_sessions(&mut self, now: i64) -> Result<IdleSweep, EngineError>;

    /// Gives a suspended session a sandbox again: its running sandbox if an
    /// interrupted suspend left one, else a restore of its newest snapshot.
    /// Also finishes a suspend or resume whose process died, and retries a
    /// failed resume.
    fn resume_session(&mut self, key: &str) -> Result<SessionRecord, EngineError>;

    /// A new session whose log is the parent's live log up to `at` (shared,
    /// not copied) and whose sandbox is a restore of the snapshot recorded
    /// at or before `at` (or a fresh one from the image if none was).
    fn fork_session(
        &mut self,
        key: &str,
        at: u64,
        reason: &str,
        name: Option<String>,
    ) -> Result<SessionRecord, EngineError>;

    /// Moves the live branch back to entry `to`: the later entries stay in
    /// the log (and in its chain), abandoned; new entries follow them.
    fn rewind_session(&self, key: &str, to: u64) -> Result<crate::Rewind, EngineError>;

    /// Closes a session: its sandbox goes; its log stays unless `purge`.
    fn close_session(&mut self, key: &str, purge: bool) -> Result<SessionRecord, EngineError>;

    /// Removes a tenant ([`cairn_engine::Engine::remove_tenant_with`]): refused while it
    /// owns sandboxes or open sessions, unless `force`, which removes those
    /// sandboxes and closes those sessions first.
    fn remove_tenant(&mut self, name: &str, force: bool) -> Result<(), EngineError>;
}

impl SessionOps for Engine {
    fn session(&self, key: &str) -> Result<SessionRecord, EngineError> {
        let mut found = self.db().find_sessions(key)?;
        match found.len() {
            0 => Err(SessionError::NotFound(key.to_string()).into()),
            1 => Ok(found.remove(0)),
            _ => Err(SessionError::Ambiguous {
                key: key.to_string(),
                ids: found.into_iter().map(|s| s.id).collect(),
            }
            .into()),
        }
    }

    fn sessions(&self) -> Result<Vec<SessionRecord>, EngineError> {
        Ok(self.db().sessions()?)
    }

    fn create_session(&mut self, opts: &SessionOptions, progress: &dyn Progress) -> Result<SessionRecord, EngineError> {
        self.new_session(opts, None, progress)
    }

    fn create_session_from(
        &mut self,
        opts: &SessionOptions,
        snap: &cairn_engine::SnapshotRecord,
        content: &str,
    ) -> Result<SessionRecord, EngineError> {
        let rec = self.new_session(opts, Some(snap), &cairn_engine::Silent)?;
        let mut note = Entry::new(EntryKind::Note);
        note.content = Some(format!("restored snapshot {}: {content}", snap.id));
        note.snapshot_id = Some(snap.id.clone());
        if let Err(e) = self.session_append(&rec, note) {
            let _ = self.close_session(&rec.id, true);
            return Err(e);
        }
        self.session(&rec.id)
    }

    fn session_append(&self, s: &SessionRecord, entry: Entry) -> Result<Entry, EngineError> {
        if s.state == SessionState::Closed {
            return Err(SessionError::WrongState {
                id: s.id.clone(),
                state: s.state,
                hint: "a closed session's log is read-only",
            }
            .into());
        }
        if let Some(a) = &entry.arguments {
            serde_json::from_str::<serde_json::Value>(a)
                .map_err(|e| SessionError::BadEntry(format!("arguments are not JSON: {e}")))?;
        }
        if entry.content_ref.is_some() || entry.result_ref.is_some() {
            return Err(SessionError::BadEntry("content_ref and result_ref are set by Cairn, not given".into()).into());
        }
        // Chunks stored before the row that names them is committed are
        // garbage to the collector; it waits for this lock.
        let _lock = self.lock_store(false)?;
        let mut entry = entry;
        if entry.content.as_ref().is_some_and(|c| c.len() > INLINE_MAX) {
            entry.content_ref = Some(self.put_payload(entry.content.take().unwrap_or_default())?);
        }
        if entry.result.as_ref().is_some_and(|c| c.len() > INLINE_MAX) {
            entry.result_ref = Some(self.put_payload(entry.result.take().unwrap_or_default())?);
        }
        let mut out = self
            .db()
            .append_entries(&s.id, &[entry])
            .map_err(|e| conflict(e, &s.id))?;
        Ok(out.remove(0))
    }

    fn session_append_batch(&self, s: &SessionRecord, entries: &[Entry]) -> Result<Vec<Entry>, EngineError> {
        if s.state == SessionState::Closed {
            return Err(SessionError::WrongState {
                id: s.id.clone(),
                state: s.state,
                hint: "a closed session's log is read-only",
            }
            .into());
        }
        for e in entries {
            if e.content_ref.is_some() || e.result_ref.is_some() {
                return Err(
                    SessionError::BadEntry("content_ref and result_ref are set by Cairn, not given".into()).into(),
                );
            }
            if [&e.content, &e.result]
                .iter()
                .any(|p| p.as_ref().is_some_and(|c| c.len() > INLINE_MAX))
            {
                return Err(SessionError::BadEntry(
                    "a batched entry's payload is above 64 KiB; append it alone".into(),
                )
                .into());
            }
            if let Some(a) = &e.arguments {
                serde_json::from_str::<serde_json::Value>(a)
                    .map_err(|err| SessionError::BadEntry(format!("arguments are not JSON: {err}")))?;
            }
        }
        self.db().append_entries(&s.id, entries).map_err(|e| conflict(e, &s.id))
    }

    fn session_log(&self, s: &SessionRecord, range: LogRange) -> Result<Vec<Entry>, EngineError> {
        let (segments, hidden) = self.lineage(s)?;
        let mut out = match range {
            LogRange::From { from, count } => {
                self.db()
                    .read_entries(&segments, &hidden, Order::Ascending { from }, count, false)?
            }
            LogRange::Tail(n) => {
                let mut v = self
                    .db()
                    .read_entries(&segments, &hidden, Order::Descending, n, false)?;
                v.reverse();
                v
            }
            LogRange::Before { before, count } => {
                let mut v = self
                    .db()
                    .read_entries(&segments, &hidden, Order::Below { before }, count, false)?;
                v.reverse();
                v
            }
        };
        for e in &mut out {
            if let Some(h) = e.content_ref.clone() {
                e.content = Some(self.get_payload(&s.id, e.seq, &h)?);
            }
            if let Some(h) = e.result_ref.clone() {
                e.result = Some(self.get_payload(&s.id, e.seq, &h)?);
            }
        }
        Ok(out)
    }

    fn verify_session(&self, s: &SessionRecord) -> Result<Verified, EngineError> {
        let mut segments = Vec::new();
        let mut cur = s.clone();
        let mut cap = u64::MAX;
        loop {
            let lo = cur.fork_seq.unwrap_or(0);
            segments.push(Segment {
                session: cur.id.clone(),
                lo,
                hi: cap.min(cur.head_seq),
            });
            let Some(parent) = cur.parent_id.clone() else { break };
            cap = cap.min(lo);
            cur = self
                .db()
                .session_by_id(&parent)?
                .ok_or_else(|| StateError::Damaged(format!("session {} names a missing parent {parent}", cur.id)))?;
        }
        segments.reverse();
        let mut previous = GENESIS.to_string();
        let mut expected = 1u64;
        let bad = |seq: u64, why: String| {
            Ok(Verified {
                entries: seq - 1,
                head_hash: s.head_hash.clone(),
                first_bad: Some((seq, why)),
            })
        };
        for seg in &segments {
            loop {
                let rows = self.db().raw_entries(seg, expected, 1000)?;
                if rows.is_empty() {
                    break;
                }
                for e in rows {
                    if e.seq != expected {
                        return bad(expected, "missing".into());
                    }
                    let hash = e.chain(&previous);
                    if hash != e.hash || e.version != crate::ENTRY_VERSION {
                        return bad(
                            e.seq,
                            format!("tampered (its hash should be {hash}, the row says {})", e.hash),
                        );
                    }
                    previous = hash;
                    expected += 1;
                }
            }
            if expected <= seg.hi {
                return bad(expected, "missing".into());
            }
        }
        if previous != s.head_hash {
            return bad(expected, "missing (the session's head names a later entry)".into());
        }
        Ok(Verified {
            entries: expected - 1,
            head_hash: previous,
            first_bad: None,
        })
    }

    fn session_exec(
        &mut self,
        key: &str,
        argv: Vec<String>,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<ExecOutcome, EngineError> {
        let req = ExecRequest {
            argv,
            env: Vec::new(),
            cwd: None,
            stdin: false,
            timeout_ms: None,
            detach: false,
            user: None,
        };
        self.session_exec_request(key, req, stdout, stderr)
    }

    fn session_exec_request(
        &mut self,
        key: &str,
        req: ExecRequest,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<ExecOutcome, EngineError> {
        self.session_exec_noted(key, req, serde_json::Map::new(), stdout, stderr)
    }

    fn session_exec_noted(
        &mut self,
        key: &str,
        req: ExecRequest,
        notes: serde_json::Map<String, serde_json::Value>,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<ExecOutcome, EngineError> {
        if req.stdin || req.detach {
            return Err(SessionError::Unsupported(
                "a session's exec takes no stdin and cannot detach (the log records each call's output and status); write input to a file first, or run a background command in a plain sandbox",
            )
            .into());
        }
        if req.argv.is_empty() {
            return Err(SessionError::Unsupported("exec needs a command").into());
        }
        let live = self.live_session(key)?;
        self.exec_live(&live, req, notes, stdout, stderr)
    }

    fn append_entry(&mut self, key: &str, entry: Entry) -> Result<Entry, EngineError> {
        let s = self.session(key)?;
        let wake = entry.kind == EntryKind::User && s.state == SessionState::Suspended;
        let entry = self.session_append(&s, entry)?;
        if wake {
            if let Err(e) = self.live_session(&s.id) {
                tracing::warn!(session = %s.id, error = %e, "resuming on a user message failed");
            }
        }
        Ok(entry)
    }

    fn snapshot_session(
        &mut self,
        key: &str,
        label: Option<&str>,
        content: &str,
    ) -> Result<cairn_engine::SnapshotRecord, EngineError> {
        let live = self.live_session(key)?;
        let snap = self.snapshot(&live.sandbox, label)?;
        let mut note = Entry::new(EntryKind::Note);
        note.content = Some(format!("snapshot {}: {content}", snap.id));
        note.snapshot_id = Some(snap.id.clone());
        self.session_append(&live.session, note)?;
        Ok(snap)
    }

    fn suspend_session(&mut self, key: &str) -> Result<SessionRecord, EngineError> {
        let id = self.session(key)?.id;
        let _held = self.lock_unless_running(&id)?;
        let s = self.session(&id)?;
        self.suspend_held(&s)
    }

    fn suspend_idle_sessions(&mut self, now: i64) -> Result<IdleSweep, EngineError> {
        let mut sweep = IdleSweep::default();
        for candidate in self.db().idle_sessions(now)? {
            let Some(_held) = self.lock_session(&candidate.id, true, false)? else {
                continue;
            };
            // Looked at again under the lock: a call may have ended since.
            let s = self.session(&candidate.id)?;
            let idle = s.idle_timeout_ms.is_some_and(|t| s.updated_at + t as i64 <= now);
            if s.state != SessionState::Active || !idle {
                continue;
            }
            match self.suspend_held(&s) {
                Ok(_) => sweep.suspended.push(s.id),
                Err(e) => sweep.failed.push((s.id, e.to_string())),
            }
        }
        Ok(sweep)
    }

    fn resume_session(&mut self, key: &str) -> Result<SessionRecord, EngineError> {
        let s = self.session(key)?;
        if s.state == SessionState::Active {
            return Err(SessionError::WrongState {
                id: s.id.clone(),
                state: s.state,
                hint: "it is already running",
            }
            .into());
        }
        // Waits for a suspend or resume in flight to finish, then looks again.
        let _held = self
            .lock_session(&s.id, true, true)?
            .ok_or_else(|| SessionError::Busy(s.id.clone()))?;
        let s = self.session(&s.id)?;
        self.resume_held(&s)
    }

    fn fork_session(
        &mut self,
        key: &str,
        at: u64,
        reason: &str,
        name: Option<String>,
    ) -> Result<SessionRecord, EngineError> {
        let id = self.session(key)?.id;
        self.as_owner_of(cairn_engine::tenants::Owned::Session, &id, |e| {
            e.fork_owned_session(&id, at, reason, name)
        })
    }

    fn rewind_session(&self, key: &str, to: u64) -> Result<crate::Rewind, EngineError> {
        let s = self.session(key)?;
        if s.state == SessionState::Closed {
            return Err(SessionError::WrongState {
                id: s.id.clone(),
                state: s.state,
                hint: "a closed session's log is read-only",
            }
            .into());
        }
        self.live_entry(&s, to)?;
        let last = self.session_log(&s, LogRange::Tail(1))?;
        if last.first().is_none_or(|e| e.seq <= to) {
            return Err(SessionError::NothingToRewind { id: s.id, seq: to }.into());
        }
        self.db()
            .add_rewind(&s.id, to, s.head_seq)
            .map_err(|e| conflict(e, &s.id))
    }

    fn remove_tenant(&mut self, name: &str, force: bool) -> Result<(), EngineError> {
        self.remove_tenant_with(name, force, &mut |engine, id| engine.close_session(id, false).map(drop))
    }

    fn close_session(&mut self, key: &str, purge: bool) -> Result<SessionRecord, EngineError> {
        let id = self.session(key)?.id;
        let _held = self.lock_unless_running(&id)?;
        let s = self.session(&id)?;
        if purge {
            let children = self.db().session_children(&s.id)?;
            if !children.is_empty() {
                return Err(SessionError::HasForks { id: s.id, children }.into());
            }
        }
        if s.state != SessionState::Closed {
            self.claim(&s, SessionState::Closed, me())?;
        }
        if let Some(sandbox) = self.session_sandbox(&s) {
            self.remove_sandbox(&sandbox, true)?;
        }
        if purge {
            self.db().delete_session(&s.id)?;
            let _ = std::fs::remove_file(self.home().session_lock(&s.id));
        }
        Ok(SessionRecord {
            state: SessionState::Closed,
            ..s
        })
    }
}

pub(crate) trait OpsSteps {
    fn new_session(
        &mut self,
        opts: &SessionOptions,
        from: Option<&cairn_engine::SnapshotRecord>,
        progress: &dyn Progress,
    ) -> Result<SessionRecord, EngineError>;

    /// Records a new session whose sandbox is made; if that fails (a name
    /// taken meanwhile), the sandbox goes, so nothing is left.
    fn record_new_session(&mut self, rec: &SessionRecord, sandbox: &SandboxRecord) -> Result<(), EngineError>;

    fn put_payload(&self, text: String) -> Result<String, EngineError>;

    fn get_payload(&self, s: &str, seq: u64, hash: &str) -> Result<String, EngineError>;

    /// The segments of a session's lineage, oldest first, and the seq
    /// ranges its rewinds (and its ancestors', as they were when it forked)
    /// hide.
    fn lineage(&self, s: &SessionRecord) -> Result<(Vec<Segment>, Hidden), EngineError>;

    /// Whether `seq` is on the session's live branch (0 always is).
    fn live_entry(&self, s: &SessionRecord, seq: u64) -> Result<Option<Entry>, EngineError>;

    /// The newest live entry at or before `seq` that records a snapshot.
    fn snapshot_at(&self, s: &SessionRecord, seq: u64) -> Result<Option<Entry>, EngineError>;

    /// The session's sandbox if it is running.
    fn session_sandbox(&self, s: &SessionRecord) -> Option<SandboxRecord>;

    /// A sandbox for session `id` (of `s`'s image and driver) from a
    /// snapshot, or fresh from the image when there is none. It is named
    /// after the session, so a sandbox a killed resume made but never
    /// recorded is found and replaced here instead of being left behind.
    /// A restore prepared ahead for the session (see `warm.rs`) is used
    /// when it restores that snapshot; if it fails, the snapshot is
    /// restored the ordinary way.
    fn sandbox_from(
        &mut self,
        s: &SessionRecord,
        id: &str,
        snapshot: Option<&str>,
    ) -> Result<SandboxRecord, EngineError>;

    /// The session's lock, exclusive, for an operation that does not wait
    /// for a command (which may run for hours): [`SessionError::Busy`]
    /// while one runs. A suspended session runs none; its lock is held
    /// only for a moment (a resume being prepared ahead, see `warm.rs`, or
    /// a resume starting), which is waited for.
    fn lock_unless_running(&self, id: &str) -> Result<Flock<File>, EngineError>;

    /// The session's lock. Calls on its sandbox (exec, file calls) hold it
    /// shared for their whole run; suspend, resume, recovery and close hold
    /// it exclusive, so a sandbox is never taken from under a command.
    /// `Ok(None)` when `wait` is false and it is held otherwise. The lock
    /// goes with its process, however that dies.
    fn lock_session(&self, id: &str, exclusive: bool, wait: bool) -> Result<Option<Flock<File>>, EngineError>;

    /// The session held for a call on its sandbox: a suspended session is
    /// resumed first, a sandbox that died is restored from the newest
    /// snapshot with a `recovered` entry naming the calls whose effects
    /// were lost. The session cannot be suspended or closed while the
    /// returned [`Live`] is held.
    fn live_session(&mut self, key: &str) -> Result<Live, EngineError>;

    /// [`SessionOps::session_exec`] on a session already held; `extra` goes
    /// into the call's arguments beside `argv`.
    fn exec_live(
        &mut self,
        live: &Live,
        req: ExecRequest,
        extra: serde_json::Map<String, serde_json::Value>,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<ExecOutcome, EngineError>;

    fn suspend_held(&mut self, s: &SessionRecord) -> Result<SessionRecord, EngineError>;

    /// Moves an active session to `to`, owned by `mine`.
    fn claim(&self, s: &SessionRecord, to: SessionState, mine: (i32, u64)) -> Result<(), EngineError>;

    fn resume_held(&mut self, s: &SessionRecord) -> Result<SessionRecord, EngineError>;

    fn fork_owned_session(
        &mut self,
        key: &str,
        at: u64,
        reason: &str,
        name: Option<String>,
    ) -> Result<SessionRecord, EngineError>;
}

impl OpsSteps for Engine {
    fn new_session(
        &mut self,
        opts: &SessionOptions,
        from: Option<&cairn_engine::SnapshotRecord>,
        progress: &dyn Progress,
    ) -> Result<SessionRecord, EngineError> {
        let id = new_session_id();
        let name = opts
            .name
            .clone()
            .map(|n| self.qualified(n))
            .unwrap_or_else(|| format!("session-{id}"));
        if !valid_name(&name) {
            return Err(SessionError::BadName(name).into());
        }
        if !self.db().find_sessions(&name)?.iter().all(|s| s.name != name) {
            return Err(SessionError::NameTaken(name).into());
        }
        let network = opts.network.clone().filter(|n| n.egress);
        let create = CreateOptions {
            image: opts.image.clone(),
            driver: opts.driver.clone(),
            name: Some(sandbox_name(&id)),
            network: Some(network.clone().unwrap_or_default()),
            ..CreateOptions::default()
        };
        let sandbox = match from {
            Some(snap) => self.restore(snap, &create)?,
            None => self.create_sandbox(&create, progress)?,
        };
        let now = cairn_engine::now_ms();
        let owner = me();
        let rec = SessionRecord {
            id,
            name: name.clone(),
            state: SessionState::Active,
            image: sandbox.image.clone(),
            driver: sandbox.driver.clone(),
            network,
            sandbox_id: Some(sandbox.id.clone()),
            snapshot_id: None,
            snapshot_seq: None,
            idle_timeout_ms: opts.idle_timeout_ms,
            parent_id: None,
            fork_seq: None,
            fork_reason: None,
            fork_rewinds: 0,
            head_seq: 0,
            head_hash: GENESIS.to_string(),
            rewinds: 0,
            owner_pid: owner.0,
            owner_start: owner.1,
            error: None,
            created_at: now,
            updated_at: now,
        };
        self.record_new_session(&rec, &sandbox)?;
        Ok(rec)
    }

    fn record_new_session(&mut self, rec: &SessionRecord, sandbox: &SandboxRecord) -> Result<(), EngineError> {
        if let Err(e) = self.db().insert_session(rec) {
            let _ = self.remove_sandbox(sandbox, true);
            return Err(match e {
                StateError::NameTaken(n) => SessionError::NameTaken(n).into(),
                other => other.into(),
            });
        }
        Ok(())
    }

    fn put_payload(&self, text: String) -> Result<String, EngineError> {
        let content = self
            .store()
            .store_reader(text.as_bytes())
            .map_err(cairn_engine::SnapshotError::from)?;
        let id = self
            .store()
            .put_object(&PayloadObject { content })
            .map_err(cairn_engine::SnapshotError::from)?;
        Ok(id.to_string())
    }

    fn get_payload(&self, s: &str, seq: u64, hash: &str) -> Result<String, EngineError> {
        let fail = |reason: String| SessionError::Payload {
            id: s.to_string(),
            seq,
            hash: hash.to_string(),
            reason,
        };
        let h: ChunkHash = hash.parse().map_err(|_| fail("not a content hash".into()))?;
        let ctx = ReadContext::new().owner("session payload", h);
        let object: PayloadObject = self.store().get_object(&h, &ctx).map_err(|e| fail(e.to_string()))?;
        let mut out = Vec::new();
        self.store()
            .read_to_writer(&object.content, &mut out, &ctx)
            .map_err(|e| fail(e.to_string()))?;
        String::from_utf8(out).map_err(|_| fail("not UTF-8".into()).into())
    }

    fn lineage(&self, s: &SessionRecord) -> Result<(Vec<Segment>, Hidden), EngineError> {
        let mut segments = Vec::new();
        let mut hidden = Vec::new();
        let mut cur = s.clone();
        // A rewind of an ancestor hides entries only below the fork it
        // passed down through, and only if it was made before that fork.
        let (mut cap, mut limit) = (u64::MAX, u64::MAX);
        loop {
            let lo = cur.fork_seq.unwrap_or(0);
            segments.push(Segment {
                session: cur.id.clone(),
                lo,
                hi: cap.min(cur.head_seq),
            });
            for r in self.db().rewinds(&cur.id)? {
                if r.n <= limit && r.to_seq < cap {
                    hidden.push((r.to_seq, r.head_seq.min(cap)));
                }
            }
            let Some(parent) = cur.parent_id.clone() else { break };
            cap = cap.min(lo);
            limit = cur.fork_rewinds;
            cur = self
                .db()
                .session_by_id(&parent)?
                .ok_or_else(|| StateError::Damaged(format!("session {} names a missing parent {parent}", cur.id)))?;
        }
        segments.reverse();
        Ok((segments, hidden))
    }

    fn live_entry(&self, s: &SessionRecord, seq: u64) -> Result<Option<Entry>, EngineError> {
        if seq == 0 {
            return Ok(None);
        }
        let found = self.session_log(s, LogRange::From { from: seq, count: 1 })?;
        match found.into_iter().next() {
            Some(e) if e.seq == seq => Ok(Some(e)),
            _ => Err(SessionError::NoSuchEntry {
                id: s.id.clone(),
                seq,
                head: s.head_seq,
            }
            .into()),
        }
    }

    fn snapshot_at(&self, s: &SessionRecord, seq: u64) -> Result<Option<Entry>, EngineError> {
        let (mut segments, hidden) = self.lineage(s)?;
        for seg in &mut segments {
            seg.hi = seg.hi.min(seq);
        }
        Ok(self
            .db()
            .read_entries(&segments, &hidden, Order::Descending, 1, true)?
            .into_iter()
            .next())
    }

    fn session_sandbox(&self, s: &SessionRecord) -> Option<SandboxRecord> {
        let id = s.sandbox_id.as_deref()?;
        self.sandbox(id).ok().filter(|r| r.id == id)
    }

    fn sandbox_from(
        &mut self,
        s: &SessionRecord,
        id: &str,
        snapshot: Option<&str>,
    ) -> Result<SandboxRecord, EngineError> {
        let opts = session_sandbox_options(s, id);
        let warm = self.take_warm_resume(id, snapshot);
        let warm_id = warm.as_ref().map(|p| p.sandbox().id.clone());
        let name = self.qualified(sandbox_name(id));
        for leftover in self.db().find_sandboxes(&name)? {
            if leftover.name == name && Some(&leftover.id) != warm_id.as_ref() {
                self.remove_sandbox(&leftover, true)?;
            }
        }
        if let Some(prepared) = warm {
            match self.finish_restore(prepared) {
                Ok(rec) => return Ok(rec),
                Err(e) => tracing::warn!(
                    session = id,
                    "resuming into the sandbox prepared ahead failed, restoring the ordinary way: {e}"
                ),
            }
        }
        match snapshot {
            Some(id) => {
                let snap = self.snapshot_record(id)?;
                self.restore(&snap, &opts)
            }
            None => self.create_sandbox(&opts, &cairn_engine::Silent),
        }
    }

    fn lock_unless_running(&self, id: &str) -> Result<Flock<File>, EngineError> {
        if let Some(held) = self.lock_session(id, true, false)? {
            return Ok(held);
        }
        if self.session(id)?.state == SessionState::Suspended {
            if let Some(held) = self.lock_session(id, true, true)? {
                return Ok(held);
            }
        }
        Err(SessionError::Busy(id.to_string()).into())
    }

    fn lock_session(&self, id: &str, exclusive: bool, wait: bool) -> Result<Option<Flock<File>>, EngineError> {
        let path = self.home().session_lock(id);
        let lock_err = |source: std::io::Error| cairn_engine::SnapshotError::Lock {
            path: path.clone(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(lock_err)?;
        }
        let file = File::options()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(lock_err)?;
        let arg = match (exclusive, wait) {
            (true, true) => FlockArg::LockExclusive,
            (true, false) => FlockArg::LockExclusiveNonblock,
            (false, true) => FlockArg::LockShared,
            (false, false) => FlockArg::LockSharedNonblock,
        };
        match Flock::lock(file, arg) {
            Ok(lock) => Ok(Some(lock)),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, e)) => Err(lock_err(e.into()).into()),
        }
    }

    fn live_session(&mut self, key: &str) -> Result<Live, EngineError> {
        let id = self.session(key)?.id;
        let mut recovered = None;
        for _ in 0..4 {
            let lock = self
                .lock_session(&id, false, true)?
                .ok_or_else(|| SessionError::Busy(id.clone()))?;
            let s = self.session(&id)?;
            let resume = match s.state {
                SessionState::Active => match self.session_sandbox(&s).filter(alive) {
                    Some(sandbox) => {
                        return Ok(Live {
                            session: s,
                            sandbox,
                            recovered,
                            _lock: lock,
                        })
                    }
                    None => false,
                },
                SessionState::Suspended => true,
                SessionState::Suspending | SessionState::Resuming
                    if !cairn_sandbox::process_alive(s.owner_pid, s.owner_start) =>
                {
                    true
                }
                state => {
                    return Err(SessionError::WrongState {
                        id: s.id.clone(),
                        state,
                        hint: match state {
                            SessionState::Closed => "a closed session runs nothing; fork it to continue from its log",
                            SessionState::Failed => "its last resume failed (`cairn session show` says why); `cairn session resume` it once the cause is fixed",
                            _ => "another command is moving it; retry",
                        },
                    }
                    .into())
                }
            };
            // Resume or recover holding the session exclusively, then look
            // again: another caller may have done it meanwhile.
            drop(lock);
            let _held = self
                .lock_session(&id, true, true)?
                .ok_or_else(|| SessionError::Busy(id.clone()))?;
            let s = self.session(&id)?;
            if resume && s.state != SessionState::Active {
                self.resume_held(&s)?;
            } else if !resume && s.state == SessionState::Active && !self.session_sandbox(&s).is_some_and(|r| alive(&r))
            {
                recovered = Some(self.recover(&s)?.1);
            }
        }
        Err(SessionError::Conflict(id).into())
    }

    fn exec_live(
        &mut self,
        live: &Live,
        req: ExecRequest,
        extra: serde_json::Map<String, serde_json::Value>,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<ExecOutcome, EngineError> {
        let (s, sandbox) = (&live.session, &live.sandbox);
        let mut call = Entry::new(EntryKind::ToolCall);
        call.tool = Some("exec".into());
        let mut arguments = extra;
        arguments.insert("argv".into(), serde_json::json!(req.argv));
        if !req.env.is_empty() {
            arguments.insert("env".into(), serde_json::json!(req.env));
        }
        if let Some(cwd) = &req.cwd {
            arguments.insert("cwd".into(), cwd.as_str().into());
        }
        if let Some(t) = req.timeout_ms {
            arguments.insert("timeout_ms".into(), t.into());
        }
        call.arguments = Some(serde_json::Value::Object(arguments).to_string());
        let call = self.session_append(s, call)?;
        let mut out_tail = Tail::new(INLINE_MAX / 2);
        let mut err_tail = Tail::new(INLINE_MAX / 2);
        let (status, error) = match self.exec(sandbox, req) {
            Ok(Ok(start)) => {
                let waited = start.session.wait(
                    &mut Tee {
                        out: stdout,
                        tail: &mut out_tail,
                    },
                    &mut Tee {
                        out: stderr,
                        tail: &mut err_tail,
                    },
                );
                match waited {
                    // A timeout reads as `timeout(1)` has it.
                    Ok(Some(st)) if st.timed_out => (Some(124), Some("timed out and killed".to_string())),
                    Ok(st) => (st.map(|st| st.shell_code()), None),
                    Err(e) => (None, Some(format!("the sandbox stopped answering: {e}"))),
                }
            }
            Ok(Err(failure)) => (Some(failure.kind.shell_code()), Some(failure.message)),
            Err(e) => (None, Some(e.to_string())),
        };
        let mut result = Entry::new(EntryKind::ToolResult);
        result.tool = Some("exec".into());
        result.exit_status = status;
        let mut body = serde_json::json!({ "call": call.seq, "stdout": out_tail.text(), "stderr": err_tail.text() });
        if let Some(e) = &error {
            body["error"] = serde_json::Value::from(e.as_str());
        }
        result.result = Some(body.to_string());
        let result = self.session_append(s, result)?;
        Ok(ExecOutcome {
            status: status.unwrap_or(LOST),
            call_seq: call.seq,
            result_seq: result.seq,
            recovered: live.recovered.clone(),
        })
    }

    fn suspend_held(&mut self, s: &SessionRecord) -> Result<SessionRecord, EngineError> {
        let s = s.clone();
        if s.state != SessionState::Active {
            return Err(SessionError::WrongState {
                id: s.id.clone(),
                state: s.state,
                hint: "only an active session can be suspended",
            }
            .into());
        }
        let mine = me();
        self.claim(&s, SessionState::Suspending, mine)?;
        if let Some(sandbox) = self.session_sandbox(&s) {
            if matches!(sandbox.state, SandboxState::Running | SandboxState::Exited) {
                let mut snap = self.snapshot_to_stop(&sandbox, None)?;
                // Each suspend that changed files stacks a layer; overlayfs
                // mounts at most 500. A flatten that fails leaves the
                // stacked snapshot, which holds everything all the same.
                if snap.layers.len() > FLATTEN_ABOVE {
                    match self.flatten_snapshot(&snap) {
                        Ok(flat) => snap = flat,
                        Err(e) => tracing::warn!(session = %s.id, snapshot = %snap.id, error = %e, "flattening failed"),
                    }
                }
                let mut note = Entry::new(EntryKind::Note);
                note.content = Some(format!("suspended: snapshot {}", snap.id));
                note.snapshot_id = Some(snap.id.clone());
                self.session_append(&s, note)?;
            }
            let sandbox = self.sandbox(&sandbox.id)?;
            self.remove_sandbox(&sandbox, true)?;
        }
        if !self.db().move_session(
            &s.id,
            SessionState::Suspending,
            mine,
            SessionState::Suspended,
            mine,
            None,
            None,
        )? {
            return Err(SessionError::Conflict(s.id.clone()).into());
        }
        self.session(&s.id)
    }

    fn claim(&self, s: &SessionRecord, to: SessionState, mine: (i32, u64)) -> Result<(), EngineError> {
        if !s.state.valid_transition(to) {
            return Err(SessionError::InvalidTransition {
                id: s.id.clone(),
                from: s.state,
                to,
            }
            .into());
        }
        if !self.db().move_session(
            &s.id,
            s.state,
            (s.owner_pid, s.owner_start),
            to,
            mine,
            s.sandbox_id.as_deref(),
            s.error.as_deref(),
        )? {
            return Err(SessionError::Conflict(s.id.clone()).into());
        }
        Ok(())
    }

    fn resume_held(&mut self, s: &SessionRecord) -> Result<SessionRecord, EngineError> {
        let s = s.clone();
        let interrupted = matches!(s.state, SessionState::Suspending | SessionState::Resuming)
            && !cairn_sandbox::process_alive(s.owner_pid, s.owner_start);
        if !(matches!(s.state, SessionState::Suspended | SessionState::Failed) || interrupted) {
            return Err(SessionError::WrongState {
                id: s.id.clone(),
                state: s.state,
                hint: match s.state {
                    SessionState::Active => "it is already running",
                    SessionState::Closed => "a closed session cannot be resumed; fork it to continue from its log",
                    _ => "another command is moving it; wait for it",
                },
            }
            .into());
        }
        let mine = me();
        self.claim(&s, SessionState::Resuming, mine)?;
        let sandbox = match self.session_sandbox(&s) {
            Some(r) if r.state == SandboxState::Running => r,
            leftover => {
                // A suspend that died after its snapshot stopped the
                // sandbox left that snapshot as the newest state, perhaps
                // before the log's note named it.
                let newest = leftover.as_ref().and_then(|o| o.last_snapshot.clone());
                if let Some(old) = leftover {
                    self.remove_sandbox(&old, true)?;
                }
                match self.sandbox_from(&s, &s.id, newest.as_deref().or(s.snapshot_id.as_deref())) {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = self.db().move_session(
                            &s.id,
                            SessionState::Resuming,
                            mine,
                            SessionState::Failed,
                            mine,
                            None,
                            Some(&e.to_string()),
                        );
                        return Err(e);
                    }
                }
            }
        };
        if !self.db().move_session(
            &s.id,
            SessionState::Resuming,
            mine,
            SessionState::Active,
            mine,
            Some(&sandbox.id),
            None,
        )? {
            let _ = self.remove_sandbox(&sandbox, true);
            return Err(SessionError::Conflict(s.id.clone()).into());
        }
        self.session(&s.id)
    }

    fn fork_owned_session(
        &mut self,
        key: &str,
        at: u64,
        reason: &str,
        name: Option<String>,
    ) -> Result<SessionRecord, EngineError> {
        let p = self.session(key)?;
        if at > p.head_seq {
            return Err(SessionError::NoSuchEntry {
                id: p.id.clone(),
                seq: at,
                head: p.head_seq,
            }
            .into());
        }
        let entry = self.live_entry(&p, at)?;
        let head_hash = entry.map_or_else(|| GENESIS.to_string(), |e| e.hash);
        let snap = self.snapshot_at(&p, at)?;
        let id = new_session_id();
        let name = name
            .map(|n| self.qualified(n))
            .unwrap_or_else(|| format!("session-{id}"));
        if !valid_name(&name) {
            return Err(SessionError::BadName(name).into());
        }
        // The fork keeps the parent's network, not its published ports
        // (a host port is one sandbox's).
        let network = p.network.clone().map(|n| cairn_sandbox::net::NetPolicy {
            publish: Vec::new(),
            ..n
        });
        let child = SessionRecord {
            network: network.clone(),
            ..p.clone()
        };
        let sandbox = self.sandbox_from(&child, &id, snap.as_ref().and_then(|e| e.snapshot_id.as_deref()))?;
        let now = cairn_engine::now_ms();
        let owner = me();
        let rec = SessionRecord {
            id,
            name,
            state: SessionState::Active,
            image: p.image.clone(),
            driver: p.driver.clone(),
            network,
            sandbox_id: Some(sandbox.id.clone()),
            snapshot_id: snap.as_ref().and_then(|e| e.snapshot_id.clone()),
            snapshot_seq: snap.as_ref().map(|e| e.seq),
            idle_timeout_ms: p.idle_timeout_ms,
            parent_id: Some(p.id.clone()),
            fork_seq: Some(at),
            fork_reason: Some(reason.to_string()),
            fork_rewinds: p.rewinds,
            head_seq: at,
            head_hash,
            rewinds: 0,
            owner_pid: owner.0,
            owner_start: owner.1,
            error: None,
            created_at: now,
            updated_at: now,
        };
        self.record_new_session(&rec, &sandbox)?;
        Ok(rec)
    }
}

/// A session's snapshot with more layers than this is flattened into one
/// when it suspends.
pub const FLATTEN_ABOVE: usize = 100;

/// The status an exec reports when the sandbox died under the command.
pub const LOST: i32 = 137;

#[cfg(test)]
mod tests {
    use cairn_store::frame::{decode, encode, FrameError};
    use cairn_store::FileContent;

    use super::*;

    #[test]
    fn payload_objects_round_trip_and_refuse_corrupt_or_future_frames() {
        let object = PayloadObject {
            content: FileContent::default(),
        };
        let bytes = encode(&object).unwrap();
        let back: PayloadObject = decode(&bytes).unwrap();
        assert_eq!(back.content.size, 0);
        let mut corrupt = bytes.clone();
        *corrupt.last_mut().unwrap() ^= 1;
        assert!(decode::<PayloadObject>(&corrupt).is_err());
        let mut future = bytes.clone();
        future[8..12].copy_from_slice(&2u32.to_le_bytes());
        assert!(matches!(
            decode::<PayloadObject>(&future),
            Err(FrameError::FutureVersion { .. })
        ));
        assert!(decode::<PayloadObject>(&bytes[..bytes.len() - 1]).is_err());
    }

    #[test]
    fn the_exec_tail_keeps_the_newest_bytes_only() {
        let mut sink = Vec::new();
        let mut tail = Tail::new(8);
        let mut tee = Tee {
            out: &mut sink,
            tail: &mut tail,
        };
        tee.write_all(b"0123456789").unwrap();
        tee.write_all(b"ab").unwrap();
        assert_eq!(sink.len(), 12, "the caller gets everything");
        assert_eq!(tail.text(), "456789ab");
    }

    #[test]
    fn only_the_documented_session_moves_are_valid() {
        use SessionState::*;
        let all = [Active, Suspending, Suspended, Resuming, Failed, Closed];
        for from in all {
            assert!(!from.valid_transition(Active) || from == Resuming, "{from} -> active");
            assert!(!Closed.valid_transition(from), "closed -> {from}");
            assert_eq!(from.as_str().parse::<SessionState>().unwrap(), from);
        }
        assert!(
            Suspending.valid_transition(Resuming),
            "an interrupted suspend is resumed"
        );
        assert!(!Suspended.valid_transition(Suspending));
    }
}
