-- Snapshots and their lineage.
--
-- Durability: a snapshot's layers, chunks and manifest are in the chunk
-- store (fsynced) before its row is inserted, in one transaction with its
-- layer list; a row therefore always names a restorable snapshot. A crash
-- before the insert leaves only unreferenced chunks, which `cairn gc`
-- reclaims.

CREATE TABLE snapshots (
    id            TEXT PRIMARY KEY,     -- BLAKE3 of the framed manifest
    parent_id     TEXT,                 -- the snapshot this one stacks on (lineage)
    sandbox_id    TEXT NOT NULL,        -- the sandbox it was taken from (may be gone)
    image         TEXT NOT NULL,
    driver        TEXT NOT NULL,
    label         TEXT,
    created_at    INTEGER NOT NULL,
    new_bytes     INTEGER NOT NULL,     -- file bytes in the new layer
    stored_bytes  INTEGER NOT NULL      -- compressed bytes it added to the store
);
CREATE INDEX snapshots_by_parent ON snapshots(parent_id);

CREATE TABLE snapshot_layers (
    snapshot_id  TEXT NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
    position     INTEGER NOT NULL,
    layer_id     TEXT NOT NULL,
    PRIMARY KEY (snapshot_id, position)
);
CREATE INDEX snapshot_layers_by_layer ON snapshot_layers(layer_id);

-- Commands cairn-init runs in the background after every start, restore,
-- fork and reset of the sandbox.
CREATE TABLE sandbox_services (
    sandbox_id  TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
    position    INTEGER NOT NULL,
    command     TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, position)
);

-- The snapshot the sandbox's next snapshot stacks on (NULL: its image).
ALTER TABLE sandboxes ADD COLUMN last_snapshot TEXT;
