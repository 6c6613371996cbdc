-- Agent sessions: the PostgreSQL form of migrations/sqlite/0006_sessions.sql
-- (read its notes on durability).

CREATE TABLE sessions (
    id              TEXT PRIMARY KEY,
    name            TEXT NOT NULL UNIQUE,
    state           TEXT NOT NULL,      -- active | suspending | suspended | resuming | failed | closed
    image           TEXT NOT NULL,
    driver          TEXT NOT NULL,
    sandbox_id      TEXT,               -- the sandbox running it, NULL while suspended or closed
    snapshot_id     TEXT,               -- the newest snapshot recorded in its log
    snapshot_seq    BIGINT,            -- the entry that records it
    idle_timeout_ms BIGINT,            -- suspend after this long idle (the server's timer)
    parent_id       TEXT REFERENCES sessions (id),
    fork_seq        BIGINT,            -- the parent's entries up to it are this log's first
    fork_reason     TEXT,
    fork_rewinds    BIGINT NOT NULL,   -- the parent's rewinds that apply to the shared entries
    head_seq        BIGINT NOT NULL,   -- the last entry appended (fork_seq for a new fork)
    head_hash       TEXT NOT NULL,      -- its hash (hex), the chain's next link
    rewinds         BIGINT NOT NULL,   -- how many branch points it has
    owner_pid       BIGINT NOT NULL,   -- the process moving it (suspend, resume)
    owner_start     BIGINT NOT NULL,
    error           TEXT,
    created_at      BIGINT NOT NULL,
    updated_at      BIGINT NOT NULL,
    CHECK (state IN ('active', 'suspending', 'suspended', 'resuming', 'failed', 'closed'))
);

-- The context log. hash = BLAKE3(previous hash || canonical entry), hex.
-- A payload above 64 KiB is in the chunk store: content_ref/result_ref
-- hold its object hash and content/result are NULL.
CREATE TABLE session_entries (
    session_id   TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    seq          BIGINT NOT NULL,
    version      BIGINT NOT NULL,
    kind         TEXT NOT NULL,     -- system | user | assistant | tool_call | tool_result | note | recovered
    role         TEXT,
    content      TEXT,
    content_ref  TEXT,
    tool         TEXT,
    arguments    TEXT,              -- JSON
    result       TEXT,
    result_ref   TEXT,
    exit_status  BIGINT,
    tokens_in    BIGINT,
    tokens_out   BIGINT,
    snapshot_id  TEXT,              -- the snapshot holding the machine after this entry
    created_at   BIGINT NOT NULL,
    hash         TEXT NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE INDEX session_entries_snapshots ON session_entries (session_id, seq) WHERE snapshot_id IS NOT NULL;

-- Branch points: entries to_seq < seq <= head_seq were abandoned by the
-- n-th rewind of the session.
CREATE TABLE session_rewinds (
    session_id  TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    n           BIGINT NOT NULL,
    to_seq      BIGINT NOT NULL,
    head_seq    BIGINT NOT NULL,
    created_at  BIGINT NOT NULL,
    PRIMARY KEY (session_id, n)
);
