package storetest

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
)

func params(user, key, fp string) idemdriver.ClaimParams {
	return idemdriver.ClaimParams{
		User:        user,
		Key:         key,
		Fingerprint: fp,
		Method:      http.MethodPost,
		Path:        "/v1/things",
		Header:      http.Header{"Content-Type": {"application/json"}},
		Body:        []byte(`{"n":1}`),
		Lease:       10 * time.Second,
		TTL:         time.Hour,
	}
}

func response(body string) *idemdriver.Response {
	return &idemdriver.Response{
		Status: http.StatusCreated,
		Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/v1/things/1"}},
		Body:   []byte(body),
	}
}

func mustLease(t *testing.T, s idem.Store, p idemdriver.ClaimParams) *idemdriver.Lease {
	t.Helper()
	c, err := s.Claim(context.Background(), p)
	if err != nil {
		t.Fatalf("Claim(%s/%s): %v", p.User, p.Key, err)
	}
	if c.Lease == nil {
		t.Fatalf("Claim(%s/%s): got response %+v, want a lease", p.User, p.Key, c.Response)
	}
	return c.Lease
}

// begin opens l's transaction and writes effect name through it, as a
// handler would.
func begin(t *testing.T, h Harness, s idem.Store, l *idemdriver.Lease, name string) idem.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := s.Begin(ctx, l)
	if err != nil {
		t.Fatalf("Begin: %v", err)
	}
	if err := h.Write(ctx, tx, name); err != nil {
		tx.Rollback(ctx)
		t.Fatalf("Write(%q): %v", name, err)
	}
	return tx
}

// run does what the middleware does with a lease: write effect name and
// commit the outcome resp.
func run(ctx context.Context, h Harness, s idem.Store, l *idemdriver.Lease, name string, resp *idemdriver.Response) error {
	tx, err := s.Begin(ctx, l)
	if err != nil {
		return fmt.Errorf("Begin: %w", err)
	}
	if err := h.Write(ctx, tx, name); err != nil {
		tx.Rollback(ctx)
		return fmt.Errorf("Write: %w", err)
	}
	return tx.Complete(ctx, resp)
}

func count(t *testing.T, h Harness, s idem.Store, name string) int {
	t.Helper()
	n, err := h.Count(context.Background(), s, name)
	if err != nil {
		t.Fatalf("Count(%q): %v", name, err)
	}
	return n
}

func sameResponse(t *testing.T, got, want *idemdriver.Response) {
	t.Helper()
	if err := responseDiff(got, want); err != nil {
		t.Fatal(err)
	}
}

// responseDiff is sameResponse for goroutines other than the test's: it
// returns the first difference instead of failing the test.
func responseDiff(got, want *idemdriver.Response) error {
	if got == nil {
		return fmt.Errorf("got no response, want %d %q", want.Status, want.Body)
	}
	if got.Status != want.Status || !bytes.Equal(got.Body, want.Body) {
		return fmt.Errorf("got response %d %q, want %d %q", got.Status, got.Body, want.Status, want.Body)
	}
	for _, k := range []string{"Content-Type", "Location"} {
		if g, w := got.Header.Get(k), want.Header.Get(k); g != w {
			return fmt.Errorf("got header %s %q, want %q", k, g, w)
		}
	}
	return nil
}

// sameHeader reports whether a and b hold the same names and values,
// in order; nil and empty are the same.
func sameHeader(a, b http.Header) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || !slices.Equal(v, w) {
			return false
		}
	}
	return true
}

// clockStart is where the clock of the cases that set one starts.
var clockStart = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

// clocked returns a fresh store on a Clock of its own, or skips t when the
// harness cannot set a store's clock.
func clocked(t *testing.T, h Harness) (idem.Store, *Clock) {
	t.Helper()
	if h.NewAt == nil {
		t.Skip("Harness.NewAt is not set: this case needs the store's clock")
	}
	clk := NewClock(clockStart)
	return h.NewAt(t, clk.Now), clk
}

// keys lists the records' keys, space-separated.
func keys(recs []idemdriver.Record) string {
	var b strings.Builder
	for i, r := range recs {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(r.Key)
	}
	return b.String()
}

// aging returns a fresh store and a function that moves the store's clock
// on by d: the store's own Clock when the harness can set one (NewAt), else
// the wall clock.
func aging(t *testing.T, h Harness) (idem.Store, func(d time.Duration)) {
	t.Helper()
	if h.NewAt == nil {
		return h.New(t), func(d time.Duration) {
			time.Sleep(d) // not waiting for an outcome: lets the wall clock of a store whose clock cannot be set pass a lease or TTL
		}
	}
	clk := NewClock(clockStart)
	return h.NewAt(t, clk.Now), clk.Advance
}
