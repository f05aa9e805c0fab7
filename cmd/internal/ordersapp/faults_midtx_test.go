package ordersapp

import (
	"context"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idem-go/idem/client"
	"github.com/idem-go/idem/cmd/internal/faultproxy"
	"github.com/idem-go/idem/internal/pgtest"
)

// Case 3, at the worst moment: instance A's path to PostgreSQL is
// partitioned in the middle of a request's transaction, after the
// handler's writes and before the transaction ends: before the completion
// (the order INSERTed, uncommitted) or before the COMMIT (the completion's
// UPDATE of the key's row executed, uncommitted). The server keeps A's
// transaction open, and its row locks, for as long as the connection
// lives. Instance B then retries the keys for 5 leases (lease 2s): each
// must end with 201 within them, while A is still cut off. Then the
// partition heals and faultCheck runs. The service sets
// idle_in_transaction_session_timeout to the lease (openPostgres), so the
// server ends A's transaction and frees its locks; before it did, 1 to 3
// of the 5 keys stayed stuck for as long as the partition lasted.
func TestFaultPartitionMidTransaction(t *testing.T) {
	t.Run("before-completion", func(t *testing.T) { faultMidTx(t, faultproxy.BeforeMarked) })
	t.Run("before-commit", func(t *testing.T) { faultMidTx(t, faultproxy.BeforeCommit) })
}

func faultMidTx(t *testing.T, point faultproxy.PartitionPoint) {
	db := pgtest.Database(t)
	c := faultNewChain(t, db)
	pgA := faultproxy.New(t, "pg-a", faultHostPort(t, db), faultCommitCut()...)
	urlA, urlB := pgA.PostgresURL(db), db
	a := faultAddInstance(t, c, urlA, c.payURL, "--key-lease", "2s")
	b := faultAddInstance(t, c, urlB, c.payURL, "--key-lease", "2s")
	const lease = 2 * time.Second

	const n = 5
	s := faultNewStorm("midtx", n, 2, 1)
	user := s.user(0)
	pgA.PartitionAt(point)
	aDone := make(chan struct{}, n)
	hcA := s.client()
	for k := 0; k < n; k++ {
		go func(k int) {
			s.answers[k][0] = faultSend(hcA, a, user, s.key(k), k)
			aDone <- struct{}{}
		}(k)
	}
	for deadline := time.Now().Add(20 * time.Second); pgA.Triggered() == 0; time.Sleep(2 * time.Millisecond) { // a poll with a deadline
		if time.Now().After(deadline) {
			t.Fatalf("no request of A reached %q in 20s", point)
		}
	}
	partitioned := time.Now()

	// B retries every key for 5 leases.
	retryFor := 5 * lease
	hcB := &http.Client{Transport: &client.Transport{Base: s, MaxAttempts: 1000,
		InitialBackoff: 20 * time.Millisecond, MaxBackoff: 500 * time.Millisecond, MaxElapsed: retryFor}}
	var wg sync.WaitGroup
	for k := 0; k < n; k++ {
		wg.Add(1)
		go func(k int) {
			defer wg.Done()
			s.answers[k][1] = faultSend(hcB, b, user, s.key(k), k)
		}(k)
	}
	// What the server holds meanwhile, seen halfway.
	time.Sleep(retryFor / 2) // not waiting for an outcome: samples the server's sessions halfway through B's retries
	sessions := faultSessions(t, db)
	wg.Wait()
	var stuck []string
	for k := 0; k < n; k++ {
		if ans := s.answers[k][1]; ans.status != http.StatusCreated {
			label := fmt.Sprint(ans.status, " ", ans.orderID)
			if ans.err != nil {
				label = "no answer: " + ans.err.Error()
			}
			stuck = append(stuck, fmt.Sprintf("%s (%s; %s)", s.key(k), label, keyState(t, db, s.key(k))))
		}
	}
	t.Logf("A partitioned %q; after %v of B retrying (%d leases), server sessions of the database: %s; keys not answered 201 by B: %d of %d",
		point, time.Since(partitioned).Round(time.Millisecond), int(retryFor/lease), sessions, len(stuck), n)
	if len(stuck) > 0 {
		t.Errorf("KEYS STUCK PAST THEIR LEASE while A is partitioned mid-transaction (%s): %s", point, strings.Join(stuck, "; "))
	}

	// Heal; every key must still end once, and B's stuck clients, retrying
	// again, get the one answer.
	pgA.Heal()
	for i := 0; i < n; i++ {
		<-aDone
	}
	hc := s.client()
	for k := 0; k < n; k++ {
		if s.answers[k][1].status != http.StatusCreated {
			s.answers[k][1] = faultSend(hc, b, user, s.key(k), k)
		}
	}
	res := faultCheck(t, c, s)
	t.Logf("case 3 (partition mid-transaction, %s): %d keys, %d stuck while partitioned, then %d orders, %d payments; A fenced %d",
		point, n, len(stuck), res.orders, res.payments, faultMetric(t, a, "idem_fenced_total"))
}

// faultSessions describes the server's sessions on db's database (other
// than its own): how many are idle in a transaction, and how many wait
// for a lock.
func faultSessions(t *testing.T, db string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, db)
	if err != nil {
		return err.Error()
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT coalesce(state, '') || coalesce(' waiting for ' || wait_event_type || ' ' || wait_event, ''), count(*)
		FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
		GROUP BY 1`)
	if err != nil {
		return err.Error()
	}
	var parts []string
	for rows.Next() {
		var state string
		var n int
		if err := rows.Scan(&state, &n); err == nil && !strings.HasPrefix(state, "idle waiting for Client") {
			parts = append(parts, fmt.Sprintf("%d %s", n, state))
		}
	}
	sort.Strings(parts)
	// Whose the sessions idle in a transaction are, and for how long:
	// their last statement and the time since it ended.
	idle, err := conn.Query(ctx, `SELECT pid, coalesce(application_name, ''), extract(epoch FROM now() - state_change)::float8,
			extract(epoch FROM now() - backend_start)::float8, left(regexp_replace(query, '\s+', ' ', 'g'), 160)
		FROM pg_stat_activity WHERE datname = current_database() AND state LIKE 'idle in transaction%'`)
	if err == nil {
		for idle.Next() {
			var pid int
			var app, q string
			var since, age float64
			if idle.Scan(&pid, &app, &since, &age, &q) == nil {
				parts = append(parts, fmt.Sprintf("[idle in transaction: pid %d app %q for %.1fs (connected %.1fs ago), last statement %q]", pid, app, since, age, q))
			}
		}
		idle.Close()
	}
	return strings.Join(parts, ", ")
}
