package idem_test

// Allocation counts of the middleware on memstore (issue 11): what a
// create and a replay add to the bare handler's own allocations, pinned
// at the figures reached, so that a change that adds one fails here.
// Counted, not timed.

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
)

// What the middleware may add to the bare handler's allocations, per
// request, on memstore, are maxAddedAllocsCreate and maxAddedAllocsReplay
// (middleware_allocs_race_test.go, middleware_allocs_norace_test.go: the race detector's build moves
// more values to the heap, the bare handler's too). Lower them when a
// change lowers the counts.

// allocsBody is the request body of every counted request: the benchmarks'.
const allocsBody = `{"sku":"sku_42","quantity":1,"currency":"EUR","note":"benchmark"}`

// allocsOrders is the one-INSERT handler of the benchmarks on memstore: it
// reads the body, "inserts" a row (at commit, through memstore's
// transaction, when there is one) and answers 201 with about 200 bytes of
// JSON.
type allocsOrders struct {
	mu   sync.Mutex
	rows map[string]bool
}

func (o *allocsOrders) add(id string) {
	o.mu.Lock()
	o.rows[id] = true
	o.mu.Unlock()
}

func (o *allocsOrders) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if _, err := io.Copy(io.Discard, r.Body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	id := "ord_" + allocsRandomHex(12)
	switch tx, err := memstore.FromContext(r.Context()); {
	case err == nil:
		tx.OnCommit(func() { o.add(id) })
	case errors.Is(err, idem.ErrNoTx):
		o.add(id)
	default:
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	body := make([]byte, 0, 256)
	body = append(body, `{"id":"`...)
	body = append(body, id...)
	body = append(body, `","object":"order","amount":1299,"currency":"EUR","status":"created","description":"one row inserted by the counted handler"}`...)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(http.StatusCreated)
	w.Write(body)
}

func allocsRandomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// allocsWriter is a plain http.ResponseWriter: the counts are the handler's
// and the middleware's, not a test recorder's.
type allocsWriter struct {
	header http.Header
	status int
	n      int
}

func (w *allocsWriter) Header() http.Header { return w.header }
func (w *allocsWriter) WriteHeader(status int) {
	if w.status == 0 {
		w.status = status
	}
}
func (w *allocsWriter) Write(p []byte) (int, error) {
	w.WriteHeader(http.StatusOK)
	w.n += len(p)
	return len(p), nil
}

var allocsURL = &url.URL{Path: "/v1/orders"}

// allocsServe sends one POST with key to h, built by hand (no parsing), and
// returns what it was answered.
func allocsServe(h http.Handler, key string) *allocsWriter {
	r := &http.Request{
		Method: http.MethodPost, URL: allocsURL, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header:        http.Header{"Content-Type": {"application/json"}, "Idempotency-Key": {key}},
		Body:          io.NopCloser(strings.NewReader(allocsBody)),
		ContentLength: int64(len(allocsBody)), Host: "example.com", RequestURI: "/v1/orders",
	}
	w := &allocsWriter{header: make(http.Header)}
	h.ServeHTTP(w, r)
	return w
}

// fewestAllocs is the fewest allocations of one call of f over many counted
// calls: a map of the handler's or the store's growing now and then, or
// a sync.Pool the race detector empties at random, adds to some calls
// and not to the others.
func fewestAllocs(f func()) int {
	fewest := -1
	for range 50 {
		if n := int(testing.AllocsPerRun(1, f)); fewest < 0 || n < fewest {
			fewest = n
		}
	}
	return fewest
}

func TestMiddlewareAllocations(t *testing.T) {
	bare := &allocsOrders{rows: map[string]bool{}}
	inner := &allocsOrders{rows: map[string]bool{}}
	keyed := idem.Middleware(memstore.New(memstore.Options{}), idem.Options{User: idem.SharedKeySpace})(inner)

	seq := 0
	create := func(h http.Handler, replayed bool) func() {
		return func() {
			seq++
			w := allocsServe(h, "alc-create-"+strconv.Itoa(seq))
			if w.status != http.StatusCreated || (w.header.Get("Idempotent-Replayed") != "") != replayed {
				t.Fatalf("create: status %d, Idempotent-Replayed %q", w.status, w.header.Get("Idempotent-Replayed"))
			}
		}
	}
	replay := func(h http.Handler, replayed bool) func() {
		return func() {
			w := allocsServe(h, "alc-replayed")
			if w.status != http.StatusCreated || (w.header.Get("Idempotent-Replayed") == "true") != replayed {
				t.Fatalf("replay: status %d, Idempotent-Replayed %q", w.status, w.header.Get("Idempotent-Replayed"))
			}
		}
	}
	if w := allocsServe(keyed, "alc-replayed"); w.status != http.StatusCreated {
		t.Fatalf("first request of the replayed key: %d", w.status)
	}

	for _, c := range []struct {
		name      string
		bare, mid func()
		max       int
	}{
		{"create", create(bare, false), create(keyed, false), maxAddedAllocsCreate},
		{"replay", replay(bare, false), replay(keyed, true), maxAddedAllocsReplay},
	} {
		b, m := fewestAllocs(c.bare), fewestAllocs(c.mid)
		t.Logf("%s: bare handler %d allocations, behind the middleware %d: %+d", c.name, b, m, m-b)
		if m-b > c.max {
			t.Errorf("%s: the middleware adds %d allocations to the bare handler's %d, want at most %d", c.name, m-b, b, c.max)
		}
	}
	if n := len(inner.rows); n == 0 || n > seq+1 {
		t.Errorf("the handler behind the middleware committed %d rows for %d creates", n, seq)
	}
}
