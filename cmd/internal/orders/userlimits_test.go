package orders

import (
	"net/http"
	"strconv"
	"testing"
	"time"
)

// TestUserRateLimit: one user's POST /v1/orders beyond the burst is
// answered 429 rate-limited with Retry-After, before the key is claimed
// or anything is charged; another user is not slowed down. Before, one
// user could send as fast as the server answered.
func TestUserRateLimit(t *testing.T) {
	b := setup(t, func(o *setupOptions) { o.userRateEvery, o.userRateBurst = time.Hour, 3 })
	for i := range 3 {
		if r := b.post(t, "alice", "rate-"+strconv.Itoa(i), orderBody); r.status != http.StatusCreated {
			t.Fatalf("order %d within the burst: %s", i, r)
		}
	}
	r := b.post(t, "alice", "rate-3", orderBody)
	r.wantProblem(t, http.StatusTooManyRequests, ProblemRateLimited)
	if s, err := strconv.Atoi(r.header.Get("Retry-After")); err != nil || s < 1 {
		t.Errorf("Retry-After %q, want whole seconds ≥ 1", r.header.Get("Retry-After"))
	}
	b.payer.mu.Lock()
	calls := b.payer.calls
	b.payer.mu.Unlock()
	if calls != 3 {
		t.Errorf("%d payments, want 3: the refused order must not pay", calls)
	}
	if r := b.post(t, "bob", "rate-0", orderBody); r.status != http.StatusCreated {
		t.Errorf("another user: %s, want 201", r)
	}
}

// TestMaxLiveKeys: a user holding the most unexpired keys allowed gets
// 429 too-many-keys for a new one, before the payment, with Retry-After
// until the first expires; the key is left free, replays of the user's
// keys still answer, and once the first expires a new order goes through.
// Before, nothing bounded the keys (and the bodies and answers they keep)
// of one user.
func TestMaxLiveKeys(t *testing.T) {
	t.Run("sqlite", func(t *testing.T) { maxLiveKeys(t, setup(t, func(o *setupOptions) { o.maxLiveKeys = 2 })) })
	t.Run("postgres", func(t *testing.T) {
		maxLiveKeys(t, pgSetup(t, nil, func(o *setupOptions) { o.maxLiveKeys = 2 }).testBundle)
	})
}

func maxLiveKeys(t *testing.T, b *testBundle) {
	for i := range 2 {
		if r := b.post(t, "alice", "live-"+strconv.Itoa(i), orderBody); r.status != http.StatusCreated {
			t.Fatalf("order %d: %s", i, r)
		}
	}
	r := b.post(t, "alice", "live-2", orderBody)
	r.wantProblem(t, http.StatusTooManyRequests, ProblemTooManyKeys)
	if s, err := strconv.Atoi(r.header.Get("Retry-After")); err != nil || s < 3000 {
		t.Errorf("Retry-After %q, want about the key TTL (24h) in seconds", r.header.Get("Retry-After"))
	}
	b.payer.mu.Lock()
	calls := b.payer.calls
	b.payer.mu.Unlock()
	if calls != 2 {
		t.Errorf("%d payments, want 2", calls)
	}
	if r := b.post(t, "alice", "live-0", orderBody); r.status != http.StatusCreated || r.header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("replay of a held key: %s replayed=%q", r, r.header.Get("Idempotent-Replayed"))
	}
	if r := b.post(t, "bob", "live-0", orderBody); r.status != http.StatusCreated {
		t.Errorf("another user: %s", r)
	}
	b.clock.Advance(25 * time.Hour)
	if r := b.post(t, "alice", "live-2", orderBody); r.status != http.StatusCreated {
		t.Errorf("after the keys expired: %s, want 201 (the refused key was left free)", r)
	}
}
