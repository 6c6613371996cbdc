-- A sandbox's network (`--network egress`): NULL for loopback only, else
-- JSON holding what was asked for (`egress`, `allow`, `publish`) and, while
-- it runs, the address it was given (`slot`, `address`, `gateway`, `mac`,
-- `interface`). The slot itself is held host-wide in /run/cairn/net (see
-- docs/formats.md): the row records it, the host's record frees it.
ALTER TABLE sandboxes ADD COLUMN network TEXT;

-- A session's network (JSON: `egress`, `allow`), given to every sandbox
-- it runs in across suspends and resumes; NULL for loopback only.
ALTER TABLE sessions ADD COLUMN network TEXT;
