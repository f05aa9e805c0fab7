package idemgrpc_test

// The completer's re-drives of abandoned calls (idemgrpc.CompleterFuncs,
// idemconnect.CompleterFunc), on the stores of forEachStore, through
// both interceptors.

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/idemgrpc"
	"github.com/idem-go/idem/idemgrpc/idemconnect"
	"github.com/idem-go/idem/memstore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// redriveLease is the interceptors' lease in these tests: a call whose
// server "died" is abandoned once it ran out.
const redriveLease = time.Second

// quiet discards the completer's and the interceptors' logs.
var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// A side is one interceptor for the re-drive tests: how a client calls
// Create through it, and the completer's functions it gives.
type side struct {
	name string
	// serve serves svc behind the interceptor on store, with
	// redriveLease, and returns a function that calls Create as user.
	serve func(t testing.TB, svc *service, store idem.Store) func(ctx context.Context, user, key string, req *structpb.Struct) answer
	// funcs are the completer's functions of svc's Create.
	funcs func(svc *service) map[string]idem.DoFunc
	// fail is the side's handler error (transport.fail).
	fail func(t testing.TB, code codes.Code, msg, reason string) error
}

var sides = []side{
	{
		name: "grpc",
		serve: func(t testing.TB, svc *service, store idem.Store) func(context.Context, string, string, *structpb.Struct) answer {
			opts := testOptions()
			opts.Lease, opts.Logger = redriveLease, quiet
			conn := serve(t, svc, []grpc.UnaryServerInterceptor{idemgrpc.UnaryServerInterceptor(store, opts)})
			return func(ctx context.Context, user, key string, req *structpb.Struct) answer {
				return grpcAnswer(create(metadata.AppendToOutgoingContext(ctx, "x-user", user), conn, key, req))
			}
		},
		funcs: func(svc *service) map[string]idem.DoFunc {
			return idemgrpc.CompleterFuncs(&serviceDesc, svc, testOptions())
		},
		fail: transports[0].fail,
	},
	{
		name: "connect",
		serve: func(t testing.TB, svc *service, store idem.Store) func(context.Context, string, string, *structpb.Struct) answer {
			opts := connectOptions()
			opts.Lease, opts.Logger = redriveLease, quiet
			c := serveConnect(t, svc, idemconnect.NewInterceptor(store, opts)).creator(createMethod)
			return func(ctx context.Context, user, key string, req *structpb.Struct) answer {
				return call(ctx, c, key, req, "x-user", user)
			}
		},
		funcs: func(svc *service) map[string]idem.DoFunc {
			return map[string]idem.DoFunc{createMethod: idemconnect.CompleterFunc(createMethod, connectHandler(svc), connectOptions())}
		},
		fail: transports[1].fail,
	},
}

// connectHandler is Create's Connect handler of svc, as serveConnect
// serves it.
func connectHandler(svc *service) func(context.Context, *connect.Request[structpb.Struct]) (*connect.Response[structpb.Struct], error) {
	return func(ctx context.Context, req *connect.Request[structpb.Struct]) (*connect.Response[structpb.Struct], error) {
		resp, err := svc.call(ctx, req.Msg)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(resp), nil
	}
}

// forEachStoreAndSide runs f, as a subtest, for each side and store.
func forEachStoreAndSide(t *testing.T, f func(t *testing.T, h harness, sd side)) {
	for _, sd := range sides {
		t.Run(sd.name, func(t *testing.T) {
			forEachStore(t, func(t *testing.T, h harness) { f(t, h, sd) })
		})
	}
}

// reply is Create's answer to req for user (whom the handler learns from
// idem.LeaseFromContext, in a call and in a re-drive alike): a function
// of them only, so that two runs give the same bytes.
func reply(t testing.TB, user string, req *structpb.Struct) *structpb.Struct {
	return mustStruct(t, map[string]any{
		"user": user, "sku": req.Fields["sku"].GetStringValue(),
		"lines": req.Fields["lines"].AsInterface(), "m": map[string]any{"z": 1, "a": "é"},
	})
}

// leaseUser is the user of ctx's lease, "" outside idem.Do.
func leaseUser(ctx context.Context) string {
	if l, ok := idem.LeaseFromContext(ctx); ok {
		return l.User
	}
	return ""
}

// newTestCompleter is a completer of store with funcs, quiet.
func newTestCompleter(t testing.TB, store idem.Store, funcs map[string]idem.DoFunc) *idem.Completer {
	t.Helper()
	s, ok := store.(idemdriver.SweepingStore)
	if !ok {
		t.Fatalf("%T is not an idemdriver.SweepingStore", store)
	}
	return idem.NewCompleter(s, nil, idem.CompleterOptions{Funcs: funcs, Logger: quiet})
}

// redriveOnce scans with c until a scan re-drove a key (Completed or
// Failed), for up to 20s (a lease to run out), and returns that scan.
func redriveOnce(t testing.TB, c *idem.Completer) idem.CompleterStats {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		st, err := c.RunOnce(t.Context())
		if err != nil {
			t.Fatalf("RunOnce: %v", err)
		}
		if st.Completed+st.Failed > 0 {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("nothing re-driven in 20s (last scan %+v)", st)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// record is the store's record of (user, key).
func record(t testing.TB, store idem.Store, user, key string) *idemdriver.Record {
	t.Helper()
	rec, err := store.(idemdriver.SweepingStore).Get(context.Background(), user, key)
	if err != nil {
		t.Fatalf("Get(%s, %s): %v", user, key, err)
	}
	return rec
}

// mustNotRun is a service whose handler fails the test: the calls of
// the retries are replays.
func mustNotRun(t testing.TB) *service {
	return &service{handle: func(context.Context, *structpb.Struct) (*structpb.Struct, error) {
		t.Error("the handler ran on a key the completer finished")
		return nil, errors.New("ran")
	}}
}

// TestCompleterFinishesAbandonedCall: a call whose server dies after the
// handler wrote (its first run blocks, holding its uncommitted write,
// until its lease ran out) is finished by a completer with the functions
// of either interceptor (the call made through either): the handler runs
// again with the stored request and the call's user, its write commits
// once, and the completer's answer is stored as the interceptor stores
// one, byte for byte, so the client's retry replays it through both
// interceptors. The dead attempt, woken, is fenced: its write rolls back.
func TestCompleterFinishesAbandonedCall(t *testing.T) {
	forEachStore(t, func(t *testing.T, h harness) {
		for _, origin := range sides {
			for _, redriver := range sides {
				t.Run(origin.name+"-call/"+redriver.name+"-completer", func(t *testing.T) {
					key := "died-" + origin.name + "-" + redriver.name
					entered, release := make(chan struct{}), make(chan struct{})
					svc := &service{}
					svc.handle = func(ctx context.Context, req *structpb.Struct) (*structpb.Struct, error) {
						if err := h.write(ctx, key); err != nil {
							return nil, err
						}
						if svc.runs.Load() == 1 {
							close(entered) // the server "dies" here
							<-release
						}
						return reply(t, leaseUser(ctx), req), nil
					}
					ctx, req := t.Context(), order(t, "SKU-1")
					dead := make(chan answer, 1)
					go func() { dead <- origin.serve(t, svc, h.store)(ctx, "bob", key, req) }()
					<-entered

					st := redriveOnce(t, newTestCompleter(t, h.store, redriver.funcs(svc)))
					if st.Completed != 1 || st.Failed != 0 {
						t.Fatalf("scan %+v, want 1 completed", st)
					}
					if got := svc.runs.Load(); got != 2 {
						t.Errorf("handler ran %d times, want 2 (the dead run and the re-drive)", got)
					}
					if got := h.count(t, key); got != 1 {
						t.Errorf("write committed %d times after the re-drive, want 1", got)
					}
					close(release)
					if a := <-dead; a.code != codes.Aborted {
						t.Errorf("the dead attempt, woken: %v, want Aborted (fenced)", a.err)
					}
					if got := h.count(t, key); got != 1 {
						t.Errorf("write committed %d times after the dead attempt woke, want 1", got)
					}

					// The client's retry replays the completer's answer,
					// through either interceptor.
					want := encode(t, reply(t, "bob", req))
					for _, sd := range sides {
						a := sd.serve(t, mustNotRun(t), h.store)(ctx, "bob", key, req)
						if a.err != nil || !a.replayed || !bytes.Equal(encode(t, a.resp), want) {
							t.Errorf("%s retry: %v, replayed %v, answer %v; want the completer's %v replayed", sd.name, a.err, a.replayed, a.resp, reply(t, "bob", req))
						}
					}
					// Byte for byte what the interceptor stores of the same
					// answer to a call.
					if a := origin.serve(t, svc, h.store)(ctx, "bob", key+"-call", req); a.err != nil || a.replayed {
						t.Fatalf("a call with another key: %v, replayed %v", a.err, a.replayed)
					}
					redriven, called := record(t, h.store, "bob", key), record(t, h.store, "bob", key+"-call")
					if !bytes.Equal(redriven.Response.Body, called.Response.Body) || redriven.Response.Status != called.Response.Status {
						t.Errorf("stored by the completer %d %x\nstored by the interceptor %d %x", redriven.Response.Status, redriven.Response.Body, called.Response.Status, called.Response.Body)
					}
				})
			}
		}
	})
}

// TestCompleterRetryableCodeLeavesKeyRetryable: a re-drive whose handler
// answers a code that Options.Stored leaves retryable stores nothing and
// commits no write: the key stays abandoned, bound to its request, and
// the client's retry runs the handler again and completes it.
func TestCompleterRetryableCodeLeavesKeyRetryable(t *testing.T) {
	forEachStoreAndSide(t, func(t *testing.T, h harness, sd side) {
		svc := &service{}
		svc.handle = func(ctx context.Context, req *structpb.Struct) (*structpb.Struct, error) {
			if err := h.write(ctx, "retryable"); err != nil {
				return nil, err
			}
			if svc.runs.Load() <= 2 { // the call and the re-drive
				return nil, sd.fail(t, codes.Unavailable, "gateway down", "")
			}
			return reply(t, leaseUser(ctx), req), nil
		}
		call, ctx, req := sd.serve(t, svc, h.store), t.Context(), order(t, "SKU-1")
		if a := call(ctx, "bob", "retryable", req); a.code != codes.Unavailable {
			t.Fatalf("the call: %v, want Unavailable", a.err)
		}
		st := redriveOnce(t, newTestCompleter(t, h.store, sd.funcs(svc)))
		if st.Failed != 1 || st.Completed != 0 {
			t.Errorf("scan %+v, want 1 failed", st)
		}
		if rec := record(t, h.store, "bob", "retryable"); rec.Response != nil || rec.Redrives != 1 {
			t.Errorf("record after the re-drive: response %v, %d re-drives; want none stored, 1 re-drive", rec.Response, rec.Redrives)
		}
		if got := h.count(t, "retryable"); got != 0 {
			t.Errorf("a retryable answer's write committed %d times", got)
		}
		if a := call(ctx, "bob", "retryable", order(t, "SKU-2")); a.code != codes.InvalidArgument {
			t.Errorf("another request with the key: %v, want InvalidArgument", a.err)
		}
		if a := call(ctx, "bob", "retryable", req); a.err != nil || a.replayed || !proto.Equal(a.resp, reply(t, "bob", req)) {
			t.Errorf("the client's retry: %v, replayed %v, %v; want a new run", a.err, a.replayed, a.resp)
		}
		if got, runs := h.count(t, "retryable"), svc.runs.Load(); got != 1 || runs != 3 {
			t.Errorf("write committed %d times, handler ran %d; want 1 and 3", got, runs)
		}
	})
}

// TestCompleterStoresFinalError: a re-drive whose handler answers a
// stored code (FailedPrecondition) completes the key with that error,
// details and all, its write committed; the client's retry replays it
// through either interceptor.
func TestCompleterStoresFinalError(t *testing.T) {
	forEachStoreAndSide(t, func(t *testing.T, h harness, sd side) {
		svc := &service{}
		svc.handle = func(ctx context.Context, _ *structpb.Struct) (*structpb.Struct, error) {
			if svc.runs.Load() == 1 {
				return nil, sd.fail(t, codes.Unavailable, "gateway down", "")
			}
			if err := h.write(ctx, "declined"); err != nil {
				return nil, err
			}
			return nil, sd.fail(t, codes.FailedPrecondition, "card declined", "CARD_DECLINED")
		}
		ctx, req := t.Context(), order(t, "SKU-1")
		if a := sd.serve(t, svc, h.store)(ctx, "bob", "declined", req); a.code != codes.Unavailable {
			t.Fatalf("the call: %v, want Unavailable", a.err)
		}
		if st := redriveOnce(t, newTestCompleter(t, h.store, sd.funcs(svc))); st.Completed != 1 {
			t.Errorf("scan %+v, want 1 completed", st)
		}
		if got := h.count(t, "declined"); got != 1 {
			t.Errorf("write committed %d times, want 1", got)
		}
		var first answer
		for i, s := range sides {
			a := s.serve(t, mustNotRun(t), h.store)(ctx, "bob", "declined", req)
			if a.code != codes.FailedPrecondition || !a.replayed || a.info.GetReason() != "CARD_DECLINED" || a.status.GetMessage() != "card declined" {
				t.Errorf("%s retry: %v (replayed %v, info %v); want the stored FailedPrecondition replayed", s.name, a.err, a.replayed, a.info)
			}
			if i == 0 {
				first = a
			} else if !proto.Equal(a.status, first.status) {
				t.Errorf("%s replays %v, %s %v", s.name, a.status, sides[0].name, first.status)
			}
		}
	})
}

// TestCompleterRacesRetries: completers re-driving an abandoned key
// while clients retry it through both interceptors, all at once: the
// handler's write commits once, every OK answer is the same, and the
// key ends completed.
func TestCompleterRacesRetries(t *testing.T) {
	forEachStoreAndSide(t, func(t *testing.T, h harness, sd side) {
		svc := &service{}
		svc.handle = func(ctx context.Context, req *structpb.Struct) (*structpb.Struct, error) {
			if svc.runs.Load() == 1 {
				return nil, sd.fail(t, codes.Unavailable, "gateway down", "")
			}
			if err := h.write(ctx, "race"); err != nil {
				return nil, err
			}
			time.Sleep(20 * time.Millisecond)
			return reply(t, leaseUser(ctx), req), nil
		}
		ctx, req := t.Context(), order(t, "SKU-1")
		calls := make([]func(context.Context, string, string, *structpb.Struct) answer, len(sides))
		first := 0
		for i, s := range sides {
			calls[i] = s.serve(t, svc, h.store)
			if s.name == sd.name {
				first = i // the handler's first error is this side's
			}
		}
		if a := calls[first](ctx, "bob", "race", req); a.code != codes.Unavailable {
			t.Fatalf("the call: %v, want Unavailable", a.err)
		}

		const retries, completers = 16, 4
		start := make(chan struct{})
		answers := make([]answer, retries)
		stats := make([]idem.CompleterStats, completers)
		var wg sync.WaitGroup
		for i := range answers {
			wg.Go(func() {
				<-start
				answers[i] = calls[i%len(calls)](ctx, "bob", "race", req)
			})
		}
		for i := range stats {
			c := newTestCompleter(t, h.store, sd.funcs(svc))
			wg.Go(func() {
				<-start
				var err error
				if stats[i], err = c.RunOnce(ctx); err != nil {
					t.Errorf("RunOnce: %v", err)
				}
			})
		}
		close(start)
		wg.Wait()

		want := encode(t, reply(t, "bob", req))
		var ok, aborted int
		for i, a := range answers {
			switch a.code {
			case codes.OK:
				ok++
				if !bytes.Equal(encode(t, a.resp), want) {
					t.Errorf("retry %d: %v, want %v", i, a.resp, reply(t, "bob", req))
				}
			case codes.Aborted:
				aborted++
			default:
				t.Errorf("retry %d: %v", i, a.err)
			}
		}
		for i, st := range stats {
			if st.Failed != 0 {
				t.Errorf("completer %d: %+v", i, st)
			}
		}
		t.Logf("retries: %d OK, %d Aborted; completers: %+v; handler runs %d", ok, aborted, stats, svc.runs.Load())
		if got := h.count(t, "race"); got != 1 {
			t.Errorf("write committed %d times, want 1", got)
		}
		if a := calls[1](ctx, "bob", "race", req); a.err != nil || !a.replayed || !bytes.Equal(encode(t, a.resp), want) {
			t.Errorf("the last retry: %v, replayed %v; want the answer replayed", a.err, a.replayed)
		}
		if got := h.count(t, "race"); got != 1 {
			t.Errorf("write committed %d times, want 1", got)
		}
	})
}

// TestCompleterFuncsMaps: CompleterFuncs gives a function for each of
// desc's methods opted in, and none for the others (Peek) or for methods
// desc lacks.
func TestCompleterFuncsMaps(t *testing.T) {
	opts := testOptions()
	opts.Methods["/other.Service/Do"] = newStruct
	funcs := idemgrpc.CompleterFuncs(&serviceDesc, &service{}, opts)
	if len(funcs) != 1 || funcs[createMethod] == nil {
		t.Errorf("functions of %v, want only %s", funcs, createMethod)
	}
}

// TestCompleterFuncsRefusesMisuse: CompleterFuncs panics, naming the
// misuse.
func TestCompleterFuncsRefusesMisuse(t *testing.T) {
	type ordersServer interface{ Create() }
	typed := serviceDesc
	typed.HandlerType = (*ordersServer)(nil)
	for name, c := range map[string]struct {
		desc *grpc.ServiceDesc
		impl any
		opts func(*idemgrpc.Options)
		want string
	}{
		"nil desc":           {nil, &service{}, func(*idemgrpc.Options) {}, "nil ServiceDesc"},
		"nil impl":           {&serviceDesc, nil, func(*idemgrpc.Options) {}, "nil implementation"},
		"nil pointer impl":   {&serviceDesc, (*service)(nil), func(*idemgrpc.Options) {}, "nil *idemgrpc_test.service"},
		"wrong handler type": {&typed, &service{}, func(*idemgrpc.Options) {}, "does not implement"},
		"nil func":           {&serviceDesc, &service{}, func(o *idemgrpc.Options) { o.Methods[createMethod] = nil }, "is nil"},
		"nothing opted in": {&serviceDesc, &service{}, func(o *idemgrpc.Options) {
			o.Methods = map[string]func() proto.Message{"/other.Service/Do": newStruct}
		}, "none of"},
	} {
		t.Run(name, func(t *testing.T) {
			opts := testOptions()
			c.opts(&opts)
			defer func() {
				msg, _ := recover().(string)
				if !strings.HasPrefix(msg, "idemgrpc.CompleterFuncs: ") || !strings.Contains(msg, c.want) {
					t.Errorf("panic %q, want one naming %q", msg, c.want)
				}
			}()
			idemgrpc.CompleterFuncs(c.desc, c.impl, opts)
		})
	}
	t.Run("nil inner interceptor", func(t *testing.T) {
		defer func() {
			if msg, _ := recover().(string); !strings.Contains(msg, "inner interceptor 0 is nil") {
				t.Errorf("panic %q, want one naming the nil inner interceptor", msg)
			}
		}()
		idemgrpc.CompleterFuncs(&serviceDesc, &service{}, testOptions(), nil)
	})
}

// TestConnectCompleterFuncRefusesMisuse: CompleterFunc panics, naming the
// misuse.
func TestConnectCompleterFuncRefusesMisuse(t *testing.T) {
	handler := connectHandler(&service{})
	for name, f := range map[string]func(){
		"nil handler": func() {
			idemconnect.CompleterFunc[structpb.Struct, structpb.Struct](createMethod, nil, connectOptions())
		},
		"not opted in": func() { idemconnect.CompleterFunc(peekMethod, handler, connectOptions()) },
		"another response type": func() {
			opts := connectOptions()
			opts.Methods[createMethod] = idemconnect.Response[structpb.ListValue]()
			idemconnect.CompleterFunc(createMethod, handler, opts)
		},
		"not a proto.Message": func() {
			idemconnect.CompleterFunc(createMethod, func(context.Context, *connect.Request[string]) (*connect.Response[structpb.Struct], error) {
				return nil, nil
			}, connectOptions())
		},
	} {
		t.Run(name, func(t *testing.T) {
			defer func() {
				if msg, _ := recover().(string); !strings.HasPrefix(msg, "idemconnect.CompleterFunc: ") {
					t.Errorf("panic %q, want idemconnect.CompleterFunc's", msg)
				}
			}()
			f()
		})
	}
}

// TestCompleterRunsInnerInterceptors: a call that an interceptor inside
// idemgrpc's refuses with a code that leaves the key retryable
// (PermissionDenied) is not run by the completer either: the re-drive
// goes through the interceptors CompleterFuncs is given, as a call goes
// through the server's chain, and the refusal stands.
func TestCompleterRunsInnerInterceptors(t *testing.T) {
	store := memHarness(memstore.New(memstore.Options{})).store
	svc := &service{handle: func(_ context.Context, req *structpb.Struct) (*structpb.Struct, error) { return req, nil }}
	var refusals atomic.Int64
	authz := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		if r := md.Get("x-role"); len(r) != 1 || r[0] != "admin" || info.FullMethod != createMethod {
			refusals.Add(1)
			return nil, status.Error(codes.PermissionDenied, "admins only")
		}
		return handler(ctx, req)
	}
	opts := testOptions()
	opts.Lease, opts.Logger = redriveLease, quiet
	conn := serve(t, svc, []grpc.UnaryServerInterceptor{idemgrpc.UnaryServerInterceptor(store, opts), authz})
	if r := create(t.Context(), conn, "refused", order(t, "SKU-1")); status.Code(r.err) != codes.PermissionDenied {
		t.Fatalf("the call: %v, want PermissionDenied", r.err)
	}
	st := redriveOnce(t, newTestCompleter(t, store, idemgrpc.CompleterFuncs(&serviceDesc, svc, testOptions(), authz)))
	if st.Failed != 1 || st.Completed != 0 {
		t.Errorf("scan %+v, want 1 failed", st)
	}
	if runs, n := svc.runs.Load(), refusals.Load(); runs != 0 || n != 2 {
		t.Errorf("the handler ran %d times, the interceptor refused %d; want 0 and 2 (the call and the re-drive)", runs, n)
	}
	if rec := record(t, store, "alice", "refused"); rec.Response != nil {
		t.Errorf("stored %q for a refused call", rec.Response.Body)
	}
}
