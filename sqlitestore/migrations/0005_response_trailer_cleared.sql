-- A row's trailers belong to the response they were stored with. An
-- instance from before 0004 knows nothing of response_trailer: when it
-- replaces an expired completed key it sets response_status,
-- response_header and response_body to NULL but leaves response_trailer,
-- and its Complete of the new operation does not write the column, so the
-- new operation would be replayed with the previous operation's trailers.
-- During a rolling deploy both kinds of instance write the file; this
-- trigger covers every writer: whenever an UPDATE takes response_status from
-- a value to NULL (a completed key starting a new operation), the trailers
-- go with it, in the same statement. Its own UPDATE does not set
-- response_status, so it never fires itself, even with recursive_triggers.
CREATE TRIGGER idempotency_keys_clear_response_trailer
    AFTER UPDATE OF response_status ON idempotency_keys
    FOR EACH ROW
    WHEN OLD.response_status IS NOT NULL AND NEW.response_status IS NULL
BEGIN
    UPDATE idempotency_keys SET response_trailer = NULL
    WHERE user_id = NEW.user_id AND key = NEW.key;
END;
