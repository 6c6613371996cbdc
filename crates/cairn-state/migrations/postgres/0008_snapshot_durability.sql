-- When a snapshot became durable in the remote chunk store (S3).
--
-- Durability: with `--store s3://…` a snapshot's objects are written to the
-- local cache and uploaded behind; the row is inserted once they are in
-- the cache (so this host can restore it), and `remote_durable_at` is set
-- only after every object it reaches (manifest, layer indexes and their
-- chunks, memory images) was confirmed in the remote store. NULL: not yet,
-- or the home has no remote store; another host can restore only a
-- snapshot with it set.
ALTER TABLE snapshots ADD COLUMN remote_durable_at BIGINT;
