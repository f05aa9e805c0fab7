package idemnats_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/internal/natsembed"
)

// defaultCINATSURL is the machine's NATS, used under CI=true when
// TEST_NATS_URL is unset.
const defaultCINATSURL = "nats://127.0.0.1:4222"

// server is the NATS server a subtest runs against.
type server struct {
	name string // "embedded" or "external"
	url  string
}

// conn returns a new connection to the server, closed when t ends.
func (s server) conn(t *testing.T) *nats.Conn {
	t.Helper()
	return dial(t, s.url)
}

// js returns a JetStream context on a new connection.
func (s server) js(t *testing.T) jetstream.JetStream {
	t.Helper()
	js, err := jetstream.New(s.conn(t))
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// forEach runs f in two subtests: against an embedded server of its own
// (natsembed in a temporary directory) and against the external one at
// TEST_NATS_URL.
func forEach(t *testing.T, f func(t *testing.T, srv server)) {
	t.Run("embedded", func(t *testing.T) {
		s, err := natsembed.Start(natsembed.Options{Dir: t.TempDir()})
		if err != nil {
			t.Fatalf("natsembed: %v", err)
		}
		t.Cleanup(s.Shutdown)
		f(t, server{name: "embedded", url: s.URL()})
	})
	t.Run("external", func(t *testing.T) {
		f(t, server{name: "external", url: natsURL(t)})
	})
}

// natsURL returns the external NATS the tests use: TEST_NATS_URL, or under
// CI=true the machine's. Elsewhere, without TEST_NATS_URL, the test is
// skipped.
func natsURL(t *testing.T) string {
	t.Helper()
	if u := os.Getenv("TEST_NATS_URL"); u != "" {
		return u
	}
	if os.Getenv("CI") == "true" {
		return defaultCINATSURL
	}
	t.Skip("idemnats: external NATS tests skipped: set TEST_NATS_URL (for example " + defaultCINATSURL + ") or CI=true")
	return ""
}

// dial connects to url, failing t when the server does not answer.
func dial(t *testing.T, url string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, nats.Timeout(5*time.Second), nats.MaxReconnects(-1))
	if err != nil {
		t.Fatalf("NATS at %s does not answer: %v", url, err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// unique returns a name of t's own: IDEMNATS_T_<hex>, for streams and
// (lower-cased) subjects, so that tests may share the external server.
func unique() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "IDEMNATS_T_" + strings.ToUpper(hex.EncodeToString(b[:]))
}

// deleteStream removes a test's stream when t ends (the external server
// outlives the test); never called with ORDERS.
func deleteStream(t *testing.T, js jetstream.JetStream, name string) {
	t.Helper()
	if name == "ORDERS" || !strings.HasPrefix(name, "IDEMNATS_T_") {
		t.Fatalf("refusing to delete stream %q", name)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := js.DeleteStream(ctx, name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			t.Errorf("delete stream %s: %v", name, err)
		}
	})
}
