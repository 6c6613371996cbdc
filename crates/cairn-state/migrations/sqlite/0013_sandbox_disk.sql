-- A sandbox's disk limit (`--disk`) in bytes: the size of the file system
-- its upper directory is on (an ext4 image in its directory, see
-- crates/cairn-sandbox/src/disk.rs); NULL: no limit of its own, its files
-- go on the state directory's file system. A fork keeps its source's.
ALTER TABLE sandboxes ADD COLUMN disk_bytes BIGINT;
