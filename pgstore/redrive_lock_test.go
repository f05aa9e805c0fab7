package pgstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/pgstore"
)

// TestRedriveDoesNotWaitForAnAttempt: Redrive of a key whose attempt
// is running answers at once that it is in flight, even when the
// attempt's transaction holds a lock on the key's row that no claim
// conflicts with. A handler takes one as soon as it writes a row with a
// foreign key to idempotency_keys (FOR KEY SHARE, held to its commit):
// Claim and the fenced Complete only update non-key columns (FOR NO KEY
// UPDATE), which do not conflict with it.
//
// FINDING (fails): Redrive reads the row with SELECT … FOR UPDATE, which
// conflicts with FOR KEY SHARE, so the operator's `orders keys redrive`
// (or any Redrive) hangs for as long as the handler's transaction is
// open, then fails on its context instead of being refused. FOR NO KEY
// UPDATE (Redrive only sets redrives) keeps the check-and-set atomic
// without waiting for a live attempt.
func TestRedriveDoesNotWaitForAnAttempt(t *testing.T) {
	pool := migratedPool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE rdv_orders (
		user_id text NOT NULL, key text NOT NULL,
		FOREIGN KEY (user_id, key) REFERENCES idempotency_keys (user_id, key))`); err != nil {
		t.Fatal(err)
	}
	s := pgstore.New(pool, pgstore.Options{})
	cl, err := s.Claim(ctx, idemdriver.ClaimParams{User: "u", Key: "k", Fingerprint: "fp", Owner: idemdriver.NewOwner(),
		Method: "POST", Path: "/v1/orders", Lease: time.Minute})
	if err != nil || cl.Lease == nil {
		t.Fatalf("Claim = %+v, %v", cl, err)
	}
	tx, err := s.Begin(ctx, cl.Lease)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.(*pgstore.Tx).PgxTx().Exec(ctx, `INSERT INTO rdv_orders VALUES ($1, $2)`, "u", "k"); err != nil {
		t.Fatal(err)
	}
	// A duplicate's claim is not held up by the handler's lock.
	dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := s.Claim(dctx, idemdriver.ClaimParams{User: "u", Key: "k", Fingerprint: "fp", Owner: idemdriver.NewOwner(), Lease: time.Minute}); !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("a duplicate's claim = %v; want in flight, at once", err)
	}
	rctx, cancel2 := context.WithTimeout(ctx, 2*time.Second)
	defer cancel2()
	start := time.Now()
	n, err := s.Redrive(rctx, "u", "k", 0)
	var ng *idemdriver.NotGivenUpError
	if !errors.As(err, &ng) || ng.State != idemdriver.KeyInFlight {
		t.Errorf("Redrive of a key in flight = %d, %v after %v; want refused (in-flight) at once", n, err, time.Since(start).Round(time.Millisecond))
	}
	// The attempt still completes.
	if err := tx.Complete(ctx, &idemdriver.Response{Status: 201}); err != nil {
		t.Errorf("Complete after the Redrive: %v", err)
	}
}

// TestRedriveDoesNotHoldUpATakeover: a Redrive of a key whose slow
// attempt's transaction holds a FOR KEY SHARE lock on it (as above, the
// attempt's lease ran out) answers without waiting for that lock (the
// key is abandoned, not given up: refused), and a client's retry that
// takes the key over is not made to wait either. (Written when Redrive
// read FOR UPDATE and queued behind the KEY SHARE lock: the takeover's
// UPDATE did not queue behind it. Since Redrive reads FOR NO KEY UPDATE
// it no longer waits at all; the test accepts either and checks the
// takeover.)
func TestRedriveDoesNotHoldUpATakeover(t *testing.T) {
	pool := migratedPool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `CREATE TABLE rdv_orders (
		user_id text NOT NULL, key text NOT NULL,
		FOREIGN KEY (user_id, key) REFERENCES idempotency_keys (user_id, key))`); err != nil {
		t.Fatal(err)
	}
	clk := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	var now = func() time.Time { return clk }
	s := pgstore.New(pool, pgstore.Options{Now: func() time.Time { return now() }})
	p := idemdriver.ClaimParams{User: "u", Key: "k", Fingerprint: "fp", Owner: idemdriver.NewOwner(), Method: "POST", Path: "/v1/orders", Lease: time.Second}
	cl, err := s.Claim(ctx, p)
	if err != nil || cl.Lease == nil {
		t.Fatalf("Claim = %+v, %v", cl, err)
	}
	tx, err := s.Begin(ctx, cl.Lease)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.(*pgstore.Tx).PgxTx().Exec(ctx, `INSERT INTO rdv_orders VALUES ($1, $2)`, "u", "k"); err != nil {
		t.Fatal(err)
	}
	later := clk.Add(time.Minute) // the slow attempt's lease ran out
	now = func() time.Time { return later }

	redriveDone := make(chan error, 1)
	rctx, cancelR := context.WithTimeout(ctx, 4*time.Second)
	defer cancelR()
	go func() {
		_, err := s.Redrive(rctx, "u", "k", 0)
		redriveDone <- err
	}()
	// Wait until the Redrive is queued on the row's lock or has answered.
	var redriveErr error
	redriveAnswered := false
	deadline := time.Now().Add(3 * time.Second)
	for !redriveAnswered {
		select {
		case redriveErr = <-redriveDone:
			redriveAnswered = true
			continue
		default:
		}
		var waiting int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%FOR %UPDATE%' AND query LIKE '%idempotency_keys%'`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the Redrive neither answered nor waited on the row")
		}
		time.Sleep(5 * time.Millisecond) // a poll with a deadline: ends as soon as the Redrive answers or waits
	}
	if redriveAnswered {
		var ng *idemdriver.NotGivenUpError
		if !errors.As(redriveErr, &ng) || ng.State != idemdriver.KeyAbandoned {
			t.Errorf("Redrive of the abandoned key = %v; want refused (abandoned)", redriveErr)
		}
	}
	q := p
	q.Owner = idemdriver.NewOwner()
	cctx, cancelC := context.WithTimeout(ctx, time.Second)
	defer cancelC()
	start := time.Now()
	cl2, err := s.Claim(cctx, q)
	if err != nil || cl2.Lease == nil {
		t.Errorf("the client's takeover while Redrive waits = %+v, %v after %v; want a lease at once", cl2, err, time.Since(start).Round(time.Millisecond))
	}
	cancelR()
	if !redriveAnswered {
		if err := <-redriveDone; err != nil {
			t.Logf("the Redrive, cancelled: %v", err) // it waited: its answer says nothing more
		}
	}
}
