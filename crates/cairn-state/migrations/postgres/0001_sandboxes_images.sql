-- Sandboxes and the images they start from: the PostgreSQL form of
-- migrations/sqlite/0001_sandboxes_images.sql (read its notes on
-- durability). Integers are BIGINT: the engine binds 64-bit values.

CREATE TABLE images (
    name        TEXT PRIMARY KEY,
    source      TEXT NOT NULL,
    size_bytes  BIGINT NOT NULL,
    created_at  BIGINT NOT NULL          -- unix milliseconds
);

-- The image's layers, position 0 topmost.
CREATE TABLE image_layers (
    image       TEXT NOT NULL REFERENCES images(name) ON DELETE CASCADE,
    position    BIGINT NOT NULL,
    layer_id    TEXT NOT NULL,
    PRIMARY KEY (image, position)
);

CREATE TABLE sandboxes (
    id            TEXT PRIMARY KEY,
    name          TEXT NOT NULL,
    image         TEXT NOT NULL,
    driver        TEXT NOT NULL,
    state         TEXT NOT NULL,         -- see SandboxState
    pid           BIGINT,                -- host pid of cairn-init
    pid_start     BIGINT,                -- its start time, against pid reuse
    owner_pid     BIGINT NOT NULL,       -- the process creating or removing it
    owner_start   BIGINT NOT NULL,
    memory_bytes  BIGINT NOT NULL,
    cpu_millis    BIGINT NOT NULL,
    pids_max      BIGINT NOT NULL,
    created_at    BIGINT NOT NULL,
    auto_remove   BIGINT NOT NULL,       -- 1 for `cairn run`: removed once its owner is gone
    ended_reason  TEXT,
    -- Named as PostgreSQL names it by default; the engine reads a
    -- violation as "sandboxes.name", like SQLite's.
    CONSTRAINT sandboxes_name_key UNIQUE (name)
);

-- The layers under the sandbox's upper directory, position 0 topmost.
CREATE TABLE sandbox_layers (
    sandbox_id  TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
    position    BIGINT NOT NULL,
    layer_id    TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, position)
);
CREATE INDEX sandbox_layers_by_layer ON sandbox_layers(layer_id);
CREATE INDEX image_layers_by_layer ON image_layers(layer_id);
