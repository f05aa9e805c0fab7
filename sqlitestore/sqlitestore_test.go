package sqlitestore_test

import (
	"context"
	"database/sql"
	"errors"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/fstest"
	"time"

	"github.com/idem-go/idem"
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
			_, err := tx.(*sqlitestore.Tx).SQL().ExecContext(ctx, `INSERT INTO storetest_effects (name) VALUES (?)`, name)
			return err
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
func params(user, key, fp string) idem.ClaimParams {
	return idem.ClaimParams{User: user, Key: key, Fingerprint: fp, Method: http.MethodPost, Path: "/v1/orders"}
}

// lease claims p, which must be free.
func lease(t *testing.T, s idem.Store, p idem.ClaimParams) *idem.Lease {
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
	h := idem.Middleware(s, idem.Options{})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
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
	tx, err := s.Begin(ctx, &idem.Lease{})
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
		other.ExecContext(ctx, `ROLLBACK`)
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
	if err := tx.Complete(ctx, &idem.Response{Status: http.StatusCreated, Body: []byte("kept")}); err != nil {
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
	if want := "idem:1 orders:1 orders:2 orders:10"; versions != want {
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
	done := make(chan error)
	go func() {
		_, err := s.Claim(ctx, params("u1", "k3", "fp1"))
		done <- err
	}()
	time.Sleep(20 * time.Millisecond)
	if err := tx.Complete(ctx, &idem.Response{Status: http.StatusOK}); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if err := <-done; err != nil {
		t.Errorf("Claim waiting for the Tx: %v", err)
	}
}
