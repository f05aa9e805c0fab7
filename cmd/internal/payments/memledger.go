package payments

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"sync"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/idemdriver"
	"github.com/idem-go/idem/memstore"
)

var _ Ledger = (*MemLedger)(nil)

// ErrForeignTx is returned by a Ledger's Create when the request's
// idempotent transaction belongs to a store the ledger cannot commit with:
// MemLedger needs a memstore.Store, PGLedger a pgstore.Store and
// SQLiteLedger a sqlitestore.Store.
var ErrForeignTx = errors.New("payments: the ledger cannot join the idempotency store's transaction")

// DefaultMaxIntents is how many PaymentIntents a MemLedger keeps when its
// MaxIntents is zero: a gateway in memory (payments serve without
// --database-url) forgets nothing until it stops, so what it keeps is
// bounded. About 1 KB each.
const DefaultMaxIntents = 100_000

// ErrLedgerFull is returned by MemLedger.Create once it holds MaxIntents
// PaymentIntents: nothing is charged; the gateway answers 503.
var ErrLedgerFull = errors.New("payments: the in-memory ledger is full")

// MemLedger is an in-memory Ledger. Inside an idempotent request it writes
// through the memstore transaction (memstore.Tx.OnCommit), so a
// PaymentIntent appears exactly when the request's outcome commits. The
// zero value is ready to use.
type MemLedger struct {
	// MaxIntents bounds the PaymentIntents kept; Create refuses more
	// (ErrLedgerFull). Zero: DefaultMaxIntents. Set it before use.
	MaxIntents int

	mu    sync.Mutex // guards every field below
	byID  map[string]int
	order []*PaymentIntent // oldest first

	refundByID map[string]int
	refunds    []*RefundRecord // oldest first
	// held is, by PaymentIntent, the amount of refunds decided in
	// transactions that have not settled yet: refunds check against it,
	// so that two of them never give back the same money.
	held map[string]int64
}

// NewMemLedger returns an empty MemLedger.
func NewMemLedger() *MemLedger { return &MemLedger{} }

// Create implements Ledger.
func (l *MemLedger) Create(ctx context.Context, pi *PaymentIntent) error {
	if n, max := l.Len(), cmp.Or(l.MaxIntents, DefaultMaxIntents); n >= max {
		return fmt.Errorf("%w: it holds %d PaymentIntents, its maximum", ErrLedgerFull, n)
	}
	pi = pi.Clone()
	tx, err := idem.TxFromContext(ctx)
	switch {
	case errors.Is(err, idem.ErrNoTx):
		return l.insert(pi)
	case err != nil:
		return fmt.Errorf("payments: joining the idempotent transaction: %w", err)
	}
	mtx, err := memstore.FromContext(ctx) // the handler's Tx: it cannot end the transaction
	if err != nil {
		return fmt.Errorf("%w: the memory ledger needs a memstore transaction, not %T", ErrForeignTx, idemdriver.UnwrapTx(tx))
	}
	// Effects run at commit, under the store's lock, after the response
	// was decided: an ID clash cannot be reported any more. IDs are 24
	// random characters, so it does not happen.
	mtx.OnCommit(func() { _ = l.insert(pi) })
	return nil
}

func (l *MemLedger) insert(pi *PaymentIntent) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.byID == nil {
		l.byID = make(map[string]int)
	}
	if _, ok := l.byID[pi.ID]; ok {
		return fmt.Errorf("payments: duplicate PaymentIntent id %s", pi.ID)
	}
	l.byID[pi.ID] = len(l.order)
	l.order = append(l.order, pi)
	return nil
}

// Get implements Ledger.
func (l *MemLedger) Get(ctx context.Context, account, id string) (*PaymentIntent, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	i, ok := l.byID[id]
	if !ok || l.order[i].Account != account {
		return nil, fmt.Errorf("%w: %s", ErrNotFound, id)
	}
	return l.order[i].Clone(), nil
}

// List implements Ledger.
func (l *MemLedger) List(ctx context.Context, q ListQuery) (Page, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	limit := q.limit()
	cursor := func(id string) (int, error) {
		i, ok := l.byID[id]
		if !ok || l.order[i].Account != q.Account {
			return 0, fmt.Errorf("%w: %s", ErrNotFound, id)
		}
		return i, nil
	}
	var p Page
	if q.EndingBefore != "" {
		// The page just newer than the cursor, still newest first.
		c, err := cursor(q.EndingBefore)
		if err != nil {
			return Page{}, err
		}
		var newer []*PaymentIntent // oldest first
		for i := c + 1; i < len(l.order); i++ {
			if l.order[i].Account == q.Account {
				if len(newer) == limit {
					p.HasMore = true
					break
				}
				newer = append(newer, l.order[i])
			}
		}
		for i := len(newer) - 1; i >= 0; i-- {
			p.Data = append(p.Data, newer[i].Clone())
		}
		return p, nil
	}
	start := len(l.order) - 1
	if q.StartingAfter != "" {
		c, err := cursor(q.StartingAfter)
		if err != nil {
			return Page{}, err
		}
		start = c - 1
	}
	for i := start; i >= 0; i-- {
		if l.order[i].Account == q.Account {
			if len(p.Data) == limit {
				p.HasMore = true
				break
			}
			p.Data = append(p.Data, l.order[i].Clone())
		}
	}
	return p, nil
}

// Search implements Ledger.
func (l *MemLedger) Search(ctx context.Context, q SearchQuery) (Page, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	limit := q.limit()
	start := len(l.order) - 1
	if q.StartingAfter != "" {
		i, ok := l.byID[q.StartingAfter]
		if !ok || l.order[i].Account != q.Account {
			return Page{}, fmt.Errorf("%w: %s", ErrNotFound, q.StartingAfter)
		}
		start = i - 1
	}
	var p Page
	for i := start; i >= 0; i-- {
		if pi := l.order[i]; pi.Account == q.Account && q.matches(pi) {
			if len(p.Data) == limit {
				p.HasMore = true
				break
			}
			p.Data = append(p.Data, pi.Clone())
		}
	}
	return p, nil
}

// Count implements Counter.
func (l *MemLedger) Count(ctx context.Context, account string) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, pi := range l.order {
		if pi.Account == account && pi.Status == StatusSucceeded {
			n++
		}
	}
	return n, nil
}

// Len reports how many PaymentIntents the ledger holds, all accounts.
func (l *MemLedger) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.order)
}

// CreateRefund implements Ledger. Inside an idempotent request the refund
// is checked at once and its amount held against the PaymentIntent until
// the request's outcome settles: it is written if the outcome commits and
// the hold is dropped if it does not. The hold is dropped when the
// request's handler (settled, in a Server) returns, or else when ctx ends.
func (l *MemLedger) CreateRefund(ctx context.Context, r *RefundRecord) error {
	tx, err := idem.TxFromContext(ctx)
	switch {
	case errors.Is(err, idem.ErrNoTx):
		l.mu.Lock()
		defer l.mu.Unlock()
		i, err := l.checkRefund(r)
		if err != nil {
			return err
		}
		l.applyRefund(i, r.Clone())
		return nil
	case err != nil:
		return fmt.Errorf("payments: joining the idempotent transaction: %w", err)
	}
	mtx, err := memstore.FromContext(ctx) // the handler's Tx: it cannot end the transaction
	if err != nil {
		return fmt.Errorf("%w: the memory ledger needs a memstore transaction, not %T", ErrForeignTx, idemdriver.UnwrapTx(tx))
	}
	l.mu.Lock()
	i, err := l.checkRefund(r)
	if err != nil {
		l.mu.Unlock()
		return err
	}
	rec, amount := r.Clone(), r.Amount
	l.held[rec.PaymentIntent] += amount
	l.mu.Unlock()

	held := true // guarded by l.mu
	unhold := func() {
		if held {
			held = false
			if l.held[rec.PaymentIntent] -= amount; l.held[rec.PaymentIntent] == 0 {
				delete(l.held, rec.PaymentIntent)
			}
		}
	}
	mtx.OnCommit(func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		unhold()
		l.applyRefund(i, rec)
	})
	afterSettled(ctx, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		unhold()
	})
	return nil
}

// checkRefund checks r against its PaymentIntent, counting held amounts,
// sets its amount and currency, and returns the PaymentIntent's index.
// l.mu is held.
func (l *MemLedger) checkRefund(r *RefundRecord) (int, error) {
	i, ok := l.byID[r.PaymentIntent]
	if !ok || l.order[i].Account != r.Account {
		return 0, fmt.Errorf("%w: %s", ErrNotFound, r.PaymentIntent)
	}
	pi := l.order[i]
	if err := refundAmount(r, pi.Status, pi.AmountReceived, pi.AmountRefunded+l.held[pi.ID]); err != nil {
		return 0, err
	}
	r.Currency = pi.Currency
	if l.held == nil {
		l.held = make(map[string]int64)
	}
	return i, nil
}

// applyRefund records rec against the PaymentIntent at index i. l.mu is
// held.
func (l *MemLedger) applyRefund(i int, rec *RefundRecord) {
	if l.refundByID == nil {
		l.refundByID = make(map[string]int)
	}
	l.order[i].AmountRefunded += rec.Amount
	l.refundByID[rec.ID] = len(l.refunds)
	l.refunds = append(l.refunds, rec)
}

// ListRefunds implements Ledger.
func (l *MemLedger) ListRefunds(ctx context.Context, q RefundQuery) (RefundPage, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	limit := q.limit()
	match := func(r *RefundRecord) bool {
		return r.Account == q.Account && (q.PaymentIntent == "" || r.PaymentIntent == q.PaymentIntent)
	}
	cursor := func(id string) (int, error) {
		i, ok := l.refundByID[id]
		if !ok || l.refunds[i].Account != q.Account {
			return 0, fmt.Errorf("%w: %s", ErrNotFound, id)
		}
		return i, nil
	}
	var p RefundPage
	if q.EndingBefore != "" {
		c, err := cursor(q.EndingBefore)
		if err != nil {
			return RefundPage{}, err
		}
		var newer []*RefundRecord // oldest first
		for i := c + 1; i < len(l.refunds); i++ {
			if match(l.refunds[i]) {
				if len(newer) == limit {
					p.HasMore = true
					break
				}
				newer = append(newer, l.refunds[i])
			}
		}
		for i := len(newer) - 1; i >= 0; i-- {
			p.Data = append(p.Data, newer[i].Clone())
		}
		return p, nil
	}
	start := len(l.refunds) - 1
	if q.StartingAfter != "" {
		c, err := cursor(q.StartingAfter)
		if err != nil {
			return RefundPage{}, err
		}
		start = c - 1
	}
	for i := start; i >= 0; i-- {
		if match(l.refunds[i]) {
			if len(p.Data) == limit {
				p.HasMore = true
				break
			}
			p.Data = append(p.Data, l.refunds[i].Clone())
		}
	}
	return p, nil
}

type settleKey struct{}

// settleFuncs are the functions to run once a request's outcome has
// settled: committed with its stored response, or rolled back.
type settleFuncs struct {
	mu  sync.Mutex
	fns []func()
}

// settled runs next with a context in which afterSettled registers
// functions, and runs them when next returns: the idempotency middleware
// inside it has then committed or rolled back the request's transaction.
func settled(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sf := &settleFuncs{}
		defer func() {
			sf.mu.Lock()
			fns := sf.fns
			sf.fns = nil
			sf.mu.Unlock()
			for _, fn := range fns {
				fn()
			}
		}()
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), settleKey{}, sf)))
	})
}

// afterSettled runs fn once the outcome of ctx's request has settled
// (see settled); outside a settled handler, once ctx ends.
func afterSettled(ctx context.Context, fn func()) {
	if sf, ok := ctx.Value(settleKey{}).(*settleFuncs); ok {
		sf.mu.Lock()
		defer sf.mu.Unlock()
		sf.fns = append(sf.fns, fn)
		return
	}
	context.AfterFunc(ctx, fn)
}
