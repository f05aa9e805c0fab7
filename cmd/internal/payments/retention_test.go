package payments

import (
	"context"
	"log/slog"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/internal/testwait"
	"github.com/idem-go/idem/memstore"
	"github.com/idem-go/idem/storetest"
)

// TestKeyRetention: a key is kept for Config.KeyRetention (default 24h,
// as at Stripe): within it a repeat replays, after it the key starts a new
// payment.
func TestKeyRetention(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		retention, want time.Duration
	}{
		{0, 24 * time.Hour},
		{48 * time.Hour, 48 * time.Hour},
		{time.Second, time.Second},
	} {
		srv, b := setup(t, Config{KeyRetention: tc.retention})
		wantStatus(t, create(t, srv, "k", chargeForm(100, "pm_card_visa")), http.StatusOK)
		rec, err := b.gw.cfg.Store.Get(ctx, AccountFor(testKey), "k")
		if err != nil {
			t.Fatal(err)
		}
		if got := rec.ExpiresAt.Sub(rec.CreatedAt); got != tc.want {
			t.Errorf("KeyRetention %v: key kept for %v, want %v", tc.retention, got, tc.want)
		}
	}

	clock := storetest.NewClock(time.Now())
	srv, b := setup(t, Config{KeyRetention: 500 * time.Millisecond, Store: memstore.New(memstore.Options{Now: clock.Now})})
	first := create(t, srv, "k", chargeForm(100, "pm_card_visa"))
	wantStatus(t, first, http.StatusOK)
	if r := create(t, srv, "k", chargeForm(100, "pm_card_visa")); r.header.Get("Idempotent-Replayed") != "true" {
		t.Error("a repeat within the retention was not replayed")
	}
	clock.Advance(700 * time.Millisecond)
	if r := create(t, srv, "k", chargeForm(100, "pm_card_visa")); r.status != http.StatusOK || r.header.Get("Idempotent-Replayed") == "true" {
		t.Errorf("a repeat after the retention: status %d, replayed %q; want a new payment", r.status, r.header.Get("Idempotent-Replayed"))
	}
	if got, want := b.ledger.Len(), 2; got != want {
		t.Errorf("ledger holds %d, want %d", got, want)
	}
}

// TestDeleteExpiredKeys: on every backend the cleaner deletes a key older
// than the retention, keeps one within it, and keeps an expired key whose
// request is still running until it has finished.
func TestDeleteExpiredKeys(t *testing.T) {
	forEachBackend(t, func(t *testing.T, be testBackend) {
		t.Parallel()
		ctx := context.Background()
		// The keys' clock is the test's; the slow request's latency is
		// real time, under half the retention (the lease's bound: see
		// MaxLatency), and long enough for the checks below to run while
		// it does.
		const retention, latency = 10 * time.Second, 4 * time.Second
		clock := storetest.NewClock(time.Now())
		db := be.open(t, clock.Now)
		srv, b := setup(t, Config{Store: db.store, Ledger: db.ledger, KeyRetention: retention})
		slow, sb := setup(t, Config{Store: db.store, Ledger: db.ledger, KeyRetention: retention, Latency: latency})
		gw := b.gw

		wantStatus(t, create(t, srv, "old", chargeForm(100, "pm_card_visa")), http.StatusOK)
		var wg sync.WaitGroup
		wg.Add(1)
		var busy result
		go func() {
			defer wg.Done()
			busy, _ = post(slow, testKey, "busy", chargeForm(100, "pm_card_visa"))
		}()
		testwait.Until(t, 0, "the busy request to be running", func() bool { return sb.metrics.Executions.Load() > 0 })
		clock.Advance(retention + 200*time.Millisecond)
		wantStatus(t, create(t, srv, "new", chargeForm(100, "pm_card_visa")), http.StatusOK)
		if got, want := db.keys(t), 3; got != want {
			t.Fatalf("keys before cleaning = %d, want %d", got, want)
		}
		n, err := gw.DeleteExpiredKeys(ctx, 100)
		if err != nil {
			t.Fatal(err)
		}
		if n != 1 || db.keys(t) != 2 {
			t.Errorf("deleted %d, %d keys left; want the old key deleted, the new and the running ones kept", n, db.keys(t))
		}

		wg.Wait()
		wantStatus(t, busy, http.StatusOK)
		// A key that completes after its expiry may be kept for the
		// retention from then on.
		clock.Advance(retention + 300*time.Millisecond)
		n, err = gw.CleanExpiredKeys(ctx, CleanOptions{Batch: 1})
		if err != nil {
			t.Fatal(err)
		}
		if n != 2 || db.keys(t) != 0 {
			t.Errorf("deleted %d, %d keys left; want the finished and the new key deleted once expired", n, db.keys(t))
		}
		if got, want := db.count(t), 3; got != want {
			t.Errorf("ledger holds %d PaymentIntents, want %d: cleaning deletes keys only", got, want)
		}
	})
}

// TestCleanLoop: `payments serve`'s cleaner deletes expired keys on its
// own, batch after batch.
func TestCleanLoop(t *testing.T) {
	srv, b := setup(t, Config{KeyRetention: 100 * time.Millisecond})
	for _, k := range []string{"a", "b", "c"} {
		wantStatus(t, create(t, srv, k, chargeForm(100, "pm_card_visa")), http.StatusOK)
	}
	st := b.gw.cfg.Store.(interface{ Len() int })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		b.gw.NewCleaner(idem.CleanerOptions{Interval: 20 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)}).Run(ctx)
	}()
	testwait.Until(t, 5*time.Second, "the cleaner to delete every expired key", func() bool { return st.Len() == 0 })
	cancel()
	<-done
}
