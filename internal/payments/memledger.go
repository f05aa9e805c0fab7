package payments

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/memstore"
)

var _ Ledger = (*MemLedger)(nil)

// ErrForeignTx is returned by a Ledger's Create when the request's
// idempotent transaction belongs to a store the ledger cannot commit with:
// MemLedger needs a memstore.Store, PGLedger a pgstore.Store and
// SQLiteLedger a sqlitestore.Store.
var ErrForeignTx = errors.New("payments: the ledger cannot join the idempotency store's transaction")

// MemLedger is an in-memory Ledger. Inside an idempotent request it writes
// through the memstore transaction (memstore.Tx.OnCommit), so a
// PaymentIntent appears exactly when the request's outcome commits. The
// zero value is ready to use.
type MemLedger struct {
	mu    sync.Mutex // guards byID and order
	byID  map[string]int
	order []*PaymentIntent // oldest first
}

// NewMemLedger returns an empty MemLedger.
func NewMemLedger() *MemLedger { return &MemLedger{} }

// Create implements Ledger.
func (l *MemLedger) Create(ctx context.Context, pi *PaymentIntent) error {
	pi = pi.Clone()
	tx, err := idem.TxFromContext(ctx)
	switch {
	case errors.Is(err, idem.ErrNoTx):
		return l.insert(pi)
	case err != nil:
		return fmt.Errorf("payments: joining the idempotent transaction: %w", err)
	}
	mtx, ok := tx.(*memstore.Tx)
	if !ok {
		return fmt.Errorf("%w: the memory ledger needs a memstore transaction, not %T", ErrForeignTx, tx)
	}
	// Effects run at commit, under the store's lock, after the response
	// was decided: an ID clash cannot be reported any more. IDs are 24
	// random characters, so it does not happen.
	mtx.OnCommit(func() { l.insert(pi) })
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
