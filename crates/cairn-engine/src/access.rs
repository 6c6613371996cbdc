//! What `cairn serve` keeps in the state store: API tokens (stored as
//! hashes) and idempotency keys (a retried POST answers what the first
//! one did). Schema and durability notes: `migrations/sqlite/0004_api.sql`.

pub use cairn_state::access::*;

use crate::{now_ms, random_hex, Engine, EngineError};

#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error("no API token matches {0:?}; `cairn token ls` lists them")]
    NoSuchToken(String),
    #[error("invalid token name {0:?}: use 1 to 64 letters, digits, '-', '_' or '.'")]
    BadTokenName(String),
}

impl Engine {
    /// Makes an API token; its secret is returned here and never again.
    /// A token of `tenant` sees only that tenant's objects; without one it
    /// is an administrator.
    pub fn create_token(&self, name: &str, tenant: Option<&str>) -> Result<NewToken, EngineError> {
        let valid = !name.is_empty()
            && name.len() <= 64
            && name.bytes().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c));
        if !valid {
            return Err(AccessError::BadTokenName(name.to_string()).into());
        }
        let record = TokenRecord {
            id: random_hex(6),
            name: name.to_string(),
            created_at: now_ms(),
            last_used: None,
            tenant: match tenant {
                Some(t) => Some(self.tenant(t)?.name),
                None => None,
            },
        };
        let secret = format!("{TOKEN_PREFIX}{}", random_hex(24));
        self.db.insert_token(&record, &secret_hash(&secret))?;
        Ok(NewToken { record, secret })
    }

    pub fn tokens(&self) -> Result<Vec<TokenRecord>, EngineError> {
        Ok(self.db.tokens()?)
    }

    /// Revokes the token with this id or name.
    pub fn remove_token(&self, key: &str) -> Result<(), EngineError> {
        match self.db.delete_token(key)? {
            0 => Err(AccessError::NoSuchToken(key.to_string()).into()),
            _ => Ok(()),
        }
    }

    /// The token a request presents, if it is one of ours.
    pub fn check_token(&self, secret: &str) -> Result<Option<TokenRecord>, EngineError> {
        if !secret.starts_with(TOKEN_PREFIX) || secret.len() > 256 {
            return Ok(None);
        }
        Ok(self.db.use_token(&secret_hash(secret), now_ms())?)
    }

    /// Whether the token with this id still exists.
    pub fn token_exists(&self, id: &str) -> Result<bool, EngineError> {
        Ok(self.db.token_exists(id)?)
    }

    /// The ids of every token that exists.
    pub fn token_ids(&self) -> Result<std::collections::HashSet<String>, EngineError> {
        Ok(self.db.token_ids()?)
    }

    /// Claims an idempotency key for a request body (see [`Claim`]).
    pub fn claim_idempotent(
        &self,
        scope: &str,
        key: &str,
        body: &[u8],
        stale_before: i64,
    ) -> Result<Claim, EngineError> {
        let request = blake3::hash(body).to_hex().to_string();
        Ok(self
            .db
            .claim_idempotency(scope, key, &request, now_ms(), stale_before)?)
    }

    pub fn answer_idempotent(&self, scope: &str, key: &str, status: u16, body: &str) -> Result<(), EngineError> {
        Ok(self.db.answer_idempotency(scope, key, status, body)?)
    }

    pub fn release_idempotent(&self, scope: &str, key: &str) -> Result<(), EngineError> {
        Ok(self.db.release_idempotency(scope, key)?)
    }
}
