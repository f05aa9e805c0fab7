-- Every primary key and unique index of the service's tables includes
-- user_id, the column they would be distributed by across several
-- PostgreSQL servers (docs/SCALING.md, "Beyond one primary"): a key that
-- leaves the user out cannot be enforced by one shard. The keys keep their
-- leading column, so that lookups by id or event_id read the same index as
-- before; ids are drawn per user (an order's id hashes its user, a
-- receipt's event is its order's), so no two rows that were told apart
-- before are told apart any less.
--
-- The indexes are built first, each under a lock that keeps writers of
-- its table out (not readers); the keys are swapped once every index is
-- built, under locks that keep readers out too. Migrations run in one
-- transaction, so every lock is held until the end: were a key swapped
-- before the next index was built, its table could not even be read for
-- as long as that build takes. On a large table, build the new indexes
-- beforehand with CREATE UNIQUE INDEX CONCURRENTLY under the names below:
-- IF NOT EXISTS then skips them, and what is left takes a moment.
-- An index of one of these names is reused only when it is the one the
-- migration would build: valid, unique, whole (no predicate, no
-- expression) and on these columns in this order. Anything else stops the
-- migration before it changes anything, naming the index: a concurrent
-- build that failed or was cancelled leaves an invalid index, which
-- enforces nothing and which ON CONFLICT does not use (receipts would be
-- left without a key on the event, and every receipt refused). Drop it
-- (DROP INDEX CONCURRENTLY) and build it again, or let the migration build it.
--
-- Instances of an earlier version name the old keys in their
-- INSERT … ON CONFLICT on receipts: once this has run their receipt writes
-- fail (the consumer naks and retries) until they are replaced.

DO $$
DECLARE
    want record;
    got record;
BEGIN
    FOR want IN SELECT * FROM (VALUES
        ('orders_id_user_id', 'orders', ARRAY['id', 'user_id']),
        ('receipts_id_user_id', 'receipts', ARRAY['id', 'user_id']),
        ('receipts_event_id_user_id', 'receipts', ARRAY['event_id', 'user_id']),
        ('receipt_duplicates_id_user_id', 'receipt_duplicates', ARRAY['id', 'user_id'])
    ) AS w(name, tbl, cols)
    LOOP
        -- The relation of that name in the table's schema, if any: where
        -- CREATE INDEX IF NOT EXISTS looks.
        SELECT c.relkind = 'i' AS is_index,
            coalesce(x.indrelid = t.oid AND x.indisvalid AND x.indisunique
                AND x.indpred IS NULL AND x.indexprs IS NULL
                AND (SELECT array_agg(a.attname::text ORDER BY k.ord)
                     FROM unnest(x.indkey) WITH ORDINALITY AS k(attnum, ord)
                     JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum) = want.cols,
                false) AS usable,
            coalesce(x.indisvalid, false) AS valid
        INTO got
        FROM pg_class t
        JOIN pg_class c ON c.relnamespace = t.relnamespace AND c.relname = want.name
        LEFT JOIN pg_index x ON x.indexrelid = c.oid
        WHERE t.oid = to_regclass(want.tbl);
        IF FOUND AND NOT got.usable THEN
            RAISE EXCEPTION '% exists but is not the key that migration 0008 would build under that name (a valid unique index on %(%), without predicate or expression)%; drop it and build it again, or let the migration build it',
                want.name, want.tbl, array_to_string(want.cols, ', '),
                CASE
                    WHEN NOT got.is_index THEN ': it is not an index'
                    WHEN NOT got.valid THEN ': it is invalid, as a failed or cancelled CREATE INDEX CONCURRENTLY leaves it'
                    ELSE ''
                END;
        END IF;
    END LOOP;
END $$;

CREATE UNIQUE INDEX IF NOT EXISTS orders_id_user_id ON orders (id, user_id);
CREATE UNIQUE INDEX IF NOT EXISTS receipts_id_user_id ON receipts (id, user_id);
-- The consumer's INSERT … ON CONFLICT (event_id, user_id) names this one.
CREATE UNIQUE INDEX IF NOT EXISTS receipts_event_id_user_id ON receipts (event_id, user_id);
CREATE UNIQUE INDEX IF NOT EXISTS receipt_duplicates_id_user_id ON receipt_duplicates (id, user_id);

ALTER TABLE orders DROP CONSTRAINT orders_pkey,
    ADD CONSTRAINT orders_pkey PRIMARY KEY USING INDEX orders_id_user_id;
ALTER TABLE receipts DROP CONSTRAINT receipts_pkey,
    ADD CONSTRAINT receipts_pkey PRIMARY KEY USING INDEX receipts_id_user_id;
DROP INDEX receipts_event_id;
ALTER TABLE receipt_duplicates DROP CONSTRAINT receipt_duplicates_pkey,
    ADD CONSTRAINT receipt_duplicates_pkey PRIMARY KEY USING INDEX receipt_duplicates_id_user_id;
