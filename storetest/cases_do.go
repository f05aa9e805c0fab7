package storetest

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

// doCases are the cases of idem.Do's records (issue 14): an empty Method,
// the operation as Path, the input as Body, kept and replayed as any
// record; re-driven by a completer through the operation's function.
var doCases = []struct {
	name string
	fn   func(*testing.T, Harness)
}{
	{"DoRoundTrip", testDoRoundTrip},
	{"DoRedrive", testDoRedrive},
	{"DoRedriveNotStarved", testDoRedriveNotStarved},
	{"AbandonedKinds", testAbandonedKinds},
}

// doWrite is a DoFunc's body: it writes effect name through the
// transaction of its Do operation, as idem.TxFromContext gives it.
func doWrite(ctx context.Context, h Harness, name string) error {
	tx, err := idem.TxFromContext(ctx)
	if err != nil {
		return err
	}
	return h.Write(ctx, tx, name)
}

func doParams(key, op string, input []byte) idem.DoParams {
	return idem.DoParams{User: "storetest:consumer", Key: key, Operation: op, Input: input, Lease: 10 * time.Second, TTL: time.Hour,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
}

// testDoRoundTrip: a Do operation's record keeps an empty Method, the
// operation as Path and the input as Body, and its output as a 200
// response; a repeat replays the output without running the function;
// another input or operation is a mismatch; an empty input and output
// round-trip.
func testDoRoundTrip(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	input := []byte("\x00binary input \xff, not UTF-8")
	output := []byte(`{"receipt":"rcp_1"}`)
	p := doParams("msg-roundtrip", "storetest.receipt", input)
	runs := 0
	fn := func(ctx context.Context, in []byte) ([]byte, error) {
		runs++
		if !bytes.Equal(in, input) {
			t.Errorf("function's input = %q, want %q", in, input)
		}
		return output, doWrite(ctx, h, "do-roundtrip")
	}
	res, err := idem.Do(ctx, s, p, fn)
	if err != nil || res.Replayed || !bytes.Equal(res.Output, output) {
		t.Fatalf("Do = %+v, %v; want the output, not replayed", res, err)
	}
	rec, err := s.Get(ctx, p.User, p.Key)
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	if rec.Method != "" || rec.Path != p.Operation || len(rec.Body) != 0 || len(rec.Header) != 0 {
		t.Errorf("record: Method %q, Path %q, Body %q, Header %v; want an empty Method, the operation, no input (dropped once completed), no header",
			rec.Method, rec.Path, rec.Body, rec.Header)
	}
	if rec.Response == nil || rec.Response.Status != http.StatusOK || !bytes.Equal(rec.Response.Body, output) || len(rec.Response.Header) != 0 {
		t.Errorf("record's response = %+v; want 200 with the output", rec.Response)
	}
	res, err = idem.Do(ctx, s, p, fn)
	if err != nil || !res.Replayed || !bytes.Equal(res.Output, output) || runs != 1 {
		t.Errorf("repeat = %+v, %v, %d runs; want the output replayed, 1 run", res, err, runs)
	}
	for _, q := range []idem.DoParams{
		doParams(p.Key, p.Operation, []byte("another input")),
		doParams(p.Key, "storetest.other", input),
	} {
		if _, err := idem.Do(ctx, s, q, fn); !errors.Is(err, idem.ErrFingerprintMismatch) {
			t.Errorf("Do(%s, %q) on the key = %v, want ErrFingerprintMismatch", q.Operation, q.Input, err)
		}
	}
	if got := count(t, h, s, "do-roundtrip"); got != 1 || runs != 1 {
		t.Errorf("effects = %d, runs = %d; want 1 and 1", got, runs)
	}
	// Nothing in, nothing out, nothing written: still completed.
	e := doParams("msg-empty", "storetest.empty", nil)
	empty := func(context.Context, []byte) ([]byte, error) { return nil, nil }
	if res, err := idem.Do(ctx, s, e, empty); err != nil || res.Replayed || len(res.Output) != 0 {
		t.Fatalf("empty Do = %+v, %v", res, err)
	}
	if res, err := idem.Do(ctx, s, e, empty); err != nil || !res.Replayed || len(res.Output) != 0 {
		t.Errorf("empty repeat = %+v, %v; want an empty output replayed", res, err)
	}
}

// testDoRedrive: a Do operation whose function failed keeps its key bound
// without a response; a completer with the function registered runs it
// again with the record's input and stores its output, which the next
// call replays. An operation not registered, and an HTTP record whose
// path is a registered name, are not listed, and never claimed.
func testDoRedrive(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	ss, ok := s.(idemdriver.SweepingStore)
	if !ok {
		t.Skip("store does not implement idemdriver.Sweeper")
	}
	boom := errors.New("downstream down")
	p := doParams("msg-redrive", "storetest.redrive", []byte("order 42"))
	failing := func(ctx context.Context, _ []byte) ([]byte, error) {
		if err := doWrite(ctx, h, "do-redrive-failed"); err != nil {
			return nil, err
		}
		return nil, boom
	}
	if _, err := idem.Do(ctx, s, p, failing); !errors.Is(err, boom) {
		t.Fatalf("failing Do = %v, want its error", err)
	}
	rec, err := s.Get(ctx, p.User, p.Key)
	if err != nil || rec.Response != nil || rec.Method != "" || rec.Path != p.Operation {
		t.Fatalf("record after the failure = %+v, %v; want it bound without a response", rec, err)
	}
	unknown := doParams("msg-unknown", "storetest.unknown", nil)
	if _, err := idem.Do(ctx, s, unknown, failing); !errors.Is(err, boom) {
		t.Fatalf("failing Do = %v, want its error", err)
	}
	// An HTTP record, failed, whose path is a registered operation.
	hp := params(p.User, "http-redrive", "fp-http")
	if err := s.Fail(ctx, mustLease(t, s, hp)); err != nil {
		t.Fatalf("Fail: %v", err)
	}

	trapped := 0
	c := idem.NewCompleter(ss, nil, idem.CompleterOptions{
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Funcs: map[string]idem.DoFunc{
			p.Operation: func(ctx context.Context, in []byte) ([]byte, error) {
				return append([]byte("done: "), in...), doWrite(ctx, h, "do-redrive")
			},
			hp.Path: func(context.Context, []byte) ([]byte, error) { trapped++; return nil, nil },
		},
	})
	st, err := c.RunOnce(ctx)
	// The scan lists only what the completer runs (AbandonedParams.Kinds):
	// neither the unregistered operation nor the HTTP record.
	if err != nil || st.Scanned != 1 || st.Completed != 1 || st.Skipped != 0 || st.Failed != 0 {
		t.Errorf("completer scan = %+v, %v; want 1 scanned and completed", st, err)
	}
	if trapped != 0 {
		t.Error("an HTTP record was run through a DoFunc")
	}
	res, err := idem.Do(ctx, s, p, failing)
	if err != nil || !res.Replayed || string(res.Output) != "done: order 42" {
		t.Errorf("Do after the completer = %+v (%q), %v; want its output replayed", res, res.Output, err)
	}
	if got := count(t, h, s, "do-redrive"); got != 1 {
		t.Errorf("completer's effects = %d, want 1", got)
	}
	if got := count(t, h, s, "do-redrive-failed"); got != 0 {
		t.Errorf("failed attempts' effects = %d, want 0", got)
	}
	if rec, err := s.Get(ctx, p.User, p.Key); err != nil || rec.Redrives != 1 || rec.Attempts != 2 {
		t.Errorf("record = %+v, %v; want 2 attempts, 1 re-drive", rec, err)
	}
	for _, k := range []string{unknown.Key, hp.Key} {
		if rec, err := s.Get(ctx, p.User, k); err != nil || rec.Attempts != 1 || rec.Redrives != 0 || rec.Response != nil {
			t.Errorf("%s = %+v, %v; want it untouched", k, rec, err)
		}
	}
}

// testDoRedriveNotStarved: records a completer would skip without a claim
// (HTTP requests when it has no handler, operations not in its Funcs) do
// not fill its batches: with a batch of 2 behind 4 such records, its first
// scan re-drives the operation it runs.
func testDoRedriveNotStarved(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	ss, ok := s.(idemdriver.SweepingStore)
	if !ok {
		t.Skip("store does not implement idemdriver.Sweeper")
	}
	boom := errors.New("downstream down")
	failing := func(context.Context, []byte) ([]byte, error) { return nil, boom }
	// Their leases end first, and their keys sort first.
	for _, k := range []string{"a-http-1", "a-http-2"} {
		if err := s.Fail(ctx, mustLease(t, s, params("storetest:consumer", k, "fp-http"))); err != nil {
			t.Fatalf("Fail: %v", err)
		}
	}
	for _, k := range []string{"a-other-1", "a-other-2"} {
		if _, err := idem.Do(ctx, s, doParams(k, "storetest.other", nil), failing); !errors.Is(err, boom) {
			t.Fatalf("failing Do = %v, want its error", err)
		}
	}
	p := doParams("z-mine", "storetest.mine", []byte("order 7"))
	if _, err := idem.Do(ctx, s, p, failing); !errors.Is(err, boom) {
		t.Fatalf("failing Do = %v, want its error", err)
	}
	c := idem.NewCompleter(ss, nil, idem.CompleterOptions{
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Batch:  2,
		Funcs: map[string]idem.DoFunc{
			p.Operation: func(ctx context.Context, in []byte) ([]byte, error) {
				return in, doWrite(ctx, h, "do-not-starved")
			},
		},
	})
	st, err := c.RunOnce(ctx)
	if err != nil || st.Completed != 1 || st.Skipped != 0 {
		t.Errorf("completer's first scan = %+v, %v; want the operation completed, nothing skipped", st, err)
	}
	if got := count(t, h, s, "do-not-starved"); got != 1 {
		t.Errorf("effects = %d, want 1", got)
	}
}

// testAbandonedKinds: AbandonedParams.Kinds selects HTTP records (a
// non-empty Method) and the Do operations it names, before the limit;
// nil selects every record, an empty AbandonedKinds none.
func testAbandonedKinds(t *testing.T, h Harness) {
	ctx := context.Background()
	s := h.New(t)
	sw, ok := s.(idemdriver.Sweeper)
	if !ok {
		t.Skip("store does not implement idemdriver.Sweeper")
	}
	failing := func(context.Context, []byte) ([]byte, error) { return nil, errors.New("down") }
	if err := s.Fail(ctx, mustLease(t, s, params("storetest:consumer", "k1-http", "fp-http"))); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	for _, c := range []struct{ key, op string }{{"k2-a", "op.a"}, {"k3-b", "op.b"}, {"k4-a", "op.a"}} {
		if _, err := idem.Do(ctx, s, doParams(c.key, c.op, nil), failing); err == nil {
			t.Fatal("failing Do succeeded")
		}
	}
	// An HTTP record whose path is an operation's name is still HTTP.
	hp := params("storetest:consumer", "k5-http", "fp-http")
	hp.Path = "op.a"
	if err := s.Fail(ctx, mustLease(t, s, hp)); err != nil {
		t.Fatalf("Fail: %v", err)
	}
	// An operation named with U+FFFD, which a store must not take for
	// a name that is not UTF-8.
	if _, err := idem.Do(ctx, s, doParams("k6-r", "op.\uFFFD", nil), failing); err == nil {
		t.Fatal("failing Do succeeded")
	}
	for _, c := range []struct {
		kinds *idemdriver.AbandonedKinds
		limit int
		want  string
	}{
		{nil, 10, "k1-http k2-a k3-b k4-a k5-http k6-r"},
		{&idemdriver.AbandonedKinds{}, 10, ""},
		{&idemdriver.AbandonedKinds{HTTP: true}, 10, "k1-http k5-http"},
		{&idemdriver.AbandonedKinds{Operations: []string{"op.a"}}, 10, "k2-a k4-a"},
		{&idemdriver.AbandonedKinds{Operations: []string{"op.b", "op.none"}}, 10, "k3-b"},
		{&idemdriver.AbandonedKinds{HTTP: true, Operations: []string{"op.b"}}, 10, "k1-http k3-b k5-http"},
		{&idemdriver.AbandonedKinds{Operations: []string{"op.a"}}, 1, "k2-a"},
		// Names no record can have (not UTF-8, a NUL) select nothing,
		// and fail nothing.
		{&idemdriver.AbandonedKinds{Operations: []string{"op.b\xff", "op.b\x00", "op.\xff"}}, 10, ""},
		{&idemdriver.AbandonedKinds{Operations: []string{"op.\uFFFD"}}, 10, "k6-r"},
		{&idemdriver.AbandonedKinds{Operations: []string{"op\xff", "op.b"}}, 10, "k3-b"},
		{&idemdriver.AbandonedKinds{HTTP: true}, 1, "k1-http"},
		{&idemdriver.AbandonedKinds{Operations: []string{"op.b"}}, 1, "k3-b"},
	} {
		recs, err := sw.Abandoned(ctx, idemdriver.AbandonedParams{Limit: c.limit, Kinds: c.kinds})
		if got := keys(recs); err != nil || got != c.want {
			t.Errorf("Abandoned(Kinds %+v, Limit %d) = %q, %v; want %q", c.kinds, c.limit, got, err, c.want)
		}
		for _, r := range recs {
			if !(idemdriver.AbandonedParams{Kinds: c.kinds}).Selects(&r) {
				t.Errorf("Selects(%s) with Kinds %+v = false, but Abandoned returned it", r.Key, c.kinds)
			}
		}
	}
}
