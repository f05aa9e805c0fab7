package idem_test

// What the allocation work of issue 11 must not change: the bodies read
// into the request's room, the contexts the store calls and the handler
// get, the values a replay shares with the answer, and the request
// headers kept with a claim.

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
)

// postWithKey sends a POST with key and body to h. size is the announced
// Content-Length (-1: unknown, the body then comes a byte at a time).
func postWithKey(h http.Handler, key string, body []byte, size int64, hdr ...string) *httptest.ResponseRecorder {
	var rd io.Reader = bytes.NewReader(body)
	if size < 0 {
		rd = iotest.OneByteReader(rd)
	}
	r := httptest.NewRequest(http.MethodPost, "/v1/things", rd)
	r.ContentLength = size
	r.Header.Set("Idempotency-Key", key)
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Add(hdr[i], hdr[i+1])
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

// The request body is read into room the answer then shares: a handler
// that writes its answer before it reads the body still reads the body it
// was sent, and both the answer and the request kept while it runs are
// byte for byte, whatever the sizes, announced or not (the request's body
// is dropped once the answer is stored).
func TestBodiesKeptByteForByteAnySize(t *testing.T) {
	store := memstore.New(memstore.Options{})
	var expect []byte // the body of the request running
	h := idem.Middleware(store, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The key keeps the request, for a re-drive, while it runs.
		if rec, err := store.Get(r.Context(), "", r.Header.Get("Idempotency-Key")); err != nil || !bytes.Equal(rec.Body, expect) {
			t.Errorf("the running request's record: %v, body %d bytes, want %d", err, len(rec.Body), len(expect))
		}
		n, _ := strconv.Atoi(r.URL.Query().Get("answer"))
		w.WriteHeader(http.StatusCreated)
		w.Write(bytes.Repeat([]byte{'a'}, n)) // before the body is read
		if _, err := io.Copy(w, r.Body); err != nil {
			t.Errorf("copying the request body: %v", err)
		}
	}))
	pattern := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte('0' + i%10)
		}
		return b
	}
	i := 0
	for _, reqLen := range []int{0, 1, 100, 511, 512, 513, 3000} {
		for _, ansLen := range []int{0, 1, 400, 511, 512, 3000} {
			for _, size := range []int64{int64(reqLen), -1} {
				i++
				key := "body-" + strconv.Itoa(i)
				body := pattern(reqLen)
				expect = body
				want := append(bytes.Repeat([]byte{'a'}, ansLen), body...)
				r := httptest.NewRequest(http.MethodPost, "/v1/things?answer="+strconv.Itoa(ansLen), nil)
				for j, replay := range []bool{false, true} {
					var rd io.Reader = bytes.NewReader(body)
					if size < 0 {
						rd = iotest.OneByteReader(rd)
					}
					req := r.Clone(context.Background())
					req.Body, req.ContentLength = io.NopCloser(rd), size
					req.Header.Set("Idempotency-Key", key)
					w := httptest.NewRecorder()
					h.ServeHTTP(w, req)
					if w.Code != http.StatusCreated || !bytes.Equal(w.Body.Bytes(), want) ||
						(w.Header().Get("Idempotent-Replayed") == "true") != replay {
						t.Fatalf("request %d bytes (announced %d), answer %d bytes, call %d: %d, %d bytes, replayed %q; want 201, %d bytes",
							reqLen, size, ansLen, j, w.Code, w.Body.Len(), w.Header().Get("Idempotent-Replayed"), len(want))
					}
				}
				rec, err := store.Get(context.Background(), "", key)
				if err != nil || len(rec.Body) != 0 || !bytes.Equal(rec.Response.Body, want) {
					t.Fatalf("request %d bytes, answer %d: stored %v, %d/%d bytes", reqLen, ansLen, err, len(rec.Body), len(rec.Response.Body))
				}
			}
		}
	}
}

// MaxRequestBody holds at the room's size and elsewhere, with the length
// announced or not.
func TestMaxRequestBodyAnySize(t *testing.T) {
	for _, limit := range []int64{10, 511, 512, 513, 4096} {
		h := idem.Middleware(memstore.New(memstore.Options{}), idem.Options{User: idem.SharedKeySpace, MaxRequestBody: limit})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			w.WriteHeader(http.StatusCreated)
			w.Write(b)
		}))
		for _, n := range []int64{limit, limit + 1} {
			for _, size := range []int64{n, -1} {
				body := bytes.Repeat([]byte{'x'}, int(n))
				w := postWithKey(h, "k-"+strconv.FormatInt(n, 10)+"-"+strconv.FormatInt(size, 10), body, size)
				switch {
				case n <= limit && (w.Code != http.StatusCreated || !bytes.Equal(w.Body.Bytes(), body)):
					t.Errorf("limit %d, body %d (announced %d): %d, %d bytes; want 201 and the body", limit, n, size, w.Code, w.Body.Len())
				case n > limit && w.Code != http.StatusRequestEntityTooLarge:
					t.Errorf("limit %d, body %d (announced %d): %d, want 413", limit, n, size, w.Code)
				}
			}
		}
	}
}

type exchangeCtxKey struct{}

// ctxWatchStore is a memstore that keeps the contexts its calls got and checks
// them during the calls.
type ctxWatchStore struct {
	*memstore.Store
	t         *testing.T
	useDone   bool
	claimCtx  context.Context
	child     context.Context // derived from the claim's context during the call
	stopChild context.CancelFunc
	txCtx     context.Context
}

func (s *ctxWatchStore) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	d, ok := ctx.Deadline()
	if left := time.Until(d); !ok || left <= 0 || left > 10*time.Second {
		s.t.Errorf("claim's deadline %v (%v), want within the next 10s", d, ok)
	}
	if err := ctx.Err(); err != nil {
		s.t.Errorf("claim's context ended during the call: %v", err)
	}
	if ctx.Value(exchangeCtxKey{}) != "request value" {
		s.t.Errorf("claim's context lost the request's values")
	}
	if s.useDone {
		select {
		case <-ctx.Done():
			s.t.Errorf("claim's Done closed during the call")
		default:
		}
		var stop context.CancelFunc
		s.child, stop = context.WithCancel(ctx)
		s.stopChild = stop
		if context.Cause(ctx) != nil || s.child.Err() != nil {
			s.t.Errorf("claim's context: cause %v, child %v during the call", context.Cause(ctx), s.child.Err())
		}
	}
	s.claimCtx = ctx
	return s.Store.Claim(ctx, p)
}

func (s *ctxWatchStore) Begin(ctx context.Context, l *idemdriver.Lease) (idem.Tx, error) {
	s.txCtx = ctx
	return s.Store.Begin(ctx, l)
}

// The claim's context is bounded and ends with the call, whether the
// store asks for Done or only for Err; the transaction's context follows
// neither the client's cancellation nor a deadline; both carry the
// request's values.
func TestStoreCallContexts(t *testing.T) {
	for _, useDone := range []bool{false, true} {
		s := &ctxWatchStore{Store: memstore.New(memstore.Options{}), t: t, useDone: useDone}
		h := idem.Middleware(s, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if _, err := idem.TxFromContext(r.Context()); err != nil {
				t.Errorf("TxFromContext: %v", err)
			}
			w.WriteHeader(http.StatusCreated)
		}))
		ctx, cancel := context.WithCancelCause(context.WithValue(context.Background(), exchangeCtxKey{}, "request value"))
		r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/things", strings.NewReader(`{}`))
		r.Header.Set("Idempotency-Key", "k")
		cancel(errors.New("client gone")) // before the claim: it runs anyway
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != http.StatusCreated {
			t.Fatalf("useDone %v: %d %s", useDone, w.Code, w.Body)
		}
		c := s.claimCtx
		if !errors.Is(c.Err(), context.Canceled) || !errors.Is(context.Cause(c), context.Canceled) {
			t.Errorf("useDone %v: claim's context after the call: %v, cause %v; want canceled", useDone, c.Err(), context.Cause(c))
		}
		select {
		case <-c.Done():
		default:
			t.Errorf("useDone %v: claim's Done open after the call", useDone)
		}
		if useDone {
			if s.child.Err() == nil {
				t.Errorf("a context derived from the claim's is not canceled with it")
			}
			s.stopChild()
		}
		tc := s.txCtx
		if _, ok := tc.Deadline(); ok || tc.Done() != nil || tc.Err() != nil || context.Cause(tc) != nil {
			t.Errorf("transaction's context follows the client: deadline %v, err %v, cause %v", ok, tc.Err(), context.Cause(tc))
		}
		if tc.Value(exchangeCtxKey{}) != "request value" {
			t.Errorf("transaction's context lost the request's values")
		}
	}
}

// The handler's context is the request's with the transaction: its
// values, and its cancellation, which a context derived from it follows
// at once (no goroutine in between).
func TestHandlerContext(t *testing.T) {
	h := idem.Middleware(memstore.New(memstore.Options{}), idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		if ctx.Value(exchangeCtxKey{}) != "request value" {
			t.Errorf("handler's context lost the request's values")
		}
		if _, err := memstore.FromContext(ctx); err != nil {
			t.Errorf("memstore.FromContext: %v", err)
		}
		if l, ok := idem.LeaseFromContext(ctx); !ok || l.Key != "k" {
			t.Errorf("LeaseFromContext: %+v %v", l, ok)
		}
		child, stop := context.WithCancel(ctx)
		defer stop()
		cancel := ctx.Value(exchangeCancelKey{}).(context.CancelCauseFunc)
		cancel(errors.New("client gone"))
		if child.Err() == nil || ctx.Err() == nil || context.Cause(child).Error() != "client gone" {
			t.Errorf("after the request's cancellation: child %v, handler's %v, cause %v", child.Err(), ctx.Err(), context.Cause(child))
		}
		w.WriteHeader(http.StatusCreated)
	}))
	ctx, cancel := context.WithCancelCause(context.WithValue(context.Background(), exchangeCtxKey{}, "request value"))
	ctx = context.WithValue(ctx, exchangeCancelKey{}, cancel)
	r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/v1/things", strings.NewReader(`{}`))
	r.Header.Set("Idempotency-Key", "k")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	if w.Code != http.StatusCreated {
		t.Fatalf("%d %s", w.Code, w.Body)
	}
}

type exchangeCancelKey struct{}

// A replay hands the answer header and trailer values that are its own:
// whatever is done to them in the answer, the next replay, and the first
// answer's afterwards, are as stored.
func TestReplayValuesAreTheAnswers(t *testing.T) {
	store := memstore.New(memstore.Options{})
	h := idem.Middleware(store, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/v1/things/1")
		w.Header().Set("Trailer", "X-Sum")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, `{"id":1}`)
		w.Header().Set("X-Sum", "abc")
	}))
	spoil := func(w *httptest.ResponseRecorder) {
		for _, h := range []http.Header{w.Header(), w.Result().Trailer} {
			for _, v := range h {
				for i := range v {
					v[i] = "spoiled"
				}
			}
		}
		b := w.Body.Bytes()
		for i := range b {
			b[i] = '!'
		}
	}
	for i := range 3 {
		w := postWithKey(h, "k", []byte(`{}`), 2)
		tr := w.Result().Trailer
		if w.Code != http.StatusCreated || w.Body.String() != `{"id":1}` || w.Header().Get("Content-Type") != "application/json" ||
			w.Header().Get("Location") != "/v1/things/1" || tr.Get("X-Sum") != "abc" || w.Header().Get("Idempotency-Key") != "k" {
			t.Fatalf("answer %d: %d %q %v trailer %v", i, w.Code, w.Body, w.Header(), tr)
		}
		if i > 0 && (w.Header().Get("Idempotent-Replayed") != "true" || w.Header().Get("Content-Length") != "") {
			t.Fatalf("answer %d: %v", i, w.Header())
		}
		spoil(w)
	}
	rec, err := store.Get(context.Background(), "", "k")
	if err != nil || string(rec.Response.Body) != `{"id":1}` || rec.Response.Header.Get("Location") != "/v1/things/1" ||
		rec.Response.Trailer.Get("X-Sum") != "abc" {
		t.Fatalf("stored: %+v %v", rec.Response, err)
	}
	// Without trailers, Content-Length is set and its value the answer's own.
	h = idem.Middleware(store, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "made")
	}))
	for i := range 3 {
		w := postWithKey(h, "k2", []byte(`{}`), 2)
		if w.Body.String() != "made" || (i > 0 && w.Header().Get("Content-Length") != "4") {
			t.Fatalf("answer %d: %q %v", i, w.Body, w.Header())
		}
		spoil(w)
	}
}

// The request headers kept with a claim are the request's, whatever the
// requests before it sent and whatever the handler does to them, with the
// names given in any case, once.
func TestKeptRequestHeadersAreTheRequests(t *testing.T) {
	store := memstore.New(memstore.Options{})
	h := idem.Middleware(store, idem.Options{User: idem.SharedKeySpace, KeptRequestHeaders: []string{"content-type", "X-Tenant", "Content-Type"}})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			for _, v := range r.Header {
				for i := range v {
					v[i] = "changed by the handler"
				}
			}
			w.WriteHeader(http.StatusCreated)
		}))
	cases := [][]string{
		{"Content-Type", "application/json"},
		{"Content-Type", "application/json"},
		{"Content-Type", "text/plain"},
		{},
		{"Content-Type", "application/json", "X-Tenant", "a"},
		{"Content-Type", "application/json", "X-Tenant", "a", "X-Tenant", "b"},
		{"Content-Type", "application/json"},
		{"X-Other", "not kept"},
		{"Content-Type", "application/json"},
	}
	for i, hdr := range cases {
		key := "kept-" + strconv.Itoa(i)
		if w := postWithKey(h, key, []byte(`{}`), 2, hdr...); w.Code != http.StatusCreated {
			t.Fatalf("case %d: %d", i, w.Code)
		}
		want := http.Header{}
		for j := 0; j+1 < len(hdr); j += 2 {
			if hdr[j] != "X-Other" {
				want.Add(hdr[j], hdr[j+1])
			}
		}
		rec, err := store.Get(context.Background(), "", key)
		if err != nil {
			t.Fatal(err)
		}
		if len(rec.Header) != len(want) {
			t.Errorf("case %d: kept %v, want %v", i, rec.Header, want)
		}
		for k, v := range want {
			if !slices.Equal(rec.Header[k], v) {
				t.Errorf("case %d: kept %s = %q, want %q", i, k, rec.Header[k], v)
			}
		}
	}
}

// StoredHeaders names are read in any case.
func TestStoredHeaderNamesAnyCase(t *testing.T) {
	store := memstore.New(memstore.Options{})
	h := idem.Middleware(store, idem.Options{User: idem.SharedKeySpace, StoredHeaders: []string{"x-custom", "content-type"}})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Custom", "1")
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Location", "/not/kept")
		w.WriteHeader(http.StatusCreated)
	}))
	postWithKey(h, "k", []byte(`{}`), 2)
	w := postWithKey(h, "k", []byte(`{}`), 2)
	if w.Header().Get("X-Custom") != "1" || w.Header().Get("Content-Type") != "text/plain" || w.Header().Get("Location") != "" {
		t.Errorf("replay header %v; want X-Custom and Content-Type only", w.Header())
	}
}

// An answer without a body is stored without one (nil), whether or not
// the handler wrote nothing, as before the body went into the room.
func TestEmptyAnswerBodyStoredAsNil(t *testing.T) {
	store := memstore.New(memstore.Options{})
	h := idem.Middleware(store, idem.Options{User: idem.SharedKeySpace})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("write") != "" {
			w.Write(nil)
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	for _, write := range []bool{false, true} {
		key := "empty-" + strconv.FormatBool(write)
		r := httptest.NewRequest(http.MethodPost, "/v1/things?write="+map[bool]string{true: "1"}[write], strings.NewReader(`{}`))
		r.Header.Set("Idempotency-Key", key)
		h.ServeHTTP(httptest.NewRecorder(), r)
		rec, err := store.Get(context.Background(), "", key)
		if err != nil || rec.Response == nil {
			t.Fatal(rec, err)
		}
		if rec.Response.Body != nil {
			t.Errorf("written %v: stored body %#v", write, rec.Response.Body)
		}
	}
}
