package sqlitestore_test

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/fstest"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/sqlitestore"
	"github.com/idem-go/idem/storetest"
)

const createEffects = `CREATE TABLE storetest_effects (name TEXT NOT NULL)`

// TestConformance runs the suite every idem.Store passes, each store on a
// file of its own.
func TestConformance(t *testing.T) {
	storetest.Run(t, storetest.Harness{
		New: func(t *testing.T) idem.Store {
			s, _ := setup(t, sqlitestore.Options{})
			return s
		},
		NewAt: func(t *testing.T, now func() time.Time) idem.Store {
			s, _ := setup(t, sqlitestore.Options{Now: now})
			return s
		},
		Write: func(ctx context.Context, tx idem.Tx, name string) error {
			_, err := idemdriver.UnwrapTx(tx).(*sqlitestore.Tx).SQL().ExecContext(ctx, `INSERT INTO storetest_effects (name) VALUES (?)`, name)
			return err
		},
		HandlerCommit: func(ctx context.Context) error {
			tx, err := sqlitestore.FromContext(ctx)
			if err != nil {
				return err
			}
			return tx.Commit()
		},
		HandlerRollback: func(ctx context.Context) error {
			tx, err := sqlitestore.FromContext(ctx)
			if err != nil {
				return err
			}
			return tx.Rollback()
		},
		Count: func(ctx context.Context, s idem.Store, name string) (int, error) {
			return countEffects(ctx, s.(*sqlitestore.Store), name)
		},
	})
}

type testBundle struct {
	path string // the database file
}

// setup opens a store with opts on a fresh file, with the effects table.
func setup(t *testing.T, opts sqlitestore.Options) (*sqlitestore.Store, *testBundle) {
	t.Helper()
	b := &testBundle{path: filepath.Join(t.TempDir(), "idem.db")}
	s, err := sqlitestore.Open(context.Background(), b.path, opts)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	if _, err := s.DB().Exec(createEffects); err != nil {
		t.Fatalf("creating storetest_effects: %v", err)
	}
	return s, b
}

func countEffects(ctx context.Context, s *sqlitestore.Store, name string) (int, error) {
	var n int
	err := s.DB().QueryRowContext(ctx, `SELECT count(*) FROM storetest_effects WHERE name = ?`, name).Scan(&n)
	return n, err
}

func mustCount(t *testing.T, s *sqlitestore.Store, name string) int {
	t.Helper()
	n, err := countEffects(context.Background(), s, name)
	if err != nil {
		t.Fatalf("counting %q: %v", name, err)
	}
	return n
}

// params describes a request for (user, key); the store fills in the
// default lease and TTL.
func params(user, key, fp string) idemdriver.ClaimParams {
	return idemdriver.ClaimParams{User: user, Key: key, Fingerprint: fp, Method: http.MethodPost, Path: "/v1/orders"}
}

// lease claims p, which must be free.
func lease(t *testing.T, s idem.Store, p idemdriver.ClaimParams) *idemdriver.Lease {
	t.Helper()
	c, err := s.Claim(context.Background(), p)
	if err != nil || c.Lease == nil {
		t.Fatalf("Claim(%s/%s) = %+v, %v; want a lease", p.User, p.Key, c, err)
	}
	return c.Lease
}

// TestMiddleware runs the store behind idem.Middleware, the handler writing
// through FromContext.
func TestMiddleware(t *testing.T) {
	s, _ := setup(t, sqlitestore.Options{})
	var runs atomic.Int64
	h := idem.Middleware(s, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		tx, err := sqlitestore.FromContext(r.Context())
		if err != nil {
			t.Errorf("FromContext: %v", err)
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if _, err := tx.ExecContext(r.Context(), `INSERT INTO storetest_effects (name) VALUES ('order')`); err != nil {
			t.Errorf("insert: %v", err)
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/v1/orders/1")
		w.WriteHeader(http.StatusCreated)
		w.Write([]byte(`{"id":"1"}`))
	}))
	send := func() *httptest.ResponseRecorder {
		r := httptest.NewRequest(http.MethodPost, "/v1/orders", strings.NewReader(`{"a": 1}`))
		r.Header.Set("Idempotency-Key", "abc")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
	first, second := send(), send()
	if first.Code != http.StatusCreated || second.Code != http.StatusCreated {
		t.Fatalf("statuses = %d, %d; want 201, 201", first.Code, second.Code)
	}
	if got := second.Header().Get("Idempotent-Replayed"); got != "true" {
		t.Errorf("replay Idempotent-Replayed = %q, want true", got)
	}
	if got, want := second.Body.String(), first.Body.String(); got != want {
		t.Errorf("replayed body = %q, want %q", got, want)
	}
	if got := second.Header().Get("Location"); got != "/v1/orders/1" {
		t.Errorf("replayed Location = %q, want /v1/orders/1", got)
	}
	if got := runs.Load(); got != 1 {
		t.Errorf("handler runs = %d, want 1", got)
	}
	if got := mustCount(t, s, "order"); got != 1 {
		t.Errorf("orders = %d, want 1", got)
	}
	if _, err := sqlitestore.FromContext(context.Background()); !errors.Is(err, idem.ErrNoTx) {
		t.Errorf("FromContext outside a request: got %v, want ErrNoTx", err)
	}
}

func TestOpenPragmas(t *testing.T) {
	s, b := setup(t, sqlitestore.Options{})
	ctx := context.Background()
	// Check several pooled connections at once, so that more than one is open.
	conns := make([]*sql.Conn, 3)
	for i := range conns {
		c, err := s.DB().Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		conns[i] = c
	}
	for i, c := range conns {
		var mode string
		var fk, busy, sync int
		if err := c.QueryRowContext(ctx, `PRAGMA journal_mode`).Scan(&mode); err != nil {
			t.Fatal(err)
		}
		if err := c.QueryRowContext(ctx, `PRAGMA foreign_keys`).Scan(&fk); err != nil {
			t.Fatal(err)
		}
		if err := c.QueryRowContext(ctx, `PRAGMA busy_timeout`).Scan(&busy); err != nil {
			t.Fatal(err)
		}
		if err := c.QueryRowContext(ctx, `PRAGMA synchronous`).Scan(&sync); err != nil {
			t.Fatal(err)
		}
		if mode != "wal" || fk != 1 || busy != 10000 || sync != 2 {
			t.Errorf("conn %d: journal_mode %q foreign_keys %d busy_timeout %d synchronous %d; want wal 1 10000 2",
				i, mode, fk, busy, sync)
		}
	}

	// Begin takes the write lock at once (BEGIN IMMEDIATE): another
	// connection that will not wait cannot start a write transaction.
	tx, err := s.Begin(ctx, &idemdriver.Lease{})
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	other, err := sql.Open("sqlite", b.path+"?_pragma=busy_timeout(0)")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if _, err := other.ExecContext(ctx, `BEGIN IMMEDIATE`); err == nil || !strings.Contains(err.Error(), "SQLITE_BUSY") {
		t.Errorf("BEGIN IMMEDIATE beside an open Tx: got %v, want SQLITE_BUSY", err)
		_, _ = other.ExecContext(ctx, `ROLLBACK`) // undo the BEGIN that should have failed
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
}

func TestOpenRefusesMemory(t *testing.T) {
	for _, path := range []string{"", ":memory:", "file:x?mode=memory"} {
		if s, err := sqlitestore.Open(context.Background(), path, sqlitestore.Options{}); err == nil {
			s.Close()
			t.Errorf("Open(%q): got nil error, want one", path)
		}
	}
}

func TestReopen(t *testing.T) {
	s, b := setup(t, sqlitestore.Options{})
	ctx := context.Background()
	tx, err := s.Begin(ctx, lease(t, s, params("u1", "k1", "fp1")))
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusCreated, Body: []byte("kept")}); err != nil {
		t.Fatal(err)
	}
	s2, err := sqlitestore.Open(ctx, b.path, sqlitestore.Options{})
	if err != nil {
		t.Fatalf("second Open: %v", err)
	}
	defer s2.Close()
	c, err := s2.Claim(ctx, params("u1", "k1", "fp1"))
	if err != nil || c.Response == nil || c.Response.Status != http.StatusCreated || string(c.Response.Body) != "kept" {
		t.Fatalf("Claim through the second store = %+v, %v; want the kept 201", c, err)
	}
}

func TestApplyMigrations(t *testing.T) {
	s, b := setup(t, sqlitestore.Options{})
	ctx := context.Background()
	fsys := fstest.MapFS{
		"0002_add_total.sql":  {Data: []byte(`ALTER TABLE orders ADD COLUMN total INTEGER NOT NULL DEFAULT 0;`)},
		"0001_orders.sql":     {Data: []byte("CREATE TABLE orders (id TEXT PRIMARY KEY);\nCREATE INDEX orders_id ON orders (id);")},
		"0010_seed.sql":       {Data: []byte(`INSERT INTO orders (id, total) VALUES ('seed', 1);`)},
		"README.md":           {Data: []byte("not a migration")},
		"notes/0003_skip.sql": {Data: []byte("this is not SQL")},
	}
	// Several handles on the file migrate at once, as instances starting
	// together would; each migration runs once.
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			db, err := sql.Open("sqlite", b.path+"?_pragma=busy_timeout(10000)")
			if err != nil {
				t.Error(err)
				return
			}
			defer db.Close()
			if err := sqlitestore.ApplyMigrations(ctx, db, "orders", fsys); err != nil {
				t.Errorf("ApplyMigrations: %v", err)
			}
		}()
	}
	wg.Wait()
	if err := sqlitestore.ApplyMigrations(ctx, s.DB(), "orders", fsys); err != nil {
		t.Fatalf("ApplyMigrations again: %v", err)
	}
	var seeds int
	if err := s.DB().QueryRowContext(ctx, `SELECT count(*) FROM orders WHERE total = 1`).Scan(&seeds); err != nil {
		t.Fatal(err)
	}
	if seeds != 1 {
		t.Errorf("seed rows = %d, want 1", seeds)
	}
	var versions string
	err := s.DB().QueryRowContext(ctx,
		`SELECT group_concat(component || ':' || version, ' ') FROM (SELECT * FROM schema_migrations ORDER BY component, version)`).Scan(&versions)
	if err != nil {
		t.Fatal(err)
	}
	if want := "idem:1 idem:2 idem:3 idem:4 idem:5 orders:1 orders:2 orders:10"; versions != want {
		t.Errorf("schema_migrations = %q, want %q", versions, want)
	}

	dup := fstest.MapFS{"0001_a.sql": {Data: []byte("SELECT 1")}, "01_b.sql": {Data: []byte("SELECT 1")}}
	if err := sqlitestore.ApplyMigrations(ctx, s.DB(), "dup", dup); err == nil {
		t.Errorf("duplicate versions: got nil error, want one")
	}
	bad := fstest.MapFS{"0001_bad.sql": {Data: []byte("CREATE TABLE good (x); THIS IS NOT SQL;")}}
	if err := sqlitestore.ApplyMigrations(ctx, s.DB(), "bad", bad); err == nil {
		t.Errorf("bad SQL: got nil error, want one")
	}
	var n int
	if err := s.DB().QueryRowContext(ctx, `SELECT count(*) FROM schema_migrations WHERE component = 'bad'`).Scan(&n); err != nil || n != 0 {
		t.Errorf("failed migration recorded: %d rows, %v; want 0", n, err)
	}
	if err := s.DB().QueryRowContext(ctx, `SELECT count(*) FROM sqlite_schema WHERE name = 'good'`).Scan(&n); err != nil || n != 0 {
		t.Errorf("failed migration left its table: %d, %v; want 0", n, err)
	}
}

// TestTwoStoresOneFile has two stores on one file, as two processes would
// be, race for one key: SQLite's lock, taken by BEGIN IMMEDIATE, decides.
func TestTwoStoresOneFile(t *testing.T) {
	s1, b := setup(t, sqlitestore.Options{})
	s2, err := sqlitestore.Open(context.Background(), b.path, sqlitestore.Options{})
	if err != nil {
		t.Fatalf("second Open: %v", err)
	}
	defer s2.Close()
	p := params("u1", "race", "fp1")
	const n = 40
	var leases, inflight atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		s := s1
		if i%2 == 1 {
			s = s2
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			c, err := s.Claim(context.Background(), p)
			switch {
			case err == nil && c.Lease != nil:
				leases.Add(1)
			case errors.Is(err, idem.ErrInFlight):
				inflight.Add(1)
			default:
				t.Errorf("Claim: %+v, %v", c, err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if got, want := leases.Load(), int64(1); got != want {
		t.Errorf("leases = %d, want %d", got, want)
	}
	if got, want := inflight.Load(), int64(n-1); got != want {
		t.Errorf("in flight = %d, want %d", got, want)
	}
}

// TestWriteLockWait checks that writers wait for an open Tx, up to the busy
// timeout or their context, and go on once it ends.
func TestWriteLockWait(t *testing.T) {
	s, _ := setup(t, sqlitestore.Options{BusyTimeout: 100 * time.Millisecond})
	ctx := context.Background()
	l := lease(t, s, params("u1", "k1", "fp1"))
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	if _, err := s.Claim(ctx, params("u1", "k2", "fp1")); !errors.Is(err, sqlitestore.ErrBusy) {
		t.Errorf("Claim beside an open Tx: got %v, want ErrBusy", err)
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
	defer cancel()
	if err := s.Fail(cctx, l); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Fail with a short context: got %v, want DeadlineExceeded", err)
	}
	// Reads do not wait.
	if _, err := s.Get(ctx, "u1", "k1"); err != nil {
		t.Errorf("Get beside an open Tx: %v", err)
	}
	done := claimWaiting(t, s, params("u1", "k3", "fp1"), "an open Tx")
	if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusOK}); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if err := <-done; err != nil {
		t.Errorf("Claim waiting for the Tx: %v", err)
	}
}

// clocked opens a store whose clock moves only when told.
func clocked(t *testing.T) (*sqlitestore.Store, *storetest.Clock) {
	t.Helper()
	clk := storetest.NewClock(time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC))
	s, _ := setup(t, sqlitestore.Options{Now: clk.Now})
	return s, clk
}

// sameLease reports whether two leases are the same hold on a key.
func sameLease(a, b *idemdriver.Lease) bool {
	return a != nil && b != nil && a.User == b.User && a.Key == b.Key && a.Owner == b.Owner &&
		a.Until.Equal(b.Until) && a.Attempt == b.Attempt && a.CreatedAt.Equal(b.CreatedAt)
}

// TestClaimResentWithOwner: a Claim sent again with its Owner (its first
// answer lost) gets the lease that owner holds, exactly as stored and
// without counting an attempt, never 409; on a new key and on a takeover.
func TestClaimResentWithOwner(t *testing.T) {
	ctx := context.Background()
	s, clk := clocked(t)

	// A new key.
	p := params("u1", "resend-new", "fp1")
	p.Owner = idemdriver.NewOwner()
	first := lease(t, s, p)
	if first.Owner != p.Owner || first.Attempt != 1 {
		t.Fatalf("first claim = %+v, want attempt 1 held by %s", first, p.Owner)
	}
	clk.Advance(time.Second)
	for i := range 3 {
		c, err := s.Claim(ctx, p)
		if err != nil || !sameLease(c.Lease, first) {
			t.Fatalf("resend %d = %+v, %v; want the first lease %+v", i, c.Lease, err, first)
		}
	}
	other := p
	other.Owner = idemdriver.NewOwner()
	if _, err := s.Claim(ctx, other); !errors.Is(err, idem.ErrInFlight) {
		t.Errorf("another owner's claim: got %v, want ErrInFlight", err)
	}
	if rec, err := s.Get(ctx, p.User, p.Key); err != nil || rec.Attempts != 1 || rec.Owner != p.Owner {
		t.Errorf("record after resends = %+v, %v; want attempts 1 held by %s", rec, err, p.Owner)
	}
	// The lease returned to the resend commits.
	tx, err := s.Begin(ctx, first)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusCreated, Body: []byte("one")}); err != nil {
		t.Fatalf("Complete with the resent lease: %v", err)
	}
	if c, err := s.Claim(ctx, p); err != nil || c.Response == nil || string(c.Response.Body) != "one" {
		t.Errorf("claim after completion = %+v, %v; want the replay", c, err)
	}

	// A takeover.
	q := params("u1", "resend-takeover", "fp1")
	q.Lease = time.Second
	crashed := lease(t, s, q)
	clk.Advance(2 * time.Second)
	q.Owner = idemdriver.NewOwner()
	taken := lease(t, s, q)
	if taken.Owner != q.Owner || taken.Attempt != 2 || !taken.CreatedAt.Equal(crashed.CreatedAt) {
		t.Fatalf("takeover = %+v, want attempt 2 held by %s, created %v", taken, q.Owner, crashed.CreatedAt)
	}
	clk.Advance(time.Millisecond)
	for i := range 3 {
		c, err := s.Claim(ctx, q)
		if err != nil || !sameLease(c.Lease, taken) {
			t.Fatalf("takeover resend %d = %+v, %v; want the takeover's lease %+v", i, c.Lease, err, taken)
		}
	}
	if rec, err := s.Get(ctx, q.User, q.Key); err != nil || rec.Attempts != 2 || rec.Owner != q.Owner {
		t.Errorf("record after takeover resends = %+v, %v; want attempts 2 held by %s", rec, err, q.Owner)
	}
	if err := s.Fail(ctx, crashed); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("the crashed attempt's Fail: got %v, want ErrFenced", err)
	}
}

// TestClaimResentAcrossProcesses: claims sent at once with one Owner, by
// two stores on one file as two processes would, all get the one lease.
func TestClaimResentAcrossProcesses(t *testing.T) {
	s1, b := setup(t, sqlitestore.Options{})
	s2, err := sqlitestore.Open(context.Background(), b.path, sqlitestore.Options{})
	if err != nil {
		t.Fatalf("second Open: %v", err)
	}
	defer s2.Close()
	p := params("u1", "resend-race", "fp1")
	p.Owner = idemdriver.NewOwner()
	const n = 20
	leases := make([]*idemdriver.Lease, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		s := s1
		if i%2 == 1 {
			s = s2
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			c, err := s.Claim(context.Background(), p)
			if err != nil || c.Lease == nil {
				t.Errorf("Claim %d = %+v, %v; want the owner's lease", i, c, err)
				return
			}
			leases[i] = c.Lease
		}()
	}
	close(start)
	wg.Wait()
	for i, l := range leases {
		if l != nil && !sameLease(l, leases[0]) {
			t.Errorf("lease %d = %+v, want %+v", i, l, leases[0])
		}
	}
	if rec, err := s1.Get(context.Background(), p.User, p.Key); err != nil || rec.Attempts != 1 {
		t.Errorf("record = %+v, %v; want one attempt", rec, err)
	}
}

// TestExpiryKeepsUnanswered: a record past its expiry without a response
// is not replaced or deleted: a claim answers in flight while its lease
// lasts, the completer sees it once the lease ran out, a takeover keeps the
// operation, and a late completion keeps the key a TTL from then, so the
// next claim replays it.
func TestExpiryKeepsUnanswered(t *testing.T) {
	ctx := context.Background()
	s, clk := clocked(t)
	p := params("u1", "expired-unanswered", "fp1")
	p.TTL, p.Lease = time.Second, time.Minute
	first := lease(t, s, p)
	clk.Advance(2 * time.Second) // expired, its lease live

	_, err := s.Claim(ctx, p)
	var ife *idem.InFlightError
	if !errors.As(err, &ife) || !ife.LeaseUntil.Equal(first.Until) {
		t.Fatalf("claim after expiry with a live lease: got %v, want *InFlightError until %v", err, first.Until)
	}
	if _, err := s.Claim(ctx, params("u1", "expired-unanswered", "fp2")); !errors.Is(err, idem.ErrFingerprintMismatch) {
		t.Errorf("another body after expiry: got %v, want ErrFingerprintMismatch", err)
	}
	if rec, err := s.Get(ctx, p.User, p.Key); err != nil || rec.Owner != first.Owner {
		t.Errorf("Get after expiry = %+v, %v; want the record held by the first attempt", rec, err)
	}
	if n, err := s.DeleteExpired(ctx, 10); err != nil || n != 0 {
		t.Errorf("DeleteExpired with a live lease = %d, %v; want 0", n, err)
	}
	if recs, err := s.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10}); err != nil || len(recs) != 0 {
		t.Errorf("Abandoned with a live lease = %d records, %v; want none", len(recs), err)
	}

	clk.Advance(time.Minute) // the lease ran out: abandoned, not deleted
	if n, err := s.DeleteExpired(ctx, 10); err != nil || n != 0 {
		t.Errorf("DeleteExpired after the lease ran out = %d, %v; want 0", n, err)
	}
	recs, err := s.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10})
	if err != nil || len(recs) != 1 || recs[0].Key != p.Key || !recs[0].CreatedAt.Equal(first.CreatedAt) {
		t.Fatalf("Abandoned after the lease ran out = %+v, %v; want %s", recs, err, p.Key)
	}

	p.Owner = idemdriver.NewOwner()
	c, err := s.Claim(ctx, p)
	if err != nil || c.Lease == nil {
		t.Fatalf("takeover = %+v, %v; want a lease", c, err)
	}
	taken := c.Lease
	if taken.Attempt != 2 || !taken.CreatedAt.Equal(first.CreatedAt) || c.ExpiresIn != 0 {
		t.Errorf("takeover = %+v, ExpiresIn %v; want attempt 2, created %v, ExpiresIn 0", taken, c.ExpiresIn, first.CreatedAt)
	}
	if rec, err := s.Get(ctx, p.User, p.Key); err != nil || !rec.ExpiresAt.Equal(first.CreatedAt.Add(p.TTL)) {
		t.Errorf("record after takeover = %+v, %v; want its expiry unchanged, %v", rec, err, first.CreatedAt.Add(p.TTL))
	}

	// The first attempt is fenced; the takeover completes late.
	tx, err := s.Begin(ctx, first)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusCreated, Body: []byte("stale")}); !errors.Is(err, idem.ErrFenced) {
		t.Errorf("the first attempt's Complete: got %v, want ErrFenced", err)
	}
	clk.Advance(time.Second)
	completed := clk.Now()
	tx, err = s.Begin(ctx, taken)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusCreated, Body: []byte("late")}); err != nil {
		t.Fatalf("late Complete: %v", err)
	}
	rec, err := s.Get(ctx, p.User, p.Key)
	if err != nil || !rec.CompletedAt.Equal(completed) || !rec.ExpiresAt.Equal(completed.Add(p.TTL)) {
		t.Fatalf("record after the late completion = %+v, %v; want completed %v, expiring %v", rec, err, completed, completed.Add(p.TTL))
	}
	clk.Advance(p.TTL - time.Nanosecond)
	c, err = s.Claim(ctx, params("u1", "expired-unanswered", "fp1"))
	if err != nil || c.Response == nil || string(c.Response.Body) != "late" || c.ExpiresIn != time.Nanosecond {
		t.Fatalf("claim after the late completion = %+v, %v; want the replay of late, ExpiresIn 1ns", c, err)
	}
	if n, err := s.DeleteExpired(ctx, 10); err != nil || n != 0 {
		t.Errorf("DeleteExpired before the extended expiry = %d, %v; want 0", n, err)
	}

	// Completed and expired at last: deleted, and the key is new again.
	clk.Advance(time.Nanosecond)
	if _, err := s.Get(ctx, p.User, p.Key); !errors.Is(err, idem.ErrNotFound) {
		t.Errorf("Get after the extended expiry: got %v, want ErrNotFound", err)
	}
	if n, err := s.DeleteExpired(ctx, 10); err != nil || n != 1 {
		t.Errorf("DeleteExpired after the extended expiry = %d, %v; want 1", n, err)
	}
}

// TestCompletedExpiredIsReplaced: a completed key whose expiry passed is a
// new operation, even when the claim's Owner is the one that completed it.
func TestCompletedExpiredIsReplaced(t *testing.T) {
	ctx := context.Background()
	s, clk := clocked(t)
	p := params("u1", "completed-expired", "fp1")
	p.TTL, p.Owner = time.Second, idemdriver.NewOwner()
	l := lease(t, s, p)
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusCreated}); err != nil {
		t.Fatal(err)
	}
	clk.Advance(p.TTL)
	c, err := s.Claim(ctx, p)
	if err != nil || c.Lease == nil || c.Lease.Attempt != 1 || !c.Lease.CreatedAt.Equal(clk.Now()) || c.ExpiresIn != p.TTL {
		t.Fatalf("claim after expiry = %+v, %v; want a new operation's lease created %v, ExpiresIn %v", c, err, clk.Now(), p.TTL)
	}
}

// TestClaimExpiresIn: every Claim answer says how long the record has left
// by the store's clock.
func TestClaimExpiresIn(t *testing.T) {
	ctx := context.Background()
	s, clk := clocked(t)
	p := params("u1", "expires-in", "fp1")
	p.TTL, p.Lease = time.Hour, time.Second
	c, err := s.Claim(ctx, p)
	if err != nil || c.Lease == nil || c.ExpiresIn != time.Hour {
		t.Fatalf("new key = %+v, %v; want a lease, ExpiresIn 1h", c, err)
	}
	clk.Advance(10 * time.Second)
	c, err = s.Claim(ctx, p)
	if err != nil || c.Lease == nil || c.ExpiresIn != time.Hour-10*time.Second {
		t.Fatalf("takeover = %+v, %v; want a lease, ExpiresIn %v", c, err, time.Hour-10*time.Second)
	}
	tx, err := s.Begin(ctx, c.Lease)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusOK}); err != nil {
		t.Fatal(err)
	}
	clk.Advance(20 * time.Minute)
	c, err = s.Claim(ctx, p)
	if err != nil || c.Response == nil || c.ExpiresIn != 40*time.Minute-10*time.Second {
		t.Fatalf("replay = %+v, %v; want a response, ExpiresIn %v", c, err, 40*time.Minute-10*time.Second)
	}
}

// TestRedrives: a completer's takeover (Redrive) counts in Redrives as well
// as in Attempts; a client's takeover and a resend with the same Owner do
// not. A completer's claim never inserts or replaces: not on a new key, not
// on an answered one, not on one completed and expired; a client's claim
// replacing an expired key starts at 0 again.
func TestRedrives(t *testing.T) {
	ctx := context.Background()
	s, clk := clocked(t)
	check := func(what string, attempts, redrives int) {
		t.Helper()
		rec, err := s.Get(ctx, "u1", "redriven")
		if err != nil || rec.Attempts != attempts || rec.Redrives != redrives {
			t.Fatalf("%s: record = %+v, %v; want %d attempts, %d redrives", what, rec, err, attempts, redrives)
		}
	}
	var created time.Time // the operation the completers listed
	try := func(redrive bool, owner string) (idemdriver.Claim, error) {
		p := params("u1", "redriven", "fp1")
		p.Lease, p.TTL, p.Owner = time.Second, time.Hour, owner
		if redrive {
			p.Redrive = &idemdriver.RedriveParams{CreatedAt: created, Due: idemdriver.AbandonedParams{}}
		}
		return s.Claim(ctx, p)
	}
	claim := func(what string, redrive bool, owner string) *idemdriver.Lease {
		t.Helper()
		c, err := try(redrive, owner)
		if err != nil || c.Lease == nil {
			t.Fatalf("%s: Claim = %+v, %v; want a lease", what, c, err)
		}
		return c.Lease
	}
	notDue := func(what string) {
		t.Helper()
		if c, err := try(true, ""); !errors.Is(err, idem.ErrNotDue) {
			t.Fatalf("%s: Claim = %+v, %v; want ErrNotDue", what, c, err)
		}
	}

	notDue("new key by a completer")
	if rec, err := s.Get(ctx, "u1", "redriven"); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("after a completer's claim of a new key: Get = %+v, %v; want ErrNotFound", rec, err)
	}
	created = claim("new key by a client", false, "").CreatedAt
	check("new key by a client", 1, 0)
	var inflight *idem.InFlightError
	if c, err := try(true, ""); !errors.As(err, &inflight) {
		t.Fatalf("completer's claim of a live lease = %+v, %v; want *InFlightError", c, err)
	}
	clk.Advance(time.Second)
	owner := idemdriver.NewOwner()
	first := claim("completer's takeover", true, owner)
	check("completer's takeover", 2, 1)
	if again := claim("completer's takeover resent", true, owner); !sameLease(first, again) {
		t.Errorf("resent takeover = %+v, want %+v", again, first)
	}
	check("completer's takeover resent", 2, 1)
	clk.Advance(time.Second)
	claim("client's takeover", false, "")
	check("client's takeover", 3, 1)
	clk.Advance(time.Second)
	l := claim("second completer's takeover", true, "")
	check("second completer's takeover", 4, 2)
	if l.Attempt != 4 || !l.CreatedAt.Equal(created) {
		t.Errorf("lease of the second completer's takeover: %+v, want attempt 4, created %v", l, created)
	}
	recs, err := s.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10})
	if err != nil || len(recs) != 0 {
		t.Errorf("Abandoned with a live lease = %+v, %v; want none", recs, err)
	}
	clk.Advance(time.Second)
	recs, err = s.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10})
	if err != nil || len(recs) != 1 || recs[0].Redrives != 2 || recs[0].Attempts != 4 {
		t.Errorf("Abandoned = %+v, %v; want the key with 4 attempts, 2 redrives", recs, err)
	}

	tx, err := s.Begin(ctx, claim("completer finishes", true, ""))
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusCreated}); err != nil {
		t.Fatal(err)
	}
	check("completed", 5, 3)
	notDue("completer's claim of an answered key")
	check("completer's claim of an answered key", 5, 3)
	clk.Advance(time.Hour)
	notDue("completer's claim of a key completed and expired")
	var n int
	if err := s.DB().QueryRowContext(ctx, `SELECT attempts + 10*redrives FROM idempotency_keys WHERE key = 'redriven' AND response_status IS NOT NULL`).Scan(&n); err != nil || n != 35 {
		t.Fatalf("expired record after a completer's claim: %d, %v; want it unchanged (5 attempts, 3 redrives)", n, err)
	}
	claim("replaced after expiry by a client", false, "")
	check("replaced after expiry by a client", 1, 0)
}

// TestRedriveStaleListingWaitsBackoff: two completers list the same due key
// at the same moment; the first re-drives it and fails at once (Fail ends
// its lease). The second, reaching the key in its stale list, gets
// ErrNotDue while the backoff runs, changing nothing, and takes the key
// over once it passed; a budget spent is ErrNotDue for good.
func TestRedriveStaleListingWaitsBackoff(t *testing.T) {
	ctx := context.Background()
	s, clk := clocked(t)
	const backoff = 10 * time.Second
	ap := idemdriver.AbandonedParams{Limit: 10, MaxRedrives: 2, Backoff: backoff}
	p := params("u1", "k", "fp1")
	p.Lease = time.Second
	lease(t, s, p)
	clk.Advance(time.Second)

	list := func() idemdriver.Record {
		t.Helper()
		recs, err := s.Abandoned(ctx, ap)
		if err != nil || len(recs) != 1 {
			t.Fatalf("Abandoned = %+v, %v; want the key", recs, err)
		}
		return recs[0]
	}
	redrive := func(rec idemdriver.Record) (idemdriver.Claim, error) {
		rp := params(rec.User, rec.Key, rec.Fingerprint)
		rp.Lease = time.Second
		rp.Redrive = &idemdriver.RedriveParams{CreatedAt: rec.CreatedAt, Due: ap}
		return s.Claim(ctx, rp)
	}
	check := func(what string, want idemdriver.Record) {
		t.Helper()
		rec, err := s.Get(ctx, "u1", "k")
		if err != nil || rec.Attempts != want.Attempts || rec.Redrives != want.Redrives || rec.Owner != want.Owner || !rec.LeaseUntil.Equal(want.LeaseUntil) {
			t.Fatalf("%s: record = %+v, %v; want owner %s, lease until %v, %d attempts, %d redrives",
				what, rec, err, want.Owner, want.LeaseUntil, want.Attempts, want.Redrives)
		}
	}

	stale1, stale2 := list(), list()
	c, err := redrive(stale1)
	if err != nil || c.Lease == nil {
		t.Fatalf("first completer's claim = %+v, %v; want a lease", c, err)
	}
	var inflight *idem.InFlightError
	if c, err := redrive(stale2); !errors.As(err, &inflight) {
		t.Fatalf("second completer's claim while the first runs = %+v, %v; want *InFlightError", c, err)
	}
	if err := s.Fail(ctx, c.Lease); err != nil {
		t.Fatal(err)
	}
	failed, err := s.Get(ctx, "u1", "k")
	if err != nil || failed.Attempts != 2 || failed.Redrives != 1 {
		t.Fatalf("after the first re-drive failed: %+v, %v; want 2 attempts, 1 redrive", failed, err)
	}
	if c, err := redrive(stale2); !errors.Is(err, idem.ErrNotDue) {
		t.Fatalf("second completer's claim in the backoff = %+v, %v; want ErrNotDue", c, err)
	}
	check("second completer's claim in the backoff", *failed)
	clk.Advance(backoff - 1)
	if c, err := redrive(stale2); !errors.Is(err, idem.ErrNotDue) {
		t.Fatalf("claim 1ns before the backoff passed = %+v, %v; want ErrNotDue", c, err)
	}
	check("claim 1ns before the backoff passed", *failed)
	clk.Advance(1)
	c, err = redrive(stale2)
	if err != nil || c.Lease == nil || c.Lease.Attempt != 3 {
		t.Fatalf("second completer's claim once the backoff passed = %+v, %v; want a lease, attempt 3", c, err)
	}
	if err := s.Fail(ctx, c.Lease); err != nil {
		t.Fatal(err)
	}
	spent, err := s.Get(ctx, "u1", "k")
	if err != nil || spent.Redrives != 2 {
		t.Fatalf("after the second re-drive: %+v, %v; want 2 redrives", spent, err)
	}
	clk.Advance(time.Hour)
	if c, err := redrive(stale1); !errors.Is(err, idem.ErrNotDue) {
		t.Fatalf("claim with the budget spent = %+v, %v; want ErrNotDue", c, err)
	}
	check("claim with the budget spent", *spent)
}

// TestRedriveStaleListingOtherOperation: a completer's stale listing of
// operation A never takes over operation B on the same key, created after A
// was released, whatever B's fingerprint and even once B's lease ran out.
func TestRedriveStaleListingOtherOperation(t *testing.T) {
	ctx := context.Background()
	s, clk := clocked(t)
	for _, fpB := range []string{"fp1", "fp2"} {
		key := "k-" + fpB
		p := params("u1", key, "fp1")
		p.Lease = time.Second
		a := lease(t, s, p)
		clk.Advance(time.Second)
		recs, err := s.Abandoned(ctx, idemdriver.AbandonedParams{Limit: 10})
		if err != nil || len(recs) != 1 || recs[0].Key != key {
			t.Fatalf("Abandoned = %+v, %v; want %s", recs, err, key)
		}
		stale := recs[0]
		if err := s.Release(ctx, a); err != nil {
			t.Fatal(err)
		}
		clk.Advance(time.Millisecond)
		pb := params("u1", key, fpB)
		pb.Lease = time.Second
		b := lease(t, s, pb)
		if b.CreatedAt.Equal(stale.CreatedAt) {
			t.Fatalf("B created at A's time %v", b.CreatedAt)
		}
		rp := params("u1", key, "fp1")
		rp.Redrive = &idemdriver.RedriveParams{CreatedAt: stale.CreatedAt, Due: idemdriver.AbandonedParams{}}
		for _, at := range []string{"B live", "B's lease ran out"} {
			if c, err := s.Claim(ctx, rp); !errors.Is(err, idem.ErrNotDue) {
				t.Fatalf("B with %s (%s), A's stale listing: Claim = %+v, %v; want ErrNotDue", fpB, at, c, err)
			}
			rec, err := s.Get(ctx, "u1", key)
			if err != nil || rec.Owner != b.Owner || !rec.LeaseUntil.Equal(b.Until) || rec.Attempts != 1 || rec.Redrives != 0 ||
				!rec.CreatedAt.Equal(b.CreatedAt) || rec.Fingerprint != fpB {
				t.Fatalf("B with %s (%s) after A's stale claim: %+v, %v; want B unchanged %+v", fpB, at, rec, err, b)
			}
			clk.Advance(time.Second)
		}
		// B's own listing takes it over.
		rp = params("u1", key, fpB)
		rp.Redrive = &idemdriver.RedriveParams{CreatedAt: b.CreatedAt, Due: idemdriver.AbandonedParams{}}
		if c, err := s.Claim(ctx, rp); err != nil || c.Lease == nil || !c.Lease.CreatedAt.Equal(b.CreatedAt) || c.Lease.Attempt != 2 {
			t.Fatalf("B's own listing: Claim = %+v, %v; want B's lease, attempt 2", c, err)
		}
	}
}

// TestRedriveMissingKeyInsertsNothing: a completer's claim of a key with no
// record (never claimed, or released since it was listed) is ErrNotDue and
// inserts nothing.
func TestRedriveMissingKeyInsertsNothing(t *testing.T) {
	ctx := context.Background()
	s, clk := clocked(t)
	rows := func() int {
		t.Helper()
		var n int
		if err := s.DB().QueryRowContext(ctx, `SELECT count(*) FROM idempotency_keys`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	rp := params("u1", "never", "fp1")
	rp.Owner = idemdriver.NewOwner()
	rp.Redrive = &idemdriver.RedriveParams{CreatedAt: clk.Now(), Due: idemdriver.AbandonedParams{}}
	for range 2 { // and sent again with its owner
		if c, err := s.Claim(ctx, rp); !errors.Is(err, idem.ErrNotDue) {
			t.Fatalf("completer's claim of a missing key = %+v, %v; want ErrNotDue", c, err)
		}
	}
	if n := rows(); n != 0 {
		t.Fatalf("%d records after a completer's claim of a missing key; want none", n)
	}

	p := params("u1", "released", "fp1")
	p.Lease = time.Second
	l := lease(t, s, p)
	clk.Advance(time.Second)
	if err := s.Release(ctx, l); err != nil {
		t.Fatal(err)
	}
	rp = params("u1", "released", "fp1")
	rp.Redrive = &idemdriver.RedriveParams{CreatedAt: l.CreatedAt, Due: idemdriver.AbandonedParams{}}
	if c, err := s.Claim(ctx, rp); !errors.Is(err, idem.ErrNotDue) {
		t.Fatalf("completer's claim of a released key = %+v, %v; want ErrNotDue", c, err)
	}
	if rec, err := s.Get(ctx, "u1", "released"); !errors.Is(err, idem.ErrNotFound) || rows() != 0 {
		t.Fatalf("after a completer's claim of a released key: Get = %+v, %v, %d rows; want none", rec, err, rows())
	}
}

// TestAbandonedDue: Abandoned lists only the keys due by its params, as
// idemdriver.AbandonedParams.Due decides, earliest lease end first: keys given
// up (MaxRedrives) or in their backoff are left out, so they never take
// the places of keys that are due under a Limit.
func TestAbandonedDue(t *testing.T) {
	ctx := context.Background()
	clk := &setClock{now: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)}
	s, _ := setup(t, sqlitestore.Options{Now: clk.Now})
	const lease = 10 * time.Second
	// redrive claims key and takes it over as a completer n times, each
	// time once the lease ran out.
	redrive := func(key string, n int) {
		t.Helper()
		p := params("u1", key, "fp1")
		p.Lease = lease
		c, err := s.Claim(ctx, p)
		if err != nil || c.Lease == nil {
			t.Fatalf("Claim(%s) = %+v, %v", key, c, err)
		}
		p.Redrive = &idemdriver.RedriveParams{CreatedAt: c.Lease.CreatedAt, Due: idemdriver.AbandonedParams{}}
		for range n {
			clk.Advance(lease)
			if c, err := s.Claim(ctx, p); err != nil || c.Lease == nil {
				t.Fatalf("re-drive of %s = %+v, %v", key, c, err)
			}
		}
	}
	// Four keys re-driven 4..1 times whose leases all end at start+5
	// leases, created one lease apart: r4-given-up first, r1 last.
	start := clk.Now()
	for n, key := range []string{"r1", "r2", "r3", "r4-given-up"} {
		clk.Set(start.Add(time.Duration(3-n) * lease))
		redrive(key, n+1)
	}
	// Two keys never re-driven, created together, their leases ending at
	// start+6 leases (the key breaks the tie); one re-driven once, its
	// lease ending at start+7 leases; one live until start+11 leases, and
	// one completed.
	clk.Set(start.Add(5 * lease))
	redrive("r0-same", 0)
	redrive("r0-later", 0)
	redrive("r1-later", 1)
	clk.Set(start.Add(10 * lease))
	redrive("live", 0)
	clk.Set(start.Add(4 * lease))
	p := params("u1", "done", "fp1")
	if c, err := s.Claim(ctx, p); err != nil || c.Lease == nil {
		t.Fatal(err)
	} else if tx, err := s.Begin(ctx, c.Lease); err != nil {
		t.Fatal(err)
	} else if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusOK}); err != nil {
		t.Fatal(err)
	}
	if rec, err := s.Get(ctx, "u1", "r4-given-up"); err != nil || rec.Redrives != 4 || !rec.LeaseUntil.Equal(start.Add(5*lease)) {
		t.Fatalf("r4-given-up = %+v, %v; want 4 redrives, lease until %v", rec, err, start.Add(5*lease))
	}

	all := []string{"r4-given-up", "r3", "r2", "r1", "r0-later", "r0-same", "r1-later", "live", "done"}
	// want lists the keys Due at the clock's time, in the order Abandoned
	// promises, read back with Get.
	want := func(ap idemdriver.AbandonedParams) string {
		t.Helper()
		var due []idemdriver.Record
		for _, k := range all {
			rec, err := s.Get(ctx, "u1", k)
			if err != nil {
				t.Fatal(err)
			}
			if ap.Due(rec, clk.Now()) {
				due = append(due, *rec)
			}
		}
		slices.SortStableFunc(due, func(a, b idemdriver.Record) int {
			return cmp.Or(a.LeaseUntil.Compare(b.LeaseUntil), a.CreatedAt.Compare(b.CreatedAt), strings.Compare(a.Key, b.Key))
		})
		if ap.Limit < len(due) {
			due = due[:max(ap.Limit, 0)]
		}
		return keys(due)
	}
	abandoned := func(ap idemdriver.AbandonedParams) string {
		t.Helper()
		recs, err := s.Abandoned(ctx, ap)
		if err != nil {
			t.Fatalf("Abandoned(%+v): %v", ap, err)
		}
		return keys(recs)
	}

	ap := idemdriver.AbandonedParams{Limit: 10, MaxRedrives: 4, Backoff: lease, MaxBackoff: 3 * lease}
	// r1, r2 and r3 wait 1, 2 and 3 (capped) leases after start+5 leases;
	// r4-given-up is given up.
	cases := []struct {
		at   time.Duration
		want string
	}{
		{5 * lease, ""},
		{6 * lease, "r1 r0-later r0-same"},
		{6*lease + lease/2, "r1 r0-later r0-same"},
		{7*lease - 1, "r1 r0-later r0-same"},
		{7 * lease, "r2 r1 r0-later r0-same"},
		{8 * lease, "r3 r2 r1 r0-later r0-same r1-later"},
		{11 * lease, "r3 r2 r1 r0-later r0-same r1-later live"},
		{1000 * lease, "r3 r2 r1 r0-later r0-same r1-later live"},
	}
	for _, c := range cases {
		clk.Set(start.Add(c.at))
		if got, w := abandoned(ap), want(ap); got != c.want || got != w {
			t.Errorf("at start+%v: Abandoned = %q; want %q (Due says %q)", c.at, got, c.want, w)
		}
	}

	// The keys that are due fill the limit, whatever waits ahead of them.
	clk.Set(start.Add(6*lease + lease/2))
	for limit := range 5 {
		ap := ap
		ap.Limit = limit
		if got, w := abandoned(ap), want(ap); got != w {
			t.Errorf("Limit %d: Abandoned = %q; want %q", limit, got, w)
		}
	}
	if got := abandoned(idemdriver.AbandonedParams{Limit: 2, MaxRedrives: 4, Backoff: lease}); got != "r1 r0-later" {
		t.Errorf("Limit 2 = %q; want r1 r0-later", got)
	}

	// Without MaxRedrives none is given up; without Backoff every key whose
	// lease ended is due; without MaxBackoff the backoff doubles on.
	for _, ap := range []idemdriver.AbandonedParams{
		{Limit: 10},
		{Limit: 10, Backoff: lease},
		{Limit: 10, MaxRedrives: 2},
		{Limit: 10, MaxRedrives: -1, Backoff: lease, MaxBackoff: -1},
		{Limit: 10, Backoff: lease, MaxBackoff: lease / 2},
		{Limit: 10, Backoff: time.Nanosecond, MaxBackoff: time.Nanosecond},
	} {
		for _, at := range []time.Duration{5 * lease, 6 * lease, 7 * lease, 9*lease - 1, 9 * lease, 13 * lease, 100 * lease} {
			clk.Set(start.Add(at))
			if got, w := abandoned(ap), want(ap); got != w {
				t.Errorf("%+v at start+%v: Abandoned = %q; Due says %q", ap, at, got, w)
			}
		}
	}

	// Many redrives and a long backoff: no overflow, the cap holds.
	if _, err := s.DB().ExecContext(ctx, `UPDATE idempotency_keys SET redrives = 200 WHERE key = 'r4-given-up'`); err != nil {
		t.Fatal(err)
	}
	huge := idemdriver.AbandonedParams{Limit: 10, Backoff: 1 << 60, MaxBackoff: 1000 * lease}
	clk.Set(start.Add(5*lease + 1000*lease - 1))
	if got, w := abandoned(huge), want(huge); strings.Contains(got, "r4-given-up") || got != w {
		t.Errorf("200 redrives before the cap passed: Abandoned = %q; want %q, without r4-given-up", got, w)
	}
	clk.Advance(1)
	if got, w := abandoned(huge), want(huge); !strings.HasPrefix(got, "r4-given-up ") || got != w {
		t.Errorf("200 redrives once the cap passed: Abandoned = %q; want %q, r4-given-up first", got, w)
	}
	huge.MaxBackoff = 0 // 2^60ns·2^199: never due
	clk.Set(start.Add(1 << 62))
	if got := abandoned(huge); strings.Contains(got, "r4-given-up") {
		t.Errorf("200 redrives, backoff 2^60ns without a cap: Abandoned = %q; want r4-given-up left out", got)
	}
}

func keys(recs []idemdriver.Record) string {
	ks := make([]string, len(recs))
	for i, r := range recs {
		ks[i] = r.Key
	}
	return strings.Join(ks, " ")
}

// setClock is a clock that tests set, forwards and back.
type setClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *setClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *setClock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = t
}

func (c *setClock) Advance(d time.Duration) { c.Set(c.Now().Add(d)) }

// TestLockWritesSharesTheStoreQueue: a writer of the application that
// takes LockWrites on the store's DB() waits in the same queue as the
// store's own writers: the store's claim waits for it (up to the store's
// busy timeout, then ErrBusy) and goes on when it lets go; and a
// LockWrites caller waits for the store's open transaction.
func TestLockWritesSharesTheStoreQueue(t *testing.T) {
	s, _ := setup(t, sqlitestore.Options{BusyTimeout: 100 * time.Millisecond})
	ctx := context.Background()
	unlock, err := sqlitestore.LockWrites(ctx, s.DB())
	if err != nil {
		t.Fatalf("LockWrites: %v", err)
	}
	if _, err := s.Claim(ctx, params("u1", "k1", "fp1")); !errors.Is(err, sqlitestore.ErrBusy) {
		t.Errorf("Claim while the application holds the write queue: got %v, want ErrBusy", err)
	}
	done := claimWaiting(t, s, params("u1", "k2", "fp1"), "the application's writer")
	unlock()
	unlock() // a second call does nothing
	if err := <-done; err != nil {
		t.Fatalf("Claim after the application's writer let go: %v", err)
	}

	l := lease(t, s, params("u1", "k3", "fp1"))
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	if _, err := sqlitestore.LockWrites(ctx, s.DB()); !errors.Is(err, sqlitestore.ErrBusy) {
		t.Errorf("LockWrites beside the store's open Tx: got %v, want ErrBusy after the store's busy timeout", err)
	}
	if err := tx.Complete(ctx, &idemdriver.Response{Status: http.StatusOK}); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	unlock, err = sqlitestore.LockWrites(ctx, s.DB())
	if err != nil {
		t.Fatalf("LockWrites after Complete: %v", err)
	}
	unlock()
}

// claimWaiting starts a claim of p on s in the background, fails t unless
// the claim waits for the write lock (held by what), and returns the
// channel of the claim's error.
func claimWaiting(t *testing.T, s *sqlitestore.Store, p idemdriver.ClaimParams, what string) <-chan error {
	t.Helper()
	waiting := make(chan struct{})
	sqlitestore.OnLockWait(s, func() { close(waiting) })
	done := make(chan error, 1)
	go func() {
		_, err := s.Claim(context.Background(), p)
		done <- err
	}()
	select {
	case <-waiting:
	case err := <-done:
		t.Fatalf("Claim beside %s returned without waiting: %v", what, err)
	}
	return done
}
