-- What the E2B-compatible gateway (`cairn serve --e2b`) keeps: the
-- sandboxes the SDK knows by their E2B id, and the snapshots it made.
--
-- Durability: an E2B sandbox keeps its id across pause and resume while
-- the Cairn sandbox under it changes, so its row says where it is now:
-- running as `sandbox_id`, or paused as `snapshot_id` (exactly one of
-- them). The row is written after the engine work it describes succeeds
-- (a pause records the snapshot once it is taken and the sandbox removed),
-- so a crash between the two leaves the older, still true row: a paused
-- sandbox is never lost, and a server restart resumes it by the same id.
-- No secret is stored: envd access tokens are derived from the sandbox id
-- with a key kept in the state directory.

CREATE TABLE e2b_sandboxes (
    id          TEXT PRIMARY KEY,       -- the id the SDK holds
    template    TEXT NOT NULL,          -- as the SDK asked: base, an image, a snapshot id
    sandbox_id  TEXT,                   -- the Cairn sandbox running it, NULL while paused
    snapshot_id TEXT,                   -- the snapshot holding it while paused, else NULL
    started_at  INTEGER NOT NULL,
    end_at      INTEGER NOT NULL,       -- its timeout: removed, or paused with auto_pause
    auto_pause  INTEGER NOT NULL,
    cpu_count   INTEGER NOT NULL,
    memory_mb   INTEGER NOT NULL,
    CHECK ((sandbox_id IS NULL) <> (snapshot_id IS NULL))
);

-- Metadata and environment variables, one row each.
CREATE TABLE e2b_sandbox_vars (
    id          TEXT NOT NULL REFERENCES e2b_sandboxes (id) ON DELETE CASCADE,
    kind        TEXT NOT NULL CHECK (kind IN ('metadata', 'env')),
    name        TEXT NOT NULL,
    value       TEXT NOT NULL,
    PRIMARY KEY (id, kind, name)
);

CREATE TABLE e2b_snapshots (
    id          TEXT PRIMARY KEY,       -- the Cairn snapshot id, usable as a template
    name        TEXT NOT NULL,
    e2b_id      TEXT NOT NULL,          -- the E2B sandbox it was taken of
    created_at  INTEGER NOT NULL
);
