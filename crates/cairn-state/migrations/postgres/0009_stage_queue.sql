-- Many hosts on one state store: the stage queue workers claim from, and
-- each sandbox's home.
--
-- `sandboxes.home_id` names the state directory (host) a sandbox runs on:
-- its processes, mounts and upper layer are there and nowhere else, so a
-- host lists, reconciles and removes only its own ('' for rows written
-- before this column, adopted by the next home that opens the store).
--
-- `stage_jobs` is the queue `cairn worker` claims from: one row per run to
-- orchestrate (`kind` = 'run') and per branch of a group spread over
-- workers (`kind` = 'branch'). A claim increments `epoch` and sets a lease
-- (`lease_until`, database clock, ms since the epoch) that the holder
-- renews; a job whose lease expired is claimed again by anyone. `epoch`
-- is the fencing token: a stage's outcome commits only in a transaction
-- that finds the job still at the epoch its worker claimed, so a worker
-- presumed dead cannot commit after its lease moved on.
ALTER TABLE sandboxes ADD COLUMN home_id TEXT NOT NULL DEFAULT '';

CREATE TABLE stage_jobs (
    id           TEXT PRIMARY KEY,   -- the run id, or RUN/STAGE/BRANCH
    run_id       TEXT NOT NULL,
    kind         TEXT NOT NULL,      -- run | branch
    stage        TEXT NOT NULL,
    branch       TEXT NOT NULL,
    payload      TEXT NOT NULL,      -- a branch's hypothesis and the params it runs with (JSON)
    status       TEXT NOT NULL,      -- queued | claimed | done
    epoch        BIGINT NOT NULL,
    worker       TEXT,
    lease_until  BIGINT,
    enqueued_at  BIGINT NOT NULL,
    claimed_at   BIGINT,
    ended_at     BIGINT
);
CREATE INDEX stage_jobs_by_status ON stage_jobs(status, enqueued_at);

CREATE TABLE workers (
    id          TEXT PRIMARY KEY,
    home_path   TEXT NOT NULL,
    hostname    TEXT NOT NULL,
    pid         BIGINT NOT NULL,
    slots       BIGINT NOT NULL,
    started_at  BIGINT NOT NULL,
    seen_at     BIGINT NOT NULL,
    stopped_at  BIGINT
);
