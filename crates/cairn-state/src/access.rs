//! What `cairn serve` keeps in the state store: API tokens (stored as
//! hashes) and idempotency keys (a retried POST answers what the first
//! one did). Schema and durability notes: `migrations/sqlite/0004_api.sql`.

use serde::Serialize;

use crate::{params, Db, Row, StateError};

/// Secrets start with this, so a leaked one is recognisable in logs and
/// by secret scanners.
pub const TOKEN_PREFIX: &str = "cairn_";

#[derive(Debug, Clone, Serialize)]
pub struct TokenRecord {
    pub id: String,
    pub name: String,
    pub created_at: i64,
    pub last_used: Option<i64>,
    /// The tenant whose objects it sees; `None`: an administrator.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// A new token: the record and the secret, shown once.
#[derive(Debug, Clone, Serialize)]
pub struct NewToken {
    #[serde(flatten)]
    pub record: TokenRecord,
    pub secret: String,
}

/// How a claim of an idempotency key went.
#[derive(Debug, Clone, PartialEq)]
pub enum Claim {
    /// The key is new: do the work, then the engine's `answer_idempotent`.
    New,
    /// A request with this key was answered: here is the answer.
    Answered { status: u16, body: String },
    /// A request with this key is being worked on now.
    InFlight,
    /// The key was used with another request body.
    Mismatch,
}

/// A token as the store keeps it: its secret's BLAKE3, never the secret.
pub fn secret_hash(secret: &str) -> String {
    blake3::hash(secret.as_bytes()).to_hex().to_string()
}

fn token_row(r: &Row) -> Result<TokenRecord, StateError> {
    Ok(TokenRecord {
        id: r.get(0)?,
        name: r.get(1)?,
        created_at: r.get(2)?,
        last_used: r.get(3)?,
        tenant: r.get(4)?,
    })
}

impl Db {
    pub fn insert_token(&self, t: &TokenRecord, hash: &str) -> Result<(), StateError> {
        self.with(|b| {
            b.execute(
                "INSERT INTO api_tokens (id, name, hash, created_at, last_used, tenant) VALUES ($1, $2, $3, $4, $5, $6)",
                params![&t.id, &t.name, hash, t.created_at, t.last_used, &t.tenant],
            )?;
            Ok(())
        })
    }

    pub fn tokens(&self) -> Result<Vec<TokenRecord>, StateError> {
        self.with(|b| {
            b.query(
                "SELECT id, name, created_at, last_used, tenant FROM api_tokens ORDER BY created_at, id",
                &[],
            )?
            .iter()
            .map(token_row)
            .collect()
        })
    }

    /// Deletes tokens whose id or name is `key`; how many went.
    pub fn delete_token(&self, key: &str) -> Result<u64, StateError> {
        self.with(|b| Ok(b.execute("DELETE FROM api_tokens WHERE id = $1 OR name = $1", params![key])?))
    }

    /// The token whose secret hashes to `hash`, marking it used.
    pub fn use_token(&self, hash: &str, at: i64) -> Result<Option<TokenRecord>, StateError> {
        self.with(|b| {
            let Some(row) = b.query_opt(
                "SELECT id, name, created_at, last_used, tenant FROM api_tokens WHERE hash = $1",
                params![hash],
            )?
            else {
                return Ok(None);
            };
            let t = token_row(&row)?;
            // Coarse on purpose: one write a minute per token, not one per request.
            if t.last_used.is_none_or(|u| at - u > 60_000) {
                b.execute("UPDATE api_tokens SET last_used = $2 WHERE id = $1", params![&t.id, at])?;
            }
            Ok(Some(t))
        })
    }

    /// Whether the token with this id exists (it has not been removed).
    pub fn token_exists(&self, id: &str) -> Result<bool, StateError> {
        self.with(|b| {
            Ok(b.query_opt("SELECT 1 FROM api_tokens WHERE id = $1", params![id])?
                .is_some())
        })
    }

    /// The ids of every token that exists.
    pub fn token_ids(&self) -> Result<std::collections::HashSet<String>, StateError> {
        self.with(|b| {
            let mut ids = std::collections::HashSet::new();
            for r in b.query("SELECT id FROM api_tokens", params![])? {
                ids.insert(r.get(0)?);
            }
            Ok(ids)
        })
    }

    /// Claims `(scope, key)` for a request whose body hashes to `request`.
    /// A claim still in flight that is older than `stale_before` belonged
    /// to a server that is gone, and is taken over.
    pub fn claim_idempotency(
        &self,
        scope: &str,
        key: &str,
        request: &str,
        at: i64,
        stale_before: i64,
    ) -> Result<Claim, StateError> {
        self.transaction(|b| {
            let inserted = b.execute(
                "INSERT INTO idempotency_keys (scope, key, request, status, response, created_at)
                 VALUES ($1, $2, $3, NULL, NULL, $4) ON CONFLICT (scope, key) DO NOTHING",
                params![scope, key, request, at],
            )?;
            if inserted == 1 {
                return Ok(Claim::New);
            }
            let Some(row) = b.query_opt(
                "SELECT request, status, response, created_at FROM idempotency_keys WHERE scope = $1 AND key = $2",
                params![scope, key],
            )?
            else {
                // Released between the insert and the read: try again.
                return Ok(Claim::InFlight);
            };
            let (stored, status, response, created): (String, Option<i64>, Option<String>, i64) =
                (row.get(0)?, row.get(1)?, row.get(2)?, row.get(3)?);
            if stored != request {
                return Ok(Claim::Mismatch);
            }
            match (status, response) {
                (Some(status), Some(body)) => Ok(Claim::Answered {
                    status: status as u16,
                    body,
                }),
                _ if created < stale_before => {
                    b.execute(
                        "UPDATE idempotency_keys SET created_at = $3 WHERE scope = $1 AND key = $2",
                        params![scope, key, at],
                    )?;
                    Ok(Claim::New)
                }
                _ => Ok(Claim::InFlight),
            }
        })
    }

    /// Stores the answer to a claimed key.
    pub fn answer_idempotency(&self, scope: &str, key: &str, status: u16, body: &str) -> Result<(), StateError> {
        self.with(|b| {
            b.execute(
                "UPDATE idempotency_keys SET status = $3, response = $4 WHERE scope = $1 AND key = $2",
                params![scope, key, status as i64, body],
            )?;
            Ok(())
        })
    }

    /// Gives a claimed key up (its request failed): a retry does the work.
    pub fn release_idempotency(&self, scope: &str, key: &str) -> Result<(), StateError> {
        self.with(|b| {
            b.execute(
                "DELETE FROM idempotency_keys WHERE scope = $1 AND key = $2 AND status IS NULL",
                params![scope, key],
            )?;
            Ok(())
        })
    }
}
