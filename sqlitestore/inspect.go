package sqlitestore

import (
	"context"
	"database/sql"
	"errors"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

var _ idemdriver.Inspector = (*Store)(nil)

// InspectKey implements idemdriver.Inspector, by the store's clock (Options.Now).
func (s *Store) InspectKey(ctx context.Context, user, key string, maxRedrives int) (*idemdriver.KeyInfo, error) {
	now := s.now()
	rec, err := scanRecord(s.db.QueryRowContext(ctx, selectRecord+` WHERE user_id = ? AND key = ?`, user, key))
	if err != nil {
		return nil, interpretError("inspect", err)
	}
	st := idemdriver.StateOf(rec, now, maxRedrives)
	if st == "" {
		return nil, idem.ErrNotFound
	}
	return &idemdriver.KeyInfo{Record: *rec, State: st, At: now}, nil
}

// listSQL are ListKeys' queries by state: :now is the store's time,
// :budget the completers' budget. The keys without a response are read
// on the index Abandoned reads (idempotency_keys_abandoned), in its order;
// the completed ones are sorted, which reads all of them.
var listSQL = map[idemdriver.KeyState]string{
	idemdriver.KeyInFlight: selectRecord + `
		WHERE response_status IS NULL AND lease_until > :now
		ORDER BY lease_until, created_at, user_id, key LIMIT :limit`,
	idemdriver.KeyAbandoned: selectRecord + `
		WHERE response_status IS NULL AND lease_until <= :now AND redrives < :budget
		ORDER BY lease_until, created_at, user_id, key LIMIT :limit`,
	idemdriver.KeyGivenUp: selectRecord + `
		WHERE response_status IS NULL AND lease_until <= :now AND redrives >= :budget
		ORDER BY lease_until, created_at, user_id, key LIMIT :limit`,
	idemdriver.KeyCompleted: selectRecord + `
		WHERE response_status IS NOT NULL AND expires_at > :now
		ORDER BY completed_at DESC, user_id, key LIMIT :limit`,
}

// ListKeys implements idemdriver.Inspector, by the store's clock (Options.Now).
func (s *Store) ListKeys(ctx context.Context, p idemdriver.ListParams) ([]idemdriver.KeyInfo, error) {
	q, ok := listSQL[p.State]
	if !ok {
		_, err := idemdriver.ParseKeyState(string(p.State))
		return nil, err
	}
	if p.Limit <= 0 {
		return nil, nil
	}
	now := s.now()
	rows, err := s.db.QueryContext(ctx, q,
		sql.Named("now", toNanos(now)),
		sql.Named("budget", int64(idemdriver.Budget(p.MaxRedrives))),
		sql.Named("limit", int64(p.Limit)))
	if err != nil {
		return nil, interpretError("list keys", err)
	}
	defer rows.Close()
	var out []idemdriver.KeyInfo
	for rows.Next() {
		rec, err := scanRecord(rows)
		if err != nil {
			return nil, interpretError("list keys", err)
		}
		out = append(out, idemdriver.KeyInfo{Record: *rec, State: p.State, At: now})
	}
	if err := rows.Err(); err != nil {
		return nil, interpretError("list keys", err)
	}
	return out, nil
}

// Redrive implements idemdriver.Inspector: it reads the record and resets its
// re-drives in one write transaction (BEGIN IMMEDIATE, and the process's
// write lock), so no claim changes the record in between.
func (s *Store) Redrive(ctx context.Context, user, key string, maxRedrives int) (int, error) {
	unlock, err := s.lockWrites(ctx)
	if err != nil {
		return 0, err
	}
	defer unlock()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return 0, interpretError("redrive", err)
	}
	defer tx.Rollback()
	rec, err := scanRecord(tx.QueryRowContext(ctx, selectRecord+` WHERE user_id = ? AND key = ?`, user, key))
	if err != nil {
		return 0, interpretError("redrive", err)
	}
	if err := idemdriver.CheckRedrive(idemdriver.StateOf(rec, s.now(), maxRedrives)); err != nil {
		return 0, err
	}
	res, err := tx.ExecContext(ctx, `
		UPDATE idempotency_keys SET redrives = 0
		WHERE user_id = ? AND key = ? AND owner = ? AND response_status IS NULL AND redrives = ?`,
		user, key, rec.Owner, rec.Redrives)
	if err != nil {
		return 0, interpretError("redrive", err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return 0, interpretError("redrive", err)
	} else if n != 1 {
		return 0, errors.New("sqlitestore: redrive: record changed under the write lock")
	}
	if err := tx.Commit(); err != nil {
		return 0, interpretError("redrive", err)
	}
	return rec.Redrives, nil
}

var _ idemdriver.Purger = (*Store)(nil)

// Purge implements idemdriver.Purger, by the store's clock (Options.Now): it
// reads the record and deletes it in one write transaction (BEGIN
// IMMEDIATE, and the process's write lock), so no claim or completion
// changes it in between; the DELETE is conditioned on everything checked
// as well.
func (s *Store) Purge(ctx context.Context, user, key string, seen idemdriver.Seen) (*idemdriver.Record, error) {
	unlock, err := s.lockWrites(ctx)
	if err != nil {
		return nil, err
	}
	defer unlock()
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, interpretError("purge", err)
	}
	defer tx.Rollback()
	rec, err := scanRecord(tx.QueryRowContext(ctx, selectRecord+` WHERE user_id = ? AND key = ?`, user, key))
	if err != nil {
		return nil, interpretError("purge", err)
	}
	now := s.now()
	if err := idemdriver.CheckPurge(rec, now, seen); err != nil {
		return nil, err
	}
	res, err := tx.ExecContext(ctx, `
		DELETE FROM idempotency_keys
		WHERE user_id = ? AND key = ? AND owner = ? AND attempts = ? AND created_at = ?
			AND response_status IS NULL AND lease_until <= ?`,
		user, key, seen.Owner, seen.Attempts, toNanos(seen.CreatedAt), toNanos(now))
	if err != nil {
		return nil, interpretError("purge", err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return nil, interpretError("purge", err)
	} else if n != 1 {
		return nil, errors.New("sqlitestore: purge: record changed under the write lock")
	}
	if err := tx.Commit(); err != nil {
		return nil, interpretError("purge", err)
	}
	return rec, nil
}
