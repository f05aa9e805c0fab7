-- PostgreSQL's 0008 makes every key of the service's tables include
-- user_id, the column they would be distributed by across several
-- servers. A SQLite file is never distributed, so its primary keys stay
-- as they are (changing one would rebuild the table). Only the receipts'
-- unique index follows, so that the consumer's insert names the same key
-- (ON CONFLICT (event_id, user_id)) on both databases; a receipt's event
-- is its order's, whose id hashes its user, so the index refuses what it
-- refused before.
CREATE UNIQUE INDEX IF NOT EXISTS receipts_event_id_user_id ON receipts (event_id, user_id);
DROP INDEX receipts_event_id;
