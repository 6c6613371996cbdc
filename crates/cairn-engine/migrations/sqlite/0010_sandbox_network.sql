-- A sandbox's network (`--network egress`): NULL for loopback only, else
-- JSON holding what was asked for (`egress`, `allow`, `publish`) and, while
-- it runs, the address it was given (`slot`, `address`, `gateway`, `mac`,
-- `interface`). The slot itself is held host-wide in /run/cairn/net (see
-- docs/formats.md): the row records it, the host's record frees it.
ALTER TABLE sandboxes ADD COLUMN network TEXT;
