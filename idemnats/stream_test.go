package idemnats_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/idemnats"
)

// TestEnsureStream: created with the defaults (2m window, file storage);
// a second call with the same config changes nothing; a call with other
// subjects or a longer window updates it and keeps settings it does not
// name; a shorter window is not applied; a different storage is refused.
func TestEnsureStream(t *testing.T) {
	forEach(t, func(t *testing.T, srv server) {
		ctx := t.Context()
		js := srv.js(t)
		name := unique()
		subj := strings.ToLower(name)
		deleteStream(t, js, name)
		c := idemnats.StreamConfig{Name: name, Subjects: []string{subj + ".a"}}
		st, err := idemnats.EnsureStream(ctx, js, c)
		if err != nil {
			t.Fatal(err)
		}
		cfg := st.CachedInfo().Config
		if cfg.Duplicates != 2*time.Minute || cfg.Storage != jetstream.FileStorage || cfg.Replicas != 1 {
			t.Fatalf("created with duplicates %v storage %v replicas %d, want 2m file 1", cfg.Duplicates, cfg.Storage, cfg.Replicas)
		}
		if _, err := idemnats.EnsureStream(ctx, js, c); err != nil {
			t.Fatalf("second EnsureStream: %v", err)
		}

		// An operator's setting EnsureStream does not name survives.
		cfg.MaxMsgs = 1000
		if _, err := js.UpdateStream(ctx, cfg); err != nil {
			t.Fatal(err)
		}
		c.Subjects = []string{subj + ".a", subj + ".b"}
		c.Duplicates = 3 * time.Minute
		st, err = idemnats.EnsureStream(ctx, js, c)
		if err != nil {
			t.Fatalf("EnsureStream with new subjects: %v", err)
		}
		info, err := st.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		got := info.Config
		if len(got.Subjects) != 2 || got.Duplicates != 3*time.Minute || got.MaxMsgs != 1000 {
			t.Fatalf("after update: subjects %v duplicates %v max msgs %d, want 2 subjects, 3m, 1000", got.Subjects, got.Duplicates, got.MaxMsgs)
		}

		// A shorter window would let a late duplicate through: the
		// stream keeps its own.
		c.Duplicates = time.Minute
		st, err = idemnats.EnsureStream(ctx, js, c)
		if err != nil {
			t.Fatalf("EnsureStream with a shorter window: %v", err)
		}
		if info, err = st.Info(ctx); err != nil {
			t.Fatal(err)
		}
		if d := info.Config.Duplicates; d != 3*time.Minute {
			t.Fatalf("after asking a 1m window: %v, want the stream's 3m kept", d)
		}

		c.Storage = jetstream.MemoryStorage
		if _, err := idemnats.EnsureStream(ctx, js, c); err == nil || !strings.Contains(err.Error(), "storage") {
			t.Fatalf("EnsureStream with another storage: %v, want a storage error", err)
		}
	})
}

// TestEnsureStreamMaxAge: a maximum age asked is set on a new stream and
// on an existing one, longer or shorter; asking none keeps the stream's
// own; a negative one is refused.
func TestEnsureStreamMaxAge(t *testing.T) {
	forEach(t, func(t *testing.T, srv server) {
		ctx := t.Context()
		js := srv.js(t)
		name := unique()
		deleteStream(t, js, name)
		c := idemnats.StreamConfig{Name: name, Subjects: []string{strings.ToLower(name)}, MaxAge: time.Hour}
		age := func(want time.Duration) {
			t.Helper()
			st, err := idemnats.EnsureStream(ctx, js, c)
			if err != nil {
				t.Fatalf("EnsureStream with max age %v: %v", c.MaxAge, err)
			}
			info, err := st.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if got := info.Config.MaxAge; got != want {
				t.Fatalf("after asking max age %v: %v, want %v", c.MaxAge, got, want)
			}
		}
		age(time.Hour)
		c.MaxAge = 48 * time.Hour
		age(48 * time.Hour)
		c.MaxAge = 10 * time.Minute
		age(10 * time.Minute)
		c.MaxAge = 0
		age(10 * time.Minute) // the stream's own
		c.MaxAge = -time.Second
		if _, err := idemnats.EnsureStream(ctx, js, c); err == nil || !strings.Contains(err.Error(), "negative") {
			t.Fatalf("EnsureStream with a negative max age: %v, want an error", err)
		}
	})
}

// TestEnsureStreamConcurrent: processes starting at once (one connection
// each) all get the stream, with their config.
func TestEnsureStreamConcurrent(t *testing.T) {
	forEach(t, func(t *testing.T, srv server) {
		js := srv.js(t)
		name := unique()
		deleteStream(t, js, name)
		c := idemnats.StreamConfig{Name: name, Subjects: []string{strings.ToLower(name) + ".>"}, Duplicates: 30 * time.Second}
		const n = 8
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			jsi := srv.js(t)
			wg.Go(func() {
				_, errs[i] = idemnats.EnsureStream(context.Background(), jsi, c)
			})
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Fatalf("caller %d: %v", i, err)
			}
		}
		st, err := js.Stream(t.Context(), name)
		if err != nil {
			t.Fatal(err)
		}
		if d := st.CachedInfo().Config.Duplicates; d != 30*time.Second {
			t.Fatalf("duplicates %v, want 30s", d)
		}
	})
}

// TestEnsureStreamMinimumWindow: JetStream refuses a duplicate window
// under 100ms; 100ms itself is accepted.
func TestEnsureStreamMinimumWindow(t *testing.T) {
	forEach(t, func(t *testing.T, srv server) {
		js := srv.js(t)
		name := unique()
		deleteStream(t, js, name)
		c := idemnats.StreamConfig{Name: name, Subjects: []string{strings.ToLower(name)}, Duplicates: 99 * time.Millisecond}
		if _, err := idemnats.EnsureStream(t.Context(), js, c); err == nil {
			t.Fatal("a 99ms window was accepted")
		}
		c.Duplicates = 100 * time.Millisecond
		if _, err := idemnats.EnsureStream(t.Context(), js, c); err != nil {
			t.Fatalf("100ms window: %v", err)
		}
	})
}

func TestEnsureStreamRefused(t *testing.T) {
	forEach(t, func(t *testing.T, srv server) {
		js := srv.js(t)
		if _, err := idemnats.EnsureStream(t.Context(), js, idemnats.StreamConfig{Subjects: []string{"x"}}); err == nil {
			t.Fatal("no name accepted")
		}
		if _, err := idemnats.EnsureStream(t.Context(), js, idemnats.StreamConfig{Name: unique()}); err == nil {
			t.Fatal("no subjects accepted")
		}
	})
}
