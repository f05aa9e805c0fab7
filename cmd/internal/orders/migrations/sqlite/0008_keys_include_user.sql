-- PostgreSQL's 0008 makes every key of the service's tables include
-- user_id, the column they would be distributed by across several
-- servers. A SQLite file is never distributed, so its primary keys stay
-- as they are (changing one would rebuild the table). Only the receipts'
-- unique index follows, so that the consumer's insert names the same key
-- (ON CONFLICT (event_id, user_id)) on both databases. A receipt of an
-- event under another user than its order's is no longer refused by the
-- index alone: the consumer writes a receipt only for an event whose order
-- exists for that user, and orders.id stays unique here, so one event
-- still has one receipt.
CREATE UNIQUE INDEX IF NOT EXISTS receipts_event_id_user_id ON receipts (event_id, user_id);
DROP INDEX receipts_event_id;
