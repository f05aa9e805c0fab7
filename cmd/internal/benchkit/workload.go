package benchkit

import (
	"bytes"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
)

// Mode is a load mode: which idempotency keys the requests carry.
type Mode string

// The load modes.
const (
	// NoKey sends no Idempotency-Key: the middleware lets the request
	// through unprotected (the library target sets OptionalKey).
	NoKey Mode = "nokey"
	// Create sends a fresh key with every request: every request claims,
	// runs the handler and stores its answer.
	Create Mode = "create"
	// Replay sends keys created in a warm-up (Workload.Warmup), over and
	// over: behind the middleware every request is a replay.
	Replay Mode = "replay"
	// Duplicates sends each fresh key Workload.Copies times in a row, so
	// that clients running at once send the same key together: one runs,
	// the others are answered 409 (in flight) or replayed.
	Duplicates Mode = "duplicates"
	// Inflight first sends Workload.Keys requests that the library
	// target's handler holds (Workload.Held, HoldHeader, Target.Hold),
	// one per key; the measured requests repeat those keys while they are
	// held, so behind the middleware every one is answered 409 (in
	// flight). Only the library target can hold its handler.
	Inflight Mode = "inflight"
)

// Modes lists the modes.
var Modes = []Mode{NoKey, Create, Replay, Duplicates, Inflight}

// ParseMode returns the Mode named s.
func ParseMode(s string) (Mode, error) {
	for _, m := range Modes {
		if string(m) == s {
			return m, nil
		}
	}
	return "", fmt.Errorf("unknown mode %q (want one of nokey, create, replay, duplicates, inflight)", s)
}

// Defaults for Workload.
const (
	DefaultKeys   = 256
	DefaultCopies = 4
)

// LibraryBody is the request body the library target is sent by default.
var LibraryBody = []byte(`{"amount":1299,"currency":"EUR","description":"one row"}`)

// Request is one request of a Workload.
type Request struct {
	User string // the key's scope: UserHeader, and the bearer token's user
	Key  string // the Idempotency-Key; "" for none
	Body []byte // shared between requests: do not modify
	Hold bool   // sent with HoldHeader (Inflight's held requests)
}

// Workload makes the requests of one mode. Next is safe for concurrent
// use. Make it with NewWorkload; its keys are unique to it, so runs against
// the same service do not meet each other's keys.
type Workload struct {
	Mode   Mode
	Users  []string // the users, taken in turn (per key, where there is one)
	Keys   int      // Replay: how many keys the warm-up creates; Inflight: how many are held
	Copies int      // Duplicates: how many times each key is sent
	Body   []byte   // the body of every request
	// Tokens, if set, gives each user's bearer token: requests then carry
	// Authorization: Bearer <token> (for a running `orders serve`).
	Tokens map[string]string

	prefix string
	n      atomic.Uint64
}

// NewWorkload returns a Workload of mode for users users named bench-1 …
// bench-N, with the default Keys, Copies and LibraryBody.
func NewWorkload(mode Mode, users int) *Workload {
	users = max(users, 1)
	w := &Workload{Mode: mode, Keys: DefaultKeys, Copies: DefaultCopies, Body: LibraryBody, prefix: "bench-" + randomHex(6)}
	for i := 1; i <= users; i++ {
		w.Users = append(w.Users, "bench-"+strconv.Itoa(i))
	}
	return w
}

func (w *Workload) key(k uint64) Request {
	return Request{
		User: w.Users[k%uint64(len(w.Users))],
		Key:  w.prefix + "-" + strconv.FormatUint(k, 10),
		Body: w.Body,
	}
}

// Warmup returns the requests to send (and complete) before the measured
// ones: Keys creates in Replay mode, none in the others.
func (w *Workload) Warmup() []Request {
	if w.Mode != Replay {
		return nil
	}
	reqs := make([]Request, max(w.Keys, 1))
	for i := range reqs {
		reqs[i] = w.key(uint64(i))
	}
	return reqs
}

// Held returns, in Inflight mode, the requests to send before the
// measured ones and to keep in the handler while they run: one per key,
// Keys of them, each with Hold set. Other modes hold none.
func (w *Workload) Held() []Request {
	if w.Mode != Inflight {
		return nil
	}
	reqs := make([]Request, max(w.Keys, 1))
	for i := range reqs {
		reqs[i] = w.key(uint64(i))
		reqs[i].Hold = true
	}
	return reqs
}

// Next returns the next measured request.
func (w *Workload) Next() Request {
	n := w.n.Add(1) - 1
	switch w.Mode {
	case Create:
		return w.key(n)
	case Replay, Inflight:
		return w.key(n % uint64(max(w.Keys, 1)))
	case Duplicates:
		return w.key(n / uint64(max(w.Copies, 1)))
	default:
		return Request{User: w.Users[n%uint64(len(w.Users))], Body: w.Body}
	}
}

// Header returns the headers of r: Content-Type, UserHeader, the
// Idempotency-Key if any, HoldHeader when r.Hold, and Authorization when
// w.Tokens is set.
func (w *Workload) Header(r Request) http.Header {
	h := make(http.Header, 5)
	h["Content-Type"] = []string{"application/json"}
	h[UserHeader] = []string{r.User}
	if r.Key != "" {
		h["Idempotency-Key"] = []string{r.Key}
	}
	if r.Hold {
		h[HoldHeader] = []string{"1"}
	}
	if w.Tokens != nil {
		h["Authorization"] = []string{"Bearer " + w.Tokens[r.User]}
	}
	return h
}

// HTTP returns r as a POST to url with w's headers.
func (w *Workload) HTTP(url string, r Request) (*http.Request, error) {
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(r.Body))
	if err != nil {
		return nil, err
	}
	req.Header = w.Header(r)
	return req, nil
}

// Replayed reports whether a response's headers say it is a replay.
func Replayed(h http.Header) bool {
	return strings.EqualFold(h.Get("Idempotent-Replayed"), "true")
}
