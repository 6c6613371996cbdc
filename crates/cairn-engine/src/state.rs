//! The embedded state store on SQLite.
//!
//! WAL mode with `synchronous=NORMAL`: a commit survives a crash of any
//! process (the WAL is in the OS page cache) and costs no fsync; only a
//! power loss can drop the last commits, and then the garbage collector
//! reconciles the host with the rows. Several Cairn processes may use one
//! state directory at once; writers wait for each other (`busy_timeout`).

use std::collections::HashSet;
use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

const MIGRATIONS: &[&str] = &[
    include_str!("../migrations/sqlite/0001_sandboxes_images.sql"),
    include_str!("../migrations/sqlite/0002_snapshots.sql"),
    include_str!("../migrations/sqlite/0003_runs.sql"),
];

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("state database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error(
        "the state database was written by a newer Cairn (schema {found}, this build knows {known}); upgrade Cairn"
    )]
    FutureSchema { found: i64, known: i64 },
    #[error("a sandbox named {0:?} already exists; pick another --name or remove it with `cairn rm -f {0}`")]
    NameTaken(String),
    #[error("sandbox {id} cannot go from {from} to {to}")]
    InvalidTransition {
        id: String,
        from: SandboxState,
        to: SandboxState,
    },
    #[error("sandbox {0} changed state while this command ran; retry")]
    Conflict(String),
}

/// The lifecycle of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// The row exists; the host resources are being made.
    Creating,
    /// cairn-init is running.
    Running,
    /// cairn-init is gone (killed, crashed, host rebooted); files remain.
    Exited,
    /// Host resources are being released; the row goes last.
    Removing,
}

impl SandboxState {
    /// The one place that says which transitions are valid.
    pub fn valid_transition(self, to: SandboxState) -> bool {
        use SandboxState::*;
        matches!(
            (self, to),
            (Creating, Running)
                | (Creating, Exited)
                | (Creating, Removing)
                | (Running, Exited)
                | (Running, Removing)
                | (Exited, Removing)
                // A reset restarts an exited sandbox on a new layer chain.
                | (Exited, Creating)
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Running => "running",
            SandboxState::Exited => "exited",
            SandboxState::Removing => "removing",
        }
    }
}

impl fmt::Display for SandboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SandboxState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "creating" => SandboxState::Creating,
            "running" => SandboxState::Running,
            "exited" => SandboxState::Exited,
            "removing" => SandboxState::Removing,
            other => return Err(format!("unknown sandbox state {other:?}")),
        })
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ImageRecord {
    pub name: String,
    pub source: String,
    pub size_bytes: u64,
    pub created_at: i64,
    /// Layer ids, topmost first.
    pub layers: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SandboxRecord {
    pub id: String,
    pub name: String,
    pub image: String,
    pub driver: String,
    pub state: SandboxState,
    pub pid: Option<i32>,
    #[serde(skip)]
    pub pid_start: Option<u64>,
    #[serde(skip)]
    pub owner_pid: i32,
    #[serde(skip)]
    pub owner_start: u64,
    pub memory_bytes: u64,
    pub cpu_millis: u32,
    pub pids_max: u32,
    pub created_at: i64,
    #[serde(skip)]
    pub auto_remove: bool,
    pub ended_reason: Option<String>,
    /// Layer ids, topmost first.
    pub layers: Vec<String>,
    /// Background commands started after every start, restore and reset.
    pub services: Vec<String>,
    /// The snapshot its next snapshot stacks on.
    pub last_snapshot: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SnapshotRecord {
    pub id: String,
    pub parent_id: Option<String>,
    pub sandbox_id: String,
    pub image: String,
    pub driver: String,
    pub label: Option<String>,
    pub created_at: i64,
    pub new_bytes: u64,
    pub stored_bytes: u64,
    /// Layer ids, topmost first.
    pub layers: Vec<String>,
}

pub struct Db {
    pub(crate) conn: Connection,
}

impl Db {
    pub fn open(path: &Path) -> Result<Db, StateError> {
        let mut conn = Connection::open(path)?;
        conn.busy_timeout(Duration::from_secs(30))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        migrate(&mut conn)?;
        Ok(Db { conn })
    }

    pub fn image(&self, name: &str) -> Result<Option<ImageRecord>, StateError> {
        let row = self
            .conn
            .query_row(
                "SELECT name, source, size_bytes, created_at FROM images WHERE name = ?1",
                [name],
                |r| {
                    Ok(ImageRecord {
                        name: r.get(0)?,
                        source: r.get(1)?,
                        size_bytes: r.get::<_, i64>(2)? as u64,
                        created_at: r.get(3)?,
                        layers: Vec::new(),
                    })
                },
            )
            .optional()?;
        let Some(mut rec) = row else { return Ok(None) };
        rec.layers = self.layers_of("image_layers", "image", name)?;
        Ok(Some(rec))
    }

    pub fn images(&self) -> Result<Vec<ImageRecord>, StateError> {
        let names: Vec<String> = self
            .conn
            .prepare("SELECT name FROM images ORDER BY name")?
            .query_map([], |r| r.get(0))?
            .collect::<Result<_, _>>()?;
        let mut out = Vec::new();
        for n in names {
            out.extend(self.image(&n)?);
        }
        Ok(out)
    }

    fn layers_of(&self, table: &str, key: &str, value: &str) -> Result<Vec<String>, StateError> {
        let sql = format!("SELECT layer_id FROM {table} WHERE {key} = ?1 ORDER BY position");
        let layers = self
            .conn
            .prepare_cached(&sql)?
            .query_map([value], |r| r.get(0))?
            .collect::<Result<_, _>>()?;
        Ok(layers)
    }

    /// Inserts or replaces an image, atomically.
    pub fn put_image(&mut self, rec: &ImageRecord) -> Result<(), StateError> {
        let tx = self.conn.transaction()?;
        tx.prepare_cached("DELETE FROM images WHERE name = ?1")?
            .execute([&rec.name])?;
        tx.prepare_cached("INSERT INTO images (name, source, size_bytes, created_at) VALUES (?1, ?2, ?3, ?4)")?
            .execute(params![rec.name, rec.source, rec.size_bytes as i64, rec.created_at])?;
        for (i, l) in rec.layers.iter().enumerate() {
            tx.prepare_cached("INSERT INTO image_layers (image, position, layer_id) VALUES (?1, ?2, ?3)")?
                .execute(params![rec.name, i, l])?;
        }
        tx.commit()?;
        Ok(())
    }

    pub fn delete_image(&self, name: &str) -> Result<bool, StateError> {
        Ok(self
            .conn
            .prepare_cached("DELETE FROM images WHERE name = ?1")?
            .execute([name])?
            > 0)
    }

    pub fn insert_sandbox(&mut self, rec: &SandboxRecord) -> Result<(), StateError> {
        let tx = self.conn.transaction()?;
        let inserted = tx
            .prepare_cached(
                "INSERT INTO sandboxes (id, name, image, driver, state, pid, pid_start, owner_pid, owner_start,
                 memory_bytes, cpu_millis, pids_max, created_at, ended_reason, auto_remove)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
            )?
            .execute(params![
                rec.id,
                rec.name,
                rec.image,
                rec.driver,
                rec.state.as_str(),
                rec.pid,
                rec.pid_start.map(|s| s as i64),
                rec.owner_pid,
                rec.owner_start as i64,
                rec.memory_bytes as i64,
                rec.cpu_millis,
                rec.pids_max,
                rec.created_at,
                rec.ended_reason,
                rec.auto_remove,
            ]);
        match inserted {
            Err(rusqlite::Error::SqliteFailure(e, Some(msg)))
                if e.code == rusqlite::ErrorCode::ConstraintViolation && msg.contains("sandboxes.name") =>
            {
                return Err(StateError::NameTaken(rec.name.clone()))
            }
            other => other?,
        };
        write_sandbox_layers(&tx, &rec.id, &rec.layers, &rec.services)?;
        tx.prepare_cached("UPDATE sandboxes SET last_snapshot = ?2 WHERE id = ?1")?
            .execute(params![rec.id, rec.last_snapshot])?;
        tx.commit()?;
        Ok(())
    }

    /// Points a sandbox at a new layer chain (reset), atomically.
    pub fn set_sandbox_layers(
        &mut self,
        id: &str,
        layers: &[String],
        services: &[String],
        last_snapshot: Option<&str>,
    ) -> Result<(), StateError> {
        let tx = self.conn.transaction()?;
        tx.prepare_cached("DELETE FROM sandbox_layers WHERE sandbox_id = ?1")?
            .execute([id])?;
        tx.prepare_cached("DELETE FROM sandbox_services WHERE sandbox_id = ?1")?
            .execute([id])?;
        write_sandbox_layers(&tx, id, layers, services)?;
        tx.prepare_cached("UPDATE sandboxes SET last_snapshot = ?2 WHERE id = ?1")?
            .execute(params![id, last_snapshot])?;
        tx.commit()?;
        Ok(())
    }

    /// Records a snapshot and makes it the sandbox's last, in one transaction.
    pub fn insert_snapshot(&mut self, rec: &SnapshotRecord) -> Result<(), StateError> {
        let tx = self.conn.transaction()?;
        tx.prepare_cached("INSERT OR IGNORE INTO snapshots (id, parent_id, sandbox_id, image, driver, label, created_at, new_bytes, stored_bytes)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)")?.execute(
            params![
                rec.id,
                rec.parent_id,
                rec.sandbox_id,
                rec.image,
                rec.driver,
                rec.label,
                rec.created_at,
                rec.new_bytes as i64,
                rec.stored_bytes as i64
            ],
        )?;
        tx.prepare_cached("DELETE FROM snapshot_layers WHERE snapshot_id = ?1")?
            .execute([&rec.id])?;
        for (i, l) in rec.layers.iter().enumerate() {
            tx.prepare_cached("INSERT INTO snapshot_layers (snapshot_id, position, layer_id) VALUES (?1, ?2, ?3)")?
                .execute(params![rec.id, i, l])?;
        }
        tx.prepare_cached("UPDATE sandboxes SET last_snapshot = ?2 WHERE id = ?1")?
            .execute(params![rec.sandbox_id, rec.id])?;
        tx.commit()?;
        Ok(())
    }

    fn snapshot_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SnapshotRecord> {
        Ok(SnapshotRecord {
            id: r.get(0)?,
            parent_id: r.get(1)?,
            sandbox_id: r.get(2)?,
            image: r.get(3)?,
            driver: r.get(4)?,
            label: r.get(5)?,
            created_at: r.get(6)?,
            new_bytes: r.get::<_, i64>(7)? as u64,
            stored_bytes: r.get::<_, i64>(8)? as u64,
            layers: Vec::new(),
        })
    }

    const SNAPSHOT_COLUMNS: &'static str =
        "id, parent_id, sandbox_id, image, driver, label, created_at, new_bytes, stored_bytes";

    pub fn snapshots(&self) -> Result<Vec<SnapshotRecord>, StateError> {
        let sql = format!(
            "SELECT {} FROM snapshots ORDER BY created_at, id",
            Self::SNAPSHOT_COLUMNS
        );
        let mut rows: Vec<SnapshotRecord> = self
            .conn
            .prepare(&sql)?
            .query_map([], Self::snapshot_from_row)?
            .collect::<Result<_, _>>()?;
        for r in &mut rows {
            r.layers = self.layers_of("snapshot_layers", "snapshot_id", &r.id)?;
        }
        Ok(rows)
    }

    /// Snapshots whose id starts with `key` (at least 4 digits) or whose label is `key`.
    pub fn find_snapshots(&self, key: &str) -> Result<Vec<SnapshotRecord>, StateError> {
        let sql = format!(
            "SELECT {} FROM snapshots WHERE id = ?1 OR label = ?1 OR (length(?1) >= 4 AND substr(id, 1, length(?1)) = ?1)
             ORDER BY created_at DESC",
            Self::SNAPSHOT_COLUMNS
        );
        let mut rows: Vec<SnapshotRecord> = self
            .conn
            .prepare(&sql)?
            .query_map([key], Self::snapshot_from_row)?
            .collect::<Result<_, _>>()?;
        for r in &mut rows {
            r.layers = self.layers_of("snapshot_layers", "snapshot_id", &r.id)?;
        }
        Ok(rows)
    }

    /// Deletes a snapshot row; its children keep their own layer lists.
    pub fn delete_snapshot(&self, id: &str) -> Result<(), StateError> {
        self.conn
            .prepare_cached("DELETE FROM snapshots WHERE id = ?1")?
            .execute([id])?;
        Ok(())
    }

    fn sandbox_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SandboxRecord> {
        let state: String = r.get(4)?;
        Ok(SandboxRecord {
            id: r.get(0)?,
            name: r.get(1)?,
            image: r.get(2)?,
            driver: r.get(3)?,
            state: state.parse().map_err(|e: String| {
                rusqlite::Error::FromSqlConversionFailure(4, rusqlite::types::Type::Text, e.into())
            })?,
            pid: r.get(5)?,
            pid_start: r.get::<_, Option<i64>>(6)?.map(|v| v as u64),
            owner_pid: r.get(7)?,
            owner_start: r.get::<_, i64>(8)? as u64,
            memory_bytes: r.get::<_, i64>(9)? as u64,
            cpu_millis: r.get(10)?,
            pids_max: r.get(11)?,
            created_at: r.get(12)?,
            ended_reason: r.get(13)?,
            auto_remove: r.get(14)?,
            last_snapshot: r.get(15)?,
            layers: Vec::new(),
            services: Vec::new(),
        })
    }

    /// Fills in the sandbox's layers and services.
    fn complete(&self, r: &mut SandboxRecord) -> Result<(), StateError> {
        r.layers = self.layers_of("sandbox_layers", "sandbox_id", &r.id)?;
        r.services = self
            .conn
            .prepare_cached("SELECT command FROM sandbox_services WHERE sandbox_id = ?1 ORDER BY position")?
            .query_map([&r.id], |row| row.get(0))?
            .collect::<Result<_, _>>()?;
        Ok(())
    }

    const SANDBOX_COLUMNS: &'static str = "id, name, image, driver, state, pid, pid_start, owner_pid, owner_start,
        memory_bytes, cpu_millis, pids_max, created_at, ended_reason, auto_remove, last_snapshot";

    pub fn sandboxes(&self) -> Result<Vec<SandboxRecord>, StateError> {
        let sql = format!(
            "SELECT {} FROM sandboxes ORDER BY created_at, id",
            Self::SANDBOX_COLUMNS
        );
        let mut rows: Vec<SandboxRecord> = self
            .conn
            .prepare(&sql)?
            .query_map([], Self::sandbox_from_row)?
            .collect::<Result<_, _>>()?;
        for r in &mut rows {
            self.complete(r)?;
        }
        Ok(rows)
    }

    /// Finds sandboxes whose id starts with `key` or whose name is `key`.
    pub fn find_sandboxes(&self, key: &str) -> Result<Vec<SandboxRecord>, StateError> {
        let sql = format!(
            "SELECT {} FROM sandboxes WHERE name = ?1 OR id = ?1 OR (length(?1) >= 3 AND substr(id, 1, length(?1)) = ?1)",
            Self::SANDBOX_COLUMNS
        );
        let mut rows: Vec<SandboxRecord> = self
            .conn
            .prepare_cached(&sql)?
            .query_map([key], Self::sandbox_from_row)?
            .collect::<Result<_, _>>()?;
        // An exact name or id beats prefixes.
        if let Some(exact) = rows.iter().position(|r| r.name == key || r.id == key) {
            rows = vec![rows.swap_remove(exact)];
        }
        for r in &mut rows {
            self.complete(r)?;
        }
        Ok(rows)
    }

    /// Moves a sandbox from `from` to `to`, refusing invalid transitions and
    /// lost races (another process moved it first).
    pub fn transition(
        &self,
        id: &str,
        from: SandboxState,
        to: SandboxState,
        reason: Option<&str>,
    ) -> Result<(), StateError> {
        if !from.valid_transition(to) {
            return Err(StateError::InvalidTransition {
                id: id.to_string(),
                from,
                to,
            });
        }
        let n = self.conn.prepare_cached("UPDATE sandboxes SET state = ?3, ended_reason = COALESCE(?4, ended_reason) WHERE id = ?1 AND state = ?2")?.execute(
            params![id, from.as_str(), to.as_str(), reason],
        )?;
        if n == 0 {
            return Err(StateError::Conflict(id.to_string()));
        }
        Ok(())
    }

    pub fn set_running(&self, id: &str, pid: i32, pid_start: u64) -> Result<(), StateError> {
        let n = self
            .conn
            .prepare_cached(
                "UPDATE sandboxes SET state = 'running', pid = ?2, pid_start = ?3 WHERE id = ?1 AND state = 'creating'",
            )?
            .execute(params![id, pid, pid_start as i64])?;
        if n == 0 {
            return Err(StateError::Conflict(id.to_string()));
        }
        Ok(())
    }

    /// Records a running sandbox's new init process (after a driver
    /// restarted it from a checkpoint).
    pub fn set_process(&self, id: &str, pid: i32, pid_start: u64) -> Result<(), StateError> {
        self.conn
            .prepare_cached("UPDATE sandboxes SET pid = ?2, pid_start = ?3 WHERE id = ?1")?
            .execute(params![id, pid, pid_start as i64])?;
        Ok(())
    }

    /// Records which process now owns an operation on the sandbox.
    pub fn set_owner(&self, id: &str, pid: i32, start: u64) -> Result<(), StateError> {
        self.conn
            .prepare_cached("UPDATE sandboxes SET owner_pid = ?2, owner_start = ?3 WHERE id = ?1")?
            .execute(params![id, pid, start as i64])?;
        Ok(())
    }

    /// Whether the sandbox goes when its owner process dies.
    pub fn set_auto_remove(&self, id: &str, auto_remove: bool) -> Result<(), StateError> {
        self.conn
            .prepare_cached("UPDATE sandboxes SET auto_remove = ?2 WHERE id = ?1")?
            .execute(params![id, auto_remove])?;
        Ok(())
    }

    /// Makes `new` the owner of a sandbox if `old` still is (a
    /// compare-and-set); false when another process took it first.
    pub fn take_over(&self, id: &str, old: (i32, u64), new: (i32, u64)) -> Result<bool, StateError> {
        let n = self.conn.prepare_cached("UPDATE sandboxes SET owner_pid = ?4, owner_start = ?5 WHERE id = ?1 AND owner_pid = ?2 AND owner_start = ?3")?.execute(
            params![id, old.0, old.1 as i64, new.0, new.1 as i64],
        )?;
        Ok(n == 1)
    }

    pub fn delete_sandbox(&self, id: &str) -> Result<(), StateError> {
        self.conn
            .prepare_cached("DELETE FROM sandboxes WHERE id = ?1")?
            .execute([id])?;
        Ok(())
    }

    /// Every layer id an image, a sandbox or a snapshot refers to.
    pub fn referenced_layers(&self) -> Result<HashSet<String>, StateError> {
        self.strings(&[
            "SELECT layer_id FROM image_layers",
            "SELECT layer_id FROM sandbox_layers",
            "SELECT layer_id FROM snapshot_layers",
        ])
    }

    /// The union of the single text column each query selects.
    pub(crate) fn strings(&self, queries: &[&str]) -> Result<HashSet<String>, StateError> {
        let mut out = HashSet::new();
        for sql in queries {
            let values: Vec<String> = self
                .conn
                .prepare_cached(sql)?
                .query_map([], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            out.extend(values);
        }
        Ok(out)
    }
}

fn write_sandbox_layers(
    tx: &rusqlite::Transaction<'_>,
    id: &str,
    layers: &[String],
    services: &[String],
) -> Result<(), StateError> {
    for (i, l) in layers.iter().enumerate() {
        tx.prepare_cached("INSERT INTO sandbox_layers (sandbox_id, position, layer_id) VALUES (?1, ?2, ?3)")?
            .execute(params![id, i, l])?;
    }
    for (i, c) in services.iter().enumerate() {
        tx.prepare_cached("INSERT INTO sandbox_services (sandbox_id, position, command) VALUES (?1, ?2, ?3)")?
            .execute(params![id, i, c])?;
    }
    Ok(())
}

fn migrate(conn: &mut Connection) -> Result<(), StateError> {
    let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    let known = MIGRATIONS.len() as i64;
    if version > known {
        return Err(StateError::FutureSchema { found: version, known });
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
        let tx = conn.transaction()?;
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", i as i64 + 1)?;
        tx.commit()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(id: &str, name: &str) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            name: name.into(),
            image: "busybox".into(),
            driver: "native".into(),
            state: SandboxState::Creating,
            pid: None,
            pid_start: None,
            owner_pid: 1,
            owner_start: 1,
            memory_bytes: 1 << 30,
            cpu_millis: 1000,
            pids_max: 100,
            created_at: 0,
            auto_remove: false,
            ended_reason: None,
            layers: vec!["a".into(), "b".into()],
            services: vec!["sleep 1".into()],
            last_snapshot: None,
        }
    }

    #[test]
    fn sandboxes_round_trip_and_names_are_unique() {
        let dir = tempfile::tempdir().unwrap();
        let mut db = Db::open(&dir.path().join("s.db")).unwrap();
        db.insert_sandbox(&sandbox("abc123", "one")).unwrap();
        let err = db.insert_sandbox(&sandbox("def456", "one")).unwrap_err();
        assert!(matches!(err, StateError::NameTaken(_)), "{err}");
        let found = db.find_sandboxes("abc").unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].layers, vec!["a", "b"]);
        assert_eq!(db.find_sandboxes("one").unwrap()[0].id, "abc123");
        assert!(db.find_sandboxes("zz").unwrap().is_empty());
    }

    #[test]
    fn invalid_transitions_are_errors_naming_both_states() {
        let dir = tempfile::tempdir().unwrap();
        let mut db = Db::open(&dir.path().join("s.db")).unwrap();
        db.insert_sandbox(&sandbox("abc123", "one")).unwrap();
        let err = db
            .transition("abc123", SandboxState::Exited, SandboxState::Running, None)
            .unwrap_err();
        assert_eq!(err.to_string(), "sandbox abc123 cannot go from exited to running");
        // A lost race is a conflict, not a silent no-op.
        let err = db
            .transition("abc123", SandboxState::Running, SandboxState::Exited, None)
            .unwrap_err();
        assert!(matches!(err, StateError::Conflict(_)));
        db.set_running("abc123", 10, 20).unwrap();
        db.transition("abc123", SandboxState::Running, SandboxState::Removing, None)
            .unwrap();
    }

    #[test]
    fn a_newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.db");
        drop(Db::open(&path).unwrap());
        Connection::open(&path)
            .unwrap()
            .pragma_update(None, "user_version", 99)
            .unwrap();
        let err = Db::open(&path).err().unwrap();
        assert!(err.to_string().contains("newer Cairn"), "{err}");
    }

    #[test]
    fn layers_stay_referenced_until_both_image_and_sandbox_are_gone() {
        let dir = tempfile::tempdir().unwrap();
        let mut db = Db::open(&dir.path().join("s.db")).unwrap();
        db.put_image(&ImageRecord {
            name: "img".into(),
            source: "test".into(),
            size_bytes: 1,
            created_at: 0,
            layers: vec!["a".into()],
        })
        .unwrap();
        db.insert_sandbox(&sandbox("abc123", "one")).unwrap();
        assert!(db.delete_image("img").unwrap());
        assert!(db.referenced_layers().unwrap().contains("a"));
        db.delete_sandbox("abc123").unwrap();
        assert!(db.referenced_layers().unwrap().is_empty());
    }
}
