package idem_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
)

// A replay is the same answer (issue 9, point 5): the headers that define
// the body and its caching are kept, Set-Cookie and hop-by-hop headers
// never are, and trailers come back as trailers.

// rawAnswer is a response as it came off the wire: no transparent
// decompression, trailers read after the body.
type rawAnswer struct {
	status  int
	header  http.Header
	trailer http.Header
	body    []byte
}

func (b *testBundle) postRaw(t *testing.T, key, body string) rawAnswer {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, b.srv.URL+"/v1/things", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Accept-Encoding", "gzip")
	c := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	defer c.CloseIdleConnections()
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("POST: %v", err)
	}
	defer resp.Body.Close()
	rb, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading body: %v", err)
	}
	return rawAnswer{resp.StatusCode, resp.Header, resp.Trailer, rb}
}

// firstAndReplay posts the same request twice and checks that the
// second is a replay that did not run the handler.
func firstAndReplay(t *testing.T, b *testBundle) (first, replay rawAnswer) {
	t.Helper()
	first = b.postRaw(t, "k", `{}`)
	replay = b.postRaw(t, "k", `{}`)
	if first.header.Get("Idempotent-Replayed") != "" || replay.header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("Idempotent-Replayed: first %q, second %q; want none and true",
			first.header.Get("Idempotent-Replayed"), replay.header.Get("Idempotent-Replayed"))
	}
	if runs := b.runs.Load(); runs != 1 {
		t.Fatalf("handler ran %d times, want 1", runs)
	}
	return first, replay
}

func gzipped(t *testing.T, s string) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	io.WriteString(zw, s)
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// Behind a compressing handler the replay is the same gzip bytes with the
// same Content-Encoding, so a client can still read it.
func TestReplayKeepsContentEncoding(t *testing.T) {
	const doc = `{"id":"thing_1","note":"compressed"}`
	zipped := gzipped(t, doc)
	b := setup(t, idem.Options{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Set("Vary", "Accept-Encoding")
		w.WriteHeader(http.StatusCreated)
		w.Write(zipped)
	})
	first, replay := firstAndReplay(t, b)
	for i, a := range []rawAnswer{first, replay} {
		if a.status != http.StatusCreated || !bytes.Equal(a.body, zipped) {
			t.Errorf("answer %d: %d %q; want 201 and the gzip bytes", i, a.status, a.body)
		}
		if got := a.header.Get("Content-Encoding"); got != "gzip" {
			t.Errorf("answer %d: Content-Encoding = %q, want gzip", i, got)
		}
		if got := a.header.Get("Vary"); got != "Accept-Encoding" {
			t.Errorf("answer %d: Vary = %q, want Accept-Encoding", i, got)
		}
		zr, err := gzip.NewReader(bytes.NewReader(a.body))
		if err != nil {
			t.Errorf("answer %d: not gzip: %v", i, err)
			continue
		}
		if got, err := io.ReadAll(zr); err != nil || string(got) != doc {
			t.Errorf("answer %d: decoded %q, %v; want %s", i, got, err, doc)
		}
	}
}

// Every representation and caching header of the default list comes back
// as it was sent.
func TestReplayKeepsRepresentationHeaders(t *testing.T) {
	sent := map[string][]string{
		"Content-Type":        {"text/plain; charset=utf-8"},
		"Content-Language":    {"de"},
		"Content-Location":    {"/v1/things/1"},
		"Content-Disposition": {`attachment; filename="thing.txt"`},
		"Location":            {"/v1/things/1"},
		"Etag":                {`"v1-abc"`},
		"Last-Modified":       {"Tue, 03 Mar 2026 10:00:00 GMT"},
		"Cache-Control":       {"private, max-age=60"},
		"Expires":             {"Tue, 03 Mar 2026 10:01:00 GMT"},
		"Vary":                {"Accept-Encoding", "Accept-Language"},
		"Link":                {`</v1/things/1/parts>; rel="parts"`, `</v1/things>; rel="collection"`},
		"Retry-After":         {"5"},
	}
	b := setup(t, idem.Options{}, func(w http.ResponseWriter, r *http.Request) {
		for k, vs := range sent {
			w.Header()[k] = vs
		}
		w.WriteHeader(http.StatusAccepted)
		io.WriteString(w, "accepted")
	})
	first, replay := firstAndReplay(t, b)
	for k, vs := range sent {
		if got := first.header.Values(k); !slices.Equal(got, vs) {
			t.Errorf("first %s = %q, want %q", k, got, vs)
		}
		if got := replay.header.Values(k); !slices.Equal(got, vs) {
			t.Errorf("replayed %s = %q, want %q", k, got, vs)
		}
	}
	if replay.status != http.StatusAccepted || string(replay.body) != "accepted" {
		t.Errorf("replay: %d %q, want 202 accepted", replay.status, replay.body)
	}
}

// A 304 is replayed with the validators that make it mean something.
func TestReplayed304KeepsETag(t *testing.T) {
	b := setup(t, idem.Options{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("ETag", `"v7"`)
		w.Header().Set("Cache-Control", "no-cache")
		w.Header().Set("Last-Modified", "Tue, 03 Mar 2026 10:00:00 GMT")
		w.WriteHeader(http.StatusNotModified)
	})
	first, replay := firstAndReplay(t, b)
	for i, a := range []rawAnswer{first, replay} {
		if a.status != http.StatusNotModified || len(a.body) != 0 {
			t.Errorf("answer %d: %d %q; want 304 without a body", i, a.status, a.body)
		}
		if got := a.header.Get("ETag"); got != `"v7"` {
			t.Errorf("answer %d: ETag = %q, want \"v7\"", i, got)
		}
		if got := a.header.Get("Cache-Control"); got != "no-cache" {
			t.Errorf("answer %d: Cache-Control = %q, want no-cache", i, got)
		}
		if got := a.header.Get("Last-Modified"); got != "Tue, 03 Mar 2026 10:00:00 GMT" {
			t.Errorf("answer %d: Last-Modified = %q", i, got)
		}
	}
}

// Set-Cookie belongs to the first client's session: it is never stored,
// even when Options.StoredHeaders names it.
func TestReplayNeverSetsCookie(t *testing.T) {
	for _, opts := range []idem.Options{{}, {StoredHeaders: []string{"Content-Type", "Set-Cookie"}}} {
		b := setup(t, opts, func(w http.ResponseWriter, r *http.Request) {
			http.SetCookie(w, &http.Cookie{Name: "session", Value: "first-client"})
			w.Header().Set("Content-Type", "text/plain")
			w.WriteHeader(http.StatusCreated)
			io.WriteString(w, "made")
		})
		first, replay := firstAndReplay(t, b)
		if first.header.Get("Set-Cookie") == "" {
			t.Errorf("StoredHeaders %q: the first answer lost its Set-Cookie", opts.StoredHeaders)
		}
		if got := replay.header.Values("Set-Cookie"); len(got) != 0 {
			t.Errorf("StoredHeaders %q: replayed Set-Cookie %q, want none", opts.StoredHeaders, got)
		}
		rec, err := b.store.Get(context.Background(), "", "k")
		if err != nil || rec.Response == nil {
			t.Fatalf("Get: %+v, %v", rec, err)
		}
		if got := rec.Response.Header.Values("Set-Cookie"); len(got) != 0 {
			t.Errorf("StoredHeaders %q: stored Set-Cookie %q, want none", opts.StoredHeaders, got)
		}
	}
}

// Hop-by-hop headers (and those the Connection header names),
// Content-Length and the middleware's own headers are never stored, even
// when Options.StoredHeaders names them.
func TestReplayNeverKeepsHopByHopHeaders(t *testing.T) {
	never := []string{"Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Connection", "Te",
		"Trailer", "Transfer-Encoding", "Upgrade", "X-Hop", "Content-Length", "Idempotency-Key", "Idempotent-Replayed"}
	opts := idem.Options{User: idem.SharedKeySpace, StoredHeaders: append([]string{"Content-Type"}, never...)}
	b := setup(t, opts, func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Type", "text/plain")
		h.Set("Connection", "X-Hop")
		h.Set("X-Hop", "only for the next hop")
		h.Set("Keep-Alive", "timeout=5")
		h.Set("Proxy-Authenticate", "Basic")
		h.Set("Proxy-Connection", "keep-alive")
		h.Set("Te", "trailers")
		h.Set("Upgrade", "websocket")
		h.Set("Content-Length", "4")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "made")
	})
	_, replay := firstAndReplay(t, b)
	rec, err := b.store.Get(context.Background(), "", "k")
	if err != nil || rec.Response == nil {
		t.Fatalf("Get: %+v, %v", rec, err)
	}
	for _, k := range never {
		if got := rec.Response.Header.Values(k); len(got) != 0 {
			t.Errorf("stored %s = %q, want none", k, got)
		}
	}
	if got := rec.Response.Header.Get("Content-Type"); got != "text/plain" {
		t.Errorf("stored Content-Type = %q, want text/plain", got)
	}
	for _, k := range []string{"X-Hop", "Keep-Alive", "Proxy-Authenticate", "Proxy-Connection", "Te", "Upgrade"} {
		if got := replay.header.Values(k); len(got) != 0 {
			t.Errorf("replayed %s = %q, want none", k, got)
		}
	}
	if replay.status != http.StatusCreated || string(replay.body) != "made" || replay.header.Get("Content-Length") != "4" {
		t.Errorf("replay: %d %q Content-Length %q; want 201 made 4", replay.status, replay.body, replay.header.Get("Content-Length"))
	}
}

// Trailers the handler declares (the Trailer header, values set after
// the body) or sets with http.TrailerPrefix are sent as trailers, first
// and on every replay, and never as headers.
func TestReplayKeepsTrailers(t *testing.T) {
	b := setup(t, idem.Options{}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Trailer", "X-Checksum, X-Rows")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "row 1\nrow 2\n")
		w.Header().Set("X-Checksum", "sha256=abc")
		w.Header().Set("X-Rows", "2")
		w.Header().Set(http.TrailerPrefix+"X-Late", "undeclared")
	})
	first, replay := firstAndReplay(t, b)
	want := http.Header{"X-Checksum": {"sha256=abc"}, "X-Rows": {"2"}, "X-Late": {"undeclared"}}
	for i, a := range []rawAnswer{first, replay} {
		if a.status != http.StatusCreated || string(a.body) != "row 1\nrow 2\n" {
			t.Errorf("answer %d: %d %q", i, a.status, a.body)
		}
		for k, vs := range want {
			if got := a.trailer.Values(k); !slices.Equal(got, vs) {
				t.Errorf("answer %d: trailer %s = %q, want %q", i, k, got, vs)
			}
			if got := a.header.Values(k); len(got) != 0 {
				t.Errorf("answer %d: header %s = %q, want it only as a trailer", i, k, got)
			}
		}
	}
	rec, err := b.store.Get(context.Background(), "", "k")
	if err != nil || rec.Response == nil {
		t.Fatalf("Get: %+v, %v", rec, err)
	}
	if got := rec.Response.Header.Values("Trailer"); len(got) != 0 {
		t.Errorf("stored Trailer header %q, want the trailers in Response.Trailer", got)
	}
}

// An answer too large to keep is replayed as a problem: the headers that
// described the original body (its encoding, validators, trailers) do not
// describe the problem and are not sent with it.
func TestOversizeReplayDropsBodyHeaders(t *testing.T) {
	zipped := gzipped(t, strings.Repeat("x", 1000))
	b := setup(t, idem.Options{MaxStoredBody: 10}, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Set("ETag", `"big"`)
		w.Header().Set("Location", "/v1/things/1")
		w.Header().Set("Trailer", "X-Checksum")
		w.WriteHeader(http.StatusCreated)
		w.Write(zipped)
		w.Header().Set("X-Checksum", "sha256=big")
	})
	_, replay := firstAndReplay(t, b)
	if replay.status != http.StatusCreated || replay.header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("replay: %d %q; want 201 and a problem", replay.status, replay.header.Get("Content-Type"))
	}
	for _, k := range []string{"Content-Encoding", "Etag"} {
		if got := replay.header.Values(k); len(got) != 0 {
			t.Errorf("replayed problem %s = %q, want none", k, got)
		}
	}
	if got := replay.trailer.Get("X-Checksum"); got != "" {
		t.Errorf("replayed problem trailer X-Checksum = %q, want none", got)
	}
	if got := replay.header.Get("Location"); got != "/v1/things/1" {
		t.Errorf("replayed problem Location = %q, want /v1/things/1", got)
	}
}

// TestMaxStoredBodyBoundsTrailers: MaxStoredBody bounds the whole stored
// answer, trailers and headers included, not only its body: an answer of
// 10 bytes with an 8 MiB trailer is kept as the too-large problem under a
// 1 KiB MaxStoredBody.
//
// It guards a bug found in the review of issue 9 (b): MaxStoredBody then
// bounded what was kept of an answer, but only its body: the trailers
// (then newly all stored) and the broad header list were kept whatever
// their size, so such an answer was stored (and cached in Redis, and
// replayed) in full.
func TestMaxStoredBodyBoundsTrailers(t *testing.T) {
	ms := memstore.New(memstore.Options{})
	big := strings.Repeat("a", 8<<20)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		io.WriteString(w, "0123456789")
		w.Header().Set(http.TrailerPrefix+"X-Digest", big)
	})
	srv := httptest.NewServer(idem.Middleware(ms, idem.Options{User: idem.SharedKeySpace, MaxStoredBody: 1 << 10})(h))
	defer srv.Close()
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/things", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "k")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	rec, err := ms.Get(context.Background(), "", "k")
	if err != nil || rec.Response == nil {
		t.Fatalf("Get: %+v, %v", rec, err)
	}
	size := len(rec.Response.Body)
	for _, h := range []http.Header{rec.Response.Header, rec.Response.Trailer} {
		for k, vs := range h {
			size += len(k)
			for _, v := range vs {
				size += len(v)
			}
		}
	}
	if size > 64<<10 {
		t.Errorf("stored answer is %d bytes under MaxStoredBody 1 KiB (trailer %d bytes); want it bounded (kept as the too-large problem)",
			size, len(rec.Response.Trailer.Get("X-Digest")))
	}
}
