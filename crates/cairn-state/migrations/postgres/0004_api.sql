-- API tokens and idempotency keys: the PostgreSQL form of
-- migrations/sqlite/0004_api.sql (read its notes on durability).

CREATE TABLE api_tokens (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    hash        TEXT NOT NULL UNIQUE,
    created_at  BIGINT NOT NULL,
    last_used   BIGINT
);

CREATE TABLE idempotency_keys (
    scope       TEXT NOT NULL,
    key         TEXT NOT NULL,
    request     TEXT NOT NULL,
    status      BIGINT,
    response    TEXT,
    created_at  BIGINT NOT NULL,
    PRIMARY KEY (scope, key)
);
