package orders

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/outbox"
	"github.com/idem-go/idem/outbox/pgoutbox"
	"github.com/idem-go/idem/outbox/sqliteoutbox"
)

func TestEventID(t *testing.T) {
	for id, want := range map[string]string{
		"ord_0123456789abcdef01234567": "evt_0123456789abcdef01234567",
		"ord_":                         "evt_",
		"x":                            "evt-x",
		"ordx":                         "evt-ordx",
	} {
		if got := EventID(id); got != want {
			t.Errorf("EventID(%q) = %q, want %q", id, got, want)
		}
	}
	if EventID("ord_x") == EventID("x") {
		t.Error("two order ids share an event id")
	}
}

// allEvents returns every event of table, oldest first.
func allEvents(t *testing.T, table outbox.Table) []outbox.Event {
	t.Helper()
	var evs []outbox.Event
	if err := table.Each(context.Background(), func(e outbox.Event, _ time.Time) error {
		evs = append(evs, e)
		return nil
	}); err != nil {
		t.Fatalf("outbox Each: %v", err)
	}
	return evs
}

// checkEvent checks that e is the orders.created event of the order whose
// GET answer is shown.
func checkEvent(t *testing.T, e outbox.Event, shown []byte) {
	t.Helper()
	o := decodeOrder(t, shown)
	if e.ID != EventID(o.ID) || e.Subject != EventSubject || e.OrderingKey != o.UserID {
		t.Errorf("event %s %s key %q, want %s %s key %q", e.ID, e.Subject, e.OrderingKey, EventID(o.ID), EventSubject, o.UserID)
	}
	if !bytes.Equal(e.Body, shown) {
		t.Errorf("event body\n%q\nwant the order as GET shows it\n%q", e.Body, shown)
	}
}

// repoEnv is a repository on a fresh database, its outbox table, a way to
// run a function in a transaction that a repository writes in (as the
// idempotent request's), and a way to refuse orders whose sku is REFUSED.
type repoEnv struct {
	repo   auditedRepository
	table  outbox.Table
	inTx   func(t *testing.T, commit bool, fn func(repo Repository))
	refuse func(t *testing.T)
	// add adds e to the outbox in a transaction of its own.
	add func(t *testing.T, e outbox.Event)
	// exec runs a statement on the database.
	exec func(t *testing.T, query string)
}

func repoEnvs() map[string]func(t *testing.T) repoEnv {
	return map[string]func(t *testing.T) repoEnv{
		"SQLite": func(t *testing.T) repoEnv {
			repo, db := openRepo(t)
			table := sqliteoutbox.New(db)
			return repoEnv{
				repo: repo, table: table,
				inTx: func(t *testing.T, commit bool, fn func(Repository)) {
					tx, err := db.BeginTx(context.Background(), nil)
					if err != nil {
						t.Fatal(err)
					}
					defer tx.Rollback()
					fn(sqliteRepoWith(db, func(context.Context) (sqliteExecer, error) { return tx, nil }))
					if commit {
						if err := tx.Commit(); err != nil {
							t.Fatal(err)
						}
					}
				},
				refuse: func(t *testing.T) {
					if _, err := db.Exec(sqliteRefuseSKU); err != nil {
						t.Fatal(err)
					}
				},
				exec: func(t *testing.T, query string) {
					if _, err := db.Exec(query); err != nil {
						t.Fatal(err)
					}
				},
				add: func(t *testing.T, e outbox.Event) {
					tx, err := db.Begin()
					if err != nil {
						t.Fatal(err)
					}
					defer tx.Rollback()
					if err := table.Add(context.Background(), tx, e); err != nil {
						t.Fatal(err)
					}
					if err := tx.Commit(); err != nil {
						t.Fatal(err)
					}
				},
			}
		},
		"PostgreSQL": func(t *testing.T) repoEnv {
			repo, pool := pgOpenRepo(t)
			table := pgoutbox.New(pool)
			ctx := context.Background()
			return repoEnv{
				repo: repo, table: table,
				inTx: func(t *testing.T, commit bool, fn func(Repository)) {
					tx, err := pool.Begin(ctx)
					if err != nil {
						t.Fatal(err)
					}
					defer tx.Rollback(ctx)
					fn(NewPostgresRepository(pool, func(context.Context) (pgx.Tx, error) { return tx, nil }))
					if commit {
						if err := tx.Commit(ctx); err != nil {
							t.Fatal(err)
						}
					}
				},
				refuse: func(t *testing.T) {
					if _, err := pool.Exec(ctx, pgRefuseSKU); err != nil {
						t.Fatal(err)
					}
				},
				exec: func(t *testing.T, query string) {
					if _, err := pool.Exec(ctx, query); err != nil {
						t.Fatal(err)
					}
				},
				add: func(t *testing.T, e outbox.Event) {
					if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return table.Add(ctx, tx, e) }); err != nil {
						t.Fatal(err)
					}
				},
			}
		},
	}
}

// shownOrder is the order as GET /v1/orders/{id} shows it: read back from
// the repository, encoded as the handler encodes it.
func shownOrder(t *testing.T, repo Repository, user, id string) []byte {
	t.Helper()
	o, err := repo.Get(context.Background(), user, id)
	if err != nil {
		t.Fatalf("Get %s: %v", id, err)
	}
	b, err := marshalJSON(o)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Create writes the order's event in the same savepoint as the order: a
// rolled-back request writes neither, a refused order no event (and the
// request's transaction still commits), an order without its transaction
// both; one event per order; its body is the order as GET shows it, to
// the byte, whatever the precision of created_at.
func TestCreateWritesEventWithOrder(t *testing.T) {
	for name, open := range repoEnvs() {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			e.refuse(t)
			ctx := context.Background()
			// Nanoseconds: SQLite keeps them, PostgreSQL keeps microseconds.
			at := time.Date(2026, 3, 4, 5, 6, 7, 123456789, time.FixedZone("CET", 3600))
			newOrder := func(id, user, sku string) *Order {
				return &Order{
					ID: id, UserID: user, Status: StatusPaid,
					Items: []Item{{SKU: sku, Quantity: 2, UnitPrice: 1299}, {SKU: "<&>\u2028é", Quantity: 1, UnitPrice: 1}},
					Total: 2599, Currency: "EUR", PaymentID: "pi_" + id, CreatedAt: at,
					IdempotencyKey: "k-" + id, KeyCreatedAt: at,
				}
			}

			// Rolled back: neither.
			e.inTx(t, false, func(repo Repository) {
				if err := repo.Create(ctx, newOrder("ord_rolledback", "alice", "A")); err != nil {
					t.Fatal(err)
				}
			})
			if evs := allEvents(t, e.table); len(evs) != 0 {
				t.Fatalf("events after a rolled-back request = %+v, want none", evs)
			}

			// Refused, then a good order in the same request: the request
			// commits, with the good order's event only.
			e.inTx(t, true, func(repo Repository) {
				if err := repo.Create(ctx, newOrder("ord_refused", "alice", "REFUSED")); !errors.Is(err, ErrUnwritable) {
					t.Fatalf("Create of a refused order = %v, want ErrUnwritable", err)
				}
				if err := repo.Create(ctx, newOrder("ord_intx", "alice", "A")); err != nil {
					t.Fatalf("Create after a refusal in the same transaction: %v", err)
				}
			})
			// Without a request: its own transaction.
			if err := e.repo.Create(ctx, newOrder("ord_own", "bob", "B")); err != nil {
				t.Fatal(err)
			}
			// A repeat is ErrExists and adds no event.
			if err := e.repo.Create(ctx, newOrder("ord_own", "bob", "B")); !errors.Is(err, ErrExists) {
				t.Fatalf("second Create = %v, want ErrExists", err)
			}
			e.inTx(t, true, func(repo Repository) {
				if err := repo.Create(ctx, newOrder("ord_intx", "alice", "A")); !errors.Is(err, ErrExists) {
					t.Fatalf("second Create in a request = %v, want ErrExists", err)
				}
			})

			evs := allEvents(t, e.table)
			if len(evs) != 2 {
				t.Fatalf("events = %d (%+v), want 2", len(evs), evs)
			}
			checkEvent(t, evs[0], shownOrder(t, e.repo, "alice", "ord_intx"))
			checkEvent(t, evs[1], shownOrder(t, e.repo, "bob", "ord_own"))
			for _, ev := range evs {
				o := decodeOrder(t, ev.Body)
				if !strings.Contains(string(ev.Body), `"created_at":"2026-03-04T04:06:07.123456`) || !o.CreatedAt.Equal(at.Truncate(time.Microsecond)) && !o.CreatedAt.Equal(at) {
					t.Errorf("event body %s: want created_at in UTC, to the database's precision", ev.Body)
				}
				want, err := EventFor(&o)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(want.Body, ev.Body) || want.ID != ev.ID || want.Subject != ev.Subject || want.OrderingKey != ev.OrderingKey {
					t.Errorf("EventFor of the order read back = %+v, want the event written %+v", want, ev)
				}
			}
			var orders []string
			if err := e.repo.AllOrders(ctx, func(o Order) error { orders = append(orders, o.ID); return nil }); err != nil {
				t.Fatal(err)
			}
			if fmt.Sprint(orders) != "[ord_intx ord_own]" {
				t.Errorf("orders = %v, want [ord_intx ord_own]", orders)
			}
		})
	}
}

// An event that exists without its order makes the order unwritable, and
// the order is rolled back with the event's savepoint: never an order
// without its event.
func TestCreateRollsBackOrderWhenEventFails(t *testing.T) {
	for name, open := range repoEnvs() {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			ctx := context.Background()
			e.add(t, outbox.Event{ID: EventID("ord_orphan"), Subject: EventSubject, OrderingKey: "alice", Body: []byte("{}")})
			o := &Order{ID: "ord_orphan", UserID: "alice", Status: StatusPaid, Items: []Item{{"A", 1, 1}}, Total: 1, Currency: "EUR", PaymentID: "pi", CreatedAt: time.Now().UTC().Truncate(time.Microsecond)}
			e.inTx(t, true, func(repo Repository) {
				err := repo.Create(ctx, o)
				if !errors.Is(err, ErrUnwritable) || !errors.Is(err, outbox.ErrExists) {
					t.Fatalf("Create with its event taken = %v, want ErrUnwritable and outbox.ErrExists", err)
				}
				o2 := *o
				o2.ID = "ord_fine"
				if err := repo.Create(ctx, &o2); err != nil {
					t.Fatalf("Create after the refusal in the same transaction: %v", err)
				}
			})
			if err := e.repo.Create(ctx, o); !errors.Is(err, ErrUnwritable) {
				t.Errorf("Create in its own transaction = %v, want ErrUnwritable", err)
			}
			if _, err := e.repo.Get(ctx, "alice", "ord_orphan"); !errors.Is(err, ErrNotFound) {
				t.Errorf("the order whose event failed was written: %v", err)
			}
			if _, err := e.repo.Get(ctx, "alice", "ord_fine"); err != nil {
				t.Errorf("the other order of the transaction: %v", err)
			}
			if evs := allEvents(t, e.table); len(evs) != 2 {
				t.Errorf("events = %+v, want the orphan and ord_fine's", evs)
			}
		})
	}
}

// eventEnv is the order API on one database, with its outbox table.
type eventEnv struct {
	*testBundle
	table  outbox.Table
	orders func(t *testing.T) int
	// refuse makes the database refuse refusedBody's order.
	refuse func(t *testing.T)
}

func eventEnvs() map[string]func(t *testing.T) eventEnv {
	return map[string]func(t *testing.T) eventEnv{
		"SQLite": func(t *testing.T) eventEnv {
			b := setup(t)
			return eventEnv{b, sqliteoutbox.New(b.store.DB()), b.countOrders, func(t *testing.T) {
				if _, err := b.store.DB().Exec(sqliteRefuseSKU); err != nil {
					t.Fatal(err)
				}
			}}
		},
		"PostgreSQL": func(t *testing.T) eventEnv {
			b := pgSetup(t, nil)
			return eventEnv{b.testBundle, pgoutbox.New(b.pool), b.countOrders, func(t *testing.T) {
				if _, err := b.pool.Exec(context.Background(), pgRefuseSKU); err != nil {
					t.Fatal(err)
				}
			}}
		},
	}
}

// Through the API: one event per order, whatever the replays, whose body
// is the 201 answer and the GET answer byte for byte; a refused order (its
// 422 stored) leaves no event.
func TestOrderEventThroughAPI(t *testing.T) {
	for name, open := range eventEnvs() {
		t.Run(name, func(t *testing.T) {
			e := open(t)
			e.refuse(t)
			type made struct{ user, key, body string }
			var all []made
			for i, user := range []string{"alice", "bob", "alice", "carol"} {
				key := fmt.Sprintf("k-%d", i)
				first := e.post(t, user, key, orderBody)
				if first.status != http.StatusCreated {
					t.Fatalf("POST: %s", first)
				}
				e.clock.Advance(time.Millisecond)
				if again := e.post(t, user, key, orderBody); again.header.Get("Idempotent-Replayed") != "true" || !bytes.Equal(again.body, first.body) {
					t.Fatalf("replay: %s", again)
				}
				all = append(all, made{user, key, string(first.body)})
			}
			e.post(t, "dora", "r-1", refusedBody).wantProblem(t, http.StatusUnprocessableEntity, ProblemOrderNotWritable)
			if got := e.post(t, "dora", "r-1", refusedBody); got.status != http.StatusUnprocessableEntity || got.header.Get("Idempotent-Replayed") != "true" {
				t.Errorf("replay of the refused order = %s, want its stored 422", got)
			}

			evs := allEvents(t, e.table)
			if len(evs) != len(all) || e.orders(t) != len(all) {
				t.Fatalf("events = %d, orders = %d, want %d of each", len(evs), e.orders(t), len(all))
			}
			for i, m := range all {
				o := decodeOrder(t, []byte(m.body))
				got := e.get(t, m.user, "/v1/orders/"+o.ID)
				if got.status != http.StatusOK || !bytes.Equal(got.body, []byte(m.body)) {
					t.Errorf("GET %s = %s, want the 201 body %s", o.ID, got, m.body)
				}
				checkEvent(t, evs[i], got.body)
			}
			if n, err := e.table.Unsent(context.Background()); err != nil || n != len(all) {
				t.Errorf("Unsent = %d, %v; want %d", n, err, len(all))
			}
		})
	}
}

// An attempt whose lease was taken over after it wrote its order and event,
// but before it committed, cannot commit either: the one event is the
// takeover's, with its order's body.
func TestPostgresFencedAttemptWritesNoEvent(t *testing.T) {
	gate := &gateRepo{inserted: make(chan struct{}, 1), release: make(chan struct{}), entered: make(chan struct{}, 1)}
	b := pgSetup(t, func(r Repository) Repository { gate.Repository = r; return gate },
		func(o *setupOptions) { o.idem.Lease = 10 * time.Second })
	slow := b.postAsync(t, "alice", "f-1", orderBody)
	<-gate.inserted // the slow attempt's order and event are written, not committed

	b.clock.Advance(11 * time.Second) // its lease runs out
	fast := b.postAsync(t, "alice", "f-1", orderBody)
	<-gate.entered
	close(gate.release)
	late, won := <-slow, <-fast
	if won.status != http.StatusCreated || late.status == http.StatusCreated {
		t.Fatalf("takeover %s, fenced attempt %s: want one 201", won, late)
	}
	evs := allEvents(t, pgoutbox.New(b.pool))
	if len(evs) != 1 {
		t.Fatalf("events = %+v, want one", evs)
	}
	checkEvent(t, evs[0], won.body)
}
