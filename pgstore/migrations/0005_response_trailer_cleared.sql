-- A row's trailers belong to the response they were stored with. An
-- instance from before 0004 knows nothing of response_trailer: when it
-- replaces an expired completed key it sets response_status,
-- response_header and response_body to NULL but leaves response_trailer,
-- and its Complete of the new operation does not write the column, so the
-- new operation would be replayed with the previous operation's trailers.
-- During a rolling deploy both kinds of instance write the table; this
-- trigger covers every writer: whenever an UPDATE takes response_status from
-- a value to NULL (a completed key starting a new operation), the trailers
-- go with it. Creating a trigger takes a SHARE ROW EXCLUSIVE lock on the
-- table (writes wait, briefly; reads go on) and rewrites nothing.
CREATE OR REPLACE FUNCTION idempotency_keys_clear_response_trailer() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.response_trailer := NULL;
    RETURN NEW;
END
$$;

CREATE TRIGGER idempotency_keys_clear_response_trailer
    BEFORE UPDATE ON idempotency_keys
    FOR EACH ROW
    WHEN (OLD.response_status IS NOT NULL AND NEW.response_status IS NULL)
    EXECUTE FUNCTION idempotency_keys_clear_response_trailer();
