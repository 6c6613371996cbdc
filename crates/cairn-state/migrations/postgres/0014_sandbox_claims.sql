-- The queue claim (stage_jobs' id and epoch) under which a pipeline
-- stage's sandbox was made, by a worker (crates/cairn-engine/src/queue.rs,
-- `Db::orphans`). A sandbox whose claim has moved on (its job claimed
-- again, ended or gone) and that no stage row names is an orphan of a dead
-- or fenced-off attempt: its home's worker, or `cairn gc` there, records
-- and removes it. Sandboxes made outside a worker have no row here.
CREATE TABLE sandbox_claims (
    sandbox_id  TEXT PRIMARY KEY REFERENCES sandboxes(id) ON DELETE CASCADE,
    job_id      TEXT NOT NULL,
    epoch       BIGINT NOT NULL,
    run_id      TEXT NOT NULL,
    stage       TEXT NOT NULL,
    branch      TEXT NOT NULL
);
