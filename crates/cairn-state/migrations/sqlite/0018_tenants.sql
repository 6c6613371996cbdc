-- Tenants: tokens that see only their own objects.
--
-- A token whose `tenant` is NULL is an administrator (every token made
-- before this migration). Every object a tenant's token creates records
-- the tenant (`tenant`, NULL: the administrator's) in the transaction
-- that inserts its row, so no object exists, even for an instant, without
-- its owner; forks, restores, snapshots and a session's sandboxes are made
-- by the same caller and take the same owner. Removing a tenant deletes
-- its tokens in the same transaction (their next request gets 401) and
-- gives what it still owns (snapshots, finished runs, images, closed
-- sessions) to the administrator: nothing is left without an owner.
-- Limits (`max_*`, NULL: none) are checked in the transaction that inserts
-- a sandbox row, so two creates racing cannot both pass the last slot.

CREATE TABLE tenants (
    name           TEXT PRIMARY KEY,
    max_sandboxes  BIGINT,
    max_memory     BIGINT,              -- bytes, the sum of its sandboxes' memory limits
    max_disk       BIGINT,              -- bytes, the sum of its sandboxes' disk limits
    created_at     BIGINT NOT NULL
);

ALTER TABLE api_tokens ADD COLUMN tenant TEXT REFERENCES tenants (name) ON DELETE CASCADE;
ALTER TABLE sandboxes ADD COLUMN tenant TEXT;
ALTER TABLE snapshots ADD COLUMN tenant TEXT;
ALTER TABLE sessions ADD COLUMN tenant TEXT;
ALTER TABLE runs ADD COLUMN tenant TEXT;
ALTER TABLE images ADD COLUMN tenant TEXT;
ALTER TABLE e2b_sandboxes ADD COLUMN tenant TEXT;
ALTER TABLE e2b_templates ADD COLUMN tenant TEXT;
CREATE INDEX sandboxes_by_tenant ON sandboxes (tenant);
CREATE INDEX snapshots_by_tenant ON snapshots (tenant);
CREATE INDEX sessions_by_tenant ON sessions (tenant);
CREATE INDEX runs_by_tenant ON runs (tenant);

-- Who did what: one row per request a token made (Cairn's API, the E2B
-- API, /mcp), written behind the answer in batches. `token` is the API
-- token's id, `tenant` its tenant then (NULL: an administrator).
CREATE TABLE audit (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    at         BIGINT NOT NULL,
    token      TEXT,
    tenant     TEXT,
    surface    TEXT NOT NULL,           -- api | e2b | mcp
    method     TEXT NOT NULL,
    path       TEXT NOT NULL,
    status     INTEGER NOT NULL
);
CREATE INDEX audit_by_tenant ON audit (tenant, seq);
