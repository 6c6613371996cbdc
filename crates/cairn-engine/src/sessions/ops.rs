//! The session service: create, append, read, exec, suspend, resume,
//! fork, rewind, verify, close.

use std::collections::VecDeque;
use std::io::Write;

use cairn_protocol::ExecRequest;
use cairn_store::{ChunkHash, FileContent, Framed, ReadContext};
use serde::{Deserialize, Serialize};

use super::log::{Order, Segment};
use super::{Entry, EntryKind, SessionError, SessionRecord, SessionState, GENESIS, INLINE_MAX};
use crate::sandboxes::me;
use crate::state::{SandboxState, StateError};
use crate::{CreateOptions, Engine, EngineError, Progress, SandboxRecord};

/// What `cairn session create` asks for.
#[derive(Debug, Clone, Default)]
pub struct SessionOptions {
    pub name: Option<String>,
    pub image: Option<String>,
    pub driver: Option<String>,
    pub idle_timeout_ms: Option<u64>,
}

/// Which entries of the live log to read.
#[derive(Debug, Clone, Copy)]
pub enum LogRange {
    /// `count` entries from seq `from` on.
    From { from: u64, count: usize },
    /// The last `n` entries.
    Tail(usize),
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

/// The outcome of walking a session's hash chain.
#[derive(Debug, Clone, Serialize)]
pub struct Verified {
    pub entries: u64,
    pub head_hash: String,
    /// The first entry that is not what its chain says, and why.
    pub first_bad: Option<(u64, String)>,
}

/// A log payload too large for its row, in the chunk store.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PayloadObject {
    pub content: FileContent,
}

impl Framed for PayloadObject {
    const MAGIC: [u8; 8] = *b"CAIRNPAY";
    const VERSION: u32 = 1;
    const MAX_PAYLOAD: u64 = 64 << 20;
    const NAME: &'static str = "session payload";
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
type Hidden = Vec<(u64, u64)>;

fn new_session_id() -> String {
    crate::random_hex(6)
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

fn conflict(e: StateError, id: &str) -> EngineError {
    match e {
        StateError::Conflict(_) => SessionError::Conflict(id.to_string()).into(),
        other => other.into(),
    }
}

impl Engine {
    /// Finds a session by name, id or unique id prefix.
    pub fn session(&self, key: &str) -> Result<SessionRecord, EngineError> {
        let mut found = self.db.find_sessions(key)?;
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

    pub fn sessions(&self) -> Result<Vec<SessionRecord>, EngineError> {
        Ok(self.db.sessions()?)
    }

    /// Creates a session and its sandbox. On error nothing is left.
    pub fn create_session(
        &mut self,
        opts: &SessionOptions,
        progress: &dyn Progress,
    ) -> Result<SessionRecord, EngineError> {
        let id = new_session_id();
        let name = opts.name.clone().unwrap_or_else(|| format!("session-{id}"));
        if !valid_name(&name) {
            return Err(SessionError::BadName(name).into());
        }
        if !self.db.find_sessions(&name)?.iter().all(|s| s.name != name) {
            return Err(SessionError::NameTaken(name).into());
        }
        let sandbox = self.create_sandbox(
            &CreateOptions {
                image: opts.image.clone(),
                driver: opts.driver.clone(),
                ..CreateOptions::default()
            },
            progress,
        )?;
        let now = crate::now_ms();
        let owner = me();
        let rec = SessionRecord {
            id,
            name: name.clone(),
            state: SessionState::Active,
            image: sandbox.image.clone(),
            driver: sandbox.driver.clone(),
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
        if let Err(e) = self.db.insert_session(&rec) {
            let _ = self.remove_sandbox(&sandbox, true);
            return Err(match e {
                StateError::NameTaken(n) => SessionError::NameTaken(n).into(),
                other => other.into(),
            });
        }
        Ok(rec)
    }

    /// Appends one entry (large payloads go to the chunk store).
    pub fn session_append(&self, s: &SessionRecord, entry: Entry) -> Result<Entry, EngineError> {
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
            .db
            .append_entries(&s.id, &[entry])
            .map_err(|e| conflict(e, &s.id))?;
        Ok(out.remove(0))
    }

    /// Appends many entries in one transaction (a bulk load). Each must
    /// fit its row: a payload above 64 KiB is refused, not stored aside.
    pub fn session_append_batch(&self, s: &SessionRecord, entries: &[Entry]) -> Result<Vec<Entry>, EngineError> {
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
        self.db.append_entries(&s.id, entries).map_err(|e| conflict(e, &s.id))
    }

    fn put_payload(&self, text: String) -> Result<String, EngineError> {
        let content = self
            .store
            .store_reader(text.as_bytes())
            .map_err(crate::SnapshotError::from)?;
        let id = self
            .store
            .put_object(&PayloadObject { content })
            .map_err(crate::SnapshotError::from)?;
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
        let object: PayloadObject = self.store.get_object(&h, &ctx).map_err(|e| fail(e.to_string()))?;
        let mut out = Vec::new();
        self.store
            .read_to_writer(&object.content, &mut out, &ctx)
            .map_err(|e| fail(e.to_string()))?;
        String::from_utf8(out).map_err(|_| fail("not UTF-8".into()).into())
    }

    /// The segments of a session's lineage, oldest first, and the seq
    /// ranges its rewinds (and its ancestors', as they were when it forked)
    /// hide.
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
            for r in self.db.rewinds(&cur.id)? {
                if r.n <= limit && r.to_seq < cap {
                    hidden.push((r.to_seq, r.head_seq.min(cap)));
                }
            }
            let Some(parent) = cur.parent_id.clone() else { break };
            cap = cap.min(lo);
            limit = cur.fork_rewinds;
            cur = self
                .db
                .session_by_id(&parent)?
                .ok_or_else(|| StateError::Damaged(format!("session {} names a missing parent {parent}", cur.id)))?;
        }
        segments.reverse();
        Ok((segments, hidden))
    }

    /// Reads the live log (abandoned entries are skipped), with payloads.
    pub fn session_log(&self, s: &SessionRecord, range: LogRange) -> Result<Vec<Entry>, EngineError> {
        let (segments, hidden) = self.lineage(s)?;
        let mut out = match range {
            LogRange::From { from, count } => {
                self.db
                    .read_entries(&segments, &hidden, Order::Ascending { from }, count, false)?
            }
            LogRange::Tail(n) => {
                let mut v = self.db.read_entries(&segments, &hidden, Order::Descending, n, false)?;
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

    /// Whether `seq` is on the session's live branch (0 always is).
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

    /// The newest live entry at or before `seq` that records a snapshot.
    fn snapshot_at(&self, s: &SessionRecord, seq: u64) -> Result<Option<Entry>, EngineError> {
        let (mut segments, hidden) = self.lineage(s)?;
        for seg in &mut segments {
            seg.hi = seg.hi.min(seq);
        }
        Ok(self
            .db
            .read_entries(&segments, &hidden, Order::Descending, 1, true)?
            .into_iter()
            .next())
    }

    /// Walks the whole chain (abandoned entries included, they are linked
    /// too) and names the first entry that is tampered with or missing.
    pub fn verify_session(&self, s: &SessionRecord) -> Result<Verified, EngineError> {
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
                .db
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
                let rows = self.db.raw_entries(seg, expected, 1000)?;
                if rows.is_empty() {
                    break;
                }
                for e in rows {
                    if e.seq != expected {
                        return bad(expected, "missing".into());
                    }
                    let hash = e.chain(&previous);
                    if hash != e.hash || e.version != super::ENTRY_VERSION {
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

    /// The session's sandbox if it is running.
    fn session_sandbox(&self, s: &SessionRecord) -> Option<SandboxRecord> {
        let id = s.sandbox_id.as_deref()?;
        self.sandbox(id).ok().filter(|r| r.id == id)
    }

    /// A sandbox for the session from its snapshot at or before the log
    /// position (or a fresh one from its image when it has none).
    fn sandbox_from(&mut self, s: &SessionRecord, snapshot: Option<&str>) -> Result<SandboxRecord, EngineError> {
        let opts = CreateOptions {
            image: Some(s.image.clone()),
            driver: Some(s.driver.clone()),
            ..CreateOptions::default()
        };
        match snapshot {
            Some(id) => {
                let snap = self.snapshot_record(id)?;
                self.restore(&snap, &opts)
            }
            None => self.create_sandbox(&opts, &crate::Silent),
        }
    }

    /// Runs a command in the session's sandbox and records a `tool_call`
    /// and a `tool_result` entry. A suspended session is resumed first; a
    /// sandbox that died is restored from the newest snapshot with a
    /// `recovered` entry naming the calls whose effects were lost.
    pub fn session_exec(
        &mut self,
        key: &str,
        argv: Vec<String>,
        stdout: &mut dyn Write,
        stderr: &mut dyn Write,
    ) -> Result<ExecOutcome, EngineError> {
        let mut s = self.session(key)?;
        if s.state == SessionState::Suspended {
            s = self.resume_session(&s.id)?;
        }
        if s.state != SessionState::Active {
            return Err(SessionError::WrongState {
                id: s.id.clone(),
                state: s.state,
                hint: if s.state == SessionState::Closed {
                    "a closed session runs nothing; fork it to continue from its log"
                } else {
                    "`cairn session resume` it first"
                },
            }
            .into());
        }
        let mut recovered = None;
        let sandbox = match self.session_sandbox(&s).filter(|r| r.state == SandboxState::Running) {
            Some(r) => r,
            None => {
                let (r, entry) = self.recover(&s)?;
                recovered = Some(entry);
                r
            }
        };
        let mut call = Entry::new(EntryKind::ToolCall);
        call.tool = Some("exec".into());
        call.arguments = Some(serde_json::json!({ "argv": argv }).to_string());
        let call = self.session_append(&s, call)?;
        let mut out_tail = Tail::new(INLINE_MAX / 2);
        let mut err_tail = Tail::new(INLINE_MAX / 2);
        let req = ExecRequest {
            argv,
            env: Vec::new(),
            cwd: None,
            stdin: false,
            timeout_ms: None,
            detach: false,
        };
        let (status, error) = match self.exec(&sandbox, req) {
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
        let mut body = serde_json::json!({ "stdout": out_tail.text(), "stderr": err_tail.text() });
        if let Some(e) = &error {
            body["error"] = serde_json::Value::from(e.as_str());
        }
        result.result = Some(body.to_string());
        let result = self.session_append(&s, result)?;
        Ok(ExecOutcome {
            status: status.unwrap_or(LOST),
            call_seq: call.seq,
            result_seq: result.seq,
            recovered,
        })
    }

    /// Replaces a dead sandbox with a restore of the newest snapshot and
    /// records what was lost.
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
        let fresh = self.sandbox_from(s, snapshot.as_deref())?;
        let won = self.db.set_session_sandbox(
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

    /// Snapshots the sandbox, records the snapshot in the log, removes the
    /// sandbox. The snapshot is recorded before the sandbox goes, so a kill
    /// at any instant leaves the sandbox or the snapshot to resume from.
    pub fn suspend_session(&mut self, key: &str) -> Result<SessionRecord, EngineError> {
        let s = self.session(key)?;
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
                let snap = self.snapshot(&sandbox, None)?;
                let mut note = Entry::new(EntryKind::Note);
                note.content = Some(format!("suspended: snapshot {}", snap.id));
                note.snapshot_id = Some(snap.id.clone());
                self.session_append(&s, note)?;
            }
            let sandbox = self.sandbox(&sandbox.id)?;
            self.remove_sandbox(&sandbox, true)?;
        }
        if !self.db.move_session(
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

    /// Moves an active session to `to`, owned by `mine`.
    fn claim(&self, s: &SessionRecord, to: SessionState, mine: (i32, u64)) -> Result<(), EngineError> {
        if !s.state.valid_transition(to) {
            return Err(SessionError::InvalidTransition {
                id: s.id.clone(),
                from: s.state,
                to,
            }
            .into());
        }
        if !self.db.move_session(
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

    /// Gives a suspended session a sandbox again: its running sandbox if an
    /// interrupted suspend left one, else a restore of its newest snapshot.
    /// Also finishes a suspend or resume whose process died, and retries a
    /// failed resume.
    pub fn resume_session(&mut self, key: &str) -> Result<SessionRecord, EngineError> {
        let s = self.session(key)?;
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
                if let Some(old) = leftover {
                    self.remove_sandbox(&old, true)?;
                }
                match self.sandbox_from(&s, s.snapshot_id.as_deref()) {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = self.db.move_session(
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
        if !self.db.move_session(
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

    /// A new session whose log is the parent's live log up to `at` (shared,
    /// not copied) and whose sandbox is a restore of the snapshot recorded
    /// at or before `at` (or a fresh one from the image if none was).
    pub fn fork_session(
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
        let name = name.unwrap_or_else(|| format!("session-{id}"));
        if !valid_name(&name) {
            return Err(SessionError::BadName(name).into());
        }
        let sandbox = self.sandbox_from(&p, snap.as_ref().and_then(|e| e.snapshot_id.as_deref()))?;
        let now = crate::now_ms();
        let owner = me();
        let rec = SessionRecord {
            id,
            name,
            state: SessionState::Active,
            image: p.image.clone(),
            driver: p.driver.clone(),
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
        if let Err(e) = self.db.insert_session(&rec) {
            let _ = self.remove_sandbox(&sandbox, true);
            return Err(match e {
                StateError::NameTaken(n) => SessionError::NameTaken(n).into(),
                other => other.into(),
            });
        }
        Ok(rec)
    }

    /// Moves the live branch back to entry `to`: the later entries stay in
    /// the log (and in its chain), abandoned; new entries follow them.
    pub fn rewind_session(&self, key: &str, to: u64) -> Result<super::Rewind, EngineError> {
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
        self.db
            .add_rewind(&s.id, to, s.head_seq)
            .map_err(|e| conflict(e, &s.id))
    }

    /// Closes a session: its sandbox goes; its log stays unless `purge`.
    pub fn close_session(&mut self, key: &str, purge: bool) -> Result<SessionRecord, EngineError> {
        let s = self.session(key)?;
        if purge {
            let children = self.db.session_children(&s.id)?;
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
            self.db.delete_session(&s.id)?;
        }
        Ok(SessionRecord {
            state: SessionState::Closed,
            ..s
        })
    }
}

/// The status an exec reports when the sandbox died under the command.
pub const LOST: i32 = 137;

#[cfg(test)]
mod tests {
    use cairn_store::frame::{decode, encode, FrameError};

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
