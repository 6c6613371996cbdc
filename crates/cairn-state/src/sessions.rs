//! A session's row: its state, its sandbox or snapshot, its log's head
//! (the entries are [`crate::session_log`]'s).

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::session_log::{insert_entry_row, Entry, Rewind};
use crate::tenants::Owned;
use crate::{
    insert_image_rows, insert_snapshot_rows, params, Backend, BackendError, Db, ImageRecord, Row, SnapshotRecord,
    StateError,
};

/// The lifecycle of a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SessionState {
    /// Its sandbox runs.
    Active,
    /// Being snapshotted and its sandbox removed.
    Suspending,
    /// No sandbox: its machine is in its newest snapshot.
    Suspended,
    /// A sandbox is being restored for it.
    Resuming,
    /// A resume failed; resume again once the cause is fixed.
    Failed,
    /// Removed; its log stays unless purged.
    Closed,
}

impl SessionState {
    /// The one place that says which transitions are valid.
    pub fn valid_transition(self, to: SessionState) -> bool {
        use SessionState::*;
        matches!(
            (self, to),
            (Active, Suspending)
                | (Suspending, Suspended)
                | (Suspended, Resuming)
                | (Resuming, Active)
                // An interrupted suspend or resume is finished by a resume.
                | (Suspending, Resuming)
                | (Resuming, Resuming)
                | (Active, Failed)
                | (Suspending, Failed)
                | (Resuming, Failed)
                | (Failed, Resuming)
                | (Active, Closed)
                | (Suspending, Closed)
                | (Suspended, Closed)
                | (Resuming, Closed)
                | (Failed, Closed)
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SessionState::Active => "active",
            SessionState::Suspending => "suspending",
            SessionState::Suspended => "suspended",
            SessionState::Resuming => "resuming",
            SessionState::Failed => "failed",
            SessionState::Closed => "closed",
        }
    }
}

impl fmt::Display for SessionState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SessionState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "active" => SessionState::Active,
            "suspending" => SessionState::Suspending,
            "suspended" => SessionState::Suspended,
            "resuming" => SessionState::Resuming,
            "failed" => SessionState::Failed,
            "closed" => SessionState::Closed,
            other => return Err(format!("unknown session state {other:?}")),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SessionRecord {
    pub id: String,
    pub name: String,
    pub state: SessionState,
    pub image: String,
    pub driver: String,
    pub sandbox_id: Option<String>,
    /// The newest snapshot its log records, and the entry recording it.
    pub snapshot_id: Option<String>,
    pub snapshot_seq: Option<u64>,
    pub idle_timeout_ms: Option<u64>,
    pub parent_id: Option<String>,
    pub fork_seq: Option<u64>,
    pub fork_reason: Option<String>,
    /// How many of the parent's rewinds apply to the entries shared with it.
    #[serde(skip)]
    pub fork_rewinds: u64,
    pub head_seq: u64,
    pub head_hash: String,
    pub rewinds: u64,
    #[serde(skip)]
    pub owner_pid: i32,
    #[serde(skip)]
    pub owner_start: u64,
    pub error: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
    /// The network of its sandboxes (`--network egress`); none: loopback.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<cairn_sandbox::net::NetPolicy>,
}

const SESSION_COLUMNS: &str =
    "id, name, state, image, driver, sandbox_id, snapshot_id, snapshot_seq, idle_timeout_ms, \
     parent_id, fork_seq, fork_reason, fork_rewinds, head_seq, head_hash, rewinds, owner_pid, owner_start, error, \
     created_at, updated_at, network";

fn session_row(r: &Row) -> Result<SessionRecord, StateError> {
    let state: String = r.get(2)?;
    Ok(SessionRecord {
        id: r.get(0)?,
        name: r.get(1)?,
        state: state.parse().map_err(StateError::Damaged)?,
        image: r.get(3)?,
        driver: r.get(4)?,
        sandbox_id: r.get(5)?,
        snapshot_id: r.get(6)?,
        snapshot_seq: r.get(7)?,
        idle_timeout_ms: r.get(8)?,
        parent_id: r.get(9)?,
        fork_seq: r.get(10)?,
        fork_reason: r.get(11)?,
        fork_rewinds: r.get(12)?,
        head_seq: r.get(13)?,
        head_hash: r.get(14)?,
        rewinds: r.get(15)?,
        owner_pid: r.get(16)?,
        owner_start: r.get(17)?,
        error: r.get(18)?,
        created_at: r.get(19)?,
        updated_at: r.get(20)?,
        network: r
            .get::<Option<String>>(21)?
            .map(|text| {
                let policy: cairn_sandbox::net::NetPolicy = serde_json::from_str(&text)
                    .map_err(|e| StateError::Damaged(format!("a session's network is unreadable: {e}")))?;
                policy
                    .check()
                    .map_err(|e| StateError::Damaged(format!("a session's network is invalid: {e}")))?;
                Ok::<_, StateError>(policy)
            })
            .transpose()?,
    })
}

/// Inserts a session row; a taken name is `BackendError::Unique` on `sessions.name`.
pub fn insert_session_row(b: &mut dyn Backend, s: &SessionRecord) -> Result<u64, BackendError> {
    b.execute(
        &format!(
            "INSERT INTO sessions ({SESSION_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11,
             $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22)"
        ),
        params![
            &s.id,
            &s.name,
            s.state.as_str(),
            &s.image,
            &s.driver,
            &s.sandbox_id,
            &s.snapshot_id,
            s.snapshot_seq,
            s.idle_timeout_ms,
            &s.parent_id,
            s.fork_seq,
            &s.fork_reason,
            s.fork_rewinds,
            s.head_seq,
            &s.head_hash,
            s.rewinds,
            s.owner_pid,
            s.owner_start,
            &s.error,
            s.created_at,
            s.updated_at,
            s.network
                .as_ref()
                .map(|n| serde_json::to_string(n).expect("a policy serialises")),
        ],
    )
}

impl Db {
    /// Records a new session; a taken name is [`StateError::NameTaken`]
    /// (the session layer's `SessionError::NameTaken`).
    pub fn insert_session(&self, s: &SessionRecord) -> Result<(), StateError> {
        self.transaction(|b| {
            match insert_session_row(b, s) {
                Err(BackendError::Unique { target }) if target == "sessions.name" => {
                    return Err(StateError::NameTaken(s.name.clone()))
                }
                other => other?,
            };
            self.stamp(b, Owned::Session, &s.id)
        })
    }

    pub fn sessions(&self) -> Result<Vec<SessionRecord>, StateError> {
        let sql = format!("SELECT {SESSION_COLUMNS} FROM sessions ORDER BY created_at, id");
        self.with(|b| b.query(&sql, &[])?.iter().map(session_row).collect())
    }

    /// Sessions whose name or id is `key`, or whose id starts with it (3+ characters).
    pub fn find_sessions(&self, key: &str) -> Result<Vec<SessionRecord>, StateError> {
        let sql = format!(
            "SELECT {SESSION_COLUMNS} FROM sessions WHERE (name = $1 OR name = $3 OR id = $1
             OR (length($1) >= 3 AND substr(id, 1, length($1)) = $1)) AND (CAST($2 AS TEXT) IS NULL OR tenant = $2)"
        );
        // A connection acting for a tenant finds that tenant's only, by
        // the names it gave too (stored qualified: `tenants::qualify`).
        let tenant = self.acting_for();
        let qualified = tenant
            .as_deref()
            .map_or_else(|| key.to_string(), |t| crate::tenants::qualify(t, key));
        let mut rows: Vec<SessionRecord> = self.with(|b| {
            b.query(&sql, params![key, tenant, &qualified])?
                .iter()
                .map(session_row)
                .collect()
        })?;
        if let Some(exact) = rows
            .iter()
            .position(|r| r.name == key || r.name == qualified || r.id == key)
        {
            rows = vec![rows.swap_remove(exact)];
        }
        Ok(rows)
    }

    pub fn session_by_id(&self, id: &str) -> Result<Option<SessionRecord>, StateError> {
        let sql = format!("SELECT {SESSION_COLUMNS} FROM sessions WHERE id = $1");
        self.with(|b| b.query_opt(&sql, params![id])?.as_ref().map(session_row).transpose())
    }

    /// Moves a session from `from` to `to` if it is still in `from` and
    /// still owned by `owner` (a compare-and-set), setting its sandbox and
    /// error and making `new_owner` its owner. False when it lost the race.
    #[allow(clippy::too_many_arguments)]
    pub fn move_session(
        &self,
        id: &str,
        from: SessionState,
        owner: (i32, u64),
        to: SessionState,
        new_owner: (i32, u64),
        sandbox_id: Option<&str>,
        error: Option<&str>,
    ) -> Result<bool, StateError> {
        let n = self.with(|b| {
            Ok(b.execute(
                "UPDATE sessions SET state = $4, owner_pid = $5, owner_start = $6, sandbox_id = $7, error = $8,
                 updated_at = $9 WHERE id = $1 AND state = $2 AND owner_pid = $3 AND owner_start = $10",
                params![
                    id,
                    from.as_str(),
                    owner.0,
                    to.as_str(),
                    new_owner.0,
                    new_owner.1,
                    sandbox_id,
                    error,
                    crate::now_ms(),
                    owner.1
                ],
            )?)
        })?;
        Ok(n == 1)
    }

    /// Active sessions with an idle timeout whose last change is at least
    /// that long before `now` (milliseconds since the epoch).
    pub fn idle_sessions(&self, now: i64) -> Result<Vec<SessionRecord>, StateError> {
        let sql = format!(
            "SELECT {SESSION_COLUMNS} FROM sessions WHERE state = 'active' AND idle_timeout_ms IS NOT NULL
             AND updated_at + idle_timeout_ms <= $1 ORDER BY updated_at"
        );
        self.with(|b| b.query(&sql, params![now])?.iter().map(session_row).collect())
    }

    /// Sets the sandbox of a session in `state` owned by `owner`.
    pub fn set_session_sandbox(
        &self,
        id: &str,
        state: SessionState,
        owner: (i32, u64),
        sandbox_id: Option<&str>,
    ) -> Result<bool, StateError> {
        let n = self.with(|b| {
            Ok(b.execute(
                "UPDATE sessions SET sandbox_id = $5, updated_at = $6
                 WHERE id = $1 AND state = $2 AND owner_pid = $3 AND owner_start = $4",
                params![id, state.as_str(), owner.0, owner.1, sandbox_id, crate::now_ms()],
            )?)
        })?;
        Ok(n == 1)
    }

    /// The sessions forked from `id`.
    pub fn session_children(&self, id: &str) -> Result<Vec<String>, StateError> {
        self.with(|b| {
            b.query("SELECT id FROM sessions WHERE parent_id = $1 ORDER BY id", params![id])?
                .iter()
                .map(|r| Ok(r.get(0)?))
                .collect()
        })
    }

    /// Deletes a session, its log and its branch points, in one transaction.
    pub fn delete_session(&self, id: &str) -> Result<(), StateError> {
        self.transaction(|b| {
            b.execute("DELETE FROM session_entries WHERE session_id = $1", params![id])?;
            b.execute("DELETE FROM session_rewinds WHERE session_id = $1", params![id])?;
            b.execute("DELETE FROM sessions WHERE id = $1", params![id])?;
            Ok(())
        })
    }
}

impl Db {
    /// Records an imported session whole, in one transaction: its row, its
    /// entries as they are (seqs, hashes, times), its rewinds, its
    /// snapshots (kept if already recorded: the id is the manifest's hash)
    /// and its image when none of that name exists. True when the image was
    /// added.
    pub fn import_session_rows(
        &self,
        s: &SessionRecord,
        entries: &[Entry],
        rewinds: &[Rewind],
        snapshots: &[SnapshotRecord],
        image: Option<&ImageRecord>,
    ) -> Result<bool, StateError> {
        self.transaction(|b| {
            match insert_session_row(b, s) {
                Err(BackendError::Unique { target }) if target == "sessions.name" => {
                    return Err(StateError::NameTaken(s.name.clone()))
                }
                other => other?,
            };
            for e in entries {
                insert_entry_row(b, &s.id, e)?;
            }
            for r in rewinds {
                b.execute(
                    "INSERT INTO session_rewinds (session_id, n, to_seq, head_seq, created_at) VALUES ($1, $2, $3, $4, $5)",
                    params![&s.id, r.n, r.to_seq, r.head_seq, r.created_at],
                )?;
            }
            self.stamp(b, Owned::Session, &s.id)?;
            for snap in snapshots {
                insert_snapshot_rows(b, snap)?;
                self.stamp(b, Owned::Snapshot, &snap.id)?;
            }
            let Some(image) = image else { return Ok(false) };
            if b.query_opt("SELECT name FROM images WHERE name = $1", params![&image.name])?
                .is_some()
            {
                return Ok(false);
            }
            insert_image_rows(b, image)?;
            self.stamp(b, Owned::Image, &image.name)?;
            Ok(true)
        })
    }
}
