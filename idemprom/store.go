package idemprom

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/storewrap"
)

// Store operations, the values of the operation label of
// idem_store_call_duration_seconds.
const (
	OpClaim         = "claim"          // Store.Claim
	OpBegin         = "begin"          // Store.Begin
	OpComplete      = "complete"       // Tx.Complete
	OpRollback      = "rollback"       // Tx.Rollback
	OpRelease       = "release"        // Store.Release
	OpFail          = "fail"           // Store.Fail
	OpGet           = "get"            // Store.Get
	OpAbandoned     = "abandoned"      // Sweeper.Abandoned
	OpDeleteExpired = "delete_expired" // Sweeper.DeleteExpired
)

// ops lists the operations, in the order of the observers of StoreMetrics.
var ops = [...]string{OpClaim, OpBegin, OpComplete, OpRollback, OpRelease, OpFail, OpGet, OpAbandoned, OpDeleteExpired}

const (
	iClaim = iota
	iBegin
	iComplete
	iRollback
	iRelease
	iFail
	iGet
	iAbandoned
	iDeleteExpired
)

// StoreBuckets are the buckets of idem_store_call_duration_seconds, in
// seconds: from a memory store's tens of microseconds to a database call
// that waits on a lock.
var StoreBuckets = []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}

// StoreMetrics is the histogram idem_store_call_duration_seconds{operation}:
// how long the calls of the stores it wraps (Wrap) took, by operation
// (OpClaim and the others), errors included. Every operation's series
// is there from the start. It is a prometheus.Collector; register it.
type StoreMetrics struct {
	vec *prometheus.HistogramVec
	obs [len(ops)]prometheus.Observer
}

// NewStoreMetrics returns a StoreMetrics with no observation yet.
func NewStoreMetrics() *StoreMetrics {
	m := &StoreMetrics{vec: prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "idem_store_call_duration_seconds",
		Help:    "Latency of idempotency store calls by operation (claim, begin, complete, rollback, release, fail, get, abandoned, delete_expired), errors included.",
		Buckets: StoreBuckets,
	}, []string{"operation"})}
	for i, op := range ops {
		m.obs[i] = m.vec.WithLabelValues(op)
	}
	return m
}

// Describe implements prometheus.Collector.
func (m *StoreMetrics) Describe(ch chan<- *prometheus.Desc) { m.vec.Describe(ch) }

// Collect implements prometheus.Collector.
func (m *StoreMetrics) Collect(ch chan<- prometheus.Metric) { m.vec.Collect(ch) }

func (m *StoreMetrics) observe(i int, start time.Time) {
	m.obs[i].Observe(time.Since(start).Seconds())
}

// Wrap returns s with the latency of its calls observed. The result
// implements idemdriver.Sweeper if s does (the completer and the cleaner need
// it) and idemdriver.Inspector if s does (the operator's calls pass through,
// not observed), and its transactions unwrap to s's (Unwrap() idem.Tx), so
// pgstore.FromContext, sqlitestore.FromContext and memstore.FromContext
// find them, and hand the handler s's handle, which refuses to commit or
// roll back (idem.ErrTxOwned); Unwrap() idem.Store returns s.
func (m *StoreMetrics) Wrap(s idem.Store) idem.Store {
	var sw idemdriver.Sweeper
	if inner, ok := s.(idemdriver.Sweeper); ok {
		sw = &sweeper{inner: inner, m: m}
	}
	return storewrap.Extend(&store{inner: s, m: m}, s, sw)
}

type store struct {
	inner idem.Store
	m     *StoreMetrics
}

func (s *store) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	defer s.m.observe(iClaim, time.Now())
	return s.inner.Claim(ctx, p)
}

func (s *store) Begin(ctx context.Context, l *idemdriver.Lease) (idem.Tx, error) {
	defer s.m.observe(iBegin, time.Now())
	tx, err := s.inner.Begin(ctx, l)
	if err != nil {
		return nil, err
	}
	return &txWrapper{inner: tx, m: s.m}, nil
}

func (s *store) Release(ctx context.Context, l *idemdriver.Lease) error {
	defer s.m.observe(iRelease, time.Now())
	return s.inner.Release(ctx, l)
}

func (s *store) Fail(ctx context.Context, l *idemdriver.Lease) error {
	defer s.m.observe(iFail, time.Now())
	return s.inner.Fail(ctx, l)
}

func (s *store) Get(ctx context.Context, user, key string) (*idemdriver.Record, error) {
	defer s.m.observe(iGet, time.Now())
	return s.inner.Get(ctx, user, key)
}

// sweeper observes the calls of the wrapped store's Sweeper.
type sweeper struct {
	inner idemdriver.Sweeper
	m     *StoreMetrics
}

func (s *sweeper) Abandoned(ctx context.Context, p idemdriver.AbandonedParams) ([]idemdriver.Record, error) {
	defer s.m.observe(iAbandoned, time.Now())
	return s.inner.Abandoned(ctx, p)
}

func (s *sweeper) DeleteExpired(ctx context.Context, limit int) (int, error) {
	defer s.m.observe(iDeleteExpired, time.Now())
	return s.inner.DeleteExpired(ctx, limit)
}

// txWrapper is the transaction of a wrapped store.
type txWrapper struct {
	inner idem.Tx
	m     *StoreMetrics
}

// Unwrap returns the store's own transaction (see idemdriver.UnwrapTx).
func (tx *txWrapper) Unwrap() idem.Tx { return tx.inner }

func (tx *txWrapper) Complete(ctx context.Context, resp *idemdriver.Response) error {
	defer tx.m.observe(iComplete, time.Now())
	return tx.inner.Complete(ctx, resp)
}

func (tx *txWrapper) Rollback(ctx context.Context) error {
	defer tx.m.observe(iRollback, time.Now())
	return tx.inner.Rollback(ctx)
}
