package memstore_test

// What memstore keeps and what it hands out never share memory (issue
// 11's allocation work: one copy where two were made, headers shared
// between records): a caller that changes what it gave or got changes
// nothing stored.

import (
	"context"
	"net/http"
	"slices"
	"testing"

	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
)

func copyTestParams(key string, h http.Header) idemdriver.ClaimParams {
	return idemdriver.ClaimParams{Key: key, Fingerprint: "fp", Owner: "owner-" + key, Method: "POST", Path: "/x", Header: h, Body: []byte(`{"a":1}`)}
}

func spoilHeader(h http.Header) {
	for k, v := range h {
		for i := range v {
			v[i] = "spoiled"
		}
		h[k+"-Added"] = []string{"added"}
	}
}

func spoilResponse(r *idemdriver.Response) {
	spoilHeader(r.Header)
	spoilHeader(r.Trailer)
	for i := range r.Body {
		r.Body[i] = '!'
	}
	r.Status = 599
}

func sampleResponse() *idemdriver.Response {
	return &idemdriver.Response{Status: 201,
		Header:  http.Header{"Content-Type": {"application/json"}, "Link": {"</a>", "</b>", "</c>", "</d>", "</e>"}},
		Body:    []byte(`{"id":1}`),
		Trailer: http.Header{"X-Sum": {"abc"}}}
}

func wantSampleResponse(t *testing.T, what string, got *idemdriver.Response) {
	t.Helper()
	want := sampleResponse()
	if got == nil || got.Status != want.Status || string(got.Body) != string(want.Body) || len(got.Header) != len(want.Header) ||
		!slices.Equal(got.Header["Link"], want.Header["Link"]) || !slices.Equal(got.Header["Content-Type"], want.Header["Content-Type"]) ||
		len(got.Trailer) != 1 || got.Trailer.Get("X-Sum") != "abc" {
		t.Fatalf("%s: %+v", what, got)
	}
}

func TestStoredResponseIsACopy(t *testing.T) {
	ctx := context.Background()
	s := memstore.New(memstore.Options{})
	for _, key := range []string{"k1", "k2"} { // k2's header is shared with k1's
		c, err := s.Claim(ctx, copyTestParams(key, http.Header{"Content-Type": {"application/json"}}))
		if err != nil || c.Lease == nil {
			t.Fatal(c, err)
		}
		tx, _ := s.Begin(ctx, c.Lease)
		resp := sampleResponse()
		if err := tx.Complete(ctx, resp); err != nil {
			t.Fatal(err)
		}
		spoilResponse(resp) // what was given to Complete
	}
	for range 2 {
		c, err := s.Claim(ctx, copyTestParams("k1", nil))
		if err != nil {
			t.Fatal(err)
		}
		wantSampleResponse(t, "replayed", c.Response)
		spoilResponse(c.Response) // what Claim handed out
	}
	rec, err := s.Get(ctx, "", "k1")
	if err != nil {
		t.Fatal(err)
	}
	wantSampleResponse(t, "Get", rec.Response)
	spoilResponse(rec.Response)
	spoilHeader(rec.Header)
	for _, key := range []string{"k1", "k2"} {
		rec, err := s.Get(ctx, "", key)
		if err != nil {
			t.Fatal(err)
		}
		wantSampleResponse(t, "Get "+key, rec.Response)
		if len(rec.Header) != 1 || rec.Header.Get("Content-Type") != "application/json" {
			t.Fatalf("%s: kept request header %v", key, rec.Header)
		}
	}
}

func TestKeptRequestIsACopy(t *testing.T) {
	ctx := context.Background()
	s := memstore.New(memstore.Options{})
	headers := []http.Header{
		{"Content-Type": {"application/json"}},
		{"Content-Type": {"application/json"}},
		{"Content-Type": {"text/plain"}},
		nil,
		{},
		{"Content-Type": {"application/json"}, "X-Tenant": {"a", "b"}},
		{"Content-Type": nil},
		{"Content-Type": {"application/json"}},
	}
	for i, h := range headers {
		p := copyTestParams(string(rune('a'+i)), h.Clone())
		if _, err := s.Claim(ctx, p); err != nil {
			t.Fatal(err)
		}
		spoilHeader(p.Header)
		for j := range p.Body {
			p.Body[j] = '!'
		}
	}
	for i, h := range headers {
		rec, err := s.Get(ctx, "", string(rune('a'+i)))
		if err != nil {
			t.Fatal(err)
		}
		if string(rec.Body) != `{"a":1}` || (rec.Header == nil) != (h == nil) || len(rec.Header) != len(h) {
			t.Fatalf("record %d: header %#v body %q, want %#v", i, rec.Header, rec.Body, h)
		}
		for k, v := range h {
			if got, ok := rec.Header[k]; !ok || (got == nil) != (v == nil) || !slices.Equal(got, v) {
				t.Fatalf("record %d: %s = %#v, want %#v", i, k, got, v)
			}
		}
		spoilHeader(rec.Header)
	}
}

// A transaction's effects all run at commit, however many; none after a
// rollback.
func TestTxEffectsRunAtCommit(t *testing.T) {
	ctx := context.Background()
	s := memstore.New(memstore.Options{})
	for n := range 4 {
		key := string(rune('a' + n))
		c, _ := s.Claim(ctx, copyTestParams(key, nil))
		tx, _ := s.Begin(ctx, c.Lease)
		ran := 0
		for range n {
			tx.(*memstore.Tx).OnCommit(func() { ran++ })
		}
		if err := tx.Complete(ctx, sampleResponse()); err != nil || ran != n {
			t.Fatalf("%d effects: %d ran, %v", n, ran, err)
		}
		c, _ = s.Claim(ctx, copyTestParams(key+"-rolled", nil))
		tx, _ = s.Begin(ctx, c.Lease)
		tx.(*memstore.Tx).OnCommit(func() { ran++ })
		tx.Rollback(ctx)
		tx.(*memstore.Tx).OnCommit(func() { ran++ })
		if err := tx.Complete(ctx, sampleResponse()); err == nil || ran != n {
			t.Fatalf("after a rollback: %d ran, %v", ran-n, err)
		}
	}
}
