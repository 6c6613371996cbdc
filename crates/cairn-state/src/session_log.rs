//! The context log's entries: their kinds, their canonical encoding and
//! the hash chain over it, and the rows that hold them.
//!
//! hash_n = BLAKE3(hash_{n-1} || canonical(entry n)); the chain of a root
//! session starts from 32 zero bytes, a fork's continues from its parent's
//! entry at the fork point. Seqs run on along a lineage: a fork at N
//! appends N+1, N+2, … while its first N entries are read from its parent.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::{params, Backend, Db, Row, StateError, Value};

/// The version of the canonical entry encoding the hash covers.
pub const ENTRY_VERSION: u32 = 1;
/// The chain's first link, before entry 1 of a root session.
pub const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";
/// Payloads above this go to the chunk store; the row keeps their hash.
pub const INLINE_MAX: usize = 64 << 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    System,
    User,
    Assistant,
    ToolCall,
    ToolResult,
    Note,
    Recovered,
}

impl EntryKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EntryKind::System => "system",
            EntryKind::User => "user",
            EntryKind::Assistant => "assistant",
            EntryKind::ToolCall => "tool_call",
            EntryKind::ToolResult => "tool_result",
            EntryKind::Note => "note",
            EntryKind::Recovered => "recovered",
        }
    }
}

impl fmt::Display for EntryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for EntryKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "system" => EntryKind::System,
            "user" => EntryKind::User,
            "assistant" => EntryKind::Assistant,
            "tool_call" => EntryKind::ToolCall,
            "tool_result" => EntryKind::ToolResult,
            "note" => EntryKind::Note,
            "recovered" => EntryKind::Recovered,
            other => return Err(format!("unknown log entry kind {other:?}")),
        })
    }
}

/// An entry as stored: large payloads by reference. `seq`, `hash` and
/// `created_at` are assigned by the append.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    #[serde(default)]
    pub seq: u64,
    #[serde(default = "default_version")]
    pub version: u32,
    pub kind: EntryKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// The chunk-store object holding `content` when it is too large to inline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// JSON text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_ref: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_status: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_in: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_out: Option<u64>,
    /// The snapshot holding the machine after this entry, if one was taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    #[serde(default)]
    pub created_at: i64,
    #[serde(default)]
    pub hash: String,
}

fn default_version() -> u32 {
    ENTRY_VERSION
}

impl Entry {
    /// A new entry of `kind`, every other field empty.
    pub fn new(kind: EntryKind) -> Entry {
        Entry {
            seq: 0,
            version: ENTRY_VERSION,
            kind,
            role: None,
            content: None,
            content_ref: None,
            tool: None,
            arguments: None,
            result: None,
            result_ref: None,
            exit_status: None,
            tokens_in: None,
            tokens_out: None,
            snapshot_id: None,
            created_at: 0,
            hash: String::new(),
        }
    }

    /// The bytes the hash covers: every field but the hash, in a fixed
    /// order, each tagged and length-prefixed (absent and empty differ).
    pub fn canonical(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(256);
        out.extend_from_slice(b"CAIRNLOG");
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        let text = |out: &mut Vec<u8>, v: Option<&str>| match v {
            None => out.push(0),
            Some(s) => {
                out.push(1);
                out.extend_from_slice(&(s.len() as u64).to_le_bytes());
                out.extend_from_slice(s.as_bytes());
            }
        };
        let int = |out: &mut Vec<u8>, v: Option<i64>| match v {
            None => out.push(0),
            Some(i) => {
                out.push(1);
                out.extend_from_slice(&i.to_le_bytes());
            }
        };
        text(&mut out, Some(self.kind.as_str()));
        text(&mut out, self.role.as_deref());
        text(&mut out, self.content.as_deref());
        text(&mut out, self.content_ref.as_deref());
        text(&mut out, self.tool.as_deref());
        text(&mut out, self.arguments.as_deref());
        text(&mut out, self.result.as_deref());
        text(&mut out, self.result_ref.as_deref());
        int(&mut out, self.exit_status.map(i64::from));
        int(&mut out, self.tokens_in.map(|t| t as i64));
        int(&mut out, self.tokens_out.map(|t| t as i64));
        text(&mut out, self.snapshot_id.as_deref());
        int(&mut out, Some(self.created_at));
        out
    }

    /// This entry's link after `previous` (hex).
    pub fn chain(&self, previous: &str) -> String {
        let mut h = blake3::Hasher::new();
        h.update(previous.as_bytes());
        h.update(&self.canonical());
        h.finalize().to_hex().to_string()
    }
}

/// A rewind: entries `to_seq < seq <= head_seq` left the live branch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Rewind {
    pub n: u64,
    pub to_seq: u64,
    pub head_seq: u64,
    pub created_at: i64,
}

/// One stretch of a lineage's log: the rows of `session` with
/// `lo < seq <= hi`.
#[derive(Debug, Clone)]
pub struct Segment {
    pub session: String,
    pub lo: u64,
    pub hi: u64,
}

/// Which rows a read returns.
#[derive(Debug, Clone, Copy)]
pub enum Order {
    /// From a seq upwards.
    Ascending { from: u64 },
    /// The newest first.
    Descending,
    /// The newest below a seq first (paging back through a long log).
    Below { before: u64 },
}

const ENTRY_COLUMNS: &str = "seq, version, kind, role, content, content_ref, tool, arguments, result, result_ref, \
     exit_status, tokens_in, tokens_out, snapshot_id, created_at, hash";

fn entry_row(r: &Row) -> Result<Entry, StateError> {
    let kind: String = r.get(2)?;
    Ok(Entry {
        seq: r.get(0)?,
        version: r.get(1)?,
        kind: kind.parse().map_err(StateError::Damaged)?,
        role: r.get(3)?,
        content: r.get(4)?,
        content_ref: r.get(5)?,
        tool: r.get(6)?,
        arguments: r.get(7)?,
        result: r.get(8)?,
        result_ref: r.get(9)?,
        exit_status: r.get(10)?,
        tokens_in: r.get(11)?,
        tokens_out: r.get(12)?,
        snapshot_id: r.get(13)?,
        created_at: r.get(14)?,
        hash: r.get(15)?,
    })
}

/// Inserts one entry row as it is (seq, hash and time included).
pub fn insert_entry_row(b: &mut dyn Backend, session: &str, e: &Entry) -> Result<(), StateError> {
    b.execute(
        &format!(
            "INSERT INTO session_entries (session_id, {ENTRY_COLUMNS})
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)"
        ),
        params![
            session,
            e.seq,
            e.version,
            e.kind.as_str(),
            &e.role,
            &e.content,
            &e.content_ref,
            &e.tool,
            &e.arguments,
            &e.result,
            &e.result_ref,
            e.exit_status,
            e.tokens_in,
            e.tokens_out,
            &e.snapshot_id,
            e.created_at,
            &e.hash,
        ],
    )?;
    Ok(())
}

/// Why an append did not happen.
#[derive(Debug)]
pub enum AppendRefused {
    /// The session is closed.
    Closed,
    /// Another appender moved the head first.
    Raced,
}

impl Db {
    /// Appends entries to a session's log in one transaction: each gets the
    /// next seq and its link, and the head moves by compare-and-set. An
    /// entry naming a snapshot makes it the session's newest.
    pub fn append_entries(&self, session: &str, entries: &[Entry]) -> Result<Vec<Entry>, StateError> {
        self.transaction(|b| {
            // Takes the session row's lock first (PostgreSQL; SQLite's
            // transaction holds the write lock already), so appenders queue
            // and each reads the head the previous one committed.
            b.execute(
                "UPDATE sessions SET head_seq = head_seq WHERE id = $1",
                params![session],
            )?;
            let head = b
                .query_opt(
                    "SELECT head_seq, head_hash, state FROM sessions WHERE id = $1",
                    params![session],
                )?
                .ok_or_else(|| StateError::Damaged(format!("no session {session}")))?;
            let (mut seq, mut hash): (u64, String) = (head.get(0)?, head.get(1)?);
            let state: String = head.get(2)?;
            if state == "closed" {
                return Err(StateError::Conflict(format!("session {session} (it is closed)")));
            }
            let start = seq;
            let now = crate::now_ms();
            let mut out = Vec::with_capacity(entries.len());
            for e in entries {
                let mut e = e.clone();
                seq += 1;
                e.seq = seq;
                e.version = ENTRY_VERSION;
                e.created_at = now;
                e.hash = e.chain(&hash);
                hash = e.hash.clone();
                insert_entry_row(b, session, &e)?;
                if let Some(snap) = &e.snapshot_id {
                    b.execute(
                        "UPDATE sessions SET snapshot_id = $2, snapshot_seq = $3 WHERE id = $1",
                        params![session, snap, e.seq],
                    )?;
                }
                out.push(e);
            }
            let n = b.execute(
                "UPDATE sessions SET head_seq = $2, head_hash = $3, updated_at = $4 WHERE id = $1 AND head_seq = $5",
                params![session, seq, &hash, now, start],
            )?;
            if n != 1 {
                return Err(StateError::Conflict(format!("session {session}")));
            }
            Ok(out)
        })
    }

    /// Up to `limit` rows of the segments, skipping seqs inside `hidden`
    /// (abandoned by rewinds), in `order`. Each segment is one range scan
    /// of the primary key, so the cost does not grow with the log.
    pub fn read_entries(
        &self,
        segments: &[Segment],
        hidden: &[(u64, u64)],
        order: Order,
        limit: usize,
        only_snapshots: bool,
    ) -> Result<Vec<Entry>, StateError> {
        let mut filter = String::new();
        let mut base: Vec<Value> = Vec::new();
        for (i, (lo, hi)) in hidden.iter().enumerate() {
            filter.push_str(&format!(" AND NOT (seq > ${} AND seq <= ${})", 5 + 2 * i, 6 + 2 * i));
            base.push(Value::from(*lo));
            base.push(Value::from(*hi));
        }
        if only_snapshots {
            filter.push_str(" AND snapshot_id IS NOT NULL");
        }
        let mut out = Vec::new();
        let ordered: Vec<&Segment> = match order {
            Order::Ascending { .. } => segments.iter().collect(),
            Order::Descending | Order::Below { .. } => segments.iter().rev().collect(),
        };
        self.with(|b| {
            for s in ordered {
                if out.len() >= limit {
                    break;
                }
                let (lo, hi, dir) = match order {
                    Order::Ascending { from } => (s.lo.max(from.saturating_sub(1)), s.hi, "ASC"),
                    Order::Descending => (s.lo, s.hi, "DESC"),
                    Order::Below { before } => (s.lo, s.hi.min(before.saturating_sub(1)), "DESC"),
                };
                if lo >= hi {
                    continue;
                }
                let sql = format!(
                    "SELECT {ENTRY_COLUMNS} FROM session_entries WHERE session_id = $1 AND seq > $2 AND seq <= $3
                     {filter} ORDER BY seq {dir} LIMIT $4"
                );
                let mut p = vec![
                    Value::from(s.session.as_str()),
                    Value::from(lo),
                    Value::from(hi),
                    Value::from((limit - out.len()) as u64),
                ];
                p.extend(base.iter().cloned());
                for r in b.query(&sql, &p)? {
                    out.push(entry_row(&r)?);
                }
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// Every row of a segment with `from <= seq`, up to `limit`, abandoned
    /// or not (the chain covers them all).
    pub fn raw_entries(&self, s: &Segment, from: u64, limit: usize) -> Result<Vec<Entry>, StateError> {
        let sql = format!(
            "SELECT {ENTRY_COLUMNS} FROM session_entries WHERE session_id = $1 AND seq >= $2 AND seq <= $3
             ORDER BY seq LIMIT $4"
        );
        self.with(|b| {
            b.query(
                &sql,
                params![s.session.as_str(), from.max(s.lo + 1), s.hi, limit as u64],
            )?
            .iter()
            .map(entry_row)
            .collect()
        })
    }

    /// A session's rewinds, oldest first.
    pub fn rewinds(&self, session: &str) -> Result<Vec<Rewind>, StateError> {
        self.with(|b| {
            b.query(
                "SELECT n, to_seq, head_seq, created_at FROM session_rewinds WHERE session_id = $1 ORDER BY n",
                params![session],
            )?
            .iter()
            .map(|r| {
                Ok(Rewind {
                    n: r.get(0)?,
                    to_seq: r.get(1)?,
                    head_seq: r.get(2)?,
                    created_at: r.get(3)?,
                })
            })
            .collect()
        })
    }

    /// Records a branch point: the entries after `to_seq` up to the head
    /// leave the live branch. A compare-and-set on the head, so an append
    /// racing with it is either abandoned with the rest or kept after it.
    pub fn add_rewind(&self, session: &str, to_seq: u64, head_seq: u64) -> Result<Rewind, StateError> {
        self.transaction(|b| {
            let now = crate::now_ms();
            b.execute("UPDATE sessions SET rewinds = rewinds WHERE id = $1", params![session])?;
            let row = b
                .query_opt(
                    "SELECT rewinds FROM sessions WHERE id = $1 AND head_seq = $2",
                    params![session, head_seq],
                )?
                .ok_or_else(|| StateError::Conflict(format!("session {session}")))?;
            let n: u64 = row.get::<u64>(0)? + 1;
            b.execute(
                "INSERT INTO session_rewinds (session_id, n, to_seq, head_seq, created_at) VALUES ($1, $2, $3, $4, $5)",
                params![session, n, to_seq, head_seq, now],
            )?;
            b.execute(
                "UPDATE sessions SET rewinds = $2, updated_at = $3 WHERE id = $1",
                params![session, n, now],
            )?;
            Ok(Rewind {
                n,
                to_seq,
                head_seq,
                created_at: now,
            })
        })
    }

    /// The chunk-store objects log payloads are kept in (for the collector).
    pub fn session_payloads(&self) -> Result<std::collections::HashSet<String>, StateError> {
        self.strings(&[
            "SELECT content_ref FROM session_entries WHERE content_ref IS NOT NULL",
            "SELECT result_ref FROM session_entries WHERE result_ref IS NOT NULL",
        ])
    }

    /// The snapshots session logs name (a fork or a resume may need any).
    pub fn session_snapshots(&self) -> Result<std::collections::HashSet<String>, StateError> {
        self.strings(&[
            "SELECT snapshot_id FROM session_entries WHERE snapshot_id IS NOT NULL",
            "SELECT snapshot_id FROM sessions WHERE snapshot_id IS NOT NULL AND state <> 'closed'",
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_distinguishes_absent_from_empty_and_fields() {
        let mut a = Entry::new(EntryKind::User);
        a.seq = 1;
        let mut b = a.clone();
        b.content = Some(String::new());
        assert_ne!(a.canonical(), b.canonical());
        let mut c = a.clone();
        c.role = Some(String::new());
        assert_ne!(b.canonical(), c.canonical());
        assert_eq!(a.chain(GENESIS), a.clone().chain(GENESIS));
        assert_ne!(a.chain(GENESIS), b.chain(GENESIS));
    }

    #[test]
    fn entry_json_round_trips_and_refuses_unknown_kinds() {
        let mut e = Entry::new(EntryKind::ToolCall);
        e.tool = Some("exec".into());
        e.arguments = Some(r#"{"argv":["ls"]}"#.into());
        let text = serde_json::to_string(&e).unwrap();
        let back: Entry = serde_json::from_str(&text).unwrap();
        assert_eq!(back, e);
        assert!(serde_json::from_str::<Entry>(r#"{"kind":"bogus"}"#).is_err());
        assert_eq!("tool_result".parse::<EntryKind>().unwrap(), EntryKind::ToolResult);
    }
}
