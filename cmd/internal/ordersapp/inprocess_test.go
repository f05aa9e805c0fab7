package ordersapp

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net"
	neturl "net/url"
	"strings"
	"sync"
	"testing"
)

// inProcess is an order service built from a Config by newServer and
// serving on a loopback port, as `orders serve` does.
type inProcess struct {
	srv  *server
	base string
	logs *syncBuffer
	stop func() // stops it; also called when the test ends
}

// startInProcess builds the service c describes and serves it on
// 127.0.0.1 until t ends or stop is called; then it shuts down, waits for
// the background loops and closes the database.
func startInProcess(t *testing.T, c *Config) *inProcess {
	t.Helper()
	logs := new(syncBuffer)
	logger := slog.New(slog.NewTextHandler(logs, nil))
	ctx, cancel := context.WithCancel(context.Background())
	srv, err := (&App{}).newServer(ctx, c, logger)
	if err != nil {
		cancel()
		t.Fatalf("newServer: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		cancel()
		srv.close()
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.run(ctx, ln) }()
	stop := sync.OnceFunc(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("server: %v", err)
		}
		srv.close()
		if t.Failed() && logs.String() != "" {
			t.Logf("server logs (last lines):\n%s", tail(logs.String(), 40))
		}
	})
	t.Cleanup(stop)
	return &inProcess{srv: srv, base: "http://" + ln.Addr().String(), logs: logs, stop: stop}
}

// tail returns the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = append([]string{fmt.Sprintf("… %d lines before", len(lines)-n)}, lines[len(lines)-n:]...)
	}
	return strings.Join(lines, "\n")
}

// withApplicationName returns dbURL with application_name set, so that the
// connections of the pools opened on it can be told from everyone else's.
func withApplicationName(t *testing.T, dbURL, name string) string {
	t.Helper()
	u, err := neturl.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	q.Set("application_name", name)
	u.RawQuery = q.Encode()
	return u.String()
}

func randomSuffix() string {
	var b [6]byte
	rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
