-- Every primary key and unique index of the service's tables includes
-- user_id, the column they would be distributed by across several
-- PostgreSQL servers (docs/SCALING.md, "Beyond one primary"): a key that
-- leaves the user out cannot be enforced by one shard. The keys keep their
-- leading column, so that lookups by id or event_id read the same index as
-- before; ids are drawn per user (an order's id hashes its user, a
-- receipt's event is its order's), so no two rows that were told apart
-- before are told apart any less.
--
-- Each step locks its table against writes while its index is built
-- (migrations run in one transaction). On a large table, build the new
-- indexes beforehand with CREATE UNIQUE INDEX CONCURRENTLY under the names
-- below: IF NOT EXISTS then skips them, and what is left takes a moment.
--
-- Instances of an earlier version name the old keys in their
-- INSERT … ON CONFLICT on receipts: once this has run their receipt writes
-- fail (the consumer naks and retries) until they are replaced.

CREATE UNIQUE INDEX IF NOT EXISTS orders_id_user_id ON orders (id, user_id);
ALTER TABLE orders DROP CONSTRAINT orders_pkey,
    ADD CONSTRAINT orders_pkey PRIMARY KEY USING INDEX orders_id_user_id;

CREATE UNIQUE INDEX IF NOT EXISTS receipts_id_user_id ON receipts (id, user_id);
ALTER TABLE receipts DROP CONSTRAINT receipts_pkey,
    ADD CONSTRAINT receipts_pkey PRIMARY KEY USING INDEX receipts_id_user_id;

-- The consumer's INSERT … ON CONFLICT (event_id, user_id) names this one.
CREATE UNIQUE INDEX IF NOT EXISTS receipts_event_id_user_id ON receipts (event_id, user_id);
DROP INDEX receipts_event_id;

CREATE UNIQUE INDEX IF NOT EXISTS receipt_duplicates_id_user_id ON receipt_duplicates (id, user_id);
ALTER TABLE receipt_duplicates DROP CONSTRAINT receipt_duplicates_pkey,
    ADD CONSTRAINT receipt_duplicates_pkey PRIMARY KEY USING INDEX receipt_duplicates_id_user_id;
