-- The trailers a handler sent after its body (idem.Response.Trailer), as
-- jsonb like response_header. NULL: none, as in every row completed before
-- this migration, which stay readable as they are. A nullable column
-- without a default is added without rewriting the table.
ALTER TABLE idempotency_keys ADD COLUMN response_trailer jsonb;
