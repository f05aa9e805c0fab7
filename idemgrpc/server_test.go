package idemgrpc_test

import (
	"bytes"
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemgrpc"
	"github.com/idem-go/idem/memstore"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// order is a Create request of the tests: a Struct with a map, so that
// only a deterministic encoding is stable.
func order(t testing.TB, sku string) *structpb.Struct {
	return mustStruct(t, map[string]any{
		"sku": sku, "quantity": 2, "currency": "EUR",
		"lines": []any{map[string]any{"b": 1, "a": 2, "c": "x"}},
	})
}

// errorInfo returns err's ErrorInfo detail, or nil.
func errorInfo(err error) *errdetails.ErrorInfo {
	for _, d := range status.Convert(err).Details() {
		if e, ok := d.(*errdetails.ErrorInfo); ok {
			return e
		}
	}
	return nil
}

// TestConcurrentCallsRunOnce sends 50 identical calls with one key at
// once, through each interceptor: the handler runs once, its write
// commits once, and every call gets its answer: at once (Aborted while
// in flight, with retry-after; a retry then replays it) or, with
// InFlightWait, after waiting for it.
func TestConcurrentCallsRunOnce(t *testing.T) {
	forEachStoreAndTransport(t, func(t *testing.T, h harness, tr transport) {
		for _, wait := range []time.Duration{0, 20 * time.Second} {
			t.Run("InFlightWait="+wait.String(), func(t *testing.T) {
				key := "concurrent-" + wait.String()
				var n atomic.Int64
				svc := &service{handle: func(ctx context.Context, req *structpb.Struct) (*structpb.Struct, error) {
					if err := h.write(ctx, key); err != nil {
						return nil, err
					}
					time.Sleep(300 * time.Millisecond)
					return mustStruct(t, map[string]any{"order": float64(n.Add(1)), "sku": req.Fields["sku"].GetStringValue()}), nil
				}}
				create := tr.start(t, svc, h.store, wait)
				ctx := t.Context()

				const calls = 50
				results := make([]answer, calls)
				var wg sync.WaitGroup
				for i := range results {
					wg.Go(func() { results[i] = create(ctx, key, order(t, "SKU-1")) })
				}
				wg.Wait()

				var ok, aborted, replayed int
				var want []byte
				for i, r := range results {
					switch r.code {
					case codes.OK:
						ok++
						if r.replayed {
							replayed++
						}
						if got := encode(t, r.resp); want == nil {
							want = got
						} else if !bytes.Equal(got, want) {
							t.Errorf("call %d: answer %v differs from another's", i, r.resp)
						}
					case codes.Aborted:
						aborted++
						if s, err := strconv.Atoi(r.retryAfter); err != nil || s < 1 {
							t.Errorf("call %d: Aborted with retry-after %q", i, r.retryAfter)
						}
					default:
						t.Errorf("call %d: %v", i, r.err)
					}
				}
				t.Logf("%d OK (%d replayed), %d Aborted", ok, replayed, aborted)
				if ok < 1 || ok != replayed+1 {
					t.Errorf("%d OK answers, %d of them replayed: want one run and the rest replays", ok, replayed)
				}
				if wait > 0 && aborted != 0 {
					t.Errorf("%d calls Aborted with InFlightWait %v", aborted, wait)
				}
				// A retry after they are done replays the one answer.
				r := create(ctx, key, order(t, "SKU-1"))
				if r.err != nil || !r.replayed || !bytes.Equal(encode(t, r.resp), want) {
					t.Errorf("retry: %v, replayed %v, answer %v", r.err, r.replayed, r.resp)
				}
				if got := svc.runs.Load(); got != 1 {
					t.Errorf("handler ran %d times, want 1", got)
				}
				if got := h.count(t, key); got != 1 {
					t.Errorf("the handler's write committed %d times, want 1", got)
				}
			})
		}
	})
}

// TestReplayIsIdentical: a repeat of the call gets the first answer,
// byte for byte in deterministic encoding, with idempotent-replayed, and
// the handler does not run again.
func TestReplayIsIdentical(t *testing.T) {
	forEachStoreAndTransport(t, func(t *testing.T, h harness, tr transport) {
		svc := &service{handle: func(ctx context.Context, req *structpb.Struct) (*structpb.Struct, error) {
			if err := h.write(ctx, "replay"); err != nil {
				return nil, err
			}
			return mustStruct(t, map[string]any{
				"id": "ord_1", "total": 2598, "items": req.Fields["lines"].AsInterface(),
				"meta": map[string]any{"z": true, "y": nil, "x": "é"},
			}), nil
		}}
		create := tr.start(t, svc, h.store, 0)
		first := create(t.Context(), "replay-1", order(t, "SKU-1"))
		if first.err != nil {
			t.Fatal(first.err)
		}
		if first.replayed {
			t.Error("the first answer says idempotent-replayed")
		}
		second := create(t.Context(), "replay-1", order(t, "SKU-1"))
		if second.err != nil {
			t.Fatal(second.err)
		}
		if !second.replayed {
			t.Errorf("the replay has no %s: true", idemgrpc.ReplayedMetadata)
		}
		if a, b := encode(t, first.resp), encode(t, second.resp); !bytes.Equal(a, b) {
			t.Errorf("replay differs:\nfirst  %x\nreplay %x", a, b)
		}
		if got := svc.runs.Load(); got != 1 {
			t.Errorf("handler ran %d times, want 1", got)
		}
		if got := h.count(t, "replay"); got != 1 {
			t.Errorf("the handler's write committed %d times, want 1", got)
		}
	})
}

// TestMismatch: the key reused with another request is InvalidArgument
// with an ErrorInfo detail, and the handler does not run.
func TestMismatch(t *testing.T) {
	forEachStoreAndTransport(t, func(t *testing.T, h harness, tr transport) {
		svc := &service{handle: func(context.Context, *structpb.Struct) (*structpb.Struct, error) {
			return new(structpb.Struct), nil
		}}
		create := tr.start(t, svc, h.store, 0)
		if r := create(t.Context(), "mismatch", order(t, "SKU-1")); r.err != nil {
			t.Fatal(r.err)
		}
		r := create(t.Context(), "mismatch", order(t, "SKU-2"))
		if r.code != codes.InvalidArgument {
			t.Fatalf("reused key: %v, want InvalidArgument", r.err)
		}
		if r.info == nil || r.info.Reason != idemgrpc.ReasonKeyReused || r.info.Domain != idemgrpc.ErrorDomain || r.info.Metadata["method"] != createMethod {
			t.Errorf("ErrorInfo %v, want reason %s", r.info, idemgrpc.ReasonKeyReused)
		}
		if got := svc.runs.Load(); got != 1 {
			t.Errorf("handler ran %d times, want 1", got)
		}
	})
}

// TestStoreDown: a store that fails is Unavailable, and the handler does
// not run.
func TestStoreDown(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		svc := &service{handle: func(context.Context, *structpb.Struct) (*structpb.Struct, error) {
			return new(structpb.Struct), nil
		}}
		r := tr.start(t, svc, downStore{memstore.New(memstore.Options{})}, 0)(t.Context(), "down", order(t, "SKU-1"))
		if r.code != codes.Unavailable {
			t.Fatalf("store down: %v, want Unavailable", r.err)
		}
		if strings.Contains(r.err.Error(), errDown.Error()) {
			t.Errorf("the answer %q tells the store's error", r.err)
		}
		if got := svc.runs.Load(); got != 0 {
			t.Errorf("handler ran %d times, want 0", got)
		}
	})
}

// TestStoredErrorReplays: a final error (FailedPrecondition, as a
// declined payment) is stored with its details and its writes commit;
// a repeat replays it without running the handler.
func TestStoredErrorReplays(t *testing.T) {
	forEachStoreAndTransport(t, func(t *testing.T, h harness, tr transport) {
		svc := &service{handle: func(ctx context.Context, _ *structpb.Struct) (*structpb.Struct, error) {
			if err := h.write(ctx, "declined"); err != nil {
				return nil, err
			}
			return nil, tr.fail(t, codes.FailedPrecondition, "card declined", "CARD_DECLINED")
		}}
		create := tr.start(t, svc, h.store, 0)
		first := create(t.Context(), "declined", order(t, "SKU-1"))
		second := create(t.Context(), "declined", order(t, "SKU-1"))
		for _, r := range []answer{first, second} {
			if r.code != codes.FailedPrecondition {
				t.Fatalf("answer %v, want FailedPrecondition", r.err)
			}
			if r.info == nil || r.info.Reason != "CARD_DECLINED" {
				t.Errorf("details lost: %v", r.info)
			}
		}
		if !proto.Equal(first.status, second.status) {
			t.Errorf("replayed status %v, first %v", second.status, first.status)
		}
		if first.replayed || !second.replayed {
			t.Errorf("idempotent-replayed: first %v, second %v", first.replayed, second.replayed)
		}
		if got := svc.runs.Load(); got != 1 {
			t.Errorf("handler ran %d times, want 1", got)
		}
		if got := h.count(t, "declined"); got != 1 {
			t.Errorf("the handler's write committed %d times, want 1", got)
		}
	})
}

// TestRetryableErrorRunsAgain: a retryable code (Unavailable) is not
// stored and its writes roll back; the same call sent again runs the
// handler again at once, and its answer is then stored. The key stays
// bound to its request: another request with it is refused.
func TestRetryableErrorRunsAgain(t *testing.T) {
	forEachStoreAndTransport(t, func(t *testing.T, h harness, tr transport) {
		svc := &service{}
		svc.handle = func(ctx context.Context, _ *structpb.Struct) (*structpb.Struct, error) {
			if err := h.write(ctx, "retryable"); err != nil {
				return nil, err
			}
			if svc.runs.Load() == 1 {
				return nil, tr.fail(t, codes.Unavailable, "gateway down", "")
			}
			return mustStruct(t, map[string]any{"id": "ord_2"}), nil
		}
		create := tr.start(t, svc, h.store, 0)
		if r := create(t.Context(), "retryable", order(t, "SKU-1")); r.code != codes.Unavailable || r.replayed {
			t.Fatalf("first call: %v (replayed %v), want the handler's Unavailable", r.err, r.replayed)
		}
		if got := h.count(t, "retryable"); got != 0 {
			t.Errorf("the failed call's write committed (%d)", got)
		}
		if r := create(t.Context(), "retryable", order(t, "SKU-2")); r.code != codes.InvalidArgument || r.info.GetReason() != idemgrpc.ReasonKeyReused {
			t.Errorf("another request with the key: %v, want InvalidArgument %s", r.err, idemgrpc.ReasonKeyReused)
		}
		r := create(t.Context(), "retryable", order(t, "SKU-1"))
		if r.err != nil || r.replayed {
			t.Fatalf("second call: %v (replayed %v), want a new run", r.err, r.replayed)
		}
		if r := create(t.Context(), "retryable", order(t, "SKU-1")); r.err != nil || !r.replayed {
			t.Errorf("third call: %v (replayed %v), want a replay", r.err, r.replayed)
		}
		if got := svc.runs.Load(); got != 2 {
			t.Errorf("handler ran %d times, want 2", got)
		}
		if got := h.count(t, "retryable"); got != 1 {
			t.Errorf("the handler's write committed %d times, want 1", got)
		}
	})
}

// TestRetryableKeyStaysBound: after a retryable error the key is still
// bound to its request.
func TestRetryableKeyStaysBound(t *testing.T) {
	svc := &service{handle: func(context.Context, *structpb.Struct) (*structpb.Struct, error) {
		return nil, status.Error(codes.Internal, "boom")
	}}
	conn := serve(t, svc, []grpc.UnaryServerInterceptor{idemgrpc.UnaryServerInterceptor(memstore.New(memstore.Options{}), testOptions())})
	if r := create(t.Context(), conn, "bound", order(t, "SKU-1")); status.Code(r.err) != codes.Internal {
		t.Fatalf("first call: %v, want Internal", r.err)
	}
	if r := create(t.Context(), conn, "bound", order(t, "SKU-2")); status.Code(r.err) != codes.InvalidArgument || errorInfo(r.err).GetReason() != idemgrpc.ReasonKeyReused {
		t.Errorf("another request with the key: %v, want InvalidArgument %s", r.err, idemgrpc.ReasonKeyReused)
	}
}

// TestStoredCodes pins the default table.
func TestStoredCodes(t *testing.T) {
	stored := map[codes.Code]bool{
		codes.OK: true, codes.InvalidArgument: true, codes.NotFound: true, codes.AlreadyExists: true,
		codes.FailedPrecondition: true, codes.OutOfRange: true, codes.Unimplemented: true,
	}
	for c := codes.OK; c <= codes.Unauthenticated; c++ {
		if got := idemgrpc.StoredCode(c); got != stored[c] {
			t.Errorf("StoredCode(%v) = %v, want %v", c, got, stored[c])
		}
	}
}

// TestKeyRules: a missing key, a bad one, OptionalKey, the quoted
// spelling, methods not opted in, and two users with one key.
func TestKeyRules(t *testing.T) {
	var n atomic.Int64
	svc := &service{handle: func(context.Context, *structpb.Struct) (*structpb.Struct, error) {
		return mustStruct(t, map[string]any{"n": float64(n.Add(1))}), nil
	}}
	store := memstore.New(memstore.Options{})
	conn := serve(t, svc, []grpc.UnaryServerInterceptor{idemgrpc.UnaryServerInterceptor(store, testOptions())})
	ctx := t.Context()

	r := create(ctx, conn, "", order(t, "SKU-1"))
	if status.Code(r.err) != codes.InvalidArgument || errorInfo(r.err).GetReason() != idemgrpc.ReasonKeyMissing {
		t.Errorf("no key: %v, want InvalidArgument %s", r.err, idemgrpc.ReasonKeyMissing)
	}
	for _, bad := range []string{"a b", strings.Repeat("k", 256), `"open`, `"a\x"`} {
		r := create(ctx, conn, bad, order(t, "SKU-1"))
		if status.Code(r.err) != codes.InvalidArgument || errorInfo(r.err).GetReason() != idemgrpc.ReasonKeyInvalid {
			t.Errorf("key %q: %v, want InvalidArgument %s", bad, r.err, idemgrpc.ReasonKeyInvalid)
		}
	}
	two := metadata.AppendToOutgoingContext(ctx, idemgrpc.KeyMetadata, "k1", idemgrpc.KeyMetadata, "k2")
	if err := conn.Invoke(two, createMethod, order(t, "SKU-1"), new(structpb.Struct)); status.Code(err) != codes.InvalidArgument {
		t.Errorf("two keys: %v, want InvalidArgument", err)
	}
	if got := svc.runs.Load(); got != 0 {
		t.Fatalf("handler ran %d times on refused calls", got)
	}

	// "abc" and abc name one key.
	if r := create(ctx, conn, "abc", order(t, "SKU-1")); r.err != nil || r.replayed() {
		t.Fatalf("bare key: %v", r.err)
	}
	if r := create(ctx, conn, `"abc"`, order(t, "SKU-1")); r.err != nil || !r.replayed() {
		t.Errorf("quoted key: %v, replayed %v; want the bare key's replay", r.err, r.replayed())
	}
	// Another user's key of the same name is another operation.
	bob := metadata.AppendToOutgoingContext(ctx, "x-user", "bob")
	if r := create(bob, conn, "abc", order(t, "SKU-1")); r.err != nil || r.replayed() {
		t.Errorf("bob's abc: %v, replayed %v; want a run of its own", r.err, r.replayed())
	}
	// A method not opted in passes through untouched, key or none.
	before := svc.runs.Load()
	for range 2 {
		var out structpb.Struct
		var hdr metadata.MD
		kctx := metadata.AppendToOutgoingContext(ctx, idemgrpc.KeyMetadata, "peek")
		if err := conn.Invoke(kctx, peekMethod, order(t, "SKU-1"), &out, grpc.Header(&hdr)); err != nil || len(hdr.Get(idemgrpc.ReplayedMetadata)) != 0 {
			t.Errorf("Peek: %v, header %v", err, hdr)
		}
	}
	if got := svc.runs.Load() - before; got != 2 {
		t.Errorf("Peek ran %d times, want 2", got)
	}

	// OptionalKey: a call without a key runs, unprotected, every time.
	opts := testOptions()
	opts.OptionalKey = true
	optional := serve(t, svc, []grpc.UnaryServerInterceptor{idemgrpc.UnaryServerInterceptor(store, opts)})
	before = svc.runs.Load()
	for range 2 {
		if r := create(ctx, optional, "", order(t, "SKU-1")); r.err != nil || r.replayed() {
			t.Errorf("OptionalKey without a key: %v, replayed %v", r.err, r.replayed())
		}
	}
	if got := svc.runs.Load() - before; got != 2 {
		t.Errorf("without a key the handler ran %d times, want 2", got)
	}
}

// TestUserRules: User's error is the answer (its status, else
// Unauthenticated), and an empty user is Unauthenticated.
func TestUserRules(t *testing.T) {
	svc := &service{handle: func(context.Context, *structpb.Struct) (*structpb.Struct, error) { return new(structpb.Struct), nil }}
	for _, c := range []struct {
		user func(context.Context) (string, error)
		want codes.Code
	}{
		{func(context.Context) (string, error) { return "", nil }, codes.Unauthenticated},
		{func(context.Context) (string, error) { return "", errors.New("no token") }, codes.Unauthenticated},
		{func(context.Context) (string, error) { return "", status.Error(codes.PermissionDenied, "no") }, codes.PermissionDenied},
	} {
		opts := testOptions()
		opts.User = c.user
		conn := serve(t, svc, []grpc.UnaryServerInterceptor{idemgrpc.UnaryServerInterceptor(memstore.New(memstore.Options{}), opts)})
		if r := create(t.Context(), conn, "u", order(t, "SKU-1")); status.Code(r.err) != c.want {
			t.Errorf("answer %v, want %v", r.err, c.want)
		}
	}
	if got := svc.runs.Load(); got != 0 {
		t.Errorf("handler ran %d times, want 0", got)
	}
}

// TestPanicRunsAgain: a handler's panic is Internal, nothing is stored,
// and the same call runs again.
func TestPanicRunsAgain(t *testing.T) {
	svc := &service{}
	svc.handle = func(context.Context, *structpb.Struct) (*structpb.Struct, error) {
		if svc.runs.Load() == 1 {
			panic("first attempt panics")
		}
		return new(structpb.Struct), nil
	}
	conn := serve(t, svc, []grpc.UnaryServerInterceptor{idemgrpc.UnaryServerInterceptor(memstore.New(memstore.Options{}), testOptions())})
	if r := create(t.Context(), conn, "panic", order(t, "SKU-1")); status.Code(r.err) != codes.Internal {
		t.Fatalf("panic: %v, want Internal", r.err)
	}
	if r := create(t.Context(), conn, "panic", order(t, "SKU-1")); r.err != nil || r.replayed() {
		t.Errorf("after the panic: %v, replayed %v; want a new run", r.err, r.replayed())
	}
}

// TestWrongResponseType: a handler answering another message type than
// Options.Methods builds is Internal and nothing is stored.
func TestWrongResponseType(t *testing.T) {
	svc := &service{handle: func(context.Context, *structpb.Struct) (*structpb.Struct, error) { return new(structpb.Struct), nil }}
	opts := testOptions()
	opts.Methods = map[string]func() proto.Message{createMethod: func() proto.Message { return new(structpb.ListValue) }}
	conn := serve(t, svc, []grpc.UnaryServerInterceptor{idemgrpc.UnaryServerInterceptor(memstore.New(memstore.Options{}), opts)})
	for range 2 {
		if r := create(t.Context(), conn, "type", order(t, "SKU-1")); status.Code(r.err) != codes.Internal {
			t.Errorf("answer %v, want Internal", r.err)
		}
	}
	if got := svc.runs.Load(); got != 2 {
		t.Errorf("handler ran %d times, want 2 (nothing stored)", got)
	}
}

// TestInterceptorRefusesBadOptions: the constructor panics on options it
// cannot work with.
func TestInterceptorRefusesBadOptions(t *testing.T) {
	store := memstore.New(memstore.Options{})
	for name, c := range map[string]struct {
		store idem.Store
		opts  func(*idemgrpc.Options)
	}{
		"nil store":  {nil, func(*idemgrpc.Options) {}},
		"nil User":   {store, func(o *idemgrpc.Options) { o.User = nil }},
		"no Methods": {store, func(o *idemgrpc.Options) { o.Methods = nil }},
		"bad method": {store, func(o *idemgrpc.Options) { o.Methods = map[string]func() proto.Message{"Create": newStruct} }},
		"nil func":   {store, func(o *idemgrpc.Options) { o.Methods = map[string]func() proto.Message{createMethod: nil} }},
		"func returns nil": {store, func(o *idemgrpc.Options) {
			o.Methods = map[string]func() proto.Message{createMethod: func() proto.Message { return nil }}
		}},
		"func returns a typed nil": {store, func(o *idemgrpc.Options) {
			o.Methods = map[string]func() proto.Message{createMethod: func() proto.Message { return (*structpb.Struct)(nil) }}
		}},
		"negative TTL": {store, func(o *idemgrpc.Options) { o.TTL = -1 }},
		"lease >= TTL": {store, func(o *idemgrpc.Options) { o.Lease, o.TTL = time.Hour, time.Minute }},
	} {
		t.Run(name, func(t *testing.T) {
			opts := testOptions()
			c.opts(&opts)
			defer func() {
				if recover() == nil {
					t.Error("no panic")
				}
			}()
			idemgrpc.UnaryServerInterceptor(c.store, opts)
		})
	}
}
