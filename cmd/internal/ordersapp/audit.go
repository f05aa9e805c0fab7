package ordersapp

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idem-go/idem"
	"github.com/idem-go/idem/cmd/internal/cli"
	"github.com/idem-go/idem/cmd/internal/orders"
	"github.com/idem-go/idem/cmd/internal/payments"
	"github.com/idem-go/idem/idemdriver"
)

// keyRow is what the audit reads of one idempotency record.
type keyRow struct {
	User       string
	Key        string
	Method     string // "" for an idem.Do operation (the receipts consumer's message ids)
	CreatedAt  time.Time
	Status     int // 0 until completed
	LeaseUntil time.Time
	ExpiresAt  time.Time
	Attempts   int
	Redrives   int // the completers' re-drives
}

// auditReport is what `orders audit` found.
type auditReport struct {
	Orders, Keys, KeysCompleted, KeysPending int
	// Operations counts the idem.Do records (the receipts consumer's
	// message ids), which make no order; OperationsPending those without
	// an outcome yet.
	Operations, OperationsPending int
	Charges, ChargesSucceeded     int
	// ChargesRefunded counts the succeeded payments without an order that
	// were refunded in full: orders the database refused for good.
	ChargesRefunded int
	Pending         []string // charges whose order the completer may still make
	GivenUp         []string // keys without an outcome the completers gave up on
	Violations      []string
	// events: invariants 5 and 6.
	events eventAudit
}

// giveUpAfter is how long a key without an outcome may wait after its last
// attempt before the audit no longer counts on serve's completer to finish
// it: its payment, if any, is then a violation.
var giveUpAfter = idem.CompleterOptions{Interval: completerInterval}.GiveUpAfter()

func (a *App) audit(ctx context.Context, args []string) error {
	var c Config
	fs := cli.NewFlagSet("orders audit", "Checks the invariants against the database and the payment gateway: one order per (user, key), one succeeded and unrefunded PaymentIntent per paid order and no payment without its order unless it was refunded in full (an order the database refused for good), every stored response with its order and every order with its stored response; every order with exactly one orders.created event in the outbox and, once sent, one message in stream ORDERS with its id and body, no event or message without its order, and at most one receipt per order. Unsent events and messages not yet applied are reported as pending, not as violations; a message id repeated in the stream (published again past the duplicate window) is counted. Prints a report; exits 1 on any violation.", a.Getenv)
	c.storageFlags(fs)
	fs.String(&c.PaymentsURL, "payments-url", "PAYMENTS_URL", "", "payment gateway base URL (default: the in-process gateway's ledger in the same database)")
	fs.String(&c.PaymentsKey, "payments-key", "PAYMENTS_API_KEY", "sk_test_local", "secret key of the gateway account to audit")
	c.natsFlag(fs, "NATS server with JetStream whose stream ORDERS to read: nats://host:port or tls://host:port, several comma-separated for a cluster "+
		"(default: the embedded server of the orders serve running on --data-dir, found through <data-dir>/nats.url; when none runs, one started by this process on <data-dir>/nats for the audit)")
	if err := a.parse(fs, args); err != nil {
		return err
	}
	be, err := openExisting(ctx, &c) // read-only: it creates and migrates nothing
	if err != nil {
		return err
	}
	defer be.close()
	p, _, err := newPayer(ctx, &c, be)
	if err != nil {
		return err
	}
	b, err := openBroker(ctx, &c, brokerOptions{mode: brokerJoin, client: "orders audit", logger: slog.New(slog.NewTextHandler(a.Stderr, nil))})
	if err != nil {
		return err
	}
	defer b.close()
	if c.NATSURL == "" {
		if err := checkAuditStream(ctx, be, b); err != nil {
			return err
		}
	}
	rep, err := runAudit(ctx, be, p, b.js, a.Stderr)
	if err != nil {
		return err
	}
	// Orders, keys and payments are read one after the other, not in one
	// snapshot: under live traffic a request that commits between two reads
	// looks like a violation. A violation counts only if a second pass, a
	// second later, sees it again.
	if len(rep.Violations) > 0 {
		time.Sleep(time.Second)
		fmt.Fprintf(a.Stderr, "orders audit: %d violations; reading everything again to keep those seen twice\n", len(rep.Violations))
		again, err := runAudit(ctx, be, p, b.js, a.Stderr)
		if err != nil {
			return err
		}
		seen := map[string]bool{}
		for _, v := range again.Violations {
			seen[v] = true
		}
		var kept []string
		for _, v := range rep.Violations {
			if seen[v] {
				kept = append(kept, v)
			}
		}
		again.Violations = kept
		rep = again
	}
	rep.print(a.Stdout)
	if len(rep.Violations) > 0 {
		return fmt.Errorf("%d invariant violations", len(rep.Violations))
	}
	return nil
}

// runAudit compares orders, idempotency keys, the gateway's charges, and
// the orders' events in the outbox, stream ORDERS (read through js) and
// the receipts. While it reads, it writes what it has read so far to
// progress (nil: nowhere) every auditProgressEvery, and once at the end.
func runAudit(ctx context.Context, be *backend, p payer, js jetstream.JetStream, progress io.Writer) (*auditReport, error) {
	// Leases are the database's times: judge them by its clock, read
	// before the keys, so that a key is never called given up early.
	now, err := be.now(ctx)
	if err != nil {
		return nil, fmt.Errorf("reading the database's clock: %w", err)
	}
	a := &auditPass{rep: &auditReport{}, now: now}
	if progress != nil {
		defer a.read.report(progress, auditProgressEvery)()
	}
	if err := a.readOrders(ctx, be); err != nil {
		return nil, err
	}
	if err := a.readKeys(ctx, be); err != nil {
		return nil, err
	}
	if err := a.readCharges(ctx, p); err != nil {
		return nil, err
	}
	if err := a.readEvents(ctx, be, js); err != nil {
		return nil, err
	}
	sort.Strings(a.rep.Violations)
	sort.Strings(a.rep.Pending)
	sort.Strings(a.rep.GivenUp)
	return a.rep, nil
}

// auditPass is one pass of runAudit: its report so far and what the later
// steps need of the earlier ones.
type auditPass struct {
	rep  *auditReport
	now  time.Time // the database's clock before the keys were read
	read auditProgress

	byID         map[string]orders.Order // every order, by id (readOrders)
	pendingOrder map[string]keyRow       // keys without an outcome, by order id (readKeys)
}

func (a *auditPass) violate(format string, args ...any) {
	a.rep.Violations = append(a.rep.Violations, fmt.Sprintf(format, args...))
}

// readOrders reads every order: one order per operation (user, key and
// the key's CreatedAt) and one order per payment.
func (a *auditPass) readOrders(ctx context.Context, be *backend) error {
	type opID struct {
		user, key string
		created   int64
	}
	a.byID = map[string]orders.Order{}
	byOp := map[opID][]string{}
	byPayment := map[string][]string{}
	err := be.allOrders(ctx, func(o orders.Order) error {
		a.read.orders.Add(1)
		a.rep.Orders++
		if _, dup := a.byID[o.ID]; dup {
			a.violate("order %s appears twice", o.ID)
		}
		a.byID[o.ID] = o
		if o.IdempotencyKey != "" {
			op := opID{o.UserID, o.IdempotencyKey, o.KeyCreatedAt.UnixMicro()}
			byOp[op] = append(byOp[op], o.ID)
		}
		byPayment[o.PaymentID] = append(byPayment[o.PaymentID], o.ID)
		return nil
	})
	if err != nil {
		return fmt.Errorf("reading orders: %w", err)
	}
	for op, ids := range byOp {
		if len(ids) > 1 {
			sort.Strings(ids)
			a.violate("user %q key %q made %d orders: %v", op.user, op.key, len(ids), ids)
		}
	}
	for pid, ids := range byPayment {
		if len(ids) > 1 {
			a.violate("payment %s pays for %d orders: %v", pid, len(ids), ids)
		}
	}
	return nil
}

// readKeys reads every idempotency key: a stored success must have its
// order (invariant 3), another stored answer must not, and an order's key
// must have its answer; a key with no outcome may still be finished by the
// completer.
func (a *auditPass) readKeys(ctx context.Context, be *backend) error {
	a.pendingOrder = map[string]keyRow{}
	keyOf := map[string]keyRow{}
	err := be.allKeys(ctx, func(k keyRow) error {
		a.read.keys.Add(1)
		if k.Method == "" {
			// An idem.Do operation: a message id of the receipts
			// consumer, whose receipt readEvents judges.
			a.rep.Operations++
			if k.Status == 0 {
				a.rep.OperationsPending++
			}
			return nil
		}
		a.rep.Keys++
		id := orders.OrderID(k.User, k.Key, k.CreatedAt)
		keyOf[id] = k
		switch {
		case k.Status == 0:
			a.rep.KeysPending++
			a.pendingOrder[id] = k
			if k.Redrives >= idem.DefaultCompleterMaxAttempts {
				a.rep.GivenUp = append(a.rep.GivenUp, fmt.Sprintf("user %q operation %s (order %s): %d attempts, %d re-drives, last lease until %s",
					k.User, idemdriver.OperationID(k.User, k.Key, k.CreatedAt), id, k.Attempts, k.Redrives, k.LeaseUntil.UTC().Format(time.RFC3339)))
			}
		case k.Status >= 200 && k.Status < 300:
			a.rep.KeysCompleted++
			if _, ok := a.byID[id]; !ok {
				a.violate("user %q key %q stored a %d answer but order %s does not exist", k.User, k.Key, k.Status, id)
			}
		default:
			a.rep.KeysCompleted++
			if _, ok := a.byID[id]; ok {
				a.violate("user %q key %q stored a %d answer but order %s exists", k.User, k.Key, k.Status, id)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("reading idempotency keys: %w", err)
	}
	for id, o := range a.byID {
		if o.IdempotencyKey == "" {
			continue
		}
		if k, ok := keyOf[id]; ok && k.Status == 0 {
			a.violate("order %s exists but its key %q has no stored answer", id, o.IdempotencyKey)
		}
	}
	return nil
}

// readCharges reads the gateway's charges (invariant 2). A payment whose
// order the database refused for good is refunded in full instead (issue
// 8, point 6): that is a payment without an order and without money kept.
// A paid order's payment must not be refunded at all: the order says paid.
func (a *auditPass) readCharges(ctx context.Context, p payer) error {
	refunded, err := a.refundedAmounts(ctx, p)
	if err != nil {
		return err
	}
	succeededFor := map[string][]string{} // order ref → succeeded PaymentIntents
	for ch, err := range p.c.All(ctx) {
		if err != nil {
			return fmt.Errorf("listing payments: %w", err)
		}
		a.read.payments.Add(1)
		a.rep.Charges++
		if ch.Status != "succeeded" {
			continue
		}
		a.rep.ChargesSucceeded++
		a.checkSucceeded(ch, refunded[ch.ID], succeededFor)
	}
	for ref, pis := range succeededFor {
		if len(pis) > 1 {
			sort.Strings(pis)
			a.violate("order %s has %d succeeded payments: %v", ref, len(pis), pis)
		}
	}
	for id, o := range a.byID {
		if o.Status == orders.StatusPaid && len(succeededFor[id]) == 0 {
			a.violate("paid order %s has no succeeded payment at the gateway (payment_id %s)", id, o.PaymentID)
		}
	}
	return nil
}

// checkSucceeded judges the succeeded charge ch, of which refunded was
// given back, against its order (or the key that may still make it), and
// adds it to succeededFor unless it was refunded in full without an order.
func (a *auditPass) checkSucceeded(ch *payments.Charge, refunded int64, succeededFor map[string][]string) {
	ref := ch.Metadata["order_ref"]
	o, ok := a.byID[ref]
	switch {
	case ok && refunded > 0:
		succeededFor[ref] = append(succeededFor[ref], ch.ID)
		a.violate("payment %s for order %s is refunded (%d of %d) but the order says %s", ch.ID, ref, refunded, ch.Amount, o.Status)
		return
	case !ok && refunded >= ch.Amount:
		a.rep.ChargesRefunded++
		return
	}
	succeededFor[ref] = append(succeededFor[ref], ch.ID)
	partly := ""
	if refunded > 0 {
		partly = fmt.Sprintf(" and is refunded only in part (%d of %d)", refunded, ch.Amount)
	}
	k := a.pendingOrder[ref]
	pending := k != (keyRow{})
	switch {
	case ok && o.PaymentID != ch.ID:
		a.violate("payment %s for order %s, which was paid by %s", ch.ID, ref, o.PaymentID)
	case ok:
	case pending && k.Redrives >= idem.DefaultCompleterMaxAttempts:
		a.violate("payment %s has no order%s: key %q of user %q was given up after %d re-drives (%d attempts in all)",
			ch.ID, partly, k.Key, k.User, k.Redrives, k.Attempts)
	case pending && k.LeaseUntil.Before(a.now.Add(-giveUpAfter)):
		a.violate("payment %s has no order%s: key %q of user %q has had no attempt for over %s (%d attempts): no completer is finishing it",
			ch.ID, partly, k.Key, k.User, giveUpAfter, k.Attempts)
	case pending:
		a.rep.Pending = append(a.rep.Pending, fmt.Sprintf("payment %s: order %s not made yet%s; key %q of user %q has no outcome after %d attempts (lease until %s)",
			ch.ID, ref, partly, k.Key, k.User, k.Attempts, k.LeaseUntil.UTC().Format(time.RFC3339)))
	default:
		a.violate("payment %s (order_ref %q) has no order%s", ch.ID, ref, partly)
	}
}

// refundedAmounts returns how much the succeeded refunds gave back, by
// PaymentIntent, from one listing of every refund of the account (not one
// call per payment: refunds are few, payments many). It is read before the
// payments: a refund is made after its payment succeeded, so every payment
// listed next that a refund read here gave back is judged with it.
func (a *auditPass) refundedAmounts(ctx context.Context, p payer) (map[string]int64, error) {
	sum := map[string]int64{}
	for r, err := range p.c.AllRefunds(ctx) {
		if err != nil {
			return nil, fmt.Errorf("listing refunds: %w", err)
		}
		a.read.refunds.Add(1)
		if r.Status == payments.StatusRefundSucceeded {
			sum[r.PaymentIntent] += r.Amount
		}
	}
	return sum, nil
}

// auditProgressEvery is how often `orders audit` writes its progress line.
const auditProgressEvery = 5 * time.Second

// auditProgress counts what one pass of the audit has read.
type auditProgress struct {
	orders, keys, payments, refunds, events, messages, receipts atomic.Int64
	start                                                       time.Time
}

func (p *auditProgress) line() string {
	return fmt.Sprintf("orders audit: read %d orders, %d idempotency keys, %d payments, %d refunds, %d events in the outbox, %d stream messages, %d receipts (%s)",
		p.orders.Load(), p.keys.Load(), p.payments.Load(), p.refunds.Load(), p.events.Load(), p.messages.Load(), p.receipts.Load(),
		time.Since(p.start).Round(time.Second))
}

// report writes p's line to w every period until the function it returns
// is called, which writes it once more and waits for the writer to stop.
func (p *auditProgress) report(w io.Writer, period time.Duration) (stop func()) {
	p.start = time.Now()
	done, stopped := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(period)
		defer t.Stop()
		for {
			select {
			case <-done:
				fmt.Fprintln(w, p.line())
				return
			case <-t.C:
				fmt.Fprintln(w, p.line())
			}
		}
	}()
	return func() {
		close(done)
		<-stopped
	}
}

func (r *auditReport) print(w io.Writer) {
	fmt.Fprintf(w, "orders:            %d\n", r.Orders)
	fmt.Fprintf(w, "idempotency keys:  %d (%d with a stored answer, %d without)\n", r.Keys, r.KeysCompleted, r.KeysPending)
	fmt.Fprintf(w, "operations:        %d (idem.Do keys of the receipts consumer; %d without an outcome yet)\n", r.Operations, r.OperationsPending)
	fmt.Fprintf(w, "payments:          %d (%d succeeded)\n", r.Charges, r.ChargesSucceeded)
	fmt.Fprintf(w, "refunded:          %d (succeeded payments without an order, refunded in full)\n", r.ChargesRefunded)
	fmt.Fprintf(w, "pending:           %d\n", len(r.Pending))
	for _, p := range r.Pending {
		fmt.Fprintf(w, "  %s\n", p)
	}
	fmt.Fprintf(w, "given up:          %d (keys without an outcome the completers gave up on; an operator's)\n", len(r.GivenUp))
	for _, g := range r.GivenUp {
		fmt.Fprintf(w, "  %s\n", g)
	}
	r.events.print(w)
	fmt.Fprintf(w, "violations:        %d\n", len(r.Violations))
	for _, v := range r.Violations {
		fmt.Fprintf(w, "  %s\n", v)
	}
	if len(r.Violations) == 0 {
		fmt.Fprintln(w, "OK: every invariant holds")
	}
}
