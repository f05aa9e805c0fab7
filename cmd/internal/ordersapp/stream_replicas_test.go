package ordersapp

import (
	"context"
	"io"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/internal/natstest"
	"github.com/idem-go/idem/internal/testwait"
)

// replicaConfig is a serve on a data dir of its own, with nats as its
// --nats-url ("" for the embedded server) and replicas copies asked.
func replicaConfig(t *testing.T, nats string, replicas int) *Config {
	return &Config{DataDir: t.TempDir(), NATSURL: nats, StreamReplicas: replicas, JWTSecret: testSecret,
		KeyTTL: time.Hour, KeyLease: 30 * time.Second, PaymentsKey: "sk_test_local", RequireKey: true, Consume: true}
}

// streamReplicas reads stream ORDERS' replica count, or 0 while it does
// not exist or has no leader to answer yet (a replicated stream being
// created, or electing one).
func streamReplicas(js jetstream.JetStream) int {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, eventStream)
	if err != nil {
		return 0
	}
	return st.CachedInfo().Config.Replicas
}

// serveUntilFailed runs serve as c says and returns the error it stops
// with on its own (within 30s), failing t if it keeps running.
func serveUntilFailed(t *testing.T, c *Config) error {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv, err := (&App{}).newServer(ctx, c, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		return err
	}
	defer srv.close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- srv.run(ctx, ln) }()
	select {
	case err := <-done:
		return err
	case <-time.After(30 * time.Second):
		cancel()
		t.Fatalf("serve kept running with a replica count its NATS refuses (it stopped with %v when told to)", <-done)
		return nil
	}
}

// TestStreamReplicasOnCluster, on a 3-node JetStream cluster on loopback:
// --stream-replicas 3 creates stream ORDERS with 3 copies; a later serve
// with the default (1) keeps the 3 and logs it, instead of writing 1 over
// them as it did before; a count the cluster cannot place (5) stops serve
// with an error naming the flag, and the stream keeps its 3.
func TestStreamReplicasOnCluster(t *testing.T) {
	cl := natstest.StartCluster(t, 3)
	js := cl.JetStream(t)

	first := startInProcess(t, replicaConfig(t, cl.URLs(), 3))
	testwait.Until(t, 20*time.Second, "serve to create stream ORDERS", func() bool { return streamReplicas(js) != 0 })
	if r := streamReplicas(js); r != 3 {
		t.Fatalf("serve --stream-replicas 3 made stream ORDERS with %d replicas", r)
	}
	first.stop()

	second := startInProcess(t, replicaConfig(t, cl.URLs(), 1))
	testwait.Until(t, 20*time.Second, "serve to say it keeps the stream's replicas", func() bool {
		return strings.Contains(second.logs.String(), "keeps them")
	})
	if r := streamReplicas(js); r != 3 {
		t.Fatalf("after a serve with --stream-replicas 1: %d replicas, want the stream's 3 kept", r)
	}
	if logs := second.logs.String(); !strings.Contains(logs, "replicas=3 asked=1") {
		t.Errorf("the warning does not name both counts:\n%s", tail(logs, 20))
	}
	// The service works on the 3-copy stream: an order gets its event.
	tok := token(t, "alice")
	if a := call(t, "POST", second.base+"/v1/orders", tok, "replicas-1", orderBody(1)); a.status != 201 {
		t.Fatalf("POST: %d %s", a.status, a.body)
	}
	testwait.Until(t, 20*time.Second, "the order's event", func() bool { return streamMsgs(t, js) == 1 })
	second.stop()

	err := serveUntilFailed(t, replicaConfig(t, cl.URLs(), 5))
	if err == nil || !strings.Contains(err.Error(), "--stream-replicas") {
		t.Fatalf("serve --stream-replicas 5 on 3 servers: %v, want an error naming --stream-replicas", err)
	}
	if r := streamReplicas(js); r != 3 {
		t.Fatalf("after the refused serve: %d replicas, want 3", r)
	}
}

// TestStreamReplicasOnOneServer: more than one copy on the embedded NATS
// (not clustered) stops serve with an error naming the flag, rather than
// a stream silently kept at one copy.
func TestStreamReplicasOnOneServer(t *testing.T) {
	err := serveUntilFailed(t, replicaConfig(t, "", 3))
	if err == nil || !strings.Contains(err.Error(), "--stream-replicas") || !strings.Contains(err.Error(), "not clustered") {
		t.Fatalf("serve --stream-replicas 3 on the embedded NATS: %v, want an error naming --stream-replicas", err)
	}
}

// TestStreamReplicasFlag: --stream-replicas outside 1..5 (flag or
// ORDERS_STREAM_REPLICAS) exits 2 with one line; --help names both.
func TestStreamReplicasFlag(t *testing.T) {
	for _, cmd := range []string{"serve", "consume"} {
		for _, bad := range []string{"0", "6", "-1", "three"} {
			code, _, stderr := run(t, nil, cmd, "--data-dir", t.TempDir(), "--stream-replicas", bad)
			if code != 2 || !strings.Contains(stderr, "stream-replicas") || strings.Count(strings.TrimRight(stderr, "\n"), "\n") != 0 {
				t.Errorf("%s --stream-replicas %s: exit %d, stderr %q; want 2 and one line naming the flag", cmd, bad, code, stderr)
			}
		}
		code, _, stderr := run(t, map[string]string{"ORDERS_STREAM_REPLICAS": "9"}, cmd, "--data-dir", t.TempDir())
		if code != 2 || !strings.Contains(stderr, "ORDERS_STREAM_REPLICAS") {
			t.Errorf("%s with ORDERS_STREAM_REPLICAS=9: exit %d, stderr %q; want 2 naming the variable", cmd, code, stderr)
		}
		_, stdout, stderr := run(t, nil, cmd, "--help")
		if help := stdout + stderr; !strings.Contains(help, "--stream-replicas") || !strings.Contains(help, "ORDERS_STREAM_REPLICAS") {
			t.Errorf("%s --help does not name --stream-replicas and ORDERS_STREAM_REPLICAS:\n%s", cmd, help)
		}
	}
}
