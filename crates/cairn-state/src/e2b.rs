//! What the E2B-compatible gateway keeps in the state store: sandboxes by
//! the id the SDK holds (running as a Cairn sandbox, or paused as a
//! snapshot) and the snapshots it made. Schema and durability notes:
//! `migrations/sqlite/0005_e2b.sql`.

use std::collections::BTreeMap;

use crate::{params, Db, Row, StateError};

/// Where an E2B sandbox is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum E2bLife {
    /// Running as this Cairn sandbox.
    Running { sandbox: String },
    /// Paused: its files are this snapshot; nothing runs.
    Paused { snapshot: String },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct E2bSandbox {
    pub id: String,
    pub template: String,
    pub life: E2bLife,
    pub started_at: i64,
    /// When it times out (removed, or paused with `auto_pause`).
    pub end_at: i64,
    pub auto_pause: bool,
    pub cpu_count: u32,
    pub memory_mb: u64,
    pub metadata: BTreeMap<String, String>,
    /// Environment for every process.
    pub env: BTreeMap<String, String>,
    /// The API token (its id) that created or last connected, resumed or
    /// paused it: its envd access token is derived from this and is
    /// honoured only while that token exists. `None` for sandboxes
    /// recorded before grants were.
    pub grant: Option<String>,
    /// The egress it was given, in E2B's terms; `None`: loopback only.
    pub network: Option<E2bNetwork>,
    /// Where its commands run unless they say (a built template's
    /// WORKDIR); `None`: the user's home.
    pub workdir: Option<String>,
    /// Whether its ports are reached without its traffic access token.
    pub public_traffic: bool,
    /// The tenant whose API key made it (`None`: an administrator's);
    /// only that tenant's keys see it.
    pub tenant: Option<String>,
}

/// An E2B sandbox's network rules as the SDK gave them: addresses,
/// networks (CIDR) and names let out, and addresses and networks refused
/// (`0.0.0.0/0`: all traffic). The allows win over the denies.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct E2bNetwork {
    #[serde(default)]
    pub allow_out: Vec<String>,
    #[serde(default)]
    pub deny_out: Vec<String>,
}

impl E2bSandbox {
    /// The Cairn sandbox running it, unless it is paused.
    pub fn running(&self) -> Option<&str> {
        match &self.life {
            E2bLife::Running { sandbox } => Some(sandbox),
            E2bLife::Paused { .. } => None,
        }
    }
}

/// A snapshot made through the E2B API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct E2bSnapshot {
    pub id: String,
    pub name: String,
    /// The E2B sandbox it was taken of.
    pub e2b_id: String,
    pub created_at: i64,
}

const COLUMNS: &str =
    "id, template, sandbox_id, snapshot_id, started_at, end_at, auto_pause, cpu_count, memory_mb, grant_token, network, workdir, public_traffic, tenant";

fn sandbox_row(r: &Row) -> Result<E2bSandbox, StateError> {
    let sandbox: Option<String> = r.get(2)?;
    let snapshot: Option<String> = r.get(3)?;
    let life = match (sandbox, snapshot) {
        (Some(sandbox), None) => E2bLife::Running { sandbox },
        (None, Some(snapshot)) => E2bLife::Paused { snapshot },
        _ => {
            return Err(StateError::Damaged(
                "an E2B sandbox row that is neither running nor paused".into(),
            ))
        }
    };
    Ok(E2bSandbox {
        id: r.get(0)?,
        template: r.get(1)?,
        life,
        started_at: r.get(4)?,
        end_at: r.get(5)?,
        auto_pause: r.get(6)?,
        cpu_count: r.get(7)?,
        memory_mb: r.get(8)?,
        metadata: BTreeMap::new(),
        env: BTreeMap::new(),
        grant: r.get(9)?,
        network: match r.get::<Option<String>>(10)? {
            None => None,
            Some(text) => Some(
                serde_json::from_str(&text)
                    .map_err(|e| StateError::Damaged(format!("an E2B sandbox's network is unreadable: {e}")))?,
            ),
        },
        workdir: r.get(11)?,
        public_traffic: r.get(12)?,
        tenant: r.get(13)?,
    })
}

impl Db {
    /// Records an E2B sandbox, replacing what was recorded under its id
    /// (its variables too), in one transaction.
    pub fn put_e2b_sandbox(&self, s: &E2bSandbox) -> Result<(), StateError> {
        let (sandbox, snapshot) = match &s.life {
            E2bLife::Running { sandbox } => (Some(sandbox.as_str()), None),
            E2bLife::Paused { snapshot } => (None, Some(snapshot.as_str())),
        };
        self.transaction(|b| {
            b.execute("DELETE FROM e2b_sandbox_vars WHERE id = $1", params![&s.id])?;
            b.execute("DELETE FROM e2b_sandboxes WHERE id = $1", params![&s.id])?;
            b.execute(
                &format!(
                    "INSERT INTO e2b_sandboxes ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)"
                ),
                params![
                    &s.id,
                    &s.template,
                    sandbox,
                    snapshot,
                    s.started_at,
                    s.end_at,
                    s.auto_pause,
                    s.cpu_count,
                    s.memory_mb,
                    &s.grant,
                    s.network
                        .as_ref()
                        .map(|n| serde_json::to_string(n).expect("a network serialises")),
                    &s.workdir,
                    s.public_traffic,
                    &s.tenant
                ],
            )?;
            for (kind, vars) in [("metadata", &s.metadata), ("env", &s.env)] {
                for (name, value) in vars {
                    b.execute(
                        "INSERT INTO e2b_sandbox_vars (id, kind, name, value) VALUES ($1, $2, $3, $4)",
                        params![&s.id, kind, name, value],
                    )?;
                }
            }
            Ok(())
        })
    }

    /// Every E2B sandbox, by id.
    pub fn e2b_sandboxes(&self) -> Result<Vec<E2bSandbox>, StateError> {
        self.with(|b| {
            let mut all: Vec<E2bSandbox> = b
                .query(&format!("SELECT {COLUMNS} FROM e2b_sandboxes ORDER BY id"), &[])?
                .iter()
                .map(sandbox_row)
                .collect::<Result<_, _>>()?;
            let vars = b.query(
                "SELECT id, kind, name, value FROM e2b_sandbox_vars ORDER BY id, kind, name",
                &[],
            )?;
            for v in &vars {
                let id: String = v.get(0)?;
                let kind: String = v.get(1)?;
                if let Ok(i) = all.binary_search_by(|s| s.id.as_str().cmp(&id)) {
                    let map = if kind == "env" {
                        &mut all[i].env
                    } else {
                        &mut all[i].metadata
                    };
                    map.insert(v.get(2)?, v.get(3)?);
                }
            }
            Ok(all)
        })
    }

    /// Forgets an E2B sandbox; whether it was there.
    pub fn delete_e2b_sandbox(&self, id: &str) -> Result<bool, StateError> {
        self.transaction(|b| {
            b.execute("DELETE FROM e2b_sandbox_vars WHERE id = $1", params![id])?;
            Ok(b.execute("DELETE FROM e2b_sandboxes WHERE id = $1", params![id])? > 0)
        })
    }

    pub fn insert_e2b_snapshot(&self, s: &E2bSnapshot) -> Result<(), StateError> {
        self.with(|b| {
            b.execute(
                "INSERT INTO e2b_snapshots (id, name, e2b_id, created_at) VALUES ($1, $2, $3, $4)",
                params![&s.id, &s.name, &s.e2b_id, s.created_at],
            )?;
            Ok(())
        })
    }

    /// The snapshots made through the E2B API, oldest first.
    pub fn e2b_snapshots(&self) -> Result<Vec<E2bSnapshot>, StateError> {
        self.with(|b| {
            b.query(
                "SELECT id, name, e2b_id, created_at FROM e2b_snapshots ORDER BY created_at, id",
                &[],
            )?
            .iter()
            .map(|r| {
                Ok(E2bSnapshot {
                    id: r.get(0)?,
                    name: r.get(1)?,
                    e2b_id: r.get(2)?,
                    created_at: r.get(3)?,
                })
            })
            .collect()
        })
    }

    /// Forgets an E2B snapshot record; whether it was there.
    pub fn delete_e2b_snapshot(&self, id: &str) -> Result<bool, StateError> {
        self.with(|b| Ok(b.execute("DELETE FROM e2b_snapshots WHERE id = $1", params![id])? > 0))
    }
}
