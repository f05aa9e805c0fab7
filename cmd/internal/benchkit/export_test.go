package benchkit

import "github.com/jackc/pgx/v5/pgxpool"

// SetPrefillBatch makes Prefill insert n rows a batch, for a test, and
// returns the function that puts the default back.
func SetPrefillBatch(n int64) (restore func()) {
	old := prefillBatch
	prefillBatch = n
	return func() { prefillBatch = old }
}

// Pool is the Target's pool (Postgres and Redis targets), for a test.
func (t *Target) Pool() *pgxpool.Pool { return t.pool }
