//! Tenants: API tokens that see only their own sandboxes, snapshots,
//! sessions, runs, images and E2B sandboxes, with limits on what they hold
//! at once. Schema and durability notes: `migrations/sqlite/0018_tenants.sql`.
//!
//! Who owns an object is written by the store itself: a connection acting
//! for a tenant ([`crate::state::Db::act_for`]) stamps every sandbox, snapshot, session,
//! run, image and E2B row it inserts in the insert's own statement, and
//! checks the tenant's limits in the transaction that inserts a sandbox.
//! What a tenant may see is answered by [`crate::state::Db::owned`] and [`crate::state::Db::resolve_owned`],
//! which the API calls before any handler looks an object up.

use std::collections::HashSet;

pub use cairn_state::tenants::*;

use crate::state::{params, StateError};
use crate::{now_ms, Engine, EngineError};

#[derive(Debug, thiserror::Error)]
pub enum TenantError {
    #[error("no tenant named {0:?}; `cairn tenant ls` lists them")]
    NoSuchTenant(String),
    #[error("a tenant named {0:?} exists already; `cairn tenant ls` lists them")]
    Exists(String),
    #[error("invalid tenant name {0:?}: use 1 to 32 lowercase letters and digits")]
    BadName(String),
    #[error(
        "tenant {tenant:?} still has {what}; remove them first, or give --force to remove its sandboxes and \
         close its sessions with it"
    )]
    StillOwns { tenant: String, what: String },
}

/// Tenant names: 1 to 32 lowercase letters and digits. Without '-', the
impl Engine {
    pub fn create_tenant(
        &self,
        name: &str,
        max_sandboxes: Option<u64>,
        max_memory: Option<u64>,
        max_disk: Option<u64>,
    ) -> Result<TenantRecord, EngineError> {
        if !valid_name(name) {
            return Err(TenantError::BadName(name.to_string()).into());
        }
        let t = TenantRecord {
            name: name.to_string(),
            max_sandboxes: stored_limit(max_sandboxes),
            max_memory: stored_limit(max_memory),
            max_disk: stored_limit(max_disk),
            created_at: now_ms(),
        };
        match self.db.insert_tenant(&t) {
            Err(StateError::Conflict(_)) => Err(TenantError::Exists(name.to_string()).into()),
            other => Ok(other.map(|()| t)?),
        }
    }

    /// Changes a tenant's limits: each `Some` replaces one (`Some(None)`:
    /// none); the others are kept. Returns the tenant as it is now.
    pub fn set_tenant_limits(
        &self,
        name: &str,
        max_sandboxes: Option<Option<u64>>,
        max_memory: Option<Option<u64>>,
        max_disk: Option<Option<u64>>,
    ) -> Result<TenantRecord, EngineError> {
        let mut t = self.tenant(name)?;
        if let Some(v) = max_sandboxes {
            t.max_sandboxes = stored_limit(v);
        }
        if let Some(v) = max_memory {
            t.max_memory = stored_limit(v);
        }
        if let Some(v) = max_disk {
            t.max_disk = stored_limit(v);
        }
        if !self.db.set_tenant_limits(&t)? {
            return Err(TenantError::NoSuchTenant(name.to_string()).into());
        }
        Ok(t)
    }

    pub fn tenants(&self) -> Result<Vec<(TenantRecord, TenantUsage)>, EngineError> {
        let mut out = Vec::new();
        for t in self.db.tenants()? {
            let used = self.db.tenant_usage(&t.name)?;
            out.push((t, used));
        }
        Ok(out)
    }

    /// The names of the tenants that exist.
    pub fn tenant_names(&self) -> Result<HashSet<String>, EngineError> {
        Ok(self.db.tenants()?.into_iter().map(|t| t.name).collect())
    }

    pub fn tenant(&self, name: &str) -> Result<TenantRecord, EngineError> {
        self.db
            .tenant(name)?
            .ok_or_else(|| TenantError::NoSuchTenant(name.to_string()).into())
    }

    /// Removes a tenant: its tokens stop working at once (401), and what it
    /// still owns goes to the administrator. Refused while it owns
    /// sandboxes or open sessions, unless `force`, which removes those
    /// sandboxes and closes those sessions (`close_session`, the session
    /// layer's close) first.
    pub fn remove_tenant_with(
        &mut self,
        name: &str,
        force: bool,
        close_session: &mut dyn FnMut(&mut Engine, &str) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let t = self.tenant(name)?;
        let sandboxes = self.db.owned(Owned::Sandbox, &t.name)?;
        let its_sessions = self.db.owned(Owned::Session, &t.name)?;
        let sessions: Vec<_> = self
            .db
            .sessions()?
            .into_iter()
            .filter(|s| s.state != crate::state::sessions::SessionState::Closed && its_sessions.contains(&s.id))
            .collect();
        if !force && (!sandboxes.is_empty() || !sessions.is_empty()) {
            let mut what = Vec::new();
            if !sandboxes.is_empty() {
                what.push(format!("{} sandbox(es)", sandboxes.len()));
            }
            if !sessions.is_empty() {
                what.push(format!("{} open session(s)", sessions.len()));
            }
            return Err(TenantError::StillOwns {
                tenant: t.name,
                what: what.join(" and "),
            }
            .into());
        }
        for s in sessions {
            close_session(self, &s.id)?;
        }
        let removed = self.db.owned(Owned::Sandbox, &t.name)?;
        for id in &removed {
            if let Ok(rec) = self.sandbox(id) {
                self.remove_sandbox(&rec, true)?;
            }
        }
        // Its E2B sandboxes that ran in them go with them; paused ones stay.
        for e in self.db.e2b_sandboxes()? {
            if e.tenant.as_deref() == Some(t.name.as_str()) && e.running().is_some_and(|s| removed.contains(s)) {
                self.db.delete_e2b_sandbox(&e.id)?;
            }
        }
        // Its tokens go last, with it, in one transaction: a server notices
        // them gone (the E2B gateway reads its book again then), and
        // anything it made meanwhile passes to the administrator.
        self.db.delete_tenant(&t.name)?;
        Ok(())
    }

    /// Runs `f` as the administrator: what it makes (the default images,
    /// built on first use by whoever asks) is shared with every tenant.
    pub fn as_administrator<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        self.acting(None, f)
    }

    /// Runs `f` acting for `tenant`, then for whom it acted for before.
    fn acting<T>(
        &mut self,
        tenant: Option<String>,
        f: impl FnOnce(&mut Self) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let before = self.db.acting_for();
        self.db.act_for(tenant);
        let out = f(self);
        self.db.act_for(before);
        out
    }

    /// Runs `f` acting for the tenant that owns the `kind` object `key`
    /// (an exact id): what it makes from that object (a fork, a restore, a
    /// snapshot, a run's stages) takes the same owner when the
    /// administrator asks. A tenant's call stays that tenant's (it reaches
    /// only its own objects).
    pub fn as_owner_of<T>(
        &mut self,
        kind: Owned,
        key: &str,
        f: impl FnOnce(&mut Self) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        match self.db.acting_for() {
            Some(tenant) => self.acting(Some(tenant), f),
            None => self.acting(self.db.tenant_of(kind, key)?, f),
        }
    }

    /// `name` as this engine's tenant stores it (see [`qualify`]); the
    /// administrator's names are kept as given.
    pub fn qualified(&self, name: String) -> String {
        match self.db.acting_for() {
            Some(t) => qualify(&t, &name),
            None => name,
        }
    }

    /// Makes this engine act for `tenant` (see [`crate::state::Db::act_for`]).
    pub fn act_for(&self, tenant: Option<String>) {
        self.db.act_for(tenant);
    }

    /// Keeps of `items` those whose `kind` object (named by `id`) this
    /// engine's tenant owns; the administrator's engine keeps them all.
    pub fn keep_mine<T>(&self, kind: Owned, items: &mut Vec<T>, id: impl Fn(&T) -> &str) -> Result<(), EngineError> {
        if let Some(t) = self.db.acting_for() {
            let mine = self.db.owned(kind, &t)?;
            items.retain(|item| mine.contains(id(item)));
        }
        Ok(())
    }

    pub fn owned(&self, kind: Owned, tenant: &str) -> Result<HashSet<String>, EngineError> {
        Ok(self.db.owned(kind, tenant)?)
    }

    pub fn owns(&self, kind: Owned, tenant: &str, key: &str) -> Result<bool, EngineError> {
        Ok(self.db.owns(kind, tenant, key)?)
    }

    pub fn resolve_owned(&self, kind: Owned, tenant: &str, key: &str) -> Result<Vec<String>, EngineError> {
        Ok(self.db.resolve_owned(kind, tenant, key)?)
    }

    pub fn record_audit(&self, entries: &[AuditEntry]) -> Result<(), EngineError> {
        Ok(self.db.insert_audit(entries)?)
    }

    /// Removes audit rows older than `before` (ms since the epoch).
    pub fn prune_audit(&self, before: i64) -> Result<u64, EngineError> {
        Ok(self
            .db
            .with(|b| Ok(b.execute("DELETE FROM audit WHERE at < $1", params![before])?))?)
    }

    pub fn audit(&self, tenant: Option<&str>, limit: i64) -> Result<Vec<AuditEntry>, EngineError> {
        Ok(self.db.audit(tenant, limit)?)
    }
}
