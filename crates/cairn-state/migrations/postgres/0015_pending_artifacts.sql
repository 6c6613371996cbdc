-- Artifacts an attempt collected, not yet committed: a stage's artifacts
-- become rows of `artifacts` (visible) only in the transaction that
-- commits the stage as completed, and only those of the claim that commits
-- it (job_id and epoch: the stage_jobs claim, or '' and 0 outside the
-- queue). Any other ending of the attempt drops its rows; `cairn gc` drops
-- those of a claim that moved on, and their bytes then go as garbage.
CREATE TABLE pending_artifacts (
    id           TEXT NOT NULL,
    run_id       TEXT NOT NULL,
    stage        TEXT NOT NULL,
    branch       TEXT NOT NULL,
    path         TEXT NOT NULL,
    size_bytes   BIGINT NOT NULL,
    content_hash TEXT NOT NULL,
    snapshot_id  TEXT NOT NULL,
    job_id       TEXT NOT NULL,
    epoch        BIGINT NOT NULL,
    PRIMARY KEY (run_id, stage, branch, path, job_id, epoch)
);
