package idemotel

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/trace"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/internal/storewrap"
)

func isErr(err, target error) bool { return errors.Is(err, target) }

// WrapStore returns s with spans around its calls that decide a key's
// fate: idem.claim (Claim), idem.begin (Begin), idem.complete
// (Tx.Complete), idem.release (Release) and idem.fail (Fail), each a
// child of the span of the call's context, with AttrOutcome and the
// lease's attributes. Get, Tx.Rollback and the Sweeper's calls make no
// span (a completer scans every few seconds). The result implements
// idemdriver.Sweeper if s does and idemdriver.Inspector if s does (the operator's
// calls pass through, with no span), its transactions unwrap to s's (Unwrap()
// idem.Tx), so pgstore.FromContext, sqlitestore.FromContext and
// memstore.FromContext find them (and hand the handler s's handle, which
// refuses to commit or roll back: idem.ErrTxOwned), and Unwrap()
// idem.Store returns s.
func WrapStore(s idem.Store, opts Options) idem.Store {
	return storewrap.Extend(&store{inner: s, tr: opts.tracer()}, s, nil)
}

type store struct {
	inner idem.Store
	tr    trace.Tracer
}

func (s *store) Claim(ctx context.Context, p idemdriver.ClaimParams) (idemdriver.Claim, error) {
	ctx, span := s.tr.Start(ctx, SpanClaim)
	c, err := s.inner.Claim(ctx, p)
	if !span.IsRecording() {
		span.End()
		return c, err
	}
	if p.Redrive != nil {
		span.SetAttributes(AttrRedrive.Bool(true))
	}
	switch {
	case err != nil:
	case c.Lease != nil:
		span.SetAttributes(leaseAttrs(c.Lease)...)
		endErr(span, nil, OutcomeClaimed)
		return c, err
	case c.Response != nil:
		span.SetAttributes(AttrStatus.Int(c.Response.Status))
		endErr(span, nil, OutcomeReplayed)
		return c, err
	}
	endErr(span, err, OutcomeClaimed,
		knownErr{idem.ErrInFlight, OutcomeInFlight},
		knownErr{idem.ErrFingerprintMismatch, OutcomeMismatch},
		knownErr{idem.ErrNotDue, OutcomeNotDue})
	return c, err
}

func (s *store) Begin(ctx context.Context, l *idemdriver.Lease) (idem.Tx, error) {
	ctx, span := s.tr.Start(ctx, SpanBegin)
	tx, err := s.inner.Begin(ctx, l)
	if err != nil {
		if span.IsRecording() {
			span.SetAttributes(leaseAttrs(l)...)
			endErr(span, err, "")
		} else {
			span.End()
		}
		return nil, err
	}
	if span.IsRecording() {
		span.SetAttributes(leaseAttrs(l)...)
	}
	span.End()
	return &txWrapper{inner: tx, tr: s.tr, lease: l}, nil
}

func (s *store) Release(ctx context.Context, l *idemdriver.Lease) error {
	ctx, span := s.tr.Start(ctx, SpanRelease)
	err := s.inner.Release(ctx, l)
	if !span.IsRecording() {
		span.End()
		return err
	}
	span.SetAttributes(leaseAttrs(l)...)
	endErr(span, err, OutcomeReleased, fenced)
	return err
}

func (s *store) Fail(ctx context.Context, l *idemdriver.Lease) error {
	ctx, span := s.tr.Start(ctx, SpanFail)
	err := s.inner.Fail(ctx, l)
	if !span.IsRecording() {
		span.End()
		return err
	}
	span.SetAttributes(leaseAttrs(l)...)
	endErr(span, err, OutcomeFailed, fenced)
	return err
}

func (s *store) Get(ctx context.Context, user, key string) (*idemdriver.Record, error) {
	return s.inner.Get(ctx, user, key)
}

// txWrapper is the transaction of a wrapped store.
type txWrapper struct {
	inner idem.Tx
	tr    trace.Tracer
	lease *idemdriver.Lease
}

// Unwrap returns the store's own transaction (see idemdriver.UnwrapTx).
func (tx *txWrapper) Unwrap() idem.Tx { return tx.inner }

func (tx *txWrapper) Complete(ctx context.Context, resp *idemdriver.Response) error {
	ctx, span := tx.tr.Start(ctx, SpanComplete)
	err := tx.inner.Complete(ctx, resp)
	if !span.IsRecording() {
		span.End()
		return err
	}
	span.SetAttributes(leaseAttrs(tx.lease)...)
	ok := OutcomeDeleted
	if resp != nil {
		span.SetAttributes(AttrStatus.Int(resp.Status))
		ok = OutcomeStored
	}
	endErr(span, err, ok, fenced)
	return err
}

func (tx *txWrapper) Rollback(ctx context.Context) error { return tx.inner.Rollback(ctx) }
