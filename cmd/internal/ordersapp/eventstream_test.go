package ordersapp

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/internal/testwait"
)

// streamServe is a serve on dir and the database db (a postgres:// URL,
// or sqlite:PATH), on the embedded NATS unless nats is set.
func streamServe(dir, db, nats string) *Config {
	return &Config{DataDir: dir, DatabaseURL: db, NATSURL: nats, StreamReplicas: 1, JWTSecret: testSecret,
		KeyTTL: time.Hour, KeyLease: 30 * time.Second, PaymentsKey: "sk_test_local", RequireKey: true, Consume: true}
}

// TestSharedDatabaseOneStream: on one database, a second instance with a
// data dir (so an embedded NATS) of its own is refused at start, with a
// message naming --nats-url, while the first runs and after it stopped;
// so are `orders consume` and `orders audit` on that data dir. The first
// restarts on its own data dir. An instance given --nats-url records that
// NATS's stream instead (with a warning), after which no embedded NATS
// starts on the database. Before, each instance started its own embedded
// NATS and the relays split the events between two streams.
func TestSharedDatabaseOneStream(t *testing.T) {
	t.Parallel()
	dbs := map[string]func(t *testing.T) string{
		"postgres": func(t *testing.T) string { return pgtest.Database(t) },
		"sqlite":   func(t *testing.T) string { return "sqlite:" + filepath.Join(t.TempDir(), "shared.db") },
	}
	for name, newDB := range dbs {
		t.Run(name, func(t *testing.T) {
			db := newDB(t)
			dirA, dirB := t.TempDir(), t.TempDir()
			ordersBin, _ := binaries(t)

			a := startInProcess(t, streamServe(dirA, db, ""))
			if st := call(t, "POST", a.base+"/v1/orders", token(t, "alice"), "one-stream-1", orderBody(1)); st.status != 201 {
				t.Fatalf("POST: %d %s", st.status, st.body)
			}
			quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
			refused := func(when string) {
				t.Helper()
				srv, err := (&App{}).newServer(context.Background(), streamServe(dirB, db, ""), quiet)
				if err == nil {
					srv.close()
					t.Fatalf("%s: a second instance on the database started an embedded NATS of its own", when)
				}
				if !errors.Is(err, errOtherStream) || !strings.Contains(err.Error(), "--nats-url") {
					t.Fatalf("%s: second instance: %v; want the other-stream refusal naming --nats-url", when, err)
				}
			}
			refused("while the first runs")
			for _, cmd := range []string{"consume", "audit"} {
				code, _, stderr := run(t, nil, cmd, "--data-dir", dirB, "--database-url", db)
				if code == 0 || !strings.Contains(stderr, "--nats-url") || !strings.Contains(stderr, "event_stream") {
					t.Errorf("orders %s on the other data dir: exit %d, stderr %q; want a refusal naming --nats-url", cmd, code, stderr)
				}
			}
			a.stop()
			refused("after the first stopped")

			// The first instance comes back on its own data dir: its stream.
			a = startInProcess(t, streamServe(dirA, db, ""))
			if st := call(t, "POST", a.base+"/v1/orders", token(t, "alice"), "one-stream-2", orderBody(2)); st.status != 201 {
				t.Fatalf("POST after the restart: %d %s", st.status, st.body)
			}
			out := auditOut(t, ordersBin, "--data-dir", dirA, "--database-url", db)
			testwait.Until(t, 20*time.Second, "the audit of the first data dir to be clean", func() bool {
				out = auditOut(t, ordersBin, "--data-dir", dirA, "--database-url", db)
				return strings.Contains(out, "events pending:    0 unsent (the relay), 0 in the stream without a receipt")
			})
			a.stop()

			// The fleet moves to one NATS: the database records its stream,
			// and says what it replaced.
			nats := testNATS(t)
			c := startInProcess(t, streamServe(dirB, db, nats))
			testwait.Until(t, 20*time.Second, "the warning about the stream replaced", func() bool {
				return strings.Contains(c.logs.String(), "went to another stream ORDERS until now")
			})
			c.stop()
			srv, err := (&App{}).newServer(context.Background(), streamServe(dirA, db, ""), quiet)
			if err == nil {
				srv.close()
				t.Fatal("an instance on the embedded NATS started after the database moved to --nats-url")
			}
			if !errors.Is(err, errOtherStream) {
				t.Fatalf("embedded after the move: %v, want the other-stream refusal", err)
			}
		})
	}
}
