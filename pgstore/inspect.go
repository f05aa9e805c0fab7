package pgstore

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

var _ idemdriver.Inspector = (*Store)(nil)

// InspectKey implements idemdriver.Inspector, by the database's clock (see
// Clocks): the record and the time are read by one statement.
func (s *Store) InspectKey(ctx context.Context, user, key string, maxRedrives int) (*idemdriver.KeyInfo, error) {
	info, err := s.inspect(ctx, s.pool, user, key, maxRedrives, "")
	if err != nil {
		return nil, err
	}
	if info.State == "" {
		return nil, idem.ErrNotFound
	}
	return info, nil
}

// querier is a pool or a transaction.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// inspect reads (user, key)'s record with the database's time (or the test
// clock's) and decides its state; lock is appended to the statement.
func (s *Store) inspect(ctx context.Context, q querier, user, key string, maxRedrives int, lock string) (*idemdriver.KeyInfo, error) {
	rows, err := q.Query(ctx, s.q(`
SELECT `+recordColumns+`, coalesce($3::timestamptz, statement_timestamp())
FROM idempotency_keys
WHERE user_id = $1 AND key = $2`+lock), s.mode,
		user, key, s.at())
	if err != nil {
		return nil, interpretError(err)
	}
	info, err := pgx.CollectExactlyOneRow(rows, scanKeyInfo)
	if err != nil {
		return nil, interpretError(err)
	}
	info.State = idemdriver.StateOf(&info.Record, info.At, maxRedrives)
	return info, nil
}

// scanKeyInfo reads the recordColumns of one row and the time after them.
func scanKeyInfo(row pgx.CollectableRow) (*idemdriver.KeyInfo, error) {
	var at time.Time
	rec, err := scanRecord(withTime{CollectableRow: row, at: &at})
	if err != nil {
		return nil, err
	}
	return &idemdriver.KeyInfo{Record: *rec, At: at}, nil
}

// withTime scans a row of recordColumns followed by one timestamptz.
type withTime struct {
	pgx.CollectableRow
	at *time.Time
}

func (w withTime) Scan(dest ...any) error { return w.CollectableRow.Scan(append(dest, w.at)...) }

// listSQL are ListKeys' queries by state: $1 is the test clock's time or
// NULL (the database's clock), $2 the completers' budget, $3 the limit.
// The keys without a response are read on the partial index Abandoned
// reads (idempotency_keys_abandoned_order_idx), in its order; the
// completed ones are sorted, which reads all of them.
var listSQL = map[idemdriver.KeyState]string{
	idemdriver.KeyInFlight: `response_status IS NULL AND lease_until > c.now
ORDER BY lease_until, created_at, user_id, key`,
	idemdriver.KeyAbandoned: `response_status IS NULL AND lease_until <= c.now AND redrives < c.budget
ORDER BY lease_until, created_at, user_id, key`,
	idemdriver.KeyGivenUp: `response_status IS NULL AND lease_until <= c.now AND redrives >= c.budget
ORDER BY lease_until, created_at, user_id, key`,
	idemdriver.KeyCompleted: `response_status IS NOT NULL AND expires_at > c.now
ORDER BY completed_at DESC, user_id, key`,
}

// ListKeys implements idemdriver.Inspector, by the database's clock (see Clocks).
func (s *Store) ListKeys(ctx context.Context, p idemdriver.ListParams) ([]idemdriver.KeyInfo, error) {
	cond, ok := listSQL[p.State]
	if !ok {
		_, err := idemdriver.ParseKeyState(string(p.State))
		return nil, err
	}
	if p.Limit <= 0 {
		return nil, nil
	}
	rows, err := s.pool.Query(ctx, s.q(`
SELECT `+recordColumns+`, c.now
FROM idempotency_keys, (SELECT coalesce($1::timestamptz, statement_timestamp()) AS now, $2::integer AS budget) c
WHERE `+cond+`
LIMIT $3`), s.mode,
		s.at(), min(idemdriver.Budget(p.MaxRedrives), math.MaxInt32), p.Limit)
	if err != nil {
		return nil, interpretError(err)
	}
	infos, err := pgx.CollectRows(rows, scanKeyInfo)
	if err != nil {
		return nil, interpretError(err)
	}
	out := make([]idemdriver.KeyInfo, len(infos))
	for i, info := range infos {
		info.State = p.State
		out[i] = *info
	}
	return out, nil
}

// Redrive implements idemdriver.Inspector: in one transaction it reads the
// record FOR NO KEY UPDATE with the database's time and resets its
// re-drives, so no claim changes the row in between (every claim, Fail,
// Release, completion and sweep updates or deletes the row, which takes a
// lock that conflicts with it); a completer's takeover decided on the old
// count matches no row afterwards (it is conditional on the re-drives it
// read) and decides again. FOR NO KEY UPDATE, not FOR UPDATE: Redrive
// changes no key column, and it must not wait behind the FOR KEY SHARE
// lock a running handler holds once it writes a row with a foreign key to
// the key's, so a Redrive of a key in flight is refused at once.
func (s *Store) Redrive(ctx context.Context, user, key string, maxRedrives int) (int, error) {
	tx, err := s.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return 0, interpretError(err)
	}
	defer tx.Rollback(ctx)
	info, err := s.inspect(ctx, tx, user, key, maxRedrives, " FOR NO KEY UPDATE")
	if err != nil {
		return 0, err
	}
	if err := idemdriver.CheckRedrive(info.State); err != nil {
		return 0, err
	}
	tag, err := tx.Exec(ctx, s.q(`
UPDATE idempotency_keys SET redrives = 0
WHERE user_id = $1 AND key = $2 AND owner = $3 AND response_status IS NULL AND redrives = $4`), s.mode,
		user, key, info.Owner, info.Redrives)
	if err != nil {
		return 0, interpretError(err)
	}
	if tag.RowsAffected() != 1 {
		return 0, errors.New("pgstore: redrive: the locked record changed")
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("pgstore: redrive: %w", err)
	}
	return info.Redrives, nil
}

var _ idemdriver.Purger = (*Store)(nil)

// Purge implements idemdriver.Purger, by the database's clock (see Clocks): in
// one transaction it reads the record FOR UPDATE with the database's time,
// checks it, and deletes it with a DELETE conditioned on everything
// checked, so no claim, completion or re-drive changes the row in between
// (each of them updates or deletes the row, which waits for the lock).
// The time is the SELECT's statement time, taken before any wait for the
// lock: an earlier time only makes a lease look live longer.
func (s *Store) Purge(ctx context.Context, user, key string, seen idemdriver.Seen) (*idemdriver.Record, error) {
	tx, err := s.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.ReadCommitted})
	if err != nil {
		return nil, interpretError(err)
	}
	defer tx.Rollback(ctx)
	info, err := s.inspect(ctx, tx, user, key, 0, " FOR UPDATE")
	if err != nil {
		return nil, err
	}
	if err := idemdriver.CheckPurge(&info.Record, info.At, seen); err != nil {
		return nil, err
	}
	tag, err := tx.Exec(ctx, s.q(`
DELETE FROM idempotency_keys
WHERE user_id = $1 AND key = $2 AND owner = $3 AND attempts = $4 AND created_at = $5
	AND response_status IS NULL AND lease_until <= $6`), s.mode,
		user, key, seen.Owner, seen.Attempts, seen.CreatedAt, info.At)
	if err != nil {
		return nil, interpretError(err)
	}
	if tag.RowsAffected() != 1 {
		return nil, errors.New("pgstore: purge: the locked record changed")
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("pgstore: purge: %w", err)
	}
	return &info.Record, nil
}
