package idemnats_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem/idemnats"
	"github.com/idem-go/idem/outbox"
)

// newStream makes a stream of t's own on srv (deleted when t ends) and
// returns it with its subject.
func newStream(t *testing.T, js jetstream.JetStream, dup time.Duration) (jetstream.Stream, string) {
	t.Helper()
	name := unique()
	subject := strings.ToLower(name) + ".created"
	deleteStream(t, js, name)
	st, err := idemnats.EnsureStream(t.Context(), js, idemnats.StreamConfig{Name: name, Subjects: []string{subject}, Duplicates: dup})
	if err != nil {
		t.Fatal(err)
	}
	return st, subject
}

func msgCount(t *testing.T, st jetstream.Stream) uint64 {
	t.Helper()
	info, err := st.Info(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Msgs
}

// TestPublishSameIDTwice: the same event published twice within the
// duplicate window (the relay crashed before marking it sent) is one
// message in the stream, and both publishes succeed.
func TestPublishSameIDTwice(t *testing.T) {
	forEach(t, func(t *testing.T, srv server) {
		js := srv.js(t)
		st, subject := newStream(t, js, 0)
		p := idemnats.NewPublisher(js)
		e := outbox.Event{ID: "evt_1", Subject: subject, Body: []byte(`{"id":"ord_1"}`)}
		for i := range 2 {
			if err := p.Publish(t.Context(), e); err != nil {
				t.Fatalf("publish %d: %v", i+1, err)
			}
		}
		if err := p.Publish(t.Context(), outbox.Event{ID: "evt_2", Subject: subject, Body: []byte("x")}); err != nil {
			t.Fatal(err)
		}
		if n := msgCount(t, st); n != 2 {
			t.Fatalf("%d messages in the stream, want 2 (evt_1 once, evt_2)", n)
		}
		m, err := st.GetMsg(t.Context(), 1)
		if err != nil {
			t.Fatal(err)
		}
		if id := m.Header.Get(jetstream.MsgIDHeader); id != "evt_1" {
			t.Fatalf("Nats-Msg-Id %q, want evt_1", id)
		}
		if !bytes.Equal(m.Data, e.Body) || m.Subject != subject {
			t.Fatalf("message %s %q, want %s %q", m.Subject, m.Data, subject, e.Body)
		}
	})
}

// TestPublishConcurrentSameID: several relays publishing one event at once
// leave one message.
func TestPublishConcurrentSameID(t *testing.T) {
	forEach(t, func(t *testing.T, srv server) {
		js := srv.js(t)
		st, subject := newStream(t, js, 0)
		const n = 8
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			p := idemnats.NewPublisher(srv.js(t))
			wg.Go(func() {
				errs[i] = p.Publish(context.Background(), outbox.Event{ID: "evt_same", Subject: subject, Body: []byte("b")})
			})
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Fatalf("publisher %d: %v", i, err)
			}
		}
		if c := msgCount(t, st); c != 1 {
			t.Fatalf("%d messages, want 1", c)
		}
	})
}

// TestPublishErrors: no stream for the subject, no id, a cancelled
// context: errors, wrapped.
func TestPublishErrors(t *testing.T) {
	forEach(t, func(t *testing.T, srv server) {
		js := srv.js(t)
		p := idemnats.NewPublisher(js)
		err := p.Publish(t.Context(), outbox.Event{ID: "evt_x", Subject: strings.ToLower(unique()) + ".nobody", Body: []byte("b")})
		if !errors.Is(err, jetstream.ErrNoStreamResponse) && !errors.Is(err, nats.ErrNoResponders) {
			t.Fatalf("publish to a subject without a stream: %v, want ErrNoStreamResponse", err)
		}
		if err := p.Publish(t.Context(), outbox.Event{Subject: "x"}); err == nil {
			t.Fatal("publish without an id succeeded")
		}
		_, subject := newStream(t, js, 0)
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		if err := p.Publish(ctx, outbox.Event{ID: "evt_c", Subject: subject}); !errors.Is(err, context.Canceled) {
			t.Fatalf("publish with a cancelled context: %v, want context.Canceled", err)
		}
	})
}
