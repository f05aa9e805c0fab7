package ordersapp

// The order events end to end (issue 14): orders → outbox → relay →
// JetStream stream ORDERS → receipts consumer, and `orders audit`'s
// invariants 5 and 6. On SQLite with the embedded NATS (found through
// <data-dir>/nats.url by `orders consume` and `orders audit`), and on
// PostgreSQL with the external NATS at TEST_NATS_URL (two serve instances
// and an `orders consume` process). The external-server tests delete and
// recreate stream ORDERS on it: they never run in parallel (no
// t.Parallel).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/internal/natsembed"
	"github.com/idem-go/idem/internal/pgtest"
	"github.com/idem-go/idem/internal/testwait"
	"github.com/idem-go/idem/outbox"
)

// testNATS starts a NATS server with JetStream for one test, its files in
// t.TempDir(), and returns its URL: the one NATS that the several
// instances of a test share (as a deployment of several instances shares
// one, through --nats-url). It is shut down when t ends, after the
// processes started later (t.Cleanup runs last in, first out).
func testNATS(t *testing.T) string {
	t.Helper()
	srv, err := natsembed.Start(natsembed.Options{Dir: t.TempDir()})
	if err != nil {
		t.Fatalf("starting a test NATS: %v", err)
	}
	t.Cleanup(srv.Shutdown)
	return srv.URL()
}

// externalNATS returns the URL of the external NATS the tests may use
// (TEST_NATS_URL), or skips t outside CI when it is unset; under CI=true
// it defaults to nats://127.0.0.1:4222 and must answer. It deletes stream
// ORDERS there (the durable consumer goes with it): each test starts with
// none, and serve creates it.
func externalNATS(t *testing.T) string {
	t.Helper()
	u := os.Getenv("TEST_NATS_URL")
	if u == "" {
		if os.Getenv("CI") != "true" {
			t.Skip("external NATS tests skipped: set TEST_NATS_URL (e.g. nats://127.0.0.1:4222) or CI=true")
		}
		u = "nats://127.0.0.1:4222"
	}
	js := natsJS(t, u)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := js.DeleteStream(ctx, eventStream); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatalf("deleting stream %s on %s: %v", eventStream, u, err)
	}
	return u
}

// natsJS connects to url for the test's own look at the stream, with
// opts (the embedded server's token: embeddedJS).
func natsJS(t *testing.T, url string, opts ...nats.Option) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(url, append([]nats.Option{nats.Timeout(5 * time.Second)}, opts...)...)
	if err != nil {
		t.Fatalf("NATS at %s does not answer: %v", url, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// embeddedJS connects to the embedded NATS of the serve running on dir,
// through the URL it wrote to <data-dir>/nats.url, with the token of
// <data-dir>/nats.token, as an operator on the machine can.
func embeddedJS(t *testing.T, dir string) jetstream.JetStream {
	t.Helper()
	return natsJS(t, embeddedURL(t, dir), nats.Token(embeddedToken(t, dir)))
}

// embeddedURL is the URL the serve running on dir wrote to
// <data-dir>/nats.url.
func embeddedURL(t *testing.T, dir string) string {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, natsURLFile))
	if err != nil {
		t.Fatalf("serve did not write %s: %v", natsURLFile, err)
	}
	return strings.TrimSpace(string(raw))
}

// embeddedToken is the embedded NATS server's token, kept in
// <data-dir>/nats.token.
func embeddedToken(t *testing.T, dir string) string {
	t.Helper()
	tok, err := natsembed.ReadToken(filepath.Join(dir, natsTokenFile))
	if err != nil {
		t.Fatalf("the embedded NATS server's token: %v", err)
	}
	return tok
}

// eventStorm sends n orders, each key sent by copies clients at once
// through the retrying client, spread over bases, and fails t unless every
// copy got 201.
func eventStorm(t *testing.T, bases []string, prefix string, n, copies int) {
	t.Helper()
	bad, first := stormOrders(bases, prefix, n, copies)
	for _, f := range first {
		t.Error(f)
	}
	if bad > 0 {
		t.Fatalf("%d of %d copies did not get 201", bad, n*copies)
	}
}

// stormOrders is eventStorm's work without a testing.T, for a test that
// runs it in a goroutine while it does something to the servers: it
// returns how many copies did not get 201 and the first five of them.
func stormOrders(bases []string, prefix string, n, copies int) (bad int64, first []string) {
	hc := retrying()
	var (
		wg sync.WaitGroup
		mu sync.Mutex // guards bad, first
	)
	sem := make(chan struct{}, 16)
	for k := 0; k < n; k++ {
		for c := 0; c < copies; c++ {
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer func() { <-sem; wg.Done() }()
				if s, err := post(hc, bases[(k+c)%len(bases)], fmt.Sprintf("%s-user-%d", prefix, k%4), fmt.Sprintf("%s-%d", prefix, k), k); s != http.StatusCreated {
					mu.Lock()
					defer mu.Unlock()
					if bad++; bad <= 5 {
						first = append(first, fmt.Sprintf("order %d copy %d: %d %v", k, c, s, err))
					}
				}
			}()
		}
	}
	wg.Wait()
	return bad, first
}

// waitConsumed waits until the durable consumer has nothing waiting and
// nothing unacknowledged.
func waitConsumed(t *testing.T, js jetstream.JetStream, timeout time.Duration) {
	t.Helper()
	testwait.Until(t, timeout, "the receipts consumer to acknowledge every message", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		cons, err := js.Consumer(ctx, eventStream, receiptsDurable)
		if err != nil {
			return false
		}
		info, err := cons.Info(ctx)
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && info.Delivered.Stream > 0
	})
}

// streamState returns stream ORDERS' message count.
func streamMsgs(t *testing.T, js jetstream.JetStream) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, eventStream)
	if err != nil {
		return 0
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Msgs
}

// republish publishes event id (with body) again by hand, as a relay that
// lost its mark would. With pastWindow, the stream's duplicate window is
// shrunk first so that JetStream keeps the repeat (a relay down longer
// than the window), and restored after; otherwise JetStream must drop it.
func republish(t *testing.T, js jetstream.JetStream, id string, body []byte, pastWindow bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	msg := &nats.Msg{Subject: eventSubject, Data: body, Header: nats.Header{}}
	msg.Header.Set(jetstream.MsgIDHeader, id)
	if !pastWindow {
		ack, err := js.PublishMsg(ctx, msg)
		if err != nil {
			t.Fatal(err)
		}
		if !ack.Duplicate {
			t.Fatalf("a repeat of %s within the duplicate window was kept (seq %d)", id, ack.Sequence)
		}
		return
	}
	st, err := js.Stream(ctx, eventStream)
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	shrinkDuplicateWindow(ctx, t, js, cfg)
	defer func() {
		if _, err := js.UpdateStream(context.Background(), cfg); err != nil {
			t.Errorf("restoring the duplicate window: %v", err)
		}
	}()
	testwait.Until(t, 10*time.Second, "a repeat of "+id+" past the duplicate window", func() bool {
		ack, err := js.PublishMsg(ctx, msg)
		if err != nil {
			t.Fatal(err)
		}
		return !ack.Duplicate
	})
}

// shrinkDuplicateWindow sets stream ORDERS' duplicate window (cfg, the
// stream's configuration) to 100ms, so that JetStream forgets the ids
// stored more than 100ms ago.
//
// It sets it twice, to 101ms and then to 100ms: on a change of the
// window, the server (nats-server 2.15, stream.update) fires its purge of
// old ids at once, but stores the new window only later in the same
// update. A purge that runs in between (under load, it does) reads the
// old window (2m), keeps every id and schedules the next purge that far
// ahead. The second update fires the purge again with the first one's
// window already stored.
func shrinkDuplicateWindow(ctx context.Context, t *testing.T, js jetstream.JetStream, cfg jetstream.StreamConfig) {
	t.Helper()
	for _, d := range []time.Duration{101 * time.Millisecond, 100 * time.Millisecond} {
		cfg.Duplicates = d
		if _, err := js.UpdateStream(ctx, cfg); err != nil {
			t.Fatalf("shrinking the duplicate window to %v: %v", d, err)
		}
	}
}

// auditLine returns the line of an audit report that begins with label.
func auditLine(out, label string) string {
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, label) {
			return strings.TrimSpace(strings.TrimPrefix(l, label))
		}
	}
	return ""
}

// wantEventAudit checks the audit's events lines: n orders, each with one
// event, one message id and one receipt, nothing pending, repeats as given.
func wantEventAudit(t *testing.T, out string, n, repeats int) {
	t.Helper()
	checks := []struct{ label, want string }{
		{"events:", fmt.Sprintf("%d in the outbox (%d sent, 0 unsent", n, n)},
		{"events per order:", fmt.Sprintf("%d orders with 1", n)},
		{"stream ORDERS:", fmt.Sprintf("%d messages, %d distinct message ids, %d repeated", n+repeats, n, repeats)},
		{"receipts:", fmt.Sprint(n)},
		{"receipts per order:", fmt.Sprintf("%d orders with 1 (", n)},
		{"events pending:", "0 unsent (the relay), 0 in the stream without a receipt"},
	}
	for _, c := range checks {
		if got := auditLine(out, c.label); !strings.HasPrefix(got, c.want) {
			t.Errorf("audit %s %q, want it to begin %q", c.label, got, c.want)
		}
	}
	if !strings.Contains(out, "OK: every invariant holds") {
		t.Errorf("audit not clean:\n%s", out)
	}
}

// oneEvent returns the first event of be's outbox.
func oneEvent(t *testing.T, be *backend) (id string, body []byte) {
	t.Helper()
	err := be.outbox.Each(context.Background(), func(e outbox.Event, _ time.Time) error {
		if id == "" {
			id, body = e.ID, e.Body
		}
		return nil
	})
	if err != nil || id == "" {
		t.Fatalf("no event in the outbox: %v", err)
	}
	return id, body
}

// TestEventsSQLiteEmbedded: `orders serve` on SQLite with the embedded
// NATS and --consume=false, `orders consume` and `orders audit` without
// --nats-url (they find the server through <data-dir>/nats.url). 60
// orders, each sent by 3 clients at once: 60 events, one message id each
// in stream ORDERS, 60 receipts; a repeat within the duplicate window is
// dropped by JetStream, one past it is applied once by the consumer; the
// audit is clean and counts the repeat.
func TestEventsSQLiteEmbedded(t *testing.T) {
	t.Parallel()
	ordersBin, _ := binaries(t)
	dir := t.TempDir()
	addr := freeAddr(t)
	start(t, "http://"+addr+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", dir, "--jwt-secret", testSecret, "--consume=false")
	if fi, err := os.Stat(filepath.Join(dir, natsURLFile)); err != nil {
		t.Fatalf("serve did not write %s: %v", natsURLFile, err)
	} else if fi.Mode().Perm() != 0o600 {
		t.Errorf("%s has mode %v, want 0600", natsURLFile, fi.Mode().Perm())
	}
	js := embeddedJS(t, dir)

	const n = 60
	eventStorm(t, []string{"http://" + addr}, "sqlite-evt", n, 3)
	testwait.Until(t, 20*time.Second, "the relay to publish every event", func() bool { return streamMsgs(t, js) == n })

	consumer := startConsume(t, ordersBin, "--data-dir", dir)
	waitConsumed(t, js, 30*time.Second)
	out := auditOut(t, ordersBin, "--data-dir", dir)
	wantEventAudit(t, out, n, 0)

	be, err := openBackend(context.Background(), &Config{DataDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer be.close()
	id, body := oneEvent(t, be)
	republish(t, js, id, body, false)
	republish(t, js, id, body, true)
	waitConsumed(t, js, 30*time.Second)
	out = auditOut(t, ordersBin, "--data-dir", dir)
	wantEventAudit(t, out, n, 1)
	t.Logf("audit after a repeat past the duplicate window:\n%s", out)

	stopped := consumer.stop(t)
	if !regexp.MustCompile(`orders consume: stopped; \d+ events applied by this process`).MatchString(stopped) {
		t.Errorf("orders consume's last line missing:\n%s", stopped)
	}
}

// TestEventsPostgresExternalNATS: two `orders serve` instances on one
// PostgreSQL database and the external NATS, each with its relay and its
// consumer, and an `orders consume` process besides: 150 orders, each sent
// by 4 clients over both instances; one event, one message id and one
// receipt per order, and a repeat past the window applied once.
func TestEventsPostgresExternalNATS(t *testing.T) {
	natsURL := externalNATS(t)
	db := pgtest.Database(t)
	ordersBin, _ := binaries(t)
	dir := t.TempDir()
	var bases []string
	for i := 0; i < 2; i++ {
		addr := freeAddr(t)
		start(t, "http://"+addr+"/healthz", ordersBin, "serve", "--addr", addr, "--data-dir", dir, "--database-url", db,
			"--jwt-secret", testSecret, "--nats-url", natsURL)
		bases = append(bases, "http://"+addr)
	}
	consumer := startConsume(t, ordersBin, "--data-dir", dir, "--database-url", db, "--nats-url", natsURL)
	js := natsJS(t, natsURL)

	const n = 150
	eventStorm(t, bases, "pg-evt", n, 4)
	testwait.Until(t, 30*time.Second, "the relays to publish every event", func() bool { return streamMsgs(t, js) == n })
	waitConsumed(t, js, 30*time.Second)
	out := auditOut(t, ordersBin, "--data-dir", dir, "--database-url", db, "--nats-url", natsURL)
	wantEventAudit(t, out, n, 0)

	be, err := openBackend(context.Background(), &Config{DataDir: dir, DatabaseURL: db})
	if err != nil {
		t.Fatal(err)
	}
	defer be.close()
	id, body := oneEvent(t, be)
	republish(t, js, id, body, false)
	republish(t, js, id, body, true)
	waitConsumed(t, js, 30*time.Second)
	out = auditOut(t, ordersBin, "--data-dir", dir, "--database-url", db, "--nats-url", natsURL)
	wantEventAudit(t, out, n, 1)
	stopped := consumer.stop(t)
	t.Logf("audit:\n%s\norders consume:\n%s", out, tail(stopped, 5))
}

// consumeProc is a running `orders consume`.
type consumeProc struct {
	cmd  *exec.Cmd
	logs *syncBuffer
}

// startConsume starts `orders consume` with args and waits for its
// "running" line; t's end stops it.
func startConsume(t *testing.T, bin string, args ...string) *consumeProc {
	t.Helper()
	cmd := exec.Command(bin, append([]string{"consume"}, args...)...)
	logs := new(syncBuffer)
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &consumeProc{cmd: cmd, logs: logs}
	t.Cleanup(func() { p.stop(t) })
	testwait.Until(t, 20*time.Second, "orders consume to run", func() bool {
		return strings.Contains(logs.String(), "orders consume: running") || cmd.ProcessState != nil
	})
	return p
}

// stop sends SIGINT and waits (10s, then SIGKILL); it returns the logs.
func (p *consumeProc) stop(t *testing.T) string {
	if p.cmd.ProcessState == nil {
		p.cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { _ = p.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			p.cmd.Process.Kill()
			<-done
			t.Errorf("orders consume did not stop on SIGINT within 10s")
		}
	}
	return p.logs.String()
}

// auditOut runs `orders audit` with args and returns its report; a
// failure fails t.
func auditOut(t *testing.T, bin string, args ...string) string {
	t.Helper()
	out, err := exec.Command(bin, append([]string{"audit"}, args...)...).CombinedOutput()
	if err != nil {
		t.Errorf("orders audit: %v\n%s", err, out)
	}
	return string(out)
}

// TestEventsSecondServeSameDataDir: a second serve on a data dir whose
// embedded NATS another one runs is refused with a clear error; the first
// one's nats.url is removed when it closes.
func TestEventsSecondServeSameDataDir(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	c := Config{DataDir: dir, JWTSecret: testSecret, KeyTTL: time.Hour, KeyLease: 30 * time.Second, PaymentsKey: "sk_test_local", RequireKey: true}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	first, err := (&App{}).newServer(ctx, &c, quiet)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, natsURLFile)); err != nil {
		t.Errorf("%s while serve runs: %v", natsURLFile, err)
	}
	c2 := c
	second, err := (&App{}).newServer(ctx, &c2, quiet)
	if err == nil {
		second.close()
		first.close()
		t.Fatal("a second serve on the same data dir with the embedded NATS started")
	}
	if !strings.Contains(err.Error(), "in use by another process") || !strings.Contains(err.Error(), "--nats-url") {
		t.Errorf("second serve: %v; want it to say the directory is in use and name --nats-url", err)
	}
	first.close()
	if _, err := os.Stat(filepath.Join(dir, natsURLFile)); !os.IsNotExist(err) {
		t.Errorf("%s after a clean shutdown: %v, want it removed", natsURLFile, err)
	}
}

// TestEventsFlags: --nats-url refuses what is not nats:// or tls:// (exit
// 2, one line, the value not repeated); --help of serve, consume and
// audit tells the flags and their variables.
func TestEventsFlags(t *testing.T) {
	for _, bad := range []string{"http://127.0.0.1:4222", "127.0.0.1:4222", "nats://", "nats://u:secretpw@h:1/path", "nats://h:1,ftp://x", "nats://h:1\n"} {
		for _, cmd := range []string{"serve", "consume", "audit"} {
			code, _, stderr := run(t, nil, cmd, "--data-dir", t.TempDir(), "--nats-url", bad)
			if code != 2 || strings.Count(strings.TrimRight(stderr, "\n"), "\n") != 0 || strings.Contains(stderr, "secretpw") {
				t.Errorf("%s --nats-url %q: exit %d, stderr %q; want 2 and one line without the password", cmd, bad, code, stderr)
			}
		}
	}
	if code, _, stderr := run(t, map[string]string{"NATS_URL": "redis://x"}, "serve", "--data-dir", t.TempDir()); code != 2 || !strings.Contains(stderr, "NATS_URL") {
		t.Errorf("NATS_URL=redis://x: exit %d %q, want 2 naming NATS_URL", code, stderr)
	}
	if code, _, stderr := run(t, map[string]string{"ORDERS_CONSUME": "perhaps"}, "serve", "--data-dir", t.TempDir()); code != 2 {
		t.Errorf("ORDERS_CONSUME=perhaps: exit %d %q, want 2", code, stderr)
	}
	for _, cmd := range []string{"serve", "consume"} {
		for _, bad := range [][]string{{"--ack-wait", "-1s"}, {"--ack-wait", "30s"}, {"--ack-wait", "20s"}, {"--ack-wait", "50s", "--key-lease", "1m"}, {"--ack-wait", "soon"}} {
			code, _, stderr := run(t, nil, append([]string{cmd, "--data-dir", t.TempDir()}, bad...)...)
			if code != 2 || !strings.Contains(stderr, "--ack-wait") {
				t.Errorf("%s %v: exit %d, stderr %q; want 2 naming --ack-wait", cmd, bad, code, stderr)
			}
		}
	}
	for _, cmd := range []string{"serve", "consume"} {
		for _, bad := range []string{"-1h", "30m", "59m59s", "soon"} {
			code, _, stderr := run(t, nil, cmd, "--data-dir", t.TempDir(), "--stream-max-age", bad)
			if code != 2 || !strings.Contains(stderr, "--stream-max-age") {
				t.Errorf("%s --stream-max-age %s: exit %d, stderr %q; want 2 naming --stream-max-age", cmd, bad, code, stderr)
			}
		}
	}
	for cmd, wants := range map[string][]string{
		"serve":   {"--nats-url", "NATS_URL", "embedded", "--consume", "ORDERS_CONSUME", "(default true)", "--ack-wait", "ORDERS_ACK_WAIT", "--stream-max-age", "ORDERS_STREAM_MAX_AGE"},
		"consume": {"--nats-url", "NATS_URL", "nats.url", "--key-lease", "--database-url", "--ack-wait", "ORDERS_ACK_WAIT", "--stream-max-age"},
		"audit":   {"--nats-url", "NATS_URL", "nats.url", "stream ORDERS"},
	} {
		code, out, _ := run(t, nil, cmd, "--help")
		for _, w := range wants {
			if code != 0 || !strings.Contains(out, w) {
				t.Errorf("%s --help (exit %d) lacks %q", cmd, code, w)
			}
		}
	}
	if code, out, _ := run(t, nil, "--help"); code != 0 || !strings.Contains(out, "consume") {
		t.Errorf("--help lacks consume: %s", out)
	}
}

// TestStreamMaxAge: --stream-max-age is set on stream ORDERS at each
// start, longer or shorter; a start without it keeps the stream's own.
func TestStreamMaxAge(t *testing.T) {
	skipInShort(t, "starts the service three times")
	ctx := context.Background()
	dir := t.TempDir()
	for _, step := range []struct{ ask, want time.Duration }{{720 * time.Hour, 720 * time.Hour}, {0, 720 * time.Hour}, {48 * time.Hour, 48 * time.Hour}} {
		c := Config{DataDir: dir, JWTSecret: testSecret, KeyTTL: time.Hour, KeyLease: 30 * time.Second, PaymentsKey: "sk_test_local", StreamMaxAge: step.ask}
		srv, err := (&App{}).newServer(ctx, &c, slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatal(err)
		}
		st, err := srv.broker.js.Stream(ctx, eventStream)
		srv.close()
		if err != nil {
			t.Fatal(err)
		}
		if got := st.CachedInfo().Config.MaxAge; got != step.want {
			t.Errorf("serve with --stream-max-age %v: the stream's max age is %v, want %v", step.ask, got, step.want)
		}
	}
}

// TestEventsRelayThroughput measures, for the note (the figures under
// -race are the race detector's), how fast orders are
// created through the in-process server (relay stopped: the events wait
// in the outbox) and how fast the relay then drains them to the embedded
// JetStream, and how fast the consumer applies them; it logs the rates
// and their ratio and asserts only the counts.
func TestEventsRelayThroughput(t *testing.T) {
	skipInShort(t, "measures the relay under a storm of orders")
	// It asserts only counts: it runs beside the package's other parallel
	// tests, so a note's figures come from a run of it alone.
	t.Parallel()
	t.Run("sqlite", func(t *testing.T) { relayThroughput(t, Config{DataDir: t.TempDir()}) })
	t.Run("postgres", func(t *testing.T) {
		relayThroughput(t, Config{DataDir: t.TempDir(), DatabaseURL: pgtest.Database(t)})
	})
}

func relayThroughput(t *testing.T, c Config) {
	// 300 keep the package's time short; ORDERS_THROUGHPUT_N sets more
	// for the note's figures.
	n := 300
	if v, err := strconv.Atoi(os.Getenv("ORDERS_THROUGHPUT_N")); err == nil && v > 0 {
		n = v
	}
	ctx := context.Background()
	c.JWTSecret, c.KeyTTL, c.KeyLease, c.PaymentsKey, c.RequireKey, c.Consume = testSecret, time.Hour, 30*time.Second, "sk_test_local", true, true
	srv, err := (&App{}).newServer(ctx, &c, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.close()
	hs := httptestServer(t, srv.handler)

	// create sends orders from..from+n-1 from 16 clients and returns how
	// long they took.
	create := func(from int) time.Duration {
		t0 := time.Now()
		var wg sync.WaitGroup
		var bad atomic.Int64
		var mu sync.Mutex
		statuses := map[string]int{} // of the orders not created
		// The project's retrying client, as a real one: under the
		// package's parallel load an attempt may get a 503 (a write that
		// waited too long for SQLite's lock), and its retry with the same
		// key makes the order once.
		hc := retrying()
		jobs := make(chan int)
		for w := 0; w < 16; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := range jobs {
					if s, err := post(hc, hs, fmt.Sprintf("tp-user-%d", i%8), fmt.Sprintf("tp-%d", i), i); s != http.StatusCreated {
						bad.Add(1)
						mu.Lock()
						statuses[fmt.Sprintf("%d %v", s, err)]++
						mu.Unlock()
					}
				}
			}()
		}
		for i := from; i < from+n; i++ {
			jobs <- i
		}
		close(jobs)
		wg.Wait()
		if bad.Load() != 0 {
			t.Fatalf("%d orders not created: %v", bad.Load(), statuses)
		}
		return time.Since(t0)
	}

	// Creation, no relay running.
	created := create(0)
	unsent, err := srv.backend.outbox.Unsent(ctx)
	if err != nil || unsent != n {
		t.Fatalf("unsent events %d (%v), want %d", unsent, err, n)
	}

	// The relay's drain, alone.
	cons, err := srv.events.setup(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t1 := time.Now()
	sent, err := srv.events.relay.RunOnce(ctx)
	drained := time.Since(t1)
	if sent != n {
		t.Fatalf("relay sent %d (%v), want %d", sent, err, n)
	}
	if err != nil {
		// RunOnce reports the last pass that failed even when a later
		// pass sent what it left: under the package's parallel load a
		// pass of 100 publishes to the embedded JetStream can outlast
		// the 10s PublishTimeout (seen in CI: 71 sent, 29 left for the
		// next pass, all 300 sent in the end). What the relay must do is
		// send every event once, checked here and by Unsent below.
		t.Logf("a pass failed and a later one sent what it left: %v", err)
	}
	if u, err := srv.backend.outbox.Unsent(ctx); err != nil || u != 0 {
		t.Fatalf("after the drain, unsent events %d (%v), want 0", u, err)
	}

	// The consumer's apply, alone.
	t2 := time.Now()
	cc, err := cons.Consume(srv.events.handler)
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 2*time.Minute, "the consumer to write every receipt", func() bool { return srv.events.handled.Load() >= int64(n) })
	applied := time.Since(t2)
	closed := cc.Closed()
	cc.Drain()
	<-closed

	// Creation with the relay and the consumer running, as in serve: how
	// much the relay slows creation, and how far it lags behind.
	srv.events.start(ctx)
	createdLive := create(n)
	t3 := time.Now()
	testwait.Until(t, time.Minute, "the relay to catch up", func() bool {
		u, err := srv.backend.outbox.Unsent(ctx)
		return err == nil && u == 0
	})
	lag := time.Since(t3)
	testwait.Until(t, 2*time.Minute, "the consumer to catch up", func() bool { return srv.events.handled.Load() >= int64(2*n) })
	receiptLag := time.Since(t3)
	srv.events.stop()

	cr, rr, ar, lr := float64(n)/created.Seconds(), float64(n)/drained.Seconds(), float64(n)/applied.Seconds(), float64(n)/createdLive.Seconds()
	t.Logf("%s, %d orders: created through the API at %.0f/s (%v, 16 clients); relay drained them to JetStream at %.0f events/s (%v, one relay, batch %d); "+
		"consumer applied them at %.0f receipts/s (%v, one consumer); relay/creation = %.1f×, consumer/creation = %.1f×; "+
		"%d more with the relay and consumer running: created at %.0f/s (%.2f× the rate without), every event published %v and every receipt written %v after the last order was answered",
		srv.backend.name, n, cr, created.Round(time.Millisecond), rr, drained.Round(time.Millisecond), 100, ar, applied.Round(time.Millisecond), rr/cr, ar/cr,
		n, lr, lr/cr, lag.Round(time.Millisecond), receiptLag.Round(time.Millisecond))
}

// httptestServer serves h on a loopback port until t ends.
func httptestServer(t *testing.T, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: h}
	go hs.Serve(ln)
	t.Cleanup(func() { hs.Close() })
	return "http://" + ln.Addr().String()
}

// TestEventsNATSDownAtStart: serve starts and takes orders while the NATS
// at --nats-url does not answer (the events wait in the outbox); once NATS
// comes up the relay publishes them and the consumer applies them.
func TestEventsNATSDownAtStart(t *testing.T) {
	skipInShort(t, "waits for the relay to retry a NATS that is down")
	t.Parallel()
	addr := freeAddr(t)
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	c := Config{DataDir: t.TempDir(), NATSURL: "nats://" + addr, JWTSecret: testSecret, KeyTTL: time.Hour, KeyLease: 30 * time.Second,
		PaymentsKey: "sk_test_local", RequireKey: true, Consume: true}
	svc := startInProcess(t, &c)
	const n = 10
	eventStorm(t, []string{svc.base}, "down-evt", n, 2)
	if unsent, err := svc.srv.backend.outbox.Unsent(context.Background()); err != nil || unsent != n {
		t.Fatalf("unsent events while NATS is down: %d (%v), want %d", unsent, err, n)
	}

	p, err := strconv.Atoi(port)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := natsembed.Start(natsembed.Options{Dir: t.TempDir(), Port: p})
	if err != nil {
		t.Fatalf("starting NATS on %s: %v", addr, err)
	}
	t.Cleanup(srv.Shutdown)
	js := natsJS(t, srv.URL())
	testwait.Until(t, 30*time.Second, "the relay to publish the events once NATS answers", func() bool { return streamMsgs(t, js) == n })
	waitConsumed(t, js, 30*time.Second)
	code, out, errs := run(t, nil, "audit", "--data-dir", c.DataDir, "--nats-url", srv.URL())
	if code != 0 {
		t.Fatalf("audit: exit %d\n%s%s", code, out, errs)
	}
	wantEventAudit(t, out, n, 0)

	// An audit pointed at another NATS says so once, not once per event.
	code, out, _ = run(t, nil, "audit", "--data-dir", c.DataDir, "--nats-url", testNATS(t))
	if code != 1 || !strings.Contains(out, "violations:        1") || !strings.Contains(out, "does not exist on this NATS, but 10 events are marked sent") {
		t.Errorf("audit against another NATS: exit %d, want 1 and one violation naming the stream\n%s", code, out)
	}
}
