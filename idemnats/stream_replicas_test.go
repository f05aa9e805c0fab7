package idemnats_test

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/idemnats"
	"github.com/idem-go/idem/internal/natsembed"
	"github.com/idem-go/idem/internal/natstest"
)

// replicasOf reads the stream's replica count from the server.
func replicasOf(t *testing.T, js jetstream.JetStream, name string) int {
	t.Helper()
	st, err := js.Stream(t.Context(), name)
	if err != nil {
		t.Fatal(err)
	}
	return st.CachedInfo().Config.Replicas
}

// TestEnsureStreamNeverLowersReplicas, on a 3-node JetStream cluster: an
// operator's 3 replicas survive a start that asks none (zero) or 1, with a
// warning naming both counts; a start that asks 3 of a 1-replica stream
// raises it; a count the cluster cannot place is refused with an error
// ReplicasRefused recognises, and the stream is left as it was. (Before,
// EnsureStream wrote 1 over an existing stream's 3 without a word.)
func TestEnsureStreamNeverLowersReplicas(t *testing.T) {
	cl := natstest.StartCluster(t, 3)
	js := cl.JetStream(t)
	ctx := t.Context()
	var logs syncBuffer
	logger := slog.New(slog.NewTextHandler(&logs, nil))

	name := unique()
	c := idemnats.StreamConfig{Name: name, Subjects: []string{strings.ToLower(name)}, Logger: logger}
	if _, err := idemnats.EnsureStream(ctx, js, c); err != nil {
		t.Fatal(err)
	}
	if r := replicasOf(t, js, name); r != 1 {
		t.Fatalf("created with replicas %d, want 1 (the default)", r)
	}
	// The operator raises it by hand.
	st, err := js.Stream(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	cfg.Replicas = 3
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatalf("raising the replicas by hand: %v", err)
	}

	for _, asked := range []int{0, 1, 2} {
		c.Replicas = asked
		if _, err := idemnats.EnsureStream(ctx, js, c); err != nil {
			t.Fatalf("EnsureStream asking %d replicas: %v", asked, err)
		}
		if r := replicasOf(t, js, name); r != 3 {
			t.Fatalf("after EnsureStream asking %d replicas: %d, want the stream's 3 kept", asked, r)
		}
	}
	if n := strings.Count(logs.String(), "keeps them"); n != 2 {
		t.Fatalf("%d warnings for the two lower counts asked (zero asks nothing), want 2; logs:\n%s", n, logs.String())
	}
	if !strings.Contains(logs.String(), "replicas=3 asked=1") {
		t.Fatalf("the warning does not name both counts:\n%s", logs.String())
	}

	// Raising works through EnsureStream too.
	raised := unique()
	rc := idemnats.StreamConfig{Name: raised, Subjects: []string{strings.ToLower(raised)}, Logger: logger}
	if _, err := idemnats.EnsureStream(ctx, js, rc); err != nil {
		t.Fatal(err)
	}
	rc.Replicas = 3
	if _, err := idemnats.EnsureStream(ctx, js, rc); err != nil {
		t.Fatalf("raising to 3 replicas: %v", err)
	}
	if r := replicasOf(t, js, raised); r != 3 {
		t.Fatalf("raised to %d replicas, want 3", r)
	}

	// More copies than servers: refused, on a new stream and on an
	// existing one, which keeps its count.
	c.Replicas = 5
	_, err = idemnats.EnsureStream(ctx, js, c)
	if err == nil || !idemnats.ReplicasRefused(err) {
		t.Fatalf("5 replicas on 3 servers (existing stream): %v, want an error ReplicasRefused knows", err)
	}
	if r := replicasOf(t, js, name); r != 3 {
		t.Fatalf("after a refused raise: %d replicas, want 3", r)
	}
	fresh := unique()
	_, err = idemnats.EnsureStream(ctx, js, idemnats.StreamConfig{Name: fresh, Subjects: []string{strings.ToLower(fresh)}, Replicas: 5})
	if err == nil || !idemnats.ReplicasRefused(err) {
		t.Fatalf("5 replicas on 3 servers (new stream): %v, want an error ReplicasRefused knows", err)
	}
	if _, err := idemnats.EnsureStream(ctx, js, idemnats.StreamConfig{Name: fresh, Subjects: []string{"x"}, Replicas: -1}); err == nil {
		t.Fatal("negative replicas accepted")
	}
}

// TestEnsureStreamReplicasOnOneServer: a server that is not clustered
// refuses more than one copy; EnsureStream says so through an error that
// ReplicasRefused recognises, not a stream silently kept at 1.
func TestEnsureStreamReplicasOnOneServer(t *testing.T) {
	s, err := natsembed.Start(natsembed.Options{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Shutdown)
	js := server{url: s.URL()}.js(t)
	name := unique()
	_, err = idemnats.EnsureStream(t.Context(), js, idemnats.StreamConfig{Name: name, Subjects: []string{strings.ToLower(name)}, Replicas: 3, Duplicates: time.Minute})
	if err == nil || !idemnats.ReplicasRefused(err) {
		t.Fatalf("3 replicas on one server: %v, want an error ReplicasRefused knows", err)
	}
	if idemnats.ReplicasRefused(jetstream.ErrStreamNotFound) {
		t.Fatal("ReplicasRefused(ErrStreamNotFound) is true")
	}
}
