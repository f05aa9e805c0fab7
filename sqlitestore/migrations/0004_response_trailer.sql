-- The trailers a handler sent after its body (idem.Response.Trailer), as
-- JSON like response_header. NULL: none, as in every row completed before
-- this migration, which stay readable as they are.
ALTER TABLE idempotency_keys ADD COLUMN response_trailer TEXT;
