-- What `cairn serve` keeps: API tokens and idempotency keys.
--
-- Durability: a token is usable once its row is committed and refused once
-- it is deleted; only its BLAKE3 hash is stored, so the state store never
-- holds a usable secret. An idempotency key is claimed (response NULL)
-- before its request's work starts and answered (response set) in the
-- transaction after it; a retried request with the key gets the stored
-- answer, and one arriving while the first is in flight is refused. A claim
-- whose server died is released when it is older than the server's start.

CREATE TABLE api_tokens (
    id          TEXT PRIMARY KEY,       -- public, shown by `cairn token ls`
    name        TEXT NOT NULL,
    hash        TEXT NOT NULL UNIQUE,   -- BLAKE3 of the secret, hex
    created_at  INTEGER NOT NULL,
    last_used   INTEGER
);

CREATE TABLE idempotency_keys (
    scope       TEXT NOT NULL,          -- the route: sandboxes.create, fork, runs.start
    key         TEXT NOT NULL,          -- the client's Idempotency-Key
    request     TEXT NOT NULL,          -- BLAKE3 of the request body: a reused key with another body is refused
    status      INTEGER,                -- the answer's HTTP status, NULL while in flight
    response    TEXT,                   -- the answer's body
    created_at  INTEGER NOT NULL,
    PRIMARY KEY (scope, key)
);
