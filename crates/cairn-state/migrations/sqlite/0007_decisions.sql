-- Decisions of decide stages: what the model chose at a stage boundary.
--
-- Durability: a decision is written in the transaction that completes its
-- stage (or, for a retry or a dead letter it asks for, that resets the
-- stage before it), so a decision recorded is never asked for again: a
-- resumed run, or another run whose decide stage has the same completed
-- key, applies the recorded answer. Rounds count the decisions one decide
-- stage took in a run (a retry it asks for makes it decide again).

CREATE TABLE decisions (
    run_id         TEXT NOT NULL,
    stage          TEXT NOT NULL,
    round          INTEGER NOT NULL,  -- 1, 2, …
    stage_key      TEXT NOT NULL,
    model          TEXT NOT NULL,     -- provider/model that answered
    answer         TEXT NOT NULL,     -- the checked answer: JSON, docs/formats.md
    reason         TEXT NOT NULL,
    input_tokens   INTEGER NOT NULL,
    output_tokens  INTEGER NOT NULL,
    calls          INTEGER NOT NULL,  -- model calls it took (invalid answers are asked again)
    created_at     INTEGER NOT NULL,
    PRIMARY KEY (run_id, stage, round)
);
CREATE INDEX decisions_by_key ON decisions(stage_key, created_at);
