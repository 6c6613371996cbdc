-- Templates built through E2B's template API (`Template().build(...)`).
--
-- A template has a name (what `Sandbox.create(name)` asks for) and builds;
-- a tag (`name:tag`; `default` when none is given) names one build. A
-- build runs its steps in a sandbox and ends as a Cairn image (`image`,
-- `e2b-<template id>-<build id>`) plus what its sandboxes start with
-- (`config`, JSON: env, workdir, user, start_cmd, ready_cmd).
--
-- Durability: a build row is written `waiting` before any work, its image
-- committed whole before the row says `ready` (in one transaction with
-- its tags), so a crash never leaves a tag naming a half image; a build
-- that was `waiting` or `building` when the server stopped is marked
-- `error` when it starts again, and its sandbox removed.

CREATE TABLE e2b_templates (
    id          TEXT PRIMARY KEY,       -- what the SDK calls templateID
    name        TEXT NOT NULL UNIQUE,
    created_at  BIGINT NOT NULL
);

CREATE TABLE e2b_template_builds (
    id          TEXT PRIMARY KEY,       -- a UUID, the SDK's buildID
    template_id TEXT NOT NULL REFERENCES e2b_templates (id) ON DELETE CASCADE,
    status      TEXT NOT NULL CHECK (status IN ('waiting', 'building', 'ready', 'error')),
    tags        TEXT NOT NULL,          -- JSON list: the tags it takes when ready
    image       TEXT,                   -- the Cairn image, once ready
    config      TEXT,                   -- JSON, once ready
    reason      TEXT,                   -- JSON {message, step} when it failed
    logs        TEXT,                   -- JSON list of log entries, once finished
    created_at  BIGINT NOT NULL,
    finished_at BIGINT
);

CREATE TABLE e2b_template_tags (
    template_id TEXT NOT NULL REFERENCES e2b_templates (id) ON DELETE CASCADE,
    tag         TEXT NOT NULL,
    build_id    TEXT NOT NULL REFERENCES e2b_template_builds (id) ON DELETE CASCADE,
    created_at  BIGINT NOT NULL,
    PRIMARY KEY (template_id, tag)
);

-- The working directory a sandbox of a built template runs commands in
-- (its WORKDIR), kept across pause and resume; NULL: the user's home.
ALTER TABLE e2b_sandboxes ADD COLUMN workdir TEXT;
-- Whether its ports are reached without its traffic access token
-- (`allow_public_traffic=True`); 0 for rows from before: the token is needed.
ALTER TABLE e2b_sandboxes ADD COLUMN public_traffic INTEGER NOT NULL DEFAULT 0;

-- What a built image's sandboxes start with (`cairn image build --file`,
-- E2B template builds), as JSON {env, workdir, user, start_cmd,
-- ready_cmd}; NULL for images that say nothing of it.
ALTER TABLE images ADD COLUMN config TEXT;
