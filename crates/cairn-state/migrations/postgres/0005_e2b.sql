-- The E2B gateway's sandboxes and snapshots: the PostgreSQL form of
-- migrations/sqlite/0005_e2b.sql (read its notes on durability).

CREATE TABLE e2b_sandboxes (
    id          TEXT PRIMARY KEY,
    template    TEXT NOT NULL,
    sandbox_id  TEXT,
    snapshot_id TEXT,
    started_at  BIGINT NOT NULL,
    end_at      BIGINT NOT NULL,
    auto_pause  BIGINT NOT NULL,
    cpu_count   BIGINT NOT NULL,
    memory_mb   BIGINT NOT NULL,
    CHECK ((sandbox_id IS NULL) <> (snapshot_id IS NULL))
);

CREATE TABLE e2b_sandbox_vars (
    id          TEXT NOT NULL REFERENCES e2b_sandboxes (id) ON DELETE CASCADE,
    kind        TEXT NOT NULL CHECK (kind IN ('metadata', 'env')),
    name        TEXT NOT NULL,
    value       TEXT NOT NULL,
    PRIMARY KEY (id, kind, name)
);

CREATE TABLE e2b_snapshots (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    e2b_id      TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);
