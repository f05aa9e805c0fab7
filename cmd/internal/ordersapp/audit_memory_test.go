package ordersapp

import (
	"context"
	"log/slog"
	"net"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/idem-go/idem/internal/natstest"
	"github.com/idem-go/idem/internal/pgtest"
)

// TestAuditMemoryDoesNotGrowWithOrders: the audit's heap at its peak is
// the same for 3,000 orders and for five times as many. Its sorts hold a
// small buffer here (32 KB, so that both sizes spill to disk and merge their
// runs), and NATS runs in a process of its own, so that the heap measured
// is the audit's. An audit that kept a map of the orders (about 2.2 KB per
// order) would grow by about 26 MB.
func TestAuditMemoryDoesNotGrowWithOrders(t *testing.T) {
	skipInShort(t, "seeds 15,000 orders, audits them at 3,000 and at 15,000")
	t.Run("sqlite", func(t *testing.T) { auditMemoryFlat(t, "") })
	t.Run("postgres", func(t *testing.T) { auditMemoryFlat(t, pgtest.Database(t)) })
}

func auditMemoryFlat(t *testing.T, dbURL string) {
	const small, large = 3_000, 15_000
	ctx := context.Background()
	c := Config{DataDir: t.TempDir(), DatabaseURL: dbURL, NATSURL: startNATSServer(t), JWTSecret: testSecret, KeyTTL: time.Hour,
		KeyLease: seedKeyLease, PaymentsKey: seedPaymentsKey, RequireKey: true}
	srv, err := (&App{}).newServer(ctx, &c, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.close()

	peak := func(n int) uint64 {
		t.Helper()
		var rep *auditReport
		p := peakHeap(t, func() {
			rep, err = auditWith(ctx, srv.backend, srv.payer, srv.broker.js, auditOptions{TempDir: t.TempDir(), SortBuffer: 32 << 10})
		})
		if err != nil {
			t.Fatalf("audit of %d orders: %v", n, err)
		}
		if rep.Orders != n || rep.events.StreamMsgs != n || rep.events.Receipts != n || len(rep.Violations) != 0 {
			t.Fatalf("audit of %d orders: %d orders, %d messages, %d receipts, violations %q", n, rep.Orders, rep.events.StreamMsgs, rep.events.Receipts, rep.Violations)
		}
		return p
	}
	if err := seedAudit(ctx, t, srv.backend, srv.broker.js, 0, small); err != nil {
		t.Fatal(err)
	}
	atSmall := peak(small)
	if err := seedAudit(ctx, t, srv.backend, srv.broker.js, small, large-small); err != nil {
		t.Fatal(err)
	}
	atLarge := peak(large)
	t.Logf("peak heap: %.1f MB at %d orders, %.1f MB at %d", float64(atSmall)/(1<<20), small, float64(atLarge)/(1<<20), large)
	if grew := int64(atLarge) - int64(atSmall); grew > 6<<20 {
		t.Errorf("the audit's peak heap grew by %.1f MB from %d to %d orders (%d bytes per order); want it flat (under 6 MB of noise)",
			float64(grew)/(1<<20), small, large, grew/(large-small))
	}
}

// peakHeap runs f and returns the most heap its objects took meanwhile,
// sampled every millisecond, with the collector kept close to the live
// heap (GOGC 10) so that the figure follows what f holds, not when the
// collector last ran.
func peakHeap(t *testing.T, f func()) uint64 {
	t.Helper()
	defer debug.SetGCPercent(debug.SetGCPercent(10))
	runtime.GC()
	sample := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	var top atomic.Uint64
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			metrics.Read(sample)
			if v := sample[0].Value.Uint64(); v > top.Load() {
				top.Store(v)
			}
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	}()
	f()
	close(done)
	<-stopped
	return top.Load()
}

// startNATSServer starts a nats-server process with JetStream on a free
// port of 127.0.0.1, stopped when t ends, and returns its URL.
func startNATSServer(t *testing.T) string {
	t.Helper()
	bin := natstest.RequireServerBinary(t)
	addr := freeAddr(t)
	host, port, _ := net.SplitHostPort(addr)
	cmd := exec.Command(bin, "-a", host, "-p", port, "-js", "-sd", filepath.Join(t.TempDir(), "nats"))
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		_ = cmd.Wait() // killed: its exit status says so
	})
	url := "nats://" + addr
	for deadline := time.Now().Add(20 * time.Second); ; {
		nc, err := nats.Connect(url)
		if err == nil {
			nc.Close()
			return url
		}
		if time.Now().After(deadline) {
			t.Fatalf("nats-server on %s: %v", addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
