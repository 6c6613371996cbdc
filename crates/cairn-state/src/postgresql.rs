//! The state store on PostgreSQL (`--state postgres://…`), for state that
//! must outlive the host or be shared by many processes.
//!
//! READ COMMITTED: every compare-and-set is one `UPDATE … WHERE state = $x`,
//! which PostgreSQL re-checks against the newest row version after waiting
//! for a concurrent writer, so exactly one of two racing transitions wins.
//! A database belongs to one Cairn state directory (its chunk store,
//! layers and sandboxes are local): the first open records the home's
//! identity and later opens from another home are refused.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::{Duration, Instant};

use postgres::error::SqlState;
use postgres::types::{ToSql, Type};
use postgres::{Client, Config, NoTls, Statement};

use crate::backend::{error_chain, Backend, BackendError, BackendKind, Row, Value};
use crate::StateError;

/// The schema version is the number of migrations applied, as SQLite's
/// `user_version` is; the two lists stay in step, one file each.
const MIGRATIONS: &[&str] = &[
    include_str!("../migrations/postgres/0001_sandboxes_images.sql"),
    include_str!("../migrations/postgres/0002_snapshots.sql"),
    include_str!("../migrations/postgres/0003_runs.sql"),
    include_str!("../migrations/postgres/0004_api.sql"),
    include_str!("../migrations/postgres/0005_e2b.sql"),
    include_str!("../migrations/postgres/0006_sessions.sql"),
    include_str!("../migrations/postgres/0007_decisions.sql"),
    include_str!("../migrations/postgres/0008_snapshot_durability.sql"),
    include_str!("../migrations/postgres/0009_stage_queue.sql"),
    include_str!("../migrations/postgres/0010_sandbox_network.sql"),
    include_str!("../migrations/postgres/0011_event_data.sql"),
    include_str!("../migrations/postgres/0012_e2b_grant.sql"),
    include_str!("../migrations/postgres/0013_sandbox_disk.sql"),
    include_str!("../migrations/postgres/0014_sandbox_claims.sql"),
    include_str!("../migrations/postgres/0015_pending_artifacts.sql"),
    include_str!("../migrations/postgres/0016_e2b_network.sql"),
    include_str!("../migrations/postgres/0017_e2b_templates.sql"),
    include_str!("../migrations/postgres/0018_tenants.sql"),
];

/// Serialises migrations (and the home claim) between processes opening
/// one database at once: "cairn" and a version of this lock's meaning.
const MIGRATION_LOCK: i64 = 0x6361_6972_6e00_0001;

/// The bookkeeping tables, outside the numbered migrations: the schema
/// version and the state directory the database belongs to.
const BOOKKEEPING: &str = "
CREATE TABLE IF NOT EXISTS cairn_schema (
    version  BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS cairn_home (
    singleton   BOOLEAN PRIMARY KEY DEFAULT TRUE CHECK (singleton),
    home_id     TEXT NOT NULL,
    home_path   TEXT NOT NULL,
    claimed_at  BIGINT NOT NULL
);
ALTER TABLE cairn_home ADD COLUMN IF NOT EXISTS store TEXT;
";

/// A parsed `postgres://` URL and how to name it without its password.
#[derive(Clone)]
pub struct PostgresTarget {
    config: Config,
    shown: String,
}

impl std::fmt::Debug for PostgresTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.shown)
    }
}

impl PostgresTarget {
    pub fn parse(url: &str) -> Result<PostgresTarget, StateError> {
        let mut config = Config::from_str(url).map_err(|e| StateError::BadLocation {
            shown: redact(url),
            reason: scrub(&error_chain(&e), url),
        })?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(10));
        }
        // A host cut off from the server (a partition, a link down) sees its
        // requests fail within seconds, not after the kernel's retries
        // (~15 min): a worker then knows its lease is running down.
        config.tcp_user_timeout(TCP_USER_TIMEOUT);
        config.keepalives(true).keepalives_idle(TCP_USER_TIMEOUT);
        config.options(&with_session_timeouts(config.get_options()));
        let hosts: Vec<String> = config
            .get_hosts()
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let port = config
                    .get_ports()
                    .get(i)
                    .or(config.get_ports().first())
                    .unwrap_or(&5432);
                match h {
                    postgres::config::Host::Tcp(name) => format!("{name}:{port}"),
                    postgres::config::Host::Unix(dir) => format!("{}:{port}", dir.display()),
                }
            })
            .collect();
        let hosts = if hosts.is_empty() {
            "localhost:5432".to_string()
        } else {
            hosts.join(",")
        };
        let db = config.get_dbname().or(config.get_user()).unwrap_or("postgres");
        Ok(PostgresTarget {
            shown: format!("{hosts}/{db}"),
            config,
        })
    }

    /// `HOST:PORT/DATABASE`: never the user's password.
    pub fn shown(&self) -> &str {
        &self.shown
    }
}

/// How long sent data may go unacknowledged, and a connection idle, before
/// it is given up (`TCP_USER_TIMEOUT`, keepalives).
pub const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);

/// Session settings every connection starts with, unless the URL's
/// `options` sets them: a worker stopped inside a transaction (SIGSTOP, a
/// pause) loses it and its row locks after `idle_in_transaction_session_timeout`,
/// a statement waits at most `lock_timeout` for a lock and runs at most
/// `statement_timeout`; all well under a worker's lease (30 s by default),
/// so no stopped worker can hold a job's row past its lease and block the
/// takeover.
pub const SESSION_TIMEOUTS: [(&str, &str); 3] = [
    ("idle_in_transaction_session_timeout", "10s"),
    ("lock_timeout", "5s"),
    ("statement_timeout", "20s"),
];

/// `options` (the URL's, if any) with each of [`SESSION_TIMEOUTS`] it does
/// not set added as `-c NAME=VALUE`.
fn with_session_timeouts(options: Option<&str>) -> String {
    let mut out = options.unwrap_or("").trim().to_string();
    for (name, value) in SESSION_TIMEOUTS {
        if !out.contains(name) {
            if !out.is_empty() {
                out.push(' ');
            }
            out.push_str(&format!("-c {name}={value}"));
        }
    }
    out
}

/// The server's version (`SHOW server_version`), from one connection
/// made as the state store makes its own; nothing is migrated, claimed or
/// written (what `cairn doctor` reports).
pub fn server_version(target: &PostgresTarget) -> Result<String, StateError> {
    let connect_error = |e: postgres::Error| StateError::Connect {
        target: target.shown.clone(),
        reason: scrub_password(&error_chain(&e), target),
    };
    let mut client = target.config.connect(NoTls).map_err(connect_error)?;
    let row = client.query_one("SHOW server_version", &[]).map_err(connect_error)?;
    Ok(row.get(0))
}

/// The URL with any password replaced by `***`, for error messages.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            let hidden = if userinfo.contains(':') { ":***" } else { "" };
            // A password in the query string (`?password=…`) goes too.
            let tail = redact_query(tail);
            format!("{scheme}://{user}{hidden}@{host}{tail}")
        }
        None => format!("{scheme}://{authority}{}", redact_query(tail)),
    }
}

/// `text` without the target's password, should a message quote it.
fn scrub_password(text: &str, target: &PostgresTarget) -> String {
    match target.config.get_password() {
        Some(p) if p.len() >= 4 => text.replace(&*String::from_utf8_lossy(p), "***"),
        _ => text.to_string(),
    }
}

/// `text` without the password `url` holds, should a message quote it.
fn scrub(text: &str, url: &str) -> String {
    let Some((_, rest)) = url.split_once("://") else {
        return text.to_string();
    };
    let authority = &rest[..rest.find(['/', '?']).unwrap_or(rest.len())];
    match authority
        .rsplit_once('@')
        .and_then(|(userinfo, _)| userinfo.split_once(':'))
    {
        Some((_, password)) if password.len() >= 4 => text.replace(password, "***"),
        _ => text.to_string(),
    }
}

fn redact_query(tail: &str) -> String {
    let Some((path, query)) = tail.split_once('?') else {
        return tail.to_string();
    };
    let query: Vec<String> = query
        .split('&')
        .map(|kv| match kv.split_once('=') {
            Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
            _ => kv.to_string(),
        })
        .collect();
    format!("{path}?{}", query.join("&"))
}

/// Who opens the database: the state directory's identity and path.
pub struct Claimant<'a> {
    pub id: &'a str,
    pub path: &'a str,
    /// The remote chunk store the home uses (its URL without credentials),
    /// if any: homes on one remote store may share the database.
    pub store: Option<&'a str>,
}

/// A connection idle this long is checked (one round trip) before it is
/// used again, so a server restarted or a connection dropped during a long
/// stage costs a reconnect, not the orchestrator.
const IDLE_CHECK: Duration = Duration::from_millis(200);

/// How long a lost server is waited for (it may be restarting).
const RECONNECT_FOR: Duration = Duration::from_secs(60);

pub struct PostgresBackend {
    client: Client,
    statements: HashMap<String, Statement>,
    target: PostgresTarget,
    last_used: Instant,
    in_transaction: bool,
}

impl PostgresBackend {
    /// Connects, migrates, and claims the database for `home` (or checks
    /// that it already belongs to it).
    pub fn open(target: &PostgresTarget, home: &Claimant<'_>) -> Result<PostgresBackend, StateError> {
        let mut client = target.config.connect(NoTls).map_err(|e| StateError::Connect {
            target: target.shown.clone(),
            reason: scrub_password(&error_chain(&e), target),
        })?;
        migrate(&mut client, target, home)?;
        Ok(PostgresBackend {
            client,
            statements: HashMap::new(),
            target: target.clone(),
            last_used: Instant::now(),
            in_transaction: false,
        })
    }

    /// Makes sure the connection is alive before a statement that starts
    /// something new (never inside a transaction, whose statements only the
    /// caller can run again): a connection closed by an error, or one that
    /// was idle and no longer answers, is replaced. Statements already sent
    /// are never sent again, so a compare-and-set cannot apply twice.
    fn ensure_connected(&mut self) -> Result<(), BackendError> {
        if self.in_transaction {
            return Ok(());
        }
        let stale = self.last_used.elapsed() >= IDLE_CHECK && self.client.is_valid(Duration::from_secs(5)).is_err();
        if self.client.is_closed() || stale {
            self.reconnect()?;
        }
        Ok(())
    }

    /// Connects again, waiting up to [`RECONNECT_FOR`] for the server.
    fn reconnect(&mut self) -> Result<(), BackendError> {
        let deadline = Instant::now() + RECONNECT_FOR;
        let mut pause = Duration::from_millis(50);
        loop {
            match self.target.config.connect(NoTls) {
                Ok(client) => {
                    tracing::warn!(target = self.target.shown, "reconnected to the PostgreSQL state store");
                    self.client = client;
                    // Prepared statements belonged to the old session.
                    self.statements.clear();
                    return Ok(());
                }
                Err(e) if Instant::now() + pause < deadline => {
                    tracing::debug!(error = %error_chain(&e), "the PostgreSQL state store is away; retrying");
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
                Err(e) => {
                    let url = self.target.shown.clone();
                    return Err(BackendError::Lost {
                        reason: scrub_password(&error_chain(&e), &self.target),
                        target: url,
                        waited: RECONNECT_FOR.as_secs(),
                    });
                }
            }
        }
    }

    /// Runs `f` on a live connection and notes when the connection was last used.
    fn on_connection<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T, BackendError>) -> Result<T, BackendError> {
        self.ensure_connected()?;
        let out = f(self);
        self.last_used = Instant::now();
        out
    }

    fn statement(&mut self, sql: &str) -> Result<Statement, BackendError> {
        if let Some(s) = self.statements.get(sql) {
            return Ok(s.clone());
        }
        let s = self.client.prepare(sql).map_err(classify)?;
        self.statements.insert(sql.to_string(), s.clone());
        Ok(s)
    }

    fn bound(stmt: &Statement, params: &[Value]) -> Result<Vec<Box<dyn ToSql + Sync>>, BackendError> {
        stmt.params()
            .iter()
            .zip(params)
            .enumerate()
            .map(|(i, (ty, v))| bind(i, v, ty))
            .collect()
    }
}

fn migrate(client: &mut Client, target: &PostgresTarget, home: &Claimant<'_>) -> Result<(), StateError> {
    let mut tx = client.transaction().map_err(BackendError::from)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .map_err(BackendError::from)?;
    tx.batch_execute(BOOKKEEPING).map_err(BackendError::from)?;
    let version: i64 = match tx
        .query_opt("SELECT version FROM cairn_schema", &[])
        .map_err(BackendError::from)?
    {
        Some(row) => row.get(0),
        None => {
            tx.execute("INSERT INTO cairn_schema (version) VALUES (0)", &[])
                .map_err(BackendError::from)?;
            0
        }
    };
    let known = MIGRATIONS.len() as i64;
    if version > known {
        return Err(StateError::FutureSchema { found: version, known });
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(version as usize) {
        tx.batch_execute(sql).map_err(BackendError::from)?;
        tx.execute("UPDATE cairn_schema SET version = $1", &[&(i as i64 + 1)])
            .map_err(BackendError::from)?;
    }
    tx.execute(
        "INSERT INTO cairn_home (home_id, home_path, claimed_at, store) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
        &[&home.id, &home.path, &crate::now_ms(), &home.store],
    )
    .map_err(BackendError::from)?;
    let owner = tx
        .query_one("SELECT home_id, home_path, store FROM cairn_home", &[])
        .map_err(BackendError::from)?;
    let (owner_id, owner_path, owner_store): (String, String, Option<String>) =
        (owner.get(0), owner.get(1), owner.get(2));
    if owner_id == home.id {
        // The owner names the store the database's hosts share.
        if owner_store.as_deref() != home.store {
            tx.execute("UPDATE cairn_home SET store = $1", &[&home.store])
                .map_err(BackendError::from)?;
        }
    } else if home.store.is_none() || owner_store.as_deref() != home.store {
        // Another host may share the database only through the remote
        // chunk store it names: snapshots must be readable from every host.
        return Err(StateError::ForeignHome {
            target: target.shown.clone(),
            owner: owner_path,
            home: home.path.to_string(),
            store: owner_store,
        });
    }
    tx.commit().map_err(BackendError::from)?;
    Ok(())
}

/// A value for a parameter of type `ty`; a value that does not fit is an
/// error naming the parameter.
fn bind(index: usize, v: &Value, ty: &Type) -> Result<Box<dyn ToSql + Sync>, BackendError> {
    let mismatch = || BackendError::Bind {
        index: index + 1,
        value: format!("{v:?}"),
        ty: ty.to_string(),
    };
    Ok(match v {
        Value::Null => {
            if *ty == Type::INT8 {
                Box::new(None::<i64>)
            } else if *ty == Type::INT4 {
                Box::new(None::<i32>)
            } else if *ty == Type::INT2 {
                Box::new(None::<i16>)
            } else if *ty == Type::FLOAT8 {
                Box::new(None::<f64>)
            } else if *ty == Type::BOOL {
                Box::new(None::<bool>)
            } else if *ty == Type::BYTEA {
                Box::new(None::<Vec<u8>>)
            } else {
                Box::new(None::<String>)
            }
        }
        Value::Int(i) => {
            if *ty == Type::INT8 {
                Box::new(*i)
            } else if *ty == Type::INT4 {
                Box::new(i32::try_from(*i).map_err(|_| mismatch())?)
            } else if *ty == Type::INT2 {
                Box::new(i16::try_from(*i).map_err(|_| mismatch())?)
            } else if *ty == Type::FLOAT8 {
                Box::new(*i as f64)
            } else if *ty == Type::BOOL {
                Box::new(*i != 0)
            } else {
                return Err(mismatch());
            }
        }
        Value::Real(r) => {
            if *ty == Type::FLOAT8 {
                Box::new(*r)
            } else {
                return Err(mismatch());
            }
        }
        Value::Text(s) => {
            if <String as ToSql>::accepts(ty) {
                Box::new(s.clone())
            } else {
                return Err(mismatch());
            }
        }
        Value::Blob(b) => {
            if *ty == Type::BYTEA {
                Box::new(b.clone())
            } else {
                return Err(mismatch());
            }
        }
    })
}

fn value_at(row: &postgres::Row, i: usize) -> Result<Value, BackendError> {
    let ty = row.columns()[i].type_();
    let v = if *ty == Type::INT8 {
        row.try_get::<_, Option<i64>>(i)?.map(Value::Int)
    } else if *ty == Type::INT4 {
        row.try_get::<_, Option<i32>>(i)?.map(|v| Value::Int(v.into()))
    } else if *ty == Type::INT2 {
        row.try_get::<_, Option<i16>>(i)?.map(|v| Value::Int(v.into()))
    } else if *ty == Type::FLOAT8 {
        row.try_get::<_, Option<f64>>(i)?.map(Value::Real)
    } else if *ty == Type::FLOAT4 {
        row.try_get::<_, Option<f32>>(i)?.map(|v| Value::Real(v.into()))
    } else if *ty == Type::BOOL {
        row.try_get::<_, Option<bool>>(i)?.map(|v| Value::Int(v.into()))
    } else if *ty == Type::BYTEA {
        row.try_get::<_, Option<Vec<u8>>>(i)?.map(Value::Blob)
    } else {
        row.try_get::<_, Option<String>>(i)?.map(Value::Text)
    };
    Ok(v.unwrap_or(Value::Null))
}

/// Maps unique violations to [`BackendError::Unique`], naming single-column
/// constraints `table.column` as SQLite does.
fn classify(e: postgres::Error) -> BackendError {
    if e.code() == Some(&SqlState::UNIQUE_VIOLATION) {
        if let Some(db) = e.as_db_error() {
            let constraint = db.constraint().unwrap_or_default();
            let column = db.table().and_then(|t| {
                constraint
                    .strip_prefix(t)
                    .and_then(|c| c.strip_prefix('_'))
                    .and_then(|c| c.strip_suffix("_key"))
                    .map(|c| format!("{t}.{c}"))
            });
            return BackendError::Unique {
                target: column.unwrap_or_else(|| constraint.to_string()),
            };
        }
    }
    BackendError::Postgres(e)
}

impl Backend for PostgresBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Postgres
    }

    fn execute(&mut self, sql: &str, params: &[Value]) -> Result<u64, BackendError> {
        self.on_connection(|this| {
            let stmt = this.statement(sql)?;
            let bound = Self::bound(&stmt, params)?;
            let refs: Vec<&(dyn ToSql + Sync)> = bound.iter().map(|b| b.as_ref()).collect();
            this.client.execute(&stmt, &refs).map_err(classify)
        })
    }

    fn query(&mut self, sql: &str, params: &[Value]) -> Result<Vec<Row>, BackendError> {
        let rows = self.on_connection(|this| {
            let stmt = this.statement(sql)?;
            let bound = Self::bound(&stmt, params)?;
            let refs: Vec<&(dyn ToSql + Sync)> = bound.iter().map(|b| b.as_ref()).collect();
            this.client.query(&stmt, &refs).map_err(classify)
        })?;
        rows.iter()
            .map(|r| {
                (0..r.len())
                    .map(|i| value_at(r, i))
                    .collect::<Result<Vec<_>, _>>()
                    .map(Row)
            })
            .collect()
    }

    fn batch(&mut self, sql: &str) -> Result<(), BackendError> {
        self.on_connection(|this| this.client.batch_execute(sql).map_err(classify))
    }

    fn begin(&mut self) -> Result<(), BackendError> {
        self.on_connection(|this| Ok(this.client.batch_execute("BEGIN")?))?;
        self.in_transaction = true;
        Ok(())
    }

    // The end of a transaction goes to the connection that began it, never
    // to a new one: a COMMIT on a fresh session would succeed with nothing
    // to commit.
    fn commit(&mut self) -> Result<(), BackendError> {
        self.in_transaction = false;
        self.last_used = Instant::now();
        Ok(self.client.batch_execute("COMMIT")?)
    }

    fn rollback(&mut self) -> Result<(), BackendError> {
        self.in_transaction = false;
        self.last_used = Instant::now();
        if self.client.is_closed() {
            // The transaction went with the connection.
            return Ok(());
        }
        Ok(self.client.batch_execute("ROLLBACK")?)
    }
}

/// A connection of its own that LISTENs for queue wake-ups (`cairn_jobs`).
pub struct Listener {
    client: Client,
}

impl Listener {
    pub fn open(target: &PostgresTarget) -> Result<Listener, StateError> {
        let mut client = target.config.connect(NoTls).map_err(|e| StateError::Connect {
            target: target.shown.clone(),
            reason: scrub_password(&error_chain(&e), target),
        })?;
        client.batch_execute("LISTEN cairn_jobs").map_err(BackendError::from)?;
        Ok(Listener { client })
    }

    /// Waits up to `timeout` for a notification: `Ok(true)` when one came,
    /// `Ok(false)` when none did, an error when the connection broke (the
    /// caller then opens another, and polls meanwhile).
    pub fn wait(&mut self, timeout: Duration) -> Result<bool, BackendError> {
        use postgres::fallible_iterator::FallibleIterator;
        let mut notes = self.client.notifications();
        let woke = notes
            .timeout_iter(timeout)
            .next()
            .map_err(BackendError::from)?
            .is_some();
        // Drain the rest: one wake-up serves every note already queued.
        while let Ok(Some(_)) = notes.iter().next() {}
        Ok(woke)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_show() {
        assert_eq!(
            redact("postgres://cairn:s3cret@db.example:5433/state?sslmode=disable&password=x"),
            "postgres://cairn:***@db.example:5433/state?sslmode=disable&password=***"
        );
        assert_eq!(redact("postgresql://db/state"), "postgresql://db/state");
        let t = PostgresTarget::parse("postgres://cairn:s3cret@db.example:5433/state").unwrap();
        assert_eq!(t.shown(), "db.example:5433/state");
        assert!(!format!("{t:?}").contains("s3cret"));
    }

    #[test]
    fn every_connection_has_timeouts_under_the_lease_unless_the_url_sets_them() {
        let t = PostgresTarget::parse("postgresql://alice@127.0.0.1/cairn").unwrap();
        assert_eq!(
            t.config.get_options(),
            Some("-c idle_in_transaction_session_timeout=10s -c lock_timeout=5s -c statement_timeout=20s")
        );
        let t = PostgresTarget::parse("postgresql://alice@127.0.0.1/cairn?options=-c%20lock_timeout%3D1s").unwrap();
        assert_eq!(
            t.config.get_options(),
            Some("-c lock_timeout=1s -c idle_in_transaction_session_timeout=10s -c statement_timeout=20s")
        );
    }

    #[test]
    fn a_url_without_a_database_names_the_users_database() {
        let t = PostgresTarget::parse("postgresql://alice@127.0.0.1").unwrap();
        assert_eq!(t.shown(), "127.0.0.1:5432/alice");
    }
}
