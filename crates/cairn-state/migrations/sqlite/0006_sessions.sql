-- Agent sessions: an append-only context log beside the sandbox's
-- execution snapshots.
--
-- Durability: an entry gets its seq (1, 2, 3, … with no gap) and its hash
-- in the transaction that appends it, which also moves the session's head
-- (head_seq, head_hash) by compare-and-set: of two appenders racing, one
-- wins and the other retries. A fork stores its parent and the fork seq
-- (the parent's entries up to it are read from the parent, never copied).
-- A rewind records a branch point; the entries it abandons stay.
-- Suspend records the snapshot (a `note` entry naming it, and
-- sessions.snapshot_id) before the sandbox is removed, so a kill at any
-- instant leaves either the running sandbox or the snapshot to resume from.

CREATE TABLE sessions (
    id              TEXT PRIMARY KEY,
    name            TEXT NOT NULL UNIQUE,
    state           TEXT NOT NULL,      -- active | suspending | suspended | resuming | failed | closed
    image           TEXT NOT NULL,
    driver          TEXT NOT NULL,
    sandbox_id      TEXT,               -- the sandbox running it, NULL while suspended or closed
    snapshot_id     TEXT,               -- the newest snapshot recorded in its log
    snapshot_seq    INTEGER,            -- the entry that records it
    idle_timeout_ms INTEGER,            -- suspend after this long idle (the server's timer)
    parent_id       TEXT REFERENCES sessions (id),
    fork_seq        INTEGER,            -- the parent's entries up to it are this log's first
    fork_reason     TEXT,
    fork_rewinds    INTEGER NOT NULL,   -- the parent's rewinds that apply to the shared entries
    head_seq        INTEGER NOT NULL,   -- the last entry appended (fork_seq for a new fork)
    head_hash       TEXT NOT NULL,      -- its hash (hex), the chain's next link
    rewinds         INTEGER NOT NULL,   -- how many branch points it has
    owner_pid       INTEGER NOT NULL,   -- the process moving it (suspend, resume)
    owner_start     INTEGER NOT NULL,
    error           TEXT,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    CHECK (state IN ('active', 'suspending', 'suspended', 'resuming', 'failed', 'closed'))
);

-- The context log. hash = BLAKE3(previous hash || canonical entry), hex.
-- A payload above 64 KiB is in the chunk store: content_ref/result_ref
-- hold its object hash and content/result are NULL.
CREATE TABLE session_entries (
    session_id   TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    seq          INTEGER NOT NULL,
    version      INTEGER NOT NULL,
    kind         TEXT NOT NULL,     -- system | user | assistant | tool_call | tool_result | note | recovered
    role         TEXT,
    content      TEXT,
    content_ref  TEXT,
    tool         TEXT,
    arguments    TEXT,              -- JSON
    result       TEXT,
    result_ref   TEXT,
    exit_status  INTEGER,
    tokens_in    INTEGER,
    tokens_out   INTEGER,
    snapshot_id  TEXT,              -- the snapshot holding the machine after this entry
    created_at   INTEGER NOT NULL,
    hash         TEXT NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE INDEX session_entries_snapshots ON session_entries (session_id, seq) WHERE snapshot_id IS NOT NULL;

-- Branch points: entries to_seq < seq <= head_seq were abandoned by the
-- n-th rewind of the session.
CREATE TABLE session_rewinds (
    session_id  TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    n           INTEGER NOT NULL,
    to_seq      INTEGER NOT NULL,
    head_seq    INTEGER NOT NULL,
    created_at  INTEGER NOT NULL,
    PRIMARY KEY (session_id, n)
);
