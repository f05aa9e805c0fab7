-- The sweep of sent events (Table.DeleteSent) reads them by sent_at, oldest
-- first; unsent events, which the relay reads by its own index, are left
-- out of this one.
CREATE INDEX IF NOT EXISTS idem_outbox_sent_at ON idem_outbox (sent_at) WHERE sent_at IS NOT NULL;
