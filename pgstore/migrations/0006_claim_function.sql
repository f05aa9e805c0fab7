-- idem_claim is the claim's insert-or-read as a function, so that a claim
-- (every create, every replay, every in-flight 409) is a one-line call
-- whose plan is trivial, instead of a statement PostgreSQL parses and
-- plans each time: pools that cannot keep prepared statements (pgx's
-- cache_describe and exec modes, a pooler in transaction mode) sent the
-- insert-or-read's text on every claim, and parsing and planning it was
-- about three quarters of PostgreSQL's work for a replay (docs/BENCHMARKS.md).
-- PL/pgSQL keeps each statement's plan for the life of the session.
--
-- It returns what the single statement returned: the INSERT's row with
-- inserted = true, or else the row it conflicted with. The SELECT is a
-- statement of its own, with a snapshot of its own taken after the INSERT:
-- it also sees a row that a concurrent claim committed while the INSERT
-- waited for it (the single statement could not, and Store.Claim then read
-- it in a second statement, which it still does when this returns no row:
-- the row was deleted in between).
--
-- SET search_path FROM CURRENT binds the function to the schema it was
-- migrated in (MigrateSchema sets it), whatever the caller's search_path:
-- a pooler in transaction mode does not keep one.
--
-- p_table is the table the caller's other statements use, resolved in the
-- caller's statement ('idempotency_keys'::regclass, qualified when
-- Options.Schema names a schema). The function refuses to claim in any
-- other table, with undefined_function (42883), the error of a schema
-- without the function, after which the store sends the insert-or-read
-- statement: an unqualified call resolves idem_claim through the caller's
-- search_path, which may find it in a later schema than the table (that
-- table's schema not yet migrated to 0006), and the function's own
-- search_path may select another relation (a temporary table comes
-- first). Claiming there would give a lease that the store's Complete,
-- Release and Fail, and the completer, do not see.
--
-- p_at is the claim's time. The store passes it always, read in its call
-- as its other statements read it (the test clock, or else
-- statement_timestamp(), the same instant the function would read): the
-- claim and the conditional UPDATE that may follow decide by one clock.
CREATE FUNCTION idem_claim(
    p_user text, p_key text, p_fingerprint text, p_method text, p_path text,
    p_request_header jsonb, p_request_body bytea, p_owner text,
    p_lease interval, p_ttl interval, p_at timestamptz, p_table regclass)
RETURNS TABLE (
    inserted boolean, fingerprint text, owner text, lease_until timestamptz,
    attempts int, redrives int, created_at timestamptz, expires_at timestamptz,
    response_status int, response_header jsonb, response_body bytea,
    response_trailer jsonb, now timestamptz)
LANGUAGE plpgsql VOLATILE
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    t timestamptz := coalesce(p_at, statement_timestamp());
BEGIN
    IF p_table IS DISTINCT FROM 'idempotency_keys'::regclass THEN
        RAISE EXCEPTION 'idem_claim: the caller''s table % is not %, this function''s', p_table, 'idempotency_keys'::regclass
            USING ERRCODE = 'undefined_function';
    END IF;
    RETURN QUERY
    INSERT INTO idempotency_keys AS k
        (user_id, key, fingerprint, method, path, request_header, request_body,
         owner, lease_until, attempts, created_at, expires_at)
    VALUES (p_user, p_key, p_fingerprint, p_method, p_path, p_request_header, p_request_body,
            p_owner, t + p_lease, 1, t, t + p_ttl)
    ON CONFLICT ON CONSTRAINT idempotency_keys_pkey DO NOTHING
    RETURNING true, k.fingerprint, k.owner, k.lease_until, k.attempts, k.redrives,
        k.created_at, k.expires_at, NULL::int, NULL::jsonb, NULL::bytea, NULL::jsonb, t;
    IF FOUND THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT false, k.fingerprint, k.owner, k.lease_until, k.attempts, k.redrives,
        k.created_at, k.expires_at, k.response_status, k.response_header,
        k.response_body, k.response_trailer, t
    FROM idempotency_keys k
    WHERE k.user_id = p_user AND k.key = p_key;
END
$$;

-- A function's EXECUTE is PUBLIC's unless default privileges revoke it (as
-- some hardened databases do); the application's role then could not claim
-- at all. The function runs with its caller's rights (it is not SECURITY
-- DEFINER): granting it gives no one a right on the table.
GRANT EXECUTE ON FUNCTION idem_claim(text, text, text, text, text, jsonb, bytea, text,
    interval, interval, timestamptz, regclass) TO PUBLIC;
