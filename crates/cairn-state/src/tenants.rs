use std::collections::HashSet;

use serde::Serialize;

use crate::now_ms;
use crate::{params, Backend, Db, Row, StateError};

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TenantRecord {
    pub name: String,
    pub max_sandboxes: Option<i64>,
    /// Bytes: the sum of its sandboxes' memory limits.
    pub max_memory: Option<i64>,
    /// Bytes: the sum of its sandboxes' disk limits.
    pub max_disk: Option<i64>,
    pub created_at: i64,
}

impl TenantRecord {
    /// Whether any limit is set: a sandbox made ahead (a resume prepared
    /// at a pause or suspend) would hold one of its slots.
    pub fn has_limits(&self) -> bool {
        self.max_sandboxes.is_some() || self.max_memory.is_some() || self.max_disk.is_some()
    }
}

/// What a tenant holds now: sandboxes that are not being removed, and the
/// memory and disk limits of those.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TenantUsage {
    pub sandboxes: i64,
    pub memory: i64,
    pub disk: i64,
}

/// The kinds of object a tenant owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owned {
    Sandbox,
    Snapshot,
    Session,
    Run,
    Image,
    E2bSandbox,
    E2bTemplate,
}

impl Owned {
    fn table(self) -> &'static str {
        match self {
            Owned::Sandbox => "sandboxes",
            Owned::Snapshot => "snapshots",
            Owned::Session => "sessions",
            Owned::Run => "runs",
            Owned::Image => "images",
            Owned::E2bSandbox => "e2b_sandboxes",
            Owned::E2bTemplate => "e2b_templates",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Owned::Image => "name",
            _ => "id",
        }
    }
}

/// prefix of one tenant's names (`acme-`) is never the start of another's.
pub fn valid_name(name: &str) -> bool {
    (1..=32).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// A name `tenant` gives (a sandbox's, a session's, an image's, a
/// template's) as it is stored: in the tenant's own namespace, `TENANT-NAME`
/// (names are one namespace per state directory, and no tenant can take
/// or learn of another's). One already qualified is kept.
pub fn qualify(tenant: &str, name: &str) -> String {
    match name.strip_prefix(tenant) {
        Some(rest) if rest.starts_with('-') => name.to_string(),
        _ => format!("{tenant}-{name}"),
    }
}

/// A limit as the store keeps it (BIGINT).
pub fn stored_limit(v: Option<u64>) -> Option<i64> {
    v.map(|v| v.min(i64::MAX as u64) as i64)
}

fn tenant_row(r: &Row) -> Result<TenantRecord, StateError> {
    Ok(TenantRecord {
        name: r.get(0)?,
        max_sandboxes: r.get(1)?,
        max_memory: r.get(2)?,
        max_disk: r.get(3)?,
        created_at: r.get(4)?,
    })
}

const TENANT_COLUMNS: &str = "name, max_sandboxes, max_memory, max_disk, created_at";

/// Sandboxes that count against a tenant's limits: every one not being
/// removed (an exited one keeps its files).
const HELD: &str = "state <> 'removing'";

fn usage(b: &mut dyn Backend, tenant: &str) -> Result<TenantUsage, StateError> {
    // SUM of BIGINT is NUMERIC on PostgreSQL: cast back.
    let row = b
        .query_opt(
            &format!(
                "SELECT COUNT(*),
                 CAST(COALESCE(SUM(CASE WHEN state IN ('creating', 'running') THEN memory_bytes ELSE 0 END), 0) AS BIGINT),
                 CAST(COALESCE(SUM(COALESCE(disk_bytes, 0)), 0) AS BIGINT) FROM sandboxes WHERE tenant = $1 AND {HELD}"
            ),
            params![tenant],
        )?
        .ok_or(StateError::Conflict("an aggregate returned no row".into()))?;
    Ok(TenantUsage {
        sandboxes: row.get(0)?,
        memory: row.get(1)?,
        disk: row.get(2)?,
    })
}

/// Checks, inside the transaction inserting a sandbox of `tenant` with
/// these limits, that it fits the tenant's own; the tenant's row is locked
/// first, so creates racing for its last slot go one at a time.
pub fn admit_sandbox(b: &mut dyn Backend, tenant: &str, memory: i64, disk: Option<i64>) -> Result<(), StateError> {
    b.execute("UPDATE tenants SET name = name WHERE name = $1", params![tenant])?;
    let Some(t) = b
        .query_opt(
            &format!("SELECT {TENANT_COLUMNS} FROM tenants WHERE name = $1"),
            params![tenant],
        )?
        .as_ref()
        .map(tenant_row)
        .transpose()?
    else {
        return Err(StateError::TenantGone(tenant.to_string()));
    };
    let used = usage(b, tenant)?;
    let over = |what: String| -> Result<(), StateError> {
        Err(StateError::TenantLimit {
            tenant: tenant.to_string(),
            what,
        })
    };
    let within = |what: &str, max: i64, held: i64, asked: i64| {
        if held + asked > max {
            over(format!(
                "{} of {what} ({} held, {} asked)",
                human(max),
                human(held),
                human(asked)
            ))
        } else {
            Ok(())
        }
    };
    if let Some(max) = t.max_sandboxes {
        if used.sandboxes + 1 > max {
            return over(format!("{max} sandboxes (it holds {})", used.sandboxes));
        }
    }
    if let Some(max) = t.max_memory {
        within("memory", max, used.memory, memory)?;
    }
    if let Some(max) = t.max_disk {
        let Some(disk) = disk else {
            return over(format!(
                "{} of disk, and this sandbox has no disk limit of its own: give it one (--disk, \"disk\")",
                human(max)
            ));
        };
        within("disk", max, used.disk, disk)?;
    }
    Ok(())
}

fn human(bytes: i64) -> String {
    const MIB: i64 = 1 << 20;
    if bytes >= 1 << 30 && bytes % (1 << 30) == 0 {
        format!("{} GiB", bytes >> 30)
    } else {
        format!("{} MiB", bytes / MIB)
    }
}

impl Db {
    /// Makes this connection act for `tenant` (`None`: the administrator):
    /// the rows it inserts from now on are that tenant's.
    pub fn act_for(&self, tenant: Option<String>) {
        *self.tenant.lock().unwrap_or_else(|e| e.into_inner()) = tenant;
    }

    /// The tenant this connection acts for.
    pub fn acting_for(&self) -> Option<String> {
        self.tenant.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Marks the row `key` of `kind`, just inserted, as the acting
    /// tenant's (inside the inserting transaction).
    pub fn stamp(&self, b: &mut dyn Backend, kind: Owned, key: &str) -> Result<(), StateError> {
        if let Some(t) = self.acting_for() {
            b.execute(
                &format!("UPDATE {} SET tenant = $2 WHERE {} = $1", kind.table(), kind.key()),
                params![key, &t],
            )?;
        }
        Ok(())
    }

    pub fn insert_tenant(&self, t: &TenantRecord) -> Result<(), StateError> {
        self.with(|b| {
            let inserted = b.execute(
                &format!(
                    "INSERT INTO tenants ({TENANT_COLUMNS}) VALUES ($1, $2, $3, $4, $5) ON CONFLICT (name) DO NOTHING"
                ),
                params![&t.name, t.max_sandboxes, t.max_memory, t.max_disk, t.created_at],
            )?;
            if inserted == 0 {
                return Err(StateError::Conflict(format!("tenant {:?} exists", t.name)));
            }
            Ok(())
        })
    }

    /// Replaces a tenant's limits; false when there is no such tenant. A
    /// limit lowered below what the tenant holds refuses its next sandbox
    /// and takes none away.
    pub fn set_tenant_limits(&self, t: &TenantRecord) -> Result<bool, StateError> {
        self.with(|b| {
            Ok(b.execute(
                "UPDATE tenants SET max_sandboxes = $2, max_memory = $3, max_disk = $4 WHERE name = $1",
                params![&t.name, t.max_sandboxes, t.max_memory, t.max_disk],
            )? > 0)
        })
    }

    pub fn tenants(&self) -> Result<Vec<TenantRecord>, StateError> {
        self.with(|b| {
            b.query(&format!("SELECT {TENANT_COLUMNS} FROM tenants ORDER BY name"), &[])?
                .iter()
                .map(tenant_row)
                .collect()
        })
    }

    pub fn tenant(&self, name: &str) -> Result<Option<TenantRecord>, StateError> {
        self.with(|b| {
            b.query_opt(
                &format!("SELECT {TENANT_COLUMNS} FROM tenants WHERE name = $1"),
                params![name],
            )?
            .as_ref()
            .map(tenant_row)
            .transpose()
        })
    }

    pub fn tenant_usage(&self, name: &str) -> Result<TenantUsage, StateError> {
        self.with(|b| usage(b, name))
    }

    /// Removes a tenant with its tokens, giving what it still owns to the
    /// administrator, in one transaction. False when there was none.
    pub fn delete_tenant(&self, name: &str) -> Result<bool, StateError> {
        self.transaction(|b| {
            for table in [
                "sandboxes",
                "snapshots",
                "sessions",
                "runs",
                "images",
                "e2b_sandboxes",
                "e2b_templates",
            ] {
                b.execute(
                    &format!("UPDATE {table} SET tenant = NULL WHERE tenant = $1"),
                    params![name],
                )?;
            }
            b.execute("DELETE FROM api_tokens WHERE tenant = $1", params![name])?;
            Ok(b.execute("DELETE FROM tenants WHERE name = $1", params![name])? > 0)
        })
    }

    /// The ids (names, for images) of every `kind` object `tenant` owns.
    pub fn owned(&self, kind: Owned, tenant: &str) -> Result<HashSet<String>, StateError> {
        self.with(|b| {
            let mut out = HashSet::new();
            for r in b.query(
                &format!("SELECT {} FROM {} WHERE tenant = $1", kind.key(), kind.table()),
                params![tenant],
            )? {
                out.insert(r.get(0)?);
            }
            Ok(out)
        })
    }

    /// The tenant that owns the `kind` object `key` (an exact id, or name
    /// for images); `None`: the administrator, or no such object.
    pub fn tenant_of(&self, kind: Owned, key: &str) -> Result<Option<String>, StateError> {
        self.with(|b| {
            let row = b.query_opt(
                &format!("SELECT tenant FROM {} WHERE {} = $1", kind.table(), kind.key()),
                params![key],
            )?;
            Ok(match row {
                Some(r) => r.get(0)?,
                None => None,
            })
        })
    }

    /// Whether `tenant` owns the `kind` object `key` (an exact id, or name
    /// for images).
    pub fn owns(&self, kind: Owned, tenant: &str, key: &str) -> Result<bool, StateError> {
        self.with(|b| {
            Ok(b.query_opt(
                &format!(
                    "SELECT 1 FROM {} WHERE {} = $1 AND tenant = $2",
                    kind.table(),
                    kind.key()
                ),
                params![key, tenant],
            )?
            .is_some())
        })
    }

    /// The ids of `tenant`'s objects of `kind` that `key` names, the way
    /// the administrator's lookups take it (an exact id or name first,
    /// then an id prefix), among that tenant's objects only.
    pub fn resolve_owned(&self, kind: Owned, tenant: &str, key: &str) -> Result<Vec<String>, StateError> {
        // The names a tenant gave are stored qualified (`qualify`): a key
        // matches those both ways. Labels are as given.
        let (name_col, min_prefix) = match kind {
            Owned::Sandbox | Owned::Session => (Some("name"), 3),
            Owned::Snapshot => (Some("label"), 4),
            Owned::Image => (Some("name"), 0),
            Owned::Run => (None, 3),
            Owned::E2bSandbox | Owned::E2bTemplate => (None, 0),
        };
        let qualified = match kind {
            Owned::Sandbox | Owned::Session | Owned::Image => qualify(tenant, key),
            _ => key.to_string(),
        };
        let id = kind.key();
        let name_sel = name_col.map(|c| format!(", {c}")).unwrap_or_default();
        let name_match = name_col
            .map(|c| format!("{c} = $1 OR {c} = $3 OR "))
            .unwrap_or_default();
        let prefix = if min_prefix > 0 {
            format!(" OR (length($1) >= {min_prefix} AND substr({id}, 1, length($1)) = $1)")
        } else {
            String::new()
        };
        let sql = format!(
            "SELECT {id}{name_sel} FROM {} WHERE tenant = $2 AND ({name_match}{id} = $1{prefix})",
            kind.table()
        ) + if kind == Owned::Snapshot {
            " ORDER BY created_at DESC"
        } else {
            ""
        };
        let mut params: Vec<crate::Value> = vec![key.into(), tenant.into()];
        if name_col.is_some() {
            params.push(qualified.as_str().into());
        }
        self.with(|b| {
            let rows = b.query(&sql, &params)?;
            let mut ids = Vec::new();
            for r in &rows {
                let id: String = r.get(0)?;
                let name: Option<String> = if name_col.is_some() { r.get(1)? } else { None };
                if id == key || name.as_deref() == Some(key) || name.as_deref() == Some(&qualified) {
                    return Ok(vec![id]);
                }
                ids.push(id);
            }
            Ok(ids)
        })
    }

    /// Records requests (see [`AuditEntry`]), in one transaction of as few
    /// statements as it can: the writer holds the store's write lock for
    /// as short a time as it can.
    pub fn insert_audit(&self, entries: &[AuditEntry]) -> Result<(), StateError> {
        const ROWS: usize = 64;
        self.transaction(|b| {
            for chunk in entries.chunks(ROWS) {
                let mut sql =
                    String::from("INSERT INTO audit (at, token, tenant, surface, method, path, status) VALUES ");
                let mut values: Vec<crate::Value> = Vec::with_capacity(chunk.len() * 7);
                for (i, e) in chunk.iter().enumerate() {
                    let n = i * 7;
                    if i > 0 {
                        sql.push_str(", ");
                    }
                    sql.push_str(&format!(
                        "(${}, ${}, ${}, ${}, ${}, ${}, ${})",
                        n + 1,
                        n + 2,
                        n + 3,
                        n + 4,
                        n + 5,
                        n + 6,
                        n + 7
                    ));
                    values.extend([
                        e.at.into(),
                        e.token.clone().into(),
                        e.tenant.clone().into(),
                        e.surface.as_str().into(),
                        e.method.as_str().into(),
                        e.path.as_str().into(),
                        e.status.into(),
                    ]);
                }
                b.execute(&sql, &values)?;
            }
            Ok(())
        })
    }

    /// The newest `limit` audit entries (of `tenant` when given), oldest first.
    pub fn audit(&self, tenant: Option<&str>, limit: i64) -> Result<Vec<AuditEntry>, StateError> {
        self.with(|b| {
            let rows = b.query(
                "SELECT at, token, tenant, surface, method, path, status FROM audit
                 WHERE (CAST($1 AS TEXT) IS NULL OR tenant = $1) ORDER BY seq DESC LIMIT $2",
                params![tenant, limit],
            )?;
            let mut out = rows
                .iter()
                .map(|r| {
                    Ok(AuditEntry {
                        at: r.get(0)?,
                        token: r.get(1)?,
                        tenant: r.get(2)?,
                        surface: r.get(3)?,
                        method: r.get(4)?,
                        path: r.get(5)?,
                        status: r.get(6)?,
                    })
                })
                .collect::<Result<Vec<_>, StateError>>()?;
            out.reverse();
            Ok(out)
        })
    }
}

/// One request a token made.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditEntry {
    /// Milliseconds since the epoch.
    pub at: i64,
    /// The API token's id.
    pub token: Option<String>,
    pub tenant: Option<String>,
    /// `api`, `e2b`, `mcp`, `envd` (an E2B sandbox's, with the access token
    /// issued to `token`), or `cli` (a command run with `--token`).
    pub surface: String,
    pub method: String,
    pub path: String,
    pub status: i64,
}

impl AuditEntry {
    /// The longest path a row keeps.
    pub const PATH_MAX: usize = 512;

    /// A row for a request made now; its path cut to [`Self::PATH_MAX`].
    pub fn now(
        token: Option<&str>,
        tenant: Option<&str>,
        surface: &str,
        method: &str,
        path: &str,
        status: i64,
    ) -> Self {
        let mut end = path.len().min(Self::PATH_MAX);
        while !path.is_char_boundary(end) {
            end -= 1;
        }
        AuditEntry {
            at: now_ms(),
            token: token.map(str::to_string),
            tenant: tenant.map(str::to_string),
            surface: surface.to_string(),
            method: method.to_string(),
            path: path[..end].to_string(),
            status,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenants_names_are_its_own_namespace_and_no_tenants_prefix_starts_anothers() {
        assert_eq!(qualify("acme", "web"), "acme-web");
        assert_eq!(qualify("acme", "acme-web"), "acme-web", "kept once qualified");
        assert_eq!(qualify("acme", "acmeweb"), "acme-acmeweb");
        assert_eq!(qualify("acme", "acme"), "acme-acme");
        for good in ["acme", "a", "team42", &"x".repeat(32)] {
            assert!(valid_name(good), "{good:?}");
        }
        for bad in ["", "Acme", "ac-me", "ac_me", "a.b", "é", &"x".repeat(33)] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }
}
