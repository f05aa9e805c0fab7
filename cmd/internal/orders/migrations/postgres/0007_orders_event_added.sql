-- event_added is true for an order whose orders.created event was added to
-- the outbox: with the order, in its transaction (every order this
-- version writes), or later by BackfillEvents. NULL marks an order written
-- before events, or by an older binary during an upgrade, whose event
-- BackfillEvents may still have to add; it reads only those, by the
-- partial index below, instead of every order at every start. An event
-- deleted from the outbox after it was sent is then never added again.
ALTER TABLE orders ADD COLUMN event_added boolean;
CREATE INDEX orders_event_not_added ON orders (user_id, created_at, id) WHERE event_added IS NULL;
