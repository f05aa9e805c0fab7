package pitfalls

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/client"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/pgstore"
	"github.com/idem-go/idem/redisfront"
)

// Trap (d): Redis alone as the truth. An entry in Redis can be lost
// without anybody deleting it: evicted under maxmemory, or never copied
// to the replica that a failover promotes (replication is asynchronous).
// When the key is the only record that the operation ran, its loss makes
// the next retry a new operation.

// TestRedisAloneIsNotTheTruth: a checkout whose answer was lost, and
// whose Redis entry is lost before the client retries, runs again (a
// second order and a second charge) when a Redis-only SET NX store is the
// record, and is replayed (one order, one charge) with redisfront in front
// of PostgreSQL, which answers the retry from its row and writes the
// entry back to Redis.
func TestRedisAloneIsNotTheTruth(t *testing.T) {
	t.Run("naive/Redis-only SET NX store", func(t *testing.T) {
		rdb, prefix := redisClient(t)
		s := newService(t, serviceConfig{
			store:     func(*pgstore.Store) idem.Store { return &redisOnlyStore{rdb: rdb, prefix: prefix} },
			ownWrites: true,
		})
		a, lost := checkoutLosingRedis(t, s, rdb, prefix)
		if a.status != http.StatusCreated || a.replayed || lost == 0 {
			t.Fatalf("checkout: %d replayed=%v %v %s (%d Redis keys lost); want a new 201 after the keys were lost", a.status, a.replayed, a.err, a.body, lost)
		}
		wantCounts(t, s, "alice", 2, 2)
	})

	t.Run("redisfront in front of PostgreSQL", func(t *testing.T) {
		rdb, prefix := redisClient(t)
		var front *redisfront.Store
		s := newService(t, serviceConfig{store: func(pg *pgstore.Store) idem.Store {
			front = redisfront.New(rdb, pg, redisfront.Options{KeyPrefix: prefix})
			return front
		}})
		a, lost := checkoutLosingRedis(t, s, rdb, prefix)
		if a.status != http.StatusCreated || !a.replayed || lost == 0 {
			t.Fatalf("checkout: %d replayed=%v %v %s (%d Redis keys lost); want the 201 replayed after the keys were lost", a.status, a.replayed, a.err, a.body, lost)
		}
		wantCounts(t, s, "alice", 1, 1)
		// The retry was decided by PostgreSQL and its answer written back
		// to Redis, which answers the next one alone.
		m := front.Metrics()
		if m.InnerClaims.Load() != 2 || m.CacheFills.Load() < 2 {
			t.Errorf("%d claims decided by PostgreSQL, %d cache fills; want 2 and at least 2", m.InnerClaims.Load(), m.CacheFills.Load())
		}
		hc := &http.Client{Transport: &client.Transport{Base: s.srv.Client().Transport}}
		again := send(hc, s.request(t, client.WithKey(context.Background(), "checkout-1"), s.srv.URL, "alice"))
		if again.status != http.StatusCreated || !again.replayed || again.body != a.body || m.ReplaysFromRedis.Load() != 1 {
			t.Errorf("next retry: %d replayed=%v, %d replays from Redis; want the same 201 from Redis", again.status, again.replayed, m.ReplaysFromRedis.Load())
		}
		wantCounts(t, s, "alice", 1, 1)
	})
}

// TestRedisLostWhileRunning: while a checkout runs (held in the
// gateway), Redis loses its lock, and a duplicate of the checkout
// arrives. With a Redis-only SET NX store the duplicate runs too: two
// orders, two charges. With redisfront in front of PostgreSQL the
// duplicate is answered 409 by PostgreSQL's row, and its retry after the
// first completed gets the first one's answer: one order, one charge.
func TestRedisLostWhileRunning(t *testing.T) {
	for _, tc := range []struct {
		name            string
		naive           bool
		dupStatus       int // the duplicate's first answer
		orders, charges int
	}{
		{"naive/Redis-only SET NX store", true, http.StatusCreated, 2, 2},
		{"redisfront in front of PostgreSQL", false, http.StatusConflict, 1, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rdb, prefix := redisClient(t)
			cfg := serviceConfig{store: func(pg *pgstore.Store) idem.Store {
				return redisfront.New(rdb, pg, redisfront.Options{KeyPrefix: prefix})
			}}
			if tc.naive {
				cfg = serviceConfig{
					store:     func(*pgstore.Store) idem.Store { return &redisOnlyStore{rdb: rdb, prefix: prefix} },
					ownWrites: true,
				}
			}
			s := newService(t, cfg)
			h := newHold()
			s.gw.hold = h
			// One try per request, with the checkout's key, no retries.
			checkout := func() *http.Request {
				req := s.request(t, context.Background(), s.srv.URL, "alice")
				req.Header.Set("Idempotency-Key", "checkout-1")
				return req
			}
			first := make(chan answer, 1)
			req := checkout()
			go func() { first <- send(s.srv.Client(), req) }()
			select {
			case <-h.entered:
			case a := <-first:
				t.Fatalf("the first checkout was answered %d %v %s before it paid", a.status, a.err, a.body)
			case <-time.After(10 * time.Second):
				t.Fatal("the first checkout did not reach the gateway within 10s")
			}
			lost := forget(t, rdb, prefix)
			dup := send(s.srv.Client(), checkout())
			close(h.release)
			a := <-first
			if lost == 0 || dup.status != tc.dupStatus || a.status != http.StatusCreated {
				t.Fatalf("%d Redis keys lost; duplicate %d %v %s, first %d %v %s; want keys lost, the duplicate %d, the first 201",
					lost, dup.status, dup.err, dup.body, a.status, a.err, a.body, tc.dupStatus)
			}
			if !tc.naive {
				retry := send(s.srv.Client(), checkout())
				if retry.status != http.StatusCreated || !retry.replayed || retry.body != a.body {
					t.Errorf("the duplicate's retry: %d replayed=%v %s; want the first one's 201 replayed", retry.status, retry.replayed, retry.body)
				}
			}
			wantCounts(t, s, "alice", tc.orders, tc.charges)
		})
	}
}

// checkoutLosingRedis sends alice's checkout with key checkout-1; its
// first answer is lost, and before the client retries, every Redis key
// under prefix is lost too. It returns what the client was told and how
// many keys were lost.
func checkoutLosingRedis(t *testing.T, s *service, rdb *redis.Client, prefix string) (answer, int) {
	t.Helper()
	lost := 0
	hc := &http.Client{Transport: &client.Transport{
		Base: newLoseAnswers(s.srv.Client().Transport, 1),
		OnRetry: func(int, *http.Response, error, time.Duration) {
			lost += forget(t, rdb, prefix)
		},
	}}
	a := send(hc, s.request(t, client.WithKey(context.Background(), "checkout-1"), s.srv.URL, "alice"))
	return a, lost
}

// redisOnlyStore is the trap: an idem.Store whose only record is one
// Redis key per (user, key), claimed with SET NX and overwritten with the
// response when the request completes. It has no transaction: the
// handler's writes commit on their own.
type redisOnlyStore struct {
	rdb    *redis.Client
	prefix string
}

type redisOnlyRecord struct {
	Fingerprint string
	Owner       string
	CreatedAt   time.Time
	LeaseUntil  time.Time
	Response    *idemdriver.Response
}

func (s *redisOnlyStore) name(user, key string) string { return s.prefix + user + "/" + key }

func (s *redisOnlyStore) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	p = p.Normalize()
	now := time.Now().UTC().Truncate(time.Microsecond)
	rec := redisOnlyRecord{Fingerprint: p.Fingerprint, Owner: p.Owner, CreatedAt: now, LeaseUntil: now.Add(p.Lease)}
	b, err := json.Marshal(rec)
	if err != nil {
		return idemdriver.Claim{}, err
	}
	ok, err := s.rdb.SetNX(ctx, s.name(p.User, p.Key), b, p.TTL).Result()
	if err != nil {
		return idemdriver.Claim{}, err
	}
	if ok {
		return idemdriver.Claim{Lease: &idemdriver.Lease{User: p.User, Key: p.Key, Owner: p.Owner, Until: rec.LeaseUntil, Attempt: 1, CreatedAt: now}}, nil
	}
	old, err := s.get(ctx, p.User, p.Key)
	switch {
	case err != nil:
		return idemdriver.Claim{}, err
	case old.Fingerprint != p.Fingerprint:
		return idemdriver.Claim{}, idem.ErrFingerprintMismatch
	case old.Response != nil:
		return idemdriver.Claim{Response: old.Response}, nil
	}
	return idemdriver.Claim{}, &idem.InFlightError{LeaseUntil: old.LeaseUntil}
}

func (s *redisOnlyStore) get(ctx context.Context, user, key string) (*redisOnlyRecord, error) {
	b, err := s.rdb.Get(ctx, s.name(user, key)).Bytes()
	if errors.Is(err, redis.Nil) {
		return nil, idem.ErrNotFound
	}
	if err != nil {
		return nil, err
	}
	var rec redisOnlyRecord
	return &rec, json.Unmarshal(b, &rec)
}

func (s *redisOnlyStore) Begin(ctx context.Context, l *idemdriver.Lease) (idem.Tx, error) {
	return &redisOnlyTx{s: s, l: l}, nil
}

// Release and Fail free the key: the naive store's lock is released on
// any failure.
func (s *redisOnlyStore) Release(ctx context.Context, l *idemdriver.Lease) error {
	return s.rdb.Del(ctx, s.name(l.User, l.Key)).Err()
}

func (s *redisOnlyStore) Fail(ctx context.Context, l *idemdriver.Lease) error {
	return s.Release(ctx, l)
}

func (s *redisOnlyStore) Get(ctx context.Context, user, key string) (*idemdriver.Record, error) {
	rec, err := s.get(ctx, user, key)
	if err != nil {
		return nil, err
	}
	return &idemdriver.Record{User: user, Key: key, Fingerprint: rec.Fingerprint, Owner: rec.Owner,
		LeaseUntil: rec.LeaseUntil, Attempts: 1, Response: rec.Response, CreatedAt: rec.CreatedAt}, nil
}

type redisOnlyTx struct {
	s *redisOnlyStore
	l *idemdriver.Lease
}

// Complete writes the response into the key, keeping its TTL.
func (tx *redisOnlyTx) Complete(ctx context.Context, resp *idemdriver.Response) error {
	rec, err := tx.s.get(ctx, tx.l.User, tx.l.Key)
	if err != nil {
		return err
	}
	rec.Response = resp
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	return tx.s.rdb.SetArgs(ctx, tx.s.name(tx.l.User, tx.l.Key), b, redis.SetArgs{KeepTTL: true}).Err()
}

func (tx *redisOnlyTx) Rollback(context.Context) error { return nil }
