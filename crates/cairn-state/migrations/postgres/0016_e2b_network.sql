-- E2B network rules.
--
-- `network` is the egress an E2B sandbox was given, as JSON
-- `{"allow_out": [...], "deny_out": [...]}` in E2B's terms (addresses,
-- networks, names; `0.0.0.0/0` in `deny_out` is all traffic, what
-- `allow_internet_access=False` asks for): applied again when a paused
-- sandbox resumes, and changed by `update_network`. NULL: loopback only
-- (a server without `--e2b-network egress`, or a gVisor template).
ALTER TABLE e2b_sandboxes ADD COLUMN network TEXT;
