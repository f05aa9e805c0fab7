package natsembed_test

import (
	"bytes"
	"errors"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/internal/natsembed"
)

func start(t *testing.T, o natsembed.Options) *natsembed.Server {
	t.Helper()
	s, err := natsembed.Start(o)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(s.Shutdown)
	return s
}

func connect(t *testing.T, url string) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// TestRestartKeepsStreams: a server started again on the same directory
// has the stream, its message and a durable consumer's position.
func TestRestartKeepsStreams(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()

	s := start(t, natsembed.Options{Dir: dir})
	if !strings.HasPrefix(s.URL(), "nats://127.0.0.1:") {
		t.Fatalf("URL %q: want nats://127.0.0.1:<port>", s.URL())
	}
	js := connect(t, s.URL())
	st, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "KEEP", Subjects: []string{"keep.>"}, Storage: jetstream.FileStorage})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if _, err := js.Publish(ctx, "keep.a", []byte{byte('0' + i)}); err != nil {
			t.Fatal(err)
		}
	}
	cons, err := st.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "d", AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	m, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if err := m.DoubleAck(ctx); err != nil {
		t.Fatal(err)
	}
	s.Shutdown()

	s2 := start(t, natsembed.Options{Dir: dir})
	js2 := connect(t, s2.URL())
	st2, err := js2.Stream(ctx, "KEEP")
	if err != nil {
		t.Fatalf("stream after restart: %v", err)
	}
	info, err := st2.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 3 {
		t.Fatalf("messages after restart: %d, want 3", info.State.Msgs)
	}
	cons2, err := st2.Consumer(ctx, "d")
	if err != nil {
		t.Fatalf("consumer after restart: %v", err)
	}
	m2, err := cons2.Next(jetstream.FetchMaxWait(5 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(m2.Data(), []byte("1")) {
		t.Fatalf("next message after restart: %q, want the second one (\"1\")", m2.Data())
	}
}

// TestSameDirTwice: while one server runs on a directory, starting another
// on it (at once, from several goroutines) fails with ErrDirInUse for all
// but one; after Shutdown the directory is free again.
func TestSameDirTwice(t *testing.T) {
	dir := t.TempDir()
	const n = 4
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		started []*natsembed.Server
		errs    []error
	)
	for range n {
		wg.Go(func() {
			s, err := natsembed.Start(natsembed.Options{Dir: dir})
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
				return
			}
			started = append(started, s)
		})
	}
	wg.Wait()
	for _, s := range started {
		t.Cleanup(s.Shutdown)
	}
	if len(started) != 1 {
		t.Fatalf("%d servers started on one directory, want 1 (errors: %v)", len(started), errs)
	}
	for _, err := range errs {
		if !errors.Is(err, natsembed.ErrDirInUse) {
			t.Fatalf("second Start: %v, want ErrDirInUse", err)
		}
	}
	started[0].Shutdown()
	start(t, natsembed.Options{Dir: dir})
}

// TestPortInUse: a port another server holds fails Start with the
// server's reason, well before the ready timeout.
func TestPortInUse(t *testing.T) {
	s := start(t, natsembed.Options{Dir: t.TempDir()})
	_, portStr, err := net.SplitHostPort(strings.TrimPrefix(s.URL(), "nats://"))
	if err != nil {
		t.Fatal(err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		t.Fatal(err)
	}
	var logs bytes.Buffer
	var mu sync.Mutex
	h := slog.NewTextHandler(&lockedWriter{mu: &mu, w: &logs}, nil)
	_, err = natsembed.Start(natsembed.Options{Dir: t.TempDir(), Port: port, Logger: slog.New(h), ReadyTimeout: time.Minute})
	if err == nil {
		t.Fatal("second server on a used port started")
	}
	if !strings.Contains(err.Error(), "listening") {
		t.Fatalf("error %q does not name the listen failure", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if !strings.Contains(logs.String(), "nats-server: ") {
		t.Fatalf("logger got nothing: %q", logs.String())
	}
}

func TestOptionsRefused(t *testing.T) {
	for _, o := range []natsembed.Options{
		{},
		{Dir: t.TempDir(), Host: "0.0.0.0"},
		{Dir: t.TempDir(), Host: "example.com"},
		{Dir: t.TempDir(), Port: 70000},
	} {
		if s, err := natsembed.Start(o); err == nil {
			s.Shutdown()
			t.Errorf("Start(%+v) succeeded", o)
		}
	}
}

// TestShutdownTwice: after Shutdown nothing listens on the URL; a second
// Shutdown is a no-op.
func TestShutdownTwice(t *testing.T) {
	s := start(t, natsembed.Options{Dir: t.TempDir(), Host: "localhost"})
	nc, err := nats.Connect(s.URL())
	if err != nil {
		t.Fatal(err)
	}
	nc.Close()
	s.Shutdown()
	s.Shutdown()
	if nc, err := nats.Connect(s.URL(), nats.Timeout(5*time.Second)); err == nil {
		nc.Close()
		t.Fatal("connected after Shutdown")
	}
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
