-- Sandboxes and the images they start from.
--
-- Durability: every row is written in its own transaction before the action
-- it describes takes effect on the host (a sandbox row exists, in state
-- 'creating', before any cgroup or process does), so after a crash the rows
-- always name every resource Cairn may have left on the host and the
-- garbage collector can find and release it.

CREATE TABLE images (
    name        TEXT PRIMARY KEY,
    source      TEXT NOT NULL,           -- how it was made: 'busybox', 'debian bookworm +jq', 'import /path'
    size_bytes  INTEGER NOT NULL,
    created_at  INTEGER NOT NULL         -- unix milliseconds
);

-- The image's layers, position 0 topmost.
CREATE TABLE image_layers (
    image       TEXT NOT NULL REFERENCES images(name) ON DELETE CASCADE,
    position    INTEGER NOT NULL,
    layer_id    TEXT NOT NULL,
    PRIMARY KEY (image, position)
);

CREATE TABLE sandboxes (
    id            TEXT PRIMARY KEY,
    name          TEXT NOT NULL UNIQUE,
    image         TEXT NOT NULL,
    driver        TEXT NOT NULL,
    state         TEXT NOT NULL,         -- see SandboxState
    pid           INTEGER,               -- host pid of cairn-init
    pid_start     INTEGER,               -- its start time, against pid reuse
    owner_pid     INTEGER NOT NULL,      -- the process creating or removing it
    owner_start   INTEGER NOT NULL,
    memory_bytes  INTEGER NOT NULL,
    cpu_millis    INTEGER NOT NULL,
    pids_max      INTEGER NOT NULL,
    created_at    INTEGER NOT NULL,
    auto_remove   INTEGER NOT NULL,      -- 1 for `cairn run`: removed once its owner is gone
    ended_reason  TEXT
);

-- The layers under the sandbox's upper directory, position 0 topmost. A
-- layer stays on disk while any image or sandbox refers to it.
CREATE TABLE sandbox_layers (
    sandbox_id  TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
    position    INTEGER NOT NULL,
    layer_id    TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, position)
);
CREATE INDEX sandbox_layers_by_layer ON sandbox_layers(layer_id);
CREATE INDEX image_layers_by_layer ON image_layers(layer_id);
