package benchkit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/idem-go/idem/idemdriver"
)

// PrefillUserPrefix begins the users of the keys Prefill inserts; no
// Workload user begins with it (those are bench-1 … bench-N), so the
// prefilled keys never meet the measured requests' keys.
const PrefillUserPrefix = "prefill-"

// PrefillBatch is how many keys one statement of Prefill inserts.
const PrefillBatch = 250_000

// prefillBatch is PrefillBatch; tests make it smaller.
var prefillBatch int64 = PrefillBatch

// prefillKeysPerUser is how many prefilled keys each prefill user has.
const prefillKeysPerUser = 100

// prefillInsert inserts the keys numbered $1 … $2-1: live records, as
// pgstore writes them for the library target's requests (a completed
// claim: the request's one kept header and 56-byte body, a 201 with its
// Content-Type and a 200-byte body), created over the last 12 hours and
// expiring 24 hours after their creation, so that none expires during a
// run. Users are prefill-0000000, prefill-0000001, … with
// prefillKeysPerUser keys each, their keys random-looking UUIDs, as
// clients make them; a batch covers whole users in ascending order, so
// its primary-key inserts land in one region of the index.
const prefillInsert = `
INSERT INTO idempotency_keys
	(user_id, key, fingerprint, method, path, request_header, request_body,
	 owner, lease_until, attempts, response_status, response_header, response_body,
	 created_at, completed_at, expires_at)
SELECT '` + PrefillUserPrefix + `' || lpad((g.i / $3)::text, 7, '0'),
	md5(g.i::text)::uuid::text,
	encode(sha256(convert_to('fp' || g.i, 'UTF8')), 'hex'),
	'POST', '` + Path + `',
	'{"Content-Type": ["application/json"]}'::jsonb,
	convert_to('{"amount":1299,"currency":"EUR","description":"one row"}', 'UTF8'),
	md5('owner' || g.i),
	c.at + interval '30 seconds', 1, 201,
	'{"Content-Type": ["application/json"]}'::jsonb,
	convert_to('{"id":"ord_' || substr(md5('ord' || g.i), 1, 24) || '","object":"order","user":"` + PrefillUserPrefix + `' ||
		lpad((g.i / $3)::text, 7, '0') || '","amount":1299,"currency":"EUR","status":"created","created":' ||
		extract(epoch FROM c.at)::bigint || ',"description":"one row inserted by the prefill"}', 'UTF8'),
	c.at, c.at + interval '5 milliseconds', c.at + interval '24 hours'
FROM generate_series($1::bigint, $2::bigint - 1) AS g(i),
	LATERAL (SELECT now() - interval '12 hours' * (g.i % 1000) / 1000 AS at) c`

// Prefill inserts n live keys (completed records that do not expire
// during a run) into the Target's idempotency_keys table, for users that
// begin with PrefillUserPrefix, PrefillBatch keys per INSERT … SELECT …
// FROM generate_series statement, calling progress (if not nil) after
// each with the keys inserted so far. Then it runs VACUUM ANALYZE on the
// table, so that the planner knows its size and autovacuum does not
// start on it in the middle of a measurement. Only the Postgres and Redis
// stores have such a table (Redis: the pgstore table under redisfront;
// the prefilled keys are not in Redis). Call it on a new Target, once.
func (t *Target) Prefill(ctx context.Context, n int64, progress func(done int64)) error {
	if t.pool == nil {
		return fmt.Errorf("benchkit: store %s has no table to prefill (postgres and redis only)", t.Store)
	}
	if n < 0 {
		return errors.New("benchkit: negative prefill")
	}
	for done := int64(0); done < n; {
		end := min(done+prefillBatch, n)
		if _, err := t.pool.Exec(ctx, prefillInsert, done, end, prefillKeysPerUser); err != nil {
			return fmt.Errorf("benchkit: prefilling keys %d to %d: %w", done, end, err)
		}
		done = end
		if progress != nil {
			progress(done)
		}
	}
	if n == 0 {
		return nil
	}
	if _, err := t.pool.Exec(ctx, `VACUUM (ANALYZE) idempotency_keys`); err != nil {
		return fmt.Errorf("benchkit: vacuum after prefill: %w", err)
	}
	return nil
}

// PrefilledKeys returns how many of the Target's keys belong to prefill
// users.
func (t *Target) PrefilledKeys(ctx context.Context) (int64, error) {
	if t.pool == nil {
		return 0, nil
	}
	var n int64
	err := t.pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys WHERE user_id LIKE '`+PrefillUserPrefix+`%'`).Scan(&n)
	return n, err
}

// ResetKeys deletes the keys of users (those of earlier runs: a
// Workload's users are the same names for every Workload of that many
// users), so that the next run starts from the prefilled keys alone. It
// reads the primary key's index by user, not the whole table. It returns
// how many keys it deleted. Memory and SQLite: nothing.
func (t *Target) ResetKeys(ctx context.Context, users []string) (int64, error) {
	if t.pool == nil {
		return 0, nil
	}
	for _, u := range users {
		if strings.HasPrefix(u, PrefillUserPrefix) {
			return 0, fmt.Errorf("benchkit: ResetKeys: %q is a prefill user", u)
		}
	}
	tag, err := t.pool.Exec(ctx, `DELETE FROM idempotency_keys WHERE user_id = ANY($1)`, users)
	if err != nil {
		return 0, fmt.Errorf("benchkit: deleting earlier runs' keys: %w", err)
	}
	return tag.RowsAffected(), nil
}

// TableBytes returns the size on disk of the Target's idempotency_keys
// table with its indexes (0 for Memory and SQLite).
func (t *Target) TableBytes(ctx context.Context) (int64, error) {
	if t.pool == nil {
		return 0, nil
	}
	var n int64
	err := t.pool.QueryRow(ctx, `SELECT pg_total_relation_size('idempotency_keys')`).Scan(&n)
	return n, err
}

// PrefillMemory puts n completed records into the memory store (Memory
// only), as a create through the middleware leaves them: users
// prefill-0000000, prefill-0000001, … with prefillKeysPerUser keys each,
// each record with its own key, fingerprint, owner and response body (a
// 201 with its Content-Type and about 200 bytes), and the request's one
// kept header; they expire 24 hours after the prefill, so that none
// expires during a run. Call it on a new Target, once, before measuring:
// the memory store's cost with many records, as Prefill for PostgreSQL.
func (t *Target) PrefillMemory(ctx context.Context, n int) error {
	if t.mem == nil {
		return fmt.Errorf("benchkit: store %s is not the memory store", t.Store)
	}
	reqHeader := http.Header{"Content-Type": {"application/json"}}
	respHeader := http.Header{"Content-Type": {"application/json"}}
	reqBody := []byte(`{"amount":1299,"currency":"EUR","description":"one row"}`)
	for i := range n {
		p := idemdriver.ClaimParams{
			User:        fmt.Sprintf("%s%07d", PrefillUserPrefix, i/prefillKeysPerUser),
			Key:         fmt.Sprintf("%08x-%04x-4%03x-8%03x-%012x", i, i%0x10000, i%0x1000, (i/7)%0x1000, uint64(i)*2654435761),
			Fingerprint: fmt.Sprintf("%064x", uint64(i)*0x9e3779b97f4a7c15),
			Owner:       fmt.Sprintf("%032x", uint64(i)*0xbf58476d1ce4e5b9),
			Method:      http.MethodPost, Path: Path, Header: reqHeader, Body: reqBody,
			TTL: 24 * time.Hour,
		}
		c, err := t.mem.Claim(ctx, p)
		if err != nil {
			return fmt.Errorf("benchkit: prefilling key %d: %w", i, err)
		}
		if c.Lease == nil {
			return fmt.Errorf("benchkit: prefilling key %d: not claimed", i)
		}
		tx, err := t.mem.Begin(ctx, c.Lease)
		if err != nil {
			return fmt.Errorf("benchkit: prefilling key %d: %w", i, err)
		}
		body := fmt.Appendf(nil, `{"id":"ord_%024x","object":"order","user":"%s","amount":1299,"currency":"EUR","status":"created","created":%d,"description":"one row inserted by the prefill"}`,
			uint64(i)*0x94d049bb133111eb, p.User, time.Now().Unix())
		if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusCreated, Header: respHeader, Body: body}); err != nil {
			return fmt.Errorf("benchkit: prefilling key %d: %w", i, err)
		}
	}
	return nil
}
