-- Typed lineage: each run event's fields beside its sentence.
--
-- `events.data` is JSON text `{"v": 1, "type": …, fields…}`
-- (`crates/cairn-engine/src/pipeline/lineage.rs`, docs/formats.md "Run
-- events"), written in the same statement as the event's sentence, which
-- is rendered from it; NULL for kinds that carry only a sentence and for
-- events recorded before this column. Durable with the event it belongs to.
ALTER TABLE events ADD COLUMN data TEXT;
