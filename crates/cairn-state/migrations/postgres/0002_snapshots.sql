-- Snapshots and their lineage: the PostgreSQL form of
-- migrations/sqlite/0002_snapshots.sql.

CREATE TABLE snapshots (
    id            TEXT PRIMARY KEY,     -- BLAKE3 of the framed manifest
    parent_id     TEXT,                 -- the snapshot this one stacks on (lineage)
    sandbox_id    TEXT NOT NULL,        -- the sandbox it was taken from (may be gone)
    image         TEXT NOT NULL,
    driver        TEXT NOT NULL,
    label         TEXT,
    created_at    BIGINT NOT NULL,
    new_bytes     BIGINT NOT NULL,
    stored_bytes  BIGINT NOT NULL
);
CREATE INDEX snapshots_by_parent ON snapshots(parent_id);

CREATE TABLE snapshot_layers (
    snapshot_id  TEXT NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
    position     BIGINT NOT NULL,
    layer_id     TEXT NOT NULL,
    PRIMARY KEY (snapshot_id, position)
);
CREATE INDEX snapshot_layers_by_layer ON snapshot_layers(layer_id);

CREATE TABLE sandbox_services (
    sandbox_id  TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
    position    BIGINT NOT NULL,
    command     TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, position)
);

-- The snapshot the sandbox's next snapshot stacks on (NULL: its image).
ALTER TABLE sandboxes ADD COLUMN last_snapshot TEXT;
