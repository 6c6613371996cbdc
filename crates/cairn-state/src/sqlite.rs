//! The embedded state store on SQLite (the default: `$CAIRN_HOME/state.db`).
//!
//! WAL mode with `synchronous=NORMAL`: a commit survives a crash of any
//! process (the WAL is in the OS page cache) and costs no fsync; only a
//! power loss can drop the last commits, and then the garbage collector
//! reconciles the host with the rows. Several Cairn processes may use one
//! state directory at once; writers wait for each other (`busy_timeout`).
//! A closing connection does not checkpoint: the WAL stays for the next
//! process, which otherwise pays two fsyncs (the new WAL's header and its
//! directory) before its first write, and every `cairn` command is one
//! process. But the first process to open the database replays the whole
//! WAL to rebuild its index (a read and a checksum per page), so a WAL left
//! to grow to SQLite's own checkpoint (1,000 pages) would slow every command
//! by its length. The process that closes a WAL longer than [`WAL_KEPT`]
//! therefore checkpoints it, without waiting for anyone, and starts the next
//! WAL with one small write, so the next command finds a short log whose
//! header is already durable. `journal_size_limit = 0` keeps the file's
//! length the length of the log in use.

use std::path::Path;
use std::time::Duration;

use rusqlite::types::{ToSqlOutput, ValueRef};
use rusqlite::{Connection, ToSql};

use crate::backend::{Backend, BackendError, BackendKind, Row, Value};
use crate::StateError;

/// `PRAGMA user_version` counts the migrations applied.
const MIGRATIONS: &[&str] = &[
    include_str!("../migrations/sqlite/0001_sandboxes_images.sql"),
    include_str!("../migrations/sqlite/0002_snapshots.sql"),
    include_str!("../migrations/sqlite/0003_runs.sql"),
    include_str!("../migrations/sqlite/0004_api.sql"),
    include_str!("../migrations/sqlite/0005_e2b.sql"),
    include_str!("../migrations/sqlite/0006_sessions.sql"),
    include_str!("../migrations/sqlite/0007_decisions.sql"),
    include_str!("../migrations/sqlite/0008_snapshot_durability.sql"),
    include_str!("../migrations/sqlite/0009_stage_queue.sql"),
    include_str!("../migrations/sqlite/0010_sandbox_network.sql"),
    include_str!("../migrations/sqlite/0011_event_data.sql"),
    include_str!("../migrations/sqlite/0012_e2b_grant.sql"),
    include_str!("../migrations/sqlite/0013_sandbox_disk.sql"),
    include_str!("../migrations/sqlite/0014_sandbox_claims.sql"),
    include_str!("../migrations/sqlite/0015_pending_artifacts.sql"),
    include_str!("../migrations/sqlite/0016_e2b_network.sql"),
    include_str!("../migrations/sqlite/0017_e2b_templates.sql"),
    include_str!("../migrations/sqlite/0018_tenants.sql"),
];

/// The WAL a closing process leaves as it is; a longer one is checkpointed.
const WAL_KEPT: u64 = 512 << 10;

pub struct SqliteBackend {
    conn: Connection,
    wal: std::path::PathBuf,
}

impl SqliteBackend {
    /// Opens (creating if needed) and migrates the database at `path`.
    pub fn open(path: &Path) -> Result<SqliteBackend, StateError> {
        let open = || -> Result<Connection, rusqlite::Error> {
            let conn = Connection::open(path)?;
            conn.busy_timeout(Duration::from_secs(30))?;
            conn.pragma_update(None, "journal_mode", "WAL")?;
            conn.pragma_update(None, "synchronous", "NORMAL")?;
            conn.pragma_update(None, "journal_size_limit", 0)?;
            conn.pragma_update(None, "foreign_keys", "ON")?;
            conn.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true)?;
            Ok(conn)
        };
        // Several processes opening a new database at once contend for the
        // switch to WAL and the first migration; SQLite answers some of that
        // contention with SQLITE_BUSY at once (without waiting, to break a
        // lock cycle), so the whole open is retried until the busy timeout.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut delay = Duration::from_millis(2);
        loop {
            let opened = open()
                .map_err(|e| StateError::from(BackendError::from(e)))
                .and_then(|mut conn| migrate(&mut conn).map(|()| conn));
            match opened {
                Ok(conn) => {
                    let mut wal = path.as_os_str().to_owned();
                    wal.push("-wal");
                    return Ok(SqliteBackend { conn, wal: wal.into() });
                }
                Err(e) if is_busy(&e) && std::time::Instant::now() < deadline => {
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(Duration::from_millis(100));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// The schema version the database records.
    pub fn schema_version(&self) -> Result<i64, BackendError> {
        Ok(self.conn.pragma_query_value(None, "user_version", |r| r.get(0))?)
    }
}

impl Drop for SqliteBackend {
    /// Checkpoints a WAL longer than [`WAL_KEPT`] and starts the next one
    /// (see the module's documentation). Nothing here waits: a reader or
    /// writer in another process leaves the WAL for a later close.
    fn drop(&mut self) {
        let long = std::fs::metadata(&self.wal).is_ok_and(|m| m.len() > WAL_KEPT);
        if !long || self.conn.busy_timeout(Duration::ZERO).is_err() {
            return;
        }
        let checkpointed = self
            .conn
            .query_row("PRAGMA wal_checkpoint(RESTART)", [], |r| r.get::<_, i64>(0))
            .is_ok_and(|busy| busy == 0);
        if checkpointed {
            // The first write after a complete checkpoint starts the WAL
            // over and makes its header durable: done here, on the way out.
            let _ = self
                .conn
                .pragma_query_value(None, "user_version", |r| r.get::<_, i64>(0))
                .and_then(|v| self.conn.pragma_update(None, "user_version", v));
        }
    }
}

/// Whether `e` is SQLite saying another connection holds the lock.
fn is_busy(e: &StateError) -> bool {
    matches!(
        e,
        StateError::Backend(BackendError::Sqlite(rusqlite::Error::SqliteFailure(f, _)))
            if matches!(f.code, rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    )
}

fn migrate(conn: &mut Connection) -> Result<(), StateError> {
    let version: i64 = conn
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(BackendError::from)?;
    let known = MIGRATIONS.len() as i64;
    if version > known {
        return Err(StateError::FutureSchema { found: version, known });
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
        let mut step = || -> Result<(), rusqlite::Error> {
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            // Another process may have migrated while this one waited.
            let now: i64 = tx.pragma_query_value(None, "user_version", |r| r.get(0))?;
            if now <= i as i64 {
                tx.execute_batch(sql)?;
                tx.pragma_update(None, "user_version", i as i64 + 1)?;
            }
            tx.commit()
        };
        step().map_err(BackendError::from)?;
    }
    Ok(())
}

/// Rewrites PostgreSQL's `$N` placeholders to SQLite's `?N` (the same
/// numbered semantics; SQLite reads a bare `$1` as a *named* parameter,
/// numbered by first appearance). Quoted strings and identifiers are
/// copied as they are.
pub fn sqlite_placeholders(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut quote: Option<char> = None;
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        match quote {
            Some(q) => {
                if c == q {
                    quote = None;
                }
                out.push(c);
            }
            None if c == '\'' || c == '"' => {
                quote = Some(c);
                out.push(c);
            }
            None if c == '$' && chars.peek().is_some_and(char::is_ascii_digit) => out.push('?'),
            None => out.push(c),
        }
    }
    out
}

impl ToSql for Value {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(match self {
            Value::Null => ValueRef::Null,
            Value::Int(i) => ValueRef::Integer(*i),
            Value::Real(r) => ValueRef::Real(*r),
            Value::Text(s) => ValueRef::Text(s.as_bytes()),
            Value::Blob(b) => ValueRef::Blob(b),
        }))
    }
}

fn value_of(v: ValueRef<'_>) -> Value {
    match v {
        ValueRef::Null => Value::Null,
        ValueRef::Integer(i) => Value::Int(i),
        ValueRef::Real(r) => Value::Real(r),
        ValueRef::Text(t) => Value::Text(String::from_utf8_lossy(t).into_owned()),
        ValueRef::Blob(b) => Value::Blob(b.to_vec()),
    }
}

/// Maps "UNIQUE constraint failed: sandboxes.name" to [`BackendError::Unique`].
fn classify(e: rusqlite::Error) -> BackendError {
    if let rusqlite::Error::SqliteFailure(f, Some(msg)) = &e {
        if f.code == rusqlite::ErrorCode::ConstraintViolation {
            for prefix in ["UNIQUE constraint failed: ", "PRIMARY KEY constraint failed: "] {
                if let Some(target) = msg.strip_prefix(prefix) {
                    return BackendError::Unique {
                        target: target.to_string(),
                    };
                }
            }
        }
    }
    BackendError::Sqlite(e)
}

impl Backend for SqliteBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Sqlite
    }

    fn execute(&mut self, sql: &str, params: &[Value]) -> Result<u64, BackendError> {
        let mut stmt = self.conn.prepare_cached(&sqlite_placeholders(sql))?;
        let n = stmt
            .execute(rusqlite::params_from_iter(params.iter()))
            .map_err(classify)?;
        Ok(n as u64)
    }

    fn query(&mut self, sql: &str, params: &[Value]) -> Result<Vec<Row>, BackendError> {
        let mut stmt = self.conn.prepare_cached(&sqlite_placeholders(sql))?;
        let width = stmt.column_count();
        let mut rows = stmt
            .query(rusqlite::params_from_iter(params.iter()))
            .map_err(classify)?;
        let mut out = Vec::new();
        while let Some(r) = rows.next().map_err(classify)? {
            let mut values = Vec::with_capacity(width);
            for i in 0..width {
                values.push(value_of(r.get_ref(i)?));
            }
            out.push(Row(values));
        }
        Ok(out)
    }

    fn batch(&mut self, sql: &str) -> Result<(), BackendError> {
        self.conn.execute_batch(sql).map_err(classify)
    }

    fn begin(&mut self) -> Result<(), BackendError> {
        Ok(self.conn.execute_batch("BEGIN IMMEDIATE")?)
    }

    fn commit(&mut self) -> Result<(), BackendError> {
        Ok(self.conn.execute_batch("COMMIT")?)
    }

    fn rollback(&mut self) -> Result<(), BackendError> {
        Ok(self.conn.execute_batch("ROLLBACK")?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_become_numbered_outside_quotes() {
        assert_eq!(
            sqlite_placeholders("UPDATE t SET a = $2, b = '$1', \"c$1\" = $10 WHERE id = $1"),
            "UPDATE t SET a = ?2, b = '$1', \"c$1\" = ?10 WHERE id = ?1"
        );
        assert_eq!(sqlite_placeholders("SELECT '$' || $1"), "SELECT '$' || ?1");
    }

    #[test]
    fn processes_leave_a_short_wal_and_lose_no_commit() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.db");
        let wal = dir.path().join("s.db-wal");
        let blob = "x".repeat(3000);
        let mut longest = 0;
        // Each open, commits and close is one `cairn` command.
        for i in 0..300i64 {
            let mut b = SqliteBackend::open(&path).unwrap();
            for j in 0..4i64 {
                b.execute(
                    "INSERT INTO images (name, source, size_bytes, created_at) VALUES ($1, $2, 0, 0)",
                    &[Value::Text(format!("i{i}-{j}")), Value::Text(blob.clone())],
                )
                .unwrap();
            }
            drop(b);
            longest = longest.max(std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0));
        }
        // A WAL past the bound is checkpointed on close, so the next open
        // replays at most the bound plus one command's commits.
        assert!(longest < WAL_KEPT + (256 << 10), "the WAL reached {longest} bytes");
        let mut b = SqliteBackend::open(&path).unwrap();
        let rows = b.query("SELECT count(*) FROM images", &[]).unwrap();
        assert_eq!(rows[0].0, vec![Value::Int(1200)]);
    }

    #[test]
    fn placeholders_keep_their_numbers_out_of_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = SqliteBackend::open(&dir.path().join("s.db")).unwrap();
        let rows = b
            .query("SELECT $2, $1, $2", &[Value::Int(1), Value::Text("two".into())])
            .unwrap();
        assert_eq!(
            rows[0].0,
            vec![Value::Text("two".into()), Value::Int(1), Value::Text("two".into())]
        );
    }

    #[test]
    fn a_database_of_an_older_schema_is_migrated_and_keeps_its_rows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.db");
        {
            // What the first release wrote: migration 1, user_version 1.
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(MIGRATIONS[0]).unwrap();
            conn.pragma_update(None, "user_version", 1).unwrap();
            conn.execute(
                "INSERT INTO sandboxes (id, name, image, driver, state, owner_pid, owner_start, memory_bytes,
                 cpu_millis, pids_max, created_at, auto_remove) VALUES ('abc', 'old', 'busybox', 'native',
                 'exited', 1, 1, 1, 1, 1, 5, 0)",
                [],
            )
            .unwrap();
        }
        let mut b = SqliteBackend::open(&path).unwrap();
        assert_eq!(b.schema_version().unwrap(), MIGRATIONS.len() as i64);
        let rows = b
            .query(
                "SELECT name, last_snapshot FROM sandboxes WHERE id = $1",
                &[Value::from("abc")],
            )
            .unwrap();
        assert_eq!(rows[0].0, vec![Value::Text("old".into()), Value::Null]);
    }
}
