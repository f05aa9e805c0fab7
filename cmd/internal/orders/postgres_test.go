package orders

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/pgstore"
)

// pgPool returns a pool on a fresh, empty schema of t's own (see
// pgtest.Pool).
func pgPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return pgtest.Pool(t, pgtest.MaxConns(8))
}

// pgOpenRepo returns a repository on a fresh schema with the orders table,
// writing with statements of its own.
func pgOpenRepo(t testing.TB) (*PostgresRepository, *pgxpool.Pool) {
	t.Helper()
	pool := pgPool(t)
	if err := MigratePostgres(context.Background(), pool); err != nil {
		t.Fatalf("MigratePostgres: %v", err)
	}
	noTx := func(context.Context) (pgx.Tx, error) { return nil, idem.ErrNoTx }
	return NewPostgresRepository(pool, noTx), pool
}

// auditedRepository is a Repository that can list every order.
type auditedRepository interface {
	Repository
	AllOrders(ctx context.Context, fn func(Order) error) error
}

var (
	_ auditedRepository = (*SQLiteRepository)(nil)
	_ auditedRepository = (*PostgresRepository)(nil)
)

// TestRepositories runs one set of cases on every repository, so that they
// keep the same semantics.
func TestRepositories(t *testing.T) {
	for _, c := range []struct {
		name string
		open func(t *testing.T) auditedRepository
	}{
		{"sqlite", func(t *testing.T) auditedRepository { r, _ := openRepo(t); return r }},
		{"postgres", func(t *testing.T) auditedRepository { r, _ := pgOpenRepo(t); return r }},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Run("CreateGet", func(t *testing.T) { exerciseCreateGet(t, c.open(t)) })
			t.Run("List", func(t *testing.T) { exerciseList(t, c.open(t)) })
			t.Run("AllOrders", func(t *testing.T) { exerciseAllOrders(t, c.open(t)) })
		})
	}
}

// exerciseCreateGet checks that an order reads back as the service wrote
// it, to the byte of its JSON, and which orders collide.
func exerciseCreateGet(t *testing.T, repo Repository) {
	ctx := context.Background()
	if err := repo.Ping(ctx); err != nil {
		t.Fatalf("Ping: %v", err)
	}
	at := time.Date(2025, 1, 2, 3, 4, 5, 678901000, time.UTC)
	o := &Order{
		ID: "ord_1", UserID: "alice", Status: StatusPaid,
		Items: []Item{{SKU: "A", Quantity: 2, UnitPrice: 5}, {SKU: "B", Quantity: 1, UnitPrice: 7}},
		Total: 17, Currency: "EUR", PaymentID: "pi_1", CreatedAt: at,
		IdempotencyKey: "k", KeyCreatedAt: at.Add(-time.Second),
	}
	if err := repo.Create(ctx, o); err != nil {
		t.Fatalf("Create: %v", err)
	}
	got, err := repo.Get(ctx, "alice", "ord_1")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if got.ID != o.ID || got.UserID != o.UserID || got.Total != o.Total || len(got.Items) != 2 || got.Items[1] != o.Items[1] ||
		!got.CreatedAt.Equal(at) || got.IdempotencyKey != "k" || !got.KeyCreatedAt.Equal(o.KeyCreatedAt) || got.PaymentID != "pi_1" {
		t.Errorf("Get = %+v, want %+v", got, o)
	}
	if got.CreatedAt.Location() != time.UTC || got.KeyCreatedAt.Location() != time.UTC {
		t.Errorf("Get times in %v and %v, want UTC", got.CreatedAt.Location(), got.KeyCreatedAt.Location())
	}
	gotJSON, _ := json.Marshal(got)
	wantJSON, _ := json.Marshal(o)
	if !bytes.Equal(gotJSON, wantJSON) {
		t.Errorf("Get as JSON = %s, want %s", gotJSON, wantJSON)
	}
	if _, err := repo.Get(ctx, "bob", "ord_1"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get of another user's order: %v, want ErrNotFound", err)
	}
	if _, err := repo.Get(ctx, "alice", "ord_nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get of an unknown order: %v, want ErrNotFound", err)
	}

	// The same id, or the same (user, key, key creation), is refused.
	dup := *o
	dup.IdempotencyKey = "other"
	if err := repo.Create(ctx, &dup); !errors.Is(err, ErrExists) {
		t.Errorf("Create with a taken id: %v, want ErrExists", err)
	}
	dup = *o
	dup.ID = "ord_2"
	if err := repo.Create(ctx, &dup); !errors.Is(err, ErrExists) {
		t.Errorf("Create with a taken key: %v, want ErrExists", err)
	}
	// The same key for another user is another operation.
	dup.UserID = "bob"
	if err := repo.Create(ctx, &dup); err != nil {
		t.Errorf("Create with another user's key: %v", err)
	}
	// The same key after it expired (a new record) is another operation.
	dup.UserID = "alice"
	dup.ID = "ord_2b"
	dup.KeyCreatedAt = at.Add(time.Hour)
	if err := repo.Create(ctx, &dup); err != nil {
		t.Errorf("Create with a new generation of the key: %v", err)
	}
	// Orders without a key never collide on it.
	for _, id := range []string{"ord_3", "ord_4"} {
		if err := repo.Create(ctx, &Order{ID: id, UserID: "alice", Status: StatusPaid, Items: o.Items, Total: 17, Currency: "EUR", PaymentID: "pi_" + id, CreatedAt: at}); err != nil {
			t.Errorf("Create %s without a key: %v", id, err)
		}
	}
	if got, err := repo.Get(ctx, "alice", "ord_3"); err != nil || got.IdempotencyKey != "" || !got.KeyCreatedAt.IsZero() {
		t.Errorf("Get of an order without a key = %+v, %v", got, err)
	}

	list, more, err := repo.List(ctx, "alice", 10, "")
	if err != nil || more || len(list) != 4 {
		t.Fatalf("List = %d orders, %v, %v; want 4", len(list), more, err)
	}
	if _, _, err := repo.List(ctx, "alice", 10, "ord_nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("List after an unknown order: %v, want ErrNotFound", err)
	}
	if _, _, err := repo.List(ctx, "bob", 10, "ord_1"); !errors.Is(err, ErrNotFound) {
		t.Errorf("List after another user's order: %v, want ErrNotFound", err)
	}
	if _, _, err := repo.List(ctx, "alice", 0, ""); err == nil || errors.Is(err, ErrNotFound) {
		t.Errorf("List with limit 0: %v, want an error", err)
	}
}

// exerciseList checks the order of List and its keyset pages.
func exerciseList(t *testing.T, repo Repository) {
	ctx := context.Background()
	base := time.Date(2025, 6, 1, 0, 0, 0, 0, time.UTC)
	// created_at ascending with a tie (ord_c, ord_b, ord_B share one) that
	// the id breaks byte-wise, and times a microsecond apart.
	orders := []struct {
		id string
		at time.Duration
	}{
		{"ord_a", 0},
		{"ord_c", time.Microsecond},
		{"ord_b", time.Microsecond},
		{"ord_B", time.Microsecond},
		{"ord_d", 2 * time.Microsecond},
		{"ord_0", time.Second},
	}
	for _, x := range orders {
		o := &Order{ID: x.id, UserID: "alice", Status: StatusPaid, Items: []Item{{"A", 1, 1}}, Total: 1, Currency: "EUR", PaymentID: "pi_" + x.id, CreatedAt: base.Add(x.at)}
		if err := repo.Create(ctx, o); err != nil {
			t.Fatal(err)
		}
	}
	if err := repo.Create(ctx, &Order{ID: "ord_z", UserID: "bob", Status: StatusPaid, Items: []Item{{"A", 1, 1}}, Total: 1, Currency: "EUR", PaymentID: "pi_z", CreatedAt: base.Add(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	want := []string{"ord_0", "ord_d", "ord_c", "ord_b", "ord_B", "ord_a"}
	ids := func(os []Order) []string {
		var s []string
		for _, o := range os {
			s = append(s, o.ID)
		}
		return s
	}

	all, more, err := repo.List(ctx, "alice", 100, "")
	if err != nil || more || !slices.Equal(ids(all), want) {
		t.Fatalf("List = %v, %v, %v; want %v", ids(all), more, err, want)
	}
	for size := 1; size <= len(want); size++ {
		var got []string
		after := ""
		for pages := 0; ; pages++ {
			if pages > len(want) {
				t.Fatalf("limit %d: more than %d pages", size, len(want))
			}
			page, more, err := repo.List(ctx, "alice", size, after)
			if err != nil {
				t.Fatalf("limit %d after %q: %v", size, after, err)
			}
			if len(page) > size || (more && len(page) != size) {
				t.Fatalf("limit %d after %q: %d orders, more=%v", size, after, len(page), more)
			}
			got = append(got, ids(page)...)
			if !more {
				break
			}
			after = page[len(page)-1].ID
		}
		if !slices.Equal(got, want) {
			t.Errorf("pages of %d = %v, want %v", size, got, want)
		}
	}
	if page, more, err := repo.List(ctx, "alice", 10, "ord_a"); err != nil || more || len(page) != 0 {
		t.Errorf("after the oldest = %v, %v, %v; want nothing", ids(page), more, err)
	}
	if page, more, err := repo.List(ctx, "alice", 2, "ord_c"); err != nil || !more || !slices.Equal(ids(page), []string{"ord_b", "ord_B"}) {
		t.Errorf("after ord_c = %v, %v, %v; want [ord_b ord_B], more", ids(page), more, err)
	}
	if page, more, err := repo.List(ctx, "carol", 10, ""); err != nil || more || len(page) != 0 {
		t.Errorf("List of a user without orders = %v, %v, %v", ids(page), more, err)
	}
}

// exerciseAllOrders checks that AllOrders sees every order, in order, keys
// included, across its pages.
func exerciseAllOrders(t *testing.T, repo auditedRepository) {
	ctx := context.Background()
	base := time.Date(2025, 6, 1, 0, 0, 0, 0, time.UTC)
	var want []Order
	users := []string{"bob", "alice", "Zed", "carol"}
	n := auditPageSize*2 + 7 // three pages, the last one short
	for i := range n {
		o := Order{
			ID: fmt.Sprintf("ord_%05d", n-i), UserID: users[i%len(users)], Status: StatusPaid,
			Items: []Item{{"A", 1, int64(i + 1)}}, Total: int64(i + 1), Currency: "EUR", PaymentID: fmt.Sprintf("pi_%d", i),
			CreatedAt: base.Add(time.Duration(i/3) * time.Microsecond), // ties broken by id
		}
		if i%2 == 0 {
			o.IdempotencyKey, o.KeyCreatedAt = fmt.Sprintf("k-%d", i), base.Add(-time.Duration(i)*time.Second)
		}
		if err := repo.Create(ctx, &o); err != nil {
			t.Fatal(err)
		}
		want = append(want, o)
	}
	slices.SortFunc(want, func(a, b Order) int {
		switch {
		case a.UserID != b.UserID:
			return cmpString(a.UserID, b.UserID)
		case !a.CreatedAt.Equal(b.CreatedAt):
			return a.CreatedAt.Compare(b.CreatedAt)
		default:
			return cmpString(a.ID, b.ID)
		}
	})
	var got []Order
	if err := repo.AllOrders(ctx, func(o Order) error { got = append(got, o); return nil }); err != nil {
		t.Fatalf("AllOrders: %v", err)
	}
	if len(got) != len(want) {
		t.Fatalf("AllOrders gave %d orders, want %d", len(got), len(want))
	}
	for i := range want {
		g, w := got[i], want[i]
		if g.ID != w.ID || g.UserID != w.UserID || g.PaymentID != w.PaymentID || g.Total != w.Total ||
			!g.CreatedAt.Equal(w.CreatedAt) || g.IdempotencyKey != w.IdempotencyKey || !g.KeyCreatedAt.Equal(w.KeyCreatedAt) {
			t.Fatalf("AllOrders[%d] = %+v, want %+v", i, g, w)
		}
	}

	// fn's error stops the scan and comes back as is.
	stop := errors.New("stop")
	calls := 0
	err := repo.AllOrders(ctx, func(Order) error {
		calls++
		if calls == auditPageSize+1 {
			return stop
		}
		return nil
	})
	if !errors.Is(err, stop) || calls != auditPageSize+1 {
		t.Errorf("AllOrders with a failing fn = %v after %d calls, want %v after %d", err, calls, stop, auditPageSize+1)
	}
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func TestPostgresRepositoryUsesRequestTx(t *testing.T) {
	ctx := context.Background()
	_, pool := pgOpenRepo(t)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	repo := NewPostgresRepository(pool, func(context.Context) (pgx.Tx, error) { return tx, nil })
	o := &Order{ID: "ord_tx", UserID: "alice", Status: StatusPaid, Items: []Item{{"A", 1, 1}}, Total: 1, Currency: "EUR", PaymentID: "pi", CreatedAt: time.Now().Truncate(time.Microsecond)}
	if err := repo.Create(ctx, o); err != nil {
		t.Fatal(err)
	}
	if _, err := repo.Get(ctx, "alice", "ord_tx"); !errors.Is(err, ErrNotFound) {
		t.Errorf("order visible before the request transaction committed: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := repo.Get(ctx, "alice", "ord_tx"); !errors.Is(err, ErrNotFound) {
		t.Errorf("order outlived the rolled-back request transaction: %v", err)
	}

	// A unique violation in the request's transaction is ErrExists too.
	own := NewPostgresRepository(pool, nil)
	if err := own.Create(ctx, o); err != nil {
		t.Fatalf("Create in its own transaction: %v", err)
	}
	tx2, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx2.Rollback(ctx)
	inTx := NewPostgresRepository(pool, func(context.Context) (pgx.Tx, error) { return tx2, nil })
	if err := inTx.Create(ctx, o); !errors.Is(err, ErrExists) {
		t.Errorf("Create of a taken id in the request transaction: %v, want ErrExists", err)
	}

	failing := NewPostgresRepository(pool, func(context.Context) (pgx.Tx, error) { return nil, errors.New("store down") })
	o.ID = "ord_tx2"
	if err := failing.Create(ctx, o); err == nil || errors.Is(err, ErrExists) {
		t.Errorf("Create = %v although the request transaction failed", err)
	}
	if _, err := repo.Get(ctx, "alice", "ord_tx2"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Create wrote outside the failed request transaction: %v", err)
	}
}

// Ping fails while the orders table is missing.
func TestPostgresRepositoryPing(t *testing.T) {
	pool := pgPool(t)
	repo := NewPostgresRepository(pool, nil)
	if err := repo.Ping(context.Background()); err == nil {
		t.Error("Ping succeeded without the orders table")
	}
}

// Instances that start at once migrate once; a second run is a no-op.
func TestPostgresMigrations(t *testing.T) {
	pool := pgPool(t)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = MigratePostgres(ctx, pool)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("concurrent MigratePostgres: %v", err)
	}
	if err := MigratePostgres(ctx, pool); err != nil {
		t.Fatalf("second MigratePostgres: %v", err)
	}
	if err := NewPostgresRepository(pool, nil).Ping(ctx); err != nil {
		t.Errorf("Ping after migrating: %v", err)
	}
}

// Both schemas move together: the same versions, one file each.
func TestMigrationsMatch(t *testing.T) {
	names := func(fsys fs.FS) []string {
		n, err := fs.Glob(fsys, "*.sql")
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if s, p := names(SQLiteMigrations), names(PostgresMigrations); !slices.Equal(s, p) || len(s) == 0 {
		t.Errorf("SQLite migrations %v, PostgreSQL migrations %v: want the same files", s, p)
	}
}

// pgBundle is the order API on PostgreSQL: pgstore as the idempotency
// store, PostgresRepository, and the fake gateway. Its embedded testBundle
// serves the HTTP helpers; its store and repo are nil.
type pgBundle struct {
	*testBundle
	pool    *pgxpool.Pool
	pgStore *pgstore.Store
	pgRepo  *PostgresRepository
}

// pgSetup starts the order API on a fresh, migrated schema. wrap, when not
// nil, wraps the repository the handler uses.
func pgSetup(t *testing.T, wrap func(Repository) Repository, opts ...func(*setupOptions)) *pgBundle {
	t.Helper()
	ctx := context.Background()
	pool := pgPool(t)
	if err := pgstore.Migrate(ctx, pool); err != nil {
		t.Fatalf("pgstore.Migrate: %v", err)
	}
	if err := MigratePostgres(ctx, pool); err != nil {
		t.Fatalf("orders migrations: %v", err)
	}
	b := &pgBundle{testBundle: newBundle(), pool: pool}
	b.pgStore = pgstore.New(pool, pgstore.Options{Now: b.clock.Now})
	b.pgRepo = NewPostgresRepository(pool, pgstore.FromContext)
	var repo Repository = b.pgRepo
	if wrap != nil {
		repo = wrap(repo)
	}
	b.serve(t, repo, b.pgStore, opts...)
	return b
}

// countOrders counts the rows of the orders table.
func (b *pgBundle) countOrders(t *testing.T) int {
	t.Helper()
	var n int
	if err := b.pool.QueryRow(context.Background(), `SELECT count(*) FROM orders`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestPostgresCreateAndReplay(t *testing.T) {
	b := pgSetup(t, nil)
	b.clock.Advance(123456 * time.Microsecond) // a created_at with a fraction
	first := b.post(t, "alice", "k-1", orderBody)
	if first.status != http.StatusCreated {
		t.Fatalf("status = %d, want 201 (%s)", first.status, first)
	}
	o := decodeOrder(t, first.body)
	if got, want := first.header.Get("Location"), "/v1/orders/"+o.ID; got != want {
		t.Errorf("Location = %q, want %q", got, want)
	}
	if o.UserID != "alice" || o.Total != 2598 || o.PaymentID != "pi_1" || !o.CreatedAt.Equal(b.clock.Now()) {
		t.Errorf("order = %+v", o)
	}

	b.clock.Advance(time.Second)
	again := b.post(t, "alice", "k-1", orderBody)
	if again.status != http.StatusCreated || again.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay = %s (Idempotent-Replayed %q), want a replayed 201", again, again.header.Get("Idempotent-Replayed"))
	}
	if !bytes.Equal(again.body, first.body) {
		t.Errorf("replay body = %s, want %s", again.body, first.body)
	}
	for _, h := range []string{"Location", "Content-Type", "Idempotency-Key"} {
		if got, want := again.header.Get(h), first.header.Get(h); got != want {
			t.Errorf("replay %s = %q, want %q", h, got, want)
		}
	}
	if got := b.payer.callCount(); got != 1 {
		t.Errorf("gateway calls = %d, want 1", got)
	}
	if got := b.countOrders(t); got != 1 {
		t.Errorf("orders = %d, want 1", got)
	}

	// Read back from PostgreSQL, the order is the one the create answered.
	got := b.get(t, "alice", first.header.Get("Location"))
	if got.status != http.StatusOK || !bytes.Equal(got.body, first.body) {
		t.Errorf("GET = %s, want %s", got, first.body)
	}
	list := b.get(t, "alice", "/v1/orders")
	var lr ListResponse
	if err := json.Unmarshal(list.body, &lr); err != nil || len(lr.Orders) != 1 || lr.Orders[0].ID != o.ID || lr.HasMore {
		t.Errorf("list = %s (%v)", list, err)
	}
	b.get(t, "bob", first.header.Get("Location")).wantProblem(t, http.StatusNotFound, ProblemNotFound)
	// The order carries its key, for the audit.
	stored, err := b.pgRepo.Get(context.Background(), "alice", o.ID)
	if err != nil || stored.IdempotencyKey != "k-1" || stored.KeyCreatedAt.IsZero() {
		t.Errorf("stored order = %+v, %v; want key k-1 and its creation time", stored, err)
	}
	if got := b.get(t, "alice", "/healthz"); got.status != http.StatusOK {
		t.Errorf("healthz = %s", got)
	}
}

func TestPostgresConcurrentSameKey(t *testing.T) {
	concurrentSameKey(t, func(t *testing.T, opts ...func(*setupOptions)) (*testBundle, func(*testing.T) int) {
		b := pgSetup(t, nil, opts...)
		return b.testBundle, b.countOrders
	})
}

// gateRepo holds the first Create after it wrote, until release closes, and
// reports every later Create as it begins.
type gateRepo struct {
	Repository
	mu       sync.Mutex // guards creates
	creates  int
	inserted chan struct{} // the first Create wrote its row
	release  chan struct{} // lets the first Create return
	entered  chan struct{} // a later Create began
}

func (g *gateRepo) Create(ctx context.Context, o *Order) error {
	g.mu.Lock()
	g.creates++
	first := g.creates == 1
	g.mu.Unlock()
	if !first {
		g.entered <- struct{}{}
		return g.Repository.Create(ctx, o)
	}
	err := g.Repository.Create(ctx, o)
	g.inserted <- struct{}{}
	<-g.release
	return err
}

// An attempt whose lease was taken over after it wrote its order, but
// before it committed, cannot commit: its order never appears, and the
// order of the attempt that took over stands alone. (The two attempts
// write the same order id; their created_at tells them apart.)
func TestPostgresFencedAttemptCannotCommit(t *testing.T) {
	gate := &gateRepo{inserted: make(chan struct{}, 1), release: make(chan struct{}), entered: make(chan struct{}, 1)}
	b := pgSetup(t, func(r Repository) Repository { gate.Repository = r; return gate },
		func(o *setupOptions) { o.idem.Lease = 10 * time.Second })
	slowAt := b.clock.Now()
	slow := b.postAsync(t, "alice", "f-1", orderBody)
	<-gate.inserted // the slow attempt's order is written, not committed

	b.clock.Advance(11 * time.Second) // its lease runs out
	fastAt := b.clock.Now()
	fast := b.postAsync(t, "alice", "f-1", orderBody)
	<-gate.entered // the takeover paid and is writing its order
	close(gate.release)

	late, won := <-slow, <-fast
	if won.status != http.StatusCreated || won.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("takeover: %s, want a fresh 201", won)
	}
	if late.status == http.StatusCreated {
		t.Errorf("the fenced attempt answered 201 too: %s", late)
	}
	t.Logf("fenced attempt answered %s", late)
	if got := b.idemM.Fenced.Load(); got != 1 {
		t.Errorf("fenced attempts = %d, want 1", got)
	}

	o := decodeOrder(t, won.body)
	if !o.CreatedAt.Equal(fastAt) {
		t.Errorf("answered created_at = %v, want the takeover's %v", o.CreatedAt, fastAt)
	}
	if got := b.countOrders(t); got != 1 {
		t.Errorf("orders = %d, want 1", got)
	}
	stored, err := b.pgRepo.Get(context.Background(), "alice", o.ID)
	if err != nil {
		t.Fatal(err)
	}
	if stored.CreatedAt.Equal(slowAt) || !stored.CreatedAt.Equal(fastAt) {
		t.Errorf("stored created_at = %v, want the takeover's %v and not the fenced attempt's %v", stored.CreatedAt, fastAt, slowAt)
	}
	if got := b.payer.succeeded(); got != 1 {
		t.Errorf("payments = %d, want 1", got)
	}
	replay := b.post(t, "alice", "f-1", orderBody)
	if replay.header.Get("Idempotent-Replayed") != "true" || !bytes.Equal(replay.body, won.body) {
		t.Errorf("replay = %s, want the takeover's answer %s", replay, won)
	}
}
