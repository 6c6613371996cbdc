-- Pipeline runs, their stages, artifacts, dead letters and lineage events.
--
-- Durability: each stage transition is one transaction. A stage is
-- `completed` only together with its `stage_keys` row and its output
-- snapshot (already in the chunk store), so a completed key never runs
-- again; an interrupted attempt leaves a `running` row that the next
-- `resume` restarts from the stage's newest checkpoint.

CREATE TABLE runs (
    id          TEXT PRIMARY KEY,
    pipeline    TEXT NOT NULL,
    file        TEXT NOT NULL,
    spec        TEXT NOT NULL,          -- the pipeline file as it was run
    params      TEXT NOT NULL,          -- --param overrides, one k=v per line
    status      TEXT NOT NULL,          -- running | completed | failed
    created_at  INTEGER NOT NULL,
    ended_at    INTEGER,
    error       TEXT
);

CREATE TABLE stages (
    run_id           TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
    stage            TEXT NOT NULL,
    branch           TEXT NOT NULL,     -- hypothesis name, '' outside branch groups
    stage_key        TEXT NOT NULL,
    status           TEXT NOT NULL,     -- pending | running | completed | failed | dead | lost
    attempts         INTEGER NOT NULL,
    input_snapshot   TEXT,
    output_snapshot  TEXT,
    sandbox_id       TEXT,
    started_at       INTEGER,
    ended_at         INTEGER,
    error            TEXT,
    metric           REAL,
    PRIMARY KEY (run_id, stage, branch)
);

-- Completed stage keys, across runs: the idempotency table.
CREATE TABLE stage_keys (
    stage_key        TEXT PRIMARY KEY,
    output_snapshot  TEXT NOT NULL,
    run_id           TEXT NOT NULL,
    stage            TEXT NOT NULL,
    completed_at     INTEGER NOT NULL,
    metric           REAL               -- a branch's number, for selection on reuse
);

CREATE TABLE checkpoints (
    run_id       TEXT NOT NULL,
    stage        TEXT NOT NULL,
    branch       TEXT NOT NULL,
    snapshot_id  TEXT NOT NULL,
    created_at   INTEGER NOT NULL
);
CREATE INDEX checkpoints_by_stage ON checkpoints(run_id, stage, branch, created_at);

CREATE TABLE artifacts (
    id           TEXT PRIMARY KEY,      -- chunk-store object holding the file's chunk list
    run_id       TEXT NOT NULL,
    stage        TEXT NOT NULL,
    branch       TEXT NOT NULL,
    path         TEXT NOT NULL,
    size_bytes   INTEGER NOT NULL,
    content_hash TEXT NOT NULL,         -- BLAKE3 of the content
    snapshot_id  TEXT NOT NULL
);

CREATE TABLE dead_letters (
    id                TEXT PRIMARY KEY,
    run_id            TEXT NOT NULL,
    stage             TEXT NOT NULL,
    branch            TEXT NOT NULL,
    error             TEXT NOT NULL,
    failure_snapshot  TEXT,
    input_snapshot    TEXT,
    created_at        INTEGER NOT NULL,
    retried_at        INTEGER
);

CREATE TABLE events (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id       TEXT NOT NULL,
    stage        TEXT,
    branch       TEXT,
    kind         TEXT NOT NULL,         -- started, reused, forked, checkpoint, failed, retry, completed, won, lost, dead, resumed
    detail       TEXT NOT NULL,
    snapshot_id  TEXT,
    created_at   INTEGER NOT NULL
);
CREATE INDEX events_by_run ON events(run_id, seq);
