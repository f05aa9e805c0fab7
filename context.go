package idem

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/idem-go/idem/idemdriver"
)

type ctxKey struct{}

// requestState is what the middleware (and Do) puts in the context of the
// work it runs under a lease: the lease and the transaction begun on first
// use.
type requestState struct {
	p        *protocol
	lease    *idemdriver.Lease
	beginCtx context.Context // the request's context without its cancellation

	mu      sync.Mutex // guards tx, err and settled
	tx      Tx
	err     error
	settled bool // the outcome is settled: no transaction may begin
}

func (s *requestState) get() (Tx, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.settled && s.tx == nil {
		return nil, ErrSettled
	}
	if s.tx == nil && s.err == nil {
		// Begin opens a transaction and nothing else: safe to send again.
		s.err = s.p.retryDetached(s.beginCtx, "begin", func(ctx context.Context) error {
			var err error
			s.tx, err = s.p.store.Begin(ctx, s.lease)
			return err
		})
		if s.err != nil {
			s.tx = nil
		}
	}
	return s.tx, s.err
}

// rollback discards the transaction, if any, and settles the request: a
// goroutine the handler left behind can no longer begin one, which would
// stay open for ever.
func (s *requestState) rollback() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.settled = true
	if s.tx != nil {
		s.tx.Rollback(s.beginCtx)
	}
}

// TxFromContext returns the transaction of the claimed request (or Do
// operation) that ctx belongs to, beginning it on first use: a handler
// that calls another service first holds no transaction while it waits.
// Outside a claimed request it returns ErrNoTx; once the request was
// answered without one (from a goroutine the handler left running),
// ErrSettled.
//
// The middleware owns the transaction: it commits the handler's writes
// with the stored answer (Complete), or rolls them back, once the
// handler returned. The Tx returned here is the handler's view of it:
// its Complete and Rollback refuse with an error matching ErrTxOwned and
// change nothing. Its Unwrap returns the store's own transaction, which
// the stores' FromContext accessors turn into their handles (see
// UnwrapTx); those refuse to commit or roll back as well.
func TxFromContext(ctx context.Context) (Tx, error) {
	s, ok := ctx.Value(ctxKey{}).(*requestState)
	if !ok {
		return nil, ErrNoTx
	}
	if _, err := s.get(); err != nil {
		return nil, err
	}
	return handlerTx{s}, nil
}

// LeaseFromContext returns the lease of the claimed request (or Do
// operation) that ctx belongs to.
func LeaseFromContext(ctx context.Context) (*idemdriver.Lease, bool) {
	s, ok := ctx.Value(ctxKey{}).(*requestState)
	if !ok {
		return nil, false
	}
	return s.lease, true
}

// stateCtx is the handler's context: the request's context with the
// request's state under ctxKey{}, as context.WithValue would make it,
// without an allocation of its own. Every other key, and the
// cancellation, are the request context's (context.WithCancel and
// context.Cause on it find the request's cancellation as through
// context.WithValue).
type stateCtx struct {
	context.Context
	st *requestState
}

func (c *stateCtx) Value(key any) any {
	if _, ok := key.(ctxKey); ok {
		return c.st
	}
	return c.Context.Value(key)
}

// detachedCtx is context.WithoutCancel(parent), made only when a value is
// asked for: no deadline, no cancellation, and parent's values (through
// a context.WithoutCancel of it, so that context.Cause finds no
// cancellation either).
type detachedCtx struct {
	parent context.Context

	mu  sync.Mutex
	ctx context.Context // context.WithoutCancel(parent), once made
}

func (*detachedCtx) Deadline() (time.Time, bool) { return time.Time{}, false }

func (*detachedCtx) Done() <-chan struct{} { return nil }

func (*detachedCtx) Err() error { return nil }

func (c *detachedCtx) Value(key any) any {
	c.mu.Lock()
	if c.ctx == nil {
		c.ctx = context.WithoutCancel(c.parent)
	}
	ctx := c.ctx
	c.mu.Unlock()
	return ctx.Value(key)
}

// callCtx is the context of one claim call: parent, which has no
// cancellation and no deadline (the request's context.WithoutCancel),
// with deadline as its deadline, ended by stop when the call returns.
// It behaves as context.WithDeadline(parent, deadline) with its cancel
// function called by stop, and it is one: the first call of Done (or of
// Value once Done was called) makes it, with its timer. A store that only
// asks Err (memstore) makes neither; Err compares the clock with the
// deadline instead.
type callCtx struct {
	parent   context.Context
	deadline time.Time

	mu     sync.Mutex
	ctx    context.Context    // context.WithDeadline(parent, deadline), once made
	cancel context.CancelFunc // ctx's
	err    error              // before ctx is made: context.Canceled once stopped, DeadlineExceeded once past
}

func (c *callCtx) init(parent context.Context, timeout time.Duration) {
	c.parent, c.deadline = parent, time.Now().Add(timeout)
}

func (c *callCtx) Deadline() (time.Time, bool) { return c.deadline, true }

func (c *callCtx) Done() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ctx == nil {
		if errors.Is(c.err, context.Canceled) {
			// Stopped before: its error stays Canceled, even past the
			// deadline.
			c.ctx, c.cancel = context.WithCancel(c.parent)
			c.cancel()
		} else {
			c.ctx, c.cancel = context.WithDeadline(c.parent, c.deadline)
		}
	}
	return c.ctx.Done()
}

func (c *callCtx) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ctx != nil {
		return c.ctx.Err()
	}
	if c.err == nil && !time.Now().Before(c.deadline) {
		c.err = context.DeadlineExceeded
	}
	return c.err
}

// Value is the parent's, or once Done made the context, that context's
// (so that a context derived from c and context.Cause find c's
// cancellation, as they would on context.WithDeadline's).
func (c *callCtx) Value(key any) any {
	c.mu.Lock()
	ctx := c.ctx
	c.mu.Unlock()
	if ctx != nil {
		return ctx.Value(key)
	}
	return c.parent.Value(key)
}

// stop ends c when its call returned, as WithDeadline's cancel function.
func (c *callCtx) stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.ctx != nil {
		c.cancel()
		return
	}
	if c.err == nil {
		if time.Now().Before(c.deadline) {
			c.err = context.Canceled
		} else {
			c.err = context.DeadlineExceeded
		}
	}
}
